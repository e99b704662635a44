// RUN: tessel-opt %s --tessel-partition --verify-diagnostics -o /dev/null

// A dimension split over tp cannot be cut further over cp in place: cp is
// slower than tp in the order of a dimension's pieces, so the pieces of
// [tp, cp] are not parts of the tp pieces (their data lies on other ranks).
module attributes {dist.mesh = #dist.mesh<tp = 2, cp = 2>} {
func.func @train_step() {
  %x = graph.param "x" {dist.param_sharding = #dist.sharding<[[], [tp], []], partial = []>, dist.sharding = [#dist.sharding<[[], [tp], []], partial = []>]} : tensor<4x8x3xf32>
  // expected-error@+1 {{cannot lower the reshard from #dist.sharding<[[], [tp], []], partial = []> to #dist.sharding<[[], [tp, cp], []], partial = []>}}
  %y = "dist.reshard"(%x) <{from = #dist.sharding<[[], [tp], []], partial = []>, to = #dist.sharding<[[], [tp, cp], []], partial = []>}> {dist.sharding = [#dist.sharding<[[], [tp, cp], []], partial = []>]} : (tensor<4x8x3xf32>) -> tensor<4x8x3xf32>
  return
}
}
