//===- Comm.cu - NCCL collectives over mesh axes --------------------------===//
//
// (Long by design: communicators, collectives, point-to-point channels and
// the watchdog share one set of per-stream state and error handling.)
//
// The CUDA counterpart of Comm.cpp, with the same contracts on device
// buffers (see tessel/Runtime/Cuda/Device.h).
//
// Communicators. MPI has started the job and placed every rank on the mesh
// (tessel/Runtime/Comm.h). At start, rank 0 creates an NCCL unique id and
// broadcasts it over MPI_COMM_WORLD to build a world communicator; every
// axis set is then split off it with ncclCommSplit: the color numbers the
// rank's coordinates on the axes outside the set (equal exactly for the
// ranks of one group) and the key is rt::groupRank, so NCCL ranks follow the
// group order of the CPU runtime. As in Comm.cpp an axis set is first
// reduced to its axes of size > 1, and a group of one rank has no
// communicator: its collectives copy or do nothing. The sets split are the
// program's DeviceProgram::commAxes, united over all ranks with an
// MPI_Allreduce: each split is collective over the world, and the pipeline
// stages are different programs whose lists may differ. Splits run in
// increasing mask order.
//
// Point-to-point channels. Point-to-point runs along pp only. NCCL matches
// the messages between two ranks of a communicator in issue order, without
// tags; the operations on one stream run in order, and an ncclSend may
// block its stream until the peer has posted the matching receive. A
// stream that carries operations with several peers can therefore close a
// cycle: with pp >= 3 a send waiting for a far stage (the tied embedding
// table from the first stage to the last, the wrap-around of an
// interleaved schedule) holds back a later send to, or receive from, a
// near stage that the far one indirectly waits for. So every stream
// carries the operations of one directed edge only, and a blocked send
// waits for its own receiver alone.
//
// A message sent from pp coordinate c with offset o (to c + o) travels on
// channel (o, parity), parity = (c / |o|) % 2. Its receiver, at c + o,
// calls recvFrom with offset -o and computes the same key from its own
// coordinate. c / |o| and (c + o) / |o| differ by exactly one, so on a
// channel every rank either sends to one peer (c + o) or receives from one
// (c - o), never both: a channel's pairs are disjoint, and each of its
// streams holds the sends of one edge or the receives of one edge. Every
// channel has an NCCL communicator over the pp groups (split after the
// axis sets, with the pp set's color and key, so NCCL rank = pp
// coordinate) and a non-blocking stream of its own. The channels are those
// of the offsets in DeviceProgram::p2pOffsets (the offsets any stage sends
// with; {+1, -1} if a program lists none), united over all ranks with an
// MPI_Allreduce since the splits are collective, each with both parities,
// split in increasing (offset, parity) order; a key that no pair of
// coordinates of the mesh can use is left out on every rank alike.
//
// sendTo copies the data into a send buffer on the compute stream (the
// send ring's next slot for a forward or backward part's send, once the
// compute stream has waited for the send that slot held to complete; a
// buffer of its own until waitSends otherwise) and queues the send; `order` is
// the message's index among everything this rank sends to that peer in a
// training step, counted in the order the peer receives them. flushSends (after
// every pipeline step) issues, per peer, the queued sends whose turn has come,
// so the sender's issue order is the receiver's even when a message is consumed
// after messages produced later (the compiler computes the orders from the
// schedules); waitSends (once per step) checks that every message went out and
// starts counting again.
//
// Ordering. Collectives run on the communication stream. Each one first
// makes that stream wait for the compute stream (an event), so it sees
// every kernel enqueued before it; a blocking collective then makes the
// compute stream wait for its completion event, while the started ones
// (allReduceSumStart, reduceScatterShardsStart, reduceScatterPieceStart)
// leave that to commWait, letting backward go on meanwhile. Started
// collectives over a data-parallel axis set (the gradient buckets and
// ZeRO's reductions) run on a background stream with communicators of
// their own (a second split of each such set), so a blocking collective
// (tp and sp inside a layer, the loss) never queues behind gradient
// buckets still in flight; the blocking ones keep the communication
// stream. Every rank issues both lanes' operations in the program's
// order, so the two communicators of a group see the same order on every
// rank. Point-to-point
// operations do the same on their channel's stream: a receive makes the
// compute stream wait for it, sends are waited for by waitSends.
//
// Watchdog. Every operation's completion event goes into an in-flight list
// of its stream (the communication stream or a channel's) that a
// background thread polls every 100 ms, together with each communicator's
// asynchronous error state. An operation still pending after
// TESSEL_NCCL_TIMEOUT seconds (default 600; counted from when the one
// before it on its stream completed), or an asynchronous NCCL error, is
// reported as one line naming the operation, its axes or peer, its size and
// the rank; the thread then aborts the communicators and the job, so that
// no rank waits forever. Completed entries give their event back to a pool
// created at start.
//
// Pieces (ZeRO-1). reduceScatterShards and allGatherShards move pieces of
// ceil(n / g) elements, the last ones shorter or empty, so NCCL's
// equal-count reduce-scatter and all-gather do not fit them without a
// padded copy. Each is instead one NCCL group, on the buffer in place, of
// one ncclReduce (ncclBroadcast) per root: root k's operation covers piece
// k alone, so the operations touch disjoint elements. Nothing is allocated.
//
// Expert parallelism. moeExchange and moeCombine move the rows of a routed
// layer as the CPU runtime does (an all-to-all of the counts, then
// MPI_Alltoallv's layout: rank j's rows for this rank's experts land by
// source rank, then expert), as grouped ncclSend / ncclRecv. The counts
// are exchanged first, on the device (a fixed __device__ array holds
// them); the row ranges (this rank's and those it receives) are then
// copied to the host, which waits for the compute stream, since NCCL takes
// message sizes from the host. That wait is the one place a step
// synchronises with the device before its end: padded messages of the
// largest possible size would avoid it, but would send up to g - 1 times
// the rows (every rank's whole buffer to every peer) and break the byte
// counts the compiler plans and the CPU runtime reports. It waits for the
// compute stream only, and every rank of the group reaches the exchange at
// the same point of its program, so the collectives and messages the
// compute stream waits for have been issued. The combine reads its two row
// ranges the same way.
//
// Counting uses the CPU runtime's counters (rt::collectiveCounter) with the
// same elements and textbook volumes (tessel/Runtime/CommVolume.h), at the
// width of the element type, so --comm-report works unchanged.
//
//===----------------------------------------------------------------------===//

#include "Internal.h"
#include "tessel/Runtime/Comm.h"
#include "tessel/Runtime/CommVolume.h"
#include "tessel/Runtime/Cuda/Device.h"

// Only the C API: keep mpi.h from pulling in the deprecated C++ bindings.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <atomic>
#include <thread>
#include <unistd.h>
#include <tuple>
#include <vector>

namespace tessel::cuda {

namespace {

using Clock = std::chrono::steady_clock;
using rt::CollectiveKind;

constexpr unsigned kNumAxisSets = 1u << tessel::kNumAxisBits;
constexpr unsigned kAllAxes = kNumAxisSets - 1;
// Events the watchdog pool starts with; it grows if more are in flight.
constexpr int kInitialEvents = 256;

// The axis point-to-point runs along (see the top).
constexpr MeshAxis kP2PAxis = MeshAxis::PP;
// The streams the watchdog follows, each of which runs its operations in
// order: the communication stream's list comes first, then one per
// point-to-point channel, in the channels' order.
constexpr int kCommQueue = 0;
constexpr int kBackgroundQueue = 1;
constexpr int queueOf(int channel) { return 2 + channel; }

// One enqueued operation, as the watchdog sees it.
struct InFlight {
  // A collective ("all_reduce"), a point-to-point operation ("send to",
  // "recv from", with `offset`), a beginP2P/endP2P group on one channel or
  // a launch of the step captured as a CUDA graph (`elements`: the
  // collectives and sends in it).
  enum Kind { Collective, PointToPoint, Group, Graph } kind;
  const char *name;
  unsigned axes;
  int offset;
  int64_t elements;
  cudaEvent_t done;
  Clock::time_point since; // enqueued, or when the one before it completed
};

// A device buffer that sends copy their data into (see sendTo).
struct SendBuffer {
  void *data;
  size_t bytes;
};

// A send that sendTo has queued for flushSends.
struct QueuedSend {
  int64_t order;
  const void *data; // its send buffer
  size_t count;
  ncclDataType_t type;
  int peer;
  int offset;
  int channel; // index into CommState::channels
  int ringSlot; // its slot of the send ring, or -1
};

// A slot of the send ring (sendTo with ringSlots): the buffer, and the
// event recorded on its channel's stream once the send it holds is issued.
struct RingSlot {
  void *data = nullptr;
  size_t bytes = 0;
  cudaEvent_t sent = nullptr;
  bool held = false;   // a send since waitSends copied into it
  bool issued = false; // and that send has been issued (`sent` recorded)
};

// A point-to-point channel, the messages sent with `offset` from the
// coordinates c with (c / |offset|) % 2 == parity (see the top): its
// communicator over the pp group and its stream.
struct P2PChannel {
  int offset = 0;
  int parity = 0;
  // "pp+3 channel (parity 0)", for messages; the watchdog's name of a
  // beginP2P/endP2P group on it. Neither changes once the channels exist.
  std::string name;
  std::string groupName;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  // Sends issued on the stream since the last waitSends; sendsDone is
  // recorded on the stream by waitSends.
  bool sendsPending = false;
  cudaEvent_t sendsDone = nullptr;
  // What the open beginP2P group enqueued on this channel.
  bool groupUsed = false;
  bool groupHasRecv = false;
  int64_t groupElements = 0;
};

struct CommState {
  bool started = false;
  int device = 0;
  ncclComm_t world = nullptr;
  ncclComm_t comms[kNumAxisSets] = {}; // by effective axis mask
  // Started collectives (the data-parallel gradient reductions) run on
  // their own stream and communicators, so that a blocking collective (tp,
  // sp, the loss) never queues behind gradient buckets: a second
  // communicator for every axis set with a data-parallel axis, and the
  // stream. `onBackground` is set while a started collective picks its
  // communicator and enqueues (BackgroundLane).
  ncclComm_t background[kNumAxisSets] = {};
  cudaStream_t backgroundStream = nullptr;
  bool onBackground = false;
  // Recorded on the compute stream whenever the communication stream or a
  // channel's stream must catch up with it; a wait captures the event's
  // state when it is issued, so one event serves every operation.
  cudaEvent_t computeReady = nullptr;

  // Staging of allGatherAlong / reduceScatterAlong with outer > 1:
  // allocated at start at the size the compiler planned
  // (DeviceProgram::stagingBytes); grown only if a call needs more, which a
  // program that planned it does not.
  void *staging = nullptr;
  // Stagings outgrown (kept until commStop: a captured step graph may
  // still point into one).
  std::vector<void *> retiredStaging;
  size_t stagingBytes = 0;

  // Started collectives: one completion event per request slot, owned by
  // the slot (a pooled event may be recorded again before commWait).
  std::vector<cudaEvent_t> requestEvents;
  std::vector<bool> requestInUse;
  std::vector<bool> requestHasWork;

