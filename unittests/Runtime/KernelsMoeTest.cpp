//===- KernelsMoeTest.cpp - Mixture-of-experts kernels ---------------------===//
//
// The routing, dispatch, grouped GEMM and auxiliary losses of a routed MoE
// layer against the naive references (KernelsRef.h: Mixtral's routing by a
// stable sort, the dispatch by a scan per expert, Switch's load-balancing
// loss and the router z-loss from their formulas), the properties a layer
// relies on (ties, capacity, shards), and each backward against central
// finite differences in double.
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Kernels.h"
#include "tessel/Runtime/KernelsRef.h"

#include "FiniteDifferences.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace rt = tessel::rt;
using tessel::testing::dot;
using tessel::testing::gradError;
using tessel::testing::randVec;
using Vec = tessel::testing::Vec;
using Ids = std::vector<int32_t>;
using Fn = tessel::testing::Fn;

namespace {

Vec softmaxRows(const Vec &logits, int64_t rows, int64_t E) {
  Vec p(logits.size());
  rt::softmaxForward(logits.data(), p.data(), rows, E);
  return p;
}

// The router's weights for logits: softmax, top-k, renormalised.
Vec routerWeights(const Vec &logits, int64_t N, int64_t E, int64_t k,
                  Ids *chosen = nullptr) {
  Vec p = softmaxRows(logits, N, E), w(N * k);
  Ids ids(N * k);
  rt::moeTopK(p.data(), ids.data(), w.data(), N, E, k);
  if (chosen)
    *chosen = ids;
  return w;
}

} // namespace

TEST(KernelMoe, TopKIsMixtralsRouting) {
  std::mt19937 gen(300);
  const int64_t N = 37, E = 8, k = 2;
  Vec p = softmaxRows(randVec(N * E, gen, -3, 3), N, E);
  Ids ids(N * k), refIds(N * k);
  Vec w(N * k), refW(N * k);
  rt::moeTopK(p.data(), ids.data(), w.data(), N, E, k);
  rt::ref::moeTopK(p.data(), refIds.data(), refW.data(), N, E, k);
  EXPECT_EQ(ids, refIds);
  for (int64_t t = 0; t < N; ++t) {
    EXPECT_NEAR(w[t * k] + w[t * k + 1], 1.0, 1e-15);
    for (int64_t s = 0; s < k; ++s)
      EXPECT_NEAR(w[t * k + s], refW[t * k + s], 1e-15);
  }
}

TEST(KernelMoe, TopKBreaksTiesByTheLowerExpert) {
  const int64_t E = 6, k = 3;
  Vec p = {0.1, 0.2, 0.2, 0.1, 0.2, 0.2};
  Ids ids(k);
  Vec w(k);
  rt::moeTopK(p.data(), ids.data(), w.data(), 1, E, k);
  EXPECT_EQ(ids, (Ids{1, 2, 4}));
  for (double x : w)
    EXPECT_DOUBLE_EQ(x, 1.0 / 3);
  std::vector<float> pf(E, 1.0f / E), wf(k);
  rt::moeTopK(pf.data(), ids.data(), wf.data(), 1, E, k);
  EXPECT_EQ(ids, (Ids{0, 1, 2}));
  EXPECT_THROW(rt::moeTopK(p.data(), ids.data(), w.data(), 1, E, E + 1),
               std::invalid_argument);
}

TEST(KernelMoe, RouterGradient) {
  std::mt19937 gen(301);
  const int64_t N = 9, E = 5, k = 2;
  Vec logits = randVec(N * E, gen, -2, 2), r = randVec(N * k, gen);
  Ids ids;
  routerWeights(logits, N, E, k, &ids);
  Vec p = softmaxRows(logits, N, E), dp(N * E), dl(N * E);
  rt::moeTopKBackward(p.data(), ids.data(), r.data(), dp.data(), N, E, k,
                      /*accumulate=*/false);
  rt::softmaxBackward(p.data(), dp.data(), dl.data(), N, E);
  EXPECT_LT(gradError([&](const Vec &l) { return routerWeights(l, N, E, k); },
                      logits, r, dl),
            1e-6);
  // Accumulating adds to what is there.
  Vec acc(N * E, 1.0);
  rt::moeTopKBackward(p.data(), ids.data(), r.data(), acc.data(), N, E, k,
                      /*accumulate=*/true);
  for (int64_t i = 0; i < N * E; ++i)
    EXPECT_NEAR(acc[i], 1.0 + dp[i], 1e-15);
}

