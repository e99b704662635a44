//===- Reference.cpp - Naive reference kernels for the tests --------------===//
//
// Straightforward loops, computed in double, single-threaded. See
// KernelsRef.h. Only the unit tests use these.
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/KernelsRef.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace tessel::rt::ref {

template <typename T>
void matmul(const T *A, const T *B, T *C, int64_t batch, int64_t M, int64_t N,
            int64_t K, bool transA, bool transB, int64_t strideA,
            int64_t strideB, int64_t strideC, bool accumulate) {
  for (int64_t b = 0; b < batch; ++b) {
    const T *Ab = A + b * strideA;
    const T *Bb = B + b * strideB;
    T *Cb = C + b * strideC;
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) {
          const double a = transA ? Ab[k * M + i] : Ab[i * K + k];
          const double bb = transB ? Bb[j * K + k] : Bb[k * N + j];
          s += a * bb;
        }
        Cb[i * N + j] = T(accumulate ? double(Cb[i * N + j]) + s : s);
      }
  }
}

template <typename T>
void addBroadcast(const T *a, const T *b, T *out, int64_t n, int64_t nb) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = T(double(a[i]) + double(b[i % nb]));
}

template <typename T>
void mulBroadcast(const T *a, const T *b, T *out, int64_t n, int64_t nb) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = T(double(a[i]) * double(b[i % nb]));
}

template <typename T>
void reduceSumLeading(const T *x, T *out, int64_t rows, int64_t cols) {
  for (int64_t j = 0; j < cols; ++j) {
    double s = 0;
    for (int64_t r = 0; r < rows; ++r)
      s += x[r * cols + j];
    out[j] = T(s);
  }
}

template <typename T> void scale(const T *x, T *out, int64_t n, T s) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = T(double(x[i]) * double(s));
}

static double geluRef(double x) {
  const double c = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(c * (x + 0.044715 * x * x * x)));
}

static double geluGradRef(double x) {
  const double c = std::sqrt(2.0 / M_PI);
  const double u = c * (x + 0.044715 * x * x * x);
  const double du = c * (1.0 + 3.0 * 0.044715 * x * x);
  const double th = std::tanh(u);
  return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * du;
}

template <typename T> void geluForward(const T *x, T *out, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = T(geluRef(x[i]));
}

template <typename T>
void geluBackward(const T *x, const T *dout, T *dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    dx[i] = T(double(dout[i]) * geluGradRef(x[i]));
}

template <typename T> void siluForward(const T *x, T *out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double v = x[i];
    out[i] = T(v / (1.0 + std::exp(-v)));
  }
}

template <typename T>
void siluBackward(const T *x, const T *dout, T *dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const double v = x[i];
    const double s = 1.0 / (1.0 + std::exp(-v));
    dx[i] = T(double(dout[i]) * (s + v * s * (1.0 - s)));
  }
}

template <typename T>
void layerNormForward(const T *x, const T *w, const T *b, T *out, int64_t rows,
                      int64_t C, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (int64_t j = 0; j < C; ++j)
      mean += x[r * C + j];
    mean /= double(C);
    for (int64_t j = 0; j < C; ++j)
      var += (x[r * C + j] - mean) * (x[r * C + j] - mean);
    var /= double(C);
    for (int64_t j = 0; j < C; ++j)
      out[r * C + j] =
          T((x[r * C + j] - mean) / std::sqrt(var + eps) * w[j] + b[j]);
  }
}

template <typename T>
void layerNormBackward(const T *x, const T *w, const T *dout, T *dx, T *dw,
                       T *db, int64_t rows, int64_t C, double eps) {
  std::vector<double> dwAcc(size_t(C), 0.0), dbAcc(size_t(C), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (int64_t j = 0; j < C; ++j)
      mean += x[r * C + j];
    mean /= double(C);
    for (int64_t j = 0; j < C; ++j)
      var += (x[r * C + j] - mean) * (x[r * C + j] - mean);
    var /= double(C);
    const double rstd = 1.0 / std::sqrt(var + eps);
    double gMean = 0, gxMean = 0;
    for (int64_t j = 0; j < C; ++j) {
      const double xhat = (x[r * C + j] - mean) * rstd;
      const double g = double(dout[r * C + j]) * w[j];
      gMean += g;
      gxMean += g * xhat;
      dwAcc[size_t(j)] += double(dout[r * C + j]) * xhat;
      dbAcc[size_t(j)] += dout[r * C + j];
    }
    gMean /= double(C);
    gxMean /= double(C);
    for (int64_t j = 0; j < C; ++j) {
      const double xhat = (x[r * C + j] - mean) * rstd;
      const double g = double(dout[r * C + j]) * w[j];
      dx[r * C + j] = T(rstd * (g - gMean - xhat * gxMean));
    }
  }
  for (int64_t j = 0; j < C; ++j) {
    dw[j] = T(dwAcc[size_t(j)]);
    db[j] = T(dbAcc[size_t(j)]);
  }
}

