// RUN: tessel-opt %s --tessel-keep-loss-statistics | FileCheck %s
// RUN: tessel-opt %s --tessel-keep-loss-statistics --tessel-plan-memory | FileCheck %s --check-prefix=PLAN

// The vocabulary-parallel loss's backward reads the logits the forward part
// hands on: the forward keeps each row's maximum and sum of exponentials
// (two fp32 values per row) in a buffer the part hands on as one more
// result, and the backward reads it instead of combining them over tp
// again.
// CHECK-LABEL: func.func @train_step
// CHECK: %[[F:.*]]:3 = pipe.forward_pass chunk 0 -> memref<8x64xf32>, memref<f32>, memref<16xf32>
// CHECK: %[[STATS:.*]] = rt.alloc : memref<16xf32>
// CHECK-NEXT: rt.cross_entropy_vocab_parallel_forward(%{{.*}}, %{{.*}}, %{{.*}}, %[[STATS]])
// CHECK: pipe.yield %{{.*}}, %{{.*}}, %[[STATS]] : memref<8x64xf32>, memref<f32>, memref<16xf32>
// CHECK: pipe.backward_pass
// CHECK: rt.cross_entropy_vocab_parallel_backward(%[[F]]#0, %{{.*}}, %{{.*}}, %{{.*}}, %[[F]]#2)
// CHECK: pipe.update(%[[F]]#1 : memref<f32>)

// The statistics cross from the forward part to the backward, so they keep
// one place in the arena meanwhile, like the logits.
// PLAN: %[[S:.*]] = rt.buffer <arena> [[AT:[0-9]+]] : memref<16xf32>
// PLAN-NEXT: rt.cross_entropy_vocab_parallel_forward(%{{.*}}, %{{.*}}, %{{.*}}, %[[S]])
// PLAN: %[[S2:.*]] = rt.buffer <arena> [[AT]] : memref<16xf32>
// PLAN-NEXT: rt.cross_entropy_vocab_parallel_backward(%{{.*}}, %{{.*}}, %{{.*}}, %{{.*}}, %[[S2]])
module attributes {dist.mesh = #dist.mesh<tp = 2>} {
func.func @train_step() -> (memref<f32>, memref<f32>) attributes {pipe.rank = 0 : i64} {
  %f:2 = pipe.forward_pass chunk 0 -> memref<8x64xf32>, memref<f32> {
    %x = rt.alloc : memref<8x64xf32>
    rt.fill(%x) {n = 512 : i64, value = 1.0 : f64} : memref<8x64xf32>
    %ids = rt.batch "targets" : memref<8xi32>
    %loss = rt.alloc : memref<f32>
    rt.cross_entropy_vocab_parallel_forward(%x, %ids, %loss) {rows = 8 : i64, local_vocab = 64 : i64, vocab_start = #rt.group_offset<#dist.axes<tp>, 64, 1>, axes = #dist.axes<tp>, valid = 128 : i64} : memref<8x64xf32>, memref<8xi32>, memref<f32>
    pipe.yield %x, %loss : memref<8x64xf32>, memref<f32>
  }
  %g:1 = pipe.backward_pass chunk 0 -> memref<8x64xf32> {
    %ids = rt.batch "targets" : memref<8xi32>
    %dloss = rt.alloc : memref<f32>
    rt.fill(%dloss) {n = 1 : i64, value = 1.0 : f64} : memref<f32>
    %dx = rt.alloc : memref<8x64xf32>
    rt.cross_entropy_vocab_parallel_backward(%f#0, %ids, %dloss, %dx) {rows = 8 : i64, local_vocab = 64 : i64, vocab_start = #rt.group_offset<#dist.axes<tp>, 64, 1>, axes = #dist.axes<tp>, valid = 128 : i64} : memref<8x64xf32>, memref<8xi32>, memref<f32>, memref<8x64xf32>
    pipe.yield %dx : memref<8x64xf32>
  }
  %u:2 = pipe.update(%f#1 : memref<f32>) -> memref<f32>, memref<f32> {
  ^bb0(%l: memref<f32>):
    %n = rt.alloc : memref<f32>
    rt.fill(%n) {n = 1 : i64, value = 1.0 : f64} : memref<f32>
    pipe.yield %l, %n : memref<f32>, memref<f32>
  }
  return %u#0, %u#1 : memref<f32>, memref<f32>
}
}
