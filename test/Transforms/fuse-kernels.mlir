// RUN: tessel-opt %s --tessel-fuse-kernels | FileCheck %s

// The kernel fusions, on rt before the memory plan: each pair of kernels that
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
// The SiLU waits for the up projection and joins the product; as nothing
// else reads the SiLU, the kernel writes the product alone.
// CHECK-NOT: rt.silu_forward
// CHECK: rt.gelu_forward(%[[S]], %[[UP:.*]]) {n = 128 : i64}
// CHECK: rt.swiglu_forward(%[[N]], %[[UP]], %[[P:.*]]) {n = 128 : i64}
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

// A GPT MLP's backward. The weight gradients' GEMMs sum the bias gradients
// (the column sums move to the products, past the input gradient that reads
// the same output gradient); the input gradient through GELU is one GEMM
// reading the pre-activation; the product added to another gradient takes
// it as its C.
// CHECK-LABEL: func.func @backward()
// CHECK-NOT: rt.reduce_sum_leading
// CHECK: rt.matmul_bias_grad(%[[H:.*]], %[[DY:.*]], %[[DW2:.*]], %[[DB2:.*]]) {col = 0 : i64, k = 8 : i64, ldc = 8 : i64, m = 16 : i64, n = 8 : i64}
// CHECK: rt.matmul_gelu_grad(%[[DY]], %[[W2:.*]], %[[PRE:.*]], %[[DH:.*]]) {k = 8 : i64, m = 8 : i64, n = 16 : i64, trans_b = true}
// CHECK: rt.matmul_bias_grad(%[[X:.*]], %[[DH]], %[[DW1:.*]], %[[DB1:.*]]) {col = 0 : i64, k = 8 : i64, ldc = 16 : i64, m = 8 : i64, n = 16 : i64}
// CHECK: rt.matmul_add(%[[DH]], %[[W1:.*]], %[[DY]], %[[DX:.*]]) {k = 16 : i64, m = 8 : i64, n = 8 : i64, trans_b = true}
// CHECK-NOT: rt.gelu_backward
// CHECK-NOT: rt.add_broadcast
// CHECK: return
  func.func @backward() {
    %w1 = rt.param "w1" {global_shape = array<i64: 8, 16>, init = "normal", mean = 0.0 : f64, std = 0.02 : f64, decay = true, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64} : memref<8x16xf32>
    %w2 = rt.param "w2" {global_shape = array<i64: 8, 16>, init = "normal", mean = 0.0 : f64, std = 0.02 : f64, decay = true, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64} : memref<8x16xf32>
    %x = rt.alloc : memref<2x4x8xf32>
    rt.fill(%x) {n = 64 : i64, value = 1.0 : f64} : memref<2x4x8xf32>
    %pre = rt.alloc : memref<2x4x16xf32>
    rt.fill(%pre) {n = 128 : i64, value = 0.5 : f64} : memref<2x4x16xf32>
    %h = rt.alloc : memref<2x4x16xf32>
    rt.fill(%h) {n = 128 : i64, value = 0.25 : f64} : memref<2x4x16xf32>
    %dy = rt.alloc : memref<2x4x8xf32>
    rt.fill(%dy) {n = 64 : i64, value = 1.0 : f64} : memref<2x4x8xf32>
    %db2 = rt.alloc : memref<8xf32>
    rt.reduce_sum_leading(%dy, %db2) {rows = 8 : i64, cols = 8 : i64} : memref<2x4x8xf32>, memref<8xf32>
    %dg = rt.alloc : memref<2x4x16xf32>
    rt.matmul(%dy, %w2, %dg) {batch = 2 : i64, m = 4 : i64, n = 16 : i64, k = 8 : i64, trans_a = false, trans_b = true, stride_a = 32 : i64, stride_b = 0 : i64, stride_c = 64 : i64} : memref<2x4x8xf32>, memref<8x16xf32>, memref<2x4x16xf32>
    %dw2 = rt.alloc : memref<16x8xf32>
    rt.matmul(%h, %dy, %dw2) {batch = 1 : i64, m = 16 : i64, n = 8 : i64, k = 8 : i64, trans_a = true, trans_b = false, stride_a = 128 : i64, stride_b = 64 : i64, stride_c = 128 : i64} : memref<2x4x16xf32>, memref<2x4x8xf32>, memref<16x8xf32>
    %dh = rt.alloc : memref<2x4x16xf32>
    rt.gelu_backward(%pre, %dg, %dh) {n = 128 : i64} : memref<2x4x16xf32>, memref<2x4x16xf32>, memref<2x4x16xf32>
    %db1 = rt.alloc : memref<16xf32>
    rt.reduce_sum_leading(%dh, %db1) {rows = 8 : i64, cols = 16 : i64} : memref<2x4x16xf32>, memref<16xf32>
    %dx1 = rt.alloc : memref<2x4x8xf32>
    rt.matmul(%dh, %w1, %dx1) {batch = 2 : i64, m = 4 : i64, n = 8 : i64, k = 16 : i64, trans_a = false, trans_b = true, stride_a = 64 : i64, stride_b = 0 : i64, stride_c = 32 : i64} : memref<2x4x16xf32>, memref<8x16xf32>, memref<2x4x8xf32>
    %dw1 = rt.alloc : memref<8x16xf32>
    rt.matmul(%x, %dh, %dw1) {batch = 1 : i64, m = 8 : i64, n = 16 : i64, k = 8 : i64, trans_a = true, trans_b = false, stride_a = 64 : i64, stride_b = 128 : i64, stride_c = 128 : i64} : memref<2x4x8xf32>, memref<2x4x16xf32>, memref<8x16xf32>
    %dx = rt.alloc : memref<2x4x8xf32>
    rt.add_broadcast(%dy, %dx1, %dx) {n = 64 : i64, nb = 64 : i64} : memref<2x4x8xf32>, memref<2x4x8xf32>, memref<2x4x8xf32>
    return
  }

