//===- tessel-schedule.cpp - Generate and check pipeline schedules --------===//
//
// tessel-schedule --pp 4 --microbatches 8 --schedule 1f1b [--virtual-stages 2]
//                 [--svg out.svg]
//   prints the schedule as pipe IR, its text timeline and bubble fraction.
// tessel-schedule --check schedule.mlir
//   verifies every pipe.schedule of a file and simulates it.
// tessel-schedule --pp 4 --layer-costs 1,2,2,1,... [--stage-layers "0,1;2;..."]
//   prints the stage of each layer (balanced, or the user's lists checked).
//
// Exits 1 with the reason for an invalid or deadlocking schedule.
//===----------------------------------------------------------------------===//

#include "dialects/Pipe/PipeOps.h"
#include "tessel/Pipeline/Schedule.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/IR/Verifier.h"
#include "mlir/Parser/Parser.h"
#include "mlir/Support/FileUtilities.h"
#include "llvm/Support/CommandLine.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/InitLLVM.h"
#include "llvm/Support/SourceMgr.h"
#include "llvm/Support/raw_ostream.h"

using namespace llvm;
using namespace tessel;
using namespace tessel::pipeline;

static cl::OptionCategory category("tessel-schedule options");
static cl::opt<int> pp("pp", cl::desc("Pipeline ranks"), cl::init(1),
                       cl::cat(category));
static cl::opt<int> microbatches("microbatches", cl::desc("Microbatches"),
                                 cl::init(1), cl::cat(category));
static cl::opt<std::string> scheduleName("schedule",
                                         cl::desc("gpipe, 1f1b or interleaved"),
                                         cl::init("1f1b"), cl::cat(category));
static cl::opt<int>
    virtualStages("virtual-stages",
                  cl::desc("Model chunks per rank (interleaved)"), cl::init(1),
                  cl::cat(category));
static cl::opt<std::string> svgPath("svg",
                                    cl::desc("Write the timeline as SVG"),
                                    cl::value_desc("file"), cl::cat(category));
static cl::opt<std::string>
    checkPath("check",
              cl::desc("Verify and simulate the pipe.schedule ops of "
                       "an MLIR file ('-' for stdin)"),
              cl::value_desc("file"), cl::cat(category));
static cl::list<double>
    layerCosts("layer-costs", cl::CommaSeparated,
               cl::desc("Cost of each layer: print the balanced stage of each"),
               cl::cat(category));
static cl::opt<std::string>
    stageLayers("stage-layers",
                cl::desc("The layers of each stage, e.g. \"0,1;2,3\" (with "
                         "--layer-costs: checked instead of balanced)"),
                cl::cat(category));

static int fail(const Twine &message) {
  errs() << "tessel-schedule: error: " << message << "\n";
  return 1;
}

static int fail(Error err) { return fail(toString(std::move(err))); }

// Prints the IR, the text timeline and the bubble; writes the SVG if asked.
static int report(const Schedule &schedule, const Timeline &timeline) {
  outs() << textTimeline(schedule, timeline);
  if (!svgPath.empty()) {
    std::error_code ec;
    raw_fd_ostream svg(svgPath, ec);
    if (ec)
      return fail("cannot write " + svgPath + ": " + ec.message());
    svg << scheduleSvg(schedule, timeline);
  }
  return 0;
}

static int checkFile(mlir::MLIRContext &context) {
  auto file = mlir::openInputFile(checkPath);
  if (!file)
    return fail("cannot read " + checkPath);
  SourceMgr sourceMgr;
  sourceMgr.AddNewSourceBuffer(std::move(file), SMLoc());
  mlir::SourceMgrDiagnosticHandler handler(sourceMgr, &context);
  mlir::OwningOpRef<mlir::ModuleOp> module =
      mlir::parseSourceFile<mlir::ModuleOp>(sourceMgr, &context);
  if (!module)
    return 1;
  int status = 0, count = 0;
  module->walk([&](pipe::ScheduleOp op) {
    ++count;
    Schedule schedule = scheduleFromOp(op);
    Expected<Timeline> timeline = simulate(schedule);
    if (!timeline) {
      op.emitError(toString(timeline.takeError()));
      status = 1;
      return;
    }
    outs() << "schedule " << count << " is valid\n";
    if (report(schedule, *timeline))
      status = 1;
  });
  if (count == 0)
    return fail(checkPath + " has no pipe.schedule");
  return status;
}

static int assignStages() {
  std::vector<double> costs(layerCosts.begin(), layerCosts.end());
  Expected<std::vector<int>> stageOf = std::vector<int>{};
  if (stageLayers.empty()) {
    stageOf = balanceStages(costs, pp);
  } else {
    std::vector<std::vector<int>> lists;
    SmallVector<StringRef> stageTexts;
    StringRef(stageLayers).split(stageTexts, ';');
    for (StringRef text : stageTexts) {
      lists.emplace_back();
      SmallVector<StringRef> layerTexts;
      text.split(layerTexts, ',', -1, /*KeepEmpty=*/false);
      for (StringRef layer : layerTexts) {
        int index;
        if (layer.trim().getAsInteger(10, index))
          return fail("--stage-layers: \"" + layer + "\" is not a layer index");
        lists.back().push_back(index);
      }
    }
    stageOf = stagesFromLayerLists(lists, costs.size(), pp);
  }
  if (!stageOf)
    return fail(stageOf.takeError());
  std::vector<double> stageCost(pp, 0);
  std::vector<std::vector<int>> members(pp);
  for (auto [layer, stage] : enumerate(*stageOf)) {
    stageCost[stage] += costs[layer];
    members[stage].push_back(layer);
  }
  for (int s = 0; s < pp; ++s)
    outs() << "stage " << s << ": layers " << members[s].front() << ".."
           << members[s].back() << ", cost " << format("%g", stageCost[s])
           << "\n";
  return 0;
}

int main(int argc, char **argv) {
  InitLLVM init(argc, argv);
  cl::HideUnrelatedOptions(category);
  cl::ParseCommandLineOptions(argc, argv,
                              "Generate, check and draw pipeline schedules\n");
  mlir::MLIRContext context;
  context.loadDialect<pipe::PipeDialect>();
  context.printOpOnDiagnostic(false);
  if (!checkPath.empty())
    return checkFile(context);
  if (!layerCosts.empty())
    return assignStages();
  if (!stageLayers.empty())
    return fail("--stage-layers needs --layer-costs");

  Expected<ScheduleKind> kind = parseScheduleKind(scheduleName);
  if (!kind)
    return fail(kind.takeError());
  Expected<Schedule> schedule =
      generateSchedule(*kind, pp, microbatches, virtualStages);
  if (!schedule)
    return fail(schedule.takeError());
  Expected<Timeline> timeline = simulate(*schedule);
  if (!timeline)
    return fail(timeline.takeError());

  mlir::OpBuilder builder(&context);
  mlir::OwningOpRef<mlir::ModuleOp> module =
      mlir::ModuleOp::create(builder.getUnknownLoc());
  builder.setInsertionPointToEnd(module->getBody());
  buildScheduleOp(builder, builder.getUnknownLoc(), *schedule);
  if (failed(mlir::verify(*module)))
    return fail("the generated schedule does not verify");
  module->print(outs());
  return report(*schedule, *timeline);
}
