//===- CudaTest.h - Helpers of the CUDA kernel tests ------------*- C++ -*-===//
//
// Each CUDA kernel is compared with the CPU kernel of the same name (the
// reference, itself tested against naive loops) on random inputs. Inputs
// are rounded to the storage type first, so both sides see the same values.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_UNITTESTS_CUDA_CUDATEST_H
#define TESSEL_UNITTESTS_CUDA_CUDATEST_H

#include "tessel/Runtime/Cuda/Kernels.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace tessel::cuda::test {

// Values in [lo, hi), reproducible per seed.
inline std::vector<float> randomVector(size_t n, uint32_t seed,
                                       float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float &x : v)
    x = dist(gen);
  return v;
}

// Rounds through the storage type (identity for float).
template <typename T> std::vector<float> roundTo(std::vector<float> v) {
  if constexpr (!std::is_same_v<T, float>)
    for (float &x : v)
      x = __bfloat162float(__float2bfloat16(x));
  return v;
}

// A device array of T, freed on scope exit.
template <typename T> class DeviceArray {
public:
  explicit DeviceArray(size_t n) : n(n) {
    TESSEL_CUDA_CHECK(cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(T)));
    TESSEL_CUDA_CHECK(cudaMemset(ptr, 0, std::max<size_t>(n, 1) * sizeof(T)));
  }
  explicit DeviceArray(const std::vector<float> &host)
      : DeviceArray(host.size()) {
    upload(host);
  }
  DeviceArray(const DeviceArray &) = delete;
  ~DeviceArray() { cudaFree(ptr); }
  void upload(const std::vector<float> &host) {
    std::vector<T> tmp(host.size());
    for (size_t i = 0; i < host.size(); ++i)
      tmp[i] = T(host[i]);
    TESSEL_CUDA_CHECK(cudaMemcpy(ptr, tmp.data(), tmp.size() * sizeof(T),
                                 cudaMemcpyHostToDevice));
    // Kernels run on a non-blocking stream: the data must be there first.
    TESSEL_CUDA_CHECK(cudaDeviceSynchronize());
  }
  std::vector<float> download() const {
    TESSEL_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<T> tmp(n);
    TESSEL_CUDA_CHECK(
        cudaMemcpy(tmp.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    std::vector<float> out(n);
    for (size_t i = 0; i < n; ++i)
      out[i] = float(tmp[i]);
    return out;
  }
  T *get() const { return ptr; }
  size_t size() const { return n; }

private:
  T *ptr = nullptr;
  size_t n;
};

// Expects |got - want| <= atol + rtol * |want| elementwise; reports the
// worst element.
inline void expectClose(const std::vector<float> &got,
                        const std::vector<float> &want, double rtol,
                        double atol, const char *what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t worst = 0;
  double worstExcess = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    double excess = std::fabs(double(got[i]) - want[i]) -
                    (atol + rtol * std::fabs(double(want[i])));
    if (!std::isfinite(got[i]))
      excess = INFINITY;
    if (excess > worstExcess) {
      worstExcess = excess;
      worst = i;
    }
  }
  EXPECT_LE(worstExcess, 0.0)
      << what << ": element " << worst << " is " << got[worst] << ", want "
      << want[worst] << " (rtol " << rtol << ", atol " << atol << ")";
}

// Waits for every kernel (checks that read results synchronise anyway).
inline void sync() { TESSEL_CUDA_CHECK(cudaDeviceSynchronize()); }

template <typename T> const char *typeName() {
  return std::is_same_v<T, float> ? "f32" : "bf16";
}

// Bitwise equality (determinism checks).
inline void expectBitwiseEqual(const std::vector<float> &a,
                               const std::vector<float> &b, const char *what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)))
      << what << ": two runs differ";
}

// Tolerances per storage type: fp32 kernels match the CPU to rounding;
// bf16 outputs carry bf16 rounding (8 bits of mantissa).
template <typename T> constexpr double rtolFor() {
  return std::is_same_v<T, float> ? 1e-4 : 2e-2;
}

} // namespace tessel::cuda::test

#endif // TESSEL_UNITTESTS_CUDA_CUDATEST_H
