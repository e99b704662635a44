// RUN: tessel-opt %s --tessel-propagate-sharding --tessel-partition --convert-graph-to-rt --tessel-plan-memory --tessel-inference-program | FileCheck %s --implicit-check-not=rt.alloc --implicit-check-not=rt.kv_cache

// An inference step (what `tessel compile --inference` builds) at tp 2:
// one token per call, a KV cache of 8 positions, two heads.
//
// The caches are split by heads as k and v are, so each rank's cache holds
// its own head (32 of a cache's 64 elements); the logits, split along the vocabulary by the head's
// matmul, are gathered for the runtime, which reads them whole.
// CHECK-LABEL: module @program0
// CHECK-SAME: pipe.rank = 0 : i64
// CHECK-SAME: rt.arena_bytes =
// CHECK-SAME: rt.chunk = 1 : i64
// CHECK-SAME: rt.kv_cache_elems = 64 : i64
// CHECK-SAME: rt.param_elems = 76 : i64
// CHECK: func.func @decode_step()
// CHECK: %[[POS:.*]] = rt.batch "positions" : memref<1x1xi32>
// CHECK-DAG: %[[KC:.*]] = rt.buffer <kv_cache> 0 : memref<1x8x1x4xf32>
// CHECK-DAG: %[[VC:.*]] = rt.buffer <kv_cache> 32 : memref<1x8x1x4xf32>
// CHECK: rt.cached_attention({{.*}}, %[[KC]], %[[VC]], %[[POS]], {{.*}}) {batch = 1 : i64, head_dim = 4 : i64, heads = 1 : i64, kv_heads = 1 : i64, max_len = 8 : i64, seq = 1 : i64}
// CHECK: rt.all_gather({{.*}}) {axes = #dist.axes<tp>, inner = 1 : i64, length = 8 : i64, outer = 1 : i64} : memref<1x1x8xf32>, memref<1x1x16xf32>
// CHECK: %[[OUT:.*]] = rt.buffer <logits> 0 : memref<1x1x16xf32>
// CHECK: rt.copy({{.*}}, %[[OUT]]) {n = 16 : i64}
module attributes {dist.mesh = #dist.mesh<tp = 2>} {
  func.func @decode_step() attributes {pipe.rank = 0 : i64} {
    %tok = graph.input "tokens" : tensor<1x1xi32>
    %pos = graph.input "positions" : tensor<1x1xi32>
    %q = graph.param "q" {dist.param_sharding = #dist.sharding<[[], [], [tp], []], partial = []>} : tensor<1x1x2x4xf32>
    %k = graph.param "k" {dist.param_sharding = #dist.sharding<[[], [], [tp], []], partial = []>} : tensor<1x1x2x4xf32>
    %v = graph.param "v" {dist.param_sharding = #dist.sharding<[[], [], [tp], []], partial = []>} : tensor<1x1x2x4xf32>
    %kc = graph.kv_cache "k_cache" {dist.param_sharding = #dist.sharding<[[], [], [tp], []], partial = []>} : tensor<1x8x2x4xf32>
    %vc = graph.kv_cache "v_cache" {dist.param_sharding = #dist.sharding<[[], [], [tp], []], partial = []>} : tensor<1x8x2x4xf32>
    %o = graph.cached_attention %q, %k, %v, %kc, %vc, %pos : (tensor<1x1x2x4xf32>, tensor<1x1x2x4xf32>, tensor<1x1x2x4xf32>, tensor<1x8x2x4xf32>, tensor<1x8x2x4xf32>, tensor<1x1xi32>) -> tensor<1x1x2x4xf32>
    %h = graph.reshape %o : (tensor<1x1x2x4xf32>) -> tensor<1x1x8xf32>
    %w = graph.param "w" {dist.param_sharding = #dist.sharding<[[tp], []], partial = []>} : tensor<16x8xf32>
    %l = graph.matmul %h, %w {transpose_rhs = true} : (tensor<1x1x8xf32>, tensor<16x8xf32>) -> tensor<1x1x16xf32>
    graph.output "logits" %l : tensor<1x1x16xf32>
    return
  }
}
