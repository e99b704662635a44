//===- GraphOps.td - Ops of the graph dialect ---------------*- tablegen -*-===//
#ifndef TESSEL_GRAPH_OPS
#define TESSEL_GRAPH_OPS

include "GraphDialect.td"
include "GraphInterfaces.td"
include "dialects/Dist/DistDialect.td"
include "mlir/Interfaces/SideEffectInterfaces.td"
include "mlir/Interfaces/InferTypeOpInterface.td"

// f32 in programs; f64 in gradient checks (tessel-float64).
def Graph_FloatTensor : RankedTensorOf<[F32, F64]>;
def Graph_I32Tensor : RankedTensorOf<[I32]>;
def Graph_FloatScalar : 0DTensorOf<[F32, F64]>;

class Graph_PureOp<string mnemonic, list<Trait> traits = [],
                   list<string> rules = []>
    : Graph_Op<mnemonic, !listconcat([Pure], traits), rules> {
  let assemblyFormat = "operands attr-dict `:` functional-type(operands, results)";
  let hasVerifier = 1;
}
// An op whose result type follows from its operands and attributes.
class Graph_InferOp<string mnemonic, list<Trait> traits = [],
                    list<string> rules = []>
    : Graph_PureOp<mnemonic, !listconcat([InferTypeOpAdaptor], traits),
                   rules> {
  let hasVerifier = 0;
}
class Graph_DiffOp<string mnemonic, list<Trait> traits = [],
                   list<string> rules = []>
    : Graph_InferOp<mnemonic,
        !listconcat([DeclareOpInterfaceMethods<GradientOpInterface>], traits),
        rules>;

//===----------------------------------------------------------------------===//
// Leaves
//===----------------------------------------------------------------------===//

def Graph_ParamOp : Graph_Op<"param", [Pure]> {
  let summary = "A trainable parameter";
  let description = [{
    A named, persistent, trainable tensor. The name is the tensor's name in
    checkpoints (Hugging Face names). `init` is `normal` (with `mean`, `std`),
    `zeros` or `ones`.

    ```mlir
    %w = graph.param "h.0.attn.c_attn.weight" {init = "normal", std = 0.02 : f64} : tensor<64x192xf32>
    ```
  }];
  let arguments = (ins StrAttr:$name,
                   DefaultValuedAttr<StrAttr, "\"normal\"">:$init,
                   DefaultValuedAttr<F64Attr, "0.0">:$mean,
                   DefaultValuedAttr<F64Attr, "0.02">:$std);
  let results = (outs Graph_FloatTensor:$result);
  let assemblyFormat = "$name attr-dict `:` type($result)";
  let hasVerifier = 1;
}

def Graph_InputOp : Graph_Op<"input", [Pure]> {
  let summary = "A per-step input of the training step";
  let description = [{
    Token ids fed by the data loader: `tokens` (the inputs) or `targets` (the
    inputs shifted by one), both `[batch, seq]` of i32.

    ```mlir
    %ids = graph.input "tokens" : tensor<8x64xi32>
    ```
  }];
  let arguments = (ins StrAttr:$name);
  let results = (outs Graph_I32Tensor:$result);
  let assemblyFormat = "$name attr-dict `:` type($result)";
  let hasVerifier = 1;
}

def Graph_FillOp : Graph_Op<"fill", [Pure]> {
  let summary = "A tensor filled with one value";
  let description = [{
    ```mlir
    %one = graph.fill {value = 1.0 : f64} : tensor<f32>
    ```
  }];
  let arguments = (ins DefaultValuedAttr<F64Attr, "0.0">:$value);
  let results = (outs Graph_FloatTensor:$result);
  let assemblyFormat = "attr-dict `:` type($result)";
}

//===----------------------------------------------------------------------===//
// Forward math
//===----------------------------------------------------------------------===//

