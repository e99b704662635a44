//===- Optimizer.cpp - AdamW, learning-rate schedule, gradient clipping ---===//
//
// adamwUpdate follows PyTorch's _single_tensor_adamw for float32 tensors:
// scalars (bias corrections, step size) are computed in double as Python
// would, then used as float in the element-wise float arithmetic.
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Kernels.h"
#include "tessel/Runtime/Program.h"

#include <algorithm>
#include <cmath>

namespace tessel::rt {

void adamwUpdate(float *p, const float *g, float *m, float *v, int64_t n,
                 float lr, float beta1, float beta2, float eps,
                 float weightDecay, int64_t step, float gradScale) {
  // Scalars, in double like the Python side of torch.optim.AdamW.
  double bc1 = 1.0 - std::pow((double)beta1, (double)step);
  double bc2 = 1.0 - std::pow((double)beta2, (double)step);
  float decay = (float)(1.0 - (double)lr * (double)weightDecay);
  float stepSize = (float)((double)lr / bc1);
  float bc2Sqrt = (float)std::sqrt(bc2);
  float oneMinusBeta1 = (float)(1.0 - (double)beta1);
  float oneMinusBeta2 = (float)(1.0 - (double)beta2);

#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i++) {
    float grad = g[i] * gradScale;
    float param = p[i] * decay;
    float mi = beta1 * m[i] + oneMinusBeta1 * grad;
    float vi = beta2 * v[i] + oneMinusBeta2 * grad * grad;
    float denom = std::sqrt(vi) / bc2Sqrt + eps;
    p[i] = param - stepSize * mi / denom;
    m[i] = mi;
    v[i] = vi;
  }
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
