// RUN: tessel-opt %s --tessel-overlap-collectives | FileCheck %s
// RUN: tessel-opt %s --tessel-overlap-collectives --tessel-plan-memory | FileCheck %s --check-prefix=PLAN

// A sequence-parallel linear layer's backward at tp = 2: the input
// gradient's GEMM (dX = dY W^T), the input re-gathered (X), the weight
// gradient's GEMM (dW = X^T dY) and the input gradient reduce-scattered
// back to the sequence pieces (dx).
//
// The re-gather starts before the input gradient's GEMM, taking its output
// and its blocks (2 x 64 elements) with it, and is waited for before the
// weight gradient's GEMM reads X. The reduce-scatter starts as soon as dX
// is written (before that wait: neither touches the other's buffers) and
// is waited for after the weight gradient's GEMM, before dx is read.
// CHECK-LABEL: pipe.backward_pass
// CHECK: %[[X:.*]] = rt.alloc : memref<2x8x8xf32>
// CHECK-NEXT: %[[XB:.*]] = rt.alloc : memref<128xf32>
// CHECK-NEXT: %[[AG:.*]] = rt.all_gather_start(%{{.*}}, %[[X]], %[[XB]]) {axes = #dist.axes<tp>, inner = 8 : i64, length = 4 : i64, outer = 2 : i64}
// CHECK-NEXT: %[[DX:.*]] = rt.alloc : memref<2x8x8xf32>
// CHECK-NEXT: rt.matmul(%{{.*}}, %{{.*}}, %[[DX]])
// CHECK-NEXT: %[[DXS:.*]] = rt.alloc : memref<2x4x8xf32>
// CHECK-NEXT: %[[DXB:.*]] = rt.alloc : memref<128xf32>
// CHECK-NEXT: %[[RS:.*]] = rt.reduce_scatter_start(%[[DX]], %[[DXS]], %[[DXB]])
// CHECK-NEXT: %[[DW:.*]] = rt.alloc : memref<8x4xf32>
// CHECK-NEXT: rt.wait %[[AG]]
// CHECK-NEXT: rt.matmul(%[[X]], %{{.*}}, %[[DW]])
// CHECK-NEXT: %[[Y:.*]] = rt.alloc
// CHECK-NEXT: rt.wait %[[RS]]
// CHECK-NEXT: rt.gelu_forward(%[[DXS]], %[[Y]])

// Without sequence parallelism the input gradient is all-reduced once the
// q and k products are summed, and that sum is read at once: nothing is
// between them to overlap. The weight gradient of k, which neither reads
// nor writes what the sum and the reduction touch, moves under it.
// CHECK: rt.matmul(%{{.*}}, %{{.*}}, %[[DQ:.*]]) {{.*}}k = 4
// CHECK-NEXT: rt.alloc
// CHECK-NEXT: rt.matmul({{.*}}) {{.*}}trans_a = true
// CHECK-NEXT: rt.alloc
// CHECK-NEXT: rt.matmul(%{{.*}}, %{{.*}}, %[[DK:.*]]) {{.*}}k = 4
// CHECK-NEXT: %[[WK:.*]] = rt.alloc : memref<8x4xf32>
// CHECK-NEXT: %[[SUM:.*]] = rt.alloc : memref<2x8x8xf32>
// CHECK-NEXT: rt.add_broadcast(%[[DQ]], %[[DK]], %[[SUM]])
// CHECK-NEXT: %[[AR:.*]] = rt.all_reduce_start(%[[SUM]]) {axes = #dist.axes<tp>}
// CHECK-NEXT: rt.matmul(%{{.*}}, %{{.*}}, %[[WK]]) {{.*}}trans_a = true
// CHECK-NEXT: rt.alloc
// CHECK-NEXT: rt.wait %[[AR]]
// CHECK-NEXT: rt.gelu_forward(%[[SUM]],

