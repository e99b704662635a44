// RUN: tessel-opt %s --tessel-fuse-kernels | FileCheck %s

// The CUDA fusions, on rt before the memory plan: each pair of kernels that
// run back to back becomes one kernel writing what both wrote, and the
// buffers only the first one wrote are gone.

module attributes {dist.mesh = #dist.mesh<>} {
// CHECK-LABEL: func.func @train_step()
// A matmul, its bias add and the GELU of the sum: one matmul_bias that
// writes the sum and the GELU (m = batch x rows = 8).
// CHECK: rt.matmul_bias(%[[X:.*]], %[[W:.*]], %[[B:.*]], %[[Y:.*]], %[[H:.*]]) {k = 8 : i64, m = 8 : i64, n = 16 : i64, trans_b = false}
// CHECK-NOT: rt.matmul(
// CHECK-NOT: rt.gelu_forward(%[[Y]], %[[H]])
// The residual add and the RMSNorm of its sum.
// CHECK: rt.add_rms_norm_forward(%[[H]], %[[Y]], %[[S:.*]], %{{.*}}, %[[N:.*]]) {cols = 16 : i64, eps = 1.000000e-05 : f64, rows = 8 : i64}
// The SiLU waits for the up projection and joins the product.
// CHECK-NOT: rt.silu_forward
// CHECK: rt.gelu_forward(%[[S]], %[[UP:.*]]) {n = 128 : i64}
// CHECK: rt.swiglu_forward(%[[N]], %[[UP]], %[[P:.*]], %{{.*}}) {n = 128 : i64}
// The norm's backward writes its input gradient plus the residual's.
// CHECK: rt.rms_norm_backward_add(%[[S]], %{{.*}}, %[[P]], %[[H]], %{{.*}}, %{{.*}}) {cols = 16 : i64, eps = 1.000000e-05 : f64, rows = 8 : i64}
// CHECK-NOT: rt.add_broadcast
// CHECK: return
  func.func @train_step() {
    %w = rt.param "w" {global_shape = array<i64: 8, 16>, init = "normal", mean = 0.0 : f64, std = 0.02 : f64, decay = true, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64} : memref<8x16xf32>
    %b = rt.param "b" {global_shape = array<i64: 16>, init = "zeros", mean = 0.0 : f64, std = 0.02 : f64, decay = false, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64} : memref<16xf32>
    %g = rt.param "g" {global_shape = array<i64: 16>, init = "ones", mean = 0.0 : f64, std = 0.02 : f64, decay = false, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64} : memref<16xf32>
    %x = rt.alloc : memref<2x4x8xf32>
    rt.fill(%x) {n = 64 : i64, value = 1.0 : f64} : memref<2x4x8xf32>
    %c = rt.alloc : memref<2x4x16xf32>
    rt.matmul(%x, %w, %c) {batch = 2 : i64, m = 4 : i64, n = 16 : i64, k = 8 : i64, trans_a = false, trans_b = false, stride_a = 32 : i64, stride_b = 0 : i64, stride_c = 64 : i64} : memref<2x4x8xf32>, memref<8x16xf32>, memref<2x4x16xf32>
    %y = rt.alloc : memref<2x4x16xf32>
    rt.add_broadcast(%c, %b, %y) {n = 128 : i64, nb = 16 : i64} : memref<2x4x16xf32>, memref<16xf32>, memref<2x4x16xf32>
    %h = rt.alloc : memref<2x4x16xf32>
    rt.gelu_forward(%y, %h) {n = 128 : i64} : memref<2x4x16xf32>, memref<2x4x16xf32>
    %s = rt.alloc : memref<2x4x16xf32>
    rt.add_broadcast(%h, %y, %s) {n = 128 : i64, nb = 128 : i64} : memref<2x4x16xf32>, memref<2x4x16xf32>, memref<2x4x16xf32>
    %n = rt.alloc : memref<2x4x16xf32>
    rt.rms_norm_forward(%s, %g, %n) {rows = 8 : i64, cols = 16 : i64, eps = 1.0e-5 : f64} : memref<2x4x16xf32>, memref<16xf32>, memref<2x4x16xf32>
    %gate = rt.alloc : memref<2x4x16xf32>
    rt.silu_forward(%n, %gate) {n = 128 : i64} : memref<2x4x16xf32>, memref<2x4x16xf32>
    %up = rt.alloc : memref<2x4x16xf32>
    rt.gelu_forward(%s, %up) {n = 128 : i64} : memref<2x4x16xf32>, memref<2x4x16xf32>
    %p = rt.alloc : memref<2x4x16xf32>
    rt.mul_broadcast(%gate, %up, %p) {n = 128 : i64, nb = 128 : i64} : memref<2x4x16xf32>, memref<2x4x16xf32>, memref<2x4x16xf32>
    %dx = rt.alloc : memref<2x4x16xf32>
    %dg = rt.alloc : memref<16xf32>
    rt.rms_norm_backward(%s, %g, %p, %dx, %dg) {rows = 8 : i64, cols = 16 : i64, eps = 1.0e-5 : f64} : memref<2x4x16xf32>, memref<16xf32>, memref<2x4x16xf32>, memref<2x4x16xf32>, memref<16xf32>
    %sum = rt.alloc : memref<2x4x16xf32>
    rt.add_broadcast(%h, %dx, %sum) {n = 128 : i64, nb = 128 : i64} : memref<2x4x16xf32>, memref<2x4x16xf32>, memref<2x4x16xf32>
    return
  }

// A matmul whose output buffer is written again later is not fused: the
// fused kernel would never write it.
// CHECK-LABEL: func.func @reused()
// CHECK: rt.matmul(
// CHECK: rt.add_broadcast(
  func.func @reused() {
    %w = rt.param "w" {global_shape = array<i64: 8, 16>, init = "normal", mean = 0.0 : f64, std = 0.02 : f64, decay = true, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64} : memref<8x16xf32>
    %b = rt.param "b" {global_shape = array<i64: 16>, init = "zeros", mean = 0.0 : f64, std = 0.02 : f64, decay = false, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64} : memref<16xf32>
    %x = rt.alloc : memref<2x4x8xf32>
    rt.fill(%x) {n = 64 : i64, value = 1.0 : f64} : memref<2x4x8xf32>
    %c = rt.alloc : memref<2x4x16xf32>
    rt.matmul(%x, %w, %c) {batch = 2 : i64, m = 4 : i64, n = 16 : i64, k = 8 : i64, trans_a = false, trans_b = false, stride_a = 32 : i64, stride_b = 0 : i64, stride_c = 64 : i64} : memref<2x4x8xf32>, memref<8x16xf32>, memref<2x4x16xf32>
    %y = rt.alloc : memref<2x4x16xf32>
    rt.add_broadcast(%c, %b, %y) {n = 128 : i64, nb = 16 : i64} : memref<2x4x16xf32>, memref<16xf32>, memref<2x4x16xf32>
    rt.gelu_forward(%y, %c) {n = 128 : i64} : memref<2x4x16xf32>, memref<2x4x16xf32>
    return
  }
}
