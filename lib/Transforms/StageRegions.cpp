//===- StageRegions.cpp - Each rank's program, cut into scheduled parts ---===//
//
// Cuts the per-rank training step into one function per pipeline rank (the
// step itself with one rank), and each function into the parts a schedule
// runs: a pipe.forward_pass and a pipe.backward_pass per model chunk the rank
// holds (once per microbatch) and one pipe.update (once per step, reading
// the microbatches' contributions summed). Every op goes to the stage of its
// layer (graph.layer; collectives and unplaced ops go with their operands)
// and to the part of its phase (graph.phase). A value used on another rank
// is sent right after it is produced and received where it is first used; a
// value used in a later part of the same rank is handed on by the part that
// produces it. See Passes.td.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "dialects/Pipe/PipeOps.h"
#include "tessel/Pipeline/Schedule.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/IRMapping.h"

#include <functional>
#include <map>
#include <set>

namespace tessel {
#define GEN_PASS_DEF_STAGEREGIONS
#include "tessel/Transforms/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;
using namespace tessel::graph;

namespace {

const AxisSet kPP = MeshAxis::PP;

// Where an op runs: a pipeline rank, and a part of that rank's program.
struct Part {
  int64_t rank = 0;
  Phase phase = Phase::Forward;
  int64_t chunk = 0; // 0 for the update
  bool operator<(const Part &o) const {
    return std::make_tuple(rank, phase, chunk) <
           std::make_tuple(o.rank, o.phase, o.chunk);
  }
  bool operator==(const Part &o) const {
    return rank == o.rank && phase == o.phase && chunk == o.chunk;
  }
};

// A part being built: its ops in a detached block, the values it hands on
// (yields) and the placeholders of values it takes from earlier parts.
struct PartBuild {
  std::unique_ptr<Block> block = std::make_unique<Block>();
  IRMapping map;
  SmallVector<Value> yields; // values of `block`
  DenseMap<Value, unsigned> yieldIndex;
  // Placeholder -> (producing part, index in its yields).
  SmallVector<std::tuple<Operation *, Part, unsigned>> imports;
};

class StageCutter {
public:
  StageCutter(ModuleOp module, func::FuncOp step, MeshLayout layout,
              ArrayRef<int64_t> layerStages, bool recomputeBlocks,
              ArrayRef<int64_t> recomputeOnly)
      : module(module), step(step), ctx(module.getContext()), layout(layout),
        ranks(layout.pipelineRanks()), stages(layout.numStages()),
        layers(layerStages), recomputeBlocks(recomputeBlocks),
        recomputeOnly(recomputeOnly.begin(), recomputeOnly.end()) {}

  LogicalResult run();

private:
  LogicalResult assignStages();
  std::optional<int64_t> stageOfLayer(LayerAttr layer) const;
  Phase phaseOf(Operation *op) const;
  Part partOf(Operation *op) const {
    int64_t stage = stageOf.lookup(op);
    Phase phase = phaseOf(op);
    return {layout.stageOwner(stage), phase,
            phase == Phase::Update ? 0 : layout.stageChunk(stage)};
  }
  PartBuild &build(const Part &part) { return parts[part]; }
  OpBuilder builderAtEnd(const Part &part) {
    OpBuilder b(ctx);
    b.setInsertionPointToEnd(build(part).block.get());
    return b;
  }
  Value lookup(Value v, const Part &user);
  Value handOn(Value v, const Part &from, const Part &to);
  Value receiveParam(Value v, int64_t rank);
  void placeNorm(GlobalNormOp norm);
  void findScalarSums(func::ReturnOp ret);
  Value partialSum(Value v, int64_t rank);
  void finishRank(int64_t rank, func::FuncOp func);

