// RUN: tessel-opt %s --tessel-overlap-gradient-syncs | FileCheck %s

// A planned step with microbatches at dp = 2: the backward part accumulates
// four gradient runs, the update reduces them over dp (one as ZeRO-1's
// reduce-scatter). The part gets a copy for the last microbatch that
// starts each movable reduction right after its last write to the run, in
// a new request slot (after the one the plan uses); the update waits for
// that slot where it reduced. The original part is unchanged.
// CHECK-LABEL: func.func @train_step
// CHECK-SAME: rt.request_slots = 4 : i64
// CHECK: pipe.backward_pass chunk 0 {
// CHECK-NOT: _start
// CHECK: pipe.backward_pass chunk 0 attributes {pipe.last_microbatch} {
// CHECK: rt.buffer <grads> 8 : memref<8xf32>
// CHECK-NEXT: rt.accumulate
// CHECK-NEXT: %[[V1:.*]] = rt.buffer <grads> 8 : memref<8xf32>
// CHECK-NEXT: rt.all_reduce_start(%[[V1]]) {axes = #dist.axes<dp>, slot = 1 : i64}
// The first run is written twice: reduced after the second write.
// CHECK: rt.buffer <grads> 0 : memref<8xf32>
// CHECK-NEXT: rt.accumulate
// CHECK-NEXT: %[[V0:.*]] = rt.buffer <grads> 0 : memref<8xf32>
// CHECK-NEXT: rt.all_reduce_start(%[[V0]]) {axes = #dist.axes<dp>, slot = 2 : i64}
// CHECK: rt.buffer <grads> 32 : memref<8xf32>
// CHECK-NEXT: rt.accumulate
// CHECK-NEXT: %[[V4:.*]] = rt.buffer <grads> 32 : memref<8xf32>
// CHECK-NEXT: rt.reduce_scatter_shards_start(%[[V4]]) {axes = #dist.axes<dp>, slot = 3 : i64}
// CHECK: pipe.update
// CHECK: rt.wait_requests {count = 1 : i64, first = 1 : i64}
// CHECK-NEXT: rt.wait_requests {count = 1 : i64, first = 2 : i64}
// A run the update writes before its reduction, and one the forward part
// writes, are reduced where they were.
// CHECK: rt.fill(%[[W:.*]]) {n = 8 : i64
// CHECK-NEXT: rt.all_reduce(%[[W]]) {axes = #dist.axes<dp>}
// CHECK: rt.all_reduce(%{{.*}}) {axes = #dist.axes<dp>}
// A reduction over tp only is not a data-parallel sync.
// CHECK: rt.all_reduce(%{{.*}}) {axes = #dist.axes<tp>}
// CHECK: rt.wait_requests {count = 1 : i64, first = 3 : i64}
// CHECK: rt.sum_squares

module attributes {dist.mesh = #dist.mesh<dp = 2, tp = 2>} {
func.func @train_step() -> (memref<f32>, memref<f32>) attributes {pipe.rank = 0 : i64, rt.request_slots = 1 : i64} {
  %f:1 = pipe.forward_pass chunk 0 -> memref<f32> {
    %l = rt.buffer <transient> 0 : memref<f32>
    rt.fill(%l) {n = 1 : i64, value = 0.5 : f64} : memref<f32>
    %g3 = rt.buffer <grads> 24 : memref<8xf32>
    rt.fill(%g3) {n = 8 : i64, value = 1.0 : f64} : memref<8xf32>
    pipe.yield %l : memref<f32>
  }
  pipe.backward_pass chunk 0 {
    %first = rt.first_run : i1
    %t = rt.buffer <transient> 0 : memref<8xf32>
    rt.fill(%t) {n = 8 : i64, value = 1.0 : f64} : memref<8xf32>
    %g0 = rt.buffer <grads> 0 : memref<8xf32>
    rt.accumulate(%t, %g0, %first) {n = 8 : i64} : memref<8xf32>, memref<8xf32>, i1
    %g1 = rt.buffer <grads> 8 : memref<8xf32>
    rt.accumulate(%t, %g1, %first) {n = 8 : i64} : memref<8xf32>, memref<8xf32>, i1
    %g0b = rt.buffer <grads> 0 : memref<8xf32>
    rt.accumulate(%t, %g0b, %first) {n = 8 : i64} : memref<8xf32>, memref<8xf32>, i1
    %g2 = rt.buffer <grads> 16 : memref<8xf32>
    rt.accumulate(%t, %g2, %first) {n = 8 : i64} : memref<8xf32>, memref<8xf32>, i1
    %g4 = rt.buffer <grads> 32 : memref<8xf32>
    rt.accumulate(%t, %g4, %first) {n = 8 : i64} : memref<8xf32>, memref<8xf32>, i1
    %g5 = rt.buffer <grads> 40 : memref<8xf32>
    rt.accumulate(%t, %g5, %first) {n = 8 : i64} : memref<8xf32>, memref<8xf32>, i1
    pipe.yield
  }
  %u:2 = pipe.update(%f#0 : memref<f32>) -> memref<f32>, memref<f32> {
  ^bb0(%loss: memref<f32>):
    %a = rt.buffer <grads> 8 : memref<8xf32>
    rt.all_reduce(%a) {axes = #dist.axes<dp>} : memref<8xf32>
    %b = rt.buffer <grads> 0 : memref<8xf32>
    rt.all_reduce(%b) {axes = #dist.axes<dp>} : memref<8xf32>
    %c = rt.buffer <grads> 16 : memref<8xf32>
    rt.fill(%c) {n = 8 : i64, value = 0.0 : f64} : memref<8xf32>
    rt.all_reduce(%c) {axes = #dist.axes<dp>} : memref<8xf32>
    %d = rt.buffer <grads> 24 : memref<8xf32>
    rt.all_reduce(%d) {axes = #dist.axes<dp>} : memref<8xf32>
    %h = rt.buffer <grads> 40 : memref<8xf32>
    rt.all_reduce(%h) {axes = #dist.axes<tp>} : memref<8xf32>
    %e = rt.buffer <grads> 32 : memref<8xf32>
    rt.reduce_scatter_shards(%e) {axes = #dist.axes<dp>, n = 8 : i64} : memref<8xf32>
    %s = rt.buffer <norm_sums> 0 : memref<1xf64>
    %all = rt.buffer <grads> 0 : memref<48xf32>
    rt.sum_squares(%all, %s) {n = 48 : i64} : memref<48xf32>, memref<1xf64>
    %n = rt.buffer <transient> 0 : memref<f32>
    rt.fill(%n) {n = 1 : i64, value = 1.0 : f64} : memref<f32>
    pipe.yield %loss, %n : memref<f32>, memref<f32>
  }
  return %u#0, %u#1 : memref<f32>, memref<f32>
}
}
