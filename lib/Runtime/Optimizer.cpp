//===- Optimizer.cpp - AdamW, learning-rate schedule, gradient clipping ---===//
//
// adamwUpdate follows PyTorch's _single_tensor_adamw for float32 tensors:
// scalars (bias corrections, step size) are computed in double as Python
// would, then used as float in the element-wise float arithmetic.
//
// The hyperparameters arrive as float, but in PyTorch they are Python
// doubles: 0.999f is 0.99900001287..., so 1 - beta2 would be off by 1.3e-5
// relative. Each float is therefore read back as the shortest decimal that
// rounds to it (0.999f -> 0.999), which is the double PyTorch would use.
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Comm.h"
#include "tessel/Runtime/Kernels.h"
#include "tessel/Runtime/Pieces.h"
#include "tessel/Runtime/Program.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <cstdio>
#include <cstdlib>

namespace tessel::rt {

namespace {

// The double nearest to the shortest decimal that rounds to `x`.
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

void adamwUpdate(float *p, const float *g, float *m, float *v, int64_t n,
                 float lr, float beta1, float beta2, float eps,
                 float weightDecay, int64_t step, float gradScale) {
  // Scalars, in double like the Python side of torch.optim.AdamW.
  double lrD = shortestDecimal(lr), beta1D = shortestDecimal(beta1);
  double beta2D = shortestDecimal(beta2), wdD = shortestDecimal(weightDecay);
  double bc1 = 1.0 - std::pow(beta1D, (double)step);
  double bc2 = 1.0 - std::pow(beta2D, (double)step);
  float decay = (float)(1.0 - lrD * wdD);
  float stepSize = (float)(lrD / bc1);
  float bc2Sqrt = (float)std::sqrt(bc2);
  float oneMinusBeta1 = (float)(1.0 - beta1D);
  float oneMinusBeta2 = (float)(1.0 - beta2D);

#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) {
    float grad = g[i] * gradScale;
    float param = p[i] * decay;
    // exp_avg.lerp_(grad, 1 - beta1), with torch's two lerp forms.
    float mi = oneMinusBeta1 < 0.5f
                   ? m[i] + oneMinusBeta1 * (grad - m[i])
                   : grad - (grad - m[i]) * (1.0f - oneMinusBeta1);
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2).
    float vi = v[i] * beta2 + oneMinusBeta2 * grad * grad;
    // denom = exp_avg_sq.sqrt() / sqrt(bc2) + eps;
    // param.addcdiv_(exp_avg, denom, value=-step_size).
    float denom = std::sqrt(vi) / bc2Sqrt + eps;
    p[i] = param - stepSize * mi / denom;
    m[i] = mi;
    v[i] = vi;
  }
}

void adamwStep(float *p, void *shadow, const float *g, float *m, float *v,
               const float *norm, float lr, int64_t step, int64_t n,
               float beta1, float beta2, float eps, float weightDecay,
               float maxNorm) {
  if (shadow)
    throw std::runtime_error("adamwStep: CPU programs keep no parameter copy");
  // A gradient that is not finite (an overflow, a bad sample) makes the
  // global norm nan or inf on every rank alike: no rank applies the step,
  // and the parameters and moments stay those of the last update.
  if (!std::isfinite(norm[0]))
    return;
  adamwUpdate(p, g, m, v, n, lr, beta1, beta2, eps, weightDecay, step,
              clipCoefficient(norm[0], maxNorm));
}

namespace {

// The elements [lo, hi) of an n-element tensor at `runOffset` in its run
// that lie in this rank's piece, and where that piece starts in the run.
struct Owned {
  int64_t lo, hi, pieceStart;
};
Owned owned(int64_t n, int64_t runOffset, int64_t piece, unsigned axes) {
  int64_t k = groupRank(axes);
  PieceRange own = inPiece(runOffset, n, piece, k);
  return {own.begin - runOffset, own.end - runOffset, k * piece};
}

} // namespace

void addSumOfSquaresShard(const float *x, double *sum, int64_t n,
                          int64_t runOffset, int64_t piece, unsigned axes,
                          bool pieceGrads) {
  Owned o = owned(n, runOffset, piece, axes);
  int64_t at = pieceGrads ? runOffset + o.lo - o.pieceStart : o.lo;
  if (o.hi > o.lo)
    addSumOfSquares(x + at, sum, o.hi - o.lo);
}

void adamwStepShard(float *p, void *shadow, const float *g, float *m,
                    float *v, const float *norm, float lr, int64_t step,
                    int64_t n, int64_t runOffset, int64_t piece, unsigned axes,
                    bool pieceGrads, bool pieceParams, float beta1,
                    float beta2, float eps, float weightDecay, float maxNorm) {
  Owned o = owned(n, runOffset, piece, axes);
  if (o.hi <= o.lo)
    return;
  int64_t state = runOffset + o.lo - o.pieceStart;
  adamwStep(p + (pieceParams ? state : o.lo), shadow,
            g + (pieceGrads ? state : o.lo), m + state,
            v + state, norm, lr, step,
            o.hi - o.lo, beta1, beta2, eps, weightDecay, maxNorm);
}

float learningRate(const TrainConfig &config, int64_t step,
                   int64_t totalSteps) {
  double lr = config.lr;
  double minLr = config.minLr;
  if (step < config.warmupSteps)
    return (float)(lr * (double)(step + 1) / (double)config.warmupSteps);
  int64_t decaySteps = std::max<int64_t>(1, totalSteps - config.warmupSteps);
  double progress =
      std::min(1.0, (double)(step - config.warmupSteps) / (double)decaySteps);
  switch (config.decay) {
  case LrDecay::Cosine:
    return (float)(minLr +
                   0.5 * (1.0 + std::cos(M_PI * progress)) * (lr - minLr));
  case LrDecay::Linear:
    return (float)(lr + (minLr - lr) * progress);
  case LrDecay::Constant:
    break;
  }
  return (float)lr;
}

float clipCoefficient(double totalNorm, float maxNorm) {
  if (maxNorm <= 0.0f)
    return 1.0f;
  double coef = (double)maxNorm / (totalNorm + 1e-6);
  return (float)std::min(1.0, coef);
}

} // namespace tessel::rt
