// Two transformer blocks between an embedding and a head, each op tagged
// with its part of the model, on two pipeline ranks.
module attributes {dist.mesh = #dist.mesh<pp = 2>} {
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
