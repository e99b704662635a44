//===- Moe.cpp - Mixture-of-experts routing, dispatch and grouped GEMM ----===//
//
// The pieces of a routed MoE layer (Mixtral's routing): the top-k of the
// router's probabilities renormalised, the dispatch of each (token, slot)
// assignment to a row of an expert-major buffer (a counting sort: experts
// in increasing order, tokens in their order within an expert), the gather
// and weighted scatter of rows, the experts' GEMMs over their row ranges,
// and the load-balancing and z losses. Every loop runs in a fixed order, so
// results do not depend on the thread count.
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Kernels.h"

#include "tessel/Runtime/Comm.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

namespace tessel::rt {
namespace {

void checkShape(int64_t tokens, int64_t E, int64_t k, const char *what) {
  if (tokens < 0 || E <= 0 || k <= 0 || k > E)
    throw std::invalid_argument(std::string(what) + ": " +
                                std::to_string(tokens) + " tokens, " +
                                std::to_string(E) + " experts, top " +
                                std::to_string(k) +
                                " (needs 1 <= top_k <= experts)");
}

} // namespace

template <typename T>
void moeTopK(const T *probs, int32_t *experts, T *weights, int64_t tokens,
             int64_t E, int64_t k) {
  checkShape(tokens, E, k, "moeTopK");
#pragma omp parallel for schedule(static) if (tokens * E >= (1 << 14))
  for (int64_t t = 0; t < tokens; ++t) {
    const T *p = probs + t * E;
    int32_t *chosen = experts + t * k;
    T *w = weights + t * k;
    // Selection by repeated arg-max: each pass takes the largest remaining
    // probability, the lower index on a tie (a strict comparison, left to
    // right), so the k experts come in descending order.
    T sum = 0;
    for (int64_t s = 0; s < k; ++s) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t q = 0; q < s; ++q)
          taken |= chosen[q] == e;
        if (!taken && (best < 0 || p[e] > p[best]))
          best = e;
      }
      chosen[s] = (int32_t)best;
      w[s] = p[best];
      sum += p[best];
    }
    for (int64_t s = 0; s < k; ++s)
      w[s] /= sum;
  }
}

template <typename T>
void moeTopKBackward(const T *probs, const int32_t *experts,
                     const T *dweights, T *dprobs, int64_t tokens, int64_t E,
                     int64_t k, bool accumulate) {
  checkShape(tokens, E, k, "moeTopKBackward");
  for (int64_t t = 0; t < tokens; ++t) {
    const T *p = probs + t * E;
    const int32_t *chosen = experts + t * k;
    const T *dw = dweights + t * k;
    T *dp = dprobs + t * E;
    if (!accumulate)
      std::fill(dp, dp + E, T(0));
    // w_s = p_s / S with S the sum of the chosen p: dp_s = (dw_s - sum_q
    // dw_q w_q) / S, and nothing for the experts not chosen.
    T sum = 0;
    for (int64_t s = 0; s < k; ++s)
      sum += p[chosen[s]];
    T weighted = 0;
    for (int64_t s = 0; s < k; ++s)
      weighted += dw[s] * (p[chosen[s]] / sum);
    for (int64_t s = 0; s < k; ++s)
      dp[chosen[s]] += (dw[s] - weighted) / sum;
  }
}

