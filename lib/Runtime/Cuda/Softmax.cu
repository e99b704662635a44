//===- Softmax.cu - Softmax over the last dimension -----------------------===//
//
// One block per row (a grid-stride loop over rows), as lib/Runtime/Kernels/
// Softmax.cpp: the row max is subtracted before exponentiating, and the
// backward is dx = y * (dy - sum(dy * y)). Statistics are fp32; block
// reductions combine lanes by a fixed butterfly and warps in ascending
// order, so results do not depend on timing. Rows of at most 32 columns get
// one warp, others 256 threads.
//
//===----------------------------------------------------------------------===//

#include "Internal.h"

namespace tessel::cuda {

using detail::fromFloat;
using detail::toFloat;

namespace {

constexpr int kMaxWarps = 32;

// Every lane of every warp receives the same value, so all threads of the
// block return the same result. `scratch` has kMaxWarps entries; the leading
// barrier lets a previous reduction's readers finish before it is reused.
__device__ inline float blockSum(float v, float *scratch) {
  for (int offset = 16; offset > 0; offset >>= 1)
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  __syncthreads();
  if ((threadIdx.x & 31) == 0)
    scratch[threadIdx.x / 32] = v;
  __syncthreads();
  float s = scratch[0];
  for (unsigned w = 1; w < blockDim.x / 32; ++w)
    s += scratch[w];
  return s;
}

__device__ inline float blockMax(float v, float *scratch) {
  for (int offset = 16; offset > 0; offset >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  __syncthreads();
  if ((threadIdx.x & 31) == 0)
    scratch[threadIdx.x / 32] = v;
  __syncthreads();
  float m = scratch[0];
  for (unsigned w = 1; w < blockDim.x / 32; ++w)
    m = fmaxf(m, scratch[w]);
  return m;
}

template <typename TI, typename TO>
__global__ void softmaxForwardKernel(const TI *x, TO *out, int64_t rows,
                                     int64_t cols) {
  __shared__ float scratch[kMaxWarps];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const TI *xr = x + r * cols;
    TO *outr = out + r * cols;
    float m = -INFINITY;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x)
      m = fmaxf(m, toFloat(xr[j]));
    m = blockMax(m, scratch);
    float s = 0.0f;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x)
      s += expf(toFloat(xr[j]) - m);
    s = blockSum(s, scratch);
    const float inv = 1.0f / s;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x)
      outr[j] = fromFloat<TO>(expf(toFloat(xr[j]) - m) * inv);
  }
}

template <typename TY, typename TG, typename TO>
__global__ void softmaxBackwardKernel(const TY *y, const TG *dy, TO *dx,
                                      int64_t rows, int64_t cols) {
  __shared__ float scratch[kMaxWarps];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const TY *yr = y + r * cols;
    const TG *dyr = dy + r * cols;
    TO *dxr = dx + r * cols;
    float s = 0.0f;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x)
      s += toFloat(dyr[j]) * toFloat(yr[j]);
    s = blockSum(s, scratch);
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x)
      dxr[j] = fromFloat<TO>(toFloat(yr[j]) * (toFloat(dyr[j]) - s));
  }
}

int threadsFor(int64_t cols) { return cols <= 32 ? 32 : 256; }

unsigned blocksForRows(int64_t rows) {
  constexpr int64_t kMaxBlocks = 65535 * 8;
  return unsigned(rows < kMaxBlocks ? rows : kMaxBlocks);
}

} // namespace

template <typename TI, typename TO>
void softmaxForward(const TI *x, TO *out, int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0)
    return;
  softmaxForwardKernel<<<blocksForRows(rows), threadsFor(cols), 0,
                         computeStream()>>>(x, out, rows, cols);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

template <typename TY, typename TG, typename TO>
void softmaxBackward(const TY *y, const TG *dy, TO *dx, int64_t rows,
                     int64_t cols) {
  if (rows <= 0 || cols <= 0)
    return;
  softmaxBackwardKernel<<<blocksForRows(rows), threadsFor(cols), 0,
                          computeStream()>>>(y, dy, dx, rows, cols);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

#define TESSEL_INSTANTIATE2(A, B)                                              \
  template void softmaxForward<A, B>(const A *, B *, int64_t, int64_t);
TESSEL_CUDA_TYPES2(TESSEL_INSTANTIATE2)
#undef TESSEL_INSTANTIATE2

#define TESSEL_INSTANTIATE3(A, B, C)                                           \
  template void softmaxBackward<A, B, C>(const A *, const B *, C *, int64_t,   \
                                         int64_t);
TESSEL_CUDA_TYPES3(TESSEL_INSTANTIATE3)
#undef TESSEL_INSTANTIATE3

} // namespace tessel::cuda
