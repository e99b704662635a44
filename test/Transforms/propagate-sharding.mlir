// RUN: tessel-opt %S/Inputs/dp-forward.mlir --tessel-autodiff --tessel-propagate-sharding | FileCheck %s

// Data parallelism falls out of the rules: tokens are split along the batch,
// everything computed from them follows, contractions over the batch (weight
// gradients, bias gradients, the embedding scatter) are partial sums over
// dp, and the update needs them whole: one reshard per gradient, reduced as
// late as possible (the tied embedding's two contributions are added while
// still partial and reduced once).

// CHECK-LABEL: func.func @train_step
// CHECK: graph.param "w" {dist.sharding = [#dist.sharding<{{\[\[\], \[\]\]}}, partial = []>]
// CHECK: graph.input "tokens" {dist.sharding = [#dist.sharding<{{\[\[dp\], \[\]\]}}, partial = []>]
// CHECK: graph.embedding {{.*}}dist.sharding = [#dist.sharding<{{\[\[dp\], \[\], \[\]\]}}, partial = []>]
// CHECK: %[[LOSS:.*]] = graph.cross_entropy {{.*}}dist.sharding = [#dist.sharding<[], partial = [dp]>]
// CHECK: graph.matmul {{.*}}partial = [dp]>], {{.*}}sum_batch = true, transpose_lhs = true} : (tensor<4x6x32xf32>, tensor<4x6x16xf32>) -> tensor<32x16xf32>
// CHECK: %[[DB:.*]] = graph.reduce_sum {{.*}}partial = [dp]>]
// CHECK: %[[DE2:.*]] = graph.embedding_grad {{.*}}partial = [dp]>]
// CHECK: %[[DE:.*]] = graph.add %{{.*}}, %[[DE2]] {dist.sharding = [#dist.sharding<{{.*}}, partial = [dp]>]
// CHECK: %[[RW:.*]] = dist.reshard %{{.*}} {{.*}}from = #dist.sharding<{{\[\[\], \[\]\]}}, partial = [dp]>, {{.*}}to = #dist.sharding<{{\[\[\], \[\]\]}}, partial = []>}
// CHECK: %[[RB:.*]] = dist.reshard %[[DB]]
// CHECK: %[[RE:.*]] = dist.reshard %[[DE]]
// CHECK: %[[NORM:.*]] = graph.global_norm %[[RW]], %[[RB]], %[[RE]]
// CHECK: graph.adamw %{{.*}}, %[[RW]], %[[NORM]]
// CHECK: graph.adamw %{{.*}}, %[[RB]], %[[NORM]]
// CHECK: graph.adamw %{{.*}}, %[[RE]], %[[NORM]]
// The loss is returned whole.
// CHECK: %[[RL:.*]] = dist.reshard %[[LOSS]]
// CHECK: return %[[RL]], %[[NORM]]
