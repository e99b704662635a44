//===- Moe.cu - Mixture-of-experts routing, dispatch and grouped GEMM -----===//
//
// The CUDA counterparts of lib/Runtime/Kernels/Moe.cpp, with the same
// results (the CPU kernels are the reference): the top-k of the router's
// probabilities, the dispatch plan, the gather and weighted scatter of
// rows, the experts' GEMMs over their row ranges and the load-balancing
// and z losses. Nothing here reads a device value on the host: the row
// ranges of the experts stay on the device and the kernels find them there.
//
// Routing. One thread per token, as the CPU loop: repeated arg-max with a
// strict comparison (the lower expert on a tie), weights renormalised in
// fp32 from the chosen probabilities.
//
// Dispatch. The CPU's counting sort, made parallel without changing its
// order. The assignments are cut into chunks of kChunk that never straddle
// a run (a run is a row of the batch whose capacity count restarts); a
// warp walks one chunk 32 assignments at a time and ranks each assignment
// among the earlier ones of its expert in the chunk (__match_any_sync), so
// a first pass gives every chunk its count per expert. One block then
// walks the chunks in order per expert: the assignments taken before a
// chunk (those of the earlier chunks of its run, plus `before`) decide how
// many of the chunk's are kept under the capacity (always a prefix of them,
// since the count only grows), and where the chunk's kept rows start. The
// second pass over the chunks writes rowOf from the same ranks. Results
// equal the CPU's exactly; integer counts make them independent of timing.
// With a group (moeDispatchGroup) the counts per expert (per row with
// sequence parallelism) are all-gathered with NCCL as floats, as the CPU
// runtime does, and the count of earlier tokens is computed on the device.
// An expert index out of range (the CPU throws) is dropped and not counted.
//
// Grouped GEMM. out[rows of segment s] = x[rows of s] * W[s % E]. The row
// ranges are device offsets, so the grid is persistent (a few blocks per
// multiprocessor): each block walks the segments in order, counts their
// 64 x 64 output tiles and takes every gridDim.x-th one. The weight
// gradient's grid is known on the host ((K / 64) x (N / 64) tiles per
// expert); each block sums its tile over the rows of every segment of its
// expert in order, so it is deterministic and writes zeros for an expert
// without rows. Both are fp32 shared-memory tiles on CUDA cores (any mix
// of fp32 and bf16 operands, fp32 accumulation): correct for every shape,
// several times slower than cuBLASLt's tensor-core GEMMs on large experts.
//
// Losses. One block sums the z loss over the tokens in fp64 (the CPU's
// precision) with a fixed reduction order; the aux loss is a sum over the
// experts on one thread.
//
//===----------------------------------------------------------------------===//

#include "BlockReduce.cuh"
#include "Internal.h"

#include "tessel/Runtime/Comm.h"
#include "tessel/Runtime/Cuda/Device.h"

#include <cmath>
#include <mma.h>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace tessel::cuda {

using detail::blockReduce;
using detail::blocksFor;
using detail::fromFloat;
using detail::Sum;
using detail::toFloat;

namespace {

constexpr int kThreads = 256;
// Assignments per dispatch chunk (one warp's), and warps per block.
constexpr int64_t kChunk = 256;
constexpr int kChunkWarps = 4;
// Grouped GEMM tiles: 64 x 64 outputs, 16 deep, 256 threads of 4 x 4.
constexpr int kTile = 64;
constexpr int kDepth = 16;
constexpr int kGemmThreads = 256;

__device__ inline int64_t gridStart() {
  return int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ inline int64_t gridStride() {
  return int64_t(blockDim.x) * gridDim.x;
}

void checkShape(int64_t tokens, int64_t E, int64_t k, const char *what) {
  if (tokens < 0 || E <= 0 || k <= 0 || k > E)
    throw std::invalid_argument(
        std::string(what) + ": " + std::to_string(tokens) + " tokens, " +
        std::to_string(E) + " experts, top " + std::to_string(k) +
        " (needs 1 <= top_k <= experts)");
}

void launched(const char *kernel) {
  checkCuda(cudaGetLastError(), kernel, __FILE__, __LINE__);
}

//===--- Routing ----------------------------------------------------------===//

template <typename TP, typename TW>
__global__ void topKKernel(const TP *probs, int32_t *experts, TW *weights,
                           int64_t tokens, int64_t E, int64_t k) {
  for (int64_t t = gridStart(); t < tokens; t += gridStride()) {
    const TP *p = probs + t * E;
    int32_t *chosen = experts + t * k;
    float sum = 0.0f;
    for (int64_t s = 0; s < k; ++s) {
      int64_t best = -1;
      float bestP = 0.0f;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t q = 0; q < s; ++q)
          taken |= chosen[q] == e;
        const float pe = toFloat(p[e]);
        if (!taken && (best < 0 || pe > bestP)) {
          best = e;
          bestP = pe;
        }
      }
      chosen[s] = (int32_t)best;
      sum += bestP;
    }
    // From the probabilities, not from stored weights: a bf16 weight is
    // rounded once.
    for (int64_t s = 0; s < k; ++s)
      weights[t * k + s] = fromFloat<TW>(toFloat(p[chosen[s]]) / sum);
  }
}

template <typename TP, typename TG, typename TO>
__global__ void topKBackwardKernel(const TP *probs, const int32_t *experts,
                                   const TG *dweights, TO *dprobs,
                                   int64_t tokens, int64_t E, int64_t k,
                                   bool accumulate) {
  for (int64_t t = gridStart(); t < tokens; t += gridStride()) {
    const TP *p = probs + t * E;
    const int32_t *chosen = experts + t * k;
    const TG *dw = dweights + t * k;
    TO *dp = dprobs + t * E;
    if (!accumulate)
      for (int64_t e = 0; e < E; ++e)
        dp[e] = fromFloat<TO>(0.0f);
    float sum = 0.0f;
    for (int64_t s = 0; s < k; ++s)
      sum += toFloat(p[chosen[s]]);
    float weighted = 0.0f;
    for (int64_t s = 0; s < k; ++s)
      weighted += toFloat(dw[s]) * (toFloat(p[chosen[s]]) / sum);
    for (int64_t s = 0; s < k; ++s)
      dp[chosen[s]] = fromFloat<TO>(toFloat(dp[chosen[s]]) +
                                    (toFloat(dw[s]) - weighted) / sum);
  }
}

//===--- Dispatch ---------------------------------------------------------===//

// Where the dispatch keeps its per-chunk counts, in the caller's scratch.
struct DispatchScratch {
  int32_t *kept;       // [chunks, E]: assignments, then those kept
  int32_t *keptBefore; // [chunks, E]: kept rows of the expert before it
  float *mine;         // [runs, E]: this rank's assignments (group only)
  float *all;          // [g, runs, E]: every group rank's
  int64_t *before;     // [runs, E]: taken by earlier tokens of the group
};

int64_t align256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

DispatchScratch carve(void *scratch, int64_t chunks, int64_t runs, int64_t E,
                      int64_t g) {
  char *at = static_cast<char *>(scratch);
  auto take = [&](int64_t bytes) {
    char *p = at;
    at += align256(bytes);
    return p;
  };
  DispatchScratch s;
  s.kept = reinterpret_cast<int32_t *>(take(chunks * E * 4));
  s.keptBefore = reinterpret_cast<int32_t *>(take(chunks * E * 4));
  s.mine = reinterpret_cast<float *>(take(runs * E * 4));
  s.all = reinterpret_cast<float *>(take(g * runs * E * 4));
  s.before = reinterpret_cast<int64_t *>(take(runs * E * 8));
  return s;
}

