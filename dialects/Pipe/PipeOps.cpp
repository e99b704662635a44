//===- PipeOps.cpp - The pipe dialect: per-rank pipeline schedules --------===//

#include "dialects/Pipe/PipeOps.h"

#include "mlir/IR/DialectImplementation.h"
#include "mlir/IR/OpImplementation.h"
#include "llvm/ADT/DenseSet.h"
#include "llvm/ADT/TypeSwitch.h"

#include <map>
#include <tuple>

using namespace mlir;
using namespace tessel::pipe;

#include "dialects/Pipe/PipeDialect.cpp.inc"
#define GET_ATTRDEF_CLASSES
#include "dialects/Pipe/PipeAttrs.cpp.inc"

void PipeDialect::initialize() {
  addAttributes<
#define GET_ATTRDEF_LIST
#include "dialects/Pipe/PipeAttrs.cpp.inc"
      >();
  addOperations<
#define GET_OP_LIST
#include "dialects/Pipe/PipeOps.cpp.inc"
      >();
}

LogicalResult PipeDialect::verifyOperationAttribute(Operation *op,
                                                    NamedAttribute attr) {
  if (attr.getName() == kLayoutAttrName &&
      (!isa<ModuleOp>(op) || !isa<LayoutAttr>(attr.getValue())))
    return op->emitOpError("pipe.layout must be a #pipe.layout<...> on a "
                           "module");
  return success();
}

LogicalResult LayoutAttr::verify(function_ref<InFlightDiagnostic()> emitError,
                                 int64_t microbatches, StringRef schedule,
                                 int64_t virtualStages,
                                 ArrayRef<int64_t> layerStages) {
  if (microbatches < 1 || virtualStages < 1)
    return emitError() << "microbatches and virtual_stages must be >= 1";
  if (!llvm::is_contained(kScheduleKinds, schedule))
    return emitError() << "schedule must be \"gpipe\", \"1f1b\" or "
                          "\"interleaved\", got \""
                       << schedule << "\"";
  for (auto [layer, stage] : llvm::enumerate(layerStages))
    if (stage < 0 || (layer > 0 && stage < layerStages[layer - 1]))
      return emitError() << "layer_stages must be non-decreasing and >= 0";
  return success();
}

LayoutAttr tessel::pipe::layoutOf(Operation *op) {
  auto module =
      isa<ModuleOp>(op) ? cast<ModuleOp>(op) : op->getParentOfType<ModuleOp>();
  if (module)
    if (auto layout =
            module->getAttrOfType<LayoutAttr>(PipeDialect::kLayoutAttrName))
      return layout;
  return LayoutAttr::get(op->getContext(), 1, "1f1b", 1, {});
}

// How many activation arena slots a rank's schedule needs: a microbatch
// holds its slot from its first forward on the rank to its last backward
// there, and microbatch m uses slot m % slots. The fewest slots with which no
// two microbatches in flight share one (1F1B: the p - r in flight at rank r;
// GPipe: all of them).
int64_t tessel::pipe::activationSlots(RankOp steps, int64_t microbatches) {
  std::vector<std::pair<bool, int64_t>> order;
  steps.walk([&](Operation *op) {
    if (auto f = dyn_cast<ForwardOp>(op))
      order.push_back({true, f.getMicrobatch()});
    else if (auto b = dyn_cast<BackwardOp>(op))
      order.push_back({false, b.getMicrobatch()});
  });
  return activationSlots(order, microbatches);
}

int64_t tessel::pipe::activationSlots(
    llvm::ArrayRef<std::pair<bool, int64_t>> steps, int64_t microbatches) {
  std::map<int64_t, int64_t> backwards; // microbatch -> backward steps here
  for (auto [forward, mb] : steps)
    backwards[mb] += !forward;
  for (int64_t slots = 1; slots < microbatches; ++slots) {
    std::map<int64_t, int64_t> left; // in flight -> backward steps left
    bool fits = true;
    for (auto [forward, mb] : steps) {
      if (forward) {
        if (left.count(mb))
          continue;
        for (auto &[other, n] : left)
          fits &= other % slots != mb % slots;
        left[mb] = backwards[mb];
      } else if (auto it = left.find(mb); it != left.end() && --it->second == 0) {
        left.erase(it);
      }
    }
    if (fits)
      return slots;
  }
  return microbatches;
}

void tessel::pipe::setLayout(ModuleOp module, LayoutAttr layout) {
  module->setAttr(PipeDialect::kLayoutAttrName, layout);
}

#define GET_OP_CLASSES
#include "dialects/Pipe/PipeOps.cpp.inc"

