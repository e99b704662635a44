//===- tessel-opt.cpp - mlir-opt with every Tessel dialect and pass ------===//
#include "tessel/InitAllDialects.h"
#include "tessel/InitAllPasses.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/DialectRegistry.h"
#include "mlir/Tools/mlir-opt/MlirOptMain.h"
#include "mlir/Transforms/Passes.h"

int main(int argc, char **argv) {
  mlir::registerTransformsPasses();
  tessel::registerAllPasses();
  mlir::DialectRegistry registry;
  tessel::registerAllDialects(registry);
  return mlir::asMainReturnCode(
      mlir::MlirOptMain(argc, argv, "Tessel optimizer driver\n", registry));
}
