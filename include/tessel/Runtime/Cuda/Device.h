//===- Device.h - GPU state and NCCL collectives of a CUDA rank -*- C++ -*-===//
//
// A CUDA rank program is launched like a CPU one (mpirun, one process per
// GPU). MPI starts the job and checks the mesh (tessel/Runtime/Comm.h); the
// data of the step then moves with NCCL:
//
//   - the GPU is chosen by the node-local rank (OMPI_COMM_WORLD_LOCAL_RANK,
//     SLURM_LOCALID or LOCAL_RANK, else the global rank modulo the GPUs);
//   - a world NCCL communicator from a unique id broadcast over MPI, and one
//     communicator per mesh-axis set the program uses, split from it
//     (ncclCommSplit) at start, in the same order on every rank;
//   - a compute stream (kernels, GEMMs) and a communication stream
//     (collectives). A collective waits for the compute stream with an event;
//     blocking collectives make the compute stream wait for them; started
//     ones (allReduceSumStart, reduceScatterShardsStart) let backward go on
//     until commWait;
//   - pipeline point-to-point on channels of its own, one communicator and
//     stream per directed edge class (see sendTo below);
//   - every NCCL call is checked; a watchdog thread turns a collective that
//     has not completed after TESSEL_NCCL_TIMEOUT seconds (default 600) or
//     an asynchronous NCCL error into a clear error naming the collective,
//     its axes, its size and the rank, then aborts the communicators and
//     the job.
//
// Element counting is the CPU runtime's (tessel::rt::collectiveCounter), so
// --comm-report works unchanged.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_RUNTIME_CUDA_DEVICE_H
#define TESSEL_RUNTIME_CUDA_DEVICE_H

#include "tessel/Runtime/Comm.h"
#include "tessel/Runtime/Cuda/Kernels.h"
#include "tessel/Runtime/Program.h"

#include <cstdint>

