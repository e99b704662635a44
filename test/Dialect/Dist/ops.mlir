// RUN: tessel-opt %s | tessel-opt | FileCheck %s

// CHECK: module attributes {dist.mesh = #dist.mesh<pp = 2, dp = 2, tp = 4>}
module attributes {dist.mesh = #dist.mesh<tp = 4, dp = 2, pp = 2>} {

// CHECK-LABEL: func.func @collectives
func.func @collectives(%a: tensor<16x64xf32>, %b: tensor<64xf32>, %x: tensor<2x16x64xf32>) {
  // CHECK: dist.all_reduce %{{.*}}, %{{.*}} {axes = #dist.axes<dp>} : (tensor<16x64xf32>, tensor<64xf32>) -> (tensor<16x64xf32>, tensor<64xf32>)
  %g0, %g1 = dist.all_reduce %a, %b {axes = #dist.axes<dp>} : (tensor<16x64xf32>, tensor<64xf32>) -> (tensor<16x64xf32>, tensor<64xf32>)
  // Axes print in the order dp, tp, pp, cp, ep whatever order they were written in.
  // CHECK: %{{.*}}, %[[R:.*]] = dist.all_reduce_start %{{.*}} {axes = #dist.axes<dp, tp>} : (tensor<64xf32>) -> (tensor<64xf32>, !dist.request)
  %s, %r = dist.all_reduce_start %b {axes = #dist.axes<tp, dp>} : (tensor<64xf32>) -> (tensor<64xf32>, !dist.request)
  // CHECK: dist.wait %[[R]]
  dist.wait %r
  // CHECK: dist.all_gather %{{.*}} {axes = #dist.axes<tp>, dim = 1 : i64} : (tensor<2x16x64xf32>) -> tensor<2x64x64xf32>
  %full = dist.all_gather %x {axes = #dist.axes<tp>, dim = 1 : i64} : (tensor<2x16x64xf32>) -> tensor<2x64x64xf32>
  // CHECK: dist.reduce_scatter
  %part = dist.reduce_scatter %full {axes = #dist.axes<tp>, dim = 1 : i64} : (tensor<2x64x64xf32>) -> tensor<2x16x64xf32>
  // CHECK: dist.all_to_all
  %t = dist.all_to_all %a {axes = #dist.axes<tp>, split_dim = 0 : i64, concat_dim = 1 : i64} : (tensor<16x64xf32>) -> tensor<4x256xf32>
  // CHECK: dist.broadcast
  %bc = dist.broadcast %b {axes = #dist.axes<dp>, root = 1 : i64} : (tensor<64xf32>) -> tensor<64xf32>
  // CHECK: dist.send %{{.*}} {axis = #dist.axis<pp>, offset = 1 : i64, tag = 3 : i64} : tensor<64xf32>
  dist.send %b {axis = #dist.axis<pp>, offset = 1 : i64, tag = 3 : i64} : tensor<64xf32>
  // CHECK: dist.recv {axis = #dist.axis<pp>, offset = -1 : i64, tag = 3 : i64} : tensor<64xf32>
  %rv = dist.recv {axis = #dist.axis<pp>, offset = -1 : i64, tag = 3 : i64} : tensor<64xf32>
  return
}

// CHECK-LABEL: func.func @annotated
// CHECK-SAME: dist.sharding = #dist.sharding<{{\[\[dp\], \[\], \[tp\]\]}}, partial = []>
func.func @annotated(%x: tensor<2x16x64xf32> {dist.sharding = #dist.sharding<[[dp], [], [tp]], partial = []>}) {
  // CHECK: #dist.sharding<{{\[\[dp\], \[\]\]}}, partial = [tp]>
  %y = graph.reshape %x {dist.sharding = [#dist.sharding<[[dp], []], partial = [tp]>]} : (tensor<2x16x64xf32>) -> tensor<2x1024xf32>
  return
}

// CHECK-LABEL: func.func @pieces
// CHECK-SAME: blocks = [1, 3]
func.func @pieces(%k: tensor<8x64x2x16xf32>, %w: tensor<64x192xf32> {dist.sharding = #dist.sharding<[[], [tp]], partial = [], blocks = [1, 3]>}) {
  // CHECK: dist.local_slice %{{.*}} {axes = #dist.axes<tp>, denominator = 2 : i64, dim = 2 : i64, numerator = 1 : i64} : (tensor<8x64x2x16xf32>) -> tensor<8x64x1x16xf32>
  %k1 = dist.local_slice %k {axes = #dist.axes<tp>, dim = 2 : i64, numerator = 1 : i64, denominator = 2 : i64} : (tensor<8x64x2x16xf32>) -> tensor<8x64x1x16xf32>
  // CHECK: dist.local_insert
  %dk = dist.local_insert %k1 {axes = #dist.axes<tp>, dim = 2 : i64, numerator = 1 : i64, denominator = 2 : i64} : (tensor<8x64x1x16xf32>) -> tensor<8x64x2x16xf32>
  return
}

}
