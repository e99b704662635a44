//===- KernelsRefTest.cpp - Kernels against their naive references --------===//
//
// Every kernel on random float inputs of odd sizes, compared with the naive
// double-precision reference in KernelsRef.h. Some sizes are large enough to
// take the multi-threaded and blocked code paths.
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/KernelsRef.h"
#include "tessel/Runtime/Dropout.h"
#include "tessel/Runtime/Kernels.h"
#include "tessel/Runtime/Sequence.h"
#include "tessel/Runtime/VocabParallel.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <random>
#include <string>
#include <vector>

namespace rt = tessel::rt;

namespace {

std::vector<float> randVec(size_t n, std::mt19937 &gen, float lo = -1.f,
                           float hi = 1.f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float &x : v)
    x = dist(gen);
  return v;
}

std::vector<int32_t> randIds(size_t n, int32_t V, std::mt19937 &gen) {
  std::uniform_int_distribution<int32_t> dist(0, V - 1);
  std::vector<int32_t> v(n);
  for (int32_t &x : v)
    x = dist(gen);
  return v;
}

// |got - want| <= rtol * (|want| + max|want|): relative per element, with an
// absolute floor at the scale of the whole tensor for entries near zero.
void expectClose(const std::vector<float> &got, const std::vector<float> &want,
                 const std::string &what, double rtol = 1e-5) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double maxAbs = 0;
  for (float w : want)
    maxAbs = std::max(maxAbs, double(std::fabs(w)));
  int reported = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double tol = rtol * (std::fabs(double(want[i])) + maxAbs);
    const double err = std::fabs(double(got[i]) - double(want[i]));
    if (!(err <= tol) && reported++ < 5)
      ADD_FAILURE() << what << ": element " << i << " got " << got[i]
                    << " want " << want[i] << " (tol " << tol << ")";
  }
}

// ---------------------------------------------------------------- matmul

struct MatmulCase {
  int64_t batch, M, N, K;
  bool transA, transB, broadcastA, broadcastB, accumulate;
  int64_t padC; // extra elements between C batches (non-contiguous C)
};

void runMatmul(const MatmulCase &c, std::mt19937 &gen) {
  const int64_t sA = c.broadcastA ? 0 : c.M * c.K;
  const int64_t sB = c.broadcastB ? 0 : c.K * c.N;
  const int64_t sC = c.M * c.N + c.padC;
  auto A = randVec(
      static_cast<size_t>(c.broadcastA ? c.M * c.K : c.batch * c.M * c.K), gen);
  auto B = randVec(
      static_cast<size_t>(c.broadcastB ? c.K * c.N : c.batch * c.K * c.N), gen);
  auto C0 = randVec(static_cast<size_t>(c.batch * sC), gen);
  auto got = C0, want = C0;
  rt::matmul(A.data(), B.data(), got.data(), c.batch, c.M, c.N, c.K, c.transA,
             c.transB, sA, sB, sC, c.accumulate);
  rt::ref::matmul(A.data(), B.data(), want.data(), c.batch, c.M, c.N, c.K,
                  c.transA, c.transB, sA, sB, sC, c.accumulate);
  std::string what = "matmul tA=" + std::to_string(c.transA) +
                     " tB=" + std::to_string(c.transB) +
                     " bcA=" + std::to_string(c.broadcastA) +
                     " bcB=" + std::to_string(c.broadcastB) +
                     " acc=" + std::to_string(c.accumulate) +
                     " padC=" + std::to_string(c.padC);
  expectClose(got, want, what);
}

} // namespace

TEST(KernelMatmul, AllTransposeCombinations) {
  std::mt19937 gen(1);
  for (bool tA : {false, true})
    for (bool tB : {false, true})
      for (bool acc : {false, true})
        runMatmul({3, 5, 7, 6, tA, tB, false, false, acc, 0}, gen);
}

TEST(KernelMatmul, BroadcastOperands) {
  std::mt19937 gen(2);
  for (bool tA : {false, true})
    for (bool tB : {false, true})
      for (bool acc : {false, true}) {
        // Shared B (collapsed into one GEMM when !tA), shared A.
        runMatmul({4, 5, 7, 6, tA, tB, false, true, acc, 0}, gen);
        runMatmul({4, 5, 7, 6, tA, tB, true, false, acc, 0}, gen);
        // Shared B but C batches not contiguous: must loop.
        runMatmul({3, 5, 7, 6, tA, tB, false, true, acc, 3}, gen);
      }
}

TEST(KernelMatmul, LargerAndDegenerate) {
  std::mt19937 gen(3);
  runMatmul({2, 67, 45, 129, false, true, false, false, false, 0}, gen);
  runMatmul({1, 1, 13, 9, true, false, false, false, true, 0}, gen);
  runMatmul({5, 3, 1, 11, false, false, false, true, false, 0}, gen);
  // K = 0: the product is zero (overwrite) or C is left as is (accumulate).
  std::vector<float> C(6, 5.f);
  rt::matmul<float>(nullptr, nullptr, C.data(), 1, 2, 3, 0, false, false, 0, 0,
                    6, true);
  EXPECT_EQ(C, std::vector<float>(6, 5.f));
  rt::matmul<float>(nullptr, nullptr, C.data(), 1, 2, 3, 0, false, false, 0, 0,
                    6, false);
  EXPECT_EQ(C, std::vector<float>(6, 0.f));
}

// The weight gradient summed over microbatches by its GEMM: the first run
// writes the product over whatever the buffer held, each later one adds
// its own; with the bias gradient, db is each run's column sums.
TEST(KernelMatmul, AccumulateOverMicrobatches) {
  std::mt19937 gen(4);
  const int64_t M = 9, N = 7, K = 13;
  for (bool withBias : {false, true}) {
    std::vector<float> got = randVec(M * N, gen), want(M * N, 0.f);
    std::vector<float> db(N), wantDb(N);
    for (int run = 0; run < 3; ++run) {
      auto A = randVec(K * M, gen), B = randVec(K * N, gen);
      if (withBias)
        rt::matmulBiasGradAccumulate(A.data(), B.data(), got.data(), db.data(),
                                     run == 0, M, N, K);
      else
        rt::matmulAccumulate(A.data(), B.data(), got.data(), run == 0, M, N, K,
                             true, false);
      rt::ref::matmul(A.data(), B.data(), want.data(), 1, M, N, K, true, false,
                      0, 0, 0, /*accumulate=*/true);
      rt::ref::reduceSumLeading(B.data(), wantDb.data(), K, N);
      if (withBias)
        expectClose(db, wantDb, "bias gradient, run " + std::to_string(run));
    }
    expectClose(got, want,
                withBias ? "matmulBiasGradAccumulate" : "matmulAccumulate");
  }
}