  // Point-to-point: the channels in increasing (offset, parity) order, set
  // up by commStart and left as they are until commStop (the watchdog
  // reads them), and their indices by (offset, parity).
  std::vector<P2PChannel> channels;
  std::map<std::pair<int, int>, int> channelIndex;
  bool inGroup = false;
  // Sends queued by sendTo until their turn (see flushSends).
  std::vector<QueuedSend> queuedSends;
  // Per (channel, peer): the order of the next message it receives.
  std::map<std::pair<int, int>, int64_t> nextOrder;
  // Sends copy their data here, in order, one buffer per send since the
  // last waitSends; the schedule repeats every step, so after the first
  // step the buffers are reused as they are.
  std::vector<SendBuffer> sendBuffers;
  size_t nextSendBuffer = 0;
  // With DeviceProgram::sendBytes: one arena allocated at start that the
  // sends of a step take in turn (256-byte aligned), from its start again
  // after waitSends; a send that does not fit falls back to sendBuffers.
  char *sendArena = nullptr;
  size_t sendArenaBytes = 0, sendArenaUsed = 0;
  // The send ring: DeviceProgram::sendRingSlots slots in one allocation of
  // sendRingSlots x sendSlotBytes made at start (a slot outgrown, or a ring
  // the program did not plan, gets a buffer of its own, outside a captured
  // step), and the ring sends since waitSends. Inside a beginP2P group the
  // slots whose sends were issued get their events at endP2P.
  std::vector<RingSlot> ring;
  char *ringArena = nullptr;
  std::vector<void *> ringBuffers; // allocated for outgrown slots
  int64_t ringNext = 0;
  std::vector<std::pair<int, int>> groupRingSlots; // (slot, channel)

  // Watchdog; `mutex` guards everything below.
  std::mutex mutex;
  std::condition_variable wake;
  // By queue (kCommQueue, kBackgroundQueue, queueOf(channel)); sized by
  // commStart, before the watchdog starts, and not resized while it runs.
  std::vector<std::deque<InFlight>> inFlight =
      std::vector<std::deque<InFlight>>(2);
  std::vector<cudaEvent_t> eventPool;
  std::thread watchdog;
  bool stopWatchdog = false;
  double timeoutSeconds = 600;
  std::string failure;
};

// Never destroyed: the watchdog thread may still run while the process
// exits after an error.
CommState &state() {
  static CommState *s = new CommState;
  return *s;
}

void check(cudaError_t status, const char *what) {
  checkCuda(status, what, __FILE__, __LINE__);
}

// "dp", "dp,tp": axis sets in messages.
std::string axesName(unsigned axes) { return AxisSet::fromBits(axes).str(); }

// `axes` restricted to the axes of size > 1: equal masks mean equal groups.
unsigned effectiveAxes(unsigned axes) {
  return rt::meshLayout().shape().effective(AxisSet::fromBits(axes)).bits();
}

void checkAxes(unsigned axes, const char *what) {
  if (axes == 0 || (axes & ~kAllAxes))
    throw std::runtime_error(std::string(what) + " called with invalid axes " +
                             std::to_string(axes));
}

void checkCount(int64_t n, const char *what) {
  if (n < 0)
    throw std::runtime_error(std::string(what) +
                             " of a negative element count " +
                             std::to_string(n));
}

template <typename T> ncclDataType_t ncclType();
template <> ncclDataType_t ncclType<float>() { return ncclFloat32; }
template <> ncclDataType_t ncclType<bf16>() { return ncclBfloat16; }
template <> ncclDataType_t ncclType<double>() { return ncclFloat64; }

// Every NCCL call: an error names the collective, its axes and size, and the
// rank, with NCCL's own explanation.
void checkNccl(ncclResult_t result, const char *collective, unsigned axes,
               int64_t elements) {
  if (result == ncclSuccess)
    return;
  std::string detail = ncclGetLastError(nullptr);
  throw std::runtime_error(
      std::string("NCCL ") + collective + " over " + axesName(axes) + " (" +
      std::to_string(elements) + " elements) failed on rank " +
      std::to_string(rt::commRank()) + ": " + ncclGetErrorString(result) +
      (detail.empty() ? "" : " (" + detail + ")"));
}

// NCCL calls that set communicators up or group others.
void checkNcclCall(ncclResult_t result, const char *call) {
  if (result == ncclSuccess)
    return;
  std::string detail = ncclGetLastError(nullptr);
  throw std::runtime_error(std::string(call) + " failed on rank " +
                           std::to_string(rt::commRank()) + ": " +
                           ncclGetErrorString(result) +
                           (detail.empty() ? "" : " (" + detail + ")"));
}

void checkMpi(int result, const char *what) {
  if (result == MPI_SUCCESS)
    return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(result, text, &length);
  throw std::runtime_error(std::string(what) +
                           " failed: " + std::string(text, length));
}

// Adds one call to the CPU runtime's counter of `kind`. Comm.h hands the
// counters out read-only; they are ordinary mutable objects, so writing
// through the reference is well defined, and keeps one set of counters for
// --comm-report whichever runtime communicates.
void count(CollectiveKind kind, int64_t elements, int64_t bytesSent) {
  if (!rt::collectivesCounted())
    return;
  auto &counter =
      const_cast<rt::CollectiveCounter &>(rt::collectiveCounter(kind));
  counter.calls += 1;
  counter.elements += elements;
  counter.bytesSent += bytesSent;
}

// The stream collectives are enqueued on: the communication stream, or
// the background stream inside a BackgroundLane.
cudaStream_t collectiveStream() {
  CommState &s = state();
  return s.onBackground ? s.backgroundStream : detail::commStream();
}

// An axis set whose started collectives get a background communicator.
bool dataParallel(unsigned axes) {
  return AxisSet::fromBits(axes).intersects(AxisSet::dataParallel());
}

// While one lives, collectives over `axes`, a data-parallel set, pick the
// background communicators and stream (a collective, from its checks to
// its enqueueing); other sets, and a job without communicators, stay on the
// communication stream. Every collective of a data-parallel group, started
// or blocking, runs there: one communicator and one stream per group, in
// program order, so that no two of the group's NCCL kernels need to run at
// once (NCCL does not promise that they can).
struct BackgroundLane {
  explicit BackgroundLane(unsigned axes) : previous(state().onBackground) {
    CommState &s = state();
    s.onBackground = s.backgroundStream && dataParallel(effectiveAxes(axes));
  }
  ~BackgroundLane() { state().onBackground = previous; }
  bool previous;
  BackgroundLane(const BackgroundLane &) = delete;
  BackgroundLane &operator=(const BackgroundLane &) = delete;
};

// The communicator of the group `axes` spans, or null for a group of one.
ncclComm_t commFor(unsigned axes, const char *collective) {
  if (rt::groupSize(axes) == 1)
    return nullptr;
  CommState &s = state();
  ncclComm_t comm = s.onBackground ? s.background[effectiveAxes(axes)]
                                   : s.comms[effectiveAxes(axes)];
  if (!comm)
    throw std::runtime_error(
        std::string(collective) + " over " + axesName(axes) +
        " has no NCCL communicator: " +
        (state().started
             ? "the axis set is missing from DeviceProgram::commAxes"
             : "the device was not started"));
  return comm;
}

//===--- Stream ordering and the watchdog's list
//---------------------------===//

cudaEvent_t newEvent() {
  cudaEvent_t event = nullptr;
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
        "cudaEventCreateWithFlags");
  return event;
}

// `stream` waits for everything enqueued so far on the compute stream.
void afterCompute(cudaStream_t stream) {
  CommState &s = state();
  check(cudaEventRecord(s.computeReady, computeStream()), "cudaEventRecord");
  check(cudaStreamWaitEvent(stream, s.computeReady, 0), "cudaStreamWaitEvent");
}

void commAfterCompute() { afterCompute(collectiveStream()); }

// Records the completion of what was just enqueued on `stream`, the stream
// of `queue`, and hands `entry` to the watchdog. With `computeWaits`, the
// compute stream waits for it (before the watchdog may recycle the event).
void operationEnqueued(int queue, cudaStream_t stream, InFlight entry,
                       bool computeWaits) {
  CommState &s = state();
  cudaEvent_t done;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (s.eventPool.empty()) {
      done = newEvent();
    } else {
      done = s.eventPool.back();
      s.eventPool.pop_back();
    }
  }
  check(cudaEventRecord(done, stream), "cudaEventRecord");
  if (computeWaits)
    check(cudaStreamWaitEvent(computeStream(), done, 0), "cudaStreamWaitEvent");
  if (detail::capturing()) {
    // Captured: the record above is an edge of the graph (the wait has
    // taken it), and the watchdog follows the graph's launches instead.
    std::lock_guard<std::mutex> lock(s.mutex);
    s.eventPool.push_back(done);
    return;
  }
  entry.done = done;
  entry.since = Clock::now();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.inFlight[queue].push_back(entry);
}

// The same for a collective on the communication (or background) stream.
void collectiveEnqueued(const char *name, unsigned axes, int64_t elements,
                        bool computeWaits) {
  operationEnqueued(state().onBackground ? kBackgroundQueue : kCommQueue,
                    collectiveStream(),
                    {InFlight::Collective, name, axes, 0, elements, nullptr,
                     Clock::time_point()},
                    computeWaits);
}

void checkNotInGroup(const char *collective) {
  if (state().inGroup)
    throw std::runtime_error(std::string(collective) +
                             " between beginP2P() and endP2P()");
}

// Runs `enqueue` (NCCL calls on the communication stream) as a blocking
// collective: after the compute stream's work, before its next kernel.
template <typename Enqueue>
void blockingCollective(const char *name, unsigned axes, int64_t elements,
                        Enqueue enqueue) {
  checkNotInGroup(name);
  commAfterCompute();
  enqueue();
  collectiveEnqueued(name, axes, elements, /*computeWaits=*/true);
}

// Runs `enqueue` (NCCL calls on collectiveStream()) as a started
// collective, after the compute stream's work; commWait on the returned
// request makes the compute stream wait for it. Without `work` nothing is
// enqueued and the request is done at once.
template <typename Enqueue>
CommRequest startedCollective(const char *name, unsigned axes, int64_t elements,
                              bool work, Enqueue enqueue) {
  checkNotInGroup(name);
  CommState &s = state();
  // Reuse the first free slot so the table stays as small as the number of
  // requests in flight at once.
  size_t slot = 0;
  while (slot < s.requestInUse.size() && s.requestInUse[slot])
    slot++;
  if (slot == s.requestInUse.size()) {
    s.requestEvents.push_back(newEvent());
    s.requestInUse.push_back(false);
    s.requestHasWork.push_back(false);
  }
  if (work) {
    commAfterCompute();
    enqueue();
    check(cudaEventRecord(s.requestEvents[slot], collectiveStream()),
          "cudaEventRecord");
    collectiveEnqueued(name, axes, elements, /*computeWaits=*/false);
  }
  s.requestInUse[slot] = true;
  s.requestHasWork[slot] = work;
  return (CommRequest)slot;
}

// (cudaMemcpyDefault: ZeRO-3's pieces may be in pinned host memory.)
template <typename T> void copyOnCompute(T *out, const T *in, int64_t n) {
  if (out != in && n > 0)
    check(cudaMemcpyAsync(out, in, (size_t)n * sizeof(T), cudaMemcpyDefault,
                          computeStream()),
          "cudaMemcpyAsync");
}

