//===- CrossEntropy.cpp - Mean cross-entropy over rows of logits ----------===//
//
// loss = mean_r (logsumexp(logits[r]) - logits[r, target[r]]). The
// log-sum-exp subtracts the row max and sums the exponentials in double, in a
// fixed order. Per-row losses are computed in parallel and then averaged in
// ascending row order. Targets are assumed to lie in [0, valid). Columns
// from `valid` on (a vocabulary padded to a multiple) take no part: they
// are left out of the softmax and get a zero gradient.
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Kernels.h"

#include "RowOps.h"

#include <cmath>
#include <vector>

namespace tessel::rt {
namespace {

using detail::dotOf;
using detail::kLanes;
using detail::maxOf;
using detail::sumOf;

constexpr int64_t kParallelMin = 1 << 14;
constexpr int64_t kChunk = 1024;

// Adds x[0..n) into the double lanes acc (element i goes to lane i % kLanes).
template <typename T>
inline void accumulateLanes(const T *x, int64_t n, double *acc) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l)
      acc[l] += double(x[i + l]);
  for (int l = 0; i < n; ++i, ++l)
    acc[l] += double(x[i]);
}

inline double laneTotal(const double *acc) {
  double s = 0.0;
  for (int l = 0; l < kLanes; ++l)
    s += acc[l];
  return s;
}

// Row max and sum(exp(x - max)) in double, going through a small buffer.
template <typename T>
inline double rowSumExp(const T *x, int64_t V, T m, T *buf) {
  double acc[kLanes] = {};
  for (int64_t j0 = 0; j0 < V; j0 += kChunk) {
    const int64_t len = j0 + kChunk < V ? kChunk : V - j0;
    detail::expShifted(x + j0, m, buf, len);
    accumulateLanes(buf, len, acc);
  }
  return laneTotal(acc);
}

} // namespace

template <typename T>
void crossEntropyForward(const T *logits, const int32_t *targets, T *loss,
                         int64_t rows, int64_t V, int64_t valid) {
  const int64_t n = valid < V ? valid : V;
  if (rows <= 0) {
    loss[0] = T(0);
    return;
  }
  std::vector<double> rowLoss(static_cast<size_t>(rows));
#pragma omp parallel if (rows * V >= kParallelMin)
  {
    T buf[kChunk];
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T *xr = logits + r * V;
      const T m = maxOf(xr, n);
      const double sum = rowSumExp(xr, n, m, buf);
      rowLoss[size_t(r)] = std::log(sum) + double(m) - double(xr[targets[r]]);
    }
  }
  double total = 0.0;
  for (int64_t r = 0; r < rows; ++r)
    total += rowLoss[size_t(r)];
  loss[0] = T(total / double(rows));
}

template <typename T>
void crossEntropyBackward(const T *logits, const int32_t *targets,
                          const T *dloss, T *dlogits, int64_t rows, int64_t V,
                          int64_t valid) {
  if (rows <= 0)
    return;
  const int64_t n = valid < V ? valid : V;
  const double g = double(dloss[0]) / double(rows);
#pragma omp parallel for schedule(static) if (rows * V >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const T *xr = logits + r * V;
    T *dr = dlogits + r * V;
    const T m = maxOf(xr, n);
    // dr = exp(x - m) first, then scaled by g / sum.
    detail::expShifted(xr, m, dr, n);
    double acc[kLanes] = {};
    accumulateLanes(dr, n, acc);
    const double k = g / laneTotal(acc);
    const int32_t tgt = targets[r];
    const double eTgt = double(dr[tgt]);
    for (int64_t j = 0; j < n; ++j)
      dr[j] = T(double(dr[j]) * k);
    for (int64_t j = n; j < V; ++j)
      dr[j] = T(0);
    dr[tgt] = T(eTgt * k - g);
  }
}

#define TESSEL_INSTANTIATE(T)                                                  \
  template void crossEntropyForward<T>(const T *, const int32_t *, T *,        \
                                       int64_t, int64_t, int64_t);             \
  template void crossEntropyBackward<T>(const T *, const int32_t *, const T *, \
                                        T *, int64_t, int64_t, int64_t);
TESSEL_INSTANTIATE(float)
TESSEL_INSTANTIATE(double)
#undef TESSEL_INSTANTIATE

} // namespace tessel::rt
