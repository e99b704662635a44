//===- TrainPipeline.cpp - The registered training pipeline ---------------===//

#include "tessel/Pipelines/TrainPipeline.h"

#include "tessel/Conversion/Passes.h"
#include "tessel/Transforms/Passes.h"

#include "mlir/Pass/PassRegistry.h"

using namespace mlir;

void tessel::buildTrainPipeline(OpPassManager &pm,
                                const TrainPipelineOptions &options) {
  SetLayoutOptions layout;
  layout.dp = options.dp;
  layout.tp = options.tp;
  layout.pp = options.pp;
  layout.sp = options.sp;
  layout.microbatches = options.microbatches;
  layout.virtualStages = options.virtualStages;
  layout.schedule = options.schedule;
  pm.addPass(createSetLayout(layout));
  pm.addPass(createAutodiff());
  pm.addPass(createPropagateSharding());
  pm.addPass(createPartition());
  BucketGradientsOptions bucketing;
  bucketing.bucketBytes = static_cast<int64_t>(options.bucketMB * (1 << 20));
  if (options.legacy) {
    pm.addPass(createSplitStages());
    pm.addPass(createBucketGradients(bucketing));
    PlanBuffersOptions planning;
    // bf16 programs store activations in 2 bytes.
    planning.bf16Activations =
        options.target == "cuda" && options.precision == "bf16";
    pm.addPass(createPlanBuffers(planning));
    return;
  }
  pm.addPass(createBucketGradients(bucketing));
  pm.addPass(createStageRegions());
  pm.addPass(createSchedulePipeline());
  pm.addPass(createConvertGraphToRt());
  if (options.target == "cuda")
    pm.addPass(createFuseKernels());
  if (options.target == "cuda" && options.precision == "bf16")
    pm.addPass(createLowerPrecision());
  pm.addPass(createPlanMemory());
  pm.addPass(createConvertPipeToRt());
  if (options.target == "cuda")
    pm.addPass(createOrderMessages());
  ConvertRtToEmitCOptions emission;
  emission.target = options.target;
  emission.cudaArch = options.cudaArch;
  pm.addPass(createConvertRtToEmitC(emission));
}

const std::vector<tessel::PipelineStage> &
tessel::trainPipelineStages(bool legacy) {
  static const std::vector<PipelineStage> stages = {
      {"tessel-autodiff", "01-train.mlir"},
      {"tessel-propagate-sharding", "02-sharded.mlir"},
      {"tessel-partition", "03-partitioned.mlir"},
      {"tessel-stage-regions", "04-stages.mlir"},
      {"convert-graph-to-rt", "05-rt.mlir"},
      {"tessel-plan-memory", "06-planned.mlir"},
      {"convert-pipe-to-rt", "07-programs.mlir"},
      {"convert-rt-to-emitc", "08-emitc.mlir"},
  };
  static const std::vector<PipelineStage> legacyStages = {
      {"tessel-autodiff", "01-train.mlir"},
      {"tessel-propagate-sharding", "02-sharded.mlir"},
      {"tessel-partition", "03-partitioned.mlir"},
      {"tessel-split-stages", "04-stages.mlir"},
      {"tessel-plan-buffers", "05-planned.mlir"},
  };
  return legacy ? legacyStages : stages;
}
void tessel::registerTrainPipeline() {
  PassPipelineRegistration<TrainPipelineOptions>(
      "tessel-train-pipeline",
      "The whole training compile: from the forward graph (@forward) to the "
      "emitc module of each rank program",
      buildTrainPipeline);
}
