// Pipeline rank 0 of an interleaved layout: two model chunks (stages 0 and
// 2), each with a forward and a backward part; only the second chunk's
// forward sends. Planned (rt), without its schedule.
module attributes {dist.mesh = #dist.mesh<pp = 2>, pipe.layout = #pipe.layout<microbatches = 2, schedule = "interleaved", virtual_stages = 2>} {
  func.func @stage_0() -> (memref<f32>, memref<f32>) attributes {pipe.rank = 0 : i64, rt.accumulator_elems = 0 : i64, rt.arena_bytes = 128 : i64, rt.norm_sums = 0 : i64, rt.param_elems = 0 : i64, rt.request_slots = 0 : i64} {
    pipe.forward_pass chunk 0 {
      %x = rt.buffer <arena> 0 : memref<8xf32>
      rt.fill(%x) {n = 8 : i64, value = 1.0 : f64} : memref<8xf32>
      pipe.yield
    }
    pipe.forward_pass chunk 1 {
      %x = rt.buffer <arena> 64 : memref<8xf32>
      %mb = rt.microbatch : i64
      rt.send(%x) microbatch %mb {offset = 1 : i64, tag = 2 : i64} : memref<8xf32>
      pipe.yield
    }
    pipe.backward_pass chunk 1 {
      %d = rt.buffer <arena> 64 : memref<8xf32>
      rt.fill(%d) {n = 8 : i64, value = 0.0 : f64} : memref<8xf32>
      pipe.yield
    }
    pipe.backward_pass chunk 0 {
      %d = rt.buffer <arena> 0 : memref<8xf32>
      rt.fill(%d) {n = 8 : i64, value = 0.0 : f64} : memref<8xf32>
      pipe.yield
    }
    %u:2 = pipe.update() -> memref<f32>, memref<f32> {
      %l = rt.buffer <arena> 0 : memref<f32>
      rt.fill(%l) {n = 1 : i64, value = 0.0 : f64} : memref<f32>
      pipe.yield %l, %l : memref<f32>, memref<f32>
    }
    return %u#0, %u#1 : memref<f32>, memref<f32>
  }
}