TEST(KernelMoe, DispatchGroupsByExpertInTokenOrder) {
  std::mt19937 gen(302);
  const int64_t N = 50, k = 2, E = 4;
  Ids experts(N * k);
  for (int64_t t = 0; t < N; ++t) {
    // Two distinct experts a token, as the top-k gives.
    int32_t a = gen() % E, b = (a + 1 + gen() % (E - 1)) % E;
    experts[t * k] = a;
    experts[t * k + 1] = b;
  }
  Ids rowOf(N * k), refRowOf(N * k);
  std::vector<int32_t> offsets(E + 1), refOffsets(E + 1);
  auto matchesReference = [&](int64_t capacity, int64_t rows) {
    EXPECT_EQ(rows, rt::ref::moeDispatchPlan(experts.data(), N, k, E,
                                             capacity, nullptr,
                                             refRowOf.data(),
                                             refOffsets.data()));
    EXPECT_EQ(rowOf, refRowOf) << "capacity " << capacity;
    EXPECT_EQ(offsets, refOffsets) << "capacity " << capacity;
  };
  int64_t rows = rt::moeDispatchPlan(experts.data(), N, k, E, 0, nullptr,
                                     rowOf.data(), offsets.data());
  EXPECT_EQ(rows, N * k);
  matchesReference(0, rows);
  // Dropless: every assignment has a row, the rows are a permutation, and
  // expert e's rows hold its assignments in (token, slot) order.
  std::vector<int> expected;
  for (int64_t e = 0; e < E; ++e) {
    EXPECT_EQ(offsets[e + 1] - offsets[e],
              std::count(experts.begin(), experts.end(), (int32_t)e));
    for (int64_t a = 0; a < N * k; ++a)
      if (experts[a] == e)
        expected.push_back((int)a);
  }
  std::vector<int> assignmentAt(N * k, -1);
  for (int64_t a = 0; a < N * k; ++a) {
    ASSERT_GE(rowOf[a], 0);
    assignmentAt[rowOf[a]] = (int)a;
  }
  EXPECT_EQ(assignmentAt, expected);

  // With a capacity, each expert keeps its first `capacity` assignments in
  // token order and drops the rest.
  const int64_t capacity = 9;
  rows = rt::moeDispatchPlan(experts.data(), N, k, E, capacity, nullptr,
                             rowOf.data(), offsets.data());
  matchesReference(capacity, rows);
  int64_t kept = 0;
  for (int64_t e = 0; e < E; ++e) {
    int64_t seen = 0;
    for (int64_t a = 0; a < N * k; ++a)
      if (experts[a] == e) {
        EXPECT_EQ(rowOf[a] >= 0, seen < capacity) << "assignment " << a;
        ++seen;
      }
    EXPECT_EQ(offsets[e + 1] - offsets[e], std::min(seen, capacity));
    kept += std::min(seen, capacity);
  }
  EXPECT_EQ(rows, kept);
  EXPECT_LT(kept, N * k); // something was dropped

  // A shard of the tokens, told how many assignments each expert took
  // before it, drops the same assignments as the whole.
  const int64_t half = N / 2;
  std::vector<int64_t> before(E, 0);
  for (int64_t a = 0; a < half * k; ++a)
    before[experts[a]]++;
  Ids second(N * k - half * k);
  std::vector<int32_t> secondOffsets(E + 1);
  rt::moeDispatchPlan(experts.data() + half * k, N - half, k, E, capacity,
                      before.data(), second.data(), secondOffsets.data());
  for (int64_t a = half * k; a < N * k; ++a)
    EXPECT_EQ(second[a - half * k] >= 0, rowOf[a] >= 0) << "assignment " << a;

  experts[3] = (int32_t)E;
  EXPECT_THROW(rt::moeDispatchPlan(experts.data(), N, k, E, 0, nullptr,
                                   rowOf.data(), offsets.data()),
               std::invalid_argument);
}

