//===- OverlapCollectives.cpp - Collectives in flight under the GEMMs -----===//
//
// A layer's backward under tensor (and sequence) parallelism runs, per
// linear layer,
//
//   dX = dY W^T          the input gradient's GEMM
//   X  = all_gather(x)   the input re-gathered (sequence parallel)
//   dW = X^T dY          the weight gradient's GEMM
//   dx = reduce_scatter(dX)
//
// with every collective blocking. Neither collective needs the GEMM next to
// it: the re-gather reads only the saved x, and the reduce-scatter only dX.
// Here each becomes a start and a wait, the start moved up and the wait
// down past the ops that do not conflict with it:
//
//   start all_gather(x)  ; dX = dY W^T ; wait ; start reduce_scatter(dX)
//   dW = X^T dY ; wait
//
// A start moves past an op unless the op writes what the collective reads
// or touches what it writes; a wait likewise. Both stop at another
// collective or message (the ranks of a group then start their collectives
// in one order), at an op with regions and at the part's end, and each
// passes at most one GEMM: the point is to hide the transfer, not to hold
// its buffers longer than that takes. A collective that would overlap no
// GEMM stays as it is.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "dialects/Dist/DistOps.h"
#include "dialects/Pipe/PipeOps.h"
#include "dialects/Rt/RtOps.h"

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/IR/Builders.h"

