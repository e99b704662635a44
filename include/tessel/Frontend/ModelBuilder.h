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

// The training recipe the runtime of the compiled programs needs (the
// spec's name, global batch, sequence length, vocabulary, steps, seed,
// clipping, learning rate and its schedule, AdamW settings), as the
// module's `graph.recipe` dictionary.
// The inference steps of the spec's model (tessel compile --inference):
// @decode_step, the forward pass of one new token of each of `batch`
// sequences over a KV cache of model.seq_len positions, and with
// `prefillChunk` > 1 @prefill_step, the same over that many tokens.
mlir::OwningOpRef<mlir::ModuleOp>
buildInferenceModel(mlir::MLIRContext &context, const Spec &spec,
                    int64_t batch, int64_t prefillChunk);

void setRecipe(mlir::ModuleOp module, const Spec &spec, bool fromSpec = true);
// For a graph given as .mlir: the recipe of `spec` (defaults) with the
// batch, sequence length and vocabulary the graph's inputs and loss have.
void setRecipeFromGraph(mlir::ModuleOp module, Spec spec);

} // namespace tessel

#endif // TESSEL_FRONTEND_MODELBUILDER_H
