//===- GemmTest.cu - cuBLASLt matmul against the CPU matmul ---------------===//
//
// matmul over transposes, batches with contiguous, padded and broadcast
// (stride 0) operands, accumulation, a shared output summing the batch and
// an empty contraction; matmulBias with and without GELU, on shapes that
// take the fused epilogue (N a multiple of 8) and the unfused one; the
// backward's fused products (matmulBiasGrad, matmulGeluGrad, matmulAdd)
// and the weight gradients summed by their GEMMs (matmulAccumulate,
// matmulBiasGradAccumulate, also into column blocks of a wider gradient)
// against the CPU kernels they replace. Storage: fp32
// throughout, bf16 operands into fp32, bf16 throughout.
//
//===----------------------------------------------------------------------===//

#include "CudaTest.h"

#include "tessel/Runtime/Kernels.h"

#include <cstring>
#include <stdexcept>
#include <string>

namespace tessel::cuda {
namespace detail {
// Gemm.cu: creates the cuBLASLt handle and workspace (idempotent).
void gemmInit();
} // namespace detail

namespace test {
namespace {

// Operand and result storage types of one test instance.
template <typename TOperand, typename TResult> struct Storage {
  using AB = TOperand;
  using C = TResult;
};

template <typename S> class Gemm : public ::testing::Test {
protected:
  void SetUp() override { detail::gemmInit(); }
};
using StorageTypes =
    ::testing::Types<Storage<float, float>, Storage<bf16, float>,
                     Storage<bf16, bf16>>;
TYPED_TEST_SUITE(Gemm, StorageTypes);

struct Problem {
  int64_t batch, M, N, K;
  bool transA, transB;
  int64_t strideA, strideB, strideC;
  bool accumulate;

