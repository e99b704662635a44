//===- Passes.h - Tessel's passes -------------------------------*- C++ -*-===//
#ifndef TESSEL_TRANSFORMS_PASSES_H
#define TESSEL_TRANSFORMS_PASSES_H

#include "dialects/Dist/DistOps.h"
#include "dialects/Graph/GraphOps.h"
#include "dialects/Pipe/PipeOps.h"
#include "dialects/Rt/RtOps.h"
#include "mlir/IR/BuiltinOps.h"
#include "mlir/Pass/Pass.h"

namespace tessel {

#define GEN_PASS_DECL
#include "tessel/Transforms/Passes.h.inc"

#define GEN_PASS_REGISTRATION
#include "tessel/Transforms/Passes.h.inc"

// The kernel fusions of tessel-fuse-kernels, for other drivers.
void populateFuseKernelsPatterns(mlir::RewritePatternSet &patterns);

} // namespace tessel

#endif // TESSEL_TRANSFORMS_PASSES_H