// The q, k and v pieces of a fused projection's gradients: each GEMM writes
// (and after the first run sums) its columns [col, col + N) of rows of ldc,
// and its column sums in db [col, col + N), leaving the other columns as
// they are (here the middle piece's, never written).
TEST(KernelMatmul, BiasGradColumnBlocks) {
  std::mt19937 gen(5);
  const int64_t M = 6, N = 5, K = 11, ldc = 3 * N;
  for (bool accumulate : {false, true}) {
    std::vector<float> got = randVec(M * ldc, gen), want = got;
    std::vector<float> db = randVec(ldc, gen), wantDb = db;
    for (int run = 0; run < 3; ++run)
      for (int64_t p : {2, 0}) {
        auto A = randVec(K * M, gen), B = randVec(K * N, gen);
        if (accumulate)
          rt::matmulBiasGradAccumulate(A.data(), B.data(), got.data(),
                                       db.data(), run == 0, M, N, K, ldc,
                                       p * N);
        else
          rt::matmulBiasGrad(A.data(), B.data(), got.data(), db.data(), M, N, K,
                             ldc, p * N);
        std::vector<float> piece(M * N), pieceDb(N);
        rt::ref::matmul(A.data(), B.data(), piece.data(), 1, M, N, K, true,
                        false, 0, 0, 0, false);
        rt::ref::reduceSumLeading(B.data(), pieceDb.data(), K, N);
        const bool sums = accumulate && run > 0;
        for (int64_t i = 0; i < M; ++i)
          for (int64_t j = 0; j < N; ++j) {
            float &w = want[i * ldc + p * N + j];
            w = (sums ? w : 0.f) + piece[i * N + j];
          }
        for (int64_t j = 0; j < N; ++j)
          wantDb[p * N + j] = pieceDb[j];
      }
    expectClose(got, want, accumulate ? "summed blocks" : "blocks");
    expectClose(db, wantDb, "bias gradient blocks");
  }
}

// ------------------------------------------------------------ elementwise

TEST(KernelElementwise, BroadcastAddMul) {
  std::mt19937 gen(4);
  for (auto [n, nb] :
       std::vector<std::pair<int64_t, int64_t>>{{7 * 13, 13},
                                                {7 * 13, 1},
                                                {91, 91},
                                                {300 * 257, 257},
                                                {100001, 1},
                                                {70000, 70000}}) {
    auto a = randVec(static_cast<size_t>(n), gen),
         b = randVec(static_cast<size_t>(nb), gen);
    std::vector<float> got(static_cast<size_t>(n)),
        want(static_cast<size_t>(n));
    rt::addBroadcast(a.data(), b.data(), got.data(), n, nb);
    rt::ref::addBroadcast(a.data(), b.data(), want.data(), n, nb);
    expectClose(got, want, "addBroadcast nb=" + std::to_string(nb));
    rt::mulBroadcast(a.data(), b.data(), got.data(), n, nb);
    rt::ref::mulBroadcast(a.data(), b.data(), want.data(), n, nb);
    expectClose(got, want, "mulBroadcast nb=" + std::to_string(nb));
  }
}

TEST(KernelElementwise, ReduceSumLeading) {
  std::mt19937 gen(5);
  for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
           {7, 13}, {1, 5}, {50, 1000}, {300, 257}}) {
    auto x = randVec(static_cast<size_t>(rows * cols), gen);
    std::vector<float> got(static_cast<size_t>(cols), 99.f),
        want(static_cast<size_t>(cols));
    rt::reduceSumLeading(x.data(), got.data(), rows, cols);
    rt::ref::reduceSumLeading(x.data(), want.data(), rows, cols);
    expectClose(got, want, "reduceSumLeading");
  }
}

TEST(KernelElementwise, Pointwise) {
  std::mt19937 gen(6);
  for (int64_t n : {int64_t(1001), int64_t(100003)}) {
    auto x = randVec(static_cast<size_t>(n), gen, -4.f, 4.f);
    auto dy = randVec(static_cast<size_t>(n), gen);
    std::vector<float> got(static_cast<size_t>(n)),
        want(static_cast<size_t>(n));
    rt::scale(x.data(), got.data(), n, 0.37f);
    rt::ref::scale(x.data(), want.data(), n, 0.37f);
    expectClose(got, want, "scale");
    rt::geluForward(x.data(), got.data(), n);
    rt::ref::geluForward(x.data(), want.data(), n);
    expectClose(got, want, "geluForward");
    rt::geluBackward(x.data(), dy.data(), got.data(), n);
    rt::ref::geluBackward(x.data(), dy.data(), want.data(), n);
    expectClose(got, want, "geluBackward");
    rt::siluForward(x.data(), got.data(), n);
    rt::ref::siluForward(x.data(), want.data(), n);
    expectClose(got, want, "siluForward");
    rt::siluBackward(x.data(), dy.data(), got.data(), n);
    rt::ref::siluBackward(x.data(), dy.data(), want.data(), n);
    expectClose(got, want, "siluBackward");
    rt::copy(x.data(), got.data(), n);
    EXPECT_EQ(got, x);
    rt::fill(got.data(), n, 2.5f);
    EXPECT_EQ(got, std::vector<float>(static_cast<size_t>(n), 2.5f));
  }
  // Spot values of 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
  const float xs[] = {-3.f, -1.f, 0.f, 0.5f, 2.f};
  const double ys[] = {-0.0036373921, -0.1588080094, 0.0, 0.3457140098,
                       1.9545976941};
  float out[5];
  rt::geluForward(xs, out, 5);
  for (int i = 0; i < 5; ++i)
    EXPECT_NEAR(out[i], ys[i], 1e-6) << "gelu(" << xs[i] << ")";
}

// SwiGLU's fused backward against the reference kernels it replaces: the
// SiLU of the gate times the output gradient (up's gradient), and the SiLU's
// backward of the output gradient times up (the gate's).
TEST(KernelElementwise, SwigluBackward) {
  std::mt19937 gen(16);
  for (int64_t n : {int64_t(1001), int64_t(100003)}) {
    const size_t un = static_cast<size_t>(n);
    auto gate = randVec(un, gen, -6.f, 6.f), up = randVec(un, gen);
    auto dout = randVec(un, gen);
    std::vector<float> dgate(un), dup(un), silu(un), t(un), wantGate(un),
        wantUp(un);
    rt::swigluBackward(gate.data(), up.data(), dout.data(), dgate.data(),
                       dup.data(), n);
    rt::ref::siluForward(gate.data(), silu.data(), n);
    rt::ref::mulBroadcast(dout.data(), silu.data(), wantUp.data(), n, n);
    rt::ref::mulBroadcast(dout.data(), up.data(), t.data(), n, n);
    rt::ref::siluBackward(gate.data(), t.data(), wantGate.data(), n);
    expectClose(dup, wantUp, "swigluBackward: up's gradient");
    expectClose(dgate, wantGate, "swigluBackward: the gate's gradient");
  }
}

TEST(KernelElementwise, SumSquares) {
  std::mt19937 gen(7);
  for (int64_t n : {int64_t(0), int64_t(13), int64_t(1001), int64_t(100003)}) {
    auto x = randVec(static_cast<size_t>(n), gen);
    const double got = rt::sumSquares(x.data(), n);
    const double want = rt::ref::sumSquares(x.data(), n);
    EXPECT_NEAR(got, want, 1e-12 * std::max(1.0, want)) << "n=" << n;
  }
}

