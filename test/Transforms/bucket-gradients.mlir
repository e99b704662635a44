// RUN: tessel-opt %S/Inputs/dp-forward.mlir --tessel-autodiff --tessel-propagate-sharding --tessel-partition --tessel-bucket-gradients | FileCheck %s
// RUN: tessel-opt %S/Inputs/dp-forward.mlir --tessel-autodiff --tessel-propagate-sharding --tessel-partition --tessel-bucket-gradients=bucket-bytes=600 | FileCheck %s --check-prefix=SMALL
// RUN: sed 's/{dist.mesh = #dist.mesh<dp = 2>}/{dist.mesh = #dist.mesh<dp = 2>, pipe.layout = #pipe.layout<microbatches = 2, schedule = "1f1b", virtual_stages = 1>}/' %S/Inputs/dp-forward.mlir | tessel-opt --tessel-autodiff --tessel-propagate-sharding --tessel-partition --tessel-bucket-gradients=bucket-bytes=600 | FileCheck %s --check-prefix=MICRO

// One bucket holds all three gradients, started when the last is final and
// waited for before the norm.
// CHECK-LABEL: func.func @train_step
// CHECK: graph.embedding_grad
// CHECK-NEXT: graph.add
// CHECK-NEXT: %{{.*}}:3, %[[REQ:.*]] = dist.all_reduce_start %{{.*}}, %{{.*}}, %{{.*}} {axes = #dist.axes<dp>
// CHECK-NEXT: dist.wait %[[REQ]]
// CHECK-NEXT: graph.global_norm
// CHECK-NOT: dist.all_reduce_start

// With 600-byte buckets the first gradients to become final (b: 32 bytes,
// then w: 512) start while the rest of backward still runs.
// SMALL: %{{.*}}:2, %[[R0:.*]] = dist.all_reduce_start %{{.*}}, %{{.*}} {axes = #dist.axes<dp>{{.*}} : (tensor<8xf32>, tensor<16x8xf32>) -> (tensor<8xf32>, tensor<16x8xf32>, !dist.request)
// SMALL: graph.embedding_grad
// SMALL: dist.all_reduce_start
// SMALL: dist.wait %[[R0]]
// SMALL: graph.global_norm

// With microbatches the gradients are reduced once, after the last one:
// the same buckets, as blocking collectives right before the norm.
// MICRO-NOT: dist.all_reduce_start
// MICRO: graph.embedding_grad
// MICRO: dist.all_reduce %{{.*}}, %{{.*}} {axes = #dist.axes<dp>{{.*}} : (tensor<8xf32>, tensor<16x8xf32>)
// MICRO-NEXT: dist.all_reduce %{{.*}} {axes = #dist.axes<dp>{{.*}} : (tensor<32x16xf32>)
// MICRO-NEXT: graph.global_norm