int64_t chunksPerRun(int64_t perRun) { return (perRun + kChunk - 1) / kChunk; }

// The first pass (kWriteRows false): counts[c, e], the assignments of
// expert e in chunk c. The second: rowOf from the chunk's kept counts and
// where its kept rows start. A warp owns a chunk and ranks each of its
// assignments among the earlier ones of the same expert (`seen`, in
// shared memory, then the lanes before it with the same expert).
template <bool kWriteRows>
__global__ void dispatchChunksKernel(const int32_t *experts, int64_t E,
                                     int64_t perRun, int64_t perChunkRun,
                                     int64_t chunks, int32_t *counts,
                                     const int32_t *keptBefore,
                                     const int32_t *offsets, int32_t *rowOf) {
  extern __shared__ int32_t shared[];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;
  int32_t *seen = shared + warp * E;
  for (int64_t c = int64_t(blockIdx.x) * warps + warp; c < chunks;
       c += int64_t(gridDim.x) * warps) {
    for (int64_t e = lane; e < E; e += 32)
      seen[e] = 0;
    __syncwarp();
    const int64_t run = c / perChunkRun, j = c % perChunkRun;
    const int64_t begin = run * perRun + j * kChunk;
    const int64_t runEnd = (run + 1) * perRun;
    const int64_t end = begin + kChunk < runEnd ? begin + kChunk : runEnd;
    for (int64_t base = begin; base < end; base += 32) {
      const int64_t a = base + lane;
      const int32_t e = a < end ? experts[a] : -1;
      const bool valid = a < end && e >= 0 && e < E;
      const unsigned same = __match_any_sync(0xffffffffu, valid ? e : -1);
      const int rank = __popc(same & ((1u << lane) - 1u));
      const int32_t earlier = valid ? seen[e] + rank : 0;
      __syncwarp();
      if (valid && rank == 0)
        seen[e] += __popc(same);
      __syncwarp();
      if (kWriteRows && a < end) {
        // The kept assignments of a chunk are the first of its expert's.
        const bool kept = valid && earlier < counts[c * E + e];
        rowOf[a] = kept ? offsets[e] + keptBefore[c * E + e] + earlier : -1;
      }
    }
    if (!kWriteRows)
      for (int64_t e = lane; e < E; e += 32)
        counts[c * E + e] = seen[e];
    __syncwarp();
  }
}

// One block, a thread per expert walking the chunks in order: the
// assignments taken before each chunk in its run (`before` first) decide
// how many of the chunk's are kept; counts[c, e] becomes that number and
// keptBefore[c, e] the expert's kept rows before the chunk. offsets is
// their exclusive sum over the experts.
__global__ void dispatchScanKernel(int32_t *counts, int32_t *keptBefore,
                                   const int64_t *before, int64_t capacity,
                                   int64_t E, int64_t runs, int64_t perChunkRun,
                                   int32_t *offsets) {
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    int64_t keptSoFar = 0;
    for (int64_t r = 0; r < runs; ++r) {
      int64_t taken = before ? before[r * E + e] : 0;
      for (int64_t j = 0; j < perChunkRun; ++j) {
        const int64_t c = r * perChunkRun + j;
        const int64_t here = counts[c * E + e];
        int64_t kept = here;
        if (capacity > 0)
          kept = capacity - taken < 0      ? 0
                 : capacity - taken < here ? capacity - taken
                                           : here;
        counts[c * E + e] = (int32_t)kept;
        keptBefore[c * E + e] = (int32_t)keptSoFar;
        keptSoFar += kept;
        taken += here;
      }
    }
    offsets[e + 1] = (int32_t)keptSoFar;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    offsets[0] = 0;
    for (int64_t e = 0; e < E; ++e)
      offsets[e + 1] += offsets[e];
  }
}

// mine[r, e]: run r's assignments of expert e (the chunk counts summed), as
// floats for the all-gather.
__global__ void runCountsKernel(const int32_t *counts, int64_t E, int64_t runs,
                                int64_t perChunkRun, float *mine) {
  for (int64_t i = gridStart(); i < runs * E; i += gridStride()) {
    const int64_t r = i / E, e = i % E;
    int64_t sum = 0;
    for (int64_t j = 0; j < perChunkRun; ++j)
      sum += counts[(r * perChunkRun + j) * E + e];
    mine[i] = (float)sum;
  }
}

// The assignments earlier group ranks took (moeDispatchGroup on the CPU).
// Without pieces (no tp): group rank j holds consecutive tokens, and
// before[e] counts ranks 0 .. me - 1. With the rows split into `pieces`
// over tp: rank j holds piece j % pieces of block j / pieces's rows, and a
// row's piece here comes after every earlier block, every earlier row of
// its block and the row's pieces on the ranks before it.
__global__ void groupBeforeKernel(const float *all, int64_t E, int64_t runs,
                                  int64_t me, int64_t pieces, int64_t *before) {
  auto count = [&](int64_t j, int64_t r, int64_t e) {
    return (int64_t)all[(j * runs + r) * E + e];
  };
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    const int64_t myBlock = me / pieces, myPiece = me % pieces;
    int64_t total = 0;
    for (int64_t j = 0; j < myBlock * pieces; ++j)
      for (int64_t r = 0; r < runs; ++r)
        total += count(j, r, e);
    for (int64_t r = 0; r < runs; ++r) {
      int64_t b = total;
      for (int64_t p = 0; p < myPiece; ++p)
        b += count(myBlock * pieces + p, r, e);
      before[r * E + e] = b;
      for (int64_t p = 0; p < pieces; ++p)
        total += count(myBlock * pieces + p, r, e);
    }
  }
}

// The group a dispatch counts its capacity over, and this rank's place.
struct GroupOf {
  unsigned axes = 0;
  int64_t size = 1, rank = 0, pieces = 1;
};

// Warps per block of dispatchChunksKernel: each keeps E counts in shared
// memory, within the 48 KiB a launch gets without opting in to more.
int chunkWarps(int64_t E) {
  constexpr int64_t kSharedBytes = 48 * 1024;
  if (E * 4 > kSharedBytes)
    throw std::invalid_argument("moeDispatchPlan: " + std::to_string(E) +
                                " experts (at most " +
                                std::to_string(kSharedBytes / 4) + ")");
  return (int)std::min<int64_t>(kChunkWarps, kSharedBytes / (E * 4));
}

