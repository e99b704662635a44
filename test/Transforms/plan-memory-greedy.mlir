// RUN: tessel-opt %s --tessel-plan-memory | FileCheck %s --implicit-check-not=rt.alloc

// First fit in allocation order puts a (256 bytes) at 0 and b (128) at
// 256; a is dead once copied, but c (320) does not fit its place, and the
// free block does not end at the top (b is there), so c would go to 384:
// 704 bytes. Placed greedy by size instead (largest first, each at the
// lowest offset clear of those whose lifetimes overlap its own), c takes
// 0, a (never live beside c) 0 too, and b, live beside both, 320: 448
// bytes, which the plan keeps.
// CHECK-LABEL: func.func @train_step()
// CHECK-SAME: rt.arena_bytes = 448 : i64
// CHECK: %[[A:.*]] = rt.buffer <arena> 0 : memref<64xf32>
// CHECK: %[[B:.*]] = rt.buffer <arena> 320 : memref<32xf32>
// CHECK: rt.copy(%[[A]], %[[B]])
// CHECK: %[[C:.*]] = rt.buffer <arena> 0 : memref<80xf32>
// CHECK: rt.copy(%[[B]], %[[C]])

module attributes {dist.mesh = #dist.mesh<dp = 1>} {
func.func @train_step() -> memref<f32> attributes {pipe.rank = 0 : i64} {
  %f = pipe.forward_pass chunk 0 -> memref<f32> {
    %a = rt.alloc : memref<64xf32>
    rt.fill(%a) {n = 64 : i64, value = 1.0 : f64} : memref<64xf32>
    %b = rt.alloc : memref<32xf32>
    rt.copy(%a, %b) {n = 32 : i64} : memref<64xf32>, memref<32xf32>
    %c = rt.alloc : memref<80xf32>
    rt.fill(%c) {n = 80 : i64, value = 2.0 : f64} : memref<80xf32>
    rt.copy(%b, %c) {n = 32 : i64} : memref<32xf32>, memref<80xf32>
    %l = rt.alloc : memref<f32>
    rt.copy(%c, %l) {n = 1 : i64} : memref<80xf32>, memref<f32>
    pipe.yield %l : memref<f32>
  }
  return %f : memref<f32>
}
}
