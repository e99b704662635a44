//===- Attention.cu - Flash attention, forward and backward ---------------===//
//
// (Long by design: the forward and backward flash-attention kernels share
// their tiling, masking and head-grouping helpers, which must stay
// together to stay consistent.)
//
// q, out, dq: [B, T, H, D]; k, v, dk, dv: [B, Tk, Hkv, D]. Query head h reads
// KV head h / (H / Hkv); scale = 1 / sqrt(D). The T query rows are positions
// first .. first + T - 1 of the keys' sequence (context parallelism: a
// rank's piece of the queries over all keys; first = 0 and Tk = T
// otherwise), and a causal row at position p sees keys 0 .. p. The semantics are those of the
// CPU kernels (lib/Runtime/Kernels/Attention.cpp), computed tile by tile as in
// FlashAttention-2 so that the T x T scores are never stored:
//
// Forward: one block per (query tile, head, batch) walks the key tiles (up to
// the diagonal when causal) with an online softmax: a running row max m and
// sum l, the output accumulator rescaled by exp(m_old - m_new) when m grows.
// It can also write the row log-sum-exp LSE of the scaled scores and
// Dvec = rowsum(dO * O), which is all the backward needs of the forward.
//
// Backward: from the forward's O and LSE (the forward stores LSE beside O),
// a small kernel writes Dvec = rowsum(dO * O) into the scratch, so that
// P = exp(S - LSE) can be recomputed tile by tile and dS = P * (dP - Dvec)
// with dP = dO V^T, without running the forward again. Then two kernels,
// neither of which accumulates atomically, so results are bitwise
// reproducible:
//   - one block per (key tile, KV head, batch) sums dV += P^T dO and
//     dK += dS^T Q over the query heads of its group and their query tiles,
//     always in the same order, in fp32;
//   - one block per (query tile, head, batch) sums dQ += dS K over key tiles.
//
// bf16 runs on tensor cores (mma.sync m16n8k16 with fp32 accumulation); P
// and dS are rounded to bf16 as operands of the second products, as in
// FlashAttention-2; the bf16 forward of a sequence longer than one tile
// gives each warp two 16-row tiles (blocks of 128 rows), so each K and V
// fragment feeds twice the products. float runs on CUDA cores in fp32:
// tensor cores would round its operands to tf32, far from the CPU kernels'
// results. Scores go through exp2 with log2(e) folded into the scale. Any
// D <= 128 is handled: the head dimension is padded with zeros in shared
// memory.
//
//===----------------------------------------------------------------------===//

#include "Internal.h"

#include "tessel/Runtime/Sequence.h"

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace tessel::cuda {
namespace {

using detail::fromFloat;
using detail::toFloat;

constexpr int kMaxHeadDim = 128;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// What every kernel needs of the problem. Element (b, t, h, d) of q is at
// ((b * T + t) * H + h) * D + d, element (b, t, g, d) of k (KV head g) at
// ((b * Tk + t) * Hkv + g) * D + d; LSE and Dvec are [B, H, T].
struct Dims {
  int T, H, Hkv, D;
  int Tk;    // keys (T unless the queries are a piece of the sequence)
  int first; // the row of query row 0 in the keys' sequence
  // > 0: the queries are in the balanced order of `zigzag` pieces
  // (Sequence.h), one piece of which this call holds.
  int zigzag;
  int group;       // H / Hkv: query heads per KV head
  float scale;     // 1 / sqrt(D)
  float scaleLog2; // scale * log2(e)
  bool causal;
  // Loads may use 16-byte vectors: D is a multiple of the vector's elements
  // and the tensors read into tiles are 16-byte aligned.
  bool vec;
};

__host__ __device__ inline int imin(int a, int b) { return a < b ? a : b; }
__host__ __device__ inline int imax(int a, int b) { return a > b ? a : b; }

//===--- Tensor-core and copy primitives ----------------------------------===//

template <typename E> __device__ __forceinline__ E *dynamicSmem() {
  extern __shared__ __align__(16) unsigned char attentionSmem[];
  return reinterpret_cast<E *>(attentionSmem);
}

__device__ __forceinline__ unsigned smemAddress(const void *p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared without waiting; srcBytes = 0 writes zeros.
__device__ __forceinline__ void cpAsync16(void *dst, const void *src,
                                          int srcBytes) {
  asm volatile(
      "cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smemAddress(dst)),
      "l"(src), "r"(srcBytes));
}
__device__ __forceinline__ void cpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
// Waits until at most N committed groups of this thread are in flight.
template <int N> __device__ __forceinline__ void cpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8x8 bf16 matrices; lane L passes the address of row L % 8 of matrix
// L / 8 and receives, in r[i], row L / 4, columns 2 (L % 4) and 2 (L % 4) + 1
// of matrix i (with .trans: of its transpose).
__device__ __forceinline__ void ldmatrixX4(unsigned r[4], const bf16 *row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smemAddress(row)));
}
__device__ __forceinline__ void ldmatrixX4Trans(unsigned r[4],
                                                const bf16 *row) {
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "r"(smemAddress(row)));
}

// c[16x8] += a[16x16] * b[16x8], bf16 operands, fp32 accumulators. With
// g = lane / 4 and t = lane % 4: a holds rows g, g + 8 and columns 2t, 2t + 1,
// 2t + 8, 2t + 9 (registers: (g, 2t), (g + 8, 2t), (g, 2t + 8),
// (g + 8, 2t + 8), two columns each); b0 holds rows 2t, 2t + 1 of column g,
// b1 rows 2t + 8, 2t + 9; c holds (g, 2t), (g, 2t + 1), (g + 8, 2t),
// (g + 8, 2t + 1).
__device__ __forceinline__ void mma16816(float c[4], const unsigned a[4],
                                         unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two bf16 in one register, `lo` in the low half (the lower column index).
__device__ __forceinline__ unsigned packBf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<unsigned *>(&v);
}

