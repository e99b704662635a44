//===- Simulator.cpp - Replaying compiled rank programs on a cluster ------===//
//
// Each program is a cursor over its step: the ops of `train_step` with each
// part call expanded (the part's microbatch bound), and a clock. A cursor
// runs until it needs what another has not produced yet (a pipeline message
// not sent, a collective over pp that not every stage has reached); then
// the next runs. Sends and collectives carry their times, so the order in
// which cursors run does not change the result.
//
//===----------------------------------------------------------------------===//

#include "tessel/Simulate/Simulator.h"

#include "dialects/Dist/DistOps.h"
#include "dialects/Pipe/PipeOps.h"
#include "dialects/Rt/RtOps.h"

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "llvm/ADT/DenseMap.h"
#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <tuple>

using namespace mlir;
using namespace tessel;
using namespace tessel::sim;
namespace rt = tessel::rtir;
using json = nlohmann::json;
using llvm::formatv;

static llvm::Error error(const llvm::Twine &message) {
  return llvm::createStringError(llvm::inconvertibleErrorCode(), message);
}

//===--- Cost model -------------------------------------------------------===//

static const char *typeName(int64_t elementBytes) {
  switch (elementBytes) {
  case 2:
    return "bf16";
  case 8:
    return "fp64";
  default:
    return "fp32";
  }
}

// The rows a grouped GEMM computes on under balanced routing. Its buffer
// holds the most that can come: with expert parallelism, the rows of each
// source rank (`segments` = source ranks x the rank's experts), each up to
// all of that rank's assignments; routed evenly, the sources together send
// one rank's worth.
static double balancedRows(Value x, int64_t k, int64_t segments,
                           int64_t experts) {
  int64_t sources = std::max<int64_t>(1, segments / std::max<int64_t>(1, experts));
  return static_cast<double>(rt::elementsOf(x)) / std::max<int64_t>(1, k) /
         sources;
}

// The share of a collective record's bytes that moves under balanced
// routing, as the grouped GEMMs are costed. An expert-parallel exchange is
// counted at the most a rank can send (plan.json's bound): all its
// assignments leave it, and in the combine every other rank's come back
// through it. Routed evenly, (g-1)/g of a rank's assignments leave and
// each rank gets back what it sent: a g-th of the combine's bound.
static double balancedShare(Operation *op, size_t record, int64_t g) {
  if (g <= 1)
    return 1;
  if (isa<rt::MoeExchangeOp>(op) && record == 1) // after the counts
    return double(g - 1) / double(g);
  if (isa<rt::MoeCombineOp>(op))
    return 1.0 / double(g);
  return 1;
}

// Whether the programs keep AdamW's state in host memory
// (parallel.offload = "optimizer", the module's recipe says).
static bool optimizerOffloaded(Operation *op) {
  for (Operation *p = op->getParentOp(); p; p = p->getParentOp())
    if (auto recipe = p->getAttrOfType<DictionaryAttr>("graph.recipe"))
      if (auto offload = recipe.getAs<StringAttr>("offload"))
        return offload.getValue() == "optimizer";
  return false;
}