// The plan over `runs` runs of consecutive tokens; `before` ([runs, E],
// device, nullable) as dispatchRuns on the CPU. With `group`, this rank's
// counts are all-gathered over it first and `before` comes from them.
void dispatchRuns(const int32_t *experts, int64_t tokens, int64_t runs,
                  int64_t k, int64_t E, int64_t capacity, const int64_t *before,
                  const GroupOf *group, int32_t *rowOf, int32_t *offsets,
                  void *scratch) {
  checkShape(tokens, E, k, "moeDispatchPlan");
  if (runs < 1 || tokens % runs != 0)
    throw std::invalid_argument("moeDispatchPlan: " + std::to_string(tokens) +
                                " tokens are not " + std::to_string(runs) +
                                " rows");
  if (!scratch)
    throw std::invalid_argument("moeDispatchPlan: no scratch");
  const int64_t perRun = tokens / runs * k, perChunkRun = chunksPerRun(perRun);
  const int64_t chunks = runs * perChunkRun;
  DispatchScratch s = carve(scratch, chunks, runs, E, group ? group->size : 1);
  cudaStream_t stream = computeStream();
  const int warps = chunkWarps(E);
  const size_t shared = (size_t)warps * E * sizeof(int32_t);
  const unsigned chunkBlocks = (unsigned)std::min<int64_t>(
      std::max<int64_t>(1, (chunks + warps - 1) / warps), int64_t(65535) * 8);
  if (chunks > 0) {
    dispatchChunksKernel<false><<<chunkBlocks, warps * 32, shared, stream>>>(
        experts, E, perRun, perChunkRun, chunks, s.kept, nullptr, nullptr,
        nullptr);
    launched("dispatchChunksKernel (counts)");
  }
  if (group) {
    runCountsKernel<<<blocksFor(runs * E), kThreads, 0, stream>>>(
        s.kept, E, runs, perChunkRun, s.mine);
    launched("runCountsKernel");
    allGatherAlong(s.mine, s.all, 1, runs * E, 1, group->axes);
    groupBeforeKernel<<<1, kThreads, 0, stream>>>(s.all, E, runs, group->rank,
                                                  group->pieces, s.before);
    launched("groupBeforeKernel");
    before = s.before;
  }
  dispatchScanKernel<<<1, kThreads, 0, stream>>>(
      s.kept, s.keptBefore, before, capacity, E, runs, perChunkRun, offsets);
  launched("dispatchScanKernel");
  if (chunks > 0) {
    dispatchChunksKernel<true><<<chunkBlocks, warps * 32, shared, stream>>>(
        experts, E, perRun, perChunkRun, chunks, s.kept, s.keptBefore, offsets,
        rowOf);
    launched("dispatchChunksKernel (rows)");
  }
}

//===--- Permutation ------------------------------------------------------===//

template <typename TI, typename TO>
__global__ void permuteKernel(const TI *x, const int32_t *rowOf, TO *xp,
                              int64_t tokens, int64_t k, int64_t H) {
  for (int64_t i = gridStart(); i < tokens * k * H; i += gridStride()) {
    const int64_t a = i / H, j = i % H;
    const int32_t row = rowOf[a];
    if (row >= 0)
      xp[row * H + j] = fromFloat<TO>(toFloat(x[(a / k) * H + j]));
  }
}

// y[t] = sum over t's kept slots in ascending order of w * yp[row] (w = 1
// without weights: the gradient of moePermute).
template <typename TY, typename TW, typename TO>
__global__ void unpermuteKernel(const TY *yp, const int32_t *rowOf,
                                const TW *weights, TO *y, int64_t tokens,
                                int64_t k, int64_t H) {
  for (int64_t i = gridStart(); i < tokens * H; i += gridStride()) {
    const int64_t t = i / H, j = i % H;
    float acc = 0.0f;
    for (int64_t s = 0; s < k; ++s) {
      const int32_t row = rowOf[t * k + s];
      if (row < 0)
        continue;
      const float w = weights ? toFloat(weights[t * k + s]) : 1.0f;
      acc += w * toFloat(yp[row * H + j]);
    }
    y[i] = fromFloat<TO>(acc);
  }
}

// A block per assignment: dyp[row] = w * dy[t], and dweights[a] = dy[t] .
// yp[row] reduced over the block in a fixed order.
template <typename TY, typename TW, typename TG, typename TO, typename TD>
__global__ void unpermuteBackwardKernel(const TY *yp, const int32_t *rowOf,
                                        const TW *weights, const TG *dy,
                                        TO *dyp, TD *dweights, int64_t tokens,
                                        int64_t k, int64_t H) {
  for (int64_t a = blockIdx.x; a < tokens * k; a += gridDim.x) {
    const int32_t row = rowOf[a];
    if (row < 0) {
      if (threadIdx.x == 0)
        dweights[a] = fromFloat<TD>(0.0f);
      continue;
    }
    const TG *g = dy + (a / k) * H;
    const TY *in = yp + row * H;
    TO *d = dyp + row * H;
    const float w = toFloat(weights[a]);
    float dot = 0.0f;
    for (int64_t j = threadIdx.x; j < H; j += blockDim.x) {
      const float gj = toFloat(g[j]);
      dot += gj * toFloat(in[j]);
      d[j] = fromFloat<TO>(w * gj);
    }
    dot = blockReduce(dot, Sum{}, 0.0f);
    if (threadIdx.x == 0)
      dweights[a] = fromFloat<TD>(dot);
  }
}

//===--- Grouped GEMM -----------------------------------------------------===//

// One 64 x 64 tile of out = x[rows] * W[e] (W [K, N], or [N, K] with
// transW) for rows [r0, r0 + count) and columns from n0.
template <typename TX, typename TW, typename TO>
__device__ void gemmTile(const TX *x, const TW *We, TO *out, int64_t r0,
                         int64_t count, int64_t n0, int64_t K, int64_t N,
                         bool transW, bool accumulate) {
  // A padded row: the loads write a column of As (and of Bs with transW).
  __shared__ float As[kDepth][kTile + 1];
  __shared__ float Bs[kDepth][kTile + 1];
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < K; k0 += kDepth) {
    for (int l = tid; l < kTile * kDepth; l += kGemmThreads) {
      const int m = l / kDepth, kk = l % kDepth;
      As[kk][m] =
          m < count && k0 + kk < K ? toFloat(x[(r0 + m) * K + k0 + kk]) : 0.0f;
      if (transW) {
        const int n = l / kDepth;
        Bs[kk][n] = n0 + n < N && k0 + kk < K
                        ? toFloat(We[(n0 + n) * K + k0 + kk])
                        : 0.0f;
      } else {
        const int kb = l / kTile, n = l % kTile;
        Bs[kb][n] = n0 + n < N && k0 + kb < K
                        ? toFloat(We[(k0 + kb) * N + n0 + n])
                        : 0.0f;
      }
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kDepth; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        a[i] = As[kk][ty * 4 + i];
        b[i] = Bs[kk][tx * 4 + i];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
          acc[i][j] += a[i] * b[j];
    }
    __syncthreads();
  }
  for (int i = 0; i < 4; ++i) {
    const int64_t m = ty * 4 + i;
    if (m >= count)
      continue;
    for (int j = 0; j < 4; ++j) {
      const int64_t n = n0 + tx * 4 + j;
      if (n >= N)
        continue;
      TO *o = out + (r0 + m) * N + n;
      *o = fromFloat<TO>(acc[i][j] + (accumulate ? toFloat(*o) : 0.0f));
    }
  }
}

// Tensor cores (sm_80 and later) for bf16 operands: WMMA 16 x 16 x 16
// products with fp32 accumulators over the same 64 x 64 tile, each of the 8
// warps owning a 16 x 32 piece, the depth in steps of kBf16Depth. Operands
// are staged in shared memory as bf16 (rows padded by 8 elements, which
// keeps every fragment 32-byte aligned), the accumulators go through
// shared memory to the masked, optionally accumulating store.
constexpr int kBf16Depth = 32;
constexpr int kBf16Pad = 8;

