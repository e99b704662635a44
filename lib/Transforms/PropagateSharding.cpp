//===- PropagateSharding.cpp - Every value of the step gets a sharding ----===//
//
// A driver over the ops' sharding rules (ShardingRuleOpInterface; the rules
// are in dialects/Graph/GraphSharding.cpp). A rule reads its operands'
// shardings, states the shardings it needs them in (`require`, which inserts
// a dist.reshard when they differ) and sets its results'. See Passes.td for
// the contract.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"

namespace tessel {
#define GEN_PASS_DEF_PROPAGATESHARDING
#include "tessel/Transforms/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;
using namespace tessel::graph;
using tessel::AxisSet;
using tessel::MeshAxis;
using tessel::MeshShape;
using tessel::dist::Sharding;

namespace {

const AxisSet kTP = MeshAxis::TP;
const AxisSet kCP = MeshAxis::CP;

int64_t rankOf(Value v) {
  return cast<RankedTensorType>(v.getType()).getRank();
}
ArrayRef<int64_t> shapeOf(Value v) {
  return cast<RankedTensorType>(v.getType()).getShape();
}

} // namespace

namespace {

// Runs the ops' rules over the step in program order (a value's producer
// comes before its users, so each op sees its operands' final shardings),
// keeping the shardings and the reshards the rules ask for.
class Propagator : public dist::ShardingContext {
public:
  Propagator(ModuleOp module)
      : ctx(module.getContext()), meshShape(dist::meshOf(module)),
        active(meshShape.activeAxes()),
        sequenceParallel(module->hasAttr("dist.sequence_parallel")),
        expertTp(module->hasAttr("dist.expert_tp") &&
                 active.contains(MeshAxis::TP)) {}

  LogicalResult run(func::FuncOp func) {
    SmallVector<Operation *> worklist;
    for (Operation &op : func.getBody().front())
      worklist.push_back(&op);
    for (Operation *op : worklist) {
      if (auto rule = dyn_cast<ShardingRuleOpInterface>(op)) {
        if (failed(rule.propagateSharding(*this)))
          return failure();
      } else if (isa<func::ReturnOp>(op)) {
        // The step returns its results (the loss and the norm) whole.
        for (unsigned i = 0; i < op->getNumOperands(); ++i)
          require(op, i, Sharding::replicated(rankOf(op->getOperand(i))));
      } else {
        return op->emitOpError("has no sharding rule");
      }
      if (op->getNumResults() > 0) {
        SmallVector<Attribute> attrs;
        for (Value r : op->getResults())
          attrs.push_back(get(r).toAttr(ctx));
        op->setAttr("dist.sharding", ArrayAttr::get(ctx, attrs));
      }
    }
    return success();
  }

  Sharding get(Value v) override {
    auto it = shardings.find(v);
    return it != shardings.end() ? it->second
                                 : Sharding::replicated(rankOf(v));
  }
  void set(Value v, Sharding s) override { shardings[v] = std::move(s); }

  void require(Operation *op, unsigned i, const Sharding &target) override {
    Value v = op->getOperand(i);
    Sharding current = get(v);
    if (current == target)
      return;
    // One reshard per value and target, shared by all its consumers (a
    // gradient read by the norm and by the update is reduced once).
    auto key = std::make_pair(v, target.toAttr(ctx));
    if (Value existing = reshards.lookup(key)) {
      op->setOperand(i, existing);
      return;
    }
    OpBuilder b(op);
    PlacementListener placement = PlacementListener::of(op);
    b.setListener(&placement);
    auto reshard = dist::ReshardOp::create(b, op->getLoc(), v,
                                           current.toAttr(ctx),
                                           target.toAttr(ctx));
    reshard->setAttr("dist.sharding",
                     ArrayAttr::get(ctx, {target.toAttr(ctx)}));
    set(reshard.getResult(), target);
    reshards[key] = reshard.getResult();
    op->setOperand(i, reshard.getResult());
  }

  Sharding reduced(Value v) override {
    Sharding s = get(v);
    AxisSet partial = s.partial;
    s.partial = {};
    // Activations are [batch, seq, ...].
    bool sequence = s.dims.size() >= 3 && s.blocksOf(1) == 1;
    // Context parallelism: a sum over cp of an activation whole along the
    // sequence (the gradient of the gathered keys and values) is taken
    // split along it, as the activations are (a reduce-scatter).
    if (sequence && partial.intersects(kCP) && s.dims[1].empty() &&
        !s.allAxes().intersects(kCP) &&
        shapeOf(v)[1] % meshShape[MeshAxis::CP] == 0)
      s.dims[1] = kCP;
    // Sequence parallelism: a sum over tp is taken split along the
    // sequence (inside a context-parallel split of it).
    if (sequenceParallel && partial.intersects(kTP) && s.dims.size() == 3 &&
        !s.allAxes().intersects(kTP) && sequence &&
        (s.dims[1] - AxisSet(MeshAxis::CP)).empty() &&
        shapeOf(v)[1] % (meshShape.groupSize(s.dims[1]) *
                         meshShape[MeshAxis::TP]) ==
            0)
      s.dims[1] |= kTP;
    return s;
  }

  bool isReducedAnyway(Value v) override {
    return reshards.count({v, reduced(v).toAttr(ctx)});
  }

  const MeshShape &mesh() const override { return meshShape; }
  AxisSet activeAxes() const override { return active; }
  bool expertTensorParallel() const override { return expertTp; }

private:
  MLIRContext *ctx;
  MeshShape meshShape;
  AxisSet active;
  bool sequenceParallel;
  bool expertTp;
  DenseMap<Value, Sharding> shardings;
  DenseMap<std::pair<Value, Attribute>, Value> reshards;
};

struct PropagateShardingPass
    : tessel::impl::PropagateShardingBase<PropagateShardingPass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    // The training step, or an inference program's steps.
    SmallVector<func::FuncOp> steps = stepFunctions(module);
    if (steps.empty() ||
        llvm::any_of(steps, [](func::FuncOp f) {
          return !f.getBody().hasOneBlock();
        })) {
      module.emitError("tessel-propagate-sharding: no single-block "
                       "@train_step (run tessel-autodiff first) or "
                       "@decode_step");
      return signalPassFailure();
    }
    for (func::FuncOp func : steps)
      if (failed(Propagator(module).run(func)))
        return signalPassFailure();
  }
};

} // namespace
