//===- ModelBuilder.cpp - GPT-2 and Llama as graph IR ---------------------===//
//
// Expands a model spec into the forward program with global shapes. The
// parameter names, layouts and initialisers are Hugging Face's, so weights
// carry over in both directions: GPT-2's Conv1D weights are [in, out] (y =
// x W), Llama's Linear weights are [out, in] (y = x W^T).
//
//===----------------------------------------------------------------------===//

#include "tessel/Frontend/ModelBuilder.h"

#include "dialects/Dist/DistOps.h"
#include "dialects/Graph/GraphOps.h"
#include "dialects/Pipe/PipeOps.h"
#include "tessel/Pipeline/Schedule.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "llvm/ADT/MapVector.h"
#include "llvm/Support/GlobPattern.h"

#include <cmath>

using namespace mlir;
using namespace tessel;
using namespace tessel::graph;
using tessel::MeshAxis;
using tessel::MeshShape;

namespace {

class ModelExpander {
public:
  ModelExpander(MLIRContext &ctx, const Spec &spec)
      : ctx(ctx), b(&ctx), spec(spec), m(spec.model), S(spec.model.seqLen) {}

  // The inference steps (tessel compile --inference): @decode_step, the
  // forward pass of one new token of each of `batch` sequences at the
  // positions the runtime gives, over a KV cache of model.seq_len positions
  // per layer, handing out the logits; and with `prefillChunk` > 1,
  // @prefill_step, the same over that many tokens at once (a prompt's
  // chunks). Tensor parallelism only.
  OwningOpRef<ModuleOp> buildInference(int64_t batch, int64_t prefillChunk) {
    inference = true;
    Location loc = NameLoc::get(b.getStringAttr(spec.name));
    const ParallelSpec &par = spec.parallel;
    if (par.pp > 1 || par.dp > 1 || par.ep > 1 || par.cp > 1) {
      emitError(loc) << "an inference program splits the model over tp "
                        "only: parallel.pp, dp, ep and cp must be 1 (got pp "
                     << par.pp << ", dp " << par.dp << ", ep " << par.ep
                     << ", cp " << par.cp
                     << "; --pp 1 --dp 1 --ep 1 --cp 1 sets them)";
      return nullptr;
    }
    if (par.tp > 1 && m.kvHeads % par.tp != 0) {
      emitError(loc) << "an inference program keeps each rank's KV heads: "
                        "parallel.tp = "
                     << par.tp << " must divide model.kv_heads = " << m.kvHeads;
      return nullptr;
    }
    if (prefillChunk < 1 || prefillChunk > m.seqLen) {
      emitError(loc) << "--prefill-chunk " << prefillChunk
                     << " must be in [1, model.seq_len = " << m.seqLen << "]";
      return nullptr;
    }
    OwningOpRef<ModuleOp> module = ModuleOp::create(loc);
    b.setInsertionPointToEnd(module->getBody());
    MeshShape mesh;
    mesh[MeshAxis::TP] = par.tp;
    dist::setMesh(*module, mesh);
    pipe::setLayout(*module, pipe::LayoutAttr::get(&ctx, 1, par.schedule, 1,
                                                   ArrayRef<int64_t>{}));
    if (failed(inferenceStep(*module, "decode_step", batch, 1)))
      return nullptr;
    // The recipe counts the parameters of one step.
    Spec recipe = spec;
    recipe.train.globalBatch = batch;
    setRecipe(*module, recipe);
    if (prefillChunk > 1 &&
        failed(inferenceStep(*module, "prefill_step", batch, prefillChunk)))
      return nullptr;
    return module;
  }

  LogicalResult inferenceStep(ModuleOp module, StringRef name, int64_t batch,
                              int64_t chunk) {
    S = chunk;
    Location loc = NameLoc::get(b.getStringAttr(spec.name));
    b.setInsertionPointToEnd(module.getBody());
    auto func = func::FuncOp::create(b, loc, name, b.getFunctionType({}, {}));
    func->setAttr("pipe.rank", b.getI64IntegerAttr(0));
    b.setInsertionPointToEnd(func.addEntryBlock());
    tokens = input("tokens", batch);
    positions = input("positions", batch);
    b.setListener(&placement);
    Value logits = m.family == "llama" ? llama() : gpt();
    b.setListener(nullptr);
    OutputOp::create(b, loc, "logits", logits);
    func::ReturnOp::create(b, loc);
    return applyShardOverrides(func);
  }

