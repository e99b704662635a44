// RUN: tessel-opt %s --convert-graph-to-rt | FileCheck %s

// Every tensor becomes a memref of the same shape, every graph op the rt
// kernel that computes it into a fresh rt.alloc with all its sizes as
// attributes, and every parameter an rt.param that says how this rank's
// piece is cut from the global tensor.

module attributes {dist.mesh = #dist.mesh<tp = 2>} {

// A parameter split along its columns over tp has twice the columns
// globally; one without dist.sharding is whole (shard_dim -1). Only
// parameters of rank 2 or more are decayed. The initialiser is kept.
// CHECK-LABEL: func.func @params() -> (memref<16x48xf32>, memref<8xf32>)
// CHECK: rt.param "h.0.w" {decay = true, global_shape = array<i64: 16, 96>, init = "normal", mean = 0.000000e+00 : f64, shard_axis = #dist.axis<tp>, shard_blocks = 1 : i64, shard_dim = 1 : i64, std = 1.000000e-02 : f64} : memref<16x48xf32>
// CHECK: rt.param "h.0.b" {decay = false, global_shape = array<i64: 8>, init = "zeros", {{.*}}shard_dim = -1 : i64{{.*}}} : memref<8xf32>
func.func @params() -> (tensor<16x48xf32>, tensor<8xf32>) {
  %w = graph.param "h.0.w" {dist.sharding = [#dist.sharding<[[], [tp]], partial = []>], std = 0.01 : f64} : tensor<16x48xf32>
  %b = graph.param "h.0.b" {init = "zeros"} : tensor<8xf32>
  return %w, %b : tensor<16x48xf32>, tensor<8xf32>
}

// The batch inputs are rt.batch; a matmul over a [2, 6, 16] activation is a
// batch of 2 (6x16)x(16x8) products against one shared weight (stride_b 0);
// an add broadcasts its 8-element bias over 96 elements; a reshape is a
// view of the same buffer, not a copy.
// CHECK-LABEL: func.func @forward
// CHECK-SAME: (%[[W:.*]]: memref<16x8xf32>, %[[B:.*]]: memref<8xf32>, %[[WTE:.*]]: memref<32x16xf32>) -> memref<f32>
// CHECK: %[[IDS:.*]] = rt.batch "tokens" : memref<2x6xi32>
// CHECK: %[[T:.*]] = rt.batch "targets" : memref<2x6xi32>
// CHECK: %[[X:.*]] = rt.alloc : memref<2x6x16xf32>
// CHECK-NEXT: rt.embedding_forward(%[[WTE]], %[[IDS]], %[[X]]) {hidden = 16 : i64, n = 12 : i64, vocab = 32 : i64}
// CHECK: %[[Y:.*]] = rt.alloc : memref<2x6x8xf32>
// CHECK-NEXT: rt.matmul(%[[X]], %[[W]], %[[Y]]) {batch = 2 : i64, k = 16 : i64, m = 6 : i64, n = 8 : i64, stride_a = 96 : i64, stride_b = 0 : i64, stride_c = 48 : i64, trans_a = false, trans_b = false}
// CHECK: %[[Z:.*]] = rt.alloc : memref<2x6x8xf32>
// CHECK-NEXT: rt.add_broadcast(%[[Y]], %[[B]], %[[Z]]) {n = 96 : i64, nb = 8 : i64}
// CHECK: %[[G:.*]] = rt.alloc : memref<2x6x8xf32>
// CHECK-NEXT: rt.gelu_forward(%[[Z]], %[[G]]) {n = 96 : i64}
// CHECK-NEXT: %[[G2:.*]] = rt.view %[[G]] : memref<2x6x8xf32> to memref<12x8xf32>
// CHECK-NEXT: %[[H:.*]] = rt.alloc : memref<12x16xf32>
// CHECK-NEXT: rt.matmul(%[[G2]], %[[W]], %[[H]]) {batch = 1 : i64, k = 8 : i64, m = 12 : i64, n = 16 : i64, stride_a = 96 : i64, stride_b = 0 : i64, stride_c = 192 : i64, trans_a = false, trans_b = true}
// CHECK: %[[L:.*]] = rt.alloc : memref<12x32xf32>
// CHECK-NEXT: rt.matmul(%[[H]], %[[WTE]], %[[L]]) {{.*}}n = 32 : i64{{.*}}trans_b = true}
// CHECK-NEXT: %[[L3:.*]] = rt.view %[[L]] : memref<12x32xf32> to memref<2x6x32xf32>
// CHECK-NEXT: %[[LOSS:.*]] = rt.alloc : memref<f32>
// CHECK-NEXT: rt.cross_entropy_forward(%[[L3]], %[[T]], %[[LOSS]]) {rows = 12 : i64, valid = 32 : i64, vocab = 32 : i64}
// CHECK-NEXT: return %[[LOSS]] : memref<f32>
// CHECK-NOT: graph.
func.func @forward(%w: tensor<16x8xf32>, %b: tensor<8xf32>, %wte: tensor<32x16xf32>) -> tensor<f32> {
  %ids = graph.input "tokens" : tensor<2x6xi32>
  %t = graph.input "targets" : tensor<2x6xi32>
  %x = graph.embedding %wte, %ids : (tensor<32x16xf32>, tensor<2x6xi32>) -> tensor<2x6x16xf32>
  %y = graph.matmul %x, %w : (tensor<2x6x16xf32>, tensor<16x8xf32>) -> tensor<2x6x8xf32>
  %z = graph.add %y, %b : (tensor<2x6x8xf32>, tensor<8xf32>) -> tensor<2x6x8xf32>
  %g = graph.gelu %z : (tensor<2x6x8xf32>) -> tensor<2x6x8xf32>
  %g2 = graph.reshape %g : (tensor<2x6x8xf32>) -> tensor<12x8xf32>
  %h = graph.matmul %g2, %w {transpose_rhs = true} : (tensor<12x8xf32>, tensor<16x8xf32>) -> tensor<12x16xf32>
  %l = graph.matmul %h, %wte {transpose_rhs = true} : (tensor<12x16xf32>, tensor<32x16xf32>) -> tensor<12x32xf32>
  %l3 = graph.reshape %l : (tensor<12x32xf32>) -> tensor<2x6x32xf32>
  %loss = graph.cross_entropy %l3, %t : (tensor<2x6x32xf32>, tensor<2x6xi32>) -> tensor<f32>
  return %loss : tensor<f32>
}

// The layer norm's backward writes its three gradients (input, weight,
// bias) into three buffers, in that order, after the operands.
// CHECK-LABEL: func.func @norm
// CHECK-SAME: (%[[X:.*]]: memref<4x16xf32>, %[[W:.*]]: memref<16xf32>, %[[B:.*]]: memref<16xf32>, %[[D:.*]]: memref<4x16xf32>)
// CHECK: %[[Y:.*]] = rt.alloc : memref<4x16xf32>
// CHECK-NEXT: rt.layer_norm_forward(%[[X]], %[[W]], %[[B]], %[[Y]]) {cols = 16 : i64, eps = 1.000000e-05 : f64, rows = 4 : i64}
// CHECK-NEXT: %[[DX:.*]] = rt.alloc : memref<4x16xf32>
// CHECK-NEXT: %[[DW:.*]] = rt.alloc : memref<16xf32>
// CHECK-NEXT: %[[DB:.*]] = rt.alloc : memref<16xf32>
// CHECK-NEXT: rt.layer_norm_backward(%[[X]], %[[W]], %[[D]], %[[DX]], %[[DW]], %[[DB]]) {cols = 16 : i64, eps = 1.000000e-05 : f64, rows = 4 : i64}
// CHECK-NEXT: return %[[Y]], %[[DX]], %[[DW]], %[[DB]]
func.func @norm(%x: tensor<4x16xf32>, %w: tensor<16xf32>, %b: tensor<16xf32>, %d: tensor<4x16xf32>) -> (tensor<4x16xf32>, tensor<4x16xf32>, tensor<16xf32>, tensor<16xf32>) {
  %y = graph.layer_norm %x, %w, %b : (tensor<4x16xf32>, tensor<16xf32>, tensor<16xf32>) -> tensor<4x16xf32>
  %dx, %dw, %db = graph.layer_norm_grad %x, %w, %d : (tensor<4x16xf32>, tensor<16xf32>, tensor<4x16xf32>) -> (tensor<4x16xf32>, tensor<16xf32>, tensor<16xf32>)
  return %y, %dx, %dw, %db : tensor<4x16xf32>, tensor<4x16xf32>, tensor<16xf32>, tensor<16xf32>
}

// A split along the last axis is one slice per result at increasing
// starts; a concat fills one buffer piece by piece, in operand order.
// CHECK-LABEL: func.func @layout
// CHECK: %[[Q:.*]] = rt.alloc : memref<2x4x16xf32>
// CHECK-NEXT: rt.slice_axis(%arg0, %[[Q]]) {extent = 48 : i64, inner = 1 : i64, length = 16 : i64, outer = 8 : i64, start = 0 : i64}
// CHECK-NEXT: %[[K:.*]] = rt.alloc : memref<2x4x16xf32>
// CHECK-NEXT: rt.slice_axis(%arg0, %[[K]]) {{.*}}start = 16 : i64}
// CHECK-NEXT: %[[V:.*]] = rt.alloc : memref<2x4x16xf32>
// CHECK-NEXT: rt.slice_axis(%arg0, %[[V]]) {{.*}}start = 32 : i64}
// CHECK-NEXT: %[[C:.*]] = rt.alloc : memref<2x4x32xf32>
// CHECK-NEXT: rt.insert_axis(%[[V]], %[[C]]) {extent = 32 : i64, inner = 1 : i64, length = 16 : i64, outer = 8 : i64, start = 0 : i64}
// CHECK-NEXT: rt.insert_axis(%[[Q]], %[[C]]) {{.*}}start = 16 : i64}
// CHECK-NEXT: return %[[C]]
func.func @layout(%x: tensor<2x4x48xf32>) -> tensor<2x4x32xf32> {
  %q, %k, %v = graph.split %x {axis = 2 : i64} : (tensor<2x4x48xf32>) -> (tensor<2x4x16xf32>, tensor<2x4x16xf32>, tensor<2x4x16xf32>)
  %c = graph.concat %v, %q {axis = 2 : i64} : (tensor<2x4x16xf32>, tensor<2x4x16xf32>) -> tensor<2x4x32xf32>
  return %c : tensor<2x4x32xf32>
}

// Over a vocabulary split over tp, the embedding and the loss see this
// rank's 16 rows: they start at groupRank(tp) * 16.
// CHECK-LABEL: func.func @vocab
// CHECK: rt.embedding_forward_range(%arg0, %{{.*}}, %{{.*}}) {hidden = 8 : i64, local_vocab = 16 : i64, n = 8 : i64, vocab_start = #rt.group_offset<<tp>, 16, 1>}
// CHECK: rt.cross_entropy_vocab_parallel_forward(%arg1, %{{.*}}, %{{.*}}) {axes = #dist.axes<tp>, local_vocab = 16 : i64, rows = 8 : i64, valid = 30 : i64, vocab_start = #rt.group_offset<<tp>, 16, 1>}
func.func @vocab(%wte: tensor<16x8xf32>, %l: tensor<2x4x16xf32>) -> (tensor<2x4x8xf32>, tensor<f32>) {
  %ids = graph.input "tokens" : tensor<2x4xi32>
  %t = graph.input "targets" : tensor<2x4xi32>
  %x = graph.embedding %wte, %ids {vocab_axes = #dist.axes<tp>} : (tensor<16x8xf32>, tensor<2x4xi32>) -> tensor<2x4x8xf32>
  %loss = graph.cross_entropy %l, %t {vocab_axes = #dist.axes<tp>, valid_vocab = 30 : i64} : (tensor<2x4x16xf32>, tensor<2x4xi32>) -> tensor<f32>
  return %x, %loss : tensor<2x4x8xf32>, tensor<f32>
}

// The gradient norm keeps one fp64 partial sum per set of axes (the
// unsplit set first): the bias's squares go to slot 0, the two gradients
// split over tp to slot 1, which alone is summed over tp. AdamW reads the
// parameter's moments (rt.state_of), the learning rate and the update count.
// CHECK-LABEL: func.func @update
// CHECK-SAME: (%[[G0:.*]]: memref<16x8xf32>, %[[G1:.*]]: memref<8xf32>, %[[G2:.*]]: memref<32x16xf32>)
// CHECK: %[[P:.*]] = rt.param "w"
// CHECK-NEXT: %[[SUMS:.*]] = rt.buffer <norm_sums> 0 : memref<2xf64>
// CHECK-NEXT: rt.zero_sums(%[[SUMS]]) {n = 2 : i64}
// CHECK-NEXT: %[[S0:.*]] = rt.buffer <norm_sums> 0 : memref<1xf64>
// CHECK-NEXT: rt.sum_squares(%[[G1]], %[[S0]]) {n = 8 : i64}
// CHECK-NEXT: %[[S1:.*]] = rt.buffer <norm_sums> 1 : memref<1xf64>
// CHECK-NEXT: rt.sum_squares(%[[G0]], %[[S1]]) {n = 128 : i64}
// CHECK-NEXT: rt.sum_squares(%[[G2]], %[[S1]]) {n = 512 : i64}
// CHECK-NEXT: rt.all_reduce(%[[S1]]) {axes = #dist.axes<tp>} : memref<1xf64>
// CHECK-NEXT: %[[N:.*]] = rt.alloc : memref<f32>
// CHECK-NEXT: rt.sqrt_sum(%[[SUMS]], %[[N]]) {parts = 2 : i64}
// CHECK-NEXT: %[[M:.*]] = rt.state_of %[[P]] <adam_m> : memref<16x8xf32> -> memref<16x8xf32>
// CHECK-NEXT: %[[V:.*]] = rt.state_of %[[P]] <adam_v> : memref<16x8xf32> -> memref<16x8xf32>
// CHECK-NEXT: %[[LR:.*]] = rt.learning_rate : f32
// CHECK-NEXT: %[[C:.*]] = rt.update_count : i64
// CHECK-NEXT: rt.adamw(%[[P]], %[[G0]], %[[M]], %[[V]], %[[N]], %[[LR]], %[[C]]) {beta1 = 0.899999976 : f32, beta2 = 0.949999988 : f32, eps = 9.99999993E-9 : f32, max_grad_norm = 1.000000e+00 : f32, n = 128 : i64, weight_decay = 1.000000e-01 : f32}
// CHECK-NEXT: return %[[N]] : memref<f32>
func.func @update(%g0: tensor<16x8xf32>, %g1: tensor<8xf32>, %g2: tensor<32x16xf32>) -> tensor<f32> {
  %w = graph.param "w" : tensor<16x8xf32>
  %n = graph.global_norm %g0, %g1, %g2 {reduce_axes = [#dist.axes<tp>, #dist.axes<>, #dist.axes<tp>]} : (tensor<16x8xf32>, tensor<8xf32>, tensor<32x16xf32>) -> tensor<f32>
  graph.adamw %w, %g0, %n {beta1 = 0.9 : f64, beta2 = 0.95 : f64, eps = 1.0e-8 : f64, weight_decay = 0.1 : f64, max_grad_norm = 1.0 : f64} : tensor<16x8xf32>, tensor<16x8xf32>, tensor<f32>
  return %n : tensor<f32>
}

// A rank program keeps its parts: their results, what they yield and the
// update's inputs and block arguments become buffers.
// CHECK-LABEL: func.func @train_step() -> (memref<f32>, memref<f32>) attributes {pipe.rank = 0 : i64}
// CHECK: %[[W:.*]] = rt.param "w"
// CHECK: %[[F:.*]]:2 = pipe.forward_pass chunk 0 -> memref<2x8xf32>, memref<f32> {
// CHECK: %[[X:.*]] = rt.alloc : memref<2x8xf32>
// CHECK-NEXT: rt.fill(%[[X]]) {n = 16 : i64, value = 1.000000e+00 : f64}
// CHECK-NEXT: %[[Y:.*]] = rt.alloc : memref<2x8xf32>
// CHECK-NEXT: rt.matmul(%[[X]], %[[W]], %[[Y]])
// CHECK: pipe.yield %[[Y]], %{{.*}} : memref<2x8xf32>, memref<f32>
// CHECK: %[[U:.*]]:2 = pipe.update(%[[F]]#0, %[[F]]#1 : memref<2x8xf32>, memref<f32>) -> memref<f32>, memref<f32> {
// CHECK-NEXT: ^bb0(%[[A:.*]]: memref<2x8xf32>, %[[L:.*]]: memref<f32>):
// CHECK-NEXT: %[[S:.*]] = rt.alloc : memref<8xf32>
// CHECK-NEXT: rt.reduce_sum_leading(%[[A]], %[[S]]) {cols = 8 : i64, rows = 2 : i64}
// CHECK-NEXT: pipe.yield %[[L]], %[[L]] : memref<f32>, memref<f32>
// CHECK: return %[[U]]#0, %[[U]]#1 : memref<f32>, memref<f32>
func.func @train_step() -> (tensor<f32>, tensor<f32>) attributes {pipe.rank = 0 : i64} {
  %w = graph.param "w" : tensor<8x8xf32>
  %f:2 = pipe.forward_pass chunk 0 -> tensor<2x8xf32>, tensor<f32> {
    %x = graph.fill {value = 1.0 : f64} : tensor<2x8xf32>
    %y = graph.matmul %x, %w : (tensor<2x8xf32>, tensor<8x8xf32>) -> tensor<2x8xf32>
    %l = graph.fill {value = 0.5 : f64} : tensor<f32>
    pipe.yield %y, %l : tensor<2x8xf32>, tensor<f32>
  }
  %u:2 = pipe.update(%f#0, %f#1 : tensor<2x8xf32>, tensor<f32>) -> tensor<f32>, tensor<f32> {
  ^bb0(%a: tensor<2x8xf32>, %b: tensor<f32>):
    %s = graph.reduce_sum %a : (tensor<2x8xf32>) -> tensor<8xf32>
    pipe.yield %b, %b : tensor<f32>, tensor<f32>
  }
  return %u#0, %u#1 : tensor<f32>, tensor<f32>
}

}
