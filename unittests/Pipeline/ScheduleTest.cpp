//===- ScheduleTest.cpp - Pipeline schedules over many shapes -------------===//

#include "tessel/Pipeline/Schedule.h"

#include <gtest/gtest.h>

using namespace tessel::pipeline;

static Timeline simulated(ScheduleKind kind, int p, int m, int v = 1) {
  llvm::Expected<Schedule> schedule = generateSchedule(kind, p, m, v);
  EXPECT_TRUE(static_cast<bool>(schedule))
      << llvm::toString(schedule.takeError());
  llvm::Expected<Timeline> timeline = simulate(*schedule);
  EXPECT_TRUE(static_cast<bool>(timeline))
      << llvm::toString(timeline.takeError());
  return *timeline;
}

// With forward = 1 and backward = 2, 1F1B idles (p-1)/(m+p-1) of the time on
// every rank, fewer microbatches than ranks included.
TEST(PipelineSchedule, OneFOneBBubbleIsTheClosedForm) {
  for (int p = 1; p <= 8; ++p)
    for (int m = 1; m <= 16; ++m) {
      Timeline timeline = simulated(ScheduleKind::OneFOneB, p, m);
      double expected = double(p - 1) / (m + p - 1);
      EXPECT_DOUBLE_EQ(timeline.makespan, 3.0 * (m + p - 1)) << p << " " << m;
      EXPECT_NEAR(timeline.bubble, expected, 1e-12) << p << " " << m;
      for (double bubble : timeline.rankBubble)
        EXPECT_NEAR(bubble, expected, 1e-12) << p << " " << m;
    }
}

TEST(PipelineSchedule, GPipeAndInterleavedAreDeadlockFree) {
  for (int p = 1; p <= 6; ++p)
    for (int m = 1; m <= 12; ++m) {
      simulated(ScheduleKind::GPipe, p, m);
      for (int v = 2; v <= 3 && m % p == 0; ++v) {
        Timeline timeline = simulated(ScheduleKind::Interleaved, p, m, v);
        // Never worse than 1F1B over the same work split into v chunks.
        EXPECT_LE(timeline.bubble, double(p - 1) / (m + p - 1) + 1e-12)
            << p << " " << m << " " << v;
      }
    }
}

TEST(PipelineSchedule, InterleavedRefusesUnevenMicrobatches) {
  llvm::Expected<Schedule> schedule =
      generateSchedule(ScheduleKind::Interleaved, 4, 6, 2);
  ASSERT_FALSE(static_cast<bool>(schedule));
  EXPECT_NE(llvm::toString(schedule.takeError()).find("multiple"),
            std::string::npos);
}

TEST(PipelineSchedule, BalanceMinimisesTheLargestStage) {
  llvm::Expected<std::vector<int>> stages =
      balanceStages({4, 1, 1, 1, 1, 4}, 3);
  ASSERT_TRUE(static_cast<bool>(stages));
  EXPECT_EQ(*stages, (std::vector<int>{0, 1, 1, 1, 1, 2}));
  stages = balanceStages({1, 1, 1, 1}, 4);
  ASSERT_TRUE(static_cast<bool>(stages));
  EXPECT_EQ(*stages, (std::vector<int>{0, 1, 2, 3}));
}
