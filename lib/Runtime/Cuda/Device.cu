//===- Device.cu - GPU selection, device buffers and the driver's hooks ---===//
//
// The device side of runMain for a program compiled for --target cuda (see
// tessel/Runtime/Cuda/Device.h). At start the rank picks its GPU from the
// node-local rank, checks that the GPU can run the code the program was
// built for, creates the compute and communication streams, the cuBLASLt
// handle and the NCCL communicators (Comm.cu), and allocates every buffer of
// the step once: nothing is allocated while training. The step then runs
// asynchronously on the compute stream; finishStep is its one
// synchronisation point, where the loss and the gradient norm come back.
//
// The step as a CUDA graph. The first training step runs eagerly: it
// creates what is made on first use (send buffers, cuBLASLt's choices) and
// counts the step's AdamW calls. The second is captured on the compute
// stream (thread-local mode; the communication streams join the capture
// through the events the step already records), and that graph, launched
// once per step, replaces the host's thousands of launches. What a graph
// cannot take:
//   - per-step values: the learning rate and the update count enter the
//     step only through AdamW's scalars, which the host computes as in an
//     eager step into pinned slots; the graph's first node copies them to
//     the device, and every launch is preceded by refilling them for its
//     step (updateSlot, refillSlots);
//   - host reads of device data at the end of the step (finishStep's loss
//     and norm, recordMetric's values): the copies to pinned memory are
//     captured and the host waits once, after the launch (waitForStep);
//   - waits, allocations and host-side reads inside the step
//     (notWhileCapturing): a program whose step has them (the expert
//     exchange, which sizes its messages from counts read on the host)
//     says so at compile time (DeviceProgram::hostReadsInStep) and runs
//     eagerly;
//   - per-operation watching: the watchdog follows each launch as one
//     operation, and the collective counters grow by the captured step's
//     counts per launch.
// A capture that CUDA refuses after the step's host code has run through
// (an unjoined stream, an operation it cannot capture) leaves the host's
// state as an eager step would: the run warns, goes on eagerly and redoes
// the step. TESSEL_CUDA_GRAPH=0 turns graphs off; --trace does too (its
// spans time the host's enqueueing).
//
//===----------------------------------------------------------------------===//

#include "Internal.h"
#include "tessel/Runtime/Comm.h"
#include "tessel/Runtime/Cuda/Device.h"
#include "tessel/Runtime/Trace.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace tessel::cuda {

namespace detail {
// Comm.cu: the NCCL communicators and the watchdog, set up once the device
// is chosen and torn down after the streams have drained.
void commStart(const DeviceProgram &program, int device);
void commStop();
// The watchdog's failure message, empty while every collective is fine.
std::string commFailure();
// Hands the watchdog a launch of the captured step (`operations`
// collectives and sends in it), just enqueued on the compute stream.
void commGraphLaunched(int64_t operations);
} // namespace detail

namespace {

struct DeviceState {
  // Set by deviceHooks(); commAxes and p2pOffsets own the program's lists.
  DeviceProgram program;
  std::vector<unsigned> commAxes;
  std::vector<int> p2pOffsets;

  bool started = false;
  int device = -1;
  std::string description;
  cudaStream_t compute = nullptr;
  cudaStream_t comm = nullptr;
  float *hostScalars = nullptr; // pinned: the loss and the norm of a step
  // The running step (detail::deviceStep): pinned, and its device copy,
  // which each step's first copy writes (a captured one replays it).
  int64_t *hostStep = nullptr, *deviceStep = nullptr;

  // The step's parameters (and a bf16 program's copy of them); with the
  // parameters sharded (parallel.zero 3) the parameters kept whole and the
  // gathered runs, and apart from them this rank's pieces (in pinned host
  // memory when the optimizer is offloaded).
  int64_t paramElems = 0;
  int64_t pieceElems = 0;
  float *paramPieces = nullptr;
  int64_t batchElems = 0; // tokens (and targets) per step
  float *params = nullptr;
  float *grads = nullptr;
  float *adamM = nullptr;
  int64_t momentElems = 0;
  float *adamV = nullptr;
  float *accumulators = nullptr;
  char *activations = nullptr;
  int32_t *tokens = nullptr; // the batch: tokens, then targets, one block
  int32_t *targets = nullptr;
  // Pinned host staging of the batch (tokens, then targets): one DMA copy
  // on the compute stream, which the host does not wait for; `staged` marks
  // its end, before which the staging is not written again.
  int32_t *hostBatch = nullptr;
  cudaEvent_t staged = nullptr;
  DeviceBuffers buffers;

