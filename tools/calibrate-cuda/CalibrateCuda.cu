//===- CalibrateCuda.cu - What `tessel calibrate --target cuda` measures --===//
//
// tessel-calibrate-cuda OUT [--quick]: one process per GPU (under mpirun, or
// alone), each measuring its own GPU at once as a compiled layout's ranks
// run: the runtime's cuBLASLt GEMMs (bf16 and fp32) at shapes a transformer
// step calls, its flash attention forward and backward, the memory
// bandwidth of a streaming kernel and the time of one launch, the rates of
// the memory-bound kernels a step spends most in, and with several
// processes NCCL all-reduces from 4 bytes to 256 MB between them. Rank 0
// writes the raw figures as JSON to OUT; `tessel calibrate` fits them into
// a cluster description (tools/tessel/Simulate.cpp).
//
// Exit status 77 when there is no CUDA device (nothing is written).
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Cuda/Kernels.h"

#define OMPI_SKIP_MPICXX 1
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace tessel::cuda::detail {
void gemmInit(); // Gemm.cu
} // namespace tessel::cuda::detail

using namespace tessel::cuda;

namespace {

[[noreturn]] void die(const std::string &what) {
  std::fprintf(stderr, "tessel-calibrate-cuda: %s\n", what.c_str());
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::exit(1);
}

void check(cudaError_t e, const char *what) {
  if (e != cudaSuccess)
    die(std::string(what) + ": " + cudaGetErrorString(e));
}

void checkNccl(ncclResult_t r, const char *what) {
  if (r != ncclSuccess)
    die(std::string(what) + ": " + ncclGetErrorString(r));
}

// Device memory of n elements, filled with small values.
template <typename T> T *deviceArray(int64_t n) {
  void *p = nullptr;
  check(cudaMalloc(&p, std::max<int64_t>(n, 1) * sizeof(T)), "cudaMalloc");
  std::vector<float> host(std::min<int64_t>(n, int64_t(1) << 20));
  for (size_t i = 0; i < host.size(); ++i)
    host[i] = 0.01f * float(int64_t(i * 7919) % 1000 - 500) / 500.0f;
  float *staging = nullptr;
  check(cudaMalloc(&staging, host.size() * sizeof(float)), "cudaMalloc");
  check(cudaMemcpy(staging, host.data(), host.size() * sizeof(float),
                   cudaMemcpyHostToDevice),
        "cudaMemcpy");
  for (int64_t at = 0; at < n; at += int64_t(host.size()))
    copy(staging, static_cast<T *>(p) + at,
         std::min<int64_t>(int64_t(host.size()), n - at));
  check(cudaDeviceSynchronize(), "fill");
  check(cudaFree(staging), "cudaFree");
  return static_cast<T *>(p);
}

// Seconds per call of `fn`, launched back to back for about `budget`
// seconds (at least 3 calls) after one warm-up call. A collective's ranks
// must call it as often as each other: they agree on the slowest rank's
// first time.
template <typename Fn>
double timeIt(Fn &&fn, double budget, bool collective = false) {
  cudaStream_t s = computeStream();
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  fn();
  check(cudaEventRecord(start, s), "cudaEventRecord");
  fn();
  check(cudaEventRecord(stop, s), "cudaEventRecord");
  check(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  if (collective) {
    float slowest = ms;
    MPI_Allreduce(&ms, &slowest, 1, MPI_FLOAT, MPI_MAX, MPI_COMM_WORLD);
    ms = slowest;
  }
  int reps = int(std::clamp(budget / std::max(ms * 1e-3, 1e-7), 3.0, 1000.0));
  check(cudaEventRecord(start, s), "cudaEventRecord");
  for (int r = 0; r < reps; ++r)
    fn();
  check(cudaEventRecord(stop, s), "cudaEventRecord");
  check(cudaEventSynchronize(stop), "cudaEventSynchronize");
  check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  check(cudaEventDestroy(start), "cudaEventDestroy");
  check(cudaEventDestroy(stop), "cudaEventDestroy");
  return ms * 1e-3 / reps;
}

// A 64-element add, as the launch-time measurement's.
__global__ void tinyAddKernel(const bf16 *a, const bf16 *b, bf16 *o, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n)
    o[i] = __float2bfloat16(__bfloat162float(a[i]) + __bfloat162float(b[i]));
}

// Seconds per kernel when the kernels are nodes of a CUDA graph, as a
// CUDA program's step runs from its second on: 256 small adds captured on
// a stream of their own (the runtime's kernels go to the legacy stream
// outside a program, which cannot be captured), the graph launched back to
// back.
double graphNodeTime(const bf16 *a, const bf16 *b, bf16 *o, double budget) {
  constexpr int kNodes = 256;
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
        "cudaStreamCreateWithFlags");
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal),
        "cudaStreamBeginCapture");
  for (int i = 0; i < kNodes; ++i)
    tinyAddKernel<<<1, 64, 0, stream>>>(a, b, o, 64);
  check(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
  check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  auto launch = [&] {
    check(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
  };
  launch();
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  int reps = std::max(3, int(budget / 1e-3)); // about 1 ms a launch
  reps = std::min(reps, 200);
  check(cudaEventRecord(start, stream), "cudaEventRecord");
  for (int r = 0; r < reps; ++r)
    launch();
  check(cudaEventRecord(stop, stream), "cudaEventRecord");
  check(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  check(cudaEventDestroy(start), "cudaEventDestroy");
  check(cudaEventDestroy(stop), "cudaEventDestroy");
  check(cudaGraphExecDestroy(exec), "cudaGraphExecDestroy");
  check(cudaGraphDestroy(graph), "cudaGraphDestroy");
  check(cudaStreamDestroy(stream), "cudaStreamDestroy");
  return ms * 1e-3 / (double(reps) * kNodes);
}

int localRank(int rank, int devices) {
  for (const char *name :
       {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK"})
    if (const char *v = std::getenv(name))
      return std::atoi(v) % devices;
  return rank % devices;
}

struct Json {
  std::string text;
  void key(const char *k) { text += "\"" + std::string(k) + "\": "; }
};

std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return buf;
}

} // namespace

int main(int argc, char **argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "tessel-calibrate-cuda: no CUDA device\n");
    return 77;
  }
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (argc < 2)
    die("usage: tessel-calibrate-cuda OUT [--quick]");
  const std::string out = argv[1];
  const bool quick = argc > 2 && std::strcmp(argv[2], "--quick") == 0;
  const double budget = quick ? 0.01 : 0.1;
  check(cudaSetDevice(localRank(rank, devices)), "cudaSetDevice");
  detail::gemmInit();
  auto barrier = [&] {
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    MPI_Barrier(MPI_COMM_WORLD);
  };

  std::string json = "{\n";
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, localRank(rank, devices)),
        "cudaGetDeviceProperties");
  size_t freeBytes = 0, totalBytes = 0;
  check(cudaMemGetInfo(&freeBytes, &totalBytes), "cudaMemGetInfo");
  json += "  \"device\": \"" + std::string(prop.name) + "\",\n";
  json += "  \"memory_bytes\": " + num(double(totalBytes)) + ",\n";
  json += "  \"ranks\": " + std::to_string(size) + ",\n";

  // GEMMs: cuBLASLt as the programs call it, row-major A [m, k] x B [k, n].
  auto gemms = [&](auto tag, const std::vector<std::array<int64_t, 3>> &shapes,
                   const char *name) {
    using T = decltype(tag);
    int64_t maxA = 0, maxB = 0, maxC = 0;
    for (auto &s : shapes) {
      maxA = std::max(maxA, s[0] * s[2]);
      maxB = std::max(maxB, s[2] * s[1]);
      maxC = std::max(maxC, s[0] * s[1]);
    }
    T *A = deviceArray<T>(maxA), *B = deviceArray<T>(maxB);
    T *C = deviceArray<T>(maxC);
    json += "  \"" + std::string(name) + "\": [";
    for (size_t i = 0; i < shapes.size(); ++i) {
      const int64_t m = shapes[i][0], n = shapes[i][1], k = shapes[i][2];
      barrier();
      double t = timeIt(
          [&] { matmul(A, B, C, 1, m, n, k, false, false, 0, 0, 0); },
          budget);
      json += std::string(i ? ", " : "") + "{\"m\": " + std::to_string(m) +
              ", \"n\": " + std::to_string(n) + ", \"k\": " +
              std::to_string(k) + ", \"seconds\": " + num(t) + "}";
    }
    json += "],\n";
    check(cudaFree(A), "cudaFree");
    check(cudaFree(B), "cudaFree");
    check(cudaFree(C), "cudaFree");
  };
  gemms(bf16(), {{256, 256, 256},    {512, 512, 512},     {1024, 1024, 1024},
                 {2048, 2048, 2048}, {4096, 4096, 4096},  {8192, 8192, 8192},
                 {8192, 2304, 768},  {8192, 768, 768},    {8192, 3072, 768},
                 {8192, 768, 3072},  {4096, 4608, 12288}, {4096, 12288, 1536},
                 {4096, 6144, 12288}, {4096, 12288, 6144}, {2048, 6288, 12288},
                 {1024, 128, 1024},  {16384, 1024, 256},  {8192, 50304, 768}},
        "gemm_bf16");
  gemms(float(), {{512, 512, 512}, {1024, 1024, 1024}, {2048, 2048, 2048},
                  {4096, 4096, 4096}, {8192, 3072, 768}, {8192, 768, 3072}},
        "gemm_fp32");

  // Flash attention, bf16, causal, forward and backward.
  json += "  \"attention\": [";
  const int64_t atts[][4] = {{8, 1024, 12, 64}, {4, 2048, 16, 128},
                             {1, 4096, 32, 128}};
  for (int i = 0; i < 3; ++i) {
    const int64_t Bn = atts[i][0], T = atts[i][1], H = atts[i][2],
                  D = atts[i][3], n = Bn * T * H * D;
    bf16 *q = deviceArray<bf16>(n), *k = deviceArray<bf16>(n),
         *v = deviceArray<bf16>(n), *o = deviceArray<bf16>(n),
         *dout = deviceArray<bf16>(n), *dq = deviceArray<bf16>(n),
         *dk = deviceArray<bf16>(n), *dv = deviceArray<bf16>(n);
    float *lse = deviceArray<float>(Bn * H * T);
    void *scratch = nullptr;
    check(cudaMalloc(&scratch, std::max<int64_t>(attentionScratchBytes(
                                                     Bn, T, H, H, D,
                                                     int(sizeof(bf16))),
                                                 1)),
          "cudaMalloc");
    barrier();
    double f = timeIt(
        [&] { attentionForward(q, k, v, o, lse, Bn, T, H, H, D, true); },
        budget);
    barrier();
    double b = timeIt(
        [&] {
          attentionBackward(q, k, v, o, lse, dout, dq, dk, dv, Bn, T, H, H, D,
                            true, 0, 0, 0, scratch);
        },
        budget);
    json += std::string(i ? ", " : "") + "{\"batch\": " + std::to_string(Bn) +
            ", \"seq\": " + std::to_string(T) + ", \"heads\": " +
            std::to_string(H) + ", \"head_dim\": " + std::to_string(D) +
            ", \"forward\": " + num(f) + ", \"backward\": " + num(b) + "}";
    for (void *p : {(void *)q, (void *)k, (void *)v, (void *)o, (void *)dout,
                    (void *)dq, (void *)dk, (void *)dv, (void *)lse,
                    scratch})
      check(cudaFree(p), "cudaFree");
  }
  json += "],\n";

  // Memory bandwidth (a streaming add over 256 MB per operand) and one
  // launch's time (a 64-element add, back to back).
  {
    const int64_t n = int64_t(1) << 27, nb = 1024;
    bf16 *a = deviceArray<bf16>(n), *b = deviceArray<bf16>(nb),
         *o = deviceArray<bf16>(n);
    barrier();
    double t = timeIt([&] { addBroadcast(a, b, o, n, nb); }, budget);
    json += "  \"bandwidth\": " + num((2.0 * n + nb) * 2 / t) + ",\n";
    barrier();
    double tiny = timeIt([&] { addBroadcast(a, b, o, 64, 64); }, budget / 4);
    json += "  \"overhead\": " + num(tiny) + ",\n";
    json += "  \"graph_overhead\": " + num(graphNodeTime(a, b, o, budget / 4)) +
            ",\n";
    for (void *p : {(void *)a, (void *)b, (void *)o})
      check(cudaFree(p), "cudaFree");
  }

  // The memory-bound kernels a step spends most in: bytes of their
  // operands (as the cost model counts them) and seconds per call.
  json += "  \"kernels\": {";
  {
    const int64_t rows = 8192, C = 4096, n = rows * C, V = 50304, Vrows = 2048;
    bf16 *x = deviceArray<bf16>(n), *dy = deviceArray<bf16>(n),
         *y = deviceArray<bf16>(n), *dx = deviceArray<bf16>(n);
    float *w = deviceArray<float>(C), *bias = deviceArray<float>(C),
          *dw = deviceArray<float>(C), *db = deviceArray<float>(C);
    bf16 *logits = deviceArray<bf16>(Vrows * V),
         *dlogits = deviceArray<bf16>(Vrows * V);
    int32_t *targets = nullptr;
    check(cudaMalloc(&targets, Vrows * sizeof(int32_t)), "cudaMalloc");
    check(cudaMemset(targets, 0, Vrows * sizeof(int32_t)), "cudaMemset");
    float *loss = deviceArray<float>(1), *dloss = deviceArray<float>(1);
    const int64_t pn = int64_t(1) << 24;
    float *p = deviceArray<float>(pn), *g = deviceArray<float>(pn),
          *m = deviceArray<float>(pn), *vv = deviceArray<float>(pn),
          *norm = deviceArray<float>(1);
    bf16 *shadow = deviceArray<bf16>(pn);
    check(cudaMemset(vv, 0, pn * sizeof(float)), "cudaMemset");
    bool first = true;
    auto rate = [&](const char *name, double bytes, auto &&fn) {
      barrier();
      double t = timeIt(fn, budget / 2);
      json += std::string(first ? "" : ", ") + "\"" + name +
              "\": {\"bytes\": " + num(bytes) + ", \"seconds\": " + num(t) +
              "}";
      first = false;
    };
    const double act = 2.0 * n; // bytes of one bf16 activation
    rate("layerNormForward", 2 * act + 2 * 4.0 * C, [&] {
      layerNormForward(x, w, bias, y, rows, C, 1e-5);
    });
    rate("layerNormBackward", 3 * act + 3 * 4.0 * C, [&] {
      layerNormBackward(x, w, dy, dx, dw, db, rows, C, 1e-5);
    });
    rate("rmsNormForward", 2 * act + 4.0 * C,
         [&] { rmsNormForward(x, w, y, rows, C, 1e-5); });
    rate("rmsNormBackward", 3 * act + 2 * 4.0 * C, [&] {
      rmsNormBackward(x, w, dy, dx, dw, rows, C, 1e-5);
    });
    rate("geluForward", 2 * act, [&] { geluForward(x, y, n); });
    rate("geluBackward", 3 * act, [&] { geluBackward(x, dy, dx, n); });
    rate("siluForward", 2 * act, [&] { siluForward(x, y, n); });
    rate("reduceSumLeading", act + 4.0 * C,
         [&] { reduceSumLeading(x, dw, rows, C); });
    rate("crossEntropyForward", 2.0 * Vrows * V + 4.0 * Vrows + 4, [&] {
      crossEntropyForward(logits, targets, loss, Vrows, V, V);
    });
    rate("crossEntropyBackward", 4.0 * Vrows * V + 4.0 * Vrows + 4, [&] {
      crossEntropyBackward(logits, targets, dloss, dlogits, Vrows, V, V);
    });
    rate("adamwStep", 4.0 * 4 * pn + 2.0 * pn + 4, [&] {
      adamwStep(p, shadow, g, m, vv, norm, 1e-4f, 1, pn, 0.9f, 0.95f, 1e-8f,
                0.1f, 0.0f);
    });
    for (void *q : {(void *)x, (void *)dy, (void *)y, (void *)dx, (void *)w,
                    (void *)bias, (void *)dw, (void *)db, (void *)logits,
                    (void *)dlogits, (void *)targets, (void *)loss,
                    (void *)dloss, (void *)p, (void *)g, (void *)m,
                    (void *)vv, (void *)norm, (void *)shadow})
      check(cudaFree(q), "cudaFree");
  }
  json += "}";

  // NCCL all-reduces between the processes (one per GPU), fp32 sum.
  if (size > 1) {
    ncclUniqueId id;
    if (rank == 0)
      checkNccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
    ncclComm_t comm;
    checkNccl(ncclCommInitRank(&comm, size, id, rank), "ncclCommInitRank");
    const int64_t maxN = int64_t(1) << 26;
    float *buf = deviceArray<float>(maxN);
    cudaStream_t s = computeStream();
    json += ",\n  \"all_reduce\": [";
    bool firstSize = true;
    for (int64_t n : {int64_t(1), int64_t(1) << 10, int64_t(1) << 16,
                      int64_t(1) << 20, int64_t(1) << 24, maxN}) {
      barrier();
      double t = timeIt(
          [&] {
            checkNccl(ncclAllReduce(buf, buf, size_t(n), ncclFloat, ncclSum,
                                    comm, s),
                      "ncclAllReduce");
          },
          budget, /*collective=*/true);
      // A collective ends together: the slowest rank's figure.
      double slowest = 0;
      MPI_Allreduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      json += std::string(firstSize ? "" : ", ") + "{\"elements\": " +
              std::to_string(n) + ", \"seconds\": " + num(slowest) + "}";
      firstSize = false;
    }
    json += "]";
    check(cudaFree(buf), "cudaFree");
    checkNccl(ncclCommDestroy(comm), "ncclCommDestroy");
  }
  json += "\n}\n";

  barrier();
  if (rank == 0) {
    std::string partial = out + ".partial";
    FILE *f = std::fopen(partial.c_str(), "w");
    if (!f || std::fwrite(json.data(), 1, json.size(), f) != json.size() ||
        std::fclose(f) != 0)
      die("cannot write " + partial);
    if (std::rename(partial.c_str(), out.c_str()) != 0)
      die("cannot write " + out);
  }
  MPI_Finalize();
  return 0;
}
