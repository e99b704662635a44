//===- SchedulePipeline.cpp - The order each rank runs its parts in -------===//
//
// Materialises the layout's schedule as a pipe.schedule op in the module
// (every rank's forward and backward steps and its transfers), after
// simulating it: a schedule that would deadlock is a compile error. See
// Passes.td.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "tessel/Pipeline/Schedule.h"

namespace tessel {
#define GEN_PASS_DEF_SCHEDULEPIPELINE
#include "tessel/Transforms/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;

namespace {

struct SchedulePipelinePass
    : tessel::impl::SchedulePipelineBase<SchedulePipelinePass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    for (auto existing : llvm::make_early_inc_range(
             module.getOps<pipe::ScheduleOp>()))
      existing.erase();
    pipe::LayoutAttr layout = pipe::layoutOf(module);
    int64_t ranks = dist::meshOf(module)[MeshAxis::PP];
    // One rank has no pipeline: each microbatch's forward, then its
    // backward, whatever the schedule's name (one arena slot suffices).
    auto kind = ranks == 1 ? pipeline::ScheduleKind::OneFOneB
                           : pipeline::parseScheduleKind(layout.getSchedule());
    auto fail = [&](llvm::Error err) {
      module.emitError("tessel-schedule-pipeline: ")
          << llvm::toString(std::move(err));
      signalPassFailure();
    };
    if (!kind)
      return fail(kind.takeError());
    auto schedule = pipeline::generateSchedule(
        *kind, ranks, layout.getMicrobatches(),
        ranks == 1 ? 1 : layout.getVirtualStages());
    if (!schedule)
      return fail(schedule.takeError());
    if (auto timeline = pipeline::simulate(*schedule); !timeline)
      return fail(timeline.takeError());
    OpBuilder b = OpBuilder::atBlockBegin(module.getBody());
    pipeline::buildScheduleOp(b, module.getLoc(), *schedule);
  }
};

} // namespace
