//===- Internal.h - Shared pieces of the CUDA runtime's files ---*- C++ -*-===//
#ifndef TESSEL_RUNTIME_CUDA_INTERNAL_H
#define TESSEL_RUNTIME_CUDA_INTERNAL_H

#include "tessel/Runtime/Cuda/Kernels.h"
#include "tessel/Runtime/Pieces.h"

#include <algorithm>
#include <cstdint>

namespace tessel::cuda::detail {

// Gemm.cu: the cuBLASLt handle and its workspace, created once by the
// device start (no allocation happens in a step) and destroyed at stop.
void gemmInit();
void gemmShutdown();

// Device.cu: streams (created at start).
cudaStream_t commStream();
// Device.cu: out[i] = bf16(in[i]) for n elements, on `stream`.
void toBf16On(cudaStream_t stream, const float *in, bf16 *out, int64_t n);

// Optimizer.cu: one AdamW call's hyperparameters, and the scalars its
// kernel reads, which change from step to step (computed on the host in
// double, as lib/Runtime/Optimizer.cpp does).
struct AdamConstants {
  float beta1, beta2, eps, weightDecay, maxNorm;
};
struct AdamScalars {
  float decay;         // 1 - lr * weightDecay
  float stepSize;      // lr / (1 - beta1^step)
  float bc2Sqrt;       // sqrt(1 - beta2^step)
  float oneMinusBeta1; // 1 - beta1
  float oneMinusBeta2; // 1 - beta2
  float beta2, eps, maxNorm;
};
AdamScalars adamScalars(const AdamConstants &c, float lr, int64_t step);

// Device.cu: the step captured as a CUDA graph (see Device.cu).
// True while this thread captures the step.
bool capturing();
// Every AdamW call of a step asks for its slot. While the step is captured
// it gets the device copy of its scalars, which the runtime rewrites for
// each later launch of the graph from that step's learning rate and update
// count (`now`: this step's); otherwise null, and the kernel takes its
// scalars by value.
const AdamScalars *updateSlot(const AdamConstants &c, const AdamScalars &now);
// The running step in device memory, which the runtime writes before each
// step (eager or launched as a graph) for the kernels that read it
// (dropout); null before the device is started.
const int64_t *deviceStep();
// Throws while the step is captured: `what` would wait for the device,
// allocate or read device data on the host, which a graph cannot replay.
void notWhileCapturing(const char *what);

// Grid size for a grid-stride loop over n elements.
inline unsigned blocksFor(int64_t n, int threads = 256) {
  int64_t b = (n + threads - 1) / threads;
  if (b < 1)
    b = 1;
  return b > 65535 * 8 ? 65535u * 8u : (unsigned)b;
}

// Runs cut into data-parallel pieces (ZeRO): tessel/Runtime/Pieces.h.
using rt::inPiece;
using rt::PieceRange;
using rt::pieceSize;

// fp32 arithmetic whatever the storage type.
__host__ __device__ inline float toFloat(float x) { return x; }
__host__ __device__ inline float toFloat(bf16 x) { return __bfloat162float(x); }
__host__ __device__ inline double toFloat(double x) { return x; }
template <typename T> __host__ __device__ inline T fromFloat(float x);
template <> __host__ __device__ inline float fromFloat<float>(float x) {
  return x;
}
template <> __host__ __device__ inline bf16 fromFloat<bf16>(float x) {
  return __float2bfloat16(x);
}

} // namespace tessel::cuda::detail

// Explicit instantiation over storage types. Each macro calls X once per
// combination of float and bf16 for its number of type parameters.
#define TESSEL_CUDA_TYPES1(X) X(float) X(::tessel::cuda::bf16)
#define TESSEL_CUDA_TYPES2(X)                                                  \
  X(float, float)                                                              \
  X(float, ::tessel::cuda::bf16) X(::tessel::cuda::bf16, float)                \
      X(::tessel::cuda::bf16, ::tessel::cuda::bf16)
#define TESSEL_CUDA_TYPES3(X)                                                  \
  X(float, float, float)                                                       \
  X(float, float, ::tessel::cuda::bf16) X(float, ::tessel::cuda::bf16, float)  \
      X(float, ::tessel::cuda::bf16, ::tessel::cuda::bf16)                     \
          X(::tessel::cuda::bf16, float, float)                                \
              X(::tessel::cuda::bf16, float, ::tessel::cuda::bf16)             \
                  X(::tessel::cuda::bf16, ::tessel::cuda::bf16, float)         \
                      X(::tessel::cuda::bf16, ::tessel::cuda::bf16,            \
                        ::tessel::cuda::bf16)

#endif // TESSEL_RUNTIME_CUDA_INTERNAL_H