// The staging buffer, grown to `bytes` if smaller. Every collective that
// uses it is blocking and its unpacking runs on the compute stream, so
// waiting for the device makes the old buffer free.
void *staging(size_t bytes) {
  CommState &s = state();
  if (bytes > s.stagingBytes) {
    detail::notWhileCapturing("growing the collective staging");
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    if (s.staging)
      s.retiredStaging.push_back(s.staging);
    s.staging = nullptr;
    s.stagingBytes = 0;
    check(cudaMalloc(&s.staging, bytes), "cudaMalloc (collective staging)");
    s.stagingBytes = bytes;
  }
  return s.staging;
}

//===--- Watchdog
//----------------------------------------------------------===//

// Reports `message` as this rank's fatal error, aborts the communicators (so
// that kernels blocked in a collective return) and ends the process; called
// by the watchdog thread only. The first caller owns the teardown (a second
// waits for the process to end), and the communicators it aborts are never
// destroyed meanwhile: commStop joins the watchdog before it destroys them.
// MPI stays single-threaded (only the main thread calls it), so the process
// ends with _exit, not MPI_Abort; a rank that ends without MPI_Finalize
// makes mpirun stop the job, as the CPU runtime's watchdog does.
[[noreturn]] void abortJob(const std::string &message) {
  static std::atomic<bool> aborting{false};
  if (aborting.exchange(true))
    for (;;)
      std::this_thread::sleep_for(std::chrono::seconds(1));
  CommState &s = state();
  std::fflush(stdout);
  std::fprintf(stderr, "rank %d: error: %s\n", rt::commRank(), message.c_str());
  std::fflush(stderr);
  // Aborting a communicator that a captured step graph still uses can wait
  // for that graph (NCCL keeps the communicator until the graph is gone),
  // and the main thread, stuck in the graph, never destroys it: the aborts
  // run on a thread of their own, and the process ends after them or after
  // ten seconds, whichever comes first.
  static std::atomic<bool> aborted{false};
  std::thread([&s] {
    for (unsigned axes = 0; axes < kNumAxisSets; axes++) {
      if (s.comms[axes])
        ncclCommAbort(s.comms[axes]);
      if (s.background[axes])
        ncclCommAbort(s.background[axes]);
    }
    for (P2PChannel &channel : s.channels)
      if (channel.comm)
        ncclCommAbort(channel.comm);
    if (s.world)
      ncclCommAbort(s.world);
    aborted = true;
  }).detach();
  for (int k = 0; k < 1000 && !aborted; k++)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  std::fflush(stderr);
  ::_exit(1);
}

// "collective all_reduce over dp (4096 elements)", "send to pp+1 (4096
// elements)".
std::string describeOperation(const InFlight &f) {
  std::string size = " (" + std::to_string(f.elements) + " elements)";
  switch (f.kind) {
  case InFlight::Collective:
    return std::string("collective ") + f.name + " over " + axesName(f.axes) +
           size;
  case InFlight::PointToPoint:
    return std::string(f.name) + " " + axesName(f.axes) +
           (f.offset > 0 ? "+" : "") + std::to_string(f.offset) + size;
  case InFlight::Group:
    break;
  case InFlight::Graph:
    return "the training step's CUDA graph (" + std::to_string(f.elements) +
           " collectives and sends)";
  }
  return std::string(f.name) + size;
}

// One poll: recycles completed operations and returns a failure message,
// or an empty string. Called with the mutex held.
std::string pollCollectives(CommState &s) {
  Clock::time_point now = Clock::now();
  for (std::deque<InFlight> &inFlight : s.inFlight) {
    while (!inFlight.empty()) {
      InFlight &oldest = inFlight.front();
      cudaError_t status = cudaEventQuery(oldest.done);
      if (status == cudaSuccess) {
        s.eventPool.push_back(oldest.done);
        inFlight.pop_front();
        // A stream runs its operations in order: the next one could not
        // start before this one completed.
        if (!inFlight.empty())
          inFlight.front().since = std::max(inFlight.front().since, now);
        continue;
      }
      if (status != cudaErrorNotReady)
        return describeOperation(oldest) +
               " failed: " + cudaGetErrorString(status);
      double waited = std::chrono::duration<double>(now - oldest.since).count();
      if (waited > s.timeoutSeconds) {
        char seconds[32];
        std::snprintf(seconds, sizeof(seconds), "%.0f", waited);
        return describeOperation(oldest) + " has not completed after " +
               seconds +
               " s (a rank died or the ranks disagree on the schedule)";
      }
      break;
    }
  }
  // The asynchronous error of `comm`, whose operations run on the stream of
  // `queue`, or an empty string.
  auto asyncFailure = [&](ncclComm_t comm, int queue) -> std::string {
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(comm, &async) != ncclSuccess ||
        async == ncclSuccess || async == ncclInProgress)
      return "";
    std::string detail = ncclGetLastError(comm);
    std::string message = std::string(ncclGetErrorString(async)) +
                          (detail.empty() ? "" : " (" + detail + ")");
    if (!s.inFlight[queue].empty())
      message +=
          ", waiting for " + describeOperation(s.inFlight[queue].front());
    return message;
  };
  for (unsigned axes = 0; axes < kNumAxisSets; axes++) {
    if (!s.comms[axes])
      continue;
    std::string failure = asyncFailure(s.comms[axes], kCommQueue);
    if (!failure.empty())
      return "NCCL reported an error on the communicator over " +
             axesName(axes) + ": " + failure;
    if (!s.background[axes])
      continue;
    failure = asyncFailure(s.background[axes], kBackgroundQueue);
    if (!failure.empty())
      return "NCCL reported an error on the background communicator over " +
             axesName(axes) + ": " + failure;
  }
  for (size_t c = 0; c < s.channels.size(); c++) {
    const P2PChannel &channel = s.channels[c];
    if (!channel.comm)
      continue;
    std::string failure = asyncFailure(channel.comm, queueOf((int)c));
    if (!failure.empty())
      return "NCCL reported an error on the communicator of the " +
             channel.name + ": " + failure;
  }
  return "";
}

void watchdogLoop() {
  CommState &s = state();
  // Events and communicators belong to this device's context.
  cudaSetDevice(s.device);
  std::unique_lock<std::mutex> lock(s.mutex);
  while (!s.stopWatchdog) {
    s.wake.wait_for(lock, std::chrono::milliseconds(100));
    if (s.stopWatchdog)
      break;
    std::string failure = pollCollectives(s);
    if (!failure.empty()) {
      s.failure = failure;
      lock.unlock();
      abortJob(failure);
    }
  }
}

double timeoutFromEnvironment() {
  const char *text = std::getenv("TESSEL_NCCL_TIMEOUT");
  if (!text)
    return 600;
  char *end = nullptr;
  double seconds = std::strtod(text, &end);
  if (!*text || *end || !std::isfinite(seconds) || seconds <= 0)
    throw std::runtime_error(
        std::string("TESSEL_NCCL_TIMEOUT expects a positive number of "
                    "seconds, got '") +
        text + "'");
  return seconds;
}

//===--- Layout of collectives along a dimension
//---------------------------===//

// blocks [g, outer, len, inner] (NCCL's rank-major layout) and a tensor
// [outer, g * len, inner]; `piece` is len * inner. Copies blocks into the
// tensor, or the tensor into blocks with `toBlocks`.
template <typename T>
__global__ void regroupKernel(const T *src, T *dst, int64_t g, int64_t outer,
                              int64_t piece, bool toBlocks) {
  int64_t total = g * outer * piece;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    int64_t e = i % piece;
    int64_t o = (i / piece) % outer;
    int64_t r = i / (piece * outer);
    int64_t j = (o * g + r) * piece + e;
    if (toBlocks)
      dst[i] = src[j];
    else
      dst[j] = src[i];
  }
}

template <typename T>
void regroup(const T *src, T *dst, int64_t g, int64_t outer, int64_t len,
             int64_t inner, bool toBlocks, cudaStream_t stream) {
  int64_t total = g * outer * len * inner;
  if (total == 0)
    return;
  regroupKernel<T><<<detail::blocksFor(total), 256, 0, stream>>>(
      src, dst, g, outer, len * inner, toBlocks);
  check(cudaGetLastError(), "regroupKernel");
}

// Peer of a point-to-point call: the coordinate along `axis`, which is also
// the NCCL rank in the channels' communicators (see Comm.cpp's peerRank for
// the rules; a peer outside the axis is an error, not a wrap-around).
int p2pPeer(int64_t n, MeshAxis axis, int offset, const char *what) {
  if ((int)axis < 0 || (int)axis >= tessel::kNumMeshAxes)
    throw std::runtime_error(std::string(what) + " called with invalid axis " +
                             std::to_string((int)axis));
  if (axis != kP2PAxis)
    throw std::runtime_error(std::string(what) + " along " +
                             tessel::meshAxisName(axis) +
                             ": the CUDA runtime sends point-to-point only "
                             "along " +
                             tessel::meshAxisName(kP2PAxis));
  checkCount(n, what);
  int64_t coord = rt::meshCoord(axis), size = rt::meshSize(axis);
  int64_t peer = coord + offset;
  if (offset == 0 || peer < 0 || peer >= size)
    throw std::runtime_error(
        std::string(what) + " along " + tessel::meshAxisName(axis) +
        " with offset " + std::to_string(offset) + " from coordinate " +
        std::to_string(coord) + ": " +
        (offset == 0 ? std::string("the peer is this rank itself")
                     : "no rank has coordinate " + std::to_string(peer) + " (" +
                           tessel::meshAxisName(axis) + " size " +
                           std::to_string(size) + ")"));
  return (int)peer;
}

// "+3", "-1": a pipeline offset in messages.
std::string signedOffset(int offset) {
  return (offset > 0 ? "+" : "") + std::to_string(offset);
}

// The parity of the channel of a message sent from coordinate `sender`
// with `offset` (see the top).
int channelParity(int64_t sender, int offset) {
  return (int)((sender / std::abs(offset)) % 2);
}

// The channel of a send (sendTo) or a receive (recvFrom) of this rank with
// `offset`, whose peer p2pPeer has checked: the key of the message's
// sender offset and the sender's coordinate.
int channelFor(int offset, bool isRecv, const char *what) {
  CommState &s = state();
  int64_t coord = rt::meshCoord(kP2PAxis);
  int sendOffset = isRecv ? -offset : offset;
  int64_t sender = isRecv ? coord + offset : coord;
  auto found =
      s.channelIndex.find({sendOffset, channelParity(sender, sendOffset)});
  if (found == s.channelIndex.end())
    throw std::runtime_error(
        std::string(what) + " along " + tessel::meshAxisName(kP2PAxis) +
        " with offset " + signedOffset(offset) + " has no NCCL channel: " +
        (s.started ? "pipeline offset " + signedOffset(sendOffset) +
                         " was not declared in DeviceProgram::p2pOffsets"
                   : std::string("the device was not started")));
  return found->second;
}