// ------------------------------------------------------------------ norms

TEST(KernelNorms, LayerNorm) {
  std::mt19937 gen(8);
  for (auto [rows, C] :
       std::vector<std::pair<int64_t, int64_t>>{{7, 13}, {1, 3}, {64, 300}}) {
    auto x = randVec(static_cast<size_t>(rows * C), gen, -2.f, 3.f);
    auto w = randVec(static_cast<size_t>(C), gen),
         b = randVec(static_cast<size_t>(C), gen);
    auto dy = randVec(static_cast<size_t>(rows * C), gen);
    const double eps = 1e-5;
    std::vector<float> got(static_cast<size_t>(rows * C)),
        want(static_cast<size_t>(rows * C));
    rt::layerNormForward(x.data(), w.data(), b.data(), got.data(), rows, C,
                         eps);
    rt::ref::layerNormForward(x.data(), w.data(), b.data(), want.data(), rows,
                              C, eps);
    expectClose(got, want, "layerNormForward");
    std::vector<float> dx(static_cast<size_t>(rows * C)),
        dw(static_cast<size_t>(C)), db(static_cast<size_t>(C));
    std::vector<float> rdx(static_cast<size_t>(rows * C)),
        rdw(static_cast<size_t>(C)), rdb(static_cast<size_t>(C));
    rt::layerNormBackward(x.data(), w.data(), dy.data(), dx.data(), dw.data(),
                          db.data(), rows, C, eps);
    rt::ref::layerNormBackward(x.data(), w.data(), dy.data(), rdx.data(),
                               rdw.data(), rdb.data(), rows, C, eps);
    expectClose(dx, rdx, "layerNorm dx");
    expectClose(dw, rdw, "layerNorm dw");
    expectClose(db, rdb, "layerNorm db");
  }
}

TEST(KernelNorms, RMSNorm) {
  std::mt19937 gen(9);
  for (auto [rows, C] :
       std::vector<std::pair<int64_t, int64_t>>{{7, 13}, {1, 3}, {64, 300}}) {
    auto x = randVec(static_cast<size_t>(rows * C), gen, -2.f, 3.f);
    auto w = randVec(static_cast<size_t>(C), gen);
    auto dy = randVec(static_cast<size_t>(rows * C), gen);
    const double eps = 1e-6;
    std::vector<float> got(static_cast<size_t>(rows * C)),
        want(static_cast<size_t>(rows * C));
    rt::rmsNormForward(x.data(), w.data(), got.data(), rows, C, eps);
    rt::ref::rmsNormForward(x.data(), w.data(), want.data(), rows, C, eps);
    expectClose(got, want, "rmsNormForward");
    std::vector<float> dx(static_cast<size_t>(rows * C)),
        dw(static_cast<size_t>(C));
    std::vector<float> rdx(static_cast<size_t>(rows * C)),
        rdw(static_cast<size_t>(C));
    rt::rmsNormBackward(x.data(), w.data(), dy.data(), dx.data(), dw.data(),
                        rows, C, eps);
    rt::ref::rmsNormBackward(x.data(), w.data(), dy.data(), rdx.data(),
                             rdw.data(), rows, C, eps);
    expectClose(dx, rdx, "rmsNorm dx");
    expectClose(dw, rdw, "rmsNorm dw");
  }
}

// ------------------------------------------------------------------- rope

TEST(KernelRope, MatchesReference) {
  std::mt19937 gen(10);
  for (int64_t D : {int64_t(6), int64_t(7), int64_t(64)})
    for (bool inverse : {false, true}) {
      const int64_t B = 2, T = 5, H = 4, n = B * T * H * D;
      auto x = randVec(static_cast<size_t>(n), gen);
      std::vector<float> got(static_cast<size_t>(n)),
          want(static_cast<size_t>(n));
      rt::rope(x.data(), got.data(), B, T, H, D, 10000.0, inverse);
      rt::ref::rope(x.data(), want.data(), B, T, H, D, 10000.0, inverse);
      expectClose(got, want, "rope D=" + std::to_string(D));
      // Rotating back restores the input.
      std::vector<float> back(static_cast<size_t>(n));
      rt::rope(got.data(), back.data(), B, T, H, D, 10000.0, !inverse);
      expectClose(back, x, "rope round trip");
    }
  // Position 0 is not rotated.
  std::vector<float> x = {1, 2, 3, 4}, out(4);
  rt::rope(x.data(), out.data(), 1, 1, 1, 4, 10000.0, false);
  EXPECT_EQ(out, x);
}

// ropeAt rotates each token by the angle of its given position: at positions
// 0..T-1 it is rope, and at an offset it is rope's rows of the longer
// sequence, bit for bit.
TEST(KernelRope, AtPositionsMatchesRope) {
  std::mt19937 gen(13);
  for (int64_t D : {int64_t(6), int64_t(7), int64_t(64)}) {
    const int64_t B = 2, L = 9, H = 3, row = H * D;
    auto x = randVec(static_cast<size_t>(B * L * row), gen);
    std::vector<float> whole(x.size());
    rt::rope(x.data(), whole.data(), B, L, H, D, 10000.0, false);

    std::vector<int32_t> positions(static_cast<size_t>(B * L));
    for (int64_t i = 0; i < B * L; ++i)
      positions[size_t(i)] = int32_t(i % L);
    std::vector<float> at(x.size());
    rt::ropeAt(x.data(), positions.data(), at.data(), B, L, H, D, 10000.0);
    EXPECT_EQ(at, whole) << "ropeAt at 0..T-1, D=" << D;

    // Tokens offset..offset+S-1 of each sequence, alone.
    const int64_t offset = 5, S = 3;
    std::vector<float> part(static_cast<size_t>(B * S * row)),
        want(part.size()), got(part.size());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s) {
        positions[size_t(b * S + s)] = int32_t(offset + s);
        const int64_t from = (b * L + offset + s) * row;
        std::copy_n(x.begin() + from, row, part.begin() + (b * S + s) * row);
        std::copy_n(whole.begin() + from, row,
                    want.begin() + (b * S + s) * row);
      }
    rt::ropeAt(part.data(), positions.data(), got.data(), B, S, H, D, 10000.0);
    EXPECT_EQ(got, want) << "ropeAt at offset " << offset << ", D=" << D;
  }
}

// -------------------------------------------------------------- attention