namespace {

// moeDispatchPlan with the tokens in `rows` runs of consecutive tokens
// (rows of the batch), each with its own count of earlier assignments per
// expert (`before`, [rows, E], or null): run r's tokens come after
// before[r * E + e] assignments of expert e in the serial order.
int64_t dispatchRuns(const int32_t *experts, int64_t tokens, int64_t rows,
                     int64_t k, int64_t E, int64_t capacity,
                     const int64_t *before, int32_t *rowOf,
                     int32_t *offsets) {
  checkShape(tokens, E, k, "moeDispatchPlan");
  if (rows < 1 || tokens % rows != 0)
    throw std::invalid_argument("moeDispatchPlan: " + std::to_string(tokens) +
                                " tokens are not " + std::to_string(rows) +
                                " rows");
  // Kept assignments per expert, in token order: an assignment is kept
  // while the expert has taken fewer than `capacity` (those of earlier
  // tokens, `before`, counted first).
  std::fill(offsets, offsets + E + 1, int32_t(0));
  int64_t perRun = tokens / rows * k;
  std::vector<int64_t> seen(E, 0);
  for (int64_t a = 0; a < tokens * k; ++a) {
    int32_t e = experts[a];
    if (e < 0 || e >= E)
      throw std::invalid_argument("moeDispatchPlan: assignment " +
                                  std::to_string(a) + " names expert " +
                                  std::to_string(e) + " of " +
                                  std::to_string(E));
    int64_t run = a / perRun;
    if (a % perRun == 0 && rows > 1)
      std::fill(seen.begin(), seen.end(), 0);
    int64_t earlier = (before ? before[run * E + e] : 0) + seen[e]++;
    bool kept = capacity <= 0 || earlier < capacity;
    rowOf[a] = kept ? 0 : -1;
    if (kept)
      offsets[e + 1]++;
  }
  for (int64_t e = 0; e < E; ++e)
    offsets[e + 1] += offsets[e];
  std::vector<int64_t> next(offsets, offsets + E);
  for (int64_t a = 0; a < tokens * k; ++a)
    if (rowOf[a] >= 0)
      rowOf[a] = (int32_t)next[experts[a]]++;
  return offsets[E];
}

} // namespace

int64_t moeDispatchPlan(const int32_t *experts, int64_t tokens, int64_t k,
                        int64_t E, int64_t capacity, const int64_t *before,
                        int32_t *rowOf, int32_t *offsets) {
  return dispatchRuns(experts, tokens, 1, k, E, capacity, before, rowOf,
                      offsets);
}

template <typename T>
void moePermute(const T *x, const int32_t *rowOf, T *xp, int64_t tokens,
                int64_t k, int64_t H) {
#pragma omp parallel for schedule(static) if (tokens * k * H >= (1 << 16))
  for (int64_t a = 0; a < tokens * k; ++a)
    if (rowOf[a] >= 0)
      std::copy(x + (a / k) * H, x + (a / k + 1) * H, xp + rowOf[a] * H);
}

template <typename T>
void moeUnpermute(const T *yp, const int32_t *rowOf, const T *weights, T *y,
                  int64_t tokens, int64_t k, int64_t H) {
#pragma omp parallel for schedule(static) if (tokens * k * H >= (1 << 16))
  for (int64_t t = 0; t < tokens; ++t) {
    T *out = y + t * H;
    std::fill(out, out + H, T(0));
    for (int64_t s = 0; s < k; ++s) {
      int32_t row = rowOf[t * k + s];
      if (row < 0)
        continue; // dropped: the residual carries the token
      // Unweighted (null weights): the gradient of moePermute.
      const T w = weights ? weights[t * k + s] : T(1);
      const T *in = yp + row * H;
      for (int64_t j = 0; j < H; ++j)
        out[j] += w * in[j];
    }
  }
}

template <typename T>
void moePermuteBackward(const T *dxp, const int32_t *rowOf, T *dx,
                        int64_t tokens, int64_t k, int64_t H) {
  moeUnpermute<T>(dxp, rowOf, nullptr, dx, tokens, k, H);
}

template <typename T>
void moeUnpermuteBackward(const T *yp, const int32_t *rowOf, const T *weights,
                          const T *dy, T *dyp, T *dweights, int64_t tokens,
                          int64_t k, int64_t H) {
#pragma omp parallel for schedule(static) if (tokens * k * H >= (1 << 16))
  for (int64_t a = 0; a < tokens * k; ++a) {
    int32_t row = rowOf[a];
    if (row < 0) {
      dweights[a] = 0;
      continue;
    }
    const T *g = dy + (a / k) * H;
    const T *in = yp + row * H;
    T *d = dyp + row * H;
    const T w = weights[a];
    T dot = 0;
    for (int64_t j = 0; j < H; ++j) {
      d[j] = w * g[j];
      dot += g[j] * in[j];
    }
    dweights[a] = dot;
  }
}

template <typename T>
void groupedMatmul(const T *x, const T *W, T *out, const int32_t *offsets,
                   int64_t E, int64_t K, int64_t N, bool transW,
                   bool accumulate) {
  for (int64_t e = 0; e < E; ++e) {
    int64_t rows = offsets[e + 1] - offsets[e];
    if (rows <= 0)
      continue;
    matmul(x + offsets[e] * K, W + e * K * N, out + offsets[e] * N, 1, rows, N,
           K, false, transW, 0, 0, 0, accumulate);
  }
}

