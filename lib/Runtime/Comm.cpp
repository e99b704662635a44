//===- Comm.cpp - Collectives over mesh axes with MPI ---------------------===//
//
// (Long by design: every collective the generated code calls, with its
// counting and the watchdog's bookkeeping, in one place over one MPI
// state.)
//
// One communicator is built per distinct group of ranks: an axis set is first
// reduced to its axes of size > 1 (dp|pp with pp = 1 is the dp group), and a
// set whose axes all have size 1 needs no communicator at all, since the
// group is this rank alone. The communicators are created in increasing mask
// order on every rank, as MPI_Comm_split is collective.
//
// Groups of size 1 (and every group of a one-rank mesh, which never starts
// MPI) turn each collective into a copy, but the call is still counted.
//
// Watchdog. Every wait (a collective, a pipeline receive, the sends of a
// step, a started all-reduce) is marked with what it waits for; a thread
// checks the mark and, when one wait lasts longer than the limit, prints
// one line naming the rank, the wait and the step and ends the process
// without calling into MPI (mpirun then stops every rank). Pipeline waits
// poll and sleep instead of spinning in MPI, so that a rank waiting out a
// bubble leaves the core to the ranks that compute.
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Comm.h"
#include "tessel/Runtime/CommVolume.h"
#include "tessel/Runtime/Kernels.h"
#include "tessel/Runtime/Pieces.h"
#include "tessel/Runtime/Trace.h"

// Only the C API: keep mpi.h from pulling in the deprecated C++ bindings.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