namespace {
void runAttention(int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                  bool causal, std::mt19937 &gen) {
  const int64_t nq = B * T * H * D, nk = B * T * Hkv * D;
  auto q = randVec(static_cast<size_t>(nq), gen, -2.f, 2.f);
  auto k = randVec(static_cast<size_t>(nk), gen, -2.f, 2.f);
  auto v = randVec(static_cast<size_t>(nk), gen);
  auto dout = randVec(static_cast<size_t>(nq), gen);
  const std::string tag =
      " B=" + std::to_string(B) + " T=" + std::to_string(T) +
      " H=" + std::to_string(H) + " Hkv=" + std::to_string(Hkv) +
      " D=" + std::to_string(D) + " causal=" + std::to_string(causal);
  std::vector<float> out(static_cast<size_t>(nq)),
      rout(static_cast<size_t>(nq));
  std::vector<float> lse(static_cast<size_t>(B * H * T)),
      rlse(static_cast<size_t>(B * H * T));
  rt::attentionForward(q.data(), k.data(), v.data(), out.data(), lse.data(), B,
                       T, H, Hkv, D, causal);
  rt::ref::attentionForward(q.data(), k.data(), v.data(), rout.data(), B, T, H,
                            Hkv, D, causal);
  expectClose(out, rout, "attentionForward" + tag);
  // lse[b, h, t] = log sum_j exp(q . k_j / sqrt(D)) over the keys row t
  // sees, in double.
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t g = h / (H / Hkv), n = causal ? t + 1 : T;
        std::vector<double> sc(static_cast<size_t>(n));
        for (int64_t j = 0; j < n; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d)
            dot += double(q[size_t(((b * T + t) * H + h) * D + d)]) *
                   double(k[size_t(((b * T + j) * Hkv + g) * D + d)]);
          sc[size_t(j)] = dot / std::sqrt(double(D));
        }
        const double mx = *std::max_element(sc.begin(), sc.end());
        double sum = 0;
        for (double x : sc)
          sum += std::exp(x - mx);
        rlse[size_t((b * H + h) * T + t)] = float(mx + std::log(sum));
      }
  expectClose(lse, rlse, "attention lse" + tag);
  std::vector<float> dq(static_cast<size_t>(nq)), dk(static_cast<size_t>(nk)),
      dv(static_cast<size_t>(nk));
  std::vector<float> rdq(static_cast<size_t>(nq)), rdk(static_cast<size_t>(nk)),
      rdv(static_cast<size_t>(nk));
  rt::attentionBackward(q.data(), k.data(), v.data(), out.data(), lse.data(),
                        dout.data(), dq.data(), dk.data(), dv.data(), B, T, H,
                        Hkv, D, causal);
  rt::ref::attentionBackward(q.data(), k.data(), v.data(), dout.data(),
                             rdq.data(), rdk.data(), rdv.data(), B, T, H, Hkv,
                             D, causal);
  expectClose(dq, rdq, "attention dq" + tag);
  expectClose(dk, rdk, "attention dk" + tag);
  expectClose(dv, rdv, "attention dv" + tag);
}
} // namespace

TEST(KernelAttention, MatchesReference) {
  std::mt19937 gen(11);
  for (bool causal : {true, false}) {
    runAttention(2, 5, 4, 2, 6, causal, gen);   // GQA
    runAttention(2, 5, 4, 4, 6, causal, gen);   // MHA
    runAttention(1, 7, 3, 1, 5, causal, gen);   // MQA
    runAttention(2, 33, 4, 2, 16, causal, gen); // multi-threaded
  }
}

// A sequence fed through the KV cache `chunk` tokens at a time (the last
// chunk shorter) gives the causal forward of the whole sequence, and leaves
// exactly its keys and values in the cache (rows past it untouched).
namespace {
void runCachedAttention(int64_t B, int64_t T, int64_t Tmax, int64_t H,
                        int64_t Hkv, int64_t D, int64_t chunk,
                        std::mt19937 &gen) {
  const int64_t qRow = H * D, kRow = Hkv * D;
  auto q = randVec(static_cast<size_t>(B * T * qRow), gen, -2.f, 2.f);
  auto k = randVec(static_cast<size_t>(B * T * kRow), gen, -2.f, 2.f);
  auto v = randVec(static_cast<size_t>(B * T * kRow), gen);
  std::vector<float> want(q.size());
  rt::attentionForward(q.data(), k.data(), v.data(), want.data(),
                       static_cast<float *>(nullptr), B, T, H, Hkv, D,
                       /*causal=*/true);

  std::vector<float> kCache(static_cast<size_t>(B * Tmax * kRow), 0.f),
      vCache(kCache.size(), 0.f), got(q.size());
  for (int64_t start = 0; start < T; start += chunk) {
    const int64_t S = std::min(chunk, T - start);
    std::vector<float> qc(static_cast<size_t>(B * S * qRow)),
        kc(static_cast<size_t>(B * S * kRow)), vc(kc.size()), out(qc.size());
    std::vector<int32_t> positions(static_cast<size_t>(B * S));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s) {
        const int64_t token = b * T + start + s, at = b * S + s;
        positions[size_t(at)] = int32_t(start + s);
        std::copy_n(q.begin() + token * qRow, qRow, qc.begin() + at * qRow);
        std::copy_n(k.begin() + token * kRow, kRow, kc.begin() + at * kRow);
        std::copy_n(v.begin() + token * kRow, kRow, vc.begin() + at * kRow);
      }
    rt::cachedAttention(qc.data(), kc.data(), vc.data(), kCache.data(),
                        vCache.data(), positions.data(), out.data(), B, S, Tmax,
                        H, Hkv, D);
    for (int64_t b = 0; b < B; ++b)
      std::copy_n(out.begin() + b * S * qRow, S * qRow,
                  got.begin() + (b * T + start) * qRow);
  }
  const std::string tag =
      " B=" + std::to_string(B) + " T=" + std::to_string(T) +
      " Tmax=" + std::to_string(Tmax) + " chunk=" + std::to_string(chunk);
  expectClose(got, want, "cachedAttention" + tag);

  std::vector<float> wantK(kCache.size(), 0.f), wantV(vCache.size(), 0.f);
  for (int64_t b = 0; b < B; ++b) {
    std::copy_n(k.begin() + b * T * kRow, T * kRow,
                wantK.begin() + b * Tmax * kRow);
    std::copy_n(v.begin() + b * T * kRow, T * kRow,
                wantV.begin() + b * Tmax * kRow);
  }
  EXPECT_EQ(kCache, wantK) << "key cache" << tag;
  EXPECT_EQ(vCache, wantV) << "value cache" << tag;
}
} // namespace

TEST(KernelAttention, CachedMatchesFullSequence) {
  std::mt19937 gen(14);
  for (int64_t chunk : {int64_t(1), int64_t(3)}) {
    runCachedAttention(2, 7, 7, 4, 2, 6, chunk, gen);    // GQA, cache full
    runCachedAttention(2, 7, 10, 4, 2, 6, chunk, gen);   // room left over
    runCachedAttention(1, 5, 8, 3, 3, 5, chunk, gen);    // MHA
    runCachedAttention(2, 40, 64, 8, 2, 32, chunk, gen); // multi-threaded
  }
}

// ------------------------------------------------- softmax, cross-entropy

