// RUN: tessel-opt %s --split-input-file --tessel-share-programs | FileCheck %s

// Pipeline ranks 1 and 2 compute alike on different layers: their programs
// differ in the parameter's name, in their activation slots and in the
// order of their parts (rank 1 warms up with one more forward). They become
// one program, stages1-2, with those differences as data: the names per
// variant, the slots per variant, and a schedule table per variant for the
// run of calls they order differently. The update call, the same on both,
// stays a call. Rank 3 reads another parameter, so it keeps its program.

// CHECK-LABEL: module @"stages1-2" attributes {
// CHECK-SAME: rt.arena_slots = 2 : i64
// CHECK-SAME: rt.serves = ["stage1", "stage2"]
// CHECK-SAME: rt.variant_arena_slots = array<i64: 2, 1>
// CHECK-SAME: rt.variants = array<i64: 1, 2>
// CHECK-NOT: pipe.rank
// CHECK: func.func @train_step()
// CHECK: rt.param "h.1.w" {{.*}}variant_names = ["h.1.w", "h.2.w"]
// CHECK-NEXT: rt.schedule [@forward0, @backward0] [array<i64: 0, 0, 1, 0, 1, 0, 1, 0, 1, 1, 1, 0>, array<i64: 0, 0, 1, 1, 0, 1, 0, 1, 0, 1, 1, 0>]
// CHECK-NEXT: rt.wait_sends
// CHECK-NEXT: call @update(%{{.*}}, %{{.*}})
// CHECK-LABEL: module @stage3 attributes {pipe.rank = 3 : i64
// CHECK-NOT: module @stage1
// CHECK-NOT: module @stage2
module attributes {dist.mesh = #dist.mesh<pp = 4>} {
  module @stage1 attributes {pipe.rank = 1 : i64, rt.arena_bytes = 64 : i64, rt.arena_slots = 2 : i64} {
    func.func @train_step() {
      %c0 = arith.constant 0 : i64
      %c1 = arith.constant 1 : i64
      %t = arith.constant true
      %f = arith.constant false
      %w = rt.param "h.1.w" {decay = true, global_shape = array<i64: 4, 4>, init = "normal", mean = 0.0 : f64, offset = 0 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64, shard_dim = -1 : i64, std = 2.0e-02 : f64} : memref<4x4xf32>
      call @forward0(%c0, %t) : (i64, i1) -> ()
      call @forward0(%c1, %f) : (i64, i1) -> ()
      call @backward0(%c0, %t) : (i64, i1) -> ()
      call @backward0(%c1, %f) : (i64, i1) -> ()
      rt.wait_sends
      call @update(%c0, %t) : (i64, i1) -> ()
      return
    }
    func.func private @forward0(%mb: i64, %first: i1) attributes {rt.part = "forward"} {
      %x = rt.buffer <arena> 0 : memref<4xf32>
      rt.recv(%x) microbatch %mb {offset = -1 : i64, tag = 0 : i64} : memref<4xf32>
      rt.send(%x) microbatch %mb {offset = 1 : i64, tag = 0 : i64} : memref<4xf32>
      return
    }
    func.func private @backward0(%mb: i64, %first: i1) attributes {rt.part = "backward"} {
      %g = rt.buffer <arena> 16 : memref<4xf32>
      rt.recv(%g) microbatch %mb {offset = 1 : i64, tag = 0 : i64} : memref<4xf32>
      rt.send(%g) microbatch %mb {offset = -1 : i64, tag = 0 : i64} : memref<4xf32>
      return
    }
    func.func private @update(%mb: i64, %first: i1) attributes {rt.part = "update"} {
      return
    }
  }
  module @stage2 attributes {pipe.rank = 2 : i64, rt.arena_bytes = 64 : i64, rt.arena_slots = 1 : i64} {
    func.func @train_step() {
      %c0 = arith.constant 0 : i64
      %c1 = arith.constant 1 : i64
      %t = arith.constant true
      %f = arith.constant false
      %w = rt.param "h.2.w" {decay = true, global_shape = array<i64: 4, 4>, init = "normal", mean = 0.0 : f64, offset = 0 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64, shard_dim = -1 : i64, std = 2.0e-02 : f64} : memref<4x4xf32>
      call @forward0(%c0, %t) : (i64, i1) -> ()
      call @backward0(%c0, %t) : (i64, i1) -> ()
      call @forward0(%c1, %f) : (i64, i1) -> ()
      call @backward0(%c1, %f) : (i64, i1) -> ()
      rt.wait_sends
      call @update(%c0, %t) : (i64, i1) -> ()
      return
    }
    func.func private @forward0(%mb: i64, %first: i1) attributes {rt.part = "forward"} {
      %x = rt.buffer <arena> 0 : memref<4xf32>
      rt.recv(%x) microbatch %mb {offset = -1 : i64, tag = 0 : i64} : memref<4xf32>
      rt.send(%x) microbatch %mb {offset = 1 : i64, tag = 0 : i64} : memref<4xf32>
      return
    }
    func.func private @backward0(%mb: i64, %first: i1) attributes {rt.part = "backward"} {
      %g = rt.buffer <arena> 16 : memref<4xf32>
      rt.recv(%g) microbatch %mb {offset = 1 : i64, tag = 0 : i64} : memref<4xf32>
      rt.send(%g) microbatch %mb {offset = -1 : i64, tag = 0 : i64} : memref<4xf32>
      return
    }
    func.func private @update(%mb: i64, %first: i1) attributes {rt.part = "update"} {
      return
    }
  }
  module @stage3 attributes {pipe.rank = 3 : i64, rt.arena_bytes = 64 : i64, rt.arena_slots = 1 : i64} {
    func.func @train_step() {
      %c0 = arith.constant 0 : i64
      %c1 = arith.constant 1 : i64
      %t = arith.constant true
      %f = arith.constant false
      %w = rt.param "h.3.w" {decay = true, global_shape = array<i64: 4, 4>, init = "normal", mean = 0.0 : f64, offset = 0 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64, shard_dim = -1 : i64, std = 2.0e-02 : f64} : memref<4x4xf32>
      %b = rt.param "h.3.b" {decay = false, global_shape = array<i64: 4>, init = "zeros", mean = 0.0 : f64, offset = 16 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64, shard_dim = -1 : i64, std = 2.0e-02 : f64} : memref<4xf32>
      call @forward0(%c0, %t) : (i64, i1) -> ()
      call @backward0(%c0, %t) : (i64, i1) -> ()
      call @forward0(%c1, %f) : (i64, i1) -> ()
      call @backward0(%c1, %f) : (i64, i1) -> ()
      rt.wait_sends
      call @update(%c0, %t) : (i64, i1) -> ()
      return
    }
    func.func private @forward0(%mb: i64, %first: i1) attributes {rt.part = "forward"} {
      %x = rt.buffer <arena> 0 : memref<4xf32>
      rt.recv(%x) microbatch %mb {offset = -1 : i64, tag = 0 : i64} : memref<4xf32>
      rt.send(%x) microbatch %mb {offset = 1 : i64, tag = 0 : i64} : memref<4xf32>
      return
    }
    func.func private @backward0(%mb: i64, %first: i1) attributes {rt.part = "backward"} {
      %g = rt.buffer <arena> 16 : memref<4xf32>
      rt.recv(%g) microbatch %mb {offset = 1 : i64, tag = 0 : i64} : memref<4xf32>
      rt.send(%g) microbatch %mb {offset = -1 : i64, tag = 0 : i64} : memref<4xf32>
      return
    }
    func.func private @update(%mb: i64, %first: i1) attributes {rt.part = "update"} {
      return
    }
  }
}

