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

TEST(MeshLayoutTest, OrderIsSpelledInnermostFirst) {
  MeshShape s;
  EXPECT_TRUE(s.defaultOrder());
  EXPECT_EQ(s.orderName(), "tp-cp-ep-dp-pp");
  EXPECT_TRUE(s.setOrder("dp-tp-cp-ep-pp"));
  EXPECT_FALSE(s.defaultOrder());
  EXPECT_EQ(s.orderName(), "dp-tp-cp-ep-pp");
  EXPECT_EQ(s.order[0], MeshAxis::PP);
  EXPECT_EQ(s.order[4], MeshAxis::DP);
  // Refused, the order unchanged: pp not last, an axis twice or missing,
  // an unknown name, empty names.
  for (const char *bad :
       {"pp-tp-cp-ep-dp", "tp-tp-cp-ep-pp", "tp-cp-ep-pp", "tp-cp-ep-dp-pp-",
        "tp-cp-ep-dp-pp-tp", "tp-cp-xp-dp-pp", "", "-tp-cp-ep-dp-pp",
        "tp--cp-ep-dp-pp"}) {
    EXPECT_FALSE(s.setOrder(bad)) << bad;
    EXPECT_EQ(s.orderName(), "dp-tp-cp-ep-pp") << bad;
  }
  MeshShape other;
  EXPECT_NE(s, other);
  other.setOrder("dp-tp-cp-ep-pp");
  EXPECT_EQ(s, other);
}

// dp = 4, tp = 2, pp = 2 numbered dp innermost: a dp group is four
// consecutive ranks and a tp group ranks four apart; pipeline stages stay
// contiguous blocks, and group indices (the order of pieces in a group)
// are the default order's, so that every order computes the same pieces.
TEST(MeshLayoutTest, OrderPlacesTheInnerAxisOnConsecutiveRanks) {
  MeshShape s = shape(4, 2, 2, 0);
  MeshLayout byDefault(s);
  s.setOrder("dp-tp-cp-ep-pp");
  MeshLayout layout(s);
  for (int64_t rank = 0; rank < 16; ++rank) {
    MeshCoords c = layout.coordsOf(rank);
    EXPECT_EQ(c[MeshAxis::DP], rank % 4);
    EXPECT_EQ(c[MeshAxis::TP], rank / 4 % 2);
    EXPECT_EQ(c[MeshAxis::PP], rank / 8);
    EXPECT_EQ(layout.rankOf(c), rank);
    EXPECT_EQ(layout.programOf(rank), rank / 8);
    // The rank with the same coordinates in the default numbering.
    int64_t same = byDefault.rankOf(c);
    for (AxisSet axes : {AxisSet(MeshAxis::DP), AxisSet(MeshAxis::TP),
                         AxisSet(MeshAxis::DP) | MeshAxis::TP,
                         AxisSet(MeshAxis::PP)})
      EXPECT_EQ(layout.groupRank(rank, axes), byDefault.groupRank(same, axes));
  }
  EXPECT_EQ(layout.firstRankOfProgram(1), 8);
  auto dp = groups(layout, MeshAxis::DP);
  ASSERT_EQ(dp.size(), 4u);
  for (auto &[color, ranks] : dp)
    EXPECT_EQ(ranks, (std::vector<int64_t>{ranks[0], ranks[0] + 1,
                                           ranks[0] + 2, ranks[0] + 3}));
  auto tp = groups(layout, MeshAxis::TP);
  for (auto &[color, ranks] : tp)
    EXPECT_EQ(ranks[1] - ranks[0], 4);
  // Pipeline neighbours: the next stage's rank with the same coordinates.
  EXPECT_EQ(layout.peer(5, MeshAxis::PP, 1), 13);
  EXPECT_EQ(layout.peer(13, MeshAxis::PP, 1), std::nullopt);
}

// Hybrid sharding under another order: the shard groups are still the
// consecutive dp coordinates, whatever ranks hold them.
TEST(MeshLayoutTest, HybridGroupsUnderAnOrder) {
  MeshShape s = shape(4, 2, 1, 2);
  s.setOrder("dp-tp-cp-ep-pp");
  MeshLayout layout(s);
  auto shards = groups(layout, AxisSet::dpShard());
  EXPECT_EQ(shards.size(), 4u);
  for (auto &[color, ranks] : shards) {
    ASSERT_EQ(ranks.size(), 2u);
    MeshCoords a = layout.coordsOf(ranks[0]), b = layout.coordsOf(ranks[1]);
    EXPECT_EQ(a[MeshAxis::TP], b[MeshAxis::TP]);
    EXPECT_EQ(a[MeshAxis::DP] / 2, b[MeshAxis::DP] / 2);
    EXPECT_EQ(a[MeshAxis::DP] % 2, 0);
    EXPECT_EQ(ranks[1] - ranks[0], 1); // dp innermost: neighbours
  }
}
