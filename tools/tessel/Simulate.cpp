//===- Simulate.cpp - `tessel simulate` and `tessel calibrate` ------------===//
//
// simulate: replays a compiled output's rank programs (ir/07-programs.mlir)
// on a cluster description and reports the step time, its breakdown per
// pipeline rank, tokens/s, model FLOP/s per device and MFU (--json), and a
// Chrome trace of the replay (--trace).
//
// calibrate: measures a CPU cluster description on this machine: the
// runtime's GEMM at a range of shapes (fitted to the cost model's
// efficiency curve), its fused attention, memory bandwidth and per-call
// overhead, the rates of the other kernels a step calls most, and with
// --ranks N the collectives' latency and bandwidth between N processes
// (MPI), all while N ranks run at once as a compiled layout's ranks do.
//
//===----------------------------------------------------------------------===//

#include "Simulate.h"
#include "Commands.h"

#include "tessel/InitAllDialects.h"
#include "tessel/Runtime/Comm.h"
#include "tessel/Runtime/Kernels.h"
#include "tessel/Simulate/Simulator.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/Parser/Parser.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/Program.h"
#include "llvm/Support/raw_ostream.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <nlohmann/json.hpp>
#include <omp.h>
#include <unistd.h>

extern "C" void openblas_set_num_threads(int numThreads);

using namespace tessel;
using namespace llvm;
using json = nlohmann::json;

namespace {

const char *kSimulateUsage =
    "usage: tessel simulate DIR (--cluster FILE | --gpu NAME [--gpus-per-node "
    "N]) [--nodes N] [--json] [--trace FILE]\n"
    "  Replays the compiled step of DIR on a cluster: step time, its\n"
    "  breakdown per pipeline rank (compute, optimizer, exposed\n"
    "  communication, pipeline bubble), tokens/s, model TFLOP/s per device\n"
    "  and MFU.\n"
    "  --cluster FILE       a cluster description (tessel calibrate writes one)\n"
    "  --gpu NAME           a preset: a100-80g, h100, h200\n"
    "  --gpus-per-node N    devices per node (default 8)\n"
    "  --nodes N            nodes (default: as many as the plan's ranks need;\n"
    "                       with --cluster, the file's node this many times)\n"
    "  --json               print the result as JSON\n"
    "  --trace FILE         write the replay as a Chrome trace (Perfetto)\n"
    "  Checkpoints (docs/simulator.md), with --ckpt-every or --mtbf:\n"
    "  --ckpt-every N       a checkpoint every N steps: the snapshot each\n"
    "                       rank copies to the host, the bytes each node\n"
    "                       writes and the time it takes\n"
    "  --storage-gbs X      the file system's write bandwidth per node, GB/s\n"
    "                       (default 2)\n"
    "  --mtbf HOURS         the job's mean time between failures: the best\n"
    "                       interval (Young and Daly) and the goodput\n"
    "  --restart-minutes M  the time a restart takes (default 10)\n";

const char *kCalibrateUsage =
    "usage: tessel calibrate -o FILE [--ranks N] [--threads T] [--quick]\n"
    "       tessel calibrate --target cuda -o FILE [--ranks N] [--like GPU]\n"
    "                        [--measurements FILE] [--quick]\n"
    "  Measures this machine as a cluster description for tessel simulate:\n"
    "  N ranks (processes, under mpirun when N > 1) of T threads each,\n"
    "  measured while all N run at once.\n"
    "  --target cuda        N GPUs of this node (one process each): cuBLASLt\n"
    "                       GEMMs (bf16, fp32), flash attention, bandwidth,\n"
    "                       launch time, kernel rates, NCCL all-reduces\n"
    "  --like GPU           take what one node cannot measure (the links\n"
    "                       between nodes, the host link) from a preset:\n"
    "                       a100-80g, h100, h200\n"
    "  --measurements FILE  fit the figures tessel-calibrate-cuda wrote\n"
    "                       (or a calibrated file's) instead of measuring\n"
    "  --quick   shorter measurements (less precise; for tests)\n";

int usage(const char *text, const Twine &message) {
  outs().flush();
  errs() << "tessel: " << message << "\n" << text;
  return 2;
}

bool parseCount(const std::string &text, int64_t &out) {
  return !StringRef(text).getAsInteger(10, out) && out >= 1;
}

bool parsePositive(const std::string &text, double &out) {
  return !StringRef(text).getAsDouble(out) && out > 0 && std::isfinite(out);
}

// What checkpointing a simulated run costs (docs/simulator.md).
struct CheckpointCost {
  double heldBytes = 0;    // the largest rank's state, copied to the host
  double writtenBytes = 0; // the most a node writes per checkpoint
  double snapshot = 0;     // s the training stops for (that copy)
  double write = 0;        // s the busiest node's background write takes
  int64_t every = 0;       // steps between checkpoints (0: not given)
  double mtbf = 0, restart = 0; // s
  int64_t bestEvery = 0;   // Young and Daly's interval, in steps
  // The fractions of the time with a failure every `mtbf`, at `every`
  // (else at bestEvery): saving, steps trained again, restarts, and what is
  // left (goodput).
  double savingShare = 0, lostShare = 0, restartShare = 0, goodput = 0;
};

// From the plan's memory figures: each rank copies the fp32 state it holds
// (its values, or at zero 3 its pieces, and AdamW's moments) to the host
// at the cluster's host bandwidth (a CPU rank: a copy in memory); each
// tensor's values and moments are written once, shared evenly among the
// ranks of its program; a node writes its ranks' shares at `storage`.
CheckpointCost checkpointCost(const json &plan, const sim::Cluster &cluster,
                              const sim::SimResult &result, double storage,
                              int64_t every, double mtbf, double restart) {
  CheckpointCost c;
  c.every = every;
  c.mtbf = mtbf;
  c.restart = restart;
  std::map<std::string, double> held, written;
  for (auto &[name, program] : plan["programs"].items()) {
    const json &m = program["memory"];
    double values = m.contains("param_piece_bytes")
                        ? m.value("param_piece_bytes", 0.0) +
                              m.value("param_whole_bytes", 0.0)
                        : m.value("params_bytes", 0.0);
    held[name] = values + m.value("optimizer_bytes", 0.0);
  }
  // Each tensor once (a tied embedding is listed by two stages), whole:
  // its local shape times the ranks that split it.
  const json &mesh = plan["mesh"];
  std::set<std::string> seen;
  for (const json &t : plan["parameters"]) {
    if (!seen.insert(t.value("name", "")).second)
      continue;
    double elements = 1;
    for (const json &d : t["local_shape"])
      elements *= d.get<double>();
    if (t.contains("shard") && t["shard"].is_object()) {
      const json &shard = t["shard"];
      elements *= mesh.value(shard.value("axis", ""), 1.0);
      if (shard.contains("second") && shard["second"].is_object())
        elements *= mesh.value(shard["second"].value("axis", ""), 1.0);
    }
    written[t.value("program", "")] += 3 * 4 * elements;
  }
  std::map<std::string, int64_t> ranksOf;
  for (const json &r : plan["ranks"])
    ranksOf[r.value("program", "")]++;
  std::vector<double> perNode(cluster.devices() > 0 ? cluster.nodes : 1, 0.0);
  for (const json &r : plan["ranks"]) {
    std::string program = r.value("program", "");
    int64_t node = std::min<int64_t>(cluster.nodeOf(r.value("rank", 0)),
                                     (int64_t)perNode.size() - 1);
    perNode[node] += written[program] / std::max<int64_t>(1, ranksOf[program]);
    c.heldBytes = std::max(c.heldBytes, held[program]);
  }
  c.writtenBytes = *std::max_element(perNode.begin(), perNode.end());
  double copyRate = cluster.device.hostBandwidth > 0
                        ? cluster.device.hostBandwidth
                        : cluster.device.memoryBandwidth / 2;
  c.snapshot = copyRate > 0 ? c.heldBytes / copyRate : 0;
  c.write = c.writtenBytes / storage;
  if (mtbf > 0) {
    // Young (1974), Daly (2006): the interval that balances the time spent
    // saving against the work lost, sqrt(2 x cost x MTBF); the cost is the
    // training's stop (the write runs beside the steps), and an interval
    // is at least as long as a write.
    double best = std::sqrt(2 * c.snapshot * mtbf);
    best = std::max(best, c.write);
    c.bestEvery = std::max<int64_t>(
        1, (int64_t)std::llround(best / result.stepTime));
    int64_t at = every > 0 ? every : c.bestEvery;
    double interval = at * result.stepTime;
    // First order, per unit of wall time: a snapshot per interval; per
    // failure a restart and the steps since the last committed checkpoint
    // trained again (half an interval, and the write that commits it).
    c.savingShare = c.snapshot / (interval + c.snapshot);
    c.lostShare = (interval / 2 + std::min(c.write, interval)) / mtbf;
    c.restartShare = restart / mtbf;
    c.goodput = std::max(0.0, 1 - c.savingShare - c.lostShare -
                                  c.restartShare);
  }
  return c;
}


} // namespace

