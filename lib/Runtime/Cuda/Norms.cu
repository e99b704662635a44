//===- Norms.cu - LayerNorm and RMSNorm, with the fused residual add ------===//
//
// The CUDA counterpart of lib/Runtime/Kernels/Norms.cpp: the same formulas
// (biased variance; RMSNorm as Hugging Face's LlamaRMSNorm), fp32 statistics
// whatever the storage type.
//
// Forward: one block per row. The statistics are block reductions (the mean
// first, then the sum of squared deviations, as the CPU does); the row is
// read again from global memory for each pass, which the L1 cache serves.
// The fused residual add writes sum = a + r in the storage type and
// normalises that stored value, so it equals addBroadcast then the norm.
//
// Backward: a fixed number G of blocks (a function of rows and C only, at
// most kMaxRowBlocks) each takes a contiguous range of rows; for
// every row it computes dx, and adds the row's dw (and db) terms to its own
// slice of a partial-sum buffer, each column owned by one thread, rows in
// ascending order. A second kernel adds the G partials of each column in
// block order. Nothing depends on timing or on the device, so results are
// bitwise reproducible. The partial buffer is a fixed __device__ array (no
// allocation in a step); kernels run on the compute stream only, one after
// the other, so it is never shared by two launches at once.
//
//===----------------------------------------------------------------------===//

#include "BlockReduce.cuh"
#include "Internal.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace tessel::cuda {

using detail::blocksFor;
using detail::fromFloat;
using detail::toFloat;

using detail::blockReduce;
using detail::Sum;

namespace {

constexpr int kForwardThreads = 256;
constexpr int kBackwardThreads = 512;
constexpr int kSumThreads = 256;
// Row blocks of the backward: enough to fill an H100/H200 with two blocks
// per SM, capped by the partial buffer.
constexpr int64_t kMaxRowBlocks = 256;
constexpr int64_t kPartialFloats = int64_t(1) << 21; // 8 MiB

__device__ float gNormPartials[kPartialFloats];

__device__ inline float blockSum(float v) {
  return blockReduce(v, Sum{}, 0.0f);
}
__device__ inline float2 blockSum(float2 v) {
  return blockReduce(v, Sum{}, make_float2(0.0f, 0.0f));
}

// 1 / sqrt(var + eps), with the CPU's double square root.
__device__ inline float rstdOf(float var, double eps) {
  return float(1.0 / sqrt(double(var) + eps));
}

//===--- Forward ----------------------------------------------------------===//

// Normalises row x (already summed, in x's storage type) with its mean.
template <typename TX, typename TO>
__device__ void layerNormRow(const TX *x, float mean, const float *w,
                             const float *b, TO *out, int64_t C, double eps) {
  float sq = 0.0f;
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
    const float d = toFloat(x[j]) - mean;
    sq += d * d;
  }
  const float rstd = rstdOf(blockSum(sq) / float(C), eps);
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x)
    out[j] = fromFloat<TO>((toFloat(x[j]) - mean) * rstd * w[j] + b[j]);
}

template <typename TX, typename TO>
__device__ void rmsNormRow(const TX *x, float sumSq, const float *w, TO *out,
                           int64_t C, double eps) {
  const float rstd = rstdOf(blockSum(sumSq) / float(C), eps);
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x)
    out[j] = fromFloat<TO>((toFloat(x[j]) * rstd) * w[j]);
}

template <typename TI, typename TO>
__global__ void layerNormForwardKernel(const TI *x, const float *w,
                                       const float *b, TO *out, int64_t rows,
                                       int64_t C, double eps) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const TI *xr = x + r * C;
    float s = 0.0f;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x)
      s += toFloat(xr[j]);
    const float mean = blockSum(s) / float(C);
    layerNormRow(xr, mean, w, b, out + r * C, C, eps);
  }
}