// Nothing moves a column sum past a write of what it sums, nor a product
// past a write of what it reads.
// CHECK-LABEL: func.func @blocked()
// CHECK: rt.reduce_sum_leading
// CHECK: rt.matmul(
// CHECK: rt.fill(%[[P:.*]]) {n = 128
// CHECK: rt.gelu_backward(%[[P]],
// CHECK: rt.matmul(
  func.func @blocked() {
    %w2 = rt.param "w2" {global_shape = array<i64: 8, 16>, init = "normal", mean = 0.0 : f64, std = 0.02 : f64, decay = true, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64} : memref<8x16xf32>
    %dy = rt.alloc : memref<2x4x8xf32>
    rt.fill(%dy) {n = 64 : i64, value = 1.0 : f64} : memref<2x4x8xf32>
    %db2 = rt.alloc : memref<8xf32>
    rt.reduce_sum_leading(%dy, %db2) {rows = 8 : i64, cols = 8 : i64} : memref<2x4x8xf32>, memref<8xf32>
    %dg = rt.alloc : memref<2x4x16xf32>
    rt.matmul(%dy, %w2, %dg) {batch = 2 : i64, m = 4 : i64, n = 16 : i64, k = 8 : i64, trans_a = false, trans_b = true, stride_a = 32 : i64, stride_b = 0 : i64, stride_c = 64 : i64} : memref<2x4x8xf32>, memref<8x16xf32>, memref<2x4x16xf32>
    %pre = rt.alloc : memref<2x4x16xf32>
    rt.fill(%pre) {n = 128 : i64, value = 0.5 : f64} : memref<2x4x16xf32>
    %dh = rt.alloc : memref<2x4x16xf32>
    rt.gelu_backward(%pre, %dg, %dh) {n = 128 : i64} : memref<2x4x16xf32>, memref<2x4x16xf32>, memref<2x4x16xf32>
    rt.fill(%dy) {n = 64 : i64, value = 2.0 : f64} : memref<2x4x8xf32>
    %dw2 = rt.alloc : memref<16x8xf32>
    rt.matmul(%dh, %dy, %dw2) {batch = 1 : i64, m = 16 : i64, n = 8 : i64, k = 8 : i64, trans_a = true, trans_b = false, stride_a = 128 : i64, stride_b = 64 : i64, stride_c = 128 : i64} : memref<2x4x16xf32>, memref<2x4x8xf32>, memref<16x8xf32>
    return
  }

