// RUN: tessel-opt %s --split-input-file --tessel-plan-memory | FileCheck %s --implicit-check-not=rt.alloc --implicit-check-not=rt.state_of --implicit-check-not='rt.wait '

// Every buffer gets its place: no rt.alloc or rt.state_of is left, and
// every rt.wait becomes an rt.wait_requests on the request table.

// One rank, one microbatch. Parameters are packed in the parameter store in
// order (w: 64 elements at 0, then b, c and d: 8 each). A gradient that a
// parameter's AdamW reads is produced straight into the gradient store at
// the parameter's offset; its moments are at the same offset in theirs.
// CHECK-LABEL: func.func @train_step()
// CHECK-SAME: rt.accumulator_elems = 0 : i64, rt.arena_bytes = 192 : i64, rt.norm_sums = 0 : i64, rt.param_elems = 88 : i64, rt.received_bytes = 0 : i64, rt.request_slots = 3 : i64
// CHECK: rt.param "w" {{.*}}offset = 0 : i64
// CHECK: rt.param "b" {{.*}}offset = 64 : i64
// CHECK: rt.param "c" {{.*}}offset = 72 : i64
// CHECK: rt.param "d" {{.*}}offset = 80 : i64

// Arena offsets are in bytes, 64-byte aligned, first fit by liveness: x1
// takes 64; x0 is still read through its view, so x2 goes to 128; x3 then
// reuses x1's place (dead after the second gelu) and the loss x0's (dead
// after its view's last read).
// CHECK: pipe.forward_pass chunk 0
// CHECK-NEXT: %[[X0:.*]] = rt.buffer <arena> 0 : memref<2x8xf32>
// CHECK-NEXT: rt.fill(%[[X0]])
// CHECK-NEXT: %[[V0:.*]] = rt.view %[[X0]] : memref<2x8xf32> to memref<16xf32>
// CHECK-NEXT: %[[X1:.*]] = rt.buffer <arena> 64 : memref<2x8xf32>
// CHECK-NEXT: rt.gelu_forward(%[[X0]], %[[X1]])
// CHECK-NEXT: %[[X2:.*]] = rt.buffer <arena> 128 : memref<2x8xf32>
// CHECK-NEXT: rt.gelu_forward(%[[X1]], %[[X2]])
// CHECK-NEXT: %[[X3:.*]] = rt.buffer <arena> 64 : memref<2x8xf32>
// CHECK-NEXT: rt.add_broadcast(%[[X2]], %[[V0]], %[[X3]])
// CHECK-NEXT: %[[L:.*]] = rt.buffer <arena> 0 : memref<f32>
// CHECK-NEXT: rt.fill(%[[L]])
// CHECK-NEXT: pipe.yield %[[X3]], %[[L]]

// The backward pass refers to the forward's x3 by its place, not by the
// forward's result. The gradients of w and b lie side by side (elements
// 0-71 of the gradient store): the first reduction covers them with one
// buffer and d's gradient with a second, and takes request slots 0 and 1;
// the second reduction takes slot 2.
// CHECK: pipe.backward_pass chunk 0
// CHECK-NEXT: %[[GW:.*]] = rt.buffer <grads> 0 : memref<8x8xf32>
// CHECK-NEXT: %[[A:.*]] = rt.buffer <arena> 64 : memref<2x8xf32>
// CHECK-NEXT: %[[B:.*]] = rt.buffer <arena> 64 : memref<2x8xf32>
// CHECK-NEXT: rt.matmul(%[[A]], %[[B]], %[[GW]])
// CHECK-NEXT: %[[GB:.*]] = rt.buffer <grads> 64 : memref<8xf32>
// CHECK: %[[GC:.*]] = rt.buffer <grads> 72 : memref<8xf32>
// CHECK: %[[GD:.*]] = rt.buffer <grads> 80 : memref<8xf32>
// CHECK: %[[JOINED:.*]] = rt.buffer <grads> 0 : memref<72xf32>
// CHECK-NEXT: %[[R1:.*]] = rt.all_reduce_start(%[[JOINED]], %[[GD]]) {axes = #dist.axes<dp>, slot = 0 : i64} : memref<72xf32>, memref<8xf32>
// CHECK-NEXT: %[[R2:.*]] = rt.all_reduce_start(%[[GC]]) {axes = #dist.axes<dp>, slot = 2 : i64} : memref<8xf32>
// CHECK-NEXT: pipe.yield %[[R1]], %[[R2]], %[[GW]], %[[GB]], %[[GC]], %[[GD]]

