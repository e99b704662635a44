//===- Plan.cpp - `tessel plan`: choosing a layout for a cluster ----------===//
//
// Enumerates the layouts of a spec on N devices (tensor parallel inside a
// node, with sequence parallelism; pipeline stages and schedule; data
// parallel for the rest; microbatch size; ZeRO level; recomputation),
// estimates each one's step and memory by closed formulas, compiles the
// most promising that fit (the exact memory plan decides) and replays their
// steps with the simulator, and ranks what it simulated. Candidates given
// with --include are always compiled and simulated beside them.
//
//===----------------------------------------------------------------------===//

#include "Commands.h"
#include "Simulate.h"

#include "dialects/Pipe/PipeOps.h"
#include "tessel/Frontend/Spec.h"
#include "tessel/Pipeline/Schedule.h"
#include "tessel/Support/MeshLayout.h"

#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/Program.h"
#include "llvm/Support/raw_ostream.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

using namespace tessel;
using namespace llvm;
using json = nlohmann::json;

namespace {

const char *kPlanUsage =
    "usage: tessel plan SPEC --gpus N (--gpu NAME [--gpus-per-node N] | "
    "--cluster FILE)\n"
    "                   [--global-batch B] [--set K=V]... [--memory-limit "
    "GB]\n"
    "                   [--candidates K] [--include LAYOUT]... [--apply "
    "OUT.json] [--target T] [--json]\n"
    "  Searches the layouts of SPEC on N devices, compiles the K most\n"
    "  promising that fit the memory (default 6) and simulates their steps;\n"
    "  prints them ranked with tokens/s, TFLOP/s per device, MFU and memory,\n"
    "  and why the best wins. A cluster file's node is replicated to N\n"
    "  devices.\n"
    "  --include LAYOUT  also simulate this layout, e.g. "
    "'tp=8,pp=16,mbs=1,zero=0,recompute=full'\n"
    "                    (keys: tp, pp, ep, cp, mbs, v, zero, recompute, sp, "
    "etp, zg,\n"
    "                    order: order=dp-tp-cp-ep-pp, or order=auto for the\n"
    "                    planner's choice; without it the default order)\n"
    "  --apply OUT.json  write SPEC with the best layout\n"
    "  --target T        cpu or cuda (default: cuda with --gpu or a GPU\n"
    "                    cluster file, cpu with a CPU one)\n"
    "  --scaling 64,128,...  instead of --gpus: the best layout at each count,\n"
    "                    the global batch growing with the GPUs (weak) and\n"
    "                    fixed (strong); --svg FILE charts both\n";

int usage(const Twine &message) {
  outs().flush();
  errs() << "tessel plan: " << message << "\n" << kPlanUsage;
  return 2;
}

struct Layout {
  int64_t tp = 1, pp = 1, dp = 1, ep = 1, mbs = 1, microbatches = 1, v = 1,
          zero = 0;
  int64_t cp = 1; // context parallelism: each sequence over cp ranks
  // Hybrid sharding (parallel.zero_group): with zero, shard over groups of
  // this many dp ranks and replicate across them; 0: over all of dp.
  int64_t zeroGroup = 0;
  std::string recompute = "none";
  bool sp = false;
  bool expertTp = false; // MoE: the routed experts split over tp
  // Rank order, innermost first (parallel.order): which axes' groups
  // share a node. Empty (--include order=auto): the planner picks it.
  std::string order = MeshShape().orderName();

