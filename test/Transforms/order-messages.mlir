// RUN: tessel-opt %s --split-input-file --tessel-order-messages --verify-diagnostics | FileCheck %s

// Each send learns, per microbatch, its place in the sequence its receiver
// takes messages on that channel (NCCL matches in order, not by tag). Stage
// 0 sends a table (tag 2) before each activation (tag 0); stage 1 takes the
// activation in its forward and the table only in its backward, so on the
// channel 0 -> 1 the receiver's order is act 0, table 0, act 1, table 1.

// Both ranks' sends go to the send ring. Stage 0 needs two slots: with
// one, its activation would take the table's slot while the table still
// waits for its turn (order 1 after the activation's 0).

// CHECK-LABEL: module @stage0 attributes {pipe.rank = 0 : i64, rt.send_ring_slots = 2 : i64, rt.send_slot_bytes = 64 : i64}
// CHECK: rt.send(%{{.*}}) microbatch %{{.*}} {offset = 1 : i64, order = array<i64: 1, 3>, ring, tag = 2 : i64}
// CHECK: rt.send(%{{.*}}) microbatch %{{.*}} {offset = 1 : i64, order = array<i64: 0, 2>, ring, tag = 0 : i64}
// CHECK-LABEL: module @stage1 attributes {pipe.rank = 1 : i64, rt.send_ring_slots = 2 : i64, rt.send_slot_bytes = 32 : i64}
// CHECK: rt.send(%{{.*}}) microbatch %{{.*}} {offset = -1 : i64, order = array<i64: 0, 1>, ring, tag = 1 : i64}
module attributes {dist.mesh = #dist.mesh<pp = 2>} {
  module @stage0 attributes {pipe.rank = 0 : i64} {
    func.func @train_step() {
      %c0 = arith.constant 0 : i64
      %c1 = arith.constant 1 : i64
      %t = arith.constant true
      %f = arith.constant false
      call @forward0(%c0, %t) : (i64, i1) -> ()
      call @forward0(%c1, %f) : (i64, i1) -> ()
      call @backward0(%c0, %t) : (i64, i1) -> ()
      call @backward0(%c1, %f) : (i64, i1) -> ()
      rt.wait_sends
      return
    }
    func.func private @forward0(%mb: i64, %first: i1) attributes {rt.part = "forward"} {
      %table = rt.buffer <params> 0 : memref<16xf32>
      rt.send(%table) microbatch %mb {offset = 1 : i64, tag = 2 : i64} : memref<16xf32>
      %act = rt.buffer <arena> 0 : memref<8xf32>
      rt.send(%act) microbatch %mb {offset = 1 : i64, tag = 0 : i64} : memref<8xf32>
      rt.flush_sends
      return
    }
    func.func private @backward0(%mb: i64, %first: i1) attributes {rt.part = "backward"} {
      %grad = rt.buffer <arena> 0 : memref<8xf32>
      rt.recv(%grad) microbatch %mb {offset = 1 : i64, tag = 1 : i64} : memref<8xf32>
      return
    }
  }
  module @stage1 attributes {pipe.rank = 1 : i64} {
    func.func @train_step() {
      %c0 = arith.constant 0 : i64
      %c1 = arith.constant 1 : i64
      %t = arith.constant true
      %f = arith.constant false
      call @forward0(%c0, %t) : (i64, i1) -> ()
      call @backward0(%c0, %t) : (i64, i1) -> ()
      call @forward0(%c1, %f) : (i64, i1) -> ()
      call @backward0(%c1, %f) : (i64, i1) -> ()
      rt.wait_sends
      return
    }
    func.func private @forward0(%mb: i64, %first: i1) attributes {rt.part = "forward"} {
      %act = rt.buffer <arena> 0 : memref<8xf32>
      rt.recv(%act) microbatch %mb {offset = -1 : i64, tag = 0 : i64} : memref<8xf32>
      return
    }
    func.func private @backward0(%mb: i64, %first: i1) attributes {rt.part = "backward"} {
      %table = rt.buffer <arena> 64 : memref<16xf32>
      rt.recv(%table) microbatch %mb {offset = -1 : i64, tag = 2 : i64} : memref<16xf32>
      %grad = rt.buffer <arena> 0 : memref<8xf32>
      rt.send(%grad) microbatch %mb {offset = -1 : i64, tag = 1 : i64} : memref<8xf32>
      rt.flush_sends
      return
    }
  }
}

