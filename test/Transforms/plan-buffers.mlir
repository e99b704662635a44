// RUN: tessel-opt %s --tessel-autodiff --tessel-plan-buffers | FileCheck %s

// Parameters are packed in the parameter store in order; activations share
// one arena and a buffer is reused once its value is dead; a reshape aliases
// its input; a parameter's final gradient lands in the gradient store at the
// parameter's own offset.

// CHECK: module attributes {tessel.arena_bytes = [[ARENA:[0-9]+]] : i64, tessel.param_elems = 640 : i64}
// CHECK-LABEL: func.func @train_step
func.func @forward() -> tensor<f32> {
  // CHECK: graph.param "w" {{{.*}}tessel.buffer = array<i64: 1, 0>}
  // CHECK: graph.param "wte" {{{.*}}tessel.buffer = array<i64: 1, 128>}
  // CHECK: graph.input "tokens" {{{.*}}tessel.buffer = array<i64: 3, 0>}
  // CHECK: graph.input "targets" {{{.*}}tessel.buffer = array<i64: 3, 1>}
  %w = graph.param "w" : tensor<16x8xf32>
  %e = graph.param "wte" : tensor<32x16xf32>
  %ids = graph.input "tokens" : tensor<2x4xi32>
  %t = graph.input "targets" : tensor<2x4xi32>
  // 2x4x16 floats = 512 bytes at the start of the arena.
  // CHECK: graph.embedding {{.*}}tessel.buffer = array<i64: 0, 0>
  %x = graph.embedding %e, %ids : (tensor<32x16xf32>, tensor<2x4xi32>) -> tensor<2x4x16xf32>
  // CHECK: graph.gelu {{.*}}tessel.buffer = array<i64: 0, 512>
  %g = graph.gelu %x : (tensor<2x4x16xf32>) -> tensor<2x4x16xf32>
  // CHECK: graph.reshape {{.*}}tessel.buffer = array<i64: 0, 512>
  %r = graph.reshape %g : (tensor<2x4x16xf32>) -> tensor<8x16xf32>
  // CHECK: graph.matmul {{.*}}tessel.buffer = array<i64: 0, [[Y:[0-9]+]]>
  %y = graph.matmul %r, %w : (tensor<8x16xf32>, tensor<16x8xf32>) -> tensor<8x8xf32>
  %y3 = graph.reshape %y : (tensor<8x8xf32>) -> tensor<2x4x8xf32>
  %h = graph.matmul %y3, %w {transpose_rhs = true} : (tensor<2x4x8xf32>, tensor<16x8xf32>) -> tensor<2x4x16xf32>
  %l = graph.matmul %h, %e {transpose_rhs = true} : (tensor<2x4x16xf32>, tensor<32x16xf32>) -> tensor<2x4x32xf32>
  %loss = graph.cross_entropy %l, %t : (tensor<2x4x32xf32>, tensor<2x4xi32>) -> tensor<f32>
  // The final gradients of w (two uses, summed) and wte go to the gradient store.
  // CHECK: graph.add {{.*}}tessel.buffer = array<i64: 2, 0>} : (tensor<16x8xf32>, tensor<16x8xf32>)
  // CHECK: graph.add {{.*}}tessel.buffer = array<i64: 2, 128>} : (tensor<32x16xf32>, tensor<32x16xf32>)
  // CHECK: graph.global_norm
  return %loss : tensor<f32>
}