template <typename T>
void groupedMatmulWeightGrad(const T *x, const T *dout, T *dW,
                             const int32_t *offsets, int64_t E, int64_t K,
                             int64_t N, bool transW, bool accumulate) {
  for (int64_t e = 0; e < E; ++e) {
    int64_t rows = offsets[e + 1] - offsets[e];
    T *d = dW + e * K * N;
    if (rows <= 0) {
      if (!accumulate)
        std::fill(d, d + K * N, T(0));
      continue;
    }
    const T *xe = x + offsets[e] * K, *ge = dout + offsets[e] * N;
    // W [K, N]: dW = x^T dout; W stored [N, K] (transW): dW = dout^T x.
    if (transW)
      matmul(ge, xe, d, 1, N, K, rows, true, false, 0, 0, 0, accumulate);
    else
      matmul(xe, ge, d, 1, K, N, rows, true, false, 0, 0, 0, accumulate);
  }
}

template <typename T>
void moeLoadStats(const T *probs, const int32_t *experts, T *counts,
                  T *probSums, int64_t tokens, int64_t E, int64_t k) {
  checkShape(tokens, E, k, "moeLoadStats");
  for (int64_t a = 0; a < tokens * k; ++a)
    counts[experts[a]] += 1;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t e = 0; e < E; ++e)
      probSums[e] += probs[t * E + e];
}

template <typename T>
T moeAuxLoss(const T *counts, const T *probSums, int64_t totalTokens,
             int64_t E, int64_t k, double coef) {
  if (totalTokens <= 0)
    return 0;
  double sum = 0;
  for (int64_t e = 0; e < E; ++e)
    sum += (double)counts[e] / ((double)totalTokens * k) *
           ((double)probSums[e] / totalTokens);
  return (T)(coef * E * sum);
}

template <typename T>
void moeAuxLossBackward(const T *counts, int64_t totalTokens, int64_t E,
                        int64_t k, double coef, T daux, T *dprobs,
                        int64_t tokens) {
  if (totalTokens <= 0)
    return;
  for (int64_t e = 0; e < E; ++e) {
    // d aux / d probs[t, e] = coef * E * f_e / totalTokens (f_e held fixed:
    // a count of choices has no gradient).
    T g = (T)(coef * E * ((double)counts[e] / ((double)totalTokens * k)) /
              totalTokens) *
          daux;
    for (int64_t t = 0; t < tokens; ++t)
      dprobs[t * E + e] += g;
  }
}

template <typename T>
T moeZLossSum(const T *logits, int64_t tokens, int64_t E) {
  double sum = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    const T *l = logits + t * E;
    double m = *std::max_element(l, l + E), s = 0;
    for (int64_t e = 0; e < E; ++e)
      s += std::exp((double)l[e] - m);
    double lse = m + std::log(s);
    sum += lse * lse;
  }
  return (T)sum;
}

template <typename T>
void moeZLossBackward(const T *logits, int64_t tokens, int64_t E, T dsum,
                      T *dlogits) {
  for (int64_t t = 0; t < tokens; ++t) {
    const T *l = logits + t * E;
    T *d = dlogits + t * E;
    double m = *std::max_element(l, l + E), s = 0;
    for (int64_t e = 0; e < E; ++e)
      s += std::exp((double)l[e] - m);
    double lse = m + std::log(s);
    // d lse^2 / d l_e = 2 lse softmax(l)_e.
    for (int64_t e = 0; e < E; ++e)
      d[e] += (T)(2 * lse * std::exp((double)l[e] - lse)) * dsum;
  }
}

// The forms a step calls: whole buffers in, whole buffers out.

template <typename T>
void groupedMatmulSegments(const T *x, const T *W, T *out,
                           const int32_t *offsets, int64_t segments, int64_t E,
                           int64_t K, int64_t N, bool transW) {
  for (int64_t c = 0; c * E < segments; ++c)
    groupedMatmul(x, W, out, offsets + c * E, E, K, N, transW);
}