// -----

// Programs that differ in what a part does (a message's tag here) are not
// alike, whatever else they share; nothing changes.

// CHECK-LABEL: module @stage1 attributes {pipe.rank = 1 : i64
// CHECK-LABEL: module @stage2 attributes {pipe.rank = 2 : i64
// CHECK-NOT: rt.schedule
module attributes {dist.mesh = #dist.mesh<pp = 4>} {
  module @stage1 attributes {pipe.rank = 1 : i64, rt.arena_bytes = 64 : i64} {
    func.func @train_step() {
      %c0 = arith.constant 0 : i64
      %t = arith.constant true
      call @forward0(%c0, %t) : (i64, i1) -> ()
      return
    }
    func.func private @forward0(%mb: i64, %first: i1) attributes {rt.part = "forward"} {
      %x = rt.buffer <arena> 0 : memref<4xf32>
      rt.send(%x) microbatch %mb {offset = 1 : i64, tag = 0 : i64} : memref<4xf32>
      return
    }
  }
  module @stage2 attributes {pipe.rank = 2 : i64, rt.arena_bytes = 64 : i64} {
    func.func @train_step() {
      %c0 = arith.constant 0 : i64
      %t = arith.constant true
      call @forward0(%c0, %t) : (i64, i1) -> ()
      return
    }
    func.func private @forward0(%mb: i64, %first: i1) attributes {rt.part = "forward"} {
      %x = rt.buffer <arena> 0 : memref<4xf32>
      rt.send(%x) microbatch %mb {offset = 1 : i64, tag = 1 : i64} : memref<4xf32>
      return
    }
  }
}
