//===- Simulator.h - Replaying compiled rank programs on a cluster -*- C++ -*-===//
//
// `tessel simulate` replays the rank programs a compile produced (the
// modules of ir/07-programs.mlir: one per pipeline coordinate, each
// `train_step` calling its parts in schedule order) on a described
// cluster. Every kernel call costs what the cost model says (a roofline:
// GEMMs and attention by FLOPs at an efficiency, the rest by the bytes of
// their operands), every collective what an alpha-beta model of its group's
// links says (the bytes it sends by the textbook formulas plan.json uses,
// a ring or a tree, within a node or across nodes whose NICs the node's
// devices share); started collectives run on a second stream and are
// waited for where the program waits, pipeline messages arrive after their
// link's time, and collectives over the pipeline axis wait for every
// stage. Ranks of one program (its dp, tp, ep coordinates) run alike, so
// each program is replayed once.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_SIMULATE_SIMULATOR_H
#define TESSEL_SIMULATE_SIMULATOR_H

#include "tessel/Simulate/Cluster.h"
#include "tessel/Support/MeshLayout.h"

#include "mlir/IR/BuiltinOps.h"
#include "llvm/Support/Error.h"
#include <nlohmann/json.hpp>

#include <map>
#include <string>
#include <vector>

namespace tessel::sim {

// The cost of one kernel call.
struct KernelCost {
  double seconds = 0;
  double flops = 0; // GEMM and attention FLOPs
  double bytes = 0; // operand bytes
  const char *kind = "memory"; // gemm, attention, memory
};
// `inGraph`: the call is a node of a CUDA graph.
KernelCost kernelCost(mlir::Operation *op, const Cluster &cluster,
                      bool inGraph = false);

// Where a group's ranks sit: how many, on how many nodes, at most how many
// on one node.
struct GroupPlacement {
  int64_t size = 1, nodes = 1, perNode = 1;
};
GroupPlacement placeGroup(const MeshLayout &layout, int64_t rank,
                          AxisSet axes, const Cluster &cluster);

// The time of one collective that sends `bytesSent` per rank (the textbook
// volume) over a group placed as `group`: kind is all_reduce, all_gather,
// reduce_scatter, all_to_all or send_recv.
double collectiveSeconds(const std::string &kind, double bytesSent,
                         const GroupPlacement &group, const Cluster &cluster);

// The collectives one rank of a program runs over one group: where the
// group sits and what its collectives took (their own time, hidden or not).
struct GroupTimes {
  GroupPlacement placement;
  int64_t collectives = 0;
  double bytes = 0;   // sent per rank (textbook volume)
  double seconds = 0; // the collectives' time
};

struct ProgramTimes {
  std::string name;
  int64_t pipelineRank = 0;
  double compute = 0;      // kernels of the forward and backward parts
  double optimizer = 0;    // kernels of the update part
  double exposedComm = 0;  // blocking collectives, waits for started ones
  double bubble = 0;       // waiting for another stage (messages, syncs)
  double end = 0;          // when its step ended
  double flops = 0;        // per rank
  double commBytes = 0;    // bytes a rank sends (textbook volume)
  int64_t kernels = 0;
  // Per group of its collectives ("tp", "dp,cp", ...).
  std::map<std::string, GroupTimes> groups;
};

struct SimResult {
  double stepTime = 0;
  int64_t devices = 0;
  double tokensPerStep = 0;
  double modelFlopsPerToken = 0;
  double hardwareFlopsPerStep = 0; // executed GEMM and attention FLOPs
  double peakFlops = 0;            // per device, at the programs' type
  std::string elementType;
  std::vector<ProgramTimes> programs;
  nlohmann::json trace; // Chrome trace events

  double tokensPerSecond() const { return tokensPerStep / stepTime; }
  // Model FLOP/s per device (the model's FLOPs per token, as plan.json
  // counts them) and its fraction of the peak.
  double tflopsPerDevice() const {
    return modelFlopsPerToken * tokensPerSecond() / devices / 1e12;
  }
  double hardwareTflopsPerDevice() const {
    return hardwareFlopsPerStep / stepTime / devices / 1e12;
  }
  double mfu() const { return tflopsPerDevice() * 1e12 / peakFlops; }
};

struct SimOptions {
  bool trace = false;
  // The programs are CUDA programs: a step without host reads inside it
  // runs as a CUDA graph (Device::graphKernelOverhead per kernel).
  bool cudaGraphs = false;
};

// Replays the programs of `top` (the module convert-pipe-to-rt produced).
llvm::Expected<SimResult> simulate(mlir::ModuleOp top, const Cluster &cluster,
                                   const SimOptions &options = {});

nlohmann::json resultToJson(const SimResult &r);

} // namespace tessel::sim

#endif // TESSEL_SIMULATE_SIMULATOR_H
