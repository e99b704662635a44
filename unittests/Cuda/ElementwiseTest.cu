//===- ElementwiseTest.cu - CUDA pointwise, layout and embedding kernels --===//
//
// Each kernel of lib/Runtime/Cuda/Elementwise.cu against the CPU kernel of
// the same name, for float and bf16 storage and a mixed combination where
// the kernel has several storage types. Layout kernels and the embedding
// (which adds in the CPU's order) must match exactly; the column sums and
// the embedding backward are also run twice and compared bitwise.
//
//===----------------------------------------------------------------------===//

#include "CudaTest.h"

#include "tessel/Runtime/Kernels.h"
#include "tessel/Runtime/VocabParallel.h"

#include <cstring>
#include <numeric>

namespace tessel::cuda::test {
namespace {

// DeviceArray copies on the default stream, which the compute stream need
// not be ordered with: inputs are synchronised before kernels read them.
class DeviceIds {
public:
  explicit DeviceIds(const std::vector<int32_t> &ids) : array(ids.size()) {
    TESSEL_CUDA_CHECK(cudaMemcpy(array.get(), ids.data(),
                                 ids.size() * sizeof(int32_t),
                                 cudaMemcpyHostToDevice));
  }
  const int32_t *get() const { return array.get(); }

private:
  DeviceArray<int32_t> array;
};

std::vector<int32_t> randomIds(size_t n, int32_t lo, int32_t hi,
                               uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int32_t> dist(lo, hi - 1);
  std::vector<int32_t> ids(n);
  for (int32_t &id : ids)
    id = dist(gen);
  return ids;
}

//===--- Broadcast --------------------------------------------------------===//

template <typename TA, typename TB, typename TO>
void checkBroadcast(int64_t n, int64_t nb, bool mul) {
  SCOPED_TRACE(std::string(mul ? "mul " : "add ") + typeName<TA>() + "," +
               typeName<TB>() + "->" + typeName<TO>() +
               " n=" + std::to_string(n) + " nb=" + std::to_string(nb));
  auto a = roundTo<TA>(randomVector(size_t(n), 1, -2.0f, 2.0f));
  auto b = roundTo<TB>(randomVector(size_t(nb), 2, -2.0f, 2.0f));
  std::vector<float> want(n);
  if (mul)
    tessel::rt::mulBroadcast(a.data(), b.data(), want.data(), n, nb);
  else
    tessel::rt::addBroadcast(a.data(), b.data(), want.data(), n, nb);
  DeviceArray<TA> da(a);
  DeviceArray<TB> db(b);
  DeviceArray<TO> out(n);
  sync();
  if (mul)
    mulBroadcast(da.get(), db.get(), out.get(), n, nb);
  else
    addBroadcast(da.get(), db.get(), out.get(), n, nb);
  expectClose(out.download(), want, rtolFor<TO>(), 1e-6, "broadcast");
}

TEST(CudaElementwise, AddMulBroadcast) {
  for (bool mul : {false, true}) {
    for (int64_t nb : {int64_t(1001), int64_t(1), int64_t(37 * 1001)}) {
      checkBroadcast<float, float, float>(37 * 1001, nb, mul);
      checkBroadcast<bf16, bf16, bf16>(37 * 1001, nb, mul);
    }
    checkBroadcast<bf16, float, bf16>(37 * 1001, 1001, mul);
    checkBroadcast<float, bf16, float>(37 * 1001, 1001, mul);
    // Multiples of 8: eight elements a thread.
    for (int64_t nb : {int64_t(1000), int64_t(8), int64_t(64 * 1000)}) {
      checkBroadcast<float, float, float>(64 * 1000, nb, mul);
      checkBroadcast<bf16, bf16, bf16>(64 * 1000, nb, mul);
      checkBroadcast<bf16, float, bf16>(64 * 1000, nb, mul);
      checkBroadcast<float, bf16, float>(64 * 1000, nb, mul);
    }
  }
}

//===--- Column sums ------------------------------------------------------===//

template <typename TI, typename TO>
void checkReduceSumLeading(int64_t rows, int64_t cols) {
  SCOPED_TRACE(std::string(typeName<TI>()) + "->" + typeName<TO>() + " rows=" +
               std::to_string(rows) + " cols=" + std::to_string(cols));
  auto x = roundTo<TI>(randomVector(size_t(rows * cols), 3));
  std::vector<float> want(cols);
  tessel::rt::reduceSumLeading(x.data(), want.data(), rows, cols);
  DeviceArray<TI> dx(x);
  DeviceArray<TO> out(cols);
  sync();
  fill(out.get(), cols, 7.0f); // every column must be written
  reduceSumLeading(dx.get(), out.get(), rows, cols);
  auto first = out.download();
  // Sums of `rows` values of magnitude <= 1 in another order.
  expectClose(first, want, rtolFor<TO>(), 2e-6 * double(rows),
              "reduceSumLeading");
  fill(out.get(), cols, 7.0f);
  reduceSumLeading(dx.get(), out.get(), rows, cols);
  expectBitwiseEqual(out.download(), first, "reduceSumLeading");
}

TEST(CudaElementwise, ReduceSumLeading) {
  checkReduceSumLeading<float, float>(1000, 333);
  checkReduceSumLeading<float, float>(5000, 40);
  checkReduceSumLeading<float, float>(1, 70);
  checkReduceSumLeading<float, float>(0, 70);
  checkReduceSumLeading<bf16, float>(1000, 333);
  checkReduceSumLeading<bf16, bf16>(1000, 333);
}

//===--- Pointwise --------------------------------------------------------===//

// Sizes odd (one element a thread) and multiples of 8 (eight).
template <typename TI, typename TO> void checkScale(int64_t n) {
  SCOPED_TRACE(std::string(typeName<TI>()) + "->" + typeName<TO>() +
               " n=" + std::to_string(n));
  auto x = roundTo<TI>(randomVector(size_t(n), 4, -3.0f, 3.0f));
  std::vector<float> want(n);
  tessel::rt::scale(x.data(), want.data(), n, 0.37f);
  DeviceArray<TI> dx(x);
  DeviceArray<TO> out(n);
  sync();
  scale(dx.get(), out.get(), n, 0.37f);
  expectClose(out.download(), want, rtolFor<TO>(), 0.0, "scale");
}

TEST(CudaElementwise, Scale) {
  for (int64_t n : {int64_t(100003), int64_t(100000)}) {
    checkScale<float, float>(n);
    checkScale<bf16, bf16>(n);
    checkScale<float, bf16>(n);
  }
}

enum class Act { Gelu, Silu };

template <typename TI, typename TO>
void checkActivationForward(Act act, int64_t n) {
  SCOPED_TRACE(std::string(act == Act::Gelu ? "gelu " : "silu ") +
               typeName<TI>() + "->" + typeName<TO>() +
               " n=" + std::to_string(n));
  auto x = roundTo<TI>(randomVector(size_t(n), 5, -5.0f, 5.0f));
  std::vector<float> want(n);
  DeviceArray<TI> dx(x);
  DeviceArray<TO> out(n);
  sync();
  if (act == Act::Gelu) {
    tessel::rt::geluForward(x.data(), want.data(), n);
    geluForward(dx.get(), out.get(), n);
  } else {
    tessel::rt::siluForward(x.data(), want.data(), n);
    siluForward(dx.get(), out.get(), n);
  }
  // The absolute term covers the left tail, where 1 + tanh(u) cancels.
  expectClose(out.download(), want, rtolFor<TO>(), 1e-5, "forward");
}

template <typename TI, typename TG, typename TO>
void checkActivationBackward(Act act) {
  SCOPED_TRACE(std::string(act == Act::Gelu ? "gelu " : "silu ") +
               typeName<TI>() + "," + typeName<TG>() + "->" + typeName<TO>());
  for (int64_t n : {int64_t(65537), int64_t(65536)}) { // 65536: vectorised
    SCOPED_TRACE("n=" + std::to_string(n));
    auto x = roundTo<TI>(randomVector(size_t(n), 6, -5.0f, 5.0f));
    auto dout = roundTo<TG>(randomVector(size_t(n), 7));
    std::vector<float> want(n);
    DeviceArray<TI> dx(x);
    DeviceArray<TG> ddout(dout);
    DeviceArray<TO> out(n);
    sync();
    if (act == Act::Gelu) {
      tessel::rt::geluBackward(x.data(), dout.data(), want.data(), n);
      geluBackward(dx.get(), ddout.get(), out.get(), n);
    } else {
      tessel::rt::siluBackward(x.data(), dout.data(), want.data(), n);
      siluBackward(dx.get(), ddout.get(), out.get(), n);
    }
    expectClose(out.download(), want, rtolFor<TO>(), 1e-5, "backward");
  }
}

TEST(CudaElementwise, GeluSilu) {
  for (Act act : {Act::Gelu, Act::Silu}) {
    for (int64_t n : {int64_t(65537), int64_t(65536)}) {
      checkActivationForward<float, float>(act, n);
      checkActivationForward<bf16, bf16>(act, n);
      checkActivationForward<float, bf16>(act, n);
    }
    checkActivationBackward<float, float, float>(act);
    checkActivationBackward<bf16, bf16, bf16>(act);
    checkActivationBackward<bf16, float, float>(act);
  }
}

template <typename TI, typename TO> void checkSwiglu(bool withSilu, int64_t n) {
  SCOPED_TRACE(std::string(typeName<TI>()) + "->" + typeName<TO>() +
               (withSilu ? " with silu" : "") + " n=" + std::to_string(n));
  auto gate = roundTo<TI>(randomVector(size_t(n), 8, -5.0f, 5.0f));
  auto up = roundTo<TI>(randomVector(size_t(n), 9, -2.0f, 2.0f));
  std::vector<float> wantSilu(n), want(n);
  tessel::rt::siluForward(gate.data(), wantSilu.data(), n);
  tessel::rt::mulBroadcast(wantSilu.data(), up.data(), want.data(), n, n);
  DeviceArray<TI> dgate(gate), dup(up);
  DeviceArray<TO> out(n), silu(n);
  sync();
  swigluForward(dgate.get(), dup.get(), out.get(),
                withSilu ? silu.get() : nullptr, n);
  expectClose(out.download(), want, rtolFor<TO>(), 1e-5, "swiglu out");
  if (withSilu)
    expectClose(silu.download(), wantSilu, rtolFor<TO>(), 1e-5, "swiglu silu");
  else
    expectClose(silu.download(), std::vector<float>(size_t(n), 0.0f), 0, 0,
                "swiglu silu untouched");
}

TEST(CudaElementwise, Swiglu) {
  for (int64_t n : {int64_t(50001), int64_t(50000)}) {
    for (bool withSilu : {true, false}) {
      checkSwiglu<float, float>(withSilu, n);
      checkSwiglu<bf16, bf16>(withSilu, n);
    }
    checkSwiglu<bf16, float>(true, n);
  }
}

// SwiGLU's fused backward against the CPU kernels it replaces, on the same
// rounded inputs: up's gradient dout * silu(gate), the gate's the SiLU's
// backward of dout * up; the 8-wide path (n a multiple of 8) and the
// scalar one.
template <typename TI, typename TG, typename TO>
void checkSwigluBackward(int64_t n) {
  SCOPED_TRACE(std::string(typeName<TI>()) + "," + typeName<TG>() + "->" +
               typeName<TO>() + " n=" + std::to_string(n));
  auto gate = roundTo<TI>(randomVector(size_t(n), 11, -5.0f, 5.0f));
  auto up = roundTo<TI>(randomVector(size_t(n), 12, -2.0f, 2.0f));
  auto dout = roundTo<TG>(randomVector(size_t(n), 13, -1.0f, 1.0f));
  std::vector<float> silu(n), t(n), wantGate(n), wantUp(n);
  tessel::rt::siluForward(gate.data(), silu.data(), n);
  tessel::rt::mulBroadcast(dout.data(), silu.data(), wantUp.data(), n, n);
  tessel::rt::mulBroadcast(dout.data(), up.data(), t.data(), n, n);
  tessel::rt::siluBackward(gate.data(), t.data(), wantGate.data(), n);
  DeviceArray<TI> dgate(gate), dup(up);
  DeviceArray<TG> ddout(dout);
  DeviceArray<TO> gradGate(n), gradUp(n);
  sync();
  swigluBackward(dgate.get(), dup.get(), ddout.get(), gradGate.get(),
                 gradUp.get(), n);
  expectClose(gradGate.download(), wantGate, rtolFor<TO>(), 1e-5,
              "the gate's gradient");
  expectClose(gradUp.download(), wantUp, rtolFor<TO>(), 1e-5, "up's gradient");
}

TEST(CudaElementwise, SwigluBackward) {
  for (int64_t n : {int64_t(50001), int64_t(50000)}) {
    checkSwigluBackward<float, float, float>(n);
    checkSwigluBackward<bf16, bf16, bf16>(n);
    checkSwigluBackward<bf16, float, float>(n);
  }
}

template <typename TI, typename TO> void checkCopy(int64_t n) {
  SCOPED_TRACE(std::string(typeName<TI>()) + "->" + typeName<TO>() +
               " n=" + std::to_string(n));
  auto x = roundTo<TI>(randomVector(size_t(n), 10, -100.0f, 100.0f));
  DeviceArray<TI> dx(x);
  DeviceArray<TO> out(n);
  sync();
  copy(dx.get(), out.get(), n);
  expectClose(out.download(), roundTo<TO>(x), 0, 0, "copy");
}

TEST(CudaElementwise, CopyFill) {
  for (int64_t n : {int64_t(70001), int64_t(70000)}) {
    checkCopy<float, float>(n);
    checkCopy<float, bf16>(n);
    checkCopy<bf16, float>(n);
    checkCopy<bf16, bf16>(n);
  }

  DeviceArray<float> f(1000);
  sync();
  fill(f.get(), 999, 0.3f);
  std::vector<float> want(1000, 0.3f);
  want[999] = 0.0f;
  expectClose(f.download(), want, 0, 0, "fill f32");
  DeviceArray<bf16> h(1000);
  sync();
  fill(h.get(), 1000, 0.3f);
  expectClose(h.download(), roundTo<bf16>(std::vector<float>(1000, 0.3f)), 0, 0,
              "fill bf16");
}

void checkAccumulate(int64_t n) {
  SCOPED_TRACE("n=" + std::to_string(n));
  auto a = randomVector(size_t(n), 11), b = randomVector(size_t(n), 12);
  std::vector<float> want(n);
  tessel::rt::accumulateSum(a.data(), want.data(), true, n);
  tessel::rt::accumulateSum(b.data(), want.data(), false, n);
  DeviceArray<float> da(a), db(b), acc(n);
  sync();
  fill(acc.get(), n, 5.0f);
  accumulateInto(da.get(), acc.get(), n, true);
  accumulateInto(db.get(), acc.get(), n, false);
  expectClose(acc.download(), want, 0, 0, "accumulateInto f32");

  auto ah = roundTo<bf16>(a), bh = roundTo<bf16>(b);
  tessel::rt::accumulateSum(ah.data(), want.data(), true, n);
  tessel::rt::accumulateSum(bh.data(), want.data(), false, n);
  DeviceArray<bf16> dah(ah), dbh(bh);
  sync();
  accumulateInto(dah.get(), acc.get(), n, true);
  accumulateInto(dbh.get(), acc.get(), n, false);
  expectClose(acc.download(), want, 0, 0, "accumulateInto bf16");
}

TEST(CudaElementwise, AccumulateInto) {
  checkAccumulate(30011);
  checkAccumulate(30008);
}

//===--- Layout -----------------------------------------------------------===//

template <typename TI, typename TO>
void checkTranspose(const std::vector<int64_t> &shape,
                    const std::vector<int64_t> &perm) {
  std::string trace =
      std::string(typeName<TI>()) + "->" + typeName<TO>() + " perm";
  for (int64_t p : perm)
    trace += " " + std::to_string(p);
  SCOPED_TRACE(trace);
  const int rank = int(shape.size());
  const int64_t total = std::accumulate(shape.begin(), shape.end(), int64_t(1),
                                        std::multiplies<int64_t>());
  auto x = roundTo<TI>(randomVector(size_t(total), 13));
  std::vector<float> want(total);
  tessel::rt::transpose(x.data(), want.data(), shape.data(), perm.data(), rank);
  DeviceArray<TI> dx(x);
  DeviceArray<TO> out(total);
  sync();
  transpose(dx.get(), out.get(), shape.data(), perm.data(), rank);
  expectClose(out.download(), roundTo<TO>(want), 0, 0, "transpose");
}

TEST(CudaElementwise, Transpose) {
  checkTranspose<float, float>({3, 4, 5, 6}, {2, 0, 3, 1});
  checkTranspose<bf16, bf16>({3, 4, 5, 6}, {2, 0, 3, 1});
  checkTranspose<float, bf16>({3, 4, 5, 6}, {2, 0, 3, 1});
  checkTranspose<float, float>({2, 3, 4, 5, 2, 3}, {5, 3, 1, 0, 4, 2});
  checkTranspose<float, float>({67, 45}, {1, 0});
  checkTranspose<float, float>({4, 5, 6}, {0, 1, 2});
  checkTranspose<bf16, float>({4, 5, 6}, {0, 1, 2});
  checkTranspose<float, float>({1, 1, 5}, {2, 1, 0});
  checkTranspose<float, float>({2, 8, 3, 16}, {0, 2, 1, 3}); // heads split
  // Rank 7 with size-1 dimensions: 5 dimensions remain after dropping them.
  checkTranspose<float, float>({2, 1, 3, 1, 2, 2, 3}, {6, 5, 4, 3, 2, 1, 0});
  checkTranspose<float, float>({13}, {0});
}

// `shift` elements into both device buffers: a pointer that is not 16-byte
// aligned takes the one-element path.
template <typename TI, typename TO>
void checkSliceInsert(int64_t outer, int64_t axis, int64_t inner,
                      int64_t start, int64_t len, int64_t shift = 0) {
  SCOPED_TRACE(std::string(typeName<TI>()) + "->" + typeName<TO>() + " [" +
               std::to_string(outer) + ", " + std::to_string(axis) + ", " +
               std::to_string(inner) + "] from " + std::to_string(start) +
               " len " + std::to_string(len) + " shift " +
               std::to_string(shift));
  auto x = roundTo<TI>(randomVector(size_t(outer * axis * inner), 14));
  std::vector<float> want(outer * len * inner);
  tessel::rt::sliceAxis(x.data(), want.data(), outer, axis, inner, start, len);
  x.insert(x.begin(), size_t(shift), 0.0f);
  DeviceArray<TI> dx(x);
  DeviceArray<TO> part(shift + outer * len * inner);
  sync();
  sliceAxis(dx.get() + shift, part.get() + shift, outer, axis, inner, start,
            len);
  auto got = part.download();
  got.erase(got.begin(), got.begin() + shift);
  expectClose(got, roundTo<TO>(want), 0, 0, "sliceAxis");

  // insertAxis leaves the rest of the output as it was.
  auto y = roundTo<TI>(randomVector(size_t(outer * len * inner), 15));
  auto before = roundTo<TO>(randomVector(size_t(outer * axis * inner), 16));
  std::vector<float> wantFull = before;
  tessel::rt::insertAxis(y.data(), wantFull.data(), outer, axis, inner, start,
                         len);
  y.insert(y.begin(), size_t(shift), 0.0f);
  before.insert(before.begin(), size_t(shift), 0.0f);
  DeviceArray<TI> dy(y);
  DeviceArray<TO> full(before);
  sync();
  insertAxis(dy.get() + shift, full.get() + shift, outer, axis, inner, start,
             len);
  auto gotFull = full.download();
  gotFull.erase(gotFull.begin(), gotFull.begin() + shift);
  expectClose(gotFull, roundTo<TO>(wantFull), 0, 0, "insertAxis");
}

TEST(CudaElementwise, SliceInsertAxis) {
  // One element at a time (sizes not multiples of 8).
  checkSliceInsert<float, float>(3, 10, 7, 4, 5);
  checkSliceInsert<bf16, bf16>(3, 10, 7, 4, 5);
  checkSliceInsert<float, bf16>(3, 10, 7, 4, 5);
  // In 16-byte vectors: q, k and v out of a fused projection's rows (inner
  // 1, every size a multiple of 8), and heads of 8 along a middle axis.
  checkSliceInsert<float, float>(37, 96, 1, 32, 32);
  checkSliceInsert<bf16, bf16>(37, 96, 1, 64, 32);
  checkSliceInsert<bf16, float>(37, 96, 1, 0, 32);
  checkSliceInsert<float, bf16>(5, 6, 8, 2, 3);
  // The same sizes off alignment: the one-element path.
  checkSliceInsert<float, float>(37, 96, 1, 32, 32, 1);
  checkSliceInsert<bf16, bf16>(5, 6, 8, 2, 3, 3);
}

// A sequence into the balanced order of context parallelism and back, as
// the CPU kernel does it.
template <typename TI, typename TO>
void checkZigzag(int64_t outer, int64_t len, int64_t inner, int64_t pieces) {
  SCOPED_TRACE(std::string(typeName<TI>()) + "->" + typeName<TO>() + " [" +
               std::to_string(outer) + ", " + std::to_string(len) + ", " +
               std::to_string(inner) + "] in " + std::to_string(pieces) +
               " pieces");
  auto x = roundTo<TI>(randomVector(size_t(outer * len * inner), 19));
  for (bool inverse : {false, true}) {
    std::vector<float> want(x.size());
    tessel::rt::zigzag(x.data(), want.data(), outer, len, inner, pieces,
                       inverse);
    DeviceArray<TI> dx(x);
    DeviceArray<TO> out(x.size());
    sync();
    zigzag(dx.get(), out.get(), outer, len, inner, pieces, inverse);
    expectClose(out.download(), roundTo<TO>(want), 0, 0,
                inverse ? "zigzag inverse" : "zigzag");
  }
}

TEST(CudaElementwise, Zigzag) {
  checkZigzag<float, float>(3, 12, 7, 3);
  checkZigzag<bf16, bf16>(8, 64, 32, 2);
  checkZigzag<float, bf16>(2, 16, 5, 4);
}

//===--- Embedding --------------------------------------------------------===//

template <typename TT, typename TO>
void checkEmbeddingForward(int64_t V, int64_t C, int64_t n) {
  SCOPED_TRACE(std::string(typeName<TT>()) + "->" + typeName<TO>());
  auto table = roundTo<TT>(randomVector(size_t(V * C), 17));
  auto ids = randomIds(size_t(n), 0, int32_t(V), 18);
  std::vector<float> want(n * C);
  tessel::rt::embeddingForward(table.data(), ids.data(), want.data(), n, V, C);
  DeviceArray<TT> dtable(table);
  DeviceIds dids(ids);
  DeviceArray<TO> out(n * C);
  sync();
  embeddingForward(dtable.get(), dids.get(), out.get(), n, V, C);
  expectClose(out.download(), roundTo<TO>(want), 0, 0, "embeddingForward");

  // This rank holds rows [vStart, vStart + Vl); others give zero rows.
  const int64_t vStart = V / 3, Vl = V / 2;
  tessel::rt::embeddingForwardRange(table.data() + vStart * C, ids.data(),
                                    want.data(), n, vStart, Vl, C);
  fill(out.get(), n * C, 9.0f);
  embeddingForwardRange(dtable.get() + vStart * C, dids.get(), out.get(), n,
                        vStart, Vl, C);
  expectClose(out.download(), roundTo<TO>(want), 0, 0, "embeddingForwardRange");
}

TEST(CudaElementwise, EmbeddingForward) {
  checkEmbeddingForward<float, float>(1000, 300, 3001);
  checkEmbeddingForward<bf16, bf16>(1000, 300, 3001);
  checkEmbeddingForward<float, bf16>(1000, 300, 3001);
}

// The CUDA kernel adds each row's contributions in ascending i in fp32, as
// the CPU does, so fp32 tables match the CPU exactly; bf16 tables carry one
// rounding of that sum.
template <typename TG, typename TO>
void checkEmbeddingBackward(int64_t V, int64_t C, int64_t n, uint32_t seed) {
  SCOPED_TRACE(std::string(typeName<TG>()) + "->" + typeName<TO>() +
               " V=" + std::to_string(V) + " C=" + std::to_string(C) +
               " n=" + std::to_string(n));
  const double rtol = std::is_same_v<TO, float> ? 0.0 : rtolFor<TO>();
  auto dout = roundTo<TG>(randomVector(size_t(n * C), seed));
  auto ids = randomIds(size_t(n), 0, int32_t(V), seed + 1);
  // A frequent id, as real token streams have.
  for (size_t i = 0; i < ids.size(); i += 3)
    ids[i] = int32_t(V / 2);
  std::vector<float> want(V * C);
  tessel::rt::embeddingBackward(ids.data(), dout.data(), want.data(), n, V, C);
  DeviceArray<TG> ddout(dout);
  DeviceIds dids(ids);
  DeviceArray<TO> dtable(V * C);
  sync();
  fill(dtable.get(), V * C, 123.0f); // rows no id touches must be zeroed
  embeddingBackward(dids.get(), ddout.get(), dtable.get(), n, V, C);
  auto first = dtable.download();
  expectClose(first, roundTo<TO>(want), rtol, 0, "embeddingBackward");
  fill(dtable.get(), V * C, -5.0f);
  embeddingBackward(dids.get(), ddout.get(), dtable.get(), n, V, C);
  expectBitwiseEqual(dtable.download(), first, "embeddingBackward");

  // Range variant: ids outside [vStart, vStart + Vl) contribute nothing.
  const int64_t vStart = V / 3, Vl = V - V / 3 - 1;
  std::vector<float> wantRange(Vl * C);
  tessel::rt::embeddingBackwardRange(ids.data(), dout.data(), wantRange.data(),
                                     n, vStart, Vl, C);
  DeviceArray<TO> dpart(Vl * C);
  sync();
  fill(dpart.get(), Vl * C, 123.0f);
  embeddingBackwardRange(dids.get(), ddout.get(), dpart.get(), n, vStart, Vl,
                         C);
  expectClose(dpart.download(), roundTo<TO>(wantRange), rtol, 0,
              "embeddingBackwardRange");

  // Summed over two microbatches in place, against the CPU kernels doing
  // the same (each entry adds its contributions, in ascending i, to what
  // it holds): the first run zeroes the table, the second adds.
  if constexpr (std::is_same_v<TO, float>) {
    std::vector<float> wantSum(V * C, 7.0f), wantRangeSum(Vl * C, 7.0f);
    fill(dtable.get(), V * C, 7.0f);
    fill(dpart.get(), Vl * C, 7.0f);
    for (bool firstRun : {true, false}) {
      tessel::rt::embeddingBackwardAccumulate(
          ids.data(), dout.data(), wantSum.data(), firstRun, n, V, C);
      tessel::rt::embeddingBackwardRangeAccumulate(ids.data(), dout.data(),
                                                   wantRangeSum.data(),
                                                   firstRun, n, vStart, Vl, C);
      embeddingBackwardAccumulate(dids.get(), ddout.get(), dtable.get(),
                                  firstRun, n, V, C);
      embeddingBackwardRangeAccumulate(dids.get(), ddout.get(), dpart.get(),
                                       firstRun, n, vStart, Vl, C);
    }
    expectBitwiseEqual(dtable.download(), wantSum,
                       "embeddingBackwardAccumulate");
    expectBitwiseEqual(dpart.download(), wantRangeSum,
                       "embeddingBackwardRangeAccumulate");
  }
}

TEST(CudaElementwise, EmbeddingBackward) {
  checkEmbeddingBackward<float, float>(1000, 300, 3001, 20);
  checkEmbeddingBackward<float, float>(5, 513, 2000, 22); // many repeats
  checkEmbeddingBackward<float, float>(70, 31, 17, 24);   // fewer ids than rows
  checkEmbeddingBackward<bf16, float>(1000, 300, 3001, 26);
  checkEmbeddingBackward<bf16, bf16>(1000, 300, 3001, 28);
  checkEmbeddingBackward<float, bf16>(77, 40, 500, 30);
}

} // namespace
} // namespace tessel::cuda::test