template <typename T>
void rmsNormForward(const T *x, const T *w, T *out, int64_t rows, int64_t C,
                    double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    double ms = 0;
    for (int64_t j = 0; j < C; ++j)
      ms += double(x[r * C + j]) * x[r * C + j];
    ms /= double(C);
    const double rstd = 1.0 / std::sqrt(ms + eps);
    for (int64_t j = 0; j < C; ++j)
      out[r * C + j] = T(x[r * C + j] * rstd * w[j]);
  }
}

template <typename T>
void rmsNormBackward(const T *x, const T *w, const T *dout, T *dx, T *dw,
                     int64_t rows, int64_t C, double eps) {
  std::vector<double> dwAcc(size_t(C), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    double ms = 0;
    for (int64_t j = 0; j < C; ++j)
      ms += double(x[r * C + j]) * x[r * C + j];
    ms /= double(C);
    const double rstd = 1.0 / std::sqrt(ms + eps);
    double gx = 0;
    for (int64_t j = 0; j < C; ++j) {
      gx += double(dout[r * C + j]) * w[j] * x[r * C + j];
      dwAcc[size_t(j)] += double(dout[r * C + j]) * x[r * C + j] * rstd;
    }
    for (int64_t j = 0; j < C; ++j)
      dx[r * C + j] =
          T(rstd * double(dout[r * C + j]) * w[j] -
            double(x[r * C + j]) * rstd * rstd * rstd * gx / double(C));
  }
  for (int64_t j = 0; j < C; ++j)
    dw[j] = T(dwAcc[size_t(j)]);
}

template <typename T>
void rope(const T *x, T *out, int64_t B, int64_t Tlen, int64_t H, int64_t D,
          double theta, bool inverse) {
  const int64_t half = D / 2;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tlen; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t base = ((b * Tlen + t) * H + h) * D;
        for (int64_t i = 0; i < half; ++i) {
          double angle =
              double(t) * std::pow(theta, -2.0 * double(i) / double(D));
          if (inverse)
            angle = -angle;
          const double x1 = x[base + i], x2 = x[base + i + half];
          out[base + i] = T(x1 * std::cos(angle) - x2 * std::sin(angle));
          out[base + i + half] = T(x2 * std::cos(angle) + x1 * std::sin(angle));
        }
        if (D % 2)
          out[base + D - 1] = x[base + D - 1];
      }
}

// Full probability matrix P[t][j] of one (b, h), in double.
template <typename T>
static std::vector<double> attentionProbs(const T *q, const T *k, int64_t b,
                                          int64_t h, int64_t Tlen, int64_t H,
                                          int64_t Hkv, int64_t D, bool causal) {
  const int64_t g = h / (H / Hkv);
  const double scale = 1.0 / std::sqrt(double(D));
  std::vector<double> P(size_t(Tlen * Tlen), 0.0);
  for (int64_t t = 0; t < Tlen; ++t) {
    const int64_t n = causal ? t + 1 : Tlen;
    double m = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t d = 0; d < D; ++d)
        s += double(q[((b * Tlen + t) * H + h) * D + d]) *
             k[((b * Tlen + j) * Hkv + g) * D + d];
      P[size_t(t * Tlen + j)] = s * scale;
      m = std::fmax(m, s * scale);
    }
    double sum = 0;
    for (int64_t j = 0; j < n; ++j) {
      P[size_t(t * Tlen + j)] = std::exp(P[size_t(t * Tlen + j)] - m);
      sum += P[size_t(t * Tlen + j)];
    }
    for (int64_t j = 0; j < n; ++j)
      P[size_t(t * Tlen + j)] /= sum;
  }
  return P;
}

