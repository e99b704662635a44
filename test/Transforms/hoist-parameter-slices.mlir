// RUN: tessel-opt %s --tessel-hoist-parameter-slices | FileCheck %s
// RUN: tessel-opt %s --tessel-hoist-parameter-slices --tessel-plan-memory | FileCheck %s --check-prefix=PLAN

// Fused q|k|v weights sliced for GEMMs in the forward part, and one slice
// again in the backward part: each slice moves before the first part, once,
// and the parts' GEMMs read it.
//
// In bf16, a weight's slices go into its own bf16 shadow slot, one after
// the other (nothing else reads it: the GEMMs read the slices), each part
// naming the slot next to its reader. In fp32 a slice gets a buffer of its
// own, which the memory plan holds for the step.
// CHECK-LABEL: func.func @train_step
// CHECK: %[[W:.*]] = rt.param "qkv"
// CHECK: %[[W16:.*]] = rt.param "qkv16"
// CHECK-NEXT: %[[W16T:.*]] = rt.param "tied16"
// A weight whose shadow a GEMM reads whole keeps its slot: its bf16 slice
// gets a buffer for the step.
// CHECK-NEXT: %[[T:.*]] = rt.alloc : memref<8x4xbf16>
// CHECK-NEXT: rt.slice_axis(%[[W16T]], %[[T]])
// CHECK-NEXT: %[[S0:.*]] = rt.state_of %[[W16]] <shadow> {offset = 0 : i64} : memref<8x12xf32> -> memref<8x4xbf16>
// CHECK-NEXT: rt.slice_axis(%[[W16]], %[[S0]]) {{.*}}start = 0 : i64}
// CHECK-NEXT: %[[S1:.*]] = rt.state_of %[[W16]] <shadow> {offset = 32 : i64}
// CHECK-NEXT: rt.slice_axis(%[[W16]], %[[S1]]) {{.*}}start = 4 : i64}
// CHECK-NEXT: %[[Q:.*]] = rt.alloc : memref<8x4xf32>
// CHECK-NEXT: rt.slice_axis(%[[W]], %[[Q]]) {extent = 12 : i64, inner = 1 : i64, length = 4 : i64, outer = 8 : i64, start = 0 : i64}
// CHECK-NEXT: pipe.forward_pass
// CHECK: %[[L0:.*]] = rt.state_of %[[W16]] <shadow> {offset = 0 : i64}
// CHECK-NEXT: rt.matmul(%{{.*}}, %[[L0]], %{{.*}})
// CHECK: %[[L1:.*]] = rt.state_of %[[W16]] <shadow> {offset = 32 : i64}
// CHECK-NEXT: rt.matmul(%{{.*}}, %[[L1]], %{{.*}})
// CHECK-NOT: rt.slice_axis(%[[W]], %{{.*}}) {{.*}}start = 0 : i64}
// CHECK: rt.matmul(%{{.*}}, %[[Q]], %{{.*}})
// A slice whose buffer the part then writes stays where it is.
// CHECK: rt.slice_axis(%[[W]], %[[K:.*]]) {{.*}}start = 4 : i64}
// CHECK-NEXT: rt.fill(%[[K]])
// A slice of a value of the part stays too.
// CHECK: rt.slice_axis(%[[X:.*]], %{{.*}}) {{.*}}start = 0 : i64}
// CHECK: pipe.backward_pass
// CHECK-NOT: rt.slice_axis(%[[W]], %{{.*}}) {{.*}}start = 0 : i64}
// CHECK: rt.matmul(%{{.*}}, %[[Q]], %{{.*}}) {{.*}}trans_b = true

// The plan places a shadow slot's slices at the weight's offset in the
// shadow store, one after the other, and holds the other hoisted slices for
// the whole step (after the arena's slots, with what a rank receives for
// the step).
// PLAN-LABEL: func.func @train_step
// PLAN-SAME: rt.received_bytes = 192 : i64
// PLAN: rt.buffer <shadow> 96 : memref<8x4xbf16>
// PLAN: rt.buffer <shadow> 128 : memref<8x4xbf16>
// PLAN: %[[R:.*]] = rt.buffer <received> 64 : memref<8x4xf32>
// PLAN: rt.slice_axis(%{{.*}}, %[[R]]) {{.*}}start = 0 : i64} : memref<8x12xf32>, memref<8x4xf32>
// PLAN-NEXT: pipe.forward_pass
// PLAN: rt.buffer <received> 64 : memref<8x4xf32>
// PLAN-NEXT: rt.matmul

