//===- Passes.td - Tessel's passes --------------------------*- tablegen -*-===//
#ifndef TESSEL_TRANSFORMS_PASSES
#define TESSEL_TRANSFORMS_PASSES

include "mlir/Pass/PassBase.td"

def SetLayout : Pass<"tessel-set-layout", "mlir::ModuleOp"> {
  let summary = "Sets the mesh and pipeline layout the passes compile for";
  let description = [{
    Writes the module's `dist.mesh`, `dist.sequence_parallel` and
    `pipe.layout` from the options given; an option left at its default
    keeps what the module says. The sharding plan (`dist.param_sharding`,
    Megatron's, written by the frontend) names mesh axes whatever their
    size, so any mesh can be chosen here. The number of microbatches is
    fixed by the graph's batch shape and can only be restated.
  }];
  let dependentDialects = ["::tessel::dist::DistDialect",
                           "::tessel::pipe::PipeDialect"];
  let options = [
    Option<"dp", "dp", "int64_t", "0", "Data-parallel degree (0: keep)">,
    Option<"tp", "tp", "int64_t", "0", "Tensor-parallel degree (0: keep)">,
    Option<"pp", "pp", "int64_t", "0", "Pipeline ranks (0: keep)">,
    Option<"sp", "sp", "std::string", "\"\"",
           "Sequence parallelism: true or false (empty: keep)">,
    Option<"microbatches", "microbatches", "int64_t", "0",
           "Microbatches per step (0: keep; must match the graph)">,
    Option<"virtualStages", "virtual-stages", "int64_t", "0",
           "Model chunks per pipeline rank (0: keep)">,
    Option<"schedule", "schedule", "std::string", "\"\"",
           "Pipeline schedule: gpipe, 1f1b or interleaved (empty: keep)">,
  ];
}

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

def PropagateSharding : Pass<"tessel-propagate-sharding", "mlir::ModuleOp"> {
  let summary = "Gives every value of the training step a sharding";
  let description = [{
    Seeds: token inputs split along the batch over `dp`, parameters as their
    `dist.sharding` attribute says (the frontend's Megatron plan), else
    replicated. Each op's rule then derives its results' shardings from its
    operands', in program order; where an operand does not have the sharding
    the rule needs (a partial sum consumed by a non-linear op, a dimension
    that must be whole), a `dist.reshard` is inserted in front of the use:
    partial values are reduced as late as possible. Under sequence
    parallelism (`dist.sequence_parallel` on the module) a reduced
    activation is split along the sequence over `tp` instead of replicated.
    An op whose operands cannot be reconciled is an error at that op.
    Results carry `dist.sharding` (one attribute per result). Mesh axes of
    size 1 are ignored, so a one-rank mesh changes nothing.
  }];
  let dependentDialects = ["::tessel::dist::DistDialect"];
}

def Partition : Pass<"tessel-partition", "mlir::ModuleOp"> {
  let summary = "Turns the global training step into the per-rank program";
  let description = [{
    Every value gets its local type (split dimensions divided by their group
    size); `dist.reshard` becomes collectives (all_reduce for partial axes,
    reduce_scatter where the target splits a dimension, all_gather where a
    split dimension must become whole); a cross-entropy over split tokens is
    scaled so that its partial sum is the global mean; `graph.global_norm`
    records over which axes each gradient's squares must be summed.
  }];
  let dependentDialects = ["::tessel::dist::DistDialect", "::tessel::pipe::PipeDialect"];
}

def StageRegions : Pass<"tessel-stage-regions", "mlir::ModuleOp"> {
  let summary = "Cuts the step into each pipeline rank's scheduled parts";
  let description = [{
    Makes one function per pipeline rank (`@stage_N`; `@train_step` with
    one rank, marked `pipe.rank`), holding the rank's parameters and its
    parts: a `pipe.forward_pass` and a `pipe.backward_pass` per model chunk
    it holds (run once per microbatch by the schedule) and one `pipe.update`
    (run once per step on the microbatches' contributions summed). Every op
    goes to the stage of its `graph.layer` (embedding first, head last,
    blocks as the layout's `layer_stages` say, else balanced by matmul
    work; ops without a layer go with their operands) and to the part of its
    `graph.phase`; collectives that only the update reads are the update's.
    A value used on another rank is sent (`dist.send`, in the part that
    produces it) and received where it is first used; one used by a later
    part of the same rank is yielded by the part that produces it. A
    parameter read on another rank (a tied embedding read by the head) is
    sent once per step, before the parts (`dist.send`/`dist.recv` in the
    rank functions' bodies), and held there for the step; a gradient summed
    from contributions of different ranks is summed by the update, so each
    contribution crosses once per step, summed over the microbatches. What
    a backward pass needs from its forward pass is handed on, except pieces
    of parameters (cut again) and gathered activations (under sequence
    parallelism, gathered again from the piece the forward pass keeps), so
    a microbatch in flight holds a t-th of them. With `recompute=full`,
    a backward pass recomputes what it needs from its transformer block's
    forward pass (the block's ops run again, collectives included, before
    the block's backward), so a microbatch in flight keeps only what crosses
    from one block to the next (Megatron's full recompute). Each
    rank's update takes the norm of its own gradients (summed over pp too)
    and returns the loss summed over pp. Sums of scalars that only the loss
    and the metrics read (MoE blocks' load-balancing and z losses, added to
    the language model's loss) are not cut: each chunk's forward pass sums
    the terms it computes (reduced over tp where they are partial sums),
    the update adds its chunks' sums and the sums over pp add the ranks'
    parts, so no such scalar crosses between stages or chunks. Stages are balanced by each block's forward matmul
    work, an MoE block's grouped matmuls counted at their average rows
    (the block's top-k assignments).
  }];
  let options = [
    Option<"recompute", "recompute", "std::string", "\"none\"",
           "Activation recomputation: none, selective (the same with flash "
           "attention: the attention scores are never stored) or full">,
    ListOption<"recomputeBlocks", "recompute-blocks", "int64_t",
               "The transformer blocks full recompute applies to (default: "
               "all)">,
  ];
  let dependentDialects = ["::tessel::dist::DistDialect",
                           "::tessel::pipe::PipeDialect"];
}

def BucketGradients : Pass<"tessel-bucket-gradients", "mlir::ModuleOp"> {
  let summary = "Buckets gradient all-reduces and overlaps them with backward";
  let description = [{
    Gradient all-reduces (those feeding `graph.adamw`) are grouped in the
    order their gradients become final into buckets of at most
    `bucket-bytes` each; a bucket's all-reduce is started right after its
    last gradient is produced and waited for before the gradient norm.
    With several microbatches (`pipe.layout`) gradients are synchronised
    once, after the last one, so the buckets are reduced right before the
    norm instead. With pipeline stages (a `pp` axis) each stage keeps one
    collective per gradient. With `lookup-tables-alone` (ZeRO-3, which
    gathers a bucket's parameters for each part that reads them) the
    gradient of a table only embedding lookups read (an untied token
    table, GPT-2's position table) takes a bucket of its own, which is then
    gathered for the forward alone. Runs on the step before it is cut into
    parts.
  }];
  let options = [
    Option<"bucketBytes", "bucket-bytes", "int64_t", "25 << 20",
           "Largest bucket in bytes (one all-reduce call per bucket)">,
    Option<"lookupTablesAlone", "lookup-tables-alone", "bool", "false",
           "Give the gradient of a table only embedding lookups read a "
           "bucket of its own (ZeRO-3)">,
    Option<"overlap", "overlap", "bool", "true",
           "Start each bucket during backward (false: reduce the buckets "
           "right before the norm, as microbatching needs)">,
  ];
  let dependentDialects = ["::tessel::dist::DistDialect"];
}

def SchedulePipeline : Pass<"tessel-schedule-pipeline", "mlir::ModuleOp"> {
  let summary = "Writes out the order each rank runs its parts in";
  let description = [{
    Generates the schedule the module's `pipe.layout` names (GPipe, 1F1B or
    interleaved 1F1B over the `pp` ranks, its microbatches and virtual
    stages), simulates it (sends buffered, receives blocking; a schedule
    that cannot finish is an error naming the stuck ranks) and adds it to
    the module as a `pipe.schedule` op, which convert-pipe-to-rt follows.
    With one pipeline rank each microbatch's forward is followed by its
    backward.
  }];
  let dependentDialects = ["::tessel::pipe::PipeDialect"];
}

def FuseKernels : Pass<"tessel-fuse-kernels", "mlir::ModuleOp"> {
  let summary = "Fuses ops that run back to back into one kernel";
  let description = [{
    On the bufferized rank programs, before the memory plan (which then
    sees the fused kernels and the buffers they no longer need): a matmul
    and its bias add (and a GELU after it) become `rt.matmul_bias`, a
    residual add and the norm of its sum `rt.add_layer_norm_forward` or
    `rt.add_rms_norm_forward`, a norm's backward and the residual gradient
    added to its input gradient `rt.layer_norm_backward_add` or
    `rt.rms_norm_backward_add`, and a SiLU with the product that gates it
    `rt.swiglu_forward`. In the backward, a weight gradient's GEMM and the
    column sums of the output gradient it reads become
    `rt.matmul_bias_grad`, an input gradient's GEMM and the GELU backward
    of it `rt.matmul_gelu_grad`, a product added to another term
    `rt.matmul_add`, and SwiGLU's two products and SiLU backward
    `rt.swiglu_backward`, which takes the SiLU again from the gate: a
    forward part then no longer hands the SiLU on (nor writes it, when
    nothing reads it). These move a kernel past others that only read what
    it reads and never touch what it writes. A weight and bias gradient
    copied into a column block of wider ones (the q, k and v pieces of a
    fused projection, `rt.insert_axis`) are written there by their
    `rt.matmul_bias_grad` (`ldc`, `col`), the copies dropped, when nothing
    in between reads the wider buffers or writes those columns. Both
    runtimes have these
    kernels; the CUDA target always runs the pass, the CPU target with
    `--fuse-kernels`.
  }];
  let dependentDialects = ["::tessel::rtir::RtDialect"];
}

def KeepLossStatistics : Pass<"tessel-keep-loss-statistics", "mlir::ModuleOp"> {
  let summary = "Keeps the vocabulary-parallel loss's row statistics for its backward";
  let description = [{
    On the bufferized rank programs: an `rt.cross_entropy_vocab_parallel_backward`
    that reads logits a forward part hands on gets `stats`, a buffer of two
    fp32 values per row (the row's maximum and sum of exponentials over the
    vocabulary, combined over the group) that the part's
    `rt.cross_entropy_vocab_parallel_forward` writes and the part hands on
    as one more result. The backward then combines nothing again: the loss
    moves the textbook's three all-reduces of a value per row per
    microbatch, not five, for 8 bytes per row held from the forward to the
    backward (as Megatron-LM's vocabulary-parallel cross-entropy saves them).
  }];
  let dependentDialects = ["::tessel::rtir::RtDialect"];
}

def HoistParameterSlices : Pass<"tessel-hoist-parameter-slices", "mlir::ModuleOp"> {
  let summary = "Slices a parameter once per step, not once per microbatch";
  let description = [{
    On the bufferized rank programs, before the memory plan: an
    `rt.slice_axis` inside a forward or backward part whose source is a
    parameter of the step (GPT-2's fused q|k|v weight and bias, sliced for
    the q, k and v GEMMs) and whose result the part's kernels only read
    moves, with its buffer, before the step's first part, where the memory
    plan holds the buffer for the whole step; the same slice in a later part
    reads that buffer instead. A bf16 slice (cut from the weight's bf16
    copy, as `tessel-lower-precision` makes it read) lands in the weight's
    own copy slot, which no GEMM reads: it is cut into a buffer used before
    the first part only (the memory plan gives it a part's place) and
    copied into the slot after the weight's last slice. So the fp32 master
    weights stay read by their update alone. Not for parameters a part
    gathers itself (ZeRO-3), whose slices stay where the gathered run is.
  }];
  let dependentDialects = ["::tessel::rtir::RtDialect"];
}

def OverlapCollectives : Pass<"tessel-overlap-collectives", "mlir::ModuleOp"> {
  let summary = "Overlaps tensor-parallel collectives with the GEMMs around them";
  let description = [{
    On the bufferized rank programs, before the memory plan: Megatron-LM's
    overlap of the tensor- and sequence-parallel collectives in a layer's
    backward. Each blocking `rt.all_gather`, `rt.reduce_scatter` or
    `rt.all_reduce` over axes without `dp` or `pp` inside a forward or
    backward part (an `rt.all_reduce` over `dp` too inside a forward part,
    where no gradient is reduced: an MoE router's statistics) becomes its
    started form and an `rt.wait`: the start rises past the ops
    before it that neither write what it reads nor touch what it writes
    (the re-gather of a sequence-parallel input moves above the GEMM of the
    input gradient), and the wait sinks past the ops after it likewise (the
    reduce-scatter of the input gradient runs under the weight gradient's
    GEMM). Each moves past at most one GEMM (or attention kernel), and never
    past another collective or a message, so every rank of a group starts
    its collectives in the same order. A collective that would overlap no
    GEMM stays blocking. The start takes the buffers it writes with it
    (their `rt.alloc`s move up), and a gather or reduce-scatter along an
    inner dimension gets a buffer of its own for the ranks' pieces, so the
    memory plan holds exactly what is in flight. The arithmetic is that of
    the blocking program; only when the data moves changes.

    With `move-gemms`, a collective that would overlap nothing (its input
    computed right before it and read right after) takes a GEMM above it
    that does not depend on it (a weight gradient's) under it, with the ops
    that consume the GEMM's result before the collective (a fused weight's
    gradient assembled, its accumulation), in their order: the nearest
    such GEMM not inside another started collective's window, among at
    most four above it.
    The pipeline turns that off at ZeRO 2 and 3, where a weight gradient
    written later keeps its run staged longer (a bucket's more memory).

    With `collective-matmul`, a gather along the outermost dimension (a
    microbatch of one sequence) whose result GEMMs read row by row (as
    their A, one batch, not transposed) is done piece by piece under them
    first: g - 1 `rt.shift_start`s on the group, this rank's rows through
    the GEMMs while they travel, then each arrived piece's rows
    (`rt.group_block`) after its `rt.wait`. Every GEMM after the gather
    that reads its result so, up to the next collective, moves up to it
    when nothing in between conflicts; other readers of the gathered tensor
    see it whole after the last piece. Likewise a reduce-scatter of the
    partial sums one such GEMM writes (read by nothing else): the rows of
    each other rank's block are computed and sent to it first
    (`rt.shift_start`), this rank's own block last, and the g partial sums
    of its block, one per source rank in a buffer of the plan, are added in
    rank order (`rt.reduce_sum_leading`). A collective whose started form
    would already run under a GEMM where it stands is left to that. Only pieces of at least
    `collective-matmul-min-rows` rows are worth it: a GEMM of fewer rows
    runs its tiles on too few of a GPU's cores for the transfer it hides
    (docs/parallelism.md has the simulator's figures).
  }];
  let options = [
    Option<"moveGemms", "move-gemms", "bool", "true",
           "Move an independent GEMM under a collective with nothing to overlap">,
    Option<"collectiveMatmul", "collective-matmul", "bool", "true",
           "Gather piece by piece under the GEMMs that read the result row by row">,
    Option<"collectiveMatmulMinRows", "collective-matmul-min-rows", "int64_t",
           "512",
           "The least rows per piece for which a gather is done piece by piece">,
  ];
  let dependentDialects = ["::tessel::rtir::RtDialect"];
}

def DeferParamGathers : Pass<"tessel-defer-param-gathers", "mlir::ModuleOp"> {
  let summary = "Moves ZeRO-1/2's parameter gathers under the next step's forward";
  let description = [{
    On the rank programs after convert-pipe-to-rt. Under ZeRO-1 and 2 the
    update gathers each run's updated pieces (`rt.all_gather_shards_start`)
    and waits for every one before the step ends, so the last runs' gathers
    are exposed. As Megatron-LM's distributed optimizer overlaps them with
    the next forward, each gather moves to the start of the step (after its
    declarations, with a request slot of its own after the program's) and is
    waited for right before the first op that touches its run, piece or bf16
    copy: in the part that reads it first, on that part's first run in the
    step (`rt.wait_requests if %first`, when the part's first call passes
    true and every other false), else before the op or call in the step; a
    run nothing touches is waited for at the step's end. Every request is
    started and waited for within one step. A program whose update touches a
    run after gathering it keeps its gathers. `@sync_params` gathers the same
    runs, blocking: the runtime runs it before it reads the parameters
    between steps (a checkpoint, a save, the end of training); the
    evaluation step (tessel-eval-step, after this pass) starts the gathers as
    the step does. Runs for `parallel.overlap_param_gather` (default true)
    at ZeRO 1 and 2.
  }];
  let dependentDialects = ["::tessel::rtir::RtDialect",
                           "::mlir::func::FuncDialect"];
}

def EvalStep : Pass<"tessel-eval-step", "mlir::ModuleOp"> {
  let summary = "Derives each rank program's forward-only step (validation loss)";
  let description = [{
    On the rank programs after convert-pipe-to-rt, adds `@eval_step`: the
    step's forward parts in the step's order, with their messages and what
    the step exchanges once before its parts, then the reductions that make
    the step's loss (the `rt.all_reduce`s of the update's loss buffer over
    dp and pp, on a rank without the loss the fill that makes its zero, and
    the adds and copies of the forward passes' sums that make it, as where
    a rank's chunks each sum a part) and `rt.finish_eval`; a loss made from
    a buffer it cannot trace to those sums is refused. No backward part or update runs, so evaluating
    leaves parameters and optimizer state as they are, and the loss equals
    what the training step computes on the same batch and parameters. The
    runtime runs it for `train.eval_every` (validation loss). Slices cut
    from a weight's bf16 copy into the copy's own slot
    (tessel-hoist-parameter-slices) leave the slot holding the pieces,
    which a training step's update makes whole again; after
    `rt.finish_eval` the evaluation puts them back itself (each slot's
    pieces copied out, then inserted where the slices took them from), so
    the next evaluation batch and the next training step read the weights
    they would have read.
  }];
  let dependentDialects = ["::tessel::rtir::RtDialect"];
}

def InferenceProgram : Pass<"tessel-inference-program", "mlir::ModuleOp"> {
  let summary = "Makes the planned inference steps a rank program";
  let description = [{
    After `tessel-plan-memory` on an inference program (`@decode_step` and,
    with a prefill chunk, `@prefill_step`, built by `tessel compile
    --inference`): moves the steps into one rank program (`module
    @program0`, as convert-pipe-to-rt makes one of a training step) with
    its memory plan (`rt.param_elems` and `rt.kv_cache_elems`, the same for
    both steps, and `rt.arena_bytes`, the larger of their arenas: one step
    runs at a time) and the tokens each step reads per sequence
    (`rt.chunk`, `rt.prefill_chunk`). Every tensor-parallel rank runs that
    program.
  }];
}

def OrderMessages : Pass<"tessel-order-messages", "mlir::ModuleOp"> {
  let summary = "Gives each pipeline send its place in the receiver's order (CUDA)";
  let description = [{
    NCCL matches point-to-point messages on a channel in the order they are
    posted, not by tag. On the rank programs after convert-pipe-to-rt, each
    `rt.send` gets `order`: per microbatch, its place in the sequence its
    receiver takes messages on that channel in `@train_step`, and
    `eval_order` its place in `@eval_step` (tessel-eval-step). The ranks'
    devices are then run op by op as the CUDA runtime drives them: a send
    is queued and goes out at the first `rt.flush_sends` (or
    `rt.wait_sends`) at which its turn on the channel has come, a receive
    waits for its message, a blocking collective over `pp` waits until
    every stage has reached it, and `rt.wait_sends` resets the channels'
    turns (a send still queued then is never issued). A rank that would
    wait forever is an error naming the part and the message, or the
    collective; so is a send never issued.

    It then plans the send ring, on both targets: the copies of the
    forward and backward parts' sends (`ring` on each) take
    `rt.send_ring_slots` slots of `rt.send_slot_bytes` (the rank's largest
    such send) in turn, and a send whose slot still holds a message waits
    until that message has been received. The slot count is the smallest
    with which the replay, with those waits, still finishes both steps on
    every rank; so the send buffers no longer grow with the microbatches.
    On the CPU target (MPI matches messages by tag, and a send goes out at
    once) orders are not set and the replay issues each send when it is
    made; a program it cannot replay keeps a buffer per send.
  }];
  let options = [
    Option<"target", "target", "std::string", "\"cuda\"",
           "The runtime the messages are planned for (cuda, cpu)">,
  ];
  let dependentDialects = ["::tessel::rtir::RtDialect"];
}

def SharePrograms : Pass<"tessel-share-programs", "mlir::ModuleOp"> {
  let summary = "Pipeline ranks with the same program share one binary";
  let description = [{
    On the rank programs after convert-pipe-to-rt (and tessel-order-messages),
    programs of pipeline ranks that are the same but for their parameters'
    names, how many microbatches' activations they hold at once, and the
    order in which their step runs its parts (1F1B's warm-up is p - r - 1
    forwards) become one program: the middle stages of a uniform model
    build one binary instead of one each. What differs becomes data chosen
    by the pipeline rank at run time: `rt.variants` (the ranks, in order),
    `rt.variant_arena_slots` (and `rt.variant_chunk_arena_offsets` and
    `rt.variant_chunk_arena_total`), each `rt.param`'s `variant_names`, and an
    `rt.schedule` table for each run of part calls the ranks order
    differently. `rt.serves` names the programs it replaces.
  }];
  let dependentDialects = ["::tessel::rtir::RtDialect"];
}

def LowerPrecision : Pass<"tessel-lower-precision", "mlir::ModuleOp"> {
  let summary = "Makes a program's working buffers bf16 (CUDA mixed precision)";
  let description = [{
    Mixed precision as element types, on the bufferized rank programs:
    every working buffer becomes `bf16` except what a bf16 program keeps
    in fp32 (what becomes a parameter gradient and every term summed into
    one, what the gradient norm reads, norm weight gradients, one-element
    values such as losses and norms, and whatever shares storage or a
    pipeline message with those). Matmuls (the MoE experts' grouped ones
    too) and sends read parameters through their bf16 shadow
    (`rt.state_of <shadow>`), which `rt.adamw` refreshes from the fp32
    master weights. Runs before the memory plan,
    which gives bf16 buffers 2-byte elements.
  }];
  let dependentDialects = ["::tessel::rtir::RtDialect",
                           "::tessel::pipe::PipeDialect"];
}

def Float64 : Pass<"tessel-float64", "mlir::ModuleOp"> {
  let summary = "Computes the whole program in float64 (gradient checks)";
  let description = [{
    Every f32 tensor of the graph becomes f64, so that central finite
    differences of the loss are accurate enough to check the gradients the
    compiled step computes (`tessel gradcheck`).
  }];
}

def PlanMemory : Pass<"tessel-plan-memory", "mlir::ModuleOp"> {
  let summary = "Gives every buffer of the rank programs its place";
  let description = [{
    On the bufferized rank programs (rt): parameters are packed in the
    parameter store (`rt.param` gets its `offset`, in elements); each
    parameter's gradient, AdamW moments and bf16 shadow (`rt.state_of`) are
    at the same offset in stores of their own; the buffer a parameter's
    update reads as its gradient is produced straight into the gradient
    store. With several microbatches (`pipe.layout`), each input of the
    update gets an accumulator (a gradient: its slot of the gradient store)
    and is summed into it (`rt.accumulate`, overwriting on the part's
    `rt.first_run`) right after the last op of its part that touches it,
    so that its arena place is free for the rest of the part; a weight
    gradient that one GEMM writes whole (or GEMMs whose column blocks tile
    it, a fused projection's pieces) and nothing else in the part touches
    is instead written there by that GEMM (`rt.matmul_accumulate`: the
    product on the first run, added to the sum after, the GEMM's beta = 1,
    as Megatron-LM's gradient accumulation fusion), with no buffer of its
    own and no pass to add it; likewise an embedding table's gradient by
    its scatter (`rt.embedding_backward_accumulate`, the table zeroed on the
    first run only) (`fuse-accumulation`; the training pipeline
    sets it below ZeRO 2, whose staged gradient runs take one microbatch's
    product at a time). With it, a gradient that is the sum of two such
    products (a tied embedding table's: the LM head's weight gradient and
    the embedding's scatter), each into a buffer only the sum reads, is
    written by the first and added to by the second (its accumulating form
    with a constant false first run), with no buffers for the terms and no
    pass to add them; with microbatches the first then sums into the
    gradient's slot as above. Every other
    buffer gets an
    offset in the activation arena of its microbatch: first fit (when no free
    block fits, one that ends at the arena's top grows into the new space
    rather than being left below it), freed after
    the last read of the value or of any value sharing its storage (views,
    values a part hands on), in the order a microbatch's parts run; each
    region is then placed again greedy by size (the largest buffer first,
    each at the lowest offset clear of those whose lifetimes overlap its
    own), and that placement is kept where it needs less. Each
    use then refers to a view of its place (`rt.buffer`), so that each part
    refers only to its own ops, and an all-reduce over buffers laid out side
    by side is one call over the run. A buffer outside every part (a
    parameter received from another rank for the step) is held in the
    `received` space, after the arena's slots, unless only ops before the
    first part touch it (a weight's slices on their way into its copy
    slot): no part holds its places yet, so it takes those (the transient
    region, or with one slot the arena), first fit. When the rank's schedule
    holds several microbatches at once, only buffers that cross from one
    part to another get the arena (one slot per microbatch in flight);
    those that live within one run of a part go to the `transient` region,
    which all parts share (`rt.transient_bytes`). With several chunks per
    rank (the interleaved schedule), when what crosses parts is read by one
    chunk's parts only, each chunk's arena is planned on its own and each
    (chunk, microbatch) of the rank's schedule gets a place, taken at its
    forward and given back after its backward, first fit
    (`rt.chunk_arena_offsets`, chunk-major byte offsets;
    `rt.chunk_arena_total`; `rt.chunks_in_flight`), unless whole-stage slots
    would hold less. The rank function records
    `rt.param_elems`, `rt.arena_bytes`, `rt.accumulator_elems`,
    `rt.norm_sums` and `rt.received_bytes`.
  }];
  let options = [
    Option<"fuseAccumulation", "fuse-accumulation", "bool", "true",
           "Sum a weight gradient over microbatches in its GEMM (an embedding's in its scatter)">,
  ];
  let dependentDialects = ["::tessel::rtir::RtDialect",
                           "::mlir::arith::ArithDialect"];
}

def JoinUpdates : Pass<"tessel-join-updates", "mlir::ModuleOp"> {
  let summary = "One optimizer call per run of adjacent, like parameters";
  let description = [{
    On the planned rank programs: `rt.sum_squares` calls that follow each
    other on adjacent runs of a store, into the same partial sum, become
    one call on the joined run; `rt.adamw` calls likewise when their
    parameters, gradients, moments (and bf16 shadows) are adjacent and
    their hyperparameters equal (in practice one call per run of parameters
    with the same weight decay). AdamW is elementwise, so the joined call
    computes what the calls did; the norm's fp64 sum adds in another order.
    GPT-2 small's update goes from 296 calls to 99 (one sum of squares and
    98 runs of AdamW, the weight decay alternating between matrices and
    vectors).
  }];
  let dependentDialects = ["::tessel::rtir::RtDialect"];
}

def OverlapGradientSyncs : Pass<"tessel-overlap-gradient-syncs", "mlir::ModuleOp"> {
  let summary = "Start the data-parallel gradient reductions in the last microbatch's backward";
  let description = [{
    On the planned rank programs of a step with microbatches (or a
    pipeline), whose update reduces the gradients over data parallelism
    (`rt.all_reduce`, or ZeRO-1's `rt.reduce_scatter_shards`, of a run of
    the gradient store, in place) after the last backward part: each such
    reduction that is the update's first op to touch its run, of a run that
    one backward part alone writes, is started in a copy of that part
    (`pipe.last_microbatch`; convert-pipe-to-rt calls it for the chunk's
    last backward step instead of the part) right after the part's last op
    that touches the run, in a new request slot, and the update waits for
    that slot where the reduction was. The other microbatches' backward
    parts are unchanged: their writes are partial sums. The same
    collectives on the same buffers, in the same order on every rank of a
    group; only when the data moves changes.
  }];
  let dependentDialects = ["::tessel::rtir::RtDialect"];
}

def ShardOptimizer : Pass<"tessel-shard-optimizer", "mlir::ModuleOp"> {
  let summary = "Shards AdamW's state over data parallel (ZeRO-1)";
  let description = [{
    On the planned rank programs (after `tessel-plan-memory`), Megatron's
    distributed optimizer. Each gradient collective over `dp` whose buffer
    is a run of the gradient store (a bucket, or one gradient) becomes
    `rt.reduce_scatter_shards` (or its started form, keeping the request
    slot): the run's n elements are cut into pieces of ceil(n / dp) elements
    in dp order, and dp rank k keeps the sum of piece k in place (a
    collective over dp and other axes first all-reduces over the others).
    Under expert parallelism a run summed over dp and ep (a dense
    parameter's) is cut over dp x ep instead, as Megatron-LM's distributed
    optimizer cuts it (not with hybrid sharding); its collectives, updates
    and gathers run over that group, `optimizer_shard` carries the group's
    axes, and the norm's partial sums of such runs are added over it.
    The flattening is the gradient store's: parameters in the order the plan
    placed them, each run cut independently.

    `rt.adamw` becomes `rt.adamw_shard`, which updates only the elements of
    the parameter inside this rank's piece; the moment stores hold the
    pieces one after another in gradient-store order
    (`rt.optimizer_elems` elements per rank, about 1/dp of the parameters),
    and each `rt.param` records where its moments are (`optimizer_shard`).
    The gradient norm sums the squares of the rank's pieces
    (`rt.sum_squares_shard`) and adds the partial sums over dp before the
    square root, so the clip is the one-rank program's. After the last
    update each run of the parameter store is gathered
    (`rt.all_gather_shards`; with a bf16 copy, that is refreshed too).

    A parameter whose gradient is synchronised otherwise (not as a run of
    the gradient store: under sequence parallelism, a gradient reduced as
    sequence pieces) keeps whole moments after the pieces, and only dp rank
    0 counts its squares.

    With `zero` 2 the gradients are kept as pieces too (ZeRO-2). A run is
    staged when one backward part writes it and the update only reduces,
    measures and applies it: the part writes the run whole into a staging
    slot of the gradient store and `rt.reduce_scatter_piece_start` starts
    reducing this rank's piece of the sum into the piece's own place right
    after the part's last write to the run (with several microbatches, into
    a piece-sized scratch buffer that `rt.accumulate` adds to the piece,
    and the part's accumulations into the run become copies). The part
    computes on while the reduction is in flight and waits for it
    (`rt.wait_requests`, one request slot) right after the next run's last
    write, before starting that one's, or at its end. A run holds its slot
    until then; runs whose holds do not overlap share a slot. The update's norm and AdamW read
    the pieces (`piece_grads`); a gradient summed over tp as well is
    all-reduced over tp as a piece, once, at the start of the update. Other
    runs (a tied embedding on the first of several stages, to which the
    update adds the last stage's gradient) stay whole, as under ZeRO-1. The
    gradient store becomes [pieces | scratch | whole gradients | staging]
    (`rt.grad_elems` and its parts).

    With `zero` 3 the parameters of a staged run are kept as pieces too
    (ZeRO-3), unless something besides the parts and the run's update reads
    them: the parameter store becomes [pieces (laid out like the moments) |
    parameters kept whole | gathered runs] (`rt.param_store_elems` and its
    parts; each `rt.param` records where its values are, `value_shard`),
    of which the pieces are a space of their own (`<param_pieces>`, from 0)
    and the step's `<params>` views the rest (offsets less the pieces).
    Each part gathers its first run whole into a slot right before its
    first read of it (`rt.all_gather_shards` with `from`, the piece) and
    prefetches the rest: the gather of each next run is started
    (`rt.all_gather_shards_start`, one request slot added to
    `rt.request_slots`) before the previous run's first read and waited for
    (`rt.wait_requests`) before its own, so one gather is in flight while
    the rank computes. A run's slot is held from its gather's start to its
    last read; slots are shared by runs whose holds do not overlap. AdamW
    updates the pieces (`piece_params`) and nothing is gathered after the
    update. In a bf16 program (after `tessel-lower-precision`) the parts'
    views of the parameters' bf16 copy (`<shadow>`) take the same places as
    their `<params>` views, each gather refreshes its slot's copy
    (`shadow`), and AdamW that of the parameters kept whole; the pieces have
    no copy.

    With hybrid sharding (the mesh's `zero_group` g below dp) "dp" above is
    the shard group, `dp_shard`: pieces of ceil(n / g), cut, gathered and
    measured within it. Each piece is summed over the groups' replicas,
    `dp_replica`, as well: by the in-place reduce-scatter itself (over
    `dp_shard, dp_replica`) for a run kept whole, and with the tp sum at the
    start of the update for a staged run.

    With `zero` 1 or 2 in a bf16 program (`master-pieces`), a run whose
    parameters nothing reads in fp32 but their update (the parts read their
    bf16 copy: matmuls' weights) keeps its fp32 master weights as pieces
    only, as Megatron-LM's distributed optimizer does: the parameter store
    becomes [pieces | parameters kept whole] (`value_shard` as under
    ZeRO-3, no gathered runs) and the copy [copy of those kept whole, at
    their places | the runs' copies] (`rt.shadow_extra_elems` more); AdamW
    updates the pieces and writes no copy, and each run's copy is gathered
    in bf16 from the pieces after the update (`rt.all_gather_shards_start`
    on the bf16 copy `from` the fp32 piece). `rt.master_copies` lists each
    run's piece, copy, elements and group for the runtime, which fills the
    copies the same way at start. With `zero` 3 such a run is gathered in
    bf16 the same way, from its piece into its slot of the copy, with no
    fp32 gather: those runs take slots of their own, in the copy alone,
    after the fp32 slots and past the end of the parameter store
    (`rt.shadow_extra_elems`). Each `rt.param` whose copy is gathered in
    bf16 is marked `bf16_gather`.
  }];
  let options = [
    Option<"zero", "zero", "int64_t", "1", "ZeRO level (1, 2 or 3)">,
    Option<"masterPieces", "master-pieces", "bool", "true",
           "With zero 1 or 2 in a bf16 program, keep the fp32 master "
           "weights of runs only their update reads in fp32 as pieces">,
  ];
  let dependentDialects = ["::tessel::rtir::RtDialect"];
}

#endif // TESSEL_TRANSFORMS_PASSES
