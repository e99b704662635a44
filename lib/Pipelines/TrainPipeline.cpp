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
  if (options.gradientCheck)
    pm.addPass(createFloat64());
  pm.addPass(createAutodiff());
  pm.addPass(createPropagateSharding());
  pm.addPass(createPartition());
  BucketGradientsOptions bucketing;
  bucketing.bucketBytes = static_cast<int64_t>(options.bucketMB * (1 << 20));
  bucketing.overlap = options.overlapGradReduce;
  bucketing.lookupTablesAlone = options.zero >= 3;
  pm.addPass(createBucketGradients(bucketing));
  StageRegionsOptions stages;
  stages.recompute = options.recompute;
  stages.recomputeBlocks.assign(options.recomputeBlocks.begin(),
                                options.recomputeBlocks.end());
  pm.addPass(createStageRegions(stages));
  pm.addPass(createSchedulePipeline());
  pm.addPass(createConvertGraphToRt());
  bool fuse = options.fuseKernels.empty() ? options.target == "cuda"
                                          : options.fuseKernels == "true";
  if (fuse)
    pm.addPass(createFuseKernels());
  if (options.target == "cuda" && options.precision == "bf16")
    pm.addPass(createLowerPrecision());
  pm.addPass(createKeepLossStatistics());
  // ZeRO-3 gathers the parameters inside the parts: their slices stay there.
  if (options.zero < 3)
    pm.addPass(createHoistParameterSlices());
  if (options.overlapTpComm) {
    // At ZeRO 2 and 3 a weight gradient written later holds its staged run
    // longer: move no GEMM there, only the collectives.
    OverlapCollectivesOptions overlap;
    overlap.moveGemms = options.zero < 2;
    overlap.collectiveMatmul = options.collectiveMatmul;
    overlap.collectiveMatmulMinRows = options.collectiveMatmulMinRows;
    pm.addPass(createOverlapCollectives(overlap));
  }
  // ZeRO 2 and 3 stage each gradient run for its reduce-scatter: a GEMM
  // summing its product in the store would hold two runs' staging at once.
  PlanMemoryOptions planning;
  planning.fuseAccumulation = options.zero < 2;
  pm.addPass(createPlanMemory(planning));
  if (options.zero > 0) {
    ShardOptimizerOptions sharding;
    sharding.zero = options.zero;
    sharding.masterPieces = options.masterPieces;
    pm.addPass(createShardOptimizer(sharding));
  }
  pm.addPass(createJoinUpdates());
  // With microbatches the gradients are final only in the last backward;
  // ZeRO 2 and 3 reduce theirs in every backward already.
  if (options.overlapGradReduce && options.zero < 2)
    pm.addPass(createOverlapGradientSyncs());
  pm.addPass(createConvertPipeToRt());
  if (options.overlapParamGather && (options.zero == 1 || options.zero == 2) &&
      !options.gradientCheck)
    pm.addPass(createDeferParamGathers());
  if (!options.gradientCheck)
    pm.addPass(createEvalStep());
  OrderMessagesOptions messages;
  messages.target = options.target;
  pm.addPass(createOrderMessages(messages));
  pm.addPass(createSharePrograms());
  ConvertRtToEmitCOptions emission;
  emission.target = options.target;
  emission.cudaArch = options.cudaArch;
  emission.gradientCheck = options.gradientCheck;
  pm.addPass(createConvertRtToEmitC(emission));
}

const std::vector<tessel::PipelineStage> &tessel::trainPipelineStages() {
  static const std::vector<PipelineStage> stages = {
      {"tessel-autodiff", "01-train.mlir"},
      {"tessel-propagate-sharding", "02-sharded.mlir"},
      {"tessel-partition", "03-partitioned.mlir"},
      {"tessel-stage-regions", "04-stages.mlir"},
      {"convert-graph-to-rt", "05-rt.mlir"},
      {"tessel-plan-memory", "06-planned.mlir"},
      {"tessel-shard-optimizer", "06-planned.mlir"},
      {"tessel-join-updates", "06-planned.mlir"},
      {"tessel-overlap-gradient-syncs", "06-planned.mlir"},
      {"convert-pipe-to-rt", "07-programs.mlir"},
      {"tessel-eval-step", "07-programs.mlir"},
      {"tessel-order-messages", "07-programs.mlir"},
      {"tessel-share-programs", "08-shared.mlir"},
      {"convert-rt-to-emitc", "09-emitc.mlir"},
  };
  return stages;
}
void tessel::buildInferencePipeline(OpPassManager &pm,
                                    const TrainPipelineOptions &options) {
  SetLayoutOptions layout;
  layout.tp = options.tp;
  pm.addPass(createSetLayout(layout));
  pm.addPass(createPropagateSharding());
  pm.addPass(createPartition());
  pm.addPass(createConvertGraphToRt());
  pm.addPass(createPlanMemory());
  pm.addPass(createInferenceProgram());
  ConvertRtToEmitCOptions emission;
  emission.target = options.target;
  emission.cudaArch = options.cudaArch;
  pm.addPass(createConvertRtToEmitC(emission));
}

const std::vector<tessel::PipelineStage> &tessel::inferencePipelineStages() {
  static const std::vector<PipelineStage> stages = {
      {"tessel-propagate-sharding", "02-sharded.mlir"},
      {"tessel-partition", "03-partitioned.mlir"},
      {"convert-graph-to-rt", "05-rt.mlir"},
      {"tessel-plan-memory", "06-planned.mlir"},
      {"tessel-inference-program", "07-programs.mlir"},
      {"convert-rt-to-emitc", "09-emitc.mlir"},
  };
  return stages;
}

void tessel::registerTrainPipeline() {
  PassPipelineRegistration<TrainPipelineOptions>(
      "tessel-train-pipeline",
      "The whole training compile: from the forward graph (@forward) to the "
      "emitc module of each rank program",
      buildTrainPipeline);
  PassPipelineRegistration<TrainPipelineOptions>(
      "tessel-inference-pipeline",
      "The inference compile: from the inference step (@decode_step) to the "
      "emitc module of its rank program",
      buildInferencePipeline);
}
