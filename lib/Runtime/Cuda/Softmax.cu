//===- Softmax.cu - Softmax over the last dimension -----------------------===//
//
// One block per row (a grid-stride loop over rows), as lib/Runtime/Kernels/
// Softmax.cpp: the row max is subtracted before exponentiating, and the
// backward is dx = y * (dy - sum(dy * y)), both times `scale` when the
// softmax is of scaled scores; a causal row (an attention's scores) reads
// only its columns up to r mod cols and writes zero after. Statistics are
// fp32; block reductions (BlockReduce.cuh) have a fixed order, so results
// do not depend on timing. Rows of at most 32 columns get one warp, others
// 256 threads.
//
//===----------------------------------------------------------------------===//

#include "BlockReduce.cuh"
#include "Internal.h"

namespace tessel::cuda {

using detail::blockReduce;
using detail::fromFloat;
using detail::Max;
using detail::Sum;
using detail::toFloat;

namespace {

template <typename TI, typename TO>
__global__ void softmaxForwardKernel(const TI *x, TO *out, int64_t rows,
                                     int64_t cols, float scale, bool causal) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const TI *xr = x + r * cols;
    TO *outr = out + r * cols;
    // A causal row sees the columns up to its position, r mod cols.
    const int64_t n = causal ? r % cols + 1 : cols;
    float m = -INFINITY;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
      m = fmaxf(m, scale * toFloat(xr[j]));
    m = blockReduce(m, Max{}, -INFINITY);
    float s = 0.0f;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
      s += expf(scale * toFloat(xr[j]) - m);
    s = blockReduce(s, Sum{}, 0.0f);
    const float inv = 1.0f / s;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x)
      outr[j] = fromFloat<TO>(j < n ? expf(scale * toFloat(xr[j]) - m) * inv
                                    : 0.0f);
  }
}

template <typename TY, typename TG, typename TO>
__global__ void softmaxBackwardKernel(const TY *y, const TG *dy, TO *dx,
                                      int64_t rows, int64_t cols,
                                      float scale) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const TY *yr = y + r * cols;
    const TG *dyr = dy + r * cols;
    TO *dxr = dx + r * cols;
    float s = 0.0f;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x)
      s += toFloat(dyr[j]) * toFloat(yr[j]);
    s = blockReduce(s, Sum{}, 0.0f);
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x)
      dxr[j] = fromFloat<TO>(scale * (toFloat(yr[j]) * (toFloat(dyr[j]) - s)));
  }
}

int threadsFor(int64_t cols) { return cols <= 32 ? 32 : 256; }

unsigned blocksForRows(int64_t rows) {
  constexpr int64_t kMaxBlocks = 65535 * 8;
  return unsigned(rows < kMaxBlocks ? rows : kMaxBlocks);
}

} // namespace

template <typename TI, typename TO>
void softmaxForward(const TI *x, TO *out, int64_t rows, int64_t cols,
                    double scale, bool causal) {
  if (rows <= 0 || cols <= 0)
    return;
  softmaxForwardKernel<<<blocksForRows(rows), threadsFor(cols), 0,
                         computeStream()>>>(x, out, rows, cols, float(scale),
                                            causal);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

template <typename TY, typename TG, typename TO>
void softmaxBackward(const TY *y, const TG *dy, TO *dx, int64_t rows,
                     int64_t cols, double scale) {
  if (rows <= 0 || cols <= 0)
    return;
  softmaxBackwardKernel<<<blocksForRows(rows), threadsFor(cols), 0,
                          computeStream()>>>(y, dy, dx, rows, cols,
                                             float(scale));
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

#define TESSEL_INSTANTIATE2(A, B)                                              \
  template void softmaxForward<A, B>(const A *, B *, int64_t, int64_t, double, \
                                     bool);
TESSEL_CUDA_TYPES2(TESSEL_INSTANTIATE2)
#undef TESSEL_INSTANTIATE2

#define TESSEL_INSTANTIATE3(A, B, C)                                           \
  template void softmaxBackward<A, B, C>(const A *, const B *, C *, int64_t,   \
                                         int64_t, double);
TESSEL_CUDA_TYPES3(TESSEL_INSTANTIATE3)
#undef TESSEL_INSTANTIATE3

} // namespace tessel::cuda