// The update waits for the requests by their slots, in its own order; it
// reads gradients and moments at the parameters' offsets, and the loss
// where the forward pass put it.
// CHECK: pipe.update
// CHECK-NEXT: ^bb0
// CHECK-NEXT: rt.wait_requests {count = 1 : i64, first = 2 : i64}
// CHECK-NEXT: rt.wait_requests {count = 2 : i64, first = 0 : i64}
// CHECK-NEXT: %[[N:.*]] = rt.buffer <arena> 64 : memref<f32>
// CHECK: %[[M:.*]] = rt.buffer <adam_m> 0 : memref<8x8xf32>
// CHECK-NEXT: %[[V:.*]] = rt.buffer <adam_v> 0 : memref<8x8xf32>
// CHECK-NEXT: %[[P:.*]] = rt.buffer <params> 0 : memref<8x8xf32>
// CHECK-NEXT: %[[G:.*]] = rt.buffer <grads> 0 : memref<8x8xf32>
// CHECK-NEXT: rt.adamw(%[[P]], %[[G]], %[[M]], %[[V]], %[[N]],
// CHECK: rt.buffer <adam_m> 80 : memref<8xf32>
// CHECK-NEXT: rt.buffer <adam_v> 80 : memref<8xf32>
// CHECK-NEXT: rt.buffer <params> 80 : memref<8xf32>
// CHECK-NEXT: rt.buffer <grads> 80 : memref<8xf32>
// CHECK-NEXT: rt.adamw
// CHECK-NEXT: %[[LOSS:.*]] = rt.buffer <arena> 0 : memref<f32>
// CHECK-NEXT: rt.all_reduce(%[[LOSS]]) {axes = #dist.axes<dp>} : memref<f32>

