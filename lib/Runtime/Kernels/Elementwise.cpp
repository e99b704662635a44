//===- Elementwise.cpp - Pointwise kernels and simple reductions ----------===//
//
// Broadcast add/mul, leading-dimension sums, scaling, GELU, SiLU, copy, fill
// and the sum of squares. Loops are contiguous so -O3 vectorises them; the
// OpenMP loops only start threads when the tensor is large enough to pay for
// it. Every reduction has a fixed order that depends neither on the number of
// threads nor on scheduling.
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Kernels.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace tessel::rt {
namespace {

// Below this many elements a pointwise loop runs on one thread.
constexpr int64_t kParallelMin = 1 << 15;

// exp for float without calls or branches, so that loops using it vectorise
// (glibc's expf is only vectorised under -ffast-math, and floorf not at all
// with trapping math). Cephes' expf: x = n ln2 + r with n rounded to nearest
// by the 1.5 * 2^23 trick, |r| <= ln2/2, a degree-6 polynomial for e^r, and
// 2^(n-1) built in the exponent bits (times 2, so n = 128 does not overflow).
// Relative error below 2 ulp for results in [2e-38, FLT_MAX]; results below
// 2e-38 (x < -86.9) are flushed to 0, x > ln(FLT_MAX) gives inf, NaN
// propagates.
inline float expApprox(float x0) {
  float x = x0 < 88.7228f ? x0 : 88.7228f;
  x = x > -86.9f ? x : -86.9f;
  const float t = x * 1.44269504088896341f + 12582912.0f;
  const float fx = t - 12582912.0f; // round(x / ln2)
  int32_t tBits;
  std::memcpy(&tBits, &t, sizeof(tBits));
  const float r = x - fx * 0.693359375f + fx * 2.12194440e-4f;
  const float z = r * r;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  const int32_t bits = (tBits - 0x4B400000 + 126) << 23; // 2^(n-1)
  float pow2;
  std::memcpy(&pow2, &bits, sizeof(pow2));
  float res = y * pow2 * 2.0f;
  res = x0 < -86.9f ? 0.0f : res;
  res = x0 > 88.7228f ? std::numeric_limits<float>::infinity() : res;
  return x0 == x0 ? res : x0;
}

// Float uses the vectorisable approximations; double (the gradient checks)
// uses libm.
template <typename T> inline T expT(T x) { return std::exp(x); }
template <> inline float expT<float>(float x) { return expApprox(x); }
template <typename T> inline T tanhT(T x) { return std::tanh(x); }
template <> inline float tanhT<float>(float x) {
  return 1.0f - 2.0f / (1.0f + expApprox(2.0f * x));
}

} // namespace

namespace detail {
// out[i] = exp(x[i] - shift); x may equal out. Shared with the softmax,
// cross-entropy and attention kernels (declared there).
void expShifted(const float *x, float shift, float *out, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = expApprox(x[i] - shift);
}
void expShifted(const double *x, double shift, double *out, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = std::exp(x[i] - shift);
}
} // namespace detail

// out[i] = op(a[i], b[i % nb]), with the common shapes (same size, a scalar
// b) as plain loops the compiler vectorises.
template <typename T, typename Op>
static void broadcastBinary(const T *a, const T *b, T *out, int64_t n,
                            int64_t nb, Op op) {
  if (n <= 0)
    return;
  if (nb == n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
    for (int64_t i = 0; i < n; ++i)
      out[i] = op(a[i], b[i]);
    return;
  }
  if (nb == 1) {
    const T s = b[0];
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
    for (int64_t i = 0; i < n; ++i)
      out[i] = op(a[i], s);
    return;
  }
  const int64_t rows = n / nb;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const T *ar = a + r * nb;
    T *outr = out + r * nb;
    for (int64_t j = 0; j < nb; ++j)
      outr[j] = op(ar[j], b[j]);
  }
}

template <typename T>
void addBroadcast(const T *a, const T *b, T *out, int64_t n, int64_t nb) {
  broadcastBinary(a, b, out, n, nb, [](T x, T y) { return x + y; });
}

