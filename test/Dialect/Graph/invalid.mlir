// RUN: tessel-opt %s -split-input-file -verify-diagnostics

func.func @bad_matmul(%a: tensor<2x8x16xf32>, %b: tensor<12x4xf32>) {
  // expected-error@+2 {{matmul contraction sizes differ: 16 vs 12}}
  // expected-error@+1 {{failed to infer returned types}}
  %y = graph.matmul %a, %b : (tensor<2x8x16xf32>, tensor<12x4xf32>) -> tensor<2x8x4xf32>
  return
}

// -----

func.func @sum_batch_untransposed(%a: tensor<2x8x16xf32>, %b: tensor<2x8x4xf32>) {
  // expected-error@+2 {{matmul with sum_batch needs transpose_lhs, no transpose_rhs and batched operands of equal rank, got [2x8x16] and [2x8x4]}}
  // expected-error@+1 {{failed to infer returned types}}
  %y = graph.matmul %a, %b {sum_batch = true} : (tensor<2x8x16xf32>, tensor<2x8x4xf32>) -> tensor<16x4xf32>
  return
}

// -----

func.func @wrong_result(%a: tensor<2x8x16xf32>, %b: tensor<16x4xf32>) {
  // expected-error@+2 {{inferred type(s) 'tensor<2x8x4xf32>' are incompatible with return type(s) of operation 'tensor<2x8x5xf32>'}}
  // expected-error@+1 {{failed to infer returned types}}
  %y = graph.matmul %a, %b : (tensor<2x8x16xf32>, tensor<16x4xf32>) -> tensor<2x8x5xf32>
  return
}

// -----

func.func @bad_bias(%a: tensor<2x8x16xf32>, %b: tensor<8xf32>) {
  // expected-error@+2 {{rhs shape [8] must equal or be a suffix of lhs shape [2x8x16]}}
  // expected-error@+1 {{failed to infer returned types}}
  %y = graph.add %a, %b : (tensor<2x8x16xf32>, tensor<8xf32>) -> tensor<2x8x16xf32>
  return
}

// -----

func.func @bad_norm(%x: tensor<4x16xf32>, %w: tensor<15xf32>, %b: tensor<16xf32>) {
  // expected-error@+2 {{weight must be [16], got [15]}}
  // expected-error@+1 {{failed to infer returned types}}
  %y = graph.layer_norm %x, %w, %b : (tensor<4x16xf32>, tensor<15xf32>, tensor<16xf32>) -> tensor<4x16xf32>
  return
}

// -----

func.func @bad_gqa(%q: tensor<2x8x4x4xf32>, %kv: tensor<2x8x3x4xf32>) {
  // expected-error@+2 {{attention heads (4) must be a multiple of kv heads (3)}}
  // expected-error@+1 {{failed to infer returned types}}
  %y, %lse = graph.attention %q, %kv, %kv : (tensor<2x8x4x4xf32>, tensor<2x8x3x4xf32>, tensor<2x8x3x4xf32>) -> (tensor<2x8x4x4xf32>, tensor<2x4x8xf32>)
  return
}

// -----

// The log-sum-exp the gradient reads is [batch, heads, seq].
func.func @bad_lse(%q: tensor<2x8x4x4xf32>, %kv: tensor<2x8x2x4xf32>, %lse: tensor<2x8x4xf32>) {
  // expected-error@+2 {{attention lse must be [2x4x8] of the query's element type, got [2x8x4]}}
  // expected-error@+1 {{failed to infer returned types}}
  %dq, %dk, %dv = graph.attention_grad %q, %kv, %kv, %q, %lse, %q : (tensor<2x8x4x4xf32>, tensor<2x8x2x4xf32>, tensor<2x8x2x4xf32>, tensor<2x8x4x4xf32>, tensor<2x8x4xf32>, tensor<2x8x4x4xf32>) -> (tensor<2x8x4x4xf32>, tensor<2x8x2x4xf32>, tensor<2x8x2x4xf32>)
  return
}

// -----

func.func @odd_rope(%q: tensor<2x8x4x5xf32>) {
  // expected-error@+2 {{rope input must be [batch, seq, heads, head_dim] with an even head_dim}}
  // expected-error@+1 {{failed to infer returned types}}
  %y = graph.rope %q : (tensor<2x8x4x5xf32>) -> tensor<2x8x4x5xf32>
  return
}

// -----

func.func @bad_targets(%l: tensor<2x8x32xf32>, %t: tensor<2x7xi32>) {
  // expected-error@+2 {{targets [2x7] must be the leading shape of logits [2x8x32]}}
  // expected-error@+1 {{failed to infer returned types}}
  %y = graph.cross_entropy %l, %t : (tensor<2x8x32xf32>, tensor<2x7xi32>) -> tensor<f32>
  return
}

// -----

func.func @bad_reshape(%x: tensor<4x16xf32>) {
  // expected-error@+1 {{cannot reshape [4x16] to [4x15]}}
  %y = graph.reshape %x : (tensor<4x16xf32>) -> tensor<4x15xf32>
  return
}

// -----

func.func @bad_split(%x: tensor<4x16xf32>) {
  // expected-error@+1 {{pieces add up to 15 along axis 1, input has 16}}
  %a, %b = graph.split %x {axis = 1 : i64} : (tensor<4x16xf32>) -> (tensor<4x8xf32>, tensor<4x7xf32>)
  return
}

// -----

func.func @bad_concat(%x: tensor<4x16xf32>, %y: tensor<3x16xf32>) {
  // expected-error@+2 {{pieces differ outside axis 1: [3x16] vs [4x16]}}
  // expected-error@+1 {{failed to infer returned types}}
  %z = graph.concat %x, %y {axis = 1 : i64} : (tensor<4x16xf32>, tensor<3x16xf32>) -> tensor<4x32xf32>
  return
}