template <typename T>
void groupedMatmulWeightGradSegmentsAccumulate(const T *x, const T *dout, T *dW,
                                               const int32_t *offsets,
                                               bool first, int64_t segments,
                                               int64_t E, int64_t K, int64_t N,
                                               bool transW) {
  for (int64_t c = 0; c * E < segments; ++c)
    groupedMatmulWeightGrad(x, dout, dW, offsets + c * E, E, K, N, transW,
                            /*accumulate=*/c > 0 || !first);
}

template <typename T>
void groupedMatmulWeightGradSegments(const T *x, const T *dout, T *dW,
                                     const int32_t *offsets, int64_t segments,
                                     int64_t E, int64_t K, int64_t N,
                                     bool transW) {
  groupedMatmulWeightGradSegmentsAccumulate(x, dout, dW, offsets,
                                            /*first=*/true, segments, E, K, N,
                                            transW);
}

// Segment s = j * El + e of the received rows holds source rank j's rows
// for this rank's expert e.
void moeExchange(const float *rows, const int32_t *offsets, float *recv,
                 int32_t *recvOffsets, int64_t E, int64_t H, int64_t recvRows,
                 unsigned axes) {
  int64_t g = groupSize(axes), El = E / g;
  std::vector<int32_t> counts(E), got(E);
  for (int64_t e = 0; e < E; ++e)
    counts[e] = offsets[e + 1] - offsets[e];
  allToAllInt(counts.data(), got.data(), El, axes);
  recvOffsets[0] = 0;
  for (int64_t s = 0; s < E; ++s)
    recvOffsets[s + 1] = recvOffsets[s] + got[s];
  if (recvOffsets[E] > recvRows)
    throw std::runtime_error("moeExchange: " + std::to_string(recvOffsets[E]) +
                             " rows received for a buffer of " +
                             std::to_string(recvRows));
  std::vector<int64_t> sendCounts(g), sendOffsets(g), recvCounts(g),
      recvDispl(g);
  for (int64_t j = 0; j < g; ++j) {
    sendOffsets[j] = (int64_t)offsets[j * El] * H;
    sendCounts[j] = (int64_t)offsets[(j + 1) * El] * H - sendOffsets[j];
    recvDispl[j] = (int64_t)recvOffsets[j * El] * H;
    recvCounts[j] = (int64_t)recvOffsets[(j + 1) * El] * H - recvDispl[j];
  }
  std::fill(recv + (int64_t)recvOffsets[E] * H, recv + recvRows * H, 0.0f);
  allToAllV(rows, sendCounts.data(), sendOffsets.data(), recv,
            recvCounts.data(), recvDispl.data(), axes);
}

void moeCombine(const float *recvOut, const int32_t *recvOffsets,
                const int32_t *offsets, float *out, int64_t E, int64_t N,
                int64_t rows, unsigned axes) {
  int64_t g = groupSize(axes), El = E / g;
  std::vector<int64_t> sendCounts(g), sendOffsets(g), recvCounts(g),
      recvDispl(g);
  for (int64_t j = 0; j < g; ++j) {
    sendOffsets[j] = (int64_t)recvOffsets[j * El] * N;
    sendCounts[j] = (int64_t)recvOffsets[(j + 1) * El] * N - sendOffsets[j];
    recvDispl[j] = (int64_t)offsets[j * El] * N;
    recvCounts[j] = (int64_t)offsets[(j + 1) * El] * N - recvDispl[j];
  }
  std::fill(out + (int64_t)offsets[E] * N, out + rows * N, 0.0f);
  allToAllV(recvOut, sendCounts.data(), sendOffsets.data(), out,
            recvCounts.data(), recvDispl.data(), axes);
}

