// RUN: tessel-opt %s --tessel-propagate-sharding | FileCheck %s
// RUN: tessel-opt %s --tessel-propagate-sharding --tessel-partition | FileCheck %s --check-prefix=LOCAL

// Sequence parallelism: a partial sum over tp that a consumer needs summed
// becomes split along the sequence instead of replicated (a reduce-scatter),
// the norm runs on the sequence shard, and the next column-parallel matmul
// gathers the sequence back (an all-gather), as in Megatron's SP.
// CHECK-LABEL: func.func @train_step
// CHECK: %[[Y:.*]] = graph.matmul {{.*}}partial = [tp]>]
// CHECK: dist.reshard %[[Y]] {{.*}}to = #dist.sharding<{{\[\[\], \[tp\], \[\]\]}}, partial = []>
// CHECK: graph.rms_norm {{.*}}dist.sharding = [#dist.sharding<{{\[\[\], \[tp\], \[\]\]}}, partial = []>]
// CHECK: dist.reshard {{.*}}to = #dist.sharding<{{\[\[\], \[\], \[\]\]}}, partial = []>
// CHECK: graph.matmul {{.*}}dist.sharding = [#dist.sharding<{{\[\[\], \[\], \[tp\]\]}}, partial = []>]
// LOCAL-LABEL: func.func @train_step
// LOCAL: dist.reduce_scatter %{{.*}} {axes = #dist.axes<tp>, dim = 1 : i64{{.*}} : (tensor<2x4x8xf32>) -> tensor<2x2x8xf32>
// LOCAL: graph.rms_norm {{.*}} : (tensor<2x2x8xf32>, tensor<8xf32>) -> tensor<2x2x8xf32>
// LOCAL: dist.all_gather %{{.*}} {axes = #dist.axes<tp>, dim = 1 : i64{{.*}} : (tensor<2x2x8xf32>) -> tensor<2x4x8xf32>
module attributes {dist.mesh = #dist.mesh<tp = 2>, dist.sequence_parallel} {
func.func @train_step() -> tensor<f32> {
  %x = graph.param "x" {dist.param_sharding = #dist.sharding<[[], [], [tp]], partial = []>} : tensor<2x4x16xf32>
  %wr = graph.param "wr" {dist.param_sharding = #dist.sharding<[[tp], []], partial = []>} : tensor<16x8xf32>
  %ln = graph.param "ln" {init = "ones"} : tensor<8xf32>
  %wc = graph.param "wc" {dist.param_sharding = #dist.sharding<[[], [tp]], partial = []>} : tensor<8x16xf32>
  %t = graph.input "targets" : tensor<2x4xi32>
  %y = graph.matmul %x, %wr : (tensor<2x4x16xf32>, tensor<16x8xf32>) -> tensor<2x4x8xf32>
  %n = graph.rms_norm %y, %ln : (tensor<2x4x8xf32>, tensor<8xf32>) -> tensor<2x4x8xf32>
  %h = graph.matmul %n, %wc : (tensor<2x4x8xf32>, tensor<8x16xf32>) -> tensor<2x4x16xf32>
  %loss = graph.cross_entropy %h, %t : (tensor<2x4x16xf32>, tensor<2x4xi32>) -> tensor<f32>
  return %loss : tensor<f32>
}
}