  std::string name() const {
    return "batch=" + std::to_string(batch) + " M=" + std::to_string(M) +
           " N=" + std::to_string(N) + " K=" + std::to_string(K) +
           " transA=" + std::to_string(transA) +
           " transB=" + std::to_string(transB) + " strides=(" +
           std::to_string(strideA) + "," + std::to_string(strideB) + "," +
           std::to_string(strideC) +
           ") accumulate=" + std::to_string(accumulate);
  }
};

// Elements spanned by `batch` matrices of `size` elements `stride` apart.
size_t extent(int64_t batch, int64_t size, int64_t stride) {
  return size_t((batch - 1) * stride + size);
}

// Runs one problem on the device and on the CPU (on the same rounded
// inputs) and compares every element of C, padding included.
template <typename S> void checkProblem(const Problem &p, uint32_t seed) {
  using TAB = typename S::AB;
  using TC = typename S::C;
  SCOPED_TRACE(p.name());
  const size_t nA = extent(p.batch, p.M * p.K, p.strideA);
  const size_t nB = extent(p.batch, p.K * p.N, p.strideB);
  const size_t nC = extent(p.batch, p.M * p.N, p.strideC);
  const std::vector<float> a = roundTo<TAB>(randomVector(nA, seed));
  const std::vector<float> b = roundTo<TAB>(randomVector(nB, seed + 1));
  const std::vector<float> c0 = roundTo<TC>(randomVector(nC, seed + 2));

  DeviceArray<TAB> dA(a), dB(b);
  DeviceArray<TC> dC(c0);
  sync();
  matmul(dA.get(), dB.get(), dC.get(), p.batch, p.M, p.N, p.K, p.transA,
         p.transB, p.strideA, p.strideB, p.strideC, p.accumulate);
  const std::vector<float> got = dC.download();

  std::vector<float> want = c0;
  rt::matmul(a.data(), b.data(), want.data(), p.batch, p.M, p.N, p.K, p.transA,
             p.transB, p.strideA, p.strideB, p.strideC, p.accumulate);
  const bool bf16Out = std::is_same_v<TC, bf16>;
  expectClose(got, want, rtolFor<TC>(), bf16Out ? 1e-2 : 1e-4, "C");
}

TYPED_TEST(Gemm, Transposes) {
  uint32_t seed = 10;
  for (bool transA : {false, true})
    for (bool transB : {false, true}) {
      checkProblem<TypeParam>({1, 37, 53, 29, transA, transB, 0, 0, 0, false},
                              seed += 3);
      checkProblem<TypeParam>(
          {1, 128, 256, 192, transA, transB, 0, 0, 0, false}, seed += 3);
    }
}

TYPED_TEST(Gemm, ContiguousBatch) {
  const int64_t M = 16, N = 24, K = 40;
  checkProblem<TypeParam>(
      {3, M, N, K, false, false, M * K, K * N, M * N, false}, 20);
  checkProblem<TypeParam>({3, M, N, K, true, true, M * K, K * N, M * N, false},
                          23);
}

TYPED_TEST(Gemm, BroadcastOperands) {
  const int64_t M = 12, N = 40, K = 24;
  // Shared B, contiguous A and C: one product of batch * M rows.
  checkProblem<TypeParam>({4, M, N, K, false, false, M * K, 0, M * N, false},
                          30);
  checkProblem<TypeParam>({4, M, N, K, false, true, M * K, 0, M * N, false},
                          33);
  // Shared B with transposed A, and shared A: strided batches, stride 0.
  checkProblem<TypeParam>({4, M, N, K, true, false, M * K, 0, M * N, false},
                          36);
  checkProblem<TypeParam>({4, M, N, K, false, true, 0, K * N, M * N, false},
                          39);
}

TYPED_TEST(Gemm, PaddedStrides) {
  const int64_t M = 9, N = 14, K = 11;
  checkProblem<TypeParam>(
      {3, M, N, K, false, false, M * K + 8, K * N + 3, M * N + 5, false}, 40);
  checkProblem<TypeParam>(
      {3, M, N, K, true, true, M * K + 1, K * N + 16, M * N + 2, true}, 43);
}

TYPED_TEST(Gemm, Accumulate) {
  const int64_t M = 33, N = 17, K = 21;
  checkProblem<TypeParam>({1, M, N, K, true, true, 0, 0, 0, true}, 50);
  checkProblem<TypeParam>({2, M, N, K, false, false, M * K, K * N, M * N, true},
                          53);
}

TYPED_TEST(Gemm, SharedOutputSumsTheBatch) {
  // strideC = 0 with accumulate: C += sum over b of A[b] * B[b], in order.
  const int64_t M = 8, N = 16, K = 12;
  checkProblem<TypeParam>({3, M, N, K, false, false, M * K, K * N, 0, true},
                          60);
}

TYPED_TEST(Gemm, EmptyContraction) {
  // K = 0: C is zeroed, or left as it is when accumulating.
  checkProblem<TypeParam>({2, 5, 7, 0, false, false, 0, 0, 40, false}, 70);
  checkProblem<TypeParam>({2, 5, 7, 0, false, false, 0, 0, 40, true}, 73);
}

TYPED_TEST(Gemm, RepeatedShapeIsBitwiseReproducible) {
  using TAB = typename TypeParam::AB;
  using TC = typename TypeParam::C;
  const int64_t M = 64, N = 96, K = 80;
  DeviceArray<TAB> dA(roundTo<TAB>(randomVector(M * K, 80)));
  DeviceArray<TAB> dB(roundTo<TAB>(randomVector(K * N, 81)));
  DeviceArray<TC> c1(M * N), c2(M * N);
  sync();
  matmul(dA.get(), dB.get(), c1.get(), 1, M, N, K, false, true, 0, 0, 0);
  matmul(dA.get(), dB.get(), c2.get(), 1, M, N, K, false, true, 0, 0, 0);
  const std::vector<float> first = c1.download(), second = c2.download();
  EXPECT_EQ(0, std::memcmp(first.data(), second.data(),
                           first.size() * sizeof(float)));
}

// matmulBias against matmul, addBroadcast and geluForward on the CPU.
template <typename S>
void checkBias(int64_t M, int64_t N, int64_t K, bool transB, bool withGelu,
               uint32_t seed) {
  using TAB = typename S::AB;
  using TC = typename S::C;
  SCOPED_TRACE("M=" + std::to_string(M) + " N=" + std::to_string(N) +
               " K=" + std::to_string(K) + " transB=" + std::to_string(transB) +
               " gelu=" + std::to_string(withGelu));
  const std::vector<float> a = roundTo<TAB>(randomVector(M * K, seed));
  const std::vector<float> b = roundTo<TAB>(randomVector(K * N, seed + 1));
  const std::vector<float> bias = randomVector(N, seed + 2);

  DeviceArray<TAB> dA(a), dB(b);
  DeviceArray<float> dBias(bias);
  DeviceArray<TC> out(M * N), gelu(M * N);
  sync();
  matmulBias(dA.get(), dB.get(), dBias.get(), out.get(),
             withGelu ? gelu.get() : static_cast<TC *>(nullptr), M, N, K,
             transB);

  std::vector<float> pre(M * N), act(M * N);
  rt::matmul(a.data(), b.data(), pre.data(), 1, M, N, K, false, transB, 0, 0,
             0);
  rt::addBroadcast(pre.data(), bias.data(), pre.data(), M * N, N);
  rt::geluForward(pre.data(), act.data(), M * N);

  const bool bf16Out = std::is_same_v<TC, bf16>;
  expectClose(out.download(), pre, rtolFor<TC>(), bf16Out ? 2e-2 : 1e-4,
              "pre-activation");
  // The epilogue's tanh need not round as the CPU's does.
  if (withGelu)
    expectClose(gelu.download(), act, bf16Out ? 2e-2 : 1e-3,
                bf16Out ? 2e-2 : 2e-3, "gelu");
}

TYPED_TEST(Gemm, BiasEpilogue) {
  uint32_t seed = 90;
  for (bool transB : {false, true})
    for (bool withGelu : {false, true}) {
      // N a multiple of 8: the fused GELU epilogue is eligible.
      checkBias<TypeParam>(48, 64, 40, transB, withGelu, seed += 3);
      // N = 50: GELU goes through the unfused path.
      checkBias<TypeParam>(31, 50, 24, transB, withGelu, seed += 3);
    }
}

// matmulBiasGrad against matmul (A^T B) and reduceSumLeading of B.
template <typename S>
void checkBiasGrad(int64_t M, int64_t N, int64_t K, uint32_t seed) {
  using TAB = typename S::AB;
  using TC = typename S::C;
  SCOPED_TRACE("M=" + std::to_string(M) + " N=" + std::to_string(N) +
               " K=" + std::to_string(K));
  const std::vector<float> a = roundTo<TAB>(randomVector(K * M, seed));
  const std::vector<float> b = roundTo<TAB>(randomVector(K * N, seed + 1));
  DeviceArray<TAB> dA(a), dB(b);
  DeviceArray<TC> c(M * N);
  DeviceArray<float> db(N);
  sync();
  matmulBiasGrad(dA.get(), dB.get(), c.get(), db.get(), M, N, K);

  std::vector<float> wantC(M * N), wantDb(N);
  rt::matmul(a.data(), b.data(), wantC.data(), 1, M, N, K, true, false, 0, 0,
             0);
  rt::reduceSumLeading(b.data(), wantDb.data(), K, N);
  const bool bf16Out = std::is_same_v<TC, bf16>;
  expectClose(c.download(), wantC, rtolFor<TC>(), bf16Out ? 1e-2 : 1e-4, "C");
  expectClose(db.download(), wantDb, 1e-4, 1e-3, "bias gradient");
}

TYPED_TEST(Gemm, BiasGradEpilogue) {
  checkBiasGrad<TypeParam>(64, 48, 96, 110);   // fp32 C: BGRADA eligible
  checkBiasGrad<TypeParam>(37, 50, 129, 113);  // odd shapes
  checkBiasGrad<TypeParam>(256, 128, 256, 116);
}

// The operands of an M x K by K x N product (B stored [N, K] with transB)
// with a third M x N operand of the output's type (a pre-activation, an
// addend), on the host and on the device, and the device output.
template <typename S> struct EpilogueOperands {
  using TAB = typename S::AB;
  using TC = typename S::C;
  EpilogueOperands(int64_t M, int64_t N, int64_t K, uint32_t seed)
      : a(roundTo<TAB>(randomVector(M * K, seed))),
        b(roundTo<TAB>(randomVector(K * N, seed + 1))),
        third(roundTo<TC>(randomVector(M * N, seed + 2))), dA(a), dB(b),
        dThird(third), out(M * N) {
    sync();
  }
  std::vector<float> a, b, third;
  DeviceArray<TAB> dA, dB;
  DeviceArray<TC> dThird, out;
};

std::string shapeTrace(int64_t M, int64_t N, int64_t K, bool transB) {
  return "M=" + std::to_string(M) + " N=" + std::to_string(N) +
         " K=" + std::to_string(K) + " transB=" + std::to_string(transB);
}

// matmulGeluGrad against matmul and geluBackward.
template <typename S>
void checkGeluGrad(int64_t M, int64_t N, int64_t K, bool transB,
                   uint32_t seed) {
  SCOPED_TRACE(shapeTrace(M, N, K, transB));
  EpilogueOperands<S> o(M, N, K, seed);
  matmulGeluGrad(o.dA.get(), o.dB.get(), o.dThird.get(), o.out.get(), M, N, K,
                 transB);

  std::vector<float> want(M * N);
  rt::matmul(o.a.data(), o.b.data(), want.data(), 1, M, N, K, false, transB, 0,
             0, 0);
  rt::geluBackward(o.third.data(), want.data(), want.data(), M * N);
  const bool bf16Out = std::is_same_v<typename S::C, bf16>;
  // cuBLASLt's GELU derivative need not round as the CPU's does.
  expectClose(o.out.download(), want, bf16Out ? 2e-2 : 1e-3,
              bf16Out ? 2e-2 : 2e-3, "dx");
}

TYPED_TEST(Gemm, GeluGradEpilogue) {
  uint32_t seed = 120;
  for (bool transB : {false, true}) {
    checkGeluGrad<TypeParam>(48, 64, 40, transB, seed += 3); // N % 8 == 0
    checkGeluGrad<TypeParam>(31, 50, 24, transB, seed += 3); // unfused path
  }
}

// matmulAdd against a copy of the addend and an accumulating matmul.
template <typename S>
void checkMatmulAdd(int64_t M, int64_t N, int64_t K, bool transB,
                    uint32_t seed) {
  SCOPED_TRACE(shapeTrace(M, N, K, transB));
  EpilogueOperands<S> o(M, N, K, seed);
  matmulAdd(o.dA.get(), o.dB.get(), o.dThird.get(), o.out.get(), M, N, K,
            transB);

  std::vector<float> want = o.third;
  rt::matmul(o.a.data(), o.b.data(), want.data(), 1, M, N, K, false, transB, 0,
             0, 0, true);
  const bool bf16Out = std::is_same_v<typename S::C, bf16>;
  expectClose(o.out.download(), want, rtolFor<typename S::C>(),
              bf16Out ? 1e-2 : 1e-4, "out");
  // The addend is read, not written.
  expectBitwiseEqual(o.dThird.download(), o.third, "addend");
}

TYPED_TEST(Gemm, AddIntoC) {
  uint32_t seed = 140;
  for (bool transB : {false, true}) {
    checkMatmulAdd<TypeParam>(64, 96, 80, transB, seed += 3);
    checkMatmulAdd<TypeParam>(33, 17, 21, transB, seed += 3);
  }
}

// The weight gradients summed over microbatches by their GEMMs: two runs,
// the first writing the product (whatever C held), the second adding its
// own, against the CPU kernels on the same rounded inputs. With the bias
// gradient, db is each run's column sums, written.
template <typename S>
void checkAccumulate(int64_t M, int64_t N, int64_t K, bool withBias,
                     uint32_t seed) {
  using TAB = typename S::AB;
  using TC = typename S::C;
  SCOPED_TRACE("M=" + std::to_string(M) + " N=" + std::to_string(N) +
               " K=" + std::to_string(K) + " bias=" + std::to_string(withBias));
  const std::vector<float> a1 = roundTo<TAB>(randomVector(K * M, seed));
  const std::vector<float> b1 = roundTo<TAB>(randomVector(K * N, seed + 1));
  const std::vector<float> a2 = roundTo<TAB>(randomVector(K * M, seed + 2));
  const std::vector<float> b2 = roundTo<TAB>(randomVector(K * N, seed + 3));
  const std::vector<float> stale = roundTo<TC>(randomVector(M * N, seed + 4));
  DeviceArray<TAB> dA1(a1), dB1(b1), dA2(a2), dB2(b2);
  DeviceArray<TC> c(stale);
  DeviceArray<float> db(N);
  sync();
  std::vector<float> want = stale, wantDb(N);
  for (int run = 0; run < 2; ++run) {
    const bool first = run == 0;
    const std::vector<float> &a = first ? a1 : a2, &b = first ? b1 : b2;
    const TAB *dA = first ? dA1.get() : dA2.get();
    const TAB *dB = first ? dB1.get() : dB2.get();
    if (withBias) {
      if constexpr (std::is_same_v<TC, float>) {
        matmulBiasGradAccumulate(dA, dB, c.get(), db.get(), first, M, N, K);
        rt::matmulBiasGradAccumulate(a.data(), b.data(), want.data(),
                                     wantDb.data(), first, M, N, K);
      }
    } else {
      matmulAccumulate(dA, dB, c.get(), first, M, N, K, true, false);
      rt::matmulAccumulate(a.data(), b.data(), want.data(), first, M, N, K,
                           true, false);
    }
  }
  const bool bf16Out = std::is_same_v<TC, bf16>;
  expectClose(c.download(), want, rtolFor<TC>(), bf16Out ? 2e-2 : 1e-4,
              "summed product");
  if (withBias && std::is_same_v<TC, float>)
    expectClose(db.download(), wantDb, 1e-4, 1e-3, "bias gradient");
}

TYPED_TEST(Gemm, AccumulateIntoGradient) {
  uint32_t seed = 160;
  for (bool withBias : {false, true}) {
    if (withBias && !std::is_same_v<typename TypeParam::C, float>)
      continue; // the bias gradient is fp32, as its product's C is
    checkAccumulate<TypeParam>(64, 48, 96, withBias, seed += 5);
    checkAccumulate<TypeParam>(37, 50, 129, withBias, seed += 5);
  }
}

// The q, k and v pieces of a fused projection's gradients: pieces 2 and 0
// of three write (then sum) their columns of rows of 3N and their column
// sums, piece 1's columns keep what they held; against the CPU kernels on
// the same inputs. N = 50 puts the pieces at 8-byte (not 16-byte) aligned
// columns; a bf16 C takes the unfused product with its leading dimension.
template <typename S>
void checkColumnBlocks(int64_t M, int64_t N, int64_t K, uint32_t seed) {
  using TAB = typename S::AB;
  using TC = typename S::C;
  SCOPED_TRACE("M=" + std::to_string(M) + " N=" + std::to_string(N) +
               " K=" + std::to_string(K));
  const int64_t ldc = 3 * N;
  const std::vector<float> stale = roundTo<TC>(randomVector(M * ldc, seed));
  const std::vector<float> staleDb = randomVector(ldc, seed + 1);
  DeviceArray<TC> c(stale);
  DeviceArray<float> db(staleDb);
  std::vector<float> want = stale, wantDb = staleDb;
  for (int run = 0; run < 2; ++run)
    for (int64_t piece : {2, 0}) {
      seed += 2;
      const std::vector<float> a = roundTo<TAB>(randomVector(K * M, seed));
      const std::vector<float> b = roundTo<TAB>(randomVector(K * N, seed + 1));
      DeviceArray<TAB> dA(a), dB(b);
      sync();
      const bool first = run == 0;
      matmulBiasGradAccumulate(dA.get(), dB.get(), c.get(), db.get(), first, M,
                               N, K, ldc, piece * N);
      rt::matmulBiasGradAccumulate(a.data(), b.data(), want.data(),
                                   wantDb.data(), first, M, N, K, ldc,
                                   piece * N);
      sync();
    }
  const bool bf16Out = std::is_same_v<TC, bf16>;
  expectClose(c.download(), want, rtolFor<TC>(), bf16Out ? 2e-2 : 1e-4,
              "column blocks");
  expectClose(db.download(), wantDb, 1e-4, 1e-3, "bias gradient blocks");
}

TYPED_TEST(Gemm, BiasGradColumnBlocks) {
  checkColumnBlocks<TypeParam>(64, 48, 96, 190);
  checkColumnBlocks<TypeParam>(37, 50, 129, 200);
}

TEST(GemmTypes, MixedOperandTypesThrow) {
  detail::gemmInit();
  DeviceArray<float> f(16);
  DeviceArray<bf16> h(16);
  EXPECT_THROW(
      matmul(f.get(), h.get(), f.get(), 1, 4, 4, 1, false, false, 0, 0, 0),
      std::runtime_error);
  EXPECT_THROW(
      matmul(h.get(), f.get(), f.get(), 1, 4, 4, 1, false, false, 0, 0, 0),
      std::runtime_error);
  // fp32 operands into a bf16 result: not a cuBLASLt combination.
  EXPECT_THROW(
      matmul(f.get(), f.get(), h.get(), 1, 4, 4, 1, false, false, 0, 0, 0),
      std::runtime_error);
  EXPECT_THROW(matmulBias(f.get(), h.get(), f.get(), f.get(),
                          static_cast<float *>(nullptr), 4, 4, 1, false),
               std::runtime_error);
}

} // namespace
} // namespace test
} // namespace tessel::cuda
