//===- KernelsDeterminismTest.cpp - Bitwise reproducibility ---------------===//
//
// Kernels that reduce across rows must give bitwise identical results from
// run to run with the same thread count. The current implementation is also
// independent of the thread count, which is checked against one thread.
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Kernels.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <cstring>
#include <functional>
#include <random>
#include <vector>

namespace rt = tessel::rt;

namespace {

std::vector<float> randVec(size_t n, std::mt19937 &gen) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> v(n);
  for (float &x : v)
    x = dist(gen);
  return v;
}

bool bitwiseEqual(const std::vector<float> &a, const std::vector<float> &b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Runs `run` (which fills its outputs) with 2 threads twice and with 1
// thread, restoring the previous thread count.
using Outputs = std::vector<std::vector<float>>;
void expectDeterministic(const char *what,
                         const std::function<Outputs()> &run) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(2);
  const Outputs first = run();
  const Outputs second = run();
  omp_set_num_threads(1);
  const Outputs single = run();
  omp_set_num_threads(saved);
  ASSERT_EQ(first.size(), second.size());
  for (size_t i = 0; i < first.size(); ++i) {
    EXPECT_TRUE(bitwiseEqual(first[i], second[i]))
        << what << " output " << i << " differs between runs (2 threads)";
    EXPECT_TRUE(bitwiseEqual(first[i], single[i]))
        << what << " output " << i << " differs between 2 and 1 threads";
  }
}

} // namespace

TEST(KernelDeterminism, AttentionBackward) {
  std::mt19937 gen(200);
  for (int64_t Hkv : {int64_t(2), int64_t(4)}) {
    const int64_t B = 2, T = 64, H = 4, D = 32;
    const int64_t nq = B * T * H * D, nk = B * T * Hkv * D;
    auto q = randVec(nq, gen), k = randVec(nk, gen), v = randVec(nk, gen);
    auto dout = randVec(nq, gen);
    std::vector<float> out(nq), lse(B * H * T);
    rt::attentionForward(q.data(), k.data(), v.data(), out.data(), lse.data(),
                         B, T, H, Hkv, D, /*causal=*/true);
    expectDeterministic("attentionBackward", [&] {
      Outputs o = {std::vector<float>(nq), std::vector<float>(nk),
                   std::vector<float>(nk)};
      rt::attentionBackward(q.data(), k.data(), v.data(), out.data(),
                            lse.data(), dout.data(), o[0].data(), o[1].data(),
                            o[2].data(), B, T, H, Hkv, D, /*causal=*/true);
      return o;
    });
  }
}

TEST(KernelDeterminism, LayerNormBackward) {
  std::mt19937 gen(201);
  const int64_t rows = 256, C = 200;
  auto x = randVec(rows * C, gen), w = randVec(C, gen),
       dout = randVec(rows * C, gen);
  expectDeterministic("layerNormBackward", [&] {
    Outputs o = {std::vector<float>(rows * C), std::vector<float>(C),
                 std::vector<float>(C)};
    rt::layerNormBackward(x.data(), w.data(), dout.data(), o[0].data(),
                          o[1].data(), o[2].data(), rows, C, 1e-5);
    return o;
  });
}

TEST(KernelDeterminism, EmbeddingBackward) {
  std::mt19937 gen(202);
  const int64_t n = 1024, V = 50, C = 64; // many repeated ids
  std::uniform_int_distribution<int32_t> idDist(0, int32_t(V - 1));
  std::vector<int32_t> ids(n);
  for (int32_t &id : ids)
    id = idDist(gen);
  auto dout = randVec(n * C, gen);
  expectDeterministic("embeddingBackward", [&] {
    Outputs o = {std::vector<float>(V * C)};
    rt::embeddingBackward(ids.data(), dout.data(), o[0].data(), n, V, C);
    return o;
  });
}

TEST(KernelDeterminism, OtherReductions) {
  std::mt19937 gen(203);
  const int64_t rows = 300, C = 257;
  auto x = randVec(rows * C, gen), w = randVec(C, gen),
       dout = randVec(rows * C, gen);
  expectDeterministic("rmsNormBackward/reduceSumLeading/sumSquares", [&] {
    Outputs o = {std::vector<float>(rows * C), std::vector<float>(C),
                 std::vector<float>(C), std::vector<float>(1)};
    rt::rmsNormBackward(x.data(), w.data(), dout.data(), o[0].data(),
                        o[1].data(), rows, C, 1e-6);
    rt::reduceSumLeading(x.data(), o[2].data(), rows, C);
    o[3][0] = float(rt::sumSquares(x.data(), rows * C));
    return o;
  });
}
