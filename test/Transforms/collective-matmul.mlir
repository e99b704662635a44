// RUN: tessel-opt %s --tessel-overlap-collectives=collective-matmul-min-rows=4 | FileCheck %s
// RUN: tessel-opt %s --tessel-overlap-collectives=collective-matmul=false | FileCheck %s --check-prefix=OFF
// RUN: tessel-opt %s --tessel-overlap-collectives=collective-matmul-min-rows=5 | FileCheck %s --check-prefix=OFF
// RUN: tessel-opt %s --tessel-overlap-collectives=collective-matmul-min-rows=4 --tessel-plan-memory | FileCheck %s --check-prefix=PLAN

// A sequence-parallel forward at tp = 4, one sequence per microbatch: the
// input's pieces (4 rows each) gathered into X (16 rows), then the two
// column-parallel GEMMs that read X row by row, and a GEMM that reads X
// whole (transposed).
//
// The gather becomes three shifts on the group, all started at once; this
// rank's rows go through both GEMMs (m = 4) while they travel, then each
// arrived piece's rows after its wait. The GEMMs' outputs are cut into the
// same blocks. X is read whole later, so this rank's piece is copied in.
// CHECK-LABEL: pipe.forward_pass
// CHECK: %[[X:.*]] = rt.alloc : memref<1x16x8xf32>
// CHECK: %[[Y1:.*]] = rt.alloc : memref<1x16x4xf32>
// CHECK: %[[Y2:.*]] = rt.alloc : memref<1x16x4xf32>
// CHECK: %[[OWN:.*]] = rt.group_block %[[X]][0] {axes = #dist.axes<tp>, blocks = 4 : i64} : memref<1x16x8xf32> to memref<1x4x8xf32>
// CHECK-NEXT: rt.copy(%[[PIECE:.*]], %[[OWN]]) {n = 32 : i64}
// CHECK-NEXT: %[[B1:.*]] = rt.group_block %[[X]][1]
// CHECK-NEXT: %[[S1:.*]] = rt.shift_start(%[[PIECE]], %[[B1]]) {axes = #dist.axes<tp>, shift = 1 : i64}
// CHECK-NEXT: %[[B2:.*]] = rt.group_block %[[X]][2]
// CHECK-NEXT: %[[S2:.*]] = rt.shift_start(%[[PIECE]], %[[B2]]) {axes = #dist.axes<tp>, shift = 2 : i64}
// CHECK-NEXT: %[[B3:.*]] = rt.group_block %[[X]][3]
// CHECK-NEXT: %[[S3:.*]] = rt.shift_start(%[[PIECE]], %[[B3]]) {axes = #dist.axes<tp>, shift = 3 : i64}
// CHECK-NEXT: %[[Y10:.*]] = rt.group_block %[[Y1]][0] {{.*}} to memref<16xf32>
// CHECK-NEXT: rt.matmul_bias(%[[PIECE]], %{{.*}}, %{{.*}}, %[[Y10]]) {k = 8 : i64, m = 4 : i64, n = 4 : i64
// CHECK-NEXT: %[[Y20:.*]] = rt.group_block %[[Y2]][0]
// CHECK-NEXT: rt.matmul_bias(%[[PIECE]], %{{.*}}, %{{.*}}, %[[Y20]]) {k = 8 : i64, m = 4 : i64
// CHECK-NEXT: rt.wait %[[S1]]
// CHECK-NEXT: %[[X1:.*]] = rt.group_block %[[X]][1]
// CHECK-NEXT: %[[Y11:.*]] = rt.group_block %[[Y1]][1]
// CHECK-NEXT: rt.matmul_bias(%[[X1]], %{{.*}}, %{{.*}}, %[[Y11]]) {{.*}}m = 4 : i64
// CHECK: rt.wait %[[S2]]
// CHECK: rt.wait %[[S3]]
// CHECK-NEXT: %[[X3:.*]] = rt.group_block %[[X]][3]
// CHECK-NEXT: %[[Y13:.*]] = rt.group_block %[[Y1]][3]
// CHECK-NEXT: rt.matmul_bias(%[[X3]], {{.*}}, %[[Y13]])
// CHECK-NEXT: %[[X3B:.*]] = rt.group_block %[[X]][3]
// CHECK-NEXT: %[[Y23:.*]] = rt.group_block %[[Y2]][3]
// CHECK-NEXT: rt.matmul_bias(%[[X3B]], {{.*}}, %[[Y23]])
// CHECK-NEXT: rt.alloc
// CHECK-NEXT: rt.matmul(%[[X]], {{.*}}trans_a = true
// CHECK-NOT: rt.all_gather