  // The step as a CUDA graph (see the top).
  struct StepGraph {
    bool enabled = false;
    std::string reason; // why not, for the banner and the warning
    int64_t stepsRun = 0;
    bool capturing = false;
    bool overflow = false; // more AdamW calls than the first step made
    cudaGraphExec_t exec = nullptr;
    // AdamW calls: counted in an eager step, then one slot each in the
    // captured one (their constants), in call order.
    int64_t eagerUpdates = 0;
    std::vector<detail::AdamConstants> slots;
    int64_t capacity = 0;
    detail::AdamScalars *hostSlots = nullptr;   // pinned
    detail::AdamScalars *deviceSlots = nullptr; // read by the kernels
    // What the captured finishStep copied back.
    bool loss = false, norm = false;
    // The metrics the step records (recordMetric): their floats in an
    // eager step, and in the captured one each metric's place in the
    // pinned buffer its copies land in.
    struct Metric {
      std::string name;
      int64_t at, n;
    };
    int64_t eagerMetricFloats = 0;
    std::vector<Metric> metrics;
    int64_t metricCapacity = 0;
    float *hostMetrics = nullptr; // pinned
    // The captured step's communication, added to the counters per launch.
    rt::CollectiveCounter counts[rt::kNumCollectiveKinds];
    int64_t operations = 0;
  } graph;
};

DeviceState &state() {
  static DeviceState s;
  return s;
}

void check(cudaError_t status, const char *what) {
  checkCuda(status, what, __FILE__, __LINE__);
}

__global__ void toBf16Kernel(const float *in, bf16 *out, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    out[i] = __float2bfloat16(in[i]);
}

// The node-local rank the launcher exports, or -1 when there is none.
int localRankFromEnvironment() {
  for (const char *name :
       {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK"}) {
    const char *text = std::getenv(name);
    if (!text)
      continue;
    char *end = nullptr;
    long value = std::strtol(text, &end, 10);
    if (!*text || *end || value < 0 || value > 1 << 20)
      throw std::runtime_error(std::string(name) + " is '" + text +
                               "', not a node-local rank");
    return (int)value;
  }
  return -1;
}

// One GPU per rank: the node-local rank's, else the global rank's modulo
// the GPUs this process sees.
int selectDevice() {
  int count = 0;
  cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    cudaGetLastError();
    std::string reason =
        status == cudaSuccess || status == cudaErrorNoDevice
            ? ""
            : std::string(" (") + cudaGetErrorString(status) + ")";
    throw std::runtime_error(
        "no CUDA device: this program was compiled for --target cuda" + reason);
  }
  int local = localRankFromEnvironment();
  if (local < 0)
    return rt::commRank() % count;
  if (local < count)
    return local;
  // A launcher that binds each rank to its own GPU leaves one visible.
  if (count == 1)
    return 0;
  throw std::runtime_error("node-local rank " + std::to_string(local) +
                           " has no GPU of its own: this node has " +
                           std::to_string(count) +
                           " visible CUDA devices; start at most one rank "
                           "per GPU");
}

// Pinned host memory mapped into the device's address space (one pointer
// for both: unified addressing, checked at start), zeroed; null for none.
// Kernels read and write it across the bus.
template <typename T> T *allocatePinned(int64_t count, const char *what) {
  if (count <= 0)
    return nullptr;
  size_t bytes = (size_t)count * sizeof(T);
  void *data = nullptr;
  cudaError_t status =
      cudaHostAlloc(&data, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
  if (status == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    char text[256];
    std::snprintf(text, sizeof(text),
                  "out of pinned host memory: %s (offloaded, "
                  "parallel.offload) need %.1f MiB",
                  what, bytes / 1048576.0);
    throw std::runtime_error(text);
  }
  check(status, "cudaHostAlloc");
  std::memset(data, 0, bytes);
  return (T *)data;
}

// cudaMalloc of `count` elements, zeroed; null for none.
template <typename T> T *allocate(int64_t count, const char *what) {
  if (count <= 0)
    return nullptr;
  size_t bytes = (size_t)count * sizeof(T);
  void *data = nullptr;
  cudaError_t status = cudaMalloc(&data, bytes);
  if (status == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    size_t freeBytes = 0, totalBytes = 0;
    cudaMemGetInfo(&freeBytes, &totalBytes);
    char text[256];
    std::snprintf(text, sizeof(text),
                  "out of GPU memory: %s need %.1f MiB, %.1f of %.1f MiB are "
                  "free on GPU %d",
                  what, bytes / 1048576.0, freeBytes / 1048576.0,
                  totalBytes / 1048576.0, state().device);
    throw std::runtime_error(text);
  }
  check(status, what);
  // On the compute stream, like everything that follows at start, so that
  // the first kernels (on that non-blocking stream) see the cleared buffers.
  check(cudaMemsetAsync(data, 0, bytes, state().compute), "cudaMemsetAsync");
  return (T *)data;
}

// Whether steps run as a CUDA graph: the program's step must allow it, and
// neither TESSEL_CUDA_GRAPH=0 nor --trace asks otherwise.
void decideGraph(DeviceState &s) {
  DeviceState::StepGraph &g = s.graph;
  g.enabled = false;
  const char *text = std::getenv("TESSEL_CUDA_GRAPH");
  std::string value = text ? text : "1";
  if (value != "0" && value != "1")
    throw std::runtime_error("TESSEL_CUDA_GRAPH is '" + value +
                             "': expected 1 (steps as a CUDA graph, the "
                             "default) or 0 (eager launches)");
  if (value == "0")
    g.reason = "TESSEL_CUDA_GRAPH=0";
  else if (s.program.hostReadsInStep)
    g.reason = s.program.hostReadsInStep;
  else if (rt::traceEnabled())
    g.reason = "--trace times the launches";
  else
    g.enabled = true;
}

void startDevice(const rt::Program &program, const float *hostParams,
                 rt::StepContext &ctx) {
  DeviceState &s = state();
  if (s.started)
    throw std::runtime_error("the CUDA device is already started");
  const DeviceProgram &device = s.program;

  s.device = selectDevice();
  check(cudaSetDevice(s.device), "cudaSetDevice");
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, s.device), "cudaGetDeviceProperties");
  int arch = prop.major * 10 + prop.minor;
  if (arch < device.cudaArch)
    throw std::runtime_error("GPU " + std::to_string(s.device) + " (" +
                             prop.name + ") has compute capability sm_" +
                             std::to_string(arch) + ", older than sm_" +
                             std::to_string(device.cudaArch) +
                             " that this program was built for");
  // "NVIDIA H200 (sm_90, 140 GiB), bf16 mixed precision"
  s.description =
      std::string(prop.name) + " (sm_" + std::to_string(arch) + ", " +
      std::to_string(
          (long long)std::llround(prop.totalGlobalMem / 1073741824.0)) +
      " GiB), " + (device.bf16 ? "bf16 mixed precision" : "fp32");

