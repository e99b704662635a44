//===- RtOps.td - Ops of the rt dialect ---------------------*- tablegen -*-===//
#ifndef TESSEL_RT_OPS
#define TESSEL_RT_OPS

include "RtDialect.td"
include "RtInterfaces.td"
include "mlir/IR/OpBase.td"
include "mlir/Interfaces/SideEffectInterfaces.td"

def Rt_Buffer : MemRefRankOf<[F32, BF16, F64, I32], [0, 1, 2, 3, 4, 5, 6]>;

//===----------------------------------------------------------------------===//
// Storage
//===----------------------------------------------------------------------===//

def Rt_AllocOp : Rt_Op<"alloc"> {
  let summary = "A working buffer of the step, not yet placed";
  let description = [{
    Holds a value of one microbatch (or of the update) from its producer to
    its last reader; `tessel-plan-buffers` gives it a place in the arena.

    ```mlir
    %0 = rt.alloc : memref<8x64xf32>
    ```
  }];
  let results = (outs Rt_Buffer:$buffer);
  let assemblyFormat = "attr-dict `:` type($buffer)";
}

def Rt_BufferOp : Rt_Op<"buffer"> {
  let summary = "A placed buffer: a view of one of the program's stores";
  let description = [{
    `offset` is in bytes in the activation arena (of the running
    microbatch), in elements in the other spaces: the parameter store and
    the stores laid out like it (gradients, AdamW moments, the bf16 shadow),
    the accumulators of the update's inputs, and the gradient norm's fp64
    partial sums.

    ```mlir
    %0 = rt.buffer <arena> 4096 : memref<8x64xf32>
    %1 = rt.buffer <grads> 128 : memref<64xf32>
    ```
  }];
  let arguments = (ins Rt_SpaceAttr:$space, I64Attr:$offset);
  let results = (outs Rt_Buffer:$buffer);
  let assemblyFormat = "$space $offset attr-dict `:` type($buffer)";
}

def Rt_BatchOp : Rt_Op<"batch"> {
  let summary = "The running microbatch's token ids or targets";
  let description = [{
    ```mlir
    %0 = rt.batch "tokens" : memref<8x64xi32>
    ```
  }];
  let arguments = (ins StrAttr:$name);
  let results = (outs Rt_Buffer:$buffer);
  let assemblyFormat = "$name attr-dict `:` type($buffer)";
  let hasVerifier = 1;
}

def Rt_ParamOp : Rt_Op<"param"> {
  let summary = "A trainable parameter: its storage and how it is initialised";
  let description = [{
    This rank's piece of a parameter (the buffer's shape) and what the
    runtime needs to initialise, load and save it: the Hugging Face name,
    the global shape, the initialiser, whether AdamW decays it, and how the
    piece is cut from the global tensor (`shard_dim` split into
    `shard_blocks` blocks, each over `shard_axis`; -1: replicated).
    `tessel-plan-buffers` gives it its place in the parameter store
    (`offset`, elements; the gradient and moments use the same offset).
    In a program shared by several pipeline ranks (`tessel-share-programs`),
    `variant_names` gives the parameter's name on each of them, in the order
    of the program's `rt.variants`.
    With the optimizer sharded over dp (`tessel-shard-optimizer`),
    `optimizer_shard` = [state offset, offset in run, piece, group] says where
    the parameter's AdamW moments are (see that pass; piece 0: whole, at the
    state offset) and, when it is not the mesh's shard group, the axes its
    run's pieces are cut over (`AxisSet` bits: dp x ep for a dense parameter
    under expert parallelism; 0 or absent: the shard group).

    ```mlir
    %w = rt.param "h.0.mlp.c_fc.weight" {global_shape = array<i64: 64, 256>, init = "normal", mean = 0.0 : f64, std = 0.02 : f64, decay = true, shard_dim = 1 : i64, shard_axis = #dist.axis<tp>, shard_blocks = 1 : i64} : memref<64x128xf32>
    ```
  }];
  let arguments = (ins StrAttr:$name, DenseI64ArrayAttr:$global_shape,
                   StrAttr:$init, F64Attr:$mean, F64Attr:$std, BoolAttr:$decay,
                   I64Attr:$shard_dim, Dist_AxisAttr:$shard_axis,
                   I64Attr:$shard_blocks, OptionalAttr<I64Attr>:$offset,
                   OptionalAttr<StrArrayAttr>:$variant_names,
                   OptionalAttr<DenseI64ArrayAttr>:$optimizer_shard);
  let results = (outs Rt_Buffer:$buffer);
  let assemblyFormat = "$name attr-dict `:` type($buffer)";
}

def Rt_KvCacheOp : Rt_Op<"kv_cache"> {
  let summary = "A layer's key or value cache (inference)";
  let description = [{
    This rank's piece of a KV cache, kept from one call of the step to the
    next; `tessel-plan-memory` places it in the KV-cache store.

    ```mlir
    %0 = rt.kv_cache "h.0.attn.k_cache" : memref<1x64x4x16xf32>
    ```
  }];
  let arguments = (ins StrAttr:$name);
  let results = (outs Rt_Buffer:$buffer);
  let assemblyFormat = "$name attr-dict `:` type($buffer)";
}

def Rt_ViewOp : Rt_Op<"view", [Pure]> {
  let summary = "The same storage seen with another shape";
  let description = [{
    ```mlir
    %v = rt.view %x : memref<8x64xf32> to memref<512xf32>
    ```
  }];
  let arguments = (ins Rt_Buffer:$source);
  let results = (outs Rt_Buffer:$result);
  let assemblyFormat = "$source attr-dict `:` type($source) `to` type($result)";
  let hasVerifier = 1;
}

