//===- Optimizer.cu - Gradient norm, AdamW and scalar accumulation --------===//
//
// sumSquaresInto is deterministic: a fixed grid of kNormBlocks blocks
// (independent of the device and of n) writes one fp64 partial sum per
// block into a fixed device array, and a single block then adds the
// partials in a fixed order into acc[0]. The partial array is shared by all
// calls, which is safe because every kernel runs on the one compute stream.
//
// adamwUpdate follows lib/Runtime/Optimizer.cpp (PyTorch's
// _single_tensor_adamw): the scalars are computed on the host in double from
// the shortest decimal of each float hyperparameter (in a step captured as
// a CUDA graph the kernel reads them from a device slot that the runtime
// refills before each launch with the same host code), then the element-wise
// update is fp32 with every product and sum rounded separately (no fused
// multiply-add), as the CPU evaluates it. The clip coefficient is computed
// on the device from the global norm, so nothing waits for the host.
//
// The sharded forms (ZeRO-1) run the same kernels on the part of a tensor
// inside this rank's piece, which the host finds from the rank's place in
// its group.
//
//===----------------------------------------------------------------------===//

#include "BlockReduce.cuh"
#include "Internal.h"
#include "tessel/Runtime/Comm.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace tessel::cuda {

using detail::blockReduce;
using detail::blocksFor;
using detail::Sum;
using detail::toFloat;

namespace {

constexpr int kThreads = 256;
constexpr int kNormBlocks = 1024;

__device__ double normPartials[kNormBlocks];

// Launched with exactly kNormBlocks blocks.
template <typename TI>
__global__ void sumSquaresPartialKernel(const TI *x, int64_t n) {
  double s = 0.0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(blockDim.x) * gridDim.x) {
    const double v = double(toFloat(x[i]));
    s += v * v;
  }
  s = blockReduce(s, Sum{}, 0.0);
  if (threadIdx.x == 0)
    normPartials[blockIdx.x] = s;
}

// One block of kNormBlocks threads.
__global__ void sumSquaresFinalKernel(double *acc) {
  const double s = blockReduce(normPartials[threadIdx.x], Sum{}, 0.0);
  if (threadIdx.x == 0)
    acc[0] += s;
}

// The partial sums are added in ascending order from 0, as the CPU program
// adds its per-axis-set parts.
__global__ void sqrtKernel(const double *acc, int parts, float *out) {
  double s = 0.0;
  for (int k = 0; k < parts; ++k)
    s += acc[k];
  out[0] = float(sqrt(s));
}

using detail::AdamConstants;
using detail::AdamScalars;

__global__ void adamwKernel(float *p, bf16 *shadow, const float *g, float *m,
                            float *v, int64_t n, AdamScalars byValue,
                            const AdamScalars *slot, const float *norm) {
  // A captured step reads the scalars its launch was given (updateSlot).
  const AdamScalars k = slot ? *slot : byValue;
  // A global norm that is not finite: the step is skipped on every rank
  // (tessel::rt::adamwStep), parameters, copy and moments untouched.
  if (!isfinite(norm[0]))
    return;
  // torch.nn.utils.clip_grad_norm_'s coefficient, as
  // tessel::rt::clipCoefficient computes it (in double).
  float gradScale = 1.0f;
  if (k.maxNorm > 0.0f)
    gradScale = float(fmin(1.0, double(k.maxNorm) / (double(norm[0]) + 1e-6)));
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(blockDim.x) * gridDim.x) {
    const float grad = __fmul_rn(g[i], gradScale);
    const float param = __fmul_rn(p[i], k.decay);
    // exp_avg.lerp_(grad, 1 - beta1), with torch's two lerp forms.
    const float mi =
        k.oneMinusBeta1 < 0.5f
            ? __fadd_rn(m[i], __fmul_rn(k.oneMinusBeta1, __fsub_rn(grad, m[i])))
            : __fsub_rn(grad, __fmul_rn(__fsub_rn(grad, m[i]),
                                        __fsub_rn(1.0f, k.oneMinusBeta1)));
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2).
    const float vi =
        __fadd_rn(__fmul_rn(v[i], k.beta2),
                  __fmul_rn(__fmul_rn(k.oneMinusBeta2, grad), grad));
    // denom = exp_avg_sq.sqrt() / sqrt(bc2) + eps;
    // param.addcdiv_(exp_avg, denom, value=-step_size).
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), k.bc2Sqrt), k.eps);
    const float pi =
        __fsub_rn(param, __fdiv_rn(__fmul_rn(k.stepSize, mi), denom));
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if (shadow)
      shadow[i] = __float2bfloat16(pi);
  }
}

__global__ void scalarAccumulateKernel(const float *x, float *acc, bool first) {
  acc[0] = first ? x[0] : acc[0] + x[0];
}

