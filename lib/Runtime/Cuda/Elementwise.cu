//===- Elementwise.cu - Pointwise, layout and embedding kernels -----------===//
//
// The CUDA counterparts of lib/Runtime/Kernels/{Elementwise,Layout,
// Embedding,VocabParallel}.cpp. Pointwise kernels are grid-stride loops
// that load the storage type, compute in fp32 (one functor per kernel) and
// store the output type, eight elements a thread with 16-byte accesses
// where the sizes are multiples of 8 and the pointers aligned, else one.
//
// The two reductions are deterministic: their order depends only on the
// shape, never on thread timing.
//  - reduceSumLeading: a block owns 32 columns; its 32 row lanes each sum
//    every 32nd row in ascending order, then the 32 lane sums are added in
//    lane order.
//  - embeddingBackward: a block owns 32 table rows by 256 columns with fp32
//    accumulators in shared memory; each thread owns its columns, and its
//    warp scans all ids in ascending order, so every table entry receives
//    its contributions in ascending i (the CPU kernel's order, so fp32
//    results equal the CPU's bitwise). Every entry of the table is written
//    once at the end, which also zeroes the rows no id touches; summing
//    over microbatches in place, the accumulators start from what the
//    table holds, so each entry adds its contributions to it in ascending
//    i, as the CPU kernel does.
//
//===----------------------------------------------------------------------===//

#include "Internal.h"

#include "tessel/Runtime/Sequence.h"

#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace tessel::cuda {

using detail::blocksFor;
using detail::fromFloat;
using detail::toFloat;