KernelCost tessel::sim::kernelCost(Operation *op, const Cluster &cluster,
                                   bool inGraph) {
  const Device &d = cluster.device;
  const double overhead = inGraph && d.graphKernelOverhead >= 0
                              ? d.graphKernelOverhead
                              : d.kernelOverhead;
  KernelCost cost;
  llvm::SmallPtrSet<Value, 8> seen;
  for (Value v : op->getOperands())
    if (isa<MemRefType>(v.getType()) && seen.insert(v).second)
      cost.bytes += static_cast<double>(rt::elementsOf(v)) *
                    rt::elementBytesOf(v);

  // GEMM FLOPs and shape.
  double m = 0, n = 0, k = 0, batch = 1;
  Value a;
  // The matmul family: one product of m x k by k x n (batched or fused).
  auto product = [&](auto mm) {
    m = mm.getM(), n = mm.getN(), k = mm.getK();
    a = mm.getA();
  };
  // A weight gradient written as a column block of a wider one moves its
  // block of c and db, not the rows they span.
  auto columnBlock = [&](auto g) {
    product(g);
    int64_t others = g.getLdc() - g.getN();
    cost.bytes -= static_cast<double>(others) * (g.getM() + 1) *
                  rt::elementBytesOf(g.getC());
  };
  // The experts' grouped GEMMs: the rows balanced routing brings, and the
  // experts' weights (or their gradients) once.
  auto grouped = [&](auto g, Value weights) {
    k = g.getK(), n = g.getN();
    m = balancedRows(g.getX(), g.getK(), g.getSegments(), g.getNumExperts());
    a = g.getX();
    cost.bytes = (m * (k + n)) * rt::elementBytesOf(a) +
                 rt::elementsOf(weights) * rt::elementBytesOf(weights);
  };
  if (auto mm = dyn_cast<rt::MatmulOp>(op)) {
    batch = mm.getBatch();
    product(mm);
  } else if (auto mb = dyn_cast<rt::MatmulBiasOp>(op)) {
    product(mb);
  } else if (auto mg = dyn_cast<rt::MatmulBiasGradOp>(op)) {
    columnBlock(mg);
  } else if (auto mg = dyn_cast<rt::MatmulGeluGradOp>(op)) {
    product(mg);
  } else if (auto ma = dyn_cast<rt::MatmulAddOp>(op)) {
    product(ma);
  } else if (auto acc = dyn_cast<rt::MatmulAccumulateOp>(op)) {
    product(acc);
  } else if (auto acc = dyn_cast<rt::MatmulBiasGradAccumulateOp>(op)) {
    columnBlock(acc);
  } else if (auto g = dyn_cast<rt::GroupedMatmulOp>(op)) {
    grouped(g, g.getW());
  } else if (auto g = dyn_cast<rt::GroupedMatmulWeightGradAccumulateOp>(op)) {
    grouped(g, g.getDw());
  } else if (auto g = dyn_cast<rt::GroupedMatmulWeightGradOp>(op)) {
    grouped(g, g.getDw());
  }
  // A sharded update or gradient norm (ZeRO) touches, of its n elements,
  // those inside this rank's piece of the run: n / g of them over a group
  // of g, so that the calls of a run add up to its piece. Its buffers span
  // the whole tensor or the run's piece, which is not what it moves: it is
  // counted as AdamW (or the norm) over those elements is.
  auto shardElements = [&](int64_t n, auto axes) {
    int64_t g = std::max<int64_t>(1, dist::meshOf(op).groupSize(axes));
    return static_cast<double>(n) / static_cast<double>(g);
  };
  if (auto u = dyn_cast<rt::AdamWShardOp>(op)) {
    double e = shardElements(u.getN(), u.getAxes());
    double perElement =
        rt::elementBytesOf(u.getParam()) + rt::elementBytesOf(u.getGrad()) +
        rt::elementBytesOf(u.getM()) + rt::elementBytesOf(u.getV());
    if (u.getShadow())
      perElement += rt::elementBytesOf(u.getShadow());
    cost.bytes = e * perElement + rt::elementBytesOf(u.getNorm());
  } else if (auto s = dyn_cast<rt::SumSquaresShardOp>(op)) {
    cost.bytes =
        shardElements(s.getN(), s.getAxes()) * rt::elementBytesOf(s.getX()) +
        rt::elementBytesOf(s.getAcc());
  }
  double memoryRate = d.memoryBandwidth * d.memoryEfficiency;
  double memoryTime = memoryRate > 0 ? cost.bytes / memoryRate : 0;
  if (a) {
    cost.kind = "gemm";
    cost.flops = 2 * batch * m * n * k;
    double h = d.gemmHalfSize;
    double eff = d.gemmEfficiency * (m / (m + h)) * (n / (n + h)) * (k / (k + h));
    double peak = cluster.peak(typeName(rt::elementBytesOf(a)));
    double t = peak > 0 && eff > 0 ? cost.flops / (peak * eff) : 0;
    cost.seconds = std::max(t, memoryTime) + overhead;
    return cost;
  }
  // s query rows over kv keys. Causal rows see the keys up to their
  // position; with the sequence split over cp (kv > s) in contiguous
  // pieces the slowest rank, which every collective waits for, is the
  // last: its rows see kv - s + 1 .. kv keys. Balanced pieces (zigzag) see
  // half the keys on every rank.
  auto attention = [&](int64_t b, int64_t s, int64_t kv, int64_t heads,
                       int64_t dim, bool causal, bool balanced, double factor,
                       Value q) {
    cost.kind = "attention";
    double pairs = !causal    ? double(s) * double(kv)
                   : balanced ? 0.5 * double(s) * double(kv)
                              : double(s) * (double(kv) - 0.5 * double(s));
    cost.flops = factor * 4.0 * b * heads * pairs * dim;
    double peak = cluster.peak(typeName(rt::elementBytesOf(q)));
    double t = cost.flops / (peak * d.attentionEfficiency);
    cost.seconds = std::max(t, memoryTime) + overhead;
  };
  if (auto f = dyn_cast<rt::AttentionForwardOp>(op)) {
    attention(f.getBatch(), f.getSeq(), f.getKvSeq(), f.getHeads(),
              f.getHeadDim(), f.getCausal(), f.getZigzag() > 0, 1.0, f.getQ());
    return cost;
  }
  if (auto b = dyn_cast<rt::AttentionBackwardOp>(op)) {
    attention(b.getBatch(), b.getSeq(), b.getKvSeq(), b.getHeads(),
              b.getHeadDim(), b.getCausal(), b.getZigzag() > 0, 2.5, b.getQ());
    return cost;
  }
  // A memory-bound kernel: its measured rate when the description has one.
  if (auto call = dyn_cast<rt::KernelCallOpInterface>(op)) {
    // The sharded update runs AdamW's kernel on its elements: its rate.
    std::string name = call.getFunction().str();
    if (name == "adamwStepShard" && !d.kernelBytesPerSecond.count(name))
      name = "adamwStep";
    // An embedding's gradient summed in place runs the scatter's kernel.
    for (llvm::StringRef base : {"embeddingBackwardRange", "embeddingBackward"})
      if (llvm::StringRef(name).starts_with(base) &&
          !d.kernelBytesPerSecond.count(name))
        name = d.kernelBytesPerSecond.count(base.str()) ? base.str()
                                                        : "embeddingBackward";
    auto it = d.kernelBytesPerSecond.find(name);
    if (it != d.kernelBytesPerSecond.end())
      memoryTime = cost.bytes / it->second;
  }
  // With the optimizer offloaded, AdamW reads and writes the moments (and
  // at zero 3 the parameter pieces) in host memory across the host link:
  // 16 bytes per fp32 element it updates, 24 with the pieces. A sharded
  // update touches the part of its n elements inside this rank's piece: a
  // g-th of them over a group of g, so that the updates of a run add up to
  // its piece (their moment buffers are the whole run's piece).
  if (d.hostBandwidth > 0 && isa<rt::AdamWOp, rt::AdamWShardOp>(op) &&
      optimizerOffloaded(op)) {
    double host = 0;
    if (auto a = dyn_cast<rt::AdamWOp>(op))
      host = 16.0 * static_cast<double>(a.getN());
    if (auto a = dyn_cast<rt::AdamWShardOp>(op)) {
      int64_t g = std::max<int64_t>(1, dist::meshOf(op).groupSize(a.getAxes()));
      host = (a.getPieceParams() ? 24.0 : 16.0) *
             std::min<double>(static_cast<double>(a.getN()) / g,
                              static_cast<double>(a.getPiece()));
    }
    memoryTime = std::max(memoryTime, host / d.hostBandwidth);
  }
  cost.seconds = memoryTime + overhead;
  return cost;
}