// The double nearest to the shortest decimal that rounds to `x` (0.999f ->
// 0.999): the Python double PyTorch would use. Must agree with the helper of
// the same name in lib/Runtime/Optimizer.cpp.
double shortestDecimal(float x) {
  if (!std::isfinite(x))
    return x;
  char buf[32];
  for (int digits = 1; digits <= 9; digits++) {
    std::snprintf(buf, sizeof(buf), "%.*g", digits, (double)x);
    double d = std::strtod(buf, nullptr);
    if ((float)d == x)
      return d;
  }
  return x;
}

} // namespace

template <typename TI>
void sumSquaresInto(const TI *x, int64_t n, double *acc) {
  if (n < 0)
    n = 0;
  sumSquaresPartialKernel<<<kNormBlocks, kThreads, 0, computeStream()>>>(x, n);
  TESSEL_CUDA_CHECK(cudaGetLastError());
  sumSquaresFinalKernel<<<1, kNormBlocks, 0, computeStream()>>>(acc);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

void sqrtInto(const double *acc, int parts, float *out) {
  sqrtKernel<<<1, 1, 0, computeStream()>>>(acc, parts, out);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

detail::AdamScalars detail::adamScalars(const AdamConstants &c, float lr,
                                        int64_t step) {
  const double lrD = shortestDecimal(lr), beta1D = shortestDecimal(c.beta1);
  const double beta2D = shortestDecimal(c.beta2);
  const double wdD = shortestDecimal(c.weightDecay);
  const double bc1 = 1.0 - std::pow(beta1D, (double)step);
  const double bc2 = 1.0 - std::pow(beta2D, (double)step);
  AdamScalars k;
  k.decay = (float)(1.0 - lrD * wdD);
  k.stepSize = (float)(lrD / bc1);
  k.bc2Sqrt = (float)std::sqrt(bc2);
  k.oneMinusBeta1 = (float)(1.0 - beta1D);
  k.oneMinusBeta2 = (float)(1.0 - beta2D);
  k.beta2 = c.beta2;
  k.eps = c.eps;
  k.maxNorm = c.maxNorm;
  return k;
}

void adamwUpdate(float *p, bf16 *shadow, const float *g, float *m, float *v,
                 int64_t n, float lr, float beta1, float beta2, float eps,
                 float weightDecay, int64_t step, const float *norm,
                 float maxNorm) {
  if (n <= 0)
    return;
  const AdamConstants c = {beta1, beta2, eps, weightDecay, maxNorm};
  const AdamScalars k = detail::adamScalars(c, lr, step);
  const AdamScalars *slot = detail::updateSlot(c, k);
  adamwKernel<<<blocksFor(n, kThreads), kThreads, 0, computeStream()>>>(
      p, shadow, g, m, v, n, k, slot, norm);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

template <typename TI>
void addSumOfSquaresShard(const TI *x, double *sum, int64_t n,
                          int64_t runOffset, int64_t piece, unsigned axes,
                          bool pieceGrads) {
  int64_t k = rt::groupRank(axes);
  detail::PieceRange own = detail::inPiece(runOffset, n, piece, k);
  if (own.size() > 0)
    sumSquaresInto(x + (pieceGrads ? own.begin - k * piece
                                   : own.begin - runOffset),
                   own.size(), sum);
}

void adamwStepShard(float *p, bf16 *shadow, const float *g, float *m, float *v,
                    const float *norm, float lr, int64_t step, int64_t n,
                    int64_t runOffset, int64_t piece, unsigned axes,
                    bool pieceGrads, bool pieceParams, float beta1,
                    float beta2, float eps,
                    float weightDecay, float maxNorm) {
  int64_t k = rt::groupRank(axes);
  detail::PieceRange own = detail::inPiece(runOffset, n, piece, k);
  if (own.size() <= 0)
    return;
  int64_t at = own.begin - runOffset;    // in the tensor
  int64_t state = own.begin - k * piece; // in the piece's moments
  int64_t value = pieceParams ? state : at;
  adamwUpdate(p + value, shadow ? shadow + value : nullptr,
              g + (pieceGrads ? state : at), m + state, v + state, own.size(),
              lr, beta1, beta2, eps, weightDecay, step, norm, maxNorm);
}

void scalarAccumulate(const float *x, float *acc, bool first) {
  scalarAccumulateKernel<<<1, 1, 0, computeStream()>>>(x, acc, first);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

#define TESSEL_INSTANTIATE(A)                                                  \
  template void sumSquaresInto<A>(const A *, int64_t, double *);               \
  template void addSumOfSquaresShard<A>(const A *, double *, int64_t, int64_t, \
                                        int64_t, unsigned, bool);
TESSEL_CUDA_TYPES1(TESSEL_INSTANTIATE)
#undef TESSEL_INSTANTIATE

} // namespace tessel::cuda