// A send or receive just issued on `channel` (NCCL call made). Outside
// beginP2P/endP2P it is a group of its own: its completion goes to the
// watchdog, and a receive blocks the compute stream until the data has
// arrived, as recvFrom blocks on the CPU; a send is waited for by
// waitSends. Inside a group, endP2P does this once per channel.
void p2pEnqueued(int channel, bool isRecv, int offset, int64_t n) {
  CommState &s = state();
  P2PChannel &c = s.channels[channel];
  if (!isRecv)
    c.sendsPending = true;
  if (s.inGroup) {
    c.groupUsed = true;
    c.groupElements += n;
    c.groupHasRecv |= isRecv;
    return;
  }
  operationEnqueued(queueOf(channel), c.stream,
                    {InFlight::PointToPoint, isRecv ? "recv from" : "send to",
                     AxisSet(kP2PAxis).bits(), offset, n, nullptr,
                     Clock::time_point()},
                    /*computeWaits=*/isRecv);
}

// A send buffer of at least `bytes` for the next send since waitSends.
void *nextSendBuffer(size_t bytes) {
  CommState &s = state();
  size_t rounded = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;
  if (s.sendArena && s.sendArenaUsed + rounded <= s.sendArenaBytes) {
    void *data = s.sendArena + s.sendArenaUsed;
    s.sendArenaUsed += rounded;
    return data;
  }
  if (s.nextSendBuffer == s.sendBuffers.size() ||
      s.sendBuffers[s.nextSendBuffer].bytes < bytes) {
    // A new schedule (or the first step): keep the existing buffers, which
    // later sends of this step may still fit, and add one here.
    detail::notWhileCapturing("allocating a send buffer");
    void *data = nullptr;
    check(cudaMalloc(&data, std::max<size_t>(bytes, 1)),
          "cudaMalloc (send buffer)");
    s.sendBuffers.insert(s.sendBuffers.begin() + s.nextSendBuffer,
                         {data, bytes});
  }
  return s.sendBuffers[s.nextSendBuffer++].data;
}

// The ring's next slot, for a send of `bytes`, and its index. The compute
// stream first waits until the send the slot held (issued, as the compiler
// made sure) has completed, that is, been received.
std::pair<void *, int> nextRingSlot(int64_t slots, size_t bytes) {
  CommState &s = state();
  if ((int64_t)s.ring.size() != slots) {
    if (s.ringNext != 0)
      throw std::runtime_error("sendTo: a send ring of " +
                               std::to_string(slots) + " slots while " +
                               std::to_string(s.ring.size()) + " are in use");
    detail::notWhileCapturing("setting up the send ring");
    for (RingSlot &slot : s.ring)
      if (slot.sent)
        cudaEventDestroy(slot.sent);
    s.ring.assign(slots, RingSlot());
    for (RingSlot &slot : s.ring)
      slot.sent = newEvent();
  }
  int index = (int)(s.ringNext++ % slots);
  RingSlot &slot = s.ring[index];
  if (slot.held) {
    if (!slot.issued)
      throw std::runtime_error(
          "rank " + std::to_string(rt::commRank()) + ": pipeline send slot " +
          std::to_string(index) + " of " + std::to_string(slots) +
          " is needed again before the send it holds was issued: the "
          "program's send ring does not fit its schedule");
    check(cudaStreamWaitEvent(computeStream(), slot.sent, 0),
          "cudaStreamWaitEvent");
  }
  if (slot.bytes < bytes) {
    detail::notWhileCapturing("allocating a send slot");
    void *data = nullptr;
    check(cudaMalloc(&data, bytes), "cudaMalloc (send slot)");
    s.ringBuffers.push_back(data);
    slot.data = data;
    slot.bytes = bytes;
  }
  slot.held = true;
  slot.issued = false;
  return {slot.data, index};
}

} // namespace

//===--- Start and stop (called by Device.cu)
//------------------------------===//

namespace detail {

void commStart(const DeviceProgram &program, int device) {
  CommState &s = state();
  if (s.started)
    throw std::runtime_error("the NCCL communicators are already set up");
  s.device = device;
  s.timeoutSeconds = timeoutFromEnvironment();
  s.computeReady = newEvent();
  for (int i = 0; i < kInitialEvents; i++)
    s.eventPool.push_back(newEvent());
  s.started = true;
  // The buffers a step would otherwise allocate (and, for the staging,
  // synchronise the device for), sized by the compiler.
  if (program.stagingBytes > 0) {
    check(cudaMalloc(&s.staging, (size_t)program.stagingBytes),
          "cudaMalloc (collective staging)");
    s.stagingBytes = (size_t)program.stagingBytes;
  }
  if (program.sendBytes > 0) {
    check(cudaMalloc(&s.sendArena, (size_t)program.sendBytes),
          "cudaMalloc (pipeline send buffers)");
    s.sendArenaBytes = (size_t)program.sendBytes;
  }
  if (program.sendRingSlots > 0 && program.sendSlotBytes > 0) {
    size_t slotBytes = (size_t)program.sendSlotBytes;
    check(cudaMalloc(&s.ringArena, slotBytes * program.sendRingSlots),
          "cudaMalloc (pipeline send ring)");
    s.ring.assign(program.sendRingSlots, RingSlot());
    for (size_t k = 0; k < s.ring.size(); k++) {
      s.ring[k].data = s.ringArena + k * slotBytes;
      s.ring[k].bytes = slotBytes;
      s.ring[k].sent = newEvent();
    }
  }

  // A one-rank mesh never starts MPI and needs no communicator.
  int worldSize = rt::commWorldSize(), rank = rt::commRank();
  if (worldSize == 1)
    return;

  // Bit m: axis set m needs a communicator on some rank.
  static_assert(kNumAxisSets <= 128, "two 64-bit words of axis sets");
  uint64_t wanted[2] = {0, 0};
  if (program.numCommAxes > 0 && !program.commAxes)
    throw std::runtime_error("DeviceProgram::commAxes is null");
  for (int i = 0; i < program.numCommAxes; i++) {
    unsigned axes = program.commAxes[i];
    if (axes == 0 || (axes & ~kAllAxes))
      throw std::runtime_error("DeviceProgram::commAxes holds an invalid axis "
                               "set " +
                               std::to_string(axes));
    unsigned set = effectiveAxes(axes);
    wanted[set / 64] |= uint64_t(1) << (set % 64);
  }
  wanted[0] &= ~uint64_t(1); // the empty set: groups of one rank
  checkMpi(MPI_Allreduce(MPI_IN_PLACE, wanted, 2, MPI_UINT64_T, MPI_BOR,
                         MPI_COMM_WORLD),
           "MPI_Allreduce");

  // The pipeline offsets that get channels: those any rank sends with.
  if (program.numP2POffsets > 0 && !program.p2pOffsets)
    throw std::runtime_error("DeviceProgram::p2pOffsets is null");
  std::vector<int> declared;
  for (int i = 0; i < program.numP2POffsets; i++) {
    if (program.p2pOffsets[i] == 0)
      throw std::runtime_error(
          "DeviceProgram::p2pOffsets holds the offset 0 (a rank does not "
          "send to itself)");
    declared.push_back(program.p2pOffsets[i]);
  }
  // Programs generated before the offsets were listed send to neighbours
  // only.
  if (declared.empty())
    declared = {+1, -1};
  // Entry o + ppSize - 1: some rank sends with offset o. The mesh, hence
  // ppSize, is the same on every rank, so all of them reduce or none; an
  // offset beyond the axis has no peer (sendTo rejects it) and no channel.
  int64_t ppSize = rt::meshSize(kP2PAxis);
  std::vector<int> offsetWanted;
  if (ppSize > 1) {
    offsetWanted.assign((size_t)(2 * ppSize - 1), 0);
    for (int offset : declared)
      if (std::abs((int64_t)offset) < ppSize)
        offsetWanted[(size_t)(offset + ppSize - 1)] = 1;
    checkMpi(MPI_Allreduce(MPI_IN_PLACE, offsetWanted.data(),
                           (int)offsetWanted.size(), MPI_INT, MPI_MAX,
                           MPI_COMM_WORLD),
             "MPI_Allreduce");
  }

  ncclUniqueId id;
  if (rank == 0)
    checkNcclCall(ncclGetUniqueId(&id), "ncclGetUniqueId");
  checkMpi(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD),
           "MPI_Bcast");
  checkNcclCall(ncclCommInitRank(&s.world, worldSize, id, rank),
                "ncclCommInitRank (world)");
  // A communicator over this rank's group of `axes`.
  auto split = [&](unsigned axes, ncclComm_t *comm, const std::string &what) {
    // The ranks of one group agree on every coordinate outside `axes`.
    int color = (int)rt::meshLayout().groupColor(rank, AxisSet::fromBits(axes));
    std::string call = "ncclCommSplit (" + what + ")";
    checkNcclCall(
        ncclCommSplit(s.world, color, (int)rt::groupRank(axes), comm, nullptr),
        call.c_str());
  };
  for (unsigned axes = 1; axes < kNumAxisSets; axes++)
    if (wanted[axes / 64] & (uint64_t(1) << (axes % 64)))
      split(axes, &s.comms[axes], axesName(axes));
  for (unsigned axes = 1; axes < kNumAxisSets; axes++)
    if (dataParallel(axes) && (wanted[axes / 64] & (uint64_t(1) << (axes % 64))))
      split(axes, &s.background[axes], "background " + axesName(axes));
  check(cudaStreamCreateWithFlags(&s.backgroundStream, cudaStreamNonBlocking),
        "cudaStreamCreateWithFlags (background collectives)");
  // The point-to-point channels, in increasing (offset, parity) order on
  // every rank, including those this rank never uses: each split is
  // collective. A key no pair of coordinates can use is skipped, alike on
  // every rank since it depends on the mesh only.
  auto channelUsed = [&](int offset, int parity) {
    for (int64_t c = 0; c < ppSize; c++)
      if (c + offset >= 0 && c + offset < ppSize &&
          channelParity(c, offset) == parity)
        return true;
    return false;
  };
  for (size_t i = 0; i < offsetWanted.size(); i++) {
    if (!offsetWanted[i])
      continue;
    int offset = (int)((int64_t)i - (ppSize - 1));
    for (int parity = 0; parity < 2; parity++) {
      if (!channelUsed(offset, parity))
        continue;
      // In the list first, so that commStop releases what was created even
      // if a later step fails.
      s.channelIndex[{offset, parity}] = (int)s.channels.size();
      s.channels.emplace_back();
      P2PChannel &channel = s.channels.back();
      channel.offset = offset;
      channel.parity = parity;
      channel.name = std::string(tessel::meshAxisName(kP2PAxis)) +
                     signedOffset(offset) + " channel (parity " +
                     std::to_string(parity) + ")";
      channel.groupName = "send/recv group on the " + channel.name;
      channel.sendsDone = newEvent();
      check(cudaStreamCreateWithFlags(&channel.stream, cudaStreamNonBlocking),
            "cudaStreamCreateWithFlags (point-to-point channel)");
      split(AxisSet(kP2PAxis).bits(), &channel.comm, channel.name);
    }
  }
  s.inFlight.resize(2 + s.channels.size());

  s.stopWatchdog = false;
  s.watchdog = std::thread(watchdogLoop);
}

