//===- KernelsGradTest.cpp - Finite-difference gradient checks ------------===//
//
// For each kernel with a backward pass, in double: the analytic gradient of
// L(x) = sum(r * f(x)) for a random projection r must match central finite
// differences with h = 1e-6 to within 1e-6 (relative, with an absolute floor
// of 1e-6).
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Kernels.h"

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
using Fn = tessel::testing::Fn;

namespace {

constexpr double kTol = 1e-6;

void checkGrad(const std::string &what, const Fn &f, const Vec &x, const Vec &r,
               const Vec &analytic) {
  ASSERT_EQ(f(x).size(), r.size()) << what;
  EXPECT_LT(gradError(f, x, r, analytic), kTol) << what;
}

} // namespace

TEST(KernelGradCheck, DetectsWrongGradient) {
  // The checker itself must fail on a slightly wrong gradient.
  std::mt19937 gen(100);
  const int64_t n = 9;
  Vec x = randVec(n, gen, -3, 3), r = randVec(n, gen);
  Fn f = [&](const Vec &in) {
    Vec out(n);
    rt::geluForward(in.data(), out.data(), n);
    return out;
  };
  Vec g(n);
  rt::geluBackward(x.data(), r.data(), g.data(), n);
  EXPECT_LT(gradError(f, x, r, g), kTol);
  g[4] *= 1.0001;
  g[4] += 1e-5;
  EXPECT_GT(gradError(f, x, r, g), kTol);
}

TEST(KernelGradCheck, GeluSilu) {
  std::mt19937 gen(101);
  const int64_t n = 23;
  Vec x = randVec(n, gen, -4, 4), r = randVec(n, gen);
  Vec g(n);
  rt::geluBackward(x.data(), r.data(), g.data(), n);
  checkGrad(
      "gelu",
      [&](const Vec &in) {
        Vec out(n);
        rt::geluForward(in.data(), out.data(), n);
        return out;
      },
      x, r, g);
  rt::siluBackward(x.data(), r.data(), g.data(), n);
  checkGrad(
      "silu",
      [&](const Vec &in) {
        Vec out(n);
        rt::siluForward(in.data(), out.data(), n);
        return out;
      },
      x, r, g);
}

TEST(KernelGradCheck, LayerNorm) {
  std::mt19937 gen(102);
  const int64_t rows = 7, C = 13, n = rows * C;
  const double eps = 1e-5;
  Vec x = randVec(n, gen, -2, 3), w = randVec(C, gen), b = randVec(C, gen);
  Vec r = randVec(n, gen);
  Vec dx(n), dw(C), db(C);
  rt::layerNormBackward(x.data(), w.data(), r.data(), dx.data(), dw.data(),
                        db.data(), rows, C, eps);
  auto fwd = [&](const Vec &xx, const Vec &ww, const Vec &bb) {
    Vec out(n);
    rt::layerNormForward(xx.data(), ww.data(), bb.data(), out.data(), rows, C,
                         eps);
    return out;
  };
  checkGrad(
      "layerNorm dx", [&](const Vec &in) { return fwd(in, w, b); }, x, r, dx);
  checkGrad(
      "layerNorm dw", [&](const Vec &in) { return fwd(x, in, b); }, w, r, dw);
  checkGrad(
      "layerNorm db", [&](const Vec &in) { return fwd(x, w, in); }, b, r, db);
}

TEST(KernelGradCheck, RMSNorm) {
  std::mt19937 gen(103);
  const int64_t rows = 7, C = 13, n = rows * C;
  const double eps = 1e-6;
  Vec x = randVec(n, gen, -2, 3), w = randVec(C, gen), r = randVec(n, gen);
  Vec dx(n), dw(C);
  rt::rmsNormBackward(x.data(), w.data(), r.data(), dx.data(), dw.data(), rows,
                      C, eps);
  auto fwd = [&](const Vec &xx, const Vec &ww) {
    Vec out(n);
    rt::rmsNormForward(xx.data(), ww.data(), out.data(), rows, C, eps);
    return out;
  };
  checkGrad(
      "rmsNorm dx", [&](const Vec &in) { return fwd(in, w); }, x, r, dx);
  checkGrad(
      "rmsNorm dw", [&](const Vec &in) { return fwd(x, in); }, w, r, dw);
}