void moeDispatchGroup(const int32_t *experts, int32_t *rowOf,
                      int32_t *offsets, int64_t tokens, int64_t rows,
                      int64_t k, int64_t E, int64_t capacity, unsigned axes) {
  if (axes == 0 || capacity <= 0 || groupSize(axes) == 1) {
    moeDispatchPlan(experts, tokens, k, E, capacity, nullptr, rowOf, offsets);
    return;
  }
  int64_t g = groupSize(axes), me = groupRank(axes);
  // The axes that split the sequence: cp (context parallelism), then tp
  // (sequence parallelism) inside it, the fastest axes in rank order.
  const unsigned sequence =
      AxisSet(MeshAxis::TP).bits() | AxisSet(MeshAxis::CP).bits();
  if (!(axes & sequence)) {
    // The ranks hold consecutive tokens in group order: those before this
    // one count first against each expert's capacity.
    std::vector<float> mine(E, 0.0f), all(g * E);
    for (int64_t a = 0; a < tokens * k; ++a)
      if (experts[a] >= 0 && experts[a] < E)
        mine[experts[a]] += 1.0f;
    allGather(mine.data(), all.data(), E, axes);
    std::vector<int64_t> before(E, 0);
    for (int64_t j = 0; j < me; ++j)
      for (int64_t e = 0; e < E; ++e)
        before[e] += (int64_t)all[j * E + e];
    moeDispatchPlan(experts, tokens, k, E, capacity, before.data(), rowOf,
                    offsets);
    return;
  }
  // The sequence split over cp and tp: consecutive group ranks (cp and tp
  // are the fastest axes in rank order) hold consecutive pieces of the same
  // rows, the serial order being row by row. Each rank's counts per row and
  // expert are all-gathered; a row's piece here comes after every earlier
  // row of the group's rows and the row's pieces on the ranks before this
  // one.
  if (rows < 1 || tokens % rows != 0)
    throw std::invalid_argument("moeDispatchGroup: " + std::to_string(tokens) +
                                " tokens are not " + std::to_string(rows) +
                                " rows");
  int64_t pieces = groupSize(axes & sequence), perRow = tokens / rows * k;
  std::vector<float> mine(rows * E, 0.0f), all(g * rows * E);
  for (int64_t a = 0; a < tokens * k; ++a)
    if (experts[a] >= 0 && experts[a] < E)
      mine[a / perRow * E + experts[a]] += 1.0f;
  allGather(mine.data(), all.data(), rows * E, axes);
  // Group rank j holds piece j % pieces of the rows of block j / pieces.
  auto count = [&](int64_t j, int64_t r, int64_t e) {
    return (int64_t)all[(j * rows + r) * E + e];
  };
  std::vector<int64_t> before(rows * E, 0), total(E, 0);
  int64_t myBlock = me / pieces, myPiece = me % pieces;
  for (int64_t j = 0; j < myBlock * pieces; ++j)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t e = 0; e < E; ++e)
        total[e] += count(j, r, e);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t e = 0; e < E; ++e) {
      int64_t b = total[e];
      for (int64_t p = 0; p < myPiece; ++p)
        b += count(myBlock * pieces + p, r, e);
      before[r * E + e] = b;
      for (int64_t p = 0; p < pieces; ++p)
        total[e] += count(myBlock * pieces + p, r, e);
    }
  }
  dispatchRuns(experts, tokens, rows, k, E, capacity, before.data(), rowOf,
               offsets);
}

void moeDispatch(const int32_t *experts, int32_t *rowOf, int32_t *offsets,
                 int64_t tokens, int64_t k, int64_t E, int64_t capacity) {
  moeDispatchPlan(experts, tokens, k, E, capacity, nullptr, rowOf, offsets);
}

template <typename T>
void moeLoadStatsInto(const T *probs, const int32_t *experts, T *counts,
                      T *probSums, int64_t tokens, int64_t E, int64_t k) {
  std::fill(counts, counts + E, T(0));
  std::fill(probSums, probSums + E, T(0));
  moeLoadStats(probs, experts, counts, probSums, tokens, E, k);
}

template <typename T>
void moeKeptCounts(const int32_t *offsets, T *kept, int64_t E) {
  for (int64_t e = 0; e < E; ++e)
    kept[e] = (T)(offsets[e + 1] - offsets[e]);
}

template <typename T>
void moeProbSumsBackward(const T *dprobSums, T *dprobs, int64_t tokens,
                         int64_t E) {
  for (int64_t t = 0; t < tokens; ++t)
    std::copy(dprobSums, dprobSums + E, dprobs + t * E);
}

template <typename T>
void moeAuxLossForward(const T *counts, const T *probSums, T *loss,
                       int64_t totalTokens, int64_t E, int64_t k,
                       double coef) {
  loss[0] = moeAuxLoss(counts, probSums, totalTokens, E, k, coef);
}