// A weight gradient's GEMM above the input gradient's, its result copied
// on (as a fused weight's gradient is assembled) before the reduction: the
// GEMM passes the input gradient's GEMM, which the reduction reads, and
// goes under the reduction with the copy that reads its result.
// CHECK: %[[WV:.*]] = rt.alloc : memref<8x4xf32>
// CHECK-NEXT: %[[DV:.*]] = rt.alloc : memref<2x8x8xf32>
// CHECK-NEXT: rt.matmul(%{{.*}}, %{{.*}}, %[[DV]]) {{.*}}trans_b = true
// CHECK-NEXT: %[[WVC:.*]] = rt.alloc : memref<8x4xf32>
// CHECK-NEXT: %[[AR2:.*]] = rt.all_reduce_start(%[[DV]]) {axes = #dist.axes<tp>}
// CHECK-NEXT: rt.matmul(%{{.*}}, %{{.*}}, %[[WV]]) {{.*}}trans_a = true
// CHECK-NEXT: rt.copy(%[[WV]], %[[WVC]])
// CHECK-NEXT: rt.alloc
// CHECK-NEXT: rt.wait %[[AR2]]
// CHECK-NEXT: rt.gelu_forward(%[[DV]],

// Data-parallel reductions are left to the gradient buckets, and a gather
// that another collective precedes and a GEMM reads at once stays blocking.
// CHECK: rt.all_reduce(%{{.*}}) {axes = #dist.axes<dp>}
// CHECK-NEXT: rt.alloc
// CHECK-NEXT: rt.all_gather(%{{.*}}, %{{.*}}) {axes = #dist.axes<tp>
// CHECK-NEXT: rt.alloc
// CHECK-NEXT: rt.matmul
// CHECK-NEXT: pipe.yield

// The plan gives each start a request slot and holds what is in flight
// until its wait: no buffer takes the place of the gather's blocks before
// the gather is waited for, nor that of the reduce-scatter's input or
// blocks before it is.
// PLAN-LABEL: pipe.backward_pass
// PLAN-NEXT: rt.buffer <arena> {{[0-9]+}} : memref<2x8x8xf32>
// PLAN-NEXT: rt.buffer <arena> [[XB:[0-9]+]] : memref<128xf32>
// PLAN: rt.all_gather_start({{.*}}slot = 0 : i64
// PLAN-NOT: <arena> [[XB]] :
// PLAN: rt.buffer <arena> [[DX:[0-9]+]] : memref<2x8x8xf32>
// PLAN-NOT: <arena> [[XB]] :
// PLAN: rt.buffer <arena> [[DXB:[0-9]+]] : memref<128xf32>
// PLAN-NEXT: rt.reduce_scatter_start({{.*}}slot = 1 : i64
// PLAN-NOT: <arena> [[XB]] :
// PLAN: rt.wait_requests {count = 1 : i64, first = 0 : i64}
// PLAN-NOT: <arena> [[DX]] :
// PLAN-NOT: <arena> [[DXB]] :
// PLAN: rt.wait_requests {count = 1 : i64, first = 1 : i64}
// PLAN: rt.all_reduce_start({{.*}}slot = 2 : i64
// PLAN-NEXT: rt.buffer
// PLAN-NEXT: rt.matmul
// PLAN-NEXT: rt.buffer
// PLAN-NEXT: rt.wait_requests {count = 1 : i64, first = 2 : i64}