namespace tessel::rt {

namespace {

constexpr unsigned kNumAxisSets = 1u << kNumAxisBits;
constexpr unsigned kAllAxes = kNumAxisSets - 1;

struct CommState {
  bool initialized = false;
  bool startedMpi = false; // MPI_Init was called by commInit
  int rank = 0;
  int worldSize = 1;
  MeshLayout layout;
  MeshCoords coord;
  MPI_Comm comms[kNumAxisSets];
  CollectiveCounter counters[kNumCollectiveKinds];
  int uncounted = 0; // UncountedCollectives alive
  std::vector<MPI_Request> requests; // indexed by CommRequest
  std::vector<bool> requestInUse;
  // A started collective of shards: its counts and offsets (kept while MPI
  // works), where a reduce-scatter's piece goes when the request is waited
  // for, and, for a traced started gather or reduction, when it started,
  // what it moves and what waiting for it is called.
  struct PieceCopy {
    std::vector<int> counts, offsets;
    const float *from = nullptr;
    float *to = nullptr;
    int size = 0;
    const char *traced = nullptr;
    double tracedSince = 0;
    int64_t tracedBytes = 0;
    unsigned tracedAxes = 0;
    // Hybrid sharding: the replicas the placed piece is then summed over,
    // and the piece size it is counted as.
    unsigned replicas = 0;
    int64_t pieceElems = 0;
    const char *waited = nullptr;
    // A gather along an inner dimension: the ranks' pieces in `blocks`,
    // laid out in `gathered` (g pieces of outer x len x inner) at the wait.
    const float *blocks = nullptr;
    float *gathered = nullptr;
    int64_t groups = 0, outer = 0, len = 0, inner = 0;
    // A shift's send (its receive is the slot's request).
    MPI_Request send = MPI_REQUEST_NULL;
  };
  std::vector<PieceCopy> pieceCopies; // indexed by CommRequest
  std::vector<MPI_Request> sends; // started by sendTo, ended by waitSends
  // What each pending send transmits (the caller may reuse its buffer).
  std::vector<std::vector<float>> sendCopies;
  // The send ring (sendTo with ringSlots): each slot's copy and its send,
  // and the ring sends made since waitSends.
  std::vector<std::vector<float>> ringCopies;
  std::vector<MPI_Request> ringSends;
  int64_t ringNext = 0;
  // The other sends' copies, taken in turn from an arena reserved at start
  // (commReserveSends) and reused after waitSends; its used bytes.
  std::vector<float> sendArena;
  size_t sendArenaUsed = 0;
};

CommState &state() {
  static CommState s;
  return s;
}

//===--- Watchdog

struct Watchdog {
  double seconds = 0; // 0: off
  // When the running wait began (steady clock, ns), 0 when none runs, and
  // what it waits for (written before `since` is set).
  std::atomic<int64_t> since{0};
  char what[256] = {};
  std::atomic<int64_t> step{-1};
  std::atomic<bool> stop{false};
  std::thread thread;
};

// Never destroyed: the thread may outlive the statics' destruction order.
Watchdog &watchdog() {
  static Watchdog *w = new Watchdog;
  return *w;
}

int64_t steadyNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Marks one wait for the watchdog, for as long as it lives.
class Waiting {
public:
  template <typename... Args> Waiting(const char *format, Args... args) {
    Watchdog &w = watchdog();
    if (w.seconds <= 0)
      return;
    std::snprintf(w.what, sizeof(w.what), format, args...);
    w.since.store(steadyNanos(), std::memory_order_release);
  }
  ~Waiting() { watchdog().since.store(0, std::memory_order_release); }
  Waiting(const Waiting &) = delete;
  Waiting &operator=(const Waiting &) = delete;
};

// A blocking collective's span on the trace's program track, with its
// group and bytes, for as long as it lives.
class Traced {
public:
  Traced(const char *name, unsigned axes, int64_t bytes)
      : name(traceEnabled() ? name : nullptr), axes(axes), bytes(bytes),
        start(this->name ? traceNowMicros() : 0) {}
  ~Traced() {
    if (name)
      traceRecordCollective(name, start, bytes, AxisSet::fromBits(axes).str(),
                            /*track=*/0);
  }
  Traced(const Traced &) = delete;
  Traced &operator=(const Traced &) = delete;

private:
  const char *name;
  unsigned axes;
  int64_t bytes;
  double start;
};

void watchdogLoop() {
  Watchdog &w = watchdog();
  auto period = std::chrono::milliseconds(
      std::clamp<int64_t>((int64_t)(w.seconds * 100), 10, 1000));
  while (!w.stop.load()) {
    std::this_thread::sleep_for(period);
    int64_t since = w.since.load(std::memory_order_acquire);
    if (!since)
      continue;
    double waited = (steadyNanos() - since) * 1e-9;
    if (waited <= w.seconds)
      continue;
    const CommState &s = state();
    char host[256] = "unknown host";
    ::gethostname(host, sizeof(host) - 1);
    host[sizeof(host) - 1] = 0;
    std::string coords;
    for (MeshAxis axis : kMeshAxes)
      if (s.layout.size(axis) > 1)
        coords += std::string(", ") + meshAxisName(axis) + " " +
                  std::to_string(s.coord[axis]);
    std::fflush(stdout);
    std::fprintf(stderr,
                 "rank %d: error: waited %.0f s for %s in step %lld: a rank "
                 "is stopped, hung or dead (the limit is --timeout %g s, or "
                 "TESSEL_TIMEOUT); ending the job\n  (on %s, pid %d%s)\n",
                 s.rank, waited, w.what, (long long)w.step.load() + 1,
                 w.seconds, host, (int)::getpid(), coords.c_str());
    std::fflush(stderr);
    // Not MPI_Abort: MPI runs single-threaded and the main thread is inside
    // it. A rank that ends without MPI_Finalize makes mpirun stop the job.
    ::_exit(1);
  }
}


// `axes` restricted to the axes of size > 1: equal masks mean equal groups.
unsigned effectiveAxes(unsigned axes) {
  return state().layout.shape().effective(AxisSet::fromBits(axes)).bits();
}

void checkAxes(unsigned axes, const char *what) {
  if (!state().initialized)
    throw std::runtime_error(std::string(what) +
                             " called before the communicator was set up");
  if (axes == 0 || (axes & ~kAllAxes))
    throw std::runtime_error(std::string(what) + " called with invalid axes " +
                             std::to_string(axes));
}

void checkCount(int64_t n, int64_t groupSize, const char *what) {
  if (n < 0 || n * groupSize > INT_MAX)
    throw std::runtime_error(std::string(what) + " of " + std::to_string(n) +
                             " elements per rank over " +
                             std::to_string(groupSize) +
                             " ranks is outside the supported range");
}

void count(CollectiveKind kind, int64_t elements, int64_t bytesSent) {
  if (state().uncounted)
    return;
  CollectiveCounter &c = state().counters[(int)kind];
  c.calls += 1;
  c.elements += elements;
  c.bytesSent += bytesSent;
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

// Waits for `requests` to complete: polls, and once the wait has lasted
// 2 ms (a pipeline bubble, a slow peer) sleeps between polls, up to 1 ms,
// so a waiting rank does not spin.
void waitAll(MPI_Request *requests, int n, const char *what,
             MPI_Status *statuses = MPI_STATUSES_IGNORE) {
  int done = 0;
  int64_t start = steadyNanos(), pause = 0;
  while (true) {
    checkMpi(MPI_Testall(n, requests, &done, statuses), what);
    if (done)
      return;
    if (!pause && steadyNanos() - start > 2000000)
      pause = 20;
    if (pause) {
      std::this_thread::sleep_for(std::chrono::microseconds(pause));
      pause = std::min<int64_t>(pause * 2, 1000);
    }
  }
}

} // namespace

const char *collectiveName(CollectiveKind kind) {
  switch (kind) {
  case CollectiveKind::AllReduce:
    return "all_reduce";
  case CollectiveKind::AllGather:
    return "all_gather";
  case CollectiveKind::ReduceScatter:
    return "reduce_scatter";
  case CollectiveKind::AllToAll:
    return "all_to_all";
  case CollectiveKind::Broadcast:
    return "broadcast";
  case CollectiveKind::SendRecv:
    return "send_recv";
  }
  return "?";
}

void commInit(int *argc, char ***argv, const MeshShape &meshShape) {
  CommState &s = state();
  if (s.initialized)
    throw std::runtime_error("the communicator is already set up");
  int64_t ranks = 1;
  for (MeshAxis axis : kMeshAxes) {
    if (meshShape[axis] < 1 || meshShape[axis] > INT_MAX)
      throw std::runtime_error("the program has an invalid mesh size " +
                               std::to_string(meshShape[axis]) + " for " +
                               meshAxisName(axis));
    ranks *= meshShape[axis];
    if (ranks > INT_MAX)
      throw std::runtime_error("the program's mesh has too many ranks");
  }
  s.layout = MeshLayout(meshShape);
  for (unsigned axes = 0; axes < kNumAxisSets; axes++)
    s.comms[axes] = MPI_COMM_NULL;

  std::string mesh = meshShape.describe();
  std::string launch = ranks == 1
                           ? "run it directly, without mpirun"
                           : "launch it with 'tessel run DIR' or 'mpirun -np " +
                                 std::to_string(ranks) + " ...'";

  if (ranks == 1) {
    // A one-rank program under `mpirun -np N` would train N identical
    // copies that overwrite each other's outputs.
    if (const char *size = std::getenv("OMPI_COMM_WORLD_SIZE"))
      if (std::strcmp(size, "1") != 0)
        throw std::runtime_error(
            "this program was compiled for 1 rank but was launched with " +
            std::string(size) + "; " + launch);
    s.initialized = true;
    return;
  }

  int alreadyStarted = 0;
  MPI_Initialized(&alreadyStarted);
  if (!alreadyStarted) {
    checkMpi(MPI_Init(argc, argv), "MPI_Init");
    s.startedMpi = true;
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &s.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &s.worldSize);
  s.initialized = true;
  if (s.worldSize != ranks) {
    // Every rank sees the same mismatch, so all can leave MPI cleanly and
    // commAbort then just exits, without MPI_Abort's banner.
    if (s.startedMpi)
      MPI_Finalize();
    s.initialized = false;
    throw std::runtime_error("this program was compiled for " +
                             std::to_string(ranks) + " ranks (" + mesh +
                             ") but was launched with " +
                             std::to_string(s.worldSize) + "; " + launch);
  }

  s.coord = s.layout.coordsOf(s.rank);

  // The group of `axes` is the ranks that agree on every other coordinate:
  // color them by those coordinates and order them by the layout's group
  // order (MeshLayout::groupRank, which parallel.order does not change).
  for (unsigned axes = 1; axes < kNumAxisSets; axes++) {
    if (effectiveAxes(axes) != axes)
      continue;
    AxisSet set = AxisSet::fromBits(axes);
    int color = (int)s.layout.groupColor(s.rank, set);
    int key = (int)s.layout.groupRank(s.rank, set);
    checkMpi(MPI_Comm_split(MPI_COMM_WORLD, color, key, &s.comms[axes]),
             "MPI_Comm_split");
  }
}

void commStartWatchdog(double seconds) {
  Watchdog &w = watchdog();
  if (state().worldSize <= 1 || seconds <= 0 || w.thread.joinable())
    return;
  w.seconds = seconds;
  w.stop = false;
  w.thread = std::thread(watchdogLoop);
}

void commSetStep(int64_t step) { watchdog().step.store(step); }

bool collectivesCounted() { return state().uncounted == 0; }

UncountedCollectives::UncountedCollectives() { ++state().uncounted; }
UncountedCollectives::~UncountedCollectives() { --state().uncounted; }

void commFinalize() {
  Watchdog &w = watchdog();
  if (w.thread.joinable()) {
    w.stop = true;
    w.thread.join();
    w.seconds = 0;
  }
  CommState &s = state();
  if (!s.initialized)
    return;
  for (unsigned axes = 0; axes < kNumAxisSets; axes++)
    if (s.comms[axes] != MPI_COMM_NULL)
      MPI_Comm_free(&s.comms[axes]);
  if (s.startedMpi) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized)
      MPI_Finalize();
  }
  s.initialized = false;
  s.startedMpi = false;
}