// The 64 x 64 fp32 tile from the warps' accumulators, stored to out
// [rows from r0 (count of them), columns from n0, ld N] (plus what it holds
// with `accumulate`).
template <typename TO, typename Frag>
__device__ void storeTile(Frag (&acc)[2], TO *out, int64_t r0, int64_t count,
                          int64_t n0, int64_t N, int64_t ldOut,
                          bool accumulate) {
  __shared__ __align__(32) float Cs[kTile][kTile + 4];
  const int warp = threadIdx.x / 32, wr = warp % 4, wc = warp / 4;
#pragma unroll
  for (int j = 0; j < 2; ++j)
    nvcuda::wmma::store_matrix_sync(&Cs[wr * 16][wc * 32 + j * 16], acc[j],
                                    kTile + 4, nvcuda::wmma::mem_row_major);
  __syncthreads();
  for (int l = threadIdx.x; l < kTile * kTile; l += kGemmThreads) {
    const int m = l / kTile, n = l % kTile;
    if (m >= count || n0 + n >= N)
      continue;
    TO *o = out + (r0 + m) * ldOut + n0 + n;
    *o = fromFloat<TO>(Cs[m][n] + (accumulate ? toFloat(*o) : 0.0f));
  }
  __syncthreads();
}

template <typename TO>
__device__ void gemmTileBf16(const bf16 *x, const bf16 *We, TO *out,
                             int64_t r0, int64_t count, int64_t n0, int64_t K,
                             int64_t N, bool transW, bool accumulate) {
  using namespace nvcuda;
  __shared__ __align__(32) bf16 As[kTile][kBf16Depth + kBf16Pad]; // [m][k]
  __shared__ __align__(32) bf16 Bs[kBf16Depth][kTile + kBf16Pad]; // [k][n]
  const int tid = threadIdx.x, warp = tid / 32, wr = warp % 4, wc = warp / 4;
  const bf16 zero = __float2bfloat16(0.0f);
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2];
  wmma::fill_fragment(acc[0], 0.0f);
  wmma::fill_fragment(acc[1], 0.0f);
  for (int64_t k0 = 0; k0 < K; k0 += kBf16Depth) {
    for (int l = tid; l < kTile * kBf16Depth; l += kGemmThreads) {
      const int m = l / kBf16Depth, kk = l % kBf16Depth;
      As[m][kk] = m < count && k0 + kk < K ? x[(r0 + m) * K + k0 + kk] : zero;
      if (transW) {
        const int n = l / kBf16Depth;
        Bs[kk][n] = n0 + n < N && k0 + kk < K ? We[(n0 + n) * K + k0 + kk]
                                              : zero;
      } else {
        const int kb = l / kTile, n = l % kTile;
        Bs[kb][n] = n0 + n < N && k0 + kb < K ? We[(k0 + kb) * N + n0 + n]
                                              : zero;
      }
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kBf16Depth; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a;
      wmma::load_matrix_sync(a, &As[wr * 16][kk], kBf16Depth + kBf16Pad);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> b;
        wmma::load_matrix_sync(b, &Bs[kk][wc * 32 + j * 16],
                               kTile + kBf16Pad);
        wmma::mma_sync(acc[j], a, b, acc[j]);
      }
    }
    __syncthreads();
  }
  storeTile(acc, out, r0, count, n0, N, N, accumulate);
}

// bf16 x bf16 on tensor cores where the device has them; other types (and
// a build for an older architecture) on CUDA cores.
template <typename TA, typename TB> constexpr bool onTensorCores() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  return std::is_same_v<TA, bf16> && std::is_same_v<TB, bf16>;
#else
  return false;
#endif
}

template <typename TX, typename TW, typename TO>
__device__ void anyGemmTile(const TX *x, const TW *We, TO *out, int64_t r0,
                            int64_t count, int64_t n0, int64_t K, int64_t N,
                            bool transW, bool accumulate) {
  if constexpr (onTensorCores<TX, TW>())
    gemmTileBf16(x, We, out, r0, count, n0, K, N, transW, accumulate);
  else
    gemmTile(x, We, out, r0, count, n0, K, N, transW, accumulate);
}

// Persistent: every block walks the segments in order, numbering their
// tiles, and computes tiles blockIdx.x, blockIdx.x + gridDim.x, ...
template <typename TX, typename TW, typename TO>
__global__ void groupedMatmulKernel(const TX *x, const TW *W, TO *out,
                                    const int32_t *offsets, int64_t segments,
                                    int64_t E, int64_t K, int64_t N,
                                    bool transW, bool accumulate) {
  const int64_t tilesN = (N + kTile - 1) / kTile;
  int64_t numbered = 0;
  for (int64_t s = 0; s < segments; ++s) {
    const int64_t r0 = offsets[s], rows = offsets[s + 1] - r0;
    if (rows <= 0)
      continue;
    const int64_t tiles = (rows + kTile - 1) / kTile * tilesN;
    const int64_t first =
        ((int64_t)blockIdx.x - numbered % gridDim.x + gridDim.x) % gridDim.x;
    const TW *We = W + (s % E) * K * N;
    for (int64_t i = first; i < tiles; i += gridDim.x) {
      const int64_t tm = i / tilesN, tn = i % tilesN;
      const int64_t left = rows - tm * kTile;
      anyGemmTile(x, We, out, r0 + tm * kTile, left < kTile ? left : kTile,
                  tn * kTile, K, N, transW, accumulate);
    }
    numbered += tiles;
  }
}

// dW[e] [P, Q] = sum over the rows r of e's segments of a[r]^T b[r] (a
// [*, P], b [*, Q]): W [K, N] takes a = x, b = dout; W stored [N, K] takes
// a = dout, b = x. A block per 64 x 64 tile of one expert, the rows in
// order, segment by segment.
template <typename TA, typename TB, typename TO>
__device__ void weightGradTile(const TA *a, const TB *b, TO *dW,
                               const int32_t *offsets, int64_t segments,
                               int64_t E, int64_t P, int64_t Q,
                               bool accumulate) {
  __shared__ float As[kDepth][kTile];
  __shared__ float Bs[kDepth][kTile];
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  const int64_t q0 = int64_t(blockIdx.x) * kTile,
                p0 = int64_t(blockIdx.y) * kTile;
  const int64_t e = blockIdx.z;
  float acc[4][4] = {};
  for (int64_t s = e; s < segments; s += E) {
    const int64_t end = offsets[s + 1];
    for (int64_t r0 = offsets[s]; r0 < end; r0 += kDepth) {
      for (int l = tid; l < kTile * kDepth; l += kGemmThreads) {
        const int rr = l / kTile, c = l % kTile;
        const bool row = r0 + rr < end;
        As[rr][c] =
            row && p0 + c < P ? toFloat(a[(r0 + rr) * P + p0 + c]) : 0.0f;
        Bs[rr][c] =
            row && q0 + c < Q ? toFloat(b[(r0 + rr) * Q + q0 + c]) : 0.0f;
      }
      __syncthreads();
#pragma unroll
      for (int rr = 0; rr < kDepth; ++rr)
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j)
            acc[i][j] += As[rr][ty * 4 + i] * Bs[rr][tx * 4 + j];
      __syncthreads();
    }
  }
  TO *d = dW + e * P * Q;
  for (int i = 0; i < 4; ++i) {
    const int64_t p = p0 + ty * 4 + i;
    if (p >= P)
      continue;
    for (int j = 0; j < 4; ++j) {
      const int64_t q = q0 + tx * 4 + j;
      if (q >= Q)
        continue;
      TO *o = d + p * Q + q;
      *o = fromFloat<TO>(acc[i][j] + (accumulate ? toFloat(*o) : 0.0f));
    }
  }
}