  decideGraph(s);
  s.description += s.graph.enabled
                       ? ", steps as a CUDA graph"
                       : ", steps launched eagerly (" + s.graph.reason + ")";

  // From here on stop() releases whatever was created.
  s.started = true;
  check(cudaStreamCreateWithFlags(&s.compute, cudaStreamNonBlocking),
        "cudaStreamCreateWithFlags");
  check(cudaStreamCreateWithFlags(&s.comm, cudaStreamNonBlocking),
        "cudaStreamCreateWithFlags");
  check(cudaMallocHost(&s.hostScalars, 2 * sizeof(float)), "cudaMallocHost");
  check(cudaMallocHost(&s.hostStep, sizeof(int64_t)),
        "cudaMallocHost (the running step)");
  check(cudaMalloc(&s.deviceStep, sizeof(int64_t)),
        "cudaMalloc (the running step)");
  *s.hostStep = 0;
  check(cudaMemcpy(s.deviceStep, s.hostStep, sizeof(int64_t),
                   cudaMemcpyHostToDevice),
        "cudaMemcpy (the running step)");
  detail::gemmInit();
  detail::commStart(device, s.device);

  const rt::TrainConfig &config = program.config;
  s.pieceElems = program.paramStoreElems > 0 ? program.paramPieceElems : 0;
  s.paramElems = program.paramStoreElems > 0
                     ? program.paramStoreElems - s.pieceElems
                     : program.paramElems;
  if (s.pieceElems < 0 || s.paramElems < 0)
    throw std::runtime_error(
        "the program's parameter pieces (" + std::to_string(s.pieceElems) +
        " elements) do not fit its parameter store (" +
        std::to_string(program.paramStoreElems) + ")");
  s.batchElems = config.batch * config.seqLen;
  s.params = allocate<float>(s.paramElems, "the parameters");
  // With gradients kept as pieces (parallel.zero 2), the gradient store's
  // own size.
  s.grads = allocate<float>(
      program.gradElems > 0 ? program.gradElems : s.paramElems,
      "the gradients");
  // With the optimizer sharded over dp, the moments of this rank's pieces.
  int64_t momentElems =
      program.optimizerElems > 0 ? program.optimizerElems : s.paramElems;
  s.momentElems = momentElems;
  // Offloaded (parallel.offload): in pinned host memory that the update
  // kernel reaches through unified addressing.
  if (device.offloadOptimizer && !prop.unifiedAddressing)
    throw std::runtime_error(
        "parallel.offload = \"optimizer\" needs unified addressing, which "
        "GPU " + std::to_string(s.device) + " (" + prop.name +
        ") does not have");
  auto moments =
      device.offloadOptimizer ? allocatePinned<float> : allocate<float>;
  s.adamM = moments(momentElems, "the AdamW first moments");
  s.adamV = moments(momentElems, "the AdamW second moments");
  // The master weights of the sharded runs go with the moments: only
  // AdamW and the gathers (this rank's piece) read them.
  s.paramPieces = moments(s.pieceElems, "the parameter pieces");
  s.activations = allocate<char>(program.activationBytes, "the activations");
  s.tokens = allocate<int32_t>(2 * s.batchElems, "the batch");
  s.targets = s.tokens + s.batchElems;
  check(cudaMallocHost(&s.hostBatch,
                       std::max<size_t>(1, 2 * (size_t)s.batchElems) *
                           sizeof(int32_t)),
        "cudaMallocHost (the batch's staging)");
  check(cudaEventCreateWithFlags(&s.staged, cudaEventDisableTiming),
        "cudaEventCreate");
  DeviceBuffers &b = s.buffers;
  // The copy of the parameter store, then (ZeRO-1/2) those of the runs
  // whose master weights are pieces, or (ZeRO-3) the slots of the runs
  // gathered in bf16.
  if (device.bf16)
    b.paramShadow = allocate<bf16>(s.paramElems + device.shadowExtraElems,
                                   "the bf16 parameter copy");
  b.scratch = allocate<char>(device.scratchBytes, "the kernel scratch");
  b.scalars = allocate<float>(16, "the step's scalars");
  b.normAcc = allocate<double>(std::max<int64_t>(16, program.normSums),
                              "the norm accumulators");
  if (program.accumulatorElems > 0)
    s.accumulators =
        allocate<float>(program.accumulatorElems, "the accumulators");

