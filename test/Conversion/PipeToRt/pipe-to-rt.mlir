// RUN: tessel-opt %s --split-input-file --verify-diagnostics --convert-pipe-to-rt | FileCheck %s
// RUN: tessel-opt %S/Inputs/interleaved.mlir --tessel-schedule-pipeline --convert-pipe-to-rt | FileCheck %s --check-prefix=CHUNKS

// Each rank program becomes a module of its own (program0 with one pipeline
// rank, stageN with several) carrying the memory plan's attributes. Each
// part becomes a private function of (microbatch, first run), named by its
// kind and chunk; the step, train_step, declares the parameters and calls
// the parts in the order of the rank's pipe.schedule, then the update once.

// One rank, one microbatch: forward, backward, update, each on microbatch 0
// as its first run. Nothing is sent, so nothing is flushed or waited for;
// nothing is accumulated. The update hands the loss and the norm (what it
// yields) to the runtime.
// CHECK-LABEL: module @program0 attributes {pipe.rank = 0 : i64, rt.accumulator_elems = 0 : i64, rt.arena_bytes = 128 : i64, rt.arena_slots = 1 : i64, rt.microbatches = 1 : i64, rt.norm_sums = 0 : i64, rt.param_elems = 8 : i64, rt.request_slots = 1 : i64}
// CHECK: func.func @train_step() {
// CHECK-DAG: %[[TRUE:.*]] = arith.constant true
// CHECK-DAG: %[[ZERO:.*]] = arith.constant 0 : i64
// CHECK: rt.param "b" {{.*}}offset = 0 : i64
// CHECK-NEXT: call @forward0(%[[ZERO]], %[[TRUE]]) : (i64, i1) -> ()
// CHECK-NEXT: call @backward0(%[[ZERO]], %[[TRUE]]) : (i64, i1) -> ()
// CHECK-NEXT: call @update(%[[ZERO]], %[[TRUE]]) : (i64, i1) -> ()
// CHECK-NEXT: return
// CHECK: func.func private @forward0(%{{.*}}: i64, %{{.*}}: i1) attributes {rt.part = "forward", rt.part_calls = 1 : i64, rt.part_chunk = 0 : i64}
// CHECK: rt.fill
// CHECK-NEXT: return
// CHECK: func.func private @backward0(%{{.*}}: i64, %{{.*}}: i1) attributes {rt.part = "backward", rt.part_calls = 1 : i64, rt.part_chunk = 0 : i64}
// CHECK: rt.all_reduce_start
// CHECK-NEXT: return
// CHECK: func.func private @update(%{{.*}}: i64, %{{.*}}: i1) attributes {rt.part = "update", rt.part_calls = 1 : i64}
// CHECK-NEXT: rt.wait_requests {count = 1 : i64, first = 0 : i64}
// CHECK-NEXT: %[[N:.*]] = rt.buffer <arena> 64 : memref<f32>
// CHECK: %[[L:.*]] = rt.buffer <arena> 0 : memref<f32>
// CHECK-NEXT: rt.all_reduce(%[[L]])
// CHECK-NEXT: rt.finish_step(%[[L]], %[[N]]) : memref<f32>, memref<f32>
// CHECK-NEXT: return
// CHECK-NOT: rt.accumulate
// CHECK-NOT: rt.flush_sends
// CHECK-NOT: rt.wait_sends
module attributes {dist.mesh = #dist.mesh<dp = 2>} {
  pipe.schedule "1f1b" ranks 1 microbatches 1 virtual_stages 1 {
    pipe.rank 0 {
      pipe.forward stage 0 microbatch 0
      pipe.backward stage 0 microbatch 0
    }
  }
  func.func @train_step() -> (memref<f32>, memref<f32>) attributes {pipe.rank = 0 : i64, rt.accumulator_elems = 0 : i64, rt.arena_bytes = 128 : i64, rt.norm_sums = 0 : i64, rt.param_elems = 8 : i64, rt.request_slots = 1 : i64} {
    %b = rt.param "b" {decay = false, global_shape = array<i64: 8>, init = "zeros", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64, offset = 0 : i64} : memref<8xf32>
    %f = pipe.forward_pass chunk 0 -> memref<f32> {
      %ids = rt.batch "tokens" : memref<2x4xi32>
      %l = rt.buffer <arena> 0 : memref<f32>
      rt.fill(%l) {n = 1 : i64, value = 0.5 : f64} : memref<f32>
      pipe.yield %l : memref<f32>
    }
    %r = pipe.backward_pass chunk 0 -> !rt.request {
      %gb = rt.buffer <grads> 0 : memref<8xf32>
      rt.fill(%gb) {n = 8 : i64, value = 1.0 : f64} : memref<8xf32>
      %q = rt.all_reduce_start(%gb) {axes = #dist.axes<dp>, slot = 0 : i64} : memref<8xf32>
      pipe.yield %q : !rt.request
    }
    %u:2 = pipe.update(%r, %f : !rt.request, memref<f32>) -> memref<f32>, memref<f32> {
    ^bb0(%q: !rt.request, %loss: memref<f32>):
      rt.wait_requests {first = 0 : i64, count = 1 : i64}
      %n = rt.buffer <arena> 64 : memref<f32>
      rt.fill(%n) {n = 1 : i64, value = 1.0 : f64} : memref<f32>
      %l = rt.buffer <arena> 0 : memref<f32>
      rt.all_reduce(%l) {axes = #dist.axes<dp>} : memref<f32>
      pipe.yield %l, %n : memref<f32>, memref<f32>
    }
    return %u#0, %u#1 : memref<f32>, memref<f32>
  }
}

// -----

// Two pipeline ranks, two microbatches, 1F1B: one program per rank, each
// calling its parts in its own order (rank 0: both forwards, then both
// backwards; rank 1: forward and backward alternating), a part's first run
// marked. The microbatch a transfer is keyed by is the part's argument; a
// part that sends flushes its sends at its end, and the step waits for
// every send before the update overwrites what was sent. A part's
// rt.first_run (whether this call is the part's first in the step, which
// the memory plan's accumulations read) is the function's argument.
// CHECK-LABEL: module @stage0 attributes {pipe.rank = 0 : i64, {{.*}}rt.arena_slots = 2 : i64, rt.microbatches = 2 : i64
// CHECK: func.func @train_step() {
// CHECK-DAG: %[[FALSE:.*]] = arith.constant false
// CHECK-DAG: %[[ONE:.*]] = arith.constant 1 : i64
// CHECK-DAG: %[[TRUE:.*]] = arith.constant true
// CHECK-DAG: %[[ZERO:.*]] = arith.constant 0 : i64
// CHECK: rt.param "w"
// CHECK-NEXT: call @forward0(%[[ZERO]], %[[TRUE]])
// CHECK-NEXT: call @forward0(%[[ONE]], %[[FALSE]])
// CHECK-NEXT: call @backward0(%[[ZERO]], %[[TRUE]])
// CHECK-NEXT: call @backward0(%[[ONE]], %[[FALSE]])
// CHECK-NEXT: call @update(%[[ZERO]], %[[TRUE]])
// CHECK-NEXT: rt.wait_sends
// CHECK-NEXT: return
// CHECK: func.func private @forward0(%[[MB:.*]]: i64, %{{.*}}: i1)
// CHECK-NOT: rt.microbatch
// CHECK: rt.send(%{{.*}}) microbatch %[[MB]] {offset = 1 : i64, tag = 0 : i64}
// CHECK-NEXT: rt.flush_sends
// CHECK-NEXT: return
// CHECK: func.func private @backward0(%[[MB:.*]]: i64, %[[FIRST:.*]]: i1)
// CHECK: rt.recv(%{{.*}}) microbatch %[[MB]] {offset = 1 : i64, tag = 1 : i64}
// CHECK: %[[G:.*]] = rt.buffer <arena> 128 : memref<8xf32>
// CHECK-NEXT: rt.reduce_sum_leading(%{{.*}}, %[[G]])
// CHECK-NEXT: %[[ACC:.*]] = rt.buffer <grads> 0 : memref<8xf32>
// CHECK-NEXT: rt.accumulate(%[[G]], %[[ACC]], %[[FIRST]]) {n = 8 : i64} : memref<8xf32>, memref<8xf32>, i1
// CHECK-NEXT: return
// CHECK: func.func private @update
// CHECK: rt.finish_step

// CHECK-LABEL: module @stage1 attributes {pipe.rank = 1 : i64, rt.accumulator_elems = 1 : i64
// CHECK: func.func @train_step() {
// CHECK: rt.param "v"
// CHECK-NEXT: call @forward0(%[[ZERO:.*]], %[[TRUE:.*]]) :
// CHECK-NEXT: call @backward0(%[[ZERO]], %[[TRUE]])
// CHECK-NEXT: call @forward0(%[[ONE:.*]], %[[FALSE:.*]]) :
// CHECK-NEXT: call @backward0(%[[ONE]], %[[FALSE]])
// CHECK-NEXT: call @update(%[[ZERO]], %[[TRUE]])
// CHECK-NEXT: rt.wait_sends
// The loss, yielded by the forward pass, is accumulated there, on the
// function's first-run argument.
// CHECK: func.func private @forward0(%[[MB:.*]]: i64, %[[FIRST:.*]]: i1)
// CHECK-NEXT: %[[X:.*]] = rt.buffer <arena> 0 : memref<2x8xf32>
// CHECK-NEXT: rt.recv(%[[X]]) microbatch %[[MB]] {offset = -1 : i64, tag = 0 : i64}
// CHECK-NEXT: %[[L:.*]] = rt.buffer <arena> 64 : memref<f32>
// CHECK-NEXT: rt.fill(%[[L]])
// CHECK-NEXT: %[[ACC:.*]] = rt.buffer <accumulators> 0 : memref<f32>
// CHECK-NEXT: rt.accumulate(%[[L]], %[[ACC]], %[[FIRST]]) {n = 1 : i64}
// CHECK-NEXT: return
// The sending part flushes after its accumulation, last.
// CHECK: func.func private @backward0(%[[MB:.*]]: i64, %[[FIRST:.*]]: i1)
// CHECK: rt.send(%{{.*}}) microbatch %[[MB]] {offset = -1 : i64, tag = 1 : i64}
// CHECK: rt.accumulate(%{{.*}}, %{{.*}}, %[[FIRST]]) {n = 8 : i64}
// CHECK-NEXT: rt.flush_sends
// CHECK-NEXT: return
module attributes {dist.mesh = #dist.mesh<pp = 2>, pipe.layout = #pipe.layout<microbatches = 2, schedule = "1f1b", virtual_stages = 1>} {
  pipe.schedule "1f1b" ranks 2 microbatches 2 virtual_stages 1 {
    pipe.rank 0 {
      pipe.forward stage 0 microbatch 0
      pipe.send "activation" stage 0 microbatch 0 to 1
      pipe.forward stage 0 microbatch 1
      pipe.send "activation" stage 0 microbatch 1 to 1
      pipe.recv "gradient" stage 1 microbatch 0 from 1
      pipe.backward stage 0 microbatch 0
      pipe.recv "gradient" stage 1 microbatch 1 from 1
      pipe.backward stage 0 microbatch 1
    }
    pipe.rank 1 {
      pipe.recv "activation" stage 0 microbatch 0 from 0
      pipe.forward stage 1 microbatch 0
      pipe.backward stage 1 microbatch 0
      pipe.send "gradient" stage 1 microbatch 0 to 0
      pipe.recv "activation" stage 0 microbatch 1 from 0
      pipe.forward stage 1 microbatch 1
      pipe.backward stage 1 microbatch 1
      pipe.send "gradient" stage 1 microbatch 1 to 0
    }
  }
  func.func @stage_0() -> (memref<f32>, memref<f32>) attributes {pipe.rank = 0 : i64, rt.accumulator_elems = 0 : i64, rt.arena_bytes = 192 : i64, rt.norm_sums = 0 : i64, rt.param_elems = 8 : i64, rt.request_slots = 0 : i64} {
    %w = rt.param "w" {decay = false, global_shape = array<i64: 8>, init = "zeros", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64, offset = 0 : i64} : memref<8xf32>
    pipe.forward_pass chunk 0 {
      %x = rt.buffer <arena> 0 : memref<2x8xf32>
      rt.fill(%x) {n = 16 : i64, value = 1.0 : f64} : memref<2x8xf32>
      %mb = rt.microbatch : i64
      rt.send(%x) microbatch %mb {offset = 1 : i64, tag = 0 : i64} : memref<2x8xf32>
      pipe.yield
    }
    %g = pipe.backward_pass chunk 0 -> memref<8xf32> {
      %d = rt.buffer <arena> 64 : memref<2x8xf32>
      %mb = rt.microbatch : i64
      rt.recv(%d) microbatch %mb {offset = 1 : i64, tag = 1 : i64} : memref<2x8xf32>
      %gw = rt.buffer <arena> 128 : memref<8xf32>
      rt.reduce_sum_leading(%d, %gw) {rows = 2 : i64, cols = 8 : i64} : memref<2x8xf32>, memref<8xf32>
      %first = rt.first_run : i1
      %acc = rt.buffer <grads> 0 : memref<8xf32>
      rt.accumulate(%gw, %acc, %first) {n = 8 : i64} : memref<8xf32>, memref<8xf32>, i1
      pipe.yield %gw : memref<8xf32>
    }
    %u:2 = pipe.update(%g : memref<8xf32>) -> memref<f32>, memref<f32> {
    ^bb0(%a: memref<8xf32>):
      %n = rt.buffer <arena> 0 : memref<f32>
      rt.fill(%n) {n = 1 : i64, value = 1.0 : f64} : memref<f32>
      %l = rt.buffer <arena> 64 : memref<f32>
      rt.fill(%l) {n = 1 : i64, value = 0.0 : f64} : memref<f32>
      rt.all_reduce(%l) {axes = #dist.axes<pp>} : memref<f32>
      pipe.yield %l, %n : memref<f32>, memref<f32>
    }
    return %u#0, %u#1 : memref<f32>, memref<f32>
  }
  func.func @stage_1() -> (memref<f32>, memref<f32>) attributes {pipe.rank = 1 : i64, rt.accumulator_elems = 1 : i64, rt.arena_bytes = 192 : i64, rt.norm_sums = 0 : i64, rt.param_elems = 8 : i64, rt.request_slots = 0 : i64} {
    %w = rt.param "v" {decay = false, global_shape = array<i64: 8>, init = "zeros", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = -1 : i64, shard_axis = #dist.axis<dp>, shard_blocks = 1 : i64, offset = 0 : i64} : memref<8xf32>
    %f = pipe.forward_pass chunk 0 -> memref<f32> {
      %x = rt.buffer <arena> 0 : memref<2x8xf32>
      %mb = rt.microbatch : i64
      rt.recv(%x) microbatch %mb {offset = -1 : i64, tag = 0 : i64} : memref<2x8xf32>
      %l = rt.buffer <arena> 64 : memref<f32>
      rt.fill(%l) {n = 1 : i64, value = 0.5 : f64} : memref<f32>
      %first = rt.first_run : i1
      %acc = rt.buffer <accumulators> 0 : memref<f32>
      rt.accumulate(%l, %acc, %first) {n = 1 : i64} : memref<f32>, memref<f32>, i1
      pipe.yield %l : memref<f32>
    }
    %g = pipe.backward_pass chunk 0 -> memref<8xf32> {
      %d = rt.buffer <arena> 128 : memref<2x8xf32>
      rt.fill(%d) {n = 16 : i64, value = 1.0 : f64} : memref<2x8xf32>
      %mb = rt.microbatch : i64
      rt.send(%d) microbatch %mb {offset = -1 : i64, tag = 1 : i64} : memref<2x8xf32>
      %x = rt.buffer <arena> 0 : memref<2x8xf32>
      %gv = rt.buffer <arena> 64 : memref<8xf32>
      rt.reduce_sum_leading(%x, %gv) {rows = 2 : i64, cols = 8 : i64} : memref<2x8xf32>, memref<8xf32>
      %first = rt.first_run : i1
      %acc = rt.buffer <grads> 0 : memref<8xf32>
      rt.accumulate(%gv, %acc, %first) {n = 8 : i64} : memref<8xf32>, memref<8xf32>, i1
      pipe.yield %gv : memref<8xf32>
    }
    %u:2 = pipe.update(%g, %f : memref<8xf32>, memref<f32>) -> memref<f32>, memref<f32> {
    ^bb0(%a: memref<8xf32>, %b: memref<f32>):
      %n = rt.buffer <arena> 0 : memref<f32>
      rt.fill(%n) {n = 1 : i64, value = 1.0 : f64} : memref<f32>
      %l = rt.buffer <accumulators> 0 : memref<f32>
      rt.all_reduce(%l) {axes = #dist.axes<pp>} : memref<f32>
      pipe.yield %l, %n : memref<f32>, memref<f32>
    }
    return %u#0, %u#1 : memref<f32>, memref<f32>
  }
}

// -----

// expected-error@+1 {{convert-pipe-to-rt: a rank program could not be lowered}}
module {
  // expected-error@+1 {{needs the module's pipe.schedule (run tessel-schedule-pipeline)}}
  func.func @train_step() attributes {pipe.rank = 0 : i64} {
    return
  }
}

// With two model chunks per rank (interleaved 1F1B) the parts of chunk k
// are forwardk and backwardk, called as the schedule runs their stages
// (stages 0 and 2 are rank 0's chunks 0 and 1). Only the part that sends
// flushes.
// CHUNKS-LABEL: module @stage0
// CHUNKS: func.func @train_step() {
// CHUNKS-DAG: %[[FALSE:.*]] = arith.constant false
// CHUNKS-DAG: %[[ONE:.*]] = arith.constant 1 : i64
// CHUNKS-DAG: %[[ZERO:.*]] = arith.constant 0 : i64
// CHUNKS-DAG: %[[TRUE:.*]] = arith.constant true
// CHUNKS: call @forward0(%[[ZERO]], %[[TRUE]])
// CHUNKS-NEXT: call @forward0(%[[ONE]], %[[FALSE]])
// CHUNKS-NEXT: call @forward1(%[[ZERO]], %[[TRUE]])
// CHUNKS-NEXT: call @forward1(%[[ONE]], %[[FALSE]])
// CHUNKS-NEXT: call @backward1(%[[ZERO]], %[[TRUE]])
// CHUNKS-NEXT: call @backward1(%[[ONE]], %[[FALSE]])
// CHUNKS-NEXT: call @backward0(%[[ZERO]], %[[TRUE]])
// CHUNKS-NEXT: call @backward0(%[[ONE]], %[[FALSE]])
// CHUNKS-NEXT: call @update(%[[ZERO]], %[[TRUE]])
// CHUNKS-NEXT: rt.wait_sends
// CHUNKS: func.func private @forward0
// CHUNKS-NOT: rt.flush_sends
// CHUNKS: func.func private @forward1
// CHUNKS: rt.send
// CHUNKS-NEXT: rt.flush_sends
// CHUNKS: func.func private @backward1
// CHUNKS-NOT: rt.flush_sends
// CHUNKS: func.func private @backward0
// CHUNKS-NOT: rt.flush_sends
// CHUNKS: func.func private @update
