//===- GradCheck.cpp - Gradients against finite differences ---------------===//
//
// The main() of a float64 program compiled by `tessel gradcheck`: the step
// computes the loss and every parameter's gradient (its optimizer removed);
// sampled entries of each gradient are compared with central differences
// of the loss.
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Program.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace tessel::rt {

int gradientCheckMain(const Program &program) {
  const TrainConfig &config = program.config;
  std::vector<double> params(program.paramElems), grads(program.paramElems);
  std::vector<double> moments(2 * program.paramElems);
  std::vector<double> accumulators(std::max<int64_t>(1, program.accumulatorElems));
  std::vector<double> normSums(std::max<int64_t>(1, program.normSums));
  std::vector<double> arena(program.activationBytes / sizeof(double) + 16);
  int64_t tokensPerStep = config.batch * config.seqLen;
  std::vector<int32_t> tokens(tokensPerStep), targets(tokensPerStep);

  // xorshift: the same parameters and tokens on every run.
  uint64_t state = 0x9E3779B97F4A7C15ull;
  auto next = [&] {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  };
  auto uniform = [&] { return (next() >> 11) * 0x1.0p-53 * 2 - 1; };
  for (double &p : params)
    p = 0.5 * uniform();
  for (int64_t i = 0; i < tokensPerStep; ++i) {
    tokens[i] = (int32_t)(next() % config.vocab);
    targets[i] = (int32_t)(next() % config.vocab);
  }

  StepContext ctx{};
  ctx.params = reinterpret_cast<float *>(params.data());
  ctx.grads = reinterpret_cast<float *>(grads.data());
  ctx.adamM = reinterpret_cast<float *>(moments.data());
  ctx.adamV = reinterpret_cast<float *>(moments.data() + program.paramElems);
  ctx.accumulators = reinterpret_cast<float *>(accumulators.data());
  ctx.normSums = normSums.data();
  ctx.activations = reinterpret_cast<char *>(arena.data());
  ctx.tokens = tokens.data();
  ctx.targets = targets.data();
  auto loss = [&] {
    program.step(ctx);
    return ctx.lossExact;
  };

  loss();
  const std::vector<double> analytic = grads;
  const double h = 1e-5;
  // Central differences of the float64 program agree with the analytic
  // gradient to about 1e-10; a wrong rule is off by far more than this.
  const double threshold = 1e-5;
  double worst = 0;
  const char *worstName = "";
  int64_t checked = 0;
  for (int k = 0; k < program.numParams; ++k) {
    const ParamInfo &p = program.params[k];
    double paramWorst = 0;
    int64_t samples = std::min<int64_t>(p.numel, 12);
    for (int64_t s = 0; s < samples; ++s) {
      int64_t i = p.offset + s * p.numel / samples;
      double saved = params[i];
      params[i] = saved + h;
      double plus = loss();
      params[i] = saved - h;
      double minus = loss();
      params[i] = saved;
      double numeric = (plus - minus) / (2 * h);
      // Central differences in double: error ~1e-10 at these sizes.
      double error =
          std::fabs(numeric - analytic[i]) / (1e-4 + std::fabs(numeric));
      paramWorst = std::max(paramWorst, error);
      ++checked;
    }
    std::printf("[%*d/%d] %-40s %.3e%s\n", (int)std::to_string(program.numParams).size(),
                k + 1, program.numParams, p.name, paramWorst,
                paramWorst < threshold ? "" : "  above the threshold");
    std::fflush(stdout);
    if (paramWorst > worst) {
      worst = paramWorst;
      worstName = p.name;
    }
  }
  bool pass = worst < threshold;
  std::printf("gradient check: %lld entries, worst relative error %.3e "
              "(%s): %s, the threshold is %.0e\n",
              (long long)checked, worst, worstName,
              pass ? "PASS" : "FAIL", threshold);
  return pass ? 0 : 1;
}

} // namespace tessel::rt