  // Ordered before the bf16 copy below: the legacy stream's cudaMemcpy from
  // pageable memory may still be in flight when a kernel on the
  // non-blocking compute stream starts.
  // hostParams is the store: the pieces first, then the rest.
  if (s.pieceElems > 0 && hostParams)
    check(cudaMemcpyAsync(s.paramPieces, hostParams,
                          (size_t)s.pieceElems * sizeof(float),
                          cudaMemcpyDefault, s.compute),
          "cudaMemcpyAsync (parameter pieces)");
  if (s.paramElems > 0 && hostParams)
    check(cudaMemcpyAsync(s.params, hostParams + s.pieceElems,
                          (size_t)s.paramElems * sizeof(float),
                          cudaMemcpyHostToDevice, s.compute),
          "cudaMemcpyAsync (parameters)");
  if (b.paramShadow)
    detail::toBf16On(s.compute, s.params, b.paramShadow, s.paramElems);
  // The copies of the runs kept as pieces, gathered from the pieces just
  // loaded, as after each update (not the step's traffic).
  if (device.numMasterCopies > 0) {
    if (!b.paramShadow)
      throw std::runtime_error(
          "the program keeps master weights as pieces but no bf16 copy");
    rt::UncountedCollectives notTraffic;
    for (int i = 0; i < device.numMasterCopies; ++i) {
      const int64_t *c = device.masterCopies[i];
      if (c[0] < 0 || c[0] > s.pieceElems || c[1] < s.paramElems || c[2] < 0 ||
          c[1] + c[2] > s.paramElems + device.shadowExtraElems)
        throw std::runtime_error("master-weight copy " + std::to_string(i) +
                                 " lies outside the parameter stores");
      commWait(allGatherShardsStart(b.paramShadow + c[1], s.paramPieces + c[0],
                                    nullptr, c[2], (unsigned)c[3]));
    }
  }
  check(cudaStreamSynchronize(s.compute), "cudaStreamSynchronize");

  ctx.params = s.params;
  ctx.paramPieces = s.paramPieces;
  ctx.grads = s.grads;
  ctx.adamM = s.adamM;
  ctx.adamV = s.adamV;
  ctx.activations = s.activations;
  ctx.accumulators = s.accumulators;
  ctx.normSums = b.normAcc;
  ctx.paramShadow = b.paramShadow;
  ctx.scratch = b.scratch;
  ctx.tokens = s.tokens;
  ctx.targets = s.targets;
}

