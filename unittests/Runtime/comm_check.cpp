//===- comm_check.cpp - Checks the collectives under mpirun ---------------===//
//
// Usage: mpirun -np DP*TP tessel-comm-check DP TP
//
// Builds a mesh of dp = DP, tp = TP and checks on every rank: coordinates in
// the documented rank order, all-reduce over tp, dp and dp|tp (blocking and
// non-blocking), all-gather and reduce-scatter blocks (also gathered piece
// by piece, point to point), that all ranks of a
// group get bitwise identical all-reduce results, and the collective
// counters. Values are small integers so every sum is exact. Prints one
// line per mismatch and exits non-zero on any.
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Comm.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

using namespace tessel::rt;

namespace {

int failures = 0;

void check(bool ok, const std::string &what) {
  if (ok)
    return;
  std::fprintf(stderr, "rank %d: FAIL: %s\n", commRank(), what.c_str());
  failures++;
}

// Expected counters, updated alongside every call.
CollectiveCounter expected[kNumCollectiveKinds];

void expectCall(CollectiveKind kind, int64_t elements, int64_t bytes) {
  expected[(int)kind].calls += 1;
  expected[(int)kind].elements += elements;
  expected[(int)kind].bytesSent += bytes;
}

void checkCounters(const char *after) {
  for (int k = 0; k < kNumCollectiveKinds; k++) {
    CollectiveKind kind = (CollectiveKind)k;
    const CollectiveCounter &got = collectiveCounter(kind);
    const CollectiveCounter &want = expected[k];
    check(got.calls == want.calls && got.elements == want.elements &&
              got.bytesSent == want.bytesSent,
          std::string(collectiveName(kind)) + " counter after " + after +
              ": got calls " + std::to_string(got.calls) + " elements " +
              std::to_string(got.elements) + " bytes " +
              std::to_string(got.bytesSent) + ", want " +
              std::to_string(want.calls) + " " + std::to_string(want.elements) +
              " " + std::to_string(want.bytesSent));
  }
}

int64_t meshDP = 1, meshTP = 1;

// World ranks of the group of `axes` containing this rank, in group order.
std::vector<int> groupRanks(unsigned axes) {
  int64_t d = meshCoord(MeshAxis::DP), t = meshCoord(MeshAxis::TP);
  std::vector<int> ranks;
  for (int64_t dd = 0; dd < meshDP; dd++)
    for (int64_t tt = 0; tt < meshTP; tt++) {
      bool sameDp = dd == d, sameTp = tt == t;
      if ((sameDp || (axes & AxisSet(MeshAxis::DP).bits())) &&
          (sameTp || (axes & AxisSet(MeshAxis::TP).bits())))
        ranks.push_back((int)(dd * meshTP + tt));
    }
  return ranks;
}

int indexIn(const std::vector<int> &ranks, int rank) {
  for (size_t i = 0; i < ranks.size(); i++)
    if (ranks[i] == rank)
      return (int)i;
  return -1;
}

float valueOf(int rank, int64_t i) { return (float)(rank * 1000 + i); }

std::string axesName(unsigned axes) { return AxisSet::fromBits(axes).str(); }

void checkAllReduce(unsigned axes, bool nonBlocking) {
  const int64_t n = 7;
  std::vector<int> ranks = groupRanks(axes);
  int64_t g = (int64_t)ranks.size();
  std::string what =
      std::string(nonBlocking ? "allReduceSumStart" : "allReduceSum") +
      " over " + axesName(axes);
  check(groupSize(axes) == g, "groupSize(" + axesName(axes) +
                                  ") = " + std::to_string(groupSize(axes)) +
                                  ", want " + std::to_string(g));
  std::vector<float> a(n), b(n);
  for (int64_t i = 0; i < n; i++) {
    a[i] = valueOf(commRank(), i);
    b[i] = -valueOf(commRank(), i);
  }
  if (nonBlocking) {
    // Two in flight at once, waited for in the opposite order.
    CommRequest ra = allReduceSumStart(a.data(), n, axes);
    CommRequest rb = allReduceSumStart(b.data(), n, axes);
    commWait(rb);
    commWait(ra);
    expectCall(CollectiveKind::AllReduce, n, 2 * (g - 1) * n * 4 / g);
  } else {
    allReduceSum(a.data(), n, axes);
    allReduceSum(b.data(), n, axes);
    expectCall(CollectiveKind::AllReduce, n, 2 * (g - 1) * n * 4 / g);
  }
  expectCall(CollectiveKind::AllReduce, n, 2 * (g - 1) * n * 4 / g);
  for (int64_t i = 0; i < n; i++) {
    float want = 0;
    for (int r : ranks)
      want += valueOf(r, i);
    check(a[i] == want && b[i] == -want,
          what + ": element " + std::to_string(i) + " is " +
              std::to_string(a[i]) + " / " + std::to_string(b[i]) + ", want " +
              std::to_string(want));
  }
  checkCounters(what.c_str());
}

void checkAllGather(unsigned axes) {
  const int64_t n = 3;
  std::vector<int> ranks = groupRanks(axes);
  int64_t g = (int64_t)ranks.size();
  std::vector<float> in(n), out(g * n, -1.0f);
  for (int64_t i = 0; i < n; i++)
    in[i] = valueOf(commRank(), i);
  allGather(in.data(), out.data(), n, axes);
  expectCall(CollectiveKind::AllGather, n, (g - 1) * n * 4);
  for (int64_t k = 0; k < g; k++)
    for (int64_t i = 0; i < n; i++)
      check(out[k * n + i] == valueOf(ranks[k], i),
            "allGather over " + axesName(axes) + ": block " +
                std::to_string(k) + " element " + std::to_string(i) + " is " +
                std::to_string(out[k * n + i]) + ", want " +
                std::to_string(valueOf(ranks[k], i)));
  checkCounters(("allGather over " + axesName(axes)).c_str());
}

void checkReduceScatter(unsigned axes) {
  const int64_t n = 5;
  std::vector<int> ranks = groupRanks(axes);
  int64_t g = (int64_t)ranks.size();
  int me = indexIn(ranks, commRank());
  std::vector<float> in(g * n), out(n, -1.0f);
  for (int64_t j = 0; j < g * n; j++)
    in[j] = valueOf(commRank(), j);
  reduceScatterSum(in.data(), out.data(), n, axes);
  expectCall(CollectiveKind::ReduceScatter, g * n, (g - 1) * n * 4);
  for (int64_t i = 0; i < n; i++) {
    float want = 0;
    for (int r : ranks)
      want += valueOf(r, me * n + i);
    check(out[i] == want, "reduceScatterSum over " + axesName(axes) +
                              ": element " + std::to_string(i) + " is " +
                              std::to_string(out[i]) + ", want " +
                              std::to_string(want));
  }
  checkCounters(("reduceScatterSum over " + axesName(axes)).c_str());
}

// The started collectives along a middle dimension (a tensor-parallel
// collective in flight under a GEMM) give, bit for bit, what the blocking
// ones give: with the gathered dimension inner (outer 2, through the
// caller's blocks) and outermost, both in flight at once and waited for in
// the other order; each counted as its blocking form.
void checkAlongStarted(unsigned axes) {
  int64_t g = groupSize(axes);
  for (int64_t outer : {2, 1}) {
    const int64_t len = 3, inner = 2, n = outer * len * inner;
    std::vector<float> piece(n), whole(g * n);
    for (int64_t i = 0; i < n; i++)
      piece[i] = valueOf(commRank(), i);
    for (int64_t j = 0; j < g * n; j++)
      whole[j] = 1.0f / (float)(3 + j) + valueOf(commRank(), j);
    std::vector<float> wantGathered(g * n), wantScattered(n);
    allGatherAlong(piece.data(), wantGathered.data(), outer, len, inner, axes);
    expectCall(CollectiveKind::AllGather, n, (g - 1) * n * 4);
    reduceScatterAlong(whole.data(), wantScattered.data(), outer, len, inner,
                       axes);
    expectCall(CollectiveKind::ReduceScatter, g * n, (g - 1) * n * 4);
    std::vector<float> gathered(g * n, -1.0f), scattered(n, -1.0f);
    std::vector<float> gatherBlocks(g * n), scatterBlocks(g * n);
    void *blocksA = outer > 1 ? gatherBlocks.data() : nullptr;
    void *blocksB = outer > 1 ? scatterBlocks.data() : nullptr;
    CommRequest a = allGatherAlongStart(piece.data(), gathered.data(), blocksA,
                                        outer, len, inner, axes);
    expectCall(CollectiveKind::AllGather, n, (g - 1) * n * 4);
    CommRequest b = reduceScatterAlongStart(whole.data(), scattered.data(),
                                            blocksB, outer, len, inner, axes);
    expectCall(CollectiveKind::ReduceScatter, g * n, (g - 1) * n * 4);
    commWait(b);
    commWait(a);
    std::string what = " over " + axesName(axes) + " (outer " +
                       std::to_string(outer) + ")";
    check(gathered == wantGathered,
          "allGatherAlongStart" + what + " differs from allGatherAlong");
    check(scattered == wantScattered,
          "reduceScatterAlongStart" + what + " differs from reduceScatterAlong");
    checkCounters(("the started collectives along a dimension" + what).c_str());
  }
}

// A gather done piece by piece (a collective matmul's steps): every shift
// in flight at once and waited for in reverse, each piece landing in the
// block groupBlock names, this rank's copied in, gives, bit for bit, what
// allGatherAlong gives; each step counted as a message of one piece.
void checkShifted(unsigned axes) {
  int64_t g = groupSize(axes);
  if (g < 2)
    return;
  const int64_t n = 6;
  std::vector<float> piece(n), want(g * n), whole(g * n, -1.0f);
  for (int64_t i = 0; i < n; i++)
    piece[i] = valueOf(commRank(), i);
  allGatherAlong(piece.data(), want.data(), 1, 3, 2, axes);
  expectCall(CollectiveKind::AllGather, n, (g - 1) * n * 4);
  std::memcpy(groupBlock(whole.data(), g * n, g, 0, axes), piece.data(),
              n * sizeof(float));
  std::vector<CommRequest> steps;
  for (int64_t shift = 1; shift < g; shift++) {
    steps.push_back(shiftStart(piece.data(),
                               groupBlock(whole.data(), g * n, g, shift, axes),
                               n, shift, axes));
    expectCall(CollectiveKind::SendRecv, n, n * 4);
  }
  for (auto it = steps.rbegin(); it != steps.rend(); ++it)
    commWait(*it);
  check(whole == want, "the shifted pieces over " + axesName(axes) +
                           " differ from allGatherAlong");
  checkCounters(("the shifts over " + axesName(axes)).c_str());
}

// Sums values with rounding error over the whole world and checks that
// every rank holds the same bits.
void checkBitwiseIdentical() {
  const int64_t n = 64;
  unsigned all = AxisSet(MeshAxis::DP).bits() | AxisSet(MeshAxis::TP).bits();
  int64_t g = groupSize(all);
  std::vector<float> a(n);
  for (int64_t i = 0; i < n; i++)
    a[i] = 1.0f / (float)(3 + commRank() * 7 + i) + 1e-3f * (float)commRank();
  allReduceSum(a.data(), n, all);
  expectCall(CollectiveKind::AllReduce, n, 2 * (g - 1) * n * 4 / g);
  std::vector<float> every(g * n);
  allGather(a.data(), every.data(), n, all);
  expectCall(CollectiveKind::AllGather, n, (g - 1) * n * 4);
  for (int64_t k = 0; k < g; k++)
    check(std::memcmp(every.data() + k * n, a.data(), n * sizeof(float)) == 0,
          "all-reduce result of rank " + std::to_string(k) +
              " differs bitwise from this rank's");
  checkCounters("the bitwise check");
}

} // namespace

