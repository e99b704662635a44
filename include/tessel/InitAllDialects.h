//===- InitAllDialects.h - Every dialect a Tessel compile uses --*- C++ -*-===//
//
// The dialects of the training pipeline, Tessel's own and the upstream ones
// it lowers through, registered once for every tool.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_INITALLDIALECTS_H
#define TESSEL_INITALLDIALECTS_H

#include "dialects/Dist/DistOps.h"
#include "dialects/Graph/GraphOps.h"
#include "dialects/Pipe/PipeOps.h"
#include "dialects/Rt/RtOps.h"

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/EmitC/IR/EmitC.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/DialectRegistry.h"
#include "mlir/IR/MLIRContext.h"

namespace tessel {

inline void registerAllDialects(mlir::DialectRegistry &registry) {
  registry.insert<graph::GraphDialect, dist::DistDialect, pipe::PipeDialect,
                  rtir::RtDialect, mlir::func::FuncDialect,
                  mlir::arith::ArithDialect, mlir::emitc::EmitCDialect>();
}

// A context with every dialect loaded (the compiler builds IR in all of
// them, so none is loaded lazily).
inline void loadAllDialects(mlir::MLIRContext &context) {
  mlir::DialectRegistry registry;
  registerAllDialects(registry);
  context.appendDialectRegistry(registry);
  context.loadAllAvailableDialects();
}

} // namespace tessel

#endif // TESSEL_INITALLDIALECTS_H