namespace tessel::cuda {

//===--- Collectives (Comm.cu) --------------------------------------------===//
// Same contracts as tessel::rt's MPI collectives, on device buffers of
// float, bf16 or double; a one-rank group copies or does nothing.

template <typename T> void allReduceSum(T *buffer, int64_t n, unsigned axes);
void allReduceMax(float *buffer, int64_t n, unsigned axes);
template <typename T>
void allGatherAlong(const T *in, T *out, int64_t outer, int64_t len,
                    int64_t inner, unsigned axes);
template <typename T>
void reduceScatterAlong(const T *in, T *out, int64_t outer, int64_t len,
                        int64_t inner, unsigned axes);
// in: g blocks of n elements, block j goes to group rank j; out: g blocks,
// block j came from group rank j.
template <typename T>
void allToAll(const T *in, T *out, int64_t n, unsigned axes);
template <typename T>
void broadcast(T *buffer, int64_t n, int root, unsigned axes);
// Expert parallelism over `axes` (E experts, E / g per rank), as the CPU's
// moeExchange and moeCombine (tessel/Runtime/Kernels.h), with the same
// layout and counts: the counts per expert exchanged first, then each
// expert's rows to the rank holding it, received by source rank then
// expert into `recv` (recvRows rows, the rest zeroed), recvOffsets [E + 1]
// their ranges; the combine sends them back into `out` (rows rows, past
// offsets[E] zeroed). Each waits on the host for the row ranges that size
// its NCCL messages (see Comm.cu).
template <typename T>
void moeExchange(const T *rows, const int32_t *offsets, T *recv,
                 int32_t *recvOffsets, int64_t E, int64_t H, int64_t recvRows,
                 unsigned axes);
template <typename T>
void moeCombine(const T *recvOut, const int32_t *recvOffsets,
                const int32_t *offsets, T *out, int64_t E, int64_t N,
                int64_t rows, unsigned axes);

// Non-blocking all-reduce on the communication stream; commWait makes the
// compute stream wait for it.
using CommRequest = int;
template <typename T>
CommRequest allReduceSumStart(T *buffer, int64_t n, unsigned axes);
void commWait(CommRequest request);
// commWait on a part's first run in the step only, as tessel::rt's.
inline void commWaitIf(bool first, CommRequest request) {
  if (first)
    commWait(request);
}
// The started forms of allGatherAlong and reduceScatterAlong (a tensor-
// parallel collective in flight under a GEMM), as tessel::rt's: `blocks`
// (g x n elements of T) holds the ranks' pieces when outer > 1.
template <typename T>
CommRequest allGatherAlongStart(const T *in, T *out, void *blocks,
                                int64_t outer, int64_t len, int64_t inner,
                                unsigned axes);
template <typename T>
CommRequest reduceScatterAlongStart(const T *in, T *out, void *blocks,
                                    int64_t outer, int64_t len, int64_t inner,
                                    unsigned axes);
// One step of a gather piece by piece, as tessel::rt's: `in` to the group
// rank `shift` places on, `out` from the one `shift` places back, both in
// one NCCL group on the communication stream.
template <typename T>
CommRequest shiftStart(const T *in, T *out, int64_t n, int64_t shift,
                       unsigned axes);

// The optimizer sharded over a group (ZeRO-1), as in tessel/Runtime/Comm.h:
// an n-element buffer cut into pieces of ceil(n / g) elements, piece k
// belonging to group rank k. reduceScatterShards leaves this rank's piece
// of the sum in place (the rest is undefined); the started form places it
// by commWait. allGatherShards gathers every rank's piece in place and
// then, with a non-null `shadow` (the bf16 copy of the same elements),
// refreshes the shadow of all n elements. Both are in-place NCCL groups of
// one reduce (broadcast) per root; counted as on the CPU.
// With `out` (ZeRO-2) the piece goes there instead of in place.
void reduceScatterShards(float *buffer, float *out, int64_t n, unsigned axes);
CommRequest reduceScatterShardsStart(float *buffer, int64_t n, unsigned axes);
// reduceScatterShards with `out`, started: `buffer` may be written, and
// `out` read, once commWait has made the compute stream wait for it.
CommRequest reduceScatterPieceStart(const float *buffer, float *out, int64_t n,
                                    unsigned axes);
void allGatherShards(float *buffer, const float *from, bf16 *shadow, int64_t n,
                     unsigned axes);
// allGatherShards started (ZeRO-3's prefetch, on the background lane): the
// piece is copied from `from` on the compute stream at once, the gather and
// the shadow's refresh run on the collective stream; `buffer` and `shadow`
// may be read, and `from` written, once commWait has made the compute
// stream wait for it.
CommRequest allGatherShardsStart(float *buffer, const float *from,
                                 bf16 *shadow, int64_t n, unsigned axes);
// A bf16 program's run whose fp32 master weights are pieces and which only
// matmuls read (ZeRO-1/2 after the update, ZeRO-3 into a part's slot): its
// bf16 copy gathered in bf16 (half the bytes), this rank's piece first
// rounded in from `from` (its fp32 piece) on the compute stream. `shadow`
// must be null (the buffer is the copy).
CommRequest allGatherShardsStart(bf16 *buffer, const float *from, bf16 *shadow,
                                 int64_t n, unsigned axes);
void allGatherShards(bf16 *buffer, const float *from, bf16 *shadow, int64_t n,
                     unsigned axes);

// Pipeline point-to-point along pp (peer = pp coordinate + offset; other
// axes are an error). NCCL matches the messages between two ranks in issue
// order, without tags, runs a stream's operations in order, and a send may
// block its stream until the peer receives; a stream shared by several
// peers could then close a cycle (a send to a far stage holding back one
// to a near stage). So each directed edge class has a channel of its own
// (an NCCL communicator over the pp groups and a stream): a message sent
// from coordinate c with offset o travels on channel (o, (c / |o|) % 2),
// which its receiver (recvFrom with offset -o) finds alike. On a channel a
// rank only sends to one peer or only receives from one, so every stream
// carries one edge's operations. The channels are those of
// DeviceProgram::p2pOffsets; using another offset is an error.
//
// sendTo copies `buffer` into a send buffer on the compute stream (the
// caller may overwrite it right after the call) and queues the send.
// flushSends issues the queued sends sorted by `order` (a stable sort),
// each on its channel after the compute stream's work so far. `order` is
// the position at which the receiver receives the message, so that both
// sides of a pair issue its messages in the same order; the emitted program
// flushes at the end of each forward or backward step. recvFrom issues the
// receive on its channel right away, after the compute stream's work so
// far, and the compute stream waits for the data before its next kernel.
// waitSends flushes what is still queued, then makes the compute stream
// wait until every send issued since the last call has completed; the send
// buffers are reused only after it (it is called once per step). With
// `ringSlots` > 0 the copy instead takes the next of that many slots of the
// send ring in turn: the compute stream first waits until the send that
// slot held has completed (been received). That send must have been issued
// by then; the compiler chooses the count so that it is and no wait can
// deadlock (tessel-order-messages).
//
// Operations between beginP2P() and endP2P() form one NCCL group, which may
// span several channels: the receives issued in it and the sends flushSends
// issues in it, or that are still queued at endP2P, start together at
// endP2P. Outside a group each operation is its own. No collective and no
// waitSends inside a group.
void beginP2P();
void endP2P();
template <typename T>
void sendTo(const T *buffer, int64_t n, rt::MeshAxis axis, int offset,
            int64_t order, int64_t ringSlots = 0);
void flushSends();
template <typename T>
void recvFrom(T *buffer, int64_t n, rt::MeshAxis axis, int offset);
void waitSends();

//===--- Device state (Device.cu) -----------------------------------------===//

// What the runtime allocates once, at start, in device memory.
struct DeviceBuffers {
  bf16 *paramShadow = nullptr; // bf16 copy of the parameters (bf16 programs)
  char *scratch = nullptr;     // attention / cross-entropy scratch
  float *scalars = nullptr;    // 16 floats: loss accumulators, norms
  double *normAcc = nullptr;   // 16 doubles: squared-norm partial sums
};
const DeviceBuffers &deviceBuffers();

// What a generated CUDA program adds to its Program.
struct DeviceProgram {
  bool bf16 = false;        // train.precision
  int64_t scratchBytes = 0; // largest attention / cross-entropy scratch
  int cudaArch = 90;        // the arch the program was built for
  // Allocated at start so that no step allocates or synchronises the
  // device: the largest staging of an all-gather or reduce-scatter along a
  // dimension, and room for the copies of every pipeline send outside the
  // send ring one step makes (each rounded up to 256 bytes). 0: grown on
  // first use.
  int64_t stagingBytes = 0;
  int64_t sendBytes = 0;
  // The send ring that the forward and backward parts' sends take in turn:
  // its slots and their size, allocated at start.
  int64_t sendRingSlots = 0;
  int64_t sendSlotBytes = 0;
  // Axis sets (masks) that collectives of this program run over.
  const unsigned *commAxes = nullptr;
  int numCommAxes = 0;
  // Pipeline offsets (nonzero) that any stage program of the job sends
  // with, e.g. {+1, -1, +3}: each gets point-to-point channels, created
  // collectively at start from the union over all ranks. None listed with
  // pp > 1 means {+1, -1}.
  const int *p2pOffsets = nullptr;
  int numP2POffsets = 0;
  // parallel.offload = "optimizer" (ZeRO-Offload): AdamW's moments live in
  // pinned host memory mapped into the device's address space; the update
  // kernel reads and writes them across the bus, and nothing else touches
  // them in a step.
  bool offloadOptimizer = false;
  // Null when the training step can run as a CUDA graph (captured once,
  // then launched per step); otherwise why not: what in the step waits
  // for device data on the host.
  const char *hostReadsInStep = nullptr;
  // The bf16 copy runs shadowExtraElems elements past the copy of the
  // parameter store: ZeRO-1/2's copies of the runs whose fp32 master
  // weights are pieces only, or ZeRO-3's slots of the runs gathered in
  // bf16 (which have no fp32 slot).
  int64_t shadowExtraElems = 0;
  // ZeRO-1/2 in bf16: those runs; each entry is {offset of the run's piece
  // in the parameter pieces, offset of its copy, elements, the group's
  // axes}. start fills the copies from the pieces.
  const int64_t (*masterCopies)[4] = nullptr;
  int numMasterCopies = 0;
};

// The tessel::rt::DeviceHooks a CUDA program hands runMain (see Program.h).
const rt::DeviceHooks *deviceHooks(const DeviceProgram &program);

// Copies the step's loss and global norm (device scalars) into ctx after the
// step's work has finished; called at the end of the generated step.
void finishStep(rt::StepContext &ctx, const float *loss, const float *norm);
// Copies `n` device floats into ctx.metrics under `name` (after finishStep,
// whose synchronisation they follow).
void recordMetric(rt::StepContext &ctx, const char *name, const float *values,
                  int64_t n);

} // namespace tessel::cuda

#endif // TESSEL_RUNTIME_CUDA_DEVICE_H
