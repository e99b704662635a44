//===- Attention.cpp - Scaled dot-product attention with grouped KV heads -===//
//
// q, out, dq: [B, T, H, D]; k, v, dk, dv: [B, Tkv, Hkv, D]. Query head h
// reads KV head h / (H / Hkv). Only one row of scores per thread is ever
// stored. The query rows are positions first .. first + T - 1 of the keys'
// sequence (a context-parallel piece; first = 0 and Tkv = T otherwise).
//
// Forward: every (b, h, t) row is independent; the loop over them is parallel.
// Backward: parallel over (b, h). Each (b, h) accumulates its contribution to
// dk/dv over query positions t in ascending order into its own buffer; the
// buffers of the query heads that share a KV head are then added in ascending
// head order. The result is independent of the number of threads.
//
// Cached (inference): the new tokens' keys and values go into the KV cache
// first; each new token then attends over the cache up to its own position,
// with the forward's row computation, so that a token fed alone agrees with
// its row of the full-sequence forward.
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Kernels.h"
#include "tessel/Runtime/Sequence.h"

#include "RowOps.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

namespace tessel::rt {
namespace {

using detail::dotOf;
using detail::kLanes;
using detail::maxOf;
using detail::sumOf;

// y += a * x
template <typename T> inline void axpy(T a, const T *x, T *y, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    y[i] += a * x[i];
}

// p[j] = softmax_j(scale * q . k_j) for j < n; k rows are kStride apart.
// Returns the row's log-sum-exp of the scaled scores.
template <typename T>
inline T attentionRow(const T *qr, const T *k0, int64_t kStride, int64_t n,
                      int64_t D, T scale, T *p) {
  for (int64_t j = 0; j < n; ++j)
    p[j] = dotOf(qr, k0 + j * kStride, D) * scale;
  const T m = maxOf(p, n);
  detail::expShifted(p, m, p, n);
  const T sum = sumOf(p, n);
  const T inv = T(1) / sum;
  for (int64_t j = 0; j < n; ++j)
    p[j] *= inv;
  return m + std::log(sum);
}

// outr = sum_j p[j] * v_j over the first n positions, p the row's
// probabilities (scratch of n elements). Returns the row's log-sum-exp.
template <typename T>
inline T attendRow(const T *qr, const T *k0, const T *v0, int64_t kStride,
                   int64_t n, int64_t D, T scale, T *p, T *outr) {
  const T lse = attentionRow(qr, k0, kStride, n, D, scale, p);
  for (int64_t d = 0; d < D; ++d)
    outr[d] = T(0);
  for (int64_t j = 0; j < n; ++j)
    axpy(p[j], v0 + j * kStride, outr, D);
  return lse;
}

// The query rows must lie inside the keys' sequence (cut into 2 x zigzag
// chunks when it is in the balanced order).
void checkQueryRows(const char *what, int64_t Tlen, int64_t Tkv,
                    int64_t first, int64_t zigzag) {
  if (zigzag < 0 || (zigzag > 0 && Tkv % (2 * zigzag) != 0))
    throw std::runtime_error(std::string(what) + ": " + std::to_string(Tkv) +
                             " keys are not 2 x " + std::to_string(zigzag) +
                             " chunks");
  if (first < 0 || first + Tlen > Tkv)
    throw std::runtime_error(std::string(what) + ": query rows " +
                             std::to_string(first) + " .. " +
                             std::to_string(first + Tlen - 1) +
                             " lie outside the " + std::to_string(Tkv) +
                             " keys");
}

} // namespace

template <typename T>
void attentionForward(const T *q, const T *k, const T *v, T *out, T *lse,
                      int64_t B, int64_t Tlen, int64_t H, int64_t Hkv,
                      int64_t D, bool causal, int64_t kvLen, int64_t first,
                      int64_t zigzag) {
  if (B <= 0 || Tlen <= 0 || H <= 0 || D <= 0)
    return;
  const int64_t Tkv = kvLen > 0 ? kvLen : Tlen;
  checkQueryRows("attentionForward", Tlen, Tkv, first, zigzag);
  const int64_t group = H / Hkv;
  const T scale = T(1.0 / std::sqrt(double(D)));
  const int64_t kStride = Hkv * D; // between positions of one KV head
  const int64_t total = B * H * Tlen;
#pragma omp parallel if (total * Tkv * D >= (1 << 15))
  {
    std::vector<T> p(static_cast<size_t>(Tkv));
    // Rows are ordered (b, h, t); small static chunks interleave short and
    // long causal rows between threads.
#pragma omp for schedule(static, 8)
    for (int64_t idx = 0; idx < total; ++idx) {
      const int64_t t = idx % Tlen;
      const int64_t h = (idx / Tlen) % H;
      const int64_t b = idx / (Tlen * H);
      const int64_t g = h / group;
      const T *qr = q + ((b * Tlen + t) * H + h) * D;
      const T *k0 = k + (b * Tkv * Hkv + g) * D;
      const T *v0 = v + (b * Tkv * Hkv + g) * D;
      T *outr = out + ((b * Tlen + t) * H + h) * D;
      const T rowLse = attendRow(
          qr, k0, v0, kStride,
          causal ? zigzagPosition(first + t, Tkv, zigzag) + 1 : Tkv, D, scale,
          p.data(), outr);
      if (lse)
        lse[idx] = rowLse; // idx is (b, h, t): lse is [B, H, T]
    }
  }
}

template <typename T>
void cachedAttention(const T *q, const T *k, const T *v, T *kCache, T *vCache,
                     const int32_t *positions, T *out, int64_t B, int64_t S,
                     int64_t Tmax, int64_t H, int64_t Hkv, int64_t D) {
  if (B <= 0 || S <= 0 || Tmax <= 0 || H <= 0 || D <= 0)
    return;
  const int64_t kStride = Hkv * D; // between positions of one KV head
  for (int64_t bs = 0; bs < B * S; ++bs) {
    const int64_t b = bs / S;
    const int64_t row = b * Tmax + positions[bs];
    for (int64_t i = 0; i < kStride; ++i) {
      kCache[row * kStride + i] = k[bs * kStride + i];
      vCache[row * kStride + i] = v[bs * kStride + i];
    }
  }
  const int64_t group = H / Hkv;
  const T scale = T(1.0 / std::sqrt(double(D)));
  const int64_t total = B * S * H;
#pragma omp parallel if (total * Tmax * D >= (1 << 15))
  {
    std::vector<T> p(static_cast<size_t>(Tmax));
#pragma omp for schedule(static)
    for (int64_t idx = 0; idx < total; ++idx) {
      const int64_t h = idx % H;
      const int64_t bs = idx / H;
      const int64_t b = bs / S;
      const int64_t g = h / group;
      const T *qr = q + idx * D;
      const T *k0 = kCache + (b * Tmax * Hkv + g) * D;
      const T *v0 = vCache + (b * Tmax * Hkv + g) * D;
      T *outr = out + idx * D;
      attendRow(qr, k0, v0, kStride, int64_t(positions[bs]) + 1, D, scale,
                p.data(), outr);
    }
  }
}

// With P = softmax(S), S = scale * Q K^T, O = P V:
//   dV = P^T dO,  dP = dO V^T,  dS = P * (dP - rowsum(P * dP)),
//   dQ = scale * dS K,  dK = scale * dS^T Q,
// P = exp(S - LSE) from the forward's log-sum-exp and rowsum(P * dP) =
// rowsum(dO * O) from its output.
template <typename T>
void attentionBackward(const T *q, const T *k, const T *v, const T *out,
                       const T *lse, const T *dout, T *dq, T *dk, T *dv,
                       int64_t B, int64_t Tlen, int64_t H, int64_t Hkv,
                       int64_t D, bool causal, int64_t kvLen, int64_t first,
                       int64_t zigzag) {
  if (B <= 0 || Tlen <= 0 || H <= 0 || D <= 0)
    return;
  const int64_t Tkv = kvLen > 0 ? kvLen : Tlen;
  checkQueryRows("attentionBackward", Tlen, Tkv, first, zigzag);
  const int64_t group = H / Hkv;
  const T scale = T(1.0 / std::sqrt(double(D)));
  const int64_t kStride = Hkv * D;
  const int64_t qStride = H * D;

  // With one query head per KV head, each (b, h) owns dk/dv[b, :, h, :] and
  // accumulates there directly; otherwise into per-(b, h) buffers [Tkv, D].
  std::vector<T> dkBuf, dvBuf;
  if (group > 1) {
    dkBuf.resize(size_t(B * H * Tkv * D));
    dvBuf.resize(size_t(B * H * Tkv * D));
  }
  const int64_t pairs = B * H;
  const bool par = pairs * Tlen * Tkv * D >= (1 << 15);
#pragma omp parallel if (par)
  {
    std::vector<T> p(static_cast<size_t>(Tkv)), dp(static_cast<size_t>(Tkv));
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < pairs; ++bh) {
      const int64_t b = bh / H, h = bh % H, g = h / group;
      const T *k0 = k + (b * Tkv * Hkv + g) * D;
      const T *v0 = v + (b * Tkv * Hkv + g) * D;
      T *dkAcc, *dvAcc;
      int64_t accStride;
      if (group > 1) {
        dkAcc = dkBuf.data() + bh * Tkv * D;
        dvAcc = dvBuf.data() + bh * Tkv * D;
        accStride = D;
      } else {
        dkAcc = dk + (b * Tkv * Hkv + g) * D;
        dvAcc = dv + (b * Tkv * Hkv + g) * D;
        accStride = kStride;
      }
      for (int64_t j = 0; j < Tkv; ++j)
        for (int64_t d = 0; d < D; ++d) {
          dkAcc[j * accStride + d] = T(0);
          dvAcc[j * accStride + d] = T(0);
        }

      for (int64_t t = 0; t < Tlen; ++t) {
        const T *qr = q + (b * Tlen + t) * qStride + h * D;
        const T *dor = dout + (b * Tlen + t) * qStride + h * D;
        T *dqr = dq + (b * Tlen + t) * qStride + h * D;
        const int64_t n =
            causal ? zigzagPosition(first + t, Tkv, zigzag) + 1 : Tkv;
        for (int64_t j = 0; j < n; ++j)
          p[size_t(j)] = dotOf(qr, k0 + j * kStride, D) * scale;
        detail::expShifted(p.data(), lse[bh * Tlen + t], p.data(), n);
        const T pdp = dotOf(dor, out + (b * Tlen + t) * qStride + h * D, D);
        for (int64_t j = 0; j < n; ++j)
          dp[size_t(j)] = dotOf(dor, v0 + j * kStride, D);
        for (int64_t d = 0; d < D; ++d)
          dqr[d] = T(0);
        for (int64_t j = 0; j < n; ++j) {
          const T pj = p[size_t(j)];
          const T ds = pj * (dp[size_t(j)] - pdp) * scale;
          axpy(ds, k0 + j * kStride, dqr, D);
          axpy(ds, qr, dkAcc + j * accStride, D);
          axpy(pj, dor, dvAcc + j * accStride, D);
        }
      }
    }

    if (group > 1) {
      // dk[b, j, g, :] = buf[b, g*group] + buf[b, g*group + 1] + ... in order.
      const int64_t rowsKV = B * Tkv * Hkv;
#pragma omp for schedule(static)
      for (int64_t idx = 0; idx < rowsKV; ++idx) {
        const int64_t g = idx % Hkv;
        const int64_t j = (idx / Hkv) % Tkv;
        const int64_t b = idx / (Hkv * Tkv);
        T *dkr = dk + idx * D;
        T *dvr = dv + idx * D;
        for (int64_t hh = 0; hh < group; ++hh) {
          const int64_t h = g * group + hh;
          const T *sk = dkBuf.data() + ((b * H + h) * Tkv + j) * D;
          const T *sv = dvBuf.data() + ((b * H + h) * Tkv + j) * D;
          if (hh == 0) {
            for (int64_t d = 0; d < D; ++d) {
              dkr[d] = sk[d];
              dvr[d] = sv[d];
            }
          } else {
            for (int64_t d = 0; d < D; ++d) {
              dkr[d] += sk[d];
              dvr[d] += sv[d];
            }
          }
        }
      }
    }
  }
}

#define TESSEL_INSTANTIATE(T)                                                  \
  template void attentionForward<T>(const T *, const T *, const T *, T *, T *, \
                                    int64_t, int64_t, int64_t, int64_t,        \
                                    int64_t, bool, int64_t, int64_t, int64_t); \
  template void attentionBackward<T>(                                          \
      const T *, const T *, const T *, const T *, const T *, const T *, T *,   \
      T *, T *, int64_t, int64_t, int64_t, int64_t, int64_t, bool, int64_t,    \
      int64_t, int64_t);                                                       \
  template void cachedAttention<T>(const T *, const T *, const T *, T *, T *,  \
                                   const int32_t *, T *, int64_t, int64_t,     \
                                   int64_t, int64_t, int64_t, int64_t);
TESSEL_INSTANTIATE(float)
TESSEL_INSTANTIATE(double)
#undef TESSEL_INSTANTIATE

} // namespace tessel::rt
