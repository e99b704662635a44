//===- GraphInterfaces.td - Gradient interface --------------*- tablegen -*-===//
#ifndef TESSEL_GRAPH_INTERFACES
#define TESSEL_GRAPH_INTERFACES

include "mlir/IR/OpBase.td"

def GradientOpInterface : OpInterface<"GradientOpInterface"> {
  let cppNamespace = "::tessel::graph";
  let description = [{
    An op that knows its reverse-mode derivative. Given the gradient of each
    result (a null Value where a result does not reach the loss), it builds
    ops after itself that compute the gradient of each operand, and appends
    them to `operandGrads` in operand order (a null Value for an operand that
    has no gradient, such as token ids).
  }];
  let methods = [
    InterfaceMethod<
      "Builds the gradients of the operands from those of the results.",
      "::llvm::LogicalResult", "buildGradients",
      (ins "::mlir::OpBuilder &":$builder,
           "::llvm::ArrayRef<::mlir::Value>":$resultGrads,
           "::llvm::SmallVectorImpl<::mlir::Value> &":$operandGrads)>
  ];
}

#endif // TESSEL_GRAPH_INTERFACES