int main(int argc, char **argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s DP TP\n", argv[0]);
    return 2;
  }
  meshDP = std::atoll(argv[1]);
  meshTP = std::atoll(argv[2]);
  MeshShape mesh;
  mesh[MeshAxis::DP] = meshDP;
  mesh[MeshAxis::TP] = meshTP;
  try {
    commInit(&argc, &argv, mesh);
  } catch (const std::exception &e) {
    std::fprintf(stderr, "rank %d: error: %s\n", commRank(), e.what());
    commAbort(1);
  }

  try {
    check(commWorldSize() == meshDP * meshTP, "world size");
    int64_t d = commRank() / meshTP, t = commRank() % meshTP;
    check(meshCoord(MeshAxis::DP) == d && meshCoord(MeshAxis::TP) == t,
          "coordinates (dp " + std::to_string(meshCoord(MeshAxis::DP)) +
              ", tp " + std::to_string(meshCoord(MeshAxis::TP)) +
              "), want (dp " + std::to_string(d) + ", tp " + std::to_string(t) +
              ")");
    for (MeshAxis axis : {MeshAxis::PP, MeshAxis::CP, MeshAxis::EP})
      check(meshCoord(axis) == 0 && meshSize(axis) == 1,
            std::string(meshAxisName(axis)) + " coordinate or size");
    check(meshSize(MeshAxis::DP) == meshDP && meshSize(MeshAxis::TP) == meshTP,
          "mesh sizes");
    checkCounters("start");

    unsigned dp = AxisSet(MeshAxis::DP).bits(),
             tp = AxisSet(MeshAxis::TP).bits(),
             pp = AxisSet(MeshAxis::PP).bits();
    for (unsigned axes : {tp, dp, dp | tp, dp | pp}) {
      checkAllReduce(axes, false);
      checkAllReduce(axes, true);
      checkAllGather(axes);
      checkReduceScatter(axes);
      checkAlongStarted(axes);
      checkShifted(axes);
    }
    checkBitwiseIdentical();
    for (CollectiveKind kind :
         {CollectiveKind::AllToAll, CollectiveKind::Broadcast})
      check(collectiveCounter(kind).calls == 0,
            std::string(collectiveName(kind)) + " was never called");
  } catch (const std::exception &e) {
    std::fprintf(stderr, "rank %d: error: %s\n", commRank(), e.what());
    commAbort(1);
  }

  if (failures > 0) {
    std::fprintf(stderr, "rank %d: %d checks failed\n", commRank(), failures);
    commAbort(1);
  }
  if (commRank() == 0)
    std::printf("comm check passed: %d ranks (dp=%lld tp=%lld)\n",
                commWorldSize(), (long long)meshDP, (long long)meshTP);
  commFinalize();
  return 0;
}
