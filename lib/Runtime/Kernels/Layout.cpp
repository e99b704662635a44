//===- Layout.cpp - Transpose, slice and concat along an axis -------------===//
//
// transpose first drops size-1 dimensions and merges runs of output
// dimensions that are also contiguous in the input, so common permutations
// become a few long copies. When the innermost output dimension is strided in
// the input but the one before it is contiguous there (a matrix transpose),
// the last two dimensions are copied in square tiles.
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Kernels.h"

#include <cstring>
#include <vector>

namespace tessel::rt {
namespace {

constexpr int64_t kParallelMin = 1 << 15;

struct Dim {
  int64_t size, stride; // output extent, input element stride
};

// Input offset of the outer multi-index `idx` over dims [0, count).
inline int64_t outerOffset(const std::vector<Dim> &dims, int count,
                           int64_t idx) {
  int64_t off = 0;
  for (int d = count - 1; d >= 0; --d) {
    off += (idx % dims[size_t(d)].size) * dims[size_t(d)].stride;
    idx /= dims[size_t(d)].size;
  }
  return off;
}

} // namespace

template <typename T>
void transpose(const T *x, T *out, const int64_t *shape, const int64_t *perm,
               int rank) {
  int64_t total = 1;
  for (int d = 0; d < rank; ++d)
    total *= shape[d];
  if (total <= 0)
    return;
  std::vector<int64_t> inStride(size_t(rank > 0 ? rank : 1), 1);
  for (int d = rank - 2; d >= 0; --d)
    inStride[size_t(d)] = inStride[size_t(d + 1)] * shape[d + 1];

  std::vector<Dim> dims;
  for (int i = 0; i < rank; ++i) {
    const Dim dim{shape[perm[i]], inStride[size_t(perm[i])]};
    if (dim.size == 1)
      continue;
    if (!dims.empty() && dims.back().stride == dim.stride * dim.size) {
      dims.back().size *= dim.size;
      dims.back().stride = dim.stride;
      continue;
    }
    dims.push_back(dim);
  }
  if (dims.empty() || (dims.size() == 1 && dims[0].stride == 1)) {
    copy(x, out, total);
    return;
  }

  const int nd = int(dims.size());
  const Dim last = dims.back();

  if (last.stride == 1) {
    // Rows of the output are contiguous runs of the input.
    const int64_t rows = total / last.size;
#pragma omp parallel for schedule(static) if (total >= kParallelMin)
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(out + r * last.size, x + outerOffset(dims, nd - 1, r),
                  size_t(last.size) * sizeof(T));
    return;
  }

  if (nd >= 2 && dims[size_t(nd - 2)].stride == 1) {
    // Batched matrix transpose: out[o][a][b] = x[o + a * 1 + b * sB].
    constexpr int64_t kTile = 32;
    const int64_t nA = dims[size_t(nd - 2)].size, nB = last.size;
    const int64_t sB = last.stride;
    const int64_t outer = total / (nA * nB);
    const int64_t tilesA = (nA + kTile - 1) / kTile;
    const int64_t tilesB = (nB + kTile - 1) / kTile;
    const int64_t work = outer * tilesA * tilesB;
#pragma omp parallel for schedule(static) if (total >= kParallelMin)
    for (int64_t w = 0; w < work; ++w) {
      const int64_t tb = w % tilesB;
      const int64_t ta = (w / tilesB) % tilesA;
      const int64_t o = w / (tilesB * tilesA);
      const T *src = x + outerOffset(dims, nd - 2, o);
      T *dst = out + o * nA * nB;
      const int64_t a1 = (ta + 1) * kTile < nA ? (ta + 1) * kTile : nA;
      const int64_t b1 = (tb + 1) * kTile < nB ? (tb + 1) * kTile : nB;
      for (int64_t a = ta * kTile; a < a1; ++a)
        for (int64_t b = tb * kTile; b < b1; ++b)
          dst[a * nB + b] = src[a + b * sB];
    }
    return;
  }

  // General case: strided gather along the innermost output dimension.
  const int64_t rows = total / last.size;
#pragma omp parallel for schedule(static) if (total >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const T *src = x + outerOffset(dims, nd - 1, r);
    T *dst = out + r * last.size;
    for (int64_t i = 0; i < last.size; ++i)
      dst[i] = src[i * last.stride];
  }
}

template <typename T>
void sliceAxis(const T *x, T *out, int64_t outer, int64_t srcAxis,
               int64_t inner, int64_t start, int64_t len) {
  const int64_t run = len * inner;
  if (run <= 0)
    return;
#pragma omp parallel for schedule(static) if (outer * run >= kParallelMin)
  for (int64_t o = 0; o < outer; ++o)
    std::memcpy(out + o * run, x + (o * srcAxis + start) * inner,
                size_t(run) * sizeof(T));
}

template <typename T>
void insertAxis(const T *x, T *out, int64_t outer, int64_t dstAxis,
                int64_t inner, int64_t start, int64_t len) {
  const int64_t run = len * inner;
  if (run <= 0)
    return;
#pragma omp parallel for schedule(static) if (outer * run >= kParallelMin)
  for (int64_t o = 0; o < outer; ++o)
    std::memcpy(out + (o * dstAxis + start) * inner, x + o * run,
                size_t(run) * sizeof(T));
}

#define TESSEL_INSTANTIATE(T)                                                  \
  template void transpose<T>(const T *, T *, const int64_t *, const int64_t *, \
                             int);                                             \
  template void sliceAxis<T>(const T *, T *, int64_t, int64_t, int64_t,        \
                             int64_t, int64_t);                                \
  template void insertAxis<T>(const T *, T *, int64_t, int64_t, int64_t,       \
                              int64_t, int64_t);
TESSEL_INSTANTIATE(float)
TESSEL_INSTANTIATE(double)
#undef TESSEL_INSTANTIATE

} // namespace tessel::rt
