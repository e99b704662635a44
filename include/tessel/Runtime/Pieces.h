//===- Pieces.h - A run cut into data-parallel pieces (ZeRO) ----*- C++ -*-===//
//
// With the training state sharded over a group of g ranks (parallel.zero),
// a run of n elements (a gradient bucket, or one gradient) is cut into g
// pieces of ceil(n / g) elements in group order, the last ones shorter or
// empty; piece k belongs to group rank k. The compiler, the CPU runtime and
// the CUDA runtime all cut runs with these.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_RUNTIME_PIECES_H
#define TESSEL_RUNTIME_PIECES_H

#include <algorithm>
#include <cstdint>

namespace tessel::rt {

// Elements of a full piece of an n-element run over g ranks.
inline int64_t pieceSize(int64_t n, int64_t g) { return (n + g - 1) / g; }

// Elements [begin, end) of a run (begin == end when empty).
struct PieceRange {
  int64_t begin, end;
  int64_t size() const { return end - begin; }
};

// The part of the run's elements [start, start + n) that lies in piece k
// of `piece`-element pieces.
inline PieceRange inPiece(int64_t start, int64_t n, int64_t piece, int64_t k) {
  int64_t begin = std::max(start, k * piece);
  int64_t end = std::min(start + n, (k + 1) * piece);
  return {begin, std::max(begin, end)};
}

} // namespace tessel::rt

#endif // TESSEL_RUNTIME_PIECES_H
