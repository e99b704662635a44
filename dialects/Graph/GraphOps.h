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

#include "dialects/Graph/GraphDialect.h.inc"
#include "dialects/Graph/GraphInterfaces.h.inc"

#define GET_OP_CLASSES
#include "dialects/Graph/GraphOps.h.inc"

#endif // TESSEL_DIALECTS_GRAPH_GRAPHOPS_H
