//===- CrossEntropy.cu - Fused softmax + cross-entropy over logits --------===//
//
// The CUDA counterparts of lib/Runtime/Kernels/CrossEntropy.cpp and of the
// vocab-parallel loss in lib/Runtime/Kernels/VocabParallel.cpp.
//
// One block per row. The full-vocabulary kernels read a row once for its
// statistics: each thread keeps an online (max, sum of exp(x - max)) over
// its elements, rescaling the sum when the max grows, and the block combines
// the pairs. The backward then reads the row a second time to write it.
//
// The loss is a mean over rows, taken deterministically: each row's loss is
// written to an array, and one block adds the rows in a fixed order in fp64
// (the CPU kernel's precision for the sum). The plain forward has no scratch
// argument, so its per-row losses go to a fixed __device__ array of kMaxRows
// entries; kernels run on the compute stream only, one after the other, so
// it is never shared by two launches at once.
//
// Vocab-parallel: this rank holds columns [vStart, vStart + Vl). Row maxima
// are all-reduced (max) over the group, then the local sums of exp(x - max)
// together with the target logits (0 on ranks that do not hold the target)
// are all-reduced (sum); `scratch` holds the 3 * rows floats.
//
//===----------------------------------------------------------------------===//

#include "BlockReduce.cuh"
#include "Internal.h"

#include "tessel/Runtime/Comm.h"
#include "tessel/Runtime/Cuda/Device.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace tessel::cuda {

using detail::blocksFor;
using detail::fromFloat;
using detail::toFloat;

using detail::blockReduce;
using detail::Max;
using detail::Sum;

namespace {

constexpr int kRowThreads = 512;
constexpr int kMeanThreads = 1024;
constexpr int64_t kMaxRows = int64_t(1) << 20;

__device__ float gRowLoss[kMaxRows];

// A running max and the sum of exp(x - max) over the elements seen.
struct MaxSum {
  float max, sum;
  __device__ MaxSum shuffleDown(int offset) const {
    return {__shfl_down_sync(0xffffffffu, max, offset),
            __shfl_down_sync(0xffffffffu, sum, offset)};
  }
};

__device__ inline MaxSum combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.max, b.max);
  if (m == -INFINITY) // nothing seen on either side
    return {m, 0.0f};
  return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

// Adds element x to a running pair; one exp per element.
__device__ inline void accumulate(MaxSum &acc, float x) {
  if (x > acc.max) {
    acc.sum = acc.sum * expf(acc.max - x) + 1.0f;
    acc.max = x;
  } else if (x != -INFINITY) {
    acc.sum += expf(x - acc.max);
  }
}

struct Combine {
  __device__ MaxSum operator()(MaxSum a, MaxSum b) const {
    return combine(a, b);
  }
};
// The row's max and sum of exp(x - max), in one pass.
template <typename TL>
__device__ MaxSum rowStatistics(const TL *xr, int64_t V) {
  MaxSum acc = {-INFINITY, 0.0f};
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x)
    accumulate(acc, toFloat(xr[j]));
  return blockReduce(acc, Combine{}, MaxSum{-INFINITY, 0.0f});
}

//===--- Full vocabulary --------------------------------------------------===//

// rowLoss[r] = log(sum) + max - x[target]; a target outside [0, V) gives NaN
// rather than reading out of bounds.
// Only the first n columns of a row (the vocabulary, not its padding) take
// part.
template <typename TL>
__global__ void __launch_bounds__(kRowThreads)
    rowLossKernel(const TL *logits, const int32_t *targets, int64_t rows,
                  int64_t V, int64_t n) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const TL *xr = logits + r * V;
    const MaxSum st = rowStatistics(xr, n);
    if (threadIdx.x == 0) {
      const int64_t t = targets[r];
      const float xt = t >= 0 && t < n ? toFloat(xr[t]) : NAN;
      gRowLoss[r] = logf(st.sum) + st.max - xt;
    }
  }
}

// dlogits = g * exp(x - max) / sum, minus g at the target; g = dloss / rows;
// zero in the padding columns (n and on).
template <typename TL, typename TO>
__global__ void __launch_bounds__(kRowThreads)
    crossEntropyBackwardKernel(const TL *logits, const int32_t *targets,
                               const float *dloss, TO *dlogits, int64_t rows,
                               int64_t V, int64_t n) {
  const float g = dloss[0] / float(rows);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const TL *xr = logits + r * V;
    TO *dr = dlogits + r * V;
    const MaxSum st = rowStatistics(xr, n);
    const float k = g / st.sum;
    const int64_t t = targets[r];
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
      const float e = j < n ? expf(toFloat(xr[j]) - st.max) * k : 0.f;
      dr[j] = fromFloat<TO>(j == t ? e - g : e);
    }
  }
}

//===--- Vocabulary shard -------------------------------------------------===//