TEST(KernelSoftmax, MatchesReference) {
  std::mt19937 gen(12);
  for (auto [rows, cols] :
       std::vector<std::pair<int64_t, int64_t>>{{7, 13}, {1, 1}, {64, 300}}) {
    auto x = randVec(static_cast<size_t>(rows * cols), gen, -5.f, 5.f);
    auto dy = randVec(static_cast<size_t>(rows * cols), gen);
    std::vector<float> y(static_cast<size_t>(rows * cols)),
        ry(static_cast<size_t>(rows * cols));
    rt::softmaxForward(x.data(), y.data(), rows, cols);
    rt::ref::softmaxForward(x.data(), ry.data(), rows, cols);
    expectClose(y, ry, "softmaxForward");
    std::vector<float> dx(static_cast<size_t>(rows * cols)),
        rdx(static_cast<size_t>(rows * cols));
    rt::softmaxBackward(ry.data(), dy.data(), dx.data(), rows, cols);
    rt::ref::softmaxBackward(ry.data(), dy.data(), rdx.data(), rows, cols);
    expectClose(dx, rdx, "softmaxBackward");
  }
  // Scaled and causal (an attention's scores; two heads' query rows
  // stacked over 5 keys, so row r sees keys 0 .. r mod 5).
  for (auto [rows, cols] :
       std::vector<std::pair<int64_t, int64_t>>{{5, 5}, {10, 5}, {64, 64}}) {
    const size_t n = static_cast<size_t>(rows * cols);
    auto x = randVec(n, gen, -5.f, 5.f), dy = randVec(n, gen);
    std::vector<float> y(n), ry(n), dx(n), rdx(n);
    rt::softmaxForward(x.data(), y.data(), rows, cols, 0.25, true);
    rt::ref::softmaxForward(x.data(), ry.data(), rows, cols, 0.25, true);
    expectClose(y, ry, "causal softmaxForward");
    for (int64_t r = 0; r < rows; ++r) {
      double sum = 0;
      for (int64_t j = 0; j < cols; ++j) {
        if (j > r % cols)
          EXPECT_EQ(y[r * cols + j], 0.f) << "row " << r << " column " << j;
        sum += y[r * cols + j];
      }
      EXPECT_NEAR(sum, 1.0, 1e-5) << "row " << r;
    }
    rt::softmaxBackward(ry.data(), dy.data(), dx.data(), rows, cols, 0.25);
    rt::ref::softmaxBackward(ry.data(), dy.data(), rdx.data(), rows, cols,
                             0.25);
    expectClose(dx, rdx, "scaled softmaxBackward");
  }
  // Large logits do not overflow.
  std::vector<float> x = {1000.f, 1001.f, 999.f}, y(3);
  rt::softmaxForward(x.data(), y.data(), 1, 3);
  for (float v : y)
    EXPECT_TRUE(std::isfinite(v));
  EXPECT_NEAR(y[1], 0.66524096f, 1e-6);
}

// ------------------------------------------------------------- dropout

// Dropout of a [4, 6, 5] tensor at step `step`, as one piece or as the
// pieces of `microbatches` microbatches (one rank: no mesh axis splits it).
std::vector<float> dropoutOf(const std::vector<float> &x, double p,
                             int64_t step, int64_t microbatches,
                             int64_t site = 3) {
  rt::setRunningStep(step, false);
  const int64_t axes[3] = {0, 0, 0};
  const int64_t rows = 4 / microbatches;
  const int64_t shape[3] = {rows, 6, 5};
  std::vector<float> out(x.size());
  for (int64_t m = 0; m < microbatches; ++m)
    rt::dropout(x.data() + m * rows * 30, out.data() + m * rows * 30, m,
                shape, axes, 3, microbatches, p, 1234, site);
  return out;
}

TEST(KernelDropout, MasksFollowGlobalPlaces) {
  std::mt19937 gen(21);
  auto x = randVec(120, gen, 0.5f, 2.f); // no zeros: a zero out is a drop
  auto whole = dropoutOf(x, 0.3, 7, 1);
  // Kept elements are scaled by 1 / (1 - p), the others zero.
  int64_t kept = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (whole[i] != 0.f) {
      EXPECT_FLOAT_EQ(whole[i], x[i] * float(1.0 / 0.7));
      ++kept;
    }
  }
  EXPECT_GT(kept, 60);
  EXPECT_LT(kept, 108);
  // Microbatches draw what the whole batch draws; so do the gradient (the
  // same op on dy) and a recomputed forward: the mask is a function of the
  // place, not of a generator's state.
  EXPECT_EQ(dropoutOf(x, 0.3, 7, 2), whole);
  EXPECT_EQ(dropoutOf(x, 0.3, 7, 4), whole);
  EXPECT_EQ(dropoutOf(x, 0.3, 7, 1), whole);
  // Another step or another site draws another mask.
  EXPECT_NE(dropoutOf(x, 0.3, 8, 1), whole);
  EXPECT_NE(dropoutOf(x, 0.3, 7, 1, 4), whole);
  // An evaluation copies.
  rt::setRunningStep(7, true);
  const int64_t axes[3] = {0, 0, 0}, shape[3] = {4, 6, 5};
  std::vector<float> out(x.size());
  rt::dropout(x.data(), out.data(), 0, shape, axes, 3, 1, 0.3, 1234, 3);
  EXPECT_EQ(out, x);
  rt::setRunningStep(0, false);
}

// A sequence held in the balanced order of context parallelism (dimension
// 1 reordered by graph.zigzag) draws each element's mask at its position in
// the sequence: the reordered whole-sequence mask.
TEST(KernelDropout, BalancedOrderDrawsTheSequencesMasks) {
  std::mt19937 gen(23);
  const int64_t shape[3] = {4, 8, 5}, axes[3] = {0, 0, 0};
  auto x = randVec(160, gen, 0.5f, 2.f);
  rt::setRunningStep(3, false);
  std::vector<float> whole(x.size()), z(x.size()), got(x.size()),
      want(x.size());
  rt::dropout(x.data(), whole.data(), 0, shape, axes, 3, 1, 0.4, 1234, 5);
  rt::zigzag(x.data(), z.data(), 4, 8, 5, 2, false);
  rt::dropout(z.data(), got.data(), 0, shape, axes, 3, 1, 0.4, 1234, 5, 2);
  rt::zigzag(whole.data(), want.data(), 4, 8, 5, 2, false);
  EXPECT_EQ(got, want);
  EXPECT_NE(want, whole); // the reordering moved some kept elements
  rt::setRunningStep(0, false);
}

TEST(KernelDropout, KeepsOneMinusPOnAverage) {
  const int64_t n = 1 << 18;
  std::vector<float> x(n, 1.f), out(n);
  const int64_t axes[1] = {0}, shape[1] = {n};
  for (double p : {0.1, 0.5, 0.9}) {
    rt::setRunningStep(3, false);
    rt::dropout(x.data(), out.data(), 0, shape, axes, 1, 1, p, 99, 0);
    double kept = std::count_if(out.begin(), out.end(),
                                [](float v) { return v != 0.f; });
    // Binomial: 5 standard deviations of n p (1 - p) is below 0.005 n.
    EXPECT_NEAR(kept / n, 1 - p, 0.005) << "p = " << p;
  }
  rt::setRunningStep(0, false);
}