void commAbort(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  int started = 0, finalized = 0;
  MPI_Initialized(&started);
  MPI_Finalized(&finalized);
  if (started && !finalized)
    MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);
}

int commRank() { return state().rank; }
int commWorldSize() { return state().worldSize; }

const MeshLayout &meshLayout() { return state().layout; }
int64_t meshCoord(MeshAxis axis) { return state().coord[axis]; }
int64_t meshSize(MeshAxis axis) { return state().layout.size(axis); }

int64_t groupSize(unsigned axes) {
  return state().layout.shape().groupSize(AxisSet::fromBits(axes));
}

int64_t groupRank(unsigned axes) {
  return state().layout.groupRank(state().rank, AxisSet::fromBits(axes));
}

// Every blocking all-reduce: counted, then reduced in place in int-sized
// chunks (MPI counts are int; an element-wise reduction splits freely).
static void allReduceInPlace(void *buffer, int64_t n, MPI_Datatype type,
                             int64_t elementBytes, MPI_Op op, unsigned axes,
                             const char *what) {
  checkAxes(axes, what);
  int64_t g = groupSize(axes);
  if (n < 0)
    throw std::runtime_error(std::string(what) +
                             " of a negative element count");
  count(CollectiveKind::AllReduce, n, allReduceBytesSent(n, g, elementBytes));
  if (g == 1)
    return;
  MPI_Comm comm = state().comms[effectiveAxes(axes)];
  Traced traced("all_reduce", axes, allReduceBytesSent(n, g, elementBytes));
  Waiting waiting("%s over %s (group of %lld, %lld elements)", what,
                  AxisSet::fromBits(axes).str().c_str(), (long long)g,
                  (long long)n);
  for (int64_t begin = 0; begin < n; begin += INT_MAX) {
    int chunk = (int)std::min<int64_t>(n - begin, INT_MAX);
    checkMpi(MPI_Allreduce(MPI_IN_PLACE, (char *)buffer + begin * elementBytes,
                           chunk, type, op, comm),
             "MPI_Allreduce");
  }
}

void allReduceSum(float *buffer, int64_t n, unsigned axes) {
  allReduceInPlace(buffer, n, MPI_FLOAT, 4, MPI_SUM, axes, "allReduceSum");
}

