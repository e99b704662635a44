//===- CommTest.cu - The NCCL collectives on a one-rank mesh --------------===//
//
// Without MPI every group has one rank: the collectives must copy or leave
// their data as it is, and still count their calls as the CPU runtime does.
// The kernels that regroup a tensor split along an inner dimension into
// NCCL's rank-major blocks are checked directly, against a loop on the host.
//
//===----------------------------------------------------------------------===//

#include "CudaTest.h"

#include "tessel/Runtime/Comm.h"
#include "tessel/Runtime/Cuda/Device.h"

#include <stdexcept>
#include <string>

namespace tessel::cuda {
namespace detail {
// Comm.cu: between blocks [g, outer, len, inner] and a tensor
// [outer, g * len, inner].
template <typename T>
void blocksToTensor(const T *blocks, T *out, int64_t g, int64_t outer,
                    int64_t len, int64_t inner, cudaStream_t stream);
template <typename T>
void tensorToBlocks(const T *in, T *blocks, int64_t g, int64_t outer,
                    int64_t len, int64_t inner, cudaStream_t stream);
} // namespace detail

namespace test {
namespace {

// The values a buffer of T holds after an upload of `v`.
template <typename T> std::vector<float> stored(std::vector<float> v) {
  if constexpr (std::is_same_v<T, bf16>)
    for (float &x : v)
      x = __bfloat162float(__float2bfloat16(x));
  return v;
}

template <typename T> class OneRankComm : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, bf16, double>;
TYPED_TEST_SUITE(OneRankComm, StorageTypes);

constexpr unsigned kTP = AxisSet(MeshAxis::TP).bits();

TYPED_TEST(OneRankComm, AllGatherAlongCopies) {
  using T = TypeParam;
  std::vector<float> in = randomVector(3 * 4 * 5, 1);
  DeviceArray<T> x(in), out(in.size());
  allGatherAlong(x.get(), out.get(), 3, 4, 5, kTP);
  EXPECT_EQ(out.download(), stored<T>(in));
}

TYPED_TEST(OneRankComm, ReduceScatterAlongCopies) {
  using T = TypeParam;
  std::vector<float> in = randomVector(2 * 6 * 3, 2);
  DeviceArray<T> x(in), out(in.size());
  reduceScatterAlong(x.get(), out.get(), 2, 6, 3, kTP);
  EXPECT_EQ(out.download(), stored<T>(in));
}

TYPED_TEST(OneRankComm, AllToAllCopies) {
  using T = TypeParam;
  std::vector<float> in = randomVector(17, 3);
  DeviceArray<T> x(in), out(in.size());
  allToAll(x.get(), out.get(), (int64_t)in.size(), kTP);
  EXPECT_EQ(out.download(), stored<T>(in));
}

TYPED_TEST(OneRankComm, AllReduceAndBroadcastKeepData) {
  using T = TypeParam;
  std::vector<float> in = randomVector(33, 4);
  DeviceArray<T> x(in);
  allReduceSum(x.get(), (int64_t)in.size(), kTP | AxisSet(MeshAxis::DP).bits());
  broadcast(x.get(), (int64_t)in.size(), 0, kTP);
  CommRequest request = allReduceSumStart(x.get(), (int64_t)in.size(), kTP);
  commWait(request);
  EXPECT_EQ(x.download(), stored<T>(in));
}

// Counted like the CPU runtime: the elements of the call, no bytes sent.
TEST(OneRankCommCount, CountsLikeTheCpuRuntime) {
  DeviceArray<float> x(8);
  rt::CollectiveCounter reduceBefore =
      rt::collectiveCounter(rt::CollectiveKind::AllReduce);
  rt::CollectiveCounter gatherBefore =
      rt::collectiveCounter(rt::CollectiveKind::AllGather);
  allReduceSum(x.get(), 8, kTP);
  allReduceMax(x.get(), 8, kTP);
  DeviceArray<float> out(8);
  allGatherAlong(x.get(), out.get(), 2, 2, 2, kTP);
  const rt::CollectiveCounter &reduce =
      rt::collectiveCounter(rt::CollectiveKind::AllReduce);
  const rt::CollectiveCounter &gather =
      rt::collectiveCounter(rt::CollectiveKind::AllGather);
  EXPECT_EQ(reduce.calls - reduceBefore.calls, 2);
  EXPECT_EQ(reduce.elements - reduceBefore.elements, 16);
  EXPECT_EQ(reduce.bytesSent, reduceBefore.bytesSent);
  EXPECT_EQ(gather.calls - gatherBefore.calls, 1);
  EXPECT_EQ(gather.elements - gatherBefore.elements, 8);
  EXPECT_EQ(gather.bytesSent, gatherBefore.bytesSent);
}

// ZeRO-1/2 in bf16: a run's bf16 copy gathered from the fp32 master-weight
// pieces. In a group of one the piece is the run: the copy is its bf16
// rounding. Counted as a gather, except while collectives are not counted
// (the copies filled at start).
TEST(OneRankCommMasterCopy, RoundsThePieceIn) {
  constexpr unsigned kDP = AxisSet(MeshAxis::DP).bits();
  std::vector<float> master = randomVector(37, 5);
  DeviceArray<float> pieces(master);
  DeviceArray<bf16> copy(master.size());
  rt::CollectiveCounter before =
      rt::collectiveCounter(rt::CollectiveKind::AllGather);
  commWait(allGatherShardsStart(copy.get(), pieces.get(), nullptr,
                                (int64_t)master.size(), kDP));
  EXPECT_EQ(copy.download(), stored<bf16>(master));
  EXPECT_EQ(rt::collectiveCounter(rt::CollectiveKind::AllGather).calls,
            before.calls + 1);
  {
    rt::UncountedCollectives notTraffic;
    commWait(allGatherShardsStart(copy.get(), pieces.get(), nullptr,
                                  (int64_t)master.size(), kDP));
  }
  EXPECT_EQ(rt::collectiveCounter(rt::CollectiveKind::AllGather).calls,
            before.calls + 1);
  DeviceArray<bf16> second(master.size());
  EXPECT_THROW(allGatherShardsStart(copy.get(), pieces.get(), second.get(),
                                    (int64_t)master.size(), kDP),
               std::runtime_error);
}

TEST(OneRankCommP2P, PeerOutsideTheMeshIsAnError) {
  DeviceArray<float> x(4);
  try {
    sendTo(x.get(), 4, MeshAxis::PP, 1, /*order=*/0);
    FAIL() << "sendTo to a missing stage did not throw";
  } catch (const std::runtime_error &e) {
    EXPECT_NE(std::string(e.what()).find("no rank has coordinate 1"),
              std::string::npos)
        << e.what();
  }
}

// Point-to-point channels exist along pp only.
TEST(OneRankCommP2P, OtherAxesAreAnError) {
  DeviceArray<float> x(4);
  try {
    recvFrom(x.get(), 4, MeshAxis::TP, 1);
    FAIL() << "recvFrom along tp did not throw";
  } catch (const std::runtime_error &e) {
    EXPECT_NE(std::string(e.what()).find("point-to-point only along pp"),
              std::string::npos)
        << e.what();
  }
}

// With nothing queued or sent, flushing and waiting do nothing.
TEST(OneRankCommP2P, FlushAndWaitWithoutSends) {
  flushSends();
  waitSends();
  flushSends();
}

// blocks [g, outer, len, inner] <-> tensor [outer, g * len, inner].
TYPED_TEST(OneRankComm, RegroupMatchesHostLoops) {
  using T = TypeParam;
  const int64_t g = 3, outer = 2, len = 4, inner = 3, n = outer * len * inner;
  std::vector<float> blocks = stored<T>(randomVector(g * n, 5));
  std::vector<float> want(g * n);
  for (int64_t r = 0; r < g; r++)
    for (int64_t o = 0; o < outer; o++)
      for (int64_t l = 0; l < len; l++)
        for (int64_t i = 0; i < inner; i++)
          want[(o * g * len + r * len + l) * inner + i] =
              blocks[((r * outer + o) * len + l) * inner + i];
  DeviceArray<T> b(blocks), tensor(g * n), back(g * n);
  detail::blocksToTensor(b.get(), tensor.get(), g, outer, len, inner,
                         computeStream());
  EXPECT_EQ(tensor.download(), want);
  detail::tensorToBlocks(tensor.get(), back.get(), g, outer, len, inner,
                         computeStream());
  EXPECT_EQ(back.download(), blocks);
}

} // namespace
} // namespace test
} // namespace tessel::cuda
