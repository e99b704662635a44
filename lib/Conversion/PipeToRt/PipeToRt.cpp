//===- PipeToRt.cpp - A rank's parts as functions called in schedule order ===//
//
// After buffer planning every part of a rank program refers only to its own
// ops, so each becomes a function of its own (taking the running microbatch
// and whether this is the part's first run in the step). The rank program
// becomes a module of its own (one distinct program: `program0`, or
// `stageN` per pipeline rank) whose `train_step` calls the parts in the
// order of the rank's schedule and then the update. With several
// microbatches the update's inputs are accumulated at the end of the part
// that produces them.
//
//===----------------------------------------------------------------------===//

#include "tessel/Conversion/PipeToRt.h"
#include "tessel/Conversion/Passes.h"

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Transforms/GreedyPatternRewriteDriver.h"

#include <map>
#include <set>

namespace tessel {
#define GEN_PASS_DEF_CONVERTPIPETORT
#include "tessel/Conversion/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;
namespace rt = tessel::rtir;

std::string tessel::programName(int64_t pipelineRank, int64_t pipelineRanks) {
  return pipelineRanks == 1 ? "program0"
                            : "stage" + std::to_string(pipelineRank);
}

namespace {

// The name of a part's function.
std::string partName(Operation *part) {
  if (auto f = dyn_cast<pipe::ForwardPassOp>(part))
    return "forward" + std::to_string(f.getChunk());
  if (auto b = dyn_cast<pipe::BackwardPassOp>(part))
    return "backward" + std::to_string(b.getChunk()) +
           (b->hasAttr("pipe.last_microbatch") ? "_last" : "");
  return "update";
}

struct RankProgramLowering : OpRewritePattern<func::FuncOp> {
  using OpRewritePattern::OpRewritePattern;

