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
#include "tessel/Runtime/Sequence.h"

#include <cstring>
#include <stdexcept>
#include <string>
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

// Chunks of h rows move whole: chunk k of the balanced order is chunk
// zigzagPosition(k h) / h of the sequence.
template <typename T>
void zigzag(const T *x, T *out, int64_t outer, int64_t len, int64_t inner,
            int64_t pieces, bool inverse) {
  if (outer <= 0 || len <= 0 || inner <= 0)
    return;
  if (pieces < 1 || len % (2 * pieces) != 0)
    throw std::invalid_argument("zigzag: " + std::to_string(len) +
                                " rows are not 2 x " + std::to_string(pieces) +
                                " chunks");
  const int64_t h = len / (2 * pieces), run = h * inner;
#pragma omp parallel for collapse(2) schedule(static) if (outer * len * inner >= kParallelMin)
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t k = 0; k < 2 * pieces; ++k) {
      const int64_t from = zigzagPosition(k * h, len, pieces);
      const int64_t src = inverse ? k * h : from, dst = inverse ? from : k * h;
      std::memcpy(out + (o * len + dst) * inner, x + (o * len + src) * inner,
                  size_t(run) * sizeof(T));
    }
}

#define TESSEL_INSTANTIATE(T)                                                  \
  template void zigzag<T>(const T *, T *, int64_t, int64_t, int64_t, int64_t,  \
                          bool);                                               \
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
