//===- Sequence.h - Where a row of a reordered sequence sits -----*- C++ -*-===//
//
// Context parallelism with balanced pieces (parallel.cp_layout = "balanced",
// as Megatron-LM's): the sequence of `total` positions is cut into 2n
// chunks of h = total / 2n, and the program holds it in zigzag order, chunk
// k then chunk 2n-1-k for k = 0 .. n-1, so that the contiguous piece c of n
// (rows [2ch, 2ch + 2h)) is chunks c and 2n-1-c: under a causal mask every
// piece has the same work. Row `row` of the zigzag order is at position
// zigzagPosition(row, total, n) of the sequence; with n = 0 the order is the
// sequence's. Positions grow with the rows inside a piece, so a piece's
// causal tiles keep their order. The same function runs on the host and on
// a CUDA device.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_RUNTIME_SEQUENCE_H
#define TESSEL_RUNTIME_SEQUENCE_H

#include <cstdint>

#ifdef __CUDACC__
#define TESSEL_SEQ_HOST_DEVICE __host__ __device__
#else
#define TESSEL_SEQ_HOST_DEVICE
#endif

namespace tessel::rt {

TESSEL_SEQ_HOST_DEVICE inline int64_t zigzagPosition(int64_t row, int64_t total,
                                                     int64_t pieces) {
  if (pieces <= 0)
    return row;
  const int64_t h = total / (2 * pieces);
  const int64_t chunk = row / h, k = chunk / 2;
  const int64_t natural = chunk % 2 == 0 ? k : 2 * pieces - 1 - k;
  return natural * h + row % h;
}

} // namespace tessel::rt

#endif // TESSEL_RUNTIME_SEQUENCE_H