// The region's terminator yields the op's results.
static LogicalResult verifyYield(Operation *op, Region &body) {
  auto yield = cast<YieldOp>(body.front().getTerminator());
  if (yield.getValues().getTypes() != op->getResultTypes())
    return op->emitOpError("yields ")
           << yield.getValues().size()
           << " values whose types differ from the op's results";
  return success();
}

LogicalResult ForwardPassOp::verify() { return verifyYield(*this, getBody()); }
LogicalResult BackwardPassOp::verify() {
  return verifyYield(*this, getBody());
}

LogicalResult UpdateOp::verify() {
  Block &block = getBody().front();
  if (block.getArgumentTypes() != getInputs().getTypes())
    return emitOpError("block arguments must have the types of the inputs");
  return verifyYield(*this, getBody());
}

LogicalResult ScheduleOp::verify() {
  if (!llvm::is_contained(kScheduleKinds, getKind()))
    return emitOpError("kind must be \"gpipe\", \"1f1b\" or \"interleaved\", "
                       "got \"")
           << getKind() << "\"";
  return success();
}

static LogicalResult verifyTransferKind(Operation *op, StringRef kind) {
  if (kind != kActivation && kind != kGradient)
    return op->emitOpError(
               "kind must be \"activation\" or \"gradient\", got \"")
           << kind << "\"";
  return success();
}

LogicalResult SendOp::verify() { return verifyTransferKind(*this, getKind()); }
LogicalResult RecvOp::verify() { return verifyTransferKind(*this, getKind()); }

namespace {
// What one rank has done so far, to check that every step's inputs come
// before it. Keys are (stage, microbatch).
using StepKey = std::pair<int64_t, int64_t>;

struct RankVerifier {
  ScheduleOp schedule;
  int64_t rank;
  int64_t numStages, numRanks, numMicrobatches;
  // Forwards and backwards of the whole schedule (each stage has one owner,
  // so a key seen here was seen on its owner rank).
  llvm::DenseSet<StepKey> &forwards, &backwards;
  llvm::DenseSet<StepKey> recvActivations, recvGradients;

  int64_t owner(int64_t stage) const {
    return pipelineLayout(numRanks).stageOwner(stage);
  }

  LogicalResult checkIds(Operation *op, int64_t stage, int64_t microbatch) {
    if (stage >= numStages)
      return op->emitOpError("stage ")
             << stage << " is out of range (the schedule has " << numStages
             << " stages)";
    if (microbatch >= numMicrobatches)
      return op->emitOpError("microbatch ")
             << microbatch << " is out of range (the schedule has "
             << numMicrobatches << " microbatches)";
    return success();
  }

  LogicalResult checkPeer(Operation *op, int64_t peer) {
    if (peer >= numRanks)
      return op->emitOpError("rank ")
             << peer << " is out of range (the schedule has " << numRanks
             << " ranks)";
    if (peer == rank)
      return op->emitOpError("transfers to its own rank ") << rank;
    return success();
  }

  LogicalResult checkOwned(Operation *op, int64_t stage) {
    if (owner(stage) != rank)
      return op->emitOpError("stage ")
             << stage << " runs on rank " << owner(stage) << ", not on rank "
             << rank;
    return success();
  }

  LogicalResult visit(ForwardOp op) {
    int64_t s = op.getStage(), mb = op.getMicrobatch();
    if (failed(checkIds(op, s, mb)) || failed(checkOwned(op, s)))
      return failure();
    if (s > 0) {
      bool local = owner(s - 1) == rank;
      bool ready = local ? forwards.contains({s - 1, mb})
                         : recvActivations.contains({s - 1, mb});
      if (!ready)
        return op.emitOpError("comes before ")
               << (local ? "the forward" : "the receive of the activation")
               << " of stage " << s - 1 << " microbatch " << mb;
    }
    if (!forwards.insert({s, mb}).second)
      return op.emitOpError("repeats the forward of stage ")
             << s << " microbatch " << mb;
    return success();
  }

  LogicalResult visit(BackwardOp op) {
    int64_t s = op.getStage(), mb = op.getMicrobatch();
    if (failed(checkIds(op, s, mb)) || failed(checkOwned(op, s)))
      return failure();
    if (!forwards.contains({s, mb}))
      return op.emitOpError("comes before the forward of stage ")
             << s << " microbatch " << mb;
    if (s + 1 < numStages) {
      bool local = owner(s + 1) == rank;
      bool ready = local ? backwards.contains({s + 1, mb})
                         : recvGradients.contains({s + 1, mb});
      if (!ready)
        return op.emitOpError("comes before ")
               << (local ? "the backward" : "the receive of the gradient")
               << " of stage " << s + 1 << " microbatch " << mb;
    }
    if (!backwards.insert({s, mb}).second)
      return op.emitOpError("repeats the backward of stage ")
             << s << " microbatch " << mb;
    return success();
  }