// -----

// Stage 0 waits for a gradient before it sends the activation stage 1
// needs first: both would wait forever.
// expected-error @below {{pipeline rank 0 would wait forever: its backward of microbatch 0 receives message 1 from rank 1, which is never sent in turn}}
module attributes {dist.mesh = #dist.mesh<pp = 2>} {
  module @stage0 attributes {pipe.rank = 0 : i64} {
    func.func @train_step() {
      %c0 = arith.constant 0 : i64
      %t = arith.constant true
      call @backward0(%c0, %t) : (i64, i1) -> ()
      call @forward0(%c0, %t) : (i64, i1) -> ()
      rt.wait_sends
      return
    }
    func.func private @forward0(%mb: i64, %first: i1) attributes {rt.part = "forward"} {
      %act = rt.buffer <arena> 0 : memref<8xf32>
      rt.send(%act) microbatch %mb {offset = 1 : i64, tag = 0 : i64} : memref<8xf32>
      rt.flush_sends
      return
    }
    func.func private @backward0(%mb: i64, %first: i1) attributes {rt.part = "backward"} {
      %grad = rt.buffer <arena> 0 : memref<8xf32>
      rt.recv(%grad) microbatch %mb {offset = 1 : i64, tag = 1 : i64} : memref<8xf32>
      return
    }
  }
  module @stage1 attributes {pipe.rank = 1 : i64} {
    func.func @train_step() {
      %c0 = arith.constant 0 : i64
      %t = arith.constant true
      call @forward0(%c0, %t) : (i64, i1) -> ()
      call @backward0(%c0, %t) : (i64, i1) -> ()
      rt.wait_sends
      return
    }
    func.func private @forward0(%mb: i64, %first: i1) attributes {rt.part = "forward"} {
      %act = rt.buffer <arena> 0 : memref<8xf32>
      rt.recv(%act) microbatch %mb {offset = -1 : i64, tag = 0 : i64} : memref<8xf32>
      return
    }
    func.func private @backward0(%mb: i64, %first: i1) attributes {rt.part = "backward"} {
      %grad = rt.buffer <arena> 0 : memref<8xf32>
      rt.send(%grad) microbatch %mb {offset = -1 : i64, tag = 1 : i64} : memref<8xf32>
      rt.flush_sends
      return
    }
  }
}

// -----