GroupPlacement tessel::sim::placeGroup(const MeshLayout &layout, int64_t rank,
                                       AxisSet axes, const Cluster &cluster) {
  GroupPlacement g;
  int64_t color = layout.groupColor(rank, axes);
  std::map<int64_t, int64_t> perNode;
  g.size = 0;
  for (int64_t r = 0; r < layout.worldSize(); ++r)
    if (layout.groupColor(r, axes) == color) {
      ++g.size;
      ++perNode[cluster.nodeOf(r)];
    }
  g.nodes = perNode.size();
  g.perNode = 0;
  for (auto &[node, count] : perNode)
    g.perNode = std::max(g.perNode, count);
  return g;
}

// The bandwidth a device gets on the NICs when every device of its node
// communicates at once (the ranks of a program run alike).
static double nicShare(const Cluster &c) {
  int64_t active = std::max<int64_t>(1, c.gpusPerNode);
  return c.interNode.bandwidth *
         std::min<double>(1.0, double(c.nicsPerNode) / active);
}

double tessel::sim::collectiveSeconds(const std::string &kind,
                                      double bytesSent,
                                      const GroupPlacement &group,
                                      const Cluster &c) {
  int64_t g = group.size;
  if (g <= 1 && kind != "send_recv")
    return 0;
  double intra = c.intraNode.bandwidth * c.intraNode.efficiency;
  if (kind == "send_recv") {
    bool cross = group.nodes > 1;
    double bw = cross ? nicShare(c) * c.interNode.efficiency : intra;
    double lat = cross ? c.interNode.latency : c.intraNode.latency;
    return lat + bytesSent / bw;
  }
  bool cross = group.nodes > 1;
  double lat = cross ? c.interNode.latency : c.intraNode.latency;
  if (kind == "all_to_all") {
    // Each rank's own traffic: what goes to ranks on other nodes takes its
    // share of the NICs, the rest the node's link, at the same time.
    double outside = double(g - group.perNode) / std::max<int64_t>(1, g - 1);
    double t = bytesSent * (1 - outside) / intra;
    if (cross)
      t = std::max(t, bytesSent * outside /
                          (nicShare(c) * c.interNode.efficiency));
    return t + (g - 1) * lat;
  }
  // A ring: every link carries what a rank sends; a ring across nodes
  // leaves each node once per channel, over the NICs its members hold.
  double bw = intra;
  if (cross)
    bw = std::min(intra, group.perNode * nicShare(c) * c.interNode.efficiency);
  double steps = kind == "all_reduce" ? 2.0 * (g - 1) : double(g - 1);
  double ring = bytesSent / bw + steps * lat;
  if (kind != "all_reduce")
    return ring;
  // A tree (NCCL's choice for small all-reduces): 2 log2(g) latencies and
  // the buffer twice through the slowest link.
  double buffer = bytesSent * g / (2.0 * (g - 1));
  double tree = 2 * std::ceil(std::log2(double(g))) * lat + 2 * buffer / bw;
  return std::min(ring, tree);
}