  std::string schedule() const { return v > 1 ? "interleaved" : "1f1b"; }
  // ZeRO sharded over groups smaller than dp.
  bool hybrid() const { return zero && zeroGroup > 0 && zeroGroup < dp; }
  MeshShape shape() const {
    MeshShape mesh;
    mesh[MeshAxis::TP] = tp, mesh[MeshAxis::PP] = pp, mesh[MeshAxis::DP] = dp;
    mesh[MeshAxis::EP] = ep, mesh[MeshAxis::CP] = cp;
    mesh.dpShard = hybrid() ? zeroGroup : 0;
    mesh.setOrder(order);
    return mesh;
  }
  std::string str() const {
    std::string s = formatv("tp{0}{1} pp{2} dp{3}{4}{5}, {6} x {7}", tp,
                            sp ? "+sp" : "", pp, dp,
                            cp > 1 ? formatv(" cp{0}", cp).str() : "",
                            ep > 1 ? formatv(" ep{0}", ep).str() : "", mbs,
                            microbatches);
    if (pp > 1)
      s += v > 1 ? formatv(", interleaved x{0}", v).str() : ", 1f1b";
    s += formatv(", zero {0}", zero).str();
    if (hybrid())
      s += formatv(" in groups of {0}", zeroGroup).str();
    s += ", recompute " + recompute;
    if (expertTp)
      s += ", etp";
    if (!shape().defaultOrder())
      s += ", order " + order;
    return s;
  }
};

struct Estimate {
  double step = 0, memory = 0;
};

// The activations the busiest pipeline rank's memory plan holds in the
// schedule Tessel runs, in units of a microbatch's whole stage: with one
// chunk per rank, a slot per microbatch in flight (as pipe::activationSlots
// counts them: a microbatch holds its slot from its forward on the rank to
// its backward there, and microbatch m takes slot m % slots); interleaved,
// a place per chunk of a microbatch in flight (the most at once, over v).
double activationSlots(int64_t pp, int64_t microbatches, int64_t v) {
  static std::map<std::tuple<int64_t, int64_t, int64_t>, double> memo;
  auto key = std::make_tuple(pp, microbatches, v);
  auto it = memo.find(key);
  if (it != memo.end())
    return it->second;
  double most = std::min(microbatches, pp);
  Expected<pipeline::ScheduleKind> kind =
      pipeline::parseScheduleKind(v > 1 ? "interleaved" : "1f1b");
  Expected<pipeline::Schedule> schedule =
      kind ? pipeline::generateSchedule(*kind, pp, microbatches, v)
           : Expected<pipeline::Schedule>(kind.takeError());
  if (schedule) {
    most = 1;
    for (const std::vector<pipeline::Step> &steps : schedule->steps) {
      std::vector<std::pair<bool, int64_t>> order;
      int64_t live = 0, chunks = 0;
      for (const pipeline::Step &step : steps)
        if (step.isCompute()) {
          bool forward = step.kind == pipeline::StepKind::Forward;
          order.push_back({forward, step.microbatch});
          live += forward ? 1 : -1;
          chunks = std::max(chunks, live);
        }
      most = std::max(most, v > 1 ? double(chunks) / v
                                  : double(pipe::activationSlots(
                                        order, microbatches)));
    }
  } else {
    consumeError(schedule.takeError());
  }
  return memo[key] = most;
}

// Closed-form estimates, only to choose what to compile: the compiled
// memory plan and the simulated step decide.
// Where the group over `axes` of the layout's first rank sits on the
// cluster's nodes (remembered: the search asks for the same few often).
sim::GroupPlacement placement(const Layout &l, AxisSet axes,
                              const sim::Cluster &cluster) {
  static std::map<std::string, sim::GroupPlacement> memo;
  MeshShape shape = l.shape();
  // describe() names the sizes, the shard groups and the order.
  std::string key = shape.describe() + " " + axes.str() + " " +
                    std::to_string(cluster.gpusPerNode);
  auto it = memo.find(key);
  if (it == memo.end())
    it = memo.emplace(key, sim::placeGroup(MeshLayout(shape), 0, axes,
                                           cluster))
             .first;
  return it->second;
}

Estimate estimate(const Spec &spec, const Layout &l, int64_t batch,
                  const sim::Cluster &cluster, bool cuda) {
  const ModelSpec &m = spec.model;
  double h = m.hidden, L = m.layers, s = m.seqLen, V = m.paddedVocab();
  double kv = double(m.kvHeads) * m.headDim();
  double mlpMatrices = m.family == "llama" ? 3 : 2;
  double attention = h * (h + 2 * kv) + h * h;
  double dense = mlpMatrices * h * m.ffnHidden;
  // An MoE block: the router, the shared experts (always on) and the
  // routed experts, of which a token passes through top_k and a rank
  // holds experts / ep.
  const MoeSpec &moe = m.moe;
  double expert = mlpMatrices * h * moe.ffnHidden;
  double moeLayers = 0;
  for (int64_t i = 0; i < m.layers; ++i)
    moeLayers += moe.isMoeLayer(i);
  double moeBase = h * moe.experts + moe.sharedExperts * expert;
  double activeParams = L * attention + (L - moeLayers) * dense +
                        moeLayers * (moeBase + moe.topK * expert) +
                        V * h * (m.tieEmbeddings ? 1 : 2);
  double totalParams = activeParams;
  double layerParams =
      attention + (L - moeLayers) / L * dense + moeLayers / L * moeBase;
  double layerExperts = moeLayers / L * moe.experts * expert;
  double stageLayers = std::ceil(L / l.pp);
  double gpuExperts =
      stageLayers * layerExperts / l.ep / (l.expertTp ? l.tp : 1);
  double gpuParams = (stageLayers * layerParams + V * h) / l.tp + gpuExperts;
  // Under ZeRO the dense parameters' state is cut over dp x ep x cp, the
  // experts' over dp x cp: the share of a GPU's parameters a rank keeps.
  // Under hybrid sharding a shard group of zero_group dp ranks holds it.
  bool hybrid = l.hybrid();
  double shardDp = hybrid ? l.zeroGroup : l.dp;
  double shardCp = hybrid ? 1 : l.cp;
  double zeroShare = ((gpuParams - gpuExperts) / (shardDp * shardCp * l.ep) +
                      gpuExperts / (shardDp * shardCp)) /
                     gpuParams;
  double devices = double(l.tp) * l.pp * l.dp * l.ep * l.cp;
  double elem = cuda ? 2 : 4;
  double peak = cluster.peak(cuda ? "bf16" : "fp32");
  const sim::Device &d = cluster.device;

  double tokens = double(batch) * s;
  // Context parallelism: a rank holds s / cp of each sequence. In balanced
  // pieces (parallel.cp_layout, the default of dense models) every rank has
  // the same attention work; in contiguous ones (MoE models) the last
  // piece's queries see the most keys, (2cp-1)/cp of the mean, which every
  // collective then waits for.
  double attentionShare = m.moe.enabled() ? (2.0 * l.cp - 1) / l.cp : 1.0;
  double flops = (6 * totalParams + 12 * L * h * s * attentionShare) *
                 tokens / devices;
  if (l.recompute == "full")
    flops *= 4.0 / 3.0;
  double rows = l.mbs * s / l.cp, hh = d.gemmHalfSize;
  double shape = (rows / (rows + hh)) * ((h / l.tp) / (h / l.tp + hh)) *
                 (h / (h + hh));
  double compute = flops / (peak * d.gemmEfficiency * shape);
  // Memory-bound kernels: about 40 activations' worth per layer and
  // microbatch, three passes (four with recomputation).
  double layersHere = std::ceil(L / l.pp);
  double act = rows * h / (l.sp ? l.tp : 1);
  double passes = l.recompute == "full" ? 4 : 3;
  compute += 40 * act * elem * passes * layersHere * l.microbatches /
             (d.memoryBandwidth * d.memoryEfficiency);
  // Unfused attention writes and reads its scores and probabilities (and
  // their dropout), s per token and head, about four times a pass.
  if (spec.train.attention == "unfused")
    compute += rows * double(m.heads) / l.tp * s * elem * 4 *
               (l.recompute == "none" ? 3 : 4) *
               (m.attentionDropout > 0 ? 2 : 1) * layersHere *
               l.microbatches / (d.memoryBandwidth * d.memoryEfficiency);
  double tpComm = 0;
  if (l.tp > 1) {
    sim::GroupPlacement g = placement(l, MeshAxis::TP, cluster);
    double bytes = 2.0 * (l.tp - 1) / l.tp * rows * h * elem;
    double perLayer = (l.recompute == "full" ? 6 : 4) *
                      sim::collectiveSeconds("all_reduce", bytes, g, cluster);
    tpComm = perLayer * layersHere * l.microbatches;
  }
  // The keys and values gathered over cp forward and backward, and their
  // gradients reduce-scattered: six collectives per layer and microbatch
  // (seven with full recompute).
  double cpComm = 0;
  if (l.cp > 1) {
    sim::GroupPlacement g = placement(l, MeshAxis::CP, cluster);
    double kvLocal = m.kvHeads % l.tp == 0 ? kv / l.tp : kv;
    double bytes = (l.cp - 1.0) / l.cp * l.mbs * s * kvLocal * elem;
    cpComm = (l.recompute == "full" ? 8 : 6) *
             sim::collectiveSeconds("all_gather", bytes, g, cluster) *
             layersHere * l.microbatches;
  }
  // Expert parallelism: each MoE layer's tokens go to their top_k experts
  // and come back, forward and backward (and in the recomputed forward):
  // four all-to-alls (six) per MoE layer and microbatch, each sending the
  // (ep-1)/ep of a rank's routed rows that leave it.
  double epComm = 0;
  if (l.ep > 1 && moeLayers > 0) {
    sim::GroupPlacement g = placement(l, MeshAxis::EP, cluster);
    double routed = rows / (l.sp && !l.expertTp ? l.tp : 1);
    double bytes = (l.ep - 1.0) / l.ep * routed * moe.topK * h * elem;
    epComm = (l.recompute == "full" ? 6 : 4) *
             sim::collectiveSeconds("all_to_all", bytes, g, cluster) *
             std::ceil(moeLayers / l.pp) * l.microbatches;
  }
  double work = compute + tpComm + cpComm + epComm;
  double bubble = l.pp > 1 ? work * (l.pp - 1) / double(l.microbatches * l.v)
                           : 0;
  double dpComm = 0;
  // Gradients are summed over dp x cp (each cp rank's piece of the
  // sequences adds its share).
  if (l.dp * l.cp > 1) {
    sim::GroupPlacement g =
        placement(l, AxisSet(MeshAxis::DP) | MeshAxis::CP, cluster);
    double sum = double(l.dp * l.cp);
    double bytes = 2.0 * (sum - 1) / sum * gpuParams * 4;
    dpComm = sim::collectiveSeconds("all_reduce", bytes, g, cluster);
    if (hybrid) {
      // A reduce-scatter and a gather inside the shard group (the volume of
      // an all-reduce there), and the pieces all-reduced over the replicas.
      g = placement(l, AxisSet::dpShard(), cluster);
      sim::GroupPlacement r = placement(l, AxisSet::dpReplica(), cluster);
      double groups = l.dp / shardDp;
      dpComm = sim::collectiveSeconds(
                   "all_reduce", 2.0 * (shardDp - 1) / shardDp * gpuParams * 4,
                   g, cluster) +
               sim::collectiveSeconds("all_reduce",
                                      2.0 * (groups - 1) / groups *
                                          gpuParams * 4 / shardDp,
                                      r, cluster);
    }
    // ZeRO reduce-scatters and gathers each run of parameters on its own
    // (a GPT layer's are six, a Llama layer's nine): a ring's latency per
    // step of the group, for each. They run in the background as the
    // gradient buckets do.
    if (l.zero >= 1 && l.dp > 1) {
      bool cross = g.nodes > 1;
      double alpha =
          cross ? cluster.interNode.latency : cluster.intraNode.latency;
      double runs = m.family == "llama" ? 9 : 6;
      dpComm += 2 * (runs * stageLayers + 2) * (shardDp - 1) * alpha;
    }
    // Without a pipeline the gradients' buckets reduce during backward.
    if (l.pp == 1)
      dpComm = std::max(0.0, dpComm - 0.6 * work);
    // ZeRO-3 gathers each stage's parameters for every microbatch's
    // forward and backward (prefetched: half of it hidden), in its shard
    // group.
    if (l.zero >= 3 && l.dp > 1)
      dpComm += 0.5 * 2 * l.microbatches *
                sim::collectiveSeconds("all_gather",
                                       (shardDp - 1.0) / shardDp * gpuParams *
                                           elem,
                                       g, cluster);
  }
  double optimizer = gpuParams * 36 * (l.zero ? zeroShare : 1) /
                     (d.memoryBandwidth * d.memoryEfficiency);
  Estimate e;
  e.step = work + bubble + dpComm + optimizer;

  // fp32 parameters (pieces from ZeRO-3, plus two gathered layers'
  // worth; in bf16 the master weights of the matrices as pieces from
  // ZeRO-1, parallel.master_pieces), gradients (pieces from ZeRO-2),
  // AdamW's moments (pieces from ZeRO-1), the bf16 copy.
  double layerShare = gpuParams / std::max(1.0, stageLayers);
  bool masterPieces = cuda && spec.train.precision == "bf16" &&
                      spec.parallel.masterPieces && l.zero >= 1;
  double state =
      gpuParams * ((l.zero >= 3 || masterPieces ? 4.0 * zeroShare : 4) +
                   (l.zero >= 2 ? 4.0 * zeroShare : 4) +
                   (l.zero >= 1 ? 8.0 * zeroShare : 8) + (cuda ? 2 : 0)) +
      (l.zero >= 3 ? 2 * layerShare * (4 + 4) : 0);
  double perLayer = l.recompute == "full"
                        ? 2 * act
                        : rows * h * (l.sp ? 34.0 / l.tp : 10 + 24.0 / l.tp);
  // An MoE block keeps its routed rows instead of a dense MLP's: each
  // token's top_k assignments through an expert's input and hidden
  // activations (SwiGLU's four, three with the CUDA target's fused
  // backward, GELU's two), in buffers the static plan
  // sizes for the worst case under ep (every token of the ep group routed
  // to this rank's experts), with a capacity as well (the plan does not
  // size them by it).
  if (moeLayers > 0 && l.recompute != "full") {
    double routed = rows * moe.topK / (l.sp && !l.expertTp ? l.tp : 1);
    // A token sends each expert one row at most: min(k, E/ep) per token of
    // the ep group.
    double held =
        routed * l.ep * std::min(1.0, double(moe.experts) / l.ep / moe.topK);
    double width = h + (mlpMatrices == 3 ? (cuda ? 3 : 4) : 2) * moe.ffnHidden /
                           (l.expertTp ? l.tp : 1);
    double mlp = rows * h * (l.sp ? 19.0 / l.tp : 2 + 17.0 / l.tp);
    perLayer += moeLayers / L * (held * width * 2 - mlp);
  }
  // Unfused attention keeps its probabilities (and their dropout), s per
  // token and head, unless recomputed.
  if (spec.train.attention == "unfused" && l.recompute == "none")
    perLayer += rows * double(m.heads) / l.tp * s *
                (m.attentionDropout > 0 ? 2 : 1);
  // Microbatches in flight, in units of a stage's layers.
  double inFlight = l.pp > 1 ? activationSlots(l.pp, l.microbatches, l.v) : 1;
  double activations = perLayer * (elem / 2) * layersHere * inFlight +
                       rows * h * 34.0 / l.tp * (elem / 2) +
                       2 * rows * V / l.tp * 4;
  e.memory = state + activations;
  return e;
}

// The layout in the rank order (pp outermost) whose estimated step is
// shortest on the cluster: every order of its axes with more than one rank
// is tried (those of one rank, which number nothing, follow in the default
// order); the default wins a tie.
Layout withBestOrder(const Spec &spec, Layout l, int64_t batch,
                     const sim::Cluster &cluster, bool cuda) {
  MeshShape shape = l.shape(), byDefault;
  std::vector<MeshAxis> active, idle;
  for (int i = kNumMeshAxes - 1; i > 0; --i) // innermost first, pp left out
    (shape[byDefault.order[i]] > 1 ? active : idle)
        .push_back(byDefault.order[i]);
  l.order = byDefault.orderName();
  Layout best = l;
  double bestStep = estimate(spec, best, batch, cluster, cuda).step;
  std::vector<MeshAxis> tried = active;
  std::sort(tried.begin(), tried.end());
  do {
    if (tried == active)
      continue; // the default
    Layout candidate = l;
    candidate.order.clear();
    for (const std::vector<MeshAxis> *axes : {&tried, &idle})
      for (MeshAxis axis : *axes)
        candidate.order += std::string(meshAxisName(axis)) + "-";
    candidate.order += "pp";
    double step = estimate(spec, candidate, batch, cluster, cuda).step;
    if (step < bestStep * (1 - 1e-9)) {
      best = candidate;
      bestStep = step;
    }
  } while (std::next_permutation(tried.begin(), tried.end()));
  return best;
}

std::vector<std::string> compileFlags(const Layout &l) {
  std::vector<std::string> f = {"--dp",
                                std::to_string(l.dp),
                                "--tp",
                                std::to_string(l.tp),
                                "--pp",
                                std::to_string(l.pp),
                                "--microbatches",
                                std::to_string(l.microbatches),
                                "--schedule",
                                l.schedule(),
                                "--recompute",
                                l.recompute,
                                "--set",
                                "parallel.sequence_parallel=" +
                                    std::string(l.sp ? "true" : "false"),
                                "--set",
                                "parallel.zero=" + std::to_string(l.zero)};
  // Every axis and option of the layout, also where it is one (or off): a
  // spec's own (an ep of 4) must not stay under a layout without it.
  f.insert(
      f.end(),
      {"--virtual-stages", std::to_string(l.v), "--ep", std::to_string(l.ep),
       "--cp", std::to_string(l.cp), "--set",
       "parallel.expert_tp=" + std::to_string(l.expertTp ? l.tp : 1), "--set",
       "parallel.zero_group=" + std::to_string(l.hybrid() ? l.zeroGroup : 0)});
  f.insert(f.end(), {"--order", l.order});
  return f;
}

// "tp=8,pp=16,mbs=1,zero=1,recompute=full,v=2,sp=true".
Expected<Layout> parseLayout(const std::string &text, int64_t devices,
                             int64_t batch) {
  Layout l;
  l.sp = true;
  bool spGiven = false;
  SmallVector<StringRef> items;
  StringRef(text).split(items, ',');
  for (StringRef item : items) {
    auto [key, value] = item.trim().split('=');
    int64_t n = 0;
    bool number = !value.getAsInteger(10, n) && n >= 0;
    if (key == "recompute" && (value == "none" || value == "selective" ||
                               value == "full"))
      l.recompute = value.str();
    else if (key == "sp" && (value == "true" || value == "false"))
      l.sp = value == "true", spGiven = true;
    else if (key == "etp" && (value == "true" || value == "false"))
      l.expertTp = value == "true";
    else if (key == "tp" && number && n >= 1)
      l.tp = n;
    else if (key == "pp" && number && n >= 1)
      l.pp = n;
    else if (key == "mbs" && number && n >= 1)
      l.mbs = n;
    else if (key == "v" && number && n >= 1)
      l.v = n;
    else if (key == "ep" && number && n >= 1)
      l.ep = n;
    else if (key == "cp" && number && n >= 1)
      l.cp = n;
    else if (key == "zero" && number && n <= 3)
      l.zero = n;
    else if (key == "zg" && number && n >= 2)
      l.zeroGroup = n;
    else if (key == "order" && value == "auto")
      l.order.clear(); // the planner's choice, as for a searched layout
    else if (key == "order" && MeshShape().setOrder(value.str()))
      l.order = value.str();
    else
      return createStringError("--include '" + text + "': cannot read '" +
                               item.str() +
                               "' (keys: tp, pp, ep, cp, mbs, v, zero, "
                               "recompute, sp, etp, zg, order)");
  }
  if (!spGiven || l.tp == 1)
    l.sp = l.sp && l.tp > 1;
  l.expertTp = l.expertTp && l.tp > 1;
  if (devices % (l.tp * l.pp * l.ep * l.cp))
    return createStringError(formatv("--include '{0}': tp x pp{1}{2} = {3} "
                                     "does not divide the {4} devices",
                                     text, l.ep > 1 ? " x ep" : "",
                                     l.cp > 1 ? " x cp" : "",
                                     l.tp * l.pp * l.ep * l.cp, devices));
  l.dp = devices / (l.tp * l.pp * l.ep * l.cp);
  if (batch % (l.dp * l.ep * l.mbs))
    return createStringError(formatv("--include '{0}': the global batch {1} "
                                     "is not a multiple of dp x ep x mbs = {2}",
                                     text, batch, l.dp * l.ep * l.mbs));
  l.microbatches = batch / (l.dp * l.ep * l.mbs);
  if (l.zeroGroup && (!l.zero || l.dp % l.zeroGroup))
    return createStringError(formatv("--include '{0}': zg={1} needs zero >= 1 "
                                     "and dividing dp = {2}",
                                     text, l.zeroGroup, l.dp));
  return l;
}

struct Candidate {
  Layout layout;
  Estimate estimate;
  bool included = false;
  // After compiling and simulating.
  bool compiled = false, fits = false;
  std::string error;
  double memory = 0; // the largest rank's plan
  sim::SimResult result;
};


// Why `a` is faster than `b`: the parts of the slowest program's step that
// differ most.
std::string whyFaster(const Candidate &a, const Candidate &b) {
  auto slowest = [](const sim::SimResult &r) {
    const sim::ProgramTimes *p = &r.programs.front();
    for (const sim::ProgramTimes &q : r.programs)
      if (q.compute + q.optimizer > p->compute + p->optimizer)
        p = &q;
    return *p;
  };
  sim::ProgramTimes pa = slowest(a.result), pb = slowest(b.result);
  struct Part {
    const char *what;
    double a, b;
  };
  std::vector<Part> parts = {{"compute", pa.compute, pb.compute},
                             {"optimizer", pa.optimizer, pb.optimizer},
                             {"exposed communication", pa.exposedComm,
                              pb.exposedComm},
                             {"pipeline bubble", pa.bubble, pb.bubble}};
  std::sort(parts.begin(), parts.end(), [](const Part &x, const Part &y) {
    return (x.b - x.a) > (y.b - y.a);
  });
  std::string out = formatv("{0:f1}% faster than the runner-up: ",
                            100 * (b.result.stepTime / a.result.stepTime - 1));
  int said = 0;
  for (const Part &p : parts) {
    if (p.b - p.a <= 1e-3 * b.result.stepTime || said == 2)
      continue;
    out += formatv("{0}{1} less {2} ({3} vs {4})", said ? "; " : "",
                   formatSeconds(p.b - p.a), p.what, formatSeconds(p.a),
                   formatSeconds(p.b));
    ++said;
  }
  if (!said)
    return out + "no part of the step differs by more than 0.1% (a near tie)";
  for (const Part &p : parts)
    if (p.a - p.b > 1e-3 * b.result.stepTime) {
      out += formatv(", for {0} more {1}", formatSeconds(p.a - p.b), p.what);
      break;
    }
  return out;
}

// What one search is asked.
struct PlanRequest {
  std::string specPath, target;
  std::vector<std::string> sets, includes;
  int64_t devices = 0;
  double limit = 0;
  int64_t candidates = 6;
  sim::Cluster cluster;
};

struct PlanOutcome {
  Spec spec;
  int64_t batch = 0;
  size_t searched = 0, fitByEstimate = 0;
  int compiled = 0, simulated = 0;
  double seconds = 0;
  std::vector<Candidate> all;
  // What was compiled and simulated, best first (those that fit first).
  std::vector<const Candidate *> ranked;
  const Candidate *best() const {
    return !ranked.empty() && ranked.front()->fits ? ranked.front() : nullptr;
  }
};

Expected<std::unique_ptr<PlanOutcome>> searchLayouts(const PlanRequest &req) {
  auto out = std::make_unique<PlanOutcome>();
  // The spec's own layout is not a constraint: each candidate replaces it.
  Expected<Spec> spec =
      loadSpec(req.specPath, req.sets, LayoutOverrides::oneRank());
  if (!spec)
    return spec.takeError();
  out->spec = *spec;
  const int64_t devices = req.devices, batch = spec->train.globalBatch;
  out->batch = batch;
  const sim::Cluster &cluster = req.cluster;
  const double limit = req.limit;
  const bool cuda = req.target == "cuda";
  if (cluster.devices() < devices)
    return createStringError(formatv("--gpus {0}: the cluster has {1} devices",
                                     devices, cluster.devices()));

  // Every layout: tp within a node and dividing the heads; pp up to the
  // layers; dp the rest; microbatch sizes that divide the rank's batch.
  std::vector<Candidate> &all = out->all;
  std::set<std::string> seen;
  const ModelSpec &m = spec->model;
  // A searched layout takes the rank order its estimate likes best (the
  // default on a tie); one given with --include keeps its own (the default
  // unless it says order=NAME), or takes the best with order=auto.
  auto add = [&](Layout l, bool included) {
    if (!included || l.order.empty())
      l = withBestOrder(*spec, l, batch, cluster, cuda);
    if (!seen.insert(l.str()).second) {
      for (Candidate &c : all)
        if (c.layout.str() == l.str())
          c.included |= included;
      return;
    }
    Candidate c;
    c.layout = l;
    c.included = included;
    c.estimate = estimate(*spec, l, batch, cluster, cuda);
    all.push_back(c);
  };
  // Expert parallel degrees: powers of two dividing the experts (1 for a
  // dense model).
  std::vector<int64_t> eps = {1};
  for (int64_t ep = 2; ep <= m.moe.experts; ep *= 2)
    if (m.moe.experts % ep == 0)
      eps.push_back(ep);
  // Context parallel degrees: powers of two whose pieces keep at least 4096
  // tokens of each sequence (shorter pieces would spend more on gathering
  // the keys and values than they save), with flash attention.
  std::vector<int64_t> cps = {1};
  if (spec->train.attention != "unfused")
    for (int64_t cp = 2; m.seqLen % cp == 0 && m.seqLen / cp >= 4096; cp *= 2)
      cps.push_back(cp);
  auto addLayouts = [&](int64_t tp, int64_t pp, int64_t ep, int64_t cp) {
    if (devices % (tp * pp * ep * cp))
      return;
    int64_t dp = devices / (tp * pp * ep * cp);
    if (batch % (dp * ep))
      return;
    int64_t perRank = batch / (dp * ep);
    for (int64_t mbs : {1, 2, 4, 8, 16}) {
      if (perRank % mbs)
        continue;
      int64_t micro = perRank / mbs;
      if (pp > 1 && micro < pp)
        continue;
      for (int64_t v : {1, 2}) {
        if (v > 1 && (pp == 1 || m.layers % (pp * v) || micro % pp))
          continue;
        for (int64_t zero : {0, 1, 2, 3}) {
          if (zero && dp == 1)
            continue;
          // Selective recomputation recomputes the attention core, which
          // flash attention never stores: the program is none's; with
          // unfused attention it is a layout of its own.
          // An MoE model's experts whole on each tp rank, or split over
          // tp (with ep too: the experts over ep, each one's width over
          // tp).
          for (const char *rc : {"none", "selective", "full"})
            for (bool etp : {false, true}) {
              if (std::string(rc) == "selective" &&
                  spec->train.attention != "unfused")
                continue;
              if (etp && (tp == 1 || !m.moe.enabled() ||
                          m.moe.ffnHidden % tp))
                continue;
              Layout l;
              l.tp = tp, l.pp = pp, l.dp = dp, l.ep = ep, l.cp = cp;
              l.mbs = mbs;
              l.microbatches = micro, l.v = v, l.zero = zero;
              l.recompute = rc, l.sp = tp > 1, l.expertTp = etp;
              add(l, false);
              // With ZeRO, also sharded within the dp ranks of a node
              // (hybrid sharding) when dp spans nodes.
              if (!zero || cp > 1)
                continue;
              int64_t perNode =
                  placement(l, AxisSet(MeshAxis::DP), cluster).perNode;
              if (perNode > 1 && perNode < dp && dp % perNode == 0) {
                l.zeroGroup = perNode;
                add(l, false);
              }
            }
        }
      }
    }
  };
  for (int64_t tp = 1; tp <= std::min(cluster.gpusPerNode, devices); tp *= 2) {
    if (m.heads % tp || m.kvHeads % tp || m.ffnHidden % tp || m.hidden % tp)
      continue;
    for (int64_t pp = 1; pp <= m.layers && tp * pp <= devices; ++pp)
      for (int64_t ep : eps)
        for (int64_t cp : cps)
          if (tp * pp * ep * cp <= devices &&
              (m.seqLen / cp) % (tp > 1 ? tp : 1) == 0)
            addLayouts(tp, pp, ep, cp);
  }
  out->searched = all.size();
  for (const std::string &text : req.includes) {
    Expected<Layout> l = parseLayout(text, devices, batch);
    if (!l)
      return l.takeError();
    add(*l, true);
  }
  if (all.empty())
    return createStringError(formatv("no layout of {0} on {1} devices "
                                     "divides the global batch {2}",
                                     req.specPath, devices, batch));

  // The most promising by estimate that fit (with a margin: the estimate
  // is rough) go first.
  std::vector<size_t> order(all.size());
  for (size_t i = 0; i < order.size(); ++i)
    order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    bool fa = all[a].estimate.memory <= 1.25 * limit;
    bool fb = all[b].estimate.memory <= 1.25 * limit;
    if (fa != fb)
      return fa;
    return all[a].estimate.step < all[b].estimate.step;
  });
  for (const Candidate &c : all)
    out->fitByEstimate += c.estimate.memory <= 1.25 * limit;

  SmallString<128> work;
  if (std::error_code ec =
          sys::fs::createUniqueDirectory("tessel-plan", work))
    return createStringError("cannot create a working directory: " +
                             ec.message());
  auto self = sys::fs::getMainExecutable(nullptr, nullptr);
  auto start = std::chrono::steady_clock::now();
  int &simulated = out->simulated, &compiledCount = out->compiled;
  auto evaluate = [&](Candidate &c, size_t index) {
    c.compiled = true;
    ++compiledCount;
    std::string dir = formatv("{0}/c{1}", work, index);
    std::vector<std::string> argv = {self,        "compile", req.specPath,
                                     "-o",        dir,       "--emit-only",
                                     "--target",  req.target};
    for (const std::string &s : req.sets)
      argv.insert(argv.end(), {"--set", s});
    std::vector<std::string> flags = compileFlags(c.layout);
    argv.insert(argv.end(), flags.begin(), flags.end());
    // A layout the compiler refuses is dropped, with the compiler's first
    // error as the reason.
    std::vector<StringRef> argRefs(argv.begin(), argv.end());
    std::string log = dir + ".log";
    std::optional<StringRef> redirects[] = {std::nullopt, StringRef(""),
                                            StringRef(log)};
    int rc = sys::ExecuteAndWait(self, argRefs, std::nullopt, redirects);
    if (rc != 0) {
      c.error = "does not compile";
      if (auto text = MemoryBuffer::getFile(log)) {
        SmallVector<StringRef> lines;
        (*text)->getBuffer().split(lines, '\n');
        for (StringRef line : lines)
          if (size_t at = line.find("error: "); at != StringRef::npos) {
            c.error += ": " + line.drop_front(at + 7).trim().str();
            break;
          }
      }
      return;
    }
    Expected<json> plan = readPlan(dir);
    if (!plan) {
      c.error = toString(plan.takeError());
      return;
    }
    for (auto &[name, program] : (*plan)["programs"].items())
      c.memory = std::max(
          c.memory, program["memory"].value("total_bytes", 0.0));
    c.fits = c.memory <= limit;
    if (!c.fits && !c.included) {
      c.error = "needs " + formatBytes(c.memory);
      sys::fs::remove_directories(dir);
      return;
    }
    Expected<sim::SimResult> r =
        simulateCompiled(dir, cluster, simOptionsFor(*plan));
    sys::fs::remove_directories(dir);
    if (!r) {
      c.error = toString(r.takeError());
      return;
    }
    c.result = *r;
    ++simulated;
  };
  // A layout that differs from one already simulated only in its ZeRO
  // level is left out (the levels trade memory for communication, which
  // the first that fits already shows), so that the candidates differ. A
  // hybrid-sharded layout is a shape of its own, simulated beside them: it
  // moves its bytes over other links, and the estimate of ZeRO's
  // collectives is rough (it must not keep the plain layout from being
  // simulated, nor take its place among the K).
  int fittingSimulated = 0;
  std::set<std::string> simulatedShapes;
  auto shapeKey = [](Layout l) {
    bool hybrid = l.hybrid();
    l.zero = 0;
    return l.str() + (hybrid ? ", hybrid" : "");
  };
  for (size_t k = 0; k < order.size() && fittingSimulated < req.candidates &&
                     compiledCount < 4 * req.candidates;
       ++k) {
    Candidate &c = all[order[k]];
    if (c.estimate.memory > 1.25 * limit)
      break;
    if (simulatedShapes.count(shapeKey(c.layout)))
      continue;
    evaluate(c, order[k]);
    if (c.fits && c.error.empty()) {
      // A hybrid-sharded layout is simulated beside the K, not instead
      // of one of them.
      if (!c.layout.hybrid())
        ++fittingSimulated;
      simulatedShapes.insert(shapeKey(c.layout));
    }
  }
  for (size_t i = 0; i < all.size(); ++i)
    if (all[i].included && !all[i].compiled)
      evaluate(all[i], i);
  sys::fs::remove_directories(work);
  out->seconds = std::chrono::duration<double>(
                       std::chrono::steady_clock::now() - start)
                       .count();

  std::vector<const Candidate *> &ranked = out->ranked;
  for (const Candidate &c : all)
    if (c.compiled && c.error.empty())
      ranked.push_back(&c);
  std::stable_sort(ranked.begin(), ranked.end(),
                   [](const Candidate *a, const Candidate *b) {
                     if (a->fits != b->fits)
                       return a->fits;
                     return a->result.stepTime < b->result.stepTime;
                   });
  return std::move(out);
}


