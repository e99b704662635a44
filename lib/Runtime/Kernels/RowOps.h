//===- RowOps.h - Fixed-order row reductions shared by the kernels -*- C++
//-*-===//
//
// Internal to lib/Runtime/Kernels. Sums use kLanes interleaved accumulators:
// they vectorise, and their order is fixed (independent of threads), which
// keeps runs bitwise reproducible.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_RUNTIME_KERNELS_ROWOPS_H
#define TESSEL_RUNTIME_KERNELS_ROWOPS_H

#include <cstdint>

namespace tessel::rt {
namespace detail {

// out[i] = exp(x[i] - shift); float uses a vectorisable approximation (under
// 2 ulp), double the standard library. Defined in Elementwise.cpp.
void expShifted(const float *x, float shift, float *out, int64_t n);
void expShifted(const double *x, double shift, double *out, int64_t n);

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

} // namespace detail
} // namespace tessel::rt

#endif // TESSEL_RUNTIME_KERNELS_ROWOPS_H