// Called after the compute and communication streams have been
// synchronised.
void commStop() {
  CommState &s = state();
  if (!s.started)
    return;
  // Sends issued since the last waitSends may still run on the channels;
  // the watchdog still watches them. A failure here is CUDA's sticky error,
  // which the step has reported already.
  for (P2PChannel &channel : s.channels)
    if (channel.stream)
      cudaStreamSynchronize(channel.stream);
  if (s.backgroundStream)
    cudaStreamSynchronize(s.backgroundStream);
  if (s.watchdog.joinable()) {
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      s.stopWatchdog = true;
    }
    s.wake.notify_all();
    s.watchdog.join();
  }
  s.started = false;
  for (unsigned axes = kNumAxisSets; axes-- > 1;) {
    if (s.comms[axes]) {
      ncclCommDestroy(s.comms[axes]);
      s.comms[axes] = nullptr;
    }
    if (s.background[axes]) {
      ncclCommDestroy(s.background[axes]);
      s.background[axes] = nullptr;
    }
  }
  if (s.backgroundStream)
    cudaStreamDestroy(s.backgroundStream);
  s.backgroundStream = nullptr;
  for (P2PChannel &channel : s.channels) {
    if (channel.comm)
      ncclCommDestroy(channel.comm);
    if (channel.stream)
      cudaStreamDestroy(channel.stream);
    if (channel.sendsDone)
      cudaEventDestroy(channel.sendsDone);
  }
  s.channels.clear();
  s.channelIndex.clear();
  if (s.world) {
    ncclCommDestroy(s.world);
    s.world = nullptr;
  }
  // Device buffers: freed (cudaFree ignores null) and forgotten.
  auto release = [](auto *&data) {
    cudaFree(data);
    data = nullptr;
  };
  auto releaseAll = [&](std::vector<void *> &buffers) {
    for (void *&data : buffers)
      release(data);
    buffers.clear();
  };
  release(s.staging);
  releaseAll(s.retiredStaging);
  s.stagingBytes = 0;
  for (SendBuffer &buffer : s.sendBuffers)
    release(buffer.data);
  s.sendBuffers.clear();
  s.nextSendBuffer = 0;
  release(s.sendArena);
  s.sendArenaBytes = s.sendArenaUsed = 0;
  for (RingSlot &slot : s.ring)
    if (slot.sent)
      cudaEventDestroy(slot.sent);
  s.ring.clear();
  release(s.ringArena);
  releaseAll(s.ringBuffers);
  s.ringNext = 0;
  s.groupRingSlots.clear();
  s.queuedSends.clear();
  s.inGroup = false;
  for (std::deque<InFlight> &inFlight : s.inFlight)
    for (const InFlight &f : inFlight)
      cudaEventDestroy(f.done);
  s.inFlight.assign(1, std::deque<InFlight>());
  for (cudaEvent_t event : s.eventPool)
    cudaEventDestroy(event);
  s.eventPool.clear();
  for (cudaEvent_t event : s.requestEvents)
    cudaEventDestroy(event);
  s.requestEvents.clear();
  s.requestInUse.clear();
  s.requestHasWork.clear();
  if (s.computeReady)
    cudaEventDestroy(s.computeReady);
  s.computeReady = nullptr;
  s.failure.clear();
}

void commGraphLaunched(int64_t operations) {
  operationEnqueued(kCommQueue, computeStream(),
                    {InFlight::Graph, "graph", 0, 0, operations, nullptr,
                     Clock::time_point()},
                    /*computeWaits=*/false);
}

// The watchdog's failure message, empty while every collective is fine.
std::string commFailure() {
  CommState &s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.failure;
}

// Between NCCL's rank-major blocks [g, outer, len, inner] and a tensor
// [outer, g * len, inner], on `stream`.
template <typename T>
void blocksToTensor(const T *blocks, T *out, int64_t g, int64_t outer,
                    int64_t len, int64_t inner, cudaStream_t stream) {
  regroup(blocks, out, g, outer, len, inner, /*toBlocks=*/false, stream);
}
template <typename T>
void tensorToBlocks(const T *in, T *blocks, int64_t g, int64_t outer,
                    int64_t len, int64_t inner, cudaStream_t stream) {
  regroup(in, blocks, g, outer, len, inner, /*toBlocks=*/true, stream);
}

} // namespace detail

//===--- Collectives
//-------------------------------------------------------===//

namespace {

template <typename T>
void allReduce(T *buffer, int64_t n, unsigned axes, ncclRedOp_t op,
               const char *what) {
  BackgroundLane lane(axes);
  checkAxes(axes, what);
  checkCount(n, what);
  count(CollectiveKind::AllReduce, n,
        rt::allReduceBytesSent(n, rt::groupSize(axes), sizeof(T)));
  const char *name = rt::collectiveName(CollectiveKind::AllReduce);
  ncclComm_t comm = commFor(axes, name);
  if (!comm || n == 0)
    return;
  blockingCollective(name, axes, n, [&] {
    checkNccl(ncclAllReduce(buffer, buffer, (size_t)n, ncclType<T>(), op, comm,
                            collectiveStream()),
              name, axes, n);
  });
}

} // namespace

template <typename T> void allReduceSum(T *buffer, int64_t n, unsigned axes) {
  allReduce(buffer, n, axes, ncclSum, "allReduceSum");
}

void allReduceMax(float *buffer, int64_t n, unsigned axes) {
  allReduce(buffer, n, axes, ncclMax, "allReduceMax");
}

template <typename T>
void allGatherAlong(const T *in, T *out, int64_t outer, int64_t len,
                    int64_t inner, unsigned axes) {
  BackgroundLane lane(axes);
  checkAxes(axes, "allGatherAlong");
  if (outer < 0 || len < 0 || inner < 0)
    throw std::runtime_error("allGatherAlong of a negative shape");
  int64_t g = rt::groupSize(axes), n = outer * len * inner;
  count(CollectiveKind::AllGather, n, rt::allGatherBytesSent(n, g, sizeof(T)));
  const char *name = rt::collectiveName(CollectiveKind::AllGather);
  ncclComm_t comm = commFor(axes, name);
  if (!comm) {
    copyOnCompute(out, in, n);
    return;
  }
  if (n == 0)
    return;
  T *blocks = outer == 1 ? out : (T *)staging((size_t)(g * n) * sizeof(T));
  blockingCollective(name, axes, n, [&] {
    checkNccl(ncclAllGather(in, blocks, (size_t)n, ncclType<T>(), comm,
                            collectiveStream()),
              name, axes, n);
  });
  if (outer > 1)
    detail::blocksToTensor(blocks, out, g, outer, len, inner, computeStream());
}

template <typename T>
void reduceScatterAlong(const T *in, T *out, int64_t outer, int64_t len,
                        int64_t inner, unsigned axes) {
  BackgroundLane lane(axes);
  checkAxes(axes, "reduceScatterAlong");
  if (outer < 0 || len < 0 || inner < 0)
    throw std::runtime_error("reduceScatterAlong of a negative shape");
  int64_t g = rt::groupSize(axes), n = outer * len * inner;
  count(CollectiveKind::ReduceScatter, g * n,
        rt::reduceScatterBytesSent(n, g, sizeof(T)));
  const char *name = rt::collectiveName(CollectiveKind::ReduceScatter);
  ncclComm_t comm = commFor(axes, name);
  if (!comm) {
    copyOnCompute(out, in, n);
    return;
  }
  if (n == 0)
    return;
  const T *blocks = in;
  if (outer > 1) {
    T *packed = (T *)staging((size_t)(g * n) * sizeof(T));
    detail::tensorToBlocks(in, packed, g, outer, len, inner, computeStream());
    blocks = packed;
  }
  blockingCollective(name, axes, g * n, [&] {
    checkNccl(ncclReduceScatter(blocks, out, (size_t)n, ncclType<T>(), ncclSum,
                                comm, collectiveStream()),
              name, axes, g * n);
  });
}

// The started forms run on the stream of the blocking ones (the
// communication stream, or a data-parallel group's background lane: the
// group's collectives stay in program order there) and leave the
// compute stream's wait to commWait. Their blocks are the caller's (a
// buffer of the memory plan), not the shared staging: a blocking
// collective may use that while these are in flight.
namespace {

// The checks and the count of a started collective along a dimension, as
// its blocking form counts it; its communicator, or null for a group of
// one (whose `out` is then `in`, copied on the compute stream).
template <typename T>
ncclComm_t startAlong(const T *in, T *out, const void *blocks, int64_t outer,
                      int64_t len, int64_t inner, unsigned axes,
                      CollectiveKind kind, const char *what) {
  checkAxes(axes, what);
  if (outer < 0 || len < 0 || inner < 0)
    throw std::runtime_error(std::string(what) + " of a negative shape");
  if (outer > 1 && !blocks)
    throw std::runtime_error(std::string(what) +
                             " along an inner dimension needs its blocks");
  int64_t g = rt::groupSize(axes), n = outer * len * inner;
  if (kind == CollectiveKind::AllGather)
    count(kind, n, rt::allGatherBytesSent(n, g, sizeof(T)));
  else
    count(kind, g * n, rt::reduceScatterBytesSent(n, g, sizeof(T)));
  ncclComm_t comm = commFor(axes, rt::collectiveName(kind));
  if (!comm)
    copyOnCompute(out, in, n);
  return comm;
}

} // namespace

template <typename T>
CommRequest allGatherAlongStart(const T *in, T *out, void *blocks,
                                int64_t outer, int64_t len, int64_t inner,
                                unsigned axes) {
  BackgroundLane lane(axes);
  ncclComm_t comm =
      startAlong(in, out, blocks, outer, len, inner, axes,
                 CollectiveKind::AllGather, "allGatherAlongStart");
  int64_t g = rt::groupSize(axes), n = outer * len * inner;
  const char *name = rt::collectiveName(CollectiveKind::AllGather);
  return startedCollective(name, axes, n, comm && n > 0, [&] {
    T *into = outer == 1 ? out : static_cast<T *>(blocks);
    checkNccl(ncclAllGather(in, into, (size_t)n, ncclType<T>(), comm,
                            collectiveStream()),
              name, axes, n);
    // Laid out on the same stream, inside the request.
    if (outer > 1)
      detail::blocksToTensor(into, out, g, outer, len, inner,
                             collectiveStream());
  });
}

template <typename T>
CommRequest reduceScatterAlongStart(const T *in, T *out, void *blocks,
                                    int64_t outer, int64_t len, int64_t inner,
                                    unsigned axes) {
  BackgroundLane lane(axes);
  ncclComm_t comm =
      startAlong(in, out, blocks, outer, len, inner, axes,
                 CollectiveKind::ReduceScatter, "reduceScatterAlongStart");
  int64_t g = rt::groupSize(axes), n = outer * len * inner;
  const char *name = rt::collectiveName(CollectiveKind::ReduceScatter);
  const T *from = in;
  if (comm && n > 0 && outer > 1) {
    // Packed on the compute stream, which the reduction then follows.
    T *packed = static_cast<T *>(blocks);
    detail::tensorToBlocks(in, packed, g, outer, len, inner, computeStream());
    from = packed;
  }
  return startedCollective(name, axes, g * n, comm && n > 0, [&] {
    checkNccl(ncclReduceScatter(from, out, (size_t)n, ncclType<T>(), ncclSum,
                                comm, collectiveStream()),
              name, axes, g * n);
  });
}

