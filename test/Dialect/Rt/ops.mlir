// RUN: tessel-opt %s | tessel-opt | FileCheck %s
// Every rt op prints and parses back to itself.

// Buffers of each store (offsets in bytes in the arena, in elements in the
// others), working buffers, views, parameters with their placement, and
// what the runtime tells the step.
// CHECK-LABEL: func.func @storage
// CHECK: %[[A:.*]] = rt.alloc : memref<8x64xf32>
// CHECK: %[[ARENA:.*]] = rt.buffer <arena> 4096 : memref<8x64xf32>
// CHECK: rt.buffer <params> 128 : memref<64xf32>
// CHECK: rt.buffer <grads> 128 : memref<64xf32>
// CHECK: rt.buffer <adam_m> 128 : memref<64xf32>
// CHECK: rt.buffer <adam_v> 128 : memref<64xf32>
// CHECK: %[[ACC:.*]] = rt.buffer <accumulators> 0 : memref<f32>
// CHECK: rt.buffer <shadow> 128 : memref<64xbf16>
// CHECK: rt.buffer <norm_sums> 1 : memref<1xf64>
// CHECK: rt.view %[[ARENA]] : memref<8x64xf32> to memref<512xf32>
// CHECK: %[[W:.*]] = rt.param "h.0.mlp.c_fc.weight" {decay = true, global_shape = array<i64: 64, 256>, init = "normal", mean = 0.000000e+00 : f64, offset = 64 : i64, shard_axis = #dist.axis<tp>, shard_blocks = 1 : i64, shard_dim = 1 : i64, std = 2.000000e-02 : f64} : memref<64x128xf32>
// CHECK: rt.param "wte" {decay = true, global_shape = array<i64: 32, 64>, {{.*}}shard_dim = -1 : i64{{.*}}} : memref<32x64xf32>
// CHECK: rt.state_of %[[W]] <adam_m> : memref<64x128xf32> -> memref<64x128xf32>
// CHECK: rt.state_of %[[W]] <shadow> : memref<64x128xf32> -> memref<64x128xbf16>
// CHECK: rt.batch "tokens" : memref<8x64xi32>
// CHECK: rt.batch "targets" : memref<8x64xi32>
// CHECK: rt.microbatch : i64
// CHECK: rt.learning_rate : f32
// CHECK: rt.update_count : i64
// CHECK: rt.finish_step(%[[ACC]], %[[ACC]]) : memref<f32>, memref<f32>
func.func @storage() {
  %a = rt.alloc : memref<8x64xf32>
  %0 = rt.buffer <arena> 4096 : memref<8x64xf32>
  %1 = rt.buffer <params> 128 : memref<64xf32>
  %2 = rt.buffer <grads> 128 : memref<64xf32>
  %3 = rt.buffer <adam_m> 128 : memref<64xf32>
  %4 = rt.buffer <adam_v> 128 : memref<64xf32>
  %5 = rt.buffer <accumulators> 0 : memref<f32>
  %6 = rt.buffer <shadow> 128 : memref<64xbf16>
  %7 = rt.buffer <norm_sums> 1 : memref<1xf64>
  %v = rt.view %0 : memref<8x64xf32> to memref<512xf32>
  %w = rt.param "h.0.mlp.c_fc.weight" {global_shape = array<i64: 64, 256>, init = "normal", mean = 0.0 : f64, std = 0.02 : f64, decay = true, shard_dim = 1 : i64, shard_axis = #dist.axis<tp>, shard_blocks = 1 : i64, offset = 64 : i64} : memref<64x128xf32>
  %e = rt.param "wte" {global_shape = array<i64: 32, 64>, init = "normal", mean = 0.0 : f64, std = 0.02 : f64, decay = true, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64} : memref<32x64xf32>
  %m = rt.state_of %w <adam_m> : memref<64x128xf32> -> memref<64x128xf32>
  %sh = rt.state_of %w <shadow> : memref<64x128xf32> -> memref<64x128xbf16>
  %ids = rt.batch "tokens" : memref<8x64xi32>
  %t = rt.batch "targets" : memref<8x64xi32>
  %mb = rt.microbatch : i64
  %lr = rt.learning_rate : f32
  %n = rt.update_count : i64
  rt.finish_step(%5, %5) : memref<f32>, memref<f32>
  return
}

// Kernels: buffers (operands) first, then attributes. Optional buffers
// (matmul_bias's gelu output, adamw's bf16 shadow) may be present or not.
// A start that depends on the rank's place in a group is a
// #rt.group_offset (groupRank(axes) * numerator / denominator); it prints
// its axes without the #dist.axes prefix and parses both spellings.
// CHECK-LABEL: func.func @kernels
// CHECK-SAME: (%[[X:[^:]*]]: memref<8x64xf32>, %[[W:[^:]*]]: memref<64x64xf32>, %[[B:[^:]*]]: memref<64xf32>, %[[IDS:[^:]*]]: memref<8xi32>, %[[T:[^:]*]]: memref<32x64xf32>, %[[Y:[^:]*]]: memref<8x64xf32>, %[[S:[^:]*]]: memref<8x32xf32>, %[[FIRST:[^:]*]]: i1, %[[LR:[^:]*]]: f32, %[[N:[^:]*]]: i64, %[[NORM:[^:]*]]: memref<f32>, %[[SH:[^:]*]]: memref<64x64xbf16>)
// CHECK: rt.fill(%[[Y]]) {n = 512 : i64, value = 0.000000e+00 : f64} : memref<8x64xf32>
// CHECK: rt.accumulate(%[[X]], %[[Y]], %[[FIRST]]) {n = 512 : i64} : memref<8x64xf32>, memref<8x64xf32>, i1
// CHECK: rt.matmul(%[[X]], %[[W]], %[[Y]]) {batch = 1 : i64, k = 64 : i64, m = 8 : i64, n = 64 : i64, stride_a = 512 : i64, stride_b = 0 : i64, stride_c = 512 : i64, trans_a = false, trans_b = true}
// CHECK: rt.matmul_bias(%[[X]], %[[W]], %[[B]], %[[Y]], %[[S]]) {k = 64 : i64, m = 8 : i64, n = 64 : i64, trans_b = false} : memref<8x64xf32>, memref<64x64xf32>, memref<64xf32>, memref<8x64xf32>, memref<8x32xf32>
// CHECK: rt.matmul_bias(%[[X]], %[[W]], %[[B]], %[[Y]]) {k = 64 : i64, m = 8 : i64, n = 64 : i64, trans_b = false} : memref<8x64xf32>, memref<64x64xf32>, memref<64xf32>, memref<8x64xf32>
// CHECK: rt.embedding_forward_range(%[[T]], %[[IDS]], %[[Y]]) {hidden = 64 : i64, local_vocab = 32 : i64, n = 8 : i64, vocab_start = #rt.group_offset<<tp>, 32, 1>}
// CHECK: rt.slice_axis(%[[X]], %[[S]]) {extent = 64 : i64, inner = 1 : i64, length = 32 : i64, outer = 8 : i64, start = 32 : i64}
// CHECK: rt.slice_axis(%[[X]], %[[S]]) {extent = 64 : i64, inner = 1 : i64, length = 32 : i64, outer = 8 : i64, start = #rt.group_offset<<dp, tp>, 1, 2>}
// CHECK: rt.slice_axis(%[[X]], %[[S]]) {{.*}}start = #rt.group_offset<<tp>, 32, 1>}
// CHECK: rt.cross_entropy_vocab_parallel_forward(%[[X]], %[[IDS]], %[[NORM]]) {axes = #dist.axes<tp>, local_vocab = 64 : i64, rows = 8 : i64, valid = 120 : i64, vocab_start = #rt.group_offset<<tp>, 64, 1>}
// CHECK-NEXT: rt.cross_entropy_vocab_parallel_forward(%[[X]], %[[IDS]], %[[NORM]], %{{.*}}) {{.*}} : memref<8x64xf32>, memref<8xi32>, memref<f32>, memref<64xf32>
// CHECK: rt.transpose(%[[X]], %[[Y]]) {permutation = array<i64: 1, 0>, rank = 2 : i64, shape = array<i64: 8, 64>}
// CHECK: rt.adamw(%[[W]], %[[SH]], %[[W]], %[[W]], %[[W]], %[[NORM]], %[[LR]], %[[N]]) {beta1 = 0.899999976 : f32, {{.*}}n = 4096 : i64{{.*}}} : memref<64x64xf32>, memref<64x64xbf16>, memref<64x64xf32>, memref<64x64xf32>, memref<64x64xf32>, memref<f32>, f32, i64
// CHECK: rt.adamw(%[[W]], %[[W]], %[[W]], %[[W]], %[[NORM]], %[[LR]], %[[N]]) {{.*}} : memref<64x64xf32>, memref<64x64xf32>, memref<64x64xf32>, memref<64x64xf32>, memref<f32>, f32, i64
func.func @kernels(%x: memref<8x64xf32>, %w: memref<64x64xf32>, %b: memref<64xf32>, %ids: memref<8xi32>, %table: memref<32x64xf32>, %y: memref<8x64xf32>, %s: memref<8x32xf32>, %first: i1, %lr: f32, %n: i64, %norm: memref<f32>, %sh: memref<64x64xbf16>) {
  rt.fill(%y) {n = 512 : i64, value = 0.0 : f64} : memref<8x64xf32>
  rt.accumulate(%x, %y, %first) {n = 512 : i64} : memref<8x64xf32>, memref<8x64xf32>, i1
  rt.matmul(%x, %w, %y) {batch = 1 : i64, m = 8 : i64, n = 64 : i64, k = 64 : i64, trans_a = false, trans_b = true, stride_a = 512 : i64, stride_b = 0 : i64, stride_c = 512 : i64} : memref<8x64xf32>, memref<64x64xf32>, memref<8x64xf32>
  rt.matmul_bias(%x, %w, %b, %y, %s) {m = 8 : i64, n = 64 : i64, k = 64 : i64, trans_b = false} : memref<8x64xf32>, memref<64x64xf32>, memref<64xf32>, memref<8x64xf32>, memref<8x32xf32>
  rt.matmul_bias(%x, %w, %b, %y) {m = 8 : i64, n = 64 : i64, k = 64 : i64, trans_b = false} : memref<8x64xf32>, memref<64x64xf32>, memref<64xf32>, memref<8x64xf32>
  rt.embedding_forward_range(%table, %ids, %y) {n = 8 : i64, vocab_start = #rt.group_offset<#dist.axes<tp>, 32, 1>, local_vocab = 32 : i64, hidden = 64 : i64} : memref<32x64xf32>, memref<8xi32>, memref<8x64xf32>
  rt.slice_axis(%x, %s) {outer = 8 : i64, extent = 64 : i64, inner = 1 : i64, start = 32 : i64, length = 32 : i64} : memref<8x64xf32>, memref<8x32xf32>
  rt.slice_axis(%x, %s) {outer = 8 : i64, extent = 64 : i64, inner = 1 : i64, start = #rt.group_offset<#dist.axes<tp, dp>, 1, 2>, length = 32 : i64} : memref<8x64xf32>, memref<8x32xf32>
  rt.slice_axis(%x, %s) {outer = 8 : i64, extent = 64 : i64, inner = 1 : i64, start = #rt.group_offset<<tp>, 32, 1>, length = 32 : i64} : memref<8x64xf32>, memref<8x32xf32>
  rt.cross_entropy_vocab_parallel_forward(%x, %ids, %norm) {rows = 8 : i64, local_vocab = 64 : i64, vocab_start = #rt.group_offset<#dist.axes<tp>, 64, 1>, axes = #dist.axes<tp>, valid = 120 : i64} : memref<8x64xf32>, memref<8xi32>, memref<f32>
  // With the row statistics kept for the backward (2 x rows fp32).
  rt.cross_entropy_vocab_parallel_forward(%x, %ids, %norm, %b) {rows = 8 : i64, local_vocab = 64 : i64, vocab_start = #rt.group_offset<#dist.axes<tp>, 64, 1>, axes = #dist.axes<tp>, valid = 120 : i64} : memref<8x64xf32>, memref<8xi32>, memref<f32>, memref<64xf32>
  rt.transpose(%x, %y) {shape = array<i64: 8, 64>, permutation = array<i64: 1, 0>, rank = 2 : i64} : memref<8x64xf32>, memref<8x64xf32>
  rt.adamw(%w, %sh, %w, %w, %w, %norm, %lr, %n) {n = 4096 : i64, beta1 = 0.9 : f32, beta2 = 0.95 : f32, eps = 1.0e-8 : f32, weight_decay = 0.1 : f32, max_grad_norm = 1.0 : f32} : memref<64x64xf32>, memref<64x64xbf16>, memref<64x64xf32>, memref<64x64xf32>, memref<64x64xf32>, memref<f32>, f32, i64
  rt.adamw(%w, %w, %w, %w, %norm, %lr, %n) {n = 4096 : i64, beta1 = 0.9 : f32, beta2 = 0.95 : f32, eps = 1.0e-8 : f32, weight_decay = 0.1 : f32, max_grad_norm = 1.0 : f32} : memref<64x64xf32>, memref<64x64xf32>, memref<64x64xf32>, memref<64x64xf32>, memref<f32>, f32, i64
  return
}

// Communication: blocking and started reductions (a started one returns
// an !rt.request; planned, it has a slot in the request table), gathers
// and scatters, and pipeline transfers keyed by tag and microbatch (with
// the receiver's order once known).
// CHECK-LABEL: func.func @communication
// CHECK-SAME: (%[[X:[^:]*]]: memref<8x64xf32>, %[[B:[^:]*]]: memref<64xf32>, %[[FULL:[^:]*]]: memref<16x64xf32>, %[[MB:[^:]*]]: i64, %[[X3:[^:]*]]: memref<2x4x8xf32>, %[[FULL3:[^:]*]]: memref<2x8x8xf32>, %[[BLOCKS:[^:]*]]: memref<128xf32>, %[[PIECE:[^:]*]]: memref<32xf32>, %[[COPY:[^:]*]]: memref<64xbf16>)
// CHECK: rt.all_reduce(%[[X]], %[[B]]) {axes = #dist.axes<dp>} : memref<8x64xf32>, memref<64xf32>
// CHECK: %[[R:.*]] = rt.all_reduce_start(%[[B]]) {axes = #dist.axes<dp, tp>} : memref<64xf32>
// CHECK: rt.wait %[[R]]
// CHECK: rt.all_reduce_start(%[[X]], %[[B]]) {axes = #dist.axes<dp>, slot = 3 : i64} : memref<8x64xf32>, memref<64xf32>
// CHECK: rt.wait_requests {count = 2 : i64, first = 3 : i64}
// CHECK: rt.all_gather(%[[X]], %[[FULL]]) {axes = #dist.axes<tp>, inner = 64 : i64, length = 8 : i64, outer = 1 : i64} : memref<8x64xf32>, memref<16x64xf32>
// CHECK: rt.reduce_scatter(%[[FULL]], %[[X]]) {axes = #dist.axes<tp>, inner = 64 : i64, length = 8 : i64, outer = 1 : i64} : memref<16x64xf32>, memref<8x64xf32>
// CHECK: %[[G:.*]] = rt.all_gather_start(%[[X]], %[[FULL]]) {axes = #dist.axes<tp>, inner = 64 : i64, length = 8 : i64, outer = 1 : i64} : memref<8x64xf32>, memref<16x64xf32>
// CHECK: %[[S:.*]] = rt.reduce_scatter_start(%[[FULL3]], %[[X3]], %[[BLOCKS]]) {axes = #dist.axes<tp>, inner = 8 : i64, length = 4 : i64, outer = 2 : i64, slot = 1 : i64} : memref<2x8x8xf32>, memref<2x4x8xf32>, memref<128xf32>
// CHECK: rt.wait %[[G]]
// CHECK: %[[BLK:.*]] = rt.group_block %[[FULL]][1] {axes = #dist.axes<tp>, blocks = 2 : i64} : memref<16x64xf32> to memref<8x64xf32>
// CHECK: %[[SH:.*]] = rt.shift_start(%[[X]], %[[BLK]]) {axes = #dist.axes<tp>, shift = 1 : i64} : memref<8x64xf32>, memref<8x64xf32>
// CHECK: rt.wait %[[SH]]
// CHECK: rt.shift_start(%[[X]], %[[BLK]]) {axes = #dist.axes<tp>, shift = 1 : i64, slot = 4 : i64}
// CHECK: rt.all_gather_shards_start(%[[B]] : memref<64xf32>) {axes = #dist.axes<dp>, n = 64 : i64, slot = 0 : i64}
// CHECK: rt.all_gather_shards_start(%[[B]] : memref<64xf32> from %[[PIECE]] : memref<32xf32> shadow %[[COPY]] : memref<64xbf16>) {axes = #dist.axes<dp>, n = 64 : i64, slot = 0 : i64}
// CHECK: rt.all_gather_shards_start(%[[B]] : memref<64xf32> shadow %[[COPY]] : memref<64xbf16>) {axes = #dist.axes<dp>, n = 64 : i64, slot = 0 : i64}
// CHECK: rt.send(%[[X]]) microbatch %[[MB]] {offset = 1 : i64, tag = 2 : i64} : memref<8x64xf32>
// CHECK: rt.send(%[[X]]) microbatch %[[MB]] {offset = 1 : i64, order = array<i64: 0, 2>, tag = 2 : i64} : memref<8x64xf32>
// CHECK: rt.recv(%[[X]]) microbatch %[[MB]] {offset = -1 : i64, tag = 2 : i64} : memref<8x64xf32>
// CHECK: rt.flush_sends
// CHECK: rt.wait_sends
func.func @communication(%x: memref<8x64xf32>, %b: memref<64xf32>, %full: memref<16x64xf32>, %mb: i64, %x3: memref<2x4x8xf32>, %full3: memref<2x8x8xf32>, %blocks: memref<128xf32>, %piece: memref<32xf32>, %copy: memref<64xbf16>) {
  rt.all_reduce(%x, %b) {axes = #dist.axes<dp>} : memref<8x64xf32>, memref<64xf32>
  %r = rt.all_reduce_start(%b) {axes = #dist.axes<tp, dp>} : memref<64xf32>
  rt.wait %r
  %q = rt.all_reduce_start(%x, %b) {axes = #dist.axes<dp>, slot = 3 : i64} : memref<8x64xf32>, memref<64xf32>
  rt.wait_requests {first = 3 : i64, count = 2 : i64}
  rt.all_gather(%x, %full) {outer = 1 : i64, length = 8 : i64, inner = 64 : i64, axes = #dist.axes<tp>} : memref<8x64xf32>, memref<16x64xf32>
  rt.reduce_scatter(%full, %x) {outer = 1 : i64, length = 8 : i64, inner = 64 : i64, axes = #dist.axes<tp>} : memref<16x64xf32>, memref<8x64xf32>
  %g = rt.all_gather_start(%x, %full) {outer = 1 : i64, length = 8 : i64, inner = 64 : i64, axes = #dist.axes<tp>} : memref<8x64xf32>, memref<16x64xf32>
  %s = rt.reduce_scatter_start(%full3, %x3, %blocks) {outer = 2 : i64, length = 4 : i64, inner = 8 : i64, axes = #dist.axes<tp>, slot = 1 : i64} : memref<2x8x8xf32>, memref<2x4x8xf32>, memref<128xf32>
  rt.wait %g
  %blk = rt.group_block %full[1] {axes = #dist.axes<tp>, blocks = 2 : i64} : memref<16x64xf32> to memref<8x64xf32>
  %sh = rt.shift_start(%x, %blk) {axes = #dist.axes<tp>, shift = 1 : i64} : memref<8x64xf32>, memref<8x64xf32>
  rt.wait %sh
  %sh2 = rt.shift_start(%x, %blk) {axes = #dist.axes<tp>, shift = 1 : i64, slot = 4 : i64} : memref<8x64xf32>, memref<8x64xf32>
  %a = rt.all_gather_shards_start(%b : memref<64xf32>) {n = 64 : i64, axes = #dist.axes<dp>, slot = 0 : i64}
  %p = rt.all_gather_shards_start(%b : memref<64xf32> from %piece : memref<32xf32> shadow %copy : memref<64xbf16>) {n = 64 : i64, axes = #dist.axes<dp>, slot = 0 : i64}
  %c = rt.all_gather_shards_start(%b : memref<64xf32> shadow %copy : memref<64xbf16>) {n = 64 : i64, axes = #dist.axes<dp>, slot = 0 : i64}
  rt.send(%x) microbatch %mb {offset = 1 : i64, tag = 2 : i64} : memref<8x64xf32>
  rt.send(%x) microbatch %mb {offset = 1 : i64, tag = 2 : i64, order = array<i64: 0, 2>} : memref<8x64xf32>
  rt.recv(%x) microbatch %mb {offset = -1 : i64, tag = 2 : i64} : memref<8x64xf32>
  rt.flush_sends
  rt.wait_sends
  return
}