// A bf16 program cuts the slices from the weight's bf16 copy (what
// tessel-lower-precision makes them read): each is cut into a buffer of its
// own first, and once the weight's last slice is cut, copied into the
// weight's shadow slot, which the parts' GEMMs read. The backward's slice
// reads the forward's.
// CHECK-LABEL: func.func @train_step_copy
// CHECK: %[[C:.*]] = rt.param "qkvc"
// CHECK-NEXT: %[[CW:.*]] = rt.state_of %[[C]] <shadow> : memref<8x12xf32> -> memref<8x12xbf16>
// CHECK-NEXT: %[[CQ:.*]] = rt.alloc : memref<8x4xbf16>
// CHECK-NEXT: rt.slice_axis(%[[CW]], %[[CQ]]) {{.*}}start = 0 : i64}
// CHECK-NEXT: %[[CW2:.*]] = rt.state_of %[[C]] <shadow> : memref<8x12xf32> -> memref<8x12xbf16>
// CHECK-NEXT: %[[CK:.*]] = rt.alloc : memref<8x4xbf16>
// CHECK-NEXT: rt.slice_axis(%[[CW2]], %[[CK]]) {{.*}}start = 4 : i64}
// CHECK-NEXT: %[[SQ:.*]] = rt.state_of %[[C]] <shadow> {offset = 0 : i64}
// CHECK-NEXT: rt.copy(%[[CQ]], %[[SQ]]) {n = 32 : i64}
// CHECK-NEXT: %[[SK:.*]] = rt.state_of %[[C]] <shadow> {offset = 32 : i64}
// CHECK-NEXT: rt.copy(%[[CK]], %[[SK]]) {n = 32 : i64}
// CHECK-NEXT: pipe.forward_pass
// CHECK: %[[L0:.*]] = rt.state_of %[[C]] <shadow> {offset = 0 : i64}
// CHECK-NEXT: rt.matmul(%{{.*}}, %[[L0]], %{{.*}})
// CHECK: %[[L1:.*]] = rt.state_of %[[C]] <shadow> {offset = 32 : i64}
// CHECK-NEXT: rt.matmul(%{{.*}}, %[[L1]], %{{.*}})
// CHECK: pipe.backward_pass
// CHECK-NOT: rt.slice_axis
// CHECK: %[[L2:.*]] = rt.state_of %[[C]] <shadow> {offset = 0 : i64}
// CHECK-NEXT: rt.matmul(%{{.*}}, %[[L2]], %{{.*}}) {{.*}}trans_b = true

// Those buffers live before the first part only: the plan puts them where
// the parts' buffers go (the arena, with one microbatch slot), not among
// what is held for the step.
// PLAN-LABEL: func.func @train_step_copy
// PLAN-SAME: rt.received_bytes = 0 : i64
// PLAN: %[[A0:.*]] = rt.buffer <arena> 0 : memref<8x4xbf16>
// PLAN-NEXT: rt.slice_axis(%{{.*}}, %[[A0]]) {{.*}}start = 0 : i64}
// PLAN: %[[A1:.*]] = rt.buffer <arena> 64 : memref<8x4xbf16>
// PLAN-NEXT: rt.slice_axis(%{{.*}}, %[[A1]]) {{.*}}start = 4 : i64}
// PLAN: rt.copy(%{{.*}}, %{{.*}}) {n = 32 : i64} : memref<8x4xbf16>, memref<8x4xbf16>