// The same on tensor cores: a^T as WMMA's column-major A straight from the
// rows staged in shared memory, the rows in steps of kBf16Depth (padded
// with zeros past a segment's end), in the same order.
template <typename TO>
__device__ void weightGradTileBf16(const bf16 *a, const bf16 *b, TO *dW,
                                   const int32_t *offsets, int64_t segments,
                                   int64_t E, int64_t P, int64_t Q,
                                   bool accumulate) {
  using namespace nvcuda;
  __shared__ __align__(32) bf16 As[kBf16Depth][kTile + kBf16Pad]; // [r][p]
  __shared__ __align__(32) bf16 Bs[kBf16Depth][kTile + kBf16Pad]; // [r][q]
  const int tid = threadIdx.x, warp = tid / 32, wr = warp % 4, wc = warp / 4;
  const int64_t q0 = int64_t(blockIdx.x) * kTile,
                p0 = int64_t(blockIdx.y) * kTile;
  const int64_t e = blockIdx.z;
  const bf16 zero = __float2bfloat16(0.0f);
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2];
  wmma::fill_fragment(acc[0], 0.0f);
  wmma::fill_fragment(acc[1], 0.0f);
  for (int64_t s = e; s < segments; s += E) {
    const int64_t end = offsets[s + 1];
    for (int64_t r0 = offsets[s]; r0 < end; r0 += kBf16Depth) {
      for (int l = tid; l < kTile * kBf16Depth; l += kGemmThreads) {
        const int rr = l / kTile, c = l % kTile;
        const bool row = r0 + rr < end;
        As[rr][c] = row && p0 + c < P ? a[(r0 + rr) * P + p0 + c] : zero;
        Bs[rr][c] = row && q0 + c < Q ? b[(r0 + rr) * Q + q0 + c] : zero;
      }
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kBf16Depth; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::col_major> fa;
        wmma::load_matrix_sync(fa, &As[kk][wr * 16], kTile + kBf16Pad);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> fb;
          wmma::load_matrix_sync(fb, &Bs[kk][wc * 32 + j * 16],
                                 kTile + kBf16Pad);
          wmma::mma_sync(acc[j], fa, fb, acc[j]);
        }
      }
      __syncthreads();
    }
  }
  const int64_t left = P - p0;
  storeTile(acc, dW + e * P * Q, p0, left < kTile ? left : kTile, q0, Q, Q,
            accumulate);
}

template <typename TA, typename TB, typename TO>
__global__ void groupedWeightGradKernel(const TA *a, const TB *b, TO *dW,
                                        const int32_t *offsets,
                                        int64_t segments, int64_t E, int64_t P,
                                        int64_t Q, bool accumulate) {
  if constexpr (onTensorCores<TA, TB>())
    weightGradTileBf16(a, b, dW, offsets, segments, E, P, Q, accumulate);
  else
    weightGradTile(a, b, dW, offsets, segments, E, P, Q, accumulate);
}

// Blocks for the persistent grouped GEMM: enough to fill the device.
unsigned persistentBlocks() {
  static int multiprocessors = [] {
    int device = 0, count = 0;
    checkCuda(cudaGetDevice(&device), "cudaGetDevice", __FILE__, __LINE__);
    checkCuda(
        cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device),
        "cudaDeviceGetAttribute", __FILE__, __LINE__);
    return count;
  }();
  return (unsigned)std::max(1, multiprocessors * 4);
}

template <typename TX, typename TW, typename TO>
void groupedMatmulOver(const TX *x, const TW *W, TO *out,
                       const int32_t *offsets, int64_t segments, int64_t E,
                       int64_t K, int64_t N, bool transW, bool accumulate) {
  if (segments <= 0 || E <= 0 || K < 0 || N <= 0)
    return;
  groupedMatmulKernel<<<persistentBlocks(), kGemmThreads, 0, computeStream()>>>(
      x, W, out, offsets, segments, E, K, N, transW, accumulate);
  launched("groupedMatmulKernel");
}

template <typename TX, typename TG, typename TO>
void groupedWeightGradOver(const TX *x, const TG *dout, TO *dW,
                           const int32_t *offsets, int64_t segments, int64_t E,
                           int64_t K, int64_t N, bool transW, bool accumulate) {
  if (E <= 0 || K <= 0 || N <= 0)
    return;
  const int64_t P = transW ? N : K, Q = transW ? K : N;
  if (E > 65535)
    throw std::invalid_argument("groupedMatmulWeightGrad: " +
                                std::to_string(E) + " experts (at most 65535)");
  dim3 grid((unsigned)((Q + kTile - 1) / kTile),
            (unsigned)((P + kTile - 1) / kTile), (unsigned)E);
  if (transW)
    groupedWeightGradKernel<<<grid, kGemmThreads, 0, computeStream()>>>(
        dout, x, dW, offsets, segments, E, P, Q, accumulate);
  else
    groupedWeightGradKernel<<<grid, kGemmThreads, 0, computeStream()>>>(
        x, dout, dW, offsets, segments, E, P, Q, accumulate);
  launched("groupedWeightGradKernel");
}

//===--- Load statistics and losses ---------------------------------------===//

// A block per expert: its assignments (exact in fp64) and its
// probabilities summed over the tokens; set, or added to with `add`.
template <typename TP, typename TO>
__global__ void loadStatsKernel(const TP *probs, const int32_t *experts,
                                TO *counts, TO *probSums, int64_t tokens,
                                int64_t E, int64_t k, bool add) {
  for (int64_t e = blockIdx.x; e < E; e += gridDim.x) {
    double count = 0.0;
    for (int64_t a = threadIdx.x; a < tokens * k; a += blockDim.x)
      count += experts[a] == e ? 1.0 : 0.0;
    float sum = 0.0f;
    for (int64_t t = threadIdx.x; t < tokens; t += blockDim.x)
      sum += toFloat(probs[t * E + e]);
    count = blockReduce(count, Sum{}, 0.0);
    sum = blockReduce(sum, Sum{}, 0.0f);
    if (threadIdx.x == 0) {
      counts[e] =
          fromFloat<TO>((add ? toFloat(counts[e]) : 0.0f) + (float)count);
      probSums[e] = fromFloat<TO>((add ? toFloat(probSums[e]) : 0.0f) + sum);
    }
  }
}

template <typename TO>
__global__ void keptCountsKernel(const int32_t *offsets, TO *kept, int64_t E) {
  for (int64_t e = gridStart(); e < E; e += gridStride())
    kept[e] = fromFloat<TO>((float)(offsets[e + 1] - offsets[e]));
}

template <typename TI, typename TO>
__global__ void probSumsBackwardKernel(const TI *dprobSums, TO *dprobs,
                                       int64_t tokens, int64_t E) {
  for (int64_t i = gridStart(); i < tokens * E; i += gridStride())
    dprobs[i] = fromFloat<TO>(toFloat(dprobSums[i % E]));
}

