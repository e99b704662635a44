
module attributes {dist.mesh = #dist.mesh<tp = 4, dp = 2, pp = 2>} {

func.func @collectives(%a: tensor<16x64xf32>, %b: tensor<64xf32>, %x: tensor<2x16x64xf32>) {
  %g0, %g1 = dist.all_reduce %a, %b {axes = #dist.axes<dp>} : (tensor<16x64xf32>, tensor<64xf32>) -> (tensor<16x64xf32>, tensor<64xf32>)
  // Axes print in the order dp, tp, pp, cp, ep whatever order they were written in.
  %s, %r = dist.all_reduce_start %b {axes = #dist.axes<tp, dp>} : (tensor<64xf32>) -> (tensor<64xf32>, !dist.request)
  dist.wait %r
  %full = dist.all_gather %x {axes = #dist.axes<tp>, dim = 1 : i64} : (tensor<2x16x64xf32>) -> tensor<2x64x64xf32>
  %part = dist.reduce_scatter %full {axes = #dist.axes<tp>, dim = 1 : i64} : (tensor<2x64x64xf32>) -> tensor<2x16x64xf32>
  %t = dist.all_to_all %a {axes = #dist.axes<tp>, split_dim = 0 : i64, concat_dim = 1 : i64} : (tensor<16x64xf32>) -> tensor<4x256xf32>
  %bc = dist.broadcast %b {axes = #dist.axes<dp>, root = 1 : i64} : (tensor<64xf32>) -> tensor<64xf32>
  dist.send %b {axis = #dist.axis<pp>, offset = 1 : i64, tag = 3 : i64} : tensor<64xf32>
  %rv = dist.recv {axis = #dist.axis<pp>, offset = -1 : i64, tag = 3 : i64} : tensor<64xf32>
  return
}

func.func @annotated(%x: tensor<2x16x64xf32> {dist.sharding = #dist.sharding<[[dp], [], [tp]], partial = []>}) {
  %y = graph.reshape %x {dist.sharding = [#dist.sharding<[[dp], []], partial = [tp]>]} : (tensor<2x16x64xf32>) -> tensor<2x1024xf32>
  return
}

func.func @pieces(%k: tensor<8x64x2x16xf32>, %w: tensor<64x192xf32> {dist.sharding = #dist.sharding<[[], [tp]], partial = [], blocks = [1, 3]>}) {
  %k1 = dist.local_slice %k {axes = #dist.axes<tp>, dim = 2 : i64, numerator = 1 : i64, denominator = 2 : i64} : (tensor<8x64x2x16xf32>) -> tensor<8x64x1x16xf32>
  %dk = dist.local_insert %k1 {axes = #dist.axes<tp>, dim = 2 : i64, numerator = 1 : i64, denominator = 2 : i64} : (tensor<8x64x1x16xf32>) -> tensor<8x64x2x16xf32>
  return
}

}
