//===- VocabParallel.cpp - Embedding and loss over a split vocabulary -----===//

#include "tessel/Runtime/VocabParallel.h"

#include "tessel/Runtime/Comm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace tessel::rt {

void embeddingForwardRange(const float *table, const int32_t *ids, float *out,
                           int64_t n, int64_t vStart, int64_t Vl, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    int64_t row = (int64_t)ids[i] - vStart;
    float *o = out + i * C;
    if (row >= 0 && row < Vl)
      std::memcpy(o, table + row * C, C * sizeof(float));
    else
      std::fill(o, o + C, 0.0f);
  }
}

void embeddingBackwardRange(const int32_t *ids, const float *dout,
                            float *dtable, int64_t n, int64_t vStart,
                            int64_t Vl, int64_t C) {
  embeddingBackwardRangeAccumulate(ids, dout, dtable, /*first=*/true, n, vStart,
                                   Vl, C);
}

void embeddingBackwardRangeAccumulate(const int32_t *ids, const float *dout,
                                      float *dtable, bool first, int64_t n,
                                      int64_t vStart, int64_t Vl, int64_t C) {
  if (first)
    std::fill(dtable, dtable + Vl * C, 0.0f);
    // Columns in parallel, tokens in ascending order within each: the same
    // order of additions as the one-rank kernel, whatever the thread count.
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < C; ++c)
    for (int64_t i = 0; i < n; ++i) {
      int64_t row = (int64_t)ids[i] - vStart;
      if (row >= 0 && row < Vl)
        dtable[row * C + c] += dout[i * C + c];
    }
}

namespace {

// Row maxima over the whole vocabulary, then each row's sum of exp(x - max)
// over it. `extra` rows of the sum buffer (the target logits) ride along in
// the same all-reduce.
void rowStatistics(const float *logits, int64_t rows, int64_t Vl, int64_t n,
                   unsigned axes, std::vector<float> &maxima,
                   std::vector<float> &sums, const int32_t *targets,
                   int64_t vStart) {
  maxima.resize(rows);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float *x = logits + r * Vl;
    float m = -INFINITY;
    for (int64_t v = 0; v < n; ++v)
      m = std::max(m, x[v]);
    maxima[r] = m;
  }
  allReduceMax(maxima.data(), rows, axes);
  int64_t count = targets ? 2 * rows : rows;
  sums.assign(count, 0.0f);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float *x = logits + r * Vl;
    double s = 0.0;
    for (int64_t v = 0; v < n; ++v)
      s += std::exp((double)x[v] - maxima[r]);
    sums[r] = (float)s;
    if (targets) {
      int64_t t = (int64_t)targets[r] - vStart;
      sums[rows + r] = (t >= 0 && t < Vl) ? x[t] : 0.0f;
    }
  }
  allReduceSum(sums.data(), count, axes);
}

// The shard's columns that are real vocabulary entries (global index below
// `valid`): the first n.
int64_t validColumns(int64_t Vl, int64_t vStart, int64_t valid) {
  return std::clamp<int64_t>(valid - vStart, 0, Vl);
}

} // namespace

void crossEntropyVocabParallelForward(const float *logits,
                                      const int32_t *targets, float *loss,
                                      float *stats, int64_t rows, int64_t Vl,
                                      int64_t vStart, unsigned axes,
                                      int64_t valid) {
  static std::vector<float> maxima, sums;
  rowStatistics(logits, rows, Vl, validColumns(Vl, vStart, valid), axes,
                maxima, sums, targets, vStart);
  double total = 0.0;
  for (int64_t r = 0; r < rows; ++r)
    total += std::log((double)sums[r]) + maxima[r] - sums[rows + r];
  loss[0] = (float)(total / rows);
  if (stats) {
    std::copy(maxima.begin(), maxima.begin() + rows, stats);
    std::copy(sums.begin(), sums.begin() + rows, stats + rows);
  }
}

void crossEntropyVocabParallelBackward(const float *logits,
                                       const int32_t *targets,
                                       const float *dloss, float *dlogits,
                                       const float *stats, int64_t rows,
                                       int64_t Vl, int64_t vStart,
                                       unsigned axes, int64_t valid) {
  // The forward's statistics, or combined here again.
  static std::vector<float> combinedMax, combinedSum;
  const int64_t n = validColumns(Vl, vStart, valid);
  if (!stats)
    rowStatistics(logits, rows, Vl, n, axes, combinedMax, combinedSum, nullptr,
                  vStart);
  const float *maxima = stats ? stats : combinedMax.data();
  const float *sums = stats ? stats + rows : combinedSum.data();
  float scale = dloss[0] / rows;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float *x = logits + r * Vl;
    float *d = dlogits + r * Vl;
    float inv = 1.0f / sums[r];
    for (int64_t v = 0; v < n; ++v)
      d[v] = scale * (std::exp(x[v] - maxima[r]) * inv);
    for (int64_t v = n; v < Vl; ++v)
      d[v] = 0.0f;
    int64_t t = (int64_t)targets[r] - vStart;
    if (t >= 0 && t < Vl)
      d[t] -= scale;
  }
}

} // namespace tessel::rt