  OwningOpRef<ModuleOp> build() {
    Location loc = NameLoc::get(b.getStringAttr(spec.name));
    OwningOpRef<ModuleOp> module = ModuleOp::create(loc);
    b.setInsertionPointToEnd(module->getBody());
    const ParallelSpec &par = spec.parallel;
    MeshShape mesh;
    mesh[MeshAxis::PP] = par.pp;
    mesh[MeshAxis::DP] = par.dp;
    mesh[MeshAxis::TP] = par.tp;
    mesh[MeshAxis::EP] = par.ep;
    mesh[MeshAxis::CP] = par.cp;
    mesh.dpShard = par.zeroGroup;
    // Checked when the spec was read.
    bool ordered = mesh.setOrder(par.order);
    assert(ordered && "parallel.order is validated by loadSpec");
    (void)ordered;
    dist::setMesh(*module, mesh);
    if (par.sequenceParallel && par.tp > 1)
      (*module)->setAttr("dist.sequence_parallel", b.getUnitAttr());
    if (par.expertTp > 1)
      (*module)->setAttr("dist.expert_tp", b.getUnitAttr());
    SmallVector<int64_t> layerStages;
    if (!par.stageLayers.empty() && par.pp > 1) {
      llvm::Expected<std::vector<int>> stages = pipeline::stagesFromLayerLists(
          par.stageLayers, m.layers, par.pp * par.virtualStages);
      if (!stages) {
        emitError(loc) << "parallel.stage_layers: "
                       << llvm::toString(stages.takeError());
        return nullptr;
      }
      layerStages.assign(stages->begin(), stages->end());
    }
    pipe::setLayout(*module,
                    pipe::LayoutAttr::get(&ctx, par.microbatches, par.schedule,
                                          par.virtualStages, layerStages));
    auto func = func::FuncOp::create(b, loc, "forward",
                                     b.getFunctionType({}, {scalarType()}));
    const TrainSpec &t = spec.train;
    func->setAttr(
        "graph.optimizer",
        b.getDictionaryAttr({
            b.getNamedAttr("name", b.getStringAttr(t.optimizer)),
            b.getNamedAttr("beta1", b.getF64FloatAttr(t.beta1)),
            b.getNamedAttr("beta2", b.getF64FloatAttr(t.beta2)),
            b.getNamedAttr("eps", b.getF64FloatAttr(t.eps)),
            b.getNamedAttr("weight_decay", b.getF64FloatAttr(t.weightDecay)),
            b.getNamedAttr("grad_clip", b.getF64FloatAttr(t.gradClip)),
        }));
    b.setInsertionPointToEnd(func.addEntryBlock());
    // Global shapes: the partition pass splits the batch over dp.
    int64_t B = t.globalBatch / spec.parallel.microbatches;
    tokens = input("tokens", B);
    targets = input("targets", B);
    // Every op of the model is stamped with its layer as it is created.
    b.setListener(&placement);
    Value loss = m.family == "llama" ? llama() : gpt();
    b.setListener(nullptr);
    SmallVector<Value> results = {loss};
    SmallVector<Attribute> names;
    metrics.insert(metrics.begin(), lossParts.begin(), lossParts.end());
    for (auto &[name, value] : metrics) {
      results.push_back(value);
      names.push_back(b.getStringAttr(name));
    }
    func::ReturnOp::create(b, loc, results);
    if (!metrics.empty()) {
      func.setFunctionType(b.getFunctionType({}, ValueRange(results).getTypes()));
      func->setAttr("graph.metrics", b.getArrayAttr(names));
    }
    if (failed(applyShardOverrides(func)))
      return nullptr;
    setRecipe(*module, spec);
    return module;
  }

private:
  RankedTensorType f32(ArrayRef<int64_t> shape) {
    return RankedTensorType::get(shape, b.getF32Type());
  }
  RankedTensorType scalarType() { return f32({}); }
  Location at(const std::string &name) {
    return NameLoc::get(b.getStringAttr(name));
  }

  Value input(const char *name, int64_t batch) {
    return InputOp::create(
        b, at(name), RankedTensorType::get({batch, S}, b.getI32Type()), name);
  }
  // Megatron's tensor-parallel plan: split parameter `p` along `dim` over tp.
  // parallel.shard: the user's per-parameter overrides of the plan. A
  // pattern that matches no parameter is an error (most likely a typo), and
  // so is an override that cannot apply: a dimension tp does not divide, or
  // one of the parameters that hold fused blocks (GPT-2's q, k, v in
  // c_attn) split otherwise than the others. An override that splits the
  // dimension the plan splits in blocks keeps the blocks.
  LogicalResult applyShardOverrides(func::FuncOp func) {
    auto shardingOf = [](ParamOp p) {
      auto attr = p->getAttrOfType<dist::ShardingAttr>("dist.param_sharding");
      return attr ? dist::Sharding::fromAttr(attr)
                  : dist::Sharding::replicated(p.getType().getRank());
    };
    llvm::DenseMap<Operation *, dist::Sharding> plan;
    for (ParamOp p : func.getOps<ParamOp>())
      plan.try_emplace(p, shardingOf(p));
    // The pattern that last set each parameter.
    llvm::DenseMap<Operation *, const std::string *> setBy;
    int64_t tp = spec.parallel.tp;
    for (const ParallelSpec::ShardOverride &o : spec.parallel.shard) {
      llvm::GlobPattern glob = cantFail(llvm::GlobPattern::create(o.pattern));
      std::string where = "parallel.shard[\"" + o.pattern + "\"]";
      bool matched = false;
      for (ParamOp p : func.getOps<ParamOp>()) {
        if (!glob.match(p.getName()))
          continue;
        matched = true;
        RankedTensorType type = p.getType();
        if ((int64_t)o.dims.size() != type.getRank())
          return emitError(p.getLoc())
                 << where << " has " << o.dims.size()
                 << " entries but parameter '" << p.getName() << "' has rank "
                 << type.getRank();
        const dist::Sharding &planned = plan.at(p);
        dist::Sharding s = dist::Sharding::replicated(o.dims.size());
        for (auto [d, axis] : llvm::enumerate(o.dims)) {
          if (axis != "tp")
            continue;
          s.dims[d] = MeshAxis::TP;
          int64_t blocks =
              planned.dims[d].contains(MeshAxis::TP) ? planned.blocksOf(d) : 1;
          s.setBlocks(d, blocks);
          if (type.getDimSize(d) % (blocks * tp) != 0)
            return emitError(p.getLoc())
                   << where << ": dimension " << d << " of parameter '"
                   << p.getName() << "' (size " << type.getDimSize(d)
                   << (blocks > 1 ? ", in " + std::to_string(blocks) +
                                        " blocks"
                                  : std::string())
                   << ") cannot be split over parallel.tp = " << tp;
        }
        p->setAttr("dist.param_sharding", s.toAttr(&ctx));
        setBy[p] = &o.pattern;
      }
      if (!matched)
        return emitError(func.getLoc())
               << where << " matches no parameter of the model";
    }
    // Parameters holding fused blocks (the weight and bias of one
    // projection) are split alike along their blocked dimension, or none
    // (with tp = 1 nothing is split).
    llvm::MapVector<StringRef, SmallVector<ParamOp>> fused;
    for (ParamOp p : func.getOps<ParamOp>())
      if (tp > 1 && !plan.at(p).blocks.empty())
        fused[p.getName().rsplit('.').first].push_back(p);
    auto splitsBlocks = [&](ParamOp p) {
      const dist::Sharding &planned = plan.at(p);
      dist::Sharding now = shardingOf(p);
      for (size_t d = 0; d < planned.dims.size(); ++d)
        if (planned.blocksOf(d) > 1)
          return now.dims[d].contains(MeshAxis::TP);
      return false;
    };
    for (auto &[prefix, group] : fused) {
      auto other = llvm::find_if(group, [&](ParamOp p) {
        return splitsBlocks(p) != splitsBlocks(group.front());
      });
      if (other == group.end())
        continue;
      ParamOp changed = setBy.count(*other) ? *other : group.front();
      ParamOp kept = changed == *other ? group.front() : *other;
      const std::string *pattern = setBy.lookup(changed);
      return emitError(changed.getLoc())
             << "parallel.shard[\"" << (pattern ? *pattern : "") << "\"]: '"
             << changed.getName() << "' and '" << kept.getName()
             << "' hold the same fused blocks (query, key, value) and must "
                "be split alike: both over tp along their blocks, or neither";
    }
    return success();
  }