// Over the shard's first n columns (those below the vocabulary's size).
template <typename TL>
__global__ void __launch_bounds__(kRowThreads)
    rowMaxKernel(const TL *logits, float *maxima, int64_t rows, int64_t Vl,
                 int64_t n) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const TL *xr = logits + r * Vl;
    float m = -INFINITY;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
      m = fmaxf(m, toFloat(xr[j]));
    m = blockReduce(m, Max{}, -INFINITY);
    if (threadIdx.x == 0)
      maxima[r] = m;
  }
}

// sums[r] = sum of exp(x - maxima[r]) over this shard; with targets,
// sums[rows + r] = the target's logit when this shard holds it, else 0.
template <typename TL>
__global__ void __launch_bounds__(kRowThreads)
    rowSumExpKernel(const TL *logits, const int32_t *targets,
                    const float *maxima, float *sums, int64_t rows, int64_t Vl,
                    int64_t n, int64_t vStart) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const TL *xr = logits + r * Vl;
    const float m = maxima[r];
    float s = 0.0f;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
      s += expf(toFloat(xr[j]) - m);
    s = blockReduce(s, Sum{}, 0.0f);
    if (threadIdx.x == 0) {
      sums[r] = s;
      if (targets) {
        const int64_t t = int64_t(targets[r]) - vStart;
        sums[rows + r] = t >= 0 && t < n ? toFloat(xr[t]) : 0.0f;
      }
    }
  }
}

// dlogits = scale * exp(x - max) / sum, minus scale at the target when this
// shard holds it; scale = dloss / rows.
template <typename TL, typename TO>
__global__ void __launch_bounds__(kRowThreads)
    vocabParallelBackwardKernel(const TL *logits, const int32_t *targets,
                                const float *dloss, const float *maxima,
                                const float *sums, TO *dlogits, int64_t rows,
                                int64_t Vl, int64_t n, int64_t vStart) {
  const float scale = dloss[0] / float(rows);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const TL *xr = logits + r * Vl;
    TO *dr = dlogits + r * Vl;
    const float m = maxima[r];
    const float inv = 1.0f / sums[r];
    const int64_t t = int64_t(targets[r]) - vStart;
    for (int64_t j = threadIdx.x; j < Vl; j += blockDim.x) {
      const float d = j < n ? scale * (expf(toFloat(xr[j]) - m) * inv) : 0.f;
      dr[j] = fromFloat<TO>(j == t ? d - scale : d);
    }
  }
}

//===--- Mean over rows ---------------------------------------------------===//

// Per-row losses from the plain forward.
struct StoredRowLoss {
  __device__ float operator()(int64_t r) const { return gRowLoss[r]; }
};

// Per-row losses from all-reduced shard statistics.
struct VocabParallelRowLoss {
  const float *maxima, *sums;
  int64_t rows;
  __device__ float operator()(int64_t r) const {
    return logf(sums[r]) + maxima[r] - sums[rows + r];
  }
};

// loss[0] = the mean of rowLoss(r) over rows, summed in fp64 by one block:
// thread i takes rows i, i + blockDim, ... in order, then the block tree.
// No rows gives 0, as on the CPU.
template <typename RowLoss>
__global__ void __launch_bounds__(kMeanThreads)
    meanKernel(RowLoss rowLoss, float *loss, int64_t rows) {
  double s = 0.0;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x)
    s += double(rowLoss(r));
  s = blockReduce(s, Sum{}, 0.0);
  if (threadIdx.x == 0)
    loss[0] = rows > 0 ? float(s / double(rows)) : 0.0f;
}

unsigned rowGrid(int64_t rows) {
  return unsigned(rows < (int64_t(1) << 30) ? rows : int64_t(1) << 30);
}

// The shard's row maxima, all-reduced over `axes`, then the shard's sums of
// exponentials (and target logits when `targets` is non-null), all-reduced.
template <typename TL>
void shardStatistics(const TL *logits, const int32_t *targets, int64_t rows,
                     int64_t Vl, int64_t n, int64_t vStart, unsigned axes,
                     float *maxima, float *sums) {
  rowMaxKernel<<<rowGrid(rows), kRowThreads, 0, computeStream()>>>(
      logits, maxima, rows, Vl, n);
  TESSEL_CUDA_CHECK(cudaGetLastError());
  allReduceMax(maxima, rows, axes);
  rowSumExpKernel<<<rowGrid(rows), kRowThreads, 0, computeStream()>>>(
      logits, targets, maxima, sums, rows, Vl, n, vStart);
  TESSEL_CUDA_CHECK(cudaGetLastError());
  allReduceSum<float>(sums, targets ? 2 * rows : rows, axes);
}

void launchMean(float *loss, int64_t rows) {
  meanKernel<<<1, kMeanThreads, 0, computeStream()>>>(StoredRowLoss{}, loss,
                                                      rows);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

} // namespace

int64_t crossEntropyScratchBytes(int64_t rows) {
  // Row maxima, then the sums of exponentials and the target logits, which
  // are all-reduced together.
  const int64_t bytes = 3 * (rows > 0 ? rows : 0) * int64_t(sizeof(float));
  return (bytes + 255) / 256 * 256;
}