void allToAllV(const float *send, const int64_t *sendCounts,
               const int64_t *sendOffsets, float *recv,
               const int64_t *recvCounts, const int64_t *recvOffsets,
               unsigned axes) {
  checkAxes(axes, "allToAllV");
  int64_t g = groupSize(axes), me = groupRank(axes);
  int64_t total = 0, offRank = 0;
  for (int64_t j = 0; j < g; ++j) {
    total += sendCounts[j];
    if (j != me)
      offRank += sendCounts[j];
  }
  count(CollectiveKind::AllToAll, total, offRank * 4);
  if (g == 1) {
    if (sendCounts[0] > 0)
      std::memmove(recv + recvOffsets[0], send + sendOffsets[0],
                   (size_t)sendCounts[0] * sizeof(float));
    return;
  }
  std::vector<int> sc(g), sd(g), rc(g), rd(g);
  for (int64_t j = 0; j < g; ++j) {
    for (int64_t v : {sendCounts[j], sendOffsets[j], recvCounts[j],
                      recvOffsets[j]})
      if (v < 0 || v > INT32_MAX)
        throw std::runtime_error("allToAllV: a count or offset of " +
                                 std::to_string(v) +
                                 " elements is out of MPI's int range");
    sc[j] = (int)sendCounts[j], sd[j] = (int)sendOffsets[j];
    rc[j] = (int)recvCounts[j], rd[j] = (int)recvOffsets[j];
  }
  Traced traced("all_to_all", axes, offRank * 4);
  Waiting waiting("allToAllV over %s (group of %lld)",
                  AxisSet::fromBits(axes).str().c_str(), (long long)g);
  checkMpi(MPI_Alltoallv(send, sc.data(), sd.data(), MPI_FLOAT, recv,
                         rc.data(), rd.data(), MPI_FLOAT,
                         state().comms[effectiveAxes(axes)]),
           "MPI_Alltoallv");
}

void allToAllInt(const int32_t *send, int32_t *recv, int64_t n,
                 unsigned axes) {
  checkAxes(axes, "allToAllInt");
  int64_t g = groupSize(axes);
  checkCount(n, g, "allToAllInt");
  count(CollectiveKind::AllToAll, n * g, n * (g - 1) * 4);
  if (g == 1) {
    std::memmove(recv, send, (size_t)n * sizeof(int32_t));
    return;
  }
  Traced traced("all_to_all", axes, n * (g - 1) * 4);
  Waiting waiting("allToAllInt over %s (group of %lld, %lld values each)",
                  AxisSet::fromBits(axes).str().c_str(), (long long)g,
                  (long long)n);
  checkMpi(MPI_Alltoall(send, (int)n, MPI_INT32_T, recv, (int)n, MPI_INT32_T,
                        state().comms[effectiveAxes(axes)]),
           "MPI_Alltoall");
}

void allGather(const float *in, float *out, int64_t n, unsigned axes) {
  checkAxes(axes, "allGather");
  int64_t g = groupSize(axes);
  checkCount(n, g, "allGather");
  count(CollectiveKind::AllGather, n, allGatherBytesSent(n, g));
  if (g == 1) {
    if (out != in && n > 0)
      std::memmove(out, in, (size_t)n * sizeof(float));
    return;
  }
  Traced traced("all_gather", axes, allGatherBytesSent(n, g));
  Waiting waiting("allGather over %s (group of %lld, %lld elements)",
                  AxisSet::fromBits(axes).str().c_str(), (long long)g,
                  (long long)n);
  checkMpi(MPI_Allgather(in, (int)n, MPI_FLOAT, out, (int)n, MPI_FLOAT,
                         state().comms[effectiveAxes(axes)]),
           "MPI_Allgather");
}

void reduceScatterSum(const float *in, float *out, int64_t n, unsigned axes) {
  checkAxes(axes, "reduceScatterSum");
  int64_t g = groupSize(axes);
  checkCount(n, g, "reduceScatterSum");
  count(CollectiveKind::ReduceScatter, g * n, reduceScatterBytesSent(n, g));
  if (g == 1) {
    if (out != in && n > 0)
      std::memmove(out, in, (size_t)n * sizeof(float));
    return;
  }
  Traced traced("reduce_scatter", axes, reduceScatterBytesSent(n, g));
  Waiting waiting("reduceScatterSum over %s (group of %lld, %lld elements)",
                  AxisSet::fromBits(axes).str().c_str(), (long long)g,
                  (long long)n);
  checkMpi(MPI_Reduce_scatter_block(in, out, (int)n, MPI_FLOAT, MPI_SUM,
                                    state().comms[effectiveAxes(axes)]),
           "MPI_Reduce_scatter_block");
}

void allReduceSumDouble(double *buffer, int64_t n, unsigned axes) {
  allReduceInPlace(buffer, n, MPI_DOUBLE, 8, MPI_SUM, axes,
                   "allReduceSumDouble");
}

void allReduceMax(float *buffer, int64_t n, unsigned axes) {
  allReduceInPlace(buffer, n, MPI_FLOAT, 4, MPI_MAX, axes, "allReduceMax");
}

namespace {

// A free slot of the request table (the first, so the table stays as small
// as the number of requests in flight at once).
size_t freeRequestSlot() {
  CommState &s = state();
  size_t slot = 0;
  while (slot < s.requestInUse.size() && s.requestInUse[slot])
    slot++;
  if (slot == s.requests.size()) {
    s.requests.push_back(MPI_REQUEST_NULL);
    s.requestInUse.push_back(false);
    s.pieceCopies.emplace_back();
  }
  s.requestInUse[slot] = true;
  s.pieceCopies[slot].to = nullptr;
  s.pieceCopies[slot].traced = nullptr;
  s.pieceCopies[slot].replicas = 0;
  s.pieceCopies[slot].gathered = nullptr;
  s.pieceCopies[slot].send = MPI_REQUEST_NULL;
  return slot;
}

// Hybrid sharding: this rank's piece (`held` elements of a c-element
// piece) summed over the replicas of its shard group. Counted once, as an
// all-reduce of c, as the plan counts it.
void reducePieceOverReplicas(float *piece, int held, int64_t c,
                             unsigned replicas) {
  int64_t r = groupSize(replicas);
  checkAxes(replicas, "reduceScatterShards");
  count(CollectiveKind::AllReduce, c, allReduceBytesSent(c, r));
  UncountedCollectives countedAbove;
  allReduceSum(piece, held, replicas);
}

// With tracing on, a started collective's flight is recorded from now to
// its completion under `name`, and the rank's wait for it as `waited`.
void traceFlight(CommState::PieceCopy &copy, const char *name,
                 const char *waited, int64_t bytes, unsigned axes) {
  if (!traceEnabled())
    return;
  copy.traced = name;
  copy.waited = waited;
  copy.tracedSince = traceNowMicros();
  copy.tracedBytes = bytes;
  copy.tracedAxes = axes;
}

// Elements of piece k of an n-element run over g ranks (Pieces.h).
int pieceCount(int64_t n, int64_t g, int64_t k) {
  return (int)inPiece(0, n, pieceSize(n, g), k).size();
}

} // namespace

