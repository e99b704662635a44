//===- Softmax.cpp - Softmax over the last dimension ----------------------===//
//
// Numerically stable (the row max is subtracted). Rows run in parallel; each
// row is reduced by one thread in a fixed order.
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Kernels.h"

#include <cmath>

namespace tessel::rt {
namespace detail {
// out[i] = exp(x[i] - shift), vectorised for float (Elementwise.cpp).
void expShifted(const float *x, float shift, float *out, int64_t n);
void expShifted(const double *x, double shift, double *out, int64_t n);
} // namespace detail
namespace {

constexpr int64_t kParallelMin = 1 << 14;
constexpr int kLanes = 8;

// Row maximum (order does not matter for max; lanes let it vectorise).
template <typename T> inline T maxOf(const T *x, int64_t n) {
  T acc[kLanes];
  for (int l = 0; l < kLanes; ++l)
    acc[l] = x[0];
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l)
      acc[l] = x[i + l] > acc[l] ? x[i + l] : acc[l];
  T m = acc[0];
  for (int l = 1; l < kLanes; ++l)
    m = acc[l] > m ? acc[l] : m;
  for (; i < n; ++i)
    m = x[i] > m ? x[i] : m;
  return m;
}

template <typename T> inline T sumOf(const T *x, int64_t n) {
  T acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l)
      acc[l] += x[i + l];
  T s = T(0);
  for (int l = 0; l < kLanes; ++l)
    s += acc[l];
  for (; i < n; ++i)
    s += x[i];
  return s;
}

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
    const T m = maxOf(xr, cols);
    detail::expShifted(xr, m, outr, cols);
    const T sum = sumOf(outr, cols);
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
