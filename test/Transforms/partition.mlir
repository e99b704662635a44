// RUN: tessel-opt %S/Inputs/dp-forward.mlir --tessel-autodiff --tessel-propagate-sharding --tessel-partition | FileCheck %s

// Each rank holds half of the batch; reshards become all-reduces; the
// cross-entropy's local mean is scaled by 1/2 so that the sum over ranks is
// the global mean, and its gradient likewise.

// CHECK-LABEL: func.func @train_step
// CHECK: graph.input "tokens" {{.*}} : tensor<2x6xi32>
// CHECK: graph.embedding {{.*}} -> tensor<2x6x16xf32>
// CHECK: %[[LOSS:.*]] = graph.cross_entropy {{.*}} -> tensor<f32>
// CHECK: %[[HALF:.*]] = graph.fill {{.*}}value = 5.000000e-01 : f64} : tensor<f32>
// CHECK: %[[SCALED:.*]] = graph.mul %[[LOSS]], %[[HALF]]
// CHECK: %[[SEED:.*]] = graph.fill {{.*}}value = 1.000000e+00
// CHECK: %[[DLOSS:.*]] = graph.mul %[[SEED]], %{{.*}}
// CHECK: graph.cross_entropy_grad %{{.*}}, %{{.*}}, %[[DLOSS]]
// The weight gradient contracts the local tokens only.
// CHECK: graph.matmul {{.*}}sum_batch = true, transpose_lhs = true} : (tensor<2x6x32xf32>, tensor<2x6x16xf32>) -> tensor<32x16xf32>
// CHECK: %[[GW:.*]] = dist.all_reduce %{{.*}} {axes = #dist.axes<dp>{{.*}} : (tensor<16x8xf32>) -> tensor<16x8xf32>
// CHECK: %[[GB:.*]] = dist.all_reduce %{{.*}} {axes = #dist.axes<dp>{{.*}} : (tensor<8xf32>) -> tensor<8xf32>
// CHECK: %[[GE:.*]] = dist.all_reduce %{{.*}} {axes = #dist.axes<dp>{{.*}} : (tensor<32x16xf32>) -> tensor<32x16xf32>
// CHECK: graph.global_norm %[[GW]], %[[GB]], %[[GE]] {{.*}}reduce_axes = [#dist.axes<>, #dist.axes<>, #dist.axes<>]
// CHECK: %[[L:.*]] = dist.all_reduce %[[SCALED]] {axes = #dist.axes<dp>
// CHECK: return %[[L]]