def Rt_GroupBlockOp : Rt_Op<"group_block", [Pure]> {
  let summary = "One of a buffer's equal blocks, chosen by the rank's place in a group";
  let description = [{
    The buffer cut into `blocks` equal, contiguous blocks (a tensor
    gathered over a group of `blocks` ranks along its outermost dimension:
    block r is group rank r's piece), and of them block
    `(groupRank(axes) - shift) mod blocks`: this rank's own piece for shift
    0, the piece of the rank `shift` places before it otherwise. Known only
    when the program runs; see `rt.shift_start`.

    ```mlir
    %b = rt.group_block %x[1] {axes = #dist.axes<tp>, blocks = 2 : i64} : memref<1x64x64xf32> to memref<1x32x64xf32>
    ```
  }];
  let arguments = (ins Rt_Buffer:$source, Dist_AxesAttr:$axes, I64Attr:$blocks,
                   I64Attr:$shift);
  let results = (outs Rt_Buffer:$result);
  let assemblyFormat = "$source `[` $shift `]` attr-dict `:` type($source) `to` type($result)";
  let hasVerifier = 1;
}

def Rt_StateOfOp : Rt_Op<"state_of"> {
  let summary = "A store laid out like the parameters: a parameter's slot in it";
  let description = [{
    The parameter's gradient, AdamW moments or bf16 shadow live at the
    parameter's own offset in stores of their own; `tessel-plan-buffers`
    resolves this to that place. With `offset`, the buffer starts that many
    elements into the parameter's slot (a piece of it: the q, k and v
    slices of a fused weight that `tessel-hoist-parameter-slices` keeps in
    the weight's bf16 shadow slot).

    ```mlir
    %m = rt.state_of %w <adam_m> : memref<64x64xf32> -> memref<64x64xf32>
    %k = rt.state_of %qkv <shadow> {offset = 2048 : i64} : memref<64x96xf32> -> memref<64x32xbf16>
    ```
  }];
  let arguments = (ins Rt_Buffer:$param, Rt_SpaceAttr:$space,
                   OptionalAttr<I64Attr>:$offset);
  let results = (outs Rt_Buffer:$buffer);
  let assemblyFormat = "$param $space attr-dict `:` type($param) `->` type($buffer)";
  let hasVerifier = 1;
}

def Rt_MicrobatchOp : Rt_Op<"microbatch", [Pure]> {
  let summary = "The index of the running microbatch";
  let description = [{
    Inside a part run once per microbatch; convert-pipe-to-rt replaces it by
    the part function's argument.
  }];
  let results = (outs I64:$index);
  let assemblyFormat = "attr-dict `:` type($index)";
}

def Rt_FirstRunOp : Rt_Op<"first_run", [Pure]> {
  let summary = "Whether the running part runs for the first time in the step";
  let description = [{
    Inside a part run once per microbatch (what `rt.accumulate` overwrites
    rather than adds to); convert-pipe-to-rt replaces it by the part
    function's argument.
  }];
  let results = (outs I1:$first);
  let assemblyFormat = "attr-dict `:` type($first)";
}

//===----------------------------------------------------------------------===//
// What the runtime tells the step
//===----------------------------------------------------------------------===//

def Rt_LearningRateOp : Rt_Op<"learning_rate", [Pure]> {
  let summary = "This step's learning rate (the runtime's schedule)";
  let results = (outs F32:$lr);
  let assemblyFormat = "attr-dict `:` type($lr)";
}

def Rt_UpdateCountOp : Rt_Op<"update_count", [Pure]> {
  let summary = "How many updates have run, this one included (AdamW's t)";
  let results = (outs I64:$count);
  let assemblyFormat = "attr-dict `:` type($count)";
}

def Rt_FinishStepOp : Rt_Op<"finish_step"> {
  let summary = "Hands the step's loss and gradient norm to the runtime";
  let arguments = (ins Rt_Buffer:$loss, Rt_Buffer:$norm);
  let assemblyFormat = "`(` $loss `,` $norm `)` attr-dict `:` type($loss) `,` type($norm)";
}

def Rt_RecordMetricOp : Rt_Op<"record_metric"> {
  let summary = "Hands one of the step's observations to the runtime's metrics";
  let description = [{
    After `rt.finish_step`: a value the step computed besides the loss (an
    MoE layer's assignments per expert, the load-balancing loss), whole on
    every rank, written in the metrics under `name` (a compiler-chosen
    identifier: letters, digits, `_` and `.`; `expert_tokens.3` is layer
    3's entry of the per-layer list `expert_tokens`).
  }];
  let arguments = (ins Rt_Buffer:$value, StrAttr:$name);
  let assemblyFormat = "$name `(` $value `)` attr-dict `:` type($value)";
  let hasVerifier = 1;
}

def Rt_FinishEvalOp : Rt_Op<"finish_eval"> {
  let summary = "Hands a forward-only step's loss to the runtime";
  let description = [{
    The end of `@eval_step` (see `tessel-eval-step`): the loss of the batch,
    reduced as the training step reduces it, and no gradient norm.
  }];
  let arguments = (ins Rt_Buffer:$loss);
  let assemblyFormat = "`(` $loss `)` attr-dict `:` type($loss)";
}

//===----------------------------------------------------------------------===//
// Kernels: one call of a runtime function each. Operands first, then the
// attributes, in the order the runtime function takes them.
//===----------------------------------------------------------------------===//

class Rt_KernelOp<string mnemonic, string function, dag args,
                  list<Trait> traits = []>
    : Rt_Op<mnemonic, !listconcat(traits, [KernelCallOpInterface])> {
  let arguments = args;
  let assemblyFormat = "`(` operands `)` attr-dict `:` type(operands)";
  let summary = "Calls " # function;
  let extraClassDeclaration = [{
    static constexpr ::llvm::StringLiteral kFunction = "}] # function # [{";
    static constexpr ::llvm::StringLiteral kArguments[] = {}] #
      !interleave(!foreach(i, !range(!size(args)),
                           "\"" # !getdagname(args, i) # "\""), ", ") # [{};
  }];
}

def Rt_FillOp : Rt_KernelOp<"fill", "fill",
    (ins Rt_Buffer:$out, I64Attr:$n, F64Attr:$value)>;
def Rt_CopyOp : Rt_KernelOp<"copy", "copy",
    (ins Rt_Buffer:$x, Rt_Buffer:$out, I64Attr:$n)>;
def Rt_AccumulateOp : Rt_KernelOp<"accumulate", "accumulateSum",
    (ins Rt_Buffer:$src, Rt_Buffer:$acc, I1:$first, I64Attr:$n)>;

def Rt_EmbeddingForwardOp : Rt_KernelOp<"embedding_forward", "embeddingForward",
    (ins Rt_Buffer:$table, Rt_Buffer:$ids, Rt_Buffer:$out, I64Attr:$n,
         I64Attr:$vocab, I64Attr:$hidden)>;
def Rt_EmbeddingBackwardOp : Rt_KernelOp<"embedding_backward", "embeddingBackward",
    (ins Rt_Buffer:$ids, Rt_Buffer:$dout, Rt_Buffer:$dtable, I64Attr:$n,
         I64Attr:$vocab, I64Attr:$hidden)>;
def Rt_EmbeddingForwardRangeOp : Rt_KernelOp<"embedding_forward_range",
    "embeddingForwardRange",
    (ins Rt_Buffer:$table, Rt_Buffer:$ids, Rt_Buffer:$out, I64Attr:$n,
         Rt_GroupOffsetAttr:$vocab_start, I64Attr:$local_vocab,
         I64Attr:$hidden)>;
def Rt_EmbeddingBackwardRangeOp : Rt_KernelOp<"embedding_backward_range",
    "embeddingBackwardRange",
    (ins Rt_Buffer:$ids, Rt_Buffer:$dout, Rt_Buffer:$dtable, I64Attr:$n,
         Rt_GroupOffsetAttr:$vocab_start, I64Attr:$local_vocab,
         I64Attr:$hidden)>;
// An embedding table's gradient summed over microbatches where it is kept
// (tessel-plan-memory): the rows the ids pick get their dout rows added in
// ascending order, after zeroing the table on the part's `first` run; no
// table-sized buffer per microbatch, no pass to add it.
def Rt_EmbeddingBackwardAccumulateOp : Rt_KernelOp<
    "embedding_backward_accumulate", "embeddingBackwardAccumulate",
    (ins Rt_Buffer:$ids, Rt_Buffer:$dout, Rt_Buffer:$dtable, I1:$first,
         I64Attr:$n, I64Attr:$vocab, I64Attr:$hidden)>;
def Rt_EmbeddingBackwardRangeAccumulateOp : Rt_KernelOp<
    "embedding_backward_range_accumulate", "embeddingBackwardRangeAccumulate",
    (ins Rt_Buffer:$ids, Rt_Buffer:$dout, Rt_Buffer:$dtable, I1:$first,
         I64Attr:$n, Rt_GroupOffsetAttr:$vocab_start, I64Attr:$local_vocab,
         I64Attr:$hidden)>;

def Rt_MatmulOp : Rt_KernelOp<"matmul", "matmul",
    (ins Rt_Buffer:$a, Rt_Buffer:$b, Rt_Buffer:$c, I64Attr:$batch, I64Attr:$m,
         I64Attr:$n, I64Attr:$k, BoolAttr:$trans_a, BoolAttr:$trans_b,
         I64Attr:$stride_a, I64Attr:$stride_b, I64Attr:$stride_c)>;
def Rt_MatmulBiasOp : Rt_KernelOp<"matmul_bias", "matmulBias",
    (ins Rt_Buffer:$a, Rt_Buffer:$b, Rt_Buffer:$bias, Rt_Buffer:$out,
         Optional<Rt_Buffer>:$gelu, I64Attr:$m, I64Attr:$n, I64Attr:$k,
         BoolAttr:$trans_b)>;
// A weight gradient and the bias gradient of the same output gradient
// (cuBLASLt's BGRAD epilogue): c [m, n] = a^T b with a stored [k, m] and b
// [k, n]; db [n] = the column sums of b. The product may be a column block
// of a wider gradient (a q, k or v piece of a fused projection's): c holds
// rows of `ldc` elements and the product goes to columns [col, col + n) of
// each, the column sums to db [col, col + n) (ldc = n, col = 0: the whole
// buffers).
def Rt_MatmulBiasGradOp : Rt_KernelOp<"matmul_bias_grad", "matmulBiasGrad",
    (ins Rt_Buffer:$a, Rt_Buffer:$b, Rt_Buffer:$c, Rt_Buffer:$db, I64Attr:$m,
         I64Attr:$n, I64Attr:$k, I64Attr:$ldc, I64Attr:$col)> {
  let hasVerifier = 1;
}
// An input gradient through GELU (cuBLASLt's DGELU epilogue): dx [m, n] =
// gelu'(pre) * (a opB(b)), a [m, k], pre the GELU's input.
def Rt_MatmulGeluGradOp : Rt_KernelOp<"matmul_gelu_grad", "matmulGeluGrad",
    (ins Rt_Buffer:$a, Rt_Buffer:$b, Rt_Buffer:$pre, Rt_Buffer:$dx,
         I64Attr:$m, I64Attr:$n, I64Attr:$k, BoolAttr:$trans_b)>;
// A weight gradient summed over microbatches by its own GEMM (the GEMM's C
// with beta = 1 after the part's first run, as Megatron-LM's gradient
// accumulation fusion; tessel-plan-memory): c [m, n] = opA(a) opB(b) when
// `first`, else c + opA(a) opB(b).
def Rt_MatmulAccumulateOp : Rt_KernelOp<"matmul_accumulate", "matmulAccumulate",
    (ins Rt_Buffer:$a, Rt_Buffer:$b, Rt_Buffer:$c, I1:$first, I64Attr:$m,
         I64Attr:$n, I64Attr:$k, BoolAttr:$trans_a, BoolAttr:$trans_b)>;
// The same for a weight gradient with its bias gradient
// (rt.matmul_bias_grad, a column block of c and db alike): c [m, n] =
// a^T b, or c + a^T b after the first run; db [n] = the column sums of b,
// written.
def Rt_MatmulBiasGradAccumulateOp : Rt_KernelOp<"matmul_bias_grad_accumulate",
    "matmulBiasGradAccumulate",
    (ins Rt_Buffer:$a, Rt_Buffer:$b, Rt_Buffer:$c, Rt_Buffer:$db, I1:$first,
         I64Attr:$m, I64Attr:$n, I64Attr:$k, I64Attr:$ldc, I64Attr:$col)> {
  let hasVerifier = 1;
}
// A product added to a sum (the GEMM's C with beta = 1): out [m, n] =
// addend + a opB(b), a [m, k].
def Rt_MatmulAddOp : Rt_KernelOp<"matmul_add", "matmulAdd",
    (ins Rt_Buffer:$a, Rt_Buffer:$b, Rt_Buffer:$addend, Rt_Buffer:$out,
         I64Attr:$m, I64Attr:$n, I64Attr:$k, BoolAttr:$trans_b)>;

def Rt_AddBroadcastOp : Rt_KernelOp<"add_broadcast", "addBroadcast",
    (ins Rt_Buffer:$a, Rt_Buffer:$b, Rt_Buffer:$out, I64Attr:$n, I64Attr:$nb)>;
def Rt_MulBroadcastOp : Rt_KernelOp<"mul_broadcast", "mulBroadcast",
    (ins Rt_Buffer:$a, Rt_Buffer:$b, Rt_Buffer:$out, I64Attr:$n, I64Attr:$nb)>;
def Rt_ReduceSumLeadingOp : Rt_KernelOp<"reduce_sum_leading", "reduceSumLeading",
    (ins Rt_Buffer:$x, Rt_Buffer:$out, I64Attr:$rows, I64Attr:$cols)>;

def Rt_GeluForwardOp : Rt_KernelOp<"gelu_forward", "geluForward",
    (ins Rt_Buffer:$x, Rt_Buffer:$out, I64Attr:$n)>;
def Rt_GeluBackwardOp : Rt_KernelOp<"gelu_backward", "geluBackward",
    (ins Rt_Buffer:$x, Rt_Buffer:$dout, Rt_Buffer:$dx, I64Attr:$n)>;
def Rt_SiluForwardOp : Rt_KernelOp<"silu_forward", "siluForward",
    (ins Rt_Buffer:$x, Rt_Buffer:$out, I64Attr:$n)>;
def Rt_SiluBackwardOp : Rt_KernelOp<"silu_backward", "siluBackward",
    (ins Rt_Buffer:$x, Rt_Buffer:$dout, Rt_Buffer:$dx, I64Attr:$n)>;
def Rt_SwigluForwardOp : Rt_KernelOp<"swiglu_forward", "swigluForward",
    (ins Rt_Buffer:$gate, Rt_Buffer:$up, Rt_Buffer:$out,
         Optional<Rt_Buffer>:$silu_out, I64Attr:$n)>;
// SwiGLU's backward with the SiLU taken again from the gate, not kept from
// the forward (as Megatron-LM's fused SwiGLU): dgate = dout * up *
// silu'(gate), dup = dout * silu(gate).
def Rt_SwigluBackwardOp : Rt_KernelOp<"swiglu_backward", "swigluBackward",
    (ins Rt_Buffer:$gate, Rt_Buffer:$up, Rt_Buffer:$dout, Rt_Buffer:$dgate,
         Rt_Buffer:$dup, I64Attr:$n)>;

def Rt_LayerNormForwardOp : Rt_KernelOp<"layer_norm_forward", "layerNormForward",
    (ins Rt_Buffer:$x, Rt_Buffer:$w, Rt_Buffer:$b, Rt_Buffer:$out,
         I64Attr:$rows, I64Attr:$cols, F64Attr:$eps)>;
def Rt_LayerNormBackwardOp : Rt_KernelOp<"layer_norm_backward",
    "layerNormBackward",
    (ins Rt_Buffer:$x, Rt_Buffer:$w, Rt_Buffer:$dout, Rt_Buffer:$dx,
         Rt_Buffer:$dw, Rt_Buffer:$db, I64Attr:$rows, I64Attr:$cols,
         F64Attr:$eps)>;
def Rt_RmsNormForwardOp : Rt_KernelOp<"rms_norm_forward", "rmsNormForward",
    (ins Rt_Buffer:$x, Rt_Buffer:$w, Rt_Buffer:$out, I64Attr:$rows,
         I64Attr:$cols, F64Attr:$eps)>;
def Rt_RmsNormBackwardOp : Rt_KernelOp<"rms_norm_backward", "rmsNormBackward",
    (ins Rt_Buffer:$x, Rt_Buffer:$w, Rt_Buffer:$dout, Rt_Buffer:$dx,
         Rt_Buffer:$dw, I64Attr:$rows, I64Attr:$cols, F64Attr:$eps)>;
def Rt_AddLayerNormForwardOp : Rt_KernelOp<"add_layer_norm_forward",
    "addLayerNormForward",
    (ins Rt_Buffer:$a, Rt_Buffer:$r, Rt_Buffer:$sum, Rt_Buffer:$w,
         Rt_Buffer:$b, Rt_Buffer:$out, I64Attr:$rows, I64Attr:$cols,
         F64Attr:$eps)>;
def Rt_AddRmsNormForwardOp : Rt_KernelOp<"add_rms_norm_forward",
    "addRmsNormForward",
    (ins Rt_Buffer:$a, Rt_Buffer:$r, Rt_Buffer:$sum, Rt_Buffer:$w,
         Rt_Buffer:$out, I64Attr:$rows, I64Attr:$cols, F64Attr:$eps)>;
def Rt_LayerNormBackwardAddOp : Rt_KernelOp<"layer_norm_backward_add",
    "layerNormBackwardAdd",
    (ins Rt_Buffer:$x, Rt_Buffer:$w, Rt_Buffer:$dout, Rt_Buffer:$dres,
         Rt_Buffer:$dx, Rt_Buffer:$dw, Rt_Buffer:$db, I64Attr:$rows,
         I64Attr:$cols, F64Attr:$eps)>;
def Rt_RmsNormBackwardAddOp : Rt_KernelOp<"rms_norm_backward_add",
    "rmsNormBackwardAdd",
    (ins Rt_Buffer:$x, Rt_Buffer:$w, Rt_Buffer:$dout, Rt_Buffer:$dres,
         Rt_Buffer:$dx, Rt_Buffer:$dw, I64Attr:$rows, I64Attr:$cols,
         F64Attr:$eps)>;

def Rt_RopeOp : Rt_KernelOp<"rope", "rope",
    (ins Rt_Buffer:$x, Rt_Buffer:$out, I64Attr:$batch, I64Attr:$seq,
         I64Attr:$heads, I64Attr:$head_dim, F64Attr:$theta,
         BoolAttr:$inverse, AnyAttrOf<[I64Attr, Rt_GroupOffsetAttr]>:$first,
         I64Attr:$zigzag, I64Attr:$total)>;
def Rt_RopeAtOp : Rt_KernelOp<"rope_at", "ropeAt",
    (ins Rt_Buffer:$x, Rt_Buffer:$positions, Rt_Buffer:$out, I64Attr:$batch,
         I64Attr:$seq, I64Attr:$heads, I64Attr:$head_dim, F64Attr:$theta)>;
def Rt_CachedAttentionOp : Rt_KernelOp<"cached_attention", "cachedAttention",
    (ins Rt_Buffer:$q, Rt_Buffer:$k, Rt_Buffer:$v, Rt_Buffer:$k_cache,
         Rt_Buffer:$v_cache, Rt_Buffer:$positions, Rt_Buffer:$out,
         I64Attr:$batch, I64Attr:$seq, I64Attr:$max_len, I64Attr:$heads,
         I64Attr:$kv_heads, I64Attr:$head_dim)>;
def Rt_AttentionForwardOp : Rt_KernelOp<"attention_forward", "attentionForward",
    (ins Rt_Buffer:$q, Rt_Buffer:$k, Rt_Buffer:$v, Rt_Buffer:$out,
         Rt_Buffer:$lse, I64Attr:$batch, I64Attr:$seq, I64Attr:$heads,
         I64Attr:$kv_heads, I64Attr:$head_dim, BoolAttr:$causal,
         I64Attr:$kv_seq, AnyAttrOf<[I64Attr, Rt_GroupOffsetAttr]>:$first,
         I64Attr:$zigzag)>;
def Rt_AttentionBackwardOp : Rt_KernelOp<"attention_backward",
    "attentionBackward",
    (ins Rt_Buffer:$q, Rt_Buffer:$k, Rt_Buffer:$v, Rt_Buffer:$out,
         Rt_Buffer:$lse, Rt_Buffer:$dout, Rt_Buffer:$dq, Rt_Buffer:$dk,
         Rt_Buffer:$dv, I64Attr:$batch,
         I64Attr:$seq, I64Attr:$heads, I64Attr:$kv_heads, I64Attr:$head_dim,
         BoolAttr:$causal, I64Attr:$kv_seq,
         AnyAttrOf<[I64Attr, Rt_GroupOffsetAttr]>:$first, I64Attr:$zigzag)>;
def Rt_DropoutOp : Rt_KernelOp<"dropout", "dropout",
    (ins Rt_Buffer:$x, Rt_Buffer:$out, I64:$microbatch,
         DenseI64ArrayAttr:$shape, DenseI64ArrayAttr:$split_axes,
         I64Attr:$rank, I64Attr:$microbatches, F64Attr:$p, I64Attr:$seed,
         I64Attr:$site, I64Attr:$zigzag)>;
def Rt_ZigzagOp : Rt_KernelOp<"zigzag", "zigzag",
    (ins Rt_Buffer:$x, Rt_Buffer:$out, I64Attr:$outer, I64Attr:$len,
         I64Attr:$inner, I64Attr:$pieces, BoolAttr:$inverse)>;
def Rt_SoftmaxForwardOp : Rt_KernelOp<"softmax_forward", "softmaxForward",
    (ins Rt_Buffer:$x, Rt_Buffer:$out, I64Attr:$rows, I64Attr:$cols,
         F64Attr:$scale, BoolAttr:$causal)>;
def Rt_SoftmaxBackwardOp : Rt_KernelOp<"softmax_backward", "softmaxBackward",
    (ins Rt_Buffer:$y, Rt_Buffer:$dy, Rt_Buffer:$dx, I64Attr:$rows,
         I64Attr:$cols, F64Attr:$scale)>;

def Rt_CrossEntropyForwardOp : Rt_KernelOp<"cross_entropy_forward",
    "crossEntropyForward",
    (ins Rt_Buffer:$logits, Rt_Buffer:$targets, Rt_Buffer:$loss,
         I64Attr:$rows, I64Attr:$vocab, I64Attr:$valid)>;
def Rt_CrossEntropyBackwardOp : Rt_KernelOp<"cross_entropy_backward",
    "crossEntropyBackward",
    (ins Rt_Buffer:$logits, Rt_Buffer:$targets, Rt_Buffer:$dloss,
         Rt_Buffer:$dlogits, I64Attr:$rows, I64Attr:$vocab, I64Attr:$valid)>;
// With `stats` (2 x rows fp32: each row's maximum, then its sum of
// exponentials, combined over the group) the forward keeps the row
// statistics and the backward reads them instead of combining them again
// (tessel-keep-loss-statistics).
def Rt_CrossEntropyVocabParallelForwardOp : Rt_KernelOp<
    "cross_entropy_vocab_parallel_forward", "crossEntropyVocabParallelForward",
    (ins Rt_Buffer:$logits, Rt_Buffer:$targets, Rt_Buffer:$loss,
         Optional<Rt_Buffer>:$stats, I64Attr:$rows, I64Attr:$local_vocab,
         Rt_GroupOffsetAttr:$vocab_start, Dist_AxesAttr:$axes,
         I64Attr:$valid),
    [DeclareOpInterfaceMethods<CommunicationOpInterface>]>;
def Rt_CrossEntropyVocabParallelBackwardOp : Rt_KernelOp<
    "cross_entropy_vocab_parallel_backward",
    "crossEntropyVocabParallelBackward",
    (ins Rt_Buffer:$logits, Rt_Buffer:$targets, Rt_Buffer:$dloss,
         Rt_Buffer:$dlogits, Optional<Rt_Buffer>:$stats, I64Attr:$rows,
         I64Attr:$local_vocab, Rt_GroupOffsetAttr:$vocab_start,
         Dist_AxesAttr:$axes, I64Attr:$valid),
    [DeclareOpInterfaceMethods<CommunicationOpInterface>]>;

// Mixture of experts (tessel/Runtime/Kernels.h; the CUDA runtime's in
// tessel/Runtime/Cuda/Kernels.h).
def Rt_MoeTopKOp : Rt_KernelOp<"moe_top_k", "moeTopK",
    (ins Rt_Buffer:$probs, Rt_Buffer:$experts, Rt_Buffer:$weights,
         I64Attr:$tokens, I64Attr:$num_experts, I64Attr:$top_k)>;
def Rt_MoeTopKBackwardOp : Rt_KernelOp<"moe_top_k_backward", "moeTopKBackward",
    (ins Rt_Buffer:$probs, Rt_Buffer:$experts, Rt_Buffer:$dweights,
         Rt_Buffer:$dprobs, I64Attr:$tokens, I64Attr:$num_experts,
         I64Attr:$top_k, BoolAttr:$accumulate)>;
def Rt_MoeLoadStatsOp : Rt_KernelOp<"moe_load_stats", "moeLoadStatsInto",
    (ins Rt_Buffer:$probs, Rt_Buffer:$experts, Rt_Buffer:$counts,
         Rt_Buffer:$prob_sums, I64Attr:$tokens, I64Attr:$num_experts,
         I64Attr:$top_k)>;
def Rt_MoeKeptCountsOp : Rt_KernelOp<"moe_kept_counts", "moeKeptCounts",
    (ins Rt_Buffer:$offsets, Rt_Buffer:$kept, I64Attr:$num_experts)>;
def Rt_MoeProbSumsBackwardOp : Rt_KernelOp<"moe_prob_sums_backward",
    "moeProbSumsBackward",
    (ins Rt_Buffer:$dprob_sums, Rt_Buffer:$dprobs, I64Attr:$tokens,
         I64Attr:$num_experts)>;
def Rt_MoeAuxLossOp : Rt_KernelOp<"moe_aux_loss", "moeAuxLossForward",
    (ins Rt_Buffer:$counts, Rt_Buffer:$prob_sums, Rt_Buffer:$loss,
         I64Attr:$tokens, I64Attr:$num_experts, I64Attr:$top_k, F64Attr:$coef)>;
def Rt_MoeAuxLossBackwardOp : Rt_KernelOp<"moe_aux_loss_backward",
    "moeAuxLossGrad",
    (ins Rt_Buffer:$counts, Rt_Buffer:$dloss, Rt_Buffer:$dprob_sums,
         I64Attr:$tokens, I64Attr:$num_experts, I64Attr:$top_k, F64Attr:$coef)>;
def Rt_MoeZLossOp : Rt_KernelOp<"moe_z_loss", "moeZLossForward",
    (ins Rt_Buffer:$logits, Rt_Buffer:$loss, I64Attr:$tokens,
         I64Attr:$num_experts, F64Attr:$coef)>;
def Rt_MoeZLossBackwardOp : Rt_KernelOp<"moe_z_loss_backward", "moeZLossGrad",
    (ins Rt_Buffer:$logits, Rt_Buffer:$dloss, Rt_Buffer:$dlogits,
         I64Attr:$tokens, I64Attr:$num_experts, F64Attr:$coef)>;
def Rt_MoeDispatchOp : Rt_KernelOp<"moe_dispatch", "moeDispatchGroup",
    (ins Rt_Buffer:$experts, Rt_Buffer:$row_of, Rt_Buffer:$offsets,
         I64Attr:$tokens, I64Attr:$rows, I64Attr:$top_k, I64Attr:$num_experts,
         I64Attr:$capacity, Dist_AxesAttr:$axes),
    [DeclareOpInterfaceMethods<CommunicationOpInterface>]>;
def Rt_MoeExchangeOp : Rt_KernelOp<"moe_exchange", "moeExchange",
    (ins Rt_Buffer:$rows, Rt_Buffer:$offsets, Rt_Buffer:$recv,
         Rt_Buffer:$recv_offsets, I64Attr:$num_experts, I64Attr:$hidden,
         I64Attr:$recv_rows, Dist_AxesAttr:$axes),
    [DeclareOpInterfaceMethods<CommunicationOpInterface>]>;
def Rt_MoeCombineOp : Rt_KernelOp<"moe_combine", "moeCombine",
    (ins Rt_Buffer:$recv_out, Rt_Buffer:$recv_offsets, Rt_Buffer:$offsets,
         Rt_Buffer:$out, I64Attr:$num_experts, I64Attr:$hidden,
         I64Attr:$rows, Dist_AxesAttr:$axes),
    [DeclareOpInterfaceMethods<CommunicationOpInterface>]>;
def Rt_MoePermuteOp : Rt_KernelOp<"moe_permute", "moePermute",
    (ins Rt_Buffer:$x, Rt_Buffer:$row_of, Rt_Buffer:$rows, I64Attr:$tokens,
         I64Attr:$top_k, I64Attr:$hidden)>;
def Rt_MoePermuteBackwardOp : Rt_KernelOp<"moe_permute_backward",
    "moePermuteBackward",
    (ins Rt_Buffer:$drows, Rt_Buffer:$row_of, Rt_Buffer:$dx, I64Attr:$tokens,
         I64Attr:$top_k, I64Attr:$hidden)>;
def Rt_MoeUnpermuteOp : Rt_KernelOp<"moe_unpermute", "moeUnpermute",
    (ins Rt_Buffer:$rows, Rt_Buffer:$row_of, Rt_Buffer:$weights, Rt_Buffer:$y,
         I64Attr:$tokens, I64Attr:$top_k, I64Attr:$hidden)>;
def Rt_MoeUnpermuteBackwardOp : Rt_KernelOp<"moe_unpermute_backward",
    "moeUnpermuteBackward",
    (ins Rt_Buffer:$rows, Rt_Buffer:$row_of, Rt_Buffer:$weights,
         Rt_Buffer:$dy, Rt_Buffer:$drows, Rt_Buffer:$dweights,
         I64Attr:$tokens, I64Attr:$top_k, I64Attr:$hidden)>;
def Rt_GroupedMatmulOp : Rt_KernelOp<"grouped_matmul", "groupedMatmulSegments",
    (ins Rt_Buffer:$x, Rt_Buffer:$w, Rt_Buffer:$out, Rt_Buffer:$offsets,
         I64Attr:$segments, I64Attr:$num_experts, I64Attr:$k, I64Attr:$n,
         BoolAttr:$trans_w)>;
// The experts' weight gradients summed over microbatches by the grouped
// GEMM (tessel-plan-memory): written on the part's first run, added to
// after.
def Rt_GroupedMatmulWeightGradAccumulateOp : Rt_KernelOp<
    "grouped_matmul_weight_grad_accumulate",
    "groupedMatmulWeightGradSegmentsAccumulate",
    (ins Rt_Buffer:$x, Rt_Buffer:$dout, Rt_Buffer:$dw, Rt_Buffer:$offsets,
         I1:$first, I64Attr:$segments, I64Attr:$num_experts, I64Attr:$k,
         I64Attr:$n, BoolAttr:$trans_w)>;
def Rt_GroupedMatmulWeightGradOp : Rt_KernelOp<"grouped_matmul_weight_grad",
    "groupedMatmulWeightGradSegments",
    (ins Rt_Buffer:$x, Rt_Buffer:$dout, Rt_Buffer:$dw, Rt_Buffer:$offsets,
         I64Attr:$segments, I64Attr:$num_experts, I64Attr:$k, I64Attr:$n,
         BoolAttr:$trans_w)>;

def Rt_TransposeOp : Rt_KernelOp<"transpose", "transpose",
    (ins Rt_Buffer:$x, Rt_Buffer:$out, DenseI64ArrayAttr:$shape,
         DenseI64ArrayAttr:$permutation, I64Attr:$rank)>;
def Rt_SliceAxisOp : Rt_KernelOp<"slice_axis", "sliceAxis",
    (ins Rt_Buffer:$x, Rt_Buffer:$out, I64Attr:$outer, I64Attr:$extent,
         I64Attr:$inner, AnyAttrOf<[I64Attr, Rt_GroupOffsetAttr]>:$start,
         I64Attr:$length)>;
def Rt_InsertAxisOp : Rt_KernelOp<"insert_axis", "insertAxis",
    (ins Rt_Buffer:$x, Rt_Buffer:$out, I64Attr:$outer, I64Attr:$extent,
         I64Attr:$inner, AnyAttrOf<[I64Attr, Rt_GroupOffsetAttr]>:$start,
         I64Attr:$length)>;

def Rt_ZeroSumsOp : Rt_KernelOp<"zero_sums", "zeroSums",
    (ins Rt_Buffer:$sums, I64Attr:$n)>;
def Rt_SumSquaresOp : Rt_KernelOp<"sum_squares", "addSumOfSquares",
    (ins Rt_Buffer:$x, Rt_Buffer:$acc, I64Attr:$n)>;
def Rt_SqrtSumOp : Rt_KernelOp<"sqrt_sum", "normFromSums",
    (ins Rt_Buffer:$acc, Rt_Buffer:$out, I64Attr:$parts)>;
def Rt_AdamWOp : Rt_KernelOp<"adamw", "adamwStep",
    (ins Rt_Buffer:$param, Optional<Rt_Buffer>:$shadow, Rt_Buffer:$grad,
         Rt_Buffer:$m, Rt_Buffer:$v, Rt_Buffer:$norm, F32:$lr, I64:$count,
         I64Attr:$n, F32Attr:$beta1, F32Attr:$beta2, F32Attr:$eps,
         F32Attr:$weight_decay, F32Attr:$max_grad_norm)>;

// The optimizer sharded over a group (ZeRO-1, tessel-shard-optimizer): a
// run of `n`-element gradient or parameter storage is cut into pieces of
// `piece` elements in group order; `run_offset` is where the op's buffer
// starts in its run. The op touches only the part of its buffer inside this
// rank's piece, and the moments `m`, `v` are that piece's. With
// `piece_grads` (ZeRO-2) the gradient `x` / `grad` is the piece's storage
// too (indexed like the moments), not the whole tensor's; with
// `piece_params` (ZeRO-3) so is the parameter.
def Rt_SumSquaresShardOp : Rt_KernelOp<"sum_squares_shard",
    "addSumOfSquaresShard",
    (ins Rt_Buffer:$x, Rt_Buffer:$acc, I64Attr:$n, I64Attr:$run_offset,
         I64Attr:$piece, Dist_AxesAttr:$axes, BoolAttr:$piece_grads)>;
def Rt_AdamWShardOp : Rt_KernelOp<"adamw_shard", "adamwStepShard",
    (ins Rt_Buffer:$param, Optional<Rt_Buffer>:$shadow, Rt_Buffer:$grad,
         Rt_Buffer:$m, Rt_Buffer:$v, Rt_Buffer:$norm, F32:$lr, I64:$count,
         I64Attr:$n, I64Attr:$run_offset, I64Attr:$piece, Dist_AxesAttr:$axes,
         BoolAttr:$piece_grads, BoolAttr:$piece_params, F32Attr:$beta1, F32Attr:$beta2, F32Attr:$eps,
         F32Attr:$weight_decay, F32Attr:$max_grad_norm)>;

//===----------------------------------------------------------------------===//
// Communication
//===----------------------------------------------------------------------===//

def Rt_ReduceScatterShardsOp : Rt_KernelOp<"reduce_scatter_shards",
    "reduceScatterShards", (ins Rt_Buffer:$buffer, Optional<Rt_Buffer>:$out,
                                I64Attr:$n, Dist_AxesAttr:$axes),
    [DeclareOpInterfaceMethods<CommunicationOpInterface>]> {
  let description = [{
    Sums an `n`-element buffer over the group and leaves this rank's piece
    of the sum (elements [k * piece, min((k + 1) * piece, n)) at group rank
    k, piece = ceil(n / g)) in place, or in `out` (ZeRO-2: the piece's
    own storage); the rest of the buffer is left undefined. With hybrid
    sharding the axes may include `dp_replica`: the pieces are cut over the
    other axes and each piece is then summed over the replicas.
  }];
}
def Rt_AllGatherShardsOp : Rt_KernelOp<"all_gather_shards", "allGatherShards",
    (ins Rt_Buffer:$buffer, Optional<Rt_Buffer>:$from,
         Optional<Rt_Buffer>:$shadow, I64Attr:$n, Dist_AxesAttr:$axes),
    [DeclareOpInterfaceMethods<CommunicationOpInterface>,
     AttrSizedOperandSegments]> {
  let description = [{
    The reverse of `rt.reduce_scatter_shards`: each rank's piece of the
    `n`-element buffer, in place, is gathered into every rank's buffer (with
    `from`, ZeRO-3, this rank's piece is first copied from there). With a
    `shadow` (the bf16 copy of parameters), the copy of the whole run is
    refreshed from the gathered values.
  }];
}

class Rt_CommOp<string mnemonic, list<Trait> traits = []>
    : Rt_Op<mnemonic, !listconcat(traits,
          [DeclareOpInterfaceMethods<CommunicationOpInterface>])>;

def Rt_AllReduceOp : Rt_CommOp<"all_reduce"> {
  let summary = "Sums each buffer over a group, in place (allReduceSum)";
  let arguments = (ins Variadic<Rt_Buffer>:$buffers, Dist_AxesAttr:$axes);
  let assemblyFormat = "`(` $buffers `)` attr-dict (`:` type($buffers)^)?";
}

def Rt_AllReduceStartOp : Rt_CommOp<"all_reduce_start"> {
  let summary = "Starts summing each buffer over a group (allReduceSumStart)";
  let description = [{
    The buffers may be read only after `rt.wait` on the request. The
    buffer plan gives the started collectives their places in the program's
    request table (`slot`: the first of one per buffer).
  }];
  let arguments = (ins Variadic<Rt_Buffer>:$buffers, Dist_AxesAttr:$axes,
                   OptionalAttr<I64Attr>:$slot);
  let results = (outs Rt_RequestType:$request);
  let assemblyFormat = "`(` $buffers `)` attr-dict (`:` type($buffers)^)?";
}

def Rt_ReduceScatterShardsStartOp : Rt_CommOp<"reduce_scatter_shards_start"> {
  let summary = "Starts rt.reduce_scatter_shards on each buffer (reduceScatterShardsStart)";
  let description = [{
    Like `rt.all_reduce_start`: the pieces may be read only after the
    request's slots (`slot`, one per buffer) have been waited for.
  }];
  let arguments = (ins Variadic<Rt_Buffer>:$buffers, Dist_AxesAttr:$axes,
                   OptionalAttr<I64Attr>:$slot);
  let results = (outs Rt_RequestType:$request);
  let assemblyFormat = "`(` $buffers `)` attr-dict (`:` type($buffers)^)?";
}

def Rt_ReduceScatterPieceStartOp : Rt_CommOp<"reduce_scatter_piece_start"> {
  let summary = "Starts rt.reduce_scatter_shards of a run into this rank's piece (reduceScatterPieceStart)";
  let description = [{
    ZeRO-2's reduction in flight: a backward part starts reducing a staged
    run into `out`, this rank's piece, right after its last write to the
    run and computes on. `buffer` may be written again, and `out` read,
    only after request slot `slot` has been waited for
    (`rt.wait_requests`).
  }];
  let arguments = (ins Rt_Buffer:$buffer, Rt_Buffer:$out, I64Attr:$n,
                   Dist_AxesAttr:$axes, OptionalAttr<I64Attr>:$slot);
  let results = (outs Rt_RequestType:$request);
  let assemblyFormat = "`(` $buffer `,` $out `)` attr-dict `:` type($buffer) `,` type($out)";
}

def Rt_AllGatherShardsStartOp : Rt_CommOp<"all_gather_shards_start",
                                           [AttrSizedOperandSegments]> {
  let summary = "Starts rt.all_gather_shards of a run from this rank's piece (allGatherShardsStart)";
  let description = [{
    ZeRO-3's prefetch: the gather of the next run a part reads is started
    before the compute that precedes its first read, this rank's piece
    copied `from` its own storage. ZeRO-1 and 2: the gather of a run's
    updated pieces, in place (no `from`), started as soon as the update has
    written this rank's piece, so that it runs while the other runs are
    updated. `buffer` may be read, and `from` written, only after request
    slot `slot` has been waited for (`rt.wait_requests`). With a `shadow`
    (a bf16 program's copy of the gathered run, where its matmuls read it),
    the copy is refreshed from the gathered values before the request
    completes.
  }];
  let arguments = (ins Rt_Buffer:$buffer, Optional<Rt_Buffer>:$from,
                   Optional<Rt_Buffer>:$shadow, I64Attr:$n,
                   Dist_AxesAttr:$axes, OptionalAttr<I64Attr>:$slot);
  let results = (outs Rt_RequestType:$request);
  let assemblyFormat = "`(` $buffer `:` type($buffer) (`from` $from^ `:` type($from))? (`shadow` $shadow^ `:` type($shadow))? `)` attr-dict";
}

def Rt_WaitOp : Rt_Op<"wait"> {
  let summary = "Waits for the collectives a start op began (commWait)";
  let arguments = (ins Rt_RequestType:$request);
  let assemblyFormat = "$request attr-dict";
}

def Rt_WaitRequestsOp : Rt_Op<"wait_requests"> {
  let summary = "Waits for the collectives in slots [first, first + count) of the request table";
  let description = [{
    The planned form of `rt.wait`: a request handed from one part to another
    lives in the program's request table. With `if %first` (a part's first
    run in the step, its second argument) it waits on that run only: a
    collective the step started before its parts
    (tessel-defer-param-gathers), which the part's first run reads.
  }];
  let arguments = (ins Optional<I1>:$when, I64Attr:$first, I64Attr:$count);
  let assemblyFormat = "(`if` $when^)? attr-dict";
  let builders = [
    OpBuilder<(ins "int64_t":$first, "int64_t":$count), [{
      build($_builder, $_state, mlir::Value(), first, count);
    }]>
  ];
}

def Rt_AllGatherOp : Rt_CommOp<"all_gather"> {
  let summary = "Gathers a [outer, length, inner] tensor along its middle dimension (allGatherAlong)";
  let arguments = (ins Rt_Buffer:$input, Rt_Buffer:$output, I64Attr:$outer,
                   I64Attr:$length, I64Attr:$inner, Dist_AxesAttr:$axes);
  let assemblyFormat = "`(` $input `,` $output `)` attr-dict `:` type($input) `,` type($output)";
}

def Rt_ReduceScatterOp : Rt_CommOp<"reduce_scatter"> {
  let summary = "Sums over a group and keeps this rank's piece of the middle dimension (reduceScatterAlong)";
  let arguments = (ins Rt_Buffer:$input, Rt_Buffer:$output, I64Attr:$outer,
                   I64Attr:$length, I64Attr:$inner, Dist_AxesAttr:$axes);
  let assemblyFormat = "`(` $input `,` $output `)` attr-dict `:` type($input) `,` type($output)";
}

def Rt_AllGatherStartOp : Rt_CommOp<"all_gather_start"> {
  let summary = "Starts rt.all_gather (allGatherAlongStart)";
  let description = [{
    The started form that `tessel-overlap-collectives` makes of an
    `rt.all_gather` whose wait it can move past a GEMM. `output` may be
    read, and `input` written, only after `rt.wait` on the request. When the
    gathered dimension is not the outermost (`outer` > 1), `blocks`, g x n
    elements of the piece's n, receives the ranks' pieces side by side and
    the wait lays them out in `output`: a buffer of the memory plan, held
    while the gather is in flight, not a runtime's shared staging.
  }];
  let arguments = (ins Rt_Buffer:$input, Rt_Buffer:$output,
                   Optional<Rt_Buffer>:$blocks, I64Attr:$outer,
                   I64Attr:$length, I64Attr:$inner, Dist_AxesAttr:$axes,
                   OptionalAttr<I64Attr>:$slot);
  let results = (outs Rt_RequestType:$request);
  let assemblyFormat = "`(` $input `,` $output (`,` $blocks^)? `)` attr-dict `:` type($input) `,` type($output) (`,` type($blocks)^)?";
  let hasVerifier = 1;
}

def Rt_ReduceScatterStartOp : Rt_CommOp<"reduce_scatter_start"> {
  let summary = "Starts rt.reduce_scatter (reduceScatterAlongStart)";
  let description = [{
    The started form of `rt.reduce_scatter`: `input` may be written, and
    `output` read, only after `rt.wait` on the request. With `outer` > 1 the
    start packs `input` into `blocks` (g x n elements of the piece's n),
    which the reduction reads while it is in flight.
  }];
  let arguments = (ins Rt_Buffer:$input, Rt_Buffer:$output,
                   Optional<Rt_Buffer>:$blocks, I64Attr:$outer,
                   I64Attr:$length, I64Attr:$inner, Dist_AxesAttr:$axes,
                   OptionalAttr<I64Attr>:$slot);
  let results = (outs Rt_RequestType:$request);
  let assemblyFormat = "`(` $input `,` $output (`,` $blocks^)? `)` attr-dict `:` type($input) `,` type($output) (`,` type($blocks)^)?";
  let hasVerifier = 1;
}

def Rt_ShiftStartOp : Rt_CommOp<"shift_start"> {
  let summary = "Starts sending a buffer `shift` ranks on in a group and receiving one from `shift` ranks back (shiftStart)";
  let description = [{
    One step of a gather done piece by piece (`tessel-overlap-collectives`'
    collective matmul): `input` goes to group rank `(r + shift) mod g`, and
    `output` receives group rank `(r - shift) mod g`'s, where r is this
    rank's place in the group over `axes` and g its size. `input` may be
    written, and `output` read, only after `rt.wait` on the request.

    ```mlir
    %b = rt.group_block %X[1] {axes = #dist.axes<tp>, blocks = 2 : i64} : memref<1x64x64xf32> to memref<1x32x64xf32>
    %r = rt.shift_start(%x, %b) {axes = #dist.axes<tp>, shift = 1 : i64} : memref<1x32x64xf32>, memref<1x32x64xf32>
    rt.wait %r
    ```
  }];
  let arguments = (ins Rt_Buffer:$input, Rt_Buffer:$output, I64Attr:$shift,
                   Dist_AxesAttr:$axes, OptionalAttr<I64Attr>:$slot);
  let results = (outs Rt_RequestType:$request);
  let assemblyFormat = "`(` $input `,` $output `)` attr-dict `:` type($input) `,` type($output)";
  let hasVerifier = 1;
}

def Rt_SendOp : Rt_CommOp<"send"> {
  let summary = "Sends a buffer to the pipeline rank at an offset (sendTo)";
  let description = [{
    `tag` names the message; `microbatch` is the running microbatch. The
    runtime keys each message by both (CPU: an MPI tag; CUDA: its place in
    the receiver's order, `order`, which tessel-order-messages fills in;
    `eval_order` is its place when the forward-only `@eval_step` runs).
    `ring`: its copy takes the next slot of the program's send ring
    (`rt.send_ring_slots` slots of `rt.send_slot_bytes`), waiting until the
    message that slot held has been received; without it the copy has a
    buffer of its own until the step waits for its sends.
  }];
  let arguments = (ins Rt_Buffer:$buffer, I64:$microbatch, I64Attr:$offset,
                   I64Attr:$tag, OptionalAttr<DenseI64ArrayAttr>:$order,
                   OptionalAttr<DenseI64ArrayAttr>:$eval_order,
                   UnitAttr:$ring);
  let assemblyFormat = "`(` $buffer `)` `microbatch` $microbatch attr-dict `:` type($buffer)";
}

def Rt_RecvOp : Rt_CommOp<"recv"> {
  let summary = "Receives a buffer from the pipeline rank at an offset (recvFrom)";
  let arguments = (ins Rt_Buffer:$buffer, I64:$microbatch, I64Attr:$offset,
                   I64Attr:$tag);
  let assemblyFormat = "`(` $buffer `)` `microbatch` $microbatch attr-dict `:` type($buffer)";
}

def Rt_FlushSendsOp : Rt_Op<"flush_sends"> {
  let summary = "Issues the sends queued so far (flushSends; CUDA orders them)";
  let assemblyFormat = "attr-dict";
}

def Rt_ScheduleOp : Rt_Op<"schedule"> {
  let summary = "Runs parts of the step in the order of a table, one per variant";
  let description = [{
    In the step of a program shared by several pipeline ranks (see
    `tessel-share-programs`), the run of part calls in which the ranks
    differ (1F1B's warm-up length, for one). `tables` holds one table per
    variant of the program (`rt.variants` on the module, in that order),
    each a flat list of (part, microbatch, first) triples: `parts[part]` is
    called with the microbatch index and whether it is the part's first
    run of the step.

    ```mlir
    rt.schedule [@forward0, @backward0] [array<i64: 0, 0, 1, 1, 0, 1>, array<i64: 0, 0, 1, 1, 0, 1>]
    ```
  }];
  let arguments = (ins FlatSymbolRefArrayAttr:$parts, ArrayAttr:$tables);
  let assemblyFormat = "$parts $tables attr-dict";
  let hasVerifier = 1;
}

def Rt_WaitSendsOp : Rt_Op<"wait_sends"> {
  let summary = "Waits for every send of the step (waitSends)";
  let assemblyFormat = "attr-dict";
}

#endif // TESSEL_RT_OPS
