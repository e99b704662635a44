//===- Softmax.cpp - Softmax over the last dimension ----------------------===//
//
// Numerically stable (the row max is subtracted). Rows run in parallel; each
// row is reduced by one thread in a fixed order. A scaled softmax scales
// first; a causal row reads only its visible columns and zeroes the rest.
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Kernels.h"

#include "RowOps.h"

#include <cmath>

namespace tessel::rt {
namespace {

using detail::dotOf;
using detail::kLanes;
using detail::maxOf;
using detail::sumOf;

constexpr int64_t kParallelMin = 1 << 14;

} // namespace

template <typename T>
void softmaxForward(const T *x, T *out, int64_t rows, int64_t cols,
                    double scale, bool causal) {
  if (cols <= 0)
    return;
  const T s = T(scale);
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const T *xr = x + r * cols;
    T *outr = out + r * cols;
    // A causal row sees the columns up to its position, r mod cols.
    const int64_t n = causal ? r % cols + 1 : cols;
    if (s != T(1)) {
      for (int64_t j = 0; j < n; ++j)
        outr[j] = s * xr[j];
      xr = outr;
    }
    const T m = maxOf(xr, n);
    detail::expShifted(xr, m, outr, n);
    const T sum = sumOf(outr, n);
    const T inv = T(1) / sum;
    for (int64_t j = 0; j < n; ++j)
      outr[j] *= inv;
    for (int64_t j = n; j < cols; ++j)
      outr[j] = T(0);
  }
}

template <typename T>
void softmaxBackward(const T *y, const T *dy, T *dx, int64_t rows,
                     int64_t cols, double scale) {
  const T scaleT = T(scale);
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const T *yr = y + r * cols;
    const T *dyr = dy + r * cols;
    T *dxr = dx + r * cols;
    const T s = dotOf(dyr, yr, cols);
    for (int64_t j = 0; j < cols; ++j)
      dxr[j] = scaleT * (yr[j] * (dyr[j] - s));
  }
}

#define TESSEL_INSTANTIATE(T)                                                  \
  template void softmaxForward<T>(const T *, T *, int64_t, int64_t, double,    \
                                  bool);                                       \
  template void softmaxBackward<T>(const T *, const T *, T *, int64_t,         \
                                   int64_t, double);
TESSEL_INSTANTIATE(float)
TESSEL_INSTANTIATE(double)
#undef TESSEL_INSTANTIATE

} // namespace tessel::rt
