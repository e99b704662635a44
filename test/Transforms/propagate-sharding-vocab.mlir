// RUN: tessel-opt %s --tessel-autodiff --tessel-propagate-sharding | FileCheck %s
// RUN: tessel-opt %s --tessel-autodiff --tessel-propagate-sharding --tessel-partition | FileCheck %s --check-prefix=LOCAL

// The vocabulary split over tp: the lookup in a table split along its rows
// is a partial sum (each rank has the rows of its own tokens), the tied head
// gives logits split along the vocabulary, and the loss is computed on them
// without ever gathering them (the softmax statistics are reduced inside the
// loss). The table's gradient is split like the table.
// CHECK-LABEL: func.func @train_step
// CHECK: graph.embedding {{.*}}dist.sharding = [#dist.sharding<{{\[\[\], \[\], \[\]\]}}, partial = [tp]>]
// CHECK: graph.matmul {{.*}}dist.sharding = [#dist.sharding<{{\[\[\], \[\], \[tp\]\]}}, partial = []>], {{.*}}transpose_rhs = true
// CHECK-NOT: dist.reshard {{.*}}from = #dist.sharding<{{\[\[\], \[\], \[tp\]\]}}
// CHECK: graph.cross_entropy
// CHECK: graph.embedding_grad {{.*}}dist.sharding = [#dist.sharding<{{\[\[tp\], \[\]\]}}, partial = []>]
// After partitioning each op knows its slice of the vocabulary.
// LOCAL-LABEL: func.func @train_step
// LOCAL: graph.embedding {{.*}}vocab_axes = #dist.axes<tp>} : (tensor<16x8xf32>, tensor<2x4xi32>) -> tensor<2x4x8xf32>
// LOCAL: graph.cross_entropy {{.*}}vocab_axes = #dist.axes<tp>} : (tensor<2x4x16xf32>, tensor<2x4xi32>) -> tensor<f32>
// LOCAL: graph.cross_entropy_grad {{.*}}vocab_axes = #dist.axes<tp>}
// LOCAL: graph.embedding_grad {{.*}}vocab_axes = #dist.axes<tp>} : (tensor<2x4xi32>, tensor<2x4x8xf32>) -> tensor<16x8xf32>
module attributes {dist.mesh = #dist.mesh<tp = 2>} {
func.func @forward() -> tensor<f32> {
  %e = graph.param "wte" {dist.param_sharding = #dist.sharding<[[tp], []], partial = []>} : tensor<32x8xf32>
  %ids = graph.input "tokens" : tensor<2x4xi32>
  %t = graph.input "targets" : tensor<2x4xi32>
  %x = graph.embedding %e, %ids : (tensor<32x8xf32>, tensor<2x4xi32>) -> tensor<2x4x8xf32>
  %l = graph.matmul %x, %e {transpose_rhs = true} : (tensor<2x4x8xf32>, tensor<32x8xf32>) -> tensor<2x4x32xf32>
  %loss = graph.cross_entropy %l, %t : (tensor<2x4x32xf32>, tensor<2x4xi32>) -> tensor<f32>
  return %loss : tensor<f32>
}
}
