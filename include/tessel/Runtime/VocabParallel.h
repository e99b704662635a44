//===- VocabParallel.h - Embedding and loss over a split vocabulary -*- C++
//-*-===//
//
// Megatron's vocab-parallel layers: a rank holds rows [vStart, vStart + Vl)
// of the token embedding (and of the tied or untied LM head), so it computes
// the logits of its vocabulary slice only. The full logits are never
// gathered: the cross-entropy combines per-row statistics (max, sum of
// exponentials, target logit) over the group instead.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_RUNTIME_VOCABPARALLEL_H
#define TESSEL_RUNTIME_VOCABPARALLEL_H

#include <cstdint>

namespace tessel::rt {

// out[i] = table[ids[i] - vStart] when the id is in this rank's range, else 0
// (the sum over the group is the full lookup).
void embeddingForwardRange(const float *table, const int32_t *ids, float *out,
                           int64_t n, int64_t vStart, int64_t Vl, int64_t C);
// dtable = 0, then dtable[ids[i] - vStart] += dout[i] for ids in range, in
// ascending i.
void embeddingBackwardRange(const int32_t *ids, const float *dout,
                            float *dtable, int64_t n, int64_t vStart,
                            int64_t Vl, int64_t C);
// The same summed over microbatches in place: dtable is zeroed only when
// `first`.
void embeddingBackwardRangeAccumulate(const int32_t *ids, const float *dout,
                                      float *dtable, bool first, int64_t n,
                                      int64_t vStart, int64_t Vl, int64_t C);

// Mean over rows of the cross-entropy of logits split along the vocabulary
// (this rank holds columns [vStart, vStart + Vl) of each of `rows` rows);
// statistics are combined over `axes`. Every rank of the group gets the
// same loss. Two all-reduces: the row maxima, then the sums of
// exponentials and the target logits. Columns whose global index is `valid`
// or more (a padded vocabulary's padding) take no part. With `stats`
// (2 * rows), the row maxima and then the sums of exponentials are kept
// there for the backward.
void crossEntropyVocabParallelForward(const float *logits,
                                      const int32_t *targets, float *loss,
                                      float *stats, int64_t rows, int64_t Vl,
                                      int64_t vStart, unsigned axes,
                                      int64_t valid);
// dlogits = dloss[0] * (softmax - onehot) / rows on this rank's columns (zero
// in the padding). With the forward's `stats`, no communication; without,
// two all-reduces: the row maxima and the sums of exponentials.
void crossEntropyVocabParallelBackward(const float *logits,
                                       const int32_t *targets,
                                       const float *dloss, float *dlogits,
                                       const float *stats, int64_t rows,
                                       int64_t Vl, int64_t vStart,
                                       unsigned axes, int64_t valid);

} // namespace tessel::rt

#endif // TESSEL_RUNTIME_VOCABPARALLEL_H