namespace {

// The first n of a shard's Vl columns starting at global column vStart are
// below `valid`, the vocabulary's size.
int64_t validColumns(int64_t Vl, int64_t vStart, int64_t valid) {
  const int64_t n = valid - vStart;
  return n < 0 ? 0 : (n > Vl ? Vl : n);
}

} // namespace

template <typename TL>
void crossEntropyForward(const TL *logits, const int32_t *targets, float *loss,
                         int64_t rows, int64_t V, int64_t valid) {
  if (rows > kMaxRows)
    throw std::runtime_error("crossEntropyForward: " + std::to_string(rows) +
                             " rows exceed the per-row loss buffer (" +
                             std::to_string(kMaxRows) + " rows at most)");
  if (rows > 0) {
    rowLossKernel<<<rowGrid(rows), kRowThreads, 0, computeStream()>>>(
        logits, targets, rows, V, validColumns(V, 0, valid));
    TESSEL_CUDA_CHECK(cudaGetLastError());
  }
  launchMean(loss, rows);
}

template <typename TL, typename TO>
void crossEntropyBackward(const TL *logits, const int32_t *targets,
                          const float *dloss, TO *dlogits, int64_t rows,
                          int64_t V, int64_t valid) {
  if (rows <= 0 || V <= 0)
    return;
  crossEntropyBackwardKernel<<<rowGrid(rows), kRowThreads, 0,
                               computeStream()>>>(
      logits, targets, dloss, dlogits, rows, V, validColumns(V, 0, valid));
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

template <typename TL>
void crossEntropyVocabParallelForward(const TL *logits, const int32_t *targets,
                                      float *loss, float *stats, int64_t rows,
                                      int64_t Vl, int64_t vStart, unsigned axes,
                                      int64_t valid, void *scratch) {
  if (rows <= 0) {
    launchMean(loss, 0);
    return;
  }
  float *maxima = static_cast<float *>(scratch);
  float *sums = maxima + rows;
  shardStatistics(logits, targets, rows, Vl, validColumns(Vl, vStart, valid),
                  vStart, axes, maxima, sums);
  meanKernel<<<1, kMeanThreads, 0, computeStream()>>>(
      VocabParallelRowLoss{maxima, sums, rows}, loss, rows);
  TESSEL_CUDA_CHECK(cudaGetLastError());
  // The maxima and the sums of exponentials (the target logits after them
  // are the loss's alone).
  if (stats)
    TESSEL_CUDA_CHECK(
        cudaMemcpyAsync(stats, maxima, 2 * size_t(rows) * sizeof(float),
                        cudaMemcpyDeviceToDevice, computeStream()));
}

template <typename TL, typename TO>
void crossEntropyVocabParallelBackward(const TL *logits, const int32_t *targets,
                                       const float *dloss, TO *dlogits,
                                       const float *stats, int64_t rows,
                                       int64_t Vl, int64_t vStart,
                                       unsigned axes, int64_t valid,
                                       void *scratch) {
  if (rows <= 0)
    return;
  const int64_t n = validColumns(Vl, vStart, valid);
  const float *maxima = stats, *sums = stats ? stats + rows : nullptr;
  if (!stats) {
    float *m = static_cast<float *>(scratch);
    shardStatistics<TL>(logits, nullptr, rows, Vl, n, vStart, axes, m,
                        m + rows);
    maxima = m;
    sums = m + rows;
  }
  if (Vl <= 0)
    return;
  vocabParallelBackwardKernel<<<rowGrid(rows), kRowThreads, 0,
                                computeStream()>>>(
      logits, targets, dloss, maxima, sums, dlogits, rows, Vl, n, vStart);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

//===--- Instantiations ---------------------------------------------------===//

#define TESSEL_INSTANTIATE2(A, B)                                              \
  template void crossEntropyBackward<A, B>(const A *, const int32_t *,         \
                                           const float *, B *, int64_t,        \
                                           int64_t, int64_t);                  \
  template void crossEntropyVocabParallelBackward<A, B>(                       \
      const A *, const int32_t *, const float *, B *, const float *, int64_t,  \
      int64_t, int64_t, unsigned, int64_t, void *);
TESSEL_CUDA_TYPES2(TESSEL_INSTANTIATE2)
#undef TESSEL_INSTANTIATE2

#define TESSEL_INSTANTIATE1(A)                                                 \
  template void crossEntropyForward<A>(const A *, const int32_t *, float *,    \
                                       int64_t, int64_t, int64_t);             \
  template void crossEntropyVocabParallelForward<A>(                           \
      const A *, const int32_t *, float *, float *, int64_t, int64_t, int64_t, \
      unsigned, int64_t, void *);
TESSEL_CUDA_TYPES1(TESSEL_INSTANTIATE1)
#undef TESSEL_INSTANTIATE1

} // namespace tessel::cuda
