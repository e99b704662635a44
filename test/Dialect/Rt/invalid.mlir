// RUN: tessel-opt %s -split-input-file -verify-diagnostics

// Parser and verifier errors of rt ops: a view must keep the element count
// and type, a batch is the tokens, the targets or the positions, a buffer
// lives in one of the known stores and holds one of the buffer element
// types.

func.func @view_count(%x: memref<8x64xf32>) {
  // expected-error@+1 {{'rt.view' op views 'memref<8x64xf32>' as 'memref<256xf32>': the element count and type must agree}}
  %v = rt.view %x : memref<8x64xf32> to memref<256xf32>
  return
}

// -----

func.func @view_type(%x: memref<8x64xf32>) {
  // expected-error@+1 {{the element count and type must agree}}
  %v = rt.view %x : memref<8x64xf32> to memref<512xbf16>
  return
}

// -----

func.func @batch_name() {
  // expected-error@+1 {{'rt.batch' op name must be "tokens", "targets" or "positions"}}
  %ids = rt.batch "labels" : memref<8x64xi32>
  return
}

// -----

func.func @space() {
  // expected-error@+2 {{expected ::tessel::rtir::Space to be one of: arena, params, grads, adam_m, adam_v, accumulators, shadow, norm_sums}}
  // expected-error@+1 {{failed to parse Rt_SpaceAttr parameter 'value'}}
  %b = rt.buffer <scratch> 0 : memref<8xf32>
  return
}

// -----

func.func @buffer_type() {
  // expected-error@+1 {{result #0 must be 0D/1D/2D/3D/4D/5D/6D memref of 32-bit float or bfloat16 type or 64-bit float or 32-bit signless integer values, but got 'memref<8xf16>'}}
  %b = rt.buffer <arena> 0 : memref<8xf16>
  return
}

// -----

// A started gather along an inner dimension needs the blocks the ranks'
// pieces arrive in.
func.func @gather_without_blocks(%x: memref<2x4x8xf32>, %y: memref<2x8x8xf32>) {
  // expected-error@+1 {{needs `blocks` (the gathered dimension is not the outermost)}}
  %r = rt.all_gather_start(%x, %y) {axes = #dist.axes<tp>, outer = 2 : i64, length = 4 : i64, inner = 8 : i64} : memref<2x4x8xf32>, memref<2x8x8xf32>
  return
}

// -----

func.func @scatter_wrong_piece(%x: memref<2x8x8xf32>, %y: memref<2x4x8xf32>, %b: memref<128xf32>) {
  // expected-error@+1 {{outer x length x inner = 48 does not describe a piece of 64 elements of a 128-element tensor}}
  %r = rt.reduce_scatter_start(%x, %y, %b) {axes = #dist.axes<tp>, outer = 2 : i64, length = 3 : i64, inner = 8 : i64} : memref<2x8x8xf32>, memref<2x4x8xf32>, memref<128xf32>
  return
}

// -----

func.func @blocks_too_small(%x: memref<2x4x8xf32>, %y: memref<2x8x8xf32>, %b: memref<64xf32>) {
  // expected-error@+1 {{`blocks` must hold the whole tensor's elements, of its element type}}
  %r = rt.all_gather_start(%x, %y, %b) {axes = #dist.axes<tp>, outer = 2 : i64, length = 4 : i64, inner = 8 : i64} : memref<2x4x8xf32>, memref<2x8x8xf32>, memref<64xf32>
  return
}

// -----

func.func @block_count(%x: memref<16x64xf32>) {
  // expected-error@+1 {{cuts 'memref<16x64xf32>' into 4 blocks of 'memref<8x64xf32>': the element type and count must agree}}
  %b = rt.group_block %x[1] {axes = #dist.axes<tp>, blocks = 4 : i64} : memref<16x64xf32> to memref<8x64xf32>
  return
}

// -----

func.func @block_shift(%x: memref<16x64xf32>) {
  // expected-error@+1 {{shift 2 is not a block of 2}}
  %b = rt.group_block %x[2] {axes = #dist.axes<tp>, blocks = 2 : i64} : memref<16x64xf32> to memref<8x64xf32>
  return
}

// -----

func.func @shift_types(%x: memref<8x64xf32>, %y: memref<512xf32>) {
  // expected-error@+1 {{sends 'memref<8x64xf32>' but receives 'memref<512xf32>'}}
  %r = rt.shift_start(%x, %y) {axes = #dist.axes<tp>, shift = 1 : i64} : memref<8x64xf32>, memref<512xf32>
  return
}

// -----

func.func @shift_zero(%x: memref<8x64xf32>) {
  // expected-error@+1 {{shift must be at least 1, got 0}}
  %r = rt.shift_start(%x, %x) {axes = #dist.axes<tp>, shift = 0 : i64} : memref<8x64xf32>, memref<8x64xf32>
  return
}

// -----

func.func @bias_grad_columns(%a: memref<4x8xf32>, %b: memref<4x8xf32>, %c: memref<8x16xf32>, %db: memref<16xf32>) {
  // expected-error@+1 {{columns [12, 20) do not fit rows of 16}}
  rt.matmul_bias_grad(%a, %b, %c, %db) {m = 8 : i64, n = 8 : i64, k = 4 : i64, ldc = 16 : i64, col = 12 : i64} : memref<4x8xf32>, memref<4x8xf32>, memref<8x16xf32>, memref<16xf32>
  return
}

// -----

func.func @bias_grad_rows(%a: memref<4x8xf32>, %b: memref<4x8xf32>, %c: memref<8x8xf32>, %db: memref<16xf32>, %first: i1) {
  // expected-error@+1 {{writes 8 rows of 16 and a row of 16, but c has 64 elements and db 16}}
  rt.matmul_bias_grad_accumulate(%a, %b, %c, %db, %first) {m = 8 : i64, n = 8 : i64, k = 4 : i64, ldc = 16 : i64, col = 8 : i64} : memref<4x8xf32>, memref<4x8xf32>, memref<8x8xf32>, memref<16xf32>, i1
  return
}
