// RUN: tessel-opt %S/Inputs/dp-forward.mlir --tessel-train-pipeline="dp=4" | FileCheck %s
// RUN: tessel-opt %S/Inputs/pp-forward.mlir --tessel-train-pipeline="dp=2 microbatches=1" | FileCheck %s --check-prefix=PP

// The whole compile as one registered pipeline: the layout chosen here, then
// autodiff, sharding, partition, gradient buckets, the parts of the step,
// rt, the memory plan, the part functions and emitc, ready to print.
// CHECK: module attributes {dist.mesh = #dist.mesh<dp = 4>
// CHECK: module @program0 attributes {{.*}}rt.arena_bytes
// CHECK: emitc.global static const @kParams
// CHECK: emitc.func @forward0(%{{.*}}: !emitc.opaque<"StepContext &">, %{{.*}}: i64, %{{.*}}: i1)
// The batch is split four ways: each rank embeds 1 of the 4 sequences.
// CHECK: call_opaque "embeddingForward"{{.*}}args = [0 : index, 1 : index, 2 : index, 6, 32, 16]
// CHECK: emitc.func @backward0
// CHECK: call_opaque "allReduceSumStart"{{.*}}#emitc.opaque<"1u">
// CHECK: emitc.func @update
// CHECK: call_opaque "commWait"
// CHECK: call_opaque "adamwStep"
// CHECK: emitc.func @trainStep
// CHECK: emitc.func @main
// CHECK: call_opaque "runMain"

// Data and pipeline parallel: one program per pipeline rank, each planned;
// activations go forward and gradients back by point-to-point messages,
// numbered per channel (each direction's first message is tag 0).
// PP: module attributes {dist.mesh = #dist.mesh<pp = 2, dp = 2>
// PP-LABEL: module @stage0
// PP: call_opaque "sendTo"{{.*}}#emitc.opaque<"MeshAxis::PP">, 1, #emitc.opaque<"0 + mb">
// PP: call_opaque "recvFrom"{{.*}}#emitc.opaque<"MeshAxis::PP">, 1, #emitc.opaque<"0 + mb">
// PP: verbatim "{}.mesh[MeshAxis::DP] = 2;"
// PP-NEXT: verbatim "{}.mesh[MeshAxis::PP] = 2;"
// PP-LABEL: module @stage1
// PP: call_opaque "recvFrom"{{.*}}#emitc.opaque<"MeshAxis::PP">, -1, #emitc.opaque<"0 + mb">
// PP: call_opaque "sendTo"{{.*}}#emitc.opaque<"MeshAxis::PP">, -1, #emitc.opaque<"0 + mb">
