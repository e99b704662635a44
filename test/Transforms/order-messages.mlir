// RUN: tessel-opt %s --split-input-file --tessel-order-messages --verify-diagnostics | FileCheck %s

// Each send learns, per microbatch, its place in the sequence its receiver
// takes messages on that channel (NCCL matches in order, not by tag). Stage
// 0 sends a table (tag 2) before each activation (tag 0); stage 1 takes the
// activation in its forward and the table only in its backward, so on the
// channel 0 -> 1 the receiver's order is act 0, table 0, act 1, table 1.

// CHECK-LABEL: module @stage0
// CHECK: rt.send(%{{.*}}) microbatch %{{.*}} {offset = 1 : i64, order = array<i64: 1, 3>, tag = 2 : i64}
// CHECK: rt.send(%{{.*}}) microbatch %{{.*}} {offset = 1 : i64, order = array<i64: 0, 2>, tag = 0 : i64}
// CHECK-LABEL: module @stage1
// CHECK: rt.send(%{{.*}}) microbatch %{{.*}} {offset = -1 : i64, order = array<i64: 0, 1>, tag = 1 : i64}
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
      return
    }
    func.func private @forward0(%mb: i64, %first: i1) attributes {rt.part = "forward"} {
      %table = rt.buffer <params> 0 : memref<16xf32>
      rt.send(%table) microbatch %mb {offset = 1 : i64, tag = 2 : i64} : memref<16xf32>
      %act = rt.buffer <arena> 0 : memref<8xf32>
      rt.send(%act) microbatch %mb {offset = 1 : i64, tag = 0 : i64} : memref<8xf32>
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
      return
    }
    func.func private @forward0(%mb: i64, %first: i1) attributes {rt.part = "forward"} {
      %act = rt.buffer <arena> 0 : memref<8xf32>
      rt.send(%act) microbatch %mb {offset = 1 : i64, tag = 0 : i64} : memref<8xf32>
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
      return
    }
  }
}