//===--- Replay -----------------------------------------------------------===//

namespace {

enum class Phase { Step, Compute, Update };

// One op of a program's step, in order.
struct Item {
  Operation *op;
  int64_t microbatch; // of the part call it is in (-1: none)
  Phase phase;
  int64_t call;       // which part call (-1: train_step itself)
};

struct PartCall {
  std::string name;
  int64_t microbatch;
  double start = -1, end = 0;
};

struct Cursor {
  std::string name;
  int64_t pipelineRank = 0, rank = 0;
  std::vector<Item> items;
  std::vector<PartCall> calls;
  size_t pc = 0;
  double t = 0;
  double commFree = 0;   // the lane of started data-parallel collectives
  double streamFree = 0; // the communication stream (every other collective)
  std::map<int64_t, double> p2pFree;   // per receiver
  std::map<int64_t, double> slotDone;  // request table slot -> completion
  llvm::DenseMap<Value, double> requestDone;
  double sendsDone = 0;
  // The send ring (rt.send_ring_slots): the messages of the ring sends
  // since the step last waited for its sends, in order; a ring send waits
  // until the one `ringSlots` before it has been received.
  int64_t ringSlots = 0;
  std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> ringHeld;
  std::map<unsigned, int64_t> ppSyncs; // axes bits -> collectives passed
  bool graph = false; // its kernels are nodes of a CUDA graph
  ProgramTimes times;
  // The item whose collectives `times.groups` counted last (an op that
  // waits for other stages is costed again when it runs).
  size_t groupsCounted = SIZE_MAX;
};

int64_t constantOf(Value v, int64_t fallback) {
  if (auto c = v.getDefiningOp<arith::ConstantOp>())
    if (auto i = dyn_cast<IntegerAttr>(c.getValue()))
      return i.getInt();
  return fallback;
}

bool isStart(Operation *op) {
  return isa<rt::AllReduceStartOp, rt::ReduceScatterShardsStartOp,
             rt::ReduceScatterPieceStartOp, rt::AllGatherShardsStartOp,
             rt::AllGatherStartOp, rt::ReduceScatterStartOp, rt::ShiftStartOp>(
      op);
}
// Whether a started collective runs on the data-parallel lane (the CUDA
// runtime's background stream and communicators) rather than on the
// communication stream that every blocking collective uses.
bool onDataParallelLane(Operation *op) {
  auto axes = op->getAttrOfType<dist::AxesAttr>("axes");
  if (!axes)
    return true;
  return axes.getValue().intersects(AxisSet::dataParallel());
}
bool isCollectiveOnly(Operation *op) {
  return isa<rt::AllReduceOp, rt::AllGatherOp, rt::ReduceScatterOp,
             rt::ReduceScatterShardsOp, rt::AllGatherShardsOp>(op);
}
// The request-table slots a started collective fills.
std::pair<int64_t, int64_t> slotsOf(Operation *op) {
  auto slot = op->getAttrOfType<IntegerAttr>("slot");
  if (!slot)
    return {-1, 0};
  int64_t count = 1;
  if (isa<rt::AllReduceStartOp, rt::ReduceScatterShardsStartOp>(op))
    count = op->getNumOperands();
  return {slot.getInt(), count};
}

class Simulation {
public:
  Simulation(ModuleOp top, const Cluster &cluster, const SimOptions &options)
      : top(top), cluster(cluster), options(options),
        layout(dist::meshOf(top), pipe::layoutOf(top).getVirtualStages()) {}

  llvm::Expected<SimResult> run();

private:
  llvm::Error load();
  // Runs one op of `c`; false when it must wait for another program.
  bool step(size_t index);
  // What one execution of a communicating op costs `c`: its records' time
  // and bytes, and the axes they run over.
  struct Comm {
    double seconds = 0, bytes = 0;
    AxisSet axes;
  };
  Comm communication(Cursor &c, Operation *op);
  const GroupPlacement &group(const Cursor &c, AxisSet axes);
  void span(const Cursor &c, int tid, const std::string &name, double start,
            double end, json args = json::object());