TEST(KernelGradCheck, RopeInverseIsAdjoint) {
  std::mt19937 gen(104);
  for (int64_t D : {int64_t(6), int64_t(7)}) {
    const int64_t B = 2, T = 5, H = 3, n = B * T * H * D;
    Vec x = randVec(n, gen), r = randVec(n, gen), g(n);
    rt::rope(r.data(), g.data(), B, T, H, D, 500.0, /*inverse=*/true);
    checkGrad(
        "rope D=" + std::to_string(D),
        [&](const Vec &in) {
          Vec out(n);
          rt::rope(in.data(), out.data(), B, T, H, D, 500.0, false);
          return out;
        },
        x, r, g);
  }
}

namespace {
void attentionGrad(int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                   bool causal, std::mt19937 &gen) {
  const int64_t nq = B * T * H * D, nk = B * T * Hkv * D;
  Vec q = randVec(nq, gen, -1.5, 1.5), k = randVec(nk, gen, -1.5, 1.5);
  Vec v = randVec(nk, gen), r = randVec(nq, gen);
  Vec dq(nq), dk(nk), dv(nk), o(nq), lse(B * H * T);
  rt::attentionForward(q.data(), k.data(), v.data(), o.data(), lse.data(), B,
                       T, H, Hkv, D, causal);
  rt::attentionBackward(q.data(), k.data(), v.data(), o.data(), lse.data(),
                        r.data(), dq.data(), dk.data(), dv.data(), B, T, H,
                        Hkv, D, causal);
  auto fwd = [&](const Vec &qq, const Vec &kk, const Vec &vv) {
    Vec out(nq);
    rt::attentionForward(qq.data(), kk.data(), vv.data(), out.data(),
                         static_cast<double *>(nullptr), B, T, H, Hkv, D,
                         causal);
    return out;
  };
  const std::string tag = " H=" + std::to_string(H) +
                          " Hkv=" + std::to_string(Hkv) +
                          " causal=" + std::to_string(causal);
  checkGrad(
      "attention dq" + tag, [&](const Vec &in) { return fwd(in, k, v); }, q, r,
      dq);
  checkGrad(
      "attention dk" + tag, [&](const Vec &in) { return fwd(q, in, v); }, k, r,
      dk);
  checkGrad(
      "attention dv" + tag, [&](const Vec &in) { return fwd(q, k, in); }, v, r,
      dv);
}
} // namespace

TEST(KernelGradCheck, Attention) {
  std::mt19937 gen(105);
  for (bool causal : {true, false}) {
    attentionGrad(2, 5, 4, 2, 6, causal, gen); // GQA
    attentionGrad(1, 4, 3, 3, 5, causal, gen); // MHA
    attentionGrad(1, 4, 2, 1, 3, causal, gen); // MQA
  }
}

TEST(KernelGradCheck, Softmax) {
  std::mt19937 gen(106);
  const int64_t rows = 7, cols = 13, n = rows * cols;
  Vec x = randVec(n, gen, -3, 3), r = randVec(n, gen), y(n), g(n);
  rt::softmaxForward(x.data(), y.data(), rows, cols);
  rt::softmaxBackward(y.data(), r.data(), g.data(), rows, cols);
  checkGrad(
      "softmax",
      [&](const Vec &in) {
        Vec out(n);
        rt::softmaxForward(in.data(), out.data(), rows, cols);
        return out;
      },
      x, r, g);
}

// The attention's probabilities when its scores are materialised: scaled,
// causal, two heads' query rows stacked over the same keys.
TEST(KernelGradCheck, ScaledCausalSoftmax) {
  std::mt19937 gen(108);
  const int64_t rows = 12, cols = 6, n = rows * cols;
  const double scale = 0.4;
  Vec x = randVec(n, gen, -3, 3), r = randVec(n, gen), y(n), g(n);
  rt::softmaxForward(x.data(), y.data(), rows, cols, scale, true);
  rt::softmaxBackward(y.data(), r.data(), g.data(), rows, cols, scale);
  checkGrad(
      "scaled causal softmax",
      [&](const Vec &in) {
        Vec out(n);
        rt::softmaxForward(in.data(), out.data(), rows, cols, scale, true);
        return out;
      },
      x, r, g);
}

