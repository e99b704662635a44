//===- Dropout.cpp - Dropout with masks drawn from global coordinates -----===//
//
// See Dropout.h: the mask of an element follows from the seed, the site,
// the step and the element's place in the whole tensor.
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Dropout.h"
#include "tessel/Runtime/Comm.h"
#include "tessel/Runtime/Kernels.h"

#include <cstring>
#include <stdexcept>
#include <string>

namespace tessel::rt {
namespace {

int64_t stepNow = 0;
bool evaluatingNow = false;

constexpr int64_t kParallelMin = 1 << 14;

} // namespace

void setRunningStep(int64_t step, bool evaluating) {
  stepNow = step;
  evaluatingNow = evaluating;
}
int64_t runningStep() { return stepNow; }
bool runningEvaluation() { return evaluatingNow; }

DropoutLayout dropoutLayout(const int64_t *shape, const int64_t *splitAxes,
                            int64_t rank, int64_t microbatch,
                            int64_t microbatches, int64_t zigzag) {
  if (rank < 1 || rank > DropoutLayout::kMaxDims)
    throw std::runtime_error("dropout: a tensor of rank " +
                             std::to_string(rank) + " (1 to " +
                             std::to_string(DropoutLayout::kMaxDims) + ")");
  DropoutLayout l;
  l.rank = int(rank);
  int64_t stride = 1;
  for (int d = l.rank - 1; d >= 0; --d) {
    unsigned axes = unsigned(splitAxes[d]);
    int64_t pieces = axes ? groupSize(axes) : 1;
    int64_t block = axes ? groupRank(axes) : 0;
    if (d == 0 && microbatches > 1) {
      block += microbatch * pieces;
      pieces *= microbatches;
    }
    l.size[d] = shape[d];
    l.offset[d] = block * shape[d];
    l.stride[d] = stride;
    stride *= shape[d] * pieces;
    if (d == 1 && zigzag > 0) {
      l.zigzag = zigzag;
      l.sequence = shape[d] * pieces;
    }
  }
  if (zigzag > 0 && (l.rank < 3 || l.sequence % (2 * zigzag) != 0))
    throw std::runtime_error("dropout: dimension 1 of a tensor of rank " +
                             std::to_string(l.rank) +
                             " is not a sequence of 2 x " +
                             std::to_string(zigzag) + " chunks");
  return l;
}

template <typename T>
void dropout(const T *x, T *out, int64_t microbatch, const int64_t *shape,
             const int64_t *splitAxes, int64_t rank, int64_t microbatches,
             double p, int64_t seed, int64_t site, int64_t zigzag) {
  const int64_t n = elementsOf(shape, rank);
  if (n <= 0)
    return;
  if (runningEvaluation() || p <= 0) {
    std::memcpy(out, x, size_t(n) * sizeof(T));
    return;
  }
  const DropoutLayout l =
      dropoutLayout(shape, splitAxes, rank, microbatch, microbatches, zigzag);
  const uint64_t key = dropoutKey(seed, site, runningStep());
  const uint64_t threshold = dropoutThreshold(p);
  const T scale = T(1.0 / (1.0 - p));
  const int64_t cols = shape[rank - 1], rows = n / cols;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const uint64_t first = dropoutRowIndex(l, r);
    for (int64_t j = 0; j < cols; ++j)
      out[r * cols + j] =
          dropoutKeeps(key, first + uint64_t(j), threshold) ? x[r * cols + j] * scale
                                                            : T(0);
  }
}

#define TESSEL_INSTANTIATE(T)                                                  \
  template void dropout<T>(const T *, T *, int64_t, const int64_t *,           \
                           const int64_t *, int64_t, int64_t, double, int64_t, \
                           int64_t, int64_t);
TESSEL_INSTANTIATE(float)
TESSEL_INSTANTIATE(double)
#undef TESSEL_INSTANTIATE

} // namespace tessel::rt
