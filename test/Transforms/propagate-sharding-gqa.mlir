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

// -----

// The key/value gradients of KV heads replicated over tp are partial sums
// over tp (here a product contracted over tp stands for one). The inverse
// rotation is linear and keeps them partial; a matmul with a weight split
// along K by tp takes them reduce-scattered along K (its product stays
// partial), and a weight gradient (sum_batch) takes the same split along M,
// so its gradient comes out split like the weight: no all-reduce of the
// activation, no gathered weight.
// CHECK-LABEL: func.func @train_step
// CHECK: graph.rope {{.*}}dist.sharding = [#dist.sharding<{{\[\[\], \[\], \[\], \[\]\]}}, partial = [tp]>]
// CHECK: %[[SPLIT:.*]] = dist.reshard %{{.*}} from = #dist.sharding<{{\[\[\], \[\], \[\]\]}}, partial = [tp]>, to = #dist.sharding<{{\[\[\], \[\], \[tp\]\]}}, partial = []>}
// CHECK: graph.matmul %[[SPLIT]], %{{.*}} {dist.sharding = [#dist.sharding<{{\[\[\], \[\], \[\]\]}}, partial = [tp]>]}
// CHECK: graph.matmul %[[SPLIT]], %{{.*}} {dist.sharding = [#dist.sharding<{{\[\[tp\], \[\]\]}}, partial = []>], sum_batch = true, transpose_lhs = true}
// LOCAL-LABEL: func.func @train_step
// LOCAL-NOT: dist.all_reduce
// LOCAL-NOT: dist.all_gather
// LOCAL: dist.reduce_scatter %{{.*}} {axes = #dist.axes<tp>, dim = 2 : i64
// LOCAL: graph.matmul
// LOCAL: graph.matmul
module attributes {dist.mesh = #dist.mesh<tp = 4>} {
func.func @train_step() -> (tensor<2x4x64xf32>, tensor<32x64xf32>) {
  %a = graph.param "a" {dist.param_sharding = #dist.sharding<[[], [], [tp]], partial = []>} : tensor<2x4x16xf32>
  %b = graph.param "b" {dist.param_sharding = #dist.sharding<[[tp], []], partial = []>} : tensor<16x32xf32>
  %p = graph.matmul %a, %b : (tensor<2x4x16xf32>, tensor<16x32xf32>) -> tensor<2x4x32xf32>
  %h = graph.reshape %p : (tensor<2x4x32xf32>) -> tensor<2x4x2x16xf32>
  %r = graph.rope %h {inverse = true} : (tensor<2x4x2x16xf32>) -> tensor<2x4x2x16xf32>
  %g = graph.reshape %r : (tensor<2x4x2x16xf32>) -> tensor<2x4x32xf32>
  %w = graph.param "w" {dist.param_sharding = #dist.sharding<[[tp], []], partial = []>} : tensor<32x64xf32>
  %dx = graph.matmul %g, %w : (tensor<2x4x32xf32>, tensor<32x64xf32>) -> tensor<2x4x64xf32>
  %x = graph.param "x" : tensor<2x4x64xf32>
  %dw = graph.matmul %g, %x {sum_batch = true, transpose_lhs = true} : (tensor<2x4x32xf32>, tensor<2x4x64xf32>) -> tensor<32x64xf32>
  return %dx, %dw : tensor<2x4x64xf32>, tensor<32x64xf32>
}
}