TEST(KernelMoe, PermuteAndUnpermute) {
  std::mt19937 gen(303);
  const int64_t N = 11, k = 2, E = 3, H = 4;
  Ids experts(N * k);
  for (int64_t t = 0; t < N; ++t) {
    experts[t * k] = (int32_t)(t % E);
    experts[t * k + 1] = (int32_t)((t + 1) % E);
  }
  Ids rowOf(N * k);
  std::vector<int32_t> offsets(E + 1);
  // A capacity that drops some assignments.
  const int64_t M = rt::moeDispatchPlan(experts.data(), N, k, E, 6, nullptr,
                                        rowOf.data(), offsets.data());
  ASSERT_LT(M, N * k);
  Vec x = randVec(N * H, gen), w = randVec(N * k, gen, 0.1, 1);
  Vec yp = randVec(M * H, gen);
  // Permute gathers each kept assignment's token row.
  Vec xp(M * H), refXp(M * H);
  rt::moePermute(x.data(), rowOf.data(), xp.data(), N, k, H);
  rt::ref::moePermute(x.data(), rowOf.data(), refXp.data(), N, k, H);
  EXPECT_EQ(xp, refXp);
  // Unpermute sums each token's kept rows, weighted.
  Vec y(N * H), refY(N * H);
  rt::moeUnpermute(yp.data(), rowOf.data(), w.data(), y.data(), N, k, H);
  rt::ref::moeUnpermute(yp.data(), rowOf.data(), w.data(), refY.data(), N, k,
                        H);
  for (int64_t i = 0; i < N * H; ++i)
    EXPECT_NEAR(y[i], refY[i], 1e-15);

  // Gradients.
  Vec rp = randVec(M * H, gen), dx(N * H);
  rt::moePermuteBackward(rp.data(), rowOf.data(), dx.data(), N, k, H);
  EXPECT_LT(gradError(
                [&](const Vec &in) {
                  Vec out(M * H);
                  rt::moePermute(in.data(), rowOf.data(), out.data(), N, k, H);
                  return out;
                },
                x, rp, dx),
            1e-6);
  Vec r = randVec(N * H, gen), dyp(M * H), dw(N * k);
  rt::moeUnpermuteBackward(yp.data(), rowOf.data(), w.data(), r.data(),
                           dyp.data(), dw.data(), N, k, H);
  auto unpermute = [&](const Vec &rows, const Vec &weights) {
    Vec out(N * H);
    rt::moeUnpermute(rows.data(), rowOf.data(), weights.data(), out.data(), N,
                     k, H);
    return out;
  };
  EXPECT_LT(gradError([&](const Vec &in) { return unpermute(in, w); }, yp, r,
                      dyp),
            1e-6);
  EXPECT_LT(gradError([&](const Vec &in) { return unpermute(yp, in); }, w, r,
                      dw),
            1e-6);
}

TEST(KernelMoe, GroupedMatmul) {
  std::mt19937 gen(304);
  const int64_t E = 3, K = 5, N = 4;
  // Expert 1 has no rows.
  std::vector<int32_t> offsets = {0, 4, 4, 9};
  const int64_t M = offsets[E];
  Vec x = randVec(M * K, gen);
  for (bool transW : {false, true}) {
    Vec W = randVec(E * K * N, gen), out(M * N), want(M * N);
    rt::groupedMatmul(x.data(), W.data(), out.data(), offsets.data(), E, K, N,
                      transW, false);
    rt::ref::groupedMatmul(x.data(), W.data(), want.data(), offsets.data(), E,
                           K, N, transW, false);
    for (int64_t i = 0; i < M * N; ++i)
      EXPECT_NEAR(out[i], want[i], 1e-13);
    // dW through the weight gradient, dx through the grouped product with
    // W transposed.
    Vec r = randVec(M * N, gen), dW(E * K * N), dx(M * K);
    rt::groupedMatmulWeightGrad(x.data(), r.data(), dW.data(), offsets.data(),
                                E, K, N, transW, false);
    rt::groupedMatmul(r.data(), W.data(), dx.data(), offsets.data(), E, N, K,
                      !transW, false);
    auto product = [&](const Vec &xx, const Vec &ww) {
      Vec o(M * N);
      rt::groupedMatmul(xx.data(), ww.data(), o.data(), offsets.data(), E, K,
                        N, transW, false);
      return o;
    };
    EXPECT_LT(gradError([&](const Vec &in) { return product(in, W); }, x, r,
                        dx),
              1e-6)
        << "transW " << transW;
    EXPECT_LT(gradError([&](const Vec &in) { return product(x, in); }, W, r,
                        dW),
              1e-6)
        << "transW " << transW;
    for (int64_t i = K * N; i < 2 * K * N; ++i)
      EXPECT_EQ(dW[i], 0.0); // the expert without rows
  }
}