__device__ __forceinline__ float quadMax(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quadSum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

//===--- Kernels ----------------------------------------------------------===//

// Online-softmax step of one row: the new running max of the scaled scores
// (base 2) is `mx`; returns the factor by which the old sum and output
// shrink, and the base the new probabilities are taken against. A row whose
// scores are all masked so far keeps m = -inf and probabilities 0.
__device__ __forceinline__ float rescale(float &m, float mx, float &base) {
  base = mx == -INFINITY ? 0.f : mx;
  const float alpha = exp2f(m - base);
  m = mx;
  return alpha;
}

// The position of query row `row` (< T) among the keys; it grows with the
// row (in the balanced order, the call holds one piece: two runs).
__host__ __device__ __forceinline__ int positionOf(const Dims &s, int row) {
  return s.zigzag > 0
             ? int(rt::zigzagPosition(s.first + row, s.Tk, s.zigzag))
             : s.first + row;
}
// The first query row whose position is at least `key` (T when none is).
__device__ __forceinline__ int firstRowSeeing(const Dims &s, int key) {
  if (s.zigzag == 0)
    return imin(s.T, imax(0, key - s.first));
  const int h = s.T / 2, f0 = positionOf(s, 0), f1 = positionOf(s, h);
  if (key <= f0)
    return 0;
  if (key < f0 + h)
    return key - f0;
  if (key <= f1)
    return h;
  return imin(s.T, h + key - f1);
}
// One past the last key the causal rows [q0, q0 + rows) see.
__device__ __forceinline__ int keyEnd(const Dims &s, int q0, int rows) {
  return imin(s.Tk, positionOf(s, imin(q0 + rows, s.T) - 1) + 1);
}

// Is the score of (query row, key) outside the attention pattern?
__device__ __forceinline__ bool masked(const Dims &s, int row, int key) {
  return key >= s.Tk || row >= s.T || (s.causal && key > positionOf(s, row));
}

// fp32 (CUDA cores). Four threads share a row of the tile; thread part
// p = tid % 4 owns scores of keys p, p + 4, ... of the key tile and the
// 4-column chunks p, p + 4, ... of the row's output or gradient. Tiles live in
// shared memory as [rows][D4 + 4] (D4 = D rounded up to 4, zero-padded), so
// that the float4 reads of the four parts of a quad hit distinct banks.

// Rows [row0, row0 + rows) of one head of a [B, T, heads, D] tensor (`head`
// points at (b, 0, h, 0); rows are rowStride apart; rows from `limit` on
// are zeros) into a shared tile.
__device__ void loadTileF32(float *tile, int stride, const float *head,
                            int64_t rowStride, int row0, int rows, int nt,
                            const Dims &s, int limit) {
  const int chunks = (s.D + 3) / 4;
  for (int idx = threadIdx.x; idx < rows * chunks; idx += nt) {
    const int r = idx / chunks, c = (idx - r * chunks) * 4;
    const int t = row0 + r;
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    if (t < limit) {
      const float *src = head + int64_t(t) * rowStride + c;
      if (s.vec) {
        x = *reinterpret_cast<const float4 *>(src);
      } else {
        x.x = src[0];
        x.y = c + 1 < s.D ? src[1] : 0.f;
        x.z = c + 2 < s.D ? src[2] : 0.f;
        x.w = c + 3 < s.D ? src[3] : 0.f;
      }
    }
    *reinterpret_cast<float4 *>(tile + r * stride + c) = x;
  }
}

__device__ __forceinline__ float dot4(float4 a, float4 b) {
  return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}
__device__ __forceinline__ float4 ld4(const float *p) {
  return *reinterpret_cast<const float4 *>(p);
}
__device__ __forceinline__ void axpy4(float acc[4], float a, float4 x) {
  acc[0] += a * x.x;
  acc[1] += a * x.y;
  acc[2] += a * x.z;
  acc[3] += a * x.w;
}

constexpr int kSimtRowsFwd = 64, kSimtKeysFwd = 32; // forward tiles
constexpr int kSimtRowsBwd = 32;                    // backward tiles (both)

inline int64_t simtForwardSmem(int D) {
  const int S = ((D + 3) & ~3) + 4;
  return int64_t(sizeof(float)) * ((kSimtRowsFwd + 2 * kSimtKeysFwd) * S +
                                   kSimtRowsFwd * (kSimtKeysFwd + 4));
}
inline int64_t simtBackwardSmem(int D) {
  const int S = ((D + 3) & ~3) + 4;
  return int64_t(sizeof(float)) *
         (4 * kSimtRowsBwd * S + 2 * kSimtRowsBwd * (kSimtRowsBwd + 4) +
          2 * kSimtRowsBwd);
}

// Forward, fp32. DMAX: head dimension bound (32, 64 or 128). `out`, `lse`
// and `dvec` (with `dout`) may each be null.
template <int DMAX>
__global__ void __launch_bounds__(256)
    forwardSimt(const float *__restrict__ q, const float *__restrict__ k,
                const float *__restrict__ v, float *__restrict__ out,
                float *__restrict__ lse, const float *__restrict__ dout,
                float *__restrict__ dvec, Dims s) {
  constexpr int BR = kSimtRowsFwd, BC = kSimtKeysFwd, NT = 256;
  constexpr int CH = DMAX / 16; // 4-column chunks per thread
  const int D4 = (s.D + 3) & ~3, S = D4 + 4, PS = BC + 4;
  float *Qs = dynamicSmem<float>();
  float *Ks = Qs + BR * S, *Vs = Ks + BC * S, *Ps = Vs + BC * S;

  // Long causal rows first: the last query tile has the most keys.
  const int q0 = (gridDim.x - 1 - blockIdx.x) * BR;
  const int h = blockIdx.y, b = blockIdx.z, g = h / s.group;
  const int64_t qStride = int64_t(s.H) * s.D, kStride = int64_t(s.Hkv) * s.D;
  const float *qHead = q + (int64_t(b) * s.T * s.H + h) * s.D;
  const float *kHead = k + (int64_t(b) * s.Tk * s.Hkv + g) * s.D;
  const float *vHead = v + (int64_t(b) * s.Tk * s.Hkv + g) * s.D;
  const int r = threadIdx.x >> 2, p = threadIdx.x & 3, row = q0 + r;

  loadTileF32(Qs, S, qHead, qStride, q0, BR, NT, s, s.T);
  float o[CH][4] = {};
  float m = -INFINITY, l = 0.f;
  const int kEnd = s.causal ? keyEnd(s, q0, BR) : s.Tk;
  for (int k0 = 0; k0 < kEnd; k0 += BC) {
    __syncthreads(); // the previous tile is no longer read
    loadTileF32(Ks, S, kHead, kStride, k0, BC, NT, s, s.Tk);
    loadTileF32(Vs, S, vHead, kStride, k0, BC, NT, s, s.Tk);
    __syncthreads();

    float sc[BC / 4] = {};
    const float *qr = Qs + r * S;
    for (int d = 0; d < D4; d += 4) {
      const float4 a = ld4(qr + d);
#pragma unroll
      for (int j = 0; j < BC / 4; ++j)
        sc[j] += dot4(a, ld4(Ks + (p + 4 * j) * S + d));
    }
    float mx = m;
#pragma unroll
    for (int j = 0; j < BC / 4; ++j) {
      sc[j] = masked(s, row, k0 + p + 4 * j) ? -INFINITY : sc[j] * s.scaleLog2;
      mx = fmaxf(mx, sc[j]);
    }
    float base;
    const float alpha = rescale(m, quadMax(mx), base);
    l *= alpha;
#pragma unroll
    for (int j = 0; j < BC / 4; ++j) {
      const float pj = exp2f(sc[j] - base);
      l += pj;
      Ps[r * PS + p + 4 * j] = pj;
    }
#pragma unroll
    for (int i = 0; i < CH; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        o[i][e] *= alpha;
    __syncthreads(); // Ps complete

    for (int j = 0; j < BC; j += 4) {
      const float4 pj = ld4(Ps + r * PS + j);
      const float pw[4] = {pj.x, pj.y, pj.z, pj.w};
#pragma unroll
      for (int jj = 0; jj < 4; ++jj)
#pragma unroll
        for (int i = 0; i < CH; ++i) {
          const int c = 4 * (p + 4 * i);
          if (c < D4)
            axpy4(o[i], pw[jj], ld4(Vs + (j + jj) * S + c));
        }
    }
  }

  l = quadSum(l);
  const float inv = 1.f / l;
  const int64_t rowOffset =
      (int64_t(b) * s.T + row) * qStride + int64_t(h) * s.D;
  float dot = 0.f;
#pragma unroll
  for (int i = 0; i < CH; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int d = 4 * (p + 4 * i) + e;
      if (row < s.T && d < s.D) {
        const float x = o[i][e] * inv;
        if (out)
          out[rowOffset + d] = x;
        if (dvec)
          dot += x * dout[rowOffset + d];
      }
    }
  dot = quadSum(dot);
  if (p == 0 && row < s.T) {
    const int64_t stat = (int64_t(b) * s.H + h) * s.T + row;
    if (lse)
      lse[stat] = (m + log2f(l)) * kLn2;
    if (dvec)
      dvec[stat] = dot;
  }
}

// dK and dV, fp32: one block per (key tile, KV head, batch); thread row r is
// key k0 + r. For each query head of the group, for each query tile: P^T and
// dS^T of the tile into shared memory, then the row's dV += P^T dO and
// dK += dS^T Q.
template <int DMAX>
__global__ void __launch_bounds__(128)
    backwardKvSimt(const float *__restrict__ q, const float *__restrict__ k,
                   const float *__restrict__ v, const float *__restrict__ dout,
                   const float *__restrict__ lse,
                   const float *__restrict__ dvec, float *__restrict__ dk,
                   float *__restrict__ dv, Dims s) {
  constexpr int BK = kSimtRowsBwd, BQ = kSimtRowsBwd, NT = 128;
  constexpr int CH = DMAX / 16;
  const int D4 = (s.D + 3) & ~3, S = D4 + 4, PS = BQ + 4;
  float *Ks = dynamicSmem<float>();
  float *Vs = Ks + BK * S, *Qs = Vs + BK * S, *dOs = Qs + BQ * S;
  float *Ps = dOs + BQ * S, *dSs = Ps + BK * PS, *lse2s = dSs + BK * PS;
  float *dvecs = lse2s + BQ;

  const int k0 = blockIdx.x * BK, g = blockIdx.y, b = blockIdx.z;
  const int64_t qStride = int64_t(s.H) * s.D, kStride = int64_t(s.Hkv) * s.D;
  const int64_t kvOffset = (int64_t(b) * s.Tk * s.Hkv + g) * s.D;
  const int r = threadIdx.x >> 2, p = threadIdx.x & 3, key = k0 + r;

  loadTileF32(Ks, S, k + kvOffset, kStride, k0, BK, NT, s, s.Tk);
  loadTileF32(Vs, S, v + kvOffset, kStride, k0, BK, NT, s, s.Tk);
  float dkAcc[CH][4] = {}, dvAcc[CH][4] = {};
  // Causal: query tiles entirely above the diagonal see none of these keys
  // (the rows before position k0).
  const int qStart = s.causal ? firstRowSeeing(s, k0) / BQ * BQ : 0;
  for (int hh = 0; hh < s.group; ++hh) {
    const int h = g * s.group + hh;
    const int64_t qOffset = (int64_t(b) * s.T * s.H + h) * s.D;
    const int64_t statOffset = (int64_t(b) * s.H + h) * s.T;
    for (int q0 = qStart; q0 < s.T; q0 += BQ) {
      __syncthreads(); // the previous tile is no longer read
      loadTileF32(Qs, S, q + qOffset, qStride, q0, BQ, NT, s, s.T);
      loadTileF32(dOs, S, dout + qOffset, qStride, q0, BQ, NT, s, s.T);
      for (int i = threadIdx.x; i < BQ; i += NT) {
        const bool in = q0 + i < s.T;
        lse2s[i] = in ? lse[statOffset + q0 + i] * kLog2e : 0.f;
        dvecs[i] = in ? dvec[statOffset + q0 + i] : 0.f;
      }
      __syncthreads();

      float sc[BQ / 4] = {}, dp[BQ / 4] = {};
      for (int d = 0; d < D4; d += 4) {
        const float4 kr = ld4(Ks + r * S + d), vr = ld4(Vs + r * S + d);
#pragma unroll
        for (int j = 0; j < BQ / 4; ++j) {
          sc[j] += dot4(kr, ld4(Qs + (p + 4 * j) * S + d));
          dp[j] += dot4(vr, ld4(dOs + (p + 4 * j) * S + d));
        }
      }
#pragma unroll
      for (int j = 0; j < BQ / 4; ++j) {
        const int i = p + 4 * j;
        const float pr = masked(s, q0 + i, key)
                             ? 0.f
                             : exp2f(sc[j] * s.scaleLog2 - lse2s[i]);
        Ps[r * PS + i] = pr;
        dSs[r * PS + i] = pr * (dp[j] - dvecs[i]);
      }
      __syncthreads(); // Ps and dSs complete

      for (int i = 0; i < BQ; i += 4) {
        const float4 p4 = ld4(Ps + r * PS + i), s4 = ld4(dSs + r * PS + i);
        const float pw[4] = {p4.x, p4.y, p4.z, p4.w};
        const float sw[4] = {s4.x, s4.y, s4.z, s4.w};
#pragma unroll
        for (int ii = 0; ii < 4; ++ii)
#pragma unroll
          for (int c = 0; c < CH; ++c) {
            const int col = 4 * (p + 4 * c);
            if (col < D4) {
              axpy4(dvAcc[c], pw[ii], ld4(dOs + (i + ii) * S + col));
              axpy4(dkAcc[c], sw[ii], ld4(Qs + (i + ii) * S + col));
            }
          }
      }
    }
  }

  if (key >= s.Tk)
    return;
  const int64_t rowOffset = kvOffset + int64_t(key) * kStride;
#pragma unroll
  for (int c = 0; c < CH; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int d = 4 * (p + 4 * c) + e;
      if (d < s.D) {
        dk[rowOffset + d] = dkAcc[c][e] * s.scale;
        dv[rowOffset + d] = dvAcc[c][e];
      }
    }
}

// dQ, fp32: one block per (query tile, head, batch); thread row r is query
// q0 + r. For each key tile: dS of the tile into shared memory, then the
// row's dQ += dS K.
template <int DMAX>
__global__ void __launch_bounds__(128)
    backwardQSimt(const float *__restrict__ q, const float *__restrict__ k,
                  const float *__restrict__ v, const float *__restrict__ dout,
                  const float *__restrict__ lse, const float *__restrict__ dvec,
                  float *__restrict__ dq, Dims s) {
  constexpr int BQ = kSimtRowsBwd, BK = kSimtRowsBwd, NT = 128;
  constexpr int CH = DMAX / 16;
  const int D4 = (s.D + 3) & ~3, S = D4 + 4, PS = BK + 4;
  float *Qs = dynamicSmem<float>();
  float *dOs = Qs + BQ * S, *Ks = dOs + BQ * S, *Vs = Ks + BK * S;
  float *dSs = Vs + BK * S;

  const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;
  const int h = blockIdx.y, b = blockIdx.z, g = h / s.group;
  const int64_t qStride = int64_t(s.H) * s.D, kStride = int64_t(s.Hkv) * s.D;
  const int64_t qOffset = (int64_t(b) * s.T * s.H + h) * s.D;
  const int64_t kvOffset = (int64_t(b) * s.Tk * s.Hkv + g) * s.D;
  const int r = threadIdx.x >> 2, p = threadIdx.x & 3, row = q0 + r;
  const int64_t stat = (int64_t(b) * s.H + h) * s.T + row;
  const float lse2 = row < s.T ? lse[stat] * kLog2e : 0.f;
  const float dvecRow = row < s.T ? dvec[stat] : 0.f;

  loadTileF32(Qs, S, q + qOffset, qStride, q0, BQ, NT, s, s.T);
  loadTileF32(dOs, S, dout + qOffset, qStride, q0, BQ, NT, s, s.T);
  float dqAcc[CH][4] = {};
  const int kEnd = s.causal ? keyEnd(s, q0, BQ) : s.Tk;
  for (int k0 = 0; k0 < kEnd; k0 += BK) {
    __syncthreads(); // the previous tile is no longer read
    loadTileF32(Ks, S, k + kvOffset, kStride, k0, BK, NT, s, s.Tk);
    loadTileF32(Vs, S, v + kvOffset, kStride, k0, BK, NT, s, s.Tk);
    __syncthreads();

    float sc[BK / 4] = {}, dp[BK / 4] = {};
    for (int d = 0; d < D4; d += 4) {
      const float4 qr = ld4(Qs + r * S + d), dr = ld4(dOs + r * S + d);
#pragma unroll
      for (int j = 0; j < BK / 4; ++j) {
        sc[j] += dot4(qr, ld4(Ks + (p + 4 * j) * S + d));
        dp[j] += dot4(dr, ld4(Vs + (p + 4 * j) * S + d));
      }
    }
#pragma unroll
    for (int j = 0; j < BK / 4; ++j) {
      const float pr = masked(s, row, k0 + p + 4 * j)
                           ? 0.f
                           : exp2f(sc[j] * s.scaleLog2 - lse2);
      dSs[r * PS + p + 4 * j] = pr * (dp[j] - dvecRow);
    }
    __syncthreads(); // dSs complete

    for (int j = 0; j < BK; j += 4) {
      const float4 s4 = ld4(dSs + r * PS + j);
      const float sw[4] = {s4.x, s4.y, s4.z, s4.w};
#pragma unroll
      for (int jj = 0; jj < 4; ++jj)
#pragma unroll
        for (int c = 0; c < CH; ++c) {
          const int col = 4 * (p + 4 * c);
          if (col < D4)
            axpy4(dqAcc[c], sw[jj], ld4(Ks + (j + jj) * S + col));
        }
    }
  }

  if (row >= s.T)
    return;
  const int64_t rowOffset = qOffset + int64_t(row) * qStride;
#pragma unroll
  for (int c = 0; c < CH; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int d = 4 * (p + 4 * c) + e;
      if (d < s.D)
        dq[rowOffset + d] = dqAcc[c][e] * s.scale;
    }
}

// bf16 (tensor cores). Four warps per block; each warp owns 16 rows of the
// block's tile (queries in the forward and dQ kernels, keys in the dK/dV
// kernel). Tiles live in shared memory as [rows][DP + 8] bf16: DP is the
// padded head dimension (64 or 128), the 8 extra columns put the 8 rows an
// ldmatrix phase reads on distinct banks. Columns [0, D16) are filled, D16 =
// D rounded up to 16 (zeros beyond D); the k-chunks and column tiles of the
// products stop at D16.

// Rows [row0, row0 + ROWS) of one head into a shared tile of DP columns, by
// cp.async when s.vec (then the caller commits and waits), else by plain
// stores; columns from D on, and rows from `limit` on, are zeros. The chunk count is a compile-time
// constant, so the index arithmetic is shifts (the loop stays rolled: its
// addresses would take registers the products need).
template <int ROWS, int NT, int DP>
__device__ __forceinline__ void
loadTileBf16(bf16 *tile, int stride, const bf16 *head, int64_t rowStride,
             int row0, const Dims &s, int limit) {
  constexpr int chunks = DP / 8, total = ROWS * chunks;
#pragma unroll 1
  for (int it = 0; it < (total + NT - 1) / NT; ++it) {
    const int idx = threadIdx.x + it * NT;
    if (total % NT != 0 && idx >= total)
      break;
    const int r = idx / chunks, c = (idx % chunks) * 8;
    const int t = row0 + r;
    bf16 *dst = tile + r * stride + c;
    const bool in = t < limit && c < s.D;
    if (s.vec) {
      cpAsync16(dst, in ? head + int64_t(t) * rowStride + c : head,
                in ? 16 : 0);
    } else {
      const bf16 *src = head + int64_t(t) * rowStride + c;
#pragma unroll
      for (int e = 0; e < 8; ++e)
        dst[e] = in && c + e < s.D ? src[e] : fromFloat<bf16>(0.f);
    }
  }
}

// Two adjacent bf16 of a row, columns d and d + 1 (d even), with one 4-byte
// store where both are inside the row and the address allows it.
__device__ __forceinline__ void storePairBf16(bf16 *row, int d, int D, float x0,
                                              float x1) {
  bf16 *dst = row + d;
  if (d + 1 < D && (reinterpret_cast<uintptr_t>(dst) & 3) == 0) {
    *reinterpret_cast<__nv_bfloat162 *>(dst) = __floats2bfloat162_rn(x0, x1);
  } else {
    if (d < D)
      dst[0] = fromFloat<bf16>(x0);
    if (d + 1 < D)
      dst[1] = fromFloat<bf16>(x1);
  }
}

// Shared-memory row address lane `lane` passes to ldmatrix for:
// - an A operand (rows m0.., columns k0.. of a [m][k] tile), and equally the
//   B operands of column tiles n0 and n0 + 8 from a [k][n] tile (.trans):
//   r0 r1 for n0, r2 r3 for n0 + 8;
__device__ __forceinline__ const bf16 *fragRowsA(const bf16 *tile, int stride,
                                                 int row0, int col0, int lane) {
  return tile + (row0 + (lane & 15)) * stride + col0 + (lane >> 4) * 8;
}
// - the B operands of column tiles n0 and n0 + 8 (r0 r1 and r2 r3) from a
//   [n][k] tile (rows n0.., columns k0..), without .trans.
__device__ __forceinline__ const bf16 *fragRowsB(const bf16 *tile, int stride,
                                                 int n0, int k0, int lane) {
  return tile + (n0 + (lane & 7) + ((lane >> 4) << 3)) * stride + k0 +
         ((lane >> 3) & 1) * 8;
}

constexpr int kMmaRows = 64;         // rows of a backward block (4 warps x 16)
constexpr int kMmaForwardRows = 128; // rows of a forward block (4 warps x 32)
template <int DP> constexpr int mmaKeysFwd() { return 64; }
template <int DP> constexpr int mmaQueriesKv() { return DP > 64 ? 32 : 64; }
template <int DP> constexpr int mmaKeysQ() { return DP > 64 ? 32 : 64; }

template <int DP> int64_t mmaForwardSmem() {
  return int64_t(sizeof(bf16)) * (kMmaForwardRows + 2 * mmaKeysFwd<DP>()) *
         (DP + 8);
}
// The backward kernels double-buffer the tiles they stream (Q, dO and the
// row statistics; K and V).
template <int DP> int64_t mmaBackwardKvSmem() {
  return int64_t(sizeof(bf16)) * (2 * kMmaRows + 4 * mmaQueriesKv<DP>()) *
             (DP + 8) +
         int64_t(sizeof(float)) * 4 * mmaQueriesKv<DP>();
}
template <int DP> int64_t mmaBackwardQSmem() {
  return int64_t(sizeof(bf16)) * (2 * kMmaRows + 4 * mmaKeysQ<DP>()) * (DP + 8);
}

// Forward, bf16, two row tiles per warp (as FlashAttention-2 does): a block
// of 128 query rows, warp w owning rows 32 w... as two 16-row tiles, so each
// K and V fragment read from shared memory feeds four products instead of
// two (0.88 instead of 1.01 ms with one tile per warp for the 1.3B GPT's
// layer, B 8, T 2048, 16 heads of 128, on an H200). Q stays in shared
// memory (its fragments are read per key tile: held in registers beside two
// tiles of accumulators they would spill). K and V tiles are
// single-buffered but loaded one phase ahead: the next K tile while P V
// runs, the next V tile while the next scores run. Every iteration commits
// exactly two cp.async groups (K, then V, possibly empty), so waiting for
// all but the newest group always completes the tile about to be read.
template <int DP>
__global__ void __launch_bounds__(128, 2)
    forwardMma(const bf16 *__restrict__ q, const bf16 *__restrict__ k,
               const bf16 *__restrict__ v, bf16 *__restrict__ out,
               float *__restrict__ lse, const bf16 *__restrict__ dout,
               float *__restrict__ dvec, Dims s) {
  constexpr int BR = kMmaForwardRows, BC = mmaKeysFwd<DP>(), NT = 128;
  constexpr int S = DP + 8, MT = 2;
  bf16 *Qs = dynamicSmem<bf16>();
  bf16 *Ks = Qs + BR * S, *Vs = Ks + BC * S;

  const int q0 = (gridDim.x - 1 - blockIdx.x) * BR;
  const int h = blockIdx.y, b = blockIdx.z, g = h / s.group;
  const int64_t qStride = int64_t(s.H) * s.D, kStride = int64_t(s.Hkv) * s.D;
  const bf16 *qHead = q + (int64_t(b) * s.T * s.H + h) * s.D;
  const bf16 *kHead = k + (int64_t(b) * s.Tk * s.Hkv + g) * s.D;
  const bf16 *vHead = v + (int64_t(b) * s.Tk * s.Hkv + g) * s.D;
  const int d16 = (s.D + 15) & ~15, chunks = d16 / 16;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gq = lane >> 2, tq = lane & 3;
  const int kEnd = s.causal ? keyEnd(s, q0, BR) : s.Tk;

  loadTileBf16<BR, NT, DP>(Qs, S, qHead, qStride, q0, s, s.T);
  loadTileBf16<BC, NT, DP>(Ks, S, kHead, kStride, 0, s, s.Tk);
  cpAsyncCommit();
  loadTileBf16<BC, NT, DP>(Vs, S, vHead, kStride, 0, s, s.Tk);
  cpAsyncCommit();

  float o[MT][DP / 8][4] = {};
  float m[MT][2], l[MT][2]; // rows gq, gq + 8 of each tile
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      m[mt][i] = -INFINITY;
      l[mt][i] = 0.f;
    }
  for (int k0 = 0; k0 < kEnd; k0 += BC) {
    cpAsyncWait<1>(); // this K tile (and, the first time, Q)
    __syncthreads();

    float sc[MT][BC / 8][4] = {};
#pragma unroll
    for (int kc = 0; kc < DP / 16; ++kc) {
      if (kc >= chunks)
        break;
      unsigned qa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        ldmatrixX4(qa[mt],
                   fragRowsA(Qs, S, warp * 32 + mt * 16, kc * 16, lane));
#pragma unroll
      for (int np = 0; np < BC / 16; ++np) {
        unsigned kb[4];
        ldmatrixX4(kb, fragRowsB(Ks, S, np * 16, kc * 16, lane));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816(sc[mt][2 * np], qa[mt], kb[0], kb[1]);
          mma16816(sc[mt][2 * np + 1], qa[mt], kb[2], kb[3]);
        }
      }
    }
    __syncthreads(); // every warp is done with Ks
    if (k0 + BC < kEnd)
      loadTileBf16<BC, NT, DP>(Ks, S, kHead, kStride, k0 + BC, s, s.Tk);
    cpAsyncCommit();

    // Online softmax of each tile's rows gq (elements 0, 1) and gq + 8 (2,
    // 3). The max is taken of the unscaled scores (scaling by a positive
    // factor keeps it), and the scale folds into the exponent's
    // multiply-add.
    const bool edge =
        k0 + BC > s.Tk || (s.causal && k0 + BC - 1 > positionOf(s, q0));
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int row0 = q0 + warp * 32 + mt * 16 + gq;
      float mxRaw[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (edge &&
              masked(s, row0 + (e >> 1) * 8, k0 + nt * 8 + 2 * tq + (e & 1)))
            sc[mt][nt][e] = -INFINITY;
          mxRaw[e >> 1] = fmaxf(mxRaw[e >> 1], sc[mt][nt][e]);
        }
      float base[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float mx = fmaxf(m[mt][i], quadMax(mxRaw[i]) * s.scaleLog2);
        const float alpha = rescale(m[mt][i], mx, base[i]);
        l[mt][i] *= alpha;
#pragma unroll
        for (int dt = 0; dt < DP / 8; ++dt) {
          o[mt][dt][2 * i] *= alpha;
          o[mt][dt][2 * i + 1] *= alpha;
        }
      }
#pragma unroll
      for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          sc[mt][nt][e] =
              exp2f(fmaf(sc[mt][nt][e], s.scaleLog2, -base[e >> 1]));
          l[mt][e >> 1] += sc[mt][nt][e];
        }
    }

    cpAsyncWait<1>(); // this V tile
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
      unsigned pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        pa[mt][0] = packBf16(sc[mt][2 * kk][0], sc[mt][2 * kk][1]);
        pa[mt][1] = packBf16(sc[mt][2 * kk][2], sc[mt][2 * kk][3]);
        pa[mt][2] = packBf16(sc[mt][2 * kk + 1][0], sc[mt][2 * kk + 1][1]);
        pa[mt][3] = packBf16(sc[mt][2 * kk + 1][2], sc[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dc = 0; dc < DP / 16; ++dc) {
        if (dc >= chunks)
          break;
        unsigned vb[4];
        ldmatrixX4Trans(vb, fragRowsA(Vs, S, kk * 16, dc * 16, lane));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816(o[mt][2 * dc], pa[mt], vb[0], vb[1]);
          mma16816(o[mt][2 * dc + 1], pa[mt], vb[2], vb[3]);
        }
      }
    }
    __syncthreads(); // every warp is done with Vs
    if (k0 + BC < kEnd)
      loadTileBf16<BC, NT, DP>(Vs, S, vHead, kStride, k0 + BC, s, s.Tk);
    cpAsyncCommit();
  }
  cpAsyncWait<0>();

  const int64_t statOffset = (int64_t(b) * s.H + h) * s.T;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = q0 + warp * 32 + mt * 16 + gq + i * 8;
      const float sum = quadSum(l[mt][i]), inv = 1.f / sum;
      const int64_t rowOffset =
          (int64_t(b) * s.T + row) * qStride + int64_t(h) * s.D;
      float dot = 0.f;
