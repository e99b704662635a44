// RUN: tessel-opt %s --tessel-autodiff --tessel-propagate-sharding --tessel-partition --tessel-bucket-gradients=lookup-tables-alone=true | FileCheck %s
// RUN: tessel-opt %s --tessel-autodiff --tessel-propagate-sharding --tessel-partition --tessel-bucket-gradients | FileCheck %s --check-prefix=SHARED
// RUN: tessel-opt %S/Inputs/dp-forward.mlir --tessel-autodiff --tessel-propagate-sharding --tessel-partition --tessel-bucket-gradients=lookup-tables-alone=true | FileCheck %s --check-prefix=TIED

// ZeRO-3 gathers a bucket's parameters for each part that reads them. The
// token table of the input embedding, which only the lookup reads (its
// gradient needs the tokens, not the table), takes a bucket of its own
// with lookup-tables-alone, so that the backward never gathers it; the
// head's own table and the matmul's weight share one. The position table
// that only an add reads does too; a table the head also reads (tied)
// does not.
// CHECK-LABEL: func.func @train_step
// CHECK: %{{.*}}:2, %{{.*}} = dist.all_reduce_start %{{.*}}, %{{.*}} {axes = #dist.axes<dp>{{.*}} : (tensor<32x16xf32>, tensor<16x8xf32>)
// CHECK: dist.all_reduce_start %{{.*}} {axes = #dist.axes<dp>{{.*}} : (tensor<6x16xf32>)
// CHECK-NEXT: graph.embedding_grad
// CHECK-NEXT: dist.all_reduce_start %{{.*}} {axes = #dist.axes<dp>{{.*}} : (tensor<32x16xf32>)
// CHECK-NOT: dist.all_reduce_start

// A table the head reads too (tied) shares the bucket.
// TIED: %{{.*}}:3, %{{.*}} = dist.all_reduce_start
// TIED-NOT: dist.all_reduce_start

// Without it, one bucket holds them all.
// SHARED: %{{.*}}:4, %{{.*}} = dist.all_reduce_start
// SHARED-NOT: dist.all_reduce_start
module attributes {dist.mesh = #dist.mesh<dp = 2>} {
func.func @forward() -> tensor<f32> {
  %w = graph.param "w" : tensor<16x8xf32>
  %e = graph.param "wte" {graph.layer = #graph.layer<embedding>} : tensor<32x16xf32>
  %p = graph.param "wpe" {graph.layer = #graph.layer<embedding>} : tensor<6x16xf32>
  %o = graph.param "lm_head" {graph.layer = #graph.layer<head>} : tensor<32x16xf32>
  %ids = graph.input "tokens" : tensor<4x6xi32>
  %t = graph.input "targets" : tensor<4x6xi32>
  %x0 = graph.embedding %e, %ids : (tensor<32x16xf32>, tensor<4x6xi32>) -> tensor<4x6x16xf32>
  %x = graph.add %x0, %p : (tensor<4x6x16xf32>, tensor<6x16xf32>) -> tensor<4x6x16xf32>
  %y = graph.matmul %x, %w : (tensor<4x6x16xf32>, tensor<16x8xf32>) -> tensor<4x6x8xf32>
  %h = graph.matmul %y, %w {transpose_rhs = true} : (tensor<4x6x8xf32>, tensor<16x8xf32>) -> tensor<4x6x16xf32>
  %l = graph.matmul %h, %o {transpose_rhs = true} : (tensor<4x6x16xf32>, tensor<32x16xf32>) -> tensor<4x6x32xf32>
  %loss = graph.cross_entropy %l, %t : (tensor<4x6x32xf32>, tensor<4x6xi32>) -> tensor<f32>
  return %loss : tensor<f32>
}
}
