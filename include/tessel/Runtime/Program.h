//===- Program.h - What a generated rank program hands the runtime -*- C++
//-*-===//
//
// A generated program is a statically scheduled training step plus a
// description of its parameters and recipe. It fills a `Program` and calls
// `runMain`, which owns everything around the step: argument parsing,
// parameter initialisation or loading, the data loader, the learning-rate
// schedule, metrics, and saving weights.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_RUNTIME_PROGRAM_H
#define TESSEL_RUNTIME_PROGRAM_H

#include "tessel/Support/MeshLayout.h"

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace tessel::rt {

enum class InitKind : int { Normal = 0, Zeros = 1, Ones = 2 };

// One trainable parameter. Its values live at params + offset (elements),
// its gradient at grads + offset, its AdamW moments at m/v + offset.
struct ParamInfo {
  const char *name; // Hugging Face tensor name, e.g. "h.0.attn.c_attn.weight"
  int rank;
  int64_t shape[4];
  int64_t numel;
  int64_t offset;
  InitKind init;
  float initMean, initStd;
  bool weightDecay; // AdamW decays parameters of rank >= 2 only
  // Sharding. `shape` is the global (checkpoint) shape; `numel` and the
  // storage at `offset` are this rank's shard. With shardDim >= 0, global
  // dimension shardDim is cut into shardBlocks equal blocks and each block
  // into meshSize(shardAxis) equal pieces; the shard is the concatenation,
  // in block order, of the pieces at this rank's coordinate along shardAxis.
  // (Blocks keep a fused [q|k|v] projection's pieces together per rank.)
  int shardDim; // -1: replicated
  MeshAxis shardAxis;
  int shardBlocks;
  // AdamW's moments. With the optimizer sharded over dp (parallel.zero 1,
  // Program::optimizerElems > 0), the parameter lies at `stateRunOffset`
  // in a run of the gradient store cut into `statePiece`-element pieces in
  // dp order; data-parallel rank k holds the moments of the part of the
  // parameter inside piece k, at m/v + stateOffset + (element's place in
  // the run - k * statePiece). statePiece 0: the moments are whole, at
  // stateOffset (without sharding, stateOffset is `offset`).
  int64_t stateOffset;
  int64_t stateRunOffset;
  int64_t statePiece;
  // Its values in the step's parameter store. With the parameters sharded
  // (parallel.zero 3, Program::paramStoreElems > 0) and valuePiece > 0,
  // data-parallel rank k holds the part inside piece k, laid out as the
  // moments are but from valueOffset; valuePiece 0: whole, at valueOffset.
  // Without sharding the store is laid out by `offset`.
  int64_t valueOffset;
  int64_t valuePiece;
  // The axes (AxisSet bits) the pieces of its run are cut over, when not
  // the mesh's shard group (0): dp x ep for a dense parameter under expert
  // parallelism. Rank k of the group holds piece k.
  unsigned stateAxes;
  // A second cut, along a later dimension (0: none) over another mesh axis:
  // an expert's width over tp when the experts are split over ep.
  int secondShardDim;
  MeshAxis secondShardAxis;
};

enum class LrDecay : int { Constant = 0, Linear = 1, Cosine = 2 };

struct TrainConfig {
  int64_t batch;  // sequences per step on this rank (global / dp)
  int64_t seqLen; // tokens per sequence
  int64_t vocab;  // token ids must be < vocab
  // Rows of the embedding (and the logits' width): the vocabulary padded to
  // model.vocab_pad_to_multiple; 0 or vocab when it is not padded.
  int64_t paddedVocab;
  int64_t steps;  // default run length and schedule horizon
  uint64_t seed;  // parameter initialisation seed
  float gradClip; // max global gradient norm; <= 0 disables clipping
  float lr, beta1, beta2, eps, weightDecay;
  int64_t warmupSteps;
  LrDecay decay;
  float minLr;
  // Shuffled sampling (data.shuffle, data.seed; TokenData::shuffle).
  bool dataShuffle;
  uint64_t dataSeed;
  // Model FLOPs per trained token (forward and backward; docs/metrics.md),
  // for MFU; 0 when unknown.
  double flopsPerToken;
  // Validation loss every evalEvery steps and at the end (0: never), as the
  // mean over the first evalBatches global batches of the validation data.
  int64_t evalEvery;
  int64_t evalBatches;
  // > 0: each sequence is held in the balanced order of this many pieces
  // (parallel.cp_layout = "balanced", Sequence.h), so context-parallel
  // rank c reads chunks c and 2 pieces - 1 - c of every row.
  int64_t sequencePieces;
};

// One of the step's observations besides the loss and the norm (an MoE
// layer's assignments per expert, the load-balancing loss; docs/metrics.md),
// recorded by the step (recordMetric) once it has finished.
struct StepMetric {
  std::string name;
  std::vector<double> values;
};

// What the step function reads and writes. All pointers are owned by the
// runtime; `activations` is the statically planned arena of the step.
struct StepContext {
  float *params;
  float *grads;
  float *adamM;
  float *adamV;
  const int32_t *tokens;  // [batch, seqLen]
  const int32_t *targets; // [batch, seqLen]
  char *activations;
  int64_t step; // 0-based index of this step
  // The updates applied before this step: `step` less the steps skipped
  // for a gradient that was not finite (--skip-nonfinite). AdamW's bias
  // correction counts updates + 1.
  int64_t updates;
  float lr;     // learning rate for this step (set by the runtime)
  // Written by the step:
  float loss;
  float gradNorm; // global gradient norm before clipping
  double lossExact; // the loss as the step computed it (float64 programs)
  // What the compiled step plans besides: accumulators of the update's
  // inputs (Program::accumulatorElems floats), the gradient norm's fp64
  // partial sums (Program::normSums), and on a device the bf16 copy of the
  // parameters and the kernels' scratch (null on the CPU).
  float *accumulators;
  double *normSums;
  void *paramShadow;
  void *scratch;
  // With the parameters sharded (Program::paramPieceElems > 0): this rank's
  // pieces of them, which ctx.params then leaves out (the CPU runtime keeps
  // them right before ctx.params; a device may keep them in host memory).
  float *paramPieces;
  // Which of a shared program's variants this rank runs (Program::variants;
  // 0 otherwise).
  int64_t variant;
  // Set while Program::evalStep runs (a device program's pipeline messages
  // are ordered differently then).
  bool evaluating;
  // An inference program's step (Program::inference) reads these instead
  // of targets: each token's position in its sequence ([batch, chunk]),
  // the KV cache (Program::kvCacheElems floats, kept from call to call),
  // and writes the logits of every token it reads ([batch, chunk, vocab],
  // the whole vocabulary on every rank).
  const int32_t *positions;
  float *kvCache;
  float *logits;
  // Written by the step after finishStep: its other observations, in the
  // order the program records them (empty for most models).
  std::vector<StepMetric> metrics;
};

struct Program;

// A program for an accelerator hands runMain these hooks; its step then
// reads and writes device memory only. Null for CPU programs.
struct DeviceHooks {
  // Runs after the launch has been checked: selects the device, creates the
  // communicators, allocates every buffer of the step once (parameters,
  // gradients, moments, activations, accumulators, the batch) and copies
  // the initial parameters in (hostParams: the parameter store, laid out as
  // ctx.params is, paramStoreElems elements with the parameters sharded).
  // Fills ctx's pointers with device pointers.
  void (*start)(const Program &program, const float *hostParams,
                StepContext &ctx);
  // Copies a step's batch (host) to the device buffers ctx points to.
  void (*loadBatch)(StepContext &ctx, const int32_t *tokens,
                    const int32_t *targets, int64_t count);
  // Copies the fp32 master parameters (the store start took) back to the
  // host (for saving).
  void (*download)(const Program &program, float *hostParams);
  // Frees everything and destroys the communicators.
  void (*stop)();
  // One line naming the device and the precision, for the run's banner.
  const char *(*describe)();
  // Copies AdamW's moments between the device and host stores laid out as
  // a CPU program's (Program::optimizerElems, or paramElems, floats each),
  // for saving and resuming.
  void (*copyMoments)(const Program &program, float *hostM, float *hostV,
                      bool toDevice);
  // Runs one training step (program.step, or what stands for it, such as
  // a captured graph of it) and fills ctx.loss and ctx.gradNorm; null:
  // the runtime calls program.step itself.
  void (*runStep)(const Program &program, StepContext &ctx);
};

// One pipeline rank a shared program serves: pipeline stages that compute
// the same on different layers build one binary, which runs with the
// parameter table and activation arena of the rank it finds itself on.
struct ProgramVariant {
  int64_t pipelineRank;
  const ParamInfo *params; // Program::numParams entries
  int64_t activationBytes;
};

struct Program {
  const char *name;
  const ParamInfo *params;
  int numParams;
  int64_t paramElems;      // total elements of all parameters
  int64_t activationBytes; // size of the activation arena
  TrainConfig config;
  void (*step)(StepContext &);
  // The forward-only step (tessel-eval-step): the loss of the batch at the
  // current parameters, reduced as `step` reduces it, without gradients or
  // an update; it writes ctx.loss only. Null in gradient checks.
  void (*evalStep)(StepContext &);
  // Makes the parameters whole after the last update
  // (tessel-defer-param-gathers: a step gathers the updated pieces at its
  // start, under its first forward parts); the runtime runs it before it
  // reads the parameters (a checkpoint, a save, the end). Null when the
  // update gathers them itself.
  void (*syncParams)(StepContext &);
  // Mesh sizes; all 1 for a one-rank program. The runtime checks the launch
  // against it, and data parallel rank d reads rows [d * batch,
  // (d + 1) * batch) of each global batch.
  MeshShape mesh;
  // Microbatches per step (gradient accumulation); TrainConfig::batch is
  // the rank's rows of all of them together.
  int64_t microbatches;
  // Sizes of the accumulators and of the norm's partial sums the step uses.
  int64_t accumulatorElems;
  int64_t normSums;
  // Elements of each AdamW moment store when the optimizer is sharded over
  // dp (ParamInfo::stateOffset); 0: the moments are laid out like the
  // parameters (paramElems).
  int64_t optimizerElems;
  // Elements of the gradient store when gradients are kept as pieces
  // (parallel.zero 2); 0: laid out like the parameters (paramElems).
  int64_t gradElems;
  // Elements of the step's parameter store when parameters are sharded
  // (parallel.zero 3: pieces, parameters kept whole and gathered runs); 0:
  // the store is laid out like `offset` (paramElems).
  int64_t paramStoreElems;
  // Of those, this rank's pieces (StepContext::paramPieces); the step's
  // ctx.params (and a bf16 program's copy of it) holds the rest: the
  // parameters kept whole and the gathered runs.
  int64_t paramPieceElems;
  // Null for CPU programs.
  const DeviceHooks *device;
  // A program shared by pipeline ranks: one entry per rank it serves (the
  // runtime replaces params and activationBytes by the running rank's).
  // Null for a program of its own.
  const ProgramVariant *variants;
  int numVariants;
  // An inference program (tessel compile --inference): `step` runs the
  // forward pass of `chunk` new tokens per sequence (TrainConfig::batch
  // sequences) at the positions StepContext::positions gives, appends their
  // keys and values to the KV cache (kvCacheElems floats; room for
  // TrainConfig::seqLen positions) and writes their logits. No gradients,
  // no optimizer state; evalStep is null.
  bool inference;
  int64_t chunk;
  int64_t kvCacheElems;
  // The same forward pass over `prefillChunk` tokens per sequence at once
  // (a prompt's chunks), over the same parameters and KV cache; null when
  // the program has none (prompts go through `step` token by token).
  void (*prefill)(StepContext &);
  int64_t prefillChunk;
  // The CPU runtime's pipeline send buffers, allocated at start
  // (commReserveSends): room for the sends outside the send ring between
  // two waits for the sends (each rounded up to 64 bytes), and the ring's
  // slots and their size (tessel-order-messages). A CUDA program's are
  // the device's (DeviceProgram).
  int64_t sendBytes;
  int64_t sendRingSlots;
  int64_t sendSlotBytes;
};

// Learning rate for 0-based `step` of a run of `totalSteps`: linear warmup
// lr * (step + 1) / warmupSteps, then decay from lr to minLr over the rest.
float learningRate(const TrainConfig &config, int64_t step, int64_t totalSteps);
// torch.nn.utils.clip_grad_norm_: min(1, maxNorm / (totalNorm + 1e-6)),
// or 1 when maxNorm <= 0.
float clipCoefficient(double totalNorm, float maxNorm);

// The end of a CPU step: hands the loss and the gradient norm to the
// runtime.
void finishStep(StepContext &ctx, const float *loss, const float *norm);
void finishStep(StepContext &ctx, const double *loss, const double *norm);
// Records `n` values of the step under `name` in ctx.metrics.
void recordMetric(StepContext &ctx, const char *name, const float *values,
                  int64_t n);
void recordMetric(StepContext &ctx, const char *name, const double *values,
                  int64_t n);

// The main() of a float64 gradient-check program (tessel gradcheck): its
// stores hold doubles. Runs the step (without an optimizer) on random
// parameters and tokens, then compares sampled entries of every parameter's
// gradient with central finite differences of the loss; prints each
// parameter's worst relative error and returns 0 when all are below 1e-5.
int gradientCheckMain(const Program &program);

// Parses the command line (see `--help`), runs the training loop and returns
// the process exit code.
int runMain(int argc, char **argv, const Program &program);

// The main() of an inference program (Program::inference): loads weights,
// feeds the prompt through the KV cache, then generates token by token;
// rank 0 prints one JSON object per line (docs/inference.md).
int runInferenceMain(int argc, char **argv, const Program &program);

// The options a rank program takes (what `--help` lists), with `program`'s
// defaults, or the spec fields they come from when it is null.
void printRunOptions(FILE *out, const Program *program);
// Whether `flag` ("--steps") is an option of a rank program, whether it
// takes a value, and the option a misspelt one most likely meant ("" when
// none is close).
bool isRunFlag(const std::string &flag);
bool runFlagTakesValue(const std::string &flag);
std::string suggestRunFlag(const std::string &flag);

} // namespace tessel::rt

#endif // TESSEL_RUNTIME_PROGRAM_H
