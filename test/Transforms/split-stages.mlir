// RUN: tessel-opt %S/Inputs/pp-forward.mlir --tessel-autodiff --tessel-propagate-sharding --tessel-partition --tessel-split-stages | FileCheck %s
// RUN: tessel-opt %S/Inputs/pp-forward.mlir --tessel-set-layout=pp=1 --tessel-autodiff --tessel-propagate-sharding --tessel-partition --tessel-split-stages | FileCheck %s --check-prefix=ONE
// RUN: sed 's/{dist.mesh = #dist.mesh<pp = 2>}/{dist.mesh = #dist.mesh<pp = 2>, pipe.layout = #pipe.layout<microbatches = 1, schedule = "1f1b", virtual_stages = 1, layer_stages = [0, 0]>}/' %S/Inputs/pp-forward.mlir | tessel-opt --tessel-autodiff --tessel-propagate-sharding --tessel-partition --tessel-split-stages | FileCheck %s --check-prefix=GIVEN

// Blocks balanced by matmul work (block 1 carries the head's): embedding and
// block 0 on the first rank, block 1 and the head on the second. The
// activation goes forward right after it is produced and its gradient comes
// back; each stage reduces its own gradients' squares over pp, and the loss
// is summed over pp (the first stage contributes zero).
// CHECK-LABEL: func.func @stage_0()
// CHECK: graph.param "wte"
// CHECK: graph.param "h.0.w"
// CHECK: %[[A:.*]] = graph.gelu
// CHECK-NEXT: dist.send %[[A]] {axis = #dist.axis<pp>, offset = 1 : i64, tag = [[FWD:[0-9]+]] : i64, {{.*}}tessel.phase = "forward"}
// CHECK: %[[DA:.*]] = dist.recv {axis = #dist.axis<pp>, offset = 1 : i64, tag = [[BWD:[0-9]+]] : i64, {{.*}}tessel.phase = "backward"}
// CHECK: graph.gelu_grad %{{.*}}, %[[DA]]
// CHECK: %[[N0:.*]] = graph.global_norm {{.*}}reduce_axes = [#dist.axes<pp>, #dist.axes<pp>]
// CHECK: %[[Z:.*]] = graph.fill
// CHECK: %[[L0:.*]] = dist.all_reduce %[[Z]] {axes = #dist.axes<pp>
// CHECK: return %[[L0]], %[[N0]]
// CHECK-NOT: head.w
// CHECK-LABEL: func.func @stage_1()
// CHECK: graph.param "h.1.w"
// CHECK: dist.recv {axis = #dist.axis<pp>, offset = -1 : i64, tag = [[FWD]] : i64
// CHECK: graph.param "head.w"
// CHECK: %[[LOSS:.*]] = graph.cross_entropy
// CHECK: dist.send %{{.*}} {axis = #dist.axis<pp>, offset = -1 : i64, tag = [[BWD]] : i64
// CHECK: %[[L1:.*]] = dist.all_reduce %[[LOSS]] {axes = #dist.axes<pp>
// CHECK: return %[[L1]]

// One pipeline rank: nothing to split.
// ONE: func.func @train_step()
// ONE-NOT: dist.send

// The layout's layer_stages put both blocks on the first stage: only the
// head is left for the second.
// GIVEN-LABEL: func.func @stage_0()
// GIVEN: graph.param "h.1.w"
// GIVEN-LABEL: func.func @stage_1()
// GIVEN-NOT: graph.param "h.
// GIVEN: graph.param "head.w"