//===--- simulate ---------------------------------------------------------===//

std::string tessel::formatSeconds(double s) {
  if (s >= 1)
    return formatv("{0:f3} s", s);
  if (s >= 1e-3)
    return formatv("{0:f2} ms", s * 1e3);
  return formatv("{0:f1} us", s * 1e6);
}

std::string tessel::formatBytes(double bytes) {
  if (bytes >= 1e9)
    return formatv("{0:f1} GB", bytes / 1e9);
  if (bytes >= 1e6)
    return formatv("{0:f1} MB", bytes / 1e6);
  return formatv("{0:f1} kB", bytes / 1e3);
}

Error tessel::checkReplaceable(const std::string &path) {
  sys::fs::file_status st;
  if (sys::fs::status(path, st) ||
      st.type() == sys::fs::file_type::regular_file)
    return Error::success();
  return createStringError(
      "cannot write " + path + ": it is " +
      (st.type() == sys::fs::file_type::directory_file
           ? std::string("a directory")
           : std::string("not a regular file (a device or a pipe)")) +
      "; the file is written whole under a temporary name and renamed into "
      "place (give a file name)");
}

Error tessel::writeFileAtomically(const std::string &path,
                                  const std::string &text) {
  if (Error e = checkReplaceable(path))
    return e;
  std::string tmp = path + ".tmp";
  {
    std::error_code ec;
    raw_fd_ostream os(tmp, ec);
    if (ec)
      return createStringError("cannot write " + path + ": " + ec.message());
    os << text;
    os.close();
    if (os.has_error())
      return createStringError("cannot write " + path);
  }
  if (std::error_code ec = sys::fs::rename(tmp, path))
    return createStringError("cannot write " + path + ": " + ec.message());
  return Error::success();
}


Expected<sim::Cluster>
tessel::clusterFromFlags(std::map<std::string, std::string> &values,
                         int64_t devices) {
  int64_t perNode = 8, nodes = 0;
  if (values.count("--cluster")) {
    // A described node (a calibrated one, say) replicated: --nodes sets
    // how many, joined by the file's links between nodes.
    Expected<sim::Cluster> c = sim::readCluster(values["--cluster"]);
    if (c && values.count("--gpus-per-node"))
      return createStringError("--gpus-per-node goes with --gpu: " +
                               values["--cluster"] +
                               " describes its node's devices");
    if (c && values.count("--nodes")) {
      if (!parseCount(values["--nodes"], nodes))
        return createStringError("--nodes expects a count >= 1, got '" +
                                 values["--nodes"] + "'");
      c->nodes = nodes;
      c->name = formatv("{0} nodes of {1}", nodes, c->name).str();
    }
    return c;
  }
  if (values.count("--gpus-per-node") &&
      !parseCount(values["--gpus-per-node"], perNode))
    return createStringError("--gpus-per-node expects a count >= 1, got '" +
                             values["--gpus-per-node"] + "'");
  if (values.count("--nodes") && !parseCount(values["--nodes"], nodes))
    return createStringError("--nodes expects a count >= 1, got '" +
                             values["--nodes"] + "'");
  if (!nodes)
    nodes = (devices + perNode - 1) / perNode;
  return sim::presetCluster(values["--gpu"], perNode, nodes);
}

sim::SimOptions tessel::simOptionsFor(const json &plan) {
  sim::SimOptions options;
  options.cudaGraphs = plan.value("target", std::string("cpu")) == "cuda";
  return options;
}

