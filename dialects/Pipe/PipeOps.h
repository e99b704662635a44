//===- PipeOps.h - The pipe dialect -----------------------------*- C++ -*-===//
#ifndef TESSEL_DIALECTS_PIPE_PIPEOPS_H
#define TESSEL_DIALECTS_PIPE_PIPEOPS_H

#include "mlir/Bytecode/BytecodeOpInterface.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/BuiltinAttributes.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/Dialect.h"
#include "mlir/IR/OpDefinition.h"
#include "mlir/Interfaces/SideEffectInterfaces.h"
#include "tessel/Support/MeshLayout.h"

#include "dialects/Pipe/PipeDialect.h.inc"
#define GET_ATTRDEF_CLASSES
#include "dialects/Pipe/PipeAttrs.h.inc"

#define GET_OP_CLASSES
#include "dialects/Pipe/PipeOps.h.inc"

namespace tessel::pipe {

// Where stages run is MeshLayout's (tessel/Support/MeshLayout.h): the
// layout of `ranks` pipeline ranks holding `virtualStages` chunks each.
inline MeshLayout pipelineLayout(int64_t ranks, int64_t virtualStages = 1) {
  MeshShape shape;
  shape[MeshAxis::PP] = ranks;
  return MeshLayout(shape, virtualStages);
}

constexpr const char *kScheduleKinds[] = {"gpipe", "1f1b", "interleaved"};

// The module's pipeline settings; one microbatch, 1F1B, one chunk per rank
// when it has none.
LayoutAttr layoutOf(mlir::Operation *op);
void setLayout(mlir::ModuleOp module, LayoutAttr layout);
// How many microbatches' activations a rank running `steps` holds at once
// (1F1B: the p - r in flight at rank r; GPipe: all of them).
int64_t activationSlots(RankOp steps, int64_t microbatches);
// The same for a rank's compute steps in order, each (a forward?, its
// microbatch).
int64_t activationSlots(llvm::ArrayRef<std::pair<bool, int64_t>> steps,
                        int64_t microbatches);
constexpr const char *kActivation = "activation";
constexpr const char *kGradient = "gradient";

} // namespace tessel::pipe

#endif // TESSEL_DIALECTS_PIPE_PIPEOPS_H