// The last stage's update sends the tied table's gradient to the first
// stage, then both join the norm's sum over the pipeline. Queued and never
// flushed before that collective, the send waits behind it on the device,
// and the first stage waits for the send in front of it.
// expected-error @below {{pipeline rank 0 would wait forever: its update of microbatch 0 receives message 3 from rank 1, which is never sent in turn}}
module attributes {dist.mesh = #dist.mesh<pp = 2>} {
  module @stage0 attributes {pipe.rank = 0 : i64} {
    func.func @train_step() {
      %c0 = arith.constant 0 : i64
      %t = arith.constant true
      call @update(%c0, %t) : (i64, i1) -> ()
      rt.wait_sends
      return
    }
    func.func private @update(%mb: i64, %first: i1) attributes {rt.part = "update"} {
      %grad = rt.buffer <arena> 0 : memref<8xf32>
      rt.recv(%grad) microbatch %mb {offset = 1 : i64, tag = 3 : i64} : memref<8xf32>
      %norm = rt.buffer <arena> 64 : memref<f32>
      rt.all_reduce(%norm) {axes = #dist.axes<pp>} : memref<f32>
      return
    }
  }
  module @stage1 attributes {pipe.rank = 1 : i64} {
    func.func @train_step() {
      %c0 = arith.constant 0 : i64
      %t = arith.constant true
      call @update(%c0, %t) : (i64, i1) -> ()
      rt.wait_sends
      return
    }
    func.func private @update(%mb: i64, %first: i1) attributes {rt.part = "update"} {
      %grad = rt.buffer <arena> 0 : memref<8xf32>
      rt.send(%grad) microbatch %mb {offset = -1 : i64, tag = 3 : i64} : memref<8xf32>
      %norm = rt.buffer <arena> 64 : memref<f32>
      rt.all_reduce(%norm) {axes = #dist.axes<pp>} : memref<f32>
      return
    }
  }
}

// -----

// Flushed right after it (as convert-pipe-to-rt emits the update), the
// send goes out before the collective.
// CHECK-LABEL: module @stage1
// CHECK: rt.send(%{{.*}}) microbatch %{{.*}} {offset = -1 : i64, order = array<i64: 0>, tag = 3 : i64}
// CHECK-NEXT: rt.flush_sends
module attributes {dist.mesh = #dist.mesh<pp = 2>} {
  module @stage0 attributes {pipe.rank = 0 : i64} {
    func.func @train_step() {
      %c0 = arith.constant 0 : i64
      %t = arith.constant true
      call @update(%c0, %t) : (i64, i1) -> ()
      rt.wait_sends
      return
    }
    func.func private @update(%mb: i64, %first: i1) attributes {rt.part = "update"} {
      %grad = rt.buffer <arena> 0 : memref<8xf32>
      rt.recv(%grad) microbatch %mb {offset = 1 : i64, tag = 3 : i64} : memref<8xf32>
      %norm = rt.buffer <arena> 64 : memref<f32>
      rt.all_reduce(%norm) {axes = #dist.axes<pp>} : memref<f32>
      return
    }
  }
  module @stage1 attributes {pipe.rank = 1 : i64} {
    func.func @train_step() {
      %c0 = arith.constant 0 : i64
      %t = arith.constant true
      call @update(%c0, %t) : (i64, i1) -> ()
      rt.wait_sends
      return
    }
    func.func private @update(%mb: i64, %first: i1) attributes {rt.part = "update"} {
      %grad = rt.buffer <arena> 0 : memref<8xf32>
      rt.send(%grad) microbatch %mb {offset = -1 : i64, tag = 3 : i64} : memref<8xf32>
      rt.flush_sends
      %norm = rt.buffer <arena> 64 : memref<f32>
      rt.all_reduce(%norm) {axes = #dist.axes<pp>} : memref<f32>
      return
    }
  }
}

// -----

// Waiting for the step's sends before the update, as the step once did,
// resets each channel's turn: the update's send (order 1, after the
// forward's activation) is never issued.
// expected-error @below {{pipeline rank 1 never issues its send of order 1 to rank 0 (its turn on the channel is 0 when the step waits for its sends)}}
module attributes {dist.mesh = #dist.mesh<pp = 2>} {
  module @stage0 attributes {pipe.rank = 0 : i64} {
    func.func @train_step() {
      %c0 = arith.constant 0 : i64
      %t = arith.constant true
      call @forward0(%c0, %t) : (i64, i1) -> ()
      call @update(%c0, %t) : (i64, i1) -> ()
      rt.wait_sends
      return
    }
    func.func private @forward0(%mb: i64, %first: i1) attributes {rt.part = "forward"} {
      %act = rt.buffer <arena> 0 : memref<8xf32>
      rt.recv(%act) microbatch %mb {offset = 1 : i64, tag = 0 : i64} : memref<8xf32>
      return
    }
    func.func private @update(%mb: i64, %first: i1) attributes {rt.part = "update"} {
      %grad = rt.buffer <arena> 0 : memref<8xf32>
      rt.recv(%grad) microbatch %mb {offset = 1 : i64, tag = 3 : i64} : memref<8xf32>
      return
    }
  }
  module @stage1 attributes {pipe.rank = 1 : i64} {
    func.func @train_step() {
      %c0 = arith.constant 0 : i64
      %t = arith.constant true
      call @forward0(%c0, %t) : (i64, i1) -> ()
      rt.wait_sends
      call @update(%c0, %t) : (i64, i1) -> ()
      rt.wait_sends
      return
    }
    func.func private @forward0(%mb: i64, %first: i1) attributes {rt.part = "forward"} {
      %act = rt.buffer <arena> 0 : memref<8xf32>
      rt.send(%act) microbatch %mb {offset = -1 : i64, tag = 0 : i64} : memref<8xf32>
      rt.flush_sends
      return
    }
    func.func private @update(%mb: i64, %first: i1) attributes {rt.part = "update"} {
      %grad = rt.buffer <arena> 0 : memref<8xf32>
      rt.send(%grad) microbatch %mb {offset = -1 : i64, tag = 3 : i64} : memref<8xf32>
      rt.flush_sends
      return
    }
  }
}
