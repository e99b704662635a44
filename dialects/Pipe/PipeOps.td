//===- PipeOps.td - Ops of the pipe dialect -----------------*- tablegen -*-===//
#ifndef TESSEL_PIPE_OPS
#define TESSEL_PIPE_OPS

include "PipeDialect.td"
include "mlir/IR/RegionKindInterface.td"
include "mlir/Interfaces/ControlFlowInterfaces.td"
include "mlir/Interfaces/SideEffectInterfaces.td"

def Pipe_Id : ConfinedAttr<I64Attr, [IntNonNegative]>;
def Pipe_Count : ConfinedAttr<I64Attr, [IntMinValue<1>]>;

def Pipe_ScheduleOp : Pipe_Op<"schedule", [NoTerminator, SingleBlock]> {
  let summary = "A pipeline schedule: one pipe.rank per pipeline rank";
  let description = [{
    `ranks` pipeline ranks run `ranks * virtual_stages` stages over
    `microbatches` microbatches; `kind` names the generator
    (`"gpipe"`, `"1f1b"` or `"interleaved"`) and is informative. The body
    holds exactly one `pipe.rank` per rank, in rank order.

    The verifier checks each rank's list on its own: ids in range, every
    (stage, microbatch) forward and backward exactly once on the rank owning
    the stage, a backward after the forward of the same stage and
    microbatch, and sends and receives between the ranks of neighbouring
    stages. Whether the sends and receives of different ranks match and the
    schedule is free of deadlock is checked by simulating all ranks
    (`tessel-schedule --check`).

    ```mlir
    pipe.schedule "gpipe" ranks 2 microbatches 1 virtual_stages 1 {
      pipe.rank 0 {
        pipe.forward stage 0 microbatch 0
        pipe.send "activation" stage 0 microbatch 0 to 1
        pipe.recv "gradient" stage 1 microbatch 0 from 1
        pipe.backward stage 0 microbatch 0
      }
      pipe.rank 1 {
        pipe.recv "activation" stage 0 microbatch 0 from 0
        pipe.forward stage 1 microbatch 0
        pipe.backward stage 1 microbatch 0
        pipe.send "gradient" stage 1 microbatch 0 to 0
      }
    }
    ```
  }];
  let arguments = (ins StrAttr:$kind, Pipe_Count:$ranks,
                   Pipe_Count:$microbatches, Pipe_Count:$virtual_stages);
  let regions = (region SizedRegion<1>:$body);
  let assemblyFormat = [{
    $kind `ranks` $ranks `microbatches` $microbatches
    `virtual_stages` $virtual_stages attr-dict-with-keyword $body
  }];
  let hasVerifier = 1;
  let hasRegionVerifier = 1;
  let extraClassDeclaration = [{
    int64_t getNumStages() { return getRanks() * getVirtualStages(); }
  }];
}

def Pipe_RankOp : Pipe_Op<"rank", [NoTerminator, SingleBlock,
                                   HasParent<"ScheduleOp">]> {
  let summary = "The ordered steps of one pipeline rank";
  let description = [{
    Steps run in order; `pipe.recv` blocks until the matching send has been
    issued, `pipe.send` does not block (it is buffered).

    ```mlir
    pipe.rank 1 {
      pipe.recv "activation" stage 0 microbatch 0 from 0
      pipe.forward stage 1 microbatch 0
    }
    ```
  }];
  let arguments = (ins Pipe_Id:$rank);
  let regions = (region SizedRegion<1>:$body);
  let assemblyFormat = "$rank attr-dict-with-keyword $body";
}

class Pipe_ComputeOp<string mnemonic> : Pipe_Op<mnemonic, [HasParent<"RankOp">]> {
  let arguments = (ins Pipe_Id:$stage, Pipe_Id:$microbatch);
  let assemblyFormat = "`stage` $stage `microbatch` $microbatch attr-dict";
}

def Pipe_ForwardOp : Pipe_ComputeOp<"forward"> {
  let summary = "The forward pass of one stage on one microbatch";
  let description = [{
    ```mlir
    pipe.forward stage 1 microbatch 3
    ```
  }];
}

def Pipe_BackwardOp : Pipe_ComputeOp<"backward"> {
  let summary = "The backward pass of one stage on one microbatch";
  let description = [{
    ```mlir
    pipe.backward stage 1 microbatch 3
    ```
  }];
}

class Pipe_TransferOp<string mnemonic>
    : Pipe_Op<mnemonic, [HasParent<"RankOp">]> {
  let hasVerifier = 1;
}

def Pipe_SendOp : Pipe_TransferOp<"send"> {
  let arguments = (ins StrAttr:$kind, Pipe_Id:$stage, Pipe_Id:$microbatch,
                   Pipe_Id:$to_rank);
  let summary = "Sends what a stage produced for a microbatch to another rank";
  let description = [{
    `stage` is the producing stage: an `"activation"` is the output of
    `stage`'s forward, sent to the rank of `stage + 1`; a `"gradient"` is
    the input gradient of `stage`'s backward, sent to the rank of
    `stage - 1`. Non-blocking.

    ```mlir
    pipe.send "activation" stage 0 microbatch 2 to 1
    ```
  }];
  let assemblyFormat = [{
    $kind `stage` $stage `microbatch` $microbatch `to` $to_rank attr-dict
  }];
}

