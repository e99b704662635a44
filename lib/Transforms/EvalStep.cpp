//===- EvalStep.cpp - The forward-only step of each rank program ----------===//
//
// Validation loss is computed by the program that trains, at its layout:
// @eval_step runs the forward parts of @train_step in the same order, with
// the messages they exchange and what the step exchanges once before its
// parts (a tied weight), then reduces the loss as the update does (over dp
// and pp) and hands it to the runtime. No backward part, gradient or update
// runs, so the parameters and the optimizer's state are untouched and the
// loss is the one the next training step would report on the same batch.
//
// Dropping every backward part and its messages from each rank's sequence
// cannot deadlock a schedule that did not: what remains waits on a subset
// of what it waited on before.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "dialects/Rt/RtOps.h"
#include "tessel/Transforms/BufferRegion.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/IRMapping.h"
#include "llvm/ADT/MapVector.h"

namespace tessel {
#define GEN_PASS_DEF_EVALSTEP
#include "tessel/Transforms/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;
namespace rt = tessel::rtir;

namespace {

using Region = BufferRegion;

struct EvalStepPass : tessel::impl::EvalStepBase<EvalStepPass> {
  void runOnOperation() override {
    ModuleOp top = getOperation();
    for (auto program : top.getOps<ModuleOp>()) {
      auto step = program.lookupSymbol<func::FuncOp>("train_step");
      if (!step || program.lookupSymbol("eval_step"))
        continue;
      if (failed(derive(program, step)))
        return signalPassFailure();
    }
  }

  LogicalResult derive(ModuleOp program, func::FuncOp step) {
    func::FuncOp update;
    for (auto call : step.getBody().getOps<func::CallOp>())
      if (partOf(program, call) == "update")
        update = program.lookupSymbol<func::FuncOp>(call.getCallee());
    if (!update)
      return step.emitOpError("calls no update part; there is no loss to "
                              "evaluate");
    rt::FinishStepOp finish;
    update.walk([&](rt::FinishStepOp f) { finish = f; });
    if (!finish)
      return update.emitOpError("does not finish the step (rt.finish_step)");
    std::optional<Region> loss = regionOf(finish.getLoss());
    if (!loss)
      return finish.emitOpError("hands on a loss that is not a placed buffer");

    // The loss's tail in the update: from rt.finish_step back, the
    // all-reduces of the loss, on a rank without it the fill that makes its
    // zero, and the adds and copies of the forward passes' sums that make it
    // (a rank's MoE losses summed by each of its chunks; the loss and a
    // metric of one value). Ops that only reach
    // other buffers are skipped; any other op on a buffer the loss is made
    // of ends the tail there, where the forward parts' sum is the loss. The
    // same code builds every rank's tail, so the ranks of a group take part
    // in the same reductions.
    SmallVector<Operation *> tail;
    DenseMap<Operation *, SmallVector<unsigned>> reducedOf; // which buffers
    SmallVector<Region> needed = {*loss};
    auto isNeeded = [&](Value v) {
      std::optional<Region> r = regionOf(v);
      return r && llvm::is_contained(needed, *r);
    };
    for (Operation *op = finish->getPrevNode(); op && !needed.empty();
         op = op->getPrevNode()) {
      if (isa<rt::BufferOp, rt::ViewOp>(op) ||
          llvm::none_of(needed,
                        [&](const Region &r) { return touches(op, r); }))
        continue;
      if (auto reduce = dyn_cast<rt::AllReduceOp>(op)) {
        for (auto [i, v] : llvm::enumerate(reduce.getBuffers()))
          if (isNeeded(v))
            reducedOf[op].push_back(i);
        if (!reducedOf.count(op))
          return reduce.emitOpError("reduces part of the loss's buffer with "
                                    "other values; the loss cannot be "
                                    "evaluated alone");
        tail.push_back(op);
        continue;
      }
      // An op that makes a buffer of the loss's: the tail takes it, and
      // what it reads outside the forward passes' sums is needed in turn.
      auto made = [&](Value out, ArrayRef<Value> inputs) {
        llvm::erase(needed, *regionOf(out));
        tail.push_back(op);
        for (Value in : inputs)
          if (std::optional<Region> r = regionOf(in);
              r && r->space != rt::Space::Accumulators)
            needed.push_back(*r);
      };
      if (auto fill = dyn_cast<rt::FillOp>(op);
          fill && isNeeded(fill.getOut())) {
        made(fill.getOut(), {});
        continue;
      }
      // The loss copied from a sum of the forward passes (the loss and a
      // metric of the same value, each in its own buffer).
      if (auto copy = dyn_cast<rt::CopyOp>(op);
          copy && isNeeded(copy.getOut())) {
        made(copy.getOut(), {copy.getX()});
        continue;
      }
      if (auto add = dyn_cast<rt::AddBroadcastOp>(op);
          add && isNeeded(add.getOut()) && add.getN() == add.getNb()) {
        made(add.getOut(), {add.getA(), add.getB()});
        continue;
      }
      break;
    }
    // What the tail reads and does not make must be the forward passes'
    // sums (the accumulators, or the loss's own buffer as they leave it);
    // anything else would be read stale by the evaluation.
    for (const Region &r : needed)
      if (r.space != rt::Space::Accumulators && !(r == *loss))
        return finish.emitOpError("makes its loss from a buffer that the "
                                  "evaluation step cannot trace to the "
                                  "forward passes");
    std::reverse(tail.begin(), tail.end());

    // The step without the backward parts and the update.
    OpBuilder b(step);
    b.setInsertionPointAfter(step);
    auto eval = cast<func::FuncOp>(b.clone(*step));
    eval.setSymName("eval_step");
    for (Operation &op : llvm::make_early_inc_range(eval.getBody().getOps())) {
      if (isa<rt::ParamOp>(op)) {
        if (!op.use_empty())
          return op.emitOpError("is read by the step itself");
        op.erase();
        continue;
      }
      if (auto call = dyn_cast<func::CallOp>(op);
          call && partOf(program, call) != "forward")
        call.erase();
    }
    // Then the loss's tail, each buffer of its own view.
    auto ret = cast<func::ReturnOp>(eval.getBody().front().getTerminator());
    b.setInsertionPoint(ret);
    auto bufferLike = [&](Value v) -> FailureOr<Value> {
      auto def = v.getDefiningOp<rt::BufferOp>();
      if (!def)
        return failure();
      return rt::BufferOp::create(b, def.getLoc(), def.getType(),
                                  def.getSpaceAttr(), def.getOffsetAttr())
          .getBuffer();
    };
    if (!finish.getLoss().getDefiningOp<rt::BufferOp>())
      return finish.emitOpError("hands on a view of the loss; expected its "
                                "buffer");
    for (Operation *op : tail) {
      if (auto reduce = dyn_cast<rt::AllReduceOp>(op)) {
        SmallVector<Value> reduced;
        for (unsigned i : reducedOf[op]) {
          FailureOr<Value> copy = bufferLike(reduce.getBuffers()[i]);
          if (failed(copy))
            return reduce.emitOpError("reduces a view of the loss");
          reduced.push_back(*copy);
        }
        rt::AllReduceOp::create(b, op->getLoc(), reduced, reduce.getAxesAttr());
        continue;
      }
      IRMapping map;
      for (Value v : op->getOperands()) {
        FailureOr<Value> copy = bufferLike(v);
        if (failed(copy))
          return op->emitOpError("makes the loss from a view");
        map.map(v, *copy);
      }
      b.clone(*op, map);
    }
    rt::FinishEvalOp::create(b, finish.getLoc(), *bufferLike(finish.getLoss()));
    return restoreSlicedCopies(eval, b);
  }