  // The part of the model the ops built next belong to.
  void enter(graph::LayerKind kind, int64_t index = 0) {
    placement.layer = graph::LayerAttr::get(&ctx, kind, index);
  }

  // Megatron's tensor-parallel plan, whatever the mesh: on a mesh without a
  // tp axis it splits nothing. `blocks` > 1 splits each of that many equal
  // blocks separately.
  Value splitOverTP(Value p, int64_t dim, int64_t blocks = 1) {
    auto param = p.getDefiningOp<ParamOp>();
    dist::Sharding s = dist::Sharding::replicated(param.getType().getRank());
    s.dims[dim] = MeshAxis::TP;
    s.setBlocks(dim, blocks);
    param->setAttr("dist.param_sharding", s.toAttr(&ctx));
    return p;
  }
  Value param(const std::string &name, ArrayRef<int64_t> shape,
              const char *init = "normal", double std = 0.02) {
    auto op = ParamOp::create(b, at(name), f32(shape), b.getStringAttr(name),
                              b.getStringAttr(init), b.getF64FloatAttr(0.0),
                              b.getF64FloatAttr(std));
    return op.getResult();
  }
  Value reshape(Value v, ArrayRef<int64_t> shape) {
    return ReshapeOp::create(b, v.getLoc(), f32(shape), v);
  }
  enum class Parallel { None, Column, Row };
  // y = x W (+ bias), W stored [in, out]. Column-parallel splits the
  // outputs (and the bias), row-parallel the inputs (the bias is added once
  // the partial sums are reduced).
  Value conv1d(Value x, const std::string &name, int64_t in, int64_t out,
               Parallel style = Parallel::None, double std = 0.02) {
    Value w = param(name + ".weight", {in, out}, "normal", std);
    if (style != Parallel::None)
      splitOverTP(w, style == Parallel::Column ? 1 : 0);
    Value y = MatmulOp::create(b, at(name), x, w, false, false);
    Value bias = param(name + ".bias", {out}, "zeros");
    if (style == Parallel::Column)
      splitOverTP(bias, 0);
    return AddOp::create(b, at(name), y, bias);
  }
  // y = x W^T, W stored [out, in], no bias.
  Value linear(Value x, const std::string &name, int64_t in, int64_t out,
               Parallel style = Parallel::None) {
    Value w = param(name + ".weight", {out, in});
    if (style != Parallel::None)
      splitOverTP(w, style == Parallel::Column ? 0 : 1);
    return MatmulOp::create(b, at(name), x, w, false, true);
  }
  Value lmHead(Value h, Value embedding, const std::string &untiedName) {
    // Vocab-parallel head: each rank computes the logits of its slice.
    enter(graph::LayerKind::Head);
    Value w = m.tieEmbeddings
                  ? embedding
                  : splitOverTP(param(untiedName, {m.paddedVocab(), m.hidden}),
                                0);
    Value logits = MatmulOp::create(b, at("lm_head"), h, w, false, true);
    if (inference)
      return logits;
    // A padded vocabulary's extra classes take no part in the softmax.
    return withSideLosses(
        CrossEntropyOp::create(b, at("loss"), logits, targets,
                               /*vocab_axes=*/nullptr,
                               b.getI64IntegerAttr(m.vocabSize)));
  }