TEST(KernelCrossEntropy, MatchesReference) {
  std::mt19937 gen(13);
  for (auto [rows, V] :
       std::vector<std::pair<int64_t, int64_t>>{{7, 11}, {1, 2}, {64, 500}}) {
    auto logits = randVec(static_cast<size_t>(rows * V), gen, -4.f, 4.f);
    auto targets = randIds(static_cast<size_t>(rows), int32_t(V), gen);
    float loss = 0, rloss = 0;
    rt::crossEntropyForward(logits.data(), targets.data(), &loss, rows, V, V);
    rt::ref::crossEntropyForward(logits.data(), targets.data(), &rloss, rows,
                                 V);
    EXPECT_NEAR(loss, rloss, 1e-5 * std::fabs(rloss));
    const float dloss = 0.7f;
    std::vector<float> d(static_cast<size_t>(rows * V)),
        rd(static_cast<size_t>(rows * V));
    rt::crossEntropyBackward(logits.data(), targets.data(), &dloss, d.data(),
                             rows, V, V);
    rt::ref::crossEntropyBackward(logits.data(), targets.data(), &dloss,
                                  rd.data(), rows, V);
    expectClose(d, rd, "crossEntropyBackward");
  }
  // Uniform logits: loss = log V; stable for huge logits.
  std::vector<float> logits(8, 3000.f);
  std::vector<int32_t> targets = {1, 3};
  float loss = 0;
  rt::crossEntropyForward(logits.data(), targets.data(), &loss, 2, 4, 4);
  EXPECT_NEAR(loss, std::log(4.0), 1e-6);
}

// A padded vocabulary: rows of 13 columns whose first 11 are the vocabulary
// give the loss and gradient of the 11 columns alone (the padding's large
// logits take no part), and a zero gradient in the padding.
TEST(KernelCrossEntropy, PaddedColumnsTakeNoPart) {
  std::mt19937 gen(15);
  const int64_t rows = 9, V = 11, Vp = 13;
  auto logits = randVec(static_cast<size_t>(rows * V), gen, -4.f, 4.f);
  auto targets = randIds(static_cast<size_t>(rows), int32_t(V), gen);
  std::vector<float> padded(static_cast<size_t>(rows * Vp), 50.f);
  for (int64_t r = 0; r < rows; ++r)
    std::copy(logits.begin() + r * V, logits.begin() + (r + 1) * V,
              padded.begin() + r * Vp);
  float loss = 0, want = 0;
  rt::crossEntropyForward(padded.data(), targets.data(), &loss, rows, Vp, V);
  rt::crossEntropyForward(logits.data(), targets.data(), &want, rows, V, V);
  EXPECT_EQ(loss, want);
  const float dloss = 0.7f;
  std::vector<float> d(static_cast<size_t>(rows * Vp), 1.f),
      dw(static_cast<size_t>(rows * V));
  rt::crossEntropyBackward(padded.data(), targets.data(), &dloss, d.data(),
                           rows, Vp, V);
  rt::crossEntropyBackward(logits.data(), targets.data(), &dloss, dw.data(),
                           rows, V, V);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < Vp; ++j)
      EXPECT_EQ(d[size_t(r * Vp + j)], j < V ? dw[size_t(r * V + j)] : 0.f)
          << "row " << r << " column " << j;
}

// -------------------------------------------------------------- embedding

TEST(KernelEmbedding, MatchesReference) {
  std::mt19937 gen(14);
  for (auto [n, V, C] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {17, 11, 13}, {1, 1, 1}, {512, 300, 64}}) {
    auto table = randVec(static_cast<size_t>(V * C), gen);
    auto ids = randIds(static_cast<size_t>(n), int32_t(V), gen);
    auto dout = randVec(static_cast<size_t>(n * C), gen);
    std::vector<float> out(static_cast<size_t>(n * C)),
        rout(static_cast<size_t>(n * C));
    rt::embeddingForward(table.data(), ids.data(), out.data(), n, V, C);
    rt::ref::embeddingForward(table.data(), ids.data(), rout.data(), n, V, C);
    EXPECT_EQ(out, rout);
    std::vector<float> dt(static_cast<size_t>(V * C), 42.f),
        rdt(static_cast<size_t>(V * C));
    rt::embeddingBackward(ids.data(), dout.data(), dt.data(), n, V, C);
    rt::ref::embeddingBackward(ids.data(), dout.data(), rdt.data(), n, V, C);
    expectClose(dt, rdt, "embeddingBackward");
  }
}

// The table's gradient summed over microbatches in place: the first run
// zeroes the table (whatever it held) and scatters, each later one adds
// its rows; the sum equals the microbatches' gradients added up. The range
// form (a vocabulary-parallel piece) likewise.
TEST(KernelEmbedding, AccumulateOverMicrobatches) {
  std::mt19937 gen(24);
  const int64_t n = 40, V = 23, C = 9, vStart = 5, Vl = 12;
  std::vector<float> got(V * C, 42.f), want(V * C, 0.f);
  std::vector<float> gotRange(Vl * C, 42.f), wantRange(Vl * C, 0.f);
  for (int run = 0; run < 3; ++run) {
    auto ids = randIds(static_cast<size_t>(n), int32_t(V), gen);
    auto dout = randVec(static_cast<size_t>(n * C), gen);
    rt::embeddingBackwardAccumulate(ids.data(), dout.data(), got.data(),
                                    run == 0, n, V, C);
    rt::embeddingBackwardRangeAccumulate(
        ids.data(), dout.data(), gotRange.data(), run == 0, n, vStart, Vl, C);
    std::vector<float> one(V * C);
    rt::ref::embeddingBackward(ids.data(), dout.data(), one.data(), n, V, C);
    for (int64_t i = 0; i < V * C; ++i)
      want[i] += one[i];
    for (int64_t i = 0; i < Vl * C; ++i)
      wantRange[i] += one[vStart * C + i];
  }
  expectClose(got, want, "embeddingBackwardAccumulate");
  expectClose(gotRange, wantRange, "embeddingBackwardRangeAccumulate");
}

// ----------------------------------------------------------------- layout

TEST(KernelLayout, TransposeAllPermutationsRank4) {
  std::mt19937 gen(15);
  const int64_t shape[4] = {2, 3, 4, 5};
  auto x = randVec(120, gen);
  int64_t perm[4] = {0, 1, 2, 3};
  do {
    std::vector<float> got(120), want(120);
    rt::transpose(x.data(), got.data(), shape, perm, 4);
    rt::ref::transpose(x.data(), want.data(), shape, perm, 4);
    EXPECT_EQ(got, want) << "perm " << perm[0] << perm[1] << perm[2] << perm[3];
  } while (std::next_permutation(perm, perm + 4));
}

