//===- ShardingTest.cpp - Shard index arithmetic --------------------------===//

#include "tessel/Runtime/Sharding.h"

#include <gtest/gtest.h>

#include <stdexcept>
#include <vector>

using namespace tessel::rt;

namespace {

std::vector<float> iota(int64_t n) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; i++)
    v[i] = (float)i;
  return v;
}

// Cuts a [6, 12] tensor into `parts` shards and puts them back together.
void roundTrip(int shardDim, int64_t blocks, int64_t parts) {
  const int64_t shape[2] = {6, 12};
  std::vector<float> global = iota(72);
  std::vector<float> rebuilt(72, -1.0f);
  int64_t total = 0;
  for (int64_t index = 0; index < parts; index++) {
    ShardLayout layout =
        makeShardLayout(shape, 2, shardDim, blocks, parts, index);
    ASSERT_EQ(layout.numel() * parts, 72);
    std::vector<float> shard(layout.numel(), -2.0f);
    copyShardOut(layout, global.data(), shard.data());
    copyShardIn(layout, shard.data(), rebuilt.data());
    total += layout.numel();
  }
  EXPECT_EQ(total, 72);
  EXPECT_EQ(rebuilt, global)
      << "dim " << shardDim << ", blocks " << blocks << ", parts " << parts;
}

} // namespace

TEST(RuntimeSharding, RoundTripDim0) {
  roundTrip(0, 1, 1);
  roundTrip(0, 1, 2);
  roundTrip(0, 1, 3);
  roundTrip(0, 3, 2);
  roundTrip(0, 1, 6);
}

TEST(RuntimeSharding, RoundTripDim1) {
  roundTrip(1, 1, 2);
  roundTrip(1, 1, 4);
  roundTrip(1, 3, 1);
  roundTrip(1, 3, 2);
  roundTrip(1, 3, 4);
}

TEST(RuntimeSharding, BlocksKeepPiecesTogether) {
  // A fused [q|k|v] bias of 12 elements: 3 blocks of 4, 2 pieces per block.
  const int64_t shape[1] = {12};
  std::vector<float> global = iota(12);
  std::vector<float> shard(6);
  copyShardOut(makeShardLayout(shape, 1, 0, 3, 2, 1), global.data(),
               shard.data());
  EXPECT_EQ(shard, (std::vector<float>{2, 3, 6, 7, 10, 11}));
  copyShardOut(makeShardLayout(shape, 1, 0, 3, 2, 0), global.data(),
               shard.data());
  EXPECT_EQ(shard, (std::vector<float>{0, 1, 4, 5, 8, 9}));
}

TEST(RuntimeSharding, ColumnShardWithBlocks) {
  // [2, 6], dimension 1 in 3 blocks of 2 columns, 2 pieces: piece 1 holds
  // columns 1, 3, 5 of each row.
  const int64_t shape[2] = {2, 6};
  std::vector<float> global = iota(12);
  ShardLayout layout = makeShardLayout(shape, 2, 1, 3, 2, 1);
  ASSERT_EQ(layout.numel(), 6);
  std::vector<float> shard(6);
  copyShardOut(layout, global.data(), shard.data());
  EXPECT_EQ(shard, (std::vector<float>{1, 3, 5, 7, 9, 11}));
}

TEST(RuntimeSharding, RunsGiveGlobalIndices) {
  // The runs map shard element k to its global index, which is what
  // initialisation uses to generate exactly a shard's values.
  const int64_t shape[3] = {2, 4, 3};
  ShardLayout layout = makeShardLayout(shape, 3, 1, 1, 2, 1);
  std::vector<int64_t> indices;
  forEachShardRun(layout, [&](int64_t g, int64_t s, int64_t n) {
    EXPECT_EQ(s, (int64_t)indices.size());
    for (int64_t i = 0; i < n; i++)
      indices.push_back(g + i);
  });
  EXPECT_EQ(indices,
            (std::vector<int64_t>{6, 7, 8, 9, 10, 11, 18, 19, 20, 21, 22, 23}));
}

TEST(RuntimeSharding, Replicated) {
  const int64_t shape[2] = {3, 5};
  ShardLayout layout = makeShardLayout(shape, 2, -1, 1, 1, 0);
  EXPECT_EQ(layout.numel(), 15);
  int runs = 0;
  forEachShardRun(layout, [&](int64_t g, int64_t s, int64_t n) {
    EXPECT_EQ(g, 0);
    EXPECT_EQ(s, 0);
    EXPECT_EQ(n, 15);
    runs++;
  });
  EXPECT_EQ(runs, 1);
}

TEST(RuntimeSharding, RejectsBadLayouts) {
  const int64_t shape[2] = {6, 10};
  EXPECT_THROW(makeShardLayout(shape, 2, 1, 3, 2, 0), std::runtime_error);
  EXPECT_THROW(makeShardLayout(shape, 2, 2, 1, 2, 0), std::runtime_error);
  EXPECT_THROW(makeShardLayout(shape, 2, 0, 1, 2, 2), std::runtime_error);
  EXPECT_THROW(makeShardLayout(shape, 2, 0, 0, 2, 0), std::runtime_error);
  EXPECT_THROW(makeShardLayout(shape, 2, -1, 1, 2, 0), std::runtime_error);
}

// An expert weight [4, 6, 10] cut over ep along dimension 0 (2 pieces) and
// then over tp along dimension 2 (2 pieces): each shard is the box [2, 6, 5]
// at (2 * ep index, 0, 5 * tp index), row-major, and the four shards
// rebuild the tensor.
TEST(RuntimeSharding, CutTwiceIsABox) {
  const int64_t shape[3] = {4, 6, 10};
  std::vector<float> global = iota(240);
  std::vector<float> rebuilt(240, -1.0f);
  for (int64_t e = 0; e < 2; e++)
    for (int64_t t = 0; t < 2; t++) {
      ShardLayout layout =
          cutAgain(makeShardLayout(shape, 3, 0, 1, 2, e), shape, 3, 0, 2, 2, t);
      ASSERT_EQ(layout.numel(), 60);
      std::vector<float> shard(60, -2.0f);
      copyShardOut(layout, global.data(), shard.data());
      for (int64_t i = 0; i < 2; i++)
        for (int64_t r = 0; r < 6; r++)
          for (int64_t c = 0; c < 5; c++)
            EXPECT_EQ(shard[(i * 6 + r) * 5 + c],
                      global[((2 * e + i) * 6 + r) * 10 + 5 * t + c]);
      copyShardIn(layout, shard.data(), rebuilt.data());
    }
  EXPECT_EQ(rebuilt, global);
}

TEST(RuntimeSharding, RejectsBadSecondCuts) {
  const int64_t shape[3] = {4, 6, 10};
  ShardLayout first = makeShardLayout(shape, 3, 1, 1, 2, 0);
  EXPECT_THROW(cutAgain(first, shape, 3, 1, 1, 2, 0), std::runtime_error);
  EXPECT_THROW(cutAgain(first, shape, 3, 1, 3, 2, 0), std::runtime_error);
  EXPECT_THROW(cutAgain(first, shape, 3, 1, 2, 3, 0), std::runtime_error);
  EXPECT_THROW(cutAgain(first, shape, 3, 1, 2, 2, 2), std::runtime_error);
  EXPECT_THROW(cutAgain(makeShardLayout(shape, 3, 1, 3, 2, 0), shape, 3, 1, 2,
                        2, 0),
               std::runtime_error);
}
