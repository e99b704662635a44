//===- TrainPipeline.h - The registered training pipeline -------*- C++ -*-===//
//
// `tessel-opt --tessel-train-pipeline="tp=2 pp=2 ..."` and `tessel compile`
// run the same passes, built here: from the forward graph to the emitc
// module of each rank program's source.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_PIPELINES_TRAINPIPELINE_H
#define TESSEL_PIPELINES_TRAINPIPELINE_H

#include "mlir/Pass/PassManager.h"
#include "mlir/Pass/PassOptions.h"

#include <string>
#include <vector>

namespace tessel {

struct TrainPipelineOptions
    : public mlir::PassPipelineOptions<TrainPipelineOptions> {
  // The layout (tessel-set-layout): 0 or empty keeps the module's.
  Option<int64_t> dp{*this, "dp", llvm::cl::desc("Data-parallel degree"),
                     llvm::cl::init(0)};
  Option<int64_t> tp{*this, "tp", llvm::cl::desc("Tensor-parallel degree"),
                     llvm::cl::init(0)};
  Option<int64_t> pp{*this, "pp", llvm::cl::desc("Pipeline ranks"),
                     llvm::cl::init(0)};
  Option<std::string> sp{*this, "sp",
                         llvm::cl::desc("Sequence parallelism: true or false"),
                         llvm::cl::init("")};
  Option<int64_t> microbatches{
      *this, "microbatches",
      llvm::cl::desc("Microbatches per step (must match the graph)"),
      llvm::cl::init(0)};
  Option<int64_t> virtualStages{
      *this, "virtual-stages",
      llvm::cl::desc("Model chunks per pipeline rank"), llvm::cl::init(0)};
  Option<std::string> schedule{
      *this, "schedule",
      llvm::cl::desc("Pipeline schedule: gpipe, 1f1b, interleaved"),
      llvm::cl::init("")};
  // Communication and the target.
  Option<double> bucketMB{*this, "bucket-mb",
                          llvm::cl::desc("Gradient all-reduce bucket (MiB)"),
                          llvm::cl::init(25.0)};
  Option<bool> overlapGradReduce{
      *this, "overlap-grad-reduce",
      llvm::cl::desc("Start gradient buckets during backward (false: reduce "
                     "them after it)"),
      llvm::cl::init(true)};
  Option<bool> overlapParamGather{
      *this, "overlap-param-gather",
      llvm::cl::desc("ZeRO 1 and 2: gather the updated parameters at the "
                     "next step's start, under its forward "
                     "(tessel-defer-param-gathers)"),
      llvm::cl::init(true)};
  Option<bool> overlapTpComm{
      *this, "overlap-tp-comm",
      llvm::cl::desc("Start tensor-parallel collectives early and wait for "
                     "them late, under the GEMMs around them "
                     "(tessel-overlap-collectives)"),
      llvm::cl::init(true)};
  Option<bool> collectiveMatmul{
      *this, "collective-matmul",
      llvm::cl::desc("Gather a sequence-parallel input piece by piece under "
                     "the GEMMs that read it (with overlap-tp-comm)"),
      llvm::cl::init(true)};
  Option<int64_t> collectiveMatmulMinRows{
      *this, "collective-matmul-min-rows",
      llvm::cl::desc("The least rows per piece for a collective matmul"),
      llvm::cl::init(512)};
  Option<int64_t> zero{
      *this, "zero",
      llvm::cl::desc("ZeRO level over dp: 0 (replicated optimizer), 1 "
                     "(AdamW moments sharded), 2 (gradients too) or 3 "
                     "(parameters too)"),
      llvm::cl::init(0)};
  Option<bool> masterPieces{
      *this, "master-pieces",
      llvm::cl::desc("With zero 1 or 2 in bf16, keep the fp32 master weights "
                     "of what only matmuls read as dp pieces"),
      llvm::cl::init(true)};
  Option<std::string> recompute{
      *this, "recompute",
      llvm::cl::desc("Activation recomputation: none, selective or full"),
      llvm::cl::init("none")};
  ListOption<int64_t> recomputeBlocks{
      *this, "recompute-blocks",
      llvm::cl::desc("The blocks full recompute applies to (default: all)")};
  Option<std::string> target{*this, "target",
                             llvm::cl::desc("cpu or cuda"),
                             llvm::cl::init("cpu")};
  Option<std::string> precision{
      *this, "precision",
      llvm::cl::desc("fp32 or bf16 (bf16 only on the cuda target)"),
      llvm::cl::init("fp32")};
  Option<std::string> fuseKernels{
      *this, "fuse-kernels",
      llvm::cl::desc("Join kernels that run back to back into one call "
                     "(tessel-fuse-kernels): true or false; empty: on the "
                     "cuda target only"),
      llvm::cl::init("")};
  Option<int> cudaArch{*this, "cuda-arch",
                       llvm::cl::desc("GPU architecture (sm_N) of CUDA code"),
                       llvm::cl::init(90)};
  Option<bool> gradientCheck{
      *this, "gradient-check",
      llvm::cl::desc("A float64 program that checks the step's gradients "
                     "against finite differences instead of training"),
      llvm::cl::init(false)};
};

void buildTrainPipeline(mlir::OpPassManager &pm,
                        const TrainPipelineOptions &options);

// The IR worth keeping after a pass: `ir/<file>` is written after the pass
// whose argument is `pass`.
struct PipelineStage {
  const char *pass;
  const char *file;
};
// In pipeline order; the graph itself is 00-graph.mlir.
const std::vector<PipelineStage> &trainPipelineStages();

// The inference compile (`tessel compile --inference`): from the inference
// step (@decode_step, buildInferenceModel) to the emitc module of its rank
// program. Of the options it reads the layout's tp and the target.
void buildInferencePipeline(mlir::OpPassManager &pm,
                            const TrainPipelineOptions &options);
const std::vector<PipelineStage> &inferencePipelineStages();

// Registers tessel-train-pipeline and tessel-inference-pipeline.
void registerTrainPipeline();

} // namespace tessel

#endif // TESSEL_PIPELINES_TRAINPIPELINE_H
