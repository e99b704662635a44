// A planned rank program (after convert-pipe-to-rt): pipeline rank 0 of
// two, two microbatches, on a dp = 2, tp = 2, pp = 2 mesh, with the
// training recipe on the top module.
module attributes {dist.mesh = #dist.mesh<dp = 2, tp = 2, pp = 2>, graph.recipe = {name = "tiny", global_batch = 8 : i64, seq_len = 4 : i64, vocab = 32 : i64, steps = 10 : i64, warmup_steps = 2 : i64, seed = 7 : i64, grad_clip = 1.0 : f64, lr = 1.0e-3 : f64, beta1 = 0.9 : f64, beta2 = 0.95 : f64, eps = 1.0e-8 : f64, weight_decay = 0.1 : f64, min_lr = 1.0e-4 : f64, decay = "linear"}} {
  module @stage0 attributes {pipe.rank = 0 : i64, rt.param_elems = 72 : i64, rt.arena_bytes = 256 : i64, rt.arena_slots = 2 : i64, rt.microbatches = 2 : i64, rt.accumulator_elems = 1 : i64, rt.norm_sums = 1 : i64} {
    func.func @train_step() {
      %true = arith.constant true
      %false = arith.constant false
      %c0 = arith.constant 0 : i64
      %c1 = arith.constant 1 : i64
      %w = rt.param "h.0.w" {decay = true, global_shape = array<i64: 8, 16>, init = "normal", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = 1 : i64, shard_axis = #dist.axis<tp>, shard_blocks = 1 : i64, offset = 0 : i64} : memref<8x8xf32>
      %b = rt.param "h.0.b" {decay = false, global_shape = array<i64: 8>, init = "zeros", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64, offset = 64 : i64} : memref<8xf32>
      call @forward0(%c0, %true) : (i64, i1) -> ()
      call @forward0(%c1, %false) : (i64, i1) -> ()
      call @backward0(%c0, %true) : (i64, i1) -> ()
      call @backward0(%c1, %false) : (i64, i1) -> ()
      rt.wait_sends
      call @update(%c0, %true) : (i64, i1) -> ()
      return
    }
    func.func private @forward0(%mb: i64, %first: i1) attributes {rt.part = "forward"} {
      %ids = rt.batch "tokens" : memref<2x4xi32>
      %x = rt.buffer <arena> 0 : memref<8x8xf32>
      %w = rt.buffer <params> 0 : memref<8x8xf32>
      %y = rt.buffer <arena> 64 : memref<8x8xf32>
      rt.matmul(%x, %w, %y) {batch = 1 : i64, m = 8 : i64, n = 8 : i64, k = 8 : i64, trans_a = false, trans_b = true, stride_a = 64 : i64, stride_b = 0 : i64, stride_c = 64 : i64} : memref<8x8xf32>, memref<8x8xf32>, memref<8x8xf32>
      %p = rt.buffer <arena> 128 : memref<8x4xf32>
      rt.slice_axis(%y, %p) {outer = 8 : i64, extent = 8 : i64, inner = 1 : i64, start = #rt.group_offset<#dist.axes<tp>, 8, 2>, length = 4 : i64} : memref<8x8xf32>, memref<8x4xf32>
      %t = rt.buffer <arena> 192 : memref<4x8xf32>
      rt.transpose(%p, %t) {shape = array<i64: 8, 4>, permutation = array<i64: 1, 0>, rank = 2 : i64} : memref<8x4xf32>, memref<4x8xf32>
      rt.send(%y) microbatch %mb {offset = 1 : i64, tag = 3 : i64} : memref<8x8xf32>
      rt.flush_sends
      return
    }
    func.func private @backward0(%mb: i64, %first: i1) attributes {rt.part = "backward"} {
      %d = rt.buffer <arena> 0 : memref<8x8xf32>
      rt.recv(%d) microbatch %mb {offset = 1 : i64, tag = 4 : i64} : memref<8x8xf32>
      %gb = rt.buffer <arena> 64 : memref<8xf32>
      rt.reduce_sum_leading(%d, %gb) {rows = 8 : i64, cols = 8 : i64} : memref<8x8xf32>, memref<8xf32>
      %acc = rt.buffer <grads> 64 : memref<8xf32>
      rt.accumulate(%gb, %acc, %first) {n = 8 : i64} : memref<8xf32>, memref<8xf32>, i1
      return
    }
    func.func private @update(%mb: i64, %first: i1) attributes {rt.part = "update"} {
      %sums = rt.buffer <norm_sums> 0 : memref<1xf64>
      rt.zero_sums(%sums) {n = 1 : i64} : memref<1xf64>
      %gw = rt.buffer <grads> 0 : memref<8x8xf32>
      rt.sum_squares(%gw, %sums) {n = 64 : i64} : memref<8x8xf32>, memref<1xf64>
      rt.all_reduce(%sums) {axes = #dist.axes<tp, pp>} : memref<1xf64>
      %n = rt.buffer <arena> 0 : memref<f32>
      rt.sqrt_sum(%sums, %n) {parts = 1 : i64} : memref<1xf64>, memref<f32>
      %p = rt.buffer <params> 0 : memref<8x8xf32>
      %m = rt.buffer <adam_m> 0 : memref<8x8xf32>
      %v = rt.buffer <adam_v> 0 : memref<8x8xf32>
      %lr = rt.learning_rate : f32
      %t = rt.update_count : i64
      rt.adamw(%p, %gw, %m, %v, %n, %lr, %t) {n = 64 : i64, beta1 = 0.9 : f32, beta2 = 0.95 : f32, eps = 1.0e-8 : f32, weight_decay = 0.1 : f32, max_grad_norm = 1.0 : f32} : memref<8x8xf32>, memref<8x8xf32>, memref<8x8xf32>, memref<8x8xf32>, memref<f32>, f32, i64
      %x = rt.buffer <arena> 64 : memref<2x4xf32>
      %full = rt.buffer <arena> 128 : memref<2x8xf32>
      rt.all_gather(%x, %full) {outer = 2 : i64, length = 4 : i64, inner = 1 : i64, axes = #dist.axes<tp>} : memref<2x4xf32>, memref<2x8xf32>
      rt.reduce_scatter(%full, %x) {outer = 2 : i64, length = 4 : i64, inner = 1 : i64, axes = #dist.axes<tp>} : memref<2x8xf32>, memref<2x4xf32>
      %l = rt.buffer <accumulators> 0 : memref<f32>
      %l2 = rt.buffer <arena> 192 : memref<f32>
      rt.all_reduce(%l, %l2) {axes = #dist.axes<dp, pp>} : memref<f32>, memref<f32>
      rt.finish_step(%l, %n) : memref<f32>, memref<f32>
      return
    }
  }
}
