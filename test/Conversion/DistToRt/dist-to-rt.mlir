// RUN: tessel-opt %s --convert-graph-to-rt | FileCheck %s

// The dist ops become the runtime's communication calls on buffers
// (convert-graph-to-rt lowers graph and dist ops together).

module attributes {dist.mesh = #dist.mesh<dp = 2, tp = 2, pp = 2>} {

// A reduction works in place on a working buffer that nothing else reads;
// an operand that is read again (here returned) is reduced in a copy, so
// the original keeps its value. One call covers all the buffers.
// CHECK-LABEL: func.func @all_reduce
// CHECK-SAME: (%[[A:.*]]: memref<16x8xf32>, %[[B:.*]]: memref<8xf32>)
// CHECK: %[[X:.*]] = rt.alloc : memref<16x8xf32>
// CHECK-NEXT: rt.gelu_forward(%[[A]], %[[X]])
// CHECK-NEXT: %[[COPY:.*]] = rt.alloc : memref<8xf32>
// CHECK-NEXT: rt.copy(%[[B]], %[[COPY]]) {n = 8 : i64} : memref<8xf32>, memref<8xf32>
// CHECK-NEXT: rt.all_reduce(%[[X]], %[[COPY]]) {axes = #dist.axes<dp>} : memref<16x8xf32>, memref<8xf32>
// CHECK-NEXT: return %[[X]], %[[COPY]], %[[B]]
func.func @all_reduce(%a: tensor<16x8xf32>, %b: tensor<8xf32>) -> (tensor<16x8xf32>, tensor<8xf32>, tensor<8xf32>) {
  %x = graph.gelu %a : (tensor<16x8xf32>) -> tensor<16x8xf32>
  %r:2 = dist.all_reduce %x, %b {axes = #dist.axes<dp>} : (tensor<16x8xf32>, tensor<8xf32>) -> (tensor<16x8xf32>, tensor<8xf32>)
  return %r#0, %r#1, %b : tensor<16x8xf32>, tensor<8xf32>, tensor<8xf32>
}

// A view shares another value's storage: reducing it in place would change
// that value too, so it is reduced in a copy even with one reader.
// CHECK-LABEL: func.func @view
// CHECK: %[[X:.*]] = rt.alloc : memref<16x8xf32>
// CHECK: %[[V:.*]] = rt.view %[[X]] : memref<16x8xf32> to memref<128xf32>
// CHECK-NEXT: %[[COPY:.*]] = rt.alloc : memref<128xf32>
// CHECK-NEXT: rt.copy(%[[V]], %[[COPY]]) {n = 128 : i64}
// CHECK-NEXT: rt.all_reduce(%[[COPY]]) {axes = #dist.axes<tp>}
// CHECK-NEXT: return %[[COPY]], %[[X]]
func.func @view(%a: tensor<16x8xf32>) -> (tensor<128xf32>, tensor<16x8xf32>) {
  %x = graph.gelu %a : (tensor<16x8xf32>) -> tensor<16x8xf32>
  %v = graph.reshape %x : (tensor<16x8xf32>) -> tensor<128xf32>
  %r = dist.all_reduce %v {axes = #dist.axes<tp>} : (tensor<128xf32>) -> tensor<128xf32>
  return %r, %x : tensor<128xf32>, tensor<16x8xf32>
}

// A started reduction returns a request, which rt.wait takes; the result
// is the reduced buffer itself. Its request slot is left to the memory plan.
// CHECK-LABEL: func.func @overlap
// CHECK: %[[X:.*]] = rt.alloc : memref<16x8xf32>
// CHECK-NEXT: rt.gelu_forward
// CHECK-NEXT: %[[REQ:.*]] = rt.all_reduce_start(%[[X]]) {axes = #dist.axes<dp, tp>} : memref<16x8xf32>
// CHECK-NEXT: rt.wait %[[REQ]]
// CHECK-NEXT: return %[[X]]
func.func @overlap(%a: tensor<16x8xf32>) -> tensor<16x8xf32> {
  %x = graph.gelu %a : (tensor<16x8xf32>) -> tensor<16x8xf32>
  %r, %req = dist.all_reduce_start %x {axes = #dist.axes<dp, tp>} : (tensor<16x8xf32>) -> (tensor<16x8xf32>, !dist.request)
  dist.wait %req
  return %r : tensor<16x8xf32>
}

// Inside the update, the summed inputs (block arguments) are reduced in
// place.
// CHECK-LABEL: func.func @update_inputs
// CHECK: pipe.update
// CHECK-NEXT: ^bb0(%[[L:.*]]: memref<f32>):
// CHECK-NEXT: rt.all_reduce(%[[L]]) {axes = #dist.axes<pp>} : memref<f32>
// CHECK-NEXT: pipe.yield %[[L]], %[[L]]
func.func @update_inputs(%loss: tensor<f32>) -> (tensor<f32>, tensor<f32>) {
  %u:2 = pipe.update(%loss : tensor<f32>) -> tensor<f32>, tensor<f32> {
  ^bb0(%l: tensor<f32>):
    %r = dist.all_reduce %l {axes = #dist.axes<pp>} : (tensor<f32>) -> tensor<f32>
    pipe.yield %r, %r : tensor<f32>, tensor<f32>
  }
  return %u#0, %u#1 : tensor<f32>, tensor<f32>
}

// Gathers and scatters along dimension 1 see the tensor as
// [outer, length, inner] = [2, 4, 8], length being this rank's piece.
// CHECK-LABEL: func.func @along
// CHECK-SAME: (%[[X:.*]]: memref<2x4x8xf32>, %[[Y:.*]]: memref<2x8x8xf32>)
// CHECK: %[[G:.*]] = rt.alloc : memref<2x8x8xf32>
// CHECK-NEXT: rt.all_gather(%[[X]], %[[G]]) {axes = #dist.axes<tp>, inner = 8 : i64, length = 4 : i64, outer = 2 : i64} : memref<2x4x8xf32>, memref<2x8x8xf32>
// CHECK-NEXT: %[[S:.*]] = rt.alloc : memref<2x4x8xf32>
// CHECK-NEXT: rt.reduce_scatter(%[[Y]], %[[S]]) {axes = #dist.axes<tp>, inner = 8 : i64, length = 4 : i64, outer = 2 : i64} : memref<2x8x8xf32>, memref<2x4x8xf32>
// CHECK-NEXT: return %[[G]], %[[S]]
func.func @along(%x: tensor<2x4x8xf32>, %y: tensor<2x8x8xf32>) -> (tensor<2x8x8xf32>, tensor<2x4x8xf32>) {
  %g = dist.all_gather %x {axes = #dist.axes<tp>, dim = 1 : i64} : (tensor<2x4x8xf32>) -> tensor<2x8x8xf32>
  %s = dist.reduce_scatter %y {axes = #dist.axes<tp>, dim = 1 : i64} : (tensor<2x8x8xf32>) -> tensor<2x4x8xf32>
  return %g, %s : tensor<2x8x8xf32>, tensor<2x4x8xf32>
}

// This rank's piece of a dimension starts at groupRank(tp) * 1 / 2: a
// local slice copies it out, a local insert zeroes the whole tensor and
// copies the piece back in.
// CHECK-LABEL: func.func @pieces
// CHECK: %[[K1:.*]] = rt.alloc : memref<8x4x1x16xf32>
// CHECK-NEXT: rt.slice_axis(%arg0, %[[K1]]) {extent = 2 : i64, inner = 16 : i64, length = 1 : i64, outer = 32 : i64, start = #rt.group_offset<<tp>, 1, 2>}
// CHECK-NEXT: %[[DK:.*]] = rt.alloc : memref<8x4x2x16xf32>
// CHECK-NEXT: rt.fill(%[[DK]]) {n = 1024 : i64, value = 0.000000e+00 : f64}
// CHECK-NEXT: rt.insert_axis(%[[K1]], %[[DK]]) {extent = 2 : i64, inner = 16 : i64, length = 1 : i64, outer = 32 : i64, start = #rt.group_offset<<tp>, 1, 2>}
// CHECK-NEXT: return %[[DK]]
func.func @pieces(%k: tensor<8x4x2x16xf32>) -> tensor<8x4x2x16xf32> {
  %k1 = dist.local_slice %k {axes = #dist.axes<tp>, dim = 2 : i64, numerator = 1 : i64, denominator = 2 : i64} : (tensor<8x4x2x16xf32>) -> tensor<8x4x1x16xf32>
  %dk = dist.local_insert %k1 {axes = #dist.axes<tp>, dim = 2 : i64, numerator = 1 : i64, denominator = 2 : i64} : (tensor<8x4x1x16xf32>) -> tensor<8x4x2x16xf32>
  return %dk : tensor<8x4x2x16xf32>
}

// Pipeline transfers keep their offset and tag and take the running
// microbatch (rt.microbatch, bound when the parts become functions); a
// receive fills a fresh buffer.
// CHECK-LABEL: func.func @p2p
// CHECK-SAME: (%[[X:.*]]: memref<2x4x8xf32>)
// CHECK: %[[MB:.*]] = rt.microbatch : i64
// CHECK-NEXT: rt.send(%[[X]]) microbatch %[[MB]] {offset = 1 : i64, tag = 3 : i64} : memref<2x4x8xf32>
// CHECK-NEXT: %[[R:.*]] = rt.alloc : memref<2x4x8xf32>
// CHECK-NEXT: %[[MB2:.*]] = rt.microbatch : i64
// CHECK-NEXT: rt.recv(%[[R]]) microbatch %[[MB2]] {offset = -1 : i64, tag = 5 : i64} : memref<2x4x8xf32>
// CHECK-NEXT: return %[[R]]
func.func @p2p(%x: tensor<2x4x8xf32>) -> tensor<2x4x8xf32> {
  dist.send %x {axis = #dist.axis<pp>, offset = 1 : i64, tag = 3 : i64} : tensor<2x4x8xf32>
  %r = dist.recv {axis = #dist.axis<pp>, offset = -1 : i64, tag = 5 : i64} : tensor<2x4x8xf32>
  return %r : tensor<2x4x8xf32>
}

}