  // Hugging Face GPT2LMHeadModel (names without the "transformer." prefix).
  Value gpt() {
    int64_t B = cast<RankedTensorType>(tokens.getType()).getDimSize(0);
    int64_t T = S, C = m.hidden, H = m.heads, D = m.headDim();
    double projStd = 0.02 / std::sqrt(2.0 * m.layers);
    enter(graph::LayerKind::Embedding);
    Value wte = splitOverTP(param("wte.weight", {m.paddedVocab(), C}), 0);
    Value wpe = param("wpe.weight", {m.seqLen, C});
    Value x = EmbeddingOp::create(b, at("wte"), wte, tokens, nullptr);
    if (inference)
      x = AddOp::create(b, at("wpe"), x,
                        EmbeddingOp::create(b, at("wpe"), wpe, positions,
                                            nullptr));
    else
      // positions 0..T-1 broadcast (in the balanced order under cp)
      x = AddOp::create(b, at("wpe"), x, inSequenceOrder(wpe, 0));
    x = dropout(x, m.dropout, kEmbeddingSite);
    for (int64_t l = 0; l < m.layers; ++l) {
      enter(graph::LayerKind::Block, l);
      std::string p = "h." + std::to_string(l) + ".";
      Value h = layerNorm(x, p + "ln_1", C);
      // The fused [q | k | v] projection, column-parallel per block: the
      // weight and bias are split into their q, k and v parts, so that each
      // rank computes the q, k and v of its own heads.
      std::string name = p + "attn.c_attn";
      Value w = splitOverTP(param(name + ".weight", {C, 3 * C}), 1, 3);
      Value bias = splitOverTP(param(name + ".bias", {3 * C}, "zeros"), 0, 3);
      Value q, k, v;
      if (inference) {
        // A step of few tokens splits the projection's output rather than
        // copying the weight apart at every call.
        Value y = MatmulOp::create(b, at(name), h, w, false, false);
        y = AddOp::create(b, at(name), y, bias);
        auto ys = SplitOp::create(
            b, at(name),
            TypeRange{f32({B, T, C}), f32({B, T, C}), f32({B, T, C})}, y, 2);
        q = reshape(ys.getResult(0), {B, T, H, D});
        k = reshape(ys.getResult(1), {B, T, H, D});
        v = reshape(ys.getResult(2), {B, T, H, D});
      } else {
      auto ws = SplitOp::create(
          b, at(name), TypeRange{f32({C, C}), f32({C, C}), f32({C, C})}, w, 1);
      auto bs = SplitOp::create(
          b, at(name), TypeRange{f32({C}), f32({C}), f32({C})}, bias, 0);
      auto project = [&](int i) {
        Value y =
            MatmulOp::create(b, at(name), h, ws.getResult(i), false, false);
        y = AddOp::create(b, at(name), y, bs.getResult(i));
        return reshape(y, {B, T, H, D});
      };
      q = project(0), k = project(1), v = project(2);
      }
      Value a = attention(p + "attn", q, k, v, H, l);
      a = reshape(a, {B, T, C});
      x = AddOp::create(
          b, at(p + "attn"), x,
          dropout(conv1d(a, p + "attn.c_proj", C, C, Parallel::Row, projStd),
                  m.dropout, blockSite(l, Site::AttentionOutput)));
      h = layerNorm(x, p + "ln_2", C);
      Value y = m.moe.isMoeLayer(l) ? moe(h, p + "mlp", projStd, l)
                                    : gptMlp(h, p + "mlp", m.ffnHidden,
                                             projStd);
      x = AddOp::create(b, at(p + "mlp"), x,
                        dropout(y, m.dropout, blockSite(l, Site::MlpOutput)));
    }
    enter(graph::LayerKind::Head);
    return lmHead(layerNorm(x, "ln_f", C), wte, "lm_head.weight");
  }
  Value gptMlp(Value h, const std::string &p, int64_t F, double projStd) {
    int64_t C = m.hidden;
    Value f = GeluOp::create(b, at(p),
                             conv1d(h, p + ".c_fc", C, F, Parallel::Column));
    return conv1d(f, p + ".c_proj", F, C, Parallel::Row, projStd);
  }
  Value llamaMlp(Value h, const std::string &p, int64_t F) {
    int64_t C = m.hidden;
    Value gate = SiluOp::create(
        b, at(p), linear(h, p + ".gate_proj", C, F, Parallel::Column));
    Value up = linear(h, p + ".up_proj", C, F, Parallel::Column);
    Value act = MulOp::create(b, at(p), gate, up);
    return linear(act, p + ".down_proj", F, C, Parallel::Row);
  }

