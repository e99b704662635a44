// RUN: tessel-opt %s --split-input-file --verify-diagnostics --tessel-schedule-pipeline | FileCheck %s

// The schedule of the module's pipe.layout over its pp ranks becomes a
// pipe.schedule op at the top of the module: per rank, its forward and
// backward steps and the transfers between them, in the order they run.

// 1F1B on two ranks with two microbatches: rank 0 runs one forward ahead
// (pp - rank - 1 = 1 warm-up forward), then alternates; rank 1, the last,
// follows each forward by its backward at once and sends the gradient back.
// CHECK-LABEL: module attributes {dist.mesh = #dist.mesh<pp = 2>
// CHECK-NEXT:  pipe.schedule "1f1b" ranks 2 microbatches 2 virtual_stages 1 {
// CHECK-NEXT:    pipe.rank 0 {
// CHECK-NEXT:      pipe.forward stage 0 microbatch 0
// CHECK-NEXT:      pipe.send "activation" stage 0 microbatch 0 to 1
// CHECK-NEXT:      pipe.forward stage 0 microbatch 1
// CHECK-NEXT:      pipe.send "activation" stage 0 microbatch 1 to 1
// CHECK-NEXT:      pipe.recv "gradient" stage 1 microbatch 0 from 1
// CHECK-NEXT:      pipe.backward stage 0 microbatch 0
// CHECK-NEXT:      pipe.recv "gradient" stage 1 microbatch 1 from 1
// CHECK-NEXT:      pipe.backward stage 0 microbatch 1
// CHECK-NEXT:    }
// CHECK-NEXT:    pipe.rank 1 {
// CHECK-NEXT:      pipe.recv "activation" stage 0 microbatch 0 from 0
// CHECK-NEXT:      pipe.forward stage 1 microbatch 0
// CHECK-NEXT:      pipe.backward stage 1 microbatch 0
// CHECK-NEXT:      pipe.send "gradient" stage 1 microbatch 0 to 0
// CHECK-NEXT:      pipe.recv "activation" stage 0 microbatch 1 from 0
// CHECK-NEXT:      pipe.forward stage 1 microbatch 1
// CHECK-NEXT:      pipe.backward stage 1 microbatch 1
// CHECK-NEXT:      pipe.send "gradient" stage 1 microbatch 1 to 0
// CHECK-NEXT:    }
// CHECK-NEXT:  }
// CHECK-NEXT:  func.func @stage_0()
module attributes {dist.mesh = #dist.mesh<pp = 2>, pipe.layout = #pipe.layout<microbatches = 2, schedule = "1f1b", virtual_stages = 1>} {
  func.func @stage_0() attributes {pipe.rank = 0 : i64} {
    return
  }
}

// -----

// GPipe: every forward in microbatch order, then every backward in reverse
// microbatch order, on both ranks.
// CHECK-LABEL: module attributes {dist.mesh = #dist.mesh<pp = 2>
// CHECK-NEXT:  pipe.schedule "gpipe" ranks 2 microbatches 2 virtual_stages 1 {
// CHECK-NEXT:    pipe.rank 0 {
// CHECK-NEXT:      pipe.forward stage 0 microbatch 0
// CHECK-NEXT:      pipe.send "activation" stage 0 microbatch 0 to 1
// CHECK-NEXT:      pipe.forward stage 0 microbatch 1
// CHECK-NEXT:      pipe.send "activation" stage 0 microbatch 1 to 1
// CHECK-NEXT:      pipe.recv "gradient" stage 1 microbatch 1 from 1
// CHECK-NEXT:      pipe.backward stage 0 microbatch 1
// CHECK-NEXT:      pipe.recv "gradient" stage 1 microbatch 0 from 1
// CHECK-NEXT:      pipe.backward stage 0 microbatch 0
// CHECK-NEXT:    }
// CHECK-NEXT:    pipe.rank 1 {
// CHECK-NEXT:      pipe.recv "activation" stage 0 microbatch 0 from 0
// CHECK-NEXT:      pipe.forward stage 1 microbatch 0
// CHECK-NEXT:      pipe.recv "activation" stage 0 microbatch 1 from 0
// CHECK-NEXT:      pipe.forward stage 1 microbatch 1
// CHECK-NEXT:      pipe.backward stage 1 microbatch 1
// CHECK-NEXT:      pipe.send "gradient" stage 1 microbatch 1 to 0
// CHECK-NEXT:      pipe.backward stage 1 microbatch 0
// CHECK-NEXT:      pipe.send "gradient" stage 1 microbatch 0 to 0
// CHECK-NEXT:    }
// CHECK-NEXT:  }
module attributes {dist.mesh = #dist.mesh<pp = 2>, pipe.layout = #pipe.layout<microbatches = 2, schedule = "gpipe", virtual_stages = 1>} {
}

// -----

// One pipeline rank has no pipeline, whatever the schedule is called: each
// microbatch's forward is followed by its backward (one arena slot
// suffices), and nothing is sent.
// CHECK-LABEL: module attributes {dist.mesh = #dist.mesh<dp = 2>
// CHECK-NEXT:  pipe.schedule "1f1b" ranks 1 microbatches 2 virtual_stages 1 {
// CHECK-NEXT:    pipe.rank 0 {
// CHECK-NEXT:      pipe.forward stage 0 microbatch 0
// CHECK-NEXT:      pipe.backward stage 0 microbatch 0
// CHECK-NEXT:      pipe.forward stage 0 microbatch 1
// CHECK-NEXT:      pipe.backward stage 0 microbatch 1
// CHECK-NEXT:    }
// CHECK-NEXT:  }
module attributes {dist.mesh = #dist.mesh<dp = 2>, pipe.layout = #pipe.layout<microbatches = 2, schedule = "gpipe", virtual_stages = 1>} {
}

// -----

// A schedule already in the module is replaced by the layout's.
// CHECK-LABEL: module attributes {dist.mesh = #dist.mesh<pp = 2>
// CHECK-NEXT:  pipe.schedule "1f1b" ranks 2 microbatches 1 virtual_stages 1 {
// CHECK-NOT:   pipe.schedule
// CHECK:       func.func @stage_0
module attributes {dist.mesh = #dist.mesh<pp = 2>, pipe.layout = #pipe.layout<microbatches = 1, schedule = "1f1b", virtual_stages = 1>} {
  pipe.schedule "gpipe" ranks 1 microbatches 1 virtual_stages 1 {
    pipe.rank 0 {
      pipe.forward stage 0 microbatch 0
      pipe.backward stage 0 microbatch 0
    }
  }
  func.func @stage_0() attributes {pipe.rank = 0 : i64} {
    return
  }
}

// -----

// A schedule that cannot be generated is an error naming why.
// expected-error@+1 {{tessel-schedule-pipeline: the interleaved schedule needs the microbatches to be a multiple of the pipeline ranks (and at least as many): 3 microbatches, 2 ranks}}
module attributes {dist.mesh = #dist.mesh<pp = 2>, pipe.layout = #pipe.layout<microbatches = 3, schedule = "interleaved", virtual_stages = 2>} {
}
