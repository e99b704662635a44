//===- Passes.td - Tessel's passes --------------------------*- tablegen -*-===//
#ifndef TESSEL_TRANSFORMS_PASSES
#define TESSEL_TRANSFORMS_PASSES

include "mlir/Pass/PassBase.td"

def Autodiff : Pass<"tessel-autodiff", "mlir::ModuleOp"> {
  let summary = "Builds the training step from the forward program";
  let description = [{
    Differentiates `@forward` (which returns the scalar loss) in reverse mode
    through each op's GradientOpInterface, sums the gradients of values with
    several uses, and appends the global gradient norm and one `graph.adamw`
    per parameter. The function becomes `@train_step`, returning the loss and
    the gradient norm. Optimizer settings come from the function's
    `graph.optimizer` dictionary when present, else from the pass options.
  }];
  let dependentDialects = ["::tessel::graph::GraphDialect"];
  let options = [
    Option<"beta1", "beta1", "double", "0.9", "AdamW beta1">,
    Option<"beta2", "beta2", "double", "0.95", "AdamW beta2">,
    Option<"eps", "eps", "double", "1e-8", "AdamW epsilon">,
    Option<"weightDecay", "weight-decay", "double", "0.1",
           "AdamW weight decay (applied to parameters of rank >= 2)">,
    Option<"gradClip", "grad-clip", "double", "1.0",
           "Maximum global gradient norm (<= 0: no clipping)">,
  ];
}

def PlanBuffers : Pass<"tessel-plan-buffers", "mlir::ModuleOp"> {
  let summary = "Assigns every tensor of the training step a static buffer";
  let description = [{
    Parameters get offsets into the parameter store (their gradients the same
    offsets in the gradient store). Every other value gets an offset in one
    activation arena, reusing memory once a value's last use has passed
    (first-fit by liveness). Reshapes alias their input. A parameter's final
    gradient is written straight into the gradient store. Results are
    recorded as `tessel.buffer` attributes: one `[space, offset]` pair per
    result, where space 0 is the arena (bytes), 1 the parameter store and 2
    the gradient store (elements), 3 an input.
  }];
  let dependentDialects = ["::tessel::graph::GraphDialect"];
}

#endif // TESSEL_TRANSFORMS_PASSES