namespace tessel {
#define GEN_PASS_DEF_OVERLAPCOLLECTIVES
#include "tessel/Transforms/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;
namespace rt = tessel::rtir;

namespace {

// The kernels worth hiding a transfer under.
bool isHeavy(Operation *op) {
  return isa<rt::MatmulOp, rt::MatmulBiasOp, rt::MatmulBiasGradOp,
             rt::MatmulGeluGradOp, rt::MatmulAddOp, rt::GroupedMatmulOp,
             rt::GroupedMatmulWeightGradOp, rt::AttentionForwardOp,
             rt::AttentionBackwardOp>(op);
}

// An op a collective may move past when the buffers allow: computation of
// the rt dialect (not a collective, a message or a wait for one) and
// constants.
bool movable(Operation *op) {
  if (op->getNumRegions() > 0 || op->hasTrait<OpTrait::IsTerminator>())
    return false;
  if (isa<arith::ArithDialect>(op->getDialect()))
    return true;
  if (!isa<rt::RtDialect>(op->getDialect()))
    return false;
  return !isa<rt::CommunicationOpInterface, rt::WaitRequestsOp,
              rt::FlushSendsOp, rt::WaitSendsOp, rt::FinishStepOp,
              rt::RecordMetricOp>(op);
}

// A blocking collective to start early and wait for late: what it reads
// and what it writes (roots of buffers).
struct Collective {
  Operation *op;
  SmallVector<Value> reads, writes;
};

// Whether `op` conflicts with `c` in flight: it writes what `c` reads or
// touches what `c` writes. The wait for another started collective does
// when that collective touches any of `c`'s buffers (`c` must not read
// what is still arriving, nor write what is still being sent).
bool conflicts(Operation *op, const Collective &c) {
  if (auto wait = dyn_cast<rt::WaitOp>(op)) {
    Operation *other = wait.getRequest().getDefiningOp();
    if (!other)
      return true;
    return llvm::any_of(other->getOperands(), [&](Value v) {
      return isa<MemRefType>(v.getType()) &&
             (llvm::is_contained(c.reads, rt::rootBuffer(v)) ||
              llvm::is_contained(c.writes, rt::rootBuffer(v)));
    });
  }
  for (OpOperand &use : op->getOpOperands()) {
    Value v = use.get();
    if (!isa<MemRefType>(v.getType()))
      continue;
    Value root = rt::rootBuffer(v);
    if (llvm::is_contained(c.writes, root))
      return true;
    if (llvm::is_contained(c.reads, root) &&
        !rt::onlyReadsOperand(op, use.getOperandNumber()))
      return true;
  }
  return false;
}

// Where the start of `c` can go: the op it would then precede (c.op itself
// when it cannot move), and the allocations and views that must move with
// it. Passes at most one heavy op; `heavy` says whether it did.
Operation *startPlace(const Collective &c, SmallVectorImpl<Operation *> &carried,
                      bool &heavy) {
  Operation *place = c.op;
  heavy = false;
  auto definesOperand = [&](Operation *prev) {
    auto defines = [&](Operation *user) {
      return llvm::any_of(user->getOperands(), [&](Value v) {
        return v.getDefiningOp() == prev;
      });
    };
    return defines(c.op) || llvm::any_of(carried, defines);
  };
  for (Operation *prev = c.op->getPrevNode(); prev;
       prev = prev->getPrevNode()) {
    if (definesOperand(prev)) {
      // Storage is named anywhere before its first use (a view's source,
      // if defined on the way up, is carried too or stops the walk).
      if (isa<rt::AllocOp, rt::ViewOp>(prev)) {
        carried.push_back(prev);
        continue;
      }
      break;
    }
    if (!movable(prev) || conflicts(prev, c))
      break;
    if (isHeavy(prev)) {
      if (heavy)
        break;
      heavy = true;
    }
    place = prev;
  }
  return place;
}

// The op after which the wait of `c` can go (c.op when it cannot move).
Operation *waitPlace(const Collective &c, bool &heavy) {
  Operation *place = c.op;
  heavy = false;
  for (Operation *next = c.op->getNextNode(); next;
       next = next->getNextNode()) {
    if (!movable(next) || conflicts(next, c))
      break;
    if (isHeavy(next)) {
      if (heavy)
        break;
      heavy = true;
    }
    place = next;
  }
  return place;
}

// The buffers `op` may write (roots): every memref operand it does not
// only read.
SmallVector<Value> writesOf(Operation *op) {
  SmallVector<Value> out;
  for (OpOperand &use : op->getOpOperands())
    if (isa<MemRefType>(use.get().getType()) &&
        !rt::onlyReadsOperand(op, use.getOperandNumber()))
      out.push_back(rt::rootBuffer(use.get()));
  return out;
}

// When nothing can overlap `c` where it stands (its input is computed
// right before it and read right after), the GEMM nearest above it that it
// does not depend on: moved to just after the start, it runs while the
// collective is in flight (the weight gradient's GEMM under the reduction
// of the input gradient that the q, k and v products summed). Every op in
// between must neither touch what the GEMM writes nor write what it reads.
Operation *independentGemmAbove(const Collective &c) {
  for (Operation *prev = c.op->getPrevNode(); prev;
       prev = prev->getPrevNode()) {
    // A GEMM above a wait may be what that collective overlaps: it stays.
    if (!movable(prev) || isa<rt::WaitOp>(prev))
      return nullptr;
    if (!isHeavy(prev))
      continue;
    if (conflicts(prev, c))
      return nullptr;
    SmallVector<Value> reads, writes = writesOf(prev);
    for (Value v : prev->getOperands())
      if (isa<MemRefType>(v.getType()))
        reads.push_back(rt::rootBuffer(v));
    Collective gemm{prev, reads, writes};
    for (Operation *between = prev->getNextNode(); between != c.op;
         between = between->getNextNode())
      if (conflicts(between, gemm))
        return nullptr;
    return prev;
  }
  return nullptr;
}

Collective describe(Operation *op) {
  Collective c{op, {}, {}};
  if (auto ag = dyn_cast<rt::AllGatherOp>(op)) {
    c.reads.push_back(rt::rootBuffer(ag.getInput()));
    c.writes.push_back(rt::rootBuffer(ag.getOutput()));
  } else if (auto rs = dyn_cast<rt::ReduceScatterOp>(op)) {
    c.reads.push_back(rt::rootBuffer(rs.getInput()));
    c.writes.push_back(rt::rootBuffer(rs.getOutput()));
  } else {
    for (Value b : cast<rt::AllReduceOp>(op).getBuffers())
      c.writes.push_back(rt::rootBuffer(b));
  }
  return c;
}

// The collectives this pass starts early: over axes without dp or pp (the
// data-parallel gradients have their own buckets; a pp group joins stages
// that run different programs).
bool candidate(Operation *op) {
  if (!isa<rt::AllGatherOp, rt::ReduceScatterOp, rt::AllReduceOp>(op))
    return false;
  auto axes = op->getAttrOfType<dist::AxesAttr>("axes");
  if (!axes)
    return false;
  unsigned bits = axes.getValue().bits();
  return !(bits & (AxisSet(MeshAxis::DP).bits() | AxisSet(MeshAxis::PP).bits() |
                   kDpShardBit | kDpReplicaBit));
}

// The started form of `c.op`, created before `startBefore`, and its wait
// after `waitAfter`.
void start(const Collective &c, Operation *startBefore, Operation *waitAfter,
           ArrayRef<Operation *> carried) {
  Operation *op = c.op;
  MLIRContext *ctx = op->getContext();
  // What the start names and is not above it already moves with it, in
  // its order.
  for (Operation *moved : llvm::reverse(carried))
    if (startBefore->isBeforeInBlock(moved))
      moved->moveBefore(startBefore);
  OpBuilder b(startBefore);
  Location loc = op->getLoc();
  Type request = rt::RequestType::get(ctx);
  // The ranks' pieces side by side when the dimension is an inner one.
  auto blocksFor = [&](Value whole, int64_t outer) -> Value {
    if (outer == 1)
      return {};
    auto type = cast<MemRefType>(whole.getType());
    return rt::AllocOp::create(
        b, loc, MemRefType::get({type.getNumElements()}, type.getElementType()));
  };
  Value started;
  if (auto ag = dyn_cast<rt::AllGatherOp>(op)) {
    Value blocks = blocksFor(ag.getOutput(), ag.getOuter());
    started = rt::AllGatherStartOp::create(
        b, loc, request, ag.getInput(), ag.getOutput(), blocks,
        ag.getOuterAttr(), ag.getLengthAttr(), ag.getInnerAttr(),
        ag.getAxesAttr(), IntegerAttr());
  } else if (auto rs = dyn_cast<rt::ReduceScatterOp>(op)) {
    Value blocks = blocksFor(rs.getInput(), rs.getOuter());
    started = rt::ReduceScatterStartOp::create(
        b, loc, request, rs.getInput(), rs.getOutput(), blocks,
        rs.getOuterAttr(), rs.getLengthAttr(), rs.getInnerAttr(),
        rs.getAxesAttr(), IntegerAttr());
  } else {
    auto ar = cast<rt::AllReduceOp>(op);
    started = rt::AllReduceStartOp::create(b, loc, request, ar.getBuffers(),
                                           ar.getAxesAttr(), IntegerAttr());
  }
  b.setInsertionPointAfter(waitAfter);
  rt::WaitOp::create(b, loc, started);
  op->erase();
}

struct OverlapCollectivesPass
    : public tessel::impl::OverlapCollectivesBase<OverlapCollectivesPass> {
  using OverlapCollectivesBase::OverlapCollectivesBase;
  void runOnOperation() override {
    ModuleOp module = getOperation();
    SmallVector<Operation *> parts;
    module.walk([&](Operation *op) {
      if (isa<pipe::ForwardPassOp, pipe::BackwardPassOp>(op))
        parts.push_back(op);
    });
    for (Operation *part : parts) {
      MeshShape mesh = dist::meshOf(part);
      Block &body = part->getRegion(0).front();
      SmallVector<Operation *> collectives;
      for (Operation &op : body)
        if (candidate(&op) &&
            mesh.effective(op.getAttrOfType<dist::AxesAttr>("axes")
                               .getValue())
                    .bits() != 0)
          collectives.push_back(&op);
      // In program order: a later collective's start may then rise above
      // an earlier one's wait, never above its start.
      for (Operation *op : collectives) {
        Collective c = describe(op);
        SmallVector<Operation *> carried;
        bool heavyBefore = false, heavyAfter = false;
        Operation *startBefore = startPlace(c, carried, heavyBefore);
        Operation *waitAfter = waitPlace(c, heavyAfter);
        if (!heavyBefore && !heavyAfter) {
          Operation *gemm = moveGemms ? independentGemmAbove(c) : nullptr;
          if (!gemm)
            continue;
          // The GEMM follows the start, and the wait the GEMM (the one
          // GEMM it may pass).
          gemm->moveAfter(op);
          startBefore = op;
          waitAfter = waitPlace(c, heavyAfter);
        }
        start(c, startBefore, waitAfter, carried);
      }
    }
  }
};

} // namespace
