//===- Norms.cpp - LayerNorm and RMSNorm ----------------------------------===//
//
// Rows are independent in the forward pass and for dx, so those loops are
// parallel over rows. The weight/bias gradients reduce across rows: they are
// computed in a second pass parallel over blocks of columns, with the rows
// added in ascending order, so the result does not depend on the threads.
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

constexpr int64_t kParallelMin = 1 << 14; // elements
constexpr int64_t kColBlock = 128;

// sum (x - m)^2
template <typename T> inline T sumSqDev(const T *x, T m, int64_t n) {
  T acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const T d = x[i + l] - m;
      acc[l] += d * d;
    }
  T s = T(0);
  for (int l = 0; l < kLanes; ++l)
    s += acc[l];
  for (; i < n; ++i)
    s += (x[i] - m) * (x[i] - m);
  return s;
}

template <typename T> struct RowStats { T mean, rstd; };

template <typename T>
inline RowStats<T> layerNormStats(const T *x, int64_t C, double eps) {
  const T mean = sumOf(x, C) / T(C);
  const T var = sumSqDev(x, mean, C) / T(C);
  return {mean, T(1.0 / std::sqrt(double(var) + eps))};
}

} // namespace

template <typename T>
void layerNormForward(const T *x, const T *w, const T *b, T *out, int64_t rows,
                      int64_t C, double eps) {
#pragma omp parallel for schedule(static) if (rows * C >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const T *xr = x + r * C;
    T *outr = out + r * C;
    const RowStats<T> s = layerNormStats(xr, C, eps);
    for (int64_t j = 0; j < C; ++j)
      outr[j] = (xr[j] - s.mean) * s.rstd * w[j] + b[j];
  }
}

// With xhat = (x - mean) * rstd and g = dout * w:
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
//   dw = sum_rows dout * xhat,  db = sum_rows dout.
template <typename T>
void layerNormBackward(const T *x, const T *w, const T *dout, T *dx, T *dw,
                       T *db, int64_t rows, int64_t C, double eps) {
  std::vector<RowStats<T>> stats(size_t(rows > 0 ? rows : 0));
  const bool par = rows * C >= kParallelMin;
#pragma omp parallel if (par)
  {
    std::vector<T> xhat(static_cast<size_t>(C)), g(static_cast<size_t>(C));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T *xr = x + r * C;
      const T *dr = dout + r * C;
      T *dxr = dx + r * C;
      const RowStats<T> s = layerNormStats(xr, C, eps);
      stats[size_t(r)] = s;
      for (int64_t j = 0; j < C; ++j) {
        xhat[size_t(j)] = (xr[j] - s.mean) * s.rstd;
        g[size_t(j)] = dr[j] * w[j];
      }
      const T gMean = sumOf(g.data(), C) / T(C);
      const T gxMean = dotOf(g.data(), xhat.data(), C) / T(C);
      for (int64_t j = 0; j < C; ++j)
        dxr[j] = s.rstd * (g[size_t(j)] - gMean - xhat[size_t(j)] * gxMean);
    }
  }

  const int64_t nBlocks = (C + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (par)
  for (int64_t blk = 0; blk < nBlocks; ++blk) {
    const int64_t c0 = blk * kColBlock;
    const int64_t c1 = c0 + kColBlock < C ? c0 + kColBlock : C;
    for (int64_t j = c0; j < c1; ++j) {
      dw[j] = T(0);
      db[j] = T(0);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const T *xr = x + r * C;
      const T *dr = dout + r * C;
      const RowStats<T> s = stats[size_t(r)];
      for (int64_t j = c0; j < c1; ++j) {
        dw[j] += dr[j] * ((xr[j] - s.mean) * s.rstd);
        db[j] += dr[j];
      }
    }
  }
}

template <typename T>
void rmsNormForward(const T *x, const T *w, T *out, int64_t rows, int64_t C,
                    double eps) {
#pragma omp parallel for schedule(static) if (rows * C >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const T *xr = x + r * C;
    T *outr = out + r * C;
    const T ms = dotOf(xr, xr, C) / T(C);
    const T rstd = T(1.0 / std::sqrt(double(ms) + eps));
    for (int64_t j = 0; j < C; ++j)
      outr[j] = (xr[j] * rstd) * w[j];
  }
}

// With rstd = 1 / sqrt(mean(x^2) + eps) and g = dout * w:
//   dx = rstd * g - x * rstd^3 * sum(g * x) / C,   dw = sum_rows dout * x *
//   rstd.
template <typename T>
void rmsNormBackward(const T *x, const T *w, const T *dout, T *dx, T *dw,
                     int64_t rows, int64_t C, double eps) {
  std::vector<T> rstds(size_t(rows > 0 ? rows : 0));
  const bool par = rows * C >= kParallelMin;
#pragma omp parallel if (par)
  {
    std::vector<T> g(static_cast<size_t>(C));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T *xr = x + r * C;
      const T *dr = dout + r * C;
      T *dxr = dx + r * C;
      const T ms = dotOf(xr, xr, C) / T(C);
      const T rstd = T(1.0 / std::sqrt(double(ms) + eps));
      rstds[size_t(r)] = rstd;
      for (int64_t j = 0; j < C; ++j)
        g[size_t(j)] = dr[j] * w[j];
      const T gx = dotOf(g.data(), xr, C);
      const T k = rstd * rstd * rstd * gx / T(C);
      for (int64_t j = 0; j < C; ++j)
        dxr[j] = rstd * g[size_t(j)] - xr[j] * k;
    }
  }

  const int64_t nBlocks = (C + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (par)
  for (int64_t blk = 0; blk < nBlocks; ++blk) {
    const int64_t c0 = blk * kColBlock;
    const int64_t c1 = c0 + kColBlock < C ? c0 + kColBlock : C;
    for (int64_t j = c0; j < c1; ++j)
      dw[j] = T(0);
    for (int64_t r = 0; r < rows; ++r) {
      const T *xr = x + r * C;
      const T *dr = dout + r * C;
      const T rstd = rstds[size_t(r)];
      for (int64_t j = c0; j < c1; ++j)
        dw[j] += dr[j] * (xr[j] * rstd);
    }
  }
}

#define TESSEL_INSTANTIATE(T)                                                  \
  template void layerNormForward<T>(const T *, const T *, const T *, T *,      \
                                    int64_t, int64_t, double);                 \
  template void layerNormBackward<T>(const T *, const T *, const T *, T *,     \
                                     T *, T *, int64_t, int64_t, double);      \
  template void rmsNormForward<T>(const T *, const T *, T *, int64_t, int64_t, \
                                  double);                                     \
  template void rmsNormBackward<T>(const T *, const T *, const T *, T *, T *,  \
                                   int64_t, int64_t, double);
TESSEL_INSTANTIATE(float)
TESSEL_INSTANTIATE(double)
#undef TESSEL_INSTANTIATE

} // namespace tessel::rt
