// RUN: tessel-opt %s --split-input-file --tessel-propagate-sharding | FileCheck %s
// RUN: tessel-opt %s --split-input-file --tessel-propagate-sharding --tessel-partition | FileCheck %s --check-prefix=LOCAL

// Megatron's MLP: a column-parallel matmul splits its output's features, the
// elementwise GELU keeps them split, the row-parallel matmul contracts over
// them into a partial sum, which is reduced (one all-reduce) only when the
// residual add needs it whole.
// CHECK-LABEL: func.func @train_step
// CHECK: %[[H:.*]] = graph.matmul {{.*}}dist.sharding = [#dist.sharding<{{\[\[\], \[\], \[tp\]\]}}, partial = []>]
// CHECK: graph.gelu %[[H]] {dist.sharding = [#dist.sharding<{{\[\[\], \[\], \[tp\]\]}}, partial = []>]
// CHECK: %[[Y:.*]] = graph.matmul {{.*}}dist.sharding = [#dist.sharding<{{\[\[\], \[\], \[\]\]}}, partial = [tp]>]
// CHECK: %[[R:.*]] = dist.reshard %[[Y]] {{.*}}from = #dist.sharding<{{\[\[\], \[\], \[\]\]}}, partial = [tp]>, {{.*}}to = #dist.sharding<{{\[\[\], \[\], \[\]\]}}, partial = []>
// CHECK: graph.add %{{.*}}, %[[R]]
// LOCAL-LABEL: func.func @train_step
// LOCAL: graph.param "wc" {{.*}} : tensor<8x8xf32>
// LOCAL: graph.param "wr" {{.*}} : tensor<8x8xf32>
// LOCAL: graph.matmul {{.*}} : (tensor<2x4x8xf32>, tensor<8x8xf32>) -> tensor<2x4x8xf32>
// LOCAL: %[[P:.*]] = graph.matmul
// LOCAL-NEXT: %[[S:.*]] = dist.all_reduce %[[P]] {axes = #dist.axes<tp>
// LOCAL-NEXT: graph.add %{{.*}}, %[[S]]
module attributes {dist.mesh = #dist.mesh<tp = 2>} {
func.func @train_step() -> tensor<f32> {
  %x = graph.param "x" : tensor<2x4x8xf32>
  %wc = graph.param "wc" {dist.param_sharding = #dist.sharding<[[], [tp]], partial = []>} : tensor<8x16xf32>
  %wr = graph.param "wr" {dist.param_sharding = #dist.sharding<[[tp], []], partial = []>} : tensor<16x8xf32>
  %t = graph.input "targets" : tensor<2x4xi32>
  %h = graph.matmul %x, %wc : (tensor<2x4x8xf32>, tensor<8x16xf32>) -> tensor<2x4x16xf32>
  %g = graph.gelu %h : (tensor<2x4x16xf32>) -> tensor<2x4x16xf32>
  %y = graph.matmul %g, %wr : (tensor<2x4x16xf32>, tensor<16x8xf32>) -> tensor<2x4x8xf32>
  %r = graph.add %x, %y : (tensor<2x4x8xf32>, tensor<2x4x8xf32>) -> tensor<2x4x8xf32>
  %loss = graph.cross_entropy %r, %t : (tensor<2x4x8xf32>, tensor<2x4xi32>) -> tensor<f32>
  return %loss : tensor<f32>
}
}

// -----

// A partial sum added to a partial sum stays partial (reduced once, later);
// a norm needs its row whole and summed.
// CHECK-LABEL: func.func @train_step
// CHECK: %[[A:.*]] = graph.add {{.*}}partial = [tp]>]
// CHECK: %[[R:.*]] = dist.reshard %[[A]]
// CHECK: graph.rms_norm %[[R]]
module attributes {dist.mesh = #dist.mesh<tp = 2>} {
func.func @train_step() -> tensor<f32> {
  %x = graph.param "x" {dist.param_sharding = #dist.sharding<[[], [], [tp]], partial = []>} : tensor<2x4x16xf32>
  %w1 = graph.param "w1" {dist.param_sharding = #dist.sharding<[[tp], []], partial = []>} : tensor<16x8xf32>
  %w2 = graph.param "w2" {dist.param_sharding = #dist.sharding<[[tp], []], partial = []>} : tensor<16x8xf32>
  %ln = graph.param "ln" {init = "ones"} : tensor<8xf32>
  %t = graph.input "targets" : tensor<2x4xi32>
  %a = graph.matmul %x, %w1 : (tensor<2x4x16xf32>, tensor<16x8xf32>) -> tensor<2x4x8xf32>
  %b = graph.matmul %x, %w2 : (tensor<2x4x16xf32>, tensor<16x8xf32>) -> tensor<2x4x8xf32>
  %s = graph.add %a, %b : (tensor<2x4x8xf32>, tensor<2x4x8xf32>) -> tensor<2x4x8xf32>
  %n = graph.rms_norm %s, %ln : (tensor<2x4x8xf32>, tensor<8xf32>) -> tensor<2x4x8xf32>
  %loss = graph.cross_entropy %n, %t : (tensor<2x4x8xf32>, tensor<2x4xi32>) -> tensor<f32>
  return %loss : tensor<f32>
}
}