Expected<sim::SimResult>
tessel::simulateCompiled(const std::string &dir, const sim::Cluster &cluster,
                         const sim::SimOptions &options) {
  SmallString<256> irPath(dir);
  sys::path::append(irPath, "ir", "07-programs.mlir");
  if (!sys::fs::exists(irPath))
    return createStringError(inQuotes(std::string(irPath)) +
                             " is missing: compile the spec again (simulate "
                             "replays the rank programs the compiler wrote "
                             "there)");
  mlir::MLIRContext context;
  loadAllDialects(context);
  std::string diagnostics;
  mlir::ScopedDiagnosticHandler handler(&context, [&](mlir::Diagnostic &d) {
    raw_string_ostream os(diagnostics);
    os << d.getLocation() << ": " << d << "\n";
    return mlir::success();
  });
  mlir::OwningOpRef<mlir::ModuleOp> module =
      mlir::parseSourceFile<mlir::ModuleOp>(irPath, &context);
  if (!module)
    return createStringError(inQuotes(std::string(irPath)) +
                             " cannot be read; compile the spec again:\n" +
                             diagnostics);
  Expected<sim::SimResult> result = sim::simulate(*module, cluster, options);
  if (!result)
    return createStringError(dir + ": " + toString(result.takeError()));
  return result;
}

int tessel::simulateCommand(ArrayRef<std::string> args) {
  Arguments parsed;
  std::string argumentError = parseArguments(
      args,
      {"--cluster", "--gpu", "--gpus-per-node", "--nodes", "--trace",
       "--ckpt-every", "--storage-gbs", "--mtbf", "--restart-minutes"},
      {"--json", "--help", "-h"}, parsed);
  if (!argumentError.empty())
    return usage(kSimulateUsage, "simulate: " + argumentError);
  if (parsed.switches.count("--help") || parsed.switches.count("-h")) {
    outs() << kSimulateUsage;
    return 0;
  }
  if (parsed.positionals.size() != 1)
    return usage(kSimulateUsage, "simulate: expects one compiled directory");
  auto &values = parsed.values;
  if (values.count("--cluster") == values.count("--gpu"))
    return usage(kSimulateUsage,
                 "simulate: give one of --cluster FILE and --gpu NAME");
  const std::string dir = parsed.positionals[0];
  Expected<json> plan = readPlan(dir);
  if (!plan)
    return fail(toString(plan.takeError()));
  if (plan->contains("inference"))
    return fail(dir + " is an inference plan: simulate replays a training "
                      "step");

  int64_t ckptEvery = 0;
  double storage = 2, mtbfHours = 0, restartMinutes = 10;
  if (values.count("--ckpt-every") &&
      !parseCount(values["--ckpt-every"], ckptEvery))
    return usage(kSimulateUsage, "simulate: --ckpt-every expects a count "
                                 ">= 1, got '" + values["--ckpt-every"] + "'");
  for (auto [flag, out] : {std::pair<const char *, double *>{"--storage-gbs",
                                                             &storage},
                           {"--mtbf", &mtbfHours},
                           {"--restart-minutes", &restartMinutes}})
    if (values.count(flag) && !parsePositive(values[flag], *out))
      return usage(kSimulateUsage, "simulate: " + std::string(flag) +
                                       " expects a number > 0, got '" +
                                       values[flag] + "'");
  bool checkpoints = values.count("--ckpt-every") || values.count("--mtbf");
  if (!checkpoints && (values.count("--storage-gbs") ||
                       values.count("--restart-minutes")))
    return usage(kSimulateUsage, "simulate: --storage-gbs and "
                                 "--restart-minutes go with --ckpt-every or "
                                 "--mtbf");

  int64_t world = plan->value("world_size", int64_t(1));
  Expected<sim::Cluster> cluster = clusterFromFlags(values, world);
  if (!cluster)
    return fail(toString(cluster.takeError()));

  sim::SimOptions options = simOptionsFor(*plan);
  options.trace = values.count("--trace");
  Expected<sim::SimResult> result = simulateCompiled(dir, *cluster, options);
  if (!result)
    return fail(toString(result.takeError()));
  if (options.trace)
    if (Error e = writeFileAtomically(values["--trace"], result->trace.dump(1)))
      return fail(toString(std::move(e)));

  CheckpointCost ckpt;
  if (checkpoints)
    ckpt = checkpointCost(*plan, *cluster, *result, storage * 1e9, ckptEvery,
                          mtbfHours * 3600, restartMinutes * 60);
  if (parsed.switches.count("--json")) {
    json out = sim::resultToJson(*result);
    out["cluster"] = cluster->name;
    if (checkpoints) {
      json c = {{"held_bytes", ckpt.heldBytes},
                {"node_written_bytes", ckpt.writtenBytes},
                {"snapshot_s", ckpt.snapshot},
                {"write_s", ckpt.write},
                {"storage_bytes_per_s", storage * 1e9}};
      if (ckptEvery > 0)
        c["every"] = ckptEvery;
      if (ckpt.mtbf > 0) {
        c["mtbf_s"] = ckpt.mtbf;
        c["restart_s"] = ckpt.restart;
        c["best_every"] = ckpt.bestEvery;
        c["saving_share"] = ckpt.savingShare;
        c["lost_share"] = ckpt.lostShare;
        c["restart_share"] = ckpt.restartShare;
        c["goodput"] = ckpt.goodput;
      }
      out["checkpoint"] = c;
    }
    outs() << out.dump(2) << "\n";
    return 0;
  }
  const sim::SimResult &r = *result;
  outs() << formatv("simulated {0} on {1}: {2} ranks\n", dir, cluster->name,
                    r.devices);
  outs() << formatv("  step {0}, {1:f0} tokens/s, {2:f2} model TFLOP/s per "
                    "device ({3:f1}% MFU at {4} {5} TFLOP/s peak)\n",
                    formatSeconds(r.stepTime), r.tokensPerSecond(),
                    r.tflopsPerDevice(), 100 * r.mfu(),
                    llvm::format("%.4g", r.peakFlops / 1e12), r.elementType);
  outs() << formatv("  {0,-12} {1,12} {2,12} {3,14} {4,12}\n", "program",
                    "compute", "optimizer", "exposed comm", "bubble");
  for (const sim::ProgramTimes &p : r.programs)
    outs() << formatv("  {0,-12} {1,12} {2,12} {3,14} {4,12}\n", p.name,
                      formatSeconds(p.compute), formatSeconds(p.optimizer),
                      formatSeconds(p.exposedComm), formatSeconds(p.bubble));
  // Where the first program's groups sit (parallel.order places them) and
  // what their collectives take, hidden or not.
  if (!r.programs.empty() && !r.programs.front().groups.empty()) {
    const sim::ProgramTimes &p = r.programs.front();
    outs() << formatv("  {0,-14} {1,6} {2,6} {3,9} {4,12} {5,14}\n",
                      "group (" + p.name + ")", "ranks", "nodes",
                      "per node", "collectives", "time");
    for (const auto &[axes, g] : p.groups)
      outs() << formatv("  {0,-14} {1,6} {2,6} {3,9} {4,12} {5,14}\n", axes,
                        g.placement.size, g.placement.nodes,
                        g.placement.perNode, g.collectives,
                        formatSeconds(g.seconds));
  }
  if (checkpoints) {
    outs() << formatv("  checkpoint: each rank copies its state to the host "
                      "({0}, {1} at most), each node writes {2} at most in "
                      "{3} at {4:f1} GB/s\n",
                      formatSeconds(ckpt.snapshot),
                      formatBytes(ckpt.heldBytes),
                      formatBytes(ckpt.writtenBytes),
                      formatSeconds(ckpt.write), storage);
    if (ckptEvery > 0) {
      double interval = ckptEvery * r.stepTime;
      outs() << formatv("  every {0} steps ({1}): the snapshots take {2:f2}% "
                        "of the time; {3}\n",
                        ckptEvery, formatSeconds(interval),
                        100 * ckpt.snapshot / (interval + ckpt.snapshot),
                        ckpt.write <= interval
                            ? std::string("each write ends before the next "
                                          "checkpoint")
                            : formatv("each write outlasts the interval: "
                                      "checkpoints wait {0} for it",
                                      formatSeconds(ckpt.write - interval))
                                  .str());
    }
    if (ckpt.mtbf > 0)
      outs() << formatv("  a failure every {0:f1} h, {1:f1} min a restart: "
                        "best every {2} steps (Young/Daly); {3} goodput "
                        "{4:f1}% (saving {5:f2}%, steps trained again "
                        "{6:f2}%, restarts {7:f2}%)\n",
                        ckpt.mtbf / 3600, ckpt.restart / 60, ckpt.bestEvery,
                        ckptEvery > 0 ? formatv("every {0} steps:", ckptEvery)
                                            .str()
                                      : std::string("there:"),
                        100 * ckpt.goodput, 100 * ckpt.savingShare,
                        100 * ckpt.lostShare, 100 * ckpt.restartShare);
  }
  if (options.trace)
    outs() << "  trace: " << values["--trace"] << "\n";
  return 0;
}