// -----

func.func @bad_perm(%x: tensor<4x16xf32>) {
  // expected-error@+2 {{permutation is not a permutation of the dimensions}}
  // expected-error@+1 {{failed to infer returned types}}
  %y = graph.transpose %x {permutation = array<i64: 0, 0>} : (tensor<4x16xf32>) -> tensor<4x4xf32>
  return
}

// -----

func.func @bad_init() {
  // expected-error@+1 {{init must be 'normal', 'zeros' or 'ones', got 'uniform'}}
  %p = graph.param "w" {init = "uniform"} : tensor<4xf32>
  return
}

// -----

func.func @bad_input() {
  // expected-error@+1 {{input must be 'tokens', 'targets' or 'positions', got 'labels'}}
  %p = graph.input "labels" : tensor<2x8xi32>
  return
}

// -----

func.func @bad_reduce(%x: tensor<4x16xf32>) {
  // expected-error@+1 {{result shape [4] must be a suffix of the input shape [4x16]}}
  %y = graph.reduce_sum %x : (tensor<4x16xf32>) -> tensor<4xf32>
  return
}

// -----

func.func @bad_embedding_grad(%t: tensor<2x8xi32>, %g: tensor<2x8x16xf32>) {
  // expected-error@+1 {{gradient [2x8x16] does not match ids [2x8] and table [32x15]}}
  %y = graph.embedding_grad %t, %g : (tensor<2x8xi32>, tensor<2x8x16xf32>) -> tensor<32x15xf32>
  return
}

// -----

func.func @bad_embedding(%w: tensor<32xf32>, %t: tensor<2x8xi32>) {
  // expected-error@+2 {{embedding table must be [vocab, hidden], got [32]}}
  // expected-error@+1 {{failed to infer returned types}}
  %y = graph.embedding %w, %t : (tensor<32xf32>, tensor<2x8xi32>) -> tensor<2x8x32xf32>
  return
}

// -----

func.func @adamw_not_param(%x: tensor<16xf32>, %n: tensor<f32>) {
  // expected-error@+1 {{updates a value that is not a graph.param}}
  graph.adamw %x, %x, %n {beta1 = 0.9 : f64, beta2 = 0.95 : f64, eps = 1.0e-8 : f64, weight_decay = 0.0 : f64, max_grad_norm = 1.0 : f64} : tensor<16xf32>, tensor<16xf32>, tensor<f32>
  return
}

// -----

// Block indices are bounded like model.layers (a wrapped-around or huge
// index would size per-block tables).
func.func @huge_block(%x: tensor<16xf32>) {
  // expected-error@+1 {{block index must be in [0, 4096), got 4294967297}}
  %y = graph.gelu %x {graph.layer = #graph.layer<block 4294967297>} : (tensor<16xf32>) -> tensor<16xf32>
  return
}

// -----

// Inference ops: a cache must fit the keys it holds, positions the tokens.
func.func @cache_too_short(%q: tensor<1x4x2x4xf32>, %k: tensor<1x4x2x4xf32>, %c: tensor<1x2x2x4xf32>, %p: tensor<1x4xi32>) {
  // expected-error@+1 {{caches must be [batch, max_len, kv_heads, head_dim] with max_len >= seq}}
  %o = graph.cached_attention %q, %k, %k, %c, %c, %p : (tensor<1x4x2x4xf32>, tensor<1x4x2x4xf32>, tensor<1x4x2x4xf32>, tensor<1x2x2x4xf32>, tensor<1x2x2x4xf32>, tensor<1x4xi32>) -> tensor<1x4x2x4xf32>
  return
}

// -----

func.func @positions_of_other_tokens(%q: tensor<1x1x2x4xf32>, %c: tensor<1x8x2x4xf32>, %p: tensor<1x2xi32>) {
  // expected-error@+1 {{positions must be [batch, seq]}}
  %o = graph.cached_attention %q, %q, %q, %c, %c, %p : (tensor<1x1x2x4xf32>, tensor<1x1x2x4xf32>, tensor<1x1x2x4xf32>, tensor<1x8x2x4xf32>, tensor<1x8x2x4xf32>, tensor<1x2xi32>) -> tensor<1x1x2x4xf32>
  return
}

// -----

func.func @rope_at_odd(%x: tensor<1x1x2x3xf32>, %p: tensor<1x1xi32>) {
  // expected-error@+1 {{input must be [batch, seq, heads, head_dim] with an even head_dim}}
  %y = graph.rope_at %x, %p : (tensor<1x1x2x3xf32>, tensor<1x1xi32>) -> tensor<1x1x2x3xf32>
  return
}

// -----

func.func @cache_rank() {
  // expected-error@+1 {{must be a static [batch, max_len, kv_heads, head_dim] tensor}}
  %c = graph.kv_cache "c" : tensor<8x4xf32>
  return
}

// -----

func.func @other_output(%x: tensor<1x1x8xf32>) {
  // expected-error@+1 {{the one output is 'logits', got 'hidden'}}
  graph.output "hidden" %x : tensor<1x1x8xf32>
  return
}

// -----

func.func @causal_rows(%x: tensor<2x12x8xf32>) {
  // expected-error@+2 {{a causal softmax needs [..., rows, n] with rows a multiple of n, got [2x12x8]}}
  // expected-error@+1 {{failed to infer returned types}}
  %p = graph.softmax %x {causal = true} : (tensor<2x12x8xf32>) -> tensor<2x12x8xf32>
  return
}