// A fused projection's q, k and v pieces (8 columns each of 24): each
// piece's GEMM writes its weight and bias gradients straight into its
// columns of the fused ones, which are allocated before the first GEMM; the
// copies are gone, and so are the pieces' buffers.
// CHECK-LABEL: func.func @fused_projection()
// CHECK: %[[FW:.*]] = rt.alloc : memref<8x24xf32>
// CHECK: %[[FB:.*]] = rt.alloc : memref<24xf32>
// CHECK: rt.matmul_bias_grad(%[[X:.*]], %[[DV:.*]], %[[FW]], %[[FB]]) {col = 16 : i64, k = 8 : i64, ldc = 24 : i64, m = 8 : i64, n = 8 : i64}
// CHECK: rt.matmul_bias_grad(%[[X]], %[[DK:.*]], %[[FW]], %[[FB]]) {col = 8 : i64, k = 8 : i64, ldc = 24 : i64, m = 8 : i64, n = 8 : i64}
// CHECK: rt.matmul_bias_grad(%[[X]], %[[DQ:.*]], %[[FW]], %[[FB]]) {col = 0 : i64, k = 8 : i64, ldc = 24 : i64, m = 8 : i64, n = 8 : i64}
// CHECK-NOT: rt.insert_axis
// CHECK-NOT: memref<8x8xf32>
// CHECK: return
  func.func @fused_projection() {
    %x = rt.alloc : memref<2x4x8xf32>
    rt.fill(%x) {n = 64 : i64, value = 1.0 : f64} : memref<2x4x8xf32>
    %dq = rt.alloc : memref<2x4x8xf32>
    rt.fill(%dq) {n = 64 : i64, value = 1.0 : f64} : memref<2x4x8xf32>
    %dk = rt.alloc : memref<2x4x8xf32>
    rt.fill(%dk) {n = 64 : i64, value = 2.0 : f64} : memref<2x4x8xf32>
    %dv = rt.alloc : memref<2x4x8xf32>
    rt.fill(%dv) {n = 64 : i64, value = 3.0 : f64} : memref<2x4x8xf32>
    %bv = rt.alloc : memref<8xf32>
    %wv = rt.alloc : memref<8x8xf32>
    rt.matmul_bias_grad(%x, %dv, %wv, %bv) {m = 8 : i64, n = 8 : i64, k = 8 : i64, ldc = 8 : i64, col = 0 : i64} : memref<2x4x8xf32>, memref<2x4x8xf32>, memref<8x8xf32>, memref<8xf32>
    %bk = rt.alloc : memref<8xf32>
    %wk = rt.alloc : memref<8x8xf32>
    rt.matmul_bias_grad(%x, %dk, %wk, %bk) {m = 8 : i64, n = 8 : i64, k = 8 : i64, ldc = 8 : i64, col = 0 : i64} : memref<2x4x8xf32>, memref<2x4x8xf32>, memref<8x8xf32>, memref<8xf32>
    %bq = rt.alloc : memref<8xf32>
    %wq = rt.alloc : memref<8x8xf32>
    rt.matmul_bias_grad(%x, %dq, %wq, %bq) {m = 8 : i64, n = 8 : i64, k = 8 : i64, ldc = 8 : i64, col = 0 : i64} : memref<2x4x8xf32>, memref<2x4x8xf32>, memref<8x8xf32>, memref<8xf32>
    %fb = rt.alloc : memref<24xf32>
    rt.insert_axis(%bq, %fb) {outer = 1 : i64, extent = 24 : i64, inner = 1 : i64, start = 0 : i64, length = 8 : i64} : memref<8xf32>, memref<24xf32>
    rt.insert_axis(%bk, %fb) {outer = 1 : i64, extent = 24 : i64, inner = 1 : i64, start = 8 : i64, length = 8 : i64} : memref<8xf32>, memref<24xf32>
    rt.insert_axis(%bv, %fb) {outer = 1 : i64, extent = 24 : i64, inner = 1 : i64, start = 16 : i64, length = 8 : i64} : memref<8xf32>, memref<24xf32>
    %fw = rt.alloc : memref<8x24xf32>
    rt.insert_axis(%wq, %fw) {outer = 8 : i64, extent = 24 : i64, inner = 1 : i64, start = 0 : i64, length = 8 : i64} : memref<8x8xf32>, memref<8x24xf32>
    rt.insert_axis(%wk, %fw) {outer = 8 : i64, extent = 24 : i64, inner = 1 : i64, start = 8 : i64, length = 8 : i64} : memref<8x8xf32>, memref<8x24xf32>
    rt.insert_axis(%wv, %fw) {outer = 8 : i64, extent = 24 : i64, inner = 1 : i64, start = 16 : i64, length = 8 : i64} : memref<8x8xf32>, memref<8x24xf32>
    rt.sum_squares(%fw, %fb) {n = 8 : i64} : memref<8x24xf32>, memref<24xf32>
    return
  }