  // A routed mixture-of-experts layer (Hugging Face Mixtral): the router's
  // softmax over the experts, each token's top k renormalised, its
  // assignments gathered into expert-major rows, each expert's MLP over its
  // rows (one grouped GEMM per projection), the rows scattered back
  // weighted; plus the always-on shared experts. The load-balancing and z
  // losses are added to the training loss.
  Value moe(Value h, const std::string &p, double projStd, int64_t layer) {
    const MoeSpec &e = m.moe;
    auto shape = cast<RankedTensorType>(h.getType()).getShape();
    int64_t C = m.hidden, E = e.experts, F = e.ffnHidden;
    int64_t tokens = shape[0] * shape[1];
    bool isLlama = m.family == "llama";
    Location loc = at(p);
    Value router = param(p + ".gate.weight", {E, C});
    Value logits = MatmulOp::create(b, at(p + ".gate"), h, router, false, true);
    Value probs = SoftmaxOp::create(b, loc, logits);
    auto top = MoeTopKOp::create(b, loc, probs, b.getI64IntegerAttr(e.topK));
    std::string tag = "." + std::to_string(layer);
    // An inference step routes every token to its top_k experts (no
    // capacity: Hugging Face's Mixtral drops nothing), with no side losses
    // or metrics.
    int64_t capacity = inference ? 0 : e.capacity(tokens);
    // The assignments per expert: the load-balancing loss's f_e, and the
    // metrics' expert_tokens (docs/metrics.md). They are counted here; the
    // side losses read them after the experts, so that their sum over the
    // token axes (over dp: across nodes, and latency-bound for E values)
    // is in flight under the experts' GEMMs.
    MoeLoadStatsOp stats;
    if (!inference)
      stats = MoeLoadStatsOp::create(b, loc, probs, top.getExperts());
    auto dispatch = MoeDispatchOp::create(
        b, loc, top.getExperts(), b.getI64IntegerAttr(E),
        b.getI64IntegerAttr(capacity), /*token_axes=*/nullptr);
    if (capacity > 0)
      metrics.push_back(
          {"expert_kept" + tag,
           MoeKeptCountsOp::create(b, loc, f32({E}), top.getExperts(),
                                   dispatch.getOffsets())
               .getResult()});
    Value rows = MoePermuteOp::create(b, loc, h, dispatch.getRowOf());
    // To the ranks that hold the experts (an all-to-all over ep; nothing
    // without expert parallelism), and back after the experts. A token
    // sends at most one row to each expert, so a rank of ep holding E/ep
    // experts receives at most min(k, E/ep) rows per token of its ep group:
    // fewer than k when the experts are spread thinner than top_k.
    Type sent = rows.getType(), received = sent;
    int64_t ep = std::max<int64_t>(spec.parallel.ep, 1);
    if (ep > 1 && E % ep == 0 && E / ep < e.topK)
      received = f32({tokens * (E / ep), C});
    auto exchange = MoeExchangeOp::create(
        b, at(p + ".experts"),
        TypeRange{received, dispatch.getOffsets().getType()}, rows,
        dispatch.getOffsets(), /*ep_axes=*/nullptr);
    Value offsets = exchange.getRecvOffsets();
    rows = exchange.getRecvRows();
    // `ffnDim`: the weight's dimension of the expert's hidden width.
    auto grouped = [&](Value x, const std::string &name,
                       ArrayRef<int64_t> shape, bool transposed, int ffnDim,
                       double std = 0.02) {
      Value w = param(p + ".experts." + name, shape, "normal", std);
      // The experts are split over ep (a mesh without ep splits nothing)
      // and, with parallel.expert_tp, each one's hidden width over tp.
      dist::Sharding s = dist::Sharding::replicated(3);
      s.dims[0] = MeshAxis::EP;
      if (spec.parallel.expertTp > 1)
        s.dims[ffnDim] = MeshAxis::TP;
      w.getDefiningOp()->setAttr("dist.param_sharding", s.toAttr(&ctx));
      return GroupedMatmulOp::create(b, at(p + ".experts"), x, w, offsets,
                                     b.getBoolAttr(transposed))
          .getResult();
    };
    Value out;
    if (isLlama) {
      // Per-expert Linear layers stacked: [E, out, in].
      Value gate =
          SiluOp::create(b, loc, grouped(rows, "w1", {E, F, C}, true, 1));
      Value up = grouped(rows, "w3", {E, F, C}, true, 1);
      Value act = MulOp::create(b, loc, gate, up);
      out = grouped(act, "w2", {E, C, F}, true, 2);
    } else {
      // Per-expert Conv1D weights stacked: [E, in, out]; no biases.
      Value f =
          GeluOp::create(b, loc, grouped(rows, "c_fc", {E, C, F}, false, 2));
      out = grouped(f, "c_proj", {E, F, C}, false, 1, projStd);
    }
    out = MoeCombineOp::create(b, at(p + ".experts"), sent, out, offsets,
                               dispatch.getOffsets(),
                               /*ep_axes=*/nullptr);
    Value y = MoeUnpermuteOp::create(b, loc, out, dispatch.getRowOf(),
                                     top.getWeights());
    if (e.sharedExperts > 0) {
      int64_t width = e.sharedExperts * F;
      Value shared = isLlama ? llamaMlp(h, p + ".shared_experts", width)
                           : gptMlp(h, p + ".shared_experts", width, projStd);
      y = AddOp::create(b, at(p + ".shared_experts"), y, shared);
    }
    if (!inference) {
      metrics.push_back({"expert_tokens" + tag, stats.getCounts()});
      if (e.auxLossCoef > 0)
        auxLosses.push_back(MoeAuxLossOp::create(
            b, at(p + ".aux_loss"), stats.getCounts(), stats.getProbSums(),
            b.getI64IntegerAttr(tokens), b.getI64IntegerAttr(e.topK),
            b.getF64FloatAttr(e.auxLossCoef)));
      if (e.zLossCoef > 0)
        zLosses.push_back(MoeZLossOp::create(b, at(p + ".z_loss"), logits,
                                             b.getF64FloatAttr(e.zLossCoef)));
    }
    return y;
  }

