//===- PipeDialect.td - The pipe dialect --------------------*- tablegen -*-===//
#ifndef TESSEL_PIPE_DIALECT
#define TESSEL_PIPE_DIALECT

include "mlir/IR/OpBase.td"

def Pipe_Dialect : Dialect {
  let name = "pipe";
  let cppNamespace = "::tessel::pipe";
  let summary = "Pipeline-parallel schedules as explicit per-rank step lists";
  let description = [{
    The `pipe` dialect writes a pipeline schedule out in full: for every
    pipeline rank, the ordered list of forward and backward computations of
    (stage, microbatch) pairs and the point-to-point sends and receives of
    activations and gradients between them. Making the order explicit lets
    the compiler verify a schedule (coverage, ordering, matching
    communication, freedom from deadlock) and measure its bubble before
    anything runs.

    Stages are numbered `0 .. ranks * virtual_stages - 1`; stage `s` lives on
    rank `s % ranks` (Megatron's interleaved layout: rank `r` holds the model
    chunks `r, r + ranks, r + 2 * ranks, ...`).
  }];
}

class Pipe_Op<string mnemonic, list<Trait> traits = []>
    : Op<Pipe_Dialect, mnemonic, traits>;

#endif // TESSEL_PIPE_DIALECT
