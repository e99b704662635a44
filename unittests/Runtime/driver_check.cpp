//===- driver_check.cpp - A toy program for multi-rank driver tests -------===//
//
// A hand-written Program on a mesh of dp = MESH_DP, tp = MESH_TP (compile
// definitions)
// with one tp-sharded parameter in 3 blocks and one replicated parameter.
// Its step fits each row of `w` to the targets with plain SGD, all-reducing
// the loss over dp|tp and the gradient over dp. ctest launches it on several
// meshes and compares what runMain saves: initialisation and --init-from
// must give the one-rank tensors bit for bit.
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Comm.h"
#include "tessel/Runtime/Program.h"

#include <cmath>

using namespace tessel::rt;

namespace {

constexpr int64_t kDP = MESH_DP, kTP = MESH_TP;
constexpr int64_t kRows = 4, kCols = 6, kLocalCols = kCols / kTP;
constexpr int64_t kGlobalBatch = 4, kSeqLen = 8;
constexpr int64_t kW = kRows * kLocalCols, kB = kCols;

const ParamInfo kParams[] = {
    {"w",
     2,
     {kRows, kCols},
     kW,
     0,
     InitKind::Normal,
     0.0f,
     0.5f,
     true,
     kTP > 1 ? 1 : -1,
     MeshAxis::TP,
     3},
    {"b",
     1,
     {kCols},
     kB,
     kW,
     InitKind::Normal,
     0.1f,
     0.3f,
     false,
     -1,
     MeshAxis::DP,
     1},
};

void step(StepContext &ctx) {
  const int64_t batch = kGlobalBatch / kDP;
  float *w = ctx.params, *b = ctx.params + kW;
  float *gw = ctx.grads, *gb = ctx.grads + kW;
  for (int64_t i = 0; i < kW + kB; i++)
    ctx.grads[i] = 0.0f;
  const float scale = 1.0f / (kGlobalBatch * kSeqLen);
  float loss = 0.0f;
  for (int64_t k = 0; k < batch * kSeqLen; k++) {
    int64_t row = ctx.tokens[k] % kRows;
    float target = (float)(ctx.targets[k] % 7) * 0.1f;
    for (int64_t j = 0; j < kLocalCols; j++) {
      float d = w[row * kLocalCols + j] - target;
      loss += d * d * scale;
      gw[row * kLocalCols + j] += 2.0f * d * scale;
    }
  }
  allReduceSum(&loss, 1,
               AxisSet(MeshAxis::DP).bits() | AxisSet(MeshAxis::TP).bits());
  commWait(allReduceSumStart(gw, kW, AxisSet(MeshAxis::DP).bits()));
  float squares = 0.0f;
  for (int64_t i = 0; i < kW; i++)
    squares += gw[i] * gw[i];
  allReduceSum(&squares, 1, AxisSet(MeshAxis::TP).bits());
  for (int64_t j = 0; j < kB; j++) {
    loss += 0.1f * b[j] * b[j];
    gb[j] = 0.2f * b[j];
    squares += gb[j] * gb[j];
  }
  ctx.loss = loss;
  ctx.gradNorm = std::sqrt(squares);
  for (int64_t i = 0; i < kW + kB; i++)
    ctx.params[i] -= ctx.lr * ctx.grads[i];
}

} // namespace

int main(int argc, char **argv) {
  TrainConfig config{};
  config.batch = kGlobalBatch / kDP;
  config.seqLen = kSeqLen;
  config.vocab = 50;
  config.steps = 3;
  config.seed = 7;
  config.lr = 0.5f;
  config.decay = LrDecay::Constant;
  Program program{};
  program.name = "driver-check";
  program.params = kParams;
  program.numParams = 2;
  program.paramElems = kW + kB;
  program.config = config;
  program.step = step;
  MeshShape mesh;
  mesh[MeshAxis::DP] = kDP;
  mesh[MeshAxis::TP] = kTP;
  program.mesh = mesh;
  return runMain(argc, argv, program);
}
