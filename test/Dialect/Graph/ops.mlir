// RUN: tessel-opt %s | tessel-opt | FileCheck %s
// Every graph op prints and parses back to itself.

// CHECK-LABEL: func.func @forward_ops
func.func @forward_ops() -> tensor<f32> {
  // CHECK: graph.param "w" {std = 1.000000e-02 : f64} : tensor<16x48xf32>
  %w = graph.param "w" {init = "normal", std = 0.01 : f64} : tensor<16x48xf32>
  // CHECK: graph.param "ln.weight" {init = "ones"} : tensor<16xf32>
  %lw = graph.param "ln.weight" {init = "ones"} : tensor<16xf32>
  %lb = graph.param "ln.bias" {init = "zeros"} : tensor<16xf32>
  %wte = graph.param "wte" : tensor<32x16xf32>
  // CHECK: graph.input "tokens" : tensor<2x8xi32>
  %ids = graph.input "tokens" : tensor<2x8xi32>
  %tg = graph.input "targets" : tensor<2x8xi32>
  // CHECK: graph.embedding %{{.*}}, %{{.*}} : (tensor<32x16xf32>, tensor<2x8xi32>) -> tensor<2x8x16xf32>
  %x = graph.embedding %wte, %ids : (tensor<32x16xf32>, tensor<2x8xi32>) -> tensor<2x8x16xf32>
  // CHECK: graph.layer_norm
  %h = graph.layer_norm %x, %lw, %lb {epsilon = 1.0e-5 : f64} : (tensor<2x8x16xf32>, tensor<16xf32>, tensor<16xf32>) -> tensor<2x8x16xf32>
  // CHECK: graph.rms_norm
  %r = graph.rms_norm %x, %lw : (tensor<2x8x16xf32>, tensor<16xf32>) -> tensor<2x8x16xf32>
  // CHECK: graph.matmul
  %qkv = graph.matmul %h, %w : (tensor<2x8x16xf32>, tensor<16x48xf32>) -> tensor<2x8x48xf32>
  // CHECK: %[[Q:.*]]:3 = graph.split %{{.*}} {axis = 2 : i64}
  %q, %k, %v = graph.split %qkv {axis = 2 : i64} : (tensor<2x8x48xf32>) -> (tensor<2x8x16xf32>, tensor<2x8x16xf32>, tensor<2x8x16xf32>)
  // CHECK: graph.concat
  %c = graph.concat %q, %k {axis = 2 : i64} : (tensor<2x8x16xf32>, tensor<2x8x16xf32>) -> tensor<2x8x32xf32>
  // CHECK: graph.reshape
  %q4 = graph.reshape %q : (tensor<2x8x16xf32>) -> tensor<2x8x4x4xf32>
  %k4 = graph.reshape %k : (tensor<2x8x16xf32>) -> tensor<2x8x2x8xf32>
  %k2 = graph.reshape %k : (tensor<2x8x16xf32>) -> tensor<2x8x4x4xf32>
  %v2 = graph.reshape %v : (tensor<2x8x16xf32>) -> tensor<2x8x4x4xf32>
  // CHECK: graph.rope {{.*}} {theta = 5.000000e+05 : f64}
  %qr = graph.rope %q4 {theta = 500000.0 : f64} : (tensor<2x8x4x4xf32>) -> tensor<2x8x4x4xf32>
  // CHECK: graph.attention
  %a, %lse = graph.attention %qr, %k2, %v2 : (tensor<2x8x4x4xf32>, tensor<2x8x4x4xf32>, tensor<2x8x4x4xf32>) -> (tensor<2x8x4x4xf32>, tensor<2x4x8xf32>)
  // CHECK: graph.transpose {{.*}} {permutation = array<i64: 0, 2, 1, 3>}
  %t = graph.transpose %a {permutation = array<i64: 0, 2, 1, 3>} : (tensor<2x8x4x4xf32>) -> tensor<2x4x8x4xf32>
  %a3 = graph.reshape %a : (tensor<2x8x4x4xf32>) -> tensor<2x8x16xf32>
  // CHECK: graph.gelu
  %g = graph.gelu %a3 : (tensor<2x8x16xf32>) -> tensor<2x8x16xf32>
  // CHECK: graph.silu
  %s = graph.silu %g : (tensor<2x8x16xf32>) -> tensor<2x8x16xf32>
  // CHECK: graph.mul
  %m = graph.mul %s, %lw : (tensor<2x8x16xf32>, tensor<16xf32>) -> tensor<2x8x16xf32>
  // CHECK: graph.add
  %y = graph.add %m, %r : (tensor<2x8x16xf32>, tensor<2x8x16xf32>) -> tensor<2x8x16xf32>
  // CHECK: graph.matmul {{.*}} {transpose_rhs = true}
  %logits = graph.matmul %y, %wte {transpose_rhs = true} : (tensor<2x8x16xf32>, tensor<32x16xf32>) -> tensor<2x8x32xf32>
  // The head's weight gradient, summed over batch and sequence:
  // CHECK: graph.matmul {{.*}} {sum_batch = true, transpose_lhs = true} : (tensor<2x8x32xf32>, tensor<2x8x16xf32>) -> tensor<32x16xf32>
  %dwte = graph.matmul %logits, %y {sum_batch = true, transpose_lhs = true} : (tensor<2x8x32xf32>, tensor<2x8x16xf32>) -> tensor<32x16xf32>
  // CHECK: graph.softmax
  %p = graph.softmax %logits : (tensor<2x8x32xf32>) -> tensor<2x8x32xf32>
  // CHECK: graph.cross_entropy
  %loss = graph.cross_entropy %logits, %tg : (tensor<2x8x32xf32>, tensor<2x8xi32>) -> tensor<f32>
  return %loss : tensor<f32>
}