module attributes {dist.mesh = #dist.mesh<dp = 2, tp = 2>} {
func.func @train_step() -> (memref<f32>, memref<f32>) attributes {pipe.rank = 0 : i64} {
  %w = rt.param "w" {decay = true, global_shape = array<i64: 8, 8>, init = "normal", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = 1 : i64, shard_axis = #dist.axis<tp>, shard_blocks = 1 : i64} : memref<8x4xf32>
  %f:3 = pipe.forward_pass chunk 0 -> memref<2x4x8xf32>, memref<2x8x4xf32>, memref<f32> {
    %x = rt.alloc : memref<2x4x8xf32>
    rt.fill(%x) {n = 64 : i64, value = 1.0 : f64} : memref<2x4x8xf32>
    %dy = rt.alloc : memref<2x8x4xf32>
    rt.fill(%dy) {n = 64 : i64, value = 1.0 : f64} : memref<2x8x4xf32>
    %l = rt.alloc : memref<f32>
    rt.fill(%l) {n = 1 : i64, value = 0.5 : f64} : memref<f32>
    pipe.yield %x, %dy, %l : memref<2x4x8xf32>, memref<2x8x4xf32>, memref<f32>
  }
  %g:6 = pipe.backward_pass chunk 0 -> memref<8x4xf32>, memref<8x4xf32>, memref<2x8x8xf32>, memref<8xf32>, memref<8x4xf32>, memref<2x8x8xf32> {
    // Sequence parallel.
    %dX = rt.alloc : memref<2x8x8xf32>
    rt.matmul(%f#1, %w, %dX) {batch = 2 : i64, m = 8 : i64, n = 8 : i64, k = 4 : i64, trans_a = false, trans_b = true, stride_a = 32 : i64, stride_b = 0 : i64, stride_c = 64 : i64} : memref<2x8x4xf32>, memref<8x4xf32>, memref<2x8x8xf32>
    %X = rt.alloc : memref<2x8x8xf32>
    rt.all_gather(%f#0, %X) {axes = #dist.axes<tp>, outer = 2 : i64, length = 4 : i64, inner = 8 : i64} : memref<2x4x8xf32>, memref<2x8x8xf32>
    %dW = rt.alloc : memref<8x4xf32>
    rt.matmul(%X, %f#1, %dW) {batch = 1 : i64, m = 8 : i64, n = 4 : i64, k = 16 : i64, trans_a = true, trans_b = false, stride_a = 128 : i64, stride_b = 64 : i64, stride_c = 32 : i64} : memref<2x8x8xf32>, memref<2x8x4xf32>, memref<8x4xf32>
    %dxs = rt.alloc : memref<2x4x8xf32>
    rt.reduce_scatter(%dX, %dxs) {axes = #dist.axes<tp>, outer = 2 : i64, length = 4 : i64, inner = 8 : i64} : memref<2x8x8xf32>, memref<2x4x8xf32>
    %y = rt.alloc : memref<2x4x8xf32>
    rt.gelu_forward(%dxs, %y) {n = 64 : i64} : memref<2x4x8xf32>, memref<2x4x8xf32>
    // Tensor parallel only: q and k.
    %dq = rt.alloc : memref<2x8x8xf32>
    rt.matmul(%f#1, %w, %dq) {batch = 2 : i64, m = 8 : i64, n = 8 : i64, k = 4 : i64, trans_a = false, trans_b = true, stride_a = 32 : i64, stride_b = 0 : i64, stride_c = 64 : i64} : memref<2x8x4xf32>, memref<8x4xf32>, memref<2x8x8xf32>
    %wq = rt.alloc : memref<8x4xf32>
    rt.matmul(%y, %f#1, %wq) {batch = 1 : i64, m = 8 : i64, n = 4 : i64, k = 8 : i64, trans_a = true, trans_b = false, stride_a = 64 : i64, stride_b = 64 : i64, stride_c = 32 : i64} : memref<2x4x8xf32>, memref<2x8x4xf32>, memref<8x4xf32>
    %dk = rt.alloc : memref<2x8x8xf32>
    rt.matmul(%f#1, %w, %dk) {batch = 2 : i64, m = 8 : i64, n = 8 : i64, k = 4 : i64, trans_a = false, trans_b = true, stride_a = 32 : i64, stride_b = 0 : i64, stride_c = 64 : i64} : memref<2x8x4xf32>, memref<8x4xf32>, memref<2x8x8xf32>
    %wk = rt.alloc : memref<8x4xf32>
    rt.matmul(%y, %f#1, %wk) {batch = 1 : i64, m = 8 : i64, n = 4 : i64, k = 8 : i64, trans_a = true, trans_b = false, stride_a = 64 : i64, stride_b = 64 : i64, stride_c = 32 : i64} : memref<2x4x8xf32>, memref<2x8x4xf32>, memref<8x4xf32>
    %sum = rt.alloc : memref<2x8x8xf32>
    rt.add_broadcast(%dq, %dk, %sum) {n = 128 : i64, nb = 128 : i64} : memref<2x8x8xf32>, memref<2x8x8xf32>, memref<2x8x8xf32>
    rt.all_reduce(%sum) {axes = #dist.axes<tp>} : memref<2x8x8xf32>
    %z = rt.alloc : memref<2x8x8xf32>
    rt.gelu_forward(%sum, %z) {n = 128 : i64} : memref<2x8x8xf32>, memref<2x8x8xf32>
    // A weight gradient assembled before the reduction.
    %wv = rt.alloc : memref<8x4xf32>
    rt.matmul(%y, %f#1, %wv) {batch = 1 : i64, m = 8 : i64, n = 4 : i64, k = 8 : i64, trans_a = true, trans_b = false, stride_a = 64 : i64, stride_b = 64 : i64, stride_c = 32 : i64} : memref<2x4x8xf32>, memref<2x8x4xf32>, memref<8x4xf32>
    %dv = rt.alloc : memref<2x8x8xf32>
    rt.matmul(%f#1, %w, %dv) {batch = 2 : i64, m = 8 : i64, n = 8 : i64, k = 4 : i64, trans_a = false, trans_b = true, stride_a = 32 : i64, stride_b = 0 : i64, stride_c = 64 : i64} : memref<2x8x4xf32>, memref<8x4xf32>, memref<2x8x8xf32>
    %wvc = rt.alloc : memref<8x4xf32>
    rt.copy(%wv, %wvc) {n = 32 : i64} : memref<8x4xf32>, memref<8x4xf32>
    rt.all_reduce(%dv) {axes = #dist.axes<tp>} : memref<2x8x8xf32>
    %z2 = rt.alloc : memref<2x8x8xf32>
    rt.gelu_forward(%dv, %z2) {n = 128 : i64} : memref<2x8x8xf32>, memref<2x8x8xf32>
    // A data-parallel reduction; after it, nothing to overlap.
    %gb = rt.alloc : memref<8xf32>
    rt.fill(%gb) {n = 8 : i64, value = 0.0 : f64} : memref<8xf32>
    rt.all_reduce(%gb) {axes = #dist.axes<dp>} : memref<8xf32>
    %Z = rt.alloc : memref<2x8x8xf32>
    rt.all_gather(%y, %Z) {axes = #dist.axes<tp>, outer = 2 : i64, length = 4 : i64, inner = 8 : i64} : memref<2x4x8xf32>, memref<2x8x8xf32>
    %wz = rt.alloc : memref<8x4xf32>
    rt.matmul(%Z, %f#1, %wz) {batch = 1 : i64, m = 8 : i64, n = 4 : i64, k = 16 : i64, trans_a = true, trans_b = false, stride_a = 128 : i64, stride_b = 64 : i64, stride_c = 32 : i64} : memref<2x8x8xf32>, memref<2x8x4xf32>, memref<8x4xf32>
    pipe.yield %dW, %wq, %z, %gb, %wvc, %z2 : memref<8x4xf32>, memref<8x4xf32>, memref<2x8x8xf32>, memref<8xf32>, memref<8x4xf32>, memref<2x8x8xf32>
  }
  %u:2 = pipe.update(%g#0, %f#2 : memref<8x4xf32>, memref<f32>) -> memref<f32>, memref<f32> {
  ^bb0(%dw: memref<8x4xf32>, %loss: memref<f32>):
    %n = rt.alloc : memref<f32>
    rt.fill(%n) {n = 1 : i64, value = 1.0 : f64} : memref<f32>
    pipe.yield %loss, %n : memref<f32>, memref<f32>
  }
  return %u#0, %u#1 : memref<f32>, memref<f32>
}
}