  ModuleOp top;
  const Cluster &cluster;
  const SimOptions &options;
  MeshLayout layout;
  std::vector<Cursor> cursors;
  llvm::DenseMap<Operation *, KernelCost> costs;
  std::map<std::pair<int64_t, unsigned>, GroupPlacement> groups;
  // (sender, receiver, tag, microbatch) -> arrival, and when the receiver
  // took it (its send completed).
  std::map<std::tuple<int64_t, int64_t, int64_t, int64_t>, double> messages,
      received;
  // (axes bits, index) -> each program's arrival.
  std::map<std::pair<unsigned, int64_t>, std::map<size_t, double>> syncs;
  json events = json::array();
  bool bf16 = false;
};

llvm::Error Simulation::load() {
  std::vector<ModuleOp> programs;
  for (auto m : top.getOps<ModuleOp>())
    programs.push_back(m);
  if (programs.empty())
    programs.push_back(top);
  if (static_cast<int64_t>(programs.size()) != layout.numPrograms())
    return error(formatv("the module holds {0} rank programs but its mesh "
                         "has {1} pipeline ranks",
                         programs.size(), layout.numPrograms()));
  if (layout.worldSize() > cluster.devices())
    return error(formatv("the plan needs {0} devices but the cluster has {1} "
                         "({2} node(s) of {3}; --nodes N sets the nodes)",
                         layout.worldSize(), cluster.devices(), cluster.nodes,
                         cluster.gpusPerNode));
  for (ModuleOp program : programs) {
    Cursor c;
    c.name = program.getSymName() ? program.getSymName()->str() : "program0";
    if (auto r = program->getAttrOfType<IntegerAttr>("pipe.rank"))
      c.pipelineRank = r.getInt();
    c.rank = layout.firstRankOfProgram(c.pipelineRank);
    if (auto slots = program->getAttrOfType<IntegerAttr>("rt.send_ring_slots"))
      c.ringSlots = slots.getInt();
    c.times.name = c.name;
    c.times.pipelineRank = c.pipelineRank;
    auto stepFn = program.lookupSymbol<func::FuncOp>("train_step");
    if (!stepFn)
      return error("program " + c.name +
                   " has no train_step: simulate replays a training compile");
    for (Operation &op : stepFn.getBody().front()) {
      if (auto call = dyn_cast<func::CallOp>(op)) {
        auto callee = program.lookupSymbol<func::FuncOp>(call.getCallee());
        if (!callee)
          return error("program " + c.name + " calls an unknown part " +
                       call.getCallee().str());
        int64_t mb = call.getNumOperands() > 0
                         ? constantOf(call.getOperand(0), 0)
                         : 0;
        auto part = callee->getAttrOfType<StringAttr>("rt.part");
        std::string name = part ? part.getValue().str() : call.getCallee().str();
        Phase phase = name == "update" ? Phase::Update : Phase::Compute;
        int64_t id = c.calls.size();
        c.calls.push_back({name, mb});
        callee.walk([&](Operation *inner) {
          if (inner->getNumRegions() == 0)
            c.items.push_back({inner, mb, phase, id});
        });
        continue;
      }
      if (op.getNumRegions() == 0)
        c.items.push_back({&op, -1, Phase::Step, -1});
    }
    // As the CUDA runtime decides (DeviceProgram::hostReadsInStep): a step
    // whose expert exchange reads counts on the host launches eagerly.
    c.graph = options.cudaGraphs;
    program.walk([&](Operation *op) {
      if (isa<rt::MoeExchangeOp, rt::MoeCombineOp>(op))
        c.graph = false;
    });
    cursors.push_back(std::move(c));
  }
  top.walk([&](Operation *op) {
    if (auto mm = dyn_cast<rt::MatmulOp>(op))
      bf16 |= rt::elementBytesOf(mm.getA()) == 2;
    if (isa<rt::MatmulBiasOp, rt::MatmulBiasGradOp, rt::MatmulGeluGradOp,
            rt::MatmulAddOp, rt::MatmulAccumulateOp,
            rt::MatmulBiasGradAccumulateOp>(op))
      bf16 |= rt::elementBytesOf(op->getOperand(0)) == 2;
  });
  return llvm::Error::success();
}

const GroupPlacement &Simulation::group(const Cursor &c, AxisSet axes) {
  auto key = std::make_pair(c.rank, axes.bits());
  auto it = groups.find(key);
  if (it == groups.end())
    it = groups.emplace(key, placeGroup(layout, c.rank, axes, cluster)).first;
  return it->second;
}

Simulation::Comm Simulation::communication(Cursor &c, Operation *op) {
  Comm out;
  auto comm = dyn_cast<rt::CommunicationOpInterface>(op);
  if (!comm)
    return out;
  SmallVector<rt::CollectiveRecord> records;
  comm.describeCommunication(layout.shape(), records);
  bool count = c.groupsCounted != c.pc;
  c.groupsCounted = c.pc;
  for (auto [index, r] : llvm::enumerate(records)) {
    const GroupPlacement &g = group(c, r.axes);
    double seconds = collectiveSeconds(
        r.kind, r.bytesSent * balancedShare(op, index, g.size), g, cluster);
    out.seconds += seconds;
    out.bytes += r.bytesSent;
    out.axes |= r.axes;
    AxisSet axes = layout.shape().effective(r.axes);
    if (!count || axes.empty())
      continue;
    GroupTimes &t = c.times.groups[axes.str()];
    t.placement = g;
    ++t.collectives;
    t.bytes += r.bytesSent;
    t.seconds += seconds;
  }
  // ZeRO-3 with the optimizer offloaded: a gather with a piece to copy in
  // first copies this rank's fp32 piece of the run (a g-th of it) from host
  // memory into its slot.
  double host = cluster.device.hostBandwidth;
  auto pieceFromHost = [&](auto gather) {
    if (!gather.getFrom())
      return 0.0;
    int64_t g = std::max<int64_t>(1, layout.shape().groupSize(gather.getAxes()));
    return 4.0 * static_cast<double>(gather.getN()) / g / host;
  };
  if (host > 0 && optimizerOffloaded(op)) {
    if (auto gather = dyn_cast<rt::AllGatherShardsOp>(op))
      out.seconds += pieceFromHost(gather);
    else if (auto gather = dyn_cast<rt::AllGatherShardsStartOp>(op))
      out.seconds += pieceFromHost(gather);
  }
  return out;
}

void Simulation::span(const Cursor &c, int tid, const std::string &name,
                      double start, double end, json args) {
  if (!options.trace || end <= start)
    return;
  events.push_back({{"name", name},
                    {"ph", "X"},
                    {"pid", c.pipelineRank},
                    {"tid", tid},
                    {"ts", start * 1e6},
                    {"dur", (end - start) * 1e6},
                    {"args", std::move(args)}});
}

bool Simulation::step(size_t index) {
  Cursor &c = cursors[index];
  const Item &item = c.items[c.pc];
  Operation *op = item.op;
  auto mbOf = [&](Value v) {
    if (isa<BlockArgument>(v))
      return item.microbatch;
    return constantOf(v, item.microbatch);
  };
  auto advance = [&]() {
    if (item.call >= 0)
      c.calls[item.call].end = c.t;
    ++c.pc;
  };
  // A part call starts where its first op does.
  if (item.call >= 0 && c.calls[item.call].start < 0)
    c.calls[item.call].start = c.t;

  if (auto send = dyn_cast<rt::SendOp>(op)) {
    auto [from, to, tag] = rt::messageOf(op);
    // A ring send copies into the slot once its last message was taken.
    if (send.getRing() && c.ringSlots > 0) {
      if ((int64_t)c.ringHeld.size() >= c.ringSlots) {
        auto it = received.find(c.ringHeld[c.ringHeld.size() - c.ringSlots]);
        if (it == received.end())
          return false;
        if (it->second > c.t) {
          span(c, 0, "send slot", c.t, it->second);
          c.times.bubble += it->second - c.t;
          c.t = it->second;
        }
      }
      c.ringHeld.push_back({from, to, tag, mbOf(send.getMicrobatch())});
    }
    double bytes = rt::elementsOf(send.getBuffer()) *
                   double(rt::elementBytesOf(send.getBuffer()));
    GroupPlacement link;
    int64_t peer = layout.firstRankOfProgram(to);
    link.size = 2;
    link.nodes = cluster.nodeOf(c.rank) == cluster.nodeOf(peer) ? 1 : 2;
    double start = std::max(c.t, c.p2pFree[to]);
    double arrive = start + collectiveSeconds("send_recv", bytes, link, cluster);
    c.p2pFree[to] = arrive;
    c.sendsDone = std::max(c.sendsDone, arrive);
    c.times.commBytes += bytes;
    messages[{from, to, tag, mbOf(send.getMicrobatch())}] = arrive;
    span(c, 2, "send", start, arrive,
         {{"to", to}, {"bytes", bytes}, {"microbatch", mbOf(send.getMicrobatch())}});
    advance();
    return true;
  }
  if (auto recv = dyn_cast<rt::RecvOp>(op)) {
    auto [from, to, tag] = rt::messageOf(op);
    auto it = messages.find({from, to, tag, mbOf(recv.getMicrobatch())});
    if (it == messages.end())
      return false;
    if (it->second > c.t) {
      span(c, 0, "recv", c.t, it->second, {{"from", from}});
      c.times.bubble += it->second - c.t;
      c.t = it->second;
    }
    received[it->first] = c.t;
    advance();
    return true;
  }
  if (isa<rt::WaitSendsOp>(op)) {
    c.ringHeld.clear();
    if (c.sendsDone > c.t) {
      span(c, 0, "wait sends", c.t, c.sendsDone);
      c.times.exposedComm += c.sendsDone - c.t;
      c.t = c.sendsDone;
    }
    advance();
    return true;
  }
  auto waitUntil = [&](double done) {
    if (done > c.t) {
      span(c, 0, "wait", c.t, done);
      c.times.exposedComm += done - c.t;
      c.t = done;
    }
  };
  if (auto w = dyn_cast<rt::WaitOp>(op)) {
    auto it = c.requestDone.find(w.getRequest());
    waitUntil(it == c.requestDone.end() ? c.t : it->second);
    advance();
    return true;
  }
  if (auto w = dyn_cast<rt::WaitRequestsOp>(op)) {
    double done = c.t;
    int64_t first = w.getFirst(), count = w.getCount();
    for (int64_t s = first; s < first + count; ++s) {
      auto it = c.slotDone.find(s);
      if (it != c.slotDone.end())
        done = std::max(done, it->second);
    }
    waitUntil(done);
    advance();
    return true;
  }
  if (isStart(op)) {
    Comm comm = communication(c, op);
    double &lane = onDataParallelLane(op) ? c.commFree : c.streamFree;
    double start = std::max(c.t, lane);
    double done = start + comm.seconds;
    lane = done;
    c.times.commBytes += comm.bytes;
    for (Value r : op->getResults())
      c.requestDone[r] = done;
    auto [first, count] = slotsOf(op);
    for (int64_t s = first; first >= 0 && s < first + count; ++s)
      c.slotDone[s] = done;
    span(c, 1, op->getName().stripDialect().str(), start, done,
         {{"bytes", comm.bytes}});
    advance();
    return true;
  }

  bool kernel = isa<rt::KernelCallOpInterface>(op) && !isCollectiveOnly(op);
  bool communicates = isa<rt::CommunicationOpInterface>(op);
  if (!kernel && !communicates) {
    advance();
    return true;
  }
  // A collective (or a kernel that communicates) blocks the program; over
  // pp it waits for every stage first.
  Comm comm = communication(c, op);
  if (communicates) {
    AxisSet axes = comm.axes;
    if (axes.contains(MeshAxis::PP) && layout.numPrograms() > 1) {
      auto key = std::make_pair(axes.bits(), c.ppSyncs[axes.bits()]);
      auto &arrived = syncs[key];
      arrived.emplace(index, c.t);
      if (arrived.size() < cursors.size())
        return false;
      double start = 0;
      for (auto &[i, t] : arrived)
        start = std::max(start, t);
      if (start > c.t) {
        span(c, 0, "stages", c.t, start);
        c.times.bubble += start - c.t;
        c.t = start;
      }
      ++c.ppSyncs[axes.bits()];
    }
  }
  if (kernel) {
    auto it = costs.find(op);
    if (it == costs.end())
      it = costs.try_emplace(op, kernelCost(op, cluster, c.graph)).first;
    const KernelCost &k = it->second;
    c.t += k.seconds;
    (item.phase == Phase::Update ? c.times.optimizer : c.times.compute) +=
        k.seconds;
    c.times.flops += k.flops;
    ++c.times.kernels;
  }
  if (communicates) {
    // Behind what a started collective still has on the stream.
    double begin = comm.seconds > 0 ? std::max(c.t, c.streamFree) : c.t;
    if (comm.seconds > 0)
      span(c, 0, op->getName().stripDialect().str(), c.t,
           begin + comm.seconds, {{"bytes", comm.bytes}});
    c.times.exposedComm += begin + comm.seconds - c.t;
    c.t = begin + comm.seconds;
    if (comm.seconds > 0)
      c.streamFree = c.t;
    c.times.commBytes += comm.bytes;
  }
  advance();
  return true;
}

llvm::Expected<SimResult> Simulation::run() {
  if (auto e = load())
    return std::move(e);
  size_t left = cursors.size();
  std::vector<bool> done(cursors.size(), false);
  while (left > 0) {
    bool progress = false;
    for (size_t i = 0; i < cursors.size(); ++i) {
      if (done[i])
        continue;
      Cursor &c = cursors[i];
      while (c.pc < c.items.size() && step(i))
        progress = true;
      if (c.pc == c.items.size()) {
        done[i] = true;
        --left;
        progress = true;
      }
    }
    if (!progress) {
      std::string stuck;
      for (size_t i = 0; i < cursors.size(); ++i)
        if (!done[i]) {
          std::string what;
          llvm::raw_string_ostream os(what);
          cursors[i].items[cursors[i].pc].op->print(
              os, OpPrintingFlags().elideLargeElementsAttrs().skipRegions());
          stuck += "\n  " + cursors[i].name + " waits at: " + what;
        }
      return error("the programs wait for each other (no schedule "
                   "completes):" +
                   stuck);
    }
  }

  SimResult r;
  r.devices = layout.worldSize();
  for (Cursor &c : cursors) {
    c.times.end = c.t;
    r.stepTime = std::max(r.stepTime, c.t);
  }
  for (Cursor &c : cursors) {
    c.times.bubble += r.stepTime - c.t;
    r.hardwareFlopsPerStep += c.times.flops * layout.ranksPerProgram();
    for (const PartCall &p : c.calls)
      if (p.start >= 0)
        span(c, 0, p.name, p.start, p.end, {{"microbatch", p.microbatch}});
    r.programs.push_back(c.times);
  }
  auto recipe = top->getAttrOfType<DictionaryAttr>("graph.recipe");
  auto number = [&](StringRef name) -> double {
    if (!recipe)
      return 0;
    Attribute a = recipe.get(name);
    if (auto i = dyn_cast_or_null<IntegerAttr>(a))
      return static_cast<double>(i.getInt());
    if (auto f = dyn_cast_or_null<FloatAttr>(a))
      return f.getValueAsDouble();
    return 0;
  };
  r.tokensPerStep = number("global_batch") * number("seq_len");
  r.modelFlopsPerToken = number("flops_per_token");
  r.elementType = bf16 ? "bf16" : "fp32";
  r.peakFlops = cluster.peak(r.elementType);
  if (options.trace) {
    json meta = json::array();
    const char *tracks[] = {"program", "collectives in flight", "messages"};
    for (const Cursor &c : cursors) {
      meta.push_back({{"name", "process_name"},
                      {"ph", "M"},
                      {"pid", c.pipelineRank},
                      {"args", {{"name", c.name}}}});
      for (int t = 0; t < 3; ++t)
        meta.push_back({{"name", "thread_name"},
                        {"ph", "M"},
                        {"pid", c.pipelineRank},
                        {"tid", t},
                        {"args", {{"name", tracks[t]}}}});
    }
    for (json &e : events)
      meta.push_back(std::move(e));
    r.trace = {{"traceEvents", meta},
               {"displayTimeUnit", "ms"},
               {"otherData", {{"simulated", true}, {"cluster", cluster.name}}}};
  }
  return r;
}

} // namespace