  ModuleOp module;
  func::FuncOp step;
  MLIRContext *ctx;
  MeshLayout layout;
  int64_t ranks, stages;
  ArrayRef<int64_t> layers; // the stage of each transformer block
  // Full recompute: a backward op of block `recomputing` gets what it needs
  // from that block's forward pass by running those ops again.
  bool recomputeBlocks;
  std::set<int64_t> recomputeOnly; // empty: every block
  std::optional<int64_t> recomputing;
  DenseMap<Operation *, int64_t> stageOf;
  // Collectives whose results only the update reads: gradient
  // synchronisation, run once per step rather than per microbatch.
  llvm::SmallPtrSet<Operation *, 32> syncOps;
  // Sums of scalars that only the step's results read (the loss: the
  // language model's plus each MoE layer's load-balancing and z losses;
  // the metrics that sum those): each chunk's forward pass sums the terms
  // it computes, the update adds the chunks' and the sums over pp add the
  // ranks' (partialSum).
  llvm::SmallPtrSet<Operation *, 8> scalarSums;
  std::map<Part, PartBuild> parts;
  // Parameters (outside every part) per rank: its own and those it
  // receives once per step.
  SmallVector<IRMapping> params;
  SmallVector<func::FuncOp> funcs; // per rank
  // Where a value lives on a rank, once it is there (defined, received or
  // cloned): its part and its value in that part.
  std::map<std::pair<int64_t, Part>, DenseMap<Value, Value>> clones;
  DenseMap<std::pair<Value, int64_t>, std::pair<Part, Value>> home;
  // Messages are numbered per channel (sender, receiver): pipeline ranks
  // that compute alike then exchange alike, and can share one program.
  std::map<std::pair<int64_t, int64_t>, int64_t> messagesOn;
  int64_t nextTag(int64_t from, int64_t to) { return messagesOn[{from, to}]++; }
};

Phase StageCutter::phaseOf(Operation *op) const {
  if (syncOps.contains(op))
    return Phase::Update;
  return graph::phaseOf(op).value_or(Phase::Update);
}

std::optional<int64_t> StageCutter::stageOfLayer(LayerAttr layer) const {
  if (!layer)
    return std::nullopt;
  switch (layer.getKind()) {
  case LayerKind::Embedding:
    return 0;
  case LayerKind::Head:
    return stages - 1;
  case LayerKind::Block:
    if (layer.getIndex() < (int64_t)layers.size())
      return layers[layer.getIndex()];
    return std::nullopt;
  }
  return std::nullopt;
}

LogicalResult StageCutter::assignStages() {
  Block &body = step.getBody().front();
  llvm::SmallPtrSet<Operation *, 32> update;
  for (Operation &op : llvm::reverse(body)) {
    bool isUpdate = phaseOf(&op) == Phase::Update;
    if (isa<dist::AllReduceOp, dist::AllGatherOp, dist::ReduceScatterOp>(op)) {
      isUpdate = llvm::all_of(op.getUsers(), [&](Operation *user) {
        return update.contains(user) || isa<func::ReturnOp>(user);
      });
      if (isUpdate)
        syncOps.insert(&op);
    }
    if (isUpdate)
      update.insert(&op);
  }
  for (Operation &op : body) {
    if (isa<func::ReturnOp, GlobalNormOp, InputOp, FillOp>(op))
      continue;
    std::optional<int64_t> s;
    if (auto adamw = dyn_cast<AdamWOp>(op))
      s = stageOf.lookup(adamw.getParam().getDefiningOp());
    else if (!isa<dist::DistDialect>(op.getDialect()))
      s = stageOfLayer(layerOf(&op));
    // A gradient summed from contributions that are all computed on one
    // later stage (a value read by several ops there, e.g. the residual
    // stream) is summed there: one tensor goes back instead of each
    // contribution.
    if (auto add = dyn_cast<AddOp>(op); add && s &&
                                        phaseOf(&op) == Phase::Backward) {
      Operation *lhs = add.getLhs().getDefiningOp();
      Operation *rhs = add.getRhs().getDefiningOp();
      if (lhs && rhs && stageOf.count(lhs) && stageOf.count(rhs) &&
          stageOf[lhs] == stageOf[rhs] && stageOf[lhs] > *s)
        s = stageOf[lhs];
    }
    // A gradient summed from contributions of different pipeline ranks (a
    // tied embedding's, from the embedding and the head) that only the
    // update reads is summed by the update: each rank sums its contribution
    // over the microbatches and one tensor crosses per step, not one per
    // microbatch.
    if (auto add = dyn_cast<AddOp>(op);
        add && s && phaseOf(&op) == Phase::Backward && !op.use_empty() &&
        llvm::all_of(op.getUsers(),
                     [&](Operation *user) { return update.contains(user); })) {
      Operation *lhs = add.getLhs().getDefiningOp();
      Operation *rhs = add.getRhs().getDefiningOp();
      if (lhs && rhs && stageOf.count(lhs) && stageOf.count(rhs) &&
          layout.stageOwner(stageOf[lhs]) != layout.stageOwner(stageOf[rhs]))
        syncOps.insert(&op);
    }
    // Collectives and ops without a layer run where their operands are
    // (the latest stage).
    if (!s)
      for (Value v : op.getOperands())
        if (Operation *def = v.getDefiningOp(); def && stageOf.count(def))
          s = std::max<int64_t>(s.value_or(0), stageOf[def]);
    // A collective whose readers are all on one earlier stage that receives
    // its operand anyway (a sequence-parallel gradient gathered there) runs
    // on that stage: the operand crosses once, not the operand and the
    // gathered tensor.
    if (s && isa<dist::AllGatherOp>(op) && op.getNumOperands() == 1) {
      std::optional<int64_t> readers;
      bool one = !op.use_empty();
      for (Operation *user : op.getUsers()) {
        std::optional<int64_t> u = stageOfLayer(layerOf(user));
        if (!u || (readers && *readers != *u))
          one = false;
        else
          readers = u;
      }
      bool operandThere = false;
      for (Operation *user : op.getOperand(0).getUsers())
        if (user != &op)
          if (std::optional<int64_t> u = stageOfLayer(layerOf(user));
              u && readers && *u == *readers)
            operandThere = true;
      if (one && readers && *readers < *s && operandThere)
        s = *readers;
    }
    if (!s && stages == 1)
      s = 0;
    if (!s)
      return op.emitOpError("cannot be placed on a pipeline stage");
    stageOf[&op] = *s;
  }
  return success();
}

// `v` (a value of part `from`) made available in the later part `to` of the
// same rank: handed on by `from`'s pipe.yield.
Value StageCutter::handOn(Value v, const Part &from, const Part &to) {
  PartBuild &producer = build(from);
  auto [it, inserted] =
      producer.yieldIndex.try_emplace(v, producer.yields.size());
  if (inserted)
    producer.yields.push_back(v);
  OpBuilder b = builderAtEnd(to);
  // Stands for the producing part's result until the parts are built.
  auto placeholder = UnrealizedConversionCastOp::create(
      b, v.getLoc(), TypeRange{v.getType()}, ValueRange{});
  build(to).imports.push_back({placeholder, from, it->second});
  return placeholder.getResult(0);
}

// Whether `v` is a parameter or a piece of one cut without arithmetic
// (split, reshape, transpose of a parameter).
static bool isParameterPiece(Value v) {
  Operation *def = v.getDefiningOp();
  if (!def)
    return false;
  if (isa<ParamOp>(def))
    return true;
  return isa<SplitOp, ReshapeOp, TransposeOp>(def) &&
         llvm::all_of(def->getOperands(), isParameterPiece);
}

// The value the original `v` has in part `user`: the part's own copy, a
// parameter, a fresh copy of an input or constant, handed on from an earlier
// part of the rank, or received from the rank that produces it.
Value StageCutter::lookup(Value v, const Part &user) {
  DenseMap<Value, Value> &here = clones[{user.rank, user}];
  if (Value mapped = here.lookup(v))
    return mapped;
  Operation *def = v.getDefiningOp();
  if (auto param = dyn_cast<ParamOp>(def)) {
    if (Value p = params[user.rank].lookupOrNull(v))
      return p;
  }
  if (isa<InputOp, FillOp>(def)) {
    OpBuilder b = builderAtEnd(user);
    Operation *clone = b.clone(*def);
    setPhase(clone, user.phase);
    here[v] = clone->getResult(0);
    return clone->getResult(0);
  }
  // Already on this rank in another part: handed on; but a piece of a
  // parameter (a fused projection's q, k or v block) is cut again where it
  // is needed rather than held from the forward pass to the backward pass
  // of every microbatch in flight.
  // Likewise a gathered activation (under sequence parallelism, a norm's
  // output gathered over tp for a column-parallel matmul) is gathered again
  // by the backward pass, which holds only this rank's piece, as Megatron
  // does: (t-1)/t of the tensor moves once more, a t-th of it is held.
  auto known = home.find({v, user.rank});
  bool fromForward = known != home.end() && user.phase == Phase::Backward &&
                     known->second.first.phase == Phase::Forward;
  bool regather = fromForward && isa<dist::AllGatherOp>(def);
  // Under full recompute, what the running block's backward needs from the
  // block's own forward pass is computed again (received values, the
  // block's input from another rank, stay received). So does the block's
  // input: a reduction of values made before the block (a vocabulary-
  // parallel embedding's partial sums, which the first block's norm reads
  // reduced) is kept as it was reduced, not reduced again.
  LayerAttr layer = layerOf(def);
  auto inBlock = [&](Value operand) {
    Operation *producer = operand.getDefiningOp();
    LayerAttr l = producer ? layerOf(producer) : LayerAttr();
    return l && l.getKind() == LayerKind::Block &&
           l.getIndex() == *recomputing;
  };
  bool blockInput =
      isa<dist::AllReduceOp, dist::ReduceScatterOp>(def) &&
      recomputing && llvm::none_of(def->getOperands(), inBlock);
  bool recompute = fromForward && recomputing && layer &&
                   layer.getKind() == LayerKind::Block &&
                   layer.getIndex() == *recomputing &&
                   !isa<dist::RecvOp>(def) && !blockInput;
  // Under selective recomputation, what the frontend marked (the attention
  // scores and probabilities) is made again by each backward part that
  // reads it.
  bool selective =
      fromForward && def->hasAttr(GraphDialect::kRecomputeAttrName);
  if (known != home.end() &&
      (isParameterPiece(v) || regather || recompute || selective)) {
    OpBuilder b = builderAtEnd(user);
    IRMapping map;
    for (Value operand : def->getOperands())
      map.map(operand, lookup(operand, user));
    Operation *clone = b.clone(*def, map);
    setPhase(clone, user.phase);
    for (auto [orig, copy] : llvm::zip(def->getResults(), clone->getResults()))
      here[orig] = copy;
    return here[v];
  }
  if (known != home.end()) {
    Value handed = handOn(known->second.second, known->second.first, user);
    here[v] = handed;
    return handed;
  }
  // A parameter of another rank (a tied embedding read by the head): sent
  // once per step, before the step's parts, and held here for the step like
  // a parameter of this rank.
  if (isa<ParamOp>(def))
    return receiveParam(v, user.rank);
  // Produced on another rank: sent right after it is produced (in the part
  // that produces it) and received here. What an update reads from a pass
  // of another rank (a gradient contribution) is summed over the
  // microbatches there and sent once, by that rank's update.
  Part from = partOf(def);
  Value sent;
  if (user.phase == Phase::Update && from.phase != Phase::Update) {
    from = {from.rank, Phase::Update, 0};
    sent = lookup(v, from);
  } else {
    sent = clones[{from.rank, from}].lookup(v);
  }
  if (!sent) {
    def->emitOpError("is used on pipeline rank ")
        << user.rank << " but was never placed on rank " << from.rank;
    return nullptr;
  }
  int64_t tag = nextTag(from.rank, user.rank);
  OpBuilder sb(ctx);
  if (Operation *sentDef = sent.getDefiningOp();
      sentDef && sentDef->getBlock() == build(from).block.get())
    sb.setInsertionPointAfter(sentDef);
  else
    sb.setInsertionPointToStart(build(from).block.get());
  auto send = dist::SendOp::create(sb, def->getLoc(), sent, MeshAxis::PP,
                                   user.rank - from.rank, tag);
  setPhase(send, from.phase);
  OpBuilder rb = builderAtEnd(user);
  auto recv = dist::RecvOp::create(rb, def->getLoc(), v.getType(),
                                   MeshAxis::PP, from.rank - user.rank, tag);
  setPhase(recv, user.phase);
  here[v] = recv.getResult();
  home[{v, user.rank}] = {user, recv.getResult()};
  return recv.getResult();
}

// Parameter `v` of another pipeline rank made available on `rank` for the
// whole step: its owner sends it at the start of the step (before any part
// runs; the update that changes it waits for the send) and `rank` receives
// it into a place held for the step.
Value StageCutter::receiveParam(Value v, int64_t rank) {
  if (Value p = params[rank].lookupOrNull(v))
    return p;
  Operation *def = v.getDefiningOp();
  int64_t owner = layout.stageOwner(stageOf.lookup(def));
  Value sent = params[owner].lookupOrNull(v);
  if (!sent) {
    def->emitOpError("is used on pipeline rank ")
        << rank << " but was never placed on rank " << owner;
    return nullptr;
  }
  int64_t tag = nextTag(owner, rank);
  OpBuilder sb = OpBuilder::atBlockEnd(&funcs[owner].getBody().front());
  auto send = dist::SendOp::create(sb, def->getLoc(), sent, MeshAxis::PP,
                                   rank - owner, tag);
  setPhase(send, Phase::Forward);
  OpBuilder rb = OpBuilder::atBlockEnd(&funcs[rank].getBody().front());
  auto recv = dist::RecvOp::create(rb, def->getLoc(), v.getType(),
                                   MeshAxis::PP, owner - rank, tag);
  setPhase(recv, Phase::Forward);
  params[rank].map(v, recv.getResult());
  return recv.getResult();
}

// The sums of scalars that only the loss and the metrics read (MoE layers'
// side losses, added to the language model's loss on the last stage): with
// them cut like other ops, each layer's terms would cross to the last rank
// once per microbatch. Instead each rank's forward pass sums the terms it
// computes and the update's sum over pp adds the ranks' parts, so nothing
// crosses for them; the loss is still the forward passes' sum, as the
// evaluation step (tessel-eval-step) expects.
void StageCutter::findScalarSums(func::ReturnOp ret) {
  Block &body = step.getBody().front();
  // Sums: adds in a forward pass, and reductions over axes within the
  // stage (a term that is a partial sum over tp under sequence
  // parallelism; a metric summed over dp once per step, in the update).
  auto isSum = [&](Operation &op) {
    if (op.getNumResults() != 1 || op.use_empty() ||
        cast<RankedTensorType>(op.getResult(0).getType()).getRank() != 0)
      return false;
    if (isa<dist::AllReduceOp>(op))
      return op.getNumOperands() == 1;
    return isa<AddOp>(op) && phaseOf(&op) == Phase::Forward;
  };
  for (Operation &op : body)
    if (isSum(op))
      scalarSums.insert(&op);
  // Only what the step's results read, of terms computed by forward passes
  // (or sums of those); the rest are cut like any op, and a sum that loses
  // a reader or a term that way loses its place too.
  for (bool changed = true; changed;) {
    changed = false;
    for (Operation &op : body) {
      if (!scalarSums.contains(&op))
        continue;
      bool forward = phaseOf(&op) == Phase::Forward;
      bool valid = llvm::all_of(op.getUses(), [&](OpOperand &use) {
        if (use.getOwner() == ret)
          return use.getOperandNumber() != 1; // not the gradient norm
        return scalarSums.contains(use.getOwner());
      });
      for (Value term : op.getOperands()) {
        Operation *def = term.getDefiningOp();
        if (!def)
          valid = false;
        else if (!scalarSums.contains(def))
          valid &=
              forward && stageOf.count(def) && phaseOf(def) == Phase::Forward;
        else
          valid &= forward ? phaseOf(def) == Phase::Forward : true;
      }
      if (!valid) {
        scalarSums.erase(&op);
        changed = true;
      }
    }
  }
}

// The terms of `v` (a sum in scalarSums) that `rank` computes: each
// chunk's forward pass sums its own in the order the sum adds them, hands
// that on to the update (summed over the microbatches), and the update adds
// the chunks'; a zero where the rank computes none. (A chunk's sum stays in
// its pass: a value handed from one chunk's forward pass to another's would
// hold the first chunk's place in the memory plan.) A null value when `v`
// is not such a sum.
Value StageCutter::partialSum(Value v, int64_t rank) {
  Operation *def = v.getDefiningOp();
  if (!def || !scalarSums.contains(def))
    return Value();
  Part update{rank, Phase::Update, 0};
  if (Value known = clones[{rank, update}].lookup(v))
    return known;
  // A reduction the update makes once per step (a metric summed over dp)
  // reduces the rank's part.
  if (phaseOf(def) != Phase::Forward) {
    IRMapping map;
    map.map(def->getOperand(0), partialSum(def->getOperand(0), rank));
    OpBuilder b = builderAtEnd(update);
    Operation *clone = b.clone(*def, map);
    clone->removeAttr(GraphDialect::kLayerAttrName);
    setPhase(clone, Phase::Update);
    clones[{rank, update}][v] = clone->getResult(0);
    return clone->getResult(0);
  }
  // The chunks of the rank's terms.
  std::set<int64_t> chunks;
  std::function<void(Value)> visit = [&](Value term) {
    Operation *termDef = term.getDefiningOp();
    if (scalarSums.contains(termDef)) {
      for (Value operand : termDef->getOperands())
        visit(operand);
      return;
    }
    int64_t stage = stageOf.lookup(termDef);
    if (layout.stageOwner(stage) == rank)
      chunks.insert(layout.stageChunk(stage));
  };
  visit(v);
  Value total;
  for (int64_t chunk : chunks) {
    Part pass{rank, Phase::Forward, chunk};
    // A sum that is a term of several (the MoE losses' sum is a metric and
    // a term of the loss) is summed once in the pass.
    DenseMap<Value, Value> &inPass = clones[{rank, pass}];
    std::function<Value(Value)> sum = [&](Value term) -> Value {
      Operation *termDef = term.getDefiningOp();
      if (!scalarSums.contains(termDef)) {
        int64_t stage = stageOf.lookup(termDef);
        return layout.stageOwner(stage) == rank &&
                       layout.stageChunk(stage) == chunk
                   ? lookup(term, pass)
                   : Value();
      }
      if (Value known = inPass.lookup(term))
        return known;
      SmallVector<Value> parts;
      for (Value operand : termDef->getOperands())
        if (Value part = sum(operand))
          parts.push_back(part);
      // A sum of one term is that term; a reduction's is reduced.
      if (parts.empty() || (parts.size() == 1 && isa<AddOp>(termDef)))
        return parts.empty() ? Value() : parts.front();
      OpBuilder b = builderAtEnd(pass);
      IRMapping map;
      map.map(termDef->getOperands(), parts);
      Operation *clone = b.clone(*termDef, map);
      clone->removeAttr(GraphDialect::kLayerAttrName); // not the head's
      inPass[term] = clone->getResult(0);
      return clone->getResult(0);
    };
    Value handed = handOn(sum(v), pass, update);
    if (!total) {
      total = handed;
      continue;
    }
    OpBuilder b = builderAtEnd(update);
    auto add = AddOp::create(b, def->getLoc(), total, handed);
    setPhase(add, Phase::Update);
    total = add.getResult();
  }
  if (!total) {
    OpBuilder b = builderAtEnd(update);
    auto zero =
        FillOp::create(b, def->getLoc(), v.getType(), b.getF64FloatAttr(0.0));
    setPhase(zero, Phase::Update);
    total = zero.getResult();
  }
  clones[{rank, update}][v] = total;
  return total;
}

// The norm of all gradients, per rank: of the rank's own gradients, their
// squares summed over pp as well.
void StageCutter::placeNorm(GlobalNormOp norm) {
  auto scalar = cast<RankedTensorType>(norm.getType());
  ArrayAttr reduce = norm.getReduceAxesAttr();
  // The partial sums over pp are reduced by every rank together: a rank
  // without gradients split over some axes (a stage without experts, under
  // expert parallelism) contributes a zero to that sum.
  auto splitOf = [&](size_t k) {
    AxisSet split =
        reduce ? cast<dist::AxesAttr>(reduce[k]).getValue() : AxisSet();
    return ranks > 1 ? split | kPP : split;
  };
  std::set<unsigned> allSets;
  for (size_t k = 0; k < norm.getInputs().size(); ++k)
    allSets.insert(splitOf(k).bits());
  for (int64_t r = 0; r < ranks; ++r) {
    Part update{r, Phase::Update, 0};
    SmallVector<Value> grads;
    SmallVector<Attribute> axes;
    for (auto [k, g] : llvm::enumerate(norm.getInputs())) {
      if (layout.stageOwner(stageOf.lookup(g.getDefiningOp())) != r)
        continue;
      grads.push_back(lookup(g, update));
      axes.push_back(dist::AxesAttr::get(ctx, splitOf(k)));
    }
    OpBuilder ub = builderAtEnd(update);
    std::set<unsigned> mine;
    for (Attribute a : axes)
      mine.insert(cast<dist::AxesAttr>(a).getValue().bits());
    for (unsigned bits : allSets) {
      if (mine.count(bits))
        continue;
      auto zero = FillOp::create(ub, norm.getLoc(), scalar,
                                 ub.getF64FloatAttr(0.0));
      copyPlacement(norm, zero);
      grads.push_back(zero);
      axes.push_back(dist::AxesAttr::get(ctx, AxisSet::fromBits(bits)));
    }
    auto local = GlobalNormOp::create(ub, norm.getLoc(), scalar, grads,
                                      ArrayAttr::get(ctx, axes));
    copyPlacement(norm, local);
    clones[{r, update}][norm.getResult()] = local.getResult();
    home[{norm.getResult(), r}] = {update, local.getResult()};
  }
}

LogicalResult StageCutter::run() {
  if (failed(assignStages()))
    return failure();
  Block &body = step.getBody().front();
  OpBuilder b(ctx);
  b.setInsertionPoint(step);
  // The loss's type (f32; f64 in gradient checks).
  auto scalar = cast<RankedTensorType>(
      step.getBody().front().getTerminator()->getOperand(0).getType());
  for (int64_t r = 0; r < ranks; ++r) {
    std::string name =
        ranks == 1 ? "train_step" : "stage_" + std::to_string(r);
    // The loss, the norm and the metrics (graph.metrics).
    auto func = func::FuncOp::create(
        b, step.getLoc(), name,
        b.getFunctionType({}, step.getFunctionType().getResults()));
    if (Attribute metrics = step->getAttr("graph.metrics"))
      func->setAttr("graph.metrics", metrics);
    func->setAttr("pipe.rank", b.getI64IntegerAttr(r));
    func.addEntryBlock();
    funcs.push_back(func);
    params.emplace_back();
  }

  func::ReturnOp ret = cast<func::ReturnOp>(body.getTerminator());
  if (ranks > 1)
    findScalarSums(ret);
  for (Operation &op : body) {
    if (isa<InputOp, FillOp>(op))
      continue; // cloned where used
    if (isa<func::ReturnOp>(op))
      continue;
    if (auto n = dyn_cast<GlobalNormOp>(op)) {
      placeNorm(n);
      continue;
    }
    if (scalarSums.contains(&op))
      continue; // summed by each rank's update
    if (auto param = dyn_cast<ParamOp>(op)) {
      int64_t r = layout.stageOwner(stageOf.lookup(&op));
      OpBuilder pb = OpBuilder::atBlockEnd(&funcs[r].getBody().front());
      params[r].map(param.getResult(), pb.clone(op)->getResult(0));
      continue;
    }
    Part part = partOf(&op);
    SmallVector<Value> operands;
    LayerAttr layer = layerOf(&op);
    if (recomputeBlocks && part.phase == Phase::Backward && layer &&
        layer.getKind() == LayerKind::Block &&
        (recomputeOnly.empty() || recomputeOnly.count(layer.getIndex())))
      recomputing = layer.getIndex();
    for (Value v : op.getOperands())
      operands.push_back(lookup(v, part));
    recomputing.reset();
    OpBuilder ob = builderAtEnd(part);
    IRMapping map;
    map.map(op.getOperands(), operands);
    Operation *clone = ob.clone(op, map);
    if (syncOps.contains(&op))
      setPhase(clone, Phase::Update);
    for (auto [orig, copy] : llvm::zip(op.getResults(), clone->getResults())) {
      clones[{part.rank, part}][orig] = copy;
      home[{orig, part.rank}] = {part, copy};
    }
  }

  // Each rank's update: the norm of its own gradients (squares summed over
  // pp as well) and the loss, which lives on the last stage, summed over pp
  // (the other ranks contribute zero) so that every rank reports it.
  for (int64_t r = 0; r < ranks; ++r) {
    Part update{r, Phase::Update, 0};
    Value loss;
    Value stepLoss = ret.getOperand(0);
    if (ranks == 1) {
      loss = lookup(stepLoss, update);
    } else {
      int64_t last = layout.stageOwner(stages - 1);
      OpBuilder ub = builderAtEnd(update);
      if (Value part = partialSum(stepLoss, r)) {
        loss = part;
      } else if (r == last) {
        loss = lookup(stepLoss, update);
      } else {
        auto zero = FillOp::create(ub, ret.getLoc(), scalar,
                                   ub.getF64FloatAttr(0.0));
        setPhase(zero, Phase::Update);
        loss = zero;
      }
      ub.setInsertionPointToEnd(build(update).block.get());
      auto ar = dist::AllReduceOp::create(ub, ret.getLoc(), TypeRange{scalar},
                                          ValueRange{loss}, kPP);
      setPhase(ar, Phase::Update);
      loss = ar.getResult(0);
    }
    Value gradNorm = lookup(ret.getOperand(1), update);
    // The metrics: each where it is computed (a layer's on its stage),
    // summed over the microbatches; under pp summed over pp like the loss
    // (the other ranks contribute zeros) so that every rank has them all.
    SmallVector<Value> metrics;
    for (Value metric : ret.getOperands().drop_front(2)) {
      Operation *def = metric.getDefiningOp();
      if (Value part = ranks > 1 ? partialSum(metric, r) : Value()) {
        metrics.push_back(part);
        continue;
      }
      if (ranks == 1 || !def || !stageOf.count(def) ||
          layout.stageOwner(stageOf.lookup(def)) == r) {
        metrics.push_back(lookup(metric, update));
        continue;
      }
      OpBuilder ub = builderAtEnd(update);
      auto zero = FillOp::create(ub, ret.getLoc(), metric.getType(),
                                 ub.getF64FloatAttr(0.0));
      setPhase(zero, Phase::Update);
      metrics.push_back(zero);
    }
    if (ranks > 1 && !metrics.empty()) {
      OpBuilder ub = builderAtEnd(update);
      auto ar = dist::AllReduceOp::create(ub, ret.getLoc(),
                                          ValueRange(metrics).getTypes(),
                                          metrics, kPP);
      setPhase(ar, Phase::Update);
      metrics.assign(ar.getResults().begin(), ar.getResults().end());
    }
    PartBuild &u = build(update);
    u.yields = {loss, gradNorm};
    llvm::append_range(u.yields, metrics);
    finishRank(r, funcs[r]);
  }
  step.erase();
  return success();
}

// Wraps the rank's parts in pipe ops, in the order their values flow:
// forward passes by chunk, backward passes in reverse chunk order, the
// update; then replaces the placeholders of handed-on values.
void StageCutter::finishRank(int64_t rank, func::FuncOp func) {
  OpBuilder b = OpBuilder::atBlockEnd(&func.getBody().front());
  std::map<Part, Operation *> built;
  auto wrap = [&](const Part &part) {
    auto it = parts.find(part);
    if (it == parts.end())
      return;
    PartBuild &p = it->second;
    // A yielded value may be a placeholder itself (the step's loss, handed
    // on unchanged): it is replaced below like its uses.
    auto replacePlaceholder = [&](Operation *placeholder, Value with) {
      for (Value &y : p.yields)
        if (y == placeholder->getResult(0))
          y = with;
      placeholder->getResult(0).replaceAllUsesWith(with);
      placeholder->erase();
    };
    SmallVector<Type> types;
    for (Value v : p.yields)
      types.push_back(v.getType());
    Operation *op;
    if (part.phase == Phase::Update) {
      // The update's inputs: what it takes from the passes, summed over the
      // microbatches (block arguments stand for the sums).
      SmallVector<Value> inputs;
      for (auto &[placeholder, from, index] : p.imports) {
        Value result = built.at(from)->getResult(index);
        inputs.push_back(result);
        Value arg = p.block->addArgument(result.getType(), result.getLoc());
        replacePlaceholder(placeholder, arg);
      }
      p.imports.clear();
      op = pipe::UpdateOp::create(b, func.getLoc(), types, inputs);
    } else if (part.phase == Phase::Forward) {
      op = pipe::ForwardPassOp::create(b, func.getLoc(), types, part.chunk);
    } else {
      op = pipe::BackwardPassOp::create(b, func.getLoc(), types, part.chunk);
    }
    for (auto &[placeholder, from, index] : p.imports)
      replacePlaceholder(placeholder, built.at(from)->getResult(index));
    Block *block = p.block.release();
    op->getRegion(0).push_back(block);
    OpBuilder yb = OpBuilder::atBlockEnd(block);
    pipe::YieldOp::create(yb, func.getLoc(), p.yields);
    built[part] = op;
  };
  int64_t chunks = layout.virtualStages();
  for (int64_t c = 0; c < chunks; ++c)
    wrap({rank, Phase::Forward, c});
  for (int64_t c = chunks - 1; c >= 0; --c)
    wrap({rank, Phase::Backward, c});
  Part update{rank, Phase::Update, 0};
  wrap(update);
  func::ReturnOp::create(b, func.getLoc(), built.at(update)->getResults());
}

// A matmul's multiply-adds: what a layer costs, to balance stages.
double matmulWork(MatmulOp m) {
  auto lhs = cast<RankedTensorType>(m.getLhs().getType()).getShape();
  int64_t K = m.getTransposeLhs() ? lhs[lhs.size() - 2] : lhs.back();
  if (m.getSumBatch())
    for (int64_t d : lhs.drop_back(2))
      K *= d;
  return double(cast<RankedTensorType>(m.getType()).getNumElements()) * K;
}

// The stage of each transformer block: the layout's `layer_stages`, else
// contiguous runs balanced by the forward matmul work of each block (the
// head's counted with the last block, which shares its stage). An MoE
// block's experts count with the rows they take on average: each of the
// block's top-k assignments through one expert's matrices (a grouped
// matmul's buffer is sized for the worst case, every row to one rank).
FailureOr<SmallVector<int64_t>>
layerStagesOf(ModuleOp module, func::FuncOp step, int64_t stages) {
  pipe::LayoutAttr layout = pipe::layoutOf(module);
  if (!layout.getLayerStages().empty())
    return SmallVector<int64_t>(layout.getLayerStages());
  std::vector<double> costs;
  double head = 0;
  DenseMap<int64_t, double> assignments; // per MoE block
  auto add = [&](LayerAttr layer, double work) {
    if (layer.getKind() == LayerKind::Head)
      head += work;
    if (layer.getKind() != LayerKind::Block)
      return;
    if ((int64_t)costs.size() <= layer.getIndex())
      costs.resize(layer.getIndex() + 1, 0.0);
    costs[layer.getIndex()] += work;
  };
  step.walk([&](Operation *op) {
    LayerAttr layer = layerOf(op);
    if (!layer || graph::phaseOf(op) != Phase::Forward)
      return;
    if (auto m = dyn_cast<MatmulOp>(op))
      add(layer, matmulWork(m));
    if (auto topK = dyn_cast<MoeTopKOp>(op))
      assignments[layer.getIndex()] +=
          cast<RankedTensorType>(topK.getExperts().getType()).getNumElements();
    if (auto g = dyn_cast<GroupedMatmulOp>(op)) {
      auto w = cast<RankedTensorType>(g.getWeight().getType()).getShape();
      add(layer, assignments.lookup(layer.getIndex()) * double(w[1]) * w[2]);
    }
  });
  if (stages == 1)
    return SmallVector<int64_t>(costs.size(), 0);
  if (costs.empty())
    return module.emitError("tessel-stage-regions: the step has no "
                            "transformer blocks (graph.layer) to cut into "
                            "pipeline stages");
  costs.back() += head;
  llvm::Expected<std::vector<int>> balanced =
      pipeline::balanceStages(costs, stages);
  if (!balanced)
    return module.emitError("tessel-stage-regions: ")
           << llvm::toString(balanced.takeError());
  return SmallVector<int64_t>(balanced->begin(), balanced->end());
}

struct StageRegionsPass : tessel::impl::StageRegionsBase<StageRegionsPass> {
  using StageRegionsBase::StageRegionsBase;
  void runOnOperation() override {
    ModuleOp module = getOperation();
    if (recompute != "none" && recompute != "selective" &&
        recompute != "full") {
      module.emitError("tessel-stage-regions: recompute must be none, "
                       "selective or full, got '")
          << recompute << "'";
      return signalPassFailure();
    }
    MeshLayout layout(dist::meshOf(module),
                      pipe::layoutOf(module).getVirtualStages());
    auto step = module.lookupSymbol<func::FuncOp>("train_step");
    if (!step || !step.getBody().hasOneBlock() ||
        step->hasAttr("pipe.rank")) {
      module.emitError("tessel-stage-regions: needs the single-block "
                       "@train_step of tessel-partition");
      return signalPassFailure();
    }
    FailureOr<SmallVector<int64_t>> layerStages =
        layerStagesOf(module, step, layout.numStages());
    if (failed(layerStages))
      return signalPassFailure();
    if (failed(StageCutter(module, step, layout, *layerStages,
                           recompute == "full", recomputeBlocks)
                   .run()))
      signalPassFailure();
  }
};

} // namespace
