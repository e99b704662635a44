//===- Float64.cpp - The whole program in float64 -------------------------===//
//
// For gradient checks: every f32 tensor of the graph becomes f64, so that
// central finite differences of the loss are accurate to ~1e-10 and the
// gradients the compiled step computes can be compared with them.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"

namespace tessel {
#define GEN_PASS_DEF_FLOAT64
#include "tessel/Transforms/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;

namespace {

Type widen(Type type) {
  auto tensor = dyn_cast<RankedTensorType>(type);
  if (!tensor || !tensor.getElementType().isF32())
    return type;
  return RankedTensorType::get(tensor.getShape(),
                               Float64Type::get(type.getContext()));
}

struct Float64Pass : tessel::impl::Float64Base<Float64Pass> {
  void runOnOperation() override {
    getOperation().walk([](Operation *op) {
      for (Value r : op->getResults())
        r.setType(widen(r.getType()));
      for (Region &region : op->getRegions())
        for (Block &block : region)
          for (BlockArgument arg : block.getArguments())
            arg.setType(widen(arg.getType()));
      if (auto func = dyn_cast<func::FuncOp>(op)) {
        FunctionType type = func.getFunctionType();
        SmallVector<Type> inputs, results;
        for (Type t : type.getInputs())
          inputs.push_back(widen(t));
        for (Type t : type.getResults())
          results.push_back(widen(t));
        func.setFunctionType(
            FunctionType::get(op->getContext(), inputs, results));
      }
    });
  }
};

} // namespace
