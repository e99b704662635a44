//===- CommLayout.cpp - Collectives along a tensor dimension --------------===//
//
// MPI's all-gather and reduce-scatter work on rank-major blocks of a flat
// buffer; a tensor split along an inner dimension is repacked through a
// scratch buffer (grown once, then reused: no allocation in steady state).
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Comm.h"
#include "tessel/Runtime/Kernels.h"

#include <vector>

namespace tessel::rt {

static float *scratch(int64_t elements) {
  static std::vector<float> buffer;
  if ((int64_t)buffer.size() < elements)
    buffer.resize(elements);
  return buffer.data();
}

void allGatherAlong(const float *in, float *out, int64_t outer, int64_t len,
                    int64_t inner, unsigned axes) {
  int64_t g = groupSize(axes), n = outer * len * inner;
  if (outer == 1) {
    allGather(in, out, n, axes);
    return;
  }
  float *blocks = scratch(g * n); // [g, outer, len, inner]
  allGather(in, blocks, n, axes);
  for (int64_t r = 0; r < g; ++r)
    insertAxis(blocks + r * n, out, outer, g * len, inner, r * len, len);
}

void reduceScatterAlong(const float *in, float *out, int64_t outer, int64_t len,
                        int64_t inner, unsigned axes) {
  int64_t g = groupSize(axes), n = outer * len * inner;
  if (outer == 1) {
    reduceScatterSum(in, out, n, axes);
    return;
  }
  float *blocks = scratch(g * n);
  for (int64_t r = 0; r < g; ++r)
    sliceAxis(in, blocks + r * n, outer, g * len, inner, r * len, len);
  reduceScatterSum(blocks, out, n, axes);
}

} // namespace tessel::rt