CommRequest allReduceSumStart(float *buffer, int64_t n, unsigned axes) {
  checkAxes(axes, "allReduceSumStart");
  int64_t g = groupSize(axes);
  checkCount(n, 1, "allReduceSumStart");
  count(CollectiveKind::AllReduce, n, allReduceBytesSent(n, g));
  CommState &s = state();
  size_t slot = freeRequestSlot();
  s.requests[slot] = MPI_REQUEST_NULL;
  if (g > 1) {
    checkMpi(MPI_Iallreduce(MPI_IN_PLACE, buffer, (int)n, MPI_FLOAT, MPI_SUM,
                            s.comms[effectiveAxes(axes)], &s.requests[slot]),
             "MPI_Iallreduce");
    traceFlight(s.pieceCopies[slot], "all_reduce_start", "all-reduce wait",
                n * (int64_t)sizeof(float), axes);
  }
  return (CommRequest)slot;
}

CommRequest reduceScatterShardsStart(float *buffer, int64_t n, unsigned axes) {
  unsigned replicas = axes & kDpReplicaBit;
  axes &= ~kDpReplicaBit;
  checkAxes(axes, "reduceScatterShards");
  int64_t g = groupSize(axes);
  checkCount(n, 1, "reduceScatterShards");
  count(CollectiveKind::ReduceScatter, n,
        reduceScatterBytesSent(pieceSize(n, g), g));
  CommState &s = state();
  size_t slot = freeRequestSlot();
  s.requests[slot] = MPI_REQUEST_NULL;
  int64_t k = groupRank(axes);
  CommState::PieceCopy &copy = s.pieceCopies[slot];
  if (replicas) {
    copy.replicas = replicas;
    copy.pieceElems = pieceSize(n, g);
    copy.size = pieceCount(n, g, k);
  }
  if (g == 1) {
    copy.from = copy.to = buffer;
    return (CommRequest)slot;
  }
  copy.counts.resize(g);
  for (int64_t r = 0; r < g; ++r)
    copy.counts[r] = pieceCount(n, g, r);
  // In place: MPI reads the whole buffer and writes this rank's piece of
  // the sum at its start; commWait moves it to the piece's place.
  copy.from = buffer;
  copy.to = buffer + k * pieceSize(n, g);
  copy.size = copy.counts[k];
  checkMpi(MPI_Ireduce_scatter(MPI_IN_PLACE, buffer, copy.counts.data(),
                               MPI_FLOAT, MPI_SUM,
                               s.comms[effectiveAxes(axes)],
                               &s.requests[slot]),
           "MPI_Ireduce_scatter");
  traceFlight(copy, "reduce_scatter_shards_start", "shards wait",
              n * (int64_t)sizeof(float), axes);
  return (CommRequest)slot;
}

CommRequest reduceScatterPieceStart(const float *buffer, float *out, int64_t n,
                                    unsigned axes) {
  unsigned replicas = axes & kDpReplicaBit;
  axes &= ~kDpReplicaBit;
  checkAxes(axes, "reduceScatterPieceStart");
  int64_t g = groupSize(axes);
  checkCount(n, 1, "reduceScatterPieceStart");
  int64_t c = pieceSize(n, g), k = groupRank(axes);
  int64_t bytes = reduceScatterBytesSent(c, g);
  count(CollectiveKind::ReduceScatter, n, bytes);
  CommState &s = state();
  size_t slot = freeRequestSlot();
  s.requests[slot] = MPI_REQUEST_NULL;
  CommState::PieceCopy &copy = s.pieceCopies[slot];
  traceFlight(copy, "reduce_scatter_piece", "reduce wait", bytes, axes);
  // The piece stays where MPI writes it (copy.from == copy.to); commWait
  // then sums it over the replicas.
  copy.to = out;
  copy.from = out;
  copy.size = pieceCount(n, g, k);
  copy.replicas = replicas;
  copy.pieceElems = c;
  if (g == 1) {
    std::memmove(out, buffer, (size_t)n * sizeof(float));
    return (CommRequest)slot;
  }
  copy.counts.resize(g);
  for (int64_t r = 0; r < g; ++r)
    copy.counts[r] = pieceCount(n, g, r);
  // A rank whose piece is empty still passes a buffer.
  static float unused;
  checkMpi(MPI_Ireduce_scatter(buffer, copy.size ? out : &unused,
                               copy.counts.data(), MPI_FLOAT, MPI_SUM,
                               s.comms[effectiveAxes(axes)], &s.requests[slot]),
           "MPI_Ireduce_scatter");
  return (CommRequest)slot;
}

void reduceScatterShards(float *buffer, float *out, int64_t n, unsigned axes) {
  if (out)
    commWait(reduceScatterPieceStart(buffer, out, n, axes));
  else
    commWait(reduceScatterShardsStart(buffer, n, axes));
}

