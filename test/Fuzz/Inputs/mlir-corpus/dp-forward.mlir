// A small model on a dp=2 mesh with its training recipe, for the whole pipeline.
module attributes {dist.mesh = #dist.mesh<dp = 2>, graph.recipe = {name = "dp-forward", global_batch = 4 : i64, seq_len = 6 : i64, vocab = 32 : i64, steps = 10 : i64, warmup_steps = 0 : i64, seed = 1 : i64, grad_clip = 1.0 : f64, lr = 1.0e-3 : f64, beta1 = 0.9 : f64, beta2 = 0.95 : f64, eps = 1.0e-8 : f64, weight_decay = 0.1 : f64, min_lr = 1.0e-4 : f64, decay = "cosine"}} {
func.func @forward() -> tensor<f32> {
  %w = graph.param "w" : tensor<16x8xf32>
  %b = graph.param "b" {init = "zeros"} : tensor<8xf32>
  %e = graph.param "wte" : tensor<32x16xf32>
  %ids = graph.input "tokens" : tensor<4x6xi32>
  %t = graph.input "targets" : tensor<4x6xi32>
  %x = graph.embedding %e, %ids : (tensor<32x16xf32>, tensor<4x6xi32>) -> tensor<4x6x16xf32>
  %y = graph.matmul %x, %w : (tensor<4x6x16xf32>, tensor<16x8xf32>) -> tensor<4x6x8xf32>
  %z = graph.add %y, %b : (tensor<4x6x8xf32>, tensor<8xf32>) -> tensor<4x6x8xf32>
  %g = graph.gelu %z : (tensor<4x6x8xf32>) -> tensor<4x6x8xf32>
  %h = graph.matmul %g, %w {transpose_rhs = true} : (tensor<4x6x8xf32>, tensor<16x8xf32>) -> tensor<4x6x16xf32>
  %l = graph.matmul %h, %e {transpose_rhs = true} : (tensor<4x6x16xf32>, tensor<32x16xf32>) -> tensor<4x6x32xf32>
  %loss = graph.cross_entropy %l, %t : (tensor<4x6x32xf32>, tensor<4x6xi32>) -> tensor<f32>
  return %loss : tensor<f32>
}
}
