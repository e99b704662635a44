// RUN: tessel-opt %S/Inputs/pp-forward.mlir --tessel-autodiff --tessel-propagate-sharding --tessel-partition --tessel-stage-regions | FileCheck %s
// RUN: tessel-opt %S/Inputs/dp-forward.mlir --tessel-autodiff --tessel-propagate-sharding --tessel-partition --tessel-bucket-gradients=bucket-bytes=600 --tessel-stage-regions | FileCheck %s --check-prefix=ONE
// RUN: sed -e '/"head.w"/d' -e 's/%h1, %wo/%h1, %e/' %S/Inputs/pp-forward.mlir | tessel-opt --tessel-autodiff --tessel-propagate-sharding --tessel-partition --tessel-stage-regions | FileCheck %s --check-prefix=TIED
// RUN: sed 's/{dist.mesh = #dist.mesh<pp = 2>}/{dist.mesh = #dist.mesh<pp = 2>, pipe.layout = #pipe.layout<microbatches = 1, schedule = "1f1b", virtual_stages = 1, layer_stages = [0, 0]>}/' %S/Inputs/pp-forward.mlir | tessel-opt --tessel-autodiff --tessel-propagate-sharding --tessel-partition --tessel-stage-regions | FileCheck %s --check-prefix=GIVEN
// RUN: tessel-opt %S/Inputs/pp-forward.mlir --tessel-autodiff --tessel-propagate-sharding --tessel-partition --tessel-stage-regions=recompute=full | FileCheck %s --check-prefix=RECOMPUTE

// Two pipeline ranks. Blocks are balanced by matmul work (block 1 carries the
// head's): the embedding and block 0 on rank 0, block 1 and the head on rank
// 1. Each rank's function holds its parameters and its parts; the forward
// pass sends the activation on right after producing it and hands on what
// its backward pass reads; the backward pass receives the activation's
// gradient and hands on this microbatch's gradients; the update reads them
// summed over microbatches.
// CHECK-LABEL: func.func @stage_0() -> (tensor<f32>, tensor<f32>) attributes {pipe.rank = 0 : i64}
// CHECK: %[[WTE:.*]] = graph.param "wte"
// CHECK: %[[W0:.*]] = graph.param "h.0.w"
// CHECK: %[[FWD:.*]]:2 = pipe.forward_pass chunk 0 -> tensor<2x4x8xf32>, tensor<2x4x8xf32> {
// CHECK: %[[A:.*]] = graph.gelu
// CHECK-NEXT: dist.send %[[A]] {axis = #dist.axis<pp>, {{.*}}offset = 1 : i64, tag = [[FT:[0-9]+]] : i64}
// CHECK: pipe.yield
// CHECK: %[[BWD:.*]]:2 = pipe.backward_pass chunk 0 -> tensor<32x8xf32>, tensor<8x8xf32> {
// CHECK: %[[DA:.*]] = dist.recv {axis = #dist.axis<pp>, {{.*}}offset = 1 : i64, tag = [[BT:[0-9]+]] : i64}
// CHECK: graph.gelu_grad %[[FWD]]#0, %[[DA]]
// CHECK: pipe.yield
// CHECK: pipe.update(%[[BWD]]#0, %[[BWD]]#1 : tensor<32x8xf32>, tensor<8x8xf32>) -> tensor<f32>, tensor<f32> {
// CHECK-NEXT: ^bb0(%[[GE:.*]]: tensor<32x8xf32>, %[[GW:.*]]: tensor<8x8xf32>):
// CHECK: %[[N:.*]] = graph.global_norm %[[GE]], %[[GW]] {{.*}}reduce_axes = [#dist.axes<pp>, #dist.axes<pp>]
// CHECK: graph.adamw %[[WTE]], %[[GE]], %[[N]]
// CHECK: %[[Z:.*]] = graph.fill
// CHECK: %[[L:.*]] = dist.all_reduce %[[Z]] {axes = #dist.axes<pp>
// CHECK: pipe.yield %[[L]], %[[N]]
// CHECK-LABEL: func.func @stage_1()
// CHECK: graph.param "h.1.w"
// CHECK: graph.param "head.w"
// CHECK: %[[F1:.*]]:4 = pipe.forward_pass chunk 0
// CHECK: dist.recv {axis = #dist.axis<pp>, {{.*}}offset = -1 : i64, tag = [[FT]] : i64}
// CHECK: %[[LOSS:.*]] = graph.cross_entropy
// CHECK: pipe.backward_pass chunk 0
// CHECK: dist.send %{{.*}} {axis = #dist.axis<pp>, {{.*}}offset = -1 : i64, tag = [[BT]] : i64}
// The loss is one of the update's inputs: summed over the microbatches.
// CHECK: pipe.update(%{{.*}}, %{{.*}}, %[[F1]]#3 :
// CHECK: dist.all_reduce %arg2 {axes = #dist.axes<pp>