TEST(KernelLayout, TransposeShapes) {
  std::mt19937 gen(16);
  struct Case {
    std::vector<int64_t> shape, perm;
  };
  const std::vector<Case> cases = {
      {{37, 45}, {1, 0}},                 // tiled matrix transpose
      {{300, 257}, {1, 0}},               // multi-threaded tiled
      {{3, 70, 65}, {0, 2, 1}},           // batched matrix transpose
      {{4, 1, 6, 1, 5}, {4, 2, 0, 1, 3}}, // size-1 dims
      {{2, 33, 4, 16}, {0, 2, 1, 3}},     // [B,T,H,D] -> [B,H,T,D]
      {{6, 7, 8}, {2, 0, 1}},             // strided innermost gather
      {{64, 48, 40}, {1, 2, 0}},          // same, multi-threaded
      {{5}, {0}},
      {{3, 4}, {0, 1}}};
  for (const Case &c : cases) {
    int64_t n = 1;
    for (int64_t s : c.shape)
      n *= s;
    auto x = randVec(static_cast<size_t>(n), gen);
    std::vector<float> got(static_cast<size_t>(n)),
        want(static_cast<size_t>(n));
    rt::transpose(x.data(), got.data(), c.shape.data(), c.perm.data(),
                  int(c.shape.size()));
    rt::ref::transpose(x.data(), want.data(), c.shape.data(), c.perm.data(),
                       int(c.shape.size()));
    EXPECT_EQ(got, want) << "rank " << c.shape.size() << " n=" << n;
  }
}

TEST(KernelLayout, SliceAndInsert) {
  std::mt19937 gen(17);
  for (auto [outer, axis, inner, start, len] :
       std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>>{
           {3, 7, 5, 2, 4},
           {1, 9, 1, 0, 9},
           {5, 4, 3, 3, 1},
           {64, 12, 128, 4, 4}}) {
    auto x = randVec(static_cast<size_t>(outer * axis * inner), gen);
    std::vector<float> got(static_cast<size_t>(outer * len * inner)),
        want(static_cast<size_t>(outer * len * inner));
    rt::sliceAxis(x.data(), got.data(), outer, axis, inner, start, len);
    rt::ref::sliceAxis(x.data(), want.data(), outer, axis, inner, start, len);
    EXPECT_EQ(got, want);
    // insertAxis writes only the slice; the rest of out is left alone.
    auto base = randVec(static_cast<size_t>(outer * axis * inner), gen);
    auto ins = base, rins = base;
    rt::insertAxis(got.data(), ins.data(), outer, axis, inner, start, len);
    rt::ref::insertAxis(got.data(), rins.data(), outer, axis, inner, start,
                        len);
    EXPECT_EQ(ins, rins);
  }
}

TEST(KernelElementwise, ExtremeInputs) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float x[] = {-100.f, -20.f, 20.f, 100.f, nan};
  float out[5];
  rt::siluForward(x, out, 5);
  EXPECT_NEAR(out[0], 0.f, 1e-30);
  EXPECT_NEAR(out[1], -20.0 / (1.0 + std::exp(20.0)), 1e-12);
  EXPECT_FLOAT_EQ(out[2], 20.f);
  EXPECT_FLOAT_EQ(out[3], 100.f);
  EXPECT_TRUE(std::isnan(out[4]));
  rt::geluForward(x, out, 5);
  EXPECT_NEAR(out[0], 0.f, 1e-30);
  EXPECT_NEAR(out[1], 0.f, 1e-30);
  EXPECT_FLOAT_EQ(out[2], 20.f);
  EXPECT_FLOAT_EQ(out[3], 100.f);
  EXPECT_TRUE(std::isnan(out[4]));
  // Masked (-inf) logits get probability 0; a NaN poisons its row only.
  const float s[] = {0.f, -inf, std::log(3.f), -200.f, 1.f, nan, 2.f, 0.f};
  float p[8];
  rt::softmaxForward(s, p, 2, 4);
  EXPECT_FLOAT_EQ(p[0], 0.25f);
  EXPECT_EQ(p[1], 0.f);
  EXPECT_FLOAT_EQ(p[2], 0.75f);
  EXPECT_EQ(p[3], 0.f);
  for (int i = 4; i < 8; ++i)
    EXPECT_TRUE(std::isnan(p[i]));
}

// -------------------------------------------------- context parallelism
//
// Under context parallelism a rank holds a piece of each sequence: its
// queries attend over all keys from their own positions, and its tokens are
// rotated at their own positions. Each piece must compute exactly the rows
// of the whole sequence's result, so that every layout trains as one rank.

namespace {

// The rows of the sequence dimension of [B, T, inner] at positions
// position(0 .. rows - 1).
template <typename Position>
std::vector<float> rowsAt(const std::vector<float> &x, int64_t B, int64_t T,
                          int64_t inner, int64_t rows, Position position) {
  std::vector<float> piece(size_t(B * rows * inner));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t i = 0; i < inner; ++i)
        piece[size_t((b * rows + t) * inner + i)] =
            x[size_t((b * T + position(t)) * inner + i)];
  return piece;
}
// Rows [first, first + rows) of the sequence dimension of [B, T, inner].
std::vector<float> rowsOf(const std::vector<float> &x, int64_t B, int64_t T,
                          int64_t inner, int64_t first, int64_t rows) {
  return rowsAt(x, B, T, inner, rows,
                [first](int64_t t) { return first + t; });
}

// The same for the last dimension of [B, H, T] (the log-sum-exp).
template <typename Position>
std::vector<float> lastRowsAt(const std::vector<float> &x, int64_t BH,
                              int64_t T, int64_t rows, Position position) {
  std::vector<float> piece(size_t(BH * rows));
  for (int64_t r = 0; r < BH; ++r)
    for (int64_t t = 0; t < rows; ++t)
      piece[size_t(r * rows + t)] = x[size_t(r * T + position(t))];
  return piece;
}

