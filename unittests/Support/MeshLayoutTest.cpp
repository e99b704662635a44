//===- MeshLayoutTest.cpp - Groups of ranks on the mesh -------------------===//

#include "tessel/Support/MeshLayout.h"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <vector>

using namespace tessel;

namespace {

MeshShape shape(int64_t dp, int64_t tp, int64_t pp, int64_t zeroGroup) {
  MeshShape s;
  s[MeshAxis::DP] = dp;
  s[MeshAxis::TP] = tp;
  s[MeshAxis::PP] = pp;
  s.dpShard = zeroGroup;
  return s;
}

// The groups over `axes`: color -> the ranks in group order.
std::map<int64_t, std::vector<int64_t>> groups(const MeshLayout &layout,
                                               AxisSet axes) {
  std::map<int64_t, std::vector<int64_t>> byColor;
  for (int64_t rank = 0; rank < layout.worldSize(); rank++) {
    std::vector<int64_t> &group = byColor[layout.groupColor(rank, axes)];
    int64_t index = layout.groupRank(rank, axes);
    if ((int64_t)group.size() <= index)
      group.resize(index + 1, -1);
    EXPECT_EQ(group[index], -1) << "two ranks at one group index";
    group[index] = rank;
  }
  return byColor;
}

// dp = 4 in shard groups of 2, tp = 2, pp = 2: a shard group is the ranks
// with the same pp, tp and dp / 2; its replicas those with the same dp % 2.
TEST(MeshLayoutTest, HybridGroupsSplitDp) {
  MeshLayout layout(shape(4, 2, 2, 2));
  EXPECT_TRUE(layout.shape().hybrid());
  EXPECT_EQ(layout.shape().groupSize(AxisSet::dpShard()), 2);
  EXPECT_EQ(layout.shape().groupSize(AxisSet::dpReplica()), 2);
  EXPECT_EQ(layout.shape().groupSize(AxisSet::dpShard() | MeshAxis::TP), 4);
  auto shards = groups(layout, AxisSet::dpShard());
  auto replicas = groups(layout, AxisSet::dpReplica());
  EXPECT_EQ(shards.size(), 8u);
  EXPECT_EQ(replicas.size(), 8u);
  for (auto &[color, ranks] : shards) {
    ASSERT_EQ(ranks.size(), 2u);
    MeshCoords a = layout.coordsOf(ranks[0]), b = layout.coordsOf(ranks[1]);
    EXPECT_EQ(a[MeshAxis::PP], b[MeshAxis::PP]);
    EXPECT_EQ(a[MeshAxis::TP], b[MeshAxis::TP]);
    EXPECT_EQ(a[MeshAxis::DP] / 2, b[MeshAxis::DP] / 2);
    EXPECT_LT(ranks[0], ranks[1]); // group order is world order
  }
  for (auto &[color, ranks] : replicas) {
    ASSERT_EQ(ranks.size(), 2u);
    MeshCoords a = layout.coordsOf(ranks[0]), b = layout.coordsOf(ranks[1]);
    EXPECT_EQ(a[MeshAxis::TP], b[MeshAxis::TP]);
    EXPECT_EQ(a[MeshAxis::DP] % 2, b[MeshAxis::DP] % 2);
    EXPECT_NE(a[MeshAxis::DP], b[MeshAxis::DP]);
  }
  // Both halves are dp; dp with a half is dp.
  EXPECT_EQ(layout.shape().canonical(AxisSet::dpShard() | AxisSet::dpReplica()),
            AxisSet(MeshAxis::DP));
  EXPECT_EQ(layout.shape().canonical(AxisSet::dpShard() | MeshAxis::DP),
            AxisSet(MeshAxis::DP));
  EXPECT_EQ(groups(layout, AxisSet::dpShard() | AxisSet::dpReplica()),
            groups(layout, AxisSet(MeshAxis::DP)));
}

// Without hybrid sharding (or with a group of all dp) the shard group is
// dp and the replicas are each rank alone.
TEST(MeshLayoutTest, WholeDpIsTheShardGroup) {
  for (int64_t zeroGroup : {0, 4}) {
    MeshLayout layout(shape(4, 2, 1, zeroGroup));
    EXPECT_FALSE(layout.shape().hybrid());
    EXPECT_EQ(layout.shape().shardAxes(), AxisSet(MeshAxis::DP));
    EXPECT_EQ(layout.shape().effective(AxisSet::dpShard()),
              AxisSet(MeshAxis::DP));
    EXPECT_TRUE(layout.shape().effective(AxisSet::dpReplica()).empty());
    EXPECT_EQ(layout.shape().groupSize(AxisSet::dpReplica()), 1);
    EXPECT_EQ(groups(layout, AxisSet::dpShard()),
              groups(layout, AxisSet(MeshAxis::DP)));
  }
  EXPECT_EQ(shape(4, 1, 1, 0), shape(4, 1, 1, 4));
  EXPECT_NE(shape(4, 1, 1, 0), shape(4, 1, 1, 2));
  EXPECT_EQ(shape(4, 2, 1, 2).describe(), "dp=4 tp=2 zero_group=2");
}

} // namespace
