// RUN: tessel-opt %S/Inputs/dp-forward.mlir --tessel-set-layout="dp=4 tp=2 sp=true schedule=gpipe" | FileCheck %s
// RUN: tessel-opt %S/Inputs/dp-forward.mlir --tessel-set-layout | FileCheck %s --check-prefix=KEEP
// RUN: not tessel-opt %S/Inputs/dp-forward.mlir --tessel-set-layout=microbatches=4 2>&1 | FileCheck %s --check-prefix=MB
// RUN: not tessel-opt %S/Inputs/dp-forward.mlir --tessel-set-layout=sp=yes 2>&1 | FileCheck %s --check-prefix=SP
// RUN: not tessel-opt %S/Inputs/dp-forward.mlir --tessel-set-layout=schedule=zigzag 2>&1 | FileCheck %s --check-prefix=SCHED

// CHECK: module attributes {dist.mesh = #dist.mesh<dp = 4, tp = 2>, dist.sequence_parallel, pipe.layout = #pipe.layout<microbatches = 1, schedule = "gpipe", virtual_stages = 1>}
// KEEP: module attributes {dist.mesh = #dist.mesh<dp = 2>, pipe.layout = #pipe.layout<microbatches = 1, schedule = "1f1b", virtual_stages = 1>}
// MB: the graph was built for 1 microbatches (its inputs hold one microbatch); compile the spec with parallel.microbatches = 4 instead
// SP: sp must be true or false, got 'yes'
// SCHED: schedule must be "gpipe", "1f1b" or "interleaved", got "zigzag"
