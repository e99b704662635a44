//===- RopeSoftmaxTest.cu - CUDA rotary embedding and softmax -------------===//
//
// rope, softmaxForward and softmaxBackward against the CPU kernels, for
// float and bf16 storage, over shapes that exercise odd head sizes, one
// warp per row (few columns) and rows longer than a block; and dropout,
// whose masks must be the CPU kernel's bit for bit.
//
//===----------------------------------------------------------------------===//

#include "CudaTest.h"

#include "tessel/Runtime/Dropout.h"
#include "tessel/Runtime/Kernels.h"

#include <string>

namespace tessel::cuda::test {
namespace {

// DeviceArray copies on the default stream, which the compute stream need
// not be ordered with: inputs are synchronised before kernels read them.
template <typename TI, typename TO>
void checkRope(int64_t B, int64_t T, int64_t H, int64_t D, double theta,
               bool inverse) {
  SCOPED_TRACE(std::string(typeName<TI>()) + "->" + typeName<TO>() +
               " D=" + std::to_string(D) + " theta=" + std::to_string(theta) +
               (inverse ? " inverse" : ""));
  const int64_t n = B * T * H * D;
  auto x = roundTo<TI>(randomVector(n, 40, -2.0f, 2.0f));
  std::vector<float> want(n);
  tessel::rt::rope(x.data(), want.data(), B, T, H, D, theta, inverse);
  DeviceArray<TI> dx(x);
  DeviceArray<TO> out(n);
  sync();
  rope(dx.get(), out.get(), B, T, H, D, theta, inverse);
  // The absolute term covers x1 cos - x2 sin cancelling.
  expectClose(out.download(), want, rtolFor<TO>(), 1e-6, "rope");
}

TEST(CudaRope, MatchesCpu) {
  for (bool inverse : {false, true}) {
    checkRope<float, float>(2, 33, 3, 64, 10000.0, inverse);
    checkRope<float, float>(1, 300, 2, 128, 500000.0, inverse);
    checkRope<float, float>(2, 5, 3, 7, 10000.0, inverse); // odd D
    checkRope<float, float>(1, 4, 2, 1, 10000.0, inverse); // no pair
    checkRope<bf16, bf16>(2, 33, 3, 64, 10000.0, inverse);
    checkRope<bf16, float>(2, 33, 3, 64, 10000.0, inverse);
  }
}

// Rotating back by the inverse gives the input again.
TEST(CudaRope, InverseUndoesForward) {
  const int64_t B = 2, T = 65, H = 4, D = 32, n = B * T * H * D;
  auto x = randomVector(n, 41);
  DeviceArray<float> dx(x), rotated(n), back(n);
  sync();
  rope(dx.get(), rotated.get(), B, T, H, D, 10000.0, false);
  rope(rotated.get(), back.get(), B, T, H, D, 10000.0, true);
  expectClose(back.download(), x, 1e-5, 1e-6, "rope round trip");
}

template <typename TI, typename TO>
void checkSoftmaxForward(int64_t rows, int64_t cols, double scale = 1.0,
                         bool causal = false) {
  SCOPED_TRACE(std::string(typeName<TI>()) + "->" + typeName<TO>() + " rows=" +
               std::to_string(rows) + " cols=" + std::to_string(cols) +
               " scale=" + std::to_string(scale) +
               (causal ? " causal" : ""));
  auto x = roundTo<TI>(randomVector(rows * cols, 42, -6.0f, 6.0f));
  std::vector<float> want(rows * cols);
  tessel::rt::softmaxForward(x.data(), want.data(), rows, cols, scale, causal);
  DeviceArray<TI> dx(x);
  DeviceArray<TO> out(rows * cols);
  sync();
  softmaxForward(dx.get(), out.get(), rows, cols, scale, causal);
  expectClose(out.download(), want, rtolFor<TO>(), 1e-7, "softmaxForward");
}

template <typename TY, typename TG, typename TO>
void checkSoftmaxBackward(int64_t rows, int64_t cols, double scale = 1.0,
                          bool causal = false) {
  SCOPED_TRACE(std::string(typeName<TY>()) + "," + typeName<TG>() + "->" +
               typeName<TO>() + " rows=" + std::to_string(rows) +
               " cols=" + std::to_string(cols) +
               " scale=" + std::to_string(scale) +
               (causal ? " causal" : ""));
  auto x = randomVector(rows * cols, 43, -4.0f, 4.0f);
  std::vector<float> y(rows * cols);
  tessel::rt::softmaxForward(x.data(), y.data(), rows, cols, scale, causal);
  y = roundTo<TY>(y);
  auto dy = roundTo<TG>(randomVector(rows * cols, 44));
  std::vector<float> want(rows * cols);
  tessel::rt::softmaxBackward(y.data(), dy.data(), want.data(), rows, cols,
                              scale);
  DeviceArray<TY> dY(y);
  DeviceArray<TG> dDy(dy);
  DeviceArray<TO> dx(rows * cols);
  sync();
  softmaxBackward(dY.get(), dDy.get(), dx.get(), rows, cols, scale);
  // dy - sum(dy y) cancels for some entries.
  expectClose(dx.download(), want, rtolFor<TO>(), 1e-6, "softmaxBackward");
}

TEST(CudaSoftmax, Forward) {
  const std::pair<int64_t, int64_t> shapes[] = {
      {7, 1}, {64, 5}, {33, 32}, {33, 100}, {9, 1000}, {3, 5000}};
  for (auto [rows, cols] : shapes) {
    checkSoftmaxForward<float, float>(rows, cols);
    checkSoftmaxForward<bf16, bf16>(rows, cols);
  }
  checkSoftmaxForward<bf16, float>(33, 100);
  checkSoftmaxForward<float, bf16>(33, 100);
  // An attention's scores: scaled, causal, query rows of two heads stacked.
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{64, 64}, {512, 256}}) {
    checkSoftmaxForward<float, float>(rows, cols, 0.125, true);
    checkSoftmaxForward<bf16, bf16>(rows, cols, 0.125, true);
  }
}

