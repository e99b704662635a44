// RUN: tessel-opt %s --tessel-plan-memory | FileCheck %s --implicit-check-not=rt.alloc --implicit-check-not=rt.matmul
// RUN: tessel-opt %s --tessel-plan-memory=fuse-accumulation=false | FileCheck %s --check-prefix=UNFUSED

// Two microbatches. w's gradient is one GEMM's product, written whole and
// read by nothing else in the part: the GEMM sums it in w's slot of the
// gradient store itself (rt.matmul_accumulate: the product on the part's
// first run, added after), with no arena place. The bias's gradient, a
// column sum, is summed by rt.accumulate as before; so is a product that
// the part reads again (v's, which a column sum reads too).
// CHECK-LABEL: func.func @train_step()
// CHECK: pipe.backward_pass
// CHECK-NEXT: %[[FIRST:.*]] = rt.first_run : i1
// CHECK-NEXT: %[[G:.*]] = rt.buffer <grads> 0 : memref<8x8xf32>
// CHECK: rt.matmul_accumulate(%{{.*}}, %{{.*}}, %[[G]], %[[FIRST]]) {k = 2 : i64, m = 8 : i64, n = 8 : i64, trans_a = true, trans_b = false}
// CHECK-NEXT: %[[GB:.*]] = rt.buffer <arena> {{[0-9]+}} : memref<8xf32>
// CHECK: rt.reduce_sum_leading({{.*}}, %[[GB]])
// CHECK-NEXT: %[[GBS:.*]] = rt.buffer <grads> 64 : memref<8xf32>
// CHECK-NEXT: rt.accumulate(%[[GB]], %[[GBS]], %[[FIRST]]) {n = 8 : i64}
// CHECK: %[[GV:.*]] = rt.buffer <arena> {{[0-9]+}} : memref<8x8xf32>
// CHECK: rt.matmul(%{{.*}}, %{{.*}}, %[[GV]])
// CHECK: rt.reduce_sum_leading(%[[GV]]
// CHECK: rt.accumulate(%[[GV]], %{{.*}}, %[[FIRST]]) {n = 64 : i64}
// CHECK: pipe.update

// Without the fusion the product has its own place and is added there.
// UNFUSED-LABEL: func.func @train_step()
// UNFUSED: pipe.backward_pass
// UNFUSED: %[[GW:.*]] = rt.buffer <arena> {{[0-9]+}} : memref<8x8xf32>
// UNFUSED: rt.matmul(%{{.*}}, %{{.*}}, %[[GW]])
// UNFUSED-NEXT: %[[G:.*]] = rt.buffer <grads> 0 : memref<8x8xf32>
// UNFUSED-NEXT: rt.accumulate(%[[GW]], %[[G]], %{{.*}}) {n = 64 : i64}
// UNFUSED-NOT: rt.matmul_accumulate

module attributes {dist.mesh = #dist.mesh<dp = 1>, pipe.layout = #pipe.layout<microbatches = 2, schedule = "1f1b", virtual_stages = 1>} {
func.func @train_step() -> memref<f32> attributes {pipe.rank = 0 : i64} {
  %w = rt.param "w" {decay = true, global_shape = array<i64: 8, 8>, init = "normal", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64} : memref<8x8xf32>
  %b = rt.param "b" {decay = false, global_shape = array<i64: 8>, init = "zeros", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64} : memref<8xf32>
  %v = rt.param "v" {decay = true, global_shape = array<i64: 8, 8>, init = "normal", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64} : memref<8x8xf32>
  %f = pipe.forward_pass chunk 0 -> memref<2x8xf32> {
    %x = rt.alloc : memref<2x8xf32>
    rt.fill(%x) {n = 16 : i64, value = 1.0 : f64} : memref<2x8xf32>
    pipe.yield %x : memref<2x8xf32>
  }
  %g:3 = pipe.backward_pass chunk 0 -> memref<8x8xf32>, memref<8xf32>, memref<8x8xf32> {
    %gw = rt.alloc : memref<8x8xf32>
    rt.matmul(%f, %f, %gw) {batch = 1 : i64, m = 8 : i64, n = 8 : i64, k = 2 : i64, trans_a = true, trans_b = false, stride_a = 0 : i64, stride_b = 0 : i64, stride_c = 0 : i64} : memref<2x8xf32>, memref<2x8xf32>, memref<8x8xf32>
    %gb = rt.alloc : memref<8xf32>
    rt.reduce_sum_leading(%f, %gb) {rows = 2 : i64, cols = 8 : i64} : memref<2x8xf32>, memref<8xf32>
    %gv = rt.alloc : memref<8x8xf32>
    rt.matmul(%f, %f, %gv) {batch = 1 : i64, m = 8 : i64, n = 8 : i64, k = 2 : i64, trans_a = true, trans_b = false, stride_a = 0 : i64, stride_b = 0 : i64, stride_c = 0 : i64} : memref<2x8xf32>, memref<2x8xf32>, memref<8x8xf32>
    %s = rt.alloc : memref<8xf32>
    rt.reduce_sum_leading(%gv, %s) {rows = 8 : i64, cols = 8 : i64} : memref<8x8xf32>, memref<8xf32>
    pipe.yield %gw, %gb, %gv : memref<8x8xf32>, memref<8xf32>, memref<8x8xf32>
  }
  %u = pipe.update(%g#0, %g#1, %g#2 : memref<8x8xf32>, memref<8xf32>, memref<8x8xf32>) -> memref<f32> {
  ^bb0(%dw: memref<8x8xf32>, %db: memref<8xf32>, %dv: memref<8x8xf32>):
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
    %mv = rt.state_of %v <adam_m> : memref<8x8xf32> -> memref<8x8xf32>
    %vv = rt.state_of %v <adam_v> : memref<8x8xf32> -> memref<8x8xf32>
    rt.adamw(%v, %dv, %mv, %vv, %n, %lr, %t) {n = 64 : i64, beta1 = 0.9 : f32, beta2 = 0.95 : f32, eps = 1.0e-8 : f32, weight_decay = 0.1 : f32, max_grad_norm = 1.0 : f32} : memref<8x8xf32>, memref<8x8xf32>, memref<8x8xf32>, memref<8x8xf32>, memref<f32>, f32, i64
    pipe.yield %n : memref<f32>
  }
  return %u : memref<f32>
}
}
