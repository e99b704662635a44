//===- NormsTest.cu - CUDA LayerNorm and RMSNorm --------------------------===//
//
// Each kernel of lib/Runtime/Cuda/Norms.cu against the CPU kernel of the
// same name on the same rounded inputs; the fused residual adds against
// addBroadcast then the norm. Row counts cover fewer rows than backward row
// blocks and more, with a remainder. The backward runs twice and must agree
// bitwise; a C beyond the partial-sum buffer must be refused.
//
//===----------------------------------------------------------------------===//

#include "CudaTest.h"

#include "tessel/Runtime/Kernels.h"

#include <cstring>
#include <stdexcept>
#include <string>

namespace tessel::cuda::test {
namespace {

// Input and output storage types of one test instance.
template <typename TIn, typename TOut> struct Storage {
  using I = TIn;
  using O = TOut;
};

template <typename S> class Norms : public ::testing::Test {};
using StorageTypes =
    ::testing::Types<Storage<float, float>, Storage<bf16, bf16>,
                     Storage<bf16, float>>;
TYPED_TEST_SUITE(Norms, StorageTypes);

struct Shape {
  int64_t rows, C;
};
// 67 rows: fewer than the backward's row blocks; 1000: more, with a
// remainder; C not a multiple of the block size, and a wide one.
// C = 300, 1000, 2048 and 4096 take the backward kernels that keep a row
// in registers (1, 2, 4 and 8 columns per thread), 5000 the general one.
const Shape kShapes[] = {{67, 300},   {1000, 96}, {50, 1000},
                         {300, 2048}, {24, 4096}, {9, 5000}};
constexpr double kEps = 1e-5;

template <typename T> double atolFor() {
  return std::is_same_v<T, float> ? 1e-4 : 2e-2;
}

std::string shapeName(const Shape &s) {
  return "rows=" + std::to_string(s.rows) + " C=" + std::to_string(s.C);
}

// Inputs with a non-zero mean, so that the mean subtraction matters.
std::vector<float> activations(size_t n, uint32_t seed) {
  return randomVector(n, seed, -1.0f, 2.0f);
}

TYPED_TEST(Norms, LayerNormForward) {
  using TI = typename TypeParam::I;
  using TO = typename TypeParam::O;
  uint32_t seed = 100;
  for (const Shape &s : kShapes) {
    SCOPED_TRACE(shapeName(s));
    const int64_t n = s.rows * s.C;
    const std::vector<float> x = roundTo<TI>(activations(n, seed++));
    const std::vector<float> w = randomVector(s.C, seed++, 0.5f, 1.5f);
    const std::vector<float> b = randomVector(s.C, seed++, -0.5f, 0.5f);
    DeviceArray<TI> dx(x);
    DeviceArray<float> dw(w), db(b);
    DeviceArray<TO> out(n);
    sync();
    layerNormForward(dx.get(), dw.get(), db.get(), out.get(), s.rows, s.C,
                     kEps);
    std::vector<float> want(n);
    rt::layerNormForward(x.data(), w.data(), b.data(), want.data(), s.rows, s.C,
                         kEps);
    expectClose(out.download(), want, rtolFor<TO>(), atolFor<TO>(), "out");
  }
}

TYPED_TEST(Norms, RmsNormForward) {
  using TI = typename TypeParam::I;
  using TO = typename TypeParam::O;
  uint32_t seed = 200;
  for (const Shape &s : kShapes) {
    SCOPED_TRACE(shapeName(s));
    const int64_t n = s.rows * s.C;
    const std::vector<float> x = roundTo<TI>(activations(n, seed++));
    const std::vector<float> w = randomVector(s.C, seed++, 0.5f, 1.5f);
    DeviceArray<TI> dx(x);
    DeviceArray<float> dw(w);
    DeviceArray<TO> out(n);
    sync();
    rmsNormForward(dx.get(), dw.get(), out.get(), s.rows, s.C, kEps);
    std::vector<float> want(n);
    rt::rmsNormForward(x.data(), w.data(), want.data(), s.rows, s.C, kEps);
    expectClose(out.download(), want, rtolFor<TO>(), atolFor<TO>(), "out");
  }
}

// sum = a + r is stored in TO (the residual stream's type) and normalised
// as stored: the same as addBroadcast into TO, then the norm.
TYPED_TEST(Norms, AddLayerNormForwardMatchesAddThenNorm) {
  using TI = typename TypeParam::I;
  using TO = typename TypeParam::O;
  uint32_t seed = 300;
  for (const Shape &s : kShapes) {
    SCOPED_TRACE(shapeName(s));
    const int64_t n = s.rows * s.C;
    const std::vector<float> a = roundTo<TI>(activations(n, seed++));
    const std::vector<float> r = roundTo<TO>(activations(n, seed++));
    const std::vector<float> w = randomVector(s.C, seed++, 0.5f, 1.5f);
    const std::vector<float> b = randomVector(s.C, seed++, -0.5f, 0.5f);
    DeviceArray<TI> da(a);
    DeviceArray<TO> dr(r), sum(n), out(n);
    DeviceArray<float> dw(w), db(b);
    sync();
    addLayerNormForward(da.get(), dr.get(), sum.get(), dw.get(), db.get(),
                        out.get(), s.rows, s.C, kEps);
    std::vector<float> wantSum(n), want(n);
    rt::addBroadcast(a.data(), r.data(), wantSum.data(), n, n);
    wantSum = roundTo<TO>(wantSum);
    rt::layerNormForward(wantSum.data(), w.data(), b.data(), want.data(),
                         s.rows, s.C, kEps);
    expectClose(sum.download(), wantSum, 0.0, 0.0, "sum");
    expectClose(out.download(), want, rtolFor<TO>(), atolFor<TO>(), "out");
  }
}

TYPED_TEST(Norms, AddRmsNormForwardMatchesAddThenNorm) {
  using TI = typename TypeParam::I;
  using TO = typename TypeParam::O;
  uint32_t seed = 400;
  for (const Shape &s : kShapes) {
    SCOPED_TRACE(shapeName(s));
    const int64_t n = s.rows * s.C;
    const std::vector<float> a = roundTo<TI>(activations(n, seed++));
    const std::vector<float> r = roundTo<TO>(activations(n, seed++));
    const std::vector<float> w = randomVector(s.C, seed++, 0.5f, 1.5f);
    DeviceArray<TI> da(a);
    DeviceArray<TO> dr(r), sum(n), out(n);
    DeviceArray<float> dw(w);
    sync();
    addRmsNormForward(da.get(), dr.get(), sum.get(), dw.get(), out.get(),
                      s.rows, s.C, kEps);
    std::vector<float> wantSum(n), want(n);
    rt::addBroadcast(a.data(), r.data(), wantSum.data(), n, n);
    wantSum = roundTo<TO>(wantSum);
    rt::rmsNormForward(wantSum.data(), w.data(), want.data(), s.rows, s.C,
                       kEps);
    expectClose(sum.download(), wantSum, 0.0, 0.0, "sum");
    expectClose(out.download(), want, rtolFor<TO>(), atolFor<TO>(), "out");
  }
}

// dw and db are fp32 sums over rows of fp32 terms from the same inputs:
// only the order of additions differs from the CPU.
constexpr double kParamRtol = 1e-4, kParamAtol = 2e-3;

TYPED_TEST(Norms, LayerNormBackward) {
  using TI = typename TypeParam::I;
  using TO = typename TypeParam::O;
  uint32_t seed = 500;
  for (const Shape &s : kShapes) {
    SCOPED_TRACE(shapeName(s));
    const int64_t n = s.rows * s.C;
    const std::vector<float> x = roundTo<TI>(activations(n, seed++));
    const std::vector<float> dout = roundTo<TI>(randomVector(n, seed++));
    const std::vector<float> w = randomVector(s.C, seed++, 0.5f, 1.5f);
    DeviceArray<TI> dX(x), dDout(dout);
    DeviceArray<float> dW(w);
    DeviceArray<TO> dx1(n), dx2(n);
    DeviceArray<float> dw1(s.C), db1(s.C), dw2(s.C), db2(s.C);
    sync();
    layerNormBackward(dX.get(), dW.get(), dDout.get(), dx1.get(), dw1.get(),
                      db1.get(), s.rows, s.C, kEps);
    layerNormBackward(dX.get(), dW.get(), dDout.get(), dx2.get(), dw2.get(),
                      db2.get(), s.rows, s.C, kEps);
    std::vector<float> wantDx(n), wantDw(s.C), wantDb(s.C);
    rt::layerNormBackward(x.data(), w.data(), dout.data(), wantDx.data(),
                          wantDw.data(), wantDb.data(), s.rows, s.C, kEps);
    const std::vector<float> gotDx = dx1.download();
    const std::vector<float> gotDw = dw1.download(), gotDb = db1.download();
    expectClose(gotDx, wantDx, rtolFor<TO>(), atolFor<TO>(), "dx");
    expectClose(gotDw, wantDw, kParamRtol, kParamAtol, "dw");
    expectClose(gotDb, wantDb, kParamRtol, kParamAtol, "db");
    expectBitwiseEqual(gotDx, dx2.download(), "dx");
    expectBitwiseEqual(gotDw, dw2.download(), "dw");
    expectBitwiseEqual(gotDb, db2.download(), "db");
  }
}

TYPED_TEST(Norms, RmsNormBackward) {
  using TI = typename TypeParam::I;
  using TO = typename TypeParam::O;
  uint32_t seed = 600;
  for (const Shape &s : kShapes) {
    SCOPED_TRACE(shapeName(s));
    const int64_t n = s.rows * s.C;
    const std::vector<float> x = roundTo<TI>(activations(n, seed++));
    const std::vector<float> dout = roundTo<TI>(randomVector(n, seed++));
    const std::vector<float> w = randomVector(s.C, seed++, 0.5f, 1.5f);
    DeviceArray<TI> dX(x), dDout(dout);
    DeviceArray<float> dW(w);
    DeviceArray<TO> dx1(n), dx2(n);
    DeviceArray<float> dw1(s.C), dw2(s.C);
    sync();
    rmsNormBackward(dX.get(), dW.get(), dDout.get(), dx1.get(), dw1.get(),
                    s.rows, s.C, kEps);
    rmsNormBackward(dX.get(), dW.get(), dDout.get(), dx2.get(), dw2.get(),
                    s.rows, s.C, kEps);
    std::vector<float> wantDx(n), wantDw(s.C);
    rt::rmsNormBackward(x.data(), w.data(), dout.data(), wantDx.data(),
                        wantDw.data(), s.rows, s.C, kEps);
    const std::vector<float> gotDx = dx1.download(), gotDw = dw1.download();
    expectClose(gotDx, wantDx, rtolFor<TO>(), atolFor<TO>(), "dx");
    expectClose(gotDw, wantDw, kParamRtol, kParamAtol, "dw");
    expectBitwiseEqual(gotDx, dx2.download(), "dx");
    expectBitwiseEqual(gotDw, dw2.download(), "dw");
  }
}

// The fused backward with the residual stream's gradient equals the norm's
// backward followed by the add, also written in place over dres.
TYPED_TEST(Norms, BackwardAddMatchesBackwardThenAdd) {
  using TI = typename TypeParam::I;
  using TO = typename TypeParam::O;
  uint32_t seed = 700;
  for (const Shape &s : kShapes) {
    SCOPED_TRACE(shapeName(s));
    const int64_t n = s.rows * s.C;
    const std::vector<float> x = roundTo<TI>(activations(n, seed++));
    const std::vector<float> dout = roundTo<TI>(randomVector(n, seed++));
    const std::vector<float> dres = roundTo<TO>(randomVector(n, seed++));
    const std::vector<float> w = randomVector(s.C, seed++, 0.5f, 1.5f);
    DeviceArray<TI> dX(x), dDout(dout);
    DeviceArray<TO> dRes(dres), dRes2(dres), dx(n);
    DeviceArray<float> dW(w), dw(s.C), db(s.C), dw2(s.C);
    sync();
    std::vector<float> lnDx(n), wantDw(s.C), wantDb(s.C), want(n);
    rt::layerNormBackward(x.data(), w.data(), dout.data(), lnDx.data(),
                          wantDw.data(), wantDb.data(), s.rows, s.C, kEps);
    rt::addBroadcast(lnDx.data(), dres.data(), want.data(), n, n);
    layerNormBackwardAdd(dX.get(), dW.get(), dDout.get(), dRes.get(), dx.get(),
                         dw.get(), db.get(), s.rows, s.C, kEps);
    expectClose(dx.download(), want, rtolFor<TO>(), atolFor<TO>(), "dx");
    expectClose(dw.download(), wantDw, kParamRtol, kParamAtol, "dw");
    expectClose(db.download(), wantDb, kParamRtol, kParamAtol, "db");
    // In place: dx is dres.
    layerNormBackwardAdd(dX.get(), dW.get(), dDout.get(), dRes2.get(),
                         dRes2.get(), dw2.get(), db.get(), s.rows, s.C, kEps);
    expectBitwiseEqual(dRes2.download(), dx.download(), "dx in place");

    std::vector<float> rmsDx(n), wantRmsDw(s.C), wantRms(n);
    rt::rmsNormBackward(x.data(), w.data(), dout.data(), rmsDx.data(),
                        wantRmsDw.data(), s.rows, s.C, kEps);
    rt::addBroadcast(rmsDx.data(), dres.data(), wantRms.data(), n, n);
    rmsNormBackwardAdd(dX.get(), dW.get(), dDout.get(), dRes.get(), dx.get(),
                       dw.get(), s.rows, s.C, kEps);
    expectClose(dx.download(), wantRms, rtolFor<TO>(), atolFor<TO>(), "rms dx");
    expectClose(dw.download(), wantRmsDw, kParamRtol, kParamAtol, "rms dw");
  }
}

TEST(NormsLimits, BackwardRefusesColumnsBeyondThePartialBuffer) {
  // Checked before anything is launched, so no buffers are needed.
  const int64_t C = (int64_t(1) << 21) + 1;
  const float *in = nullptr;
  float *out = nullptr;
  EXPECT_THROW(layerNormBackward(in, in, in, out, out, out, 4, C, kEps),
               std::runtime_error);
  EXPECT_THROW(rmsNormBackward(in, in, in, out, out, 4, C, kEps),
               std::runtime_error);
}

} // namespace
} // namespace tessel::cuda::test
