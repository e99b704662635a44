//===- PipeDialect.td - The pipe dialect --------------------*- tablegen -*-===//
#ifndef TESSEL_PIPE_DIALECT
#define TESSEL_PIPE_DIALECT

include "mlir/IR/OpBase.td"
include "mlir/IR/AttrTypeBase.td"

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

    A module's pipeline settings are its `pipe.layout` attribute; the
    number of pipeline ranks is the `pp` axis of its `dist.mesh`.
  }];
  let useDefaultAttributePrinterParser = 1;
  let hasOperationAttrVerify = 1;
  let extraClassDeclaration = [{
    static constexpr ::llvm::StringLiteral kLayoutAttrName = "pipe.layout";
  }];
}

def Pipe_LayoutAttr : AttrDef<Pipe_Dialect, "Layout"> {
  let mnemonic = "layout";
  let summary = "How a training step is cut into microbatches and stages";
  let description = [{
    `microbatches` per step (gradients accumulate over them), the schedule
    that orders them on each pipeline rank (`gpipe`, `1f1b` or
    `interleaved`), the model chunks per pipeline rank (`virtual_stages`),
    and optionally the stage of each transformer block (`layer_stages`;
    absent: balanced by cost).

    ```mlir
    module attributes {pipe.layout = #pipe.layout<microbatches = 4, schedule = "1f1b", virtual_stages = 1>} {}
    module attributes {pipe.layout = #pipe.layout<microbatches = 2, schedule = "1f1b", virtual_stages = 1, layer_stages = [0, 0, 0, 1]>} {}
    ```
  }];
  let parameters = (ins "int64_t":$microbatches, StringRefParameter<>:$schedule,
                    "int64_t":$virtual_stages,
                    OptionalArrayRefParameter<"int64_t">:$layer_stages);
  let assemblyFormat = [{
    `<` `microbatches` `=` $microbatches `,` `schedule` `=` $schedule `,`
    `virtual_stages` `=` $virtual_stages
    (`,` `layer_stages` `=` `[` $layer_stages^ `]`)? `>`
  }];
  let genVerifyDecl = 1;
}

class Pipe_Op<string mnemonic, list<Trait> traits = []>
    : Op<Pipe_Dialect, mnemonic, traits>;

#endif // TESSEL_PIPE_DIALECT
