//===- Softmax.cpp - Softmax over the last dimension ----------------------===//
//
// Numerically stable (the row max is subtracted). Rows run in parallel; each
// row is reduced by one thread in a fixed order.
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Kernels.h"

#include <cmath>

namespace tessel::rt {
namespace {

constexpr int64_t kParallelMin = 1 << 14;
constexpr int kLanes = 8;

template <typename T> inline T dotOf(const T *a, const T *b, int64_t n) {
  T acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l)
      acc[l] += a[i + l] * b[i + l];
  T s = T(0);
  for (int l = 0; l < kLanes; ++l)
    s += acc[l];
  for (; i < n; ++i)
    s += a[i] * b[i];
  return s;
}

} // namespace

template <typename T>
void softmaxForward(const T *x, T *out, int64_t rows, int64_t cols) {
  if (cols <= 0)
    return;
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const T *xr = x + r * cols;
    T *outr = out + r * cols;
    T m = xr[0];
    for (int64_t j = 1; j < cols; ++j)
      m = xr[j] > m ? xr[j] : m;
    T sum = T(0);
    for (int64_t j = 0; j < cols; ++j) {
      const T e = std::exp(xr[j] - m);
      outr[j] = e;
      sum += e;
    }
    const T inv = T(1) / sum;
    for (int64_t j = 0; j < cols; ++j)
      outr[j] *= inv;
  }
}

template <typename T>
void softmaxBackward(const T *y, const T *dy, T *dx, int64_t rows,
                     int64_t cols) {
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const T *yr = y + r * cols;
    const T *dyr = dy + r * cols;
    T *dxr = dx + r * cols;
    const T s = dotOf(dyr, yr, cols);
    for (int64_t j = 0; j < cols; ++j)
      dxr[j] = yr[j] * (dyr[j] - s);
  }
}

#define TESSEL_INSTANTIATE(T)                                                  \
  template void softmaxForward<T>(const T *, T *, int64_t, int64_t);           \
  template void softmaxBackward<T>(const T *, const T *, T *, int64_t,         \
                                   int64_t);
TESSEL_INSTANTIATE(float)
TESSEL_INSTANTIATE(double)
#undef TESSEL_INSTANTIATE

} // namespace tessel::rt
