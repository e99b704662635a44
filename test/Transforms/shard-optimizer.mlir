// RUN: tessel-opt %S/Inputs/dp-forward.mlir --tessel-autodiff --tessel-propagate-sharding --tessel-partition --tessel-bucket-gradients=bucket-bytes=600 --tessel-stage-regions --tessel-schedule-pipeline --convert-graph-to-rt --tessel-plan-memory --tessel-shard-optimizer=zero=1 | FileCheck %s --check-prefix=ONE --implicit-check-not='rt.adamw('
// RUN: tessel-opt %S/Inputs/dp-forward.mlir --tessel-autodiff --tessel-propagate-sharding --tessel-partition --tessel-bucket-gradients=bucket-bytes=600 --tessel-stage-regions --tessel-schedule-pipeline --convert-graph-to-rt --tessel-plan-memory=fuse-accumulation=false --tessel-shard-optimizer=zero=2 | FileCheck %s --check-prefix=TWO --implicit-check-not=rt.reduce_scatter_shards_start
// RUN: tessel-opt %S/Inputs/dp-forward.mlir --tessel-autodiff --tessel-propagate-sharding --tessel-partition --tessel-bucket-gradients=bucket-bytes=600 --tessel-stage-regions --tessel-schedule-pipeline --convert-graph-to-rt --tessel-plan-memory=fuse-accumulation=false --tessel-shard-optimizer=zero=3 | FileCheck %s --check-prefix=THREE
// RUN: tessel-opt %S/Inputs/dp-forward.mlir --tessel-autodiff --tessel-propagate-sharding --tessel-partition --tessel-bucket-gradients=bucket-bytes=600 --tessel-stage-regions --tessel-schedule-pipeline --convert-graph-to-rt --tessel-lower-precision --tessel-plan-memory=fuse-accumulation=false --tessel-shard-optimizer=zero=3 | FileCheck %s --check-prefix=COPY
// RUN: tessel-opt %S/Inputs/dp-forward.mlir --tessel-autodiff --tessel-propagate-sharding --tessel-partition --tessel-bucket-gradients=bucket-bytes=100 --tessel-stage-regions --tessel-schedule-pipeline --convert-graph-to-rt --tessel-lower-precision --tessel-plan-memory --tessel-shard-optimizer=zero=1 | FileCheck %s --check-prefix=MASTER
// RUN: tessel-opt %S/Inputs/dp-forward.mlir --tessel-autodiff --tessel-propagate-sharding --tessel-partition --tessel-bucket-gradients=bucket-bytes=100 --tessel-stage-regions --tessel-schedule-pipeline --convert-graph-to-rt --tessel-lower-precision --tessel-plan-memory=fuse-accumulation=false --tessel-shard-optimizer=zero=3 | FileCheck %s --check-prefix=APART

// Two gradient buckets at dp 2: w and b side by side (136 elements, pieces
// of 68) and wte (512, pieces of 256). The moments hold the pieces, w's and
// b's piece first: 68 + 256 = 324 elements.

