//===- CommVolume.h - Bytes a rank sends per collective ---------*- C++ -*-===//
//
// The one place that knows the textbook (ring) volume of each collective:
// the runtime counts with it and the compiler predicts with it, so a run's
// counters can be checked against the plan.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_RUNTIME_COMMVOLUME_H
#define TESSEL_RUNTIME_COMMVOLUME_H

#include <cstdint>

namespace tessel::rt {

// All-reduce of n elements over g ranks: 2(g-1)/g * n * bytes, rounded down.
inline int64_t allReduceBytesSent(int64_t n, int64_t g, int64_t bytes = 4) {
  return 2 * (g - 1) * n * bytes / g;
}
// All-gather of n elements per rank: (g-1) * n * bytes.
inline int64_t allGatherBytesSent(int64_t n, int64_t g, int64_t bytes = 4) {
  return (g - 1) * n * bytes;
}
// Reduce-scatter to n elements per rank: (g-1) * n * bytes.
inline int64_t reduceScatterBytesSent(int64_t n, int64_t g, int64_t bytes = 4) {
  return (g - 1) * n * bytes;
}

} // namespace tessel::rt

#endif // TESSEL_RUNTIME_COMMVOLUME_H