// A gather that a GEMM above could overlap as it is, started, is left to
// that (it costs no GEMM any efficiency); here the weight gradient's GEMM
// (m = 8) above the second gather is cut off from it by a message.
// A GEMM that reads another's output whole (as its B) must wait for all of
// it: only the first is done piece by piece, and the second (m = 16, below)
// stays after the last piece.
// CHECK: rt.shift_start
// CHECK: rt.matmul_bias(%{{.*}}, %{{.*}}, %{{.*}}, %[[P3:.*]]) {{.*}}m = 4
// CHECK-NOT: rt.shift_start

// A reduce-scatter of the partial sums a GEMM writes row by row goes piece
// by piece too: the rows of each other rank's block are computed and sent
// to it at once (the block of the rank s places on is the one 4 - s places
// back), this rank's own block last, into the first of the buffer's four
// pieces that the received ones fill (one per source rank); then one
// column sum adds them in rank order into this rank's piece.
// CHECK: %[[PARTS:.*]] = rt.alloc : memref<128xf32>
// CHECK-NEXT: %[[YB3:.*]] = rt.group_block %[[YP:.*]][3] {{.*}} to memref<32xf32>
// CHECK-NEXT: %[[AB3:.*]] = rt.group_block %{{.*}}[3] {{.*}} to memref<16xf32>
// CHECK-NEXT: rt.matmul(%[[AB3]], %{{.*}}, %[[YB3]]) {{.*}}m = 4
// CHECK-NEXT: %[[P1:.*]] = rt.group_block %[[PARTS]][1]
// CHECK-NEXT: %[[R1:.*]] = rt.shift_start(%[[YB3]], %[[P1]]) {axes = #dist.axes<tp>, shift = 1 : i64}
// CHECK: rt.group_block %[[YP]][2]
// CHECK: rt.shift_start({{.*}}shift = 2 : i64}
// CHECK: rt.group_block %[[YP]][1]
// CHECK: %[[R3:.*]] = rt.shift_start({{.*}}shift = 3 : i64}
// CHECK-NEXT: %[[P0:.*]] = rt.group_block %[[PARTS]][0]
// CHECK-NEXT: %[[A0:.*]] = rt.group_block %{{.*}}[0]
// CHECK-NEXT: rt.matmul(%[[A0]], %{{.*}}, %[[P0]]) {{.*}}m = 4
// CHECK-NEXT: rt.wait %[[R1]]
// CHECK-NEXT: rt.wait
// CHECK-NEXT: rt.wait %[[R3]]
// CHECK-NEXT: rt.reduce_sum_leading(%[[PARTS]], %{{.*}}) {cols = 32 : i64, rows = 4 : i64}
// CHECK-NEXT: rt.flush_sends
// CHECK-NOT: rt.shift_start
// CHECK: rt.reduce_scatter({{.*}}) {axes = #dist.axes<tp>, inner = 8 : i64, length = 4 : i64, outer = 1 : i64}
// CHECK-NEXT: rt.alloc
// CHECK-NEXT: rt.gelu_forward

// Two sequences per microbatch: the gathered dimension is not the
// outermost, the pieces' rows are not contiguous, and the gather is left to
// the started form (which, with a collective above it and the GEMM that
// reads it right after, stays blocking).
// CHECK: rt.all_gather(%{{.*}}, %{{.*}}) {axes = #dist.axes<tp>, inner = 8 : i64, length = 4 : i64, outer = 2 : i64}
// CHECK-NEXT: rt.alloc
// CHECK-NEXT: rt.matmul_bias({{.*}}m = 32

// Off, or with pieces of fewer rows than asked for, the gathers stay
// whole.
// OFF-NOT: rt.shift_start
// OFF-NOT: rt.group_block