  // The stage a transfer of `kind` produced by `stage` goes to, or -1.
  int64_t consumer(StringRef kind, int64_t stage) const {
    int64_t next = kind == kActivation ? stage + 1 : stage - 1;
    return next >= 0 && next < numStages ? next : -1;
  }

  LogicalResult visit(SendOp op) {
    int64_t s = op.getStage(), mb = op.getMicrobatch();
    if (failed(checkIds(op, s, mb)) || failed(checkPeer(op, op.getToRank())) ||
        failed(checkOwned(op, s)))
      return failure();
    int64_t next = consumer(op.getKind(), s);
    if (next < 0)
      return op.emitOpError("sends the ") << op.getKind() << " of stage " << s
                                          << ", which no stage consumes";
    if (owner(next) != static_cast<int64_t>(op.getToRank()))
      return op.emitOpError("sends to rank ")
             << op.getToRank() << ", but the consuming stage " << next
             << " runs on rank " << owner(next);
    bool produced = op.getKind() == kActivation ? forwards.contains({s, mb})
                                                : backwards.contains({s, mb});
    if (!produced)
      return op.emitOpError("comes before the ")
             << (op.getKind() == kActivation ? "forward" : "backward")
             << " of stage " << s << " microbatch " << mb;
    return success();
  }

  LogicalResult visit(RecvOp op) {
    int64_t s = op.getStage(), mb = op.getMicrobatch();
    if (failed(checkIds(op, s, mb)) || failed(checkPeer(op, op.getFromRank())))
      return failure();
    if (owner(s) != static_cast<int64_t>(op.getFromRank()))
      return op.emitOpError("receives from rank ")
             << op.getFromRank() << ", but stage " << s << " runs on rank "
             << owner(s);
    int64_t next = consumer(op.getKind(), s);
    if (next < 0 || owner(next) != rank)
      return op.emitOpError("receives the ")
             << op.getKind() << " of stage " << s << ", which no stage of rank "
             << rank << " consumes";
    auto &received =
        op.getKind() == kActivation ? recvActivations : recvGradients;
    if (!received.insert({s, mb}).second)
      return op.emitOpError("repeats the receive of the ")
             << op.getKind() << " of stage " << s << " microbatch " << mb;
    return success();
  }
};
} // namespace

LogicalResult ScheduleOp::verifyRegions() {
  SmallVector<RankOp> ranks;
  if (!getBody().empty())
    for (Operation &op : getBody().front()) {
      auto rank = dyn_cast<RankOp>(op);
      if (!rank)
        return op.emitOpError("is not a pipe.rank; a pipe.schedule holds only "
                              "pipe.rank ops");
      ranks.push_back(rank);
    }
  if (ranks.size() != getRanks())
    return emitOpError("has ")
           << ranks.size() << " pipe.rank ops but " << getRanks() << " ranks";
  for (auto [index, rank] : llvm::enumerate(ranks))
    if (rank.getRank() != index)
      return rank.emitOpError("is rank ")
             << rank.getRank() << " at position " << index
             << "; ranks must be listed in order 0.." << getRanks() - 1;

  llvm::DenseSet<StepKey> forwards, backwards;
  for (RankOp rank : ranks) {
    RankVerifier verifier{*this,
                          static_cast<int64_t>(rank.getRank()),
                          getNumStages(),
                          static_cast<int64_t>(getRanks()),
                          static_cast<int64_t>(getMicrobatches()),
                          forwards,
                          backwards,
                          {},
                          {}};
    if (rank.getBody().empty())
      continue;
    for (Operation &op : rank.getBody().front()) {
      LogicalResult result =
          llvm::TypeSwitch<Operation *, LogicalResult>(&op)
              .Case<ForwardOp, BackwardOp, SendOp, RecvOp>(
                  [&](auto step) { return verifier.visit(step); })
              .Default([](Operation *other) {
                return other->emitOpError(
                    "is not a pipeline step; a pipe.rank holds pipe.forward, "
                    "pipe.backward, pipe.send and pipe.recv");
              });
      if (failed(result))
        return failure();
    }
  }
  for (int64_t s = 0; s < getNumStages(); ++s)
    for (int64_t mb = 0, e = getMicrobatches(); mb < e; ++mb) {
      if (!forwards.contains({s, mb}))
        return emitOpError("has no forward of stage ")
               << s << " microbatch " << mb << " (on rank "
               << pipelineLayout(getRanks()).stageOwner(s) << ")";
      if (!backwards.contains({s, mb}))
        return emitOpError("has no backward of stage ")
               << s << " microbatch " << mb << " (on rank "
               << pipelineLayout(getRanks()).stageOwner(s) << ")";
    }
  return success();
}