//===--- calibrate --------------------------------------------------------===//

namespace {

using Clock = std::chrono::steady_clock;

// The median time of `fn` over repetitions lasting about `budget` seconds
// (at least 3).
template <typename Fn> double timeIt(Fn &&fn, double budget) {
  fn(); // warm up
  std::vector<double> samples;
  auto begin = Clock::now();
  while (samples.size() < 3 ||
         (std::chrono::duration<double>(Clock::now() - begin).count() <
              budget &&
          samples.size() < 1000)) {
    auto t0 = Clock::now();
    fn();
    samples.push_back(
        std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

std::vector<float> filled(int64_t n, float scale = 0.01f) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i)
    v[i] = scale * float((i * 7919) % 1000 - 500) / 500.0f;
  return v;
}

// Everything one rank measures (rank 0's figures are written).
json measureRank(double budget, int64_t ranks) {
  json out;
  bool multi = ranks > 1;
  auto barrier = [&]() {
    if (multi) {
      float x = 0;
      rt::allReduceSum(&x, 1, AxisSet(MeshAxis::DP).bits());
    }
  };

  // GEMMs at shapes a small model's step calls.
  json gemms = json::array();
  const int64_t shapes[][3] = {
      {64, 64, 64},      {128, 128, 128},  {256, 256, 256},
      {512, 512, 512},   {1024, 1024, 1024}, {1024, 256, 256},
      {1024, 768, 256},  {1024, 256, 1024}, {1024, 1024, 256},
      {1024, 4096, 256}, {256, 1024, 1024}, {2048, 512, 512},
      {1024, 128, 256},  {1024, 256, 128},   {1024, 384, 256},
      {1024, 2048, 256}, {1024, 64, 1024},   {1024, 1024, 64}};
  for (auto &s : shapes) {
    int64_t m = s[0], n = s[1], k = s[2];
    auto a = filled(m * k), b = filled(k * n);
    std::vector<float> c(m * n);
    barrier();
    double t = timeIt(
        [&] {
          rt::matmul(a.data(), b.data(), c.data(), 1, m, n, k, false, false,
                     0, 0, 0);
        },
        budget);
    gemms.push_back({{"m", m}, {"n", n}, {"k", k}, {"seconds", t}});
  }
  out["gemm"] = gemms;

  // Fused attention, forward and backward.
  json attention = json::array();
  const int64_t atts[][4] = {{4, 128, 8, 32}, {2, 256, 4, 64}};
  for (auto &s : atts) {
    int64_t B = s[0], T = s[1], H = s[2], D = s[3];
    int64_t n = B * T * H * D;
    auto q = filled(n), k = filled(n), v = filled(n), dout = filled(n);
    std::vector<float> o(n), lse(B * H * T), dq(n), dk(n), dv(n);
    barrier();
    double f = timeIt(
        [&] {
          rt::attentionForward(q.data(), k.data(), v.data(), o.data(),
                               lse.data(), B, T, H, H, D, true);
        },
        budget);
    barrier();
    double bw = timeIt(
        [&] {
          rt::attentionBackward(q.data(), k.data(), v.data(), o.data(),
                                lse.data(), dout.data(), dq.data(), dk.data(),
                                dv.data(), B, T, H, H, D, true);
        },
        budget);
    attention.push_back({{"batch", B}, {"seq", T}, {"heads", H},
                         {"head_dim", D}, {"forward", f}, {"backward", bw}});
  }
  out["attention"] = attention;

  // Memory bandwidth and a call's overhead.
  {
    int64_t n = 4 << 20;
    auto a = filled(n), b = filled(1024);
    std::vector<float> o(n);
    barrier();
    double t = timeIt(
        [&] { rt::addBroadcast(a.data(), b.data(), o.data(), n, 1024); },
        budget);
    out["bandwidth"] = (2.0 * n + 1024) * 4 / t;
    barrier();
    double tiny = timeIt(
        [&] { rt::addBroadcast(a.data(), b.data(), o.data(), 64, 64); },
        budget / 4);
    out["overhead"] = tiny;
  }

  // The rates of the other kernels a step spends time in: bytes of their
  // operands (as the cost model counts them) per second.
  json kernels = json::object();
  auto rate = [&](const char *name, double bytes, auto &&fn) {
    barrier();
    double t = timeIt(fn, budget / 2);
    kernels[name] = {{"bytes", bytes}, {"seconds", t}};
  };
  {
    int64_t rows = 1024, C = 512, n = rows * C;
    auto x = filled(n), w = filled(C, 1), bias = filled(C), dout = filled(n);
    std::vector<float> out1(n), dx(n), dw(C), db(C);
    rate("layerNormForward", (2.0 * n + 2 * C) * 4, [&] {
      rt::layerNormForward(x.data(), w.data(), bias.data(), out1.data(), rows,
                           C, 1e-5);
    });
    rate("layerNormBackward", (3.0 * n + 3 * C) * 4, [&] {
      rt::layerNormBackward(x.data(), w.data(), dout.data(), dx.data(),
                            dw.data(), db.data(), rows, C, 1e-5);
    });
    rate("rmsNormForward", (2.0 * n + C) * 4, [&] {
      rt::rmsNormForward(x.data(), w.data(), out1.data(), rows, C, 1e-5);
    });
    rate("rmsNormBackward", (3.0 * n + 2 * C) * 4, [&] {
      rt::rmsNormBackward(x.data(), w.data(), dout.data(), dx.data(),
                          dw.data(), rows, C, 1e-5);
    });
    rate("geluForward", 2.0 * n * 4,
         [&] { rt::geluForward(x.data(), out1.data(), n); });
    rate("geluBackward", 3.0 * n * 4, [&] {
      rt::geluBackward(x.data(), dout.data(), dx.data(), n);
    });
    rate("siluForward", 2.0 * n * 4,
         [&] { rt::siluForward(x.data(), out1.data(), n); });
    rate("siluBackward", 3.0 * n * 4, [&] {
      rt::siluBackward(x.data(), dout.data(), dx.data(), n);
    });
    rate("accumulateSum", 2.0 * n * 4, [&] {
      rt::accumulateSum(x.data(), out1.data(), false, n);
    });
    rate("rope", 2.0 * n * 4, [&] {
      rt::rope(x.data(), out1.data(), 1, rows, C / 64, 64, 10000.0, false);
    });
    rate("mulBroadcast", (2.0 * n + C) * 4, [&] {
      rt::mulBroadcast(x.data(), w.data(), out1.data(), n, C);
    });
    rate("reduceSumLeading", (double(n) + C) * 4, [&] {
      rt::reduceSumLeading(x.data(), dw.data(), rows, C);
    });
    rate("copy", 2.0 * n * 4, [&] { rt::copy(x.data(), out1.data(), n); });
    // The layout kernels around split tensors: a third of each row (as a
    // fused QKV weight's split), out of and into a whole buffer.
    int64_t third = C / 2;
    rate("sliceAxis", (double(n) + rows * third) * 4, [&] {
      rt::sliceAxis(x.data(), out1.data(), rows, C, 1, third / 2, third);
    });
    rate("insertAxis", (double(n) + rows * third) * 4, [&] {
      rt::insertAxis(x.data(), out1.data(), rows, C, 1, third / 2, third);
    });
    const int64_t shape[] = {8, 128, 8, C / 16}, perm[] = {0, 2, 1, 3};
    rate("transpose", 2.0 * (8 * 128 * 8 * (C / 16)) * 4, [&] {
      rt::transpose(x.data(), out1.data(), shape, perm, 4);
    });
  }
  {
    int64_t rows = 512, V = 4096;
    auto logits = filled(rows * V);
    std::vector<int32_t> targets(rows);
    for (int64_t r = 0; r < rows; ++r)
      targets[r] = (r * 31) % V;
    std::vector<float> loss(1), dloss(1, 1.0f), dlogits(rows * V);
    rate("crossEntropyForward", (rows * V + rows + 1) * 4.0, [&] {
      rt::crossEntropyForward(logits.data(), targets.data(), loss.data(), rows,
                              V, V);
    });
    rate("crossEntropyBackward", (2.0 * rows * V + rows + 1) * 4, [&] {
      rt::crossEntropyBackward(logits.data(), targets.data(), dloss.data(),
                               dlogits.data(), rows, V, V);
    });
  }
  {
    int64_t tokens = 1024, V = 4096, C = 256;
    auto table = filled(V * C), dout = filled(tokens * C);
    std::vector<int32_t> ids(tokens);
    for (int64_t i = 0; i < tokens; ++i)
      ids[i] = (i * 37) % V;
    std::vector<float> out1(tokens * C), dtable(V * C);
    rate("embeddingForward", (V * C + tokens + tokens * C) * 4.0, [&] {
      rt::embeddingForward(table.data(), ids.data(), out1.data(), tokens, V,
                           C);
    });
    rate("embeddingBackward", (V * C + tokens + tokens * C) * 4.0, [&] {
      rt::embeddingBackward(ids.data(), dout.data(), dtable.data(), tokens, V,
                            C);
    });
  }
  {
    int64_t n = 1 << 20;
    auto p = filled(n), g = filled(n), m = filled(n), v = filled(n, 0.001f);
    for (float &x : v)
      x = std::fabs(x);
    float norm = 1.0f;
    rate("adamwStep", (4.0 * n + 1) * 4, [&] {
      rt::adamwStep(p.data(), nullptr, g.data(), m.data(), v.data(), &norm,
                    1e-4f, 1, n, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f);
    });
  }
  out["kernels"] = kernels;

  // The collectives between the ranks: an all-reduce at a small and a
  // large size (latency, then bandwidth).
  if (multi) {
    unsigned axes = AxisSet(MeshAxis::DP).bits();
    json comm = json::array();
    // Every rank runs the same number of each (a collective is called
    // by all), the median of them kept.
    for (int64_t n : {int64_t(1), int64_t(1024), int64_t(1) << 20,
                      int64_t(4) << 20}) {
      std::vector<float> buf = filled(n);
      int reps = n <= 1024 ? (budget < 0.1 ? 20 : 200) : (budget < 0.1 ? 3 : 10);
      std::vector<double> samples;
      barrier();
      rt::allReduceSum(buf.data(), n, axes); // warm up
      for (int r = 0; r < reps; ++r) {
        auto t0 = Clock::now();
        rt::allReduceSum(buf.data(), n, axes);
        samples.push_back(
            std::chrono::duration<double>(Clock::now() - t0).count());
      }
      std::sort(samples.begin(), samples.end());
      comm.push_back({{"elements", n}, {"seconds", samples[reps / 2]}});
    }
    out["all_reduce"] = comm;
  }
  return out;
}

// The cost model's GEMM curve fitted to the measured GEMMs: for each
// half-size h on a grid, the peak that fits best in log space; the h with
// the least squared error.
std::pair<double, double> fitGemm(const json &gemms) {
  double bestH = 0, bestPeak = 0, bestErr = INFINITY;
  for (double h = 0; h <= 2048; h = h < 1 ? 1 : h * 1.15) {
    double sum = 0;
    std::vector<double> resid;
    for (const json &g : gemms) {
      double m = g["m"], n = g["n"], k = g["k"], t = g["seconds"];
      double rate = 2 * m * n * k / t;
      double f = (m / (m + h)) * (n / (n + h)) * (k / (k + h));
      resid.push_back(std::log(rate / f));
      sum += resid.back();
    }
    double logPeak = sum / resid.size(), err = 0;
    for (double r : resid)
      err += (r - logPeak) * (r - logPeak);
    if (err < bestErr)
      bestErr = err, bestH = h, bestPeak = std::exp(logPeak);
  }
  return {bestPeak, bestH};
}

// The peak that fits `gemms` best in log space at half-size h.
double fitPeak(const json &gemms, double h) {
  double sum = 0;
  for (const json &g : gemms) {
    double m = g["m"], n = g["n"], k = g["k"], t = g["seconds"];
    sum += std::log(2 * m * n * k / t /
                    ((m / (m + h)) * (n / (n + h)) * (k / (k + h))));
  }
  return std::exp(sum / gemms.size());
}

// The ring all-reduce's alpha-beta fit: a one-element all-reduce is
// 2 (g - 1) latencies; the largest moves 2 (g - 1) / g of its bytes.
sim::Link linkFromAllReduce(const json &ar, double g) {
  double alpha = double(ar.front()["seconds"]) / (2 * (g - 1));
  const json &big = ar.back();
  double bytesSent = 2 * (g - 1) / g * double(big["elements"]) * 4;
  double t = double(big["seconds"]) - 2 * (g - 1) * alpha;
  return {bytesSent / std::max(t, 1e-9), alpha, 1};
}

// Attention's efficiency against `peak`, over forward and backward (3.5x
// the forward's FLOPs), as the cost model counts them.
double attentionEfficiencyOf(const json &attention, double peak) {
  double logSum = 0;
  for (const json &a : attention) {
    double B = a["batch"], T = a["seq"], H = a["heads"], D = a["head_dim"];
    double f = 4 * B * H * T * T * D * 0.5;
    double t = double(a["forward"]) + double(a["backward"]);
    logSum += std::log(3.5 * f / t / peak);
  }
  return std::min(1.0, std::exp(logSum / attention.size()));
}

void kernelRatesInto(const json &kernels, sim::Device &d) {
  for (auto it = kernels.begin(); it != kernels.end(); ++it) {
    double bytes = (*it)["bytes"], t = (*it)["seconds"];
    double net = std::max(t - d.kernelOverhead, t * 0.5);
    d.kernelBytesPerSecond[it.key()] = bytes / net;
  }
}

// The device figures both calibrations measure the same way: the GEMM
// curve fitted to `gemms` (its peak stored for `elementType`), attention
// against that peak, bandwidth, a call's time and the kernels' rates.
void fitDeviceInto(const json &m, const json &gemms,
                   const std::string &elementType, sim::Device &d) {
  auto [peak, half] = fitGemm(gemms);
  d.peakFlops[elementType] = peak;
  d.gemmEfficiency = 1;
  d.gemmHalfSize = half;
  d.attentionEfficiency = attentionEfficiencyOf(m["attention"], peak);
  d.memoryBandwidth = m["bandwidth"];
  d.memoryEfficiency = 1;
  d.kernelOverhead = m["overhead"];
  // A CUDA graph's kernel (GPU measurements only).
  if (m.contains("graph_overhead"))
    d.graphKernelOverhead = m["graph_overhead"];
  kernelRatesInto(m["kernels"], d);
}

// A GPU node as tessel-calibrate-cuda measured it; `like` (when given)
// supplies what one node cannot measure.
Expected<sim::Cluster> clusterFromGpuMeasurements(const json &m,
                                                  const std::string &from,
                                                  const sim::Cluster *like) {
  for (const char *field : {"device", "memory_bytes", "ranks", "gemm_bf16",
                            "gemm_fp32", "attention", "bandwidth", "overhead",
                            "kernels"})
    if (!m.contains(field))
      return createStringError(from + ": not GPU measurements (no '" +
                               field + "'; tessel-calibrate-cuda writes them)");
  try {
    sim::Cluster c;
    int64_t ranks = m["ranks"];
    std::string device = m["device"];
    c.name = formatv("{0} x {1} (calibrated)", ranks, device);
    sim::Device &d = c.device;
    d.name = device;
    d.memoryBytes = m["memory_bytes"];
    fitDeviceInto(m, m["gemm_bf16"], "bf16", d);
    d.peakFlops["fp32"] = fitPeak(m["gemm_fp32"], d.gemmHalfSize);
    c.gpusPerNode = ranks;
    c.nodes = 1;
    if (m.contains("all_reduce") && ranks > 1)
      c.intraNode = linkFromAllReduce(m["all_reduce"], double(ranks));
    else if (like)
      c.intraNode = like->intraNode;
    else
      c.intraNode = {d.memoryBandwidth / 2, 1e-6, 1};
    c.interNode = like ? like->interNode : c.intraNode;
    c.nicsPerNode = like ? like->nicsPerNode : c.gpusPerNode;
    if (like)
      d.hostBandwidth = like->device.hostBandwidth;
    c.sources["device"] = formatv(
        "measured by tessel calibrate --target cuda ({0}): cuBLASLt GEMMs "
        "at {1} bf16 shapes fitted to the efficiency curve (fp32 at {2} "
        "shapes, the same half-size), the runtime's flash attention, a "
        "streaming add's bandwidth, one launch's time (and a CUDA graph "
        "node's), {3} kernels' rates",
        device, m["gemm_bf16"].size(), m["gemm_fp32"].size(),
        m["kernels"].size());
    c.sources["links"] =
        ranks > 1 && m.contains("all_reduce")
            ? formatv("inside the node: NCCL all-reduces of 4 B (latency) and "
                      "{0} MB (bandwidth) between {1} GPUs{2}",
                      double(m["all_reduce"].back()["elements"]) * 4 / 1e6,
                      ranks,
                      like ? ", between nodes: the preset's" : "")
                  .str()
        : like ? std::string("one GPU measured: the preset's links")
               : std::string("one GPU measured: no links");
    return c;
  } catch (const json::exception &e) {
    return createStringError(from + ": " + e.what());
  }
}

sim::Cluster clusterFromMeasurements(const json &m, int64_t ranks,
                                     int64_t threads) {
  sim::Cluster c;
  char host[256] = "";
  ::gethostname(host, sizeof(host) - 1);
  c.name = formatv("cpu: {0} ranks x {1} threads", ranks, threads);
  sim::Device &d = c.device;
  d.name = formatv("CPU rank ({0} threads)", threads);
  long pages = ::sysconf(_SC_PHYS_PAGES), pageSize = ::sysconf(_SC_PAGE_SIZE);
  d.memoryBytes = pages > 0 && pageSize > 0
                      ? double(pages) * pageSize / ranks
                      : 1e9;
  fitDeviceInto(m, m["gemm"], "fp32", d);
  c.gpusPerNode = ranks;
  c.nodes = 1;
  // A one-rank description still names a link (its collectives are
  // trivial): shared memory at the measured bandwidth.
  c.intraNode = {d.memoryBandwidth / 2, 1e-6, 1};
  if (m.contains("all_reduce"))
    c.intraNode = linkFromAllReduce(m["all_reduce"], double(ranks));
  c.interNode = c.intraNode;
  c.nicsPerNode = c.gpusPerNode;
  c.sources["device"] = formatv(
      "measured by tessel calibrate on {0}: the runtime's GEMM (OpenBLAS) at "
      "{1} shapes fitted to the efficiency curve, its fused attention, "
      "addBroadcast's bandwidth and per-call time, {2} kernels' rates; all "
      "ranks measuring at once",
      host, m["gemm"].size(), m["kernels"].size());
  c.sources["links"] =
      ranks > 1 ? "measured: MPI all-reduce of 4 B (latency) and 16 MB "
                  "(bandwidth) between the ranks"
                : "one rank: no collectives";
  return c;
}

} // namespace

namespace {

// The mpirun prefix that starts `ranks` measuring processes (none for one).
// CPU ranks may outnumber the cores; GPU ranks are one per GPU.
Expected<std::vector<std::string>> mpirunFor(int64_t ranks,
                                             bool oversubscribe) {
  std::vector<std::string> argv;
  if (ranks <= 1)
    return argv;
  auto mpirun = sys::findProgramByName("mpirun");
  if (!mpirun)
    return createStringError("calibrate --ranks " + std::to_string(ranks) +
                             " needs mpirun (Debian: openmpi-bin)");
  argv = {*mpirun};
  if (oversubscribe)
    argv.push_back("--oversubscribe");
  if (getuid() == 0)
    argv.push_back("--allow-run-as-root");
  argv.insert(argv.end(), {"-np", std::to_string(ranks)});
  return argv;
}

// `tessel calibrate --target cuda`: runs tessel-calibrate-cuda (beside this
// executable) on `ranks` GPUs, or reads --measurements, and writes the
// fitted description with the figures it came from.
int calibrateCuda(std::map<std::string, std::string> &values, int64_t ranks,
                  bool quick) {
  if (!values.count("-o"))
    return usage(kCalibrateUsage, "calibrate: -o FILE is required");
  std::string output = values["-o"];
  std::optional<sim::Cluster> like;
  if (values.count("--like")) {
    Expected<sim::Cluster> preset =
        sim::presetCluster(values["--like"], 8, 1);
    if (!preset)
      return fail("calibrate --like: " + toString(preset.takeError()));
    like = *preset;
  }
  // The measurements: the file given, or what tessel-calibrate-cuda
  // writes (removed once read).
  std::string from;
  bool measuredHere = !values.count("--measurements");
  if (!measuredHere) {
    from = values["--measurements"];
  } else {
    auto self = sys::fs::getMainExecutable(nullptr, nullptr);
    SmallString<256> tool(sys::path::parent_path(self));
    sys::path::append(tool, "tessel-calibrate-cuda");
    if (!sys::fs::can_execute(tool))
      return fail("calibrate --target cuda needs " + tool.str().str() +
                  ", which is built where the CUDA toolkit is (nvcc)");
    Expected<std::vector<std::string>> launcher = mpirunFor(ranks, false);
    if (!launcher)
      return fail(toString(launcher.takeError()));
    std::vector<std::string> argv = *launcher;
    from = output + ".measurements";
    argv.insert(argv.end(), {std::string(tool), from});
    if (quick)
      argv.push_back("--quick");
    outs() << formatv("calibrate: measuring {0} GPU(s)...\n", ranks);
    outs().flush();
    int rc = runForwardingSignals(argv, rankEnvironment());
    if (rc == 77)
      return fail("calibrate --target cuda: no CUDA device on this machine");
    if (rc != 0) {
      sys::fs::remove(from);
      return fail("calibrate: the measurement failed (" + describeExit(rc) +
                  ")");
    }
  }
  json measured;
  {
    std::ifstream in(from);
    if (!in)
      return fail("calibrate: cannot read " + from);
    try {
      in >> measured;
    } catch (const json::exception &e) {
      return fail("calibrate: " + from + " is not JSON (" + e.what() + ")");
    }
  }
  if (measuredHere)
    sys::fs::remove(from);
  // A calibrated description keeps its measurements.
  if (measured.contains("measurements"))
    measured = json(measured["measurements"]);
  Expected<sim::Cluster> c =
      clusterFromGpuMeasurements(measured, from, like ? &*like : nullptr);
  if (!c)
    return fail("calibrate: " + toString(c.takeError()));
  json out = sim::clusterToJson(*c);
  out["measurements"] = measured;
  // What the simulator reads back must be what was fitted.
  if (Expected<sim::Cluster> check = sim::clusterFromJson(out, output); !check)
    return fail("calibrate: " + toString(check.takeError()));
  if (Error e = writeFileAtomically(output, out.dump(2)))
    return fail(toString(std::move(e)));
  outs() << formatv("calibrate: wrote {0}: {1}, bf16 GEMM peak {2:f1} "
                    "TFLOP/s (half size {3:f0}), fp32 {4:f1} TFLOP/s, "
                    "attention at {5:f0}% of bf16, {6:f0} GB/s, {7:f1} us per "
                    "launch",
                    output, c->device.name, c->peak("bf16") / 1e12,
                    c->device.gemmHalfSize, c->peak("fp32") / 1e12,
                    100 * c->device.attentionEfficiency,
                    c->device.memoryBandwidth / 1e9,
                    c->device.kernelOverhead * 1e6);
  if (c->gpusPerNode > 1)
    outs() << formatv("; NCCL {0:f1} GB/s, {1:f1} us",
                      c->intraNode.bandwidth / 1e9,
                      c->intraNode.latency * 1e6);
  outs() << "\n";
  return 0;
}

} // namespace

int tessel::calibrateCommand(ArrayRef<std::string> args) {
  Arguments parsed;
  std::string argumentError = parseArguments(
      args,
      {"-o", "--ranks", "--threads", "--worker-out", "--target", "--like",
       "--measurements"},
      {"--quick", "--help", "-h", "--worker"}, parsed);
  if (!argumentError.empty())
    return usage(kCalibrateUsage, "calibrate: " + argumentError);
  if (parsed.switches.count("--help") || parsed.switches.count("-h")) {
    outs() << kCalibrateUsage;
    return 0;
  }
  auto &values = parsed.values;
  int64_t ranks = 1, threads = 1;
  if (values.count("--ranks") && !parseCount(values["--ranks"], ranks))
    return usage(kCalibrateUsage, "calibrate: --ranks expects a count >= 1, "
                                  "got '" + values["--ranks"] + "'");
  if (values.count("--threads") && !parseCount(values["--threads"], threads))
    return usage(kCalibrateUsage, "calibrate: --threads expects a count >= "
                                  "1, got '" + values["--threads"] + "'");
  bool quick = parsed.switches.count("--quick");
  double budget = quick ? 0.02 : 0.25;
  std::string target = values.count("--target") ? values["--target"] : "cpu";
  if (target != "cpu" && target != "cuda")
    return usage(kCalibrateUsage, "calibrate: --target expects cpu or cuda, "
                                  "got '" + target + "'");
  if (target == "cuda")
    return calibrateCuda(values, ranks, quick);
  for (const char *gpuOnly : {"--like", "--measurements"})
    if (values.count(gpuOnly))
      return usage(kCalibrateUsage, std::string("calibrate: ") + gpuOnly +
                                        " goes with --target cuda");

  if (parsed.switches.count("--worker")) {
    // One rank of the measurement.
    omp_set_num_threads(threads);
    openblas_set_num_threads(threads);
    try {
      MeshShape mesh;
      mesh[MeshAxis::DP] = ranks;
      int argc = 0;
      char **argv = nullptr;
      rt::commInit(&argc, &argv, mesh);
      json m = measureRank(budget, ranks);
      if (rt::commRank() == 0) {
        sim::Cluster c = clusterFromMeasurements(m, ranks, threads);
        json out = sim::clusterToJson(c);
        out["measurements"] = m;
        if (Error e = writeFileAtomically(values["--worker-out"], out.dump(2)))
          return fail(toString(std::move(e)));
      }
      rt::commFinalize();
    } catch (const std::exception &e) {
      return fail(std::string("calibrate: ") + e.what());
    }
    return 0;
  }

  if (!values.count("-o"))
    return usage(kCalibrateUsage, "calibrate: -o FILE is required");
  std::string output = values["-o"];
  if (Error e = checkReplaceable(output))
    return fail(toString(std::move(e)));
  auto self = sys::fs::getMainExecutable(nullptr, nullptr);
  Expected<std::vector<std::string>> launcher = mpirunFor(ranks, true);
  if (!launcher)
    return fail(toString(launcher.takeError()));
  std::vector<std::string> argv = *launcher;
  std::string partial = output + ".partial";
  argv.insert(argv.end(),
              {self, "calibrate", "--worker", "--ranks", std::to_string(ranks),
               "--threads", std::to_string(threads), "--worker-out", partial});
  if (quick)
    argv.push_back("--quick");
  std::vector<std::string> env = rankEnvironment();
  env.push_back("OMP_NUM_THREADS=" + std::to_string(threads));
  env.push_back("OPENBLAS_NUM_THREADS=" + std::to_string(threads));
  outs() << formatv("calibrate: measuring {0} rank(s) x {1} thread(s)...\n",
                    ranks, threads);
  outs().flush();
  int rc = runForwardingSignals(argv, env);
  if (rc != 0) {
    sys::fs::remove(partial);
    return fail("calibrate: the measurement failed (" + describeExit(rc) +
                ")");
  }
  if (std::error_code ec = sys::fs::rename(partial, output))
    return fail("cannot write " + output + ": " + ec.message());
  Expected<sim::Cluster> c = sim::readCluster(output);
  if (!c)
    return fail(toString(c.takeError()));
  outs() << formatv("calibrate: wrote {0}: GEMM peak {1:f1} GFLOP/s (half "
                    "size {2:f0}), attention at {3:f0}% of it, {4:f1} GB/s, "
                    "{5:f1} us per call",
                    output, c->peak("fp32") / 1e9,
                    c->device.gemmHalfSize,
                    100 * c->device.attentionEfficiency,
                    c->device.memoryBandwidth / 1e9,
                    c->device.kernelOverhead * 1e6);
  if (ranks > 1)
    outs() << formatv("; links {0:f2} GB/s, {1:f1} us",
                      c->intraNode.bandwidth / 1e9, c->intraNode.latency * 1e6);
  outs() << "\n";
  return 0;
}