#pragma unroll
      for (int dt = 0; dt < DP / 8; ++dt) {
        const int d = dt * 8 + 2 * tq;
        if (row >= s.T || d >= s.D)
          continue;
        const float x0 = o[mt][dt][2 * i] * inv,
                    x1 = o[mt][dt][2 * i + 1] * inv;
        if (out)
          storePairBf16(out + rowOffset, d, s.D, x0, x1);
        if (dvec) {
          dot += x0 * toFloat(dout[rowOffset + d]);
          if (d + 1 < s.D)
            dot += x1 * toFloat(dout[rowOffset + d + 1]);
        }
      }
      dot = quadSum(dot);
      if (tq == 0 && row < s.T) {
        if (lse)
          lse[statOffset + row] = (m[mt][i] + log2f(sum)) * kLn2;
        if (dvec)
          dvec[statOffset + row] = dot;
      }
    }
}

// dK and dV, bf16: one block per (key tile of 64, KV head, batch); warp w
// owns keys k0 + 16 w... The block steps through the query tiles of BQ rows
// of each query head of the group, in order: S^T = K Q^T and dP^T = V dO^T,
// P^T and dS^T in registers, then dV += P^T dO and dK += dS^T Q. The next
// step's Q, dO and statistics load into the other buffer meanwhile.
template <int DP>
__global__ void __launch_bounds__(128)
    backwardKvMma(const bf16 *__restrict__ q, const bf16 *__restrict__ k,
                  const bf16 *__restrict__ v, const bf16 *__restrict__ dout,
                  const float *__restrict__ lse, const float *__restrict__ dvec,
                  bf16 *__restrict__ dk, bf16 *__restrict__ dv, Dims s) {
  constexpr int BK = kMmaRows, BQ = mmaQueriesKv<DP>(), NT = 128, S = DP + 8;
  bf16 *Ks = dynamicSmem<bf16>();
  bf16 *Vs = Ks + BK * S, *Qs = Vs + BK * S, *dOs = Qs + 2 * BQ * S;
  float *lse2s = reinterpret_cast<float *>(dOs + 2 * BQ * S);
  float *dvecs = lse2s + 2 * BQ;

  const int k0 = blockIdx.x * BK, g = blockIdx.y, b = blockIdx.z;
  const int64_t qStride = int64_t(s.H) * s.D, kStride = int64_t(s.Hkv) * s.D;
  const int64_t kvOffset = (int64_t(b) * s.Tk * s.Hkv + g) * s.D;
  const int d16 = (s.D + 15) & ~15, chunks = d16 / 16;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gq = lane >> 2, tq = lane & 3;
  const int key0 = k0 + warp * 16 + gq; // keys of fragment rows: key0, key0+8
  // Causal: query tiles entirely above the diagonal see none of these keys
  // (the rows before position k0; none of a piece that ends before it).
  const int qStart = s.causal ? firstRowSeeing(s, k0) / BQ * BQ : 0;
  const int qTiles = imax(0, (s.T - qStart + BQ - 1) / BQ);
  const int steps = s.group * qTiles;

  // Step n is query tile n % qTiles of head g * group + n / qTiles.
  auto stepHead = [&](int n) { return g * s.group + n / qTiles; };
  auto stepRow = [&](int n) { return qStart + n % qTiles * BQ; };
  auto load = [&](int n, int buf) {
    const int h = stepHead(n), q0 = stepRow(n);
    const int64_t qOffset = (int64_t(b) * s.T * s.H + h) * s.D;
    const int64_t statOffset = (int64_t(b) * s.H + h) * s.T;
    loadTileBf16<BQ, NT, DP>(Qs + buf * BQ * S, S, q + qOffset, qStride, q0, s,
                             s.T);
    loadTileBf16<BQ, NT, DP>(dOs + buf * BQ * S, S, dout + qOffset, qStride, q0,
                             s, s.T);
    for (int i = threadIdx.x; i < BQ; i += NT) {
      const bool in = q0 + i < s.T;
      lse2s[buf * BQ + i] = in ? lse[statOffset + q0 + i] * kLog2e : 0.f;
      dvecs[buf * BQ + i] = in ? dvec[statOffset + q0 + i] : 0.f;
    }
  };

  loadTileBf16<BK, NT, DP>(Ks, S, k + kvOffset, kStride, k0, s, s.Tk);
  loadTileBf16<BK, NT, DP>(Vs, S, v + kvOffset, kStride, k0, s, s.Tk);
  if (steps > 0)
    load(0, 0);
  cpAsyncCommit();
  float dkAcc[DP / 8][4] = {}, dvAcc[DP / 8][4] = {};
  for (int n = 0; n < steps; ++n) {
    const int buf = n & 1;
    // Step n's tiles have landed, and every warp is done with step n - 1,
    // whose buffer the next load reuses.
    cpAsyncWait<0>();
    __syncthreads();
    if (n + 1 < steps)
      load(n + 1, buf ^ 1);
    cpAsyncCommit();

    const int q0 = stepRow(n);
    const bf16 *Qt = Qs + buf * BQ * S, *dOt = dOs + buf * BQ * S;
    const float *lse2t = lse2s + buf * BQ, *dvect = dvecs + buf * BQ;
    float sT[BQ / 8][4] = {}, dpT[BQ / 8][4] = {};
#pragma unroll
    for (int kc = 0; kc < DP / 16; ++kc) {
      if (kc >= chunks)
        break;
      unsigned ka[4], va[4];
      ldmatrixX4(ka, fragRowsA(Ks, S, warp * 16, kc * 16, lane));
      ldmatrixX4(va, fragRowsA(Vs, S, warp * 16, kc * 16, lane));
#pragma unroll
      for (int np = 0; np < BQ / 16; ++np) {
        unsigned qb[4], ob[4];
        ldmatrixX4(qb, fragRowsB(Qt, S, np * 16, kc * 16, lane));
        mma16816(sT[2 * np], ka, qb[0], qb[1]);
        mma16816(sT[2 * np + 1], ka, qb[2], qb[3]);
        ldmatrixX4(ob, fragRowsB(dOt, S, np * 16, kc * 16, lane));
        mma16816(dpT[2 * np], va, ob[0], ob[1]);
        mma16816(dpT[2 * np + 1], va, ob[2], ob[3]);
      }
    }
    // P^T into sT, dS^T into dpT. Only tiles at the diagonal or the end of
    // the sequence test each score against the pattern.
    const bool edge = q0 + BQ > s.T || k0 + BK > s.Tk ||
                      (s.causal && k0 + BK - 1 > positionOf(s, q0));
#pragma unroll
    for (int nt = 0; nt < BQ / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = nt * 8 + 2 * tq + (e & 1);
        const float pr = edge && masked(s, q0 + i, key0 + (e >> 1) * 8)
                             ? 0.f
                             : exp2f(fmaf(sT[nt][e], s.scaleLog2, -lse2t[i]));
        sT[nt][e] = pr;
        dpT[nt][e] = pr * (dpT[nt][e] - dvect[i]);
      }
#pragma unroll
    for (int qc = 0; qc < BQ / 16; ++qc) {
      const unsigned pa[4] = {packBf16(sT[2 * qc][0], sT[2 * qc][1]),
                              packBf16(sT[2 * qc][2], sT[2 * qc][3]),
                              packBf16(sT[2 * qc + 1][0], sT[2 * qc + 1][1]),
                              packBf16(sT[2 * qc + 1][2], sT[2 * qc + 1][3])};
      const unsigned sa[4] = {packBf16(dpT[2 * qc][0], dpT[2 * qc][1]),
                              packBf16(dpT[2 * qc][2], dpT[2 * qc][3]),
                              packBf16(dpT[2 * qc + 1][0], dpT[2 * qc + 1][1]),
                              packBf16(dpT[2 * qc + 1][2], dpT[2 * qc + 1][3])};
#pragma unroll
      for (int dc = 0; dc < DP / 16; ++dc) {
        if (dc >= chunks)
          break;
        unsigned ob[4], qb[4];
        ldmatrixX4Trans(ob, fragRowsA(dOt, S, qc * 16, dc * 16, lane));
        mma16816(dvAcc[2 * dc], pa, ob[0], ob[1]);
        mma16816(dvAcc[2 * dc + 1], pa, ob[2], ob[3]);
        ldmatrixX4Trans(qb, fragRowsA(Qt, S, qc * 16, dc * 16, lane));
        mma16816(dkAcc[2 * dc], sa, qb[0], qb[1]);
        mma16816(dkAcc[2 * dc + 1], sa, qb[2], qb[3]);
      }
    }
  }
  cpAsyncWait<0>(); // nothing in flight at exit

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int key = key0 + i * 8;
    if (key >= s.Tk)
      continue;
    const int64_t rowOffset = kvOffset + int64_t(key) * kStride;
#pragma unroll
    for (int dt = 0; dt < DP / 8; ++dt) {
      const int d = dt * 8 + 2 * tq;
      if (d >= s.D)
        continue;
      storePairBf16(dk + rowOffset, d, s.D, dkAcc[dt][2 * i] * s.scale,
                    dkAcc[dt][2 * i + 1] * s.scale);
      storePairBf16(dv + rowOffset, d, s.D, dvAcc[dt][2 * i],
                    dvAcc[dt][2 * i + 1]);
    }
  }
}

