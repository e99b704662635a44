//===- Kernels.h - CPU compute kernels of the Tessel runtime ----*- C++ -*-===//
//
// Every kernel the generated CPU programs call. Tensors are contiguous and
// row-major. Kernels are templates instantiated for float (what programs run)
// and double (what the gradient checks run). A kernel's outputs are written,
// never accumulated into, unless its comment says otherwise; outputs never
// alias inputs.
//
// Each kernel family lives in its own file under lib/Runtime/Kernels/ with a
// naive reference beside it (namespace tessel::rt::ref) for the tests.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_RUNTIME_KERNELS_H
#define TESSEL_RUNTIME_KERNELS_H

#include <cstdint>

namespace tessel::rt {

// C[b] = opA(A[b]) * opB(B[b]) for b in [0, batch). opA(A) is M x K: stored
// [M, K], or [K, M] when transA. opB(B) is K x N: stored [K, N], or [N, K] when
// transB. strideA/B/C are element strides between batch entries; a stride of 0
// broadcasts that operand to every batch entry. When accumulate is true the
// product is added to C instead of overwriting it. C's rows are ldc elements
// apart (0: N, contiguous).
template <typename T>
void matmul(const T *A, const T *B, T *C, int64_t batch, int64_t M, int64_t N,
            int64_t K, bool transA, bool transB, int64_t strideA,
            int64_t strideB, int64_t strideC, bool accumulate = false,
            int64_t ldc = 0);

// Fused kernels (tessel-fuse-kernels; lib/Runtime/Kernels/Fused.cpp), each
// the plain kernels it replaces run in their order:
// out = A opB(B) + bias (row broadcast), A [M, K]; gelu (when non-null) =
// gelu(out).
template <typename T>
void matmulBias(const T *A, const T *B, const T *bias, T *out, T *gelu,
                int64_t M, int64_t N, int64_t K, bool transB);
// C = A^T B (A stored [K, M], B [K, N]); db = the column sums of B. The
// product may be a column block of a wider gradient: C's rows are ldc
// elements long (0: N) and the product goes to their columns [col, col + N),
// the sums to db [col, col + N).
template <typename T>
void matmulBiasGrad(const T *A, const T *B, T *C, T *db, int64_t M, int64_t N,
                    int64_t K, int64_t ldc = 0, int64_t col = 0);
// The same, C summed over microbatches by the GEMM (C + A^T B after the
// first); db written.
template <typename T>
void matmulBiasGradAccumulate(const T *A, const T *B, T *C, T *db, bool first,
                              int64_t M, int64_t N, int64_t K, int64_t ldc = 0,
                              int64_t col = 0);
// dx = gelu'(pre) * (A opB(B)), A [M, K].
template <typename T>
void matmulGeluGrad(const T *A, const T *B, const T *pre, T *dx, int64_t M,
                    int64_t N, int64_t K, bool transB);
// A weight gradient summed over microbatches by its GEMM: C = opA(A) opB(B)
// on the first, C + opA(A) opB(B) after (the BLAS call's beta = 1).
template <typename T>
void matmulAccumulate(const T *A, const T *B, T *C, bool first, int64_t M,
                      int64_t N, int64_t K, bool transA, bool transB) {
  matmul(A, B, C, 1, M, N, K, transA, transB, 0, 0, 0,
         /*accumulate=*/!first);
}
// out = addend + A opB(B), A [M, K].
template <typename T>
void matmulAdd(const T *A, const T *B, const T *addend, T *out, int64_t M,
               int64_t N, int64_t K, bool transB);
// sum = a + r; out = LayerNorm(sum) / RMSNorm(sum).
template <typename T>
void addLayerNormForward(const T *a, const T *r, T *sum, const T *w,
                         const T *b, T *out, int64_t rows, int64_t C,
                         double eps);
template <typename T>
void addRmsNormForward(const T *a, const T *r, T *sum, const T *w, T *out,
                       int64_t rows, int64_t C, double eps);
// The norm's backward with dx = its input gradient + dres.
template <typename T>
void layerNormBackwardAdd(const T *x, const T *w, const T *dout,
                          const T *dres, T *dx, T *dw, T *db, int64_t rows,
                          int64_t C, double eps);
template <typename T>
void rmsNormBackwardAdd(const T *x, const T *w, const T *dout, const T *dres,
                        T *dx, T *dw, int64_t rows, int64_t C, double eps);
// out = silu(gate) * up; siluOut (when non-null) = silu(gate).
template <typename T>
void swigluForward(const T *gate, const T *up, T *out, T *siluOut, int64_t n);
// SwiGLU's backward, the SiLU taken again from the gate: dgate = dout * up *
// silu'(gate), dup = dout * silu(gate) (the unfused kernels' arithmetic, so
// fp32 results equal theirs).
template <typename T>
void swigluBackward(const T *gate, const T *up, const T *dout, T *dgate, T *dup,
                    int64_t n);

// out[i] = a[i] + b[i % nb]; b has nb elements and n is a multiple of nb
// (b's shape is a suffix of a's shape).
template <typename T>
void addBroadcast(const T *a, const T *b, T *out, int64_t n, int64_t nb);
// out[i] = a[i] * b[i % nb].
template <typename T>
void mulBroadcast(const T *a, const T *b, T *out, int64_t n, int64_t nb);
// out[j] = sum over r of x[r * cols + j]: reduces leading dimensions, used for
// the gradient of a broadcast operand. Summation order is fixed (r ascending).
template <typename T>
void reduceSumLeading(const T *x, T *out, int64_t rows, int64_t cols);
// out[i] = x[i] * s.
template <typename T> void scale(const T *x, T *out, int64_t n, T s);

// GELU, tanh approximation (PyTorch approximate="tanh", GPT-2's "gelu_new").
template <typename T> void geluForward(const T *x, T *out, int64_t n);
// dx = dout * gelu'(x).
template <typename T>
void geluBackward(const T *x, const T *dout, T *dx, int64_t n);
// SiLU: x * sigmoid(x).
template <typename T> void siluForward(const T *x, T *out, int64_t n);
template <typename T>
void siluBackward(const T *x, const T *dout, T *dx, int64_t n);

// LayerNorm over the last dimension C of a [rows, C] tensor, biased variance,
// as torch.nn.LayerNorm: out = (x - mean) / sqrt(var + eps) * w + b.
template <typename T>
void layerNormForward(const T *x, const T *w, const T *b, T *out, int64_t rows,
                      int64_t C, double eps);
// Recomputes the statistics from x. Writes dx [rows, C], dw [C], db [C].
template <typename T>
void layerNormBackward(const T *x, const T *w, const T *dout, T *dx, T *dw,
                       T *db, int64_t rows, int64_t C, double eps);
// RMSNorm as Hugging Face LlamaRMSNorm: out = x / sqrt(mean(x^2) + eps) * w.
template <typename T>
void rmsNormForward(const T *x, const T *w, T *out, int64_t rows, int64_t C,
                    double eps);
template <typename T>
void rmsNormBackward(const T *x, const T *w, const T *dout, T *dx, T *dw,
                     int64_t rows, int64_t C, double eps);

// Rotary embedding on x of shape [B, T, H, D], Hugging Face Llama convention
// (rotate_half): for i < D/2 with angle = t * theta^(-2i/D),
//   out[i]       = x[i] * cos - x[i + D/2] * sin
//   out[i + D/2] = x[i + D/2] * cos + x[i] * sin.
// inverse = true rotates by -angle, which is the backward pass. Token t is
// row first + t of the sequence (a piece of a sequence split over cp
// ranks), at position zigzagPosition(first + t, total, zigzag) (Sequence.h:
// first + t unless the sequence is in the balanced order of `zigzag`
// pieces).
template <typename T>
void rope(const T *x, T *out, int64_t B, int64_t Tlen, int64_t H, int64_t D,
          double theta, bool inverse, int64_t first = 0, int64_t zigzag = 0,
          int64_t total = 0);
// rope at explicit positions: x [B, S, H, D], and the angle of token (b, t)
// is positions[b, t] * theta^(-2i/D) (the same table entries as rope's at
// that t).
template <typename T>
void ropeAt(const T *x, const int32_t *positions, T *out, int64_t B, int64_t S,
            int64_t H, int64_t D, double theta);

// Causal (when causal) scaled dot-product attention with grouped KV heads.
// q, out: [B, T, H, D]; k, v: [B, Tkv, Hkv, D]; query head h reads KV head
// h / (H / Hkv); scale = 1 / sqrt(D). Never stores the full score matrix
// beyond one row per thread. lse [B, H, T] (may be null) receives each
// row's log-sum-exp of the scaled scores. The T query rows are rows
// first .. first + T - 1 of the Tkv keys' sequence (kvLen 0: Tkv = T), as
// under context parallelism, where a rank attends with its piece of the
// queries over all keys; query row r is at position zigzagPosition(r, Tkv,
// zigzag) (r itself unless the queries are in the balanced order of
// `zigzag` pieces; the keys are in the sequence's); a causal row at
// position p sees keys 0 .. p.
template <typename T>
void attentionForward(const T *q, const T *k, const T *v, T *out, T *lse,
                      int64_t B, int64_t Tlen, int64_t H, int64_t Hkv,
                      int64_t D, bool causal, int64_t kvLen = 0,
                      int64_t first = 0, int64_t zigzag = 0);
// From the forward's out and lse: the probabilities are exp(S - lse), the
// softmax gradient's row sums rowsum(dout * out). Writes dq, dk, dv (same
// shapes as q, k, v); dk and dv hold this piece's queries' share.
template <typename T>
void attentionBackward(const T *q, const T *k, const T *v, const T *out,
                       const T *lse, const T *dout, T *dq, T *dk, T *dv,
                       int64_t B, int64_t Tlen, int64_t H, int64_t Hkv,
                       int64_t D, bool causal, int64_t kvLen = 0,
                       int64_t first = 0, int64_t zigzag = 0);
// Inference attention over a KV cache. q, out: [B, S, H, D]; k, v: [B, S,
// Hkv, D], the S new tokens' keys and values; kCache, vCache: [B, Tmax, Hkv,
// D]; positions: [B, S], each new token's position (0 <= position < Tmax).
// Writes k[b, s] and v[b, s] into row positions[b, s] of the caches, then
// attends each new token causally over cache rows 0..positions[b, s] as
// attentionForward does (same scale, same order of operations), so that a
// token fed alone gives its row of the full-sequence forward.
template <typename T>
void cachedAttention(const T *q, const T *k, const T *v, T *kCache, T *vCache,
                     const int32_t *positions, T *out, int64_t B, int64_t S,
                     int64_t Tmax, int64_t H, int64_t Hkv, int64_t D);

// Softmax of scale * x over the last dimension of [rows, cols]. With
// `causal`, row r sees columns 0 .. r mod cols (an attention's scores, query
// rows of one or more heads stacked over the keys); the others are zero.
template <typename T>
void softmaxForward(const T *x, T *out, int64_t rows, int64_t cols,
                    double scale = 1.0, bool causal = false);
// dx = scale * y * (dy - sum(dy * y)), from the forward output y.
template <typename T>
void softmaxBackward(const T *y, const T *dy, T *dx, int64_t rows,
                     int64_t cols, double scale = 1.0);

// out = x * keep / (1 - p), keep drawn per element from the seed, the site,
// the running step and the element's place in the whole tensor (Dropout.h):
// x is this rank's piece ([shape], `rank` dimensions, dimension d split over
// the mesh axes splitAxes[d], the batch also over `microbatches`, this being
// `microbatch`). With `zigzag`, dimension 1 is a sequence in the balanced
// order of that many pieces: an element's place counts its position in
// the sequence. Copies x while the program evaluates.
template <typename T>
void dropout(const T *x, T *out, int64_t microbatch, const int64_t *shape,
             const int64_t *splitAxes, int64_t rank, int64_t microbatches,
             double p, int64_t seed, int64_t site, int64_t zigzag = 0);

// Dimension `len` of [outer, len, inner] into the balanced order of `pieces`
// pieces (Sequence.h): out row t = x row zigzagPosition(t); `inverse` puts
// it back.
template <typename T>
void zigzag(const T *x, T *out, int64_t outer, int64_t len, int64_t inner,
            int64_t pieces, bool inverse);

// Mean over rows of -log softmax(logits[r])[targets[r]]; logits [rows, V],
// of which the first `valid` columns are the vocabulary (the rest, padding,
// take no part in the softmax). Writes the scalar to loss[0].
template <typename T>
void crossEntropyForward(const T *logits, const int32_t *targets, T *loss,
                         int64_t rows, int64_t V, int64_t valid);
// dlogits = dloss[0] * (softmax(logits) - onehot(targets)) / rows; zero in
// the padding columns.
template <typename T>
void crossEntropyBackward(const T *logits, const int32_t *targets,
                          const T *dloss, T *dlogits, int64_t rows, int64_t V,
                          int64_t valid);

// Mixture of experts (Kernels/Moe.cpp). A routed layer over `tokens` rows
// and E experts, each token sent to its top k: `experts` and `weights` are
// [tokens, k], assignment a = t * k + s.
//
// The top k of each row of router probabilities [tokens, E], in descending
// order, the lower expert first on a tie, and their weights renormalised to
// sum to 1 (Hugging Face's Mixtral routing).
template <typename T>
void moeTopK(const T *probs, int32_t *experts, T *weights, int64_t tokens,
             int64_t E, int64_t k);
// dprobs [tokens, E] from dweights: through the renormalisation; zero (or
// unchanged, with accumulate) at the experts not chosen.
template <typename T>
void moeTopKBackward(const T *probs, const int32_t *experts,
                     const T *dweights, T *dprobs, int64_t tokens, int64_t E,
                     int64_t k, bool accumulate);
// Where each assignment goes in an expert-major buffer: rowOf[a], or -1 when
// dropped. Expert e's rows are [offsets[e], offsets[e + 1]) (E + 1
// entries), its assignments in (token, slot) order. With capacity > 0 an
// expert keeps only the assignments before its capacity in token order,
// counting `before[e]` (nullable) taken by earlier tokens of the serial
// order (another shard's). Returns the number of rows.
int64_t moeDispatchPlan(const int32_t *experts, int64_t tokens, int64_t k,
                        int64_t E, int64_t capacity, const int64_t *before,
                        int32_t *rowOf, int32_t *offsets);
// xp[rowOf[a]] = x[a / k] (rows of H); dropped assignments move nothing.
template <typename T>
void moePermute(const T *x, const int32_t *rowOf, T *xp, int64_t tokens,
                int64_t k, int64_t H);
// dx[t] = sum over t's kept assignments s (ascending) of dxp[rowOf[t, s]].
template <typename T>
void moePermuteBackward(const T *dxp, const int32_t *rowOf, T *dx,
                        int64_t tokens, int64_t k, int64_t H);
// y[t] = sum over t's kept assignments s (ascending) of weights[t, s] *
// yp[rowOf[t, s]]: a dropped assignment adds nothing.
template <typename T>
void moeUnpermute(const T *yp, const int32_t *rowOf, const T *weights, T *y,
                  int64_t tokens, int64_t k, int64_t H);
// dyp[rowOf[a]] = weights[a] * dy[a / k]; dweights[a] = dy[a / k] .
// yp[rowOf[a]], 0 when dropped.
template <typename T>
void moeUnpermuteBackward(const T *yp, const int32_t *rowOf, const T *weights,
                          const T *dy, T *dyp, T *dweights, int64_t tokens,
                          int64_t k, int64_t H);
// The experts' products over their rows: out[rows of e] = x[rows of e]
// ([rows, K]) * W[e], W [E, K, N] (or [E, N, K], transposed, with transW).
// The input gradient is groupedMatmul(dout, W, dx, ..., K <-> N, !transW).
template <typename T>
void groupedMatmul(const T *x, const T *W, T *out, const int32_t *offsets,
                   int64_t E, int64_t K, int64_t N, bool transW,
                   bool accumulate = false);
// dW [E, K, N] (as W is laid out) = x[rows of e]^T dout[rows of e]; zero for
// an expert without rows (unless accumulating).
template <typename T>
void groupedMatmulWeightGrad(const T *x, const T *dout, T *dW,
                             const int32_t *offsets, int64_t E, int64_t K,
                             int64_t N, bool transW, bool accumulate = false);
// Adds the number of assignments to each expert to counts [E] and each
// expert's probabilities summed over the tokens to probSums [E] (shards add
// theirs before the loss).
template <typename T>
void moeLoadStats(const T *probs, const int32_t *experts, T *counts,
                  T *probSums, int64_t tokens, int64_t E, int64_t k);
// Switch's load-balancing loss over totalTokens: coef * E * sum_e f_e P_e,
// f_e = counts[e] / (totalTokens * k), P_e = probSums[e] / totalTokens.
template <typename T>
T moeAuxLoss(const T *counts, const T *probSums, int64_t totalTokens,
             int64_t E, int64_t k, double coef);
// Adds daux * d aux / d probs (the counts held fixed) to dprobs, for this
// shard's `tokens` rows.
template <typename T>
void moeAuxLossBackward(const T *counts, int64_t totalTokens, int64_t E,
                        int64_t k, double coef, T daux, T *dprobs,
                        int64_t tokens);
// The router z-loss's sum over these tokens of logsumexp(logits[t])^2 (the
// loss is coef times the sum over all tokens, over their count), and its
// gradient times dsum, added to dlogits.
template <typename T> T moeZLossSum(const T *logits, int64_t tokens, int64_t E);
template <typename T>
void moeZLossBackward(const T *logits, int64_t tokens, int64_t E, T dsum,
                      T *dlogits);

// The forms a step calls (rt.moe_* ops): outputs written whole.
// moeDispatchPlan without earlier shards.
void moeDispatch(const int32_t *experts, int32_t *rowOf, int32_t *offsets,
                 int64_t tokens, int64_t k, int64_t E, int64_t capacity);
// With the tokens (`rows` rows of the batch here) split over `axes` and a
// capacity: the assignments of the tokens before this rank's in the serial
// order count first (their counts all-gathered over `axes`). The ranks of
// the group hold consecutive rows in group order; with tp among the axes
// (sequence parallelism) consecutive tp ranks hold consecutive pieces of
// the same rows, and the counts are gathered per row.
void moeDispatchGroup(const int32_t *experts, int32_t *rowOf,
                      int32_t *offsets, int64_t tokens, int64_t rows,
                      int64_t k, int64_t E, int64_t capacity, unsigned axes);
// groupedMatmul (and its weight gradient, summed) over `segments` row
// ranges (offsets [segments + 1]), segment s using expert s % E: the rows
// an expert-parallel rank received, by source rank, then its expert.
template <typename T>
void groupedMatmulSegments(const T *x, const T *W, T *out,
                           const int32_t *offsets, int64_t segments, int64_t E,
                           int64_t K, int64_t N, bool transW);
template <typename T>
void groupedMatmulWeightGradSegments(const T *x, const T *dout, T *dW,
                                     const int32_t *offsets, int64_t segments,
                                     int64_t E, int64_t K, int64_t N,
                                     bool transW);
// The same, added to dW except on the first microbatch.
template <typename T>
void groupedMatmulWeightGradSegmentsAccumulate(const T *x, const T *dout, T *dW,
                                               const int32_t *offsets,
                                               bool first, int64_t segments,
                                               int64_t E, int64_t K, int64_t N,
                                               bool transW);
// Expert parallelism over `axes` (E experts, E / g per rank): sends each
// expert's rows [offsets[e], offsets[e + 1]) of `rows` ([*, H]) to the rank
// holding e, after the counts (an all-to-all); receives into `recv`
// (recvRows rows, the rest zeroed) by source rank then expert, with
// recvOffsets [E + 1] those segments' row ranges.
void moeExchange(const float *rows, const int32_t *offsets, float *recv,
                 int32_t *recvOffsets, int64_t E, int64_t H, int64_t recvRows,
                 unsigned axes);
// The way back: each received segment's rows of `recvOut` ([*, N]) to
// where they came from, into `out` (rows rows, past offsets[E] zeroed).
void moeCombine(const float *recvOut, const int32_t *recvOffsets,
                const int32_t *offsets, float *out, int64_t E, int64_t N,
                int64_t rows, unsigned axes);
// counts and probSums [E] set (not added to) by moeLoadStats.
template <typename T>
void moeLoadStatsInto(const T *probs, const int32_t *experts, T *counts,
                      T *probSums, int64_t tokens, int64_t E, int64_t k);
// kept[e] = offsets[e + 1] - offsets[e]: the assignments each expert kept.
template <typename T>
void moeKeptCounts(const int32_t *offsets, T *kept, int64_t E);
// dprobs[t, e] = dprobSums[e]: the gradient of the probability sums.
template <typename T>
void moeProbSumsBackward(const T *dprobSums, T *dprobs, int64_t tokens,
                         int64_t E);
// loss[0] = moeAuxLoss(...); its gradient with respect to probSums (the
// counts held fixed) times dloss[0].
template <typename T>
void moeAuxLossForward(const T *counts, const T *probSums, T *loss,
                       int64_t totalTokens, int64_t E, int64_t k, double coef);
template <typename T>
void moeAuxLossGrad(const T *counts, const T *dloss, T *dprobSums,
                    int64_t totalTokens, int64_t E, int64_t k, double coef);
// loss[0] = coef * mean over the tokens of logsumexp(logits[t])^2, and
// dlogits = its gradient times dloss[0].
template <typename T>
void moeZLossForward(const T *logits, T *loss, int64_t tokens, int64_t E,
                     double coef);
template <typename T>
void moeZLossGrad(const T *logits, const T *dloss, T *dlogits, int64_t tokens,
                  int64_t E, double coef);

// out[i, :] = table[ids[i], :] for i < n; table is [V, C].
template <typename T>
void embeddingForward(const T *table, const int32_t *ids, T *out, int64_t n,
                      int64_t V, int64_t C);
// dtable = 0, then dtable[ids[i], :] += dout[i, :] in ascending i (a fixed,
// thread-count independent order so that runs are bitwise reproducible).
template <typename T>
void embeddingBackward(const int32_t *ids, const T *dout, T *dtable, int64_t n,
                       int64_t V, int64_t C);
// The same summed over microbatches in place: dtable is zeroed only when
// `first`, then dtable[ids[i], :] += dout[i, :] in ascending i.
template <typename T>
void embeddingBackwardAccumulate(const int32_t *ids, const T *dout, T *dtable,
                                 bool first, int64_t n, int64_t V, int64_t C);

// General transpose: out = permute(x, perm), x has shape[rank].
// out's dimension i is x's dimension perm[i].
template <typename T>
void transpose(const T *x, T *out, const int64_t *shape, const int64_t *perm,
               int rank);
// Views x as [outer, srcAxis, inner] and copies x[:, start:start+len, :]
// into out of shape [outer, len, inner] (split).
template <typename T>
void sliceAxis(const T *x, T *out, int64_t outer, int64_t srcAxis,
               int64_t inner, int64_t start, int64_t len);
// Views out as [outer, dstAxis, inner] and writes x [outer, len, inner] into
// out[:, start:start+len, :] (concat).
template <typename T>
void insertAxis(const T *x, T *out, int64_t outer, int64_t dstAxis,
                int64_t inner, int64_t start, int64_t len);
template <typename T> void copy(const T *x, T *out, int64_t n);
template <typename T> void fill(T *out, int64_t n, T value);

// Sum of squares of x, accumulated in double in a fixed order.
template <typename T> double sumSquares(const T *x, int64_t n);

// One AdamW step exactly as torch.optim.AdamW (decoupled weight decay, bias
// correction). step counts from 1. The gradient is multiplied by gradScale
// first (gradient clipping). m and v are updated in place, as is p.
void adamwUpdate(float *p, const float *g, float *m, float *v, int64_t n,
                 float lr, float beta1, float beta2, float eps,
                 float weightDecay, int64_t step, float gradScale);

//===--- The step's bookkeeping (same calls on the CUDA runtime) ----------===//

// acc = src when `first`, else acc += src: an input of the update summed
// over the step's microbatches.
template <typename T>
void accumulateSum(const T *src, T *acc, bool first, int64_t n);
// The gradient norm from fp64 partial sums: sums[0 .. n) = 0; each gradient
// adds the sum of its squares to its partial sum (accumulated in double in
// a fixed order); out[0] = sqrt(sums[0] + ... + sums[parts - 1]).
void zeroSums(double *sums, int64_t n);
template <typename T>
void addSumOfSquares(const T *x, double *sum, int64_t n);
template <typename T>
void normFromSums(const double *sums, T *out, int64_t parts);
// One AdamW step (adamwUpdate) with the gradient clipped by the global norm
// norm[0] to maxNorm (clipCoefficient); nothing at all when norm[0] is nan
// or inf (the step is skipped). `shadow` must be null: CPU programs have no
// low-precision copy of the parameters.
void adamwStep(float *p, void *shadow, const float *g, float *m, float *v,
               const float *norm, float lr, int64_t step, int64_t n,
               float beta1, float beta2, float eps, float weightDecay,
               float maxNorm);

// The optimizer sharded over the group `axes` (ZeRO-1): x, p and g are an
// n-element tensor at `runOffset` in a run cut into `piece`-element pieces
// in group order (reduceScatterShards); only its elements inside this
// rank's piece k are read, and m, v are the moments of piece k (element
// runOffset + i of the run at m[runOffset + i - k * piece]). With
// pieceGrads (ZeRO-2) x and g are piece k's storage too, indexed alike;
// with pieceParams (ZeRO-3) so is p.
void addSumOfSquaresShard(const float *x, double *sum, int64_t n,
                          int64_t runOffset, int64_t piece, unsigned axes,
                          bool pieceGrads);
void adamwStepShard(float *p, void *shadow, const float *g, float *m,
                    float *v, const float *norm, float lr, int64_t step,
                    int64_t n, int64_t runOffset, int64_t piece, unsigned axes,
                    bool pieceGrads, bool pieceParams, float beta1,
                    float beta2, float eps, float weightDecay, float maxNorm);

} // namespace tessel::rt

#endif // TESSEL_RUNTIME_KERNELS_H
