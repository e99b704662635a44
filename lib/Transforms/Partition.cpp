//===- Partition.cpp - The global training step becomes the rank program --===//
//
// After sharding propagation every value has a sharding; here every value
// gets its local type and every dist.reshard becomes the collectives that
// realise it. See Passes.td for the contract.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "dialects/Pipe/PipeOps.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"

namespace tessel {
#define GEN_PASS_DEF_PARTITION
#include "tessel/Transforms/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;
using namespace tessel::graph;
using tessel::AxisSet;
using tessel::MeshShape;
using tessel::dist::Sharding;

namespace {

class Partitioner {
public:
  Partitioner(ModuleOp module)
      : ctx(module.getContext()), mesh(dist::meshOf(module)) {}

  LogicalResult run(func::FuncOp func);

private:
  Sharding shardingOf(Value v) {
    auto result = dyn_cast<OpResult>(v);
    if (result)
      if (auto attrs =
              result.getOwner()->getAttrOfType<ArrayAttr>("dist.sharding"))
        return Sharding::fromAttr(
            cast<dist::ShardingAttr>(attrs[result.getResultNumber()]));
    return Sharding::replicated(cast<RankedTensorType>(v.getType()).getRank());
  }
  FailureOr<RankedTensorType> localType(Operation *op, RankedTensorType type,
                                        const Sharding &s) {
    SmallVector<int64_t> shape(type.getShape());
    for (auto [d, axes] : llvm::enumerate(s.dims)) {
      int64_t g = mesh.groupSize(axes);
      if (shape[d] % g != 0) {
        op->emitOpError("dimension ")
            << d << " of size " << shape[d] << " cannot be split over "
            << axes.str() << " (" << g << " ranks)";
        return failure();
      }
      shape[d] /= g;
    }
    return RankedTensorType::get(shape, type.getElementType());
  }
  LogicalResult lowerReshard(dist::ReshardOp reshard);
  void selectKVHead(Operation *op);
  // The local op works on this rank's slice of the vocabulary.
  void markVocabSplit(Operation *op, AxisSet axes) {
    if (!axes.empty())
      op->setAttr("dist.vocab_axes", dist::AxesAttr::get(ctx, axes));
  }
  void scaleCrossEntropy(Operation *op);

