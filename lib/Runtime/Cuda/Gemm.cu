//===- Gemm.cu - Batched matrix multiplication on cuBLASLt ----------------===//
//
// The CUDA counterpart of lib/Runtime/Kernels/Matmul.cpp. cuBLASLt is
// column-major, and a row-major matrix read as column-major is its
// transpose, so row-major C = opA(A) * opB(B) is issued as column-major
// C^T = opB(B)^T * opA(A)^T: cuBLASLt's first operand is our B, its second
// our A, and its output has N rows and M columns.
//
// Arithmetic is CUBLAS_COMPUTE_32F with fp32 scales: bf16 operands multiply
// with fp32 accumulation, and fp32 operands stay fp32 (no TF32), so fp32
// results match the CPU to rounding. cuBLASLt takes one type for A and B,
// and fp32 operands only with an fp32 result; the other instantiations
// exist so that every combination links, and throw.
//
// Descriptors, layouts and the heuristic's algorithm are built once per
// problem (types, shape, transposes, batch and strides, beta, epilogue and
// pointer alignments) and kept in a small map, so a step's repeated shapes
// query the heuristic once. The handle and one workspace are created by
// gemmInit() when the device starts; a step allocates nothing.
//
// matmulBias fuses the bias (and GELU) into the epilogue when cuBLASLt has
// an algorithm for it (GELU_AUX_BIAS writes gelu to D and the pre-activation
// to the auxiliary buffer, so D is our `gelu` and the auxiliary buffer our
// `out`); otherwise it runs the plain product and one bias + GELU kernel.
// cuBLASLt's epilogue takes the bias in D's type only, so a bf16 product
// first rounds the fp32 bias to bf16 into a small buffer beside the
// workspace (as PyTorch's autocast casts a linear layer's bias); an fp32
// bias would send every bf16 layer to the separate kernel, which costs
// more than the matmul's epilogue (measured on an H200).
//
//===----------------------------------------------------------------------===//

#include "Internal.h"

#include <cublasLt.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace tessel::cuda {

using detail::blocksFor;
using detail::fromFloat;
using detail::toFloat;

namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;
// The bf16 copy of a bias (elements), after the workspace in one allocation.
constexpr int64_t kBiasElements = int64_t(1) << 19;
constexpr int kThreads = 256;

template <typename T> constexpr cudaDataType_t dataTypeOf() {
  return std::is_same_v<T, float> ? CUDA_R_32F : CUDA_R_16BF;
}

const char *typeName(cudaDataType_t t) {
  return t == CUDA_R_32F ? "fp32" : t == CUDA_R_16BF ? "bf16" : "?";
}

// Largest power of two, at most 256, dividing the address and, when the
// operand is batched, its batch offset in bytes: every matrix of the batch
// starts at least that aligned. cuBLASLt's heuristic assumes 256 unless told.
uint32_t alignmentOf(const void *ptr, int64_t strideElems, int64_t batch,
                     size_t elemBytes) {
  uint64_t bits = uint64_t(reinterpret_cast<uintptr_t>(ptr)) | 256u;
  if (batch > 1 && strideElems != 0)
    bits |= uint64_t(strideElems) * elemBytes;
  return uint32_t(bits & (~bits + 1));
}

// One row-major product as the runtime sees it: what keys the plan cache and
// what error messages describe.
struct GemmCall {
  cudaDataType_t abType = CUDA_R_32F, cType = CUDA_R_32F;
  int64_t M = 0, N = 0, K = 0, batch = 1;
  int64_t strideA = 0, strideB = 0, strideC = 0;
  // C's rows are ldc elements apart (0: N).
  int64_t ldc = 0;
  bool transA = false, transB = false, accumulate = false;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  uint32_t alignA = 256, alignB = 256, alignC = 256, alignBias = 256,
           alignAux = 256;

