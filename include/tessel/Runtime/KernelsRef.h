//===- KernelsRef.h - Naive reference kernels for the tests -----*- C++ -*-===//
//
// Obviously-correct, unoptimised versions of the kernels in Kernels.h with the
// same signatures and semantics, in namespace tessel::rt::ref. They compute in
// double internally (whatever T is) and exist only to check the real kernels;
// nothing in the runtime calls them. Instantiated for float and double.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_RUNTIME_KERNELSREF_H
#define TESSEL_RUNTIME_KERNELSREF_H

#include <cstdint>

namespace tessel::rt::ref {

template <typename T>
void matmul(const T *A, const T *B, T *C, int64_t batch, int64_t M, int64_t N,
            int64_t K, bool transA, bool transB, int64_t strideA,
            int64_t strideB, int64_t strideC, bool accumulate = false);

template <typename T>
void addBroadcast(const T *a, const T *b, T *out, int64_t n, int64_t nb);
template <typename T>
void mulBroadcast(const T *a, const T *b, T *out, int64_t n, int64_t nb);
template <typename T>
void reduceSumLeading(const T *x, T *out, int64_t rows, int64_t cols);
template <typename T> void scale(const T *x, T *out, int64_t n, T s);

template <typename T> void geluForward(const T *x, T *out, int64_t n);
template <typename T>
void geluBackward(const T *x, const T *dout, T *dx, int64_t n);
template <typename T> void siluForward(const T *x, T *out, int64_t n);
template <typename T>
void siluBackward(const T *x, const T *dout, T *dx, int64_t n);

template <typename T>
void layerNormForward(const T *x, const T *w, const T *b, T *out, int64_t rows,
                      int64_t C, double eps);
template <typename T>
void layerNormBackward(const T *x, const T *w, const T *dout, T *dx, T *dw,
                       T *db, int64_t rows, int64_t C, double eps);
template <typename T>
void rmsNormForward(const T *x, const T *w, T *out, int64_t rows, int64_t C,
                    double eps);
template <typename T>
void rmsNormBackward(const T *x, const T *w, const T *dout, T *dx, T *dw,
                     int64_t rows, int64_t C, double eps);

template <typename T>
void rope(const T *x, T *out, int64_t B, int64_t Tlen, int64_t H, int64_t D,
          double theta, bool inverse);

template <typename T>
void attentionForward(const T *q, const T *k, const T *v, T *out, int64_t B,
                      int64_t Tlen, int64_t H, int64_t Hkv, int64_t D,
                      bool causal);
template <typename T>
void attentionBackward(const T *q, const T *k, const T *v, const T *dout, T *dq,
                       T *dk, T *dv, int64_t B, int64_t Tlen, int64_t H,
                       int64_t Hkv, int64_t D, bool causal);

template <typename T>
void softmaxForward(const T *x, T *out, int64_t rows, int64_t cols,
                    double scale = 1.0, bool causal = false);
template <typename T>
void softmaxBackward(const T *y, const T *dy, T *dx, int64_t rows,
                     int64_t cols, double scale = 1.0);

template <typename T>
void crossEntropyForward(const T *logits, const int32_t *targets, T *loss,
                         int64_t rows, int64_t V);
template <typename T>
void crossEntropyBackward(const T *logits, const int32_t *targets,
                          const T *dloss, T *dlogits, int64_t rows, int64_t V);

template <typename T>
void embeddingForward(const T *table, const int32_t *ids, T *out, int64_t n,
                      int64_t V, int64_t C);
template <typename T>
void embeddingBackward(const int32_t *ids, const T *dout, T *dtable, int64_t n,
                       int64_t V, int64_t C);

template <typename T>
void transpose(const T *x, T *out, const int64_t *shape, const int64_t *perm,
               int rank);
template <typename T>
void sliceAxis(const T *x, T *out, int64_t outer, int64_t srcAxis,
               int64_t inner, int64_t start, int64_t len);
template <typename T>
void insertAxis(const T *x, T *out, int64_t outer, int64_t dstAxis,
                int64_t inner, int64_t start, int64_t len);
template <typename T> void copy(const T *x, T *out, int64_t n);
template <typename T> void fill(T *out, int64_t n, T value);
template <typename T> double sumSquares(const T *x, int64_t n);

// Mixture of experts: the top k by a stable sort of each row, the dispatch
// by a scan of each expert's assignments, rows moved one by one, each
// expert's product by the reference matmul, the losses from their formulas.
template <typename T>
void moeTopK(const T *probs, int32_t *experts, T *weights, int64_t tokens,
             int64_t E, int64_t k);
int64_t moeDispatchPlan(const int32_t *experts, int64_t tokens, int64_t k,
                        int64_t E, int64_t capacity, const int64_t *before,
                        int32_t *rowOf, int32_t *offsets);
template <typename T>
void moePermute(const T *x, const int32_t *rowOf, T *xp, int64_t tokens,
                int64_t k, int64_t H);
template <typename T>
void moeUnpermute(const T *yp, const int32_t *rowOf, const T *weights, T *y,
                  int64_t tokens, int64_t k, int64_t H);
template <typename T>
void groupedMatmul(const T *x, const T *W, T *out, const int32_t *offsets,
                   int64_t E, int64_t K, int64_t N, bool transW,
                   bool accumulate = false);
template <typename T>
T moeAuxLoss(const T *probs, const int32_t *experts, int64_t tokens,
             int64_t E, int64_t k, double coef);
template <typename T> T moeZLossSum(const T *logits, int64_t tokens, int64_t E);

} // namespace tessel::rt::ref

#endif // TESSEL_RUNTIME_KERNELSREF_H