// Each thread reads back only the sum entries it wrote itself.
template <typename TA, typename TR, typename TO>
__global__ void addLayerNormForwardKernel(const TA *a, const TR *res, TO *sum,
                                          const float *w, const float *b,
                                          TO *out, int64_t rows, int64_t C,
                                          double eps) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const TA *ar = a + r * C;
    const TR *rr = res + r * C;
    TO *sr = sum + r * C;
    float s = 0.0f;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const TO v = fromFloat<TO>(toFloat(ar[j]) + toFloat(rr[j]));
      sr[j] = v;
      s += toFloat(v);
    }
    const float mean = blockSum(s) / float(C);
    layerNormRow(sr, mean, w, b, out + r * C, C, eps);
  }
}

template <typename TI, typename TO>
__global__ void rmsNormForwardKernel(const TI *x, const float *w, TO *out,
                                     int64_t rows, int64_t C, double eps) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const TI *xr = x + r * C;
    float sq = 0.0f;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const float v = toFloat(xr[j]);
      sq += v * v;
    }
    rmsNormRow(xr, sq, w, out + r * C, C, eps);
  }
}

template <typename TA, typename TR, typename TO>
__global__ void addRmsNormForwardKernel(const TA *a, const TR *res, TO *sum,
                                        const float *w, TO *out, int64_t rows,
                                        int64_t C, double eps) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const TA *ar = a + r * C;
    const TR *rr = res + r * C;
    TO *sr = sum + r * C;
    float sq = 0.0f;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const TO v = fromFloat<TO>(toFloat(ar[j]) + toFloat(rr[j]));
      sr[j] = v;
      const float f = toFloat(v);
      sq += f * f;
    }
    rmsNormRow(sr, sq, w, out + r * C, C, eps);
  }
}

//===--- Backward ---------------------------------------------------------===//

// Rows [first, last) of row block `blockIdx.x` out of gridDim.x.
__device__ inline void rowRange(int64_t rows, int64_t &first, int64_t &last) {
  first = int64_t(blockIdx.x) * rows / gridDim.x;
  last = (int64_t(blockIdx.x) + 1) * rows / gridDim.x;
}

// With xhat = (x - mean) * rstd and g = dout * w:
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
// The block's partials: dw at [2 C blockIdx.x, +C), db right after.
template <typename TI, typename TG, typename TO>
__global__ void __launch_bounds__(kBackwardThreads)
    layerNormBackwardKernel(const TI *x, const float *w, const TG *dout,
                            const TO *dres, TO *dx, int64_t rows, int64_t C,
                            double eps) {
  int64_t first, last;
  rowRange(rows, first, last);
  float *pdw = gNormPartials + 2 * C * int64_t(blockIdx.x);
  float *pdb = pdw + C;
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
    pdw[j] = 0.0f;
    pdb[j] = 0.0f;
  }
  for (int64_t r = first; r < last; ++r) {
    const TI *xr = x + r * C;
    const TG *dr = dout + r * C;
    TO *dxr = dx + r * C;
    float s = 0.0f;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x)
      s += toFloat(xr[j]);
    const float mean = blockSum(s) / float(C);
    float sq = 0.0f;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const float d = toFloat(xr[j]) - mean;
      sq += d * d;
    }
    const float rstd = rstdOf(blockSum(sq) / float(C), eps);
    float2 gs = make_float2(0.0f, 0.0f);
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const float xhat = (toFloat(xr[j]) - mean) * rstd;
      const float g = toFloat(dr[j]) * w[j];
      gs.x += g;
      gs.y += g * xhat;
    }
    gs = blockSum(gs);
    const float gMean = gs.x / float(C);
    const float gxMean = gs.y / float(C);
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const float xhat = (toFloat(xr[j]) - mean) * rstd;
      const float d = toFloat(dr[j]);
      const float g = d * w[j];
      const float res = dres ? toFloat(dres[r * C + j]) : 0.0f;
      dxr[j] = fromFloat<TO>(rstd * (g - gMean - xhat * gxMean) + res);
      pdw[j] += d * xhat;
      pdb[j] += d;
    }
  }
}

