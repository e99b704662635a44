// RUN: tessel-opt %s --tessel-join-updates | FileCheck %s

// The update's calls on adjacent runs of the stores join: the sums of
// squares into one partial sum become one call; AdamW one call per run of
// parameters with equal hyperparameters. A gap in the store, another
// partial sum or another weight decay starts a new call.

module attributes {dist.mesh = #dist.mesh<>} {
// CHECK-LABEL: func.func @update()
// CHECK: %[[X:.*]] = rt.buffer <grads> 0 : memref<96xf32>
// CHECK: rt.sum_squares(%[[X]], %[[S0:.*]]) {n = 96 : i64}
// CHECK: rt.sum_squares(%{{.*}}, %{{.*}}) {n = 8 : i64}
// CHECK: rt.sum_squares(%{{.*}}, %{{.*}}) {n = 16 : i64}
// CHECK-NOT: rt.sum_squares
// CHECK: %[[P:.*]] = rt.buffer <params> 0 : memref<96xf32>
// CHECK: %[[G:.*]] = rt.buffer <grads> 0 : memref<96xf32>
// CHECK: %[[M:.*]] = rt.buffer <adam_m> 0 : memref<96xf32>
// CHECK: %[[V:.*]] = rt.buffer <adam_v> 0 : memref<96xf32>
// CHECK: rt.adamw(%[[P]], %[[G]], %[[M]], %[[V]], {{.*}}) {{{.*}}n = 96 : i64, weight_decay = 1.000000e-01 : f32}
// CHECK: rt.adamw({{.*}}) {{{.*}}n = 8 : i64, weight_decay = 0.000000e+00 : f32}
// CHECK: rt.adamw({{.*}}) {{{.*}}n = 16 : i64, weight_decay = 1.000000e-01 : f32}
// CHECK-NOT: rt.adamw
// CHECK: return
  func.func @update() {
    %s0 = rt.buffer <norm_sums> 0 : memref<1xf64>
    %s1 = rt.buffer <norm_sums> 1 : memref<1xf64>
    %g0 = rt.buffer <grads> 0 : memref<64xf32>
    rt.sum_squares(%g0, %s0) {n = 64 : i64} : memref<64xf32>, memref<1xf64>
    %g1 = rt.buffer <grads> 64 : memref<32xf32>
    rt.sum_squares(%g1, %s0) {n = 32 : i64} : memref<32xf32>, memref<1xf64>
    %g2 = rt.buffer <grads> 96 : memref<8xf32>
    rt.sum_squares(%g2, %s1) {n = 8 : i64} : memref<8xf32>, memref<1xf64>
    %g3 = rt.buffer <grads> 112 : memref<16xf32>
    rt.sum_squares(%g3, %s1) {n = 16 : i64} : memref<16xf32>, memref<1xf64>
    %norm = rt.buffer <arena> 0 : memref<f32>
    rt.sqrt_sum(%s0, %norm) {parts = 2 : i64} : memref<1xf64>, memref<f32>

    %p0 = rt.buffer <params> 0 : memref<8x8xf32>
    %q0 = rt.buffer <grads> 0 : memref<8x8xf32>
    %m0 = rt.buffer <adam_m> 0 : memref<8x8xf32>
    %v0 = rt.buffer <adam_v> 0 : memref<8x8xf32>
    %lr0 = rt.learning_rate : f32
    %c0 = rt.update_count : i64
    rt.adamw(%p0, %q0, %m0, %v0, %norm, %lr0, %c0) {beta1 = 0.9 : f32, beta2 = 0.95 : f32, eps = 1.0e-8 : f32, max_grad_norm = 1.0 : f32, n = 64 : i64, weight_decay = 0.1 : f32} : memref<8x8xf32>, memref<8x8xf32>, memref<8x8xf32>, memref<8x8xf32>, memref<f32>, f32, i64
    %p1 = rt.buffer <params> 64 : memref<32xf32>
    %q1 = rt.buffer <grads> 64 : memref<32xf32>
    %m1 = rt.buffer <adam_m> 64 : memref<32xf32>
    %v1 = rt.buffer <adam_v> 64 : memref<32xf32>
    %lr1 = rt.learning_rate : f32
    %c1 = rt.update_count : i64
    rt.adamw(%p1, %q1, %m1, %v1, %norm, %lr1, %c1) {beta1 = 0.9 : f32, beta2 = 0.95 : f32, eps = 1.0e-8 : f32, max_grad_norm = 1.0 : f32, n = 32 : i64, weight_decay = 0.1 : f32} : memref<32xf32>, memref<32xf32>, memref<32xf32>, memref<32xf32>, memref<f32>, f32, i64
    %p2 = rt.buffer <params> 96 : memref<8xf32>
    %q2 = rt.buffer <grads> 96 : memref<8xf32>
    %m2 = rt.buffer <adam_m> 96 : memref<8xf32>
    %v2 = rt.buffer <adam_v> 96 : memref<8xf32>
    %lr2 = rt.learning_rate : f32
    %c2 = rt.update_count : i64
    rt.adamw(%p2, %q2, %m2, %v2, %norm, %lr2, %c2) {beta1 = 0.9 : f32, beta2 = 0.95 : f32, eps = 1.0e-8 : f32, max_grad_norm = 1.0 : f32, n = 8 : i64, weight_decay = 0.0 : f32} : memref<8xf32>, memref<8xf32>, memref<8xf32>, memref<8xf32>, memref<f32>, f32, i64
    %p3 = rt.buffer <params> 112 : memref<16xf32>
    %q3 = rt.buffer <grads> 112 : memref<16xf32>
    %m3 = rt.buffer <adam_m> 112 : memref<16xf32>
    %v3 = rt.buffer <adam_v> 112 : memref<16xf32>
    %lr3 = rt.learning_rate : f32
    %c3 = rt.update_count : i64
    rt.adamw(%p3, %q3, %m3, %v3, %norm, %lr3, %c3) {beta1 = 0.9 : f32, beta2 = 0.95 : f32, eps = 1.0e-8 : f32, max_grad_norm = 1.0 : f32, n = 16 : i64, weight_decay = 0.1 : f32} : memref<16xf32>, memref<16xf32>, memref<16xf32>, memref<16xf32>, memref<f32>, f32, i64
    return
  }
}