void allGatherShards(float *buffer, const float *from, void *shadow, int64_t n,
                     unsigned axes) {
  if (shadow)
    throw std::runtime_error(
        "allGatherShards: CPU programs keep no parameter copy");
  checkAxes(axes, "allGatherShards");
  int64_t g = groupSize(axes);
  checkCount(n, 1, "allGatherShards");
  int64_t c = pieceSize(n, g);
  count(CollectiveKind::AllGather, c, allGatherBytesSent(c, g));
  if (from) {
    int64_t k = groupRank(axes);
    std::memmove(buffer + k * c, from,
                 (size_t)pieceCount(n, g, k) * sizeof(float));
  }
  if (g == 1)
    return;
  std::vector<int> counts(g), offsets(g);
  for (int64_t r = 0; r < g; ++r) {
    counts[r] = pieceCount(n, g, r);
    offsets[r] = (int)inPiece(0, n, c, r).begin;
  }
  Traced traced("all_gather", axes, allGatherBytesSent(c, g));
  Waiting waiting("allGatherShards over %s (group of %lld, %lld elements)",
                  AxisSet::fromBits(axes).str().c_str(), (long long)g,
                  (long long)n);
  checkMpi(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buffer,
                          counts.data(), offsets.data(), MPI_FLOAT,
                          state().comms[effectiveAxes(axes)]),
           "MPI_Allgatherv");
}

CommRequest allGatherShardsStart(float *buffer, const float *from,
                                 void *shadow, int64_t n, unsigned axes) {
  if (shadow)
    throw std::runtime_error(
        "allGatherShardsStart: CPU programs keep no parameter copy");
  checkAxes(axes, "allGatherShardsStart");
  int64_t g = groupSize(axes);
  checkCount(n, 1, "allGatherShardsStart");
  int64_t c = pieceSize(n, g), k = groupRank(axes);
  int64_t bytes = allGatherBytesSent(c, g);
  count(CollectiveKind::AllGather, c, bytes);
  CommState &s = state();
  size_t slot = freeRequestSlot();
  s.requests[slot] = MPI_REQUEST_NULL;
  if (from)
    std::memmove(buffer + k * c, from,
                 (size_t)pieceCount(n, g, k) * sizeof(float));
  CommState::PieceCopy &copy = s.pieceCopies[slot];
  traceFlight(copy, "all_gather_shards", "gather wait", bytes, axes);
  if (g == 1)
    return (CommRequest)slot;
  copy.counts.resize(g);
  copy.offsets.resize(g);
  for (int64_t r = 0; r < g; ++r) {
    copy.counts[r] = pieceCount(n, g, r);
    copy.offsets[r] = (int)inPiece(0, n, c, r).begin;
  }
  checkMpi(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buffer,
                           copy.counts.data(), copy.offsets.data(), MPI_FLOAT,
                           s.comms[effectiveAxes(axes)], &s.requests[slot]),
           "MPI_Iallgatherv");
  return (CommRequest)slot;
}

// The start of a collective along a dimension: checks the shape (and the
// blocks an inner dimension needs), counts it as its blocking form would
// be counted and takes a request slot. A group of one copies `in` to `out`
// and leaves the request done.
struct AlongStart {
  int n = 0; // the piece's elements, in MPI's int
  int64_t g = 1;
  int64_t bytes = 0;
  size_t slot = 0;
};
static AlongStart startAlong(const float *in, float *out, const void *blocks,
                             int64_t outer, int64_t len, int64_t inner,
                             unsigned axes, CollectiveKind kind,
                             const char *what) {
  checkAxes(axes, what);
  if (outer < 0 || len < 0 || inner < 0)
    throw std::runtime_error(std::string(what) + " of a negative shape");
  int64_t n = outer * len * inner;
  if (n > INT32_MAX)
    throw std::runtime_error(std::string(what) + " of " + std::to_string(n) +
                             " elements is out of MPI's int range");
  if (outer > 1 && !blocks)
    throw std::runtime_error(std::string(what) +
                             " along an inner dimension needs its blocks");
  AlongStart start;
  start.n = (int)n;
  start.g = groupSize(axes);
  bool gather = kind == CollectiveKind::AllGather;
  start.bytes = gather ? allGatherBytesSent(n, start.g)
                       : reduceScatterBytesSent(n, start.g);
  count(kind, gather ? n : start.g * n, start.bytes);
  CommState &s = state();
  start.slot = freeRequestSlot();
  s.requests[start.slot] = MPI_REQUEST_NULL;
  if (start.g == 1 && out != in && n > 0)
    std::memmove(out, in, (size_t)n * sizeof(float));
  return start;
}

CommRequest allGatherAlongStart(const float *in, float *out, void *blocks,
                                int64_t outer, int64_t len, int64_t inner,
                                unsigned axes) {
  AlongStart start = startAlong(in, out, blocks, outer, len, inner, axes,
                                CollectiveKind::AllGather,
                                "allGatherAlongStart");
  CommState &s = state();
  if (start.g == 1)
    return (CommRequest)start.slot;
  CommState::PieceCopy &copy = s.pieceCopies[start.slot];
  traceFlight(copy, "all_gather_start", "gather wait", start.bytes, axes);
  float *into = out;
  if (outer > 1) {
    into = static_cast<float *>(blocks);
    copy.blocks = into;
    copy.gathered = out;
    copy.groups = start.g;
    copy.outer = outer;
    copy.len = len;
    copy.inner = inner;
  }
  checkMpi(MPI_Iallgather(in, start.n, MPI_FLOAT, into, start.n, MPI_FLOAT,
                          s.comms[effectiveAxes(axes)],
                          &s.requests[start.slot]),
           "MPI_Iallgather");
  return (CommRequest)start.slot;
}