  // The training loss: the language model's, plus the MoE layers'
  // load-balancing and z losses, each part also a metric.
  Value withSideLosses(Value lm) {
    if (auxLosses.empty() && zLosses.empty() && metrics.empty())
      return lm;
    lossParts.push_back({"lm_loss", lm});
    Value loss = lm;
    for (auto [name, parts] : {std::pair{"aux_loss", &auxLosses},
                               std::pair{"z_loss", &zLosses}}) {
      if (parts->empty())
        continue;
      Value sum = (*parts)[0];
      for (Value part : ArrayRef<Value>(*parts).drop_front())
        sum = AddOp::create(b, at("loss"), sum, part);
      lossParts.push_back({name, sum});
      loss = AddOp::create(b, at("loss"), loss, sum);
    }
    return loss;
  }

  Value layerNorm(Value x, const std::string &name, int64_t C) {
    Value w = param(name + ".weight", {C}, "ones");
    Value bias = param(name + ".bias", {C}, "zeros");
    return LayerNormOp::create(b, at(name), x, w, bias,
                               b.getF64FloatAttr(m.normEps));
  }

  // Hugging Face LlamaForCausalLM.
  Value llama() {
    int64_t B = cast<RankedTensorType>(tokens.getType()).getDimSize(0);
    int64_t T = S, C = m.hidden, H = m.heads, Hkv = m.kvHeads,
            D = m.headDim(), F = m.ffnHidden;
    enter(graph::LayerKind::Embedding);
    Value embed =
        splitOverTP(param("model.embed_tokens.weight", {m.paddedVocab(), C}),
                    0);
    Value x = EmbeddingOp::create(b, at("model.embed_tokens"), embed, tokens,
                                  nullptr);
    x = dropout(x, m.dropout, kEmbeddingSite);
    auto theta = b.getF64FloatAttr(m.ropeTheta);
    for (int64_t l = 0; l < m.layers; ++l) {
      enter(graph::LayerKind::Block, l);
      std::string p = "model.layers." + std::to_string(l) + ".";
      Value h = rmsNorm(x, p + "input_layernorm", C);
      const Parallel col = Parallel::Column, row = Parallel::Row;
      Value q = reshape(linear(h, p + "self_attn.q_proj", C, H * D, col),
                        {B, T, H, D});
      Value k = reshape(linear(h, p + "self_attn.k_proj", C, Hkv * D, col),
                        {B, T, Hkv, D});
      Value v = reshape(linear(h, p + "self_attn.v_proj", C, Hkv * D, col),
                        {B, T, Hkv, D});
      if (inference) {
        q = RopeAtOp::create(b, at(p + "self_attn.rope"), q.getType(), q,
                             positions, theta);
        k = RopeAtOp::create(b, at(p + "self_attn.rope"), k.getType(), k,
                             positions, theta);
      } else {
        q = RopeOp::create(b, at(p + "self_attn.rope"), q, theta,
                           b.getBoolAttr(false), nullptr, zigzag());
        k = RopeOp::create(b, at(p + "self_attn.rope"), k, theta,
                           b.getBoolAttr(false), nullptr, zigzag());
      }
      Value a = attention(p + "self_attn", q, k, v, Hkv, l);
      a = reshape(a, {B, T, H * D});
      x = AddOp::create(b, at(p + "self_attn"), x,
                        dropout(linear(a, p + "self_attn.o_proj", H * D, C,
                                       row),
                                m.dropout,
                                blockSite(l, Site::AttentionOutput)));
      h = rmsNorm(x, p + "post_attention_layernorm", C);
      Value y = m.moe.isMoeLayer(l) ? moe(h, p + "block_sparse_moe", 0.02, l)
                                    : llamaMlp(h, p + "mlp", F);
      x = AddOp::create(b, at(p + "mlp"), x,
                        dropout(y, m.dropout, blockSite(l, Site::MlpOutput)));
    }
    enter(graph::LayerKind::Head);
    return lmHead(rmsNorm(x, "model.norm", C), embed, "lm_head.weight");
  }
  // Causal attention; in an inference step, over the layer's KV cache
  // (`prefix`.k_cache and .v_cache, split over tp by heads as k and v are).
  Value attention(const std::string &prefix, Value q, Value k, Value v,
                  int64_t kvHeads, int64_t layer) {
    if (!inference && spec.train.attention == "unfused")
      return unfusedAttention(prefix, q, k, v, kvHeads, layer);
    if (!inference) {
      // Under balanced context parallelism the queries stay in the balanced
      // order; the keys and values are put back in the sequence's. The
      // backward gathers and reorders them again rather than keeping them
      // whole (as with contiguous pieces): a rank keeps only its piece.
      if (IntegerAttr pieces = zigzag()) {
        for (Value *x : {&k, &v}) {
          auto sequenceOrder =
              ZigzagOp::create(b, at(prefix), *x, b.getI64IntegerAttr(1),
                               pieces, b.getBoolAttr(true));
          sequenceOrder->setAttr(GraphDialect::kRecomputeAttrName,
                                 b.getUnitAttr());
          *x = sequenceOrder;
        }
      }
      return AttentionOp::create(b, at(prefix), q, k, v, true, nullptr,
                                 nullptr, zigzag())
          .getResult();
    }
    auto kt = cast<RankedTensorType>(k.getType());
    auto cacheType = f32({kt.getDimSize(0), m.seqLen, kvHeads,
                          kt.getDimSize(3)});
    auto cache = [&](const char *what) {
      Value c = KvCacheOp::create(b, at(prefix + what), cacheType,
                                  b.getStringAttr(prefix + what));
      dist::Sharding s = dist::Sharding::replicated(4);
      s.dims[2] = MeshAxis::TP;
      c.getDefiningOp()->setAttr("dist.param_sharding", s.toAttr(&ctx));
      return c;
    };
    Value kc = cache(".k_cache"), vc = cache(".v_cache");
    return CachedAttentionOp::create(b, at(prefix), q.getType(), q, k, v, kc,
                                     vc, positions);
  }
  // Attention with its scores materialised (train.attention = "unfused"),
  // as Megatron-LM computed it before FlashAttention: per head S = Q K^T, P
  // the causal softmax of S / sqrt(D), then P V. The G = heads / kv_heads
  // query heads that read one key head are stacked as G * T rows against
  // its T keys (the causal mask follows a row's position, its index modulo
  // T). Under selective recomputation S and P (and P's dropout) are made
  // again in backward (Korthikanti et al. 2022) rather than kept.
  Value unfusedAttention(const std::string &prefix, Value q, Value k, Value v,
                         int64_t kvHeads, int64_t layer) {
    auto shape = cast<RankedTensorType>(q.getType()).getShape();
    int64_t B = shape[0], T = shape[1], H = shape[2], D = shape[3],
            G = H / kvHeads;
    Location loc = at(prefix);
    auto transpose = [&](Value x, ArrayRef<int64_t> permutation) -> Value {
      return TransposeOp::create(b, loc, x,
                                 b.getDenseI64ArrayAttr(permutation));
    };
    // [B, T, H, D] -> [B, Hkv, G * T, D]; keys and values [B, Hkv, T, D].
    Value qs = G == 1 ? transpose(q, {0, 2, 1, 3})
                      : reshape(transpose(reshape(q, {B, T, kvHeads, G, D}),
                                          {0, 2, 3, 1, 4}),
                                {B, kvHeads, G * T, D});
    Value ks = transpose(k, {0, 2, 1, 3}), vs = transpose(v, {0, 2, 1, 3});
    auto scores = MatmulOp::create(b, loc, qs, ks, false, true, false);
    auto probs = SoftmaxOp::create(
        b, loc, scores.getResult(),
        b.getF64FloatAttr(1.0 / std::sqrt(double(D))), b.getBoolAttr(true));
    Value p = dropout(probs.getResult(), m.attentionDropout,
                      blockSite(layer, Site::AttentionProbs));
    if (spec.train.recompute == "selective")
      for (Operation *op : {scores.getOperation(), probs.getOperation(),
                            p.getDefiningOp()})
        op->setAttr(GraphDialect::kRecomputeAttrName, b.getUnitAttr());
    Value o = MatmulOp::create(b, loc, p, vs, false, false, false);
    if (G == 1)
      return transpose(o, {0, 2, 1, 3});
    return reshape(transpose(reshape(o, {B, kvHeads, G, T, D}),
                             {0, 3, 1, 2, 4}),
                   {B, T, H, D});
  }
  // Dropout sites: the embedding's output, then three per block. A site's
  // number keys its masks, so it depends on the model only.
  static constexpr int64_t kEmbeddingSite = 0;
  enum class Site : int64_t { AttentionProbs, AttentionOutput, MlpOutput };
  static int64_t blockSite(int64_t l, Site site) {
    return 1 + 3 * l + static_cast<int64_t>(site);
  }
  Value dropout(Value x, double p, int64_t site) {
    if (inference || p <= 0)
      return x;
    return DropoutOp::create(b, x.getLoc(), x, b.getF64FloatAttr(p),
                             b.getI64IntegerAttr(int64_t(spec.train.seed)),
                             b.getI64IntegerAttr(site), nullptr, nullptr,
                             zigzag());
  }
  // Balanced context parallelism (parallel.cp_layout): the training step
  // holds every sequence in the zigzag order of cp pieces (graph.zigzag),
  // which the position-dependent ops are told; none otherwise.
  IntegerAttr zigzag() {
    if (inference || !spec.parallel.cpBalanced())
      return nullptr;
    return b.getI64IntegerAttr(spec.parallel.cp);
  }
  // `x`, whose dimension `dim` is the sequence in its order, in the order
  // the step holds the sequence.
  Value inSequenceOrder(Value x, int64_t dim) {
    IntegerAttr pieces = zigzag();
    if (!pieces)
      return x;
    return ZigzagOp::create(b, x.getLoc(), x, b.getI64IntegerAttr(dim), pieces,
                            b.getBoolAttr(false));
  }
  Value rmsNorm(Value x, const std::string &name, int64_t C) {
    Value w = param(name + ".weight", {C}, "ones");
    return RmsNormOp::create(b, at(name), x, w, b.getF64FloatAttr(m.normEps));
  }