  using Key = std::array<int64_t, 17>;
  Key key() const {
    const int64_t flags =
        int64_t(transA) | int64_t(transB) << 1 | int64_t(accumulate) << 2;
    return {abType,  cType,   M,       N,         K,       batch,
            strideA, strideB, strideC, ldc,       flags,   epilogue,
            alignA,  alignB,  alignC,  alignBias, alignAux};
  }

  std::string describe() const {
    std::string s = epilogue == CUBLASLT_EPILOGUE_DEFAULT ? "matmul"
                    : epilogue == CUBLASLT_EPILOGUE_BGRADA ? "matmulBiasGrad"
                    : epilogue == CUBLASLT_EPILOGUE_DGELU  ? "matmulGeluGrad"
                                                           : "matmulBias";
    s += " M=" + std::to_string(M) + " N=" + std::to_string(N) +
         " K=" + std::to_string(K) + " batch=" + std::to_string(batch) +
         " transA=" + std::to_string(int(transA)) +
         " transB=" + std::to_string(int(transB)) + " strides=(" +
         std::to_string(strideA) + ", " + std::to_string(strideB) + ", " +
         std::to_string(strideC) + ")" +
         (ldc > 0 && ldc != N ? " ldc=" + std::to_string(ldc) : "") +
         " accumulate=" + std::to_string(int(accumulate)) + " A/B " +
         typeName(abType) + " C " + typeName(cType);
    if (epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS)
      s += " epilogue GELU_AUX_BIAS";
    else if (epilogue == CUBLASLT_EPILOGUE_BIAS)
      s += " epilogue BIAS";
    else if (epilogue == CUBLASLT_EPILOGUE_BGRADA)
      s += " epilogue BGRADA";
    else if (epilogue == CUBLASLT_EPILOGUE_DGELU)
      s += " epilogue DGELU";
    return s;
  }
};

void checkLt(cublasStatus_t status, const char *what, const GemmCall &call) {
  if (status == CUBLAS_STATUS_SUCCESS)
    return;
  throw std::runtime_error(
      std::string(what) + " failed: " + cublasLtGetStatusName(status) + " (" +
      cublasLtGetStatusString(status) + ") for " + call.describe());
}

// cuBLASLt's description of one problem; `found` is false when the heuristic
// has no algorithm for it.
struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t first = nullptr;  // our B
  cublasLtMatrixLayout_t second = nullptr; // our A
  cublasLtMatrixLayout_t out = nullptr;    // C and D
  cublasLtMatmulAlgo_t algo = {};
  bool found = false;
};

struct GemmState {
  std::mutex mutex;
  cublasLtHandle_t handle = nullptr;
  void *workspace = nullptr;
  bf16 *biasBf16 = nullptr; // kBiasElements, after the workspace
  std::map<GemmCall::Key, Plan> plans;
};

GemmState &state() {
  static GemmState s;
  return s;
}

void destroyPlan(Plan &p) {
  // Destruction of valid descriptors does not fail; statuses are ignored so
  // that shutdown releases everything it can.
  if (p.op)
    cublasLtMatmulDescDestroy(p.op);
  if (p.first)
    cublasLtMatrixLayoutDestroy(p.first);
  if (p.second)
    cublasLtMatrixLayoutDestroy(p.second);
  if (p.out)
    cublasLtMatrixLayoutDestroy(p.out);
  p = Plan();
}

template <typename V>
void setDesc(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
             const V &value, const GemmCall &call) {
  checkLt(cublasLtMatmulDescSetAttribute(d, attr, &value, sizeof(value)),
          "cublasLtMatmulDescSetAttribute", call);
}