void loadBatch(rt::StepContext &, const int32_t *tokens, const int32_t *targets,
               int64_t count) {
  DeviceState &s = state();
  if (!s.started)
    throw std::runtime_error("loadBatch before the CUDA device was started");
  if (count < 0 || count > s.batchElems)
    throw std::runtime_error("loadBatch of " + std::to_string(count) +
                             " tokens into a batch of " +
                             std::to_string(s.batchElems));
  // The previous batch's copy has left the staging (it has long: the step
  // that read it ended in finishStep's synchronisation). The copy runs on
  // the compute stream, after the kernels that read the previous batch and
  // before the step's, and the host goes on at once; the caller may refill
  // its own buffers right away.
  check(cudaEventSynchronize(s.staged), "cudaEventSynchronize (batch)");
  size_t bytes = (size_t)count * sizeof(int32_t);
  std::memcpy(s.hostBatch, tokens, bytes);
  std::memcpy(s.hostBatch + s.batchElems, targets, bytes);
  if (count == s.batchElems) {
    check(cudaMemcpyAsync(s.tokens, s.hostBatch, 2 * bytes,
                          cudaMemcpyHostToDevice, s.compute),
          "cudaMemcpyAsync (batch)");
  } else {
    check(cudaMemcpyAsync(s.tokens, s.hostBatch, bytes,
                          cudaMemcpyHostToDevice, s.compute),
          "cudaMemcpyAsync (tokens)");
    check(cudaMemcpyAsync(s.targets, s.hostBatch + s.batchElems, bytes,
                          cudaMemcpyHostToDevice, s.compute),
          "cudaMemcpyAsync (targets)");
  }
  check(cudaEventRecord(s.staged, s.compute), "cudaEventRecord (batch)");
}

void download(const rt::Program &program, float *hostParams) {
  DeviceState &s = state();
  if (!s.started)
    throw std::runtime_error("download before the CUDA device was started");
  int64_t elems = program.paramStoreElems > 0 ? program.paramStoreElems
                                               : program.paramElems;
  if (elems != s.pieceElems + s.paramElems)
    throw std::runtime_error(
        "download of " + std::to_string(elems) +
        " parameters from a device holding " +
        std::to_string(s.pieceElems + s.paramElems));
  check(cudaStreamSynchronize(s.compute), "cudaStreamSynchronize");
  // The store's layout: the pieces, then the rest.
  if (s.pieceElems > 0)
    check(cudaMemcpy(hostParams, s.paramPieces,
                     (size_t)s.pieceElems * sizeof(float), cudaMemcpyDefault),
          "cudaMemcpy (parameter pieces)");
  if (s.paramElems > 0)
    check(cudaMemcpy(hostParams + s.pieceElems, s.params,
                     (size_t)s.paramElems * sizeof(float),
                     cudaMemcpyDeviceToHost),
          "cudaMemcpy (parameters)");
}

void copyMoments(const rt::Program &program, float *hostM, float *hostV,
                 bool toDevice) {
  DeviceState &s = state();
  if (!s.started)
    throw std::runtime_error("copyMoments before the CUDA device was started");
  int64_t elems =
      program.optimizerElems > 0 ? program.optimizerElems : program.paramElems;
  if (elems != s.momentElems)
    throw std::runtime_error("copyMoments of " + std::to_string(elems) +
                             " elements with a device holding " +
                             std::to_string(s.momentElems));
  check(cudaStreamSynchronize(s.compute), "cudaStreamSynchronize");
  size_t bytes = (size_t)elems * sizeof(float);
  if (bytes == 0)
    return;
  if (toDevice) {
    // On the compute stream, which the next step's kernels follow: a
    // pageable cudaMemcpy on the legacy stream may return before its DMA
    // has landed, and the non-blocking compute stream does not wait for it.
    // (cudaMemcpyDefault: the moments may be in pinned host memory.)
    check(cudaMemcpyAsync(s.adamM, hostM, bytes, cudaMemcpyDefault,
                          s.compute),
          "cudaMemcpyAsync (first moments)");
    check(cudaMemcpyAsync(s.adamV, hostV, bytes, cudaMemcpyDefault,
                          s.compute),
          "cudaMemcpyAsync (second moments)");
    check(cudaStreamSynchronize(s.compute), "cudaStreamSynchronize");
  } else {
    check(cudaMemcpy(hostM, s.adamM, bytes, cudaMemcpyDefault),
          "cudaMemcpy (first moments)");
    check(cudaMemcpy(hostV, s.adamV, bytes, cudaMemcpyDefault),
          "cudaMemcpy (second moments)");
  }
}

