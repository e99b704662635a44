// A small model on a dp=2 mesh, for the sharding tests.
module attributes {dist.mesh = #dist.mesh<dp = 2>} {
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