template <typename T>
void mulBroadcast(const T *a, const T *b, T *out, int64_t n, int64_t nb) {
  broadcastBinary(a, b, out, n, nb, [](T x, T y) { return x * y; });
}

template <typename T>
void reduceSumLeading(const T *x, T *out, int64_t rows, int64_t cols) {
  if (cols <= 0)
    return;
  // Threads own blocks of columns; inside a block rows are added in
  // ascending order, so out[j] = ((x[0,j] + x[1,j]) + x[2,j]) + ... always.
  constexpr int64_t kBlock = 256;
  const int64_t nBlocks = (cols + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t blk = 0; blk < nBlocks; ++blk) {
    const int64_t c0 = blk * kBlock;
    const int64_t c1 = c0 + kBlock < cols ? c0 + kBlock : cols;
    for (int64_t j = c0; j < c1; ++j)
      out[j] = T(0);
    for (int64_t r = 0; r < rows; ++r) {
      const T *xr = x + r * cols;
      for (int64_t j = c0; j < c1; ++j)
        out[j] += xr[j];
    }
  }
}

template <typename T> void scale(const T *x, T *out, int64_t n, T s) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i)
    out[i] = x[i] * s;
}

// GELU with the tanh approximation:
//   gelu(x) = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3).
template <typename T> void geluForward(const T *x, T *out, int64_t n) {
  const T c = T(0.7978845608028654); // sqrt(2/pi)
  const T a = T(0.044715);
#pragma omp parallel for schedule(static) if (n >= kParallelMin / 4)
  for (int64_t i = 0; i < n; ++i) {
    const T xi = x[i];
    const T u = c * (xi + a * xi * xi * xi);
    out[i] = T(0.5) * xi * (T(1) + tanhT(u));
  }
}

// gelu'(x) = 0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) sqrt(2/pi) (1 + 3a x^2).
template <typename T>
void geluBackward(const T *x, const T *dout, T *dx, int64_t n) {
  const T c = T(0.7978845608028654);
  const T a = T(0.044715);
#pragma omp parallel for schedule(static) if (n >= kParallelMin / 4)
  for (int64_t i = 0; i < n; ++i) {
    const T xi = x[i];
    const T x2 = xi * xi;
    const T th = tanhT(c * (xi + a * x2 * xi));
    const T d = T(0.5) * (T(1) + th) +
                T(0.5) * xi * (T(1) - th * th) * c * (T(1) + T(3) * a * x2);
    dx[i] = dout[i] * d;
  }
}

template <typename T> void siluForward(const T *x, T *out, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin / 4)
  for (int64_t i = 0; i < n; ++i) {
    const T xi = x[i];
    out[i] = xi / (T(1) + expT(-xi));
  }
}

// silu'(x) = s (1 + x (1 - s)), s = sigmoid(x).
template <typename T>
void siluBackward(const T *x, const T *dout, T *dx, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin / 4)
  for (int64_t i = 0; i < n; ++i) {
    const T xi = x[i];
    const T s = T(1) / (T(1) + expT(-xi));
    dx[i] = dout[i] * (s * (T(1) + xi * (T(1) - s)));
  }
}

template <typename T>
void swigluBackward(const T *gate, const T *up, const T *dout, T *dgate, T *dup,
                    int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin / 4)
  for (int64_t i = 0; i < n; ++i) {
    const T g = gate[i], d = dout[i];
    const T silu = g / (T(1) + expT(-g));
    const T s = T(1) / (T(1) + expT(-g));
    dup[i] = d * silu;
    dgate[i] = (d * up[i]) * (s * (T(1) + g * (T(1) - s)));
  }
}

template <typename T> void copy(const T *x, T *out, int64_t n) {
  if (n <= 0)
    return;
  if (n < kParallelMin * 8) {
    std::memcpy(out, x, size_t(n) * sizeof(T));
    return;
  }
  constexpr int64_t kChunk = 1 << 16;
  const int64_t nChunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
  for (int64_t ch = 0; ch < nChunks; ++ch) {
    const int64_t i0 = ch * kChunk;
    const int64_t len = i0 + kChunk < n ? kChunk : n - i0;
    std::memcpy(out + i0, x + i0, size_t(len) * sizeof(T));
  }
}