// Nothing moves a piece's write up past an op that reads the fused
// gradient, or writes the same columns of it.
// CHECK-LABEL: func.func @projection_blocked()
// CHECK-COUNT-2: rt.insert_axis
// CHECK: return
  func.func @projection_blocked() {
    %x = rt.alloc : memref<2x4x8xf32>
    rt.fill(%x) {n = 64 : i64, value = 1.0 : f64} : memref<2x4x8xf32>
    %fb = rt.alloc : memref<16xf32>
    %fw = rt.alloc : memref<8x16xf32>
    rt.fill(%fw) {n = 128 : i64, value = 0.0 : f64} : memref<8x16xf32>
    %bq = rt.alloc : memref<8xf32>
    %wq = rt.alloc : memref<8x8xf32>
    rt.matmul_bias_grad(%x, %x, %wq, %bq) {m = 8 : i64, n = 8 : i64, k = 8 : i64, ldc = 8 : i64, col = 0 : i64} : memref<2x4x8xf32>, memref<2x4x8xf32>, memref<8x8xf32>, memref<8xf32>
    rt.sum_squares(%fw, %fb) {n = 8 : i64} : memref<8x16xf32>, memref<16xf32>
    rt.insert_axis(%bq, %fb) {outer = 1 : i64, extent = 16 : i64, inner = 1 : i64, start = 0 : i64, length = 8 : i64} : memref<8xf32>, memref<16xf32>
    rt.insert_axis(%wq, %fw) {outer = 8 : i64, extent = 16 : i64, inner = 1 : i64, start = 0 : i64, length = 8 : i64} : memref<8x8xf32>, memref<8x16xf32>
    return
  }

