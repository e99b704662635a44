// RUN: tessel-opt %S/../Transforms/Inputs/dp-forward.mlir --tessel-train-pipeline="dp=4" | FileCheck %s
// RUN: tessel-opt %S/../Transforms/Inputs/pp-forward.mlir --tessel-train-pipeline="dp=2 microbatches=1" | FileCheck %s --check-prefix=PP

// The whole compile as one registered pipeline: the layout chosen here, then
// autodiff, sharding, partition, gradient buckets and the buffer plan.
// CHECK: module attributes {dist.mesh = #dist.mesh<dp = 4>
// CHECK-SAME: tessel.arena_bytes
// CHECK-LABEL: func.func @train_step
// CHECK: graph.input "tokens" {{.*}} : tensor<1x6xi32>
// CHECK: dist.all_reduce_start {{.*}}axes = #dist.axes<dp>
// CHECK: graph.adamw

// Data and pipeline parallel: one program per pipeline rank, each planned.
// PP: module attributes {dist.mesh = #dist.mesh<pp = 2, dp = 2>
// PP-LABEL: func.func @stage_0() {{.*}}tessel.arena_bytes
// PP: graph.input "tokens" {{.*}} : tensor<1x4xi32>
// PP-LABEL: func.func @stage_1() {{.*}}tessel.arena_bytes