  MLIRContext &ctx;
  graph::PlacementListener placement;
  OpBuilder b;
  const Spec &spec;
  const ModelSpec &m;
  // Tokens per sequence the step reads: model.seq_len in training, the
  // chunk of new tokens in an inference step.
  int64_t S;
  bool inference = false;
  Value tokens, targets, positions;
  // The MoE layers' load-balancing and z losses, in layer order.
  SmallVector<Value> auxLosses, zLosses;
  // What the step reports besides the loss (returned after it, named by the
  // function's graph.metrics).
  // (the loss's parts first, then the layers').
  SmallVector<std::pair<std::string, Value>> lossParts, metrics;
};

} // namespace

// Model FLOPs per trained token (forward and backward), as MFU counts them
// (PaLM, appendix B; Megatron-LM): 6N for the parameters' matmuls, N every
// parameter of the graph (the tied embedding once, the LM head's matmul in
// it), and 12 L h s for the attention scores and their weighted sum, at
// full (not causally halved) cost. Recomputation is not counted: MFU counts
// the model's FLOPs, not the hardware's. A graph program (no spec model)
// counts its parameters only.
static double modelFlopsPerToken(ModuleOp module, const Spec &spec,
                                 bool fromSpec) {
  double params = 0;
  const MoeSpec &moe = spec.model.moe;
  module.walk([&](ParamOp p) {
    double n = (double)cast<RankedTensorType>(p.getType()).getNumElements();
    // A token passes through top_k of the routed experts.
    if (fromSpec && moe.enabled() && p.getName().contains(".experts."))
      n *= (double)moe.topK / (double)moe.experts;
    params += n;
  });
  double attention = fromSpec ? 12.0 * (double)spec.model.layers *
                                    (double)spec.model.hidden *
                                    (double)spec.model.seqLen
                              : 0.0;
  return 6.0 * params + attention;
}

