//===- CrossEntropyTest.cu - CUDA fused softmax + cross-entropy -----------===//
//
// The full-vocabulary kernels against the CPU kernels of the same name, on
// a small vocabulary and a GPT-2 sized one; both run twice and must agree
// bitwise. The vocab-parallel kernels run on a group of one rank (the tensor
// axis of a one-rank mesh): holding the whole vocabulary they must give the
// full cross-entropy, and holding a slice they must give the slice's
// statistics (target logits counted only when the slice holds the target),
// checked against a loop on the host.
//
//===----------------------------------------------------------------------===//

#include "CudaTest.h"

#include "tessel/Runtime/Comm.h"
#include "tessel/Runtime/Kernels.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace tessel::cuda::test {
namespace {

std::vector<int32_t> randomTargets(size_t n, int32_t V, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int32_t> dist(0, V - 1);
  std::vector<int32_t> t(n);
  for (int32_t &x : t)
    x = dist(gen);
  return t;
}

class DeviceTargets {
public:
  explicit DeviceTargets(const std::vector<int32_t> &t) : array(t.size()) {
    TESSEL_CUDA_CHECK(cudaMemcpy(array.get(), t.data(),
                                 t.size() * sizeof(int32_t),
                                 cudaMemcpyHostToDevice));
  }
  const int32_t *get() const { return array.get(); }

private:
  DeviceArray<int32_t> array;
};

// Logits and gradient storage types of one test instance.
template <typename TLogits, typename TGrad> struct Storage {
  using L = TLogits;
  using G = TGrad;
};

template <typename S> class CrossEntropy : public ::testing::Test {};
using StorageTypes =
    ::testing::Types<Storage<float, float>, Storage<bf16, bf16>,
                     Storage<bf16, float>>;
TYPED_TEST_SUITE(CrossEntropy, StorageTypes);

struct Shape {
  int64_t rows, V;
};
const Shape kShapes[] = {{67, 1000}, {33, 50257}};

std::string shapeName(const Shape &s) {
  return "rows=" + std::to_string(s.rows) + " V=" + std::to_string(s.V);
}

std::vector<float> logitsFor(size_t n, uint32_t seed) {
  return randomVector(n, seed, -4.0f, 4.0f);
}

constexpr float kDloss = 2.5f;
// A single group of one rank whatever the mesh of the test process.
constexpr unsigned kOneRank = AxisSet(MeshAxis::TP).bits();

// Gradients are g * p with g = dloss / rows and p down to exp(-8) / V, so
// the absolute tolerance is a fraction of g.
double gradAtol(int64_t rows) { return 1e-5 * kDloss / double(rows); }

// The loss and gradient of a vocabulary shard [vStart, vStart + Vl) of
// `rows` rows from its own statistics over its first n columns (the rest
// padding), as VocabParallel.cpp defines them, in double.
struct ShardReference {
  float loss;
  std::vector<float> grad;
};
ShardReference shardReference(const std::vector<float> &x,
                              const std::vector<int32_t> &t, int64_t rows,
                              int64_t Vl, int64_t vStart, int64_t n) {
  double total = 0;
  const double scale = double(kDloss) / double(rows);
  std::vector<float> grad(size_t(rows * Vl), 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const float *xr = x.data() + r * Vl;
    const double m = *std::max_element(xr, xr + n);
    double sum = 0;
    for (int64_t j = 0; j < n; ++j)
      sum += std::exp(double(xr[j]) - m);
    const int64_t local = int64_t(t[r]) - vStart;
    const bool held = local >= 0 && local < n;
    total += std::log(sum) + m - (held ? double(xr[local]) : 0.0);
    for (int64_t j = 0; j < n; ++j)
      grad[size_t(r * Vl + j)] = float(scale * std::exp(double(xr[j]) - m) /
                                           sum -
                                       (held && j == local ? scale : 0.0));
  }
  return {float(total / double(rows)), grad};
}

TYPED_TEST(CrossEntropy, Forward) {
  using TL = typename TypeParam::L;
  uint32_t seed = 700;
  for (const Shape &s : kShapes) {
    SCOPED_TRACE(shapeName(s));
    const std::vector<float> x = roundTo<TL>(logitsFor(s.rows * s.V, seed++));
    const std::vector<int32_t> t = randomTargets(s.rows, s.V, seed++);
    DeviceArray<TL> dx(x);
    DeviceTargets dt(t);
    DeviceArray<float> loss1(1), loss2(1);
    sync();
    crossEntropyForward(dx.get(), dt.get(), loss1.get(), s.rows, s.V, s.V);
    crossEntropyForward(dx.get(), dt.get(), loss2.get(), s.rows, s.V, s.V);
    float want = 0;
    rt::crossEntropyForward(x.data(), t.data(), &want, s.rows, s.V, s.V);
    const std::vector<float> got = loss1.download();
    expectClose(got, {want}, 1e-5, 1e-5, "loss");
    expectBitwiseEqual(got, loss2.download(), "loss");
  }
}

TYPED_TEST(CrossEntropy, Backward) {
  using TL = typename TypeParam::L;
  using TG = typename TypeParam::G;
  uint32_t seed = 800;
  for (const Shape &s : kShapes) {
    SCOPED_TRACE(shapeName(s));
    const int64_t n = s.rows * s.V;
    const std::vector<float> x = roundTo<TL>(logitsFor(n, seed++));
    const std::vector<int32_t> t = randomTargets(s.rows, s.V, seed++);
    DeviceArray<TL> dx(x);
    DeviceTargets dt(t);
    DeviceArray<float> dDloss(std::vector<float>{kDloss});
    DeviceArray<TG> g1(n), g2(n);
    sync();
    crossEntropyBackward(dx.get(), dt.get(), dDloss.get(), g1.get(), s.rows,
                         s.V, s.V);
    crossEntropyBackward(dx.get(), dt.get(), dDloss.get(), g2.get(), s.rows,
                         s.V, s.V);
    std::vector<float> want(n);
    rt::crossEntropyBackward(x.data(), t.data(), &kDloss, want.data(), s.rows,
                             s.V, s.V);
    const std::vector<float> got = g1.download();
    expectClose(got, want, rtolFor<TG>(), gradAtol(s.rows), "dlogits");
    expectBitwiseEqual(got, g2.download(), "dlogits");
  }
}

TYPED_TEST(CrossEntropy, VocabParallelWholeVocabularyIsTheFullLoss) {
  using TL = typename TypeParam::L;
  using TG = typename TypeParam::G;
  uint32_t seed = 900;
  for (const Shape &s : kShapes) {
    SCOPED_TRACE(shapeName(s));
    const int64_t n = s.rows * s.V;
    const std::vector<float> x = roundTo<TL>(logitsFor(n, seed++));
    const std::vector<int32_t> t = randomTargets(s.rows, s.V, seed++);
    DeviceArray<TL> dx(x);
    DeviceTargets dt(t);
    DeviceArray<float> loss(1), dDloss(std::vector<float>{kDloss});
    DeviceArray<TG> grad(n);
    DeviceArray<char> scratch(crossEntropyScratchBytes(s.rows));
    sync();
    crossEntropyVocabParallelForward(dx.get(), dt.get(), loss.get(), nullptr,
                                     s.rows, s.V, 0, kOneRank, s.V,
                                     scratch.get());
    crossEntropyVocabParallelBackward(dx.get(), dt.get(), dDloss.get(),
                                      grad.get(), nullptr, s.rows, s.V, 0,
                                      kOneRank, s.V, scratch.get());
    float wantLoss = 0;
    rt::crossEntropyForward(x.data(), t.data(), &wantLoss, s.rows, s.V, s.V);
    std::vector<float> wantGrad(n);
    rt::crossEntropyBackward(x.data(), t.data(), &kDloss, wantGrad.data(),
                             s.rows, s.V, s.V);
    expectClose(loss.download(), {wantLoss}, 1e-5, 1e-5, "loss");
    expectClose(grad.download(), wantGrad, rtolFor<TG>(), gradAtol(s.rows),
                "dlogits");
  }
}

// The row statistics a vocabulary-parallel forward keeps, over the first
// `n` of each row's `Vl` columns: the maxima, then the sums of exp(x - max)
// (in double).
std::vector<float> rowStatisticsOf(const std::vector<float> &x, int64_t rows,
                                   int64_t Vl, int64_t n) {
  std::vector<float> stats(2 * rows);
  for (int64_t r = 0; r < rows; ++r) {
    float m = -INFINITY;
    for (int64_t v = 0; v < n; ++v)
      m = std::max(m, x[r * Vl + v]);
    double sum = 0;
    for (int64_t v = 0; v < n; ++v)
      sum += std::exp(double(x[r * Vl + v]) - m);
    stats[r] = m;
    stats[rows + r] = float(sum);
  }
  return stats;
}

// A slice [vStart, vStart + Vl) of a vocabulary of V on a one-rank group:
// the loss and gradient of the slice's own statistics, as VocabParallel.cpp
// defines them, computed here in double.
TYPED_TEST(CrossEntropy, VocabParallelSlice) {
  using TL = typename TypeParam::L;
  using TG = typename TypeParam::G;
  const int64_t rows = 45, V = 1000, vStart = 300, Vl = 500;
  const std::vector<float> x = roundTo<TL>(logitsFor(rows * Vl, 1000));
  // Targets over the whole vocabulary: some in the slice, some not.
  const std::vector<int32_t> t = randomTargets(rows, V, 1001);
  DeviceArray<TL> dx(x);
  DeviceTargets dt(t);
  DeviceArray<float> loss(1), dDloss(std::vector<float>{kDloss});
  DeviceArray<TG> grad(rows * Vl);
  DeviceArray<char> scratch(crossEntropyScratchBytes(rows));
  sync();
  // The forward keeps the row statistics; a backward that reads them
  // (no communication) writes exactly what one that combines them again
  // does.
  DeviceArray<float> stats(2 * rows);
  DeviceArray<TG> kept(rows * Vl);
  crossEntropyVocabParallelForward(dx.get(), dt.get(), loss.get(), stats.get(),
                                   rows, Vl, vStart, kOneRank, V,
                                   scratch.get());
  crossEntropyVocabParallelBackward(dx.get(), dt.get(), dDloss.get(),
                                    grad.get(), nullptr, rows, Vl, vStart,
                                    kOneRank, V, scratch.get());
  crossEntropyVocabParallelBackward(dx.get(), dt.get(), dDloss.get(),
                                    kept.get(), stats.get(), rows, Vl, vStart,
                                    kOneRank, V, scratch.get());

  const ShardReference want = shardReference(x, t, rows, Vl, vStart, Vl);
  expectClose(loss.download(), {want.loss}, 1e-5, 1e-5, "loss");
  const std::vector<float> got = grad.download();
  expectClose(got, want.grad, rtolFor<TG>(), gradAtol(rows), "dlogits");
  expectBitwiseEqual(kept.download(), got, "dlogits from the kept statistics");
  // What is kept is VocabParallel.cpp's: the row maxima, then each row's
  // sum of exp(x - max).
  expectClose(stats.download(), rowStatisticsOf(x, rows, Vl, Vl), 1e-4, 0,
              "row statistics");
}

// A vocabulary padded to a multiple: rows of V = 1000 columns of which the
// first 937 are the vocabulary. The padding (filled with large logits, which
// would dominate the softmax) takes no part: the loss and gradient equal the
// CPU kernels' on the same padded rows, the padding's gradient is zero. Over
// a shard [600, 1000) the same holds for its 337 real columns.
TYPED_TEST(CrossEntropy, PaddedVocabulary) {
  using TL = typename TypeParam::L;
  using TG = typename TypeParam::G;
  const int64_t rows = 33, V = 1000, valid = 937;
  std::vector<float> x = logitsFor(rows * V, 1200);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = valid; j < V; ++j)
      x[r * V + j] = 30.f;
  x = roundTo<TL>(x);
  const std::vector<int32_t> t = randomTargets(rows, valid, 1201);
  DeviceArray<TL> dx(x);
  DeviceTargets dt(t);
  DeviceArray<float> loss(1), dDloss(std::vector<float>{kDloss});
  DeviceArray<TG> grad(rows * V);
  sync();
  crossEntropyForward(dx.get(), dt.get(), loss.get(), rows, V, valid);
  crossEntropyBackward(dx.get(), dt.get(), dDloss.get(), grad.get(), rows, V,
                       valid);
  float want = 0;
  rt::crossEntropyForward(x.data(), t.data(), &want, rows, V, valid);
  std::vector<float> wantGrad(rows * V);
  rt::crossEntropyBackward(x.data(), t.data(), &kDloss, wantGrad.data(), rows,
                           V, valid);
  const std::vector<float> got = grad.download();
  expectClose(loss.download(), {want}, 1e-5, 1e-5, "loss");
  expectClose(got, wantGrad, rtolFor<TG>(), gradAtol(rows), "dlogits");
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = valid; j < V; ++j)
      ASSERT_EQ(got[r * V + j], 0.f) << "row " << r << " column " << j;

  // The shard of columns [600, 1000): its own statistics over 337 columns.
  const int64_t vStart = 600, Vl = 400;
  std::vector<float> xs(rows * Vl);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < Vl; ++j)
      xs[r * Vl + j] = x[r * V + vStart + j];
  DeviceArray<TL> dxs(xs);
  DeviceArray<TG> grads(rows * Vl);
  DeviceArray<char> scratch(crossEntropyScratchBytes(rows));
  sync();
  DeviceArray<float> stats(2 * rows);
  DeviceArray<TG> kept(rows * Vl);
  crossEntropyVocabParallelForward(dxs.get(), dt.get(), loss.get(),
                                   stats.get(), rows, Vl, vStart, kOneRank,
                                   valid, scratch.get());
  crossEntropyVocabParallelBackward(dxs.get(), dt.get(), dDloss.get(),
                                    grads.get(), nullptr, rows, Vl, vStart,
                                    kOneRank, valid, scratch.get());
  crossEntropyVocabParallelBackward(dxs.get(), dt.get(), dDloss.get(),
                                    kept.get(), stats.get(), rows, Vl, vStart,
                                    kOneRank, valid, scratch.get());
  const ShardReference shard =
      shardReference(xs, t, rows, Vl, vStart, valid - vStart);
  expectClose(loss.download(), {shard.loss}, 1e-5, 1e-5, "shard loss");
  const std::vector<float> gotShard = grads.download();
  expectClose(gotShard, shard.grad, rtolFor<TG>(), gradAtol(rows),
              "shard dlogits");
  // The kept statistics leave the padding out (its logits of 30 would be
  // every row's maximum), and the backward from them is the same.
  expectClose(stats.download(), rowStatisticsOf(xs, rows, Vl, valid - vStart),
              1e-4, 0, "shard row statistics");
  expectBitwiseEqual(kept.download(), gotShard,
                     "shard dlogits from the kept statistics");
}

TEST(CrossEntropyLimits, OutOfRangeTargetGivesNaN) {
  const int64_t rows = 4, V = 16;
  DeviceArray<float> dx(randomVector(rows * V, 1100));
  DeviceTargets dt({0, 3, int32_t(V), 5});
  DeviceArray<float> loss(1);
  sync();
  crossEntropyForward(dx.get(), dt.get(), loss.get(), rows, V, V);
  EXPECT_TRUE(std::isnan(loss.download()[0]));
}

TEST(CrossEntropyLimits, ForwardRefusesRowsBeyondItsBuffer) {
  // Checked before anything is launched, so no buffers are needed.
  EXPECT_THROW(crossEntropyForward<float>(nullptr, nullptr, nullptr,
                                          (int64_t(1) << 20) + 1, 8, 8),
               std::runtime_error);
}

TEST(CrossEntropyLimits, ScratchCoversTheRowStatistics) {
  for (int64_t rows : {1, 7, 1000, 131072}) {
    const int64_t bytes = crossEntropyScratchBytes(rows);
    EXPECT_GE(bytes, 3 * rows * int64_t(sizeof(float)));
    EXPECT_EQ(bytes % 256, 0);
  }
}

} // namespace
} // namespace tessel::cuda::test
