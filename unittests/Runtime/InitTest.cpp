//===- InitTest.cpp - Deterministic parameter initialisation --------------===//

#include "tessel/Runtime/Init.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

using namespace tessel::rt;

namespace {

ParamInfo normalParam(const char *name, int64_t numel, float mean, float std) {
  ParamInfo p = {};
  p.name = name;
  p.rank = 1;
  p.shape[0] = numel;
  p.numel = numel;
  p.init = InitKind::Normal;
  p.initMean = mean;
  p.initStd = std;
  return p;
}

} // namespace

TEST(RuntimeInit, Reproducible) {
  ParamInfo p = normalParam("h.0.attn.c_attn.weight", 1000, 0.0f, 0.02f);
  std::vector<float> a(1000), b(1000);
  initParam(p, 42, a.data());
  initParam(p, 42, b.data());
  EXPECT_EQ(a, b);
  // Another seed or another name gives other values.
  std::vector<float> c(1000), d(1000);
  initParam(p, 43, c.data());
  p.name = "h.1.attn.c_attn.weight";
  initParam(p, 42, d.data());
  EXPECT_NE(a, c);
  EXPECT_NE(a, d);
}

TEST(RuntimeInit, ShardsMatchWholeParameter) {
  ParamInfo p = normalParam("wte.weight", 4096, 0.0f, 1.0f);
  std::vector<float> whole(4096);
  initParam(p, 7, whole.data());
  std::vector<float> shard(1000);
  initRange(p.name, p.init, p.initMean, p.initStd, 7, 1500, 1000, shard.data());
  for (int i = 0; i < 1000; i++)
    ASSERT_EQ(shard[i], whole[1500 + i]) << i;
  // The same element through the scalar sampler.
  uint64_t h = hashName("wte.weight");
  EXPECT_EQ(whole[123], (float)normalSample(7, h, 123));
}

TEST(RuntimeInit, MeanAndStd) {
  const int64_t n = 200000;
  ParamInfo p = normalParam("lm.w", n, 0.5f, 0.02f);
  std::vector<float> x(n);
  initParam(p, 1234, x.data());
  double sum = 0, sumSq = 0;
  int64_t within1 = 0;
  for (float v : x) {
    ASSERT_TRUE(std::isfinite(v));
    sum += v;
    sumSq += (double)v * v;
    within1 += std::fabs(v - 0.5) < 0.02;
  }
  double mean = sum / n;
  double std = std::sqrt(sumSq / n - mean * mean);
  EXPECT_NEAR(mean, 0.5, 0.001);
  EXPECT_NEAR(std, 0.02, 0.0005);
  // About 68.3% of a normal lies within one standard deviation.
  EXPECT_NEAR((double)within1 / n, 0.6827, 0.01);
}

TEST(RuntimeInit, ZerosAndOnes) {
  ParamInfo p = normalParam("ln.weight", 17, 3.0f, 9.0f);
  std::vector<float> x(17, -5.0f);
  p.init = InitKind::Ones;
  initParam(p, 1, x.data());
  for (float v : x)
    EXPECT_EQ(v, 1.0f);
  p.init = InitKind::Zeros;
  initParam(p, 1, x.data());
  for (float v : x)
    EXPECT_EQ(v, 0.0f);
}

TEST(RuntimeInit, NameHashIsStable) {
  EXPECT_EQ(hashName("a"), hashName("a"));
  EXPECT_NE(hashName("h.0.mlp.c_fc.weight"), hashName("h.0.mlp.c_fc.bias"));
  EXPECT_NE(hashName(""), hashName("a"));
}