// A column-major layout of rows x cols with leading dimension `ld` (0:
// rows), batched with the given element stride.
cublasLtMatrixLayout_t makeLayout(cudaDataType_t type, int64_t rows,
                                  int64_t cols, int64_t batch, int64_t stride,
                                  const GemmCall &call, int64_t ld = 0) {
  cublasLtMatrixLayout_t layout = nullptr;
  checkLt(cublasLtMatrixLayoutCreate(&layout, type, uint64_t(rows),
                                     uint64_t(cols), ld > 0 ? ld : rows),
          "cublasLtMatrixLayoutCreate", call);
  if (batch > 1) {
    const int32_t count = int32_t(batch);
    cublasStatus_t s = cublasLtMatrixLayoutSetAttribute(
        layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count));
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatrixLayoutSetAttribute(
          layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
          sizeof(stride));
    if (s != CUBLAS_STATUS_SUCCESS) {
      cublasLtMatrixLayoutDestroy(layout);
      checkLt(s, "cublasLtMatrixLayoutSetAttribute", call);
    }
  }
  return layout;
}

// Sets the epilogue's per-call pointers (their alignment is part of the key,
// their values are not).
void setEpiloguePointers(const Plan &p, const GemmCall &call, const void *bias,
                         void *aux) {
  if (call.epilogue == CUBLASLT_EPILOGUE_DEFAULT)
    return;
  if (call.epilogue != CUBLASLT_EPILOGUE_DGELU)
    setDesc(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias, call);
  if (call.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS ||
      call.epilogue == CUBLASLT_EPILOGUE_DGELU)
    setDesc(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux, call);
}

Plan buildPlan(cublasLtHandle_t handle, const GemmCall &call, const void *bias,
               void *aux) {
  Plan p;
  try {
    checkLt(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F),
            "cublasLtMatmulDescCreate", call);
    // Our B is cuBLASLt's A and our A its B (see the file comment).
    const cublasOperation_t opFirst = call.transB ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t opSecond = call.transA ? CUBLAS_OP_T : CUBLAS_OP_N;
    setDesc(p.op, CUBLASLT_MATMUL_DESC_TRANSA, opFirst, call);
    setDesc(p.op, CUBLASLT_MATMUL_DESC_TRANSB, opSecond, call);

    // Row-major B is [K, N] (or [N, K] when transB): column-major N x K
    // (K x N) with leading dimension N (K). Likewise for A; C is N x M.
    const int64_t M = call.M, N = call.N, K = call.K;
    p.first = makeLayout(call.abType, call.transB ? K : N, call.transB ? N : K,
                         call.batch, call.strideB, call);
    p.second = makeLayout(call.abType, call.transA ? M : K, call.transA ? K : M,
                          call.batch, call.strideA, call);
    p.out =
        makeLayout(call.cType, N, M, call.batch, call.strideC, call, call.ldc);

    if (call.epilogue != CUBLASLT_EPILOGUE_DEFAULT) {
      const uint32_t epilogue = call.epilogue;
      setDesc(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue, call);
      // The bias and the auxiliary buffer keep cuBLASLt's default type,
      // D's (a bf16 product's bias is the rounded copy).
      if (call.epilogue == CUBLASLT_EPILOGUE_GELU_AUX_BIAS ||
          call.epilogue == CUBLASLT_EPILOGUE_DGELU) {
        const int64_t auxLd = N;
        setDesc(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, auxLd, call);
      }
      // The heuristic reads the pointers' alignment.
      setEpiloguePointers(p, call, bias, aux);
    }

    cublasLtMatmulPreference_t pref = nullptr;
    checkLt(cublasLtMatmulPreferenceCreate(&pref),
            "cublasLtMatmulPreferenceCreate", call);
    const uint64_t workspace = kWorkspaceBytes;
    const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, call.alignB},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, call.alignA},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, call.alignC},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, call.alignC}};
    cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
        sizeof(workspace));
    for (const auto &[attr, value] : aligns)
      if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, attr, &value,
                                                 sizeof(value));
    cublasLtMatmulHeuristicResult_t result = {};
    int returned = 0;
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulAlgoGetHeuristic(handle, p.op, p.first, p.second, p.out,
                                         p.out, pref, 1, &result, &returned);
    cublasLtMatmulPreferenceDestroy(pref);
    // No algorithm, or an epilogue whose types cuBLASLt rejects (the fp32
    // bias of a bf16 result, say): the caller decides what to do.
    const bool unsupported = s == CUBLAS_STATUS_NOT_SUPPORTED ||
                             (s == CUBLAS_STATUS_INVALID_VALUE &&
                              call.epilogue != CUBLASLT_EPILOGUE_DEFAULT);
    if (unsupported)
      returned = 0;
    else
      checkLt(s, "cublasLtMatmulAlgoGetHeuristic", call);
    p.found = returned > 0 && result.state == CUBLAS_STATUS_SUCCESS;
    if (p.found)
      p.algo = result.algo;
  } catch (...) {
    destroyPlan(p);
    throw;
  }
  return p;
}