namespace {

constexpr int kThreads = 256;

__device__ inline int64_t gridStart() {
  return int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ inline int64_t gridStride() {
  return int64_t(blockDim.x) * gridDim.x;
}

// exp-based tanh, the formula the CPU float kernels use, so that both sides
// round alike. Saturates correctly: exp overflow gives 1, underflow -1.
__device__ inline float tanhViaExp(float x) {
  return 1.0f - 2.0f / (1.0f + expf(2.0f * x));
}

__device__ inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

//===--- Pointwise --------------------------------------------------------===//

// Eight consecutive elements as fp32, in one or two 16-byte accesses. The
// pointwise kernels take this path when their sizes are multiples of 8 and
// their pointers 16-byte aligned: one element per thread with 64-bit
// indices left them at a third of the memory bandwidth (measured on an
// H200 for the residual adds and GELU's backward). The arithmetic per
// element is unchanged, so results are the same bits.
__device__ inline void load8(const float *p, float v[8]) {
  const float4 a = reinterpret_cast<const float4 *>(p)[0];
  const float4 b = reinterpret_cast<const float4 *>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
  v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ inline void load8(const bf16 *p, float v[8]) {
  const uint4 u = *reinterpret_cast<const uint4 *>(p);
  const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __bfloat1622float2(h[k]);
    v[2 * k] = f.x;
    v[2 * k + 1] = f.y;
  }
}
__device__ inline void store8(float *p, const float v[8]) {
  reinterpret_cast<float4 *>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4 *>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ inline void store8(bf16 *p, const float v[8]) {
  uint4 u;
  __nv_bfloat162 *h = reinterpret_cast<__nv_bfloat162 *>(&u);
#pragma unroll
  for (int k = 0; k < 4; ++k)
    h[k] = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
  *reinterpret_cast<uint4 *>(p) = u;
}

inline bool aligned16(const void *p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// Vector v of a broadcast operand of nbv vectors: 32-bit arithmetic where
// the sizes allow (a 64-bit remainder costs several times more).
__device__ inline int64_t broadcastIndex(int64_t v, int64_t nv, int64_t nbv) {
  if (nbv == nv)
    return v;
  if (nv <= int64_t(UINT32_MAX))
    return int64_t(uint32_t(v) % uint32_t(nbv));
  return v % nbv;
}

// GELU, tanh approximation: 0.5 x (1 + tanh(c (x + a x^3))).
constexpr float kGeluC = float(0.7978845608028654); // sqrt(2/pi)
constexpr float kGeluA = float(0.044715);

__device__ inline float geluGrad(float xi) {
  const float x2 = xi * xi;
  const float th = tanhViaExp(kGeluC * (xi + kGeluA * x2 * xi));
  const float du = kGeluC * (1.0f + 3.0f * kGeluA * x2); // du/dx
  return 0.5f * (1.0f + th) + 0.5f * xi * (1.0f - th * th) * du;
}

// The arithmetic of each pointwise kernel, in fp32, shared by its
// one-element and eight-element paths (so both give the same bits).
struct Add {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct Mul {
  __device__ float operator()(float a, float b) const { return a * b; }
};
struct Scale {
  float s;
  __device__ float operator()(float x) const { return x * s; }
};
struct Identity {
  __device__ float operator()(float x) const { return x; }
};
struct Gelu {
  __device__ float operator()(float x) const {
    const float u = kGeluC * (x + kGeluA * x * x * x);
    return 0.5f * x * (1.0f + tanhViaExp(u));
  }
};
struct GeluGrad { // (x, dout)
  __device__ float operator()(float x, float g) const {
    return g * geluGrad(x);
  }
};
struct Silu {
  __device__ float operator()(float x) const { return x / (1.0f + expf(-x)); }
};
// silu'(x) = s (1 + x (1 - s)), s = sigmoid(x).
struct SiluGrad { // (x, dout)
  __device__ float operator()(float x, float g) const {
    const float s = sigmoid(x);
    return g * (s * (1.0f + x * (1.0f - s)));
  }
};
struct Accumulate { // (src, acc): the first microbatch sets, the rest add
  bool first;
  __device__ float operator()(float src, float acc) const {
    return first ? src : acc + src;
  }
};

// out = f(a, b[broadcast]) for nu units of Width elements (8: one 16-byte
// access per operand, see load8), b repeating every nbu units.
template <int Width, typename F, typename TA, typename TB, typename TO>
__global__ void broadcastKernel(F f, const TA *a, const TB *b, TO *out,
                                int64_t nu, int64_t nbu) {
  for (int64_t u = gridStart(); u < nu; u += gridStride()) {
    const int64_t j = broadcastIndex(u, nu, nbu);
    if constexpr (Width == 8) {
      float x[8], y[8];
      load8(a + 8 * u, x);
      load8(b + 8 * j, y);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        x[e] = f(x[e], y[e]);
      store8(out + 8 * u, x);
    } else {
      out[u] = fromFloat<TO>(f(toFloat(a[u]), toFloat(b[j])));
    }
  }
}

// out = f(x) over nu units of Width elements.
template <int Width, typename F, typename TI, typename TO>
__global__ void map1Kernel(F f, const TI *x, TO *out, int64_t nu) {
  for (int64_t u = gridStart(); u < nu; u += gridStride()) {
    if constexpr (Width == 8) {
      float v[8];
      load8(x + 8 * u, v);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        v[e] = f(v[e]);
      store8(out + 8 * u, v);
    } else {
      out[u] = fromFloat<TO>(f(toFloat(x[u])));
    }
  }
}

// Eight elements a thread where n and nb are multiples of 8 and every
// pointer is 16-byte aligned, else one.
template <typename F, typename TA, typename TB, typename TO>
void launchBroadcast(F f, const TA *a, const TB *b, TO *out, int64_t n,
                     int64_t nb) {
  if (n <= 0)
    return;
  if (n % 8 == 0 && nb % 8 == 0 && nb > 0 && aligned16(a) && aligned16(b) &&
      aligned16(out))
    broadcastKernel<8><<<blocksFor(n / 8), kThreads, 0, computeStream()>>>(
        f, a, b, out, n / 8, nb / 8);
  else
    broadcastKernel<1><<<blocksFor(n), kThreads, 0, computeStream()>>>(
        f, a, b, out, n, nb);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

template <typename F, typename TI, typename TO>
void launchMap(F f, const TI *x, TO *out, int64_t n) {
  if (n <= 0)
    return;
  if (n % 8 == 0 && aligned16(x) && aligned16(out))
    map1Kernel<8><<<blocksFor(n / 8), kThreads, 0, computeStream()>>>(
        f, x, out, n / 8);
  else
    map1Kernel<1><<<blocksFor(n), kThreads, 0, computeStream()>>>(f, x, out,
                                                                  n);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

// SwiGLU's forward: out = silu(gate) * up, and silu(gate) itself into
// siluOut when it is non-null.
template <int Width, typename TI, typename TO>
__global__ void swigluForwardKernel(const TI *gate, const TI *up, TO *out,
                                    TO *siluOut, int64_t nu) {
  for (int64_t u = gridStart(); u < nu; u += gridStride()) {
    float g[Width], v[Width];
    if constexpr (Width == 8) {
      load8(gate + 8 * u, g);
      load8(up + 8 * u, v);
    } else {
      g[0] = toFloat(gate[u]);
      v[0] = toFloat(up[u]);
    }
#pragma unroll
    for (int e = 0; e < Width; ++e) {
      g[e] = Silu{}(g[e]);
      v[e] = g[e] * v[e];
    }
    if constexpr (Width == 8) {
      store8(out + 8 * u, v);
      if (siluOut)
        store8(siluOut + 8 * u, g);
    } else {
      out[u] = fromFloat<TO>(v[0]);
      if (siluOut)
        siluOut[u] = fromFloat<TO>(g[0]);
    }
  }
}

// SwiGLU's backward: the SiLU and its derivative from the gate, then
// dup = dout * silu(gate) and dgate = dout * up * silu'(gate).
template <int Width, typename TI, typename TG, typename TO>
__global__ void swigluBackwardKernel(const TI *gate, const TI *up,
                                     const TG *dout, TO *dgate, TO *dup,
                                     int64_t nu) {
  for (int64_t u = gridStart(); u < nu; u += gridStride()) {
    float g[Width], v[Width], d[Width];
    if constexpr (Width == 8) {
      load8(gate + 8 * u, g);
      load8(up + 8 * u, v);
      load8(dout + 8 * u, d);
    } else {
      g[0] = toFloat(gate[u]);
      v[0] = toFloat(up[u]);
      d[0] = toFloat(dout[u]);
    }
#pragma unroll
    for (int e = 0; e < Width; ++e) {
      const float dg = SiluGrad{}(g[e], d[e] * v[e]);
      v[e] = d[e] * Silu{}(g[e]);
      g[e] = dg;
    }
    if constexpr (Width == 8) {
      store8(dgate + 8 * u, g);
      store8(dup + 8 * u, v);
    } else {
      dgate[u] = fromFloat<TO>(g[0]);
      dup[u] = fromFloat<TO>(v[0]);
    }
  }
}

template <int Width, typename TO>
__global__ void fillKernel(TO *out, int64_t nu, float value) {
  float v[8];
#pragma unroll
  for (int e = 0; e < 8; ++e)
    v[e] = value;
  for (int64_t u = gridStart(); u < nu; u += gridStride()) {
    if constexpr (Width == 8)
      store8(out + 8 * u, v);
    else
      out[u] = fromFloat<TO>(value);
  }
}

//===--- Column sums ------------------------------------------------------===//

constexpr int kSumCols = 32;  // columns per block (one warp wide)
constexpr int kSumLanes = 32; // row lanes per block

template <typename TI, typename TO>
__global__ void reduceSumLeadingKernel(const TI *x, TO *out, int64_t rows,
                                       int64_t cols) {
  __shared__ float lane[kSumLanes][kSumCols + 1];
  const int64_t c = int64_t(blockIdx.x) * kSumCols + threadIdx.x;
  float s = 0.0f;
  if (c < cols)
    for (int64_t r = threadIdx.y; r < rows; r += kSumLanes)
      s += toFloat(x[r * cols + c]);
  lane[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float total = 0.0f;
    for (int k = 0; k < kSumLanes; ++k)
      total += lane[k][threadIdx.x];
    out[c] = fromFloat<TO>(total);
  }
}

//===--- Layout -----------------------------------------------------------===//

constexpr int kMaxRank = 6;

// Output dimensions (outermost first) with the input stride of each; passed
// by value as a kernel argument.
struct PermutedDims {
  int64_t size[kMaxRank];
  int64_t stride[kMaxRank];
  int rank;
};

template <typename TI, typename TO>
__global__ void transposeKernel(const TI *x, TO *out, int64_t total,
                                PermutedDims dims) {
  for (int64_t i = gridStart(); i < total; i += gridStride()) {
    int64_t idx = i, off = 0;
    // Unrolled over the fixed maximum rank so that `dims` stays in
    // registers (a runtime index would copy it to local memory).
#pragma unroll
    for (int d = kMaxRank - 1; d >= 0; --d)
      if (d < dims.rank) {
        off += (idx % dims.size[d]) * dims.stride[d];
        idx /= dims.size[d];
      }
    out[i] = fromFloat<TO>(toFloat(x[off]));
  }
}

// sliceAxis (out[o, j, :] = x[o, start + j, :] over the [outer, len,
// inner] output) and insertAxis (the reverse) over `runs` = outer rows of
// `run` = len * inner elements, the axis-long tensor's rows `axisRun` =
// axis * inner long and the piece at `offset` = start * inner in each. In
// units of `width` elements (8: one 16-byte vector per thread, when every
// size is a multiple of 8 and both pointers are 16-byte aligned; else 1),
// with Index 32-bit when the axis-long tensor has fewer than 2^31 of them
// (a 64-bit division costs several times more). Copies, so every path
// gives the same bits.
template <int Width, bool Insert, typename Index, typename TI, typename TO>
__global__ void axisPieceKernel(const TI *x, TO *out, Index units, Index run,
                                Index axisRun, Index offset) {
  const Index stride = Index(blockDim.x) * gridDim.x;
  for (Index u = Index(blockIdx.x) * blockDim.x + threadIdx.x; u < units;
       u += stride) {
    const Index o = u / run;
    const Index far = o * axisRun + offset + (u - o * run);
    const int64_t near = int64_t(u) * Width;
    const int64_t wide = int64_t(far) * Width;
    if constexpr (Width == 8) {
      float v[8];
      load8(x + (Insert ? near : wide), v);
      store8(out + (Insert ? wide : near), v);
    } else {
      out[Insert ? wide : near] = fromFloat<TO>(toFloat(x[Insert ? near : wide]));
    }
  }
}

template <bool Insert, typename TI, typename TO>
void launchAxisPiece(const TI *x, TO *out, int64_t outer, int64_t axis,
                     int64_t inner, int64_t start, int64_t len) {
  if (outer <= 0 || len <= 0 || inner <= 0)
    return;
  const int64_t run = len * inner, axisRun = axis * inner,
                offset = start * inner;
  const bool vectors = run % 8 == 0 && axisRun % 8 == 0 && offset % 8 == 0 &&
                       aligned16(x) && aligned16(out);
  const int64_t width = vectors ? 8 : 1;
  const int64_t units = outer * run / width;
  const bool narrow = outer * axisRun / width < (int64_t(1) << 31);
  auto launch = [&](auto kernel, auto index) {
    using Index = decltype(index);
    kernel<<<blocksFor(units), kThreads, 0, computeStream()>>>(
        x, out, Index(units), Index(run / width), Index(axisRun / width),
        Index(offset / width));
  };
  if (vectors && narrow)
    launch(axisPieceKernel<8, Insert, uint32_t, TI, TO>, uint32_t());
  else if (vectors)
    launch(axisPieceKernel<8, Insert, int64_t, TI, TO>, int64_t());
  else if (narrow)
    launch(axisPieceKernel<1, Insert, uint32_t, TI, TO>, uint32_t());
  else
    launch(axisPieceKernel<1, Insert, int64_t, TI, TO>, int64_t());
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

//===--- Embedding --------------------------------------------------------===//

// out[i, :] = table[ids[i] - vStart, :] when that row is in [0, Vl), else 0.
template <typename TT, typename TO>
__global__ void embeddingForwardKernel(const TT *table, const int32_t *ids,
                                       TO *out, int64_t n, int64_t vStart,
                                       int64_t Vl, int64_t C) {
  const int64_t total = n * C;
  for (int64_t k = gridStart(); k < total; k += gridStride()) {
    const int64_t i = k / C, c = k % C;
    const int64_t row = int64_t(ids[i]) - vStart;
    out[k] = row >= 0 && row < Vl ? fromFloat<TO>(toFloat(table[row * C + c]))
                                  : fromFloat<TO>(0.0f);
  }
}

constexpr int kEmbThreads = 64; // two warps
constexpr int kEmbColsPerThread = 4;
constexpr int kEmbCols = kEmbThreads * kEmbColsPerThread; // per block
constexpr int kEmbRows = 32; // table rows per block: 32 KiB of fp32

// Block (x, y) owns table rows [x * kEmbRows, ...) and columns
// [y * kEmbCols, ...); thread t owns columns t + j * kEmbThreads of the
// block, whose accumulators only it touches (no synchronisation needed).
// Each warp reads the ids 32 at a time, finds those in its rows with a
// ballot and applies them lowest lane (smallest i) first.
template <typename TG, typename TO>
__global__ void __launch_bounds__(kEmbThreads)
    embeddingBackwardKernel(const int32_t *ids, const TG *dout, TO *dtable,
                            bool first, int64_t n, int64_t vStart, int64_t Vl,
                            int64_t C) {
  __shared__ float acc[kEmbRows][kEmbCols];
  const int64_t v0 = int64_t(blockIdx.x) * kEmbRows;
  const int64_t c0 = int64_t(blockIdx.y) * kEmbCols;
  const int64_t rowsHere = Vl - v0 < kEmbRows ? Vl - v0 : kEmbRows;
  const int lane = threadIdx.x & 31;

  // Zero, or what the table holds (summing over microbatches in place).
  for (int r = 0; r < kEmbRows; ++r)
    for (int j = 0; j < kEmbColsPerThread; ++j) {
      const int64_t c = c0 + threadIdx.x + j * kEmbThreads;
      acc[r][threadIdx.x + j * kEmbThreads] =
          first || r >= rowsHere || c >= C ? 0.0f
                                           : toFloat(dtable[(v0 + r) * C + c]);
    }

  for (int64_t i0 = 0; i0 < n; i0 += 32) {
    int row = -1;
    if (i0 + lane < n) {
      const int64_t r = int64_t(ids[i0 + lane]) - vStart - v0;
      if (r >= 0 && r < rowsHere)
        row = int(r);
    }
    unsigned hits = __ballot_sync(0xffffffffu, row >= 0);
    while (hits) {
      const int k = __ffs(hits) - 1; // the smallest remaining i
      hits &= hits - 1;
      const int r = __shfl_sync(0xffffffffu, row, k);
      const TG *src = dout + (i0 + k) * C;
      for (int j = 0; j < kEmbColsPerThread; ++j) {
        const int64_t c = c0 + threadIdx.x + j * kEmbThreads;
        if (c < C)
          acc[r][threadIdx.x + j * kEmbThreads] += toFloat(src[c]);
      }
    }
  }

  for (int64_t r = 0; r < rowsHere; ++r)
    for (int j = 0; j < kEmbColsPerThread; ++j) {
      const int64_t c = c0 + threadIdx.x + j * kEmbThreads;
      if (c < C)
        dtable[(v0 + r) * C + c] =
            fromFloat<TO>(acc[r][threadIdx.x + j * kEmbThreads]);
    }
}

template <typename TG, typename TO>
void launchEmbeddingBackward(const int32_t *ids, const TG *dout, TO *dtable,
                             bool first, int64_t n, int64_t vStart, int64_t Vl,
                             int64_t C) {
  if (Vl <= 0 || C <= 0)
    return;
  const int64_t rowBlocks = (Vl + kEmbRows - 1) / kEmbRows;
  const int64_t colBlocks = (C + kEmbCols - 1) / kEmbCols;
  if (rowBlocks > 0x7fffffff || colBlocks > 65535)
    throw std::runtime_error("embeddingBackward: table too large");
  const dim3 grid{unsigned(rowBlocks), unsigned(colBlocks)};
  embeddingBackwardKernel<<<grid, kEmbThreads, 0, computeStream()>>>(
      ids, dout, dtable, first, n < 0 ? 0 : n, vStart, Vl, C);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

} // namespace

//===--- Launchers --------------------------------------------------------===//

template <typename TA, typename TB, typename TO>
void addBroadcast(const TA *a, const TB *b, TO *out, int64_t n, int64_t nb) {
  launchBroadcast(Add{}, a, b, out, n, nb);
}

template <typename TA, typename TB, typename TO>
void mulBroadcast(const TA *a, const TB *b, TO *out, int64_t n, int64_t nb) {
  launchBroadcast(Mul{}, a, b, out, n, nb);
}

template <typename TI, typename TO>
void reduceSumLeading(const TI *x, TO *out, int64_t rows, int64_t cols) {
  if (cols <= 0)
    return;
  const int64_t blocks = (cols + kSumCols - 1) / kSumCols;
  if (blocks > 0x7fffffff)
    throw std::runtime_error("reduceSumLeading: too many columns");
  reduceSumLeadingKernel<<<unsigned(blocks), dim3(kSumCols, kSumLanes), 0,
                           computeStream()>>>(x, out, rows < 0 ? 0 : rows,
                                              cols);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

template <typename TI, typename TO>
void scale(const TI *x, TO *out, int64_t n, float s) {
  launchMap(Scale{s}, x, out, n);
}

template <typename TI, typename TO>
void geluForward(const TI *x, TO *out, int64_t n) {
  launchMap(Gelu{}, x, out, n);
}

template <typename TI, typename TG, typename TO>
void geluBackward(const TI *x, const TG *dout, TO *dx, int64_t n) {
  launchBroadcast(GeluGrad{}, x, dout, dx, n, n);
}

template <typename TI, typename TO>
void siluForward(const TI *x, TO *out, int64_t n) {
  launchMap(Silu{}, x, out, n);
}

template <typename TI, typename TG, typename TO>
void siluBackward(const TI *x, const TG *dout, TO *dx, int64_t n) {
  launchBroadcast(SiluGrad{}, x, dout, dx, n, n);
}

template <typename TI, typename TO>
void swigluForward(const TI *gate, const TI *up, TO *out, TO *siluOut,
                   int64_t n) {
  if (n <= 0)
    return;
  if (n % 8 == 0 && aligned16(gate) && aligned16(up) && aligned16(out) &&
      (!siluOut || aligned16(siluOut)))
    swigluForwardKernel<8><<<blocksFor(n / 8), kThreads, 0, computeStream()>>>(
        gate, up, out, siluOut, n / 8);
  else
    swigluForwardKernel<1><<<blocksFor(n), kThreads, 0, computeStream()>>>(
        gate, up, out, siluOut, n);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

template <typename TI, typename TG, typename TO>
void swigluBackward(const TI *gate, const TI *up, const TG *dout, TO *dgate,
                    TO *dup, int64_t n) {
  if (n <= 0)
    return;
  if (n % 8 == 0 && aligned16(gate) && aligned16(up) && aligned16(dout) &&
      aligned16(dgate) && aligned16(dup))
    swigluBackwardKernel<8><<<blocksFor(n / 8), kThreads, 0, computeStream()>>>(
        gate, up, dout, dgate, dup, n / 8);
  else
    swigluBackwardKernel<1><<<blocksFor(n), kThreads, 0, computeStream()>>>(
        gate, up, dout, dgate, dup, n);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

template <typename TI, typename TO> void copy(const TI *x, TO *out, int64_t n) {
  if (n <= 0)
    return;
  if constexpr (std::is_same_v<TI, TO>)
    TESSEL_CUDA_CHECK(cudaMemcpyAsync(out, x, size_t(n) * sizeof(TO),
                                      cudaMemcpyDeviceToDevice,
                                      computeStream()));
  else
    launchMap(Identity{}, x, out, n);
}

template <typename TO> void fill(TO *out, int64_t n, float value) {
  if (n <= 0)
    return;
  if (n % 8 == 0 && aligned16(out))
    fillKernel<8><<<blocksFor(n / 8), kThreads, 0, computeStream()>>>(
        out, n / 8, value);
  else
    fillKernel<1><<<blocksFor(n), kThreads, 0, computeStream()>>>(out, n,
                                                                  value);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

template <typename TI, typename TO>
void transpose(const TI *x, TO *out, const int64_t *shape, const int64_t *perm,
               int rank) {
  int64_t total = 1;
  for (int d = 0; d < rank; ++d)
    total *= shape[d];
  if (total <= 0)
    return;
  std::vector<int64_t> inStride(size_t(rank > 0 ? rank : 1), 1);
  for (int d = rank - 2; d >= 0; --d)
    inStride[size_t(d)] = inStride[size_t(d + 1)] * shape[d + 1];

  // Drop size-1 dimensions and merge output dimensions that are also
  // adjacent in the input (as the CPU kernel does), which bounds the rank
  // the kernel sees and shortens its index arithmetic.
  PermutedDims dims{};
  std::vector<int64_t> sizes, strides;
  for (int i = 0; i < rank; ++i) {
    const int64_t size = shape[perm[i]], stride = inStride[size_t(perm[i])];
    if (size == 1)
      continue;
    if (!sizes.empty() && strides.back() == stride * size) {
      sizes.back() *= size;
      strides.back() = stride;
      continue;
    }
    sizes.push_back(size);
    strides.push_back(stride);
  }
  if (sizes.empty() || (sizes.size() == 1 && strides[0] == 1)) {
    copy(x, out, total);
    return;
  }
  if (sizes.size() > size_t(kMaxRank))
    throw std::runtime_error("transpose: more than 6 dimensions after merging");
  dims.rank = int(sizes.size());
  for (int d = 0; d < dims.rank; ++d) {
    dims.size[d] = sizes[size_t(d)];
    dims.stride[d] = strides[size_t(d)];
  }
  transposeKernel<<<blocksFor(total), kThreads, 0, computeStream()>>>(
      x, out, total, dims);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

template <typename TI, typename TO>
void sliceAxis(const TI *x, TO *out, int64_t outer, int64_t srcAxis,
               int64_t inner, int64_t start, int64_t len) {
  launchAxisPiece<false>(x, out, outer, srcAxis, inner, start, len);
}

template <typename TI, typename TO>
void insertAxis(const TI *x, TO *out, int64_t outer, int64_t dstAxis,
                int64_t inner, int64_t start, int64_t len) {
  launchAxisPiece<true>(x, out, outer, dstAxis, inner, start, len);
}

namespace {
// Element i of the balanced order's rows; `inverse` scatters instead.
template <typename TI, typename TO>
__global__ void zigzagKernel(const TI *x, TO *out, int64_t n, int64_t len,
                             int64_t inner, int64_t pieces, bool inverse) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(blockDim.x) * gridDim.x) {
    const int64_t e = i % inner, t = (i / inner) % len, o = i / (inner * len);
    const int64_t from =
        (o * len + rt::zigzagPosition(t, len, pieces)) * inner + e;
    if (inverse)
      out[from] = fromFloat<TO>(toFloat(x[i]));
    else
      out[i] = fromFloat<TO>(toFloat(x[from]));
  }
}
} // namespace

template <typename TI, typename TO>
void zigzag(const TI *x, TO *out, int64_t outer, int64_t len, int64_t inner,
            int64_t pieces, bool inverse) {
  const int64_t n = outer * len * inner;
  if (n <= 0)
    return;
  if (pieces < 1 || len % (2 * pieces) != 0)
    throw std::invalid_argument("CUDA zigzag: " + std::to_string(len) +
                                " rows are not 2 x " + std::to_string(pieces) +
                                " chunks");
  zigzagKernel<<<blocksFor(n), kThreads, 0, computeStream()>>>(
      x, out, n, len, inner, pieces, inverse);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

template <typename TT, typename TO>
void embeddingForward(const TT *table, const int32_t *ids, TO *out, int64_t n,
                      int64_t V, int64_t C) {
  embeddingForwardRange(table, ids, out, n, 0, V, C);
}

template <typename TG, typename TO>
void embeddingBackward(const int32_t *ids, const TG *dout, TO *dtable,
                       int64_t n, int64_t V, int64_t C) {
  launchEmbeddingBackward(ids, dout, dtable, true, n, 0, V, C);
}

template <typename TG, typename TO>
void embeddingBackwardAccumulate(const int32_t *ids, const TG *dout, TO *dtable,
                                 bool first, int64_t n, int64_t V, int64_t C) {
  launchEmbeddingBackward(ids, dout, dtable, first, n, 0, V, C);
}

template <typename TT, typename TO>
void embeddingForwardRange(const TT *table, const int32_t *ids, TO *out,
                           int64_t n, int64_t vStart, int64_t Vl, int64_t C) {
  if (n <= 0 || C <= 0)
    return;
  embeddingForwardKernel<<<blocksFor(n * C), kThreads, 0, computeStream()>>>(
      table, ids, out, n, vStart, Vl, C);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

template <typename TG, typename TO>
void embeddingBackwardRange(const int32_t *ids, const TG *dout, TO *dtable,
                            int64_t n, int64_t vStart, int64_t Vl, int64_t C) {
  launchEmbeddingBackward(ids, dout, dtable, true, n, vStart, Vl, C);
}

template <typename TG, typename TO>
void embeddingBackwardRangeAccumulate(const int32_t *ids, const TG *dout,
                                      TO *dtable, bool first, int64_t n,
                                      int64_t vStart, int64_t Vl, int64_t C) {
  launchEmbeddingBackward(ids, dout, dtable, first, n, vStart, Vl, C);
}

template <typename TI>
void accumulateInto(const TI *src, float *acc, int64_t n, bool first) {
  launchBroadcast(Accumulate{first}, src, acc, acc, n, n);
}

//===--- Instantiations ---------------------------------------------------===//

#define TESSEL_INSTANTIATE3(A, B, C)                                           \
  template void addBroadcast<A, B, C>(const A *, const B *, C *, int64_t,      \
                                      int64_t);                                \
  template void mulBroadcast<A, B, C>(const A *, const B *, C *, int64_t,      \
                                      int64_t);                                \
  template void geluBackward<A, B, C>(const A *, const B *, C *, int64_t);     \
  template void siluBackward<A, B, C>(const A *, const B *, C *, int64_t);     \
  template void swigluBackward<A, B, C>(const A *, const A *, const B *, C *,  \
                                        C *, int64_t);
TESSEL_CUDA_TYPES3(TESSEL_INSTANTIATE3)
#undef TESSEL_INSTANTIATE3

#define TESSEL_INSTANTIATE2(A, B)                                              \
  template void reduceSumLeading<A, B>(const A *, B *, int64_t, int64_t);      \
  template void scale<A, B>(const A *, B *, int64_t, float);                   \
  template void geluForward<A, B>(const A *, B *, int64_t);                    \
  template void siluForward<A, B>(const A *, B *, int64_t);                    \
  template void swigluForward<A, B>(const A *, const A *, B *, B *, int64_t);  \
  template void copy<A, B>(const A *, B *, int64_t);                           \
  template void transpose<A, B>(const A *, B *, const int64_t *,               \
                                const int64_t *, int);                         \
  template void sliceAxis<A, B>(const A *, B *, int64_t, int64_t, int64_t,     \
                                int64_t, int64_t);                             \
  template void insertAxis<A, B>(const A *, B *, int64_t, int64_t, int64_t,    \
                                 int64_t, int64_t);                            \
  template void zigzag<A, B>(const A *, B *, int64_t, int64_t, int64_t,        \
                             int64_t, bool);                                   \
  template void embeddingForward<A, B>(const A *, const int32_t *, B *,        \
                                       int64_t, int64_t, int64_t);             \
  template void embeddingBackward<A, B>(const int32_t *, const A *, B *,       \
                                        int64_t, int64_t, int64_t);            \
  template void embeddingForwardRange<A, B>(                                   \
      const A *, const int32_t *, B *, int64_t, int64_t, int64_t, int64_t);    \
  template void embeddingBackwardRange<A, B>(                                  \
      const int32_t *, const A *, B *, int64_t, int64_t, int64_t, int64_t);    \
  template void embeddingBackwardAccumulate<A, B>(                             \
      const int32_t *, const A *, B *, bool, int64_t, int64_t, int64_t);       \
  template void embeddingBackwardRangeAccumulate<A, B>(                        \
      const int32_t *, const A *, B *, bool, int64_t, int64_t, int64_t,        \
      int64_t);
TESSEL_CUDA_TYPES2(TESSEL_INSTANTIATE2)
#undef TESSEL_INSTANTIATE2

#define TESSEL_INSTANTIATE1(A)                                                 \
  template void fill<A>(A *, int64_t, float);                                  \
  template void accumulateInto<A>(const A *, float *, int64_t, bool);
TESSEL_CUDA_TYPES1(TESSEL_INSTANTIATE1)
#undef TESSEL_INSTANTIATE1

} // namespace tessel::cuda
