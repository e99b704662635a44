//===- Sharding.h - Which elements of a parameter a rank holds --*- C++ -*-===//
//
// A sharded parameter (see ParamInfo) is cut along one global dimension:
// that dimension is split into `blocks` equal blocks and each block into
// `parts` equal pieces, one per rank along the shard axis. A rank's shard is
// the concatenation, in block order, of its piece of every block, so with
// the global tensor viewed as [outer, dim, inner] the shard is
// [outer, blocks * piece, inner] with piece = dim / (blocks * parts).
//
// A tensor may be cut a second time along a later dimension (an expert's
// weights: the experts over ep, each one's width over tp), of one block
// each: the shard is then a box of the global tensor, the second cut's
// piece of the first's.
//
// Everything here is plain index arithmetic; it never communicates.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_RUNTIME_SHARDING_H
#define TESSEL_RUNTIME_SHARDING_H

#include <cstdint>

namespace tessel::rt {

struct ShardLayout {
  int64_t outer = 1;  // product of the dimensions before the shard dimension
  int64_t dim = 1;    // global size of the shard dimension
  int64_t inner = 1;  // product of the dimensions after it
  int64_t blocks = 1; // equal blocks of the shard dimension
  int64_t parts = 1;  // pieces per block, one per rank along the shard axis
  int64_t index = 0;  // which piece this shard holds, in [0, parts)
  // The second cut, within the first's piece viewed as [outer2, dim2,
  // inner2] per row of `outer` (parts2 1: none).
  int64_t outer2 = 1, dim2 = 1, inner2 = 1, parts2 = 1, index2 = 0;

  // Rows of the shard dimension in one piece.
  int64_t pieceRows() const { return dim / (blocks * parts); }
  int64_t globalNumel() const { return outer * dim * inner; }
  int64_t numel() const {
    return outer * blocks * pieceRows() * inner / parts2;
  }
};

// The layout of piece `index` of `parts` of a tensor of global `shape`
// (`rank` dimensions) cut along `shardDim` with `blocks` blocks. shardDim < 0
// means replicated: the shard is the whole tensor and parts must be 1.
// Throws std::runtime_error when shardDim is out of range, blocks or parts
// is not positive, index is outside [0, parts), or the dimension is not
// divisible by blocks * parts.
ShardLayout makeShardLayout(const int64_t *shape, int rank, int shardDim,
                            int64_t blocks, int64_t parts, int64_t index);
// `first` (one block) cut again along `dim2` > its shard dimension into
// `parts2` pieces, of which this shard holds `index2`. Throws as above.
ShardLayout cutAgain(ShardLayout first, const int64_t *shape, int rank,
                     int shardDim, int dim2, int64_t parts2, int64_t index2);

// Calls fn(globalOffset, shardOffset, count) for every contiguous run of
// the shard, in shard order; the runs cover [0, numel()) of the shard.
template <typename Fn>
void forEachShardRun(const ShardLayout &layout, Fn &&fn) {
  const int64_t piece = layout.pieceRows();
  const int64_t run = piece * layout.inner;
  const int64_t blockRows = layout.dim / layout.blocks;
  // Second cut: each run of the first holds outer2 rows of [dim2, inner2],
  // of which the shard keeps piece2 rows.
  const int64_t piece2 = layout.dim2 / layout.parts2;
  const int64_t run2 = piece2 * layout.inner2;
  int64_t shardOffset = 0;
  for (int64_t o = 0; o < layout.outer; o++)
    for (int64_t b = 0; b < layout.blocks; b++) {
      int64_t row = b * blockRows + layout.index * piece;
      int64_t globalOffset = (o * layout.dim + row) * layout.inner;
      if (layout.parts2 == 1) {
        if (run > 0)
          fn(globalOffset, shardOffset, run);
        shardOffset += run;
        continue;
      }
      for (int64_t o2 = 0; o2 < layout.outer2; o2++) {
        int64_t at = globalOffset +
                     (o2 * layout.dim2 + layout.index2 * piece2) *
                         layout.inner2;
        if (run2 > 0)
          fn(at, shardOffset, run2);
        shardOffset += run2;
      }
    }
}

// Copies this shard's elements out of the global tensor into shard[0,
// numel()).
void copyShardOut(const ShardLayout &layout, const float *global, float *shard);
// Copies shard[0, numel()) into its place in the global tensor.
void copyShardIn(const ShardLayout &layout, const float *shard, float *global);

} // namespace tessel::rt

#endif // TESSEL_RUNTIME_SHARDING_H