// The cached plan of `call`, built on first use. Requires the state's mutex.
Plan &planFor(GemmState &st, const GemmCall &call, const void *bias,
              void *aux) {
  const GemmCall::Key key = call.key();
  auto it = st.plans.find(key);
  if (it == st.plans.end())
    it = st.plans.emplace(key, buildPlan(st.handle, call, bias, aux)).first;
  return it->second;
}

GemmState &initialisedState(const GemmCall &call) {
  GemmState &st = state();
  if (!st.handle)
    throw std::runtime_error(
        "cuBLASLt is not initialised (gemmInit runs when the CUDA device "
        "starts) for " +
        call.describe());
  return st;
}

// D = first * second (+ C) in cuBLASLt's terms; D is C except for the GELU
// epilogue, whose D is the GELU output. Returns the status so that the
// fused epilogue can fall back.
cublasStatus_t launchPlan(GemmState &st, const Plan &p, const void *A,
                          const void *B, const void *C, void *D, float beta) {
  const float alpha = 1.0f;
  return cublasLtMatmul(st.handle, p.op, &alpha, B, p.first, A, p.second, &beta,
                        C, p.out, D, p.out, &p.algo, st.workspace,
                        kWorkspaceBytes, computeStream());
}

// One strided-batched product, through its cached plan.
void runGemm(const GemmCall &call, const void *A, const void *B, void *C) {
  GemmState &st = initialisedState(call);
  std::lock_guard<std::mutex> lock(st.mutex);
  Plan &p = planFor(st, call, nullptr, nullptr);
  if (!p.found)
    throw std::runtime_error("cuBLASLt has no algorithm for " +
                             call.describe());
  checkLt(launchPlan(st, p, A, B, C, C, call.accumulate ? 1.0f : 0.0f),
          "cublasLtMatmul", call);
}

template <typename T>
__global__ void zeroBatchesKernel(T *C, int64_t batch, int64_t MN,
                                  int64_t strideC) {
  const int64_t total = batch * MN;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(blockDim.x) * gridDim.x)
    C[(i / MN) * strideC + i % MN] = fromFloat<T>(0.0f);
}

// GELU, tanh approximation, with the exp-based tanh of the CPU float kernel.
__device__ inline float geluTanh(float x) {
  const float c = float(0.7978845608028654); // sqrt(2/pi)
  const float u = c * (x + 0.044715f * x * x * x);
  const float th = 1.0f - 2.0f / (1.0f + expf(2.0f * u));
  return 0.5f * x * (1.0f + th);
}

// The bf16 copy of a bias for the fused epilogue.
__global__ void toBf16Kernel(const float *x, bf16 *out, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(blockDim.x) * gridDim.x)
    out[i] = fromFloat<bf16>(x[i]);
}

// The unfused epilogue: out += bias (row broadcast); gelu = gelu(out) of the
// stored pre-activation.
template <typename T>
__global__ void biasGeluKernel(T *out, T *gelu, const float *bias, int64_t n,
                               int64_t N) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(blockDim.x) * gridDim.x) {
    const T pre = fromFloat<T>(toFloat(out[i]) + bias[i % N]);
    out[i] = pre;
    if (gelu)
      gelu[i] = fromFloat<T>(geluTanh(toFloat(pre)));
  }
}

