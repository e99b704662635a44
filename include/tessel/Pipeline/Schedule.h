//===- Schedule.h - Pipeline stage assignment and schedules -----*- C++ -*-===//
//
// Plain C++ model of a pipeline-parallel schedule: which layers form each
// stage, the ordered steps of every rank (GPipe, 1F1B, interleaved 1F1B as
// in Megatron-LM), a simulation that finds deadlocks and measures the bubble,
// and conversions to and from the pipe dialect.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_PIPELINE_SCHEDULE_H
#define TESSEL_PIPELINE_SCHEDULE_H

#include "mlir/IR/Builders.h"
#include "llvm/Support/Error.h"

#include <string>
#include <vector>

namespace tessel::pipe {
class ScheduleOp;
} // namespace tessel::pipe

namespace tessel::pipeline {

//===--- Stage assignment -------------------------------------------------===//

// The stage of each layer: contiguous runs of layers, every stage non-empty,
// minimising the cost of the most expensive stage.
llvm::Expected<std::vector<int>>
balanceStages(const std::vector<double> &layerCost, int stages);

// The stage of each layer from a user's `stage_layers` list (the layers of
// each stage), after checking that it names every layer exactly once, in
// order and contiguously, and has `stages` entries.
llvm::Expected<std::vector<int>>
stagesFromLayerLists(const std::vector<std::vector<int>> &stageLayers,
                     int numLayers, int stages);

//===--- Schedules --------------------------------------------------------===//

enum class ScheduleKind { GPipe, OneFOneB, Interleaved };
llvm::StringRef scheduleKindName(ScheduleKind kind);
llvm::Expected<ScheduleKind> parseScheduleKind(llvm::StringRef name);

enum class StepKind { Forward, Backward, Send, Recv };
enum class Payload { Activation, Gradient };

struct Step {
  StepKind kind;
  int stage;
  int microbatch;
  // Send and Recv: what moves and the rank it goes to or comes from.
  Payload payload = Payload::Activation;
  int peer = -1;

  bool isCompute() const {
    return kind == StepKind::Forward || kind == StepKind::Backward;
  }
};
std::string describeStep(const Step &step);

struct Schedule {
  ScheduleKind kind;
  int ranks;
  int microbatches;
  int virtualStages;
  // The steps of each rank, in order.
  std::vector<std::vector<Step>> steps;

  int numStages() const { return ranks * virtualStages; }
};

// The schedule of `kind` for `ranks` pipeline ranks, `microbatches`
// microbatches and `virtualStages` model chunks per rank (> 1 only for the
// interleaved schedule, which also needs microbatches % ranks == 0).
llvm::Expected<Schedule> generateSchedule(ScheduleKind kind, int ranks,
                                          int microbatches,
                                          int virtualStages = 1);

//===--- Simulation -------------------------------------------------------===//

struct StepTime {
  int step; // index into the rank's steps
  double start, end;
};

struct Timeline {
  // Per rank, the compute steps with their times.
  std::vector<std::vector<StepTime>> ranks;
  double makespan = 0;
  std::vector<double> busy; // per rank
  // Idle time over the makespan, per rank and over all ranks.
  std::vector<double> rankBubble;
  double bubble = 0;
};

struct Costs {
  double forward = 1;
  double backward = 2;
};

// Runs every rank's steps: a send is buffered and takes no time, a receive
// waits for its matching send, a forward or backward takes its cost. Fails
// when sends and receives do not match one to one, or when some ranks can no
// longer progress (naming each stuck rank and the step it waits at).
llvm::Expected<Timeline> simulate(const Schedule &schedule,
                                  const Costs &costs = {});

// One line per rank, one cell per time unit (forward "F<mb>", backward
// "B<mb>" over two cells, idle "."), plus the bubble fractions.
std::string textTimeline(const Schedule &schedule, const Timeline &timeline);
// The same timeline as an SVG drawing.
std::string scheduleSvg(const Schedule &schedule, const Timeline &timeline);

//===--- The pipe dialect -------------------------------------------------===//

pipe::ScheduleOp buildScheduleOp(mlir::OpBuilder &builder, mlir::Location loc,
                                 const Schedule &schedule);
// The schedule a verified pipe.schedule op describes.
Schedule scheduleFromOp(pipe::ScheduleOp op);

} // namespace tessel::pipeline

#endif // TESSEL_PIPELINE_SCHEDULE_H
