//===- Dropout.h - Dropout masks that every layout draws alike --*- C++ -*-===//
//
// A dropout mask is a function of the training seed, the dropout site (which
// place of the model), the step and the element's coordinates in the whole
// tensor of the step (the global batch, all heads, the whole sequence), and
// of nothing else: no generator state, no rank, no microbatch count. So
// every layout drops the same elements as the one-rank program, the backward
// pass (and a recomputed forward) draws the mask again instead of storing
// it, and a resumed run draws what the uninterrupted one would.
//
// The bits are a 64-bit mix (SplitMix64's finaliser) of a per-site, per-step
// key and the element's global index; an element is kept when its top 32
// bits are at least p * 2^32, and scaled by 1 / (1 - p). The same functions
// run on the host and on a CUDA device, so both targets draw the same masks.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_RUNTIME_DROPOUT_H
#define TESSEL_RUNTIME_DROPOUT_H

#include "tessel/Runtime/Sequence.h"

#include <cstdint>

#ifdef __CUDACC__
#define TESSEL_HOST_DEVICE __host__ __device__
#else
#define TESSEL_HOST_DEVICE
#endif

namespace tessel::rt {

TESSEL_HOST_DEVICE inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The key of one site at one step.
TESSEL_HOST_DEVICE inline uint64_t dropoutKey(int64_t seed, int64_t site,
                                              int64_t step) {
  return mix64(mix64(uint64_t(seed) + 0x9E3779B97F4A7C15ull) ^
               mix64(uint64_t(site) * 0xD1B54A32D192ED03ull + 1) ^
               mix64(uint64_t(step) * 0x8CB92BA72F3D8DD7ull + 2));
}

// Whether the element at `index` (its place in the whole tensor) is kept.
TESSEL_HOST_DEVICE inline bool dropoutKeeps(uint64_t key, uint64_t index,
                                            uint64_t threshold) {
  uint64_t bits = mix64(key ^ (index * 0x9E3779B97F4A7C15ull)) >> 32;
  return bits >= threshold;
}

// p * 2^32, the threshold of dropoutKeeps.
inline uint64_t dropoutThreshold(double p) {
  return uint64_t(p * 4294967296.0);
}

// Where a rank's piece of a site's tensor sits in the whole one: per
// dimension (at most kMaxDims), the piece's size, the whole tensor's
// stride and the piece's offset. Dimension d is split over the mesh axes
// `splitAxes[d]` (a bit set) in their group order; dimension 0, the
// batch, also over `microbatches` in time, microbatch-major, as the data
// loader hands out rows (the global row of row r of microbatch m at data
// rank g is (m * G + g) * rows + r).
// With `zigzag` pieces, dimension 1 is a sequence of `sequence` rows in
// the balanced order (Sequence.h): its coordinate is the row's position.
struct DropoutLayout {
  static constexpr int kMaxDims = 6;
  int rank = 0;
  int64_t size[kMaxDims], stride[kMaxDims], offset[kMaxDims];
  int64_t zigzag = 0, sequence = 0;
};
inline int64_t elementsOf(const int64_t *shape, int64_t rank) {
  int64_t n = 1;
  for (int64_t d = 0; d < rank; ++d)
    n *= shape[d];
  return n;
}
DropoutLayout dropoutLayout(const int64_t *shape, const int64_t *splitAxes,
                            int64_t rank, int64_t microbatch,
                            int64_t microbatches, int64_t zigzag = 0);

// The global index of the first element of local row `row` of a piece
// laid out by `l` (a row: the last dimension, whose elements follow one
// another in the whole tensor too).
TESSEL_HOST_DEVICE inline uint64_t dropoutRowIndex(const DropoutLayout &l,
                                                   int64_t row) {
  const int last = l.rank - 1;
  uint64_t index = uint64_t(l.offset[last]);
  for (int d = last - 1; d >= 0; --d) {
    int64_t c = row % l.size[d] + l.offset[d];
    row /= l.size[d];
    if (d == 1 && l.zigzag > 0)
      c = zigzagPosition(c, l.sequence, l.zigzag);
    index += uint64_t(c) * uint64_t(l.stride[d]);
  }
  return index;
}

// The step the running program computes, and whether it evaluates (no
// dropout then): the driver sets them before each call of a step.
void setRunningStep(int64_t step, bool evaluating);
int64_t runningStep();
bool runningEvaluation();

} // namespace tessel::rt

#endif // TESSEL_RUNTIME_DROPOUT_H