template <typename TA, typename TB, typename TC>
constexpr bool supportedTypes() {
  return std::is_same_v<TA, TB> &&
         !(std::is_same_v<TA, float> && std::is_same_v<TC, bf16>);
}

template <typename TA, typename TB, typename TC>
[[noreturn]] void unsupportedTypes(const char *kernel) {
  throw std::runtime_error(
      std::string(kernel) + ": A " + typeName(dataTypeOf<TA>()) + ", B " +
      typeName(dataTypeOf<TB>()) + ", C " + typeName(dataTypeOf<TC>()) +
      " is not supported: cuBLASLt multiplies operands of one type, and fp32 "
      "operands only into an fp32 result");
}

// One product of row-major [M, K] (or [K, M] when transA) rows, no batch,
// with the operands' alignments.
template <typename TA, typename TB, typename TC>
GemmCall rowsCall(const TA *A, const TB *B, const TC *D, int64_t M, int64_t N,
                  int64_t K, bool transA, bool transB,
                  cublasLtEpilogue_t epilogue) {
  GemmCall call;
  call.abType = dataTypeOf<TA>();
  call.cType = dataTypeOf<TC>();
  call.M = M;
  call.N = N;
  call.K = K;
  call.transA = transA;
  call.transB = transB;
  call.epilogue = epilogue;
  call.alignA = alignmentOf(A, 0, 1, sizeof(TA));
  call.alignB = alignmentOf(B, 0, 1, sizeof(TB));
  call.alignC = alignmentOf(D, 0, 1, sizeof(TC));
  return call;
}

// Runs `call` (one product, no batch) with its epilogue's pointers through
// its cached plan, D = C except where the caller says; `prepare` runs right
// before the launch, on the stream, once an algorithm is found. Returns false when
// cuBLASLt has no algorithm for the epilogue or rejects it at launch (the
// plan then stays unfused for this problem), so the caller runs the
// unfused kernels.
bool tryFused(GemmCall &call, const void *A, const void *B, const void *C,
              void *D, float beta, const void *bias, size_t biasBytes,
              void *aux, const std::function<void()> &prepare = {}) {
  GemmState &st = initialisedState(call);
  std::lock_guard<std::mutex> lock(st.mutex);
  if (bias)
    call.alignBias = alignmentOf(bias, 0, 1, biasBytes);
  Plan &p = planFor(st, call, bias, aux);
  if (!p.found)
    return false;
  if (prepare)
    prepare();
  setEpiloguePointers(p, call, bias, aux);
  const cublasStatus_t s = launchPlan(st, p, A, B, C, D, beta);
  if (s == CUBLAS_STATUS_SUCCESS)
    return true;
  if (s != CUBLAS_STATUS_NOT_SUPPORTED && s != CUBLAS_STATUS_INVALID_VALUE)
    checkLt(s, "cublasLtMatmul", call);
  p.found = false;
  return false;
}

} // namespace

namespace detail {

void gemmInit() {
  GemmState &st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  if (st.handle)
    return;
  cublasLtHandle_t handle = nullptr;
  const cublasStatus_t s = cublasLtCreate(&handle);
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("cublasLtCreate failed: ") +
                             cublasLtGetStatusName(s) + " (" +
                             cublasLtGetStatusString(s) + ")");
  const cudaError_t e =
      cudaMalloc(&st.workspace, kWorkspaceBytes + kBiasElements * sizeof(bf16));
  if (e != cudaSuccess) {
    cublasLtDestroy(handle);
    st.workspace = nullptr;
    checkCuda(e, "cudaMalloc of the cuBLASLt workspace", __FILE__, __LINE__);
  }
  st.biasBf16 = reinterpret_cast<bf16 *>(static_cast<char *>(st.workspace) +
                                         kWorkspaceBytes);
  st.handle = handle;
}

