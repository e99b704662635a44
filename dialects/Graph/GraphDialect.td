//===- GraphDialect.td - The graph dialect ------------------*- tablegen -*-===//
#ifndef TESSEL_GRAPH_DIALECT
#define TESSEL_GRAPH_DIALECT

include "mlir/IR/OpBase.td"

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
  }];
}

class Graph_Op<string mnemonic, list<Trait> traits = []>
    : Op<Graph_Dialect, mnemonic, traits>;

#endif // TESSEL_GRAPH_DIALECT
