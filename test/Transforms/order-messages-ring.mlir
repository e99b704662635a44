// RUN: tessel-opt %s --split-input-file --tessel-order-messages | FileCheck %s --check-prefixes=CHECK,CUDA
// RUN: tessel-opt %s --split-input-file --tessel-order-messages=target=cpu | FileCheck %s --check-prefixes=CHECK,CPU

// The send ring: the copies of the forward and backward parts' sends take
// rt.send_ring_slots slots in turn, and a send whose slot still holds a
// message waits until it has been received. The count is the smallest with
// which no rank waits forever, the same for every program of the job, and
// does not grow with the microbatches.

// 1F1B over two stages and four microbatches: one slot per rank, on both
// targets; the update's send (the tied table's gradient) keeps a buffer of
// its own. The CPU target orders nothing (MPI matches tags).
// CHECK-LABEL: module @stage0 attributes {pipe.rank = 0 : i64, rt.send_ring_slots = 1 : i64, rt.send_slot_bytes = 32 : i64}
// CUDA: rt.send(%{{.*}}) microbatch %{{.*}} {offset = 1 : i64, order = array<i64: 0, 1, 2, 3>, ring, tag = 0 : i64}
// CPU: rt.send(%{{.*}}) microbatch %{{.*}} {offset = 1 : i64, ring, tag = 0 : i64}
// CHECK-LABEL: module @stage1 attributes {pipe.rank = 1 : i64, rt.send_ring_slots = 1 : i64, rt.send_slot_bytes = 32 : i64}
// CHECK: rt.send(%{{.*}}) microbatch %{{.*}} {offset = -1 : i64, {{(order = array<i64: 0, 1, 2, 3>, )?}}ring, tag = 1 : i64}
// CHECK: func.func private @update
// CUDA: rt.send(%{{.*}}) microbatch %{{.*}} {offset = -1 : i64, order = array<i64: 4>, tag = 2 : i64}
// CPU: rt.send(%{{.*}}) microbatch %{{.*}} {offset = -1 : i64, tag = 2 : i64}
module attributes {dist.mesh = #dist.mesh<pp = 2>} {
  module @stage0 attributes {pipe.rank = 0 : i64} {
    func.func @train_step() {
      %c0 = arith.constant 0 : i64
      %c1 = arith.constant 1 : i64
      %c2 = arith.constant 2 : i64
      %c3 = arith.constant 3 : i64
      %t = arith.constant true
      %f = arith.constant false
      call @forward0(%c0, %t) : (i64, i1) -> ()
      call @forward0(%c1, %f) : (i64, i1) -> ()
      call @backward0(%c0, %t) : (i64, i1) -> ()
      call @forward0(%c2, %f) : (i64, i1) -> ()
      call @backward0(%c1, %f) : (i64, i1) -> ()
      call @forward0(%c3, %f) : (i64, i1) -> ()
      call @backward0(%c2, %f) : (i64, i1) -> ()
      call @backward0(%c3, %f) : (i64, i1) -> ()
      call @update(%c0, %t) : (i64, i1) -> ()
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
    func.func private @update(%mb: i64, %first: i1) attributes {rt.part = "update"} {
      %table = rt.buffer <arena> 64 : memref<64xf32>
      rt.recv(%table) microbatch %mb {offset = 1 : i64, tag = 2 : i64} : memref<64xf32>
      return
    }
  }
  module @stage1 attributes {pipe.rank = 1 : i64} {
    func.func @train_step() {
      %c0 = arith.constant 0 : i64
      %c1 = arith.constant 1 : i64
      %c2 = arith.constant 2 : i64
      %c3 = arith.constant 3 : i64
      %t = arith.constant true
      %f = arith.constant false
      call @forward0(%c0, %t) : (i64, i1) -> ()
      call @backward0(%c0, %t) : (i64, i1) -> ()
      call @forward0(%c1, %f) : (i64, i1) -> ()
      call @backward0(%c1, %f) : (i64, i1) -> ()
      call @forward0(%c2, %f) : (i64, i1) -> ()
      call @backward0(%c2, %f) : (i64, i1) -> ()
      call @forward0(%c3, %f) : (i64, i1) -> ()
      call @backward0(%c3, %f) : (i64, i1) -> ()
      call @update(%c0, %t) : (i64, i1) -> ()
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
    func.func private @update(%mb: i64, %first: i1) attributes {rt.part = "update"} {
      %table = rt.buffer <arena> 64 : memref<64xf32>
      rt.send(%table) microbatch %mb {offset = -1 : i64, tag = 2 : i64} : memref<64xf32>
      rt.flush_sends
      return
    }
  }
}

// -----

// Stage 1 takes microbatch 1's activation before microbatch 0's. With one
// slot, stage 0's second send would wait until the first is received, which
// stage 1 only does after the second: both targets need two slots. (On
// CUDA the first is not even issued then, as its turn comes second.)
// CHECK-LABEL: module @stage0 attributes {pipe.rank = 0 : i64, rt.send_ring_slots = 2 : i64, rt.send_slot_bytes = 32 : i64}
// CUDA: rt.send(%{{.*}}) microbatch %{{.*}} {offset = 1 : i64, order = array<i64: 1, 0>, ring, tag = 0 : i64}
// CPU: rt.send(%{{.*}}) microbatch %{{.*}} {offset = 1 : i64, ring, tag = 0 : i64}
// CHECK-LABEL: module @stage1 attributes {pipe.rank = 1 : i64}
// CHECK-NOT: rt.send_ring_slots
module attributes {dist.mesh = #dist.mesh<pp = 2>} {
  module @stage0 attributes {pipe.rank = 0 : i64} {
    func.func @train_step() {
      %c0 = arith.constant 0 : i64
      %c1 = arith.constant 1 : i64
      %t = arith.constant true
      %f = arith.constant false
      call @forward0(%c0, %t) : (i64, i1) -> ()
      call @forward0(%c1, %f) : (i64, i1) -> ()
      rt.wait_sends
      return
    }
    func.func private @forward0(%mb: i64, %first: i1) attributes {rt.part = "forward"} {
      %act = rt.buffer <arena> 0 : memref<8xf32>
      rt.send(%act) microbatch %mb {offset = 1 : i64, tag = 0 : i64} : memref<8xf32>
      rt.flush_sends
      return
    }
  }
  module @stage1 attributes {pipe.rank = 1 : i64} {
    func.func @train_step() {
      %c0 = arith.constant 0 : i64
      %c1 = arith.constant 1 : i64
      %t = arith.constant true
      %f = arith.constant false
      call @forward0(%c1, %t) : (i64, i1) -> ()
      call @forward0(%c0, %f) : (i64, i1) -> ()
      rt.wait_sends
      return
    }
    func.func private @forward0(%mb: i64, %first: i1) attributes {rt.part = "forward"} {
      %act = rt.buffer <arena> 0 : memref<8xf32>
      rt.recv(%act) microbatch %mb {offset = -1 : i64, tag = 0 : i64} : memref<8xf32>
      return
    }
  }
}