  // A bf16 copy's slot that the step's slices were cut from and copied
  // back into (tessel-hoist-parameter-slices) holds the pieces once they
  // are in: a training step's update makes the copy whole again, an
  // evaluation has none, so it puts the pieces back where they were cut
  // from. It does so once the loss is handed over: the slices' buffers may
  // share their places with the parts' (the loss's among them).
  LogicalResult restoreSlicedCopies(func::FuncOp eval, OpBuilder &b) {
    // The pieces of each slot, in the step's order (the slices' buffers of
    // one slot are apart; those of different slots may share places).
    llvm::MapVector<int64_t,
                    SmallVector<std::pair<rt::CopyOp, rt::SliceAxisOp>>>
        slots;
    for (auto copy : eval.getBody().getOps<rt::CopyOp>()) {
      std::optional<Region> into = regionOf(copy.getOut());
      if (!into || into->space != rt::Space::Shadow)
        continue;
      rt::SliceAxisOp cut;
      for (auto slice : eval.getBody().getOps<rt::SliceAxisOp>()) {
        std::optional<Region> from = regionOf(slice.getX());
        if (slice->isBeforeInBlock(copy) &&
            regionOf(slice.getOut()) == regionOf(copy.getX()) && from &&
            from->space == rt::Space::Shadow && from->begin <= into->begin &&
            into->end <= from->end)
          cut = slice;
      }
      if (!cut)
        return copy.emitOpError("writes the bf16 copy of the parameters "
                                "with no slice of it to put back after an "
                                "evaluation");
      slots[regionOf(cut.getX())->begin].push_back({copy, cut});
    }
    // A slot's pieces out of it first (they overlap where the slices take
    // them back to), then each one back in its place.
    for (auto &[begin, pieces] : slots) {
      for (auto [copy, slice] : pieces)
        rt::CopyOp::create(b, copy.getLoc(), copy.getOut(), copy.getX(),
                           copy.getNAttr());
      for (auto [copy, slice] : pieces)
        rt::InsertAxisOp::create(b, slice.getLoc(), slice.getOut(),
                                 slice.getX(), slice.getOuterAttr(),
                                 slice.getExtentAttr(), slice.getInnerAttr(),
                                 slice.getStartAttr(), slice.getLengthAttr());
    }
    return success();
  }
};

} // namespace
