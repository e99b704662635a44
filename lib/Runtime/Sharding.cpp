//===- Sharding.cpp - Which elements of a parameter a rank holds ----------===//

#include "tessel/Runtime/Sharding.h"

#include <cstring>
#include <stdexcept>
#include <string>

namespace tessel::rt {

ShardLayout makeShardLayout(const int64_t *shape, int rank, int shardDim,
                            int64_t blocks, int64_t parts, int64_t index) {
  if (rank < 0)
    throw std::runtime_error("invalid tensor rank " + std::to_string(rank));
  ShardLayout layout;
  if (shardDim < 0) {
    if (parts != 1 || index != 0)
      throw std::runtime_error("a replicated tensor has exactly one piece");
    for (int d = 0; d < rank; d++)
      layout.dim *= shape[d];
    return layout;
  }
  if (shardDim >= rank)
    throw std::runtime_error("shard dimension " + std::to_string(shardDim) +
                             " is out of range for a tensor of rank " +
                             std::to_string(rank));
  if (blocks < 1 || parts < 1 || index < 0 || index >= parts)
    throw std::runtime_error("invalid sharding: " + std::to_string(blocks) +
                             " blocks, piece " + std::to_string(index) +
                             " of " + std::to_string(parts));
  for (int d = 0; d < shardDim; d++)
    layout.outer *= shape[d];
  layout.dim = shape[shardDim];
  for (int d = shardDim + 1; d < rank; d++)
    layout.inner *= shape[d];
  if (layout.dim % (blocks * parts) != 0)
    throw std::runtime_error("dimension " + std::to_string(shardDim) +
                             " of size " + std::to_string(layout.dim) +
                             " cannot be cut into " + std::to_string(blocks) +
                             " blocks of " + std::to_string(parts) +
                             " equal pieces");
  layout.blocks = blocks;
  layout.parts = parts;
  layout.index = index;
  return layout;
}

ShardLayout cutAgain(ShardLayout first, const int64_t *shape, int rank,
                     int shardDim, int dim2, int64_t parts2, int64_t index2) {
  if (dim2 <= shardDim || dim2 >= rank)
    throw std::runtime_error("second shard dimension " + std::to_string(dim2) +
                             " is not after " + std::to_string(shardDim) +
                             " in a tensor of rank " + std::to_string(rank));
  if (first.blocks != 1 || parts2 < 1 || index2 < 0 || index2 >= parts2)
    throw std::runtime_error("invalid second cut: piece " +
                             std::to_string(index2) + " of " +
                             std::to_string(parts2) + " of a tensor in " +
                             std::to_string(first.blocks) + " blocks");
  first.outer2 = first.pieceRows();
  for (int d = shardDim + 1; d < dim2; d++)
    first.outer2 *= shape[d];
  first.dim2 = shape[dim2];
  first.inner2 = 1;
  for (int d = dim2 + 1; d < rank; d++)
    first.inner2 *= shape[d];
  if (first.dim2 % parts2 != 0)
    throw std::runtime_error("dimension " + std::to_string(dim2) +
                             " of size " + std::to_string(first.dim2) +
                             " cannot be cut into " + std::to_string(parts2) +
                             " equal pieces");
  first.parts2 = parts2;
  first.index2 = index2;
  return first;
}

void copyShardOut(const ShardLayout &layout, const float *global,
                  float *shard) {
  forEachShardRun(
      layout, [&](int64_t globalOffset, int64_t shardOffset, int64_t count) {
        std::memcpy(shard + shardOffset, global + globalOffset,
                    (size_t)count * sizeof(float));
      });
}

void copyShardIn(const ShardLayout &layout, const float *shard, float *global) {
  forEachShardRun(
      layout, [&](int64_t globalOffset, int64_t shardOffset, int64_t count) {
        std::memcpy(global + globalOffset, shard + shardOffset,
                    (size_t)count * sizeof(float));
      });
}

} // namespace tessel::rt
