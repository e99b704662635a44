//===- Check.cpp - `tessel check`: a layout trains as one rank does -------===//
//
// The contract of DESIGN.md section 1 as a command: compile the spec at the
// requested layout and at one rank, train both from the same seed and data,
// and compare every step's loss and every final parameter.
//
//===----------------------------------------------------------------------===//

#include "Commands.h"
#include "Compile.h"

#include "tessel/Runtime/Safetensors.h"

#include "llvm/ADT/ScopeExit.h"
#include "llvm/ADT/SmallString.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/raw_ostream.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <functional>
#include <map>

using namespace llvm;
using tessel::LayoutOverrides;

namespace {

// Each step's loss and, at the steps that evaluated, the validation loss
// (NaN elsewhere).
// An MoE model's also the loss's parts (lm_loss, aux_loss, z_loss) and
// its routing: the assignments per expert of each layer and the dropped
// ones, flattened, per step.
struct Losses {
  std::vector<double> train, valid;
  std::vector<std::map<std::string, double>> parts;
  std::vector<std::vector<double>> routing;
};

Expected<Losses> readLosses(StringRef path) {
  auto text = MemoryBuffer::getFile(path);
  if (!text)
    return createStringError(path + ": " + text.getError().message());
  Losses losses;
  SmallVector<StringRef> lines;
  (*text)->getBuffer().split(lines, '\n', -1, false);
  for (StringRef line : lines) {
    auto j = nlohmann::json::parse(line.begin(), line.end(), nullptr, false);
    if (j.is_discarded() || !j.contains("loss") || !j["loss"].is_number())
      return createStringError(path + ": bad metrics line");
    losses.train.push_back(j["loss"].get<double>());
    losses.valid.push_back(j.contains("val_loss") && j["val_loss"].is_number()
                               ? j["val_loss"].get<double>()
                               : NAN);
    std::map<std::string, double> parts;
    for (const char *key : {"lm_loss", "aux_loss", "z_loss"})
      if (j.contains(key) && j[key].is_number())
        parts[key] = j[key].get<double>();
    losses.parts.push_back(parts);
    std::vector<double> routing;
    std::function<void(const nlohmann::json &)> flatten =
        [&](const nlohmann::json &v) {
          if (v.is_number())
            routing.push_back(v.get<double>());
          else if (v.is_array())
            for (const nlohmann::json &x : v)
              flatten(x);
        };
    for (const char *key : {"expert_tokens", "expert_dropped"})
      if (j.contains(key))
        flatten(j[key]);
    losses.routing.push_back(routing);
  }
  return losses;
}

struct Comparison {
  double lossDiff = 0, paramDiff = 0, validDiff = 0, partDiff = 0;
  int64_t lossStep = -1, validStep = -1, partStep = -1;
  std::string paramName, partName;
  // Expert assignments counted differently (half the summed absolute
  // difference of the per-expert counts) of all counted, over the run.
  double moved = 0, assigned = 0;
  bool routed = false;
};

Expected<Comparison> compareRuns(StringRef refDir, StringRef layoutDir) {
  Comparison c;
  SmallString<256> refMetrics(refDir), layMetrics(layoutDir);
  sys::path::append(refMetrics, "check-metrics.jsonl");
  sys::path::append(layMetrics, "check-metrics.jsonl");
  auto ref = readLosses(refMetrics), lay = readLosses(layMetrics);
  if (!ref)
    return ref.takeError();
  if (!lay)
    return lay.takeError();
  if (ref->train.size() != lay->train.size())
    return createStringError("the runs logged different step counts");
  auto relative = [](double a, double b) {
    return std::fabs(a - b) / std::max(std::fabs(a), 1e-30);
  };
  for (size_t s = 0; s < ref->train.size(); ++s) {
    double d = relative(ref->train[s], lay->train[s]);
    if (c.lossStep < 0 || !(d <= c.lossDiff)) {
      c.lossDiff = d;
      c.lossStep = s;
    }
    for (auto &[name, value] : ref->parts[s]) {
      auto other = lay->parts[s].find(name);
      if (other == lay->parts[s].end())
        return createStringError("the runs logged different metrics");
      double pd = relative(value, other->second);
      if (c.partStep < 0 || !(pd <= c.partDiff)) {
        c.partDiff = pd;
        c.partStep = s;
        c.partName = name;
      }
    }
    if (ref->routing[s].size() != lay->routing[s].size())
      return createStringError("the runs logged different expert counts");
    for (size_t i = 0; i < ref->routing[s].size(); ++i) {
      c.routed = true;
      c.moved += std::fabs(ref->routing[s][i] - lay->routing[s][i]) / 2;
      c.assigned += ref->routing[s][i];
    }
    if (std::isnan(ref->valid[s]) != std::isnan(lay->valid[s]))
      return createStringError("the runs evaluated at different steps");
    if (std::isnan(ref->valid[s]))
      continue;
    d = relative(ref->valid[s], lay->valid[s]);
    if (c.validStep < 0 || !(d <= c.validDiff)) {
      c.validDiff = d;
      c.validStep = s;
    }
  }
  SmallString<256> refWeights(refDir), layWeights(layoutDir);
  sys::path::append(refWeights, "check-final.safetensors");
  sys::path::append(layWeights, "check-final.safetensors");
  try {
    tessel::rt::SafetensorsReader a(std::string(refWeights.str())),
        b(std::string(layWeights.str()));
    if (a.names() != b.names())
      return createStringError("the runs saved different tensors");
    // Differences are relative to the model's largest parameter magnitude:
    // a parameter whose gradient is zero in exact arithmetic (GPT-2's key
    // bias: softmax ignores a constant shift) receives AdamW updates of
    // pure rounding noise, normalised to the size of the learning rate, so
    // its own magnitude is no scale for what summation order changes.
    double scale = 0;
    std::map<std::string, double> diffs;
    for (const std::string &name : a.names()) {
      std::vector<float> x = a.read(name), y = b.read(name);
      if (x.size() != y.size())
        return createStringError("tensor " + name + " has different sizes");
      double diff = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        scale = std::max(scale, (double)std::fabs(x[i]));
        diff = std::max(diff, (double)std::fabs(x[i] - y[i]));
      }
      diffs[name] = diff;
    }
    for (auto &[name, diff] : diffs) {
      double d = diff / std::max(scale, 1e-30);
      if (!(d <= c.paramDiff)) {
        c.paramDiff = d;
        c.paramName = name;
      }
    }
  } catch (const std::exception &e) {
    return createStringError(e.what());
  }
  return c;
}

} // namespace

