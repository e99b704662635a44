//===- OptimizerTest.cu - CUDA gradient norm, AdamW, scalar accumulation --===//
//
// sumSquaresInto against the CPU sumSquares (and bitwise against itself),
// sqrtInto, adamwUpdate against the CPU adamwUpdate over several steps with
// and without clipping, and scalarAccumulate.
//
//===----------------------------------------------------------------------===//

#include "CudaTest.h"

#include "tessel/Runtime/Kernels.h"
#include "tessel/Runtime/Program.h"

#include <cstring>
#include <string>

namespace tessel::cuda::test {
namespace {

// DeviceArray copies on the default stream, which the compute stream need
// not be ordered with: inputs are synchronised before kernels read them.
// One double on the device (DeviceArray reads back through float).
class DeviceDouble {
public:
  explicit DeviceDouble(double value) {
    TESSEL_CUDA_CHECK(cudaMalloc(&ptr, sizeof(double)));
    set(value);
  }
  DeviceDouble(const DeviceDouble &) = delete;
  ~DeviceDouble() { cudaFree(ptr); }
  void set(double value) {
    TESSEL_CUDA_CHECK(cudaDeviceSynchronize());
    TESSEL_CUDA_CHECK(
        cudaMemcpy(ptr, &value, sizeof(double), cudaMemcpyHostToDevice));
    TESSEL_CUDA_CHECK(cudaDeviceSynchronize());
  }
  double get() const {
    TESSEL_CUDA_CHECK(cudaDeviceSynchronize());
    double value = 0;
    TESSEL_CUDA_CHECK(
        cudaMemcpy(&value, ptr, sizeof(double), cudaMemcpyDeviceToHost));
    return value;
  }
  double *device() const { return ptr; }

private:
  double *ptr = nullptr;
};

template <typename T> void checkSumSquares(int64_t n) {
  SCOPED_TRACE(std::string(std::is_same_v<T, float> ? "f32" : "bf16") +
               " n=" + std::to_string(n));
  auto x = roundTo<T>(randomVector(n, 50, -3.0f, 3.0f));
  const double want = 1.25 + tessel::rt::sumSquares(x.data(), n);
  DeviceArray<T> dx(x);
  DeviceDouble acc(1.25);
  sync();
  sumSquaresInto(dx.get(), n, acc.device());
  const double got = acc.get();
  // Both sums are fp64 in different orders.
  EXPECT_NEAR(got, want, 1e-12 * want);

  // acc accumulates: a second call adds the same sum again.
  sumSquaresInto(dx.get(), n, acc.device());
  EXPECT_NEAR(acc.get(), 2 * want - 1.25, 2e-12 * want);

  // Bitwise reproducible.
  acc.set(1.25);
  sumSquaresInto(dx.get(), n, acc.device());
  const double again = acc.get();
  EXPECT_EQ(0, std::memcmp(&got, &again, sizeof(double)))
      << "two runs differ: " << got << " vs " << again;
}

TEST(CudaOptimizer, SumSquaresInto) {
  for (int64_t n : {int64_t(1), int64_t(1000), int64_t(1000003)}) {
    checkSumSquares<float>(n);
    checkSumSquares<bf16>(n);
  }
  DeviceArray<float> empty(1);
  DeviceDouble acc(3.5);
  sync();
  sumSquaresInto(empty.get(), 0, acc.device());
  EXPECT_EQ(acc.get(), 3.5);
}

TEST(CudaOptimizer, SqrtInto) {
  DeviceDouble acc(2.0);
  DeviceArray<float> out(1);
  sync();
  sqrtInto(acc.device(), 1, out.get());
  EXPECT_EQ(out.download()[0], float(std::sqrt(2.0)));

  // Several partial sums (one per set of mesh axes) are added first.
  const std::vector<double> parts = {1.5, 0.25, 7.0};
  double *dparts = nullptr;
  TESSEL_CUDA_CHECK(cudaMalloc(&dparts, parts.size() * sizeof(double)));
  TESSEL_CUDA_CHECK(cudaMemcpy(dparts, parts.data(),
                               parts.size() * sizeof(double),
                               cudaMemcpyHostToDevice));
  sync();
  sqrtInto(dparts, int(parts.size()), out.get());
  const float got = out.download()[0];
  TESSEL_CUDA_CHECK(cudaFree(dparts));
  EXPECT_EQ(got, float(std::sqrt(1.5 + 0.25 + 7.0)));
}

// Several AdamW steps on both sides; the device computes the clip
// coefficient from the norm the CPU passes to clipCoefficient.
void checkAdamw(float norm, float maxNorm, bool withShadow) {
  SCOPED_TRACE("norm=" + std::to_string(norm) + " maxNorm=" +
               std::to_string(maxNorm) + (withShadow ? " with shadow" : ""));
  const int64_t n = 100003;
  const float lr = 3e-4f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, wd = 0.1f;
  auto p = randomVector(n, 51);
  auto m = randomVector(n, 52, -0.01f, 0.01f);
  auto v = randomVector(n, 53, 0.0f, 1e-4f);
  DeviceArray<float> dp(p), dm(m), dv(v), dnorm(std::vector<float>{norm});
  DeviceArray<bf16> shadow(n);
  for (int64_t step = 1; step <= 3; ++step) {
    auto g = randomVector(n, 60 + uint32_t(step));
    tessel::rt::adamwUpdate(p.data(), g.data(), m.data(), v.data(), n, lr,
                            beta1, beta2, eps, wd, step,
                            tessel::rt::clipCoefficient(norm, maxNorm));
    DeviceArray<float> dg(g);
    sync();
    adamwUpdate(dp.get(), withShadow ? shadow.get() : nullptr, dg.get(),
                dm.get(), dv.get(), n, lr, beta1, beta2, eps, wd, step,
                dnorm.get(), maxNorm);
    sync();
  }
  // The same fp32 operations; the CPU build may fuse multiply-adds. m's
  // update m + 0.1 (g - m) cancels where m is small: the product is O(0.1)
  // for gradients of O(1), one rounding of it is up to 7.5e-9, and a fused
  // multiply-add skips that rounding, so over three steps m may differ by a
  // few 1e-8 in absolute terms (seen on an H200: 1.6e-8 at m = 1.7e-4).
  expectClose(dp.download(), p, 1e-6, 1e-8, "p");
  expectClose(dm.download(), m, 1e-5, 1e-7, "m");
  expectClose(dv.download(), v, 1e-5, 1e-12, "v");
  if (withShadow)
    expectClose(shadow.download(), roundTo<bf16>(p), 1e-2, 0, "shadow");
  else
    expectClose(shadow.download(), std::vector<float>(n, 0.0f), 0, 0,
                "shadow untouched");
}

TEST(CudaOptimizer, AdamwUpdate) {
  checkAdamw(2.5f, 1.0f, true);  // clipped
  checkAdamw(0.5f, 1.0f, false); // below the threshold
  checkAdamw(2.5f, 0.0f, true);  // clipping off
}

// The update must actually move the parameters: with zero moments and a
// gradient of 1 the first AdamW step is p * (1 - lr wd) - lr.
TEST(CudaOptimizer, AdamwFirstStep) {
  const int64_t n = 1000;
  const float lr = 1e-2f, wd = 0.1f;
  DeviceArray<float> p(std::vector<float>(n, 2.0f)),
      g(std::vector<float>(n, 1.0f));
  DeviceArray<float> m(n), v(n), norm(std::vector<float>{1.0f});
  sync();
  adamwUpdate(p.get(), nullptr, g.get(), m.get(), v.get(), n, lr, 0.9f, 0.999f,
              1e-8f, wd, 1, norm.get(), 0.0f);
  const float want = 2.0f * (1.0f - lr * wd) - lr;
  expectClose(p.download(), std::vector<float>(n, want), 1e-5, 0, "p");
}

// A global norm that is not finite skips the step on the device as on the
// CPU (tessel::rt::adamwStep): parameters, moments and copy untouched.
TEST(CudaOptimizer, AdamwSkipsNonfiniteNorm) {
  const int64_t n = 1000;
  const std::vector<float> p0(n, 2.0f), m0(n, 0.5f), v0(n, 0.25f);
  for (float bad : {NAN, INFINITY}) {
    for (float maxNorm : {1.0f, 0.0f}) {
      SCOPED_TRACE("norm=" + std::to_string(bad) +
                   " maxNorm=" + std::to_string(maxNorm));
      DeviceArray<float> p(p0), m(m0), v(v0), g(std::vector<float>(n, 1.0f)),
          norm(std::vector<float>{bad});
      DeviceArray<bf16> shadow(n);
      sync();
      adamwUpdate(p.get(), shadow.get(), g.get(), m.get(), v.get(), n, 1e-2f,
                  0.9f, 0.999f, 1e-8f, 0.1f, 1, norm.get(), maxNorm);
      sync();
      expectClose(p.download(), p0, 0, 0, "p");
      expectClose(m.download(), m0, 0, 0, "m");
      expectClose(v.download(), v0, 0, 0, "v");
      expectClose(shadow.download(), std::vector<float>(n, 0.0f), 0, 0,
                  "shadow");
    }
  }
}

TEST(CudaOptimizer, ScalarAccumulate) {
  DeviceArray<float> a(std::vector<float>{1.5f}), b(std::vector<float>{2.25f});
  DeviceArray<float> acc(std::vector<float>{100.0f});
  sync();
  scalarAccumulate(a.get(), acc.get(), true);
  EXPECT_EQ(acc.download()[0], 1.5f);
  scalarAccumulate(b.get(), acc.get(), false);
  EXPECT_EQ(acc.download()[0], 3.75f);
}

} // namespace
} // namespace tessel::cuda::test