module attributes {dist.mesh = #dist.mesh<dp = 2>} {
func.func @train_step() -> (memref<f32>, memref<f32>) attributes {pipe.rank = 0 : i64} {
  %w = rt.param "w" {decay = true, global_shape = array<i64: 8, 8>, init = "normal", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64} : memref<8x8xf32>
  %b = rt.param "b" {decay = false, global_shape = array<i64: 8>, init = "zeros", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64} : memref<8xf32>
  %c = rt.param "c" {decay = false, global_shape = array<i64: 8>, init = "zeros", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64} : memref<8xf32>
  %d = rt.param "d" {decay = false, global_shape = array<i64: 8>, init = "zeros", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64} : memref<8xf32>
  %f:2 = pipe.forward_pass chunk 0 -> memref<2x8xf32>, memref<f32> {
    %x0 = rt.alloc : memref<2x8xf32>
    rt.fill(%x0) {n = 16 : i64, value = 1.0 : f64} : memref<2x8xf32>
    %v0 = rt.view %x0 : memref<2x8xf32> to memref<16xf32>
    %x1 = rt.alloc : memref<2x8xf32>
    rt.gelu_forward(%x0, %x1) {n = 16 : i64} : memref<2x8xf32>, memref<2x8xf32>
    %x2 = rt.alloc : memref<2x8xf32>
    rt.gelu_forward(%x1, %x2) {n = 16 : i64} : memref<2x8xf32>, memref<2x8xf32>
    %x3 = rt.alloc : memref<2x8xf32>
    rt.add_broadcast(%x2, %v0, %x3) {n = 16 : i64, nb = 16 : i64} : memref<2x8xf32>, memref<16xf32>, memref<2x8xf32>
    %l = rt.alloc : memref<f32>
    rt.fill(%l) {n = 1 : i64, value = 0.5 : f64} : memref<f32>
    pipe.yield %x3, %l : memref<2x8xf32>, memref<f32>
  }
  %g:6 = pipe.backward_pass chunk 0 -> !rt.request, !rt.request, memref<8x8xf32>, memref<8xf32>, memref<8xf32>, memref<8xf32> {
    %gw = rt.alloc : memref<8x8xf32>
    rt.matmul(%f#0, %f#0, %gw) {batch = 1 : i64, m = 8 : i64, n = 8 : i64, k = 2 : i64, trans_a = true, trans_b = false, stride_a = 16 : i64, stride_b = 0 : i64, stride_c = 64 : i64} : memref<2x8xf32>, memref<2x8xf32>, memref<8x8xf32>
    %gb = rt.alloc : memref<8xf32>
    rt.reduce_sum_leading(%f#0, %gb) {rows = 2 : i64, cols = 8 : i64} : memref<2x8xf32>, memref<8xf32>
    %gc = rt.alloc : memref<8xf32>
    rt.fill(%gc) {n = 8 : i64, value = 0.0 : f64} : memref<8xf32>
    %gd = rt.alloc : memref<8xf32>
    rt.fill(%gd) {n = 8 : i64, value = 0.0 : f64} : memref<8xf32>
    %r1 = rt.all_reduce_start(%gd, %gw, %gb) {axes = #dist.axes<dp>} : memref<8xf32>, memref<8x8xf32>, memref<8xf32>
    %r2 = rt.all_reduce_start(%gc) {axes = #dist.axes<dp>} : memref<8xf32>
    pipe.yield %r1, %r2, %gw, %gb, %gc, %gd : !rt.request, !rt.request, memref<8x8xf32>, memref<8xf32>, memref<8xf32>, memref<8xf32>
  }
  %u:2 = pipe.update(%g#0, %g#1, %g#2, %g#3, %g#4, %g#5, %f#1 : !rt.request, !rt.request, memref<8x8xf32>, memref<8xf32>, memref<8xf32>, memref<8xf32>, memref<f32>) -> memref<f32>, memref<f32> {
  ^bb0(%q1: !rt.request, %q2: !rt.request, %dw: memref<8x8xf32>, %db: memref<8xf32>, %dc: memref<8xf32>, %dd: memref<8xf32>, %loss: memref<f32>):
    rt.wait %q2
    rt.wait %q1
    %n = rt.alloc : memref<f32>
    rt.fill(%n) {n = 1 : i64, value = 1.0 : f64} : memref<f32>
    %lr = rt.learning_rate : f32
    %t = rt.update_count : i64
    %mw = rt.state_of %w <adam_m> : memref<8x8xf32> -> memref<8x8xf32>
    %vw = rt.state_of %w <adam_v> : memref<8x8xf32> -> memref<8x8xf32>
    rt.adamw(%w, %dw, %mw, %vw, %n, %lr, %t) {n = 64 : i64, beta1 = 0.9 : f32, beta2 = 0.95 : f32, eps = 1.0e-8 : f32, weight_decay = 0.1 : f32, max_grad_norm = 1.0 : f32} : memref<8x8xf32>, memref<8x8xf32>, memref<8x8xf32>, memref<8x8xf32>, memref<f32>, f32, i64
    %mb = rt.state_of %b <adam_m> : memref<8xf32> -> memref<8xf32>
    %vb = rt.state_of %b <adam_v> : memref<8xf32> -> memref<8xf32>
    rt.adamw(%b, %db, %mb, %vb, %n, %lr, %t) {n = 8 : i64, beta1 = 0.9 : f32, beta2 = 0.95 : f32, eps = 1.0e-8 : f32, weight_decay = 0.0 : f32, max_grad_norm = 1.0 : f32} : memref<8xf32>, memref<8xf32>, memref<8xf32>, memref<8xf32>, memref<f32>, f32, i64
    %mc = rt.state_of %c <adam_m> : memref<8xf32> -> memref<8xf32>
    %vc = rt.state_of %c <adam_v> : memref<8xf32> -> memref<8xf32>
    rt.adamw(%c, %dc, %mc, %vc, %n, %lr, %t) {n = 8 : i64, beta1 = 0.9 : f32, beta2 = 0.95 : f32, eps = 1.0e-8 : f32, weight_decay = 0.0 : f32, max_grad_norm = 1.0 : f32} : memref<8xf32>, memref<8xf32>, memref<8xf32>, memref<8xf32>, memref<f32>, f32, i64
    %md = rt.state_of %d <adam_m> : memref<8xf32> -> memref<8xf32>
    %vd = rt.state_of %d <adam_v> : memref<8xf32> -> memref<8xf32>
    rt.adamw(%d, %dd, %md, %vd, %n, %lr, %t) {n = 8 : i64, beta1 = 0.9 : f32, beta2 = 0.95 : f32, eps = 1.0e-8 : f32, weight_decay = 0.0 : f32, max_grad_norm = 1.0 : f32} : memref<8xf32>, memref<8xf32>, memref<8xf32>, memref<8xf32>, memref<f32>, f32, i64
    rt.all_reduce(%loss) {axes = #dist.axes<dp>} : memref<f32>
    pipe.yield %loss, %n : memref<f32>, memref<f32>
  }
  return %u#0, %u#1 : memref<f32>, memref<f32>
}
}

// -----

// Two microbatches: the update's inputs are sums over them, each in an
// accumulator: b's gradient in its slot of the gradient store (offset 64),
// the loss in the accumulator store. Each is summed into its place right
// after the last op of its part that touches it (the part's first run
// overwriting), so its arena place is free again for the rest of the part:
// the backward pass's later buffer takes the gradient's place while the
// forward's activation is still read, and the forward's loss leaves its
// place to the gradient.
// CHECK-LABEL: func.func @train_step()
// CHECK-SAME: rt.accumulator_elems = 1 : i64, rt.arena_bytes = 128 : i64, rt.norm_sums = 0 : i64, rt.param_elems = 72 : i64, rt.received_bytes = 0 : i64, rt.request_slots = 0 : i64
// CHECK: pipe.forward_pass
// CHECK-NEXT: %[[FIRST:.*]] = rt.first_run : i1
// CHECK: %[[L:.*]] = rt.buffer <arena> 64 : memref<f32>
// CHECK-NEXT: rt.fill(%[[L]])
// CHECK-NEXT: %[[ACC:.*]] = rt.buffer <accumulators> 0 : memref<f32>
// CHECK-NEXT: rt.accumulate(%[[L]], %[[ACC]], %[[FIRST]]) {n = 1 : i64}
// CHECK: pipe.backward_pass
// CHECK-NEXT: %[[FIRST:.*]] = rt.first_run : i1
// CHECK-NEXT: %[[GB:.*]] = rt.buffer <arena> 64 : memref<8xf32>
// CHECK-NEXT: %[[X:.*]] = rt.buffer <arena> 0 : memref<2x8xf32>
// CHECK-NEXT: rt.reduce_sum_leading(%[[X]], %[[GB]])
// CHECK-NEXT: %[[G:.*]] = rt.buffer <grads> 64 : memref<8xf32>
// CHECK-NEXT: rt.accumulate(%[[GB]], %[[G]], %[[FIRST]]) {n = 8 : i64}
// CHECK-NEXT: %[[T:.*]] = rt.buffer <arena> 64 : memref<2x8xf32>
// CHECK-NEXT: rt.fill(%[[T]])
// CHECK: pipe.yield %[[GB]]
// CHECK: pipe.update(%{{.*}}) -> memref<f32>, memref<f32> {
// CHECK: rt.buffer <params> 64 : memref<8xf32>
// CHECK-NEXT: rt.buffer <grads> 64 : memref<8xf32>
// CHECK-NEXT: rt.adamw
// CHECK-NEXT: %[[LOSS:.*]] = rt.buffer <accumulators> 0 : memref<f32>
// CHECK-NEXT: rt.all_reduce(%[[LOSS]])

module attributes {dist.mesh = #dist.mesh<dp = 1>, pipe.layout = #pipe.layout<microbatches = 2, schedule = "1f1b", virtual_stages = 1>} {
func.func @train_step() -> (memref<f32>, memref<f32>) attributes {pipe.rank = 0 : i64} {
  %w = rt.param "w" {decay = true, global_shape = array<i64: 8, 8>, init = "normal", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64} : memref<8x8xf32>
  %b = rt.param "b" {decay = false, global_shape = array<i64: 8>, init = "zeros", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64} : memref<8xf32>
  %f:2 = pipe.forward_pass chunk 0 -> memref<2x8xf32>, memref<f32> {
    %x = rt.alloc : memref<2x8xf32>
    rt.fill(%x) {n = 16 : i64, value = 1.0 : f64} : memref<2x8xf32>
    %l = rt.alloc : memref<f32>
    rt.fill(%l) {n = 1 : i64, value = 0.5 : f64} : memref<f32>
    pipe.yield %x, %l : memref<2x8xf32>, memref<f32>
  }
  %g = pipe.backward_pass chunk 0 -> memref<8xf32> {
    %gb = rt.alloc : memref<8xf32>
    rt.reduce_sum_leading(%f#0, %gb) {rows = 2 : i64, cols = 8 : i64} : memref<2x8xf32>, memref<8xf32>
    %t = rt.alloc : memref<2x8xf32>
    rt.fill(%t) {n = 16 : i64, value = 1.0 : f64} : memref<2x8xf32>
    %u = rt.alloc : memref<8xf32>
    rt.reduce_sum_leading(%f#0, %u) {rows = 2 : i64, cols = 8 : i64} : memref<2x8xf32>, memref<8xf32>
    pipe.yield %gb : memref<8xf32>
  }
  %u:2 = pipe.update(%g, %f#1 : memref<8xf32>, memref<f32>) -> memref<f32>, memref<f32> {
  ^bb0(%db: memref<8xf32>, %loss: memref<f32>):
    %n = rt.alloc : memref<f32>
    rt.fill(%n) {n = 1 : i64, value = 1.0 : f64} : memref<f32>
    %lr = rt.learning_rate : f32
    %t = rt.update_count : i64
    %mb = rt.state_of %b <adam_m> : memref<8xf32> -> memref<8xf32>
    %vb = rt.state_of %b <adam_v> : memref<8xf32> -> memref<8xf32>
    rt.adamw(%b, %db, %mb, %vb, %n, %lr, %t) {n = 8 : i64, beta1 = 0.9 : f32, beta2 = 0.95 : f32, eps = 1.0e-8 : f32, weight_decay = 0.0 : f32, max_grad_norm = 1.0 : f32} : memref<8xf32>, memref<8xf32>, memref<8xf32>, memref<8xf32>, memref<f32>, f32, i64
    rt.all_reduce(%loss) {axes = #dist.axes<dp>} : memref<f32>
    pipe.yield %loss, %n : memref<f32>, memref<f32>
  }
  return %u#0, %u#1 : memref<f32>, memref<f32>
}
}

// -----

// The interleaved schedule: rank 1 of two runs chunks 0 (stage 1) and 1
// (stage 3). What crosses a chunk's parts (x for chunk 0, y for chunk 1, 64
// bytes each) gets an arena of that chunk's own (both at offset 0 in it),
// and each (chunk, microbatch) a place taken at its forward and given back
// after its backward, first fit over the schedule: chunk 0's microbatches 0
// and 1 at 0 and 64, chunk 1's microbatch 0 at 128 and again microbatch 1,
// chunk 0's microbatch 2 at 128, then 3 where microbatch 0 was; chunk 1's
// microbatches 2 and 3 where chunk 0's microbatch 1 was. Three chunks in
// flight at most: 192 bytes, where a slot of the whole stage (128 bytes)
// per microbatch in flight would hold three slots, 384.
// CHECK-LABEL: func.func @stage_1()
// CHECK-SAME: rt.arena_bytes = 128 : i64
// CHECK-SAME: rt.chunk_arena_offsets = array<i64: 0, 64, 128, 0, 128, 128, 64, 64>
// CHECK-SAME: rt.chunk_arena_total = 192 : i64
// CHECK-SAME: rt.chunks_in_flight = 3 : i64
// CHECK: pipe.forward_pass chunk 0
// CHECK-NEXT: rt.buffer <arena> 0 : memref<2x8xf32>
// CHECK: pipe.forward_pass chunk 1
// CHECK-NEXT: rt.first_run
// CHECK-NEXT: rt.buffer <arena> 0 : memref<2x8xf32>

module attributes {dist.mesh = #dist.mesh<pp = 2>, pipe.layout = #pipe.layout<microbatches = 4, schedule = "interleaved", virtual_stages = 2>} {
  pipe.schedule "interleaved" ranks 2 microbatches 4 virtual_stages 2 {
    pipe.rank 0 {
      pipe.forward stage 0 microbatch 0
      pipe.send "activation" stage 0 microbatch 0 to 1
      pipe.forward stage 0 microbatch 1
      pipe.send "activation" stage 0 microbatch 1 to 1
      pipe.recv "activation" stage 1 microbatch 0 from 1
      pipe.forward stage 2 microbatch 0
      pipe.send "activation" stage 2 microbatch 0 to 1
      pipe.recv "activation" stage 1 microbatch 1 from 1
      pipe.forward stage 2 microbatch 1
      pipe.send "activation" stage 2 microbatch 1 to 1
      pipe.forward stage 0 microbatch 2
      pipe.send "activation" stage 0 microbatch 2 to 1
      pipe.recv "gradient" stage 3 microbatch 0 from 1
      pipe.backward stage 2 microbatch 0
      pipe.send "gradient" stage 2 microbatch 0 to 1
      pipe.forward stage 0 microbatch 3
      pipe.send "activation" stage 0 microbatch 3 to 1
      pipe.recv "gradient" stage 3 microbatch 1 from 1
      pipe.backward stage 2 microbatch 1
      pipe.send "gradient" stage 2 microbatch 1 to 1
      pipe.recv "activation" stage 1 microbatch 2 from 1
      pipe.forward stage 2 microbatch 2
      pipe.send "activation" stage 2 microbatch 2 to 1
      pipe.recv "gradient" stage 1 microbatch 0 from 1
      pipe.backward stage 0 microbatch 0
      pipe.recv "activation" stage 1 microbatch 3 from 1
      pipe.forward stage 2 microbatch 3
      pipe.send "activation" stage 2 microbatch 3 to 1
      pipe.recv "gradient" stage 1 microbatch 1 from 1
      pipe.backward stage 0 microbatch 1
      pipe.recv "gradient" stage 3 microbatch 2 from 1
      pipe.backward stage 2 microbatch 2
      pipe.send "gradient" stage 2 microbatch 2 to 1
      pipe.recv "gradient" stage 3 microbatch 3 from 1
      pipe.backward stage 2 microbatch 3
      pipe.send "gradient" stage 2 microbatch 3 to 1
      pipe.recv "gradient" stage 1 microbatch 2 from 1
      pipe.backward stage 0 microbatch 2
      pipe.recv "gradient" stage 1 microbatch 3 from 1
      pipe.backward stage 0 microbatch 3
    }
    pipe.rank 1 {
      pipe.recv "activation" stage 0 microbatch 0 from 0
      pipe.forward stage 1 microbatch 0
      pipe.send "activation" stage 1 microbatch 0 to 0
      pipe.recv "activation" stage 0 microbatch 1 from 0
      pipe.forward stage 1 microbatch 1
      pipe.send "activation" stage 1 microbatch 1 to 0
      pipe.recv "activation" stage 2 microbatch 0 from 0
      pipe.forward stage 3 microbatch 0
      pipe.backward stage 3 microbatch 0
      pipe.send "gradient" stage 3 microbatch 0 to 0
      pipe.recv "activation" stage 2 microbatch 1 from 0
      pipe.forward stage 3 microbatch 1
      pipe.backward stage 3 microbatch 1
      pipe.send "gradient" stage 3 microbatch 1 to 0
      pipe.recv "activation" stage 0 microbatch 2 from 0
      pipe.forward stage 1 microbatch 2
      pipe.send "activation" stage 1 microbatch 2 to 0
      pipe.recv "gradient" stage 2 microbatch 0 from 0
      pipe.backward stage 1 microbatch 0
      pipe.send "gradient" stage 1 microbatch 0 to 0
      pipe.recv "activation" stage 0 microbatch 3 from 0
      pipe.forward stage 1 microbatch 3
      pipe.send "activation" stage 1 microbatch 3 to 0
      pipe.recv "gradient" stage 2 microbatch 1 from 0
      pipe.backward stage 1 microbatch 1
      pipe.send "gradient" stage 1 microbatch 1 to 0
      pipe.recv "activation" stage 2 microbatch 2 from 0
      pipe.forward stage 3 microbatch 2
      pipe.backward stage 3 microbatch 2
      pipe.send "gradient" stage 3 microbatch 2 to 0
      pipe.recv "activation" stage 2 microbatch 3 from 0
      pipe.forward stage 3 microbatch 3
      pipe.backward stage 3 microbatch 3
      pipe.send "gradient" stage 3 microbatch 3 to 0
      pipe.recv "gradient" stage 2 microbatch 2 from 0
      pipe.backward stage 1 microbatch 2
      pipe.send "gradient" stage 1 microbatch 2 to 0
      pipe.recv "gradient" stage 2 microbatch 3 from 0
      pipe.backward stage 1 microbatch 3
      pipe.send "gradient" stage 1 microbatch 3 to 0
    }
  }
func.func @stage_1() -> (memref<f32>, memref<f32>) attributes {pipe.rank = 1 : i64} {
  %b = rt.param "b" {decay = false, global_shape = array<i64: 8>, init = "zeros", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64} : memref<8xf32>
  %f0 = pipe.forward_pass chunk 0 -> memref<2x8xf32> {
    %x = rt.alloc : memref<2x8xf32>
    rt.fill(%x) {n = 16 : i64, value = 1.0 : f64} : memref<2x8xf32>
    pipe.yield %x : memref<2x8xf32>
  }
  %f1:2 = pipe.forward_pass chunk 1 -> memref<2x8xf32>, memref<f32> {
    %y = rt.alloc : memref<2x8xf32>
    rt.fill(%y) {n = 16 : i64, value = 1.0 : f64} : memref<2x8xf32>
    %l = rt.alloc : memref<f32>
    rt.fill(%l) {n = 1 : i64, value = 0.5 : f64} : memref<f32>
    pipe.yield %y, %l : memref<2x8xf32>, memref<f32>
  }
  %g1 = pipe.backward_pass chunk 1 -> memref<8xf32> {
    %gy = rt.alloc : memref<8xf32>
    rt.reduce_sum_leading(%f1#0, %gy) {rows = 2 : i64, cols = 8 : i64} : memref<2x8xf32>, memref<8xf32>
    pipe.yield %gy : memref<8xf32>
  }
  %g0 = pipe.backward_pass chunk 0 -> memref<8xf32> {
    %gx = rt.alloc : memref<8xf32>
    rt.reduce_sum_leading(%f0, %gx) {rows = 2 : i64, cols = 8 : i64} : memref<2x8xf32>, memref<8xf32>
    pipe.yield %gx : memref<8xf32>
  }
  %u:2 = pipe.update(%g0, %f1#1 : memref<8xf32>, memref<f32>) -> memref<f32>, memref<f32> {
  ^bb0(%db: memref<8xf32>, %loss: memref<f32>):
    %n = rt.alloc : memref<f32>
    rt.fill(%n) {n = 1 : i64, value = 1.0 : f64} : memref<f32>
    %lr = rt.learning_rate : f32
    %t = rt.update_count : i64
    %mb = rt.state_of %b <adam_m> : memref<8xf32> -> memref<8xf32>
    %vb = rt.state_of %b <adam_v> : memref<8xf32> -> memref<8xf32>
    rt.adamw(%b, %db, %mb, %vb, %n, %lr, %t) {n = 8 : i64, beta1 = 0.9 : f32, beta2 = 0.95 : f32, eps = 1.0e-8 : f32, weight_decay = 0.0 : f32, max_grad_norm = 1.0 : f32} : memref<8xf32>, memref<8xf32>, memref<8xf32>, memref<8xf32>, memref<f32>, f32, i64
    pipe.yield %loss, %n : memref<f32>, memref<f32>
  }
  return %u#0, %u#1 : memref<f32>, memref<f32>
}
}
