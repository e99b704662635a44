//===- GraphOps.h - The graph dialect ---------------------------*- C++ -*-===//
#ifndef TESSEL_DIALECTS_GRAPH_GRAPHOPS_H
#define TESSEL_DIALECTS_GRAPH_GRAPHOPS_H

#include "mlir/Bytecode/BytecodeOpInterface.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/BuiltinTypes.h"
#include "mlir/IR/Dialect.h"
#include "mlir/IR/OpDefinition.h"
#include "mlir/Interfaces/InferTypeOpInterface.h"
#include "mlir/Interfaces/SideEffectInterfaces.h"

#include "dialects/Dist/ShardingContext.h"

#include "dialects/Graph/GraphDialect.h.inc"
#include "dialects/Graph/GraphEnums.h.inc"
#define GET_ATTRDEF_CLASSES
#include "dialects/Graph/GraphAttrs.h.inc"
#include "dialects/Graph/GraphInterfaces.h.inc"

#define GET_OP_CLASSES
#include "dialects/Graph/GraphOps.h.inc"

namespace tessel::graph {

// Where an op sits: its part of the model and of the step (null when unset).
LayerAttr layerOf(mlir::Operation *op);
std::optional<Phase> phaseOf(mlir::Operation *op);
void setLayer(mlir::Operation *op, LayerAttr layer);
void setPhase(mlir::Operation *op, Phase phase);
// Gives `op` the layer and phase of `from` (ops a pass adds for another).
void copyPlacement(mlir::Operation *from, mlir::Operation *op);

// Stamps the given layer and phase on every op created through the builder
// it listens to (frontend: the layer being built; autodiff: the forward op
// being differentiated).
class PlacementListener : public mlir::OpBuilder::Listener {
public:
  LayerAttr layer;
  std::optional<Phase> phase;
  // The placement of `anchor`, for ops a pass adds on its behalf.
  static PlacementListener of(mlir::Operation *anchor) {
    PlacementListener listener;
    listener.layer = layerOf(anchor);
    listener.phase = phaseOf(anchor);
    return listener;
  }
  void notifyOperationInserted(mlir::Operation *op,
                               mlir::OpBuilder::InsertPoint) override {
    if (layer)
      setLayer(op, layer);
    if (phase)
      setPhase(op, *phase);
  }
};

} // namespace tessel::graph

#endif // TESSEL_DIALECTS_GRAPH_GRAPHOPS_H