// dQ, bf16: one block per (query tile of 64, head, batch); warp w owns rows
// q0 + 16 w... For each key tile: S = Q K^T and dP = dO V^T, dS in registers,
// then dQ += dS K. The next K and V tiles load into the other buffer
// meanwhile.
template <int DP>
__global__ void __launch_bounds__(128)
    backwardQMma(const bf16 *__restrict__ q, const bf16 *__restrict__ k,
                 const bf16 *__restrict__ v, const bf16 *__restrict__ dout,
                 const float *__restrict__ lse, const float *__restrict__ dvec,
                 bf16 *__restrict__ dq, Dims s) {
  constexpr int BQ = kMmaRows, BK = mmaKeysQ<DP>(), NT = 128, S = DP + 8;
  bf16 *Qs = dynamicSmem<bf16>();
  bf16 *dOs = Qs + BQ * S, *Ks = dOs + BQ * S, *Vs = Ks + 2 * BK * S;

  const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;
  const int h = blockIdx.y, b = blockIdx.z, g = h / s.group;
  const int64_t qStride = int64_t(s.H) * s.D, kStride = int64_t(s.Hkv) * s.D;
  const int64_t qOffset = (int64_t(b) * s.T * s.H + h) * s.D;
  const int64_t kvOffset = (int64_t(b) * s.Tk * s.Hkv + g) * s.D;
  const int64_t statOffset = (int64_t(b) * s.H + h) * s.T;
  const int d16 = (s.D + 15) & ~15, chunks = d16 / 16;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gq = lane >> 2, tq = lane & 3;
  const int row0 = q0 + warp * 16 + gq; // rows of fragment rows: row0, row0+8
  float lse2[2], dvecRow[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = row0 + i * 8;
    lse2[i] = row < s.T ? lse[statOffset + row] * kLog2e : 0.f;
    dvecRow[i] = row < s.T ? dvec[statOffset + row] : 0.f;
  }

  const int kEnd = s.causal ? keyEnd(s, q0, BQ) : s.Tk;
  const int kTiles = (kEnd + BK - 1) / BK;
  auto load = [&](int j, int buf) {
    loadTileBf16<BK, NT, DP>(Ks + buf * BK * S, S, k + kvOffset, kStride,
                             j * BK, s, s.Tk);
    loadTileBf16<BK, NT, DP>(Vs + buf * BK * S, S, v + kvOffset, kStride,
                             j * BK, s, s.Tk);
  };
  loadTileBf16<BQ, NT, DP>(Qs, S, q + qOffset, qStride, q0, s, s.T);
  loadTileBf16<BQ, NT, DP>(dOs, S, dout + qOffset, qStride, q0, s, s.T);
  load(0, 0);
  cpAsyncCommit();
  float dqAcc[DP / 8][4] = {};
  for (int j = 0; j < kTiles; ++j) {
    const int buf = j & 1, k0 = j * BK;
    // Tile j has landed, and every warp is done with tile j - 1, whose
    // buffer the next load reuses.
    cpAsyncWait<0>();
    __syncthreads();
    if (j + 1 < kTiles)
      load(j + 1, buf ^ 1);
    cpAsyncCommit();

    const bf16 *Kt = Ks + buf * BK * S, *Vt = Vs + buf * BK * S;
    float sc[BK / 8][4] = {}, dp[BK / 8][4] = {};
#pragma unroll
    for (int kc = 0; kc < DP / 16; ++kc) {
      if (kc >= chunks)
        break;
      unsigned qa[4], oa[4];
      ldmatrixX4(qa, fragRowsA(Qs, S, warp * 16, kc * 16, lane));
      ldmatrixX4(oa, fragRowsA(dOs, S, warp * 16, kc * 16, lane));
#pragma unroll
      for (int np = 0; np < BK / 16; ++np) {
        unsigned kb[4], vb[4];
        ldmatrixX4(kb, fragRowsB(Kt, S, np * 16, kc * 16, lane));
        mma16816(sc[2 * np], qa, kb[0], kb[1]);
        mma16816(sc[2 * np + 1], qa, kb[2], kb[3]);
        ldmatrixX4(vb, fragRowsB(Vt, S, np * 16, kc * 16, lane));
        mma16816(dp[2 * np], oa, vb[0], vb[1]);
        mma16816(dp[2 * np + 1], oa, vb[2], vb[3]);
      }
    }
    // dS into sc. Only tiles at the diagonal or the end of the sequence
    // test each score against the pattern.
    const bool edge = q0 + BQ > s.T || k0 + BK > s.Tk ||
                      (s.causal && k0 + BK - 1 > positionOf(s, q0));
#pragma unroll
    for (int nt = 0; nt < BK / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = e >> 1;
        const float pr =
            edge && masked(s, row0 + i * 8, k0 + nt * 8 + 2 * tq + (e & 1))
                ? 0.f
                : exp2f(fmaf(sc[nt][e], s.scaleLog2, -lse2[i]));
        sc[nt][e] = pr * (dp[nt][e] - dvecRow[i]);
      }
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      const unsigned sa[4] = {packBf16(sc[2 * kk][0], sc[2 * kk][1]),
                              packBf16(sc[2 * kk][2], sc[2 * kk][3]),
                              packBf16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                              packBf16(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
      for (int dc = 0; dc < DP / 16; ++dc) {
        if (dc >= chunks)
          break;
        unsigned kb[4];
        ldmatrixX4Trans(kb, fragRowsA(Kt, S, kk * 16, dc * 16, lane));
        mma16816(dqAcc[2 * dc], sa, kb[0], kb[1]);
        mma16816(dqAcc[2 * dc + 1], sa, kb[2], kb[3]);
      }
    }
  }
  cpAsyncWait<0>(); // nothing in flight at exit

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = row0 + i * 8;
    if (row >= s.T)
      continue;
    const int64_t rowOffset = qOffset + int64_t(row) * qStride;
#pragma unroll
    for (int dt = 0; dt < DP / 8; ++dt) {
      const int d = dt * 8 + 2 * tq;
      if (d < s.D)
        storePairBf16(dq + rowOffset, d, s.D, dqAcc[dt][2 * i] * s.scale,
                      dqAcc[dt][2 * i + 1] * s.scale);
    }
  }
}

