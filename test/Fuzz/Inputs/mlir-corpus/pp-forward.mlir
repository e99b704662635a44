// Two transformer blocks between an embedding and a head, each op tagged
// with its part of the model, on two pipeline ranks.
module attributes {dist.mesh = #dist.mesh<pp = 2>, graph.recipe = {name = "pp-forward", global_batch = 2 : i64, seq_len = 4 : i64, vocab = 32 : i64, steps = 10 : i64, warmup_steps = 0 : i64, seed = 1 : i64, grad_clip = 1.0 : f64, lr = 1.0e-3 : f64, beta1 = 0.9 : f64, beta2 = 0.95 : f64, eps = 1.0e-8 : f64, weight_decay = 0.1 : f64, min_lr = 1.0e-4 : f64, decay = "cosine"}} {
func.func @forward() -> tensor<f32> {
  %ids = graph.input "tokens" : tensor<2x4xi32>
  %t = graph.input "targets" : tensor<2x4xi32>
  %e = graph.param "wte" {graph.layer = #graph.layer<embedding>} : tensor<32x8xf32>
  %x = graph.embedding %e, %ids {graph.layer = #graph.layer<embedding>} : (tensor<32x8xf32>, tensor<2x4xi32>) -> tensor<2x4x8xf32>
  %w0 = graph.param "h.0.w" {graph.layer = #graph.layer<block 0>} : tensor<8x8xf32>
  %h0 = graph.matmul %x, %w0 {graph.layer = #graph.layer<block 0>} : (tensor<2x4x8xf32>, tensor<8x8xf32>) -> tensor<2x4x8xf32>
  %a0 = graph.gelu %h0 {graph.layer = #graph.layer<block 0>} : (tensor<2x4x8xf32>) -> tensor<2x4x8xf32>
  %w1 = graph.param "h.1.w" {graph.layer = #graph.layer<block 1>} : tensor<8x8xf32>
  %h1 = graph.matmul %a0, %w1 {graph.layer = #graph.layer<block 1>} : (tensor<2x4x8xf32>, tensor<8x8xf32>) -> tensor<2x4x8xf32>
  %wo = graph.param "head.w" {graph.layer = #graph.layer<head>} : tensor<32x8xf32>
  %l = graph.matmul %h1, %wo {transpose_rhs = true, graph.layer = #graph.layer<head>} : (tensor<2x4x8xf32>, tensor<32x8xf32>) -> tensor<2x4x32xf32>
  %loss = graph.cross_entropy %l, %t {graph.layer = #graph.layer<head>} : (tensor<2x4x32xf32>, tensor<2x4xi32>) -> tensor<f32>
  return %loss : tensor<f32>
}
}