// `--scaling 64,128,...`: the best layout at each count, the global batch
// growing with the devices (weak scaling) and fixed (strong scaling).
struct ScalingPoint {
  int64_t devices = 0, weakBatch = 0;
  const Candidate *weak = nullptr, *strong = nullptr;
  std::unique_ptr<PlanOutcome> weakPlan, strongPlan;
};

std::string xmlEscaped(StringRef text) {
  std::string out;
  for (char c : text)
    switch (c) {
    case '<':
      out += "&lt;";
      break;
    case '>':
      out += "&gt;";
      break;
    case '&':
      out += "&amp;";
      break;
    case '"':
      out += "&quot;";
      break;
    default:
      out += c;
    }
  return out;
}

std::string scalingSvg(const std::vector<ScalingPoint> &points,
                       const std::string &title, double base) {
  // Two panels: model TFLOP/s per device, and efficiency against the first
  // count; weak and strong scaling as two lines, GPUs on a log2 axis.
  const int W = 900, H = 380, panelW = 400, top = 50, plotH = 260;
  auto x = [&](size_t i, int left) {
    return left + 40 + (points.size() > 1
                            ? double(i) * (panelW - 60) / (points.size() - 1)
                            : 0.0);
  };
  std::string svg = formatv(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" "
      "height=\"{1}\" font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{2}\" y=\"22\" text-anchor=\"middle\" "
      "font-size=\"15\">{3}</text>\n",
      W, H, W / 2, xmlEscaped(title));
  double maxT = 0;
  for (const ScalingPoint &p : points)
    for (const Candidate *c : {p.weak, p.strong})
      if (c)
        maxT = std::max(maxT, c->result.tflopsPerDevice());
  maxT = maxT > 0 ? maxT * 1.15 : 1;
  const char *colors[] = {"#1f77b4", "#ff7f0e"};
  const char *names[] = {"weak scaling", "strong scaling"};
  for (int panel = 0; panel < 2; ++panel) {
    int left = 40 + panel * (panelW + 60);
    double maxY = panel == 0 ? maxT : 1.2;
    auto y = [&](double v) { return top + plotH - v / maxY * plotH; };
    svg += formatv("<text x=\"{0}\" y=\"{1}\" text-anchor=\"middle\">{2}"
                   "</text>\n",
                   left + panelW / 2, top - 8,
                   panel == 0 ? "model TFLOP/s per GPU"
                              : "efficiency (per-GPU throughput / at first "
                                "count)");
    svg += formatv("<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" "
                   "stroke=\"black\"/><line x1=\"{0}\" y1=\"{2}\" "
                   "x2=\"{3}\" y2=\"{2}\" stroke=\"black\"/>\n",
                   left + 30, top, top + plotH, left + panelW);
    for (int t = 0; t <= 4; ++t) {
      double v = maxY * t / 4;
      svg += formatv("<text x=\"{0}\" y=\"{1:f1}\" text-anchor=\"end\">"
                     "{2}</text>\n",
                     left + 26, y(v) + 4,
                     panel == 0 ? formatv("{0:f0}", v).str()
                                : formatv("{0:f0}%", 100 * v).str());
    }
    for (size_t i = 0; i < points.size(); ++i)
      svg += formatv("<text x=\"{0:f1}\" y=\"{1}\" text-anchor=\"middle\">"
                     "{2}</text>\n",
                     x(i, left), top + plotH + 16, points[i].devices);
    svg += formatv("<text x=\"{0}\" y=\"{1}\" text-anchor=\"middle\">GPUs"
                   "</text>\n",
                   left + panelW / 2, top + plotH + 34);
    for (int line = 0; line < 2; ++line) {
      std::string path;
      double first = 0;
      for (size_t i = 0; i < points.size(); ++i) {
        const Candidate *c = line == 0 ? points[i].weak : points[i].strong;
        if (!c)
          continue;
        double t = c->result.tflopsPerDevice();
        if (first == 0)
          first = line == 0 ? base : t;
        double v = panel == 0 ? t : t / first;
        path += formatv("{0}{1:f1},{2:f1} ", path.empty() ? "M" : "L",
                        x(i, left), y(v));
        svg += formatv("<circle cx=\"{0:f1}\" cy=\"{1:f1}\" r=\"3\" "
                       "fill=\"{2}\"/>\n",
                       x(i, left), y(v), colors[line]);
      }
      if (!path.empty())
        svg += formatv("<path d=\"{0}\" fill=\"none\" stroke=\"{1}\" "
                       "stroke-width=\"2\"/>\n",
                       path, colors[line]);
    }
  }
  for (int line = 0; line < 2; ++line)
    svg += formatv("<rect x=\"{0}\" y=\"{1}\" width=\"14\" height=\"4\" "
                   "fill=\"{2}\"/><text x=\"{3}\" y=\"{4}\">{5}</text>\n",
                   80 + line * 160, H - 20, colors[line], 100 + line * 160,
                   H - 14, names[line]);
  return svg + "</svg>\n";
}