CommRequest reduceScatterAlongStart(const float *in, float *out, void *blocks,
                                    int64_t outer, int64_t len, int64_t inner,
                                    unsigned axes) {
  AlongStart start = startAlong(in, out, blocks, outer, len, inner, axes,
                                CollectiveKind::ReduceScatter,
                                "reduceScatterAlongStart");
  CommState &s = state();
  if (start.g == 1)
    return (CommRequest)start.slot;
  traceFlight(s.pieceCopies[start.slot], "reduce_scatter_start", "reduce wait",
              start.bytes, axes);
  const float *from = in;
  if (outer > 1) {
    float *packed = static_cast<float *>(blocks);
    for (int64_t r = 0; r < start.g; ++r)
      sliceAxis(in, packed + r * start.n, outer, start.g * len, inner, r * len,
                len);
    from = packed;
  }
  checkMpi(MPI_Ireduce_scatter_block(from, out, start.n, MPI_FLOAT, MPI_SUM,
                                     s.comms[effectiveAxes(axes)],
                                     &s.requests[start.slot]),
           "MPI_Ireduce_scatter_block");
  return (CommRequest)start.slot;
}

CommRequest shiftStart(const float *in, float *out, int64_t n, int64_t shift,
                       unsigned axes) {
  checkAxes(axes, "shiftStart");
  int64_t g = groupSize(axes);
  if (n < 0 || n > INT32_MAX)
    throw std::runtime_error("shiftStart of " + std::to_string(n) +
                             " elements (MPI counts are int)");
  if (shift < 1 || shift >= std::max<int64_t>(g, 2))
    throw std::runtime_error("shiftStart by " + std::to_string(shift) +
                             " in a group of " + std::to_string(g));
  count(CollectiveKind::SendRecv, n, n * 4);
  CommState &s = state();
  size_t slot = freeRequestSlot();
  s.requests[slot] = MPI_REQUEST_NULL;
  if (g == 1)
    return (CommRequest)slot;
  CommState::PieceCopy &copy = s.pieceCopies[slot];
  traceFlight(copy, "shift_start", "shift wait", n * 4, axes);
  int64_t me = groupRank(axes);
  int to = (int)((me + shift) % g), from = (int)((me - shift + g) % g);
  MPI_Comm comm = s.comms[effectiveAxes(axes)];
  // Tagged by the shift: two shifts between the same ranks do not mix.
  checkMpi(MPI_Irecv(out, (int)n, MPI_FLOAT, from, (int)shift, comm,
                     &s.requests[slot]),
           "MPI_Irecv");
  checkMpi(MPI_Isend(in, (int)n, MPI_FLOAT, to, (int)shift, comm, &copy.send),
           "MPI_Isend");
  return (CommRequest)slot;
}

void commWait(CommRequest request) {
  CommState &s = state();
  if (request < 0 || (size_t)request >= s.requests.size() ||
      !s.requestInUse[request])
    throw std::runtime_error("commWait on an unknown or finished request " +
                             std::to_string(request));
  CommState::PieceCopy &copy = s.pieceCopies[request];
  if (s.requests[request] != MPI_REQUEST_NULL) {
    TraceSpan span(copy.traced ? copy.waited : nullptr);
    Waiting waiting("the collective started as request %d", (int)request);
    waitAll(&s.requests[request], 1, "MPI_Wait");
  }
  if (copy.send != MPI_REQUEST_NULL) {
    Waiting waiting("the send started as request %d", (int)request);
    waitAll(&copy.send, 1, "MPI_Wait");
  }
  if (copy.traced) {
    traceRecordCollective(copy.traced, copy.tracedSince, copy.tracedBytes,
                          AxisSet::fromBits(copy.tracedAxes).str());
    copy.traced = nullptr;
  }
  if (copy.gathered) {
    int64_t n = copy.outer * copy.len * copy.inner;
    for (int64_t r = 0; r < copy.groups; ++r)
      insertAxis(copy.blocks + r * n, copy.gathered, copy.outer,
                 copy.groups * copy.len, copy.inner, r * copy.len, copy.len);
    copy.gathered = nullptr;
  }
  if (copy.to) {
    if (copy.to != copy.from)
      std::memmove(copy.to, copy.from, (size_t)copy.size * sizeof(float));
    if (copy.replicas)
      reducePieceOverReplicas(copy.to, copy.size, copy.pieceElems,
                              copy.replicas);
    copy.to = nullptr;
  }
  s.requestInUse[request] = false;
}

// The world rank at this rank's coordinates with `offset` added along
// `axis`, after checking the arguments of sendTo or recvFrom.
static int peerRank(int64_t n, MeshAxis axis, int offset, int tag,
                    const char *what) {
  const CommState &s = state();
  if (!s.initialized)
    throw std::runtime_error(std::string(what) +
                             " called before the communicator was set up");
  if ((int)axis < 0 || (int)axis >= tessel::kNumMeshAxes)
    throw std::runtime_error(std::string(what) + " called with invalid axis " +
                             std::to_string((int)axis));
  if (n < 0 || n > INT_MAX)
    throw std::runtime_error(std::string(what) + " of " + std::to_string(n) +
                             " elements is outside the supported range");
  // MPI guarantees tags up to 32767 at least.
  if (tag < 0 || tag >= 32767)
    throw std::runtime_error(std::string(what) + " called with tag " +
                             std::to_string(tag) +
                             ", outside the supported range [0, 32767)");
  int64_t peer = s.coord[axis] + offset;
  std::optional<int64_t> peerRank = s.layout.peer(s.rank, axis, offset);
  if (offset == 0 || !peerRank)
    throw std::runtime_error(
        std::string(what) + " along " + meshAxisName(axis) + " with offset " +
        std::to_string(offset) + " from coordinate " +
        std::to_string(s.coord[axis]) + ": " +
        (offset == 0 ? std::string("the peer is this rank itself")
                     : "no rank has coordinate " + std::to_string(peer) + " (" +
                           meshAxisName(axis) + " size " +
                           std::to_string(s.layout.size(axis)) + ")"));
  return (int)*peerRank;
}