llvm::Expected<SimResult> tessel::sim::simulate(ModuleOp top,
                                                const Cluster &cluster,
                                                const SimOptions &options) {
  Simulation s(top, cluster, options);
  return s.run();
}

json tessel::sim::resultToJson(const SimResult &r) {
  json programs = json::array();
  for (const ProgramTimes &p : r.programs) {
    json groups = json::array();
    for (const auto &[axes, g] : p.groups)
      groups.push_back({{"axes", axes},
                        {"ranks", g.placement.size},
                        {"nodes", g.placement.nodes},
                        {"ranks_per_node", g.placement.perNode},
                        {"collectives", g.collectives},
                        {"bytes_per_rank", g.bytes},
                        {"seconds", g.seconds}});
    programs.push_back({{"program", p.name},
                        {"pipeline_rank", p.pipelineRank},
                        {"compute_s", p.compute},
                        {"optimizer_s", p.optimizer},
                        {"exposed_comm_s", p.exposedComm},
                        {"bubble_s", p.bubble},
                        {"end_s", p.end},
                        {"flops_per_rank", p.flops},
                        {"comm_bytes_per_rank", p.commBytes},
                        {"kernels", p.kernels},
                        {"groups", groups}});
  }
  return {{"step_time_s", r.stepTime},
          {"devices", r.devices},
          {"tokens_per_step", r.tokensPerStep},
          {"tokens_per_s", r.tokensPerSecond()},
          {"model_flops_per_token", r.modelFlopsPerToken},
          {"tflops_per_gpu", r.tflopsPerDevice()},
          {"hardware_tflops_per_gpu", r.hardwareTflopsPerDevice()},
          {"mfu", r.mfu()},
          {"element_type", r.elementType},
          {"peak_tflops", r.peakFlops / 1e12},
          {"programs", programs}};
}
