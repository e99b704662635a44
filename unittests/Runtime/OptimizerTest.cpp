//===- OptimizerTest.cpp - AdamW, schedule and clipping -------------------===//

#include "tessel/Runtime/Kernels.h"
#include "tessel/Runtime/Program.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

using namespace tessel::rt;

namespace {

TrainConfig scheduleConfig(LrDecay decay) {
  TrainConfig c = {};
  c.lr = 1e-3f;
  c.minLr = 1e-4f;
  c.warmupSteps = 10;
  c.decay = decay;
  return c;
}

} // namespace

// Two AdamW steps computed by hand (in double) for lr 0.1, betas (0.9,
// 0.999), eps 1e-8, weight decay 0.01, following torch.optim.AdamW:
//   step 1, p = 1, g = 0.5:  p = 0.999 - 0.1 * 0.5 / (0.5 + 1e-8)
//                              = 0.899000002, m = 0.05, v = 0.00025
//   step 2, g = -0.25:       m = 0.02, v = 0.00031225,
//                            p = 0.8714672987...
TEST(RuntimeOptimizer, AdamWTwoSteps) {
  std::vector<float> p = {1.0f, -0.5f}, m(2, 0.0f), v(2, 0.0f);
  std::vector<float> g1 = {0.5f, 2.0f}, g2 = {-0.25f, 1.0f};
  adamwUpdate(p.data(), g1.data(), m.data(), v.data(), 2, 0.1f, 0.9f, 0.999f,
              1e-8f, 0.01f, 1, 1.0f);
  EXPECT_NEAR(p[0], 0.899000002, 1e-6);
  EXPECT_NEAR(p[1], -0.5994999995, 1e-6);
  EXPECT_FLOAT_EQ(m[0], 0.05f);
  EXPECT_FLOAT_EQ(m[1], 0.2f);
  EXPECT_FLOAT_EQ(v[0], 0.00025f);
  EXPECT_FLOAT_EQ(v[1], 0.004f);

  adamwUpdate(p.data(), g2.data(), m.data(), v.data(), 2, 0.1f, 0.9f, 0.999f,
              1e-8f, 0.01f, 2, 1.0f);
  EXPECT_NEAR(p[0], 0.8714672987058463, 1e-6);
  EXPECT_NEAR(p[1], -0.6921184627919895, 1e-6);
  EXPECT_FLOAT_EQ(m[0], 0.02f);
  EXPECT_FLOAT_EQ(m[1], 0.28f);
  EXPECT_FLOAT_EQ(v[0], 0.00031225f);
  EXPECT_FLOAT_EQ(v[1], 0.004996f);
}

TEST(RuntimeOptimizer, AdamWGradScaleAndNoDecay) {
  // Scaling the gradient by 0.5 equals passing half the gradient.
  std::vector<float> pa = {0.3f, -1.2f, 2.0f}, pb = pa;
  std::vector<float> ma(3, 0), va(3, 0), mb(3, 0), vb(3, 0);
  std::vector<float> g = {0.4f, -0.8f, 1.6f}, half = {0.2f, -0.4f, 0.8f};
  for (int64_t step = 1; step <= 3; step++) {
    adamwUpdate(pa.data(), g.data(), ma.data(), va.data(), 3, 1e-2f, 0.9f,
                0.95f, 1e-8f, 0.1f, step, 0.5f);
    adamwUpdate(pb.data(), half.data(), mb.data(), vb.data(), 3, 1e-2f, 0.9f,
                0.95f, 1e-8f, 0.1f, step, 1.0f);
  }
  EXPECT_EQ(pa, pb);
  EXPECT_EQ(ma, mb);
  EXPECT_EQ(va, vb);

  // Without weight decay and a zero gradient nothing moves.
  std::vector<float> p = {1.0f}, z = {0.0f}, m = {0.0f}, v = {0.0f};
  adamwUpdate(p.data(), z.data(), m.data(), v.data(), 1, 0.1f, 0.9f, 0.999f,
              1e-8f, 0.0f, 1, 1.0f);
  EXPECT_EQ(p[0], 1.0f);
  // With weight decay only the decay applies: p * (1 - lr * wd).
  adamwUpdate(p.data(), z.data(), m.data(), v.data(), 1, 0.1f, 0.9f, 0.999f,
              1e-8f, 0.5f, 2, 1.0f);
  EXPECT_FLOAT_EQ(p[0], 0.95f);
}