module attributes {dist.mesh = #dist.mesh<>} {
func.func @train_step() -> (memref<f32>, memref<f32>) attributes {pipe.rank = 0 : i64} {
  %w = rt.param "qkv" {decay = true, global_shape = array<i64: 8, 12>, init = "normal", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = -1 : i64, shard_axis = #dist.axis<tp>, shard_blocks = 1 : i64} : memref<8x12xf32>
  %w16 = rt.param "qkv16" {decay = true, global_shape = array<i64: 8, 12>, init = "normal", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = -1 : i64, shard_axis = #dist.axis<tp>, shard_blocks = 1 : i64} : memref<8x12xf32>
  %t16 = rt.param "tied16" {decay = true, global_shape = array<i64: 8, 12>, init = "normal", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = -1 : i64, shard_axis = #dist.axis<tp>, shard_blocks = 1 : i64} : memref<8x12xf32>
  %f:3 = pipe.forward_pass chunk 0 -> memref<2x8xf32>, memref<2x8x8xf32>, memref<f32> {
    %h = rt.alloc : memref<2x8xbf16>
    %t16s = rt.alloc : memref<8x4xbf16>
    rt.slice_axis(%t16, %t16s) {outer = 8 : i64, extent = 12 : i64, inner = 1 : i64, start = 0 : i64, length = 4 : i64} : memref<8x12xf32>, memref<8x4xbf16>
    %t16w = rt.state_of %t16 <shadow> : memref<8x12xf32> -> memref<8x12xbf16>
    %yt = rt.alloc : memref<2x12xbf16>
    rt.matmul(%h, %t16w, %yt) {batch = 1 : i64, m = 2 : i64, n = 12 : i64, k = 8 : i64, trans_a = false, trans_b = false, stride_a = 16 : i64, stride_b = 0 : i64, stride_c = 24 : i64} : memref<2x8xbf16>, memref<8x12xbf16>, memref<2x12xbf16>
    %yt2 = rt.alloc : memref<2x4xbf16>
    rt.matmul(%h, %t16s, %yt2) {batch = 1 : i64, m = 2 : i64, n = 4 : i64, k = 8 : i64, trans_a = false, trans_b = false, stride_a = 16 : i64, stride_b = 0 : i64, stride_c = 8 : i64} : memref<2x8xbf16>, memref<8x4xbf16>, memref<2x4xbf16>
    rt.fill(%h) {n = 16 : i64, value = 1.0 : f64} : memref<2x8xbf16>
    %q16 = rt.alloc : memref<8x4xbf16>
    rt.slice_axis(%w16, %q16) {outer = 8 : i64, extent = 12 : i64, inner = 1 : i64, start = 0 : i64, length = 4 : i64} : memref<8x12xf32>, memref<8x4xbf16>
    %k16 = rt.alloc : memref<8x4xbf16>
    rt.slice_axis(%w16, %k16) {outer = 8 : i64, extent = 12 : i64, inner = 1 : i64, start = 4 : i64, length = 4 : i64} : memref<8x12xf32>, memref<8x4xbf16>
    %y16 = rt.alloc : memref<2x4xbf16>
    rt.matmul(%h, %q16, %y16) {batch = 1 : i64, m = 2 : i64, n = 4 : i64, k = 8 : i64, trans_a = false, trans_b = false, stride_a = 16 : i64, stride_b = 0 : i64, stride_c = 8 : i64} : memref<2x8xbf16>, memref<8x4xbf16>, memref<2x4xbf16>
    rt.matmul(%h, %k16, %y16) {batch = 1 : i64, m = 2 : i64, n = 4 : i64, k = 8 : i64, trans_a = false, trans_b = false, stride_a = 16 : i64, stride_b = 0 : i64, stride_c = 8 : i64} : memref<2x8xbf16>, memref<8x4xbf16>, memref<2x4xbf16>
    %x = rt.alloc : memref<2x8xf32>
    rt.fill(%x) {n = 16 : i64, value = 1.0 : f64} : memref<2x8xf32>
    %q = rt.alloc : memref<8x4xf32>
    rt.slice_axis(%w, %q) {outer = 8 : i64, extent = 12 : i64, inner = 1 : i64, start = 0 : i64, length = 4 : i64} : memref<8x12xf32>, memref<8x4xf32>
    %y = rt.alloc : memref<2x4xf32>
    rt.matmul(%x, %q, %y) {batch = 1 : i64, m = 2 : i64, n = 4 : i64, k = 8 : i64, trans_a = false, trans_b = false, stride_a = 16 : i64, stride_b = 0 : i64, stride_c = 8 : i64} : memref<2x8xf32>, memref<8x4xf32>, memref<2x4xf32>
    %k = rt.alloc : memref<8x4xf32>
    rt.slice_axis(%w, %k) {outer = 8 : i64, extent = 12 : i64, inner = 1 : i64, start = 4 : i64, length = 4 : i64} : memref<8x12xf32>, memref<8x4xf32>
    rt.fill(%k) {n = 32 : i64, value = 0.0 : f64} : memref<8x4xf32>
    %xs = rt.alloc : memref<2x4xf32>
    rt.slice_axis(%x, %xs) {outer = 2 : i64, extent = 8 : i64, inner = 1 : i64, start = 0 : i64, length = 4 : i64} : memref<2x8xf32>, memref<2x4xf32>
    %s = rt.alloc : memref<2x8x8xf32>
    rt.fill(%s) {n = 128 : i64, value = 1.0 : f64} : memref<2x8x8xf32>
    %l = rt.alloc : memref<f32>
    rt.fill(%l) {n = 1 : i64, value = 0.5 : f64} : memref<f32>
    pipe.yield %x, %s, %l : memref<2x8xf32>, memref<2x8x8xf32>, memref<f32>
  }
  %g:1 = pipe.backward_pass chunk 0 -> memref<2x8xf32> {
    %dy = rt.alloc : memref<2x4xf32>
    rt.fill(%dy) {n = 8 : i64, value = 1.0 : f64} : memref<2x4xf32>
    %q2 = rt.alloc : memref<8x4xf32>
    rt.slice_axis(%w, %q2) {outer = 8 : i64, extent = 12 : i64, inner = 1 : i64, start = 0 : i64, length = 4 : i64} : memref<8x12xf32>, memref<8x4xf32>
    %dx = rt.alloc : memref<2x8xf32>
    rt.matmul(%dy, %q2, %dx) {batch = 1 : i64, m = 2 : i64, n = 8 : i64, k = 4 : i64, trans_a = false, trans_b = true, stride_a = 8 : i64, stride_b = 0 : i64, stride_c = 16 : i64} : memref<2x4xf32>, memref<8x4xf32>, memref<2x8xf32>
    pipe.yield %dx : memref<2x8xf32>
  }
  %u:2 = pipe.update(%f#2 : memref<f32>) -> memref<f32>, memref<f32> {
  ^bb0(%loss: memref<f32>):
    %n = rt.alloc : memref<f32>
    rt.fill(%n) {n = 1 : i64, value = 1.0 : f64} : memref<f32>
    pipe.yield %loss, %n : memref<f32>, memref<f32>
  }
  return %u#0, %u#1 : memref<f32>, memref<f32>
}

func.func @train_step_copy() -> (memref<f32>, memref<f32>) attributes {pipe.rank = 1 : i64} {
  %c = rt.param "qkvc" {decay = true, global_shape = array<i64: 8, 12>, init = "normal", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = -1 : i64, shard_axis = #dist.axis<tp>, shard_blocks = 1 : i64} : memref<8x12xf32>
  %f:1 = pipe.forward_pass chunk 0 -> memref<f32> {
    %h = rt.alloc : memref<2x8xbf16>
    rt.fill(%h) {n = 16 : i64, value = 1.0 : f64} : memref<2x8xbf16>
    %cw = rt.state_of %c <shadow> : memref<8x12xf32> -> memref<8x12xbf16>
    %q = rt.alloc : memref<8x4xbf16>
    rt.slice_axis(%cw, %q) {outer = 8 : i64, extent = 12 : i64, inner = 1 : i64, start = 0 : i64, length = 4 : i64} : memref<8x12xbf16>, memref<8x4xbf16>
    %cw2 = rt.state_of %c <shadow> : memref<8x12xf32> -> memref<8x12xbf16>
    %k = rt.alloc : memref<8x4xbf16>
    rt.slice_axis(%cw2, %k) {outer = 8 : i64, extent = 12 : i64, inner = 1 : i64, start = 4 : i64, length = 4 : i64} : memref<8x12xbf16>, memref<8x4xbf16>
    %y = rt.alloc : memref<2x4xbf16>
    rt.matmul(%h, %q, %y) {batch = 1 : i64, m = 2 : i64, n = 4 : i64, k = 8 : i64, trans_a = false, trans_b = false, stride_a = 16 : i64, stride_b = 0 : i64, stride_c = 8 : i64} : memref<2x8xbf16>, memref<8x4xbf16>, memref<2x4xbf16>
    rt.matmul(%h, %k, %y) {batch = 1 : i64, m = 2 : i64, n = 4 : i64, k = 8 : i64, trans_a = false, trans_b = false, stride_a = 16 : i64, stride_b = 0 : i64, stride_c = 8 : i64} : memref<2x8xbf16>, memref<8x4xbf16>, memref<2x4xbf16>
    %l = rt.alloc : memref<f32>
    rt.fill(%l) {n = 1 : i64, value = 0.5 : f64} : memref<f32>
    pipe.yield %l : memref<f32>
  }
  %g:1 = pipe.backward_pass chunk 0 -> memref<2x8xbf16> {
    %dy = rt.alloc : memref<2x4xbf16>
    rt.fill(%dy) {n = 8 : i64, value = 1.0 : f64} : memref<2x4xbf16>
    %cw3 = rt.state_of %c <shadow> : memref<8x12xf32> -> memref<8x12xbf16>
    %q2 = rt.alloc : memref<8x4xbf16>
    rt.slice_axis(%cw3, %q2) {outer = 8 : i64, extent = 12 : i64, inner = 1 : i64, start = 0 : i64, length = 4 : i64} : memref<8x12xbf16>, memref<8x4xbf16>
    %dx = rt.alloc : memref<2x8xbf16>
    rt.matmul(%dy, %q2, %dx) {batch = 1 : i64, m = 2 : i64, n = 8 : i64, k = 4 : i64, trans_a = false, trans_b = true, stride_a = 8 : i64, stride_b = 0 : i64, stride_c = 16 : i64} : memref<2x4xbf16>, memref<8x4xbf16>, memref<2x8xbf16>
    pipe.yield %dx : memref<2x8xbf16>
  }
  %u:2 = pipe.update(%f#0 : memref<f32>) -> memref<f32>, memref<f32> {
  ^bb0(%loss: memref<f32>):
    %n = rt.alloc : memref<f32>
    rt.fill(%n) {n = 1 : i64, value = 1.0 : f64} : memref<f32>
    pipe.yield %loss, %n : memref<f32>, memref<f32>
  }
  return %u#0, %u#1 : memref<f32>, memref<f32>
}
}
