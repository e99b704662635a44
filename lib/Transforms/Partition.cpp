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

#include <list>

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

// Whether the pieces of a dimension split over `held`, each cut over
// `more`, are the pieces of the dimension split over both. A dimension
// split over several axes holds its pieces in the order of the group's
// ranks (MeshLayout::groupRank: the default rank order, tp fastest), so
// the axes of `more` must all be faster than those of `held`.
bool cutsInside(AxisSet held, AxisSet more) {
  constexpr unsigned meshBits = (1u << kNumMeshAxes) - 1;
  if ((held.bits() | more.bits()) & ~meshBits)
    return false; // a hybrid shard group's part of dp
  int lastHeld = -1, firstMore = kNumMeshAxes;
  for (int i = 0; i < kNumMeshAxes; ++i) {
    if (held.contains(kRankOrder[i]))
      lastHeld = i;
    if (more.contains(kRankOrder[i]))
      firstMore = std::min(firstMore, i);
  }
  return lastHeld < firstMore;
}

class Partitioner : public dist::PartitionContext {
public:
  Partitioner(ModuleOp module)
      : ctx(module.getContext()), meshShape(dist::meshOf(module)),
        microbatchCount(pipe::layoutOf(module).getMicrobatches()) {}

  LogicalResult run(func::FuncOp func);

  Sharding shardingOf(Value v) override {
    auto result = dyn_cast<OpResult>(v);
    if (result)
      if (auto attrs =
              result.getOwner()->getAttrOfType<ArrayAttr>("dist.sharding"))
        return Sharding::fromAttr(
            cast<dist::ShardingAttr>(attrs[result.getResultNumber()]));
    return Sharding::replicated(cast<RankedTensorType>(v.getType()).getRank());
  }
  const MeshShape &mesh() const override { return meshShape; }
  int64_t microbatches() const override { return microbatchCount; }
  OpBuilder builderBefore(Operation *anchor) override {
    OpBuilder b(anchor);
    b.setListener(placementOf(anchor));
    return b;
  }
  OpBuilder builderAfter(Operation *anchor) override {
    OpBuilder b(anchor->getContext(), placementOf(anchor));
    b.setInsertionPointAfter(anchor);
    return b;
  }
  void annotate(Operation *op, ArrayRef<Sharding> shardings) override {
    SmallVector<Attribute> attrs;
    for (const Sharding &s : shardings)
      attrs.push_back(s.toAttr(ctx));
    op->setAttr("dist.sharding", ArrayAttr::get(ctx, attrs));
  }

private:
  FailureOr<RankedTensorType> localType(Operation *op, RankedTensorType type,
                                        const Sharding &s) {
    SmallVector<int64_t> shape(type.getShape());
    for (auto [d, axes] : llvm::enumerate(s.dims)) {
      int64_t g = meshShape.groupSize(axes);
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
  void mergeCollectives(func::FuncOp func);
  PlacementListener *placementOf(Operation *anchor) {
    listeners.push_back(PlacementListener::of(anchor));
    return &listeners.back();
  }

  MLIRContext *ctx;
  MeshShape meshShape;
  int64_t microbatchCount;
  std::list<PlacementListener> listeners;
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
    // Local types first, so that the op's rule sees local operands.
    for (Value r : op->getResults()) {
      auto type = dyn_cast<RankedTensorType>(r.getType());
      if (!type)
        continue;
      FailureOr<RankedTensorType> local = localType(op, type, shardingOf(r));
      if (failed(local))
        return failure();
      r.setType(*local);
    }
    if (auto rule = dyn_cast<ShardingRuleOpInterface>(op))
      if (failed(rule.localize(*this)))
        return failure();
  }
  mergeCollectives(func);
  return success();
}

// Readers in one phase that need the same collective of a value share it:
// it runs once (a sequence-parallel position table's gradient, reduced over
// dp both for the norm and for the update).
void Partitioner::mergeCollectives(func::FuncOp func) {
  // What the collective does (its attributes but where it is placed and
  // the sharding propagation recorded).
  auto what = [](Operation *op) {
    NamedAttrList attrs(op->getAttrDictionary());
    attrs.erase("graph.layer");
    attrs.erase("dist.sharding");
    return attrs.getDictionary(op->getContext());
  };
  // The earlier collectives of each operand, with what they do.
  DenseMap<Value, SmallVector<std::pair<Operation *, DictionaryAttr>>> seen;
  for (Operation &op :
       llvm::make_early_inc_range(func.getBody().front().getOperations())) {
    if (!isa<dist::AllReduceOp, dist::AllGatherOp, dist::ReduceScatterOp>(op) ||
        op.getNumOperands() == 0)
      continue;
    DictionaryAttr does = what(&op);
    auto &candidates = seen[op.getOperand(0)];
    auto earlier = llvm::find_if(candidates, [&](auto &c) {
      Operation *o = c.first;
      return o->getName() == op.getName() &&
             o->getOperands() == op.getOperands() &&
             o->getResultTypes() == op.getResultTypes() && c.second == does;
    });
    if (earlier == candidates.end()) {
      candidates.push_back({&op, does});
      continue;
    }
    op.replaceAllUsesWith(earlier->first);
    op.erase();
  }
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
  // holds the whole dimension already and keeps its piece. So does a
  // dimension split further over axes that cut inside its pieces (a
  // sequence piece of cp cut over tp under sequence parallelism).
  for (size_t d = 0; d < to.dims.size(); ++d) {
    AxisSet split = to.dims[d] - current.dims[d];
    if (split.empty() ||
        (!current.dims[d].empty() && !cutsInside(current.dims[d], split)))
      continue;
    current.dims[d] |= split;
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
    SmallVector<func::FuncOp> steps = stepFunctions(module);
    if (steps.empty()) {
      module.emitError("tessel-partition: no @train_step or @decode_step");
      return signalPassFailure();
    }
    for (func::FuncOp func : steps)
      if (failed(Partitioner(module).run(func)))
        return signalPassFailure();
  }
};

} // namespace