int tessel::checkCommand(const CheckOptions &options) {
  SmallString<256> work;
  if (std::error_code ec =
          sys::fs::createUniqueDirectory("tessel-check", work)) {
    errs() << "tessel: error: cannot create a temporary directory: "
           << ec.message() << "\n";
    return 1;
  }
  auto cleanup = make_scope_exit([&] { sys::fs::remove_directories(work); });
  SmallString<256> refDir(work), layDir(work);
  sys::path::append(refDir, "one-rank");
  sys::path::append(layDir, "layout");

  CompileOptions ref;
  ref.input = options.input;
  ref.output = std::string(refDir);
  ref.overrides = options.overrides;
  ref.layout = LayoutOverrides::oneRank();
  ref.layout.layers = options.layers;
  CompileOptions layout = ref;
  layout.output = std::string(layDir);
  layout.layout = options.layout;
  // A mixture-of-experts model routes, balances and drops per microbatch:
  // its serial program splits the batch into the layout's microbatches
  // (read from the spec as the layout compiles it: with --layers, which
  // an interleaved layout of a shallow example needs).
  LayoutOverrides checked = options.layout;
  checked.layers = options.layers;
  // The reference's attention is the flash kernel, so an unfused layout is
  // checked against it too; unless the attention probabilities are dropped
  // out, which only the unfused attention does.
  bool flashReference = true;
  if (Expected<tessel::Spec> spec = tessel::loadSpec(
          options.input, options.overrides, checked)) {
    if (spec->model.moe.enabled())
      ref.layout.microbatches = spec->parallel.microbatches;
    flashReference = spec->model.attentionDropout == 0;
  } else {
    consumeError(spec.takeError()); // compile reports it
  }
  // One rank has no dp groups to shard over nor tp ranks to split experts
  // over, and the CPU program keeps its optimizer state in host memory
  // anyway.
  if (flashReference)
    ref.overrides.push_back("train.attention=\"flash\"");
  ref.overrides.push_back("parallel.zero_group=0");
  ref.overrides.push_back("parallel.offload=\"none\"");
  ref.overrides.push_back("parallel.expert_tp=1");
  layout.layout.layers = options.layers;
  layout.target = options.target;
  layout.cudaArch = options.cudaArch;
  layout.fuseKernels = options.fuseKernels;
  for (CompileOptions *o : {&ref, &layout})
    if (Error err = compile(*o)) {
      errs() << "tessel: error: " << toString(std::move(err)) << "\n";
      return 1;
    }
  Expected<nlohmann::json> refPlan = readPlan(refDir),
                           plan = readPlan(layDir);
  for (Expected<nlohmann::json> *p : {&refPlan, &plan})
    if (!*p) {
      errs() << "tessel: error: " << toString(p->takeError()) << "\n";
      return 1;
    }
  // The validation loss is compared too, where there is validation data
  // (the spec's data.valid, or held-out synthetic tokens): twice in the run.
  const nlohmann::json data = refPlan->value("data", nlohmann::json::object());
  bool evaluate = data.value("format", std::string()) == "synthetic" ||
                  data.contains("valid");
  for (StringRef dir : {StringRef(refDir), StringRef(layDir)}) {
    SmallString<256> metrics(dir), weights(dir);
    sys::path::append(metrics, "check-metrics.jsonl");
    sys::path::append(weights, "check-final.safetensors");
    std::vector<std::string> args = {dir.str(),
                                     "--steps",
                                     std::to_string(options.steps),
                                     "--metrics",
                                     std::string(metrics),
                                     "--save-final",
                                     std::string(weights),
                                     "--quiet"};
    if (evaluate && options.steps > 0)
      args.insert(args.end(),
                  {"--eval-every", std::to_string(std::max<int64_t>(
                                       1, options.steps / 2)),
                   "--eval-batches", "2"});
    if (runCommand(args) != 0) {
      errs() << "tessel: error: the run of " << dir << " failed\n";
      return 1;
    }
  }
  Expected<Comparison> c = compareRuns(refDir, layDir);
  if (!c) {
    errs() << "tessel: error: " << toString(c.takeError()) << "\n";
    return 1;
  }
  // What the layout's plan says it computes in, and its ZeRO level.
  int64_t zero = plan->value("zero", int64_t(0));
  double tolerance = options.tolerance;
  if (tolerance < 0) {
    // The CPU program matches one rank to rounding, fp32 CUDA kernels to
    // 1e-4, and bf16 (8 bits of mantissa in the activations) to about 1e-2.
    std::string precision = plan->value("precision", std::string("fp32"));
    tolerance = options.target != "cuda" ? 1e-5
                : precision == "bf16"    ? 3e-2
                                         : 1e-4;
  }
  // Routing is decided by comparisons of probabilities: an assignment may
  // move where two experts' probabilities tie to rounding, as summation
  // order differs between layouts; more than one in a thousand is a
  // difference in the routing itself.
  const double routingTolerance = 1e-3;
  double movedFraction = c->assigned > 0 ? c->moved / c->assigned : 0;
  bool ok = c->lossDiff <= tolerance && c->paramDiff <= tolerance &&
            c->validDiff <= tolerance && c->partDiff <= tolerance &&
            movedFraction <= routingTolerance;
  outs() << "tessel check: " << options.input << ", layout "
         << options.layout.describe();
  if (zero > 0)
    outs() << " zero=" << zero;
  if (zero > 0 && plan->contains("zero_group"))
    outs() << " zero_group=" << (*plan)["zero_group"].get<int64_t>();
  if (plan->contains("offload"))
    outs() << " offload=" << (*plan)["offload"].get<std::string>();
  if (options.target != "cpu")
    outs() << " on " << options.target;
  outs() << " vs one rank on the cpu, " << options.steps << " steps\n"
         << format("  largest relative loss difference      %.3e (step %lld)\n",
                   c->lossDiff, (long long)c->lossStep)
         << format("  largest relative parameter difference %.3e (%s)\n",
                   c->paramDiff, c->paramName.c_str());
  if (c->validStep >= 0)
    outs() << format("  largest relative val_loss difference  %.3e (step %lld)\n",
                     c->validDiff, (long long)c->validStep);
  if (c->partStep >= 0)
    outs() << format("  largest relative loss part difference %.3e (%s, step "
                     "%lld)\n",
                     c->partDiff, c->partName.c_str(), (long long)c->partStep);
  if (c->routed)
    outs() << format("  expert assignments counted otherwise  %.0f of %.0f "
                     "(tolerance %.0e)\n",
                     c->moved, c->assigned, routingTolerance);
  outs() << (ok ? "  OK" : "  FAILED")
         << format(" (tolerance %.1e)\n", tolerance);
  // An assignment that moved on a near-tie sends that token's rows through
  // another expert from then on: the experts' weights (and what follows)
  // part by more than rounding, with no error in the layout to find.
  if (!ok && c->moved > 0 && movedFraction <= routingTolerance)
    outs() << format("  (%.0f expert assignment%s moved on near-ties of the "
                     "router's probabilities, which summation order breaks "
                     "differently; the differences above may follow from "
                     "them alone: check again with another train.seed or "
                     "fewer steps)\n",
                     c->moved, c->moved == 1 ? "" : "s");
  return ok ? 0 : 1;
}