// ZeRO-1: each bucket's all-reduce is a reduce-scatter started in the
// backward pass; the norm adds the pieces' squares over dp; AdamW updates
// the pieces; each parameter run's gather starts right after the update of
// its last piece (w's and b's run under wte's update), and the update waits
// for both at its end.
// ONE: rt.optimizer_elems = 324
// ONE: rt.param "w" {{.*}}optimizer_shard = array<i64: 0, 0, 68>
// ONE: rt.param "b" {{.*}}optimizer_shard = array<i64: 0, 128, 68>
// ONE: rt.param "wte" {{.*}}optimizer_shard = array<i64: 68, 0, 256>
// ONE: rt.reduce_scatter_shards_start({{.*}}) {axes = #dist.axes<dp>, slot = 0 : i64} : memref<136xf32>
// ONE: rt.reduce_scatter_shards_start({{.*}}) {axes = #dist.axes<dp>, slot = 1 : i64} : memref<32x16xf32>
// ONE: pipe.update
// ONE: rt.sum_squares_shard({{.*}}) {axes = #dist.axes<dp>, n = 128 : i64, piece = 68 : i64, piece_grads = false, run_offset = 0 : i64}
// ONE: rt.sum_squares_shard({{.*}}) {axes = #dist.axes<dp>, n = 8 : i64, piece = 68 : i64, piece_grads = false, run_offset = 128 : i64}
// ONE: rt.all_reduce({{.*}}) {axes = #dist.axes<dp>} : memref<1xf64>
// ONE-NEXT: rt.sqrt_sum
// ONE: rt.adamw_shard({{.*}}n = 128 : i64, piece = 68 : i64, piece_grads = false, piece_params = false, run_offset = 0 : i64
// ONE: rt.adamw_shard({{.*}}n = 8 : i64, piece = 68 : i64
// ONE-NEXT: rt.buffer <params> 0 : memref<136xf32>
// ONE-NEXT: rt.all_gather_shards_start({{.*}} : memref<136xf32>) {axes = #dist.axes<dp>, n = 136 : i64, slot = 2 : i64}
// ONE: rt.adamw_shard({{.*}}n = 512 : i64
// ONE-NEXT: rt.buffer <params> 136 : memref<512xf32>
// ONE-NEXT: rt.all_gather_shards_start({{.*}} : memref<512xf32>) {axes = #dist.axes<dp>, n = 512 : i64, slot = 3 : i64}
// ONE-NEXT: rt.wait_requests {count = 2 : i64, first = 2 : i64}

// ZeRO-2: the gradient store holds the pieces (324) and staging; the
// backward part starts reduce-scattering each run into its piece (w's and
// b's at 0, wte's at 68) right after its last write and waits for it (in
// request slot 4, after the update's gathers' 2 and 3) right after the
// next run's last write, before starting that one's, or at the part's end;
// the update reads the pieces. The first run holds its slot until its
// wait, so the second takes another: staging is 136 + 512.
// TWO: rt.grad_piece_elems = 324
// TWO-SAME: rt.grad_staging_elems = 648
// TWO-SAME: rt.request_slots = 5
// TWO: pipe.backward_pass
// TWO: %[[STAGED:.*]] = rt.buffer <grads> 324 : memref<136xf32>
// TWO-NEXT: %[[PIECE:.*]] = rt.buffer <grads> 0 : memref<68xf32>
// TWO-NEXT: rt.reduce_scatter_piece_start(%[[STAGED]], %[[PIECE]]) {axes = #dist.axes<dp>, n = 136 : i64, slot = 4 : i64}
// TWO-NOT: rt.wait_requests
// TWO: rt.embedding_backward
// TWO: rt.add_broadcast({{.*}}) {n = 512
// TWO-NEXT: rt.wait_requests {count = 1 : i64, first = 4 : i64}
// TWO-NEXT: %[[STAGED2:.*]] = rt.buffer <grads> 460 : memref<512xf32>
// TWO-NEXT: %[[PIECE2:.*]] = rt.buffer <grads> 68 : memref<256xf32>
// TWO-NEXT: rt.reduce_scatter_piece_start(%[[STAGED2]], %[[PIECE2]]) {axes = #dist.axes<dp>, n = 512 : i64, slot = 4 : i64}
// TWO: rt.wait_requests {count = 1 : i64, first = 4 : i64}
// TWO-NEXT: pipe.yield
// TWO: pipe.update
// TWO: rt.sum_squares_shard({{.*}}piece_grads = true
// TWO: rt.adamw_shard({{.*}}piece_grads = true, piece_params = false