// The same computation for rows of at most PER * blockDim.x columns: the
// thread's columns j = threadIdx.x + k blockDim.x of the row, its w and its
// dw/db partials stay in registers, so each row is read from memory once
// and the partials are written once (the general kernel above re-reads the
// row for each pass and adds to the partials in global memory every row,
// which left it at a quarter of the memory bandwidth on an H200). Every sum
// runs in the general kernel's order, so results are the same bits.
template <int PER, typename TI, typename TG, typename TO>
__global__ void __launch_bounds__(kBackwardThreads)
    layerNormBackwardRegKernel(const TI *x, const float *w, const TG *dout,
                               const TO *dres, TO *dx, int64_t rows, int64_t C,
                               double eps) {
  int64_t first, last;
  rowRange(rows, first, last);
  float wv[PER], adw[PER], adb[PER], xv[PER], dv[PER];
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
    wv[k] = j < C ? w[j] : 0.0f;
    adw[k] = 0.0f;
    adb[k] = 0.0f;
  }
  for (int64_t r = first; r < last; ++r) {
    const TI *xr = x + r * C;
    const TG *dr = dout + r * C;
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
      if (j < C) {
        xv[k] = toFloat(xr[j]);
        dv[k] = toFloat(dr[j]);
        s += xv[k];
      }
    }
    const float mean = blockSum(s) / float(C);
    float sq = 0.0f;
#pragma unroll
    for (int k = 0; k < PER; ++k)
      if (threadIdx.x + int64_t(k) * blockDim.x < C) {
        const float d = xv[k] - mean;
        sq += d * d;
      }
    const float rstd = rstdOf(blockSum(sq) / float(C), eps);
    float2 gs = make_float2(0.0f, 0.0f);
#pragma unroll
    for (int k = 0; k < PER; ++k)
      if (threadIdx.x + int64_t(k) * blockDim.x < C) {
        const float xhat = (xv[k] - mean) * rstd;
        const float g = dv[k] * wv[k];
        gs.x += g;
        gs.y += g * xhat;
      }
    gs = blockSum(gs);
    const float gMean = gs.x / float(C);
    const float gxMean = gs.y / float(C);
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
      if (j < C) {
        const float xhat = (xv[k] - mean) * rstd;
        const float g = dv[k] * wv[k];
        const float res = dres ? toFloat(dres[r * C + j]) : 0.0f;
        dx[r * C + j] = fromFloat<TO>(rstd * (g - gMean - xhat * gxMean) + res);
        adw[k] += dv[k] * xhat;
        adb[k] += dv[k];
      }
    }
  }
  float *pdw = gNormPartials + 2 * C * int64_t(blockIdx.x);
  float *pdb = pdw + C;
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
    if (j < C) {
      pdw[j] = adw[k];
      pdb[j] = adb[k];
    }
  }
}

// With rstd = 1 / sqrt(mean(x^2) + eps) and g = dout * w:
//   dx = rstd * g - x * rstd^3 * sum(g * x) / C,
//   dw = sum_rows dout * x * rstd.
// The block's dw partials are at [C blockIdx.x, +C).
template <typename TI, typename TG, typename TO>
__global__ void __launch_bounds__(kBackwardThreads)
    rmsNormBackwardKernel(const TI *x, const float *w, const TG *dout,
                          const TO *dres, TO *dx, int64_t rows, int64_t C,
                          double eps) {
  int64_t first, last;
  rowRange(rows, first, last);
  float *pdw = gNormPartials + C * int64_t(blockIdx.x);
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x)
    pdw[j] = 0.0f;
  for (int64_t r = first; r < last; ++r) {
    const TI *xr = x + r * C;
    const TG *dr = dout + r * C;
    TO *dxr = dx + r * C;
    float sq = 0.0f;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const float v = toFloat(xr[j]);
      sq += v * v;
    }
    const float rstd = rstdOf(blockSum(sq) / float(C), eps);
    float gx = 0.0f;
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x)
      gx += toFloat(dr[j]) * w[j] * toFloat(xr[j]);
    const float k = rstd * rstd * rstd * blockSum(gx) / float(C);
    for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
      const float xv = toFloat(xr[j]);
      const float d = toFloat(dr[j]);
      const float res = dres ? toFloat(dres[r * C + j]) : 0.0f;
      dxr[j] = fromFloat<TO>(rstd * (d * w[j]) - xv * k + res);
      pdw[j] += d * (xv * rstd);
    }
  }
}