// A global norm that is not finite (a gradient that overflowed, a bad
// sample) skips the step, clipping on or off, plain or sharded: nothing
// moves. A finite one updates.
TEST(RuntimeOptimizer, AdamWSkipsNonfiniteNorm) {
  for (float bad : {NAN, INFINITY, -INFINITY})
    for (float maxNorm : {1.0f, 0.0f}) {
      std::vector<float> p = {1.0f, -2.0f}, m = {0.1f, 0.2f}, v = {0.3f, 0.4f};
      std::vector<float> g = {NAN, 1.0f};
      const std::vector<float> p0 = p, m0 = m, v0 = v;
      float norm = bad;
      adamwStep(p.data(), nullptr, g.data(), m.data(), v.data(), &norm, 1e-2f,
                3, 2, 0.9f, 0.95f, 1e-8f, 0.1f, maxNorm);
      EXPECT_EQ(p, p0);
      EXPECT_EQ(m, m0);
      EXPECT_EQ(v, v0);
      adamwStepShard(p.data(), nullptr, g.data(), m.data(), v.data(), &norm,
                     1e-2f, 3, 2, 0, 2, 0, false, false, 0.9f, 0.95f, 1e-8f,
                     0.1f, maxNorm);
      EXPECT_EQ(p, p0);
      EXPECT_EQ(m, m0);
      EXPECT_EQ(v, v0);
    }
  std::vector<float> p = {1.0f}, g = {0.5f}, m = {0.0f}, v = {0.0f};
  float norm = 0.5f;
  adamwStep(p.data(), nullptr, g.data(), m.data(), v.data(), &norm, 1e-2f, 1, 1,
            0.9f, 0.95f, 1e-8f, 0.0f, 1.0f);
  EXPECT_NE(p[0], 1.0f);
}

TEST(RuntimeOptimizer, ScheduleWarmup) {
  TrainConfig c = scheduleConfig(LrDecay::Cosine);
  EXPECT_FLOAT_EQ(learningRate(c, 0, 110), 1e-4f);
  EXPECT_FLOAT_EQ(learningRate(c, 4, 110), 5e-4f);
  EXPECT_FLOAT_EQ(learningRate(c, 9, 110), 1e-3f);
}

TEST(RuntimeOptimizer, ScheduleCosine) {
  TrainConfig c = scheduleConfig(LrDecay::Cosine);
  EXPECT_FLOAT_EQ(learningRate(c, 10, 110), 1e-3f);
  EXPECT_FLOAT_EQ(learningRate(c, 55, 110), 0.000620395509268104f);
  EXPECT_FLOAT_EQ(learningRate(c, 60, 110), 5.5e-4f);
  EXPECT_FLOAT_EQ(learningRate(c, 109, 110), 0.00010022204783542078f);
  EXPECT_FLOAT_EQ(learningRate(c, 110, 110), 1e-4f);
  EXPECT_FLOAT_EQ(learningRate(c, 500, 110), 1e-4f);
}

TEST(RuntimeOptimizer, ScheduleLinearAndConstant) {
  TrainConfig c = scheduleConfig(LrDecay::Linear);
  EXPECT_FLOAT_EQ(learningRate(c, 10, 110), 1e-3f);
  EXPECT_FLOAT_EQ(learningRate(c, 60, 110), 5.5e-4f);
  EXPECT_FLOAT_EQ(learningRate(c, 100, 110), 1.9e-4f);
  EXPECT_FLOAT_EQ(learningRate(c, 110, 110), 1e-4f);

  c = scheduleConfig(LrDecay::Constant);
  EXPECT_FLOAT_EQ(learningRate(c, 0, 110), 1e-4f); // warmup still applies
  EXPECT_FLOAT_EQ(learningRate(c, 60, 110), 1e-3f);
  EXPECT_FLOAT_EQ(learningRate(c, 109, 110), 1e-3f);
}

TEST(RuntimeOptimizer, ScheduleWithoutWarmupOrHorizon) {
  TrainConfig c = scheduleConfig(LrDecay::Cosine);
  c.warmupSteps = 0;
  EXPECT_FLOAT_EQ(learningRate(c, 0, 100), 1e-3f);
  EXPECT_FLOAT_EQ(learningRate(c, 50, 100), 5.5e-4f);
  // Horizon shorter than warmup: decaySteps is clamped to 1.
  c.warmupSteps = 10;
  EXPECT_FLOAT_EQ(learningRate(c, 10, 5), 1e-3f);
  EXPECT_FLOAT_EQ(learningRate(c, 11, 5), 1e-4f);
}

TEST(RuntimeOptimizer, ClipCoefficient) {
  EXPECT_EQ(clipCoefficient(10.0, 0.0f), 1.0f);
  EXPECT_EQ(clipCoefficient(10.0, -1.0f), 1.0f);
  EXPECT_EQ(clipCoefficient(0.5, 1.0f), 1.0f);
  EXPECT_FLOAT_EQ(clipCoefficient(4.0, 1.0f), (float)(1.0 / (4.0 + 1e-6)));
  EXPECT_FLOAT_EQ(clipCoefficient(2.0, 1.0f), 0.4999997f);
  // The norm exactly at the limit is still scaled by the 1e-6 epsilon.
  EXPECT_LT(clipCoefficient(1.0, 1.0f), 1.0f);
}

TEST(RuntimeOptimizer, AdamWSmallBeta1) {
  // beta1 = 0.25 takes torch's other lerp form; m is then 0.75 * g.
  std::vector<float> p = {0.0f}, g = {2.0f}, m = {0.0f}, v = {0.0f};
  adamwUpdate(p.data(), g.data(), m.data(), v.data(), 1, 0.5f, 0.25f, 0.5f,
              0.0f, 0.0f, 1, 1.0f);
  EXPECT_FLOAT_EQ(m[0], 1.5f);
  EXPECT_FLOAT_EQ(v[0], 2.0f);
  // Bias-corrected m and v are g and g^2, so the step is lr * sign(g).
  EXPECT_FLOAT_EQ(p[0], -0.5f);
}