template <typename T>
void moeAuxLossGrad(const T *counts, const T *dloss, T *dprobSums,
                    int64_t totalTokens, int64_t E, int64_t k, double coef) {
  // aux = coef E / (N^2 k) sum_e counts_e probSums_e.
  double scale = coef * (double)E /
                 ((double)totalTokens * (double)totalTokens * (double)k);
  for (int64_t e = 0; e < E; ++e)
    dprobSums[e] = (T)(scale * (double)counts[e] * (double)dloss[0]);
}

template <typename T>
void moeZLossForward(const T *logits, T *loss, int64_t tokens, int64_t E,
                     double coef) {
  loss[0] = (T)(coef * (double)moeZLossSum(logits, tokens, E) /
                (double)tokens);
}

template <typename T>
void moeZLossGrad(const T *logits, const T *dloss, T *dlogits, int64_t tokens,
                  int64_t E, double coef) {
  std::fill(dlogits, dlogits + tokens * E, T(0));
  moeZLossBackward(logits, tokens, E, (T)(coef * (double)dloss[0] / (double)tokens),
                   dlogits);
}

#define TESSEL_MOE_INSTANTIATE(T)                                              \
  template void moeTopK<T>(const T *, int32_t *, T *, int64_t, int64_t,        \
                           int64_t);                                           \
  template void moeTopKBackward<T>(const T *, const int32_t *, const T *, T *, \
                                   int64_t, int64_t, int64_t, bool);           \
  template void moePermute<T>(const T *, const int32_t *, T *, int64_t,        \
                              int64_t, int64_t);                               \
  template void moePermuteBackward<T>(const T *, const int32_t *, T *,         \
                                      int64_t, int64_t, int64_t);              \
  template void moeUnpermute<T>(const T *, const int32_t *, const T *, T *,    \
                                int64_t, int64_t, int64_t);                    \
  template void moeUnpermuteBackward<T>(const T *, const int32_t *, const T *, \
                                        const T *, T *, T *, int64_t, int64_t, \
                                        int64_t);                              \
  template void groupedMatmul<T>(const T *, const T *, T *, const int32_t *,   \
                                 int64_t, int64_t, int64_t, bool, bool);       \
  template void groupedMatmulWeightGrad<T>(const T *, const T *, T *,          \
                                           const int32_t *, int64_t, int64_t,  \
                                           int64_t, bool, bool);               \
  template void moeLoadStats<T>(const T *, const int32_t *, T *, T *, int64_t, \
                                int64_t, int64_t);                             \
  template T moeAuxLoss<T>(const T *, const T *, int64_t, int64_t, int64_t,    \
                           double);                                            \
  template void moeAuxLossBackward<T>(const T *, int64_t, int64_t, int64_t,    \
                                      double, T, T *, int64_t);                \
  template T moeZLossSum<T>(const T *, int64_t, int64_t);                      \
  template void moeZLossBackward<T>(const T *, int64_t, int64_t, T, T *);      \
  template void groupedMatmulSegments<T>(const T *, const T *, T *,            \
                                         const int32_t *, int64_t, int64_t,    \
                                         int64_t, int64_t, bool);              \
  template void groupedMatmulWeightGradSegments<T>(                            \
      const T *, const T *, T *, const int32_t *, int64_t, int64_t, int64_t,   \
      int64_t, bool);                                                          \
  template void groupedMatmulWeightGradSegmentsAccumulate<T>(                  \
      const T *, const T *, T *, const int32_t *, bool, int64_t, int64_t,      \
      int64_t, int64_t, bool);                                                 \
  template void moeLoadStatsInto<T>(const T *, const int32_t *, T *, T *,      \
                                    int64_t, int64_t, int64_t);                \
  template void moeProbSumsBackward<T>(const T *, T *, int64_t, int64_t);      \
  template void moeKeptCounts<T>(const int32_t *, T *, int64_t);               \
  template void moeAuxLossForward<T>(const T *, const T *, T *, int64_t,       \
                                     int64_t, int64_t, double);                \
  template void moeAuxLossGrad<T>(const T *, const T *, T *, int64_t, int64_t, \
                                  int64_t, double);                            \
  template void moeZLossForward<T>(const T *, T *, int64_t, int64_t, double);  \
  template void moeZLossGrad<T>(const T *, const T *, T *, int64_t, int64_t,   \
                                double);

TESSEL_MOE_INSTANTIATE(float)
TESSEL_MOE_INSTANTIATE(double)

} // namespace tessel::rt
