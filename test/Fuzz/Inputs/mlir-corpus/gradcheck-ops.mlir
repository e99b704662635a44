// The graph ops that the two model families do not use, on one path to the
// loss: softmax, transpose, a transposed batched lhs, a batched rhs, concat,
// a broadcast mul, and a split whose second piece is unused.
func.func @forward() -> tensor<f32> {
  %wte = graph.param "wte" : tensor<11x6xf32>
  %bm = graph.param "batched" : tensor<2x3x5xf32>
  %w2 = graph.param "w2" : tensor<5x3xf32>
  %scale = graph.param "scale" {init = "ones"} : tensor<10xf32>
  %wo = graph.param "wo" : tensor<10x11xf32>
  %ids = graph.input "tokens" : tensor<2x3xi32>
  %tg = graph.input "targets" : tensor<2x3xi32>
  %x = graph.embedding %wte, %ids : (tensor<11x6xf32>, tensor<2x3xi32>) -> tensor<2x3x6xf32>
  %s = graph.softmax %x : (tensor<2x3x6xf32>) -> tensor<2x3x6xf32>
  %a = graph.matmul %s, %bm {transpose_lhs = true} : (tensor<2x3x6xf32>, tensor<2x3x5xf32>) -> tensor<2x6x5xf32>
  %t = graph.transpose %s {permutation = array<i64: 0, 2, 1>} : (tensor<2x3x6xf32>) -> tensor<2x6x3xf32>
  %b = graph.matmul %t, %w2 {transpose_rhs = true} : (tensor<2x6x3xf32>, tensor<5x3xf32>) -> tensor<2x6x5xf32>
  %c = graph.concat %a, %b {axis = 2 : i64} : (tensor<2x6x5xf32>, tensor<2x6x5xf32>) -> tensor<2x6x10xf32>
  %g = graph.mul %c, %scale : (tensor<2x6x10xf32>, tensor<10xf32>) -> tensor<2x6x10xf32>
  %p1, %p2 = graph.split %g {axis = 1 : i64} : (tensor<2x6x10xf32>) -> (tensor<2x3x10xf32>, tensor<2x3x10xf32>)
  %logits = graph.matmul %p1, %wo : (tensor<2x3x10xf32>, tensor<10x11xf32>) -> tensor<2x3x11xf32>
  %loss = graph.cross_entropy %logits, %tg : (tensor<2x3x11xf32>, tensor<2x3xi32>) -> tensor<f32>
  return %loss : tensor<f32>
}