def Graph_EmbeddingOp : Graph_DiffOp<"embedding", [], ["localize"]> {
  let summary = "Row lookup in a [vocab, hidden] table";
  let description = [{
    `result[..., :] = table[ids[...], :]`. With `vocab_axes` (set by the
    partition pass) the table is this rank's slice of the vocabulary, rows
    `[groupRank * V, (groupRank + 1) * V)` of the global table over those
    axes; ids outside it give zeros, so the result is a partial sum.

    ```mlir
    %x = graph.embedding %wte, %ids : (tensor<256x64xf32>, tensor<8x64xi32>) -> tensor<8x64x64xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$table, Graph_I32Tensor:$ids,
                   OptionalAttr<Dist_AxesAttr>:$vocab_axes);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_MatmulOp : Graph_DiffOp<"matmul"> {
  let summary = "Batched matrix product with optionally transposed operands";
  let description = [{
    `lhs` is `[batch..., M, K]` (`[batch..., K, M]` with `transpose_lhs`);
    `rhs` is `[K, N]` (broadcast over the batch) or `[batch..., K, N]`
    (`[..., N, K]` with `transpose_rhs`). The result is `[batch..., M, N]`.

    With `sum_batch` (which needs `transpose_lhs`, no `transpose_rhs` and a
    batched rhs) the batch dimensions are contracted as well: the result is
    `[M, N]`, the sum over the batch of `lhs[b]^T rhs[b]`. That is the
    weight gradient of a matmul whose rhs is broadcast over the batch, and
    written this way the batch and sequence splits of a `[batch, seq, ...]`
    activation both become partial sums of the result (a reshape to
    `[batch * seq, ...]` would have to gather one of them first).

    ```mlir
    %y = graph.matmul %x, %w : (tensor<8x64x64xf32>, tensor<64x192xf32>) -> tensor<8x64x192xf32>
    %l = graph.matmul %h, %wte {transpose_rhs = true} : (tensor<8x64x64xf32>, tensor<256x64xf32>) -> tensor<8x64x256xf32>
    %g = graph.matmul %x, %dy {sum_batch = true, transpose_lhs = true} : (tensor<8x64x64xf32>, tensor<8x64x192xf32>) -> tensor<64x192xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$lhs, Graph_FloatTensor:$rhs,
                   DefaultValuedAttr<BoolAttr, "false">:$transpose_lhs,
                   DefaultValuedAttr<BoolAttr, "false">:$transpose_rhs,
                   DefaultValuedAttr<BoolAttr, "false">:$sum_batch);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_AddOp : Graph_DiffOp<"add"> {
  let summary = "Elementwise sum, broadcasting rhs over leading dimensions";
  let description = [{
    `rhs`'s shape must equal `lhs`'s or be a suffix of it (a bias).

    ```mlir
    %y = graph.add %x, %b : (tensor<8x64x192xf32>, tensor<192xf32>) -> tensor<8x64x192xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$lhs, Graph_FloatTensor:$rhs);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_MulOp : Graph_DiffOp<"mul"> {
  let summary = "Elementwise product, broadcasting rhs over leading dimensions";
  let description = [{
    ```mlir
    %y = graph.mul %a, %b : (tensor<8x64x172xf32>, tensor<8x64x172xf32>) -> tensor<8x64x172xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$lhs, Graph_FloatTensor:$rhs);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_GeluOp : Graph_DiffOp<"gelu"> {
  let summary = "GELU, tanh approximation";
  let description = [{
    `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`, as GPT-2.

    ```mlir
    %y = graph.gelu %x : (tensor<8x64x256xf32>) -> tensor<8x64x256xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_SiluOp : Graph_DiffOp<"silu"> {
  let summary = "SiLU, x * sigmoid(x)";
  let description = [{
    ```mlir
    %y = graph.silu %x : (tensor<8x64x172xf32>) -> tensor<8x64x172xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_LayerNormOp : Graph_DiffOp<"layer_norm"> {
  let summary = "LayerNorm over the last dimension";
  let description = [{
    `(x - mean) / sqrt(var + epsilon) * weight + bias`, biased variance.

    ```mlir
    %y = graph.layer_norm %x, %w, %b {epsilon = 1.0e-05 : f64} : (tensor<8x64x64xf32>, tensor<64xf32>, tensor<64xf32>) -> tensor<8x64x64xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, Graph_FloatTensor:$weight, Graph_FloatTensor:$bias,
                   DefaultValuedAttr<F64Attr, "1.0e-5">:$epsilon);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_RmsNormOp : Graph_DiffOp<"rms_norm"> {
  let summary = "RMSNorm over the last dimension";
  let description = [{
    `x / sqrt(mean(x^2) + epsilon) * weight`, as Llama.

    ```mlir
    %y = graph.rms_norm %x, %w {epsilon = 1.0e-05 : f64} : (tensor<8x64x64xf32>, tensor<64xf32>) -> tensor<8x64x64xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, Graph_FloatTensor:$weight,
                   DefaultValuedAttr<F64Attr, "1.0e-5">:$epsilon);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_RopeOp : Graph_DiffOp<"rope", [], ["localize"]> {
  let summary = "Rotary position embedding on [batch, seq, heads, head_dim]";
  let description = [{
    Hugging Face Llama convention (`rotate_half`): dimension `i < D/2` pairs
    with `i + D/2` and rotates by `pos * theta^(-2i/D)`. `inverse` rotates the
    other way, which is the gradient. The sequence may be split over the
    context-parallel axis: partitioning records the axes (`seq_axes`), and
    a rank's positions start at its piece's offset. With `zigzag = n` the
    sequence is held in the balanced order of n pieces (`graph.zigzag`):
    row t is at position zigzagPosition(t) (lib/Runtime's Sequence.h).

    ```mlir
    %q2 = graph.rope %q {theta = 1.0e+04 : f64} : (tensor<8x64x4x16xf32>) -> tensor<8x64x4x16xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input,
                   DefaultValuedAttr<F64Attr, "10000.0">:$theta,
                   DefaultValuedAttr<BoolAttr, "false">:$inverse,
                   OptionalAttr<Dist_AxesAttr>:$seq_axes,
                   OptionalAttr<I64Attr>:$zigzag);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_AttentionOp : Graph_DiffOp<"attention", [], ["localize"]> {
  let summary = "Scaled dot-product attention with grouped KV heads";
  let description = [{
    `query` is `[batch, seq, heads, head_dim]`, `key` and `value` are
    `[batch, seq, kv_heads, head_dim]`; `heads` must be a multiple of
    `kv_heads`, and query head `h` reads KV head `h / (heads / kv_heads)`.
    Scale `1/sqrt(head_dim)`; causal unless `causal = false`.
    `kv_replicated` (set by sharding propagation) names the axes that split
    the query heads while every rank holds all KV heads (fewer KV heads than
    ranks); the partition pass then gives the op the one KV head its query
    heads read.
    `lse` is `[batch, heads, seq]`: each query row's log-sum-exp of its
    scaled scores (natural log), which the gradient reads with the result
    instead of computing the forward again (FlashAttention-2). Its element
    type is the query's; a bf16 program keeps it in fp32.
    The queries may be split along the sequence over the context-parallel
    axis while the keys and values are whole (context parallelism):
    partitioning records the axes (`seq_axes`), and a rank's query rows
    start at its piece's offset for the causal mask. With `zigzag = n` the
    queries are in the balanced order of n pieces (`graph.zigzag`; the keys
    in the sequence's): query row t is at position zigzagPosition(t).

    ```mlir
    %o, %lse = graph.attention %q, %k, %v : (tensor<8x64x4x16xf32>, tensor<8x64x2x16xf32>, tensor<8x64x2x16xf32>) -> (tensor<8x64x4x16xf32>, tensor<8x4x64xf32>)
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$query, Graph_FloatTensor:$key, Graph_FloatTensor:$value,
                   DefaultValuedAttr<BoolAttr, "true">:$causal,
                   OptionalAttr<Dist_AxesAttr>:$kv_replicated,
                   OptionalAttr<Dist_AxesAttr>:$seq_axes,
                   OptionalAttr<I64Attr>:$zigzag);
  let results = (outs Graph_FloatTensor:$result, Graph_FloatTensor:$lse);
}

def Graph_SoftmaxOp : Graph_DiffOp<"softmax"> {
  let summary = "Softmax over the last dimension, optionally scaled and causal";
  let description = [{
    `softmax(scale * x)` over the last dimension. With `causal`, a row of
    `[..., rows, n]` sees only the columns up to its position, which is its
    index along `rows` modulo `n` (`rows` a multiple of `n`: the query rows of
    a group of heads that share one key head, stacked); the others are zero.
    That is the attention's probabilities when its scores are materialised
    (Megatron-LM's scaled upper-triangular masked softmax).

    ```mlir
    %p = graph.softmax %x : (tensor<8x256xf32>) -> tensor<8x256xf32>
    %a = graph.softmax %s {causal = true, scale = 0.25 : f64} : (tensor<2x4x64x64xf32>) -> tensor<2x4x64x64xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input,
                   DefaultValuedAttr<F64Attr, "1.0">:$scale,
                   DefaultValuedAttr<BoolAttr, "false">:$causal);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_DropoutOp : Graph_DiffOp<"dropout", [], ["localize"]> {
  let summary = "Dropout with a mask drawn from the element's global place";
  let description = [{
    `input * keep / (1 - p)`, where `keep` is drawn per element from `seed`,
    `site` (which place of the model), the running step and the element's
    coordinates in the whole tensor of the step (lib/Runtime's Dropout.h),
    so every layout drops what the one-rank program drops. It is linear and
    its own transpose: the gradient is the same dropout of the result's
    gradient. An evaluation step copies its input.
    Partitioning records `split_axes` (per dimension, the bit set of mesh
    axes that split it) and `microbatches` (which split the batch,
    dimension 0, in time). With `zigzag = n`, dimension 1 (the sequence) is
    in the balanced order of n pieces (`graph.zigzag`): the mask follows the
    element's position in the sequence, not its row.

    ```mlir
    %y = graph.dropout %x {p = 0.1 : f64, seed = 1234 : i64, site = 3 : i64} : (tensor<8x64x64xf32>) -> tensor<8x64x64xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, F64Attr:$p, I64Attr:$seed,
                   I64Attr:$site,
                   OptionalAttr<DenseI64ArrayAttr>:$split_axes,
                   OptionalAttr<I64Attr>:$microbatches,
                   OptionalAttr<I64Attr>:$zigzag);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_ZigzagOp : Graph_DiffOp<"zigzag"> {
  let summary = "A sequence into (or out of) the balanced order of n pieces";
  let description = [{
    Context parallelism with balanced pieces: dimension `dim` (the sequence,
    T rows) is cut into 2n chunks of T/2n and reordered chunk 0, 2n-1, 1,
    2n-2, ..., so that the contiguous piece c of n holds chunks c and
    2n-1-c. Row t of the result is row zigzagPosition(t) of the input
    (lib/Runtime's Sequence.h); `inverse` puts it back. Linear; the
    gradient is the other direction.

    ```mlir
    %z = graph.zigzag %x {dim = 1 : i64, pieces = 2 : i64} : (tensor<8x64x16xf32>) -> tensor<8x64x16xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, I64Attr:$dim, I64Attr:$pieces,
                   DefaultValuedAttr<BoolAttr, "false">:$inverse);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_CrossEntropyOp : Graph_DiffOp<"cross_entropy", [], ["localize"]> {
  let summary = "Mean token cross-entropy of logits against target ids";
  let description = [{
    `logits` is `[..., vocab]`, `targets` has the leading shape `[...]`; the
    result is the mean over all tokens of `-log softmax(logits)[target]`.
    With `vocab_axes` the logits are this rank's slice of the vocabulary
    (see `graph.embedding`); the softmax statistics are reduced over those
    axes. With `valid_vocab` the vocabulary is padded: only the first
    `valid_vocab` classes (global indices) take part in the softmax.

    ```mlir
    %loss = graph.cross_entropy %logits, %targets : (tensor<8x64x256xf32>, tensor<8x64xi32>) -> tensor<f32>
    %padded = graph.cross_entropy %logits, %targets {valid_vocab = 250 : i64} : (tensor<8x64x256xf32>, tensor<8x64xi32>) -> tensor<f32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$logits, Graph_I32Tensor:$targets,
                   OptionalAttr<Dist_AxesAttr>:$vocab_axes,
                   OptionalAttr<I64Attr>:$valid_vocab);
  let results = (outs Graph_FloatScalar:$result);
}

//===----------------------------------------------------------------------===//
// Layout
//===----------------------------------------------------------------------===//

def Graph_ReshapeOp : Graph_PureOp<"reshape",
    [DeclareOpInterfaceMethods<GradientOpInterface>]> {
  let summary = "Same elements, new shape";
  let description = [{
    ```mlir
    %q = graph.reshape %x : (tensor<8x64x64xf32>) -> tensor<8x64x4x16xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_TransposeOp : Graph_DiffOp<"transpose"> {
  let summary = "Permutes dimensions";
  let description = [{
    Result dimension `i` is input dimension `permutation[i]`.

    ```mlir
    %t = graph.transpose %x {permutation = array<i64: 0, 2, 1, 3>} : (tensor<8x64x4x16xf32>) -> tensor<8x4x64x16xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, DenseI64ArrayAttr:$permutation);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_SplitOp : Graph_PureOp<"split",
    [DeclareOpInterfaceMethods<GradientOpInterface>]> {
  let summary = "Splits a tensor into consecutive pieces along one axis";
  let description = [{
    The piece sizes are the result types' sizes along `axis`; they must add
    up to the input's.

    ```mlir
    %q, %k, %v = graph.split %qkv {axis = 2 : i64} : (tensor<8x64x192xf32>) -> (tensor<8x64x64xf32>, tensor<8x64x64xf32>, tensor<8x64x64xf32>)
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, I64Attr:$axis);
  let results = (outs Variadic<Graph_FloatTensor>:$results);
}

def Graph_ConcatOp : Graph_DiffOp<"concat"> {
  let summary = "Concatenates tensors along one axis";
  let description = [{
    ```mlir
    %qkv = graph.concat %q, %k, %v {axis = 2 : i64} : (tensor<8x64x64xf32>, tensor<8x64x64xf32>, tensor<8x64x64xf32>) -> tensor<8x64x192xf32>
    ```
  }];
  let arguments = (ins Variadic<Graph_FloatTensor>:$inputs, I64Attr:$axis);
  let results = (outs Graph_FloatTensor:$result);
}

//===----------------------------------------------------------------------===//
// Gradient ops (built by the autodiff pass)
//===----------------------------------------------------------------------===//

def Graph_ReduceSumOp : Graph_PureOp<"reduce_sum"> {
  let summary = "Sums over leading dimensions";
  let description = [{
    The result's shape is a suffix of the input's; the leading dimensions
    are summed. The gradient of a broadcast operand.

    ```mlir
    %db = graph.reduce_sum %dy : (tensor<8x64x192xf32>) -> tensor<192xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_GeluGradOp : Graph_InferOp<"gelu_grad"> {
  let summary = "Gradient of gelu: dy * gelu'(x)";
  let description = [{
    ```mlir
    %dx = graph.gelu_grad %x, %dy : (tensor<8x256xf32>, tensor<8x256xf32>) -> tensor<8x256xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, Graph_FloatTensor:$grad);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_SiluGradOp : Graph_InferOp<"silu_grad"> {
  let summary = "Gradient of silu: dy * silu'(x)";
  let description = [{
    ```mlir
    %dx = graph.silu_grad %x, %dy : (tensor<8x256xf32>, tensor<8x256xf32>) -> tensor<8x256xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, Graph_FloatTensor:$grad);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_LayerNormGradOp : Graph_InferOp<"layer_norm_grad"> {
  let summary = "Gradients of layer_norm for input, weight and bias";
  let description = [{
    Recomputes the statistics from the input.

    ```mlir
    %dx, %dw, %db = graph.layer_norm_grad %x, %w, %dy {epsilon = 1.0e-05 : f64} : (tensor<8x64xf32>, tensor<64xf32>, tensor<8x64xf32>) -> (tensor<8x64xf32>, tensor<64xf32>, tensor<64xf32>)
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, Graph_FloatTensor:$weight, Graph_FloatTensor:$grad,
                   DefaultValuedAttr<F64Attr, "1.0e-5">:$epsilon);
  let results = (outs Graph_FloatTensor:$input_grad, Graph_FloatTensor:$weight_grad,
                 Graph_FloatTensor:$bias_grad);
}

def Graph_RmsNormGradOp : Graph_InferOp<"rms_norm_grad"> {
  let summary = "Gradients of rms_norm for input and weight";
  let description = [{
    ```mlir
    %dx, %dw = graph.rms_norm_grad %x, %w, %dy {epsilon = 1.0e-05 : f64} : (tensor<8x64xf32>, tensor<64xf32>, tensor<8x64xf32>) -> (tensor<8x64xf32>, tensor<64xf32>)
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, Graph_FloatTensor:$weight, Graph_FloatTensor:$grad,
                   DefaultValuedAttr<F64Attr, "1.0e-5">:$epsilon);
  let results = (outs Graph_FloatTensor:$input_grad, Graph_FloatTensor:$weight_grad);
}

def Graph_AttentionGradOp : Graph_InferOp<"attention_grad", [], ["localize"]> {
  let summary = "Gradients of attention for query, key and value";
  let description = [{
    Takes the forward's `result` and `lse`: the probabilities are
    `exp(scale * q k^T - lse)`, recomputed tile by tile, and the softmax
    gradient's row sums are `rowsum(grad * result)`.

    ```mlir
    %dq, %dk, %dv = graph.attention_grad %q, %k, %v, %o, %lse, %do : (tensor<2x8x4x16xf32>, tensor<2x8x2x16xf32>, tensor<2x8x2x16xf32>, tensor<2x8x4x16xf32>, tensor<2x4x8xf32>, tensor<2x8x4x16xf32>) -> (tensor<2x8x4x16xf32>, tensor<2x8x2x16xf32>, tensor<2x8x2x16xf32>)
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$query, Graph_FloatTensor:$key, Graph_FloatTensor:$value,
                   Graph_FloatTensor:$result, Graph_FloatTensor:$lse,
                   Graph_FloatTensor:$grad, DefaultValuedAttr<BoolAttr, "true">:$causal,
                   OptionalAttr<Dist_AxesAttr>:$kv_replicated,
                   OptionalAttr<Dist_AxesAttr>:$seq_axes,
                   OptionalAttr<I64Attr>:$zigzag);
  let results = (outs Graph_FloatTensor:$query_grad, Graph_FloatTensor:$key_grad,
                 Graph_FloatTensor:$value_grad);
}

def Graph_SoftmaxGradOp : Graph_InferOp<"softmax_grad"> {
  let summary = "Gradient of softmax from its output: scale * y * (dy - sum(dy * y))";
  let description = [{
    A causal softmax's masked outputs are zero, so their gradients are too.

    ```mlir
    %dx = graph.softmax_grad %y, %dy : (tensor<8x256xf32>, tensor<8x256xf32>) -> tensor<8x256xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$output, Graph_FloatTensor:$grad,
                   DefaultValuedAttr<F64Attr, "1.0">:$scale);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_CrossEntropyGradOp : Graph_InferOp<"cross_entropy_grad", [], ["localize"]> {
  let summary = "Gradient of cross_entropy with respect to the logits";
  let description = [{
    Zero in the padding classes (from `valid_vocab` on).

    ```mlir
    %dl = graph.cross_entropy_grad %logits, %targets, %dloss : (tensor<8x64x256xf32>, tensor<8x64xi32>, tensor<f32>) -> tensor<8x64x256xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$logits, Graph_I32Tensor:$targets, Graph_FloatScalar:$grad,
                   OptionalAttr<Dist_AxesAttr>:$vocab_axes,
                   OptionalAttr<I64Attr>:$valid_vocab);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_EmbeddingGradOp : Graph_PureOp<"embedding_grad", [], ["localize"]> {
  let summary = "Gradient of embedding with respect to the table";
  let description = [{
    Scatter-adds the rows of the gradient into a zeroed `[vocab, hidden]`
    table in token order.

    ```mlir
    %dt = graph.embedding_grad %ids, %dy : (tensor<8x64xi32>, tensor<8x64x64xf32>) -> tensor<256x64xf32>
    ```
  }];
  let arguments = (ins Graph_I32Tensor:$ids, Graph_FloatTensor:$grad,
                   OptionalAttr<Dist_AxesAttr>:$vocab_axes);
  let results = (outs Graph_FloatTensor:$result);
}

//===----------------------------------------------------------------------===//
// Mixture of experts (Hugging Face Mixtral routing)
//
// Tokens are all leading dimensions of the routed tensors: `probs` is
// [..., E], `experts`, `weights` and `row_of` are [..., k], the layer's
// input and output [..., C]. The expert-major buffers have R = tokens * k
// rows; expert e's rows are [offsets[e], offsets[e + 1]) and the rows past
// offsets[E] (dropped assignments) hold nothing a later op reads.
//===----------------------------------------------------------------------===//

def Graph_MoeTopKOp : Graph_DiffOp<"moe_top_k"> {
  let summary = "The top k experts of each token and their renormalised weights";
  let description = [{
    The k largest router probabilities of each token in descending order,
    the lower expert first on a tie; `weights` are those probabilities over
    their sum.

    ```mlir
    %w, %e = graph.moe_top_k %probs {top_k = 2 : i64} : (tensor<8x64x8xf32>) -> (tensor<8x64x2xf32>, tensor<8x64x2xi32>)
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$probs, I64Attr:$top_k);
  let results = (outs Graph_FloatTensor:$weights, Graph_I32Tensor:$experts);
}

def Graph_MoeTopKGradOp : Graph_InferOp<"moe_top_k_grad"> {
  let summary = "Gradient of moe_top_k with respect to the probabilities";
  let description = [{
    ```mlir
    %dp = graph.moe_top_k_grad %probs, %e, %dw : (tensor<8x64x8xf32>, tensor<8x64x2xi32>, tensor<8x64x2xf32>) -> tensor<8x64x8xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$probs, Graph_I32Tensor:$experts,
                   Graph_FloatTensor:$grad);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_MoeLoadStatsOp : Graph_DiffOp<"moe_load_stats"> {
  let summary = "Assignments per expert and each expert's summed probability";
  let description = [{
    `counts[e]` is the number of top-k assignments to expert e (before any
    capacity drops), `prob_sums[e]` the sum over tokens of `probs[..., e]`.
    Over split tokens both are partial sums; the load-balancing loss reads
    them summed over all the microbatch's tokens.

    ```mlir
    %c, %s = graph.moe_load_stats %probs, %e : (tensor<8x64x8xf32>, tensor<8x64x2xi32>) -> (tensor<8xf32>, tensor<8xf32>)
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$probs, Graph_I32Tensor:$experts);
  let results = (outs Graph_FloatTensor:$counts, Graph_FloatTensor:$prob_sums);
}

def Graph_MoeProbSumsGradOp : Graph_InferOp<"moe_prob_sums_grad"> {
  let summary = "Gradient of moe_load_stats' probability sums";
  let description = [{
    `result[..., e] = grad[e]`, shaped as `probs`.

    ```mlir
    %dp = graph.moe_prob_sums_grad %probs, %ds : (tensor<8x64x8xf32>, tensor<8xf32>) -> tensor<8x64x8xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$probs, Graph_FloatTensor:$grad);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_MoeAuxLossOp : Graph_DiffOp<"moe_aux_loss", [], ["localize"]> {
  let summary = "Switch's load-balancing loss of one MoE layer";
  let description = [{
    `coef * E * sum_e f_e P_e` with `f_e = counts[e] / (tokens * top_k)` and
    `P_e = prob_sums[e] / tokens`, `tokens` the microbatch's (all ranks').
    Differentiable in `prob_sums` only. Every rank computes the whole loss;
    over split tokens each holds its share (a partial sum, as the
    cross-entropy), its gradient being the whole loss's.

    ```mlir
    %aux = graph.moe_aux_loss %c, %s {tokens = 512 : i64, top_k = 2 : i64, coef = 1.0e-02 : f64} : (tensor<8xf32>, tensor<8xf32>) -> tensor<f32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$counts, Graph_FloatTensor:$prob_sums,
                   I64Attr:$tokens, I64Attr:$top_k, F64Attr:$coef);
  let results = (outs Graph_FloatScalar:$result);
}

def Graph_MoeAuxLossGradOp : Graph_InferOp<"moe_aux_loss_grad", [], ["localize"]> {
  let summary = "Gradient of moe_aux_loss with respect to the probability sums";
  let description = [{
    ```mlir
    %ds = graph.moe_aux_loss_grad %c, %daux {tokens = 512 : i64, top_k = 2 : i64, coef = 1.0e-02 : f64} : (tensor<8xf32>, tensor<f32>) -> tensor<8xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$counts, Graph_FloatScalar:$grad,
                   I64Attr:$tokens, I64Attr:$top_k, F64Attr:$coef);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_MoeZLossOp : Graph_DiffOp<"moe_z_loss", [], ["localize"]> {
  let summary = "The router z-loss: coef * mean over tokens of logsumexp(logits)^2";
  let description = [{
    ```mlir
    %z = graph.moe_z_loss %logits {coef = 1.0e-03 : f64} : (tensor<8x64x8xf32>) -> tensor<f32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$logits, F64Attr:$coef);
  let results = (outs Graph_FloatScalar:$result);
}

def Graph_MoeZLossGradOp : Graph_InferOp<"moe_z_loss_grad", [], ["localize"]> {
  let summary = "Gradient of moe_z_loss with respect to the logits";
  let description = [{
    ```mlir
    %dl = graph.moe_z_loss_grad %logits, %dz {coef = 1.0e-03 : f64} : (tensor<8x64x8xf32>, tensor<f32>) -> tensor<8x64x8xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$logits, Graph_FloatScalar:$grad,
                   F64Attr:$coef);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_MoeDispatchOp : Graph_Op<"moe_dispatch", [Pure, InferTypeOpAdaptor],
                                   ["localize"]> {
  let summary = "Where each assignment goes in the expert-major buffer";
  let description = [{
    `row_of[..., s]` is the row of the token's assignment s, or -1 when its
    expert is full: with `capacity` > 0 an expert keeps its first
    `capacity` assignments in token order (the serial program's order),
    counting the microbatch's tokens on all ranks: `token_axes` (set by the
    partition) are the axes splitting them, whose ranks before this one
    count first (with the sequence split over tp, row by row: a row's piece
    comes after the earlier rows and the row's pieces on earlier tp ranks).
    `offsets` [E + 1] are this rank's experts' row ranges. Not
    differentiable.

    ```mlir
    %rows, %off = graph.moe_dispatch %e {num_experts = 8 : i64, capacity = 0 : i64} : (tensor<8x64x2xi32>) -> (tensor<8x64x2xi32>, tensor<9xi32>)
    ```
  }];
  let arguments = (ins Graph_I32Tensor:$experts, I64Attr:$num_experts,
                   DefaultValuedAttr<I64Attr, "0">:$capacity,
                   OptionalAttr<Dist_AxesAttr>:$token_axes);
  let results = (outs Graph_I32Tensor:$row_of, Graph_I32Tensor:$offsets);
  let assemblyFormat = "operands attr-dict `:` functional-type(operands, results)";
}

def Graph_MoeKeptCountsOp : Graph_PureOp<"moe_kept_counts"> {
  let summary = "Assignments each expert kept (after capacity), as floats";
  let description = [{
    `result[e] = offsets[e + 1] - offsets[e]`: the rows of expert e that
    `moe_dispatch` kept. `experts` (the dispatch's input) says how the
    tokens are split: over split tokens the result is a partial sum, like
    `moe_load_stats`' counts. An observation for the metrics (with the
    counts before capacity it gives the drop rate); not differentiable.

    ```mlir
    %kept = graph.moe_kept_counts %e, %off : (tensor<8x64x2xi32>, tensor<9xi32>) -> tensor<8xf32>
    ```
  }];
  let arguments = (ins Graph_I32Tensor:$experts, Graph_I32Tensor:$offsets);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_MoePermuteOp : Graph_DiffOp<"moe_permute"> {
  let summary = "Gathers each kept assignment's token into its expert's rows";
  let description = [{
    `result[row_of[t, s]] = input[t]`: `[..., C]` to `[tokens * k, C]`.

    ```mlir
    %xp = graph.moe_permute %x, %rows : (tensor<8x64x64xf32>, tensor<8x64x2xi32>) -> tensor<1024x64xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, Graph_I32Tensor:$row_of);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_MoePermuteGradOp : Graph_InferOp<"moe_permute_grad"> {
  let summary = "Gradient of moe_permute: each token sums its kept rows";
  let description = [{
    ```mlir
    %dx = graph.moe_permute_grad %dxp, %rows : (tensor<1024x64xf32>, tensor<8x64x2xi32>) -> tensor<8x64x64xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$grad, Graph_I32Tensor:$row_of);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_MoeUnpermuteOp : Graph_DiffOp<"moe_unpermute"> {
  let summary = "Each token's weighted sum of its kept assignments' rows";
  let description = [{
    `result[t] = sum over kept s (ascending) of weights[t, s] * rows[row_of[t, s]]`.

    ```mlir
    %y = graph.moe_unpermute %yp, %rows, %w : (tensor<1024x64xf32>, tensor<8x64x2xi32>, tensor<8x64x2xf32>) -> tensor<8x64x64xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$rows, Graph_I32Tensor:$row_of,
                   Graph_FloatTensor:$weights);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_MoeUnpermuteGradOp : Graph_InferOp<"moe_unpermute_grad"> {
  let summary = "Gradients of moe_unpermute for the rows and the weights";
  let description = [{
    ```mlir
    %dyp, %dw = graph.moe_unpermute_grad %yp, %rows, %w, %dy : (tensor<1024x64xf32>, tensor<8x64x2xi32>, tensor<8x64x2xf32>, tensor<8x64x64xf32>) -> (tensor<1024x64xf32>, tensor<8x64x2xf32>)
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$rows, Graph_I32Tensor:$row_of,
                   Graph_FloatTensor:$weights, Graph_FloatTensor:$grad);
  let results = (outs Graph_FloatTensor:$rows_grad, Graph_FloatTensor:$weights_grad);
}

def Graph_MoeExchangeOp : Graph_PureOp<"moe_exchange",
    [DeclareOpInterfaceMethods<GradientOpInterface>]> {
  let summary = "Expert-major rows to the ranks that hold their experts";
  let description = [{
    With expert parallelism (`ep_axes`, set by sharding propagation) the
    experts are split over those axes: each rank sends its rows of expert
    e to the rank holding e (an all-to-all, counts first) and receives the
    rows of its own experts from every rank, as segments (source rank, then
    expert) whose row ranges are `recv_offsets`; the receive buffer holds
    the most that can come, the rest zero. Without it, the identity.

    ```mlir
    %rr, %ro = graph.moe_exchange %xp, %off : (tensor<1024x64xf32>, tensor<9xi32>) -> (tensor<1024x64xf32>, tensor<9xi32>)
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$rows, Graph_I32Tensor:$offsets,
                   OptionalAttr<Dist_AxesAttr>:$ep_axes);
  let results = (outs Graph_FloatTensor:$recv_rows,
                 Graph_I32Tensor:$recv_offsets);
}

def Graph_MoeCombineOp : Graph_PureOp<"moe_combine",
    [DeclareOpInterfaceMethods<GradientOpInterface>]> {
  let summary = "The experts' output rows back to the ranks they came from";
  let description = [{
    The reverse of `moe_exchange`: `rows` in segments as `recv_offsets`
    says, back into this rank's expert-major order (`offsets`). Without
    expert parallelism, the identity.

    ```mlir
    %yp = graph.moe_combine %ro_out, %ro, %off : (tensor<1024x64xf32>, tensor<9xi32>, tensor<9xi32>) -> tensor<1024x64xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$rows, Graph_I32Tensor:$recv_offsets,
                   Graph_I32Tensor:$offsets,
                   OptionalAttr<Dist_AxesAttr>:$ep_axes);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_GroupedMatmulOp : Graph_DiffOp<"grouped_matmul"> {
  let summary = "Each expert's rows times its weight";
  let description = [{
    `input` is [R, K], `weight` [E, K, N] ([E, N, K] with `transpose_rhs`),
    `offsets` [S + 1] for S segments, a multiple of E: `result[rows of s] =
    input[rows of s] * weight[s % E]` (with expert parallelism a rank's
    segments are its experts' rows from each source rank).

    ```mlir
    %h = graph.grouped_matmul %xp, %w1, %off {transpose_rhs = true} : (tensor<1024x64xf32>, tensor<8x128x64xf32>, tensor<9xi32>) -> tensor<1024x128xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, Graph_FloatTensor:$weight,
                   Graph_I32Tensor:$offsets,
                   DefaultValuedAttr<BoolAttr, "false">:$transpose_rhs);
  let results = (outs Graph_FloatTensor:$result);
}

def Graph_GroupedMatmulWeightGradOp : Graph_PureOp<"grouped_matmul_weight_grad"> {
  let summary = "Gradient of grouped_matmul with respect to the weight";
  let description = [{
    `result[e] = input[rows of e]^T grad[rows of e]`, laid out as the
    weight (transposed with `transpose_rhs`); zero for an expert without
    rows.

    ```mlir
    %dw = graph.grouped_matmul_weight_grad %xp, %dh, %off {transpose_rhs = true} : (tensor<1024x64xf32>, tensor<1024x128xf32>, tensor<9xi32>) -> tensor<8x128x64xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, Graph_FloatTensor:$grad,
                   Graph_I32Tensor:$offsets,
                   DefaultValuedAttr<BoolAttr, "false">:$transpose_rhs);
  let results = (outs Graph_FloatTensor:$result);
}

//===----------------------------------------------------------------------===//
// Optimizer
//===----------------------------------------------------------------------===//

def Graph_GlobalNormOp : Graph_Op<"global_norm", [Pure], ["localize"]> {
  let summary = "The L2 norm of all gradients together";
  let description = [{
    `reduce_axes` (set by the partition pass) gives, per input, the mesh
    axes over which its squares are summed: those that split it.

    ```mlir
    %n = graph.global_norm %g0, %g1 : (tensor<256x64xf32>, tensor<64xf32>) -> tensor<f32>
    ```
  }];
  let arguments = (ins Variadic<Graph_FloatTensor>:$inputs,
                   OptionalAttr<TypedArrayAttrBase<Dist_AxesAttr, "per input">>:$reduce_axes);
  let results = (outs Graph_FloatScalar:$result);
  let assemblyFormat = "operands attr-dict `:` functional-type(operands, results)";
}

def Graph_AdamWOp : Graph_Op<"adamw", [MemoryEffects<[MemWrite]>]> {
  let summary = "One AdamW update of a parameter, in place";
  let description = [{
    Updates `param` (a `graph.param`) and its moment estimates as
    `torch.optim.AdamW` does, after scaling `grad` by
    `min(1, max_grad_norm / (norm + 1e-6))` (no scaling when
    `max_grad_norm <= 0`). The learning rate comes from the runtime's
    schedule at each step. `weight_decay` is the decay applied to this
    parameter (0 for parameters of rank < 2).

    ```mlir
    graph.adamw %w, %dw, %norm {beta1 = 0.9 : f64, beta2 = 0.95 : f64, eps = 1.0e-08 : f64, weight_decay = 0.1 : f64, max_grad_norm = 1.0 : f64} : tensor<64x64xf32>, tensor<64x64xf32>, tensor<f32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$param, Graph_FloatTensor:$grad, Graph_FloatScalar:$norm,
                   F64Attr:$beta1, F64Attr:$beta2, F64Attr:$eps,
                   F64Attr:$weight_decay, F64Attr:$max_grad_norm);
  let assemblyFormat = "$param `,` $grad `,` $norm attr-dict `:` type($param) `,` type($grad) `,` type($norm)";
  let hasVerifier = 1;
}

//===----------------------------------------------------------------------===//
// Inference (tessel compile --inference): a forward step over a KV cache
//===----------------------------------------------------------------------===//

def Graph_KvCacheOp : Graph_Op<"kv_cache", [Pure]> {
  let summary = "A layer's key or value cache, kept from step to step";
  let description = [{
    `[batch, max_len, kv_heads, head_dim]`: the keys (or values) of every
    position a sequence has reached. It lives in the program's KV-cache
    store; `graph.cached_attention` writes it. `dist.param_sharding` splits
    it as the keys it holds are split (heads over tp).

    ```mlir
    %kc = graph.kv_cache "h.0.attn.k_cache" : tensor<1x64x4x16xf32>
    ```
  }];
  let arguments = (ins StrAttr:$name);
  let results = (outs Graph_FloatTensor:$result);
  let assemblyFormat = "$name attr-dict `:` type($result)";
  let hasVerifier = 1;
}

def Graph_CachedAttentionOp : Graph_Op<"cached_attention",
    [MemoryEffects<[MemWrite]>]> {
  let summary = "Attention of new tokens over a KV cache they are added to";
  let description = [{
    `query` is `[batch, seq, heads, head_dim]` for `seq` new tokens, `key`
    and `value` `[batch, seq, kv_heads, head_dim]` theirs, `k_cache` and
    `v_cache` `[batch, max_len, kv_heads, head_dim]`, `positions`
    `[batch, seq]` the place of each new token in its sequence. Writes each
    new token's key and value into row `positions[b, s]` of the caches, then
    attends each query to the cached rows at positions up to its own
    (causal), with grouped KV heads and scale `1/sqrt(head_dim)` as
    `graph.attention`.

    ```mlir
    %o = graph.cached_attention %q, %k, %v, %kc, %vc, %pos : (tensor<1x1x4x16xf32>, tensor<1x1x4x16xf32>, tensor<1x1x4x16xf32>, tensor<1x64x4x16xf32>, tensor<1x64x4x16xf32>, tensor<1x1xi32>) -> tensor<1x1x4x16xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$query, Graph_FloatTensor:$key,
                   Graph_FloatTensor:$value, Graph_FloatTensor:$k_cache,
                   Graph_FloatTensor:$v_cache, Graph_I32Tensor:$positions);
  let results = (outs Graph_FloatTensor:$result);
  let assemblyFormat = "operands attr-dict `:` functional-type(operands, results)";
  let hasVerifier = 1;
}

def Graph_RopeAtOp : Graph_Op<"rope_at", [Pure]> {
  let summary = "Rotary position embedding at given positions";
  let description = [{
    `graph.rope` with the position of token `(b, t)` read from
    `positions[b, t]` rather than `t`.

    ```mlir
    %q2 = graph.rope_at %q, %pos {theta = 1.0e+04 : f64} : (tensor<1x1x4x16xf32>, tensor<1x1xi32>) -> tensor<1x1x4x16xf32>
    ```
  }];
  let arguments = (ins Graph_FloatTensor:$input, Graph_I32Tensor:$positions,
                   DefaultValuedAttr<F64Attr, "10000.0">:$theta);
  let results = (outs Graph_FloatTensor:$result);
  let assemblyFormat = "operands attr-dict `:` functional-type(operands, results)";
  let hasVerifier = 1;
}

def Graph_OutputOp : Graph_Op<"output", [MemoryEffects<[MemWrite]>]> {
  let summary = "A result of an inference step, handed to the runtime";
  let description = [{
    `logits`, `[batch, seq, vocab]`, whole on every rank.

    ```mlir
    graph.output "logits" %l : tensor<1x1x256xf32>
    ```
  }];
  let arguments = (ins StrAttr:$name, Graph_FloatTensor:$value);
  let assemblyFormat = "$name $value attr-dict `:` type($value)";
  let hasVerifier = 1;
}

#endif // TESSEL_GRAPH_OPS
