//===- Autodiff.cpp - From @forward to @train_step ------------------------===//
//
// Reverse-mode differentiation of the straight-line forward program through
// GradientOpInterface, then gradient clipping and one AdamW update per
// parameter. See Passes.td for the contract.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "llvm/ADT/StringMap.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"

namespace tessel {
#define GEN_PASS_DEF_AUTODIFF
#include "tessel/Transforms/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;
using namespace tessel::graph;

namespace {

struct OptimizerSettings {
  double beta1, beta2, eps, weightDecay, gradClip;
};

// Overrides `settings` with the entries of the function's `graph.optimizer`
// dictionary (written by the frontend from the spec).
void readOptimizerAttr(func::FuncOp func, OptimizerSettings &settings) {
  auto dict = func->getAttrOfType<DictionaryAttr>("graph.optimizer");
  if (!dict)
    return;
  auto read = [&](StringRef key, double &field) {
    if (auto attr = dict.getAs<FloatAttr>(key))
      field = attr.getValueAsDouble();
  };
  read("beta1", settings.beta1);
  read("beta2", settings.beta2);
  read("eps", settings.eps);
  read("weight_decay", settings.weightDecay);
  read("grad_clip", settings.gradClip);
}

// Adds `grad` to the gradient already known for `value`.
void accumulate(OpBuilder &b, DenseMap<Value, Value> &grads, Value value,
                Value grad) {
  auto [it, inserted] = grads.try_emplace(value, grad);
  if (!inserted)
    it->second = AddOp::create(b, value.getLoc(), it->second, grad);
}

LogicalResult differentiate(func::FuncOp func, OptimizerSettings settings) {
  if (!func.getBody().hasOneBlock())
    return func.emitOpError("@forward must be a single block");
  Block &body = func.getBody().front();
  auto ret = dyn_cast<func::ReturnOp>(body.getTerminator());
  // The loss, then the metrics the function names (graph.metrics).
  auto metricNames = func->getAttrOfType<ArrayAttr>("graph.metrics");
  unsigned results = 1 + (metricNames ? metricNames.size() : 0);
  auto lossType = ret && ret.getNumOperands() == results
                      ? dyn_cast<RankedTensorType>(ret.getOperand(0).getType())
                      : RankedTensorType();
  if (!lossType || lossType.getRank() != 0 ||
      !isa<Float32Type, Float64Type>(lossType.getElementType()))
    return func.emitOpError("@forward must return the loss as tensor<f32>, "
                            "then one value per name of graph.metrics");
  Value loss = ret.getOperand(0);
  SmallVector<Value> metrics(ret.getOperands().drop_front());

  SmallVector<Operation *> forwardOps;
  SmallVector<ParamOp> params;
  // A name is a parameter's identity in checkpoints and in the runtime's
  // tables: two parameters may not share one.
  llvm::StringMap<ParamOp> byName;
  for (Operation &op : body.without_terminator()) {
    forwardOps.push_back(&op);
    if (auto param = dyn_cast<ParamOp>(op)) {
      auto [it, inserted] = byName.try_emplace(param.getName(), param);
      if (!inserted)
        return param.emitOpError("declares parameter '")
               << param.getName()
               << "' a second time; parameter names must be unique";
      params.push_back(param);
    }
  }

  for (Operation *op : forwardOps)
    setPhase(op, Phase::Forward);
  // Gradient ops take the layer of the op they differentiate.
  PlacementListener placement;
  placement.phase = Phase::Backward;
  OpBuilder b(ret);
  b.setListener(&placement);
  if (Operation *def = loss.getDefiningOp())
    placement.layer = layerOf(def);
  DenseMap<Value, Value> grads;
  grads[loss] =
      FillOp::create(b, loss.getLoc(), loss.getType(), b.getF64FloatAttr(1.0));

  for (Operation *op : llvm::reverse(forwardOps)) {
    SmallVector<Value> resultGrads;
    bool reachesLoss = false;
    for (Value result : op->getResults()) {
      resultGrads.push_back(grads.lookup(result));
      reachesLoss |= bool(resultGrads.back());
    }
    if (!reachesLoss || isa<ParamOp, InputOp, FillOp>(op))
      continue;
    auto rule = dyn_cast<GradientOpInterface>(op);
    if (!rule)
      return op->emitOpError("has no gradient rule but lies on the path to "
                             "the loss");
    SmallVector<Value> operandGrads;
    placement.layer = layerOf(op);
    if (failed(rule.buildGradients(b, resultGrads, operandGrads)))
      return failure();
    for (auto [operand, grad] : llvm::zip(op->getOperands(), operandGrads))
      if (grad) {
        // A sum of contributions belongs with the value they are for.
        if (Operation *def = operand.getDefiningOp())
          placement.layer = layerOf(def);
        accumulate(b, grads, operand, grad);
      }
  }

  SmallVector<Value> paramGrads;
  for (ParamOp param : params) {
    Value grad = grads.lookup(param.getResult());
    placement.layer = layerOf(param);
    if (!grad)
      grad = FillOp::create(b, param.getLoc(), param.getType(),
                            b.getF64FloatAttr(0.0));
    paramGrads.push_back(grad);
  }
  // A permutation that makes a parameter's gradient (GPT-2's position
  // table under context parallelism's balanced layout: the rows back in
  // sequence order) runs in the update, once per step, on the sum of the
  // microbatches' rows, which it commutes with. The rows' sum over dp and
  // gather over cp before it then run there once too, as for sequence
  // parallelism, rather than in every microbatch's backward pass.
  for (Value grad : paramGrads)
    if (auto perm = grad.getDefiningOp<ZigzagOp>(); perm && grad.use_empty())
      setPhase(perm, Phase::Update);
  // The update: the norm of all gradients, then one AdamW per parameter
  // (in the parameter's layer).
  placement.phase = Phase::Update;
  placement.layer = nullptr;
  Value norm =
      GlobalNormOp::create(b, loss.getLoc(), loss.getType(), paramGrads,
                           /*reduce_axes=*/nullptr);
  for (auto [param, grad] : llvm::zip(params, paramGrads)) {
    placement.layer = layerOf(param);
    // Decoupled weight decay on matrices only, as in GPT-2/Llama recipes.
    double decay = param.getType().getRank() >= 2 ? settings.weightDecay : 0.0;
    AdamWOp::create(
        b, param.getLoc(), param, grad, norm, b.getF64FloatAttr(settings.beta1),
        b.getF64FloatAttr(settings.beta2), b.getF64FloatAttr(settings.eps),
        b.getF64FloatAttr(decay), b.getF64FloatAttr(settings.gradClip));
  }
  b.setListener(nullptr);
  SmallVector<Value> returned = {loss, norm};
  llvm::append_range(returned, metrics);
  func::ReturnOp::create(b, ret.getLoc(), returned);
  ret.erase();
  func.setFunctionType(
      b.getFunctionType({}, ValueRange(returned).getTypes()));
  func.setSymName("train_step");
  return success();
}

struct AutodiffPass : tessel::impl::AutodiffBase<AutodiffPass> {
  using AutodiffBase::AutodiffBase;
  void runOnOperation() override {
    ModuleOp module = getOperation();
    auto forward = module.lookupSymbol<func::FuncOp>("forward");
    if (!forward) {
      module.emitError("tessel-autodiff: the module has no @forward function");
      return signalPassFailure();
    }
    OptimizerSettings settings{beta1, beta2, eps, weightDecay, gradClip};
    readOptimizerAttr(forward, settings);
    if (failed(differentiate(forward, settings)))
      signalPassFailure();
  }
};

} // namespace
