// RUN: tessel-opt %s --tessel-plan-memory | FileCheck %s --implicit-check-not=rt.alloc --implicit-check-not="rt.embedding_backward("
// RUN: tessel-opt %s --tessel-plan-memory=fuse-accumulation=false | FileCheck %s --check-prefix=UNFUSED

// Two microbatches. The embedding table's gradient is written whole by the
// scatter of the output gradient's rows: the scatter sums them into the
// table's slot of the gradient store itself, zeroing it on the part's first
// run only (rt.embedding_backward_accumulate), with no table-sized place in
// the arena and no pass to add it.
// CHECK-LABEL: func.func @train_step()
// CHECK: pipe.backward_pass
// CHECK-NEXT: %[[FIRST:.*]] = rt.first_run : i1
// CHECK: %[[G:.*]] = rt.buffer <grads> 0 : memref<32x8xf32>
// CHECK: rt.embedding_backward_accumulate(%{{.*}}, %{{.*}}, %[[G]], %[[FIRST]]) {hidden = 8 : i64, n = 4 : i64, vocab = 32 : i64}
// CHECK-NOT: rt.accumulate
// CHECK: pipe.update

// Without the fusion the gradient has its place in the arena and is added.
// UNFUSED-LABEL: func.func @train_step()
// UNFUSED: %[[GW:.*]] = rt.buffer <arena> {{[0-9]+}} : memref<32x8xf32>
// UNFUSED: rt.embedding_backward(%{{.*}}, %{{.*}}, %[[GW]])
// UNFUSED: rt.accumulate(%[[GW]], %{{.*}}, %{{.*}}) {n = 256 : i64}

module attributes {dist.mesh = #dist.mesh<dp = 1>, pipe.layout = #pipe.layout<microbatches = 2, schedule = "1f1b", virtual_stages = 1>} {
func.func @train_step() -> memref<f32> attributes {pipe.rank = 0 : i64} {
  %w = rt.param "wte" {decay = true, global_shape = array<i64: 32, 8>, init = "normal", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64} : memref<32x8xf32>
  %f = pipe.forward_pass chunk 0 -> memref<4x8xf32> {
    %x = rt.alloc : memref<4x8xf32>
    rt.fill(%x) {n = 32 : i64, value = 1.0 : f64} : memref<4x8xf32>
    pipe.yield %x : memref<4x8xf32>
  }
  %g = pipe.backward_pass chunk 0 -> memref<32x8xf32> {
    %ids = rt.batch "tokens" : memref<1x4xi32>
    %gw = rt.alloc : memref<32x8xf32>
    rt.embedding_backward(%ids, %f, %gw) {n = 4 : i64, vocab = 32 : i64, hidden = 8 : i64} : memref<1x4xi32>, memref<4x8xf32>, memref<32x8xf32>
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