// One rank: one function, @train_step, with the same parts. Gradient buckets
// started during backward are handed to the update with their requests,
// which it waits for before the norm.
// ONE-LABEL: func.func @train_step() {{.*}}attributes {pipe.rank = 0 : i64}
// ONE: pipe.forward_pass chunk 0
// ONE: %[[B:.*]]:5 = pipe.backward_pass chunk 0 -> !dist.request, !dist.request,
// ONE: %{{.*}}, %[[R0:.*]] = dist.all_reduce_start
// ONE: %{{.*}}, %[[R1:.*]] = dist.all_reduce_start
// ONE: pipe.yield %[[R0]], %[[R1]],
// ONE: pipe.update(%[[B]]#0, %[[B]]#1,
// ONE-NEXT: ^bb0(%[[Q0:.*]]: !dist.request, %[[Q1:.*]]: !dist.request,
// ONE-NEXT: dist.wait %[[Q0]]
// ONE-NEXT: dist.wait %[[Q1]]
// ONE-NEXT: graph.global_norm
// ONE-NOT: dist.send

// The layout's layer_stages put both blocks on rank 0: only the head runs on
// rank 1.
// GIVEN-LABEL: func.func @stage_0()
// GIVEN: graph.param "h.1.w"
// GIVEN-LABEL: func.func @stage_1()
// GIVEN-NOT: graph.param "h.
// GIVEN: graph.param "head.w"

// The head tied to the embedding table: rank 0 sends the table once per
// step, before its parts, and rank 1 holds it for the step like a parameter
// of its own. Rank 1's gradient contribution is summed over the
// microbatches by its update, which sends it once; rank 0's update adds it
// to its own before the norm and AdamW.
// TIED-LABEL: func.func @stage_0()
// TIED: %[[WTE:.*]] = graph.param "wte"
// TIED: dist.send %[[WTE]] {axis = #dist.axis<pp>, {{.*}}offset = 1 : i64, tag = [[TT:[0-9]+]] : i64}
// TIED-NEXT: pipe.forward_pass chunk 0
// TIED: pipe.update(%{{.*}}, %{{.*}} : tensor<32x8xf32>, tensor<8x8xf32>)
// TIED-NEXT: ^bb0(%[[MINE:.*]]: tensor<32x8xf32>, %{{.*}}: tensor<8x8xf32>):
// TIED-NEXT: %[[THEIRS:.*]] = dist.recv {axis = #dist.axis<pp>, {{.*}}offset = 1 : i64, tag = [[GT:[0-9]+]] : i64} : tensor<32x8xf32>
// TIED-NEXT: %[[G:.*]] = graph.add %[[THEIRS]], %[[MINE]] {{.*}}graph.phase = #graph.phase<update>
// TIED: graph.adamw %[[WTE]], %[[G]]
// TIED-LABEL: func.func @stage_1()
// TIED: %[[TABLE:.*]] = dist.recv {axis = #dist.axis<pp>, {{.*}}offset = -1 : i64, tag = [[TT]] : i64} : tensor<32x8xf32>
// TIED-NEXT: pipe.forward_pass chunk 0
// TIED: graph.matmul %{{.*}}, %[[TABLE]] {{.*}}transpose_rhs = true
// TIED: pipe.backward_pass chunk 0
// TIED-NOT: tag = [[GT]]
// TIED: pipe.update
// TIED-NEXT: ^bb0(%[[SUM:.*]]: tensor<32x8xf32>,
// TIED-NEXT: dist.send %[[SUM]] {axis = #dist.axis<pp>, {{.*}}offset = -1 : i64, tag = [[GT]] : i64}

// Full recompute: the forward pass hands on only block 0's input (the
// embedding's output); the backward pass runs block 0's matmul again for
// the GELU's gradient instead of holding its output.
// RECOMPUTE-LABEL: func.func @stage_0()
// RECOMPUTE: %[[F:.*]] = pipe.forward_pass chunk 0 -> tensor<2x4x8xf32> {
// RECOMPUTE: %[[X:.*]] = graph.embedding
// RECOMPUTE: graph.gelu
// RECOMPUTE: pipe.yield %[[X]] : tensor<2x4x8xf32>
// RECOMPUTE: pipe.backward_pass chunk 0
// RECOMPUTE-NEXT: %[[Y:.*]] = graph.matmul %[[F]], %{{.*}} {{.*}}graph.layer = #graph.layer<block 0>, graph.phase = #graph.phase<backward>
// RECOMPUTE: graph.gelu_grad %[[Y]],
