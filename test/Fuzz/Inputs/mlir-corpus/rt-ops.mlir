// Every rt op prints and parses back to itself.

// Buffers of each store (offsets in bytes in the arena, in elements in the
// others), working buffers, views, parameters with their placement, and
// what the runtime tells the step.
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
  rt.transpose(%x, %y) {shape = array<i64: 8, 64>, permutation = array<i64: 1, 0>, rank = 2 : i64} : memref<8x64xf32>, memref<8x64xf32>
  rt.adamw(%w, %sh, %w, %w, %w, %norm, %lr, %n) {n = 4096 : i64, beta1 = 0.9 : f32, beta2 = 0.95 : f32, eps = 1.0e-8 : f32, weight_decay = 0.1 : f32, max_grad_norm = 1.0 : f32} : memref<64x64xf32>, memref<64x64xbf16>, memref<64x64xf32>, memref<64x64xf32>, memref<64x64xf32>, memref<f32>, f32, i64
  rt.adamw(%w, %w, %w, %w, %norm, %lr, %n) {n = 4096 : i64, beta1 = 0.9 : f32, beta2 = 0.95 : f32, eps = 1.0e-8 : f32, weight_decay = 0.1 : f32, max_grad_norm = 1.0 : f32} : memref<64x64xf32>, memref<64x64xf32>, memref<64x64xf32>, memref<64x64xf32>, memref<f32>, f32, i64
  return
}

// Communication: blocking and started reductions (a started one returns
// an !rt.request; planned, it has a slot in the request table), gathers
// and scatters, and pipeline transfers keyed by tag and microbatch (with
// the receiver's order once known).
func.func @communication(%x: memref<8x64xf32>, %b: memref<64xf32>, %full: memref<16x64xf32>, %mb: i64) {
  rt.all_reduce(%x, %b) {axes = #dist.axes<dp>} : memref<8x64xf32>, memref<64xf32>
  %r = rt.all_reduce_start(%b) {axes = #dist.axes<tp, dp>} : memref<64xf32>
  rt.wait %r
  %q = rt.all_reduce_start(%x, %b) {axes = #dist.axes<dp>, slot = 3 : i64} : memref<8x64xf32>, memref<64xf32>
  rt.wait_requests {first = 3 : i64, count = 2 : i64}
  rt.all_gather(%x, %full) {outer = 1 : i64, length = 8 : i64, inner = 64 : i64, axes = #dist.axes<tp>} : memref<8x64xf32>, memref<16x64xf32>
  rt.reduce_scatter(%full, %x) {outer = 1 : i64, length = 8 : i64, inner = 64 : i64, axes = #dist.axes<tp>} : memref<16x64xf32>, memref<8x64xf32>
  rt.send(%x) microbatch %mb {offset = 1 : i64, tag = 2 : i64} : memref<8x64xf32>
  rt.send(%x) microbatch %mb {offset = 1 : i64, tag = 2 : i64, order = array<i64: 0, 2>} : memref<8x64xf32>
  rt.recv(%x) microbatch %mb {offset = -1 : i64, tag = 2 : i64} : memref<8x64xf32>
  rt.flush_sends
  rt.wait_sends
  return
}
