//===- Rope.cpp - Rotary position embedding -------------------------------===//
//
// Hugging Face Llama convention (rotate_half): the pair (i, i + D/2) is rotated
// by angle p * theta^(-2i/D), p the token's position (its index t in the
// sequence for rope, positions[b, t] for ropeAt). The cos/sin table is built
// once per call in double and rounded to T, so that both kernels rotate a
// token at the same position bit for bit alike. With an odd D the last element
// is copied through.
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Kernels.h"
#include "tessel/Runtime/Sequence.h"

#include <cmath>
#include <vector>

namespace tessel::rt {
namespace {

// cos and sin of the angles of `count` positions, [count, D/2] each; row r is
// the angles of position positionOf(r).
template <typename T, typename PositionOf>
void angleTables(int64_t count, PositionOf positionOf, int64_t D, double theta,
                 bool inverse, std::vector<T> &cosT, std::vector<T> &sinT) {
  const int64_t half = D / 2;
  cosT.resize(size_t(count * half));
  sinT.resize(size_t(count * half));
  for (int64_t i = 0; i < half; ++i) {
    const double invFreq = std::pow(theta, -2.0 * double(i) / double(D));
    for (int64_t r = 0; r < count; ++r) {
      const double angle = double(positionOf(r)) * invFreq;
      cosT[size_t(r * half + i)] = T(std::cos(angle));
      sinT[size_t(r * half + i)] =
          T(inverse ? -std::sin(angle) : std::sin(angle));
    }
  }
}

// Rotates the H heads of each of the `rows` tokens of x by the angles of
// table row tableRow(token).
template <typename T, typename TableRow>
void rotate(const T *x, T *out, int64_t rows, int64_t H, int64_t D,
            const std::vector<T> &cosT, const std::vector<T> &sinT,
            TableRow tableRow) {
  const int64_t half = D / 2;
#pragma omp parallel for schedule(static) if (rows * H * D >= (1 << 14))
  for (int64_t bt = 0; bt < rows; ++bt) {
    const T *c = cosT.data() + tableRow(bt) * half;
    const T *s = sinT.data() + tableRow(bt) * half;
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

} // namespace

template <typename T>
void rope(const T *x, T *out, int64_t B, int64_t Tlen, int64_t H, int64_t D,
          double theta, bool inverse, int64_t first, int64_t zigzag,
          int64_t total) {
  if (B <= 0 || Tlen <= 0 || H <= 0 || D <= 0)
    return;
  std::vector<T> cosT, sinT;
  angleTables(
      Tlen,
      [=](int64_t t) { return zigzagPosition(first + t, total, zigzag); }, D,
      theta, inverse, cosT, sinT);
  rotate(x, out, B * Tlen, H, D, cosT, sinT,
         [Tlen](int64_t bt) { return bt % Tlen; });
}

template <typename T>
void ropeAt(const T *x, const int32_t *positions, T *out, int64_t B, int64_t S,
            int64_t H, int64_t D, double theta) {
  if (B <= 0 || S <= 0 || H <= 0 || D <= 0)
    return;
  std::vector<T> cosT, sinT;
  angleTables(
      B * S, [positions](int64_t bt) { return int64_t(positions[bt]); }, D,
      theta, /*inverse=*/false, cosT, sinT);
  rotate(x, out, B * S, H, D, cosT, sinT, [](int64_t bt) { return bt; });
}

#define TESSEL_INSTANTIATE(T)                                                  \
  template void rope<T>(const T *, T *, int64_t, int64_t, int64_t, int64_t,    \
                        double, bool, int64_t, int64_t, int64_t);              \
  template void ropeAt<T>(const T *, const int32_t *, T *, int64_t, int64_t,   \
                          int64_t, int64_t, double);
TESSEL_INSTANTIATE(float)
TESSEL_INSTANTIATE(double)
#undef TESSEL_INSTANTIATE

} // namespace tessel::rt
