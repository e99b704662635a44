// RUN: tessel-opt %s --tessel-autodiff --split-input-file --verify-diagnostics | FileCheck %s

// A tied embedding: the table is used by the lookup and by the head, so its
// gradient is the sum of both contributions.
// CHECK-LABEL: func.func @train_step() -> (tensor<f32>, tensor<f32>)
func.func @forward() -> tensor<f32> attributes {graph.optimizer = {beta1 = 0.8 : f64, weight_decay = 0.5 : f64, grad_clip = 2.0 : f64}} {
  // CHECK: %[[W:.*]] = graph.param "w"
  // CHECK: %[[B:.*]] = graph.param "b"
  // CHECK: %[[E:.*]] = graph.param "wte"
  %w = graph.param "w" : tensor<16x8xf32>
  %b = graph.param "b" {init = "zeros"} : tensor<8xf32>
  %e = graph.param "wte" : tensor<32x16xf32>
  %ids = graph.input "tokens" : tensor<2x4xi32>
  %t = graph.input "targets" : tensor<2x4xi32>
  // CHECK: %[[X:.*]] = graph.embedding
  %x = graph.embedding %e, %ids : (tensor<32x16xf32>, tensor<2x4xi32>) -> tensor<2x4x16xf32>
  // CHECK: %[[Y:.*]] = graph.matmul %[[X]], %[[W]]
  %y = graph.matmul %x, %w : (tensor<2x4x16xf32>, tensor<16x8xf32>) -> tensor<2x4x8xf32>
  %z = graph.add %y, %b : (tensor<2x4x8xf32>, tensor<8xf32>) -> tensor<2x4x8xf32>
  %h = graph.matmul %z, %w {transpose_rhs = true} : (tensor<2x4x8xf32>, tensor<16x8xf32>) -> tensor<2x4x16xf32>
  // CHECK: %[[LOGITS:.*]] = graph.matmul %{{.*}}, %[[E]] {graph.phase = #graph.phase<forward>, transpose_rhs = true}
  %l = graph.matmul %h, %e {transpose_rhs = true} : (tensor<2x4x16xf32>, tensor<32x16xf32>) -> tensor<2x4x32xf32>
  // CHECK: %[[LOSS:.*]] = graph.cross_entropy
  %loss = graph.cross_entropy %l, %t : (tensor<2x4x32xf32>, tensor<2x4xi32>) -> tensor<f32>
  // The seed dL/dL = 1, then the backward in reverse order.
  // CHECK: %[[SEED:.*]] = graph.fill {graph.phase = #graph.phase<backward>, value = 1.000000e+00 : f64} : tensor<f32>
  // CHECK: %[[DL:.*]] = graph.cross_entropy_grad %[[LOGITS]], %{{.*}}, %[[SEED]]
  // dH = dL E (the head's rhs was transposed, so no transpose here)
  // CHECK: %[[DH:.*]] = graph.matmul %[[DL]], %[[E]] {graph.phase = #graph.phase<backward>} :
  // dE (head part) = dL^T H, summed over the batch as well
  // CHECK: %[[DE1:.*]] = graph.matmul %[[DL]], %{{.*}} {graph.phase = #graph.phase<backward>, sum_batch = true, transpose_lhs = true} : (tensor<2x4x32xf32>, tensor<2x4x16xf32>) -> tensor<32x16xf32>
  // The bias gradient sums over batch and sequence.
  // CHECK: %[[DB:.*]] = graph.reduce_sum {{.*}} : (tensor<2x4x8xf32>) -> tensor<8xf32>
  // CHECK: %[[DE2:.*]] = graph.embedding_grad
  // CHECK: %[[DE:.*]] = graph.add %[[DE1]], %[[DE2]]
  // CHECK: %[[NORM:.*]] = graph.global_norm %[[DW:.*]], %[[DB]], %[[DE]] {graph.phase = #graph.phase<update>}
  // Weight decay only on matrices; settings from graph.optimizer.
  // CHECK: graph.adamw %[[W]], %[[DW]], %[[NORM]] {beta1 = 8.000000e-01 : f64, {{.*}}graph.phase = #graph.phase<update>, max_grad_norm = 2.000000e+00 : f64, weight_decay = 5.000000e-01 : f64}
  // CHECK: graph.adamw %[[B]], %[[DB]], %[[NORM]] {{.*}}weight_decay = 0.000000e+00 : f64}
  // CHECK: graph.adamw %[[E]], %[[DE]], %[[NORM]] {{.*}}weight_decay = 5.000000e-01 : f64}
  // CHECK: return %[[LOSS]], %[[NORM]] : tensor<f32>, tensor<f32>
  return %loss : tensor<f32>
}

// -----

func.func @forward() -> tensor<f32> {
  %w = graph.param "w" : tensor<4x8xf32>
  // expected-error@+1 {{has no gradient rule but lies on the path to the loss}}
  %s = graph.reduce_sum %w : (tensor<4x8xf32>) -> tensor<8xf32>
  %t = graph.input "targets" : tensor<1x1xi32>
  %r = graph.reshape %s : (tensor<8xf32>) -> tensor<1x1x8xf32>
  %loss = graph.cross_entropy %r, %t : (tensor<1x1x8xf32>, tensor<1x1xi32>) -> tensor<f32>
  return %loss : tensor<f32>
}

// -----

// expected-error@+1 {{must return the loss as tensor<f32>}}
func.func @forward() -> tensor<2xf32> {
  %w = graph.param "w" : tensor<2xf32>
  return %w : tensor<2xf32>
}

// -----

// Two parameters with one name would be one tensor in checkpoints and in
// the runtime's tables: refused at the second.
func.func @forward() -> tensor<f32> {
  %w = graph.param "w" : tensor<1x8xf32>
  // expected-error@+1 {{declares parameter 'w' a second time; parameter names must be unique}}
  %v = graph.param "w" : tensor<1x8xf32>
  %s = graph.add %w, %v : (tensor<1x8xf32>, tensor<1x8xf32>) -> tensor<1x8xf32>
  %t = graph.input "targets" : tensor<1x1xi32>
  %r = graph.reshape %s : (tensor<1x8xf32>) -> tensor<1x1x8xf32>
  %loss = graph.cross_entropy %r, %t : (tensor<1x1x8xf32>, tensor<1x1xi32>) -> tensor<f32>
  return %loss : tensor<f32>
}
