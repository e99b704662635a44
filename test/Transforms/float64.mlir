// RUN: tessel-opt %s --tessel-float64 | FileCheck %s
// RUN: tessel-opt %s --tessel-float64 --tessel-autodiff | FileCheck %s --check-prefix=TRAIN

// Gradient checks compute in float64: every f32 tensor of the graph, the
// function's signature included, becomes f64; token ids stay i32.
// CHECK-LABEL: func.func @forward() -> tensor<f64>
// CHECK: graph.input "tokens" : tensor<2x3xi32>
// CHECK: graph.param "wte" : tensor<11x6xf64>
// CHECK: graph.embedding {{.*}} -> tensor<2x3x6xf64>
// CHECK: graph.matmul {{.*}} -> tensor<2x3x11xf64>
// CHECK: graph.cross_entropy {{.*}} -> tensor<f64>
// CHECK: return {{.*}} : tensor<f64>

// Autodiff builds the float64 step on it: the loss, the gradients and the
// norm are f64 too.
// TRAIN-LABEL: func.func @train_step() -> (tensor<f64>, tensor<f64>)
// TRAIN: graph.cross_entropy_grad {{.*}} -> tensor<2x3x11xf64>
// TRAIN: graph.global_norm {{.*}} -> tensor<f64>
func.func @forward() -> tensor<f32> {
  %ids = graph.input "tokens" : tensor<2x3xi32>
  %targets = graph.input "targets" : tensor<2x3xi32>
  %wte = graph.param "wte" : tensor<11x6xf32>
  %x = graph.embedding %wte, %ids : (tensor<11x6xf32>, tensor<2x3xi32>) -> tensor<2x3x6xf32>
  %logits = graph.matmul %x, %wte {transpose_rhs = true} : (tensor<2x3x6xf32>, tensor<11x6xf32>) -> tensor<2x3x11xf32>
  %loss = graph.cross_entropy %logits, %targets : (tensor<2x3x11xf32>, tensor<2x3xi32>) -> tensor<f32>
  return %loss : tensor<f32>
}