void sendTo(const float *buffer, int64_t n, MeshAxis axis, int offset, int tag,
            int64_t ringSlots) {
  TraceSpan span("send", tag);
  int peer = peerRank(n, axis, offset, tag, "sendTo");
  count(CollectiveKind::SendRecv, n, n * 4);
  // The caller's buffer lives in a statically planned arena that later ops
  // reuse right away: send from a copy, in the ring's next slot once the
  // message that slot held has been received, or one that lives until
  // waitSends().
  CommState &s = state();
  if (ringSlots > 0) {
    if ((int64_t)s.ringCopies.size() != ringSlots) {
      if (s.ringNext != 0)
        throw std::runtime_error("sendTo: a send ring of " +
                                 std::to_string(ringSlots) + " slots while " +
                                 std::to_string(s.ringCopies.size()) +
                                 " are in use");
      s.ringCopies.resize(ringSlots);
      s.ringSends.resize(ringSlots, MPI_REQUEST_NULL);
    }
    int64_t slot = s.ringNext++ % ringSlots;
    MPI_Request &pending = s.ringSends[slot];
    if (pending != MPI_REQUEST_NULL) {
      Waiting waiting("pipeline send slot %lld to be free (its message "
                      "received), before sending to rank %d (%s %+d, tag %d)",
                      (long long)slot, peer, meshAxisName(axis), offset, tag);
      waitAll(&pending, 1, "MPI_Wait (send slot)");
    }
    std::vector<float> &copy = s.ringCopies[slot];
    copy.assign(buffer, buffer + n);
    checkMpi(MPI_Isend(copy.data(), (int)n, MPI_FLOAT, peer, tag,
                       MPI_COMM_WORLD, &pending),
             "MPI_Isend");
    return;
  }
  size_t rounded = ((size_t)n * sizeof(float) + 63) / 64 * 64;
  float *copy = nullptr;
  if (s.sendArenaUsed + rounded <= s.sendArena.size() * sizeof(float)) {
    copy = s.sendArena.data() + s.sendArenaUsed / sizeof(float);
    s.sendArenaUsed += rounded;
    std::copy_n(buffer, n, copy);
  } else {
    s.sendCopies.emplace_back(buffer, buffer + n);
    copy = s.sendCopies.back().data();
  }
  MPI_Request request = MPI_REQUEST_NULL;
  checkMpi(
      MPI_Isend(copy, (int)n, MPI_FLOAT, peer, tag, MPI_COMM_WORLD, &request),
      "MPI_Isend");
  s.sends.push_back(request);
}

void recvFrom(float *buffer, int64_t n, MeshAxis axis, int offset, int tag) {
  TraceSpan span("recv", tag);
  int peer = peerRank(n, axis, offset, tag, "recvFrom");
  MPI_Status status;
  MPI_Request request = MPI_REQUEST_NULL;
  checkMpi(MPI_Irecv(buffer, (int)n, MPI_FLOAT, peer, tag, MPI_COMM_WORLD,
                     &request),
           "MPI_Irecv");
  Waiting waiting("a message from rank %d (%s %+d, tag %d, %lld elements)",
                  peer, meshAxisName(axis), offset, tag, (long long)n);
  waitAll(&request, 1, "MPI_Recv", &status);
  int received = 0;
  MPI_Get_count(&status, MPI_FLOAT, &received);
  if (received != n)
    throw std::runtime_error("recvFrom rank " + std::to_string(peer) +
                             " with tag " + std::to_string(tag) + " expected " +
                             std::to_string(n) + " elements but received " +
                             std::to_string(received));
}

void waitSends() {
  TraceSpan span("wait");
  CommState &s = state();
  std::vector<MPI_Request> &sends = s.sends;
  for (MPI_Request &ring : s.ringSends)
    if (ring != MPI_REQUEST_NULL) {
      sends.push_back(ring);
      ring = MPI_REQUEST_NULL;
    }
  s.ringNext = 0;
  s.sendArenaUsed = 0;
  if (sends.empty())
    return;
  std::vector<MPI_Request> pending;
  pending.swap(sends);
  Waiting waiting("%d pipeline sends of the step to be received",
                  (int)pending.size());
  waitAll(pending.data(), (int)pending.size(), "MPI_Waitall");
  state().sendCopies.clear();
}

void commReserveSends(int64_t otherBytes, int64_t ringSlots,
                      int64_t slotBytes) {
  CommState &s = state();
  // Zero-filled, so resident from the start like the other stores.
  s.sendArena.assign((size_t)std::max<int64_t>(otherBytes, 0) / sizeof(float),
                     0.0f);
  s.sendArenaUsed = 0;
  s.ringCopies.assign(
      (size_t)std::max<int64_t>(ringSlots, 0),
      std::vector<float>(
          (size_t)std::max<int64_t>(slotBytes, 0) / sizeof(float), 0.0f));
  s.ringSends.assign(s.ringCopies.size(), MPI_REQUEST_NULL);
  s.ringNext = 0;
}

const CollectiveCounter &collectiveCounter(CollectiveKind kind) {
  return state().counters[(int)kind];
}

} // namespace tessel::rt
