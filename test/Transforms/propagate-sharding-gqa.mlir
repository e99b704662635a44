// RUN: tessel-opt %s --split-input-file --tessel-propagate-sharding | FileCheck %s
// RUN: tessel-opt %s --split-input-file --tessel-propagate-sharding --tessel-partition | FileCheck %s --check-prefix=LOCAL

// Grouped KV heads split with the query heads when the group divides them
// (4 query heads, 2 KV heads over tp = 2: one KV head per rank).
// CHECK-LABEL: func.func @train_step
// CHECK: graph.attention {{.*}}dist.sharding = [#dist.sharding<{{\[\[\], \[\], \[tp\], \[\]\]}}, partial = []>, #dist.sharding<{{\[\[\], \[tp\], \[\]\]}}, partial = []>]
// CHECK-NOT: kv_replicated
// LOCAL-LABEL: func.func @train_step
// LOCAL: graph.attention {{.*}} : (tensor<2x4x2x8xf32>, tensor<2x4x1x8xf32>, tensor<2x4x1x8xf32>) -> (tensor<2x4x2x8xf32>, tensor<2x2x4xf32>)
module attributes {dist.mesh = #dist.mesh<tp = 2>} {
func.func @train_step() -> tensor<2x4x4x8xf32> {
  %q = graph.param "q" {dist.param_sharding = #dist.sharding<[[], [], [tp], []], partial = []>} : tensor<2x4x4x8xf32>
  %k = graph.param "k" {dist.param_sharding = #dist.sharding<[[], [], [tp], []], partial = []>} : tensor<2x4x2x8xf32>
  %v = graph.param "v" {dist.param_sharding = #dist.sharding<[[], [], [tp], []], partial = []>} : tensor<2x4x2x8xf32>
  %o, %lse = graph.attention %q, %k, %v : (tensor<2x4x4x8xf32>, tensor<2x4x2x8xf32>, tensor<2x4x2x8xf32>) -> (tensor<2x4x4x8xf32>, tensor<2x4x4xf32>)
  return %o : tensor<2x4x4x8xf32>
}
}

// -----

// More ranks than KV heads (4 query heads, 2 KV heads over tp = 4): every
// rank holds both KV heads and reads the one its query head uses.
// CHECK-LABEL: func.func @train_step
// CHECK: graph.attention {{.*}}kv_replicated = #dist.axes<tp>
// LOCAL-LABEL: func.func @train_step
// LOCAL: %[[K:.*]] = dist.local_slice %{{.*}} {axes = #dist.axes<tp>, denominator = 2 : i64, dim = 2 : i64, {{.*}}numerator = 1 : i64} : (tensor<2x4x2x8xf32>) -> tensor<2x4x1x8xf32>
// LOCAL: %[[V:.*]] = dist.local_slice
// LOCAL: graph.attention %{{.*}}, %[[K]], %[[V]] {{.*}} : (tensor<2x4x1x8xf32>, tensor<2x4x1x8xf32>, tensor<2x4x1x8xf32>) -> (tensor<2x4x1x8xf32>, tensor<2x1x4xf32>)
module attributes {dist.mesh = #dist.mesh<tp = 4>} {
func.func @train_step() -> tensor<2x4x4x8xf32> {
  %q = graph.param "q" {dist.param_sharding = #dist.sharding<[[], [], [tp], []], partial = []>} : tensor<2x4x4x8xf32>
  %k = graph.param "k" : tensor<2x4x2x8xf32>
  %v = graph.param "v" : tensor<2x4x2x8xf32>
  %o, %lse = graph.attention %q, %k, %v : (tensor<2x4x4x8xf32>, tensor<2x4x2x8xf32>, tensor<2x4x2x8xf32>) -> (tensor<2x4x4x8xf32>, tensor<2x4x4xf32>)
  return %o : tensor<2x4x4x8xf32>
}
}