template <typename T>
CommRequest shiftStart(const T *in, T *out, int64_t n, int64_t shift,
                       unsigned axes) {
  BackgroundLane lane(axes);
  checkAxes(axes, "shiftStart");
  checkCount(n, "shiftStart");
  int64_t g = rt::groupSize(axes);
  if (shift < 1 || shift >= std::max<int64_t>(g, 2))
    throw std::runtime_error("shiftStart by " + std::to_string(shift) +
                             " in a group of " + std::to_string(g));
  count(CollectiveKind::SendRecv, n, n * (int64_t)sizeof(T));
  const char *name = rt::collectiveName(CollectiveKind::SendRecv);
  ncclComm_t comm = commFor(axes, name);
  int64_t me = rt::groupRank(axes);
  int to = (int)((me + shift) % g), from = (int)((me - shift + g) % g);
  // On the communication stream, in program order with the group's other
  // collectives: the steps of a gather arrive one after another.
  return startedCollective(name, axes, n, comm && n > 0, [&] {
    checkNccl(ncclGroupStart(), name, axes, n);
    checkNccl(
        ncclSend(in, (size_t)n, ncclType<T>(), to, comm, collectiveStream()),
        name, axes, n);
    checkNccl(
        ncclRecv(out, (size_t)n, ncclType<T>(), from, comm, collectiveStream()),
        name, axes, n);
    checkNccl(ncclGroupEnd(), name, axes, n);
  });
}

template <typename T>
void allToAll(const T *in, T *out, int64_t n, unsigned axes) {
  BackgroundLane lane(axes);
  checkAxes(axes, "allToAll");
  checkCount(n, "allToAll");
  int64_t g = rt::groupSize(axes);
  // Each rank keeps one of its g blocks and sends the others.
  count(CollectiveKind::AllToAll, g * n, (g - 1) * n * (int64_t)sizeof(T));
  const char *name = rt::collectiveName(CollectiveKind::AllToAll);
  ncclComm_t comm = commFor(axes, name);
  if (!comm) {
    copyOnCompute(out, in, n);
    return;
  }
  if (n == 0)
    return;
  int me = (int)rt::groupRank(axes);
  cudaStream_t stream = collectiveStream();
  blockingCollective(name, axes, g * n, [&] {
    check(cudaMemcpyAsync(out + me * n, in + me * n, (size_t)n * sizeof(T),
                          cudaMemcpyDeviceToDevice, stream),
          "cudaMemcpyAsync");
    checkNccl(ncclGroupStart(), name, axes, g * n);
    for (int peer = 0; peer < (int)g; peer++) {
      if (peer == me)
        continue;
      checkNccl(
          ncclSend(in + peer * n, (size_t)n, ncclType<T>(), peer, comm, stream),
          name, axes, g * n);
      checkNccl(ncclRecv(out + peer * n, (size_t)n, ncclType<T>(), peer, comm,
                         stream),
                name, axes, g * n);
    }
    checkNccl(ncclGroupEnd(), name, axes, g * n);
  });
}

template <typename T>
void broadcast(T *buffer, int64_t n, int root, unsigned axes) {
  BackgroundLane lane(axes);
  checkAxes(axes, "broadcast");
  checkCount(n, "broadcast");
  int64_t g = rt::groupSize(axes);
  if (root < 0 || root >= g)
    throw std::runtime_error("broadcast from group rank " +
                             std::to_string(root) + " over " + axesName(axes) +
                             " of " + std::to_string(g) + " ranks");
  // A chain from the root: every rank but the last one forwards the data.
  bool last = rt::groupRank(axes) == (root + g - 1) % g;
  count(CollectiveKind::Broadcast, n,
        g == 1 || last ? 0 : n * (int64_t)sizeof(T));
  const char *name = rt::collectiveName(CollectiveKind::Broadcast);
  ncclComm_t comm = commFor(axes, name);
  if (!comm || n == 0)
    return;
  blockingCollective(name, axes, n, [&] {
    checkNccl(ncclBroadcast(buffer, buffer, (size_t)n, ncclType<T>(), root,
                            comm, collectiveStream()),
              name, axes, n);
  });
}

//===--- Expert parallelism ----------------------------------------------===//

namespace {

__global__ void rowCountsKernel(const int32_t *offsets, int32_t *counts,
                                int64_t E) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < E;
       e += int64_t(blockDim.x) * gridDim.x)
    counts[e] = offsets[e + 1] - offsets[e];
}

__global__ void rowRangesKernel(const int32_t *counts, int32_t *offsets,
                                int64_t E) {
  offsets[0] = 0;
  for (int64_t e = 0; e < E; ++e)
    offsets[e + 1] = offsets[e] + counts[e];
}

// The counts an exchange sends and receives (E each): a fixed device array,
// so that no step allocates. Exchanges run one at a time on the compute
// stream, which waits for each one's counts to arrive, so one array serves
// them all.
constexpr int64_t kMaxExperts = int64_t(1) << 14;
__device__ int32_t gExpertCounts[2 * kMaxExperts];

int32_t *expertCounts(int64_t E, const char *what) {
  if (E > kMaxExperts)
    throw std::runtime_error(std::string(what) + ": " + std::to_string(E) +
                             " experts (the CUDA runtime routes at most " +
                             std::to_string(kMaxExperts) + ")");
  static int32_t *counts = [] {
    void *p = nullptr;
    check(cudaGetSymbolAddress(&p, gExpertCounts), "cudaGetSymbolAddress");
    return static_cast<int32_t *>(p);
  }();
  return counts;
}

// Two row-range arrays [E + 1] copied to the host after the compute
// stream's work so far, which the host waits for: an exchange's message
// sizes (see the top).
std::vector<int32_t> rowRangesOnHost(const int32_t *first,
                                     const int32_t *second, int64_t E) {
  detail::notWhileCapturing("an expert exchange's counts");
  std::vector<int32_t> host((size_t)(2 * (E + 1)));
  const size_t bytes = (size_t)(E + 1) * sizeof(int32_t);
  check(cudaMemcpyAsync(host.data(), first, bytes, cudaMemcpyDeviceToHost,
                        computeStream()),
        "cudaMemcpyAsync");
  check(cudaMemcpyAsync(host.data() + E + 1, second, bytes,
                        cudaMemcpyDeviceToHost, computeStream()),
        "cudaMemcpyAsync");
  check(cudaStreamSynchronize(computeStream()), "cudaStreamSynchronize");
  return host;
}

int64_t expertsPerRank(int64_t E, int64_t g, const char *what) {
  if (E <= 0 || E % g != 0)
    throw std::runtime_error(std::string(what) + ": " + std::to_string(E) +
                             " experts over a group of " + std::to_string(g) +
                             " ranks");
  return E / g;
}

// Where each group rank's rows start and how many there are, from row
// ranges by (rank, expert): rank j's are ranges [j El, (j + 1) El).
struct PeerRows {
  std::vector<int64_t> at, count;
};
PeerRows peerRows(const int32_t *ranges, int64_t g, int64_t El) {
  PeerRows p{std::vector<int64_t>(g), std::vector<int64_t>(g)};
  for (int64_t j = 0; j < g; ++j) {
    p.at[j] = ranges[j * El];
    p.count[j] = ranges[(j + 1) * El] - ranges[j * El];
  }
  return p;
}

// Rows [sendAt[j], sendAt[j] + sendRows[j]) of `send` to group rank j, rows
// from j at recvAt[j] (row counts, on the host): MPI_Alltoallv's layout,
// as grouped NCCL sends and receives; a rank keeps its own block with a
// copy. Counted as the CPU runtime's allToAllV.
template <typename T>
void exchangeRows(const T *send, const std::vector<int64_t> &sendAt,
                  const std::vector<int64_t> &sendRows, T *recv,
                  const std::vector<int64_t> &recvAt,
                  const std::vector<int64_t> &recvRows, int64_t width,
                  unsigned axes) {
  const int64_t g = rt::groupSize(axes), me = rt::groupRank(axes);
  int64_t total = 0, offRank = 0;
  for (int64_t j = 0; j < g; ++j) {
    total += sendRows[j] * width;
    if (j != me)
      offRank += sendRows[j] * width;
  }
  count(CollectiveKind::AllToAll, total, offRank * (int64_t)sizeof(T));
  const char *name = rt::collectiveName(CollectiveKind::AllToAll);
  ncclComm_t comm = commFor(axes, name);
  if (!comm) {
    copyOnCompute(recv + recvAt[0] * width, send + sendAt[0] * width,
                  sendRows[0] * width);
    return;
  }
  cudaStream_t stream = collectiveStream();
  blockingCollective(name, axes, total, [&] {
    if (sendRows[me] > 0)
      check(cudaMemcpyAsync(recv + recvAt[me] * width,
                            send + sendAt[me] * width,
                            (size_t)(sendRows[me] * width) * sizeof(T),
                            cudaMemcpyDeviceToDevice, stream),
            "cudaMemcpyAsync");
    // Both ends skip an empty message: they agree on its size.
    checkNccl(ncclGroupStart(), name, axes, total);
    for (int peer = 0; peer < (int)g; peer++) {
      if (peer == me)
        continue;
      if (sendRows[peer] > 0)
        checkNccl(ncclSend(send + sendAt[peer] * width,
                           (size_t)(sendRows[peer] * width), ncclType<T>(),
                           peer, comm, stream),
                  name, axes, total);
      if (recvRows[peer] > 0)
        checkNccl(ncclRecv(recv + recvAt[peer] * width,
                           (size_t)(recvRows[peer] * width), ncclType<T>(),
                           peer, comm, stream),
                  name, axes, total);
    }
    checkNccl(ncclGroupEnd(), name, axes, total);
  });
}

// Rows [from, rows) of a [rows, width] buffer set to zero (an all-zero
// pattern in float and bf16), on the compute stream.
template <typename T>
void zeroRows(T *buffer, int64_t from, int64_t rows, int64_t width) {
  if (rows > from)
    check(cudaMemsetAsync(buffer + from * width, 0,
                          (size_t)((rows - from) * width) * sizeof(T),
                          computeStream()),
          "cudaMemsetAsync");
}

// The rows of `send` by (rank, expert) range to the ranks, those of the
// ranks into `recv` by theirs (E + 1 host offsets each, rank j's experts
// [j El, (j + 1) El)); recv's rows past the last received are zeroed.
template <typename T>
void exchangeByRanges(const T *send, const int32_t *sendRanges, T *recv,
                      const int32_t *recvRanges, int64_t recvCapacity,
                      int64_t width, int64_t g, int64_t El, unsigned axes,
                      const char *what) {
  const int64_t arriving = recvRanges[g * El];
  if (arriving > recvCapacity)
    throw std::runtime_error(std::string(what) + ": " +
                             std::to_string(arriving) +
                             " rows arrive for a buffer of " +
                             std::to_string(recvCapacity));
  zeroRows(recv, arriving, recvCapacity, width);
  PeerRows to = peerRows(sendRanges, g, El), from = peerRows(recvRanges, g, El);
  exchangeRows(send, to.at, to.count, recv, from.at, from.count, width, axes);
}

} // namespace

