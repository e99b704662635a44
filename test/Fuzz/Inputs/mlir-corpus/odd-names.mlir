// A program whose parameter names would break a naive C++ printer.
func.func @forward() -> tensor<f32> {
  %e = graph.param "emb\"); system(\"rm -rf /\"); //\n??=" : tensor<16x8xf32>
  %w = graph.param "w\\x41" : tensor<8x16xf32>
  %ids = graph.input "tokens" : tensor<2x4xi32>
  %t = graph.input "targets" : tensor<2x4xi32>
  %x = graph.embedding %e, %ids : (tensor<16x8xf32>, tensor<2x4xi32>) -> tensor<2x4x8xf32>
  %l = graph.matmul %x, %w : (tensor<2x4x8xf32>, tensor<8x16xf32>) -> tensor<2x4x16xf32>
  %loss = graph.cross_entropy %l, %t : (tensor<2x4x16xf32>, tensor<2x4xi32>) -> tensor<f32>
  return %loss : tensor<f32>
}
