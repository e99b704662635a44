// RUN: tessel-opt %s --tessel-lower-precision | FileCheck %s

// Mixed precision as element types: working buffers become bf16, except a
// parameter's gradient and every term summed into it, what the norm reads,
// and one-element values; matmuls read the weight's bf16 shadow, which
// AdamW refreshes; master weights and moments stay fp32.

module attributes {dist.mesh = #dist.mesh<>} {
// CHECK-LABEL: func.func @train_step()
func.func @train_step() {
  // CHECK: %[[W:.*]] = rt.param "w" {{.*}} : memref<8x16xf32>
  %w = rt.param "w" {global_shape = array<i64: 8, 16>, init = "normal", mean = 0.0 : f64, std = 0.02 : f64, decay = true, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64} : memref<8x16xf32>
  // CHECK: %[[X:.*]] = rt.alloc : memref<4x8xbf16>
  %x = rt.alloc : memref<4x8xf32>
  rt.fill(%x) {n = 32 : i64, value = 1.0 : f64} : memref<4x8xf32>
  // CHECK: %[[Y:.*]] = rt.alloc : memref<4x16xbf16>
  %y = rt.alloc : memref<4x16xf32>
  // CHECK: %[[WS:.*]] = rt.state_of %[[W]] <shadow> : memref<8x16xf32> -> memref<8x16xbf16>
  // CHECK-NEXT: rt.matmul(%[[X]], %[[WS]], %[[Y]])
  rt.matmul(%x, %w, %y) {batch = 1 : i64, m = 4 : i64, n = 16 : i64, k = 8 : i64, trans_a = false, trans_b = false, stride_a = 32 : i64, stride_b = 0 : i64, stride_c = 64 : i64} : memref<4x8xf32>, memref<8x16xf32>, memref<4x16xf32>
  // A slice of a parameter for a GEMM (GPT-2's q of its q|k|v weight) is
  // cut from the bf16 copy: the fp32 master weights are read by their
  // update alone.
  // CHECK: %[[Q:.*]] = rt.alloc : memref<8x4xbf16>
  // CHECK-NEXT: %[[WQ:.*]] = rt.state_of %[[W]] <shadow> : memref<8x16xf32> -> memref<8x16xbf16>
  // CHECK-NEXT: rt.slice_axis(%[[WQ]], %[[Q]])
  %q = rt.alloc : memref<8x4xf32>
  rt.slice_axis(%w, %q) {outer = 8 : i64, extent = 16 : i64, inner = 1 : i64, start = 0 : i64, length = 4 : i64} : memref<8x16xf32>, memref<8x4xf32>
  %yq = rt.alloc : memref<4x4xf32>
  rt.matmul(%x, %q, %yq) {batch = 1 : i64, m = 4 : i64, n = 4 : i64, k = 8 : i64, trans_a = false, trans_b = false, stride_a = 32 : i64, stride_b = 0 : i64, stride_c = 16 : i64} : memref<4x8xf32>, memref<8x4xf32>, memref<4x4xf32>
  // The loss: one element, fp32.
  // CHECK: rt.alloc : memref<f32>
  %loss = rt.alloc : memref<f32>
  rt.fill(%loss) {n = 1 : i64, value = 0.0 : f64} : memref<f32>
  // The weight gradient is the sum of two contributions: both fp32.
  // CHECK: %[[G1:.*]] = rt.alloc : memref<8x16xf32>
  // CHECK: %[[G2:.*]] = rt.alloc : memref<8x16xf32>
  // CHECK: %[[G:.*]] = rt.alloc : memref<8x16xf32>
  %g1 = rt.alloc : memref<8x16xf32>
  rt.matmul(%x, %y, %g1) {batch = 1 : i64, m = 8 : i64, n = 16 : i64, k = 4 : i64, trans_a = true, trans_b = false, stride_a = 32 : i64, stride_b = 0 : i64, stride_c = 128 : i64} : memref<4x8xf32>, memref<4x16xf32>, memref<8x16xf32>
  %g2 = rt.alloc : memref<8x16xf32>
  rt.fill(%g2) {n = 128 : i64, value = 0.0 : f64} : memref<8x16xf32>
  %g = rt.alloc : memref<8x16xf32>
  rt.add_broadcast(%g1, %g2, %g) {n = 128 : i64, nb = 128 : i64} : memref<8x16xf32>, memref<8x16xf32>, memref<8x16xf32>
  %sums = rt.alloc : memref<1xf64>
  rt.zero_sums(%sums) {n = 1 : i64} : memref<1xf64>
  rt.sum_squares(%g, %sums) {n = 128 : i64} : memref<8x16xf32>, memref<1xf64>
  %norm = rt.alloc : memref<f32>
  rt.sqrt_sum(%sums, %norm) {parts = 1 : i64} : memref<1xf64>, memref<f32>
  // CHECK: %[[M:.*]] = rt.state_of %[[W]] <adam_m> : memref<8x16xf32> -> memref<8x16xf32>
  %m = rt.state_of %w <adam_m> : memref<8x16xf32> -> memref<8x16xf32>
  %v = rt.state_of %w <adam_v> : memref<8x16xf32> -> memref<8x16xf32>
  %lr = rt.learning_rate : f32
  %t = rt.update_count : i64
  // CHECK: %[[SHADOW:.*]] = rt.state_of %[[W]] <shadow> : memref<8x16xf32> -> memref<8x16xbf16>
  // CHECK-NEXT: rt.adamw(%[[W]], %[[SHADOW]], %[[G]], %[[M]]
  rt.adamw(%w, %g, %m, %v, %norm, %lr, %t) {n = 128 : i64, beta1 = 0.9 : f32, beta2 = 0.95 : f32, eps = 1.0e-8 : f32, weight_decay = 0.1 : f32, max_grad_norm = 1.0 : f32} : memref<8x16xf32>, memref<8x16xf32>, memref<8x16xf32>, memref<8x16xf32>, memref<f32>, f32, i64
  rt.finish_step(%loss, %norm) : memref<f32>, memref<f32>
  return
}
}