TEST(KernelGradCheck, CrossEntropy) {
  std::mt19937 gen(107);
  const int64_t rows = 7, V = 11, n = rows * V;
  Vec logits = randVec(n, gen, -3, 3);
  std::vector<int32_t> targets = {0, 10, 3, 3, 7, 1, 5};
  Vec r = {0.83}, g(n);
  rt::crossEntropyBackward(logits.data(), targets.data(), r.data(), g.data(),
                           rows, V, V);
  checkGrad(
      "crossEntropy",
      [&](const Vec &in) {
        Vec loss(1);
        rt::crossEntropyForward(in.data(), targets.data(), loss.data(), rows,
                                V, V);
        return loss;
      },
      logits, r, g);
}

TEST(KernelGradCheck, Embedding) {
  std::mt19937 gen(108);
  const int64_t n = 9, V = 11, C = 5;
  std::vector<int32_t> ids = {3, 0, 3, 10, 7, 3, 0, 5, 10};
  Vec table = randVec(V * C, gen), r = randVec(n * C, gen), g(V * C);
  rt::embeddingBackward(ids.data(), r.data(), g.data(), n, V, C);
  checkGrad(
      "embedding",
      [&](const Vec &in) {
        Vec out(n * C);
        rt::embeddingForward(in.data(), ids.data(), out.data(), n, V, C);
        return out;
      },
      table, r, g);
}

namespace {
// Gradients of C[b] = opA(A[b]) opB(B[b]) expressed with matmul itself.
void matmulGrad(bool tA, bool tB, bool broadcastB, std::mt19937 &gen) {
  const int64_t batch = 3, M = 4, N = 5, K = 3;
  const int64_t sA = M * K, sB = broadcastB ? 0 : K * N, sC = M * N;
  Vec A = randVec(batch * M * K, gen);
  Vec B = randVec(broadcastB ? K * N : batch * K * N, gen);
  Vec r = randVec(batch * M * N, gen);
  auto fwd = [&](const Vec &AA, const Vec &BB) {
    Vec C(batch * M * N);
    rt::matmul(AA.data(), BB.data(), C.data(), batch, M, N, K, tA, tB, sA, sB,
               sC);
    return C;
  };
  // dA = dC opB^T (stored [M,K]) or opB dC^T (stored [K,M]).
  Vec dA(A.size());
  if (!tA)
    rt::matmul(r.data(), B.data(), dA.data(), batch, M, K, N, false, !tB, sC,
               sB, sA);
  else
    rt::matmul(B.data(), r.data(), dA.data(), batch, K, M, N, tB, true, sB, sC,
               sA);
  // dB = opA^T dC (stored [K,N]) or dC^T opA (stored [N,K]); summed over the
  // batch with accumulate when B is shared.
  Vec dB(B.size(), 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    double *dst = dB.data() + b * sB;
    const bool acc = broadcastB && b > 0;
    if (!tB)
      rt::matmul(A.data() + b * sA, r.data() + b * sC, dst, 1, K, N, M, !tA,
                 false, 0, 0, 0, acc);
    else
      rt::matmul(r.data() + b * sC, A.data() + b * sA, dst, 1, N, K, M, true,
                 tA, 0, 0, 0, acc);
  }
  const std::string tag = " tA=" + std::to_string(tA) +
                          " tB=" + std::to_string(tB) +
                          " bcB=" + std::to_string(broadcastB);
  checkGrad(
      "matmul dA" + tag, [&](const Vec &in) { return fwd(in, B); }, A, r, dA);
  checkGrad(
      "matmul dB" + tag, [&](const Vec &in) { return fwd(A, in); }, B, r, dB);
}
} // namespace

TEST(KernelGradCheck, Matmul) {
  std::mt19937 gen(109);
  for (bool tA : {false, true})
    for (bool tB : {false, true})
      for (bool bc : {false, true})
        matmulGrad(tA, tB, bc, gen);
}