// ZeRO-3: the parameters too: each part gathers a run from its piece
// before reading it, AdamW updates the pieces and nothing is gathered after
// the update. A part's first run is gathered right before its first read;
// the next one's gather is started then (prefetch, in request slot 3, after
// the two the gradient buckets take and ZeRO-2's reductions' one) and
// waited for right before its own first read, so it is in flight while the
// previous run is computed on.
// THREE: rt.param_piece_elems = 324
// THREE-SAME: rt.request_slots = 4
// THREE: rt.param "w" {{.*}}value_shard = array<i64: 0, 68>
// THREE: rt.param "wte" {{.*}}value_shard = array<i64: 68, 256>
// The pieces are a store of their own (wte's at 68, after w's and b's);
// the step's parameters are the gathered runs (wte's slot at 0, w's and b's
// at 512).
// THREE: pipe.forward_pass
// THREE: %[[WTE:.*]] = rt.buffer <params> 0 : memref<512xf32>
// THREE-NEXT: %[[WTEPIECE:.*]] = rt.buffer <param_pieces> 68 : memref<256xf32>
// THREE-NEXT: rt.all_gather_shards(%[[WTE]], %[[WTEPIECE]]) {axes = #dist.axes<dp>, n = 512 : i64, operandSegmentSizes = array<i32: 1, 1, 0>} : memref<512xf32>, memref<256xf32>
// THREE-NEXT: rt.buffer <params> 512 : memref<136xf32>
// THREE-NEXT: rt.buffer <param_pieces> 0 : memref<68xf32>
// THREE-NEXT: rt.all_gather_shards_start({{.*}} : memref<136xf32> from {{.*}} : memref<68xf32>) {axes = #dist.axes<dp>, n = 136 : i64, slot = 3 : i64}
// THREE: rt.wait_requests {count = 1 : i64, first = 3 : i64}
// THREE-NEXT: rt.matmul({{.*}}memref<16x8xf32>
// THREE: pipe.backward_pass
// THREE: rt.all_gather_shards({{.*}}) {axes = #dist.axes<dp>, n = 512 : i64, operandSegmentSizes = array<i32: 1, 1, 0>}
// THREE: rt.all_gather_shards_start({{.*}}) {axes = #dist.axes<dp>, n = 136 : i64, slot = 3 : i64}
// THREE-NEXT: rt.matmul({{.*}}memref<32x16xf32>
// THREE: rt.wait_requests {count = 1 : i64, first = 3 : i64}
// THREE-NEXT: rt.matmul({{.*}}memref<16x8xf32>
// THREE: pipe.update
// THREE: rt.adamw_shard({{.*}}piece_grads = true, piece_params = true
// THREE-NOT: rt.all_gather_shards
// THREE: pipe.yield

// ZeRO-3 in a bf16 program: the matmuls read the parameters' bf16 copy.
// Each gather also writes the copy of its slot, and the parts' views of
// the copy take the places of the parameters' views (wte's slot at 0, w's
// and b's at 512), and AdamW writes no copy of a piece.
// COPY: pipe.forward_pass
// COPY: %[[WTE:.*]] = rt.buffer <shadow> 0 : memref<512xbf16>
// COPY-NEXT: rt.all_gather_shards({{.*}}, %[[WTE]]) {axes = #dist.axes<dp>, n = 512 : i64, operandSegmentSizes = array<i32: 1, 1, 1>}
// COPY: %[[W:.*]] = rt.buffer <shadow> 512 : memref<136xbf16>
// COPY-NEXT: rt.all_gather_shards_start({{.*}} : memref<136xf32> from {{.*}} : memref<68xf32> shadow %[[W]] : memref<136xbf16>) {axes = #dist.axes<dp>, n = 136 : i64, slot = 3 : i64}
// COPY: %[[READ:.*]] = rt.buffer <shadow> 512 : memref<16x8xbf16>
// COPY-NEXT: rt.wait_requests {count = 1 : i64, first = 3 : i64}
// COPY-NEXT: rt.matmul({{.*}}, %[[READ]], {{.*}}) {{.*}} : memref<2x6x16xbf16>, memref<16x8xbf16>
// COPY: rt.buffer <shadow> 0 : memref<32x16xbf16>
// COPY: pipe.update
// COPY-NOT: <shadow>
// COPY: pipe.yield

