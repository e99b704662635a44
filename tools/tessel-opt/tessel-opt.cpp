//===- tessel-opt.cpp - mlir-opt with every Tessel dialect and pass ------===//
#include "dialects/Dist/DistOps.h"
#include "dialects/Graph/GraphOps.h"
#include "dialects/Pipe/PipeOps.h"
#include "tessel/Transforms/Passes.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/DialectRegistry.h"
#include "mlir/Tools/mlir-opt/MlirOptMain.h"
#include "mlir/Transforms/Passes.h"

int main(int argc, char **argv) {
  mlir::registerTransformsPasses();
  tessel::registerTesselPasses();
  mlir::DialectRegistry registry;
  registry.insert<tessel::graph::GraphDialect, tessel::dist::DistDialect,
                  tessel::pipe::PipeDialect, mlir::func::FuncDialect>();
  return mlir::asMainReturnCode(
      mlir::MlirOptMain(argc, argv, "Tessel optimizer driver\n", registry));
}