template <typename T>
void attentionForward(const T *q, const T *k, const T *v, T *out, int64_t B,
                      int64_t Tlen, int64_t H, int64_t Hkv, int64_t D,
                      bool causal) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / Hkv);
      const std::vector<double> P =
          attentionProbs(q, k, b, h, Tlen, H, Hkv, D, causal);
      for (int64_t t = 0; t < Tlen; ++t)
        for (int64_t d = 0; d < D; ++d) {
          double s = 0;
          for (int64_t j = 0; j < Tlen; ++j)
            s +=
                P[size_t(t * Tlen + j)] * v[((b * Tlen + j) * Hkv + g) * D + d];
          out[((b * Tlen + t) * H + h) * D + d] = T(s);
        }
    }
}

template <typename T>
void attentionBackward(const T *q, const T *k, const T *v, const T *dout, T *dq,
                       T *dk, T *dv, int64_t B, int64_t Tlen, int64_t H,
                       int64_t Hkv, int64_t D, bool causal) {
  const double scale = 1.0 / std::sqrt(double(D));
  std::vector<double> dkAcc(size_t(B * Tlen * Hkv * D), 0.0);
  std::vector<double> dvAcc(size_t(B * Tlen * Hkv * D), 0.0);
  auto qi = [&](int64_t b, int64_t t, int64_t h, int64_t d) {
    return ((b * Tlen + t) * H + h) * D + d;
  };
  auto ki = [&](int64_t b, int64_t t, int64_t g, int64_t d) {
    return ((b * Tlen + t) * Hkv + g) * D + d;
  };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / Hkv);
      const std::vector<double> P =
          attentionProbs(q, k, b, h, Tlen, H, Hkv, D, causal);
      // dP = dO V^T, dS = P * (dP - rowsum(P * dP)).
      std::vector<double> dS(size_t(Tlen * Tlen), 0.0);
      for (int64_t t = 0; t < Tlen; ++t) {
        std::vector<double> dP(size_t(Tlen), 0.0);
        double rowsum = 0;
        for (int64_t j = 0; j < Tlen; ++j) {
          for (int64_t d = 0; d < D; ++d)
            dP[size_t(j)] += double(dout[qi(b, t, h, d)]) * v[ki(b, j, g, d)];
          rowsum += P[size_t(t * Tlen + j)] * dP[size_t(j)];
        }
        for (int64_t j = 0; j < Tlen; ++j)
          dS[size_t(t * Tlen + j)] =
              P[size_t(t * Tlen + j)] * (dP[size_t(j)] - rowsum);
      }
      for (int64_t t = 0; t < Tlen; ++t)
        for (int64_t d = 0; d < D; ++d) {
          double s = 0;
          for (int64_t j = 0; j < Tlen; ++j)
            s += dS[size_t(t * Tlen + j)] * k[ki(b, j, g, d)];
          dq[qi(b, t, h, d)] = T(scale * s);
        }
      for (int64_t j = 0; j < Tlen; ++j)
        for (int64_t d = 0; d < D; ++d)
          for (int64_t t = 0; t < Tlen; ++t) {
            dkAcc[size_t(ki(b, j, g, d))] +=
                scale * dS[size_t(t * Tlen + j)] * q[qi(b, t, h, d)];
            dvAcc[size_t(ki(b, j, g, d))] +=
                P[size_t(t * Tlen + j)] * dout[qi(b, t, h, d)];
          }
    }
  for (size_t i = 0; i < dkAcc.size(); ++i) {
    dk[i] = T(dkAcc[i]);
    dv[i] = T(dvAcc[i]);
  }
}

template <typename T>
void softmaxForward(const T *x, T *out, int64_t rows, int64_t cols,
                    double scale, bool causal) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = causal ? r % cols + 1 : cols;
    double m = -INFINITY, sum = 0;
    for (int64_t j = 0; j < n; ++j)
      m = std::fmax(m, scale * x[r * cols + j]);
    for (int64_t j = 0; j < n; ++j)
      sum += std::exp(scale * x[r * cols + j] - m);
    for (int64_t j = 0; j < cols; ++j)
      out[r * cols + j] =
          j < n ? T(std::exp(scale * x[r * cols + j] - m) / sum) : T(0);
  }
}

