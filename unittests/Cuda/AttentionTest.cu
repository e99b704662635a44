//===- AttentionTest.cu - CUDA flash attention against the CPU kernels ----===//
//
// attentionForward and attentionBackward on random inputs, compared with the
// CPU kernels in fp32 on the same (storage-rounded) inputs: causal or not,
// sequence lengths that are not multiples of the tiles, grouped KV heads,
// head dimensions from 8 to 128 (multiples of 16, of 4 only, of neither),
// unaligned tensors. The forward's row log-sum-exp is checked too, and the
// backward reads the device forward's output and log-sum-exp, as a compiled
// step does. The backward is also run twice and must agree bitwise.
//
//===----------------------------------------------------------------------===//

#include "CudaTest.h"

#include "tessel/Runtime/Kernels.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace tessel::cuda::test {
namespace {

struct Shape {
  int64_t B, T, H, Hkv, D;
  bool causal;
};

std::string describe(const Shape &s) {
  return "B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) +
         " H=" + std::to_string(s.H) + " Hkv=" + std::to_string(s.Hkv) +
         " D=" + std::to_string(s.D) + (s.causal ? " causal" : " full");
}

// Absolute tolerance: a fraction of the largest reference value, for the
// elements of a gradient that nearly cancel (fp32 sums in another order;
// in bf16, P and dS are rounded to bf16 before their products).
template <typename T> double atolFor(const std::vector<float> &want) {
  float largest = 0.f;
  for (float x : want)
    largest = std::max(largest, std::fabs(x));
  return (std::is_same_v<T, float> ? 1e-5 : 1e-2) * largest;
}

struct Reference {
  std::vector<float> q, k, v, dout, out, lse, dq, dk, dv;
};

// Random inputs rounded to T (queries spread wider than keys, so that rows
// of probabilities are far from uniform) and the CPU results on them.
template <typename T> Reference reference(const Shape &s) {
  const size_t nq = size_t(s.B * s.T * s.H * s.D);
  const size_t nk = size_t(s.B * s.T * s.Hkv * s.D);
  Reference r;
  r.q = roundTo<T>(randomVector(nq, 1, -2.f, 2.f));
  r.k = roundTo<T>(randomVector(nk, 2));
  r.v = roundTo<T>(randomVector(nk, 3));
  r.dout = roundTo<T>(randomVector(nq, 4));
  r.out.resize(nq);
  r.lse.resize(size_t(s.B * s.H * s.T));
  r.dq.resize(nq);
  r.dk.resize(nk);
  r.dv.resize(nk);
  rt::attentionForward<float>(r.q.data(), r.k.data(), r.v.data(), r.out.data(),
                              r.lse.data(), s.B, s.T, s.H, s.Hkv, s.D,
                              s.causal);
  rt::attentionBackward<float>(r.q.data(), r.k.data(), r.v.data(),
                               r.out.data(), r.lse.data(), r.dout.data(),
                               r.dq.data(), r.dk.data(), r.dv.data(), s.B, s.T,
                               s.H, s.Hkv, s.D, s.causal);
  return r;
}

// Device copies of the inputs, `offset` elements into their allocations (an
// offset of 1 makes every tensor unaligned for vector loads).
template <typename T> struct DeviceInputs {
  DeviceArray<T> q, k, v, dout;
  DeviceInputs(const Reference &r, int64_t offset)
      : q(padded(r.q, offset)), k(padded(r.k, offset)), v(padded(r.v, offset)),
        dout(padded(r.dout, offset)) {}
  static std::vector<float> padded(const std::vector<float> &x,
                                   int64_t offset) {
    std::vector<float> y(size_t(offset), 0.f);
    y.insert(y.end(), x.begin(), x.end());
    return y;
  }
};

std::vector<float> dropFront(std::vector<float> x, int64_t n) {
  x.erase(x.begin(), x.begin() + n);
  return x;
}

template <typename T> void checkAgainstCpu(const Shape &s, int64_t offset = 0) {
  SCOPED_TRACE(describe(s) + (offset ? " unaligned" : ""));
  const Reference r = reference<T>(s);
  const DeviceInputs<T> in(r, offset);
  const size_t nq = r.q.size(), nk = r.k.size();
  DeviceArray<T> out(nq + size_t(offset)), dq(nq + size_t(offset)),
      dk(nk + size_t(offset)), dv(nk + size_t(offset));
  DeviceArray<float> lse(r.lse.size());
  DeviceArray<unsigned char> scratch(
      size_t(attentionScratchBytes(s.B, s.T, s.H, s.Hkv, s.D, int(sizeof(T)))));
  const int64_t o = offset;

  attentionForward<T>(in.q.get() + o, in.k.get() + o, in.v.get() + o,
                      out.get() + o, lse.get(), s.B, s.T, s.H, s.Hkv, s.D,
                      s.causal);
  attentionBackward<T>(in.q.get() + o, in.k.get() + o, in.v.get() + o,
                       out.get() + o, lse.get(), in.dout.get() + o,
                       dq.get() + o, dk.get() + o, dv.get() + o, s.B, s.T, s.H,
                       s.Hkv, s.D, s.causal, 0, 0, 0, scratch.get());

  const double rtol = rtolFor<T>();
  expectClose(dropFront(out.download(), o), r.out, rtol, atolFor<T>(r.out),
              "out");
  // The log-sum-exp is computed in fp32 on both sides (from the same
  // storage-rounded inputs), the scores summed in another order.
  expectClose(lse.download(), r.lse, 1e-4, 1e-4, "lse");
  expectClose(dropFront(dq.download(), o), r.dq, rtol, atolFor<T>(r.dq), "dq");
  expectClose(dropFront(dk.download(), o), r.dk, rtol, atolFor<T>(r.dk), "dk");
  expectClose(dropFront(dv.download(), o), r.dv, rtol, atolFor<T>(r.dv), "dv");
}

// Tiles are 64 query rows (32 in the fp32 backward) and 32 or 64 keys: 77,
// 150, 70, 45 and 33 leave partial tiles; 1 is a single row. Head dimensions:
// 16, 64 and 128 fill the tensor-core tiles; 8, 20 and 100 are padded to 16,
// 32 and 112; 20 and 30 take element-wise bf16 loads (not multiples of 8), 30
// element-wise fp32 loads (not a multiple of 4).
const Shape kShapes[] = {
    {2, 77, 4, 4, 16, true},   {2, 77, 4, 4, 16, false},
    {2, 77, 4, 2, 64, true},   {2, 77, 4, 2, 64, false},
    {2, 77, 4, 1, 128, true},  {2, 77, 4, 1, 128, false},
    {2, 150, 4, 2, 128, true}, {1, 150, 2, 1, 64, false},
    {2, 45, 2, 1, 20, true},   {2, 33, 2, 2, 30, false},
    {1, 70, 3, 1, 100, true},  {1, 1, 1, 1, 8, true},
    {1, 1, 1, 1, 8, false},
};

TEST(CudaAttention, MatchesCpuFloat) {
  for (const Shape &s : kShapes)
    checkAgainstCpu<float>(s);
}

TEST(CudaAttention, MatchesCpuBf16) {
  for (const Shape &s : kShapes)
    checkAgainstCpu<bf16>(s);
}

// Tensors that are not 16-byte aligned take the element-wise loads.
TEST(CudaAttention, UnalignedTensors) {
  checkAgainstCpu<float>({2, 77, 4, 2, 64, true}, 1);
  checkAgainstCpu<bf16>({2, 77, 4, 2, 64, true}, 1);
}

// Context parallelism: a piece of `Tq` query rows at row `first` of the
// `s.T` keys (in the balanced order of `zigzag` pieces, when given), on the
// device against the CPU kernels given the same piece
// (which equal the whole sequence's rows, unittests/Runtime). Pieces that
// start inside a tile, past the first key tile, and a last piece whose key
// tiles see no query of an earlier piece.
template <typename T>
void checkPieceAgainstCpu(const Shape &s, int64_t Tq, int64_t first,
                          int64_t zigzag = 0) {
  SCOPED_TRACE(describe(s) + " queries " + std::to_string(first) + ".." +
               std::to_string(first + Tq - 1) +
               (zigzag ? " of " + std::to_string(zigzag) + " balanced pieces"
                       : std::string()));
  const size_t nq = size_t(s.B * Tq * s.H * s.D);
  const size_t nk = size_t(s.B * s.T * s.Hkv * s.D);
  const std::vector<float> q = roundTo<T>(randomVector(nq, 5, -2.f, 2.f));
  const std::vector<float> k = roundTo<T>(randomVector(nk, 6));
  const std::vector<float> v = roundTo<T>(randomVector(nk, 7));
  const std::vector<float> dout = roundTo<T>(randomVector(nq, 8));
  std::vector<float> out(nq), lse(size_t(s.B * s.H * Tq)), dq(nq), dk(nk),
      dv(nk);
  rt::attentionForward<float>(q.data(), k.data(), v.data(), out.data(),
                              lse.data(), s.B, Tq, s.H, s.Hkv, s.D, s.causal,
                              s.T, first, zigzag);
  rt::attentionBackward<float>(q.data(), k.data(), v.data(), out.data(),
                               lse.data(), dout.data(), dq.data(), dk.data(),
                               dv.data(), s.B, Tq, s.H, s.Hkv, s.D, s.causal,
                               s.T, first, zigzag);

  DeviceArray<T> dQ(q), dK(k), dV(v), dO(dout), dOut(nq), gq(nq), gk(nk),
      gv(nk);
  DeviceArray<float> dLse(lse.size());
  DeviceArray<unsigned char> scratch(
      size_t(attentionScratchBytes(s.B, Tq, s.H, s.Hkv, s.D, int(sizeof(T)))));
  attentionForward<T>(dQ.get(), dK.get(), dV.get(), dOut.get(), dLse.get(),
                      s.B, Tq, s.H, s.Hkv, s.D, s.causal, s.T, first, zigzag);
  attentionBackward<T>(dQ.get(), dK.get(), dV.get(), dOut.get(), dLse.get(),
                       dO.get(), gq.get(), gk.get(), gv.get(), s.B, Tq, s.H,
                       s.Hkv, s.D, s.causal, s.T, first, zigzag,
                       scratch.get());
  const double rtol = rtolFor<T>();
  expectClose(dOut.download(), out, rtol, atolFor<T>(out), "out");
  expectClose(dLse.download(), lse, 1e-4, 1e-4, "lse");
  expectClose(gq.download(), dq, rtol, atolFor<T>(dq), "dq");
  expectClose(gk.download(), dk, rtol, atolFor<T>(dk), "dk");
  expectClose(gv.download(), dv, rtol, atolFor<T>(dv), "dv");
}

template <typename T> void checkPieces() {
  for (bool causal : {true, false}) {
    // 300 keys in pieces of 150 and 100 rows (tiles of 32 to 128 rows).
    checkPieceAgainstCpu<T>({2, 300, 4, 2, 64, causal}, 150, 0);
    checkPieceAgainstCpu<T>({2, 300, 4, 2, 64, causal}, 150, 150);
    checkPieceAgainstCpu<T>({1, 300, 2, 1, 128, causal}, 100, 200);
    checkPieceAgainstCpu<T>({1, 300, 2, 2, 30, causal}, 75, 75);
    checkPieceAgainstCpu<T>({1, 64, 2, 1, 16, causal}, 1, 63);
    // Balanced pieces: chunks c and 2n-1-c of 2n (of 50 and 37 rows, so
    // that tiles straddle the two chunks).
    checkPieceAgainstCpu<T>({2, 400, 4, 2, 64, causal}, 100, 100, 4);
    checkPieceAgainstCpu<T>({2, 400, 4, 2, 64, causal}, 100, 0, 4);
    checkPieceAgainstCpu<T>({1, 296, 2, 1, 128, causal}, 74, 222, 4);
  }
}

TEST(CudaAttention, QueryPiecesMatchCpuFloat) { checkPieces<float>(); }
TEST(CudaAttention, QueryPiecesMatchCpuBf16) { checkPieces<bf16>(); }

// Bitwise equal gradients from two runs: dK and dV of a shared KV head are
// summed over its query heads in a fixed order, nothing atomically.
template <typename T> void checkDeterministic(const Shape &s) {
  SCOPED_TRACE(describe(s));
  const Reference r = reference<T>(s);
  const DeviceInputs<T> in(r, 0);
  DeviceArray<unsigned char> scratch(
      size_t(attentionScratchBytes(s.B, s.T, s.H, s.Hkv, s.D, int(sizeof(T)))));
  DeviceArray<T> out(r.q.size());
  DeviceArray<float> lse(r.lse.size());
  attentionForward<T>(in.q.get(), in.k.get(), in.v.get(), out.get(), lse.get(),
                      s.B, s.T, s.H, s.Hkv, s.D, s.causal);
  const char *const names[3] = {"dq", "dk", "dv"};
  std::vector<float> first[3];
  for (int run = 0; run < 2; ++run) {
    DeviceArray<T> dq(r.q.size()), dk(r.k.size()), dv(r.k.size());
    attentionBackward<T>(in.q.get(), in.k.get(), in.v.get(), out.get(),
                         lse.get(), in.dout.get(), dq.get(), dk.get(), dv.get(),
                         s.B, s.T, s.H, s.Hkv, s.D, s.causal, 0, 0, 0, scratch.get());
    const std::vector<float> got[3] = {dq.download(), dk.download(),
                                       dv.download()};
    for (int i = 0; i < 3; ++i) {
      if (run == 0) {
        first[i] = got[i];
        continue;
      }
      ASSERT_EQ(got[i].size(), first[i].size());
      EXPECT_EQ(std::memcmp(got[i].data(), first[i].data(),
                            got[i].size() * sizeof(float)),
                0)
          << names[i] << " differs between runs";
    }
  }
}

TEST(CudaAttention, BackwardIsDeterministic) {
  checkDeterministic<float>({2, 200, 8, 2, 64, true});
  checkDeterministic<bf16>({2, 200, 8, 2, 64, true});
  checkDeterministic<bf16>({2, 200, 4, 1, 128, false});
}

TEST(CudaAttention, RejectsUnsupportedShapes) {
  // The shape is checked before anything is launched: null tensors do.
  const float *none = nullptr;
  float *out = nullptr;
  char scratch[1];
  EXPECT_THROW(attentionForward<float>(none, none, none, out, out, 1, 8, 2, 2,
                                       136, true),
               std::runtime_error);
  EXPECT_THROW(attentionForward<float>(none, none, none, out, out, 1, 8, 3, 2,
                                       64, true),
               std::runtime_error);
  EXPECT_THROW(attentionBackward<float>(none, none, none, none, none, none,
                                        out, out, out, 1, 8, 2, 1, 129, false, 0, 0, 0,
                                        scratch),
               std::runtime_error);
  EXPECT_THROW(attentionBackward<float>(none, none, none, none, none, none,
                                        out, out, out, 1, 8, 4, 3, 64, false, 0, 0, 0,
                                        scratch),
               std::runtime_error);
  // Query rows 12..19 of 16 keys.
  EXPECT_THROW(attentionForward<float>(none, none, none, out, out, 1, 8, 2, 2,
                                       64, true, 16, 12),
               std::runtime_error);
  // Without the forward's output and log-sum-exp there is nothing to start
  // from.
  EXPECT_THROW(attentionBackward<float>(none, none, none, none, none, none,
                                        out, out, out, 1, 8, 2, 1, 64, false, 0, 0, 0,
                                        scratch),
               std::runtime_error);
}

TEST(CudaAttention, ScratchRegionsAreAligned) {
  const int64_t bytes = attentionScratchBytes(3, 77, 5, 1, 64, 2);
  EXPECT_EQ(bytes % 256, 0);
  EXPECT_GE(bytes, 3 * 77 * 5 * int64_t(sizeof(float)));
}

} // namespace
} // namespace tessel::cuda::test