template <typename TC, typename TP, typename TO>
__global__ void auxLossKernel(const TC *counts, const TP *probSums, TO *loss,
                              int64_t totalTokens, int64_t E, int64_t k,
                              double coef) {
  double sum = 0;
  for (int64_t e = 0; e < E && totalTokens > 0; ++e)
    sum += (double)toFloat(counts[e]) / ((double)totalTokens * k) *
           ((double)toFloat(probSums[e]) / totalTokens);
  loss[0] = fromFloat<TO>(totalTokens > 0 ? (float)(coef * E * sum) : 0.0f);
}

template <typename TC, typename TG, typename TO>
__global__ void auxLossGradKernel(const TC *counts, const TG *dloss,
                                  TO *dprobSums, int64_t totalTokens, int64_t E,
                                  int64_t k, double coef) {
  const double scale = coef * (double)E /
                       ((double)totalTokens * (double)totalTokens * (double)k);
  for (int64_t e = gridStart(); e < E; e += gridStride())
    dprobSums[e] = fromFloat<TO>((float)(scale * (double)toFloat(counts[e]) *
                                         (double)toFloat(dloss[0])));
}

template <typename TC, typename TO>
__global__ void auxLossBackwardKernel(const TC *counts, int64_t totalTokens,
                                      int64_t E, int64_t k, double coef,
                                      float daux, TO *dprobs, int64_t tokens) {
  for (int64_t i = gridStart(); i < tokens * E; i += gridStride()) {
    const int64_t e = i % E;
    const float g =
        (float)(coef * E *
                ((double)toFloat(counts[e]) / ((double)totalTokens * k)) /
                totalTokens) *
        daux;
    dprobs[i] = fromFloat<TO>(toFloat(dprobs[i]) + g);
  }
}

// logsumexp of a row in fp64, from its largest element.
template <typename TL> __device__ double rowLogSumExp(const TL *l, int64_t E) {
  float m = toFloat(l[0]);
  for (int64_t e = 1; e < E; ++e)
    m = fmaxf(m, toFloat(l[e]));
  double s = 0;
  for (int64_t e = 0; e < E; ++e)
    s += exp((double)toFloat(l[e]) - (double)m);
  return (double)m + log(s);
}

// One block: each thread sums lse^2 over its tokens in fp64, then a fixed
// block reduction. The sum is rounded to fp32 before the scaling, as the
// CPU's moeZLossSum returns it.
template <typename TL, typename TO>
__global__ void zLossKernel(const TL *logits, TO *loss, int64_t tokens,
                            int64_t E, double coef) {
  double part = 0;
  for (int64_t t = threadIdx.x; t < tokens; t += blockDim.x) {
    const double lse = rowLogSumExp(logits + t * E, E);
    part += lse * lse;
  }
  const double sum = blockReduce(part, Sum{}, 0.0);
  if (threadIdx.x == 0)
    loss[0] =
        fromFloat<TO>((float)(coef * (double)(float)sum / (double)tokens));
}

// d lse^2 / d l_e = 2 lse softmax(l)_e, times dsum; set, or added with `add`.
template <typename TL, typename TO>
__device__ void zLossRowGrad(const TL *l, int64_t E, float dsum, TO *d,
                             bool add) {
  const double lse = rowLogSumExp(l, E);
  for (int64_t e = 0; e < E; ++e) {
    const float g = (float)(2 * lse * exp((double)toFloat(l[e]) - lse)) * dsum;
    d[e] = fromFloat<TO>((add ? toFloat(d[e]) : 0.0f) + g);
  }
}

template <typename TL, typename TG, typename TO>
__global__ void zLossGradKernel(const TL *logits, const TG *dloss, TO *dlogits,
                                int64_t tokens, int64_t E, double coef) {
  const float dsum = (float)(coef * (double)toFloat(dloss[0]) / (double)tokens);
  for (int64_t t = gridStart(); t < tokens; t += gridStride())
    zLossRowGrad(logits + t * E, E, dsum, dlogits + t * E, false);
}

template <typename TL, typename TO>
__global__ void zLossBackwardKernel(const TL *logits, int64_t tokens, int64_t E,
                                    float dsum, TO *dlogits) {
  for (int64_t t = gridStart(); t < tokens; t += gridStride())
    zLossRowGrad(logits + t * E, E, dsum, dlogits + t * E, true);
}

} // namespace

//===--- Entry points -----------------------------------------------------===//

template <typename TP, typename TW>
void moeTopK(const TP *probs, int32_t *experts, TW *weights, int64_t tokens,
             int64_t E, int64_t k) {
  checkShape(tokens, E, k, "moeTopK");
  if (tokens == 0)
    return;
  topKKernel<<<blocksFor(tokens), kThreads, 0, computeStream()>>>(
      probs, experts, weights, tokens, E, k);
  launched("topKKernel");
}

template <typename TP, typename TG, typename TO>
void moeTopKBackward(const TP *probs, const int32_t *experts,
                     const TG *dweights, TO *dprobs, int64_t tokens, int64_t E,
                     int64_t k, bool accumulate) {
  checkShape(tokens, E, k, "moeTopKBackward");
  if (tokens == 0)
    return;
  topKBackwardKernel<<<blocksFor(tokens), kThreads, 0, computeStream()>>>(
      probs, experts, dweights, dprobs, tokens, E, k, accumulate);
  launched("topKBackwardKernel");
}

int64_t moeDispatchScratchBytes(int64_t tokens, int64_t rows, int64_t k,
                                int64_t E, int64_t groupSize) {
  // Runs of one row each bound every form: ceil(n / c) <= rows *
  // ceil(n / (rows c)).
  rows = std::max<int64_t>(rows, 1);
  const int64_t chunks = std::max(rows * chunksPerRun(tokens / rows * k),
                                  chunksPerRun(tokens * k));
  const int64_t g = std::max<int64_t>(groupSize, 1);
  return 2 * align256(chunks * E * 4) + align256(rows * E * 4) +
         align256(g * rows * E * 4) + align256(rows * E * 8);
}

void moeDispatchPlan(const int32_t *experts, int64_t tokens, int64_t k,
                     int64_t E, int64_t capacity, const int64_t *before,
                     int32_t *rowOf, int32_t *offsets, void *scratch) {
  dispatchRuns(experts, tokens, 1, k, E, capacity, before, nullptr, rowOf,
               offsets, scratch);
}

void moeDispatchRuns(const int32_t *experts, int64_t tokens, int64_t rows,
                     int64_t k, int64_t E, int64_t capacity,
                     const int64_t *before, int32_t *rowOf, int32_t *offsets,
                     void *scratch) {
  dispatchRuns(experts, tokens, rows, k, E, capacity, before, nullptr, rowOf,
               offsets, scratch);
}

void moeDispatch(const int32_t *experts, int32_t *rowOf, int32_t *offsets,
                 int64_t tokens, int64_t k, int64_t E, int64_t capacity,
                 void *scratch) {
  moeDispatchPlan(experts, tokens, k, E, capacity, nullptr, rowOf, offsets,
                  scratch);
}

