// RUN: tessel-opt %s --tessel-plan-memory | FileCheck %s --implicit-check-not=rt.add_broadcast --implicit-check-not="rt.embedding_backward(" --implicit-check-not="rt.matmul("
// RUN: tessel-opt %s --tessel-plan-memory=fuse-accumulation=false | FileCheck %s --check-prefix=UNFUSED

// Two microbatches. A tied table's gradient is the LM head's weight
// gradient (a GEMM) plus the embedding's scatter, each into a buffer that
// only their sum reads. The GEMM sums into the table's slot of the
// gradient store (its product on the part's first run, added after) and
// the scatter adds its rows there on every run (a constant false first
// run): no table-sized terms in the arena, no pass to add them.
// CHECK-LABEL: func.func @train_step()
// CHECK: pipe.backward_pass
// CHECK-NEXT: %[[FIRST:.*]] = rt.first_run : i1
// CHECK: %[[G:.*]] = rt.buffer <grads> 0 : memref<32x8xf32>
// CHECK: rt.matmul_accumulate(%{{.*}}, %{{.*}}, %[[G]], %[[FIRST]]) {k = 4 : i64, m = 32 : i64, n = 8 : i64, trans_a = true, trans_b = false}
// CHECK: %[[NEVER:.*]] = arith.constant false
// CHECK: rt.embedding_backward_accumulate(%{{.*}}, %{{.*}}, %[[G]], %[[NEVER]]) {hidden = 8 : i64, n = 4 : i64, vocab = 32 : i64}
// CHECK-NOT: rt.accumulate
// CHECK: pipe.update

// Without the fusion each term has its place in the arena, and their sum
// is added into the slot.
// UNFUSED-LABEL: func.func @train_step()
// UNFUSED: rt.matmul(
// UNFUSED: rt.embedding_backward(
// UNFUSED: rt.add_broadcast(
// UNFUSED: rt.accumulate(

module attributes {dist.mesh = #dist.mesh<dp = 1>, pipe.layout = #pipe.layout<microbatches = 2, schedule = "1f1b", virtual_stages = 1>} {
func.func @train_step() -> memref<f32> attributes {pipe.rank = 0 : i64} {
  %w = rt.param "wte" {decay = true, global_shape = array<i64: 32, 8>, init = "normal", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64} : memref<32x8xf32>
  %f:2 = pipe.forward_pass chunk 0 -> memref<4x8xf32>, memref<4x32xf32> {
    %x = rt.alloc : memref<4x8xf32>
    rt.fill(%x) {n = 32 : i64, value = 1.0 : f64} : memref<4x8xf32>
    %d = rt.alloc : memref<4x32xf32>
    rt.fill(%d) {n = 128 : i64, value = 0.5 : f64} : memref<4x32xf32>
    pipe.yield %x, %d : memref<4x8xf32>, memref<4x32xf32>
  }
  %g = pipe.backward_pass chunk 0 -> memref<32x8xf32> {
    %head = rt.alloc : memref<32x8xf32>
    rt.matmul(%f#1, %f#0, %head) {batch = 1 : i64, m = 32 : i64, n = 8 : i64, k = 4 : i64, trans_a = true, trans_b = false, stride_a = 128 : i64, stride_b = 32 : i64, stride_c = 256 : i64} : memref<4x32xf32>, memref<4x8xf32>, memref<32x8xf32>
    %ids = rt.batch "tokens" : memref<1x4xi32>
    %emb = rt.alloc : memref<32x8xf32>
    rt.embedding_backward(%ids, %f#0, %emb) {n = 4 : i64, vocab = 32 : i64, hidden = 8 : i64} : memref<1x4xi32>, memref<4x8xf32>, memref<32x8xf32>
    %gw = rt.alloc : memref<32x8xf32>
    rt.add_broadcast(%head, %emb, %gw) {n = 256 : i64, nb = 256 : i64} : memref<32x8xf32>, memref<32x8xf32>, memref<32x8xf32>
    pipe.yield %gw : memref<32x8xf32>
  }
  %u = pipe.update(%g : memref<32x8xf32>) -> memref<f32> {
  ^bb0(%dw: memref<32x8xf32>):
    %n = rt.alloc : memref<f32>
    rt.fill(%n) {n = 1 : i64, value = 1.0 : f64} : memref<f32>
    %lr = rt.learning_rate : f32
    %t = rt.update_count : i64
    %mw = rt.state_of %w <adam_m> : memref<32x8xf32> -> memref<32x8xf32>
    %vw = rt.state_of %w <adam_v> : memref<32x8xf32> -> memref<32x8xf32>
    rt.adamw(%w, %dw, %mw, %vw, %n, %lr, %t) {n = 256 : i64, beta1 = 0.9 : f32, beta2 = 0.95 : f32, eps = 1.0e-8 : f32, weight_decay = 0.1 : f32, max_grad_norm = 1.0 : f32} : memref<32x8xf32>, memref<32x8xf32>, memref<32x8xf32>, memref<32x8xf32>, memref<f32>, f32, i64
    pipe.yield %n : memref<f32>
  }
  return %u : memref<f32>
}
}
