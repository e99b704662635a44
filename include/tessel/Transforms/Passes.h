//===- Passes.h - Tessel's passes -------------------------------*- C++ -*-===//
#ifndef TESSEL_TRANSFORMS_PASSES_H
#define TESSEL_TRANSFORMS_PASSES_H

#include "dialects/Dist/DistOps.h"
#include "dialects/Graph/GraphOps.h"
#include "dialects/Pipe/PipeOps.h"
#include "dialects/Rt/RtOps.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/Pass/Pass.h"

namespace tessel {

#define GEN_PASS_DECL
#include "tessel/Transforms/Passes.h.inc"

#define GEN_PASS_REGISTRATION
#include "tessel/Transforms/Passes.h.inc"

// The part a rank program's call runs ("forward", "backward", "update":
// the callee's rt.part, set by convert-pipe-to-rt); empty for another call.
inline llvm::StringRef partOf(mlir::ModuleOp program, mlir::func::CallOp call) {
  auto fn = program.lookupSymbol<mlir::func::FuncOp>(call.getCallee());
  auto part =
      fn ? fn->getAttrOfType<mlir::StringAttr>("rt.part") : mlir::StringAttr();
  return part ? part.getValue() : llvm::StringRef();
}

// The steps sharding propagation and the partition work on: @train_step,
// or an inference program's @decode_step and @prefill_step (those present).
inline llvm::SmallVector<mlir::func::FuncOp>
stepFunctions(mlir::ModuleOp module) {
  if (auto train = module.lookupSymbol<mlir::func::FuncOp>("train_step"))
    return {train};
  llvm::SmallVector<mlir::func::FuncOp> steps;
  for (llvm::StringRef name : {"decode_step", "prefill_step"})
    if (auto step = module.lookupSymbol<mlir::func::FuncOp>(name))
      steps.push_back(step);
  return steps;
}

// The kernel fusions of tessel-fuse-kernels, for other drivers.
void populateFuseKernelsPatterns(mlir::RewritePatternSet &patterns);

} // namespace tessel

#endif // TESSEL_TRANSFORMS_PASSES_H