template <typename T>
void softmaxBackward(const T *y, const T *dy, T *dx, int64_t rows,
                     int64_t cols, double scale) {
  for (int64_t r = 0; r < rows; ++r) {
    double s = 0;
    for (int64_t j = 0; j < cols; ++j)
      s += double(dy[r * cols + j]) * y[r * cols + j];
    for (int64_t j = 0; j < cols; ++j)
      dx[r * cols + j] = T(scale * y[r * cols + j] * (dy[r * cols + j] - s));
  }
}

template <typename T>
void crossEntropyForward(const T *logits, const int32_t *targets, T *loss,
                         int64_t rows, int64_t V) {
  double total = 0;
  for (int64_t r = 0; r < rows; ++r) {
    double m = -INFINITY, sum = 0;
    for (int64_t j = 0; j < V; ++j)
      m = std::fmax(m, double(logits[r * V + j]));
    for (int64_t j = 0; j < V; ++j)
      sum += std::exp(logits[r * V + j] - m);
    total += -(logits[r * V + targets[r]] - m - std::log(sum));
  }
  loss[0] = T(rows > 0 ? total / double(rows) : 0.0);
}

template <typename T>
void crossEntropyBackward(const T *logits, const int32_t *targets,
                          const T *dloss, T *dlogits, int64_t rows, int64_t V) {
  for (int64_t r = 0; r < rows; ++r) {
    double m = -INFINITY, sum = 0;
    for (int64_t j = 0; j < V; ++j)
      m = std::fmax(m, double(logits[r * V + j]));
    for (int64_t j = 0; j < V; ++j)
      sum += std::exp(logits[r * V + j] - m);
    for (int64_t j = 0; j < V; ++j) {
      const double p = std::exp(logits[r * V + j] - m) / sum;
      const double onehot = j == targets[r] ? 1.0 : 0.0;
      dlogits[r * V + j] = T(double(dloss[0]) * (p - onehot) / double(rows));
    }
  }
}

template <typename T>
void embeddingForward(const T *table, const int32_t *ids, T *out, int64_t n,
                      int64_t V, int64_t C) {
  (void)V;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < C; ++j)
      out[i * C + j] = table[int64_t(ids[i]) * C + j];
}

template <typename T>
void embeddingBackward(const int32_t *ids, const T *dout, T *dtable, int64_t n,
                       int64_t V, int64_t C) {
  for (int64_t i = 0; i < V * C; ++i)
    dtable[i] = T(0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < C; ++j)
      dtable[int64_t(ids[i]) * C + j] += dout[i * C + j];
}

template <typename T>
void transpose(const T *x, T *out, const int64_t *shape, const int64_t *perm,
               int rank) {
  std::vector<int64_t> inStride(size_t(rank), 1),
      outShape(static_cast<size_t>(rank));
  for (int d = rank - 2; d >= 0; --d)
    inStride[size_t(d)] = inStride[size_t(d + 1)] * shape[d + 1];
  int64_t total = 1;
  for (int i = 0; i < rank; ++i) {
    outShape[size_t(i)] = shape[perm[i]];
    total *= shape[i];
  }
  std::vector<int64_t> idx(size_t(rank), 0); // output multi-index
  for (int64_t o = 0; o < total; ++o) {
    int64_t rem = o, src = 0;
    for (int i = rank - 1; i >= 0; --i) {
      idx[size_t(i)] = rem % outShape[size_t(i)];
      rem /= outShape[size_t(i)];
      src += idx[size_t(i)] * inStride[size_t(perm[i])];
    }
    out[o] = x[src];
  }
}

template <typename T>
void sliceAxis(const T *x, T *out, int64_t outer, int64_t srcAxis,
               int64_t inner, int64_t start, int64_t len) {
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t a = 0; a < len; ++a)
      for (int64_t i = 0; i < inner; ++i)
        out[(o * len + a) * inner + i] =
            x[(o * srcAxis + start + a) * inner + i];
}