// Dvec[b, h, t] = sum_d dO[b, t, h, d] * O[b, t, h, d] in fp32: one warp per
// row (b, t, h), D <= 128, so each lane takes at most four columns.
template <typename T>
__global__ void __launch_bounds__(256)
    rowDotKernel(const T *__restrict__ dout, const T *__restrict__ out,
                 float *__restrict__ dvec, int64_t rows, Dims s) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x >> 5);
  for (int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
       row < rows; row += warps) {
    const T *a = dout + row * s.D, *o = out + row * s.D;
    float acc = 0.f;
    for (int d = lane; d < s.D; d += 32)
      acc = fmaf(toFloat(a[d]), toFloat(o[d]), acc);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
      acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) {
      const int64_t h = row % s.H, bt = row / s.H;
      const int64_t t = bt % s.T, b = bt / s.T;
      dvec[(b * s.H + h) * s.T + t] = acc;
    }
  }
}

//===--- Launchers --------------------------------------------------------===//

int64_t align256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

bool aligned16(const void *p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// Validates the shape (throws for what the kernels cannot do) and fills
// Dims; returns false when there is nothing to compute.
bool makeDims(const char *what, int64_t B, int64_t Tlen, int64_t H, int64_t Hkv,
              int64_t D, bool causal, int64_t kvLen, int64_t first,
              int64_t zigzag, Dims &s) {
  if (B <= 0 || Tlen <= 0 || H <= 0 || D <= 0)
    return false;
  const std::string name = std::string("CUDA ") + what + ": ";
  const int64_t Tk = kvLen > 0 ? kvLen : Tlen;
  if (first < 0 || first + Tlen > Tk)
    throw std::runtime_error(name + "query rows " + std::to_string(first) +
                             " .. " + std::to_string(first + Tlen - 1) +
                             " lie outside the " + std::to_string(Tk) +
                             " keys");
  // The tiles need positions that grow with the rows: one piece of the
  // balanced order.
  if (zigzag < 0 || (zigzag > 0 && (Tk % (2 * zigzag) != 0 ||
                                    Tlen != Tk / zigzag || first % Tlen != 0)))
    throw std::runtime_error(name + "query rows " + std::to_string(first) +
                             " .. " + std::to_string(first + Tlen - 1) +
                             " are not one of " + std::to_string(zigzag) +
                             " balanced pieces of " + std::to_string(Tk) +
                             " keys");
  if (D > kMaxHeadDim)
    throw std::runtime_error(name + "head dimension " + std::to_string(D) +
                             " exceeds " + std::to_string(kMaxHeadDim) +
                             ", the largest the kernels support");
  if (Hkv <= 0 || H % Hkv != 0)
    throw std::runtime_error(name + "H = " + std::to_string(H) +
                             " query heads are not a multiple of Hkv = " +
                             std::to_string(Hkv) + " KV heads");
  if (Tk > INT32_MAX / 2 || H > 65535 || B > 65535)
    throw std::runtime_error(name + "B = " + std::to_string(B) +
                             ", T = " + std::to_string(Tk) +
                             ", H = " + std::to_string(H) +
                             " exceed the grid (T < 2^30, B and H <= 65535)");
  s.T = int(Tlen);
  s.Tk = int(Tk);
  s.first = int(first);
  s.zigzag = int(zigzag);
  s.H = int(H);
  s.Hkv = int(Hkv);
  s.D = int(D);
  s.group = int(H / Hkv);
  s.scale = float(1.0 / std::sqrt(double(D)));
  s.scaleLog2 = s.scale * kLog2e;
  s.causal = causal;
  s.vec = false;
  return true;
}

template <typename... KernelArgs, typename... Args>
void launch(void (*kernel)(KernelArgs...), dim3 grid, int threads, int64_t smem,
            Args... args) {
  if (smem > 48 * 1024)
    TESSEL_CUDA_CHECK(cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  // The largest shared-memory carveout: the driver's default split (135 KB
  // seen on an H200) holds two blocks of the bf16 kernels per SM where
  // three fit.
  TESSEL_CUDA_CHECK(cudaFuncSetAttribute(
      kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
      int(cudaSharedmemCarveoutMaxShared)));
  kernel<<<grid, threads, size_t(smem), computeStream()>>>(args...);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

unsigned tiles(int T, int rows) { return unsigned((T + rows - 1) / rows); }

// The forward of either precision; out, lse and (dout, dvec) may be null.
void forward(const float *q, const float *k, const float *v, float *out,
             float *lse, const float *dout, float *dvec, int64_t B, Dims s) {
  s.vec = s.D % 4 == 0 && aligned16(q) && aligned16(k) && aligned16(v);
  const dim3 grid(tiles(s.T, kSimtRowsFwd), unsigned(s.H), unsigned(B));
  const int64_t smem = simtForwardSmem(s.D);
  if (s.D <= 32)
    launch(forwardSimt<32>, grid, 256, smem, q, k, v, out, lse, dout, dvec, s);
  else if (s.D <= 64)
    launch(forwardSimt<64>, grid, 256, smem, q, k, v, out, lse, dout, dvec, s);
  else
    launch(forwardSimt<128>, grid, 256, smem, q, k, v, out, lse, dout, dvec, s);
}

void forward(const bf16 *q, const bf16 *k, const bf16 *v, bf16 *out, float *lse,
             const bf16 *dout, float *dvec, int64_t B, Dims s) {
  s.vec = s.D % 8 == 0 && aligned16(q) && aligned16(k) && aligned16(v);
  const dim3 grid(tiles(s.T, kMmaForwardRows), unsigned(s.H), unsigned(B));
  if (s.D <= 64)
    launch(forwardMma<64>, grid, 128, mmaForwardSmem<64>(), q, k, v, out, lse,
           dout, dvec, s);
  else
    launch(forwardMma<128>, grid, 128, mmaForwardSmem<128>(), q, k, v, out, lse,
           dout, dvec, s);
}

void backwardGrads(const float *q, const float *k, const float *v,
                   const float *dout, const float *lse, const float *dvec,
                   float *dq, float *dk, float *dv, int64_t B, Dims s) {
  s.vec = s.D % 4 == 0 && aligned16(q) && aligned16(k) && aligned16(v) &&
          aligned16(dout);
  const dim3 kvGrid(tiles(s.Tk, kSimtRowsBwd), unsigned(s.Hkv), unsigned(B));
  const dim3 qGrid(tiles(s.T, kSimtRowsBwd), unsigned(s.H), unsigned(B));
  const int64_t smem = simtBackwardSmem(s.D);
  auto run = [&](auto kvKernel, auto qKernel) {
    launch(kvKernel, kvGrid, 128, smem, q, k, v, dout, lse, dvec, dk, dv, s);
    launch(qKernel, qGrid, 128, smem, q, k, v, dout, lse, dvec, dq, s);
  };
  if (s.D <= 32)
    run(backwardKvSimt<32>, backwardQSimt<32>);
  else if (s.D <= 64)
    run(backwardKvSimt<64>, backwardQSimt<64>);
  else
    run(backwardKvSimt<128>, backwardQSimt<128>);
}

void backwardGrads(const bf16 *q, const bf16 *k, const bf16 *v,
                   const bf16 *dout, const float *lse, const float *dvec,
                   bf16 *dq, bf16 *dk, bf16 *dv, int64_t B, Dims s) {
  s.vec = s.D % 8 == 0 && aligned16(q) && aligned16(k) && aligned16(v) &&
          aligned16(dout);
  const dim3 kvGrid(tiles(s.Tk, kMmaRows), unsigned(s.Hkv), unsigned(B));
  const dim3 qGrid(tiles(s.T, kMmaRows), unsigned(s.H), unsigned(B));
  if (s.D <= 64) {
    launch(backwardKvMma<64>, kvGrid, 128, mmaBackwardKvSmem<64>(), q, k, v,
           dout, lse, dvec, dk, dv, s);
    launch(backwardQMma<64>, qGrid, 128, mmaBackwardQSmem<64>(), q, k, v, dout,
           lse, dvec, dq, s);
  } else {
    launch(backwardKvMma<128>, kvGrid, 128, mmaBackwardKvSmem<128>(), q, k, v,
           dout, lse, dvec, dk, dv, s);
    launch(backwardQMma<128>, qGrid, 128, mmaBackwardQSmem<128>(), q, k, v,
           dout, lse, dvec, dq, s);
  }
}

// Row statistics (LSE, Dvec) are [B, H, T], fp32, 256-byte aligned.
int64_t statBytes(int64_t B, int64_t Tlen, int64_t H) {
  return align256(B * H * Tlen * int64_t(sizeof(float)));
}

} // namespace

template <typename T>
void attentionForward(const T *q, const T *k, const T *v, T *out, float *lse,
                      int64_t B, int64_t Tlen, int64_t H, int64_t Hkv,
                      int64_t D, bool causal, int64_t kvLen, int64_t first,
                      int64_t zigzag) {
  Dims s;
  if (!makeDims("attentionForward", B, Tlen, H, Hkv, D, causal, kvLen, first,
                zigzag, s))
    return;
  forward(q, k, v, out, lse, nullptr, nullptr, B, s);
}

template <typename T>
void attentionBackward(const T *q, const T *k, const T *v, const T *out,
                       const float *lse, const T *dout, T *dq, T *dk, T *dv,
                       int64_t B, int64_t Tlen, int64_t H, int64_t Hkv,
                       int64_t D, bool causal, int64_t kvLen, int64_t first,
                       int64_t zigzag, void *scratch) {
  Dims s;
  if (!makeDims("attentionBackward", B, Tlen, H, Hkv, D, causal, kvLen, first,
                zigzag, s))
    return;
  if (!scratch)
    throw std::runtime_error("CUDA attentionBackward: no scratch buffer");
  if (!out || !lse)
    throw std::runtime_error(
        "CUDA attentionBackward: the forward's output and log-sum-exp are "
        "needed");
  // Dvec = rowsum(dO * O) from the stored output (rounded to T in a bf16
  // program, as FlashAttention-2 takes it).
  float *dvec = static_cast<float *>(scratch);
  const int64_t rows = B * Tlen * H;
  launch(rowDotKernel<T>, dim3(detail::blocksFor(rows * 32)), 256, 0, dout, out, dvec,
         rows, s);
  backwardGrads(q, k, v, dout, lse, dvec, dq, dk, dv, B, s);
}

// Only the row sums Dvec are kept, whatever the KV heads, head dimension
// and element size (the log-sum-exp is the forward's).
int64_t attentionScratchBytes(int64_t B, int64_t Tlen, int64_t H,
                              int64_t /*Hkv*/, int64_t /*D*/,
                              int /*elementBytes*/) {
  return statBytes(B, Tlen, H);
}

#define TESSEL_INSTANTIATE(T)                                                  \
  template void attentionForward<T>(const T *, const T *, const T *, T *,      \
                                    float *, int64_t, int64_t, int64_t,        \
                                    int64_t, int64_t, bool, int64_t, int64_t,  \
                                    int64_t);                                  \
  template void attentionBackward<T>(                                          \
      const T *, const T *, const T *, const T *, const float *, const T *,    \
      T *, T *, T *, int64_t, int64_t, int64_t, int64_t, int64_t, bool,        \
      int64_t, int64_t, int64_t, void *);
TESSEL_CUDA_TYPES1(TESSEL_INSTANTIATE)
#undef TESSEL_INSTANTIATE

} // namespace tessel::cuda
