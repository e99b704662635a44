//===- Kernels.h - CUDA kernels of the Tessel runtime -----------*- C++ -*-===//
//
// Every kernel a program generated for `--target cuda` calls. The functions
// are host-side launchers: pointers are device pointers, work is enqueued on
// the compute stream (computeStream()) and nothing synchronises. Semantics
// are those of the CPU kernels of the same name (tessel/Runtime/Kernels.h),
// which are the reference every CUDA kernel is tested against.
//
// Storage types. Activations are `float` (train.precision "fp32") or `bf16`
// ("bf16"); parameters are fp32 master weights, read by matmuls through a
// bf16 shadow copy in bf16 mode; gradients of parameters, optimizer state,
// losses and norms are fp32. Each pointer argument of a kernel template is
// therefore a type parameter of its own; the library instantiates every
// combination of float and bf16 (see Instantiate.cuh). Whatever the storage
// type, arithmetic is fp32 and reductions accumulate in fp32 (or fp64 where
// the CPU kernel uses double).
//
// Each kernel family lives in one file under lib/Runtime/Cuda/.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_RUNTIME_CUDA_KERNELS_H
#define TESSEL_RUNTIME_CUDA_KERNELS_H

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace tessel::cuda {

using bf16 = __nv_bfloat16;

// The stream every kernel and GEMM is enqueued on.
cudaStream_t computeStream();

// Throws std::runtime_error naming `what`, the file and the line when
// `status` is an error. Kernel launches are checked with
// checkCuda(cudaGetLastError(), ...).
void checkCuda(cudaError_t status, const char *what, const char *file,
               int line);
#define TESSEL_CUDA_CHECK(call)                                                \
  ::tessel::cuda::checkCuda((call), #call, __FILE__, __LINE__)

//===--- Gemm.cu: cuBLASLt ------------------------------------------------===//

// C[b] = opA(A[b]) * opB(B[b]) (+ C[b] when accumulate), exactly the CPU
// matmul's contract (row-major, strides in elements, stride 0 broadcasts,
// C's rows ldc elements apart, 0: N). bf16 operands multiply with fp32
// accumulation; A and B have one type.
template <typename TA, typename TB, typename TC>
void matmul(const TA *A, const TB *B, TC *C, int64_t batch, int64_t M,
            int64_t N, int64_t K, bool transA, bool transB, int64_t strideA,
            int64_t strideB, int64_t strideC, bool accumulate = false,
            int64_t ldc = 0);

// Fused epilogue (cuBLASLt CUBLASLT_EPILOGUE_BIAS / GELU_AUX_BIAS):
// out = A * opB(B) + bias (row broadcast), and when `gelu` is non-null it
// receives gelu_tanh(out) while `out` keeps the pre-activation (which the
// GELU backward reads). A is [M, K] row-major, no batch.
template <typename TA, typename TB, typename TC>
void matmulBias(const TA *A, const TB *B, const float *bias, TC *out, TC *gelu,
                int64_t M, int64_t N, int64_t K, bool transB);

// A weight gradient with its bias gradient (cuBLASLt BGRADA on our B):
// C = A^T B (A stored [K, M], B [K, N]) and db = the column sums of B in
// fp32. Falls back to the plain product and reduceSumLeading when cuBLASLt
// has no algorithm (or C is not fp32, the type its bias gradient takes).
// As on the CPU, the product may be a column block of a wider gradient: C's
// rows ldc elements long (0: N), the product in their columns [col, col +
// N), the sums in db [col, col + N).
template <typename TA, typename TB, typename TC>
void matmulBiasGrad(const TA *A, const TB *B, TC *C, float *db, int64_t M,
                    int64_t N, int64_t K, int64_t ldc = 0, int64_t col = 0);

// The same, C summed over microbatches by the GEMM after the first (beta =
// 1, C is D); db written. Falls back as matmulBiasGrad does.
template <typename TA, typename TB, typename TC>
void matmulBiasGradAccumulate(const TA *A, const TB *B, TC *C, float *db,
                              bool first, int64_t M, int64_t N, int64_t K,
                              int64_t ldc = 0, int64_t col = 0);

// An input gradient through GELU (cuBLASLt DGELU): dx = gelu'(pre) *
// (A opB(B)), A [M, K] row-major; `pre` is the GELU's input as the forward
// epilogue stored it. Falls back to the product and geluBackward.
template <typename TA, typename TB, typename TC>
void matmulGeluGrad(const TA *A, const TB *B, const TC *pre, TC *dx,
                    int64_t M, int64_t N, int64_t K, bool transB);

// A weight gradient summed over microbatches by its GEMM: C = opA(A) opB(B)
// on the first, C + opA(A) opB(B) after (beta = 1: C is D, fp32 in place).
template <typename TA, typename TB, typename TC>
void matmulAccumulate(const TA *A, const TB *B, TC *C, bool first, int64_t M,
                      int64_t N, int64_t K, bool transA, bool transB) {
  matmul(A, B, C, 1, M, N, K, transA, transB, 0, 0, 0, /*accumulate=*/!first);
}

// out = addend + A opB(B) as one GEMM (C = addend, D = out, beta = 1).
template <typename TA, typename TB, typename TC>
void matmulAdd(const TA *A, const TB *B, const TC *addend, TC *out, int64_t M,
               int64_t N, int64_t K, bool transB);

//===--- Elementwise.cu ---------------------------------------------------===//

template <typename TA, typename TB, typename TO>
void addBroadcast(const TA *a, const TB *b, TO *out, int64_t n, int64_t nb);
template <typename TA, typename TB, typename TO>
void mulBroadcast(const TA *a, const TB *b, TO *out, int64_t n, int64_t nb);
// Column sums in fp32, deterministic (a fixed reduction tree).
template <typename TI, typename TO>
void reduceSumLeading(const TI *x, TO *out, int64_t rows, int64_t cols);
template <typename TI, typename TO>
void scale(const TI *x, TO *out, int64_t n, float s);
template <typename TI, typename TO>
void geluForward(const TI *x, TO *out, int64_t n);
template <typename TI, typename TG, typename TO>
void geluBackward(const TI *x, const TG *dout, TO *dx, int64_t n);
template <typename TI, typename TO>
void siluForward(const TI *x, TO *out, int64_t n);
template <typename TI, typename TG, typename TO>
void siluBackward(const TI *x, const TG *dout, TO *dx, int64_t n);
// Fused SwiGLU: out = silu(gate) * up; when `siluOut` is non-null it also
// receives silu(gate) (which the backward of the product reads).
template <typename TI, typename TO>
void swigluForward(const TI *gate, const TI *up, TO *out, TO *siluOut,
                   int64_t n);
// SwiGLU's backward, the SiLU taken again from the gate (nothing kept from
// the forward but gate and up): dgate = dout * up * silu'(gate), dup = dout
// * silu(gate).
template <typename TI, typename TG, typename TO>
void swigluBackward(const TI *gate, const TI *up, const TG *dout, TO *dgate,
                    TO *dup, int64_t n);
template <typename TI, typename TO> void copy(const TI *x, TO *out, int64_t n);
template <typename TO> void fill(TO *out, int64_t n, float value);

// out = permute(x, perm); shape and perm are host arrays of `rank` entries.
template <typename TI, typename TO>
void transpose(const TI *x, TO *out, const int64_t *shape, const int64_t *perm,
               int rank);
template <typename TI, typename TO>
void sliceAxis(const TI *x, TO *out, int64_t outer, int64_t srcAxis,
               int64_t inner, int64_t start, int64_t len);
template <typename TI, typename TO>
void insertAxis(const TI *x, TO *out, int64_t outer, int64_t dstAxis,
                int64_t inner, int64_t start, int64_t len);

// Embedding lookups. The backward is deterministic: each table entry sums
// its contributions in ascending i, in fp32 (the CPU's order).
template <typename TT, typename TO>
void embeddingForward(const TT *table, const int32_t *ids, TO *out, int64_t n,
                      int64_t V, int64_t C);
template <typename TG, typename TO>
void embeddingBackward(const int32_t *ids, const TG *dout, TO *dtable,
                       int64_t n, int64_t V, int64_t C);
// Vocab-parallel variants: this rank holds rows [vStart, vStart + Vl).
template <typename TT, typename TO>
void embeddingForwardRange(const TT *table, const int32_t *ids, TO *out,
                           int64_t n, int64_t vStart, int64_t Vl, int64_t C);
template <typename TG, typename TO>
void embeddingBackwardRange(const int32_t *ids, const TG *dout, TO *dtable,
                            int64_t n, int64_t vStart, int64_t Vl, int64_t C);
// The gradients summed over microbatches in place: the table is zeroed
// only when `first`, then each entry takes its contributions in ascending
// i after what it held (the CPU kernels' order).
template <typename TG, typename TO>
void embeddingBackwardAccumulate(const int32_t *ids, const TG *dout, TO *dtable,
                                 bool first, int64_t n, int64_t V, int64_t C);
template <typename TG, typename TO>
void embeddingBackwardRangeAccumulate(const int32_t *ids, const TG *dout,
                                      TO *dtable, bool first, int64_t n,
                                      int64_t vStart, int64_t Vl, int64_t C);

// Gradient accumulation over microbatches: acc = src when `first`, else
// acc += src (fp32 accumulator).
template <typename TI>
void accumulateInto(const TI *src, float *acc, int64_t n, bool first);

//===--- Rope.cu ----------------------------------------------------------===//

template <typename TI, typename TO>
void rope(const TI *x, TO *out, int64_t B, int64_t Tlen, int64_t H, int64_t D,
          double theta, bool inverse, int64_t first = 0, int64_t zigzag = 0,
          int64_t total = 0);

//===--- Dropout.cu -------------------------------------------------------===//

// As the CPU kernel (Kernels.h): the masks of Dropout.h, keyed by the step
// the runtime keeps in device memory (before start: rt::runningStep()).
template <typename TI, typename TO>
void dropout(const TI *x, TO *out, int64_t microbatch, const int64_t *shape,
             const int64_t *splitAxes, int64_t rank, int64_t microbatches,
             double p, int64_t seed, int64_t site, int64_t zigzag = 0);
// As the CPU kernel: a sequence into (or out of) the balanced order.
template <typename TI, typename TO>
void zigzag(const TI *x, TO *out, int64_t outer, int64_t len, int64_t inner,
            int64_t pieces, bool inverse);

//===--- Softmax.cu -------------------------------------------------------===//

// As the CPU kernels (Kernels.h): softmax of scale * x, causal rows.
template <typename TI, typename TO>
void softmaxForward(const TI *x, TO *out, int64_t rows, int64_t cols,
                    double scale = 1.0, bool causal = false);
template <typename TY, typename TG, typename TO>
void softmaxBackward(const TY *y, const TG *dy, TO *dx, int64_t rows,
                     int64_t cols, double scale = 1.0);

//===--- Norms.cu: fused residual add + LayerNorm / RMSNorm ---------------===//

// LayerNorm over the last dimension (biased variance), w and b fp32.
template <typename TI, typename TO>
void layerNormForward(const TI *x, const float *w, const float *b, TO *out,
                      int64_t rows, int64_t C, double eps);
// Fused residual add: sum = a + r is written (the residual stream goes on),
// and out = LayerNorm(sum). A row of a and r is read completely before that
// row of out is written, so out may be a or r (exactly), never sum.
template <typename TA, typename TR, typename TO>
void addLayerNormForward(const TA *a, const TR *r, TO *sum, const float *w,
                         const float *b, TO *out, int64_t rows, int64_t C,
                         double eps);
// Recomputes the statistics from x. dw and db are written (not accumulated),
// reduced over rows in a fixed order in fp32.
template <typename TI, typename TG, typename TO>
void layerNormBackward(const TI *x, const float *w, const TG *dout, TO *dx,
                       float *dw, float *db, int64_t rows, int64_t C,
                       double eps);
// Fused with the residual stream's gradient: dx = the LayerNorm backward's
// dx + dres (the sum autodiff forms for a value read by the norm and by the
// residual add). Each element of dx is written after its row of x, dout and
// dres has been read by the same thread, so dx may be exactly any of them.
template <typename TI, typename TG, typename TO>
void layerNormBackwardAdd(const TI *x, const float *w, const TG *dout,
                          const TO *dres, TO *dx, float *dw, float *db,
                          int64_t rows, int64_t C, double eps);
template <typename TI, typename TO>
void rmsNormForward(const TI *x, const float *w, TO *out, int64_t rows,
                    int64_t C, double eps);
template <typename TA, typename TR, typename TO>
void addRmsNormForward(const TA *a, const TR *r, TO *sum, const float *w,
                       TO *out, int64_t rows, int64_t C, double eps);
template <typename TI, typename TG, typename TO>
void rmsNormBackward(const TI *x, const float *w, const TG *dout, TO *dx,
                     float *dw, int64_t rows, int64_t C, double eps);
template <typename TI, typename TG, typename TO>
void rmsNormBackwardAdd(const TI *x, const float *w, const TG *dout,
                        const TO *dres, TO *dx, float *dw, int64_t rows,
                        int64_t C, double eps);

//===--- Attention.cu: flash attention ------------------------------------===//

// Causal (when causal) attention, q/out [B, T, H, D], k/v [B, Tkv, Hkv, D],
// scale 1/sqrt(D), never materialising the T x Tkv scores (tiles of queries
// and keys in shared memory, online softmax). D <= 128. lse [B, H, T] (fp32,
// may be null) receives each row's log-sum-exp of the scaled scores. The
// query rows are positions first .. first + T - 1 of the keys' sequence
// (kvLen 0: Tkv = T), as rt::attentionForward's.
template <typename T>
void attentionForward(const T *q, const T *k, const T *v, T *out, float *lse,
                      int64_t B, int64_t Tlen, int64_t H, int64_t Hkv,
                      int64_t D, bool causal, int64_t kvLen = 0,
                      int64_t first = 0, int64_t zigzag = 0);
// From the forward's out and lse: rowsum(dout * out) into `scratch`, then the
// flash-attention backward: a pass over key tiles (dK, dV) and one over query
// tiles (dQ). dk and dv of a KV head shared by several query heads are summed
// in fp32. `scratch` must hold attentionScratchBytes(...) bytes.
template <typename T>
void attentionBackward(const T *q, const T *k, const T *v, const T *out,
                       const float *lse, const T *dout, T *dq, T *dk, T *dv,
                       int64_t B, int64_t Tlen, int64_t H, int64_t Hkv,
                       int64_t D, bool causal, int64_t kvLen, int64_t first,
                       int64_t zigzag, void *scratch);
int64_t attentionScratchBytes(int64_t B, int64_t Tlen, int64_t H, int64_t Hkv,
                              int64_t D, int elementBytes);

//===--- CrossEntropy.cu: fused softmax + cross-entropy -------------------===//

// loss[0] = mean over rows of logsumexp(logits[r]) - logits[r, target[r]],
// one pass over each row (online max and sum), fp32 statistics. Only the
// first `valid` columns (the vocabulary, not its padding) take part.
template <typename TL>
void crossEntropyForward(const TL *logits, const int32_t *targets, float *loss,
                         int64_t rows, int64_t V, int64_t valid);
// dlogits = dloss[0] * (softmax - onehot) / rows; zero in the padding.
template <typename TL, typename TO>
void crossEntropyBackward(const TL *logits, const int32_t *targets,
                          const float *dloss, TO *dlogits, int64_t rows,
                          int64_t V, int64_t valid);
// Over a vocabulary shard: this rank holds columns [vStart, vStart + Vl);
// row statistics are combined over `axes` with NCCL all-reduces (max, then
// sum of exponentials and target logit); columns whose global index is
// `valid` or more (padding) take no part. `scratch` holds
// crossEntropyScratchBytes(rows) bytes. With `stats` (2 * rows floats) the
// forward keeps the combined row maxima, then the sums of exponentials,
// and the backward reads them instead of combining them again (no NCCL
// call); null to combine them in the backward too.
template <typename TL>
void crossEntropyVocabParallelForward(const TL *logits, const int32_t *targets,
                                      float *loss, float *stats, int64_t rows,
                                      int64_t Vl, int64_t vStart, unsigned axes,
                                      int64_t valid, void *scratch);
template <typename TL, typename TO>
void crossEntropyVocabParallelBackward(const TL *logits, const int32_t *targets,
                                       const float *dloss, TO *dlogits,
                                       const float *stats, int64_t rows,
                                       int64_t Vl, int64_t vStart,
                                       unsigned axes, int64_t valid,
                                       void *scratch);
int64_t crossEntropyScratchBytes(int64_t rows);

//===--- Moe.cu: mixture of experts ---------------------------------------===//
// A routed layer over `tokens` rows and E experts, each token sent to its
// top k; assignment a = t * k + s. The row ranges of the experts (offsets)
// stay on the device: no kernel here reads them on the host. The CPU
// kernels that return a host value (moeAuxLoss, moeZLossSum) have their
// step forms only (moeAuxLossForward, moeZLossForward), which write it to
// the device.

// The top k of each row of router probabilities [tokens, E], descending,
// the lower expert first on a tie, weights renormalised to sum to 1.
template <typename TP, typename TW>
void moeTopK(const TP *probs, int32_t *experts, TW *weights, int64_t tokens,
             int64_t E, int64_t k);
template <typename TP, typename TG, typename TO>
void moeTopKBackward(const TP *probs, const int32_t *experts,
                     const TG *dweights, TO *dprobs, int64_t tokens, int64_t E,
                     int64_t k, bool accumulate);
// The dispatch plan: rowOf[a] (-1 when dropped) and offsets [E + 1], in the
// CPU's order and with its capacity drops (`before` [E], device, nullable:
// the assignments of earlier shards). `scratch` holds
// moeDispatchScratchBytes(tokens, 1, k, E, 1) bytes.
void moeDispatchPlan(const int32_t *experts, int64_t tokens, int64_t k,
                     int64_t E, int64_t capacity, const int64_t *before,
                     int32_t *rowOf, int32_t *offsets, void *scratch);
// The same over `rows` runs of consecutive tokens whose capacity counts
// restart, run r after before[r * E + e] (nullable, [rows, E]) earlier
// assignments of expert e: the form moeDispatchGroup uses with the
// sequence split over tp.
void moeDispatchRuns(const int32_t *experts, int64_t tokens, int64_t rows,
                     int64_t k, int64_t E, int64_t capacity,
                     const int64_t *before, int32_t *rowOf, int32_t *offsets,
                     void *scratch);
void moeDispatch(const int32_t *experts, int32_t *rowOf, int32_t *offsets,
                 int64_t tokens, int64_t k, int64_t E, int64_t capacity,
                 void *scratch);
// With the tokens split over `axes` and a capacity: the counts per expert
// (per row with tp among the axes) all-gathered with NCCL, the earlier
// ranks' assignments counted first, as the CPU's moeDispatchGroup.
void moeDispatchGroup(const int32_t *experts, int32_t *rowOf, int32_t *offsets,
                      int64_t tokens, int64_t rows, int64_t k, int64_t E,
                      int64_t capacity, unsigned axes, void *scratch);
// The scratch any dispatch of `tokens` tokens in `rows` rows over a group
// of `groupSize` ranks needs.
int64_t moeDispatchScratchBytes(int64_t tokens, int64_t rows, int64_t k,
                                int64_t E, int64_t groupSize);
template <typename TI, typename TO>
void moePermute(const TI *x, const int32_t *rowOf, TO *xp, int64_t tokens,
                int64_t k, int64_t H);
template <typename TI, typename TO>
void moePermuteBackward(const TI *dxp, const int32_t *rowOf, TO *dx,
                        int64_t tokens, int64_t k, int64_t H);
template <typename TY, typename TW, typename TO>
void moeUnpermute(const TY *yp, const int32_t *rowOf, const TW *weights, TO *y,
                  int64_t tokens, int64_t k, int64_t H);
template <typename TY, typename TW, typename TG, typename TO, typename TD>
void moeUnpermuteBackward(const TY *yp, const int32_t *rowOf, const TW *weights,
                          const TG *dy, TO *dyp, TD *dweights, int64_t tokens,
                          int64_t k, int64_t H);
// The experts' products over their rows (fp32 accumulation; W may be the
// fp32 master weights under bf16 activations): segment s of the rows uses
// expert s % E.
template <typename TX, typename TW, typename TO>
void groupedMatmul(const TX *x, const TW *W, TO *out, const int32_t *offsets,
                   int64_t E, int64_t K, int64_t N, bool transW,
                   bool accumulate = false);
template <typename TX, typename TW, typename TO>
void groupedMatmulSegments(const TX *x, const TW *W, TO *out,
                           const int32_t *offsets, int64_t segments, int64_t E,
                           int64_t K, int64_t N, bool transW);
template <typename TX, typename TG, typename TO>
void groupedMatmulWeightGrad(const TX *x, const TG *dout, TO *dW,
                             const int32_t *offsets, int64_t E, int64_t K,
                             int64_t N, bool transW, bool accumulate = false);
template <typename TX, typename TG, typename TO>
void groupedMatmulWeightGradSegments(const TX *x, const TG *dout, TO *dW,
                                     const int32_t *offsets, int64_t segments,
                                     int64_t E, int64_t K, int64_t N,
                                     bool transW);
// The same, added to dW except on the first microbatch.
template <typename TX, typename TG, typename TO>
void groupedMatmulWeightGradSegmentsAccumulate(const TX *x, const TG *dout,
                                               TO *dW, const int32_t *offsets,
                                               bool first, int64_t segments,
                                               int64_t E, int64_t K, int64_t N,
                                               bool transW);
// Load statistics: moeLoadStats adds to counts and probSums, the Into form
// sets them.
template <typename TP, typename TO>
void moeLoadStats(const TP *probs, const int32_t *experts, TO *counts,
                  TO *probSums, int64_t tokens, int64_t E, int64_t k);
template <typename TP, typename TO>
void moeLoadStatsInto(const TP *probs, const int32_t *experts, TO *counts,
                      TO *probSums, int64_t tokens, int64_t E, int64_t k);
template <typename TO>
void moeKeptCounts(const int32_t *offsets, TO *kept, int64_t E);
template <typename TI, typename TO>
void moeProbSumsBackward(const TI *dprobSums, TO *dprobs, int64_t tokens,
                         int64_t E);
template <typename TC, typename TP, typename TO>
void moeAuxLossForward(const TC *counts, const TP *probSums, TO *loss,
                       int64_t totalTokens, int64_t E, int64_t k, double coef);
template <typename TC, typename TG, typename TO>
void moeAuxLossGrad(const TC *counts, const TG *dloss, TO *dprobSums,
                    int64_t totalTokens, int64_t E, int64_t k, double coef);
// Adds daux * d aux / d probs (the counts held fixed) to dprobs.
template <typename TC, typename TO>
void moeAuxLossBackward(const TC *counts, int64_t totalTokens, int64_t E,
                        int64_t k, double coef, float daux, TO *dprobs,
                        int64_t tokens);
template <typename TL, typename TO>
void moeZLossForward(const TL *logits, TO *loss, int64_t tokens, int64_t E,
                     double coef);
template <typename TL, typename TG, typename TO>
void moeZLossGrad(const TL *logits, const TG *dloss, TO *dlogits,
                  int64_t tokens, int64_t E, double coef);
// Adds dsum * d (sum of lse^2) / d logits to dlogits.
template <typename TL, typename TO>
void moeZLossBackward(const TL *logits, int64_t tokens, int64_t E, float dsum,
                      TO *dlogits);

//===--- Optimizer.cu -----------------------------------------------------===//

// acc[0] += sum of x^2 (fp64), deterministic.
template <typename TI> void sumSquaresInto(const TI *x, int64_t n, double *acc);
// out[0] = sqrt(acc[0] + ... + acc[parts - 1]) (fp32): the global norm from
// its partial sums (one per set of mesh axes the gradients are split over).
void sqrtInto(const double *acc, int parts, float *out);
// One AdamW step as torch.optim.AdamW on fp32 master weights p; the clip
// coefficient min(1, maxNorm / (norm[0] + 1e-6)) is computed on the device
// from the global norm (maxNorm <= 0: no clipping). When `shadow` is
// non-null it receives bf16(p) for the next step's matmuls.
void adamwUpdate(float *p, bf16 *shadow, const float *g, float *m, float *v,
                 int64_t n, float lr, float beta1, float beta2, float eps,
                 float weightDecay, int64_t step, const float *norm,
                 float maxNorm);
// The optimizer sharded over the group `axes` (ZeRO-1), as the CPU kernels
// of the same name: x, p and g are an n-element tensor at `runOffset` in a
// run cut into `piece`-element pieces in group order, and only its elements
// inside this rank's piece k (groupRank(axes), found on the host) are read
// or updated; m and v are the moments of piece k (element runOffset + i of
// the run at m[runOffset + i - k * piece]). With pieceGrads (ZeRO-2) x and
// g are piece k's storage too, indexed like the moments.
template <typename TI>
void addSumOfSquaresShard(const TI *x, double *sum, int64_t n,
                          int64_t runOffset, int64_t piece, unsigned axes,
                          bool pieceGrads);
void adamwStepShard(float *p, bf16 *shadow, const float *g, float *m, float *v,
                    const float *norm, float lr, int64_t step, int64_t n,
                    int64_t runOffset, int64_t piece, unsigned axes,
                    bool pieceGrads, bool pieceParams, float beta1,
                    float beta2, float eps,
                    float weightDecay, float maxNorm);
// Loss accumulation over microbatches on the device: acc[0] = x[0] when
// `first`, else acc[0] += x[0].
void scalarAccumulate(const float *x, float *acc, bool first);

//===--- The step's bookkeeping: the CPU runtime's calls ------------------===//
// (tessel/Runtime/Kernels.h), on the device.

template <typename TI>
void accumulateSum(const TI *src, float *acc, bool first, int64_t n) {
  accumulateInto(src, acc, n, first);
}
inline void zeroSums(double *sums, int64_t n) {
  TESSEL_CUDA_CHECK(
      cudaMemsetAsync(sums, 0, (size_t)n * sizeof(double), computeStream()));
}
template <typename TI>
void addSumOfSquares(const TI *x, double *sum, int64_t n) {
  sumSquaresInto(x, n, sum);
}
inline void normFromSums(const double *sums, float *out, int64_t parts) {
  sqrtInto(sums, (int)parts, out);
}
inline void adamwStep(float *p, bf16 *shadow, const float *g, float *m,
                      float *v, const float *norm, float lr, int64_t step,
                      int64_t n, float beta1, float beta2, float eps,
                      float weightDecay, float maxNorm) {
  adamwUpdate(p, shadow, g, m, v, n, lr, beta1, beta2, eps, weightDecay, step,
              norm, maxNorm);
}

} // namespace tessel::cuda

#endif // TESSEL_RUNTIME_CUDA_KERNELS_H
