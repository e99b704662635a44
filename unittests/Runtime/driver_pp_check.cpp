//===- driver_pp_check.cpp - Toy pipeline stages for driver tests ---------===//
//
// Hand-written Programs for a two-stage pipeline (pp = 2), chosen by the
// compile definition STAGE: stage 0 holds parameter "a", stage 1 holds "b",
// and STAGE = -1 is the one-rank program holding both. Each step, stage 0
// sends its `a` to stage 1 (sendTo along pp), which checks it against its
// own replay of a's initialisation and updates and sends it back plus one;
// stage 0 checks that too. Each stage decays its parameter with plain SGD
// and the loss is all-reduced over pp, so the stages together train exactly
// what the one-rank program trains and --save-final must write the same
// bytes. ctest launches the stages MPMD (mpirun -np 1 S0 : -np 1 S1).
//
// The replay assumes the default seed and initialised (not loaded)
// parameters whenever steps are run. With TESSEL_PP_CHECK_BAD=1 in the
// environment, the last stage sends past the end of the pipeline, which
// must fail with a clear error.
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Comm.h"
#include "tessel/Runtime/Init.h"
#include "tessel/Runtime/Program.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

using namespace tessel::rt;

namespace {

constexpr int64_t kA = 6, kB = 4;
constexpr uint64_t kSeed = 7;
constexpr int kForwardTag = 7, kBackwardTag = 8;

constexpr ParamInfo kParamA = {
    "a",  2,    {2, 3}, kA,           0, InitKind::Normal, 0.0f,
    0.5f, true, -1,     MeshAxis::DP, 1};
constexpr ParamInfo kParamB = {
    "b",  1,     {kB}, kB,           0, InitKind::Normal, 0.1f,
    0.3f, false, -1,   MeshAxis::DP, 1};

#if STAGE < 0
const ParamInfo kParams[] = {kParamA,
                             {"b",
                              1,
                              {kB},
                              kB,
                              kA,
                              InitKind::Normal,
                              0.1f,
                              0.3f,
                              false,
                              -1,
                              MeshAxis::DP,
                              1}};
constexpr int kNumParams = 2;
constexpr int64_t kElems = kA + kB;
#elif STAGE == 0
const ParamInfo kParams[] = {kParamA};
constexpr int kNumParams = 1;
constexpr int64_t kElems = kA;
#else
const ParamInfo kParams[] = {kParamB};
constexpr int kNumParams = 1;
constexpr int64_t kElems = kB;
#endif

bool badSend() {
  const char *bad = std::getenv("TESSEL_PP_CHECK_BAD");
  return bad && std::strcmp(bad, "1") == 0;
}

// loss += 0.05 a^2 (gradient 0.1 a), then a -= lr * grad.
float decayA(float *a, float lr) {
  float loss = 0.0f;
  for (int64_t i = 0; i < kA; i++) {
    loss += 0.05f * a[i] * a[i];
    a[i] -= lr * (0.1f * a[i]);
  }
  return loss;
}

// loss += 0.1 b^2 (gradient 0.2 b), then b -= lr * grad.
float decayB(float *b, float lr) {
  float loss = 0.0f;
  for (int64_t i = 0; i < kB; i++) {
    loss += 0.1f * b[i] * b[i];
    b[i] -= lr * (0.2f * b[i]);
  }
  return loss;
}

void step(StepContext &ctx) {
#if STAGE < 0
  if (badSend()) {
    float x = 0.0f;
    sendTo(&x, 1, MeshAxis::PP, 1, kForwardTag);
  }
  ctx.loss = decayA(ctx.params, ctx.lr) + decayB(ctx.params + kA, ctx.lr);
#elif STAGE == 0
  // Untouched until waitSends().
  static float sent[kA];
  float back[kA];
  std::memcpy(sent, ctx.params, sizeof(sent));
  sendTo(sent, kA, MeshAxis::PP, 1, kForwardTag);
  recvFrom(back, kA, MeshAxis::PP, 1, kBackwardTag);
  for (int64_t i = 0; i < kA; i++)
    if (back[i] != sent[i] + 1.0f)
      throw std::runtime_error("stage 0 received wrong data at step " +
                               std::to_string(ctx.step + 1));
  waitSends();
  ctx.loss = decayA(ctx.params, ctx.lr);
#else
  // Stage 1 replays a's initialisation and updates to check what arrives.
  static float expected[kA];
  static float back[kA];
  if (ctx.step == 0)
    initRange("a", kParamA.init, kParamA.initMean, kParamA.initStd, kSeed, 0,
              kA, expected);
  float received[kA];
  recvFrom(received, kA, MeshAxis::PP, -1, kForwardTag);
  for (int64_t i = 0; i < kA; i++)
    if (received[i] != expected[i])
      throw std::runtime_error("stage 1 received wrong data at step " +
                               std::to_string(ctx.step + 1));
  std::printf("stage 1 received step %lld\n", (long long)ctx.step + 1);
  std::fflush(stdout);
  decayA(expected, ctx.lr);
  for (int64_t i = 0; i < kA; i++)
    back[i] = received[i] + 1.0f;
  sendTo(back, kA, MeshAxis::PP, -1, kBackwardTag);
  if (badSend())
    sendTo(back, kA, MeshAxis::PP, 1, kForwardTag);
  waitSends();
  ctx.loss = decayB(ctx.params, ctx.lr);
#endif
#if STAGE >= 0
  allReduceSum(&ctx.loss, 1, AxisSet(MeshAxis::PP).bits());
#endif
  ctx.gradNorm = 0.0f;
}

} // namespace

int main(int argc, char **argv) {
  TrainConfig config{};
  config.batch = 2;
  config.seqLen = 8;
  config.vocab = 50;
  config.steps = 3;
  config.seed = kSeed;
  config.lr = 0.5f;
  config.decay = LrDecay::Constant;
  Program program{};
  program.name = "driver-pp-check";
  program.params = kParams;
  program.numParams = kNumParams;
  program.paramElems = kElems;
  program.config = config;
  program.step = step;
  MeshShape mesh;
  mesh[MeshAxis::PP] = STAGE < 0 ? 1 : 2;
  program.mesh = mesh;
  return runMain(argc, argv, program);
}
