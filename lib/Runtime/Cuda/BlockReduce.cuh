//===- BlockReduce.cuh - Deterministic reductions over a block --*- C++ -*-===//
//
// The one block reduction of the CUDA kernels: a shuffle tree per warp, then
// the warp results in warp order, so the order of additions depends on the
// block size only and runs are bitwise reproducible.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_RUNTIME_CUDA_BLOCKREDUCE_CUH
#define TESSEL_RUNTIME_CUDA_BLOCKREDUCE_CUH

#include <cuda_runtime.h>

namespace tessel::cuda::detail {

__device__ inline float shuffleDown(float v, int offset) {
  return __shfl_down_sync(0xffffffffu, v, offset);
}
__device__ inline double shuffleDown(double v, int offset) {
  return __shfl_down_sync(0xffffffffu, v, offset);
}
__device__ inline float2 shuffleDown(float2 v, int offset) {
  return make_float2(__shfl_down_sync(0xffffffffu, v.x, offset),
                     __shfl_down_sync(0xffffffffu, v.y, offset));
}
// A value of several fields shuffles itself (a member shuffleDown).
template <typename T> __device__ inline T shuffleDown(const T &v, int offset) {
  return v.shuffleDown(offset);
}

struct Sum {
  __device__ float operator()(float a, float b) const { return a + b; }
  __device__ double operator()(double a, double b) const { return a + b; }
  __device__ float2 operator()(float2 a, float2 b) const {
    return make_float2(a.x + b.x, a.y + b.y);
  }
};

struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Reduces v over the block (blockDim.x a multiple of 32) and returns the
// result to every thread. Every thread of the block must call it.
template <typename T, typename Op>
__device__ T blockReduce(T v, Op op, T identity) {
  __shared__ T warpResults[32];
  __shared__ T result;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;
  for (int offset = 16; offset > 0; offset /= 2)
    v = op(v, shuffleDown(v, offset));
  // A previous call's readers of `result` are done before it is rewritten.
  __syncthreads();
  if (lane == 0)
    warpResults[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < warps ? warpResults[lane] : identity;
    for (int offset = 16; offset > 0; offset /= 2)
      v = op(v, shuffleDown(v, offset));
    if (lane == 0)
      result = v;
  }
  __syncthreads();
  return result;
}

} // namespace tessel::cuda::detail

#endif // TESSEL_RUNTIME_CUDA_BLOCKREDUCE_CUH