template <typename T> void fill(T *out, int64_t n, T value) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin * 8)
  for (int64_t i = 0; i < n; ++i)
    out[i] = value;
}

// Fixed-size blocks (independent of the thread count) are summed with eight
// interleaved partial sums each; the block sums are then added in ascending
// block order. The result is the same for any number of threads.
template <typename T> double sumSquares(const T *x, int64_t n) {
  if (n <= 0)
    return 0.0;
  constexpr int64_t kBlock = 1 << 14;
  constexpr int kLanes = 8;
  const int64_t nBlocks = (n + kBlock - 1) / kBlock;
  std::vector<double> partial(size_t(nBlocks), 0.0);
#pragma omp parallel for schedule(static) if (nBlocks > 1)
  for (int64_t blk = 0; blk < nBlocks; ++blk) {
    const int64_t i0 = blk * kBlock;
    const int64_t i1 = i0 + kBlock < n ? i0 + kBlock : n;
    double acc[kLanes] = {};
    int64_t i = i0;
    for (; i + kLanes <= i1; i += kLanes)
      for (int l = 0; l < kLanes; ++l) {
        const double v = double(x[i + l]);
        acc[l] += v * v;
      }
    double s = 0.0;
    for (int l = 0; l < kLanes; ++l)
      s += acc[l];
    for (; i < i1; ++i)
      s += double(x[i]) * double(x[i]);
    partial[size_t(blk)] = s;
  }
  double total = 0.0;
  for (int64_t blk = 0; blk < nBlocks; ++blk)
    total += partial[size_t(blk)];
  return total;
}

#define TESSEL_INSTANTIATE(T)                                                  \
  template void addBroadcast<T>(const T *, const T *, T *, int64_t, int64_t);  \
  template void mulBroadcast<T>(const T *, const T *, T *, int64_t, int64_t);  \
  template void reduceSumLeading<T>(const T *, T *, int64_t, int64_t);         \
  template void scale<T>(const T *, T *, int64_t, T);                          \
  template void geluForward<T>(const T *, T *, int64_t);                       \
  template void geluBackward<T>(const T *, const T *, T *, int64_t);           \
  template void siluForward<T>(const T *, T *, int64_t);                       \
  template void siluBackward<T>(const T *, const T *, T *, int64_t);           \
  template void swigluBackward<T>(const T *, const T *, const T *, T *, T *,   \
                                  int64_t);                                    \
  template void copy<T>(const T *, T *, int64_t);                              \
  template void fill<T>(T *, int64_t, T);                                      \
  template double sumSquares<T>(const T *, int64_t);
TESSEL_INSTANTIATE(float)
TESSEL_INSTANTIATE(double)
#undef TESSEL_INSTANTIATE

template <typename T>
void accumulateSum(const T *src, T *acc, bool first, int64_t n) {
  if (first) {
    std::memcpy(acc, src, n * sizeof(T));
    return;
  }
#pragma omp parallel for schedule(static) if (n >= (1 << 16))
  for (int64_t i = 0; i < n; ++i)
    acc[i] += src[i];
}

void zeroSums(double *sums, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    sums[i] = 0.0;
}

template <typename T>
void addSumOfSquares(const T *x, double *sum, int64_t n) {
  sum[0] += sumSquares(x, n);
}

template <typename T>
void normFromSums(const double *sums, T *out, int64_t parts) {
  double total = 0.0;
  for (int64_t i = 0; i < parts; ++i)
    total += sums[i];
  out[0] = static_cast<T>(std::sqrt(total));
}

#define TESSEL_INSTANTIATE(T)                                                  \
  template void accumulateSum<T>(const T *, T *, bool, int64_t);               \
  template void addSumOfSquares<T>(const T *, double *, int64_t);              \
  template void normFromSums<T>(const double *, T *, int64_t);
TESSEL_INSTANTIATE(float)
TESSEL_INSTANTIATE(double)
#undef TESSEL_INSTANTIATE

} // namespace tessel::rt