  LogicalResult matchAndRewrite(func::FuncOp step,
                                PatternRewriter &b) const override {
    auto rankAttr = step->getAttrOfType<IntegerAttr>("pipe.rank");
    auto outer = dyn_cast<ModuleOp>(step->getParentOp());
    if (!rankAttr || !outer || outer->hasAttr("pipe.rank"))
      return failure();
    int64_t rank = rankAttr.getInt();
    pipe::ScheduleOp schedule;
    for (auto s : outer.getOps<pipe::ScheduleOp>())
      schedule = s;
    if (!schedule)
      return step.emitOpError("needs the module's pipe.schedule (run "
                              "tessel-schedule-pipeline)");
    pipe::RankOp steps;
    for (auto r : schedule.getBody().getOps<pipe::RankOp>())
      if ((int64_t)r.getRank() == rank)
        steps = r;
    if (!steps)
      return step.emitOpError("has no steps in the schedule");
    MeshLayout layout = pipe::pipelineLayout(schedule.getRanks(),
                                             schedule.getVirtualStages());
    Location loc = step.getLoc();

    // The program: a module of its own.
    b.setInsertionPoint(step);
    auto program = ModuleOp::create(
        b, loc, programName(rank, schedule.getRanks()));
    program->setAttr("pipe.rank", rankAttr);
    for (StringRef name : {"rt.param_elems",         "rt.arena_bytes",
                           "rt.accumulator_elems",   "rt.norm_sums",
                           "rt.request_slots",       "rt.received_bytes",
                           "rt.transient_bytes",     "rt.optimizer_elems",
                           "rt.grad_elems",          "rt.grad_staging_elems",
                           "rt.grad_piece_elems",    "rt.grad_scratch_elems",
                           "rt.grad_whole_elems",    "rt.param_store_elems",
                           "rt.param_piece_elems",   "rt.param_gather_elems",
                           "rt.master_copies",       "rt.shadow_extra_elems",
                           "rt.chunk_arena_offsets", "rt.chunk_arena_total",
                           "rt.chunks_in_flight"})
      if (Attribute attr = step->getAttr(name))
        program->setAttr(name, attr);
    program->setAttr("rt.arena_slots",
                     b.getI64IntegerAttr(
                         pipe::activationSlots(steps, schedule.getMicrobatches())));
    program->setAttr("rt.microbatches",
                     b.getI64IntegerAttr(schedule.getMicrobatches()));

    // Each part becomes a function (microbatch, first run).
    auto partType = b.getFunctionType({b.getI64Type(), b.getI1Type()}, {});
    pipe::UpdateOp update;
    DenseMap<Operation *, func::FuncOp> partFuncs;
    SmallVector<Operation *> parts;
    for (Operation &op : step.getBody().front())
      if (isa<pipe::ForwardPassOp, pipe::BackwardPassOp, pipe::UpdateOp>(op))
        parts.push_back(&op);
    for (Operation *op : parts)
      if (auto u = dyn_cast<pipe::UpdateOp>(op))
        update = u;

    b.setInsertionPointToEnd(program.getBody());
    auto trainStep = func::FuncOp::create(b, loc, "train_step",
                                          b.getFunctionType({}, {}));
    for (Operation *part : parts) {
      auto fn = func::FuncOp::create(b, loc, partName(part), partType);
      fn.setPrivate();
      fn->setAttr("rt.part", b.getStringAttr(isa<pipe::UpdateOp>(part)
                                                 ? "update"
                                             : isa<pipe::ForwardPassOp>(part)
                                                 ? "forward"
                                                 : "backward"));
      if (auto f = dyn_cast<pipe::ForwardPassOp>(part))
        fn->setAttr("rt.part_chunk", b.getI64IntegerAttr(f.getChunk()));
      else if (auto bp = dyn_cast<pipe::BackwardPassOp>(part))
        fn->setAttr("rt.part_chunk", b.getI64IntegerAttr(bp.getChunk()));
      Block *body = &part->getRegion(0).front();
      fn.getBody().push_back(body->getParent()->getBlocks().remove(body));
      // The update's block arguments are unused once planned.
      while (body->getNumArguments())
        body->eraseArgument(0);
      Value mb = body->addArgument(b.getI64Type(), loc);
      Value first = body->addArgument(b.getI1Type(), loc);
      SmallVector<rt::MicrobatchOp> indices;
      fn.walk([&](rt::MicrobatchOp m) { indices.push_back(m); });
      for (rt::MicrobatchOp m : indices) {
        m.getResult().replaceAllUsesWith(mb);
        m.erase();
      }
      // Constants the part reads (hoisted out of it by a canonicalization)
      // are its own again.
      DenseMap<Operation *, Value> ownConstants;
      fn.walk([&](Operation *op) {
        for (OpOperand &use : op->getOpOperands()) {
          auto c = use.get().getDefiningOp<arith::ConstantOp>();
          if (!c || fn->isAncestor(c))
            continue;
          Value &own = ownConstants[c];
          if (!own) {
            OpBuilder cb = OpBuilder::atBlockBegin(body);
            own = cb.clone(*c)->getResult(0);
          }
          use.set(own);
        }
      });
      SmallVector<rt::FirstRunOp> firsts;
      fn.walk([&](rt::FirstRunOp f) { firsts.push_back(f); });
      for (rt::FirstRunOp f : firsts) {
        f.getResult().replaceAllUsesWith(first);
        f.erase();
      }
      auto yield = cast<pipe::YieldOp>(body->getTerminator());
      OpBuilder end(yield);
      if (update && part == update.getOperation()) {
        // A send of the update (a tied weight's gradient to the first
        // stage) goes out at once: the stages' collectives after it (the
        // norm's sums over pp) wait for the rank that receives it, and a
        // runtime that queues sends to keep their order (CUDA's) would
        // otherwise hold it until the step's end.
        SmallVector<rt::SendOp> updateSends;
        fn.walk([&](rt::SendOp send) { updateSends.push_back(send); });
        for (rt::SendOp send : updateSends) {
          OpBuilder after(send->getBlock(), ++Block::iterator(send));
          rt::FlushSendsOp::create(after, send.getLoc());
        }
        rt::FinishStepOp::create(end, loc, yield.getValues()[0],
                                 yield.getValues()[1]);
        // Then the metrics, by the names the step gives them.
        // (StageRegions yields one value per name.)
        if (auto names = step->getAttrOfType<ArrayAttr>("graph.metrics"))
          for (auto [value, name] :
               llvm::zip(yield.getValues().drop_front(2), names.getValue()))
            rt::RecordMetricOp::create(end, loc, value,
                                       cast<StringAttr>(name));
      } else {
        bool sends = false;
        fn.walk([&](rt::SendOp) { sends = true; });
        if (sends)
          rt::FlushSendsOp::create(end, loc);
      }
      func::ReturnOp::create(end, loc);
      yield.erase();
      partFuncs[part] = fn;
    }

    // The step: the parameters and what is exchanged once per step (a
    // parameter sent to or received from another rank), then the parts in
    // schedule order.
    Block *stepBody = trainStep.addEntryBlock();
    OpBuilder sb = OpBuilder::atBlockEnd(stepBody);
    auto constant = [&](int64_t v, Type type) {
      return arith::ConstantOp::create(sb, loc, type,
                                       IntegerAttr::get(type, v));
    };
    bool stepSends = false;
    for (Operation &op :
         llvm::make_early_inc_range(step.getBody().front().without_terminator())) {
      if (llvm::is_contained(parts, &op))
        continue;
      if (auto m = dyn_cast<rt::MicrobatchOp>(op)) {
        m.getResult().replaceAllUsesWith(constant(0, sb.getI64Type()));
        m.erase();
        continue;
      }
      stepSends |= isa<rt::SendOp>(op);
      op.moveBefore(stepBody, stepBody->end());
    }
    if (stepSends)
      rt::FlushSendsOp::create(sb, loc);
    // How often the step calls each part (rt.part_calls).
    DenseMap<Operation *, int64_t> calls;
    auto call = [&](func::FuncOp fn, int64_t mb, bool first) {
      func::CallOp::create(sb, loc, fn,
                           ValueRange{constant(mb, sb.getI64Type()),
                                      constant(first, sb.getI1Type())});
      ++calls[fn];
    };
    std::set<std::pair<bool, int64_t>> done;
    // A chunk's backward part for its last microbatch only
    // (pipe.last_microbatch, tessel-overlap-gradient-syncs): that
    // microbatch, the chunk's last backward step on this rank.
    std::map<int64_t, int64_t> lastBackward; // chunk -> microbatch
    for (Operation &s : steps.getBody().front())
      if (auto bwd = dyn_cast<pipe::BackwardOp>(s))
        lastBackward[layout.stageChunk(bwd.getStage())] = bwd.getMicrobatch();
    for (Operation &s : steps.getBody().front()) {
      auto fwd = dyn_cast<pipe::ForwardOp>(s);
      auto bwd = dyn_cast<pipe::BackwardOp>(s);
      if (!fwd && !bwd)
        continue;
      int64_t stage = fwd ? fwd.getStage() : bwd.getStage();
      int64_t mb = fwd ? fwd.getMicrobatch() : bwd.getMicrobatch();
      int64_t chunk = layout.stageChunk(stage);
      Operation *part = nullptr, *lastPart = nullptr;
      for (Operation *p : parts) {
        if (fwd)
          if (auto f = dyn_cast<pipe::ForwardPassOp>(p);
              f && (int64_t)f.getChunk() == chunk)
            part = p;
        if (bwd)
          if (auto bp = dyn_cast<pipe::BackwardPassOp>(p);
              bp && (int64_t)bp.getChunk() == chunk)
            (bp->hasAttr("pipe.last_microbatch") ? lastPart : part) = p;
      }
      if (lastPart && lastBackward[chunk] == mb)
        part = lastPart;
      if (!part)
        continue; // a chunk with no ops on this rank
      bool first = done.insert({bool(bwd), chunk}).second;
      call(partFuncs[part], mb, first);
    }
    // Every send of the step, the update's included, has completed at its
    // end (both runtimes send from copies, so the update may overwrite what
    // was sent). The send orders count on through the update's sends.
    if (update)
      call(partFuncs[update.getOperation()], 0, true);
    bool sends = false;
    program.walk([&](rt::SendOp) { sends = true; });
    if (sends)
      rt::WaitSendsOp::create(sb, loc);
    for (auto &[part, fn] : partFuncs)
      fn->setAttr("rt.part_calls", b.getI64IntegerAttr(calls.lookup(fn)));
    func::ReturnOp::create(sb, loc);
    b.eraseOp(step);
    return success();
  }
};

struct ConvertPipeToRtPass
    : tessel::impl::ConvertPipeToRtBase<ConvertPipeToRtPass> {
  void runOnOperation() override {
    RewritePatternSet patterns(&getContext());
    populatePipeToRtPatterns(patterns);
    if (failed(applyPatternsGreedily(getOperation(), std::move(patterns))))
      signalPassFailure();
    bool left = false;
    getOperation().walk([&](func::FuncOp func) {
      if (func->hasAttr("pipe.rank"))
        left = true;
    });
    getOperation().walk([&](Operation *op) {
      if (isa<pipe::ForwardPassOp, pipe::BackwardPassOp, pipe::UpdateOp>(op))
        left = true;
    });
    if (left) {
      getOperation().emitError("convert-pipe-to-rt: a rank program could not "
                               "be lowered");
      signalPassFailure();
    }
  }
};

} // namespace

void tessel::populatePipeToRtPatterns(RewritePatternSet &patterns) {
  patterns.add<RankProgramLowering>(patterns.getContext());
}
