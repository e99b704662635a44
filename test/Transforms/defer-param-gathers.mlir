// RUN: tessel-opt %s --split-input-file --tessel-defer-param-gathers | FileCheck %s

// ZeRO-1's gathers of the updated runs leave the update (with their waits)
// and start before the step's parts, each in a request slot of its own after
// the program's; a run a forward part reads is waited for before its first
// read, on the part's first run; a run a top-level op of the step touches
// (the tied weight's send) before that op, and one nothing touches at the
// step's end; a wait of the update's on a slot that served another
// collective first stays. @sync_params gathers them all, blocking.

// CHECK-LABEL: module @stage0 attributes {pipe.rank = 0 : i64, rt.request_slots = 5 : i64}
// CHECK-LABEL: func.func @train_step()
// CHECK: %[[TIED:.*]] = rt.buffer <params> 0 : memref<16xf32>
// CHECK-NEXT: %[[W:.*]] = rt.buffer <params> 0 : memref<16xf32>
// CHECK-NEXT: %[[B:.*]] = rt.buffer <shadow> 0 : memref<32xbf16>
// CHECK-NEXT: %[[P:.*]] = rt.buffer <param_pieces> 0 : memref<16xf32>
// CHECK-NEXT: %[[U:.*]] = rt.buffer <params> 64 : memref<8xf32>
// CHECK-NEXT: rt.all_gather_shards_start(%[[W]] : memref<16xf32>) {axes = #dist.axes<dp>, n = 16 : i64, slot = 2 : i64}
// CHECK-NEXT: rt.all_gather_shards_start(%[[B]] : memref<32xbf16> from %[[P]] : memref<16xf32>) {axes = #dist.axes<dp>, n = 32 : i64, slot = 3 : i64}
// CHECK-NEXT: rt.all_gather_shards_start(%[[U]] : memref<8xf32>) {axes = #dist.axes<dp>, n = 8 : i64, slot = 4 : i64}
// CHECK-NEXT: rt.wait_requests {count = 1 : i64, first = 2 : i64}
// CHECK-NEXT: rt.send(%[[TIED]])
// CHECK-NEXT: call @forward0(%{{.*}}, %true)
// CHECK-NEXT: call @forward0(%{{.*}}, %false)
// CHECK-NEXT: call @backward0
// CHECK-NEXT: call @update
// CHECK-NEXT: rt.wait_requests {count = 1 : i64, first = 4 : i64}
// CHECK-NEXT: return
// CHECK-LABEL: func.func @sync_params()
// CHECK: rt.all_gather_shards(%{{.*}}) {axes = #dist.axes<dp>, n = 16 : i64
// CHECK: rt.all_gather_shards(%{{.*}}, %{{.*}}) {axes = #dist.axes<dp>, n = 32 : i64
// CHECK: rt.all_gather_shards(%{{.*}}) {axes = #dist.axes<dp>, n = 8 : i64
// CHECK: return
// CHECK-LABEL: func.func private @forward0(
// CHECK-SAME: %[[MB:.*]]: i64, %[[FIRST:.*]]: i1
// CHECK: rt.fill
// CHECK: rt.wait_requests if %[[FIRST]] {count = 1 : i64, first = 3 : i64}
// CHECK-NEXT: rt.matmul
// CHECK-LABEL: func.func private @update(
// CHECK-NOT: all_gather_shards
// CHECK: rt.wait_requests {count = 1 : i64, first = 0 : i64}
// CHECK-NOT: all_gather_shards
// CHECK: return
module attributes {dist.mesh = #dist.mesh<dp = 2, pp = 2>} {
  module @stage0 attributes {pipe.rank = 0 : i64, rt.request_slots = 2 : i64} {
    func.func @train_step() {
      %c0 = arith.constant 0 : i64
      %c1 = arith.constant 1 : i64
      %t = arith.constant true
      %f = arith.constant false
      %tied = rt.buffer <params> 0 : memref<16xf32>
      rt.send(%tied) microbatch %c0 {offset = 1 : i64, tag = 1 : i64} : memref<16xf32>
      call @forward0(%c0, %t) : (i64, i1) -> ()
      call @forward0(%c1, %f) : (i64, i1) -> ()
      call @backward0(%c0, %t) : (i64, i1) -> ()
      call @update(%c0, %t) : (i64, i1) -> ()
      return
    }
    func.func private @forward0(%mb: i64, %first: i1) attributes {rt.part = "forward"} {
      %out = rt.buffer <arena> 0 : memref<4x4xbf16>
      rt.fill(%out) {n = 16 : i64, value = 0.0 : f64} : memref<4x4xbf16>
      %w = rt.buffer <shadow> 0 : memref<4x8xbf16>
      %x = rt.buffer <arena> 64 : memref<4x8xbf16>
      rt.matmul(%x, %w, %out) {batch = 1 : i64, k = 8 : i64, m = 4 : i64, n = 4 : i64, stride_a = 0 : i64, stride_b = 0 : i64, stride_c = 0 : i64, trans_a = false, trans_b = true} : memref<4x8xbf16>, memref<4x8xbf16>, memref<4x4xbf16>
      return
    }
    func.func private @backward0(%mb: i64, %first: i1) attributes {rt.part = "backward"} {
      %g = rt.buffer <grads> 0 : memref<16xf32>
      rt.fill(%g) {n = 16 : i64, value = 0.0 : f64} : memref<16xf32>
      return
    }
    func.func private @update(%mb: i64, %first: i1) attributes {rt.part = "update"} {
      %g = rt.buffer <grads> 0 : memref<16xf32>
      %r = rt.reduce_scatter_piece_start(%g, %g) {axes = #dist.axes<dp>, n = 16 : i64, slot = 0 : i64} : memref<16xf32>, memref<16xf32>
      rt.wait_requests {count = 1 : i64, first = 0 : i64}
      %w = rt.buffer <params> 0 : memref<16xf32>
      %s0 = rt.all_gather_shards_start(%w : memref<16xf32>) {axes = #dist.axes<dp>, n = 16 : i64, slot = 0 : i64}
      %copy = rt.buffer <shadow> 0 : memref<32xbf16>
      %piece = rt.buffer <param_pieces> 0 : memref<16xf32>
      %s1 = rt.all_gather_shards_start(%copy : memref<32xbf16> from %piece : memref<16xf32>) {axes = #dist.axes<dp>, n = 32 : i64, slot = 1 : i64}
      %u = rt.buffer <params> 64 : memref<8xf32>
      %s2 = rt.all_gather_shards_start(%u : memref<8xf32>) {axes = #dist.axes<dp>, n = 8 : i64, slot = 2 : i64}
      rt.wait_requests {count = 3 : i64, first = 0 : i64}
      return
    }
  }
}