void moeDispatchGroup(const int32_t *experts, int32_t *rowOf, int32_t *offsets,
                      int64_t tokens, int64_t rows, int64_t k, int64_t E,
                      int64_t capacity, unsigned axes, void *scratch) {
  if (axes == 0 || capacity <= 0 || rt::groupSize(axes) == 1) {
    moeDispatchPlan(experts, tokens, k, E, capacity, nullptr, rowOf, offsets,
                    scratch);
    return;
  }
  // The axes that split the sequence: cp, then tp inside it.
  const unsigned sequence =
      AxisSet(MeshAxis::TP).bits() | AxisSet(MeshAxis::CP).bits();
  GroupOf group;
  group.axes = axes;
  group.size = rt::groupSize(axes);
  group.rank = rt::groupRank(axes);
  // Without cp or tp the ranks hold consecutive tokens: one run, counted per
  // expert. With the sequence split over cp or tp, per row.
  if (!(axes & sequence)) {
    dispatchRuns(experts, tokens, 1, k, E, capacity, nullptr, &group, rowOf,
                 offsets, scratch);
    return;
  }
  group.pieces = rt::groupSize(axes & sequence);
  dispatchRuns(experts, tokens, rows, k, E, capacity, nullptr, &group, rowOf,
               offsets, scratch);
}

template <typename TI, typename TO>
void moePermute(const TI *x, const int32_t *rowOf, TO *xp, int64_t tokens,
                int64_t k, int64_t H) {
  if (tokens * k * H <= 0)
    return;
  permuteKernel<<<blocksFor(tokens * k * H), kThreads, 0, computeStream()>>>(
      x, rowOf, xp, tokens, k, H);
  launched("permuteKernel");
}

template <typename TI, typename TO>
void moePermuteBackward(const TI *dxp, const int32_t *rowOf, TO *dx,
                        int64_t tokens, int64_t k, int64_t H) {
  if (tokens * H <= 0)
    return;
  unpermuteKernel<<<blocksFor(tokens * H), kThreads, 0, computeStream()>>>(
      dxp, rowOf, static_cast<const float *>(nullptr), dx, tokens, k, H);
  launched("unpermuteKernel (permute backward)");
}

template <typename TY, typename TW, typename TO>
void moeUnpermute(const TY *yp, const int32_t *rowOf, const TW *weights, TO *y,
                  int64_t tokens, int64_t k, int64_t H) {
  if (tokens * H <= 0)
    return;
  unpermuteKernel<<<blocksFor(tokens * H), kThreads, 0, computeStream()>>>(
      yp, rowOf, weights, y, tokens, k, H);
  launched("unpermuteKernel");
}

template <typename TY, typename TW, typename TG, typename TO, typename TD>
void moeUnpermuteBackward(const TY *yp, const int32_t *rowOf, const TW *weights,
                          const TG *dy, TO *dyp, TD *dweights, int64_t tokens,
                          int64_t k, int64_t H) {
  const int64_t assignments = tokens * k;
  if (assignments <= 0)
    return;
  const unsigned blocks =
      (unsigned)std::min<int64_t>(assignments, int64_t(65535) * 8);
  const int threads = H <= 64 ? 64 : H <= 128 ? 128 : 256;
  unpermuteBackwardKernel<<<blocks, threads, 0, computeStream()>>>(
      yp, rowOf, weights, dy, dyp, dweights, tokens, k, H);
  launched("unpermuteBackwardKernel");
}

template <typename TX, typename TW, typename TO>
void groupedMatmul(const TX *x, const TW *W, TO *out, const int32_t *offsets,
                   int64_t E, int64_t K, int64_t N, bool transW,
                   bool accumulate) {
  groupedMatmulOver(x, W, out, offsets, E, E, K, N, transW, accumulate);
}

template <typename TX, typename TW, typename TO>
void groupedMatmulSegments(const TX *x, const TW *W, TO *out,
                           const int32_t *offsets, int64_t segments, int64_t E,
                           int64_t K, int64_t N, bool transW) {
  groupedMatmulOver(x, W, out, offsets, segments, E, K, N, transW, false);
}

template <typename TX, typename TG, typename TO>
void groupedMatmulWeightGrad(const TX *x, const TG *dout, TO *dW,
                             const int32_t *offsets, int64_t E, int64_t K,
                             int64_t N, bool transW, bool accumulate) {
  groupedWeightGradOver(x, dout, dW, offsets, E, E, K, N, transW, accumulate);
}

template <typename TX, typename TG, typename TO>
void groupedMatmulWeightGradSegments(const TX *x, const TG *dout, TO *dW,
                                     const int32_t *offsets, int64_t segments,
                                     int64_t E, int64_t K, int64_t N,
                                     bool transW) {
  groupedMatmulWeightGradSegmentsAccumulate(x, dout, dW, offsets,
                                            /*first=*/true, segments, E, K, N,
                                            transW);
}

template <typename TX, typename TG, typename TO>
void groupedMatmulWeightGradSegmentsAccumulate(const TX *x, const TG *dout,
                                               TO *dW, const int32_t *offsets,
                                               bool first, int64_t segments,
                                               int64_t E, int64_t K, int64_t N,
                                               bool transW) {
  groupedWeightGradOver(x, dout, dW, offsets, segments, E, K, N, transW,
                        /*accumulate=*/!first);
}

// The per-expert statistics, added to what the buffers hold (`add`) or
// in place of it.
template <typename TP, typename TO>
void launchLoadStats(const TP *probs, const int32_t *experts, TO *counts,
                     TO *probSums, int64_t tokens, int64_t E, int64_t k,
                     bool add, const char *what) {
  checkShape(tokens, E, k, what);
  loadStatsKernel<<<(unsigned)std::min<int64_t>(E, 65535), kThreads, 0,
                    computeStream()>>>(probs, experts, counts, probSums, tokens,
                                       E, k, add);
  launched("loadStatsKernel");
}

template <typename TP, typename TO>
void moeLoadStats(const TP *probs, const int32_t *experts, TO *counts,
                  TO *probSums, int64_t tokens, int64_t E, int64_t k) {
  launchLoadStats(probs, experts, counts, probSums, tokens, E, k, true,
                  "moeLoadStats");
}

template <typename TP, typename TO>
void moeLoadStatsInto(const TP *probs, const int32_t *experts, TO *counts,
                      TO *probSums, int64_t tokens, int64_t E, int64_t k) {
  launchLoadStats(probs, experts, counts, probSums, tokens, E, k, false,
                  "moeLoadStatsInto");
}

template <typename TO>
void moeKeptCounts(const int32_t *offsets, TO *kept, int64_t E) {
  if (E <= 0)
    return;
  keptCountsKernel<<<blocksFor(E), kThreads, 0, computeStream()>>>(offsets,
                                                                   kept, E);
  launched("keptCountsKernel");
}

template <typename TI, typename TO>
void moeProbSumsBackward(const TI *dprobSums, TO *dprobs, int64_t tokens,
                         int64_t E) {
  if (tokens * E <= 0)
    return;
  probSumsBackwardKernel<<<blocksFor(tokens * E), kThreads, 0,
                           computeStream()>>>(dprobSums, dprobs, tokens, E);
  launched("probSumsBackwardKernel");
}

template <typename TC, typename TP, typename TO>
void moeAuxLossForward(const TC *counts, const TP *probSums, TO *loss,
                       int64_t totalTokens, int64_t E, int64_t k, double coef) {
  auxLossKernel<<<1, 1, 0, computeStream()>>>(counts, probSums, loss,
                                              totalTokens, E, k, coef);
  launched("auxLossKernel");
}