void gemmShutdown() {
  GemmState &st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  if (!st.handle)
    return;
  // Matmuls still in flight use the workspace.
  TESSEL_CUDA_CHECK(cudaDeviceSynchronize());
  for (auto &[key, plan] : st.plans)
    destroyPlan(plan);
  st.plans.clear();
  TESSEL_CUDA_CHECK(cudaFree(st.workspace));
  st.workspace = nullptr;
  st.biasBf16 = nullptr;
  cublasLtDestroy(st.handle);
  st.handle = nullptr;
}

} // namespace detail

template <typename TA, typename TB, typename TC>
void matmul(const TA *A, const TB *B, TC *C, int64_t batch, int64_t M,
            int64_t N, int64_t K, bool transA, bool transB, int64_t strideA,
            int64_t strideB, int64_t strideC, bool accumulate, int64_t ldc) {
  if constexpr (!supportedTypes<TA, TB, TC>()) {
    unsupportedTypes<TA, TB, TC>("matmul");
  } else {
    if (batch <= 0 || M <= 0 || N <= 0)
      return;
    if (ldc <= 0)
      ldc = N;
    if (K <= 0) {
      // Empty contraction: the product is zero (M rows of N, ldc apart, per
      // batch entry).
      if (!accumulate)
        for (int64_t b = 0; b < (ldc == N ? 1 : batch); ++b) {
          const int64_t rows = ldc == N ? batch : M;
          const int64_t each = ldc == N ? M * N : N;
          const int64_t stride = ldc == N ? strideC : ldc;
          zeroBatchesKernel<<<blocksFor(rows * each), kThreads, 0,
                              computeStream()>>>(C + b * strideC, rows, each,
                                                 stride);
          TESSEL_CUDA_CHECK(cudaGetLastError());
        }
      return;
    }
    // Shared B with contiguous, untransposed A batches: the batch is more
    // rows of one product, [batch * M, K] x [K, N] (as the CPU kernel does).
    if (batch > 1 && strideB == 0 && !transA && strideA == M * K &&
        strideC == M * ldc) {
      M *= batch;
      batch = 1;
    }
    if (batch == 1)
      strideA = strideB = strideC = 0;

    // The alignments are set below, per batch layout.
    GemmCall call = rowsCall(A, B, C, M, N, K, transA, transB,
                             CUBLASLT_EPILOGUE_DEFAULT);
    call.accumulate = accumulate;
    call.ldc = ldc == N ? 0 : ldc;

    // cuBLASLt's strided batch takes non-negative strides, an int32 count,
    // and outputs that do not overlap. Anything else (a shared C summing
    // the products, say) runs as one product per batch entry, in order,
    // which is the CPU kernel's semantics.
    const bool strided =
        batch == 1 || (strideA >= 0 && strideB >= 0 && strideC >= M * ldc &&
                       batch <= INT32_MAX);
    if (strided) {
      call.batch = batch;
      call.strideA = strideA;
      call.strideB = strideB;
      call.strideC = strideC;
      call.alignA = alignmentOf(A, strideA, batch, sizeof(TA));
      call.alignB = alignmentOf(B, strideB, batch, sizeof(TB));
      call.alignC = alignmentOf(C, strideC, batch, sizeof(TC));
      runGemm(call, A, B, C);
      return;
    }
    for (int64_t b = 0; b < batch; ++b) {
      const TA *Ab = A + b * strideA;
      const TB *Bb = B + b * strideB;
      TC *Cb = C + b * strideC;
      call.alignA = alignmentOf(Ab, 0, 1, sizeof(TA));
      call.alignB = alignmentOf(Bb, 0, 1, sizeof(TB));
      call.alignC = alignmentOf(Cb, 0, 1, sizeof(TC));
      runGemm(call, Ab, Bb, Cb);
    }
  }
}