// Splits the queries of one attention into `pieces` pieces along the
// sequence, contiguous or balanced (chunks c and 2 pieces - 1 - c, the
// queries in that order); each piece's output, log-sum-exp and query
// gradient are the whole attention's rows bit for bit (the same row
// computation), and the key and value gradients of the pieces add up to
// the whole's.
void checkPieces(int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                 bool causal, int64_t pieces, std::mt19937 &gen,
                 bool balanced = false) {
  const std::string tag = " (T=" + std::to_string(T) + " H=" +
                          std::to_string(H) + " Hkv=" + std::to_string(Hkv) +
                          " pieces=" + std::to_string(pieces) +
                          (balanced ? " balanced" : "") +
                          (causal ? " causal)" : ")");
  const int64_t zigzag = balanced ? pieces : 0;
  const int64_t nq = B * T * H * D, nk = B * T * Hkv * D;
  std::vector<float> q = randVec(size_t(nq), gen), k = randVec(size_t(nk), gen),
                     v = randVec(size_t(nk), gen),
                     dout = randVec(size_t(nq), gen);
  std::vector<float> out(static_cast<size_t>(nq)),
      lse(static_cast<size_t>(B * H * T)), dq(static_cast<size_t>(nq)),
      dk(static_cast<size_t>(nk)), dv(static_cast<size_t>(nk));
  rt::attentionForward(q.data(), k.data(), v.data(), out.data(), lse.data(), B,
                       T, H, Hkv, D, causal);
  rt::attentionBackward(q.data(), k.data(), v.data(), out.data(), lse.data(),
                        dout.data(), dq.data(), dk.data(), dv.data(), B, T, H,
                        Hkv, D, causal);

  const int64_t Tc = T / pieces;
  std::vector<float> dkSum(static_cast<size_t>(nk), 0.f),
      dvSum(static_cast<size_t>(nk), 0.f);
  for (int64_t r = 0; r < pieces; ++r) {
    const int64_t first = r * Tc;
    auto position = [&](int64_t t) {
      return rt::zigzagPosition(first + t, T, zigzag);
    };
    std::vector<float> qp = rowsAt(q, B, T, H * D, Tc, position);
    std::vector<float> dop = rowsAt(dout, B, T, H * D, Tc, position);
    std::vector<float> op(qp.size()), lsep(static_cast<size_t>(B * H * Tc)),
        dqp(qp.size()), dkp(static_cast<size_t>(nk)),
        dvp(static_cast<size_t>(nk));
    rt::attentionForward(qp.data(), k.data(), v.data(), op.data(), lsep.data(),
                         B, Tc, H, Hkv, D, causal, T, first, zigzag);
    EXPECT_EQ(op, rowsAt(out, B, T, H * D, Tc, position)) << "out" << tag;
    EXPECT_EQ(lsep, lastRowsAt(lse, B * H, T, Tc, position)) << "lse" << tag;
    rt::attentionBackward(qp.data(), k.data(), v.data(), op.data(),
                          lsep.data(), dop.data(), dqp.data(), dkp.data(),
                          dvp.data(), B, Tc, H, Hkv, D, causal, T, first,
                          zigzag);
    EXPECT_EQ(dqp, rowsAt(dq, B, T, H * D, Tc, position)) << "dq" << tag;
    for (int64_t i = 0; i < nk; ++i) {
      dkSum[size_t(i)] += dkp[size_t(i)];
      dvSum[size_t(i)] += dvp[size_t(i)];
    }
  }
  expectClose(dkSum, dk, "dk" + tag);
  expectClose(dvSum, dv, "dv" + tag);
}

} // namespace

TEST(KernelAttention, QueryPiecesMatchTheWholeSequence) {
  std::mt19937 gen(29);
  for (bool causal : {true, false}) {
    checkPieces(2, 8, 4, 2, 6, causal, 2, gen);   // GQA
    checkPieces(2, 8, 4, 4, 6, causal, 4, gen);   // MHA
    checkPieces(1, 12, 3, 1, 5, causal, 3, gen);  // MQA
    checkPieces(2, 64, 4, 2, 16, causal, 2, gen); // multi-threaded
    checkPieces(2, 16, 4, 2, 6, causal, 2, gen, /*balanced=*/true);
    checkPieces(1, 24, 3, 1, 5, causal, 3, gen, /*balanced=*/true);
    checkPieces(2, 64, 4, 2, 16, causal, 4, gen, /*balanced=*/true);
  }
}

TEST(KernelAttention, RefusesQueriesOutsideTheKeys) {
  std::vector<float> x(2 * 8 * 2 * 4), lse(2 * 2 * 8);
  // Rows 12..19 of 16 keys.
  EXPECT_THROW(rt::attentionForward(x.data(), x.data(), x.data(), x.data(),
                                    lse.data(), 1, 8, 2, 2, 4, true, 16, 12),
               std::runtime_error);
  EXPECT_THROW(rt::attentionBackward(x.data(), x.data(), x.data(), x.data(),
                                     lse.data(), x.data(), x.data(), x.data(),
                                     x.data(), 1, 8, 2, 2, 4, true, 16, -1),
               std::runtime_error);
}

// A piece of the sequence rotated from its first position is the whole
// sequence's rotation of those rows, bit for bit.
TEST(KernelRope, PiecesMatchTheWholeSequence) {
  std::mt19937 gen(31);
  const int64_t B = 2, T = 12, H = 3;
  for (int64_t D : {8, 7})
    for (bool inverse : {false, true})
      for (int64_t pieces : {2, 3, 4}) {
        std::vector<float> x = randVec(size_t(B * T * H * D), gen);
        std::vector<float> whole(x.size());
        rt::rope(x.data(), whole.data(), B, T, H, D, 10000.0, inverse);
        const int64_t Tc = T / pieces;
        for (int64_t r = 0; r < pieces; ++r) {
          std::vector<float> piece = rowsOf(x, B, T, H * D, r * Tc, Tc);
          std::vector<float> got(piece.size());
          rt::rope(piece.data(), got.data(), B, Tc, H, D, 10000.0, inverse,
                   r * Tc);
          EXPECT_EQ(got, rowsOf(whole, B, T, H * D, r * Tc, Tc))
              << "D=" << D << " piece " << r << " of " << pieces;
          // In the balanced order: chunks r and 2 pieces - 1 - r.
          auto position = [&](int64_t t) {
            return rt::zigzagPosition(r * Tc + t, T, pieces);
          };
          std::vector<float> balanced = rowsAt(x, B, T, H * D, Tc, position);
          rt::rope(balanced.data(), got.data(), B, Tc, H, D, 10000.0, inverse,
                   r * Tc, pieces, T);
          EXPECT_EQ(got, rowsAt(whole, B, T, H * D, Tc, position))
              << "D=" << D << " balanced piece " << r << " of " << pieces;
        }
      }
}

// The balanced order of n pieces: chunk k of the order is chunk k / 2 or
// 2n - 1 - k / 2 of the sequence; graph.zigzag reorders and puts back.
TEST(KernelZigzag, BalancedOrderAndBack) {
  EXPECT_EQ(rt::zigzagPosition(0, 8, 2), 0);
  EXPECT_EQ(rt::zigzagPosition(2, 8, 2), 6); // chunk 1 -> chunk 3
  EXPECT_EQ(rt::zigzagPosition(4, 8, 2), 2); // chunk 2 -> chunk 1
  EXPECT_EQ(rt::zigzagPosition(7, 8, 2), 5); // chunk 3 -> chunk 2
  EXPECT_EQ(rt::zigzagPosition(5, 8, 0), 5); // no reordering
  std::mt19937 gen(37);
  const int64_t outer = 3, len = 12, inner = 5;
  std::vector<float> x = randVec(size_t(outer * len * inner), gen);
  std::vector<float> z(x.size()), back(x.size());
  rt::zigzag(x.data(), z.data(), outer, len, inner, 3, false);
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t t = 0; t < len; ++t)
      for (int64_t i = 0; i < inner; ++i)
        ASSERT_EQ(z[size_t((o * len + t) * inner + i)],
                  x[size_t((o * len + rt::zigzagPosition(t, len, 3)) * inner +
                           i)]);
  rt::zigzag(z.data(), back.data(), outer, len, inner, 3, true);
  EXPECT_EQ(back, x);
  EXPECT_THROW(rt::zigzag(x.data(), z.data(), outer, len, inner, 4, false),
               std::invalid_argument);
}