template <typename T>
void insertAxis(const T *x, T *out, int64_t outer, int64_t dstAxis,
                int64_t inner, int64_t start, int64_t len) {
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t a = 0; a < len; ++a)
      for (int64_t i = 0; i < inner; ++i)
        out[(o * dstAxis + start + a) * inner + i] =
            x[(o * len + a) * inner + i];
}

template <typename T> void copy(const T *x, T *out, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = x[i];
}

template <typename T> void fill(T *out, int64_t n, T value) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = value;
}

template <typename T> double sumSquares(const T *x, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i)
    s += double(x[i]) * double(x[i]);
  return s;
}

#define TESSEL_INSTANTIATE(T)                                                  \
  template void matmul<T>(const T *, const T *, T *, int64_t, int64_t,         \
                          int64_t, int64_t, bool, bool, int64_t, int64_t,      \
                          int64_t, bool);                                      \
  template void addBroadcast<T>(const T *, const T *, T *, int64_t, int64_t);  \
  template void mulBroadcast<T>(const T *, const T *, T *, int64_t, int64_t);  \
  template void reduceSumLeading<T>(const T *, T *, int64_t, int64_t);         \
  template void scale<T>(const T *, T *, int64_t, T);                          \
  template void geluForward<T>(const T *, T *, int64_t);                       \
  template void geluBackward<T>(const T *, const T *, T *, int64_t);           \
  template void siluForward<T>(const T *, T *, int64_t);                       \
  template void siluBackward<T>(const T *, const T *, T *, int64_t);           \
  template void layerNormForward<T>(const T *, const T *, const T *, T *,      \
                                    int64_t, int64_t, double);                 \
  template void layerNormBackward<T>(const T *, const T *, const T *, T *,     \
                                     T *, T *, int64_t, int64_t, double);      \
  template void rmsNormForward<T>(const T *, const T *, T *, int64_t, int64_t, \
                                  double);                                     \
  template void rmsNormBackward<T>(const T *, const T *, const T *, T *, T *,  \
                                   int64_t, int64_t, double);                  \
  template void rope<T>(const T *, T *, int64_t, int64_t, int64_t, int64_t,    \
                        double, bool);                                         \
  template void attentionForward<T>(const T *, const T *, const T *, T *,      \
                                    int64_t, int64_t, int64_t, int64_t,        \
                                    int64_t, bool);                            \
  template void attentionBackward<T>(                                          \
      const T *, const T *, const T *, const T *, T *, T *, T *, int64_t,      \
      int64_t, int64_t, int64_t, int64_t, bool);                               \
  template void softmaxForward<T>(const T *, T *, int64_t, int64_t, double,    \
                                  bool);                                       \
  template void softmaxBackward<T>(const T *, const T *, T *, int64_t,         \
                                   int64_t, double);                           \
  template void crossEntropyForward<T>(const T *, const int32_t *, T *,        \
                                       int64_t, int64_t);                      \
  template void crossEntropyBackward<T>(const T *, const int32_t *, const T *, \
                                        T *, int64_t, int64_t);                \
  template void embeddingForward<T>(const T *, const int32_t *, T *, int64_t,  \
                                    int64_t, int64_t);                         \
  template void embeddingBackward<T>(const int32_t *, const T *, T *, int64_t, \
                                     int64_t, int64_t);                        \
  template void transpose<T>(const T *, T *, const int64_t *, const int64_t *, \
                             int);                                             \
  template void sliceAxis<T>(const T *, T *, int64_t, int64_t, int64_t,        \
                             int64_t, int64_t);                                \
  template void insertAxis<T>(const T *, T *, int64_t, int64_t, int64_t,       \
                              int64_t, int64_t);                               \
  template void copy<T>(const T *, T *, int64_t);                              \
  template void fill<T>(T *, int64_t, T);                                      \
  template double sumSquares<T>(const T *, int64_t);
TESSEL_INSTANTIATE(float)
TESSEL_INSTANTIATE(double)
#undef TESSEL_INSTANTIATE

template <typename T>
void moeTopK(const T *probs, int32_t *experts, T *weights, int64_t tokens,
             int64_t E, int64_t k) {
  for (int64_t t = 0; t < tokens; ++t) {
    const T *p = probs + t * E;
    std::vector<int32_t> order(E);
    for (int64_t e = 0; e < E; ++e)
      order[e] = (int32_t)e;
    // Descending; a stable sort keeps the lower expert first on a tie.
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return p[a] > p[b]; });
    double sum = 0;
    for (int64_t s = 0; s < k; ++s)
      sum += double(p[order[s]]);
    for (int64_t s = 0; s < k; ++s) {
      experts[t * k + s] = order[s];
      weights[t * k + s] = T(double(p[order[s]]) / sum);
    }
  }
}