void stopDevice() {
  DeviceState &s = state();
  if (!s.started)
    return;
  if (s.compute)
    check(cudaStreamSynchronize(s.compute), "cudaStreamSynchronize");
  if (s.comm)
    check(cudaStreamSynchronize(s.comm), "cudaStreamSynchronize");
  s.started = false;
  // The step's graph first: NCCL holds each communicator a captured graph
  // uses until the graph is destroyed, and destroying the communicator
  // before it waits for that forever.
  DeviceState::StepGraph &g = s.graph;
  if (g.exec)
    cudaGraphExecDestroy(g.exec);
  g.exec = nullptr;
  detail::commStop();
  detail::gemmShutdown();
  DeviceBuffers &b = s.buffers;
  void *buffers[] = {s.params,      s.grads,       s.activations, s.tokens,
                     b.paramShadow, b.scratch,     b.scalars,     b.normAcc,
                     s.accumulators};
  for (void *data : buffers)
    if (data)
      cudaFree(data);
  for (void *data : {(void *)s.adamM, (void *)s.adamV, (void *)s.paramPieces})
    if (data)
      (s.program.offloadOptimizer ? cudaFreeHost : cudaFree)(data);
  s.params = s.grads = s.adamM = s.adamV = s.accumulators = s.paramPieces =
      nullptr;
  s.activations = nullptr;
  s.tokens = s.targets = nullptr;
  if (s.hostBatch)
    cudaFreeHost(s.hostBatch);
  s.hostBatch = nullptr;
  if (s.staged)
    cudaEventDestroy(s.staged);
  s.staged = nullptr;
  b = DeviceBuffers();
  if (g.hostSlots)
    cudaFreeHost(g.hostSlots);
  if (g.deviceSlots)
    cudaFree(g.deviceSlots);
  if (g.hostMetrics)
    cudaFreeHost(g.hostMetrics);
  g = DeviceState::StepGraph();
  if (s.hostScalars)
    cudaFreeHost(s.hostScalars);
  s.hostScalars = nullptr;
  if (s.hostStep)
    cudaFreeHost(s.hostStep);
  if (s.deviceStep)
    cudaFree(s.deviceStep);
  s.hostStep = s.deviceStep = nullptr;
  for (cudaStream_t *stream : {&s.compute, &s.comm}) {
    if (*stream)
      cudaStreamDestroy(*stream);
    *stream = nullptr;
  }
}

// Waits for the step on the compute stream and hands its loss and norm
// (copied to hostScalars by the step) to ctx: the step's one
// synchronisation.
void waitForStep(rt::StepContext &ctx, bool loss, bool norm) {
  DeviceState &s = state();
  cudaError_t status = cudaStreamSynchronize(s.compute);
  // A collective that failed explains a failed step better than CUDA can.
  std::string failure = detail::commFailure();
  if (!failure.empty())
    throw std::runtime_error(failure);
  check(status, "cudaStreamSynchronize (end of step)");
  ctx.loss = loss ? s.hostScalars[0] : NAN;
  ctx.gradNorm = norm ? s.hostScalars[1] : NAN;
}

// AdamW's scalars for the step about to launch, in the pinned slots the
// graph's first node copies to the device. The generated step passes
// AdamW ctx.lr and the update count ctx.updates + 1.
void refillSlots(const rt::StepContext &ctx) {
  DeviceState::StepGraph &g = state().graph;
  for (size_t i = 0; i < g.slots.size(); i++)
    g.hostSlots[i] = detail::adamScalars(g.slots[i], ctx.lr, ctx.updates + 1);
}

// The running step to the device, on the compute stream (its first
// operation; in a captured step, the graph's first node, which reads the
// pinned value again at each launch).
void copyStep(DeviceState &s) {
  check(cudaMemcpyAsync(s.deviceStep, s.hostStep, sizeof(int64_t),
                        cudaMemcpyHostToDevice, s.compute),
        "cudaMemcpyAsync (the running step)");
}

// The runtime's counter of collectives of kind `k` (Comm.h hands them out
// read-only; Comm.cu's count() writes them the same way).
rt::CollectiveCounter &counter(int k) {
  return const_cast<rt::CollectiveCounter &>(
      rt::collectiveCounter((rt::CollectiveKind)k));
}

void launchGraph(rt::StepContext &ctx) {
  DeviceState &s = state();
  DeviceState::StepGraph &g = s.graph;
  check(cudaGraphLaunch(g.exec, s.compute), "cudaGraphLaunch (the step)");
  if (g.operations > 0)
    detail::commGraphLaunched(g.operations);
  waitForStep(ctx, g.loss, g.norm);
  for (const DeviceState::StepGraph::Metric &m : g.metrics)
    ctx.metrics.push_back(
        {m.name, std::vector<double>(g.hostMetrics + m.at,
                                     g.hostMetrics + m.at + m.n)});
}

std::string errorText(cudaError_t status) {
  return std::string(cudaGetErrorName(status)) + ": " +
         cudaGetErrorString(status);
}

