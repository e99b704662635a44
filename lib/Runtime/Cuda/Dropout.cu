//===- Dropout.cu - Dropout with masks drawn from global coordinates ------===//
//
// As lib/Runtime/Kernels/Dropout.cpp, with the same mask functions
// (Dropout.h), so a device program drops what the CPU program drops. The
// step that keys the masks is read from device memory, which the runtime
// writes before each step (a captured step's first node copies it), so a
// step launched as a CUDA graph draws its own step's masks.
//
//===----------------------------------------------------------------------===//

#include "Internal.h"

#include "tessel/Runtime/Dropout.h"

namespace tessel::cuda {

using detail::fromFloat;
using detail::toFloat;

namespace {

// One block per row (grid-stride over rows): the row's global index once,
// then its elements one after another.
template <typename TI, typename TO>
__global__ void dropoutKernel(const TI *x, TO *out, int64_t rows, int64_t cols,
                              rt::DropoutLayout layout, const int64_t *step,
                              int64_t stepValue, int64_t seed, int64_t site,
                              uint64_t threshold, float scale) {
  const uint64_t key = rt::dropoutKey(seed, site, step ? *step : stepValue);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const uint64_t first = rt::dropoutRowIndex(layout, r);
    const TI *xr = x + r * cols;
    TO *outr = out + r * cols;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
      bool keep = rt::dropoutKeeps(key, first + uint64_t(j), threshold);
      outr[j] = fromFloat<TO>(keep ? toFloat(xr[j]) * scale : 0.0f);
    }
  }
}

} // namespace

template <typename TI, typename TO>
void dropout(const TI *x, TO *out, int64_t microbatch, const int64_t *shape,
             const int64_t *splitAxes, int64_t rank, int64_t microbatches,
             double p, int64_t seed, int64_t site, int64_t zigzag) {
  const int64_t n = rt::elementsOf(shape, rank);
  if (n <= 0)
    return;
  // An evaluation keeps everything (threshold 0, scale 1).
  bool drop = !rt::runningEvaluation() && p > 0;
  rt::DropoutLayout layout =
      rt::dropoutLayout(shape, splitAxes, rank, microbatch, microbatches,
                        zigzag);
  const int64_t cols = shape[rank - 1], rows = n / cols;
  constexpr int64_t kMaxBlocks = 65535 * 8;
  unsigned blocks = unsigned(rows < kMaxBlocks ? rows : kMaxBlocks);
  dropoutKernel<<<blocks, cols <= 32 ? 32 : 256, 0, computeStream()>>>(
      x, out, rows, cols, layout, detail::deviceStep(), rt::runningStep(), seed,
      site, drop ? rt::dropoutThreshold(p) : 0,
      drop ? float(1.0 / (1.0 - p)) : 1.0f);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

#define TESSEL_INSTANTIATE2(A, B)                                              \
  template void dropout<A, B>(const A *, B *, int64_t, const int64_t *,        \
                              const int64_t *, int64_t, int64_t, double,       \
                              int64_t, int64_t, int64_t);
TESSEL_CUDA_TYPES2(TESSEL_INSTANTIATE2)
#undef TESSEL_INSTANTIATE2

} // namespace tessel::cuda
