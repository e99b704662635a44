//===- CrossEntropy.cpp - Mean cross-entropy over rows of logits ----------===//
//
// loss = mean_r (logsumexp(logits[r]) - logits[r, target[r]]). The
// log-sum-exp subtracts the row max and sums in double. Per-row losses are
// computed in parallel and then averaged in ascending row order.
// Targets are assumed to lie in [0, V).
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Kernels.h"

#include <cmath>
#include <vector>

namespace tessel::rt {
namespace {

constexpr int64_t kParallelMin = 1 << 14;

// Returns max and log(sum(exp(x - max))) of a row, the sum taken in double.
template <typename T>
inline void rowLogSumExp(const T *x, int64_t V, double &maxOut,
                         double &logSumOut) {
  T m = x[0];
  for (int64_t j = 1; j < V; ++j)
    m = x[j] > m ? x[j] : m;
  double sum = 0.0;
  for (int64_t j = 0; j < V; ++j)
    sum += std::exp(double(x[j]) - double(m));
  maxOut = double(m);
  logSumOut = std::log(sum);
}

} // namespace

template <typename T>
void crossEntropyForward(const T *logits, const int32_t *targets, T *loss,
                         int64_t rows, int64_t V) {
  if (rows <= 0) {
    loss[0] = T(0);
    return;
  }
  std::vector<double> rowLoss(static_cast<size_t>(rows));
#pragma omp parallel for schedule(static) if (rows * V >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const T *xr = logits + r * V;
    double m, ls;
    rowLogSumExp(xr, V, m, ls);
    rowLoss[size_t(r)] = ls + m - double(xr[targets[r]]);
  }
  double total = 0.0;
  for (int64_t r = 0; r < rows; ++r)
    total += rowLoss[size_t(r)];
  loss[0] = T(total / double(rows));
}

template <typename T>
void crossEntropyBackward(const T *logits, const int32_t *targets,
                          const T *dloss, T *dlogits, int64_t rows,
                          int64_t V) {
  if (rows <= 0)
    return;
  const double g = double(dloss[0]) / double(rows);
#pragma omp parallel for schedule(static) if (rows * V >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const T *xr = logits + r * V;
    T *dr = dlogits + r * V;
    double m, ls;
    rowLogSumExp(xr, V, m, ls);
    const double shift = m + ls; // log of the softmax denominator
    for (int64_t j = 0; j < V; ++j)
      dr[j] = T(g * std::exp(double(xr[j]) - shift));
    const int32_t tgt = targets[r];
    dr[tgt] = T(g * (std::exp(double(xr[tgt]) - shift) - 1.0));
  }
}

#define TESSEL_INSTANTIATE(T)                                                  \
  template void crossEntropyForward<T>(const T *, const int32_t *, T *,        \
                                       int64_t, int64_t);                      \
  template void crossEntropyBackward<T>(const T *, const int32_t *, const T *, \
                                        T *, int64_t, int64_t);
TESSEL_INSTANTIATE(float)
TESSEL_INSTANTIATE(double)
#undef TESSEL_INSTANTIATE

} // namespace tessel::rt