template <typename T>
void moeExchange(const T *rows, const int32_t *offsets, T *recv,
                 int32_t *recvOffsets, int64_t E, int64_t H, int64_t recvRows,
                 unsigned axes) {
  checkAxes(axes, "moeExchange");
  checkNotInGroup("moeExchange");
  const int64_t g = rt::groupSize(axes);
  const int64_t El = expertsPerRank(E, g, "moeExchange");
  int32_t *counts = expertCounts(E, "moeExchange"), *got = counts + E;
  rowCountsKernel<<<detail::blocksFor(E), 256, 0, computeStream()>>>(
      offsets, counts, E);
  check(cudaGetLastError(), "rowCountsKernel");
  // The counts first, El to each rank, as the CPU's allToAllInt.
  count(CollectiveKind::AllToAll, El * g, El * (g - 1) * 4);
  const char *name = rt::collectiveName(CollectiveKind::AllToAll);
  ncclComm_t comm = commFor(axes, name);
  if (!comm) {
    copyOnCompute(got, counts, E);
  } else {
    const int me = (int)rt::groupRank(axes);
    cudaStream_t stream = collectiveStream();
    blockingCollective(name, axes, El * g, [&] {
      check(cudaMemcpyAsync(got + me * El, counts + me * El,
                            (size_t)El * sizeof(int32_t),
                            cudaMemcpyDeviceToDevice, stream),
            "cudaMemcpyAsync");
      checkNccl(ncclGroupStart(), name, axes, El * g);
      for (int peer = 0; peer < (int)g; peer++) {
        if (peer == me)
          continue;
        checkNccl(ncclSend(counts + peer * El, (size_t)El, ncclInt32, peer,
                           comm, stream),
                  name, axes, El * g);
        checkNccl(ncclRecv(got + peer * El, (size_t)El, ncclInt32, peer, comm,
                           stream),
                  name, axes, El * g);
      }
      checkNccl(ncclGroupEnd(), name, axes, El * g);
    });
  }
  // Segment j * El + e: source rank j's rows for this rank's expert e.
  rowRangesKernel<<<1, 1, 0, computeStream()>>>(got, recvOffsets, E);
  check(cudaGetLastError(), "rowRangesKernel");
  const std::vector<int32_t> host = rowRangesOnHost(offsets, recvOffsets, E);
  exchangeByRanges(rows, host.data(), recv, host.data() + E + 1, recvRows, H,
                   g, El, axes, "moeExchange");
}

template <typename T>
void moeCombine(const T *recvOut, const int32_t *recvOffsets,
                const int32_t *offsets, T *out, int64_t E, int64_t N,
                int64_t rows, unsigned axes) {
  checkAxes(axes, "moeCombine");
  checkNotInGroup("moeCombine");
  const int64_t g = rt::groupSize(axes);
  const int64_t El = expertsPerRank(E, g, "moeCombine");
  const std::vector<int32_t> host = rowRangesOnHost(recvOffsets, offsets, E);
  exchangeByRanges(recvOut, host.data(), out, host.data() + E + 1, rows, N, g,
                   El, axes, "moeCombine");
}

template <typename T>
CommRequest allReduceSumStart(T *buffer, int64_t n, unsigned axes) {
  BackgroundLane lane(axes);
  checkAxes(axes, "allReduceSumStart");
  checkCount(n, "allReduceSumStart");
  count(CollectiveKind::AllReduce, n,
        rt::allReduceBytesSent(n, rt::groupSize(axes), sizeof(T)));
  const char *name = rt::collectiveName(CollectiveKind::AllReduce);
  ncclComm_t comm = commFor(axes, name);
  return startedCollective(name, axes, n, comm && n > 0, [&] {
    checkNccl(ncclAllReduce(buffer, buffer, (size_t)n, ncclType<T>(), ncclSum,
                            comm, collectiveStream()),
              name, axes, n);
  });
}

namespace {

// Enqueues one NCCL group with an operation per root of the group `axes`:
// call(at, elements, root) for each nonempty piece [at, at + elements) of an
// n-element run, root k's piece being piece k (see the top).
template <typename Call>
void perPiece(int64_t n, unsigned axes, const char *name, Call call) {
  int64_t g = rt::groupSize(axes), c = detail::pieceSize(n, g);
  checkNccl(ncclGroupStart(), name, axes, n);
  for (int64_t root = 0; root < g; root++) {
    detail::PieceRange piece = detail::inPiece(0, n, c, root);
    if (piece.size() > 0)
      checkNccl(call(piece.begin, (size_t)piece.size(), (int)root), name, axes,
                n);
  }
  checkNccl(ncclGroupEnd(), name, axes, n);
}

// Checks and counts a reduce-scatter of shards; its communicator.
ncclComm_t reduceScatterShardsComm(int64_t n, unsigned axes,
                                   const char *name) {
  checkAxes(axes, "reduceScatterShards");
  checkCount(n, "reduceScatterShards");
  int64_t g = rt::groupSize(axes);
  count(CollectiveKind::ReduceScatter, n,
        rt::reduceScatterBytesSent(detail::pieceSize(n, g), g));
  return commFor(axes, name);
}

// Hybrid sharding: after the pieces are reduced within the shard group,
// this rank's piece (at `piece`, `n` the run's elements over the group of
// `axes`) is summed over the replicas of the group, on the same stream.
// Counted as an all-reduce of a whole piece, as the plan counts it.
struct ReplicaSum {
  unsigned replicas = 0;
  ncclComm_t comm = nullptr;
  detail::PieceRange own{0, 0};

  ReplicaSum(unsigned replicas, int64_t n, unsigned axes) : replicas(replicas) {
    if (!replicas)
      return;
    checkAxes(replicas, "reduceScatterShards");
    int64_t g = rt::groupSize(axes), c = detail::pieceSize(n, g);
    own = detail::inPiece(0, n, c, rt::groupRank(axes));
    count(CollectiveKind::AllReduce, c,
          rt::allReduceBytesSent(c, rt::groupSize(replicas)));
    comm = commFor(replicas,
                   rt::collectiveName(CollectiveKind::AllReduce));
  }
  // Enqueues the sum of the piece that starts at `piece`.
  void enqueue(float *piece, const char *name, unsigned axes, int64_t n) {
    if (comm && own.size() > 0)
      checkNccl(ncclAllReduce(piece, piece, (size_t)own.size(), ncclFloat32,
                              ncclSum, comm, collectiveStream()),
                name, replicas, n);
  }
};

} // namespace

CommRequest reduceScatterShardsStart(float *buffer, int64_t n, unsigned axes) {
  BackgroundLane lane(axes);
  unsigned replicas = axes & tessel::kDpReplicaBit;
  axes &= ~tessel::kDpReplicaBit;
  const char *name = rt::collectiveName(CollectiveKind::ReduceScatter);
  ncclComm_t comm = reduceScatterShardsComm(n, axes, name);
  ReplicaSum sum(replicas, n, axes);
  return startedCollective(name, axes, n, (comm || sum.comm) && n > 0, [&] {
    if (comm)
      perPiece(n, axes, name, [&](int64_t at, size_t elements, int root) {
        return ncclReduce(buffer + at, buffer + at, elements, ncclFloat32,
                          ncclSum, root, comm, collectiveStream());
      });
    sum.enqueue(buffer + sum.own.begin, name, axes, n);
  });
}

// The started form waited for at once (as on the CPU): the compute stream
// waits for the pieces before its next kernel. With `out` (ZeRO-2), root
// k's reduce writes piece k to its `out` (the others' `out` is unused).
void reduceScatterShards(float *buffer, float *out, int64_t n, unsigned axes) {
  if (!out) {
    commWait(reduceScatterShardsStart(buffer, n, axes));
    return;
  }
  commWait(reduceScatterPieceStart(buffer, out, n, axes));
}

// Started (ZeRO-2's reduction in flight): the comm stream reads `buffer`
// after the compute stream's work so far; commWait makes the compute stream
// wait before `out` is read or `buffer` written again.
CommRequest reduceScatterPieceStart(const float *buffer, float *out, int64_t n,
                                    unsigned axes) {
  BackgroundLane lane(axes);
  unsigned replicas = axes & tessel::kDpReplicaBit;
  axes &= ~tessel::kDpReplicaBit;
  const char *name = rt::collectiveName(CollectiveKind::ReduceScatter);
  ncclComm_t comm = reduceScatterShardsComm(n, axes, name);
  ReplicaSum sum(replicas, n, axes);
  if (!comm)
    copyOnCompute(out, buffer, n);
  return startedCollective(name, axes, n, (comm || sum.comm) && n > 0, [&] {
    if (comm)
      perPiece(n, axes, name, [&](int64_t at, size_t elements, int root) {
        return ncclReduce(buffer + at, out, elements, ncclFloat32, ncclSum,
                          root, comm, collectiveStream());
      });
    sum.enqueue(out, name, axes, n);
  });
}

// The started form waited for at once, as reduceScatterShards.
void allGatherShards(float *buffer, const float *from, bf16 *shadow, int64_t n,
                     unsigned axes) {
  commWait(allGatherShardsStart(buffer, from, shadow, n, axes));
}

// With `from` (ZeRO-3) this rank's piece is first copied into its place;
// without it (ZeRO-1's update) the piece is in place already.
CommRequest allGatherShardsStart(float *buffer, const float *from,
                                 bf16 *shadow, int64_t n, unsigned axes) {
  BackgroundLane lane(axes);
  checkAxes(axes, "allGatherShards");
  checkCount(n, "allGatherShards");
  int64_t g = rt::groupSize(axes), c = detail::pieceSize(n, g);
  count(CollectiveKind::AllGather, c, rt::allGatherBytesSent(c, g));
  // On the compute stream, which the gather follows (and whose later
  // writes to `from` come after it).
  detail::PieceRange own = detail::inPiece(0, n, c, rt::groupRank(axes));
  if (from && own.size() > 0)
    copyOnCompute(buffer + own.begin, from, own.size());
  const char *name = rt::collectiveName(CollectiveKind::AllGather);
  ncclComm_t comm = commFor(axes, name);
  if (!comm || n <= 0) {
    // A group of one: the piece is the run; the copy follows on compute.
    if (shadow)
      copy(buffer, shadow, n);
    return startedCollective(name, axes, n, false, [] {});
  }
  return startedCollective(name, axes, n, true, [&] {
    perPiece(n, axes, name, [&](int64_t at, size_t elements, int root) {
      return ncclBroadcast(buffer + at, buffer + at, elements, ncclFloat32,
                           root, comm, collectiveStream());
    });
    // After the broadcasts on the same stream, inside the request.
    if (shadow)
      detail::toBf16On(collectiveStream(), buffer, shadow, n);
  });
}

void allGatherShards(bf16 *buffer, const float *from, bf16 *shadow, int64_t n,
                     unsigned axes) {
  commWait(allGatherShardsStart(buffer, from, shadow, n, axes));
}

