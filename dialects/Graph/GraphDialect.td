//===- GraphDialect.td - The graph dialect ------------------*- tablegen -*-===//
#ifndef TESSEL_GRAPH_DIALECT
#define TESSEL_GRAPH_DIALECT

include "mlir/IR/OpBase.td"
include "mlir/IR/AttrTypeBase.td"
include "mlir/IR/EnumAttr.td"
include "mlir/IR/OpBase.td"
include "GraphInterfaces.td"

def Graph_Dialect : Dialect {
  let name = "graph";
  let cppNamespace = "::tessel::graph";
  let summary = "Model and training math on tensors with global shapes";
  let description = [{
    The `graph` dialect holds what a model computes, independent of how it is
    spread over devices: parameters, embeddings, matmuls, norms, attention,
    the loss, their gradients and the optimizer update. Ops are deliberately
    coarse (attention, layer norm, cross-entropy) so that they map onto fused
    kernels and carry known sharding rules. Every op verifies its shapes; ops
    with a computable result type infer it.

    Two dialect attributes place an op in the model and the step:
    `graph.layer` (set by the frontend: which part of the model an op
    computes) and `graph.phase` (set by autodiff: forward, backward or the
    optimizer update). Passes that add ops copy them from the op they work
    for; pipeline stages are cut by layer and scheduled by phase.
    `graph.recompute` (a unit attribute, set by the frontend) marks a forward
    op whose result the backward makes again rather than keeps (selective
    recomputation: the attention scores and probabilities).
  }];
  let useDefaultAttributePrinterParser = 1;
  let hasOperationAttrVerify = 1;
  let extraClassDeclaration = [{
    static constexpr ::llvm::StringLiteral kLayerAttrName = "graph.layer";
    static constexpr ::llvm::StringLiteral kPhaseAttrName = "graph.phase";
    static constexpr ::llvm::StringLiteral kRecomputeAttrName =
        "graph.recompute";
  }];
}

def Graph_LayerKind : I32EnumAttr<"LayerKind", "part of the model", [
    I32EnumAttrCase<"Embedding", 0, "embedding">,
    I32EnumAttrCase<"Block", 1, "block">,
    I32EnumAttrCase<"Head", 2, "head">]> {
  let cppNamespace = "::tessel::graph";
  let genSpecializedAttr = 0;
}

def Graph_LayerAttr : AttrDef<Graph_Dialect, "Layer"> {
  let mnemonic = "layer";
  let summary = "Which part of the model an op computes";
  let description = [{
    The input embedding, transformer block `index`, or the head (final norm,
    LM head and loss). Pipeline stages are cut along these.

    ```mlir
    #graph.layer<embedding>
    #graph.layer<block 3>
    #graph.layer<head>
    ```
  }];
  let parameters = (ins EnumParameter<Graph_LayerKind>:$kind,
                    DefaultValuedParameter<"int64_t", "0">:$index);
  let hasCustomAssemblyFormat = 1;
  let extraClassDeclaration = [{
    static LayerAttr block(::mlir::MLIRContext *ctx, int64_t index) {
      return get(ctx, LayerKind::Block, index);
    }
  }];
}

def Graph_Phase : I32EnumAttr<"Phase", "part of the training step", [
    I32EnumAttrCase<"Forward", 0, "forward">,
    I32EnumAttrCase<"Backward", 1, "backward">,
    I32EnumAttrCase<"Update", 2, "update">]> {
  let cppNamespace = "::tessel::graph";
  let genSpecializedAttr = 0;
}

def Graph_PhaseAttr : EnumAttr<Graph_Dialect, Graph_Phase, "phase"> {
  let assemblyFormat = "`<` $value `>`";
}

// Every graph op has a sharding rule; `rules` names the optional methods of
// ShardingRuleOpInterface the op implements too (e.g. "localize").
class Graph_Op<string mnemonic, list<Trait> traits = [],
               list<string> rules = []>
    : Op<Graph_Dialect, mnemonic,
         !listconcat(traits,
                     [DeclareOpInterfaceMethods<ShardingRuleOpInterface,
                                                rules>])>;

#endif // TESSEL_GRAPH_DIALECT
