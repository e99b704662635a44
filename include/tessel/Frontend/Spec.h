//===- Spec.h - The JSON training spec ---------------------------*- C++
//-*-===//
//
// A spec says what to train (model), with which recipe (train), on what data
// (data) and how to spread it (parallel). `loadSpec` validates every field
// and reports the first problem with its JSON path; docs/spec.md is the
// schema.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_FRONTEND_SPEC_H
#define TESSEL_FRONTEND_SPEC_H

#include "tessel/Support/MeshLayout.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/Support/Error.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace tessel {

// model.moe: mixture-of-experts blocks (Hugging Face Mixtral routing).
struct MoeSpec {
  int64_t experts = 0; // 0: no MoE layers
  int64_t topK = 2;
  // Block l is an MoE block iff l % every == 0 (Megatron's moe_layer_freq).
  int64_t every = 1;
  int64_t ffnHidden = 0;     // each expert's hidden size
  int64_t sharedExperts = 0; // always-on experts, one MLP of this many widths
  // Each expert takes at most ceil(capacityFactor * tokens * topK / experts)
  // assignments of a microbatch; <= 0: dropless.
  double capacityFactor = 0.0;
  double auxLossCoef = 0.01, zLossCoef = 0.001;
  bool enabled() const { return experts > 0; }
  bool isMoeLayer(int64_t layer) const {
    return enabled() && layer % every == 0;
  }
  // The assignments an expert keeps of `tokens` (0: all).
  int64_t capacity(int64_t tokens) const;
};

struct ModelSpec {
  std::string family; // "gpt" | "llama"
  int64_t vocabSize = 0, seqLen = 0, layers = 0, hidden = 0, heads = 0;
  int64_t kvHeads = 0, ffnHidden = 0;
  // model.vocab_pad_to_multiple: the embedding (and an untied head) have
  // paddedVocab() rows, the vocabulary rounded up to this multiple; the
  // padding rows are initialised like the others and never predicted (the
  // loss leaves them out of its softmax).
  int64_t vocabPadTo = 1;
  bool tieEmbeddings = true;
  double normEps = 1e-5, ropeTheta = 10000.0;
  // model.dropout: on the embedding's output and on each block's attention
  // and MLP outputs before the residual adds; model.attention_dropout: on
  // the attention probabilities (unfused attention). Masks are drawn from
  // global coordinates (runtime Dropout.h), the same at every layout.
  double dropout = 0, attentionDropout = 0;
  MoeSpec moe;
  int64_t headDim() const { return hidden / heads; }
  int64_t paddedVocab() const {
    return (vocabSize + vocabPadTo - 1) / vocabPadTo * vocabPadTo;
  }
};

struct TrainSpec {
  int64_t globalBatch = 8, steps = 100;
  uint64_t seed = 1234;
  double gradClip = 1.0;
  std::string optimizer = "adamw";
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weightDecay = 0.1;
  int64_t warmupSteps = 0;
  std::string decay = "cosine"; // "cosine" | "linear" | "constant"
  double minLr = 0.0;
  // Validation loss (train.eval_every, train.eval_batches): every this many
  // steps and at the end, the mean loss of the first eval_batches global
  // batches of the validation data; 0: never.
  int64_t evalEvery = 0, evalBatches = 8;
  // Storage and matmul precision on accelerators: "bf16" (bf16 activations
  // and matmul operands, fp32 master weights, optimizer state and
  // reductions) or "fp32". The CPU target always computes in fp32.
  std::string precision = "bf16";
  // Activation recomputation: "none", "selective" (the attention scores and
  // probabilities are made again in backward rather than kept: what flash
  // attention does anyway, so only unfused attention changes) or "full"
  // (each transformer block's forward runs again in its backward; a
  // microbatch in flight keeps only each block's input).
  std::string recompute = "none";
  // train.attention: "flash" (one kernel that never stores the scores) or
  // "unfused" (the scores materialised: batched matmuls around a scaled
  // causal softmax, as Megatron-LM ran attention before FlashAttention).
  std::string attention = "flash";
  // The transformer blocks `recompute` applies to (train.recompute_layers);
  // empty: all of them.
  std::vector<int64_t> recomputeLayers;
};

struct DataSpec {
  std::string format = "synthetic"; // "synthetic" | "llmc" | "megatron"
  std::string path;                 // absolute, for a file
  std::string valid; // data.valid: validation data (absolute), or empty
  bool shuffle = false;             // a permutation of the samples per epoch
  uint64_t seed = 1234;             // the shuffle's seed
  // data.blend: datasets (absolute paths) drawn by weight; format "blend".
  std::vector<std::pair<std::string, double>> blend;
};

