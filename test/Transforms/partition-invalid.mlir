// RUN: tessel-opt %s --split-input-file --tessel-propagate-sharding --tessel-partition --verify-diagnostics -o /dev/null

// Layouts the sharding rules or the partition cannot realise are refused at
// the op that cannot be split.

// A split that does not divide the dimension is refused at the op.
module attributes {dist.mesh = #dist.mesh<tp = 4>} {
func.func @train_step() -> tensor<f32> {
  %x = graph.param "x" : tensor<2x4x8xf32>
  // expected-error@+1 {{dimension 1 of size 6 cannot be split over tp (4 ranks)}}
  %w = graph.param "w" {dist.param_sharding = #dist.sharding<[[], [tp]], partial = []>} : tensor<8x6xf32>
  %t = graph.input "targets" : tensor<2x4xi32>
  %h = graph.matmul %x, %w : (tensor<2x4x8xf32>, tensor<8x6xf32>) -> tensor<2x4x6xf32>
  %loss = graph.cross_entropy %h, %t : (tensor<2x4x6xf32>, tensor<2x4xi32>) -> tensor<f32>
  return %loss : tensor<f32>
}
}

// -----

// KV heads that neither divide nor are a multiple of the tp group.
module attributes {dist.mesh = #dist.mesh<tp = 2>} {
func.func @train_step() -> tensor<2x4x6x8xf32> {
  %q = graph.param "q" {dist.param_sharding = #dist.sharding<[[], [], [tp], []], partial = []>} : tensor<2x4x6x8xf32>
  %k = graph.param "k" : tensor<2x4x3x8xf32>
  %v = graph.param "v" : tensor<2x4x3x8xf32>
  // expected-error@+1 {{kv heads (3) neither divide nor are a multiple of the tp group of 2}}
  %o, %lse = graph.attention %q, %k, %v : (tensor<2x4x6x8xf32>, tensor<2x4x3x8xf32>, tensor<2x4x3x8xf32>) -> (tensor<2x4x6x8xf32>, tensor<2x6x4xf32>)
  return %o : tensor<2x4x6x8xf32>
}
}