// CHECK-LABEL: func.func @gradient_ops
func.func @gradient_ops(%x: tensor<4x16xf32>, %w: tensor<16xf32>, %q: tensor<2x8x4x4xf32>,
                        %kv: tensor<2x8x2x4xf32>, %l: tensor<2x8x32xf32>, %t: tensor<2x8xi32>,
                        %e: tensor<2x8x16xf32>, %one: tensor<f32>) {
  // CHECK: graph.fill {value = 1.000000e+00 : f64} : tensor<f32>
  %f = graph.fill {value = 1.0 : f64} : tensor<f32>
  // CHECK: graph.reduce_sum
  %rs = graph.reduce_sum %x : (tensor<4x16xf32>) -> tensor<16xf32>
  // CHECK: graph.gelu_grad
  %gg = graph.gelu_grad %x, %x : (tensor<4x16xf32>, tensor<4x16xf32>) -> tensor<4x16xf32>
  // CHECK: graph.silu_grad
  %sg = graph.silu_grad %x, %x : (tensor<4x16xf32>, tensor<4x16xf32>) -> tensor<4x16xf32>
  // CHECK: graph.layer_norm_grad
  %dx, %dw, %db = graph.layer_norm_grad %x, %w, %x : (tensor<4x16xf32>, tensor<16xf32>, tensor<4x16xf32>) -> (tensor<4x16xf32>, tensor<16xf32>, tensor<16xf32>)
  // CHECK: graph.rms_norm_grad
  %rx, %rw = graph.rms_norm_grad %x, %w, %x : (tensor<4x16xf32>, tensor<16xf32>, tensor<4x16xf32>) -> (tensor<4x16xf32>, tensor<16xf32>)
  %lse = graph.fill {value = 0.0 : f64} : tensor<2x4x8xf32>
  // CHECK: graph.attention_grad
  %dq, %dk, %dv = graph.attention_grad %q, %kv, %kv, %q, %lse, %q : (tensor<2x8x4x4xf32>, tensor<2x8x2x4xf32>, tensor<2x8x2x4xf32>, tensor<2x8x4x4xf32>, tensor<2x4x8xf32>, tensor<2x8x4x4xf32>) -> (tensor<2x8x4x4xf32>, tensor<2x8x2x4xf32>, tensor<2x8x2x4xf32>)
  // CHECK: graph.softmax_grad
  %smg = graph.softmax_grad %x, %x : (tensor<4x16xf32>, tensor<4x16xf32>) -> tensor<4x16xf32>
  // CHECK: graph.cross_entropy_grad
  %ceg = graph.cross_entropy_grad %l, %t, %one : (tensor<2x8x32xf32>, tensor<2x8xi32>, tensor<f32>) -> tensor<2x8x32xf32>
  // CHECK: graph.embedding_grad
  %eg = graph.embedding_grad %t, %e : (tensor<2x8xi32>, tensor<2x8x16xf32>) -> tensor<32x16xf32>
  // CHECK: graph.global_norm
  %n = graph.global_norm %x, %w : (tensor<4x16xf32>, tensor<16xf32>) -> tensor<f32>
  return
}

// CHECK-LABEL: func.func @optimizer
func.func @optimizer(%g: tensor<16xf32>, %n: tensor<f32>) {
  %p = graph.param "b" {init = "zeros"} : tensor<16xf32>
  // CHECK: graph.adamw %{{.*}}, %{{.*}}, %{{.*}} {beta1 = 9.000000e-01 : f64
  graph.adamw %p, %g, %n {beta1 = 0.9 : f64, beta2 = 0.95 : f64, eps = 1.0e-8 : f64, weight_decay = 0.0 : f64, max_grad_norm = 1.0 : f64} : tensor<16xf32>, tensor<16xf32>, tensor<f32>
  return
}

// An attention's probabilities when its scores are materialised: two query
// heads stacked over 16 keys, scaled and causal.
// CHECK-LABEL: func.func @causal_softmax
func.func @causal_softmax(%s: tensor<2x32x16xf32>) -> tensor<2x32x16xf32> {
  // CHECK: graph.softmax {{.*}} {causal = true, scale = 2.500000e-01 : f64} : (tensor<2x32x16xf32>)
  %p = graph.softmax %s {causal = true, scale = 0.25 : f64} : (tensor<2x32x16xf32>) -> tensor<2x32x16xf32>
  // CHECK: graph.softmax_grad {{.*}} {scale = 2.500000e-01 : f64}
  %d = graph.softmax_grad %p, %s {scale = 0.25 : f64} : (tensor<2x32x16xf32>, tensor<2x32x16xf32>) -> tensor<2x32x16xf32>
  return %d : tensor<2x32x16xf32>
}
