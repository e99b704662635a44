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

def ShardingRuleOpInterface : OpInterface<"ShardingRuleOpInterface"> {
  let cppNamespace = "::tessel::graph";
  let description = [{
    An op that knows how it can be spread over a device mesh: how its
    dimensions follow its operands' shardings, which shardings it needs of
    them, and how its per-rank form is built. Tessel's sharding propagation
    and partition passes are drivers over this interface (as upstream's
    ShardingInterface and Shardy's per-op rules); the rules of all graph ops
    live in dialects/Graph/GraphSharding.cpp.
  }];
  let methods = [
    InterfaceMethod<[{
        Reads the shardings of the operands (`context.get`), states those it
        needs them in (`context.require`, which reshards an operand that has
        another) and sets those of the results (`context.set`). Partial sums
        are reduced as late as possible: a rule that can take a partial
        operand passes the partial axes on. Fails, at the op, when the
        operands cannot be reconciled.
      }],
      "::llvm::LogicalResult", "propagateSharding",
      (ins "::tessel::dist::ShardingContext &":$context)>,
    InterfaceMethod<[{
        Runs once the op and its operands have their local (per-rank) types:
        makes the op compute this rank's piece where the local types alone
        do not say how (a vocabulary slice, a loss over split tokens, the KV
        head of this rank's query heads, the axes a gradient's squares are
        summed over).
      }],
      "::llvm::LogicalResult", "localize",
      (ins "::tessel::dist::PartitionContext &":$context), [{}],
      [{ return ::mlir::success(); }]>,
  ];
}

#endif // TESSEL_GRAPH_INTERFACES
