//===- MoeTest.cu - CUDA mixture-of-experts kernels -----------------------===//
//
// Every kernel of Moe.cu against the CPU kernel of the same name
// (lib/Runtime/Kernels/Moe.cpp) on random routings, for float and bf16
// storage: the routing and the dispatch plan exactly (the same experts,
// rows and capacity drops), the rest to rounding. Shapes cross the
// dispatch's chunks (256 assignments) and runs and the grouped GEMM's
// 64-row tiles, with empty experts and dropped assignments. The exchange
// and combine run on a one-rank group (no MPI), where they copy, and are
// counted as on the CPU.
//
//===----------------------------------------------------------------------===//

#include "CudaTest.h"

#include "tessel/Runtime/Comm.h"
#include "tessel/Runtime/Cuda/Device.h"
#include "tessel/Runtime/Kernels.h"

#include <algorithm>
#include <string>

namespace tessel::cuda::test {
namespace {

std::vector<float> asFloats(const std::vector<int32_t> &v) {
  return std::vector<float>(v.begin(), v.end());
}

// Router probabilities [tokens, E] (a softmax of random logits) rounded to
// T; every seventh row has a tie between its first and last expert.
template <typename T>
std::vector<float> routerProbs(int64_t tokens, int64_t E, uint32_t seed) {
  auto logits = randomVector(tokens * E, seed, -3.0f, 3.0f);
  std::vector<float> p(tokens * E);
  tessel::rt::softmaxForward(logits.data(), p.data(), tokens, E);
  for (int64_t t = 0; t < tokens; t += 7)
    p[t * E + E - 1] = p[t * E];
  return roundTo<T>(p);
}

struct Routing {
  std::vector<int32_t> experts;
  std::vector<float> weights;
};

Routing cpuRouting(const std::vector<float> &probs, int64_t tokens, int64_t E,
                   int64_t k) {
  Routing r{std::vector<int32_t>(tokens * k), std::vector<float>(tokens * k)};
  tessel::rt::moeTopK(probs.data(), r.experts.data(), r.weights.data(), tokens,
                      E, k);
  return r;
}

// The CPU's dispatch of a routing (capacity 0: every assignment kept).
struct Plan {
  std::vector<int32_t> rowOf, offsets;
  int64_t rows = 0;
};

Plan cpuPlan(const std::vector<int32_t> &experts, int64_t tokens, int64_t k,
             int64_t E, int64_t capacity) {
  Plan p{std::vector<int32_t>(tokens * k), std::vector<int32_t>(E + 1), 0};
  p.rows =
      tessel::rt::moeDispatchPlan(experts.data(), tokens, k, E, capacity,
                                  nullptr, p.rowOf.data(), p.offsets.data());
  return p;
}

//===--- Routing ----------------------------------------------------------===//

template <typename TP, typename TW>
void checkTopK(int64_t tokens, int64_t E, int64_t k) {
  SCOPED_TRACE(std::string(typeName<TP>()) + "->" + typeName<TW>() +
               " E=" + std::to_string(E) + " k=" + std::to_string(k));
  auto probs = routerProbs<TP>(tokens, E, 1);
  Routing want = cpuRouting(probs, tokens, E, k);
  DeviceArray<TP> p(probs);
  DeviceArray<int32_t> experts(tokens * k);
  DeviceArray<TW> weights(tokens * k);
  moeTopK(p.get(), experts.get(), weights.get(), tokens, E, k);
  EXPECT_EQ(experts.download(), asFloats(want.experts));
  expectClose(weights.download(), want.weights, rtolFor<TW>(), 1e-7,
              "moeTopK weights");
}

TEST(CudaMoe, TopKMatchesCpu) {
  checkTopK<float, float>(777, 8, 2);
  checkTopK<float, float>(300, 64, 6);
  checkTopK<float, float>(50, 3, 3);
  checkTopK<bf16, bf16>(777, 8, 2);
  checkTopK<bf16, float>(300, 64, 6);
}

template <typename TP, typename TG, typename TO>
void checkTopKBackward(int64_t tokens, int64_t E, int64_t k, bool accumulate) {
  SCOPED_TRACE(std::string(typeName<TP>()) + "," + typeName<TG>() + "->" +
               typeName<TO>() + (accumulate ? " accumulate" : ""));
  auto probs = routerProbs<TP>(tokens, E, 2);
  Routing r = cpuRouting(probs, tokens, E, k);
  auto dweights = roundTo<TG>(randomVector(tokens * k, 3));
  auto want = roundTo<TO>(randomVector(tokens * E, 4));
  DeviceArray<TP> p(probs);
  DeviceArray<int32_t> experts(asFloats(r.experts));
  DeviceArray<TG> dw(dweights);
  DeviceArray<TO> dprobs(want);
  tessel::rt::moeTopKBackward(probs.data(), r.experts.data(), dweights.data(),
                              want.data(), tokens, E, k, accumulate);
  moeTopKBackward(p.get(), experts.get(), dw.get(), dprobs.get(), tokens, E, k,
                  accumulate);
  expectClose(dprobs.download(), want, rtolFor<TO>(), 1e-5, "moeTopKBackward");
}

TEST(CudaMoe, TopKBackwardMatchesCpu) {
  for (bool accumulate : {false, true}) {
    checkTopKBackward<float, float, float>(513, 8, 2, accumulate);
    checkTopKBackward<float, float, float>(100, 16, 4, accumulate);
    checkTopKBackward<bf16, bf16, bf16>(513, 8, 2, accumulate);
    checkTopKBackward<bf16, bf16, float>(513, 8, 2, accumulate);
  }
}

//===--- Dispatch ---------------------------------------------------------===//

// Expert choices: the top k of random probabilities, or (skewed) mostly
// the first experts, so that capacities drop many.
std::vector<int32_t> routedExperts(int64_t tokens, int64_t E, int64_t k,
                                   bool skewed, uint32_t seed) {
  auto probs = routerProbs<float>(tokens, E, seed);
  if (skewed)
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t e = 0; e < E; ++e)
        probs[t * E + e] *= e < 2 ? 8.0f : 1.0f;
  return cpuRouting(probs, tokens, E, k).experts;
}

void checkDispatch(int64_t tokens, int64_t E, int64_t k, int64_t capacity,
                   bool withBefore, bool skewed) {
  SCOPED_TRACE("tokens=" + std::to_string(tokens) + " E=" + std::to_string(E) +
               " k=" + std::to_string(k) +
               " capacity=" + std::to_string(capacity) +
               (withBefore ? " before" : "") + (skewed ? " skewed" : ""));
  auto experts = routedExperts(tokens, E, k, skewed, 5);
  std::vector<int64_t> before(E);
  for (int64_t e = 0; e < E; ++e)
    before[e] = withBefore ? (e * 37) % (capacity + 3) : 0;
  std::vector<int32_t> rowOf(tokens * k), offsets(E + 1);
  tessel::rt::moeDispatchPlan(experts.data(), tokens, k, E, capacity,
                              withBefore ? before.data() : nullptr,
                              rowOf.data(), offsets.data());
  DeviceArray<int32_t> dExperts(asFloats(experts)), dRowOf(tokens * k),
      dOffsets(E + 1);
  DeviceArray<int64_t> dBefore(
      std::vector<float>(before.begin(), before.end()));
  DeviceArray<char> scratch(moeDispatchScratchBytes(tokens, 1, k, E, 1));
  moeDispatchPlan(dExperts.get(), tokens, k, E, capacity,
                  withBefore ? dBefore.get() : nullptr, dRowOf.get(),
                  dOffsets.get(), scratch.get());
  EXPECT_EQ(dOffsets.download(), asFloats(offsets));
  EXPECT_EQ(dRowOf.download(), asFloats(rowOf));
}

TEST(CudaMoe, DispatchPlanMatchesCpu) {
  checkDispatch(1000, 8, 2, 0, false, false);
  checkDispatch(1000, 8, 2, 200, false, true);
  checkDispatch(1000, 8, 2, 200, true, true);
  checkDispatch(3000, 64, 6, 100, true, false);
  checkDispatch(5, 8, 2, 1, false, true); // one partial chunk
  checkDispatch(129, 1, 1, 100, false, false);
  checkDispatch(0, 8, 2, 4, false, false);
}

// lib/Runtime/Kernels/Moe.cpp's dispatch over runs (internal there), as a
// loop: run r's tokens come after before[r * E + e] assignments of e.
void runsReference(const std::vector<int32_t> &experts, int64_t tokens,
                   int64_t rows, int64_t k, int64_t E, int64_t capacity,
                   const std::vector<int64_t> &before,
                   std::vector<int32_t> &rowOf, std::vector<int32_t> &offsets) {
  offsets.assign(E + 1, 0);
  rowOf.assign(tokens * k, 0);
  const int64_t perRun = tokens / rows * k;
  std::vector<int64_t> seen(E, 0);
  for (int64_t a = 0; a < tokens * k; ++a) {
    if (a % perRun == 0)
      std::fill(seen.begin(), seen.end(), 0);
    const int32_t e = experts[a];
    const bool kept =
        capacity <= 0 || before[a / perRun * E + e] + seen[e]++ < capacity;
    rowOf[a] = kept ? 0 : -1;
    if (kept)
      offsets[e + 1]++;
  }
  for (int64_t e = 0; e < E; ++e)
    offsets[e + 1] += offsets[e];
  std::vector<int64_t> next(offsets.begin(), offsets.end() - 1);
  for (int64_t a = 0; a < tokens * k; ++a)
    if (rowOf[a] >= 0)
      rowOf[a] = (int32_t)next[experts[a]]++;
}

TEST(CudaMoe, DispatchRunsMatchLoop) {
  const int64_t tokens = 4 * 300, rows = 4, k = 2, E = 8, capacity = 90;
  auto experts = routedExperts(tokens, E, k, true, 6);
  std::vector<int64_t> before(rows * E);
  for (int64_t i = 0; i < rows * E; ++i)
    before[i] = (i * 13) % 40;
  std::vector<int32_t> rowOf, offsets;
  runsReference(experts, tokens, rows, k, E, capacity, before, rowOf, offsets);
  DeviceArray<int32_t> dExperts(asFloats(experts)), dRowOf(tokens * k),
      dOffsets(E + 1);
  DeviceArray<int64_t> dBefore(
      std::vector<float>(before.begin(), before.end()));
  DeviceArray<char> scratch(moeDispatchScratchBytes(tokens, rows, k, E, 1));
  moeDispatchRuns(dExperts.get(), tokens, rows, k, E, capacity, dBefore.get(),
                  dRowOf.get(), dOffsets.get(), scratch.get());
  EXPECT_EQ(dOffsets.download(), asFloats(offsets));
  EXPECT_EQ(dRowOf.download(), asFloats(rowOf));
}

// On one rank the group forms are the plain plan, as on the CPU.
TEST(CudaMoe, DispatchFormsMatchCpu) {
  const int64_t tokens = 640, rows = 2, k = 2, E = 8, capacity = 120;
  auto experts = routedExperts(tokens, E, k, true, 7);
  const unsigned axes =
      AxisSet(MeshAxis::DP).bits() | AxisSet(MeshAxis::TP).bits();
  std::vector<int32_t> rowOf(tokens * k), offsets(E + 1);
  tessel::rt::moeDispatchGroup(experts.data(), rowOf.data(), offsets.data(),
                               tokens, rows, k, E, capacity, axes);
  DeviceArray<int32_t> dExperts(asFloats(experts)), dRowOf(tokens * k),
      dOffsets(E + 1);
  DeviceArray<char> scratch(moeDispatchScratchBytes(tokens, rows, k, E, 1));
  moeDispatchGroup(dExperts.get(), dRowOf.get(), dOffsets.get(), tokens, rows,
                   k, E, capacity, axes, scratch.get());
  EXPECT_EQ(dOffsets.download(), asFloats(offsets));
  EXPECT_EQ(dRowOf.download(), asFloats(rowOf));
  tessel::rt::moeDispatch(experts.data(), rowOf.data(), offsets.data(), tokens,
                          k, E, 0);
  moeDispatch(dExperts.get(), dRowOf.get(), dOffsets.get(), tokens, k, E, 0,
              scratch.get());
  EXPECT_EQ(dOffsets.download(), asFloats(offsets));
  EXPECT_EQ(dRowOf.download(), asFloats(rowOf));
}

//===--- Permutation ------------------------------------------------------===//

template <typename TA, typename TW>
void checkPermutation(int64_t tokens, int64_t E, int64_t k, int64_t H,
                      int64_t capacity) {
  SCOPED_TRACE(std::string(typeName<TA>()) + " activations, " + typeName<TW>() +
               " weights, H=" + std::to_string(H) +
               " capacity=" + std::to_string(capacity));
  auto probs = routerProbs<TW>(tokens, E, 8);
  Routing r = cpuRouting(probs, tokens, E, k);
  auto weights = roundTo<TW>(r.weights);
  Plan plan = cpuPlan(r.experts, tokens, k, E, capacity);
  const int64_t n = tokens * H, np = tokens * k * H;
  DeviceArray<int32_t> rowOf(asFloats(plan.rowOf));
  DeviceArray<TW> dWeights(weights);
  const double rtol = rtolFor<TA>(), atol = 1e-6;

  auto x = roundTo<TA>(randomVector(n, 9));
  std::vector<float> xp(np, 0.0f);
  tessel::rt::moePermute(x.data(), plan.rowOf.data(), xp.data(), tokens, k, H);
  DeviceArray<TA> dx(x), dxp(np);
  moePermute(dx.get(), rowOf.get(), dxp.get(), tokens, k, H);
  expectClose(dxp.download(), xp, rtol, atol, "moePermute");

  auto grows = roundTo<TA>(randomVector(np, 10));
  std::vector<float> gx(n);
  tessel::rt::moePermuteBackward(grows.data(), plan.rowOf.data(), gx.data(),
                                 tokens, k, H);
  DeviceArray<TA> dgrows(grows), dgx(n);
  moePermuteBackward(dgrows.get(), rowOf.get(), dgx.get(), tokens, k, H);
  expectClose(dgx.download(), gx, rtol, atol, "moePermuteBackward");

  auto yp = roundTo<TA>(randomVector(np, 11));
  std::vector<float> y(n);
  tessel::rt::moeUnpermute(yp.data(), plan.rowOf.data(), weights.data(),
                           y.data(), tokens, k, H);
  DeviceArray<TA> dyp(yp), dy(n);
  moeUnpermute(dyp.get(), rowOf.get(), dWeights.get(), dy.get(), tokens, k, H);
  expectClose(dy.download(), y, rtol, atol, "moeUnpermute");

  auto gy = roundTo<TA>(randomVector(n, 12));
  std::vector<float> gyp(np, 0.0f), gw(tokens * k);
  tessel::rt::moeUnpermuteBackward(yp.data(), plan.rowOf.data(), weights.data(),
                                   gy.data(), gyp.data(), gw.data(), tokens, k,
                                   H);
  DeviceArray<TA> dgy(gy), dgyp(np);
  DeviceArray<TW> dgw(tokens * k);
  moeUnpermuteBackward(dyp.get(), rowOf.get(), dWeights.get(), dgy.get(),
                       dgyp.get(), dgw.get(), tokens, k, H);
  expectClose(dgyp.download(), gyp, rtol, atol, "moeUnpermuteBackward dyp");
  // A dot product over H: its sum order differs from the CPU loop's.
  expectClose(dgw.download(), gw, rtolFor<TW>(), 1e-4,
              "moeUnpermuteBackward dweights");
}

TEST(CudaMoe, PermutationMatchesCpu) {
  checkPermutation<float, float>(300, 8, 2, 64, 0);
  checkPermutation<float, float>(300, 8, 2, 100, 40);
  checkPermutation<float, float>(70, 4, 3, 300, 20);
  checkPermutation<bf16, bf16>(300, 8, 2, 64, 40);
  checkPermutation<bf16, float>(300, 8, 2, 64, 40);
}

//===--- Grouped GEMM -----------------------------------------------------===//

// Row ranges of `segments` segments: empty ones, ones shorter than a tile,
// and ones crossing several.
std::vector<int32_t> segmentOffsets(int64_t segments) {
  const int32_t sizes[] = {0, 1, 70, 130, 5, 0, 64, 33, 200, 2, 65};
  std::vector<int32_t> offsets(segments + 1, 0);
  for (int64_t s = 0; s < segments; ++s)
    offsets[s + 1] = offsets[s] + sizes[(s * 3) % 11];
  return offsets;
}

template <typename TX, typename TW, typename TO>
void checkGroupedMatmul(int64_t segments, int64_t E, int64_t K, int64_t N,
                        bool transW) {
  SCOPED_TRACE(std::string(typeName<TX>()) + "," + typeName<TW>() + "->" +
               typeName<TO>() + " segments=" + std::to_string(segments) +
               " K=" + std::to_string(K) + " N=" + std::to_string(N) +
               (transW ? " transW" : ""));
  auto offsets = segmentOffsets(segments);
  const int64_t rows = offsets[segments] + 3; // rows past the last stay
  auto x = roundTo<TX>(randomVector(rows * K, 13));
  auto W = roundTo<TW>(randomVector(E * K * N, 14));
  auto init = roundTo<TO>(randomVector(rows * N, 15));
  std::vector<float> want = init;
  tessel::rt::groupedMatmulSegments(x.data(), W.data(), want.data(),
                                    offsets.data(), segments, E, K, N, transW);
  DeviceArray<TX> dx(x);
  DeviceArray<TW> dW(W);
  DeviceArray<TO> out(init);
  DeviceArray<int32_t> dOffsets(asFloats(offsets));
  groupedMatmulSegments(dx.get(), dW.get(), out.get(), dOffsets.get(), segments,
                        E, K, N, transW);
  expectClose(out.download(), want, rtolFor<TO>(), 1e-4,
              "groupedMatmulSegments");

  // The accumulating form, over E segments.
  want = init;
  tessel::rt::groupedMatmul(x.data(), W.data(), want.data(), offsets.data(), E,
                            K, N, transW, /*accumulate=*/true);
  out.upload(init);
  groupedMatmul(dx.get(), dW.get(), out.get(), dOffsets.get(), E, K, N, transW,
                /*accumulate=*/true);
  expectClose(out.download(), want, rtolFor<TO>(), 1e-4,
              "groupedMatmul (accumulate)");
}

TEST(CudaMoe, GroupedMatmulMatchesCpu) {
  for (bool transW : {false, true}) {
    checkGroupedMatmul<float, float, float>(8, 8, 64, 64, transW);
    checkGroupedMatmul<float, float, float>(16, 8, 72, 40, transW);
    checkGroupedMatmul<float, float, float>(6, 3, 17, 130, transW);
    checkGroupedMatmul<bf16, bf16, bf16>(16, 8, 72, 40, transW);
    // Tensor cores: several tiles each way, the depth not a multiple of 32.
    checkGroupedMatmul<bf16, bf16, bf16>(11, 4, 200, 136, transW);
    checkGroupedMatmul<bf16, float, bf16>(8, 8, 64, 96, transW);
  }
}

template <typename TX, typename TG, typename TO>
void checkGroupedWeightGrad(int64_t segments, int64_t E, int64_t K, int64_t N,
                            bool transW) {
  SCOPED_TRACE(std::string(typeName<TX>()) + "," + typeName<TG>() + "->" +
               typeName<TO>() + " segments=" + std::to_string(segments) +
               " K=" + std::to_string(K) + " N=" + std::to_string(N) +
               (transW ? " transW" : ""));
  auto offsets = segmentOffsets(segments);
  const int64_t rows = offsets[segments];
  auto x = roundTo<TX>(randomVector(rows * K, 16));
  auto dout = roundTo<TG>(randomVector(rows * N, 17));
  auto init = roundTo<TO>(randomVector(E * K * N, 18));
  std::vector<float> want = init;
  tessel::rt::groupedMatmulWeightGradSegments(x.data(), dout.data(),
                                              want.data(), offsets.data(),
                                              segments, E, K, N, transW);
  DeviceArray<TX> dx(x);
  DeviceArray<TG> dd(dout);
  DeviceArray<TO> dW(init);
  DeviceArray<int32_t> dOffsets(asFloats(offsets));
  groupedMatmulWeightGradSegments(dx.get(), dd.get(), dW.get(), dOffsets.get(),
                                  segments, E, K, N, transW);
  // Sums over up to 330 rows.
  expectClose(dW.download(), want, rtolFor<TO>(), 1e-4,
              "groupedMatmulWeightGradSegments");

  want = init;
  tessel::rt::groupedMatmulWeightGrad(x.data(), dout.data(), want.data(),
                                      offsets.data(), E, K, N, transW,
                                      /*accumulate=*/true);
  dW.upload(init);
  groupedMatmulWeightGrad(dx.get(), dd.get(), dW.get(), dOffsets.get(), E, K, N,
                          transW, /*accumulate=*/true);
  expectClose(dW.download(), want, rtolFor<TO>(), 1e-4,
              "groupedMatmulWeightGrad (accumulate)");

  // Summed over microbatches: the first writes over what dW held, a later
  // one adds to it, over every segment.
  for (bool first : {true, false}) {
    want = init;
    tessel::rt::groupedMatmulWeightGradSegmentsAccumulate(
        x.data(), dout.data(), want.data(), offsets.data(), first, segments, E,
        K, N, transW);
    dW.upload(init);
    groupedMatmulWeightGradSegmentsAccumulate(dx.get(), dd.get(), dW.get(),
                                              dOffsets.get(), first, segments,
                                              E, K, N, transW);
    expectClose(dW.download(), want, rtolFor<TO>(), 1e-4,
                first ? "groupedMatmulWeightGradSegmentsAccumulate (first)"
                      : "groupedMatmulWeightGradSegmentsAccumulate (after)");
  }
}

TEST(CudaMoe, GroupedMatmulWeightGradMatchesCpu) {
  for (bool transW : {false, true}) {
    checkGroupedWeightGrad<float, float, float>(8, 8, 64, 64, transW);
    checkGroupedWeightGrad<float, float, float>(16, 8, 72, 40, transW);
    checkGroupedWeightGrad<float, float, float>(6, 3, 17, 130, transW);
    checkGroupedWeightGrad<bf16, bf16, float>(16, 8, 72, 40, transW);
    checkGroupedWeightGrad<bf16, bf16, bf16>(11, 4, 200, 136, transW);
  }
}

//===--- Statistics and losses --------------------------------------------===//

template <typename TP, typename TO> void checkStatsAndLosses() {
  SCOPED_TRACE(std::string(typeName<TP>()) + "->" + typeName<TO>());
  const int64_t tokens = 1500, E = 8, k = 2, total = 3000;
  const double coef = 0.01, zcoef = 0.001;
  auto probs = routerProbs<TP>(tokens, E, 19);
  Routing r = cpuRouting(probs, tokens, E, k);
  DeviceArray<TP> dProbs(probs);
  DeviceArray<int32_t> experts(asFloats(r.experts));
  const double rtol = rtolFor<TO>();

  std::vector<float> counts(E), probSums(E);
  tessel::rt::moeLoadStatsInto(probs.data(), r.experts.data(), counts.data(),
                               probSums.data(), tokens, E, k);
  DeviceArray<TO> dCounts(roundTo<TO>(randomVector(E, 20))),
      dProbSums(roundTo<TO>(randomVector(E, 21)));
  moeLoadStatsInto(dProbs.get(), experts.get(), dCounts.get(), dProbSums.get(),
                   tokens, E, k);
  // Counts up to 3000 are exact in float (bf16 keeps 8 bits).
  expectClose(dCounts.download(), counts, rtol, 0, "moeLoadStatsInto counts");
  expectClose(dProbSums.download(), probSums, rtol, 1e-4,
              "moeLoadStatsInto probSums");
  tessel::rt::moeLoadStats(probs.data(), r.experts.data(), counts.data(),
                           probSums.data(), tokens, E, k);
  moeLoadStats(dProbs.get(), experts.get(), dCounts.get(), dProbSums.get(),
               tokens, E, k);
  expectClose(dCounts.download(), counts, rtol, 0, "moeLoadStats counts");
  expectClose(dProbSums.download(), probSums, rtol, 1e-4,
              "moeLoadStats probSums");

  Plan plan = cpuPlan(r.experts, tokens, k, E, 300);
  std::vector<float> kept(E);
  tessel::rt::moeKeptCounts(plan.offsets.data(), kept.data(), E);
  DeviceArray<int32_t> offsets(asFloats(plan.offsets));
  DeviceArray<TO> dKept(E);
  moeKeptCounts(offsets.get(), dKept.get(), E);
  expectClose(dKept.download(), kept, rtol, 0, "moeKeptCounts");

  // The aux loss and its gradients from the (exact) float statistics.
  tessel::rt::moeLoadStatsInto(probs.data(), r.experts.data(), counts.data(),
                               probSums.data(), tokens, E, k);
  DeviceArray<float> fCounts(counts), fProbSums(probSums);
  std::vector<float> loss(1), dloss = {1.7f};
  tessel::rt::moeAuxLossForward(counts.data(), probSums.data(), loss.data(),
                                total, E, k, coef);
  DeviceArray<TO> dLoss(1);
  moeAuxLossForward(fCounts.get(), fProbSums.get(), dLoss.get(), total, E, k,
                    coef);
  expectClose(dLoss.download(), loss, rtol, 0, "moeAuxLossForward");

  std::vector<float> dps(E);
  tessel::rt::moeAuxLossGrad(counts.data(), dloss.data(), dps.data(), total, E,
                             k, coef);
  DeviceArray<float> dDloss(dloss);
  DeviceArray<TO> dDps(E);
  moeAuxLossGrad(fCounts.get(), dDloss.get(), dDps.get(), total, E, k, coef);
  expectClose(dDps.download(), dps, rtol, 0, "moeAuxLossGrad");

  std::vector<float> dprobs(tokens * E);
  tessel::rt::moeProbSumsBackward(dps.data(), dprobs.data(), tokens, E);
  DeviceArray<float> fDps(dps);
  DeviceArray<TO> dDprobs(tokens * E);
  moeProbSumsBackward(fDps.get(), dDprobs.get(), tokens, E);
  expectClose(dDprobs.download(), dprobs, rtol, 0, "moeProbSumsBackward");

  auto base = roundTo<TO>(randomVector(tokens * E, 22));
  dprobs = base;
  tessel::rt::moeAuxLossBackward(counts.data(), total, E, k, coef, 1.7f,
                                 dprobs.data(), tokens);
  dDprobs.upload(base);
  moeAuxLossBackward(fCounts.get(), total, E, k, coef, 1.7f, dDprobs.get(),
                     tokens);
  expectClose(dDprobs.download(), dprobs, rtol, 1e-7, "moeAuxLossBackward");

  // The z loss over router logits.
  auto logits = roundTo<TP>(randomVector(tokens * E, 23, -4.0f, 4.0f));
  DeviceArray<TP> dLogits(logits);
  tessel::rt::moeZLossForward(logits.data(), loss.data(), tokens, E, zcoef);
  moeZLossForward(dLogits.get(), dLoss.get(), tokens, E, zcoef);
  expectClose(dLoss.download(), loss, std::max(rtol, 1e-5), 0,
              "moeZLossForward");
  std::vector<float> dlogits(tokens * E);
  tessel::rt::moeZLossGrad(logits.data(), dloss.data(), dlogits.data(), tokens,
                           E, zcoef);
  DeviceArray<TO> dDlogits(tokens * E);
  moeZLossGrad(dLogits.get(), dDloss.get(), dDlogits.get(), tokens, E, zcoef);
  expectClose(dDlogits.download(), dlogits, rtol, 1e-9, "moeZLossGrad");

  dlogits = base;
  tessel::rt::moeZLossBackward(logits.data(), tokens, E, 0.3f, dlogits.data());
  dDlogits.upload(base);
  moeZLossBackward(dLogits.get(), tokens, E, 0.3f, dDlogits.get());
  expectClose(dDlogits.download(), dlogits, rtol, 1e-6, "moeZLossBackward");
}

TEST(CudaMoe, StatisticsAndLossesMatchCpu) {
  checkStatsAndLosses<float, float>();
  checkStatsAndLosses<bf16, float>();
  checkStatsAndLosses<bf16, bf16>();
}

// Runs twice give the same bits (no atomics, fixed reduction orders), on
// CUDA cores (fp32) and on tensor cores (bf16).
template <typename T> void checkDeterministic() {
  SCOPED_TRACE(typeName<T>());
  const int64_t segments = 16, E = 8, K = 72, N = 40;
  auto offsets = segmentOffsets(segments);
  const int64_t rows = offsets[segments];
  DeviceArray<T> x(randomVector(rows * K, 24)),
      dout(randomVector(rows * N, 25));
  DeviceArray<float> dW(E * K * N);
  DeviceArray<int32_t> dOffsets(asFloats(offsets));
  groupedMatmulWeightGradSegments(x.get(), dout.get(), dW.get(), dOffsets.get(),
                                  segments, E, K, N, false);
  auto first = dW.download();
  groupedMatmulWeightGradSegments(x.get(), dout.get(), dW.get(), dOffsets.get(),
                                  segments, E, K, N, false);
  expectBitwiseEqual(dW.download(), first, "groupedMatmulWeightGradSegments");
}

TEST(CudaMoe, Deterministic) {
  checkDeterministic<float>();
  checkDeterministic<bf16>();
}

//===--- Expert parallelism on one rank -----------------------------------===//

template <typename T> void checkExchangeOneRank() {
  SCOPED_TRACE(typeName<T>());
  const int64_t tokens = 200, E = 8, k = 2, H = 24, recvRows = 460;
  const unsigned ep = AxisSet(MeshAxis::EP).bits();
  auto r = cpuRouting(routerProbs<float>(tokens, E, 26), tokens, E, k);
  Plan plan = cpuPlan(r.experts, tokens, k, E, 0);
  const int64_t rows = tokens * k;
  auto x = roundTo<T>(randomVector(rows * H, 27));
  auto garbage = roundTo<T>(randomVector(recvRows * H, 28));
  const auto &counter =
      tessel::rt::collectiveCounter(tessel::rt::CollectiveKind::AllToAll);

  std::vector<float> recv = garbage;
  std::vector<int32_t> recvOffsets(E + 1);
  tessel::rt::CollectiveCounter before = counter;
  tessel::rt::moeExchange(x.data(), plan.offsets.data(), recv.data(),
                          recvOffsets.data(), E, H, recvRows, ep);
  tessel::rt::CollectiveCounter cpu = counter;
  DeviceArray<T> dx(x), dRecv(garbage);
  DeviceArray<int32_t> dOffsets(asFloats(plan.offsets)), dRecvOffsets(E + 1);
  moeExchange(dx.get(), dOffsets.get(), dRecv.get(), dRecvOffsets.get(), E, H,
              recvRows, ep);
  sync();
  EXPECT_EQ(dRecvOffsets.download(), asFloats(recvOffsets));
  EXPECT_EQ(dRecv.download(), recv);
  EXPECT_EQ(counter.calls - cpu.calls, cpu.calls - before.calls);
  EXPECT_EQ(counter.elements - cpu.elements, cpu.elements - before.elements);
  EXPECT_EQ(counter.bytesSent - cpu.bytesSent,
            cpu.bytesSent - before.bytesSent);

  std::vector<float> out = roundTo<T>(randomVector(rows * H, 29));
  DeviceArray<T> dOut(out);
  tessel::rt::moeCombine(recv.data(), recvOffsets.data(), plan.offsets.data(),
                         out.data(), E, H, rows, ep);
  moeCombine(dRecv.get(), dRecvOffsets.get(), dOffsets.get(), dOut.get(), E, H,
             rows, ep);
  EXPECT_EQ(dOut.download(), out);
}

TEST(CudaMoe, ExchangeAndCombineOneRank) {
  checkExchangeOneRank<float>();
  checkExchangeOneRank<bf16>();
}

} // namespace
} // namespace tessel::cuda::test
