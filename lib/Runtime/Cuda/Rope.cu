//===- Rope.cu - Rotary position embedding --------------------------------===//
//
// Hugging Face Llama convention (rotate_half), as lib/Runtime/Kernels/
// Rope.cpp: the pair (i, i + D/2) of each head is rotated by
// angle = t * theta^(-2i/D); inverse rotates by -angle (the backward pass).
//
// One thread per (row b*T + t, pair i) computes the angle, its cosine and
// its sine in double and rounds them to float, exactly as the CPU kernel
// builds its table, then rotates that pair in all H heads. With an odd D the
// last element of each head is copied through.
//
//===----------------------------------------------------------------------===//

#include "Internal.h"

#include "tessel/Runtime/Sequence.h"

namespace tessel::cuda {

using detail::blocksFor;
using detail::fromFloat;
using detail::toFloat;

namespace {

constexpr int kThreads = 256;

template <typename TI, typename TO>
__global__ void ropeKernel(const TI *x, TO *out, int64_t rowsBT, int64_t Tlen,
                           int64_t H, int64_t D, double theta, bool inverse,
                           int64_t first, int64_t zigzag, int64_t sequence) {
  const int64_t half = D / 2;
  // With D == 1 there is no pair, only the copied element.
  const int64_t pairs = half > 0 ? half : 1;
  const int64_t total = rowsBT * pairs;
  for (int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; k < total;
       k += int64_t(blockDim.x) * gridDim.x) {
    const int64_t bt = k / pairs, i = k % pairs;
    const int64_t t = rt::zigzagPosition(first + bt % Tlen, sequence, zigzag);
    float c = 1.0f, s = 0.0f;
    if (i < half) {
      const double invFreq = pow(theta, -2.0 * double(i) / double(D));
      const double angle = double(t) * invFreq;
      double sd, cd;
      sincos(angle, &sd, &cd);
      c = float(cd);
      s = float(inverse ? -sd : sd);
    }
    for (int64_t h = 0; h < H; ++h) {
      const int64_t base = (bt * H + h) * D;
      if (i < half) {
        const float x1 = toFloat(x[base + i]);
        const float x2 = toFloat(x[base + i + half]);
        // Rounded products and sums (no fused multiply-add) as on the CPU:
        // the difference of two products cancels for some inputs.
        out[base + i] =
            fromFloat<TO>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
        out[base + i + half] =
            fromFloat<TO>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
      }
      if (i == 0 && D % 2)
        out[base + D - 1] = fromFloat<TO>(toFloat(x[base + D - 1]));
    }
  }
}

} // namespace

template <typename TI, typename TO>
void rope(const TI *x, TO *out, int64_t B, int64_t Tlen, int64_t H, int64_t D,
          double theta, bool inverse, int64_t first, int64_t zigzag,
          int64_t sequence) {
  if (B <= 0 || Tlen <= 0 || H <= 0 || D <= 0)
    return;
  const int64_t half = D / 2;
  const int64_t total = B * Tlen * (half > 0 ? half : 1);
  ropeKernel<<<blocksFor(total, kThreads), kThreads, 0, computeStream()>>>(
      x, out, B * Tlen, Tlen, H, D, theta, inverse, first, zigzag, sequence);
  TESSEL_CUDA_CHECK(cudaGetLastError());
}

#define TESSEL_INSTANTIATE(A, B)                                               \
  template void rope<A, B>(const A *, B *, int64_t, int64_t, int64_t, int64_t, \
                           double, bool, int64_t, int64_t, int64_t);
TESSEL_CUDA_TYPES2(TESSEL_INSTANTIATE)
#undef TESSEL_INSTANTIATE

} // namespace tessel::cuda