template <typename TC, typename TG, typename TO>
void moeAuxLossGrad(const TC *counts, const TG *dloss, TO *dprobSums,
                    int64_t totalTokens, int64_t E, int64_t k, double coef) {
  if (E <= 0)
    return;
  auxLossGradKernel<<<blocksFor(E), kThreads, 0, computeStream()>>>(
      counts, dloss, dprobSums, totalTokens, E, k, coef);
  launched("auxLossGradKernel");
}

template <typename TC, typename TO>
void moeAuxLossBackward(const TC *counts, int64_t totalTokens, int64_t E,
                        int64_t k, double coef, float daux, TO *dprobs,
                        int64_t tokens) {
  if (totalTokens <= 0 || tokens * E <= 0)
    return;
  auxLossBackwardKernel<<<blocksFor(tokens * E), kThreads, 0,
                          computeStream()>>>(counts, totalTokens, E, k, coef,
                                             daux, dprobs, tokens);
  launched("auxLossBackwardKernel");
}

template <typename TL, typename TO>
void moeZLossForward(const TL *logits, TO *loss, int64_t tokens, int64_t E,
                     double coef) {
  zLossKernel<<<1, kThreads, 0, computeStream()>>>(logits, loss, tokens, E,
                                                   coef);
  launched("zLossKernel");
}

template <typename TL, typename TG, typename TO>
void moeZLossGrad(const TL *logits, const TG *dloss, TO *dlogits,
                  int64_t tokens, int64_t E, double coef) {
  if (tokens <= 0)
    return;
  zLossGradKernel<<<blocksFor(tokens), kThreads, 0, computeStream()>>>(
      logits, dloss, dlogits, tokens, E, coef);
  launched("zLossGradKernel");
}

template <typename TL, typename TO>
void moeZLossBackward(const TL *logits, int64_t tokens, int64_t E, float dsum,
                      TO *dlogits) {
  if (tokens <= 0)
    return;
  zLossBackwardKernel<<<blocksFor(tokens), kThreads, 0, computeStream()>>>(
      logits, tokens, E, dsum, dlogits);
  launched("zLossBackwardKernel");
}

//===--- Instantiations ---------------------------------------------------===//

// Every combination of float and bf16 for five type parameters (Internal.h
// has one to three).
#define TESSEL_MOE_T5D(X, A, B, C, D) X(A, B, C, D, float) X(A, B, C, D, bf16)
#define TESSEL_MOE_T5C(X, A, B, C)                                             \
  TESSEL_MOE_T5D(X, A, B, C, float) TESSEL_MOE_T5D(X, A, B, C, bf16)
#define TESSEL_MOE_T5B(X, A, B)                                                \
  TESSEL_MOE_T5C(X, A, B, float) TESSEL_MOE_T5C(X, A, B, bf16)
#define TESSEL_MOE_T5A(X, A)                                                   \
  TESSEL_MOE_T5B(X, A, float) TESSEL_MOE_T5B(X, A, bf16)
#define TESSEL_MOE_TYPES5(X) TESSEL_MOE_T5A(X, float) TESSEL_MOE_T5A(X, bf16)

#define TESSEL_INSTANTIATE1(A)                                                 \
  template void moeKeptCounts<A>(const int32_t *, A *, int64_t);
TESSEL_CUDA_TYPES1(TESSEL_INSTANTIATE1)
#undef TESSEL_INSTANTIATE1

#define TESSEL_INSTANTIATE2(A, B)                                              \
  template void moeTopK<A, B>(const A *, int32_t *, B *, int64_t, int64_t,     \
                              int64_t);                                        \
  template void moePermute<A, B>(const A *, const int32_t *, B *, int64_t,     \
                                 int64_t, int64_t);                            \
  template void moePermuteBackward<A, B>(const A *, const int32_t *, B *,      \
                                         int64_t, int64_t, int64_t);           \
  template void moeLoadStats<A, B>(const A *, const int32_t *, B *, B *,       \
                                   int64_t, int64_t, int64_t);                 \
  template void moeLoadStatsInto<A, B>(const A *, const int32_t *, B *, B *,   \
                                       int64_t, int64_t, int64_t);             \
  template void moeProbSumsBackward<A, B>(const A *, B *, int64_t, int64_t);   \
  template void moeAuxLossBackward<A, B>(const A *, int64_t, int64_t, int64_t, \
                                         double, float, B *, int64_t);         \
  template void moeZLossForward<A, B>(const A *, B *, int64_t, int64_t,        \
                                      double);                                 \
  template void moeZLossBackward<A, B>(const A *, int64_t, int64_t, float, B *);
TESSEL_CUDA_TYPES2(TESSEL_INSTANTIATE2)
#undef TESSEL_INSTANTIATE2

#define TESSEL_INSTANTIATE3(A, B, C)                                           \
  template void moeTopKBackward<A, B, C>(const A *, const int32_t *,           \
                                         const B *, C *, int64_t, int64_t,     \
                                         int64_t, bool);                       \
  template void moeUnpermute<A, B, C>(const A *, const int32_t *, const B *,   \
                                      C *, int64_t, int64_t, int64_t);         \
  template void groupedMatmul<A, B, C>(const A *, const B *, C *,              \
                                       const int32_t *, int64_t, int64_t,      \
                                       int64_t, bool, bool);                   \
  template void groupedMatmulSegments<A, B, C>(                                \
      const A *, const B *, C *, const int32_t *, int64_t, int64_t, int64_t,   \
      int64_t, bool);                                                          \
  template void groupedMatmulWeightGrad<A, B, C>(                              \
      const A *, const B *, C *, const int32_t *, int64_t, int64_t, int64_t,   \
      bool, bool);                                                             \
  template void groupedMatmulWeightGradSegments<A, B, C>(                      \
      const A *, const B *, C *, const int32_t *, int64_t, int64_t, int64_t,   \
      int64_t, bool);                                                          \
  template void groupedMatmulWeightGradSegmentsAccumulate<A, B, C>(            \
      const A *, const B *, C *, const int32_t *, bool, int64_t, int64_t,      \
      int64_t, int64_t, bool);                                                 \
  template void moeAuxLossForward<A, B, C>(const A *, const B *, C *, int64_t, \
                                           int64_t, int64_t, double);          \
  template void moeAuxLossGrad<A, B, C>(const A *, const B *, C *, int64_t,    \
                                        int64_t, int64_t, double);             \
  template void moeZLossGrad<A, B, C>(const A *, const B *, C *, int64_t,      \
                                      int64_t, double);
TESSEL_CUDA_TYPES3(TESSEL_INSTANTIATE3)
#undef TESSEL_INSTANTIATE3

#define TESSEL_INSTANTIATE5(A, B, C, D, F)                                     \
  template void moeUnpermuteBackward<A, B, C, D, F>(                           \
      const A *, const int32_t *, const B *, const C *, D *, F *, int64_t,     \
      int64_t, int64_t);
TESSEL_MOE_TYPES5(TESSEL_INSTANTIATE5)
#undef TESSEL_INSTANTIATE5
#undef TESSEL_MOE_TYPES5
#undef TESSEL_MOE_T5A
#undef TESSEL_MOE_T5B
#undef TESSEL_MOE_T5C
#undef TESSEL_MOE_T5D

} // namespace tessel::cuda