// Captures the step into g.exec, launches it and waits for it. Returns
// false, with the host's state as after an eager step's host code and the
// counters as before, when CUDA refused the capture; nothing of the step
// has run on the device then.
bool captureStep(const rt::Program &program, rt::StepContext &ctx) {
  DeviceState &s = state();
  DeviceState::StepGraph &g = s.graph;
  // A step is captured once: the slots and the metrics' buffer, sized by
  // the eager step before, are allocated here, before the capture (which
  // allocates nothing).
  g.capacity = g.eagerUpdates;
  g.metricCapacity = g.eagerMetricFloats;
  if (g.capacity > 0) {
    size_t bytes = (size_t)g.capacity * sizeof(detail::AdamScalars);
    check(cudaMallocHost(&g.hostSlots, bytes),
          "cudaMallocHost (AdamW's step scalars)");
    check(cudaMalloc(&g.deviceSlots, bytes),
          "cudaMalloc (AdamW's step scalars)");
  }
  if (g.metricCapacity > 0)
    check(cudaMallocHost(&g.hostMetrics,
                         (size_t)g.metricCapacity * sizeof(float)),
          "cudaMallocHost (the step's metrics)");
  rt::CollectiveCounter before[rt::kNumCollectiveKinds];
  for (int k = 0; k < rt::kNumCollectiveKinds; k++)
    before[k] = counter(k);

  check(cudaStreamBeginCapture(s.compute, cudaStreamCaptureModeThreadLocal),
        "cudaStreamBeginCapture (the step)");
  g.capturing = true;
  cudaGraph_t graph = nullptr;
  try {
    copyStep(s);
    if (g.capacity > 0)
      check(cudaMemcpyAsync(g.deviceSlots, g.hostSlots,
                            (size_t)g.capacity * sizeof(detail::AdamScalars),
                            cudaMemcpyHostToDevice, s.compute),
            "cudaMemcpyAsync (AdamW's step scalars)");
    program.step(ctx);
  } catch (const std::exception &e) {
    g.capturing = false;
    cudaStreamEndCapture(s.compute, &graph);
    if (graph)
      cudaGraphDestroy(graph);
    cudaGetLastError();
    throw std::runtime_error(
        std::string("capturing the training step as a CUDA graph failed "
                    "midway: ") +
        e.what() + " (TESSEL_CUDA_GRAPH=0 runs the steps eagerly)");
  }
  g.capturing = false;
  cudaError_t status = cudaStreamEndCapture(s.compute, &graph);
  std::string refused;
  if (status != cudaSuccess)
    refused = "cudaStreamEndCapture: " + errorText(status);
  else if (g.overflow)
    refused = "the step made more AdamW calls or recorded more metrics than "
              "the first one";
  if (refused.empty()) {
    status = cudaGraphInstantiate(&g.exec, graph, 0);
    if (status != cudaSuccess)
      refused = "cudaGraphInstantiate: " + errorText(status);
  }
  if (graph)
    cudaGraphDestroy(graph);
  if (!refused.empty()) {
    cudaGetLastError();
    g.exec = nullptr;
    for (int k = 0; k < rt::kNumCollectiveKinds; k++)
      counter(k) = before[k]; // the eager step counts again
    g.enabled = false;
    g.reason = "the capture failed: " + refused;
    return false;
  }
  // The capture counted this step's operations; each later launch adds
  // them again.
  g.operations = 0;
  for (int k = 0; k < rt::kNumCollectiveKinds; k++) {
    const rt::CollectiveCounter &now = counter(k);
    g.counts[k] = {now.calls - before[k].calls,
                   now.elements - before[k].elements,
                   now.bytesSent - before[k].bytesSent};
    g.operations += g.counts[k].calls;
  }
  launchGraph(ctx);
  return true;
}

// One training step (DeviceHooks::runStep): eagerly the first time, then
// captured once and launched as a graph (see the top).
void runStep(const rt::Program &program, rt::StepContext &ctx) {
  DeviceState &s = state();
  if (!s.started)
    throw std::runtime_error("runStep before the CUDA device was started");
  DeviceState::StepGraph &g = s.graph;
  bool first = g.stepsRun++ == 0;
  // The previous step has finished (waitForStep), so its copy has read the
  // pinned step.
  *s.hostStep = ctx.step;
  if (g.enabled && g.exec) {
    refillSlots(ctx);
    for (int k = 0; k < rt::kNumCollectiveKinds; k++) {
      counter(k).calls += g.counts[k].calls;
      counter(k).elements += g.counts[k].elements;
      counter(k).bytesSent += g.counts[k].bytesSent;
    }
    launchGraph(ctx);
    return;
  }
  if (g.enabled && !first) {
    if (captureStep(program, ctx))
      return;
    if (rt::commRank() == 0)
      std::fprintf(stderr,
                   "warning: the training step runs eagerly: %s\n",
                   g.reason.c_str());
  }
  g.eagerUpdates = 0;
  g.eagerMetricFloats = 0;
  copyStep(s);
  program.step(ctx);
}

const char *describe() { return state().description.c_str(); }

} // namespace

void checkCuda(cudaError_t status, const char *what, const char *file,
               int line) {
  if (status == cudaSuccess)
    return;
  const char *slash = std::strrchr(file, '/');
  throw std::runtime_error(std::string("CUDA error in ") + what + " at " +
                           (slash ? slash + 1 : file) + ":" +
                           std::to_string(line) + ": " +
                           cudaGetErrorString(status));
}