void tessel::setRecipe(ModuleOp module, const Spec &spec, bool fromSpec) {
  Builder b(module.getContext());
  const TrainSpec &t = spec.train;
  auto i = [&](int64_t v) { return b.getI64IntegerAttr(v); };
  auto f = [&](double v) { return b.getF64FloatAttr(v); };
  SmallVector<NamedAttribute> recipe({
          b.getNamedAttr("name", b.getStringAttr(spec.name)),
          b.getNamedAttr("global_batch", i(t.globalBatch)),
          b.getNamedAttr("seq_len", i(spec.model.seqLen)),
          b.getNamedAttr("vocab", i(spec.model.vocabSize)),
          b.getNamedAttr("padded_vocab", i(spec.model.paddedVocab())),
          b.getNamedAttr("steps", i(t.steps)),
          b.getNamedAttr("seed", i(static_cast<int64_t>(t.seed))),
          b.getNamedAttr("grad_clip", f(t.gradClip)),
          b.getNamedAttr("lr", f(t.lr)),
          b.getNamedAttr("beta1", f(t.beta1)),
          b.getNamedAttr("beta2", f(t.beta2)),
          b.getNamedAttr("eps", f(t.eps)),
          b.getNamedAttr("weight_decay", f(t.weightDecay)),
          b.getNamedAttr("warmup_steps", i(t.warmupSteps)),
          b.getNamedAttr("decay", b.getStringAttr(t.decay)),
          b.getNamedAttr("min_lr", f(t.minLr)),
          b.getNamedAttr("eval_every", i(t.evalEvery)),
          b.getNamedAttr("eval_batches", i(t.evalBatches)),
          b.getNamedAttr("data_shuffle", b.getBoolAttr(spec.data.shuffle)),
          b.getNamedAttr("data_seed",
                         i(static_cast<int64_t>(spec.data.seed))),
          b.getNamedAttr("flops_per_token",
                         f(modelFlopsPerToken(module, spec, fromSpec))),
  });
  // Where the optimizer state lives, when not on the device (absent:
  // there).
  if (spec.parallel.offload != "none")
    recipe.push_back(
        b.getNamedAttr("offload", b.getStringAttr(spec.parallel.offload)));
  // Each sequence in the balanced order of cp pieces (absent: in order).
  if (spec.parallel.cpBalanced())
    recipe.push_back(b.getNamedAttr("sequence_pieces", i(spec.parallel.cp)));
  module->setAttr("graph.recipe", b.getDictionaryAttr(recipe));
}

void tessel::setRecipeFromGraph(ModuleOp module, Spec spec) {
  module.walk([&](InputOp input) {
    spec.train.globalBatch = input.getType().getDimSize(0);
    spec.model.seqLen = input.getType().getDimSize(1);
  });
  module.walk([&](CrossEntropyOp ce) {
    spec.model.vocabSize =
        ce.getValidVocab()
            ? int64_t(*ce.getValidVocab())
            : cast<RankedTensorType>(ce.getLogits().getType()).getShape().back();
  });
  spec.train.globalBatch *= pipe::layoutOf(module).getMicrobatches();
  setRecipe(module, spec, /*fromSpec=*/false);
}

OwningOpRef<ModuleOp> tessel::buildModel(MLIRContext &context,
                                         const Spec &spec) {
  return ModelExpander(context, spec).build();
}

OwningOpRef<ModuleOp> tessel::buildInferenceModel(MLIRContext &context,
                                                  const Spec &spec,
                                                  int64_t batch,
                                                  int64_t prefillChunk) {
  return ModelExpander(context, spec).buildInference(batch, prefillChunk);
}