// The weak- and strong-scaling table (and chart) of `--scaling`.
template <typename RequestFor>
int scalingReport(PlanRequest &req, const std::vector<int64_t> &counts,
                  RequestFor &&requestFor,
                  std::map<std::string, std::string> &values) {
  // The spec's own layout is not a constraint: each candidate replaces it.
  Expected<Spec> spec =
      loadSpec(req.specPath, req.sets, LayoutOverrides::oneRank());
  if (!spec)
    return fail(toString(spec.takeError()));
  const int64_t baseBatch = spec->train.globalBatch;
  std::vector<ScalingPoint> points;
  auto start = std::chrono::steady_clock::now();
  for (int64_t n : counts) {
    ScalingPoint p;
    p.devices = n;
    if (Error e = requestFor(n))
      return fail(toString(std::move(e)));
    // Weak: the global batch grows with the devices.
    p.weakBatch = baseBatch * n / counts.front();
    PlanRequest weak = req;
    weak.sets.push_back("train.global_batch=" + std::to_string(p.weakBatch));
    weak.includes.clear();
    if (auto o = searchLayouts(weak)) {
      p.weakPlan = std::move(*o);
      p.weak = p.weakPlan->best();
    } else {
      consumeError(o.takeError());
    }
    PlanRequest strong = req;
    strong.includes.clear();
    if (n == counts.front()) {
      p.strong = p.weak;
    } else if (auto o = searchLayouts(strong)) {
      p.strongPlan = std::move(*o);
      p.strong = p.strongPlan->best();
    } else {
      consumeError(o.takeError());
    }
    points.push_back(std::move(p));
  }
  double seconds = std::chrono::duration<double>(
                       std::chrono::steady_clock::now() - start)
                       .count();
  if (!points.front().weak)
    return fail(formatv("no layout of {0} fits on {1} devices",
                        req.specPath, counts.front()));
  double base = points.front().weak->result.tflopsPerDevice();
  json rows = json::array();
  outs() << formatv("scaling of {0} on {1} GPUs, {2} at {3} GPUs "
                    "(weak: the batch grows with the GPUs; strong: it "
                    "stays {2}); {4:f1} s\n",
                    req.specPath, req.cluster.device.name, baseBatch,
                    counts.front(), seconds);
  outs() << formatv("  {0,6} {1,7} {2,-52} {3,12} {4,8} {5,6} | {6,12} {7,8} "
                    "{8,6}\n",
                    "GPUs", "batch", "weak: best layout", "tokens/s",
                    "TFLOP/s", "eff", "strong tok/s", "TFLOP/s", "eff");
  double strongBase = points.front().strong
                          ? points.front().strong->result.tflopsPerDevice()
                          : 0;
  for (const ScalingPoint &p : points) {
    json row = {{"gpus", p.devices}, {"weak_batch", p.weakBatch}};
    std::string weakText = "no layout fits", strongText;
    if (p.weak) {
      double t = p.weak->result.tflopsPerDevice();
      row["weak"] = {{"layout", p.weak->layout.str()},
                     {"tokens_per_s", p.weak->result.tokensPerSecond()},
                     {"tflops_per_gpu", t},
                     {"mfu", p.weak->result.mfu()},
                     {"efficiency", t / base}};
      weakText = formatv("{0,-52} {1,12:f0} {2,8:f1} {3,5:f1}%",
                         p.weak->layout.str(),
                         p.weak->result.tokensPerSecond(), t, 100 * t / base);
    }
    if (p.strong && strongBase > 0) {
      double t = p.strong->result.tflopsPerDevice();
      row["strong"] = {{"layout", p.strong->layout.str()},
                       {"tokens_per_s", p.strong->result.tokensPerSecond()},
                       {"tflops_per_gpu", t},
                       {"efficiency", t / strongBase}};
      strongText = formatv("{0,12:f0} {1,8:f1} {2,5:f1}%",
                           p.strong->result.tokensPerSecond(), t,
                           100 * t / strongBase);
    } else {
      strongText = "(no layout of this batch)";
    }
    outs() << formatv("  {0,6} {1,7} {2} | {3}\n", p.devices, p.weakBatch,
                      weakText, strongText);
    rows.push_back(row);
  }
  if (values.count("--svg")) {
    std::string title = formatv("{0}: simulated scaling on {1}",
                                sys::path::filename(req.specPath),
                                req.cluster.device.name);
    if (Error e = writeFileAtomically(values["--svg"],
                                      scalingSvg(points, title, base)))
      return fail(toString(std::move(e)));
    outs() << "  chart: " << values["--svg"] << "\n";
  }
  if (values.count("--apply"))
    outs() << "  (--apply is for one GPU count; ignored with --scaling)\n";
  return 0;
}

} // namespace