// SwiGLU's backward across the parts: one kernel computes the gate's and
// up's gradients from the gate, up and the output gradient, taking the SiLU
// again. The forward part no longer hands the SiLU on, and its fused forward
// writes the product alone.
// CHECK-LABEL: func.func @swiglu_parts()
// CHECK: %[[F:.*]]:3 = pipe.forward_pass chunk 0 -> memref<2x4x16xf32>, memref<2x4x16xf32>, memref<2x4x16xf32> {
// CHECK: rt.swiglu_forward(%[[G:.*]], %[[U:.*]], %[[O:.*]]) {n = 128 : i64}
// CHECK: pipe.yield %[[G]], %[[U]], %[[O]]
// CHECK: pipe.backward_pass
// CHECK: rt.swiglu_backward(%[[F]]#0, %[[F]]#1, %[[D:.*]], %[[DG:.*]], %[[DU:.*]]) {n = 128 : i64}
// CHECK-NOT: rt.mul_broadcast
// CHECK-NOT: rt.silu_backward
// CHECK: pipe.yield %[[DG]], %[[DU]]
  func.func @swiglu_parts() {
    %f:4 = pipe.forward_pass chunk 0 -> memref<2x4x16xf32>, memref<2x4x16xf32>, memref<2x4x16xf32>, memref<2x4x16xf32> {
      %gate = rt.alloc : memref<2x4x16xf32>
      rt.fill(%gate) {n = 128 : i64, value = 0.5 : f64} : memref<2x4x16xf32>
      %up = rt.alloc : memref<2x4x16xf32>
      rt.fill(%up) {n = 128 : i64, value = 2.0 : f64} : memref<2x4x16xf32>
      %s = rt.alloc : memref<2x4x16xf32>
      rt.silu_forward(%gate, %s) {n = 128 : i64} : memref<2x4x16xf32>, memref<2x4x16xf32>
      %o = rt.alloc : memref<2x4x16xf32>
      rt.mul_broadcast(%s, %up, %o) {n = 128 : i64, nb = 128 : i64} : memref<2x4x16xf32>, memref<2x4x16xf32>, memref<2x4x16xf32>
      pipe.yield %gate, %up, %s, %o : memref<2x4x16xf32>, memref<2x4x16xf32>, memref<2x4x16xf32>, memref<2x4x16xf32>
    }
    %b:3 = pipe.backward_pass chunk 0 -> memref<2x4x16xf32>, memref<2x4x16xf32>, memref<16xf32> {
      %d = rt.alloc : memref<2x4x16xf32>
      rt.fill(%d) {n = 128 : i64, value = 1.0 : f64} : memref<2x4x16xf32>
      %r = rt.alloc : memref<16xf32>
      rt.reduce_sum_leading(%f#3, %r) {rows = 8 : i64, cols = 16 : i64} : memref<2x4x16xf32>, memref<16xf32>
      %t = rt.alloc : memref<2x4x16xf32>
      rt.mul_broadcast(%d, %f#1, %t) {n = 128 : i64, nb = 128 : i64} : memref<2x4x16xf32>, memref<2x4x16xf32>, memref<2x4x16xf32>
      %du = rt.alloc : memref<2x4x16xf32>
      rt.mul_broadcast(%d, %f#2, %du) {n = 128 : i64, nb = 128 : i64} : memref<2x4x16xf32>, memref<2x4x16xf32>, memref<2x4x16xf32>
      %dg = rt.alloc : memref<2x4x16xf32>
      rt.silu_backward(%f#0, %t, %dg) {n = 128 : i64} : memref<2x4x16xf32>, memref<2x4x16xf32>, memref<2x4x16xf32>
      pipe.yield %dg, %du, %r : memref<2x4x16xf32>, memref<2x4x16xf32>, memref<16xf32>
    }
    return
  }

// Not when up changes between the products and the SiLU backward: each
// kernel keeps its place.
// CHECK-LABEL: func.func @swiglu_blocked()
// CHECK: rt.mul_broadcast
// CHECK: rt.mul_broadcast
// CHECK: rt.silu_backward
  func.func @swiglu_blocked() {
    %gate = rt.alloc : memref<2x4x16xf32>
    rt.fill(%gate) {n = 128 : i64, value = 0.5 : f64} : memref<2x4x16xf32>
    %up = rt.alloc : memref<2x4x16xf32>
    rt.fill(%up) {n = 128 : i64, value = 2.0 : f64} : memref<2x4x16xf32>
    %s = rt.alloc : memref<2x4x16xf32>
    rt.silu_forward(%gate, %s) {n = 128 : i64} : memref<2x4x16xf32>, memref<2x4x16xf32>
    %r = rt.alloc : memref<16xf32>
    rt.reduce_sum_leading(%s, %r) {rows = 8 : i64, cols = 16 : i64} : memref<2x4x16xf32>, memref<16xf32>
    %d = rt.alloc : memref<2x4x16xf32>
    rt.fill(%d) {n = 128 : i64, value = 1.0 : f64} : memref<2x4x16xf32>
    %t = rt.alloc : memref<2x4x16xf32>
    rt.mul_broadcast(%d, %up, %t) {n = 128 : i64, nb = 128 : i64} : memref<2x4x16xf32>, memref<2x4x16xf32>, memref<2x4x16xf32>
    %du = rt.alloc : memref<2x4x16xf32>
    rt.mul_broadcast(%d, %s, %du) {n = 128 : i64, nb = 128 : i64} : memref<2x4x16xf32>, memref<2x4x16xf32>, memref<2x4x16xf32>
    rt.fill(%up) {n = 128 : i64, value = 3.0 : f64} : memref<2x4x16xf32>
    %dg = rt.alloc : memref<2x4x16xf32>
    rt.silu_backward(%gate, %t, %dg) {n = 128 : i64} : memref<2x4x16xf32>, memref<2x4x16xf32>, memref<2x4x16xf32>
    rt.sum_squares(%dg, %du) {n = 8 : i64} : memref<2x4x16xf32>, memref<2x4x16xf32>
    return
  }
}
