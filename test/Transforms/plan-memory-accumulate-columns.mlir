// RUN: tessel-opt %s --tessel-plan-memory | FileCheck %s --implicit-check-not=rt.alloc --implicit-check-not=rt.matmul_bias_grad(

// Two microbatches. The fused weight's gradient [8, 16] is written by two
// GEMMs, each its block of 8 columns (the pieces of a fused projection,
// tessel-fuse-kernels): together they write it whole, so each sums its
// block in the weight's slot of the gradient store (beta = 1 after the
// part's first run), with no arena place and no add. Their bias gradients
// are written, not summed, by the epilogue: the fused bias's gradient is
// summed by rt.accumulate once both blocks are in.
// CHECK-LABEL: func.func @train_step()
// CHECK: pipe.backward_pass
// CHECK-NEXT: %[[FIRST:.*]] = rt.first_run : i1
// CHECK-NEXT: %[[GB:.*]] = rt.buffer <arena> {{[0-9]+}} : memref<16xf32>
// CHECK-NEXT: %[[G:.*]] = rt.buffer <grads> 0 : memref<8x16xf32>
// CHECK: rt.matmul_bias_grad_accumulate(%{{.*}}, %{{.*}}, %[[G]], %[[GB]], %[[FIRST]]) {col = 8 : i64, k = 2 : i64, ldc = 16 : i64, m = 8 : i64, n = 8 : i64}
// CHECK: rt.matmul_bias_grad_accumulate(%{{.*}}, %{{.*}}, %[[G]], %[[GB]], %[[FIRST]]) {col = 0 : i64, k = 2 : i64, ldc = 16 : i64, m = 8 : i64, n = 8 : i64}
// CHECK-NEXT: %[[GBS:.*]] = rt.buffer <grads> 128 : memref<16xf32>
// CHECK-NEXT: rt.accumulate(%[[GB]], %[[GBS]], %[[FIRST]]) {n = 16 : i64}
// CHECK: pipe.update

module attributes {dist.mesh = #dist.mesh<dp = 1>, pipe.layout = #pipe.layout<microbatches = 2, schedule = "1f1b", virtual_stages = 1>} {
func.func @train_step() -> memref<f32> attributes {pipe.rank = 0 : i64} {
  %w = rt.param "w" {decay = true, global_shape = array<i64: 8, 16>, init = "normal", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64} : memref<8x16xf32>
  %b = rt.param "b" {decay = false, global_shape = array<i64: 16>, init = "zeros", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64} : memref<16xf32>
  %f = pipe.forward_pass chunk 0 -> memref<2x8xf32> {
    %x = rt.alloc : memref<2x8xf32>
    rt.fill(%x) {n = 16 : i64, value = 1.0 : f64} : memref<2x8xf32>
    pipe.yield %x : memref<2x8xf32>
  }
  %g:2 = pipe.backward_pass chunk 0 -> memref<8x16xf32>, memref<16xf32> {
    %gb = rt.alloc : memref<16xf32>
    %gw = rt.alloc : memref<8x16xf32>
    rt.matmul_bias_grad(%f, %f, %gw, %gb) {m = 8 : i64, n = 8 : i64, k = 2 : i64, ldc = 16 : i64, col = 8 : i64} : memref<2x8xf32>, memref<2x8xf32>, memref<8x16xf32>, memref<16xf32>
    rt.matmul_bias_grad(%f, %f, %gw, %gb) {m = 8 : i64, n = 8 : i64, k = 2 : i64, ldc = 16 : i64, col = 0 : i64} : memref<2x8xf32>, memref<2x8xf32>, memref<8x16xf32>, memref<16xf32>
    pipe.yield %gw, %gb : memref<8x16xf32>, memref<16xf32>
  }
  %u = pipe.update(%g#0, %g#1 : memref<8x16xf32>, memref<16xf32>) -> memref<f32> {
  ^bb0(%dw: memref<8x16xf32>, %db: memref<16xf32>):
    %n = rt.alloc : memref<f32>
    rt.fill(%n) {n = 1 : i64, value = 1.0 : f64} : memref<f32>
    %lr = rt.learning_rate : f32
    %t = rt.update_count : i64
    %mw = rt.state_of %w <adam_m> : memref<8x16xf32> -> memref<8x16xf32>
    %vw = rt.state_of %w <adam_v> : memref<8x16xf32> -> memref<8x16xf32>
    rt.adamw(%w, %dw, %mw, %vw, %n, %lr, %t) {n = 128 : i64, beta1 = 0.9 : f32, beta2 = 0.95 : f32, eps = 1.0e-8 : f32, weight_decay = 0.1 : f32, max_grad_norm = 1.0 : f32} : memref<8x16xf32>, memref<8x16xf32>, memref<8x16xf32>, memref<8x16xf32>, memref<f32>, f32, i64
    %mb = rt.state_of %b <adam_m> : memref<16xf32> -> memref<16xf32>
    %vb = rt.state_of %b <adam_v> : memref<16xf32> -> memref<16xf32>
    rt.adamw(%b, %db, %mb, %vb, %n, %lr, %t) {n = 16 : i64, beta1 = 0.9 : f32, beta2 = 0.95 : f32, eps = 1.0e-8 : f32, weight_decay = 0.0 : f32, max_grad_norm = 1.0 : f32} : memref<16xf32>, memref<16xf32>, memref<16xf32>, memref<16xf32>, memref<f32>, f32, i64
    pipe.yield %n : memref<f32>
  }
  return %u : memref<f32>
}
}