int64_t moeDispatchPlan(const int32_t *experts, int64_t tokens, int64_t k,
                        int64_t E, int64_t capacity, const int64_t *before,
                        int32_t *rowOf, int32_t *offsets) {
  int64_t row = 0;
  for (int64_t a = 0; a < tokens * k; ++a)
    rowOf[a] = -1;
  for (int64_t e = 0; e < E; ++e) {
    offsets[e] = row;
    int64_t taken = before ? before[e] : 0;
    for (int64_t a = 0; a < tokens * k; ++a) {
      if (experts[a] != e)
        continue;
      if (capacity <= 0 || taken < capacity)
        rowOf[a] = (int32_t)row++;
      ++taken;
    }
  }
  offsets[E] = row;
  return row;
}

template <typename T>
void moePermute(const T *x, const int32_t *rowOf, T *xp, int64_t tokens,
                int64_t k, int64_t H) {
  for (int64_t a = 0; a < tokens * k; ++a)
    for (int64_t j = 0; rowOf[a] >= 0 && j < H; ++j)
      xp[rowOf[a] * H + j] = x[(a / k) * H + j];
}

template <typename T>
void moeUnpermute(const T *yp, const int32_t *rowOf, const T *weights, T *y,
                  int64_t tokens, int64_t k, int64_t H) {
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < H; ++j) {
      double s = 0;
      for (int64_t q = 0; q < k; ++q)
        if (rowOf[t * k + q] >= 0)
          s += double(weights[t * k + q]) * double(yp[rowOf[t * k + q] * H + j]);
      y[t * H + j] = T(s);
    }
}

template <typename T>
void groupedMatmul(const T *x, const T *W, T *out, const int32_t *offsets,
                   int64_t E, int64_t K, int64_t N, bool transW,
                   bool accumulate) {
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = offsets[e]; i < offsets[e + 1]; ++i)
      matmul(x + i * K, W + e * K * N, out + i * N, 1, 1, N, K, false, transW,
             0, 0, 0, accumulate);
}

template <typename T>
T moeAuxLoss(const T *probs, const int32_t *experts, int64_t tokens,
             int64_t E, int64_t k, double coef) {
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) {
    double chosen = 0, prob = 0;
    for (int64_t a = 0; a < tokens * k; ++a)
      chosen += experts[a] == e;
    for (int64_t t = 0; t < tokens; ++t)
      prob += double(probs[t * E + e]);
    sum += chosen / double(tokens * k) * (prob / double(tokens));
  }
  return T(coef * double(E) * sum);
}

template <typename T> T moeZLossSum(const T *logits, int64_t tokens, int64_t E) {
  double sum = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    double s = 0;
    for (int64_t e = 0; e < E; ++e)
      s += std::exp(double(logits[t * E + e]));
    sum += std::log(s) * std::log(s);
  }
  return T(sum);
}

#define TESSEL_INSTANTIATE_MOE(T)                                              \
  template void moeTopK<T>(const T *, int32_t *, T *, int64_t, int64_t,        \
                           int64_t);                                           \
  template void moePermute<T>(const T *, const int32_t *, T *, int64_t,        \
                              int64_t, int64_t);                               \
  template void moeUnpermute<T>(const T *, const int32_t *, const T *, T *,    \
                                int64_t, int64_t, int64_t);                    \
  template void groupedMatmul<T>(const T *, const T *, T *, const int32_t *,   \
                                 int64_t, int64_t, int64_t, bool, bool);       \
  template T moeAuxLoss<T>(const T *, const int32_t *, int64_t, int64_t,       \
                           int64_t, double);                                   \
  template T moeZLossSum<T>(const T *, int64_t, int64_t);
TESSEL_INSTANTIATE_MOE(float)
TESSEL_INSTANTIATE_MOE(double)
#undef TESSEL_INSTANTIATE_MOE

} // namespace tessel::rt::ref