// out[j] = sum over blocks g in ascending order of the partial
// gNormPartials[g * pitch + offset + j].
__global__ void sumPartialsKernel(float *out, int64_t blocks, int64_t pitch,
                                  int64_t offset, int64_t C) {
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < C;
       j += int64_t(blockDim.x) * gridDim.x) {
    float s = 0.0f;
    for (int64_t g = 0; g < blocks; ++g)
      s += gNormPartials[g * pitch + offset + j];
    out[j] = s;
  }
}

// Number of row blocks for `perRow` partial vectors of C floats each.
int64_t rowBlocks(const char *kernel, int64_t rows, int64_t C, int perRow) {
  const int64_t fit = kPartialFloats / (perRow * C);
  if (fit < 1)
    throw std::runtime_error(
        std::string(kernel) + ": C = " + std::to_string(C) +
        " exceeds the partial-sum buffer (" +
        std::to_string(kPartialFloats / perRow) + " columns at most)");
  return std::min({rows, kMaxRowBlocks, fit});
}

unsigned forwardGrid(int64_t rows) {
  return unsigned(std::min<int64_t>(rows, int64_t(1) << 30));
}

} // namespace

template <typename TI, typename TO>
void layerNormForward(const TI *x, const float *w, const float *b, TO *out,
                      int64_t rows, int64_t C, double eps) {
  if (rows <= 0 || C <= 0)
    return;
  layerNormForwardKernel<<<forwardGrid(rows), kForwardThreads, 0,
                           computeStream()>>>(x, w, b, out, rows, C, eps);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

template <typename TA, typename TR, typename TO>
void addLayerNormForward(const TA *a, const TR *r, TO *sum, const float *w,
                         const float *b, TO *out, int64_t rows, int64_t C,
                         double eps) {
  if (rows <= 0 || C <= 0)
    return;
  addLayerNormForwardKernel<<<forwardGrid(rows), kForwardThreads, 0,
                              computeStream()>>>(a, r, sum, w, b, out, rows, C,
                                                 eps);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

template <typename TI, typename TG, typename TO>
void layerNormBackwardAdd(const TI *x, const float *w, const TG *dout,
                          const TO *dres, TO *dx, float *dw, float *db,
                          int64_t rows, int64_t C, double eps) {
  if (C <= 0)
    return;
  if (rows <= 0) {
    TESSEL_CUDA_CHECK(
        cudaMemsetAsync(dw, 0, C * sizeof(float), computeStream()));
    TESSEL_CUDA_CHECK(
        cudaMemsetAsync(db, 0, C * sizeof(float), computeStream()));
    return;
  }
  const int64_t blocks = rowBlocks("layerNormBackward", rows, C, 2);
  const unsigned grid = unsigned(blocks);
  const int64_t per = (C + kBackwardThreads - 1) / kBackwardThreads;
  auto inRegisters = [&](auto columns) {
    layerNormBackwardRegKernel<decltype(columns)::value>
        <<<grid, kBackwardThreads, 0, computeStream()>>>(x, w, dout, dres, dx,
                                                         rows, C, eps);
  };
  if (per <= 1)
    inRegisters(std::integral_constant<int, 1>{});
  else if (per <= 2)
    inRegisters(std::integral_constant<int, 2>{});
  else if (per <= 4)
    inRegisters(std::integral_constant<int, 4>{});
  else if (per <= 8)
    inRegisters(std::integral_constant<int, 8>{});
  else
    layerNormBackwardKernel<<<grid, kBackwardThreads, 0, computeStream()>>>(
        x, w, dout, dres, dx, rows, C, eps);
  TESSEL_CUDA_CHECK(cudaGetLastError());
  sumPartialsKernel<<<blocksFor(C, kSumThreads), kSumThreads, 0,
                      computeStream()>>>(dw, blocks, 2 * C, 0, C);
  TESSEL_CUDA_CHECK(cudaGetLastError());
  sumPartialsKernel<<<blocksFor(C, kSumThreads), kSumThreads, 0,
                      computeStream()>>>(db, blocks, 2 * C, C, C);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

template <typename TI, typename TO>
void rmsNormForward(const TI *x, const float *w, TO *out, int64_t rows,
                    int64_t C, double eps) {
  if (rows <= 0 || C <= 0)
    return;
  rmsNormForwardKernel<<<forwardGrid(rows), kForwardThreads, 0,
                         computeStream()>>>(x, w, out, rows, C, eps);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

template <typename TA, typename TR, typename TO>
void addRmsNormForward(const TA *a, const TR *r, TO *sum, const float *w,
                       TO *out, int64_t rows, int64_t C, double eps) {
  if (rows <= 0 || C <= 0)
    return;
  addRmsNormForwardKernel<<<forwardGrid(rows), kForwardThreads, 0,
                            computeStream()>>>(a, r, sum, w, out, rows, C, eps);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

template <typename TI, typename TG, typename TO>
void rmsNormBackwardAdd(const TI *x, const float *w, const TG *dout,
                        const TO *dres, TO *dx, float *dw, int64_t rows,
                        int64_t C, double eps) {
  if (C <= 0)
    return;
  if (rows <= 0) {
    TESSEL_CUDA_CHECK(
        cudaMemsetAsync(dw, 0, C * sizeof(float), computeStream()));
    return;
  }
  const int64_t blocks = rowBlocks("rmsNormBackward", rows, C, 1);
  rmsNormBackwardKernel<<<unsigned(blocks), kBackwardThreads, 0,
                          computeStream()>>>(x, w, dout, dres, dx, rows, C,
                                             eps);
  TESSEL_CUDA_CHECK(cudaGetLastError());
  sumPartialsKernel<<<blocksFor(C, kSumThreads), kSumThreads, 0,
                      computeStream()>>>(dw, blocks, C, 0, C);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

template <typename TI, typename TG, typename TO>
void layerNormBackward(const TI *x, const float *w, const TG *dout, TO *dx,
                       float *dw, float *db, int64_t rows, int64_t C,
                       double eps) {
  layerNormBackwardAdd(x, w, dout, static_cast<const TO *>(nullptr), dx, dw, db,
                       rows, C, eps);
}

template <typename TI, typename TG, typename TO>
void rmsNormBackward(const TI *x, const float *w, const TG *dout, TO *dx,
                     float *dw, int64_t rows, int64_t C, double eps) {
  rmsNormBackwardAdd(x, w, dout, static_cast<const TO *>(nullptr), dx, dw, rows,
                     C, eps);
}

//===--- Instantiations ---------------------------------------------------===//

#define TESSEL_INSTANTIATE3(A, B, C)                                           \
  template void addLayerNormForward<A, B, C>(const A *, const B *, C *,        \
                                             const float *, const float *,     \
                                             C *, int64_t, int64_t, double);   \
  template void layerNormBackward<A, B, C>(const A *, const float *,           \
                                           const B *, C *, float *, float *,   \
                                           int64_t, int64_t, double);          \
  template void addRmsNormForward<A, B, C>(const A *, const B *, C *,          \
                                           const float *, C *, int64_t,        \
                                           int64_t, double);                   \
  template void rmsNormBackward<A, B, C>(const A *, const float *, const B *,  \
                                         C *, float *, int64_t, int64_t,       \
                                         double);                              \
  template void layerNormBackwardAdd<A, B, C>(                                 \
      const A *, const float *, const B *, const C *, C *, float *, float *,   \
      int64_t, int64_t, double);                                               \
  template void rmsNormBackwardAdd<A, B, C>(                                   \
      const A *, const float *, const B *, const C *, C *, float *, int64_t,   \
      int64_t, double);
TESSEL_CUDA_TYPES3(TESSEL_INSTANTIATE3)
#undef TESSEL_INSTANTIATE3

#define TESSEL_INSTANTIATE2(A, B)                                              \
  template void layerNormForward<A, B>(                                        \
      const A *, const float *, const float *, B *, int64_t, int64_t, double); \
  template void rmsNormForward<A, B>(const A *, const float *, B *, int64_t,   \
                                     int64_t, double);
TESSEL_CUDA_TYPES2(TESSEL_INSTANTIATE2)
#undef TESSEL_INSTANTIATE2

} // namespace tessel::cuda