struct ParallelSpec {
  int64_t dp = 1, tp = 1, pp = 1, microbatches = 1;
  // parallel.ep: expert parallelism (MoE models). The routed experts are
  // split over ep ranks; the tokens are split over dp x ep (for everything
  // but the experts, ep is more data parallelism).
  int64_t ep = 1;
  // parallel.cp: context parallelism. Every activation is split along the
  // sequence over cp ranks (outside tp, inside ep and dp); attention gathers
  // the keys and values over cp and each rank attends with its own queries.
  int64_t cp = 1;
  // parallel.cp_layout: "balanced" (each rank holds chunks c and 2cp-1-c of
  // 2cp, so that every rank has the same causal attention work; the
  // default for dense models) or "contiguous" (piece c of cp; the default,
  // and the only layout, of mixture-of-experts models).
  std::string cpLayout;
  bool cpBalanced() const { return cp > 1 && cpLayout == "balanced"; }
  // parallel.expert_tp: 1 keeps each routed expert whole on a rank (under
  // sequence parallelism each tp rank routes its piece of the sequence);
  // tp splits every expert's MLP over tp as a dense MLP is split (the
  // tokens gathered over tp before the router, the output reduced after).
  int64_t expertTp = 1;
  int64_t virtualStages = 1; // pipeline stages per rank (interleaved)
  std::string schedule = "1f1b";
  bool sequenceParallel = false;
  double bucketMB = 25.0; // gradient all-reduce bucket size
  // parallel.overlap_grad_reduce: start each gradient bucket's all-reduce
  // during backward (true) or reduce them all after it (false, as Megatron-LM
  // did before its overlapped data parallelism).
  bool overlapGradReduce = true;
  // parallel.overlap_param_gather: under ZeRO 1 and 2, gather the updated
  // parameters at the next step's start, under its forward
  // (tessel-defer-param-gathers); false gathers them in the update.
  bool overlapParamGather = true;
  // parallel.overlap_tp_comm: start the tensor-parallel collectives of a
  // part early and wait for them late, under the GEMMs around them
  // (tessel-overlap-collectives); false keeps each blocking where it is.
  bool overlapTpComm = true;
  // parallel.collective_matmul: with overlap_tp_comm, a sequence-parallel
  // gather of one sequence is done piece by piece under the GEMMs that read
  // its rows (tessel-overlap-collectives' collective-matmul).
  bool collectiveMatmul = true;
  // parallel.collective_matmul_min_rows: the least rows (sequence positions)
  // per piece for which it is done.
  int64_t collectiveMatmulMinRows = 512;
  // parallel.zero: 0 replicates the optimizer over dp; 1 shards AdamW's
  // moments over dp (gradients reduce-scattered, parameters all-gathered);
  // 2 keeps the gradients as pieces too; 3 the parameters as well (CPU).
  int64_t zero = 0;
  // parallel.zero_group: shard over groups of this many consecutive dp
  // ranks and replicate across the groups (hybrid sharding, as HSDP and
  // ZeRO++'s hpZ do); 0: over all of dp.
  int64_t zeroGroup = 0;
  // parallel.master_pieces: with zero 1 or 2 on the CUDA target in bf16,
  // keep the fp32 master weights of the parameters only matmuls read as
  // dp pieces (Megatron-LM's distributed optimizer); false keeps them whole.
  bool masterPieces = true;
  // parallel.offload: "optimizer" keeps AdamW's moments in pinned host
  // memory, read and written by the update kernel across the bus
  // (ZeRO-Offload; CUDA target); "none" keeps everything on the device.
  std::string offload = "none";
  // parallel.order: how ranks are numbered, innermost axis first, as
  // Megatron-LM spells it. Consecutive ranks share a node, so the inner
  // axes' collectives stay on its link. pp is always last (MeshLayout.h).
  std::string order = MeshShape().orderName();
  // User overrides of the tensor-parallel plan, applied in order (the last
  // matching pattern wins): a glob over parameter names and, per dimension,
  // the mesh axis splitting it ("" for none).
  struct ShardOverride {
    std::string pattern;
    std::vector<std::string> dims;
  };
  std::vector<ShardOverride> shard;
  // parallel.stage_layers: the layers of each pipeline stage (empty: balance
  // by estimated cost).
  std::vector<std::vector<int>> stageLayers;
};

struct Spec {
  std::string name; // from the file name, e.g. "gpt-tiny"
  ModelSpec model;
  TrainSpec train;
  DataSpec data;
  ParallelSpec parallel;
  // The spec as compiled (JSON text): the file with the overrides and the
  // layout flags applied and the data path made absolute, so that it
  // compiles again from anywhere (tessel run --elastic does). Empty for
  // programs given as IR.
  std::string document;
};

// Layout fields given on the command line (--dp, --tp, ..., and tessel
// check's --layers): typed values that replace the spec's and are validated
// with it, so that errors still name the spec field (parallel.tp, ...).
struct LayoutOverrides {
  std::optional<int64_t> dp, tp, pp, microbatches, virtualStages, ep, cp;
  std::optional<std::string> schedule, order;
  std::optional<bool> sequenceParallel;
  std::optional<int64_t> layers; // model.layers

  // One rank, one microbatch: the program every layout is checked against.
  static LayoutOverrides oneRank();
  // "dp=2 tp=2 sp", in the order of the command-line flags.
  std::string describe() const;
};

// Reads and validates a spec file. `overrides` are "dotted.path=value" strings
// applied before validation (the value is JSON, or a bare string); `layout`
// replaces layout fields after them.
llvm::Expected<Spec> loadSpec(llvm::StringRef path,
                              llvm::ArrayRef<std::string> overrides = {},
                              const LayoutOverrides &layout = {});

// The training recipe with its defaults, for programs given as .mlir files.
Spec defaultSpecForIR(llvm::StringRef name);

} // namespace tessel

#endif // TESSEL_FRONTEND_SPEC_H
