//===- Rope.cpp - Rotary position embedding -------------------------------===//
//
// Hugging Face Llama convention (rotate_half): the pair (i, i + D/2) is rotated
// by angle t * theta^(-2i/D). The cos/sin table is built once per call in
// double and rounded to T. With an odd D the last element is copied through.
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Kernels.h"

#include <cmath>
#include <vector>

namespace tessel::rt {

template <typename T>
void rope(const T *x, T *out, int64_t B, int64_t Tlen, int64_t H, int64_t D,
          double theta, bool inverse) {
  const int64_t half = D / 2;
  if (B <= 0 || Tlen <= 0 || H <= 0 || D <= 0)
    return;
  std::vector<T> cosT(size_t(Tlen * half)), sinT(size_t(Tlen * half));
  for (int64_t i = 0; i < half; ++i) {
    const double invFreq = std::pow(theta, -2.0 * double(i) / double(D));
    for (int64_t t = 0; t < Tlen; ++t) {
      const double angle = double(t) * invFreq;
      cosT[size_t(t * half + i)] = T(std::cos(angle));
      sinT[size_t(t * half + i)] =
          T(inverse ? -std::sin(angle) : std::sin(angle));
    }
  }
  const int64_t rowsBT = B * Tlen;
#pragma omp parallel for schedule(static) if (rowsBT * H * D >= (1 << 14))
  for (int64_t bt = 0; bt < rowsBT; ++bt) {
    const int64_t t = bt % Tlen;
    const T *c = cosT.data() + t * half;
    const T *s = sinT.data() + t * half;
    for (int64_t h = 0; h < H; ++h) {
      const T *xr = x + (bt * H + h) * D;
      T *outr = out + (bt * H + h) * D;
      for (int64_t i = 0; i < half; ++i) {
        const T x1 = xr[i], x2 = xr[i + half];
        outr[i] = x1 * c[i] - x2 * s[i];
        outr[i + half] = x2 * c[i] + x1 * s[i];
      }
      if (D % 2)
        outr[D - 1] = xr[D - 1];
    }
  }
}

template void rope<float>(const float *, float *, int64_t, int64_t, int64_t,
                          int64_t, double, bool);
template void rope<double>(const double *, double *, int64_t, int64_t, int64_t,
                           int64_t, double, bool);

} // namespace tessel::rt