  MLIRContext *ctx;
  MeshShape mesh;
};

LogicalResult Partitioner::run(func::FuncOp func) {
  SmallVector<Operation *> ops;
  for (Operation &op : func.getBody().front())
    ops.push_back(&op);
  for (Operation *op : ops) {
    // A reshard is lowered from its global type (its operand is local by now).
    if (auto reshard = dyn_cast<dist::ReshardOp>(op)) {
      if (failed(lowerReshard(reshard)))
        return failure();
      continue;
    }
    // Local types first, so that rewrites below see local operands.
    for (Value r : op->getResults()) {
      auto type = dyn_cast<RankedTensorType>(r.getType());
      if (!type)
        continue;
      FailureOr<RankedTensorType> local = localType(op, type, shardingOf(r));
      if (failed(local))
        return failure();
      r.setType(*local);
    }
    if (op->hasAttr("dist.kv_replicated"))
      selectKVHead(op);
    if (isa<CrossEntropyOp, CrossEntropyGradOp>(op)) {
      scaleCrossEntropy(op);
      markVocabSplit(op, shardingOf(op->getOperand(0)).dims.back());
    }
    if (auto e = dyn_cast<EmbeddingOp>(op))
      markVocabSplit(op, shardingOf(e.getTable()).dims[0]);
    if (auto e = dyn_cast<EmbeddingGradOp>(op))
      markVocabSplit(op, shardingOf(e.getResult()).dims[0]);
    if (auto norm = dyn_cast<GlobalNormOp>(op)) {
      // A split gradient's squares are summed over the axes that split it.
      SmallVector<Attribute> axes;
      for (Value g : norm.getInputs())
        axes.push_back(dist::AxesAttr::get(ctx, shardingOf(g).allAxes() -
                                                    shardingOf(g).partial));
      norm->setAttr("dist.norm_axes", ArrayAttr::get(ctx, axes));
    }
  }
  return success();
}

// KV heads replicated over a group larger than their number: this rank's
// query heads [r*Hl, (r+1)*Hl) all read KV head r*Hl / (H/Hkv). Slice it out
// of k and v; under the gradient, place dk and dv back into zeros (a partial
// sum over the group).
void Partitioner::selectKVHead(Operation *op) {
  AxisSet axes =
      op->getAttrOfType<dist::AxesAttr>("dist.kv_replicated").getValue();
  auto q = cast<RankedTensorType>(op->getOperand(0).getType());
  auto k = cast<RankedTensorType>(op->getOperand(1).getType());
  int64_t localHeads = q.getDimSize(2);
  int64_t queriesPerKV = localHeads * mesh.groupSize(axes) / k.getDimSize(2);
  auto one = RankedTensorType::get(
      {k.getDimSize(0), k.getDimSize(1), 1, k.getDimSize(3)},
      k.getElementType());
  Location loc = op->getLoc();
  OpBuilder b(op);
  PlacementListener placement = PlacementListener::of(op);
  b.setListener(&placement);
  auto attrs = [&](Operation *piece) {
    piece->setAttr("dist.sharding",
                   ArrayAttr::get(ctx, {Sharding::replicated(4).toAttr(ctx)}));
  };
  for (unsigned i : {1u, 2u}) {
    auto slice = dist::LocalSliceOp::create(
        b, loc, one, op->getOperand(i), dist::AxesAttr::get(ctx, axes),
        b.getI64IntegerAttr(2), b.getI64IntegerAttr(localHeads),
        b.getI64IntegerAttr(queriesPerKV));
    attrs(slice);
    op->setOperand(i, slice);
  }
  if (!isa<AttentionGradOp>(op))
    return;
  b.setInsertionPointAfter(op);
  for (unsigned i : {1u, 2u}) {
    Value grad = op->getResult(i);
    Type whole = grad.getType();
    grad.setType(one);
    auto insert = dist::LocalInsertOp::create(
        b, loc, whole, grad, dist::AxesAttr::get(ctx, axes),
        b.getI64IntegerAttr(2), b.getI64IntegerAttr(localHeads),
        b.getI64IntegerAttr(queriesPerKV));
    auto resultAttrs = op->getAttrOfType<ArrayAttr>("dist.sharding");
    insert->setAttr("dist.sharding", ArrayAttr::get(ctx, {resultAttrs[i]}));
    grad.replaceAllUsesExcept(insert, insert);
  }
}

// A cross-entropy over tokens split across ranks (and microbatches) computes,
// per rank and microbatch, the sum of its tokens' losses divided by the
// global token count, so that the sum of the pieces is the global mean:
// scale the local mean by 1 / pieces.
void Partitioner::scaleCrossEntropy(Operation *op) {
  Sharding targets = shardingOf(op->getOperand(1));
  AxisSet axes = targets.leadingAxes(targets.dims.size());
  // Microbatches split the batch in time as dp splits it in space.
  auto module = op->getParentOfType<ModuleOp>();
  int64_t group =
      mesh.groupSize(axes) * pipe::layoutOf(module).getMicrobatches();
  if (group == 1)
    return;
  Location loc = op->getLoc();
  auto scalar = RankedTensorType::get({}, Float32Type::get(ctx));
  auto replicated = ArrayAttr::get(ctx, {Sharding::replicated(0).toAttr(ctx)});
  if (isa<CrossEntropyGradOp>(op)) {
    OpBuilder b(op);
    PlacementListener placement = PlacementListener::of(op);
    b.setListener(&placement);
    auto scale = FillOp::create(b, loc, scalar, b.getF64FloatAttr(1.0 / group));
    scale->setAttr("dist.sharding", replicated);
    auto dloss = MulOp::create(b, loc, op->getOperand(2), scale);
    dloss->setAttr("dist.sharding", replicated);
    op->setOperand(2, dloss);
    return;
  }
  OpBuilder b(op->getContext());
  PlacementListener placement = PlacementListener::of(op);
  b.setListener(&placement);
  b.setInsertionPointAfter(op);
  auto scale = FillOp::create(b, loc, scalar, b.getF64FloatAttr(1.0 / group));
  scale->setAttr("dist.sharding", replicated);
  Value loss = op->getResult(0);
  auto scaled = MulOp::create(b, loc, loss, scale);
  scaled->setAttr("dist.sharding", op->getAttr("dist.sharding"));
  loss.replaceAllUsesExcept(scaled, scaled);
}

LogicalResult Partitioner::lowerReshard(dist::ReshardOp reshard) {
  Sharding from = Sharding::fromAttr(reshard.getFrom());
  Sharding to = Sharding::fromAttr(reshard.getTo());
  Location loc = reshard.getLoc();
  OpBuilder b(reshard);
  PlacementListener placement = PlacementListener::of(reshard);
  b.setListener(&placement);
  Value v = reshard.getInput();
  Sharding current = from;
  auto annotate = [&](Operation *op) {
    op->setAttr("dist.sharding", ArrayAttr::get(ctx, {current.toAttr(ctx)}));
  };
  if (!(to.partial - from.partial).empty())
    return reshard.emitOpError("cannot make a value partial over ")
           << (to.partial - from.partial).str();
  AxisSet reduce = from.partial - to.partial;
  // Partial axes that the target splits a dimension by: reduce-scatter.
  for (size_t d = 0; d < to.dims.size(); ++d) {
    AxisSet scatter = (to.dims[d] & reduce) - from.dims[d];
    if (scatter.empty())
      continue;
    current.dims[d] |= scatter;
    current.partial -= scatter;
    reduce -= scatter;
    FailureOr<RankedTensorType> type =
        localType(reshard, cast<RankedTensorType>(reshard.getType()), current);
    if (failed(type))
      return failure();
    auto rs = dist::ReduceScatterOp::create(b, loc, *type, v,
                                            dist::AxesAttr::get(ctx, scatter),
                                            b.getI64IntegerAttr(d));
    annotate(rs);
    v = rs.getResult();
  }
  if (!reduce.empty()) {
    current.partial -= reduce;
    auto ar = dist::AllReduceOp::create(b, loc, TypeRange{v.getType()},
                                        ValueRange{v}, reduce);
    annotate(ar);
    v = ar.getResult(0);
  }
  // Split dimensions the target needs whole (or split otherwise): gather.
  for (size_t d = 0; d < to.dims.size(); ++d) {
    AxisSet gather = current.dims[d] - to.dims[d];
    if (gather.empty())
      continue;
    if (current.blocksOf(d) != 1)
      return reshard.emitOpError("cannot gather dimension ")
             << d << ", which is split in " << current.blocksOf(d) << " blocks";
    current.dims[d] -= gather;
    FailureOr<RankedTensorType> type =
        localType(reshard, cast<RankedTensorType>(reshard.getType()), current);
    if (failed(type))
      return failure();
    auto ag = dist::AllGatherOp::create(b, loc, *type, v,
                                        dist::AxesAttr::get(ctx, gather),
                                        b.getI64IntegerAttr(d));
    annotate(ag);
    v = ag.getResult();
  }
  // Dimensions the target splits that nothing split before: every rank
  // holds the whole dimension already and keeps its piece.
  for (size_t d = 0; d < to.dims.size(); ++d) {
    AxisSet split = to.dims[d] - current.dims[d];
    if (split.empty() || !current.dims[d].empty())
      continue;
    current.dims[d] = split;
    FailureOr<RankedTensorType> type =
        localType(reshard, cast<RankedTensorType>(reshard.getType()), current);
    if (failed(type))
      return failure();
    auto slice = dist::LocalSliceOp::create(
        b, loc, *type, v, dist::AxesAttr::get(ctx, split),
        b.getI64IntegerAttr(d), b.getI64IntegerAttr(type->getDimSize(d)),
        b.getI64IntegerAttr(1));
    annotate(slice);
    v = slice.getResult();
  }
  if (current != to)
    return reshard.emitOpError("cannot lower the reshard from ")
           << reshard.getFrom() << " to " << reshard.getTo()
           << " (a dimension split over other axes must be gathered first)";
  reshard.getResult().replaceAllUsesWith(v);
  reshard.erase();
  return success();
}

struct PartitionPass : tessel::impl::PartitionBase<PartitionPass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    auto func = module.lookupSymbol<func::FuncOp>("train_step");
    if (!func) {
      module.emitError("tessel-partition: no @train_step");
      return signalPassFailure();
    }
    if (failed(Partitioner(module).run(func)))
      signalPassFailure();
  }
};

} // namespace