// The experts' weight gradient summed over microbatches by the grouped
// kernel: over segments by source rank (two ranks' rows for each of the
// experts), the first microbatch writing whatever dW held, the second
// adding its own; the sum of the two microbatches' gradients.
TEST(KernelMoe, GroupedWeightGradAccumulates) {
  std::mt19937 gen(305);
  const int64_t E = 2, K = 3, N = 4, segments = 4;
  std::vector<int32_t> offsets = {0, 2, 5, 5, 7};
  const int64_t M = offsets[segments];
  for (bool transW : {false, true}) {
    Vec dW = randVec(E * K * N, gen), want(E * K * N, 0.0);
    for (int run = 0; run < 2; ++run) {
      Vec x = randVec(M * K, gen), r = randVec(M * N, gen), one(E * K * N);
      rt::groupedMatmulWeightGradSegmentsAccumulate(
          x.data(), r.data(), dW.data(), offsets.data(), run == 0, segments, E,
          K, N, transW);
      rt::groupedMatmulWeightGradSegments(x.data(), r.data(), one.data(),
                                          offsets.data(), segments, E, K, N,
                                          transW);
      for (int64_t i = 0; i < E * K * N; ++i)
        want[i] += one[i];
    }
    for (int64_t i = 0; i < E * K * N; ++i)
      EXPECT_NEAR(dW[i], want[i], 1e-13) << "transW " << transW;
  }
}

TEST(KernelMoe, LoadBalancingAndZLoss) {
  std::mt19937 gen(305);
  const int64_t N = 13, E = 4, k = 2;
  const double coef = 0.01;
  Vec logits = randVec(N * E, gen, -2, 2);
  Vec p = softmaxRows(logits, N, E);
  Ids ids(N * k);
  Vec w(N * k);
  rt::moeTopK(p.data(), ids.data(), w.data(), N, E, k);
  // Statistics accumulate: two shards of the tokens give the whole's.
  Vec counts(E, 0), probSums(E, 0);
  rt::moeLoadStats(p.data(), ids.data(), counts.data(), probSums.data(), 6, E,
                   k);
  rt::moeLoadStats(p.data() + 6 * E, ids.data() + 6 * k, counts.data(),
                   probSums.data(), N - 6, E, k);
  double aux = rt::moeAuxLoss(counts.data(), probSums.data(), N, E, k, coef);
  EXPECT_NEAR(aux, rt::ref::moeAuxLoss(p.data(), ids.data(), N, E, k, coef),
              1e-15);
  // Its gradient by the probabilities, with the choices held fixed.
  Vec dp(N * E, 0);
  rt::moeAuxLossBackward(counts.data(), N, E, k, coef, 1.0, dp.data(), N);
  Vec one = {1.0};
  EXPECT_LT(gradError(
                [&](const Vec &probs) {
                  Vec c(E, 0), s(E, 0);
                  rt::moeLoadStats(probs.data(), ids.data(), c.data(),
                                   s.data(), N, E, k);
                  return Vec{rt::moeAuxLoss(c.data(), s.data(), N, E, k,
                                            coef)};
                },
                p, one, dp),
            1e-6);

  // z-loss: the sum over tokens of logsumexp(logits)^2.
  EXPECT_NEAR(rt::moeZLossSum(logits.data(), N, E),
              rt::ref::moeZLossSum(logits.data(), N, E), 1e-12);
  Vec dl(N * E, 0);
  rt::moeZLossBackward(logits.data(), N, E, 1.0, dl.data());
  EXPECT_LT(gradError(
                [&](const Vec &l) {
                  return Vec{rt::moeZLossSum(l.data(), N, E)};
                },
                logits, one, dl),
            1e-6);
}