// ZeRO-1 in a bf16 program, buckets of 100 bytes: w, which only matmuls read (through its bf16
// copy), is a bucket of its own and keeps its fp32 master weights as a
// piece only (64 of its 128 elements); b (the bias add) and wte (the
// embedding lookup) are read in fp32 and stay whole. The parameter store
// is [w's piece | b | wte], the piece a store of its own; the copy mirrors
// b and wte (0 and 8) and holds w's copy after them (520). AdamW updates
// w's piece, writing no copy; w's copy is gathered in bf16 from the pieces,
// this rank's rounded in first. The runtime fills it the same way at start
// (rt.master_copies: piece at 0, copy at 520, 128 elements, over dp).
// MASTER: rt.master_copies = [array<i64: 0, 520, 128, 1>]
// MASTER-SAME: rt.param_gather_elems = 0 : i64, rt.param_piece_elems = 64 : i64, rt.param_store_elems = 584
// MASTER-SAME: rt.shadow_extra_elems = 128
// MASTER: rt.param "w" {{.*}}value_shard = array<i64: 0, 64>
// MASTER: rt.param "b" {{.*}}value_shard = array<i64: 64, 0>
// MASTER: rt.param "wte" {{.*}}value_shard = array<i64: 72, 0>
// MASTER: pipe.forward_pass
// MASTER: rt.buffer <params> 8 : memref<32x16xf32>
// MASTER: rt.buffer <shadow> 520 : memref<16x8xbf16>
// MASTER: rt.buffer <params> 0 : memref<8xf32>
// MASTER: pipe.update
// MASTER: %[[PIECE:.*]] = rt.buffer <param_pieces> 0 : memref<64xf32>
// MASTER-NEXT: rt.adamw_shard(%[[PIECE]], %{{[0-9]+}}, %{{[0-9]+}}, %{{[0-9]+}}, %{{[0-9]+}}, %{{[0-9]+}}, %{{[0-9]+}}) {{.*}}n = 128 : i64, piece = 64 : i64, piece_grads = false, piece_params = true
// MASTER-NEXT: %[[FROM:.*]] = rt.buffer <param_pieces> 0 : memref<64xf32>
// MASTER-NEXT: %[[GATHERED:.*]] = rt.buffer <shadow> 520 : memref<128xbf16>
// MASTER-NEXT: rt.all_gather_shards_start(%[[GATHERED]] : memref<128xbf16> from %[[FROM]] : memref<64xf32>) {axes = #dist.axes<dp>, n = 128 : i64, slot = 3 : i64}
// MASTER: rt.adamw_shard({{.*}}n = 8 : i64, piece = 4 : i64, piece_grads = false, piece_params = false
// MASTER-NEXT: rt.buffer <params> 0 : memref<8xf32>
// MASTER-NEXT: rt.buffer <shadow> 0 : memref<8xbf16>
// MASTER-NEXT: rt.all_gather_shards_start({{.*}} : memref<8xf32> shadow {{.*}} : memref<8xbf16>)
// MASTER: rt.wait_requests {count = 3 : i64, first = 3 : i64}

// ZeRO-3 in a bf16 program, buckets of 100 bytes: w is a run of its own,
// which only matmuls read, so it is gathered in bf16 alone, into a slot of
// the copy with no fp32 slot: past the end of the parameter store (pieces
// 324 + the fp32 slots 520 of wte and b), in the copy's extra elements.
// APART: rt.param_gather_elems = 520
// APART-SAME: rt.param_store_elems = 844
// APART-SAME: rt.shadow_extra_elems = 128
// APART: %[[W:.*]] = rt.buffer <shadow> 520 : memref<128xbf16>
// APART-NEXT: rt.all_gather_shards_start(%[[W]] : memref<128xbf16> from {{.*}} : memref<64xf32>)
// APART: rt.buffer <shadow> 520 : memref<16x8xbf16>