def Pipe_RecvOp : Pipe_TransferOp<"recv"> {
  let arguments = (ins StrAttr:$kind, Pipe_Id:$stage, Pipe_Id:$microbatch,
                   Pipe_Id:$from_rank);
  let summary = "Receives what a stage of another rank produced for a microbatch";
  let description = [{
    Matches the `pipe.send` with the same kind, stage and microbatch on rank
    `from_rank` whose `to_rank` is this rank; blocks until it is issued.

    ```mlir
    pipe.recv "activation" stage 0 microbatch 2 from 0
    ```
  }];
  let assemblyFormat = [{
    $kind `stage` $stage `microbatch` $microbatch `from` $from_rank attr-dict
  }];
}

//===----------------------------------------------------------------------===//
// A rank's program, cut into the parts a schedule runs
//===----------------------------------------------------------------------===//

class Pipe_PassOp<string mnemonic>
    : Pipe_Op<mnemonic, [SingleBlockImplicitTerminator<"YieldOp">,
                         RecursiveMemoryEffects]> {
  let arguments = (ins Pipe_Id:$chunk);
  let results = (outs Variadic<AnyType>:$results);
  let regions = (region SizedRegion<1>:$body);
  let assemblyFormat = [{
    `chunk` $chunk (`->` type($results)^)? attr-dict-with-keyword $body
  }];
  let hasVerifier = 1;
}

def Pipe_ForwardPassOp : Pipe_PassOp<"forward_pass"> {
  let summary = "The forward pass of one model chunk on one microbatch";
  let description = [{
    The ops of a rank's stage `chunk` (the rank's `chunk`-th model chunk)
    that run forward, for one microbatch. The schedule runs the region once
    per microbatch; its results are that microbatch's values that a later
    part reads (activations its backward pass needs, the loss).

    ```mlir
    %x, %loss = pipe.forward_pass chunk 0 -> tensor<2x4x8xf32>, tensor<f32> {
      ...
      pipe.yield %h, %l : tensor<2x4x8xf32>, tensor<f32>
    }
    ```
  }];
}

def Pipe_BackwardPassOp : Pipe_PassOp<"backward_pass"> {
  let summary = "The backward pass of one model chunk on one microbatch";
  let description = [{
    The ops of a rank's stage `chunk` that run backward, for one microbatch,
    reading the results of the forward pass of the same chunk (those of the
    same microbatch). Its results are the microbatch's contributions to the
    gradients that the update reads.

    ```mlir
    %dw = pipe.backward_pass chunk 0 -> tensor<8x8xf32> {
      ...
      pipe.yield %g : tensor<8x8xf32>
    }
    ```
  }];
}

def Pipe_UpdateOp : Pipe_Op<"update", [SingleBlockImplicitTerminator<"YieldOp">,
                                       RecursiveMemoryEffects]> {
  let summary = "What a rank runs once per step, after every microbatch";
  let description = [{
    The block's arguments are the `inputs` summed over the step's
    microbatches (gradient accumulation; with one microbatch they are the
    inputs themselves, which may then also be requests of collectives still
    in flight). The region synchronises gradients, computes the norm and
    updates the parameters; its results are the step's loss and gradient
    norm.

    ```mlir
    %loss, %norm = pipe.update(%dw, %l : tensor<8x8xf32>, tensor<f32>) -> tensor<f32>, tensor<f32> {
    ^bb0(%g: tensor<8x8xf32>, %lsum: tensor<f32>):
      ...
      pipe.yield %lsum, %n : tensor<f32>, tensor<f32>
    }
    ```
  }];
  let arguments = (ins Variadic<AnyType>:$inputs);
  let results = (outs Variadic<AnyType>:$results);
  let regions = (region SizedRegion<1>:$body);
  let assemblyFormat = [{
    `(` ($inputs^ `:` type($inputs))? `)` (`->` type($results)^)?
    attr-dict-with-keyword $body
  }];
  let hasVerifier = 1;
}

def Pipe_YieldOp : Pipe_Op<"yield", [Pure, Terminator,
    ParentOneOf<["ForwardPassOp", "BackwardPassOp", "UpdateOp"]>]> {
  let summary = "The values a part of the step hands on";
  let description = [{
    ```mlir
    pipe.yield %h, %loss : tensor<2x4x8xf32>, tensor<f32>
    ```
  }];
  let arguments = (ins Variadic<AnyType>:$values);
  let builders = [OpBuilder<(ins), [{ build($_builder, $_state, {}); }]>];
  let assemblyFormat = "($values^ `:` type($values))? attr-dict";
}

#endif // TESSEL_PIPE_OPS
