//===- ModelBuilder.h - Spec to graph IR ------------------------*- C++ -*-===//
#ifndef TESSEL_FRONTEND_MODELBUILDER_H
#define TESSEL_FRONTEND_MODELBUILDER_H

#include "tessel/Frontend/Spec.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/OwningOpRef.h"

namespace tessel {

// Expands the model of `spec` into a module holding `func.func @forward()
// -> tensor<f32>` in the graph dialect, with global shapes, Hugging Face
// parameter names and the optimizer settings as `graph.optimizer`.
mlir::OwningOpRef<mlir::ModuleOp> buildModel(mlir::MLIRContext &context,
                                             const Spec &spec);

} // namespace tessel

#endif // TESSEL_FRONTEND_MODELBUILDER_H