// Before start (kernel tests) both are the legacy default stream.
cudaStream_t computeStream() { return state().compute; }
cudaStream_t detail::commStream() { return state().comm; }

void detail::toBf16On(cudaStream_t stream, const float *in, bf16 *out,
                      int64_t n) {
  if (n <= 0)
    return;
  toBf16Kernel<<<detail::blocksFor(n), 256, 0, stream>>>(in, out, n);
  check(cudaGetLastError(), "toBf16Kernel");
}

const DeviceBuffers &deviceBuffers() { return state().buffers; }

bool detail::capturing() { return state().graph.capturing; }

const int64_t *detail::deviceStep() { return state().deviceStep; }

const detail::AdamScalars *
detail::updateSlot(const AdamConstants &c, const AdamScalars &now) {
  DeviceState::StepGraph &g = state().graph;
  if (!g.capturing) {
    g.eagerUpdates++;
    return nullptr;
  }
  if ((int64_t)g.slots.size() >= g.capacity) {
    // Refused when the capture ends; this launch's scalars are baked in.
    g.overflow = true;
    return nullptr;
  }
  g.hostSlots[g.slots.size()] = now;
  g.slots.push_back(c);
  return g.deviceSlots + (g.slots.size() - 1);
}

void detail::notWhileCapturing(const char *what) {
  if (state().graph.capturing)
    throw std::runtime_error(
        std::string(what) +
        " inside a step captured as a CUDA graph, which cannot replay it");
}

const rt::DeviceHooks *deviceHooks(const DeviceProgram &program) {
  DeviceState &s = state();
  s.commAxes.assign(program.commAxes,
                    program.commAxes + std::max(program.numCommAxes, 0));
  s.program = program;
  s.program.commAxes = s.commAxes.data();
  s.program.numCommAxes = (int)s.commAxes.size();
  // A null list with a count is left as it is, for commStart to report.
  if (program.p2pOffsets) {
    s.p2pOffsets.assign(program.p2pOffsets,
                        program.p2pOffsets +
                            std::max(program.numP2POffsets, 0));
    s.program.p2pOffsets = s.p2pOffsets.data();
    s.program.numP2POffsets = (int)s.p2pOffsets.size();
  } else {
    s.p2pOffsets.clear();
  }
  static const rt::DeviceHooks hooks = {&startDevice, &loadBatch, &download,
                                        &stopDevice,  &describe,  &copyMoments,
                                        &runStep};
  return &hooks;
}

void finishStep(rt::StepContext &ctx, const float *loss, const float *norm) {
  DeviceState &s = state();
  if (!s.started)
    throw std::runtime_error("finishStep before the CUDA device was started");
  if (loss)
    check(cudaMemcpyAsync(&s.hostScalars[0], loss, sizeof(float),
                          cudaMemcpyDeviceToHost, s.compute),
          "cudaMemcpyAsync (loss)");
  if (norm)
    check(cudaMemcpyAsync(&s.hostScalars[1], norm, sizeof(float),
                          cudaMemcpyDeviceToHost, s.compute),
          "cudaMemcpyAsync (gradient norm)");
  // A captured step's copies run at each launch, which waits for them.
  if (s.graph.capturing) {
    s.graph.loss = loss != nullptr;
    s.graph.norm = norm != nullptr;
    return;
  }
  waitForStep(ctx, loss != nullptr, norm != nullptr);
}

void recordMetric(rt::StepContext &ctx, const char *name, const float *values,
                  int64_t n) {
  DeviceState &s = state();
  DeviceState::StepGraph &g = s.graph;
  if (g.capturing) {
    // Copied at each launch into the pinned buffer that launchGraph reads
    // after the step's synchronisation.
    int64_t at = g.metrics.empty() ? 0
                                   : g.metrics.back().at + g.metrics.back().n;
    if (at + n > g.metricCapacity) {
      g.overflow = true; // refused when the capture ends
      return;
    }
    if (n > 0)
      check(cudaMemcpyAsync(g.hostMetrics + at, values, n * sizeof(float),
                            cudaMemcpyDeviceToHost, s.compute),
            "cudaMemcpyAsync (metric)");
    g.metrics.push_back({name, at, n});
    return;
  }
  g.eagerMetricFloats += n;
  std::vector<float> host(n);
  check(cudaMemcpyAsync(host.data(), values, n * sizeof(float),
                        cudaMemcpyDeviceToHost, s.compute),
        "cudaMemcpyAsync (metric)");
  check(cudaStreamSynchronize(s.compute), "cudaStreamSynchronize (metric)");
  ctx.metrics.push_back({name, std::vector<double>(host.begin(), host.end())});
}

} // namespace tessel::cuda