int tessel::planCommand(ArrayRef<std::string> args) {
  Arguments parsed;
  PlanRequest req;
  std::vector<std::string> rest;
  // --set and --include repeat; the rest go through the common parser.
  for (size_t i = 0; i < args.size(); ++i) {
    if ((args[i] == "--set" || args[i] == "--include") && i + 1 < args.size()) {
      (args[i] == "--set" ? req.sets : req.includes).push_back(args[i + 1]);
      ++i;
      continue;
    }
    rest.push_back(args[i]);
  }
  std::string argumentError = parseArguments(
      rest,
      {"--gpus", "--gpu", "--gpus-per-node", "--cluster", "--global-batch",
       "--memory-limit", "--candidates", "--apply", "--target", "--scaling",
       "--svg"},
      {"--json", "--help", "-h"}, parsed);
  if (!argumentError.empty())
    return usage(argumentError);
  if (parsed.switches.count("--help") || parsed.switches.count("-h")) {
    outs() << kPlanUsage;
    return 0;
  }
  auto &values = parsed.values;
  if (parsed.positionals.size() != 1)
    return usage("expects one spec");
  if (values.count("--cluster") == values.count("--gpu"))
    return usage("give one of --gpu NAME and --cluster FILE");
  std::vector<int64_t> counts;
  if (values.count("--scaling")) {
    SmallVector<StringRef> items;
    StringRef(values["--scaling"]).split(items, ',');
    for (StringRef item : items) {
      int64_t n = 0;
      if (item.trim().getAsInteger(10, n) || n < 1 ||
          (!counts.empty() && n <= counts.back()))
        return usage("--scaling expects increasing GPU counts, e.g. "
                     "64,128,256, got '" +
                     values["--scaling"] + "'");
      counts.push_back(n);
    }
  } else if (!values.count("--gpus") ||
             StringRef(values["--gpus"]).getAsInteger(10, req.devices) ||
             req.devices < 1) {
    return usage("--gpus N is required (a count >= 1)");
  }
  if (values.count("--candidates") &&
      (StringRef(values["--candidates"]).getAsInteger(10, req.candidates) ||
       req.candidates < 1))
    return usage("--candidates expects a count >= 1");
  // A cluster file measured on GPUs (a bf16 peak) plans CUDA programs.
  auto gpuCluster = [&] {
    if (!values.count("--cluster"))
      return false;
    Expected<sim::Cluster> c = sim::readCluster(values["--cluster"]);
    if (!c) {
      consumeError(c.takeError()); // reported when the cluster is read
      return false;
    }
    return c->device.peakFlops.count("bf16") > 0;
  };
  req.target = values.count("--target")        ? values["--target"]
               : values.count("--gpu") || gpuCluster() ? "cuda"
                                                       : "cpu";
  if (req.target != "cuda" && req.target != "cpu")
    return usage("--target expects cpu or cuda, got '" + req.target + "'");
  const std::string target = req.target;
  if (values.count("--global-batch"))
    req.sets.push_back("train.global_batch=" + values["--global-batch"]);
  req.specPath = parsed.positionals[0];
  const std::string &specPath = req.specPath;
  double memoryLimit = 0;
  if (values.count("--memory-limit") &&
      (StringRef(values["--memory-limit"]).getAsDouble(memoryLimit) ||
       !(memoryLimit > 0)))
    return usage("--memory-limit expects GB (a number > 0), got '" +
                 values["--memory-limit"] + "'");
  auto requestFor = [&](int64_t devices) -> Error {
    req.devices = devices;
    Expected<sim::Cluster> cluster = clusterFromFlags(values, devices);
    if (!cluster)
      return cluster.takeError();
    // A described node (a calibrated one) replicated to the devices asked.
    if (values.count("--cluster") && cluster->devices() < devices)
      cluster->nodes =
          (devices + cluster->gpusPerNode - 1) / cluster->gpusPerNode;
    req.cluster = *cluster;
    req.limit = memoryLimit > 0 ? memoryLimit * 1e9
                                : cluster->device.memoryBytes;
    return Error::success();
  };

  if (!counts.empty())
    return scalingReport(req, counts, requestFor, values);

  if (Error e = requestFor(req.devices))
    return fail(toString(std::move(e)));
  Expected<std::unique_ptr<PlanOutcome>> outcome = searchLayouts(req);
  if (!outcome)
    return fail(toString(outcome.takeError()));
  const PlanOutcome &o = **outcome;
  const std::vector<const Candidate *> &ranked = o.ranked;
  if (!o.best())
    return fail(formatv("no layout of {0} on {1} devices fits {2} per "
                        "device among the {3} compiled",
                        specPath, req.devices, formatBytes(req.limit),
                        o.compiled));

  if (parsed.switches.count("--json")) {
    json out = {{"spec", specPath},
                {"devices", req.devices},
                {"cluster", req.cluster.name},
                {"global_batch", o.batch},
                {"searched", o.searched},
                {"fit_by_estimate", o.fitByEstimate},
                {"compiled", o.compiled},
                {"seconds", o.seconds}};
    json rows = json::array();
    for (const Candidate *c : ranked) {
      const Layout &l = c->layout;
      json row = sim::resultToJson(c->result);
      row["layout"] = {{"tp", l.tp},         {"pp", l.pp},
                       {"dp", l.dp},         {"ep", l.ep},
                       {"cp", l.cp},
                       {"mbs", l.mbs},
                       {"microbatches", l.microbatches},
                       {"virtual_stages", l.v},
                       {"schedule", l.schedule()},
                       {"zero", l.zero},     {"recompute", l.recompute},
                       {"sequence_parallel", l.sp},
                       {"expert_tp", l.expertTp ? l.tp : 1},
                       {"zero_group", l.hybrid() ? l.zeroGroup : 0},
                       {"order", l.order}};
      row["describe"] = l.str();
      row["memory_bytes"] = c->memory;
      row["fits"] = c->fits;
      row["included"] = c->included;
      row["estimated_step_s"] = c->estimate.step;
      row["estimated_memory_bytes"] = c->estimate.memory;
      rows.push_back(row);
    }
    out["ranked"] = rows;
    // What was compiled and dropped: too large, or refused.
    json rejected = json::array();
    for (const Candidate &c : o.all)
      if (c.compiled && !c.error.empty())
        rejected.push_back({{"describe", c.layout.str()},
                            {"why", c.error},
                            {"memory_bytes", c.memory},
                            {"estimated_memory_bytes", c.estimate.memory}});
    out["rejected"] = rejected;
    if (ranked.size() > 1 && ranked[1]->fits)
      out["why"] = whyFaster(*ranked[0], *ranked[1]);
    outs() << out.dump(2) << "\n";
  } else {
    outs() << formatv("plan for {0} on {1}, {2} devices, global batch {3}\n",
                      specPath, req.cluster.name, req.devices, o.batch);
    outs() << formatv("  searched {0} layouts, {1} fit by estimate; compiled "
                      "{2}, simulated {3} in {4:f1} s\n",
                      o.searched, o.fitByEstimate, o.compiled, o.simulated,
                      o.seconds);
    outs() << formatv("  {0,-4} {1,-64} {2,10} {3,12} {4,8} {5,6} {6,10}\n",
                      "rank", "layout (tp pp dp, mbs x microbatches, ...)",
                      "step", "tokens/s", "TFLOP/s", "MFU", "memory");
    int rank = 0;
    for (const Candidate *c : ranked) {
      std::string name = c->layout.str() + (c->included ? " *" : "");
      outs() << formatv("  {0,-4} {1,-64} {2,10} {3,12:f0} {4,8:f1} {5,5:f1}% "
                        "{6,10}{7}\n",
                        ++rank, name,
                        formatSeconds(c->result.stepTime),
                        c->result.tokensPerSecond(),
                        c->result.tflopsPerDevice(), 100 * c->result.mfu(),
                        formatBytes(c->memory), c->fits ? "" : " (does not fit)");
    }
    if (!req.includes.empty())
      outs() << "  (* given with --include)\n";
    for (const Candidate &c : o.all)
      if (c.included && c.compiled && !c.error.empty())
        outs() << "  not ranked: " << c.layout.str() << " *: " << c.error
               << "\n";
    if (ranked.size() > 1 && ranked[1]->fits)
      outs() << "  best: " << ranked[0]->layout.str() << ", "
             << whyFaster(*ranked[0], *ranked[1]) << "\n";
  }

  if (values.count("--apply")) {
    const Layout &l = ranked.front()->layout;
    json doc = json::parse(o.spec.document, nullptr, false);
    if (doc.is_discarded())
      return fail("cannot write " + values["--apply"] + ": the spec's text");
    json &p = doc["parallel"];
    p["dp"] = l.dp, p["tp"] = l.tp, p["pp"] = l.pp, p["ep"] = l.ep;
    if (l.cp > 1 || p.contains("cp"))
      p["cp"] = l.cp;
    p["microbatches"] = l.microbatches;
    p["schedule"] = l.schedule();
    p["virtual_stages"] = l.v;
    p["sequence_parallel"] = l.sp;
    p["zero"] = l.zero;
    if (l.expertTp)
      p["expert_tp"] = l.tp;
    else
      p.erase("expert_tp");
    if (!l.shape().defaultOrder() || p.contains("order"))
      p["order"] = l.order;
    if (l.hybrid())
      p["zero_group"] = l.zeroGroup;
    else
      p.erase("zero_group");
    doc["train"]["recompute"] = l.recompute;
    doc["train"]["global_batch"] = o.batch;
    if (Error e = writeFileAtomically(values["--apply"], doc.dump(2) + "\n"))
      return fail(toString(std::move(e)));
    if (!parsed.switches.count("--json"))
      outs() << "  wrote " << values["--apply"] << " (tessel compile it with "
             << "--target " << target << ")\n";
  }
  return 0;
}
