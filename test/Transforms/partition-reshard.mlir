// RUN: tessel-opt %s --tessel-partition | FileCheck %s

// A dimension split over cp cut further over tp (a sequence piece of cp
// cut over tp under sequence parallelism): tp is faster than cp in the
// order a dimension's pieces take (the group's ranks, tp fastest), so the
// pieces of [tp, cp] are those of cp, each cut over tp, and every rank
// keeps its part of its own piece, with no collective.
module attributes {dist.mesh = #dist.mesh<tp = 2, cp = 2>} {
// CHECK-LABEL: func.func @train_step
func.func @train_step() {
  // CHECK: %[[X:.*]] = graph.param "x" {{.*}} : tensor<4x4x3xf32>
  %x = graph.param "x" {dist.param_sharding = #dist.sharding<[[], [cp], []], partial = []>, dist.sharding = [#dist.sharding<[[], [cp], []], partial = []>]} : tensor<4x8x3xf32>
  // CHECK-NEXT: dist.local_slice %[[X]] {axes = #dist.axes<tp>, denominator = 1 : i64, dim = 1 : i64{{.*}}numerator = 2 : i64} : (tensor<4x4x3xf32>) -> tensor<4x2x3xf32>
  // CHECK-NOT: dist.all_gather
  %y = "dist.reshard"(%x) <{from = #dist.sharding<[[], [cp], []], partial = []>, to = #dist.sharding<[[], [tp, cp], []], partial = []>}> {dist.sharding = [#dist.sharding<[[], [tp, cp], []], partial = []>]} : (tensor<4x8x3xf32>) -> tensor<4x8x3xf32>
  return
}
}