TEST(KernelGradCheck, BroadcastAddMul) {
  std::mt19937 gen(110);
  const int64_t rows = 7, nb = 13, n = rows * nb;
  Vec a = randVec(n, gen), b = randVec(nb, gen), r = randVec(n, gen);
  auto add = [&](const Vec &aa, const Vec &bb) {
    Vec out(n);
    rt::addBroadcast(aa.data(), bb.data(), out.data(), n, nb);
    return out;
  };
  auto mul = [&](const Vec &aa, const Vec &bb) {
    Vec out(n);
    rt::mulBroadcast(aa.data(), bb.data(), out.data(), n, nb);
    return out;
  };
  Vec db(nb);
  rt::reduceSumLeading(r.data(), db.data(), rows, nb);
  checkGrad(
      "add da", [&](const Vec &in) { return add(in, b); }, a, r, r);
  checkGrad(
      "add db", [&](const Vec &in) { return add(a, in); }, b, r, db);
  // mul: da = r * b (broadcast), db = reduceSumLeading(r * a).
  Vec da(n), ra(n);
  rt::mulBroadcast(r.data(), b.data(), da.data(), n, nb);
  rt::mulBroadcast(r.data(), a.data(), ra.data(), n, n);
  rt::reduceSumLeading(ra.data(), db.data(), rows, nb);
  checkGrad(
      "mul da", [&](const Vec &in) { return mul(in, b); }, a, r, da);
  checkGrad(
      "mul db", [&](const Vec &in) { return mul(a, in); }, b, r, db);
}

TEST(KernelGradCheck, Scale) {
  std::mt19937 gen(111);
  const int64_t n = 17;
  Vec x = randVec(n, gen), r = randVec(n, gen), g(n);
  rt::scale(r.data(), g.data(), n, -1.7);
  checkGrad(
      "scale",
      [&](const Vec &in) {
        Vec out(n);
        rt::scale(in.data(), out.data(), n, -1.7);
        return out;
      },
      x, r, g);
}

TEST(KernelGradCheck, Transpose) {
  std::mt19937 gen(112);
  const int64_t shape[4] = {2, 3, 4, 5};
  const int64_t perm[4] = {2, 0, 3, 1};
  const int64_t n = 120;
  int64_t outShape[4], inv[4];
  for (int i = 0; i < 4; ++i) {
    outShape[i] = shape[perm[i]];
    inv[perm[i]] = i;
  }
  Vec x = randVec(n, gen), r = randVec(n, gen), g(n);
  rt::transpose(r.data(), g.data(), outShape, inv, 4);
  checkGrad(
      "transpose",
      [&](const Vec &in) {
        Vec out(n);
        rt::transpose(in.data(), out.data(), shape, perm, 4);
        return out;
      },
      x, r, g);
}

TEST(KernelGradCheck, SliceInsert) {
  std::mt19937 gen(113);
  const int64_t outer = 3, axis = 7, inner = 5, start = 2, len = 4;
  const int64_t nFull = outer * axis * inner, nPart = outer * len * inner;
  // slice: gradient is the upstream gradient inserted into zeros.
  Vec x = randVec(nFull, gen), r = randVec(nPart, gen), g(nFull, 0.0);
  rt::insertAxis(r.data(), g.data(), outer, axis, inner, start, len);
  checkGrad(
      "sliceAxis",
      [&](const Vec &in) {
        Vec out(nPart);
        rt::sliceAxis(in.data(), out.data(), outer, axis, inner, start, len);
        return out;
      },
      x, r, g);
  // insert (into zeros): gradient is the slice of the upstream gradient.
  Vec y = randVec(nPart, gen), r2 = randVec(nFull, gen), g2(nPart);
  rt::sliceAxis(r2.data(), g2.data(), outer, axis, inner, start, len);
  checkGrad(
      "insertAxis",
      [&](const Vec &in) {
        Vec out(nFull, 0.0);
        rt::insertAxis(in.data(), out.data(), outer, axis, inner, start, len);
        return out;
      },
      y, r2, g2);
}