template <typename TA, typename TB, typename TC>
void matmulBias(const TA *A, const TB *B, const float *bias, TC *out, TC *gelu,
                int64_t M, int64_t N, int64_t K, bool transB) {
  if constexpr (!supportedTypes<TA, TB, TC>()) {
    unsupportedTypes<TA, TB, TC>("matmulBias");
  } else {
    if (M <= 0 || N <= 0)
      return;
    // D is `gelu` when fused with GELU (the pre-activation goes to the
    // auxiliary buffer, `out`), else `out`.
    TC *D = gelu ? gelu : out;
    GemmCall call = rowsCall(
        A, B, D, M, N, K, false, transB,
        gelu ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_BIAS);
    call.alignAux = gelu ? alignmentOf(out, 0, 1, sizeof(TC)) : 256;

    // The auxiliary buffer's leading dimension must be a multiple of 8, and
    // a bf16 product's bias must fit the buffer of its rounded copy.
    constexpr bool roundBias = std::is_same_v<TC, bf16>;
    if (K > 0 && (!gelu || N % 8 == 0) && (!roundBias || N <= kBiasElements)) {
      bf16 *copy = initialisedState(call).biasBf16;
      const void *epilogueBias =
          roundBias ? static_cast<const void *>(copy) : bias;
      // Stream-ordered: the previous product reading the copy is done
      // before this one overwrites it.
      auto roundBiasIntoCopy = [&] {
        toBf16Kernel<<<blocksFor(N), kThreads, 0, computeStream()>>>(bias,
                                                                     copy, N);
        TESSEL_CUDA_CHECK(cudaGetLastError());
      };
      if (tryFused(call, A, B, D, D, 0.0f, epilogueBias, roundBias ? 2 : 4,
                   gelu ? out : nullptr,
                   roundBias ? std::function<void()>(roundBiasIntoCopy)
                             : std::function<void()>()))
        return;
    }
    matmul(A, B, out, 1, M, N, K, false, transB, 0, 0, 0, false);
    const int64_t n = M * N;
    biasGeluKernel<<<blocksFor(n), kThreads, 0, computeStream()>>>(out, gelu,
                                                                   bias, n, N);
    TESSEL_CUDA_CHECK(cudaGetLastError());
  }
}

// C = A^T B, or C + A^T B when accumulating, with db = the column sums of
// B (the two bias-gradient entry points), in columns [col, col + N) of C's
// rows of ldc and of db.
template <typename TA, typename TB, typename TC>
void biasGradProduct(const TA *A, const TB *B, TC *C, float *db, int64_t M,
                     int64_t N, int64_t K, int64_t ldc, int64_t col,
                     bool accumulate) {
  if constexpr (!supportedTypes<TA, TB, TC>()) {
    unsupportedTypes<TA, TB, TC>("matmulBiasGrad");
  } else {
    if (M <= 0 || N <= 0)
      return;
    if (ldc <= 0)
      ldc = N;
    C += col;
    db += col;
    // cuBLASLt's first operand is our B, reduced over K: BGRADA. The bias
    // gradient takes D's type, so only an fp32 C gets it.
    if (K > 0 && std::is_same_v<TC, float>) {
      GemmCall call = rowsCall(A, B, C, M, N, K, true, false,
                               CUBLASLT_EPILOGUE_BGRADA);
      call.accumulate = accumulate;
      call.ldc = ldc == N ? 0 : ldc;
      if (tryFused(call, A, B, C, C, accumulate ? 1.0f : 0.0f, db,
                   sizeof(float), nullptr))
        return;
    }
    reduceSumLeading(B, db, K, N);
    matmul(A, B, C, 1, M, N, K, true, false, 0, 0, 0, accumulate, ldc);
  }
}

template <typename TA, typename TB, typename TC>
void matmulBiasGrad(const TA *A, const TB *B, TC *C, float *db, int64_t M,
                    int64_t N, int64_t K, int64_t ldc, int64_t col) {
  biasGradProduct(A, B, C, db, M, N, K, ldc, col, false);
}