// Rows sum to one (a property, independent of the CPU kernel).
TEST(CudaSoftmax, RowsSumToOne) {
  const int64_t rows = 17, cols = 777;
  auto x = randomVector(rows * cols, 45, -10.0f, 10.0f);
  DeviceArray<float> dx(x), out(rows * cols);
  sync();
  softmaxForward(dx.get(), out.get(), rows, cols);
  auto y = out.download();
  for (int64_t r = 0; r < rows; ++r) {
    double s = 0;
    for (int64_t j = 0; j < cols; ++j)
      s += y[r * cols + j];
    EXPECT_NEAR(s, 1.0, 1e-5) << "row " << r;
  }
}

TEST(CudaSoftmax, Backward) {
  const std::pair<int64_t, int64_t> shapes[] = {
      {7, 1}, {64, 5}, {33, 100}, {9, 1000}, {3, 5000}};
  for (auto [rows, cols] : shapes) {
    checkSoftmaxBackward<float, float, float>(rows, cols);
    checkSoftmaxBackward<bf16, bf16, bf16>(rows, cols);
  }
  checkSoftmaxBackward<bf16, float, float>(33, 100);
  checkSoftmaxBackward<float, bf16, bf16>(33, 100);
  checkSoftmaxBackward<float, float, float>(512, 256, 0.125, true);
  checkSoftmaxBackward<bf16, bf16, bf16>(512, 256, 0.125, true);
}

// The device draws the CPU kernel's masks (Dropout.h runs on both), for
// each microbatch's piece, and copies while evaluating.
TEST(CudaDropout, MatchesCpuMasks) {
  const int64_t shape[3] = {3, 40, 33}, axes[3] = {0, 0, 0},
                n = shape[0] * shape[1] * shape[2];
  auto x = randomVector(n, 46, 0.5f, 2.0f);
  for (int64_t microbatch : {0, 1}) {
    for (bool evaluating : {false, true}) {
      tessel::rt::setRunningStep(5, evaluating);
      std::vector<float> want(n);
      tessel::rt::dropout(x.data(), want.data(), microbatch, shape, axes, 3, 2,
                          0.25, 1234, 7);
      DeviceArray<float> dx(x), out(n);
      sync();
      dropout(dx.get(), out.get(), microbatch, shape, axes, 3, 2, 0.25, 1234,
              7);
      EXPECT_EQ(out.download(), want)
          << "microbatch " << microbatch << (evaluating ? " evaluating" : "");
    }
  }
  tessel::rt::setRunningStep(0, false);
}

} // namespace
} // namespace tessel::cuda::test
