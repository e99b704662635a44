//===- Passes.td - Tessel's conversions ---------------------*- tablegen -*-===//
#ifndef TESSEL_CONVERSION_PASSES
#define TESSEL_CONVERSION_PASSES

include "mlir/Pass/PassBase.td"

def ConvertGraphToRt : Pass<"convert-graph-to-rt", "mlir::ModuleOp"> {
  let summary = "Gives every tensor a buffer and every op its runtime call";
  let description = [{
    The per-rank program (after tessel-stage-regions) is bufferized: each
    tensor becomes a `memref` (a fresh `rt.alloc`, or a view of another
    buffer where the op only reinterprets it), each `graph` op the `rt`
    kernel that computes it with every size known (GraphToRt), each `dist`
    op its collective or point-to-point call (DistToRt), parameters
    `rt.param` with what the runtime needs to initialise and save them.
    The `pipe` parts keep their structure with buffer types. A collective
    reduces its operand in place when nothing else reads it.
  }];
  let dependentDialects = ["::tessel::rtir::RtDialect",
                           "::tessel::dist::DistDialect"];
}

def ConvertPipeToRt : Pass<"convert-pipe-to-rt", "mlir::ModuleOp"> {
  let summary = "Turns a rank's parts into functions called in schedule order";
  let description = [{
    After buffer planning, each `pipe.forward_pass`, `pipe.backward_pass`
    and `pipe.update` of a rank program becomes a function of its own
    (taking the microbatch and whether it is the part's first run), and
    the program's step calls them in the order the rank's `pipe.schedule`
    gives: every microbatch's forward and backward, then the update once.
    What the rank function holds outside its parts (a parameter sent to or
    received from another rank once per step) runs first.
    A part's `rt.microbatch` and `rt.first_run` become the function's
    arguments; the step ends by waiting for its sends and handing the loss
    and norm to the runtime.
  }];
  let dependentDialects = ["::tessel::rtir::RtDialect",
                           "::mlir::func::FuncDialect",
                           "::mlir::arith::ArithDialect"];
}

def ConvertRtToEmitC : Pass<"convert-rt-to-emitc", "mlir::ModuleOp"> {
  let summary = "Turns each rank program into the emitc module of its source";
  let description = [{
    Each rank program (a nested module after convert-pipe-to-rt) becomes
    an emitc module that `mlir::emitc::translateToCpp` prints as one C++ or
    CUDA source: the runtime's includes, the parameter table, one function
    per part taking the step context (`StepContext &`), every buffer an
    address in one of the step's stores, every rt op one call of its
    runtime function, and a `main` that describes the program to the
    runtime. What differs between the CPU and CUDA targets is asked of
    their TargetInfo (lib/Conversion/RtToEmitC/TargetInfo.cpp).
  }];
  let options = [
    Option<"target", "target", "std::string", "\"cpu\"",
           "cpu or cuda">,
    Option<"cudaArch", "cuda-arch", "int", "90",
           "The GPU architecture a CUDA program is built for (sm_N)">,
    Option<"gradientCheck", "gradient-check", "bool", "false",
           "A gradient check: no optimizer step, and main() compares the "
           "gradients with finite differences (gradientCheckMain)">,
  ];
  let dependentDialects = ["::mlir::emitc::EmitCDialect"];
}

#endif // TESSEL_CONVERSION_PASSES