template <typename TA, typename TB, typename TC>
void matmulBiasGradAccumulate(const TA *A, const TB *B, TC *C, float *db,
                              bool first, int64_t M, int64_t N, int64_t K,
                              int64_t ldc, int64_t col) {
  biasGradProduct(A, B, C, db, M, N, K, ldc, col, !first);
}

template <typename TA, typename TB, typename TC>
void matmulGeluGrad(const TA *A, const TB *B, const TC *pre, TC *dx,
                    int64_t M, int64_t N, int64_t K, bool transB) {
  if constexpr (!supportedTypes<TA, TB, TC>()) {
    unsupportedTypes<TA, TB, TC>("matmulGeluGrad");
  } else {
    if (M <= 0 || N <= 0)
      return;
    // The auxiliary buffer (the GELU's input, D's type and layout) needs a
    // leading dimension that is a multiple of 8.
    if (K > 0 && N % 8 == 0) {
      GemmCall call = rowsCall(A, B, dx, M, N, K, false, transB,
                               CUBLASLT_EPILOGUE_DGELU);
      call.alignAux = alignmentOf(pre, 0, 1, sizeof(TC));
      if (tryFused(call, A, B, dx, dx, 0.0f, nullptr, 0,
                   const_cast<TC *>(pre)))
        return;
    }
    matmul(A, B, dx, 1, M, N, K, false, transB, 0, 0, 0, false);
    // Elementwise, so in place.
    geluBackward(pre, dx, dx, M * N);
  }
}

template <typename TA, typename TB, typename TC>
void matmulAdd(const TA *A, const TB *B, const TC *addend, TC *out, int64_t M,
               int64_t N, int64_t K, bool transB) {
  if constexpr (!supportedTypes<TA, TB, TC>()) {
    unsupportedTypes<TA, TB, TC>("matmulAdd");
  } else {
    if (M <= 0 || N <= 0)
      return;
    if (K > 0) {
      GemmCall call = rowsCall(A, B, out, M, N, K, false, transB,
                               CUBLASLT_EPILOGUE_DEFAULT);
      call.accumulate = true;
      // C and D share the plan's layout and its alignment preference.
      call.alignC = std::min(call.alignC, alignmentOf(addend, 0, 1, sizeof(TC)));
      if (tryFused(call, A, B, addend, out, 1.0f, nullptr, 0, nullptr))
        return;
    }
    copy(addend, out, M * N);
    matmul(A, B, out, 1, M, N, K, false, transB, 0, 0, 0, true);
  }
}

//===--- Instantiations ---------------------------------------------------===//

#define TESSEL_INSTANTIATE3(A, B, C)                                           \
  template void matmul<A, B, C>(const A *, const B *, C *, int64_t, int64_t,   \
                                int64_t, int64_t, bool, bool, int64_t,         \
                                int64_t, int64_t, bool, int64_t);              \
  template void matmulBias<A, B, C>(const A *, const B *, const float *, C *,  \
                                    C *, int64_t, int64_t, int64_t, bool);     \
  template void matmulBiasGrad<A, B, C>(const A *, const B *, C *, float *,    \
                                        int64_t, int64_t, int64_t, int64_t,    \
                                        int64_t);                              \
  template void matmulBiasGradAccumulate<A, B, C>(                             \
      const A *, const B *, C *, float *, bool, int64_t, int64_t, int64_t,     \
      int64_t, int64_t);                                                       \
  template void matmulGeluGrad<A, B, C>(const A *, const B *, const C *, C *,  \
                                        int64_t, int64_t, int64_t, bool);      \
  template void matmulAdd<A, B, C>(const A *, const B *, const C *, C *,       \
                                   int64_t, int64_t, int64_t, bool);
TESSEL_CUDA_TYPES3(TESSEL_INSTANTIATE3)
#undef TESSEL_INSTANTIATE3

} // namespace tessel::cuda