CommRequest allGatherShardsStart(bf16 *buffer, const float *from, bf16 *shadow,
                                 int64_t n, unsigned axes) {
  BackgroundLane lane(axes);
  checkAxes(axes, "allGatherShards (bf16)");
  checkCount(n, "allGatherShards (bf16)");
  if (shadow)
    throw std::runtime_error(
        "allGatherShards of a bf16 copy takes no second copy");
  int64_t g = rt::groupSize(axes), c = detail::pieceSize(n, g);
  count(CollectiveKind::AllGather, c, rt::allGatherBytesSent(c, g, 2));
  // Rounded in on the compute stream, which the gather follows (and whose
  // later writes to `from`, the next update, come after it).
  detail::PieceRange own = detail::inPiece(0, n, c, rt::groupRank(axes));
  if (from && own.size() > 0)
    detail::toBf16On(computeStream(), from, buffer + own.begin, own.size());
  const char *name = rt::collectiveName(CollectiveKind::AllGather);
  ncclComm_t comm = commFor(axes, name);
  if (!comm || n <= 0)
    return startedCollective(name, axes, n, false, [] {});
  return startedCollective(name, axes, n, true, [&] {
    perPiece(n, axes, name, [&](int64_t at, size_t elements, int root) {
      return ncclBroadcast(buffer + at, buffer + at, elements, ncclBfloat16,
                           root, comm, collectiveStream());
    });
  });
}

void commWait(CommRequest request) {
  CommState &s = state();
  if (request < 0 || (size_t)request >= s.requestInUse.size() ||
      !s.requestInUse[request])
    throw std::runtime_error("commWait on an unknown or finished request " +
                             std::to_string(request));
  if (s.requestHasWork[request])
    check(cudaStreamWaitEvent(computeStream(), s.requestEvents[request], 0),
          "cudaStreamWaitEvent");
  s.requestInUse[request] = false;
}

//===--- Point-to-point
//----------------------------------------------------===//

void flushSends() {
  CommState &s = state();
  if (s.queuedSends.empty())
    return;
  // Each peer receives in the order of `order`: issue, per peer, the queued
  // sends that come next, so that NCCL's in-order matching pairs every send
  // with its receive. The others wait for the messages before them. (A
  // peer is reached through one channel only: its offset and this rank's
  // coordinate fix the key.)
  std::stable_sort(s.queuedSends.begin(), s.queuedSends.end(),
                   [](const QueuedSend &a, const QueuedSend &b) {
                     return std::make_tuple(a.channel, a.peer, a.order) <
                            std::make_tuple(b.channel, b.peer, b.order);
                   });
  std::vector<QueuedSend> ready, waiting;
  for (const QueuedSend &send : s.queuedSends) {
    int64_t &next = s.nextOrder[{send.channel, send.peer}];
    if (send.order == next) {
      ready.push_back(send);
      ++next;
    } else {
      waiting.push_back(send);
    }
  }
  s.queuedSends = std::move(waiting);
  if (ready.empty())
    return;
  // The sends read the copies sendTo enqueued on the compute stream.
  check(cudaEventRecord(s.computeReady, computeStream()), "cudaEventRecord");
  std::vector<bool> waited(s.channels.size(), false);
  unsigned axes = AxisSet(kP2PAxis).bits();
  for (const QueuedSend &send : ready) {
    P2PChannel &channel = s.channels[send.channel];
    if (!waited[send.channel]) {
      check(cudaStreamWaitEvent(channel.stream, s.computeReady, 0),
            "cudaStreamWaitEvent");
      waited[send.channel] = true;
    }
    checkNccl(ncclSend(send.data, send.count, send.type, send.peer,
                       channel.comm, channel.stream),
              "send", axes, (int64_t)send.count);
    p2pEnqueued(send.channel, /*isRecv=*/false, send.offset,
                (int64_t)send.count);
    // A ring slot is free again once this send has completed: an event
    // after it on its channel (inside a group, after the group's end).
    if (send.ringSlot >= 0) {
      if (s.inGroup) {
        s.groupRingSlots.push_back({send.ringSlot, send.channel});
      } else {
        RingSlot &slot = s.ring[send.ringSlot];
        check(cudaEventRecord(slot.sent, channel.stream), "cudaEventRecord");
        slot.issued = true;
      }
    }
  }
}

void beginP2P() {
  CommState &s = state();
  if (s.inGroup)
    throw std::runtime_error("beginP2P() inside another beginP2P() group");
  checkNcclCall(ncclGroupStart(), "ncclGroupStart (beginP2P)");
  s.inGroup = true;
  for (P2PChannel &channel : s.channels) {
    channel.groupUsed = false;
    channel.groupHasRecv = false;
    channel.groupElements = 0;
  }
}

void endP2P() {
  CommState &s = state();
  if (!s.inGroup)
    throw std::runtime_error("endP2P() without beginP2P()");
  // Sends still queued travel with the group.
  flushSends();
  s.inGroup = false;
  int64_t elements = 0;
  for (const P2PChannel &channel : s.channels)
    elements += channel.groupElements;
  // NCCL enqueues the group's work here, on every channel it used (a group
  // may span communicators and streams), so completions are recorded after
  // this call, once per channel.
  checkNccl(ncclGroupEnd(), rt::collectiveName(CollectiveKind::SendRecv),
            AxisSet(kP2PAxis).bits(), elements);
  for (size_t c = 0; c < s.channels.size(); c++) {
    P2PChannel &channel = s.channels[c];
    if (!channel.groupUsed)
      continue;
    operationEnqueued(queueOf((int)c), channel.stream,
                      {InFlight::Group, channel.groupName.c_str(),
                       AxisSet(kP2PAxis).bits(), 0, channel.groupElements,
                       nullptr, Clock::time_point()},
                      /*computeWaits=*/channel.groupHasRecv);
  }
  for (auto [index, channel] : s.groupRingSlots) {
    RingSlot &slot = s.ring[index];
    check(cudaEventRecord(slot.sent, s.channels[channel].stream),
          "cudaEventRecord");
    slot.issued = true;
  }
  s.groupRingSlots.clear();
}

template <typename T>
void sendTo(const T *buffer, int64_t n, MeshAxis axis, int offset,
            int64_t order, int64_t ringSlots) {
  int peer = p2pPeer(n, axis, offset, "sendTo");
  count(CollectiveKind::SendRecv, n, n * (int64_t)sizeof(T));
  int channel = channelFor(offset, /*isRecv=*/false, "sendTo");
  // The caller's buffer lives in an arena that later kernels reuse right
  // away (as on the CPU): send from a copy, in the ring's next slot or in a
  // buffer that lives until waitSends().
  T *copy = nullptr;
  int slot = -1;
  if (ringSlots > 0) {
    auto [data, index] = nextRingSlot(ringSlots, (size_t)n * sizeof(T));
    copy = (T *)data;
    slot = index;
  } else {
    copy = (T *)nextSendBuffer((size_t)n * sizeof(T));
  }
  copyOnCompute(copy, buffer, n);
  state().queuedSends.push_back(
      {order, copy, (size_t)n, ncclType<T>(), peer, offset, channel, slot});
}

template <typename T>
void recvFrom(T *buffer, int64_t n, MeshAxis axis, int offset) {
  int peer = p2pPeer(n, axis, offset, "recvFrom");
  int channel = channelFor(offset, /*isRecv=*/true, "recvFrom");
  P2PChannel &c = state().channels[channel];
  // The receive overwrites `buffer`: after every kernel enqueued so far.
  afterCompute(c.stream);
  checkNccl(ncclRecv(buffer, (size_t)n, ncclType<T>(), peer, c.comm, c.stream),
            "recv", AxisSet(kP2PAxis).bits(), n);
  p2pEnqueued(channel, /*isRecv=*/true, offset, n);
}

void waitSends() {
  CommState &s = state();
  checkNotInGroup("waitSends()");
  flushSends();
  if (!s.queuedSends.empty()) {
    const QueuedSend &send = s.queuedSends.front();
    throw std::runtime_error(
        "rank " + std::to_string(rt::commRank()) + ": " +
        std::to_string(s.queuedSends.size()) +
        " pipeline sends were never issued (the next to pp" +
        (send.offset > 0 ? "+" : "") + std::to_string(send.offset) +
        " has order " + std::to_string(send.order) + ", expected " +
        std::to_string(s.nextOrder[{send.channel, send.peer}]) +
        "): the program's send orders do not match its schedule");
  }
  s.nextOrder.clear();
  s.nextSendBuffer = 0;
  s.sendArenaUsed = 0;
  // The compute stream waits for every send below: the ring starts over.
  s.ringNext = 0;
  for (RingSlot &slot : s.ring)
    slot.held = slot.issued = false;
  for (P2PChannel &channel : s.channels) {
    if (!channel.sendsPending)
      continue;
    // A channel's stream runs in order: an event recorded now follows every
    // send issued on it so far. The compute stream's next copies into the
    // send buffers then wait for them.
    check(cudaEventRecord(channel.sendsDone, channel.stream),
          "cudaEventRecord");
    check(cudaStreamWaitEvent(computeStream(), channel.sendsDone, 0),
          "cudaStreamWaitEvent");
    channel.sendsPending = false;
  }
}

//===--- Instantiations
//----------------------------------------------------===//

#define TESSEL_CUDA_COMM_INSTANTIATE(T)                                        \
  template void allReduceSum<T>(T *, int64_t, unsigned);                       \
  template void allGatherAlong<T>(const T *, T *, int64_t, int64_t, int64_t,   \
                                  unsigned);                                   \
  template void reduceScatterAlong<T>(const T *, T *, int64_t, int64_t,        \
                                      int64_t, unsigned);                      \
  template void allToAll<T>(const T *, T *, int64_t, unsigned);                \
  template void broadcast<T>(T *, int64_t, int, unsigned);                     \
  template CommRequest allReduceSumStart<T>(T *, int64_t, unsigned);           \
  template CommRequest allGatherAlongStart<T>(const T *, T *, void *, int64_t, \
                                              int64_t, int64_t, unsigned);     \
  template CommRequest reduceScatterAlongStart<T>(                             \
      const T *, T *, void *, int64_t, int64_t, int64_t, unsigned);            \
  template CommRequest shiftStart<T>(const T *, T *, int64_t, int64_t,         \
                                     unsigned);                                \
  template void sendTo<T>(const T *, int64_t, MeshAxis, int, int64_t,          \
                          int64_t);                                            \
  template void recvFrom<T>(T *, int64_t, MeshAxis, int);                      \
  template void detail::blocksToTensor<T>(const T *, T *, int64_t, int64_t,    \
                                          int64_t, int64_t, cudaStream_t);     \
  template void detail::tensorToBlocks<T>(const T *, T *, int64_t, int64_t,    \
                                          int64_t, int64_t, cudaStream_t);
TESSEL_CUDA_COMM_INSTANTIATE(float)
TESSEL_CUDA_COMM_INSTANTIATE(bf16)
TESSEL_CUDA_COMM_INSTANTIATE(double)
#undef TESSEL_CUDA_COMM_INSTANTIATE

#define TESSEL_CUDA_MOE_INSTANTIATE(T)                                         \
  template void moeExchange<T>(const T *, const int32_t *, T *, int32_t *,     \
                               int64_t, int64_t, int64_t, unsigned);           \
  template void moeCombine<T>(const T *, const int32_t *, const int32_t *,     \
                              T *, int64_t, int64_t, int64_t, unsigned);
TESSEL_CUDA_MOE_INSTANTIATE(float)
TESSEL_CUDA_MOE_INSTANTIATE(bf16)
#undef TESSEL_CUDA_MOE_INSTANTIATE

} // namespace tessel::cuda
