// RUN: tessel-opt %s --split-input-file --tessel-eval-step --verify-diagnostics | FileCheck %s

// The forward-only step: what train_step does before its parts (the tied
// weight's send), the forward calls in the same order, then the loss's tail
// of the update (the zero on a rank without the loss, its reductions) on
// the loss's buffer, and rt.finish_eval. Gradient reductions, the norm,
// the backward calls and the update stay out; rt.param goes (the runtime
// reads the parameters' table from train_step).

// CHECK-LABEL: func.func @train_step()
// CHECK: call @update
// CHECK-LABEL: func.func @eval_step()
// CHECK-NOT: rt.param
// CHECK: rt.send(%{{.*}}) microbatch %{{.*}} {offset = 1 : i64, tag = 1 : i64}
// CHECK-NEXT: rt.flush_sends
// CHECK-NEXT: call @forward0(%{{.*}}, %{{.*}}) : (i64, i1) -> ()
// CHECK-NEXT: call @forward0(%{{.*}}, %{{.*}}) : (i64, i1) -> ()
// CHECK-NEXT: rt.wait_sends
// CHECK-NEXT: %[[Z:.*]] = rt.buffer <transient> 64 : memref<f32>
// CHECK-NEXT: rt.fill(%[[Z]]) {n = 1 : i64, value = 0.000000e+00 : f64} : memref<f32>
// CHECK-NEXT: %[[P:.*]] = rt.buffer <transient> 64 : memref<f32>
// CHECK-NEXT: rt.all_reduce(%[[P]]) {axes = #dist.axes<pp>} : memref<f32>
// CHECK-NEXT: %[[D:.*]] = rt.buffer <transient> 64 : memref<f32>
// CHECK-NEXT: rt.all_reduce(%[[D]]) {axes = #dist.axes<dp>} : memref<f32>
// CHECK-NEXT: %[[L:.*]] = rt.buffer <transient> 64 : memref<f32>
// CHECK-NEXT: rt.finish_eval(%[[L]]) : memref<f32>
// CHECK-NEXT: return
module attributes {dist.mesh = #dist.mesh<dp = 2, pp = 2>} {
  module @stage0 attributes {pipe.rank = 0 : i64} {
    func.func @train_step() {
      %c0 = arith.constant 0 : i64
      %c1 = arith.constant 1 : i64
      %t = arith.constant true
      %f = arith.constant false
      %w = rt.param "wte" {global_shape = array<i64: 16>, init = "normal", mean = 0.0 : f64, std = 0.02 : f64, decay = true, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64, offset = 0 : i64} : memref<16xf32>
      %tied = rt.buffer <params> 0 : memref<16xf32>
      rt.send(%tied) microbatch %c0 {offset = 1 : i64, tag = 1 : i64} : memref<16xf32>
      rt.flush_sends
      call @forward0(%c0, %t) : (i64, i1) -> ()
      call @forward0(%c1, %f) : (i64, i1) -> ()
      call @backward0(%c0, %t) : (i64, i1) -> ()
      call @backward0(%c1, %f) : (i64, i1) -> ()
      rt.wait_sends
      call @update(%c0, %t) : (i64, i1) -> ()
      return
    }
    func.func private @forward0(%mb: i64, %first: i1) attributes {rt.part = "forward"} {
      %act = rt.buffer <arena> 0 : memref<8xf32>
      rt.send(%act) microbatch %mb {offset = 1 : i64, tag = 0 : i64} : memref<8xf32>
      return
    }
    func.func private @backward0(%mb: i64, %first: i1) attributes {rt.part = "backward"} {
      %grad = rt.buffer <arena> 0 : memref<8xf32>
      rt.recv(%grad) microbatch %mb {offset = 1 : i64, tag = 2 : i64} : memref<8xf32>
      return
    }
    func.func private @update(%mb: i64, %first: i1) attributes {rt.part = "update"} {
      %loss = rt.buffer <transient> 64 : memref<f32>
      rt.fill(%loss) {n = 1 : i64, value = 0.0 : f64} : memref<f32>
      %g = rt.buffer <grads> 0 : memref<16xf32>
      rt.all_reduce(%g) {axes = #dist.axes<dp>} : memref<16xf32>
      %loss1 = rt.buffer <transient> 64 : memref<f32>
      rt.all_reduce(%loss1) {axes = #dist.axes<pp>} : memref<f32>
      %loss2 = rt.buffer <transient> 64 : memref<f32>
      rt.all_reduce(%loss2) {axes = #dist.axes<dp>} : memref<f32>
      %norm = rt.buffer <transient> 0 : memref<f32>
      %loss3 = rt.buffer <transient> 64 : memref<f32>
      rt.finish_step(%loss3, %norm) : memref<f32>, memref<f32>
      return
    }
  }
}

// -----

// A rank whose loss is reduced together with another value cannot have it
// reduced alone; the pass says so rather than reduce the wrong thing.
module attributes {dist.mesh = #dist.mesh<dp = 2>} {
  module @program0 {
    func.func @train_step() {
      %c0 = arith.constant 0 : i64
      %t = arith.constant true
      call @update(%c0, %t) : (i64, i1) -> ()
      return
    }
    func.func private @update(%mb: i64, %first: i1) attributes {rt.part = "update"} {
      %both = rt.buffer <transient> 0 : memref<2xf32>
      // expected-error @+1 {{reduces part of the loss's buffer with other values}}
      rt.all_reduce(%both) {axes = #dist.axes<dp>} : memref<2xf32>
      %loss = rt.buffer <transient> 4 : memref<f32>
      %norm = rt.buffer <transient> 0 : memref<f32>
      rt.finish_step(%loss, %norm) : memref<f32>, memref<f32>
      return
    }
  }
}

// -----

module attributes {dist.mesh = #dist.mesh<dp = 2>} {
  module @program0 {
    // expected-error @+1 {{calls no update part; there is no loss to evaluate}}
    func.func @train_step() {
      return
    }
  }
}

// -----

// Slices cut from a weight's bf16 copy and copied back into its slot
// (tessel-hoist-parameter-slices) leave the slot holding the pieces; a
// training step's update makes the copy whole again, the evaluation puts
// the pieces back itself, slot by slot, once the loss is handed over (the
// pieces' buffers share places with the parts' and between the slots).

// CHECK-LABEL: func.func @eval_step()
// CHECK: rt.copy(%[[QA:.*]], %[[QS:.*]]) {n = 8 : i64}
// CHECK: rt.copy(%[[KA:.*]], %[[KS:.*]]) {n = 8 : i64}
// CHECK: rt.copy(%[[WA:.*]], %[[WS:.*]]) {n = 8 : i64}
// CHECK: call @forward0
// CHECK: rt.finish_eval
// CHECK-NEXT: rt.copy(%[[QS]], %[[QA]]) {n = 8 : i64}
// CHECK-NEXT: rt.copy(%[[KS]], %[[KA]]) {n = 8 : i64}
// CHECK-NEXT: rt.insert_axis(%[[QA]], %{{.*}}) {extent = 4 : i64, inner = 1 : i64, length = 2 : i64, outer = 4 : i64, start = 0 : i64}
// CHECK-NEXT: rt.insert_axis(%[[KA]], %{{.*}}) {extent = 4 : i64, inner = 1 : i64, length = 2 : i64, outer = 4 : i64, start = 2 : i64}
// CHECK-NEXT: rt.copy(%[[WS]], %[[WA]]) {n = 8 : i64}
// CHECK-NEXT: rt.insert_axis(%[[WA]], %{{.*}}) {extent = 4 : i64, inner = 1 : i64, length = 2 : i64, outer = 4 : i64, start = 2 : i64}
// CHECK-NEXT: return
module attributes {dist.mesh = #dist.mesh<dp = 1>} {
  module @program0 {
    func.func @train_step() {
      %c0 = arith.constant 0 : i64
      %t = arith.constant true
      %slot = rt.buffer <shadow> 16 : memref<4x4xbf16>
      %q = rt.buffer <arena> 0 : memref<4x2xbf16>
      rt.slice_axis(%slot, %q) {extent = 4 : i64, inner = 1 : i64, length = 2 : i64, outer = 4 : i64, start = 0 : i64} : memref<4x4xbf16>, memref<4x2xbf16>
      %k = rt.buffer <arena> 16 : memref<4x2xbf16>
      rt.slice_axis(%slot, %k) {extent = 4 : i64, inner = 1 : i64, length = 2 : i64, outer = 4 : i64, start = 2 : i64} : memref<4x4xbf16>, memref<4x2xbf16>
      %qs = rt.buffer <shadow> 16 : memref<4x2xbf16>
      rt.copy(%q, %qs) {n = 8 : i64} : memref<4x2xbf16>, memref<4x2xbf16>
      %ks = rt.buffer <shadow> 24 : memref<4x2xbf16>
      rt.copy(%k, %ks) {n = 8 : i64} : memref<4x2xbf16>, memref<4x2xbf16>
      %other = rt.buffer <shadow> 32 : memref<4x4xbf16>
      %w = rt.buffer <arena> 0 : memref<4x2xbf16>
      rt.slice_axis(%other, %w) {extent = 4 : i64, inner = 1 : i64, length = 2 : i64, outer = 4 : i64, start = 2 : i64} : memref<4x4xbf16>, memref<4x2xbf16>
      %ws = rt.buffer <shadow> 32 : memref<4x2xbf16>
      rt.copy(%w, %ws) {n = 8 : i64} : memref<4x2xbf16>, memref<4x2xbf16>
      call @forward0(%c0, %t) : (i64, i1) -> ()
      call @update(%c0, %t) : (i64, i1) -> ()
      return
    }
    func.func private @forward0(%mb: i64, %first: i1) attributes {rt.part = "forward"} {
      return
    }
    func.func private @update(%mb: i64, %first: i1) attributes {rt.part = "update"} {
      %loss = rt.buffer <transient> 0 : memref<f32>
      %norm = rt.buffer <transient> 4 : memref<f32>
      rt.finish_step(%loss, %norm) : memref<f32>, memref<f32>
      return
    }
  }
}

// -----

// A copy into the bf16 copy that no slice of it explains cannot be undone.
module attributes {dist.mesh = #dist.mesh<dp = 1>} {
  module @program0 {
    func.func @train_step() {
      %c0 = arith.constant 0 : i64
      %t = arith.constant true
      %a = rt.buffer <arena> 0 : memref<8xbf16>
      %s = rt.buffer <shadow> 0 : memref<8xbf16>
      // expected-error @+1 {{writes the bf16 copy of the parameters with no slice of it to put back after an evaluation}}
      rt.copy(%a, %s) {n = 8 : i64} : memref<8xbf16>, memref<8xbf16>
      call @update(%c0, %t) : (i64, i1) -> ()
      return
    }
    func.func private @update(%mb: i64, %first: i1) attributes {rt.part = "update"} {
      %loss = rt.buffer <transient> 0 : memref<f32>
      %norm = rt.buffer <transient> 4 : memref<f32>
      rt.finish_step(%loss, %norm) : memref<f32>, memref<f32>
      return
    }
  }
}

// -----

// A rank whose chunks each sum their own part of the loss (an MoE model's
// load-balancing losses under interleaved stages) makes the loss in its
// update by adding the forward passes' sums: the evaluation adds them the
// same way, through the buffer between the adds, before the reductions.

// CHECK-LABEL: func.func @eval_step()
// CHECK: call @forward0
// CHECK-NEXT: %[[A0:.*]] = rt.buffer <accumulators> 0 : memref<f32>
// CHECK-NEXT: %[[A1:.*]] = rt.buffer <accumulators> 1 : memref<f32>
// CHECK-NEXT: %[[T:.*]] = rt.buffer <transient> 8 : memref<f32>
// CHECK-NEXT: rt.add_broadcast(%[[A0]], %[[A1]], %[[T]]) {n = 1 : i64, nb = 1 : i64}
// CHECK-NEXT: %[[T2:.*]] = rt.buffer <transient> 8 : memref<f32>
// CHECK-NEXT: %[[A2:.*]] = rt.buffer <accumulators> 2 : memref<f32>
// CHECK-NEXT: %[[L:.*]] = rt.buffer <transient> 4 : memref<f32>
// CHECK-NEXT: rt.add_broadcast(%[[T2]], %[[A2]], %[[L]]) {n = 1 : i64, nb = 1 : i64}
// CHECK-NEXT: %[[R:.*]] = rt.buffer <transient> 4 : memref<f32>
// CHECK-NEXT: rt.all_reduce(%[[R]]) {axes = #dist.axes<pp>} : memref<f32>
// CHECK-NEXT: %[[F:.*]] = rt.buffer <transient> 4 : memref<f32>
// CHECK-NEXT: rt.finish_eval(%[[F]]) : memref<f32>
// CHECK-NEXT: return
module attributes {dist.mesh = #dist.mesh<pp = 2>} {
  module @stage0 attributes {pipe.rank = 0 : i64} {
    func.func @train_step() {
      %c0 = arith.constant 0 : i64
      %t = arith.constant true
      call @forward0(%c0, %t) : (i64, i1) -> ()
      call @update(%c0, %t) : (i64, i1) -> ()
      return
    }
    func.func private @forward0(%mb: i64, %first: i1) attributes {rt.part = "forward"} {
      return
    }
    func.func private @update(%mb: i64, %first: i1) attributes {rt.part = "update"} {
      %a0 = rt.buffer <accumulators> 0 : memref<f32>
      %a1 = rt.buffer <accumulators> 1 : memref<f32>
      %tmp = rt.buffer <transient> 8 : memref<f32>
      rt.add_broadcast(%a0, %a1, %tmp) {n = 1 : i64, nb = 1 : i64} : memref<f32>, memref<f32>, memref<f32>
      %norm = rt.buffer <transient> 0 : memref<f32>
      rt.fill(%norm) {n = 1 : i64, value = 0.0 : f64} : memref<f32>
      %tmp2 = rt.buffer <transient> 8 : memref<f32>
      %a2 = rt.buffer <accumulators> 2 : memref<f32>
      %loss = rt.buffer <transient> 4 : memref<f32>
      rt.add_broadcast(%tmp2, %a2, %loss) {n = 1 : i64, nb = 1 : i64} : memref<f32>, memref<f32>, memref<f32>
      %loss1 = rt.buffer <transient> 4 : memref<f32>
      rt.all_reduce(%loss1) {axes = #dist.axes<pp>} : memref<f32>
      %loss2 = rt.buffer <transient> 4 : memref<f32>
      rt.finish_step(%loss2, %norm) : memref<f32>, memref<f32>
      return
    }
  }
}

// -----

// A loss made from a buffer the tail cannot trace to the forward passes'
// sums (here scaled in the update) is refused rather than read stale.
module attributes {dist.mesh = #dist.mesh<pp = 2>} {
  module @stage0 attributes {pipe.rank = 0 : i64} {
    func.func @train_step() {
      %c0 = arith.constant 0 : i64
      %t = arith.constant true
      call @update(%c0, %t) : (i64, i1) -> ()
      return
    }
    func.func private @update(%mb: i64, %first: i1) attributes {rt.part = "update"} {
      %a0 = rt.buffer <accumulators> 0 : memref<f32>
      %a1 = rt.buffer <accumulators> 1 : memref<f32>
      %tmp = rt.buffer <transient> 8 : memref<f32>
      rt.mul_broadcast(%a0, %a1, %tmp) {n = 1 : i64, nb = 1 : i64} : memref<f32>, memref<f32>, memref<f32>
      %a2 = rt.buffer <accumulators> 2 : memref<f32>
      %loss = rt.buffer <transient> 4 : memref<f32>
      rt.add_broadcast(%tmp, %a2, %loss) {n = 1 : i64, nb = 1 : i64} : memref<f32>, memref<f32>, memref<f32>
      %norm = rt.buffer <transient> 0 : memref<f32>
      %loss2 = rt.buffer <transient> 4 : memref<f32>
      // expected-error @+1 {{makes its loss from a buffer that the evaluation step cannot trace to the forward passes}}
      rt.finish_step(%loss2, %norm) : memref<f32>, memref<f32>
      return
    }
  }
}
