//===- Matmul.cpp - Batched matrix multiplication on OpenBLAS -------------===//
//
// C[b] = opA(A[b]) * opB(B[b]) (+ C[b] when accumulating). Every product goes
// through cblas_?gemm; OpenBLAS does its own threading inside each call.
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Kernels.h"

#include <cblas.h>

namespace tessel::rt {
namespace {

void gemm(bool transA, bool transB, int64_t M, int64_t N, int64_t K,
          const float *A, int64_t lda, const float *B, int64_t ldb, float beta,
          float *C, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, transA ? CblasTrans : CblasNoTrans,
              transB ? CblasTrans : CblasNoTrans, (blasint)M, (blasint)N,
              (blasint)K, 1.0f, A, (blasint)lda, B, (blasint)ldb, beta, C,
              (blasint)ldc);
}

void gemm(bool transA, bool transB, int64_t M, int64_t N, int64_t K,
          const double *A, int64_t lda, const double *B, int64_t ldb,
          double beta, double *C, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, transA ? CblasTrans : CblasNoTrans,
              transB ? CblasTrans : CblasNoTrans, (blasint)M, (blasint)N,
              (blasint)K, 1.0, A, (blasint)lda, B, (blasint)ldb, beta, C,
              (blasint)ldc);
}

} // namespace

template <typename T>
void matmul(const T *A, const T *B, T *C, int64_t batch, int64_t M, int64_t N,
            int64_t K, bool transA, bool transB, int64_t strideA,
            int64_t strideB, int64_t strideC, bool accumulate, int64_t ldc) {
  if (batch <= 0 || M <= 0 || N <= 0)
    return;
  // Leading dimension of C's rows as stored.
  if (ldc <= 0)
    ldc = N;
  if (K <= 0) {
    // Empty contraction: the product is zero.
    if (!accumulate)
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t i = 0; i < M; ++i)
          for (int64_t j = 0; j < N; ++j)
            C[b * strideC + i * ldc + j] = T(0);
    return;
  }
  const T beta = accumulate ? T(1) : T(0);
  // Leading dimensions of the row-major operands as stored.
  const int64_t lda = transA ? M : K;
  const int64_t ldb = transB ? K : N;

  // Shared B with contiguous, untransposed A batches: the batch is just more
  // rows of one GEMM, [batch * M, K] x [K, N].
  if (strideB == 0 && !transA &&
      (batch == 1 || (strideA == M * K && strideC == M * ldc))) {
    gemm(false, transB, batch * M, N, K, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  for (int64_t b = 0; b < batch; ++b)
    gemm(transA, transB, M, N, K, A + b * strideA, lda, B + b * strideB, ldb,
         beta, C + b * strideC, ldc);
}

template void matmul<float>(const float *, const float *, float *, int64_t,
                            int64_t, int64_t, int64_t, bool, bool, int64_t,
                            int64_t, int64_t, bool, int64_t);
template void matmul<double>(const double *, const double *, double *, int64_t,
                             int64_t, int64_t, int64_t, bool, bool, int64_t,
                             int64_t, int64_t, bool, int64_t);

} // namespace tessel::rt