// The plan gives each shift a request slot and holds the gathered tensor
// and the piece until the last wait.
// PLAN-LABEL: pipe.forward_pass
// PLAN: rt.shift_start({{.*}}slot = 0 : i64
// PLAN: rt.shift_start({{.*}}slot = 1 : i64
// PLAN: rt.shift_start({{.*}}slot = 2 : i64
// PLAN: rt.wait_requests {count = 1 : i64, first = 0 : i64}
// PLAN: rt.wait_requests {count = 1 : i64, first = 1 : i64}
// PLAN: rt.wait_requests {count = 1 : i64, first = 2 : i64}

module attributes {dist.mesh = #dist.mesh<tp = 4>} {
func.func @train_step() -> (memref<f32>, memref<f32>) attributes {pipe.rank = 0 : i64} {
  %w1 = rt.param "w1" {decay = true, global_shape = array<i64: 8, 16>, init = "normal", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = 1 : i64, shard_axis = #dist.axis<tp>, shard_blocks = 1 : i64} : memref<8x4xf32>
  %b1 = rt.param "b1" {decay = false, global_shape = array<i64: 16>, init = "zeros", mean = 0.0 : f64, std = 0.0 : f64, shard_dim = 0 : i64, shard_axis = #dist.axis<tp>, shard_blocks = 1 : i64} : memref<4xf32>
  %w2 = rt.param "w2" {decay = true, global_shape = array<i64: 8, 16>, init = "normal", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = 1 : i64, shard_axis = #dist.axis<tp>, shard_blocks = 1 : i64} : memref<8x4xf32>
  %f:3 = pipe.forward_pass chunk 0 -> memref<8x4xf32>, memref<16x4xf32>, memref<f32> {
    %x = rt.alloc : memref<1x4x8xf32>
    rt.fill(%x) {n = 32 : i64, value = 1.0 : f64} : memref<1x4x8xf32>
    %X = rt.alloc : memref<1x16x8xf32>
    rt.all_gather(%x, %X) {axes = #dist.axes<tp>, outer = 1 : i64, length = 4 : i64, inner = 8 : i64} : memref<1x4x8xf32>, memref<1x16x8xf32>
    %y1 = rt.alloc : memref<1x16x4xf32>
    rt.matmul_bias(%X, %w1, %b1, %y1) {m = 16 : i64, n = 4 : i64, k = 8 : i64, trans_b = false} : memref<1x16x8xf32>, memref<8x4xf32>, memref<4xf32>, memref<1x16x4xf32>
    %y2 = rt.alloc : memref<1x16x4xf32>
    rt.matmul_bias(%X, %w2, %b1, %y2) {m = 16 : i64, n = 4 : i64, k = 8 : i64, trans_b = false} : memref<1x16x8xf32>, memref<8x4xf32>, memref<4xf32>, memref<1x16x4xf32>
    %dw = rt.alloc : memref<8x4xf32>
    rt.matmul(%X, %y1, %dw) {batch = 1 : i64, m = 8 : i64, n = 4 : i64, k = 16 : i64, trans_a = true, trans_b = false, stride_a = 128 : i64, stride_b = 64 : i64, stride_c = 32 : i64} : memref<1x16x8xf32>, memref<1x16x4xf32>, memref<8x4xf32>
    // The second GEMM's B is the first's output. (A message ends what a
    // started gather could rise past: nothing else overlaps it.)
    rt.flush_sends
    %X2 = rt.alloc : memref<1x16x8xf32>
    rt.all_gather(%x, %X2) {axes = #dist.axes<tp>, outer = 1 : i64, length = 4 : i64, inner = 8 : i64} : memref<1x4x8xf32>, memref<1x16x8xf32>
    %p = rt.alloc : memref<1x16x4xf32>
    rt.matmul_bias(%X2, %w1, %b1, %p) {m = 16 : i64, n = 4 : i64, k = 8 : i64, trans_b = false} : memref<1x16x8xf32>, memref<8x4xf32>, memref<4xf32>, memref<1x16x4xf32>
    %q = rt.alloc : memref<16x4xf32>
    rt.matmul(%X2, %p, %q) {batch = 1 : i64, m = 16 : i64, n = 4 : i64, k = 8 : i64, trans_a = false, trans_b = false, stride_a = 128 : i64, stride_b = 0 : i64, stride_c = 64 : i64} : memref<1x16x8xf32>, memref<1x16x4xf32>, memref<16x4xf32>
    // (A message: the GEMMs above are not taken under the reduce-scatter
    // below, which then has nothing independent to overlap.)
    rt.flush_sends
    // A row-parallel GEMM's partial sums reduce-scattered.
    %wp = rt.param "wp" {decay = true, global_shape = array<i64: 16, 8>, init = "normal", mean = 0.0 : f64, std = 0.02 : f64, shard_dim = 0 : i64, shard_axis = #dist.axis<tp>, shard_blocks = 1 : i64} : memref<4x8xf32>
    %Yp = rt.alloc : memref<1x16x8xf32>
    rt.matmul(%y1, %wp, %Yp) {batch = 1 : i64, m = 16 : i64, n = 8 : i64, k = 4 : i64, trans_a = false, trans_b = false, stride_a = 64 : i64, stride_b = 0 : i64, stride_c = 128 : i64} : memref<1x16x4xf32>, memref<4x8xf32>, memref<1x16x8xf32>
    %yp = rt.alloc : memref<1x4x8xf32>
    rt.reduce_scatter(%Yp, %yp) {axes = #dist.axes<tp>, outer = 1 : i64, length = 4 : i64, inner = 8 : i64} : memref<1x16x8xf32>, memref<1x4x8xf32>
    rt.flush_sends
    // Partial sums someone else reads too: reduced whole.
    %Yq = rt.alloc : memref<1x16x8xf32>
    rt.matmul(%y1, %wp, %Yq) {batch = 1 : i64, m = 16 : i64, n = 8 : i64, k = 4 : i64, trans_a = false, trans_b = false, stride_a = 64 : i64, stride_b = 0 : i64, stride_c = 128 : i64} : memref<1x16x4xf32>, memref<4x8xf32>, memref<1x16x8xf32>
    %yq = rt.alloc : memref<1x4x8xf32>
    rt.reduce_scatter(%Yq, %yq) {axes = #dist.axes<tp>, outer = 1 : i64, length = 4 : i64, inner = 8 : i64} : memref<1x16x8xf32>, memref<1x4x8xf32>
    %zq = rt.alloc : memref<1x16x8xf32>
    rt.gelu_forward(%Yq, %zq) {n = 128 : i64} : memref<1x16x8xf32>, memref<1x16x8xf32>
    // Two sequences.
    %x2 = rt.alloc : memref<2x4x8xf32>
    rt.fill(%x2) {n = 64 : i64, value = 1.0 : f64} : memref<2x4x8xf32>
    %X3 = rt.alloc : memref<2x16x8xf32>
    rt.all_gather(%x2, %X3) {axes = #dist.axes<tp>, outer = 2 : i64, length = 4 : i64, inner = 8 : i64} : memref<2x4x8xf32>, memref<2x16x8xf32>
    %y3 = rt.alloc : memref<2x16x4xf32>
    rt.matmul_bias(%X3, %w1, %b1, %y3) {m = 32 : i64, n = 4 : i64, k = 8 : i64, trans_b = false} : memref<2x16x8xf32>, memref<8x4xf32>, memref<4xf32>, memref<2x16x4xf32>
    %l = rt.alloc : memref<f32>
    rt.fill(%l) {n = 1 : i64, value = 0.5 : f64} : memref<f32>
    pipe.yield %dw, %q, %l : memref<8x4xf32>, memref<16x4xf32>, memref<f32>
  }
  %u:2 = pipe.update(%f#2 : memref<f32>) -> memref<f32>, memref<f32> {
  ^bb0(%loss: memref<f32>):
    %n = rt.alloc : memref<f32>
    rt.fill(%n) {n = 1 : i64, value = 1.0 : f64} : memref<f32>
    pipe.yield %loss, %n : memref<f32>, memref<f32>
  }
  return %u#0, %u#1 : memref<f32>, memref<f32>
}
}
