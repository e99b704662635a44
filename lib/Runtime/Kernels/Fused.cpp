//===- Fused.cpp - The fused kernels, composed of the plain ones ----------===//
//
// tessel-fuse-kernels joins kernels that run back to back into one call (a
// cuBLASLt epilogue or one pass over a row on the GPU). On the CPU each
// fused kernel runs its parts in the order the unfused program ran them, so
// a fused CPU program computes what the unfused one does (to the rounding
// of a GEMM that adds into its output); it exists so that the fusion pass
// is checked by training on the CPU. Some parts work in place on the
// kernel's own output, which the elementwise kernels allow.
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Kernels.h"

namespace tessel::rt {

template <typename T>
void matmulBias(const T *A, const T *B, const T *bias, T *out, T *gelu,
                int64_t M, int64_t N, int64_t K, bool transB) {
  matmul(A, B, out, 1, M, N, K, false, transB, 0, 0, 0);
  addBroadcast(out, bias, out, M * N, N);
  if (gelu)
    geluForward(out, gelu, M * N);
}

template <typename T>
void matmulBiasGradAccumulate(const T *A, const T *B, T *C, T *db, bool first,
                              int64_t M, int64_t N, int64_t K, int64_t ldc,
                              int64_t col) {
  reduceSumLeading(B, db + col, K, N);
  matmul(A, B, C + col, 1, M, N, K, true, false, 0, 0, 0,
         /*accumulate=*/!first, ldc);
}

template <typename T>
void matmulBiasGrad(const T *A, const T *B, T *C, T *db, int64_t M, int64_t N,
                    int64_t K, int64_t ldc, int64_t col) {
  matmulBiasGradAccumulate(A, B, C, db, /*first=*/true, M, N, K, ldc, col);
}

template <typename T>
void matmulGeluGrad(const T *A, const T *B, const T *pre, T *dx, int64_t M,
                    int64_t N, int64_t K, bool transB) {
  matmul(A, B, dx, 1, M, N, K, false, transB, 0, 0, 0);
  geluBackward(pre, dx, dx, M * N);
}

template <typename T>
void matmulAdd(const T *A, const T *B, const T *addend, T *out, int64_t M,
               int64_t N, int64_t K, bool transB) {
  copy(addend, out, M * N);
  matmul(A, B, out, 1, M, N, K, false, transB, 0, 0, 0, /*accumulate=*/true);
}

template <typename T>
void addLayerNormForward(const T *a, const T *r, T *sum, const T *w,
                         const T *b, T *out, int64_t rows, int64_t C,
                         double eps) {
  addBroadcast(a, r, sum, rows * C, rows * C);
  layerNormForward(sum, w, b, out, rows, C, eps);
}

template <typename T>
void addRmsNormForward(const T *a, const T *r, T *sum, const T *w, T *out,
                       int64_t rows, int64_t C, double eps) {
  addBroadcast(a, r, sum, rows * C, rows * C);
  rmsNormForward(sum, w, out, rows, C, eps);
}

template <typename T>
void layerNormBackwardAdd(const T *x, const T *w, const T *dout,
                          const T *dres, T *dx, T *dw, T *db, int64_t rows,
                          int64_t C, double eps) {
  layerNormBackward(x, w, dout, dx, dw, db, rows, C, eps);
  addBroadcast(dx, dres, dx, rows * C, rows * C);
}

template <typename T>
void rmsNormBackwardAdd(const T *x, const T *w, const T *dout, const T *dres,
                        T *dx, T *dw, int64_t rows, int64_t C, double eps) {
  rmsNormBackward(x, w, dout, dx, dw, rows, C, eps);
  addBroadcast(dx, dres, dx, rows * C, rows * C);
}

template <typename T>
void swigluForward(const T *gate, const T *up, T *out, T *siluOut, int64_t n) {
  if (siluOut) {
    siluForward(gate, siluOut, n);
    mulBroadcast(siluOut, up, out, n, n);
    return;
  }
  siluForward(gate, out, n);
  mulBroadcast(out, up, out, n, n);
}

#define TESSEL_INSTANTIATE(T)                                                  \
  template void matmulBias<T>(const T *, const T *, const T *, T *, T *,       \
                              int64_t, int64_t, int64_t, bool);                \
  template void matmulBiasGrad<T>(const T *, const T *, T *, T *, int64_t,     \
                                  int64_t, int64_t, int64_t, int64_t);         \
  template void matmulBiasGradAccumulate<T>(const T *, const T *, T *, T *,    \
                                            bool, int64_t, int64_t, int64_t,   \
                                            int64_t, int64_t);                 \
  template void matmulGeluGrad<T>(const T *, const T *, const T *, T *,        \
                                  int64_t, int64_t, int64_t, bool);            \
  template void matmulAdd<T>(const T *, const T *, const T *, T *, int64_t,    \
                             int64_t, int64_t, bool);                          \
  template void addLayerNormForward<T>(const T *, const T *, T *, const T *,   \
                                       const T *, T *, int64_t, int64_t,       \
                                       double);                                \
  template void addRmsNormForward<T>(const T *, const T *, T *, const T *,     \
                                     T *, int64_t, int64_t, double);           \
  template void layerNormBackwardAdd<T>(const T *, const T *, const T *,       \
                                        const T *, T *, T *, T *, int64_t,     \
                                        int64_t, double);                      \
  template void rmsNormBackwardAdd<T>(const T *, const T *, const T *,         \
                                      const T *, T *, T *, int64_t, int64_t,   \
                                      double);                                 \
  template void swigluForward<T>(const T *, const T *, T *, T *, int64_t);
TESSEL_INSTANTIATE(float)
TESSEL_INSTANTIATE(double)
#undef TESSEL_INSTANTIATE

} // namespace tessel::rt
