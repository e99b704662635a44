//===- Sharding.h - Which elements of a parameter a rank holds --*- C++ -*-===//
//
// A sharded parameter (see ParamInfo) is cut along one global dimension:
// that dimension is split into `blocks` equal blocks and each block into
// `parts` equal pieces, one per rank along the shard axis. A rank's shard is
// the concatenation, in block order, of its piece of every block, so with
// the global tensor viewed as [outer, dim, inner] the shard is
// [outer, blocks * piece, inner] with piece = dim / (blocks * parts).
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

  // Rows of the shard dimension in one piece.
  int64_t pieceRows() const { return dim / (blocks * parts); }
  int64_t globalNumel() const { return outer * dim * inner; }
  int64_t numel() const { return outer * blocks * pieceRows() * inner; }
};

// The layout of piece `index` of `parts` of a tensor of global `shape`
// (`rank` dimensions) cut along `shardDim` with `blocks` blocks. shardDim < 0
// means replicated: the shard is the whole tensor and parts must be 1.
// Throws std::runtime_error when shardDim is out of range, blocks or parts
// is not positive, index is outside [0, parts), or the dimension is not
// divisible by blocks * parts.
ShardLayout makeShardLayout(const int64_t *shape, int rank, int shardDim,
                            int64_t blocks, int64_t parts, int64_t index);

// Calls fn(globalOffset, shardOffset, count) for every contiguous run of
// the shard, in shard order; the runs cover [0, numel()) of the shard.
template <typename Fn>
void forEachShardRun(const ShardLayout &layout, Fn &&fn) {
  const int64_t piece = layout.pieceRows();
  const int64_t run = piece * layout.inner;
  const int64_t blockRows = layout.dim / layout.blocks;
  int64_t shardOffset = 0;
  for (int64_t o = 0; o < layout.outer; o++)
    for (int64_t b = 0; b < layout.blocks; b++) {
      int64_t row = b * blockRows + layout.index * piece;
      int64_t globalOffset = (o * layout.dim + row) * layout.inner;
      if (run > 0)
        fn(globalOffset, shardOffset, run);
      shardOffset += run;
    }
}

// Copies this shard's elements out of the global tensor into shard[0,
// numel()).
void copyShardOut(const ShardLayout &layout, const float *global, float *shard);
// Copies shard[0, numel()) into its place in the global tensor.
void copyShardIn(const ShardLayout &layout, const float *shard, float *global);

} // namespace tessel::rt

#endif // TESSEL_RUNTIME_SHARDING_H
