//===- Comm.h - Collectives over mesh axes (CPU: MPI) -----------*- C++ -*-===//
//
// A rank program runs on a device mesh with named axes; where each rank sits
// is tessel::MeshLayout's (tessel/Support/MeshLayout.h). A collective runs
// over a set of axes, passed as AxisSet::bits(): the group of ranks whose
// coordinates differ only along those axes. One communicator per axis set is
// built once at start (MPI_Comm_split). All buffers are float32.
//
// Every call is counted (calls, elements passed, and the bytes each rank
// sends under the textbook ring algorithms), so the run can be checked
// against the compiler's prediction.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_RUNTIME_COMM_H
#define TESSEL_RUNTIME_COMM_H

#include "tessel/Support/MeshLayout.h"

#include <stdexcept>

#include <cstdint>

namespace tessel::rt {

using tessel::AxisSet;
using tessel::MeshAxis;
using tessel::MeshLayout;
using tessel::MeshShape;

enum class CollectiveKind : int {
  AllReduce = 0,
  AllGather = 1,
  ReduceScatter = 2,
  AllToAll = 3,
  Broadcast = 4,
  SendRecv = 5,
};
constexpr int kNumCollectiveKinds = 6;

struct CollectiveCounter {
  int64_t calls = 0;
  int64_t elements = 0;  // elements of the buffer argument (see each call)
  int64_t bytesSent = 0; // per rank, textbook ring volume
};

// Starts MPI when the mesh has more than one rank, checks that the world size
// and this rank match `mesh`, and builds the communicators. Throws
// std::runtime_error with a clear message otherwise. With a one-rank mesh
// nothing is started and every collective is a no-op copy.
void commInit(int *argc, char ***argv, const MeshShape &mesh);
void commFinalize();
// Aborts every rank (after a fatal error on one of them).
[[noreturn]] void commAbort(int code);

// The watchdog of a multi-rank CPU run: a background thread ends the job
// with a message naming this rank, what it waits for (a collective and its
// group, or a pipeline peer) and the step, when one wait lasts longer than
// `seconds` (a rank was stopped, hangs or died). Waits for pipeline
// messages sleep between polls rather than spin. Started after commInit;
// commFinalize stops it. No-op for a one-rank run.
void commStartWatchdog(double seconds);
// The step the driver runs, for the watchdog's message.
void commSetStep(int64_t step);

// While one lives, collectives are not counted: what the driver exchanges
// around training (checking a checkpoint) is not the step's traffic.
class UncountedCollectives {
public:
  UncountedCollectives();
  ~UncountedCollectives();
  UncountedCollectives(const UncountedCollectives &) = delete;
  UncountedCollectives &operator=(const UncountedCollectives &) = delete;
};

// False while an UncountedCollectives lives (for the CUDA runtime's
// counting).
bool collectivesCounted();

int commRank();
int commWorldSize();
// The layout the communicators were built for.
const MeshLayout &meshLayout();
int64_t meshCoord(MeshAxis axis);
int64_t meshSize(MeshAxis axis);
// A failure every rank raises at the same point, having agreed on it
// through a collective (a checkpoint no rank could commit): each rank
// reports it and the ranks end together, so that none is stopped before it
// has said why.
class AgreedError : public std::runtime_error {
public:
  using std::runtime_error::runtime_error;
};

// Size of the group spanned by `axes`.
int64_t groupSize(unsigned axes);
// This rank's index within that group (MeshLayout::groupRank).
int64_t groupRank(unsigned axes);

// In-place sum over the group. buffer: n elements. Counts n elements and
// 2(g-1)/g * n * 4 bytes sent.
void allReduceSum(float *buffer, int64_t n, unsigned axes);
// in: n elements per rank; out: g * n elements, rank-major in group order.
// Counts n elements and (g-1) * n * 4 bytes.
void allGather(const float *in, float *out, int64_t n, unsigned axes);
// Every rank of the group sends sendCounts[j] elements (from sendOffsets[j])
// to group rank j and receives recvCounts[j] (at recvOffsets[j]) from it
// (MPI_Alltoallv). Counted as one all-to-all of the elements this rank
// sends, its bytes those sent to other ranks.
void allToAllV(const float *send, const int64_t *sendCounts,
               const int64_t *sendOffsets, float *recv,
               const int64_t *recvCounts, const int64_t *recvOffsets,
               unsigned axes);
// n int32 values to each rank of the group, n from each (MPI_Alltoall):
// the counts an all-to-allv exchanges first. Counted with the all-to-alls.
void allToAllInt(const int32_t *send, int32_t *recv, int64_t n, unsigned axes);
// in: g * n elements; out: this rank's n-element block of the sum. Counts
// g * n elements and (g-1) * n * 4 bytes.
void reduceScatterSum(const float *in, float *out, int64_t n, unsigned axes);

// Sum of doubles (gradient-norm partial sums); counted as an all-reduce of
// n 8-byte elements.
void allReduceSumDouble(double *buffer, int64_t n, unsigned axes);
// Elementwise maximum (vocab-parallel softmax); counted as an all-reduce.
void allReduceMax(float *buffer, int64_t n, unsigned axes);

// All-gather along one dimension of a [outer, len, inner] tensor: out is
// [outer, g * len, inner] with the pieces in group order. Counted as one
// all-gather of outer * len * inner elements.
void allGatherAlong(const float *in, float *out, int64_t outer, int64_t len,
                    int64_t inner, unsigned axes);
// Reduce-scatter along one dimension: in is [outer, g * len, inner], out this
// rank's [outer, len, inner] piece of the sum. Counted as one reduce-scatter.
void reduceScatterAlong(const float *in, float *out, int64_t outer, int64_t len,
                        int64_t inner, unsigned axes);

// Non-blocking all-reduce (MPI_Iallreduce); wait before reading the buffer.
using CommRequest = int;
CommRequest allReduceSumStart(float *buffer, int64_t n, unsigned axes);
void commWait(CommRequest request);
// commWait on a part's first run in the step only (`first`: the part's
// second argument); its other runs find the collective done.
inline void commWaitIf(bool first, CommRequest request) {
  if (first)
    commWait(request);
}

// The started forms of allGatherAlong and reduceScatterAlong (a tensor-
// parallel collective in flight under a GEMM): `in` may be written, and
// `out` read, only after commWait. With outer > 1, `blocks` (g x n floats,
// n = outer x len x inner, a buffer of the memory plan) holds the ranks'
// pieces side by side while the collective is in flight: the gather lays
// them out in `out` at commWait, the reduce-scatter packs `in` into it at
// its start. Counted as their blocking forms; with tracing on, the time in
// flight is recorded on the collectives track.
CommRequest allGatherAlongStart(const float *in, float *out, void *blocks,
                                int64_t outer, int64_t len, int64_t inner,
                                unsigned axes);
CommRequest reduceScatterAlongStart(const float *in, float *out, void *blocks,
                                    int64_t outer, int64_t len, int64_t inner,
                                    unsigned axes);

// One step of a gather done piece by piece (a collective matmul): sends
// `in` (n floats) to the group rank `shift` places after this one and
// receives `out` from the one `shift` places before. `in` may be written,
// and `out` read, only after commWait. Counted as a message of n elements.
CommRequest shiftStart(const float *in, float *out, int64_t n, int64_t shift,
                       unsigned axes);

// Block (groupRank(axes) - shift) mod blocks of an n-element buffer cut
// into `blocks` equal blocks: in a tensor gathered over the group along its
// outermost dimension, the piece of the rank `shift` places before this
// one.
template <typename T>
T *groupBlock(T *base, int64_t n, int64_t blocks, int64_t shift,
              unsigned axes) {
  int64_t r = groupRank(axes) % blocks;
  return base + ((r - shift) % blocks + blocks) % blocks * (n / blocks);
}

// The optimizer sharded over a group (ZeRO-1): an n-element buffer is cut
// into g pieces of c = ceil(n / g) elements (the last ones shorter or
// empty); piece k belongs to group rank k.
// Sums the buffer over the group and leaves this rank's piece of the sum in
// place; the rest of the buffer is undefined afterwards. Counts n elements
// and (g-1) * c * 4 bytes (a reduce-scatter of pieces of c). The started
// form completes (and places the piece) at commWait.
// reduceScatterShards with `out` writes the piece there instead.
// With hybrid sharding `axes` may also hold the replicas of the shard group
// (kDpReplicaBit): the pieces are cut over the other axes and then each
// piece is all-reduced over the replicas (counted as an all-reduce of c).
void reduceScatterShards(float *buffer, float *out, int64_t n, unsigned axes);
CommRequest reduceScatterShardsStart(float *buffer, int64_t n, unsigned axes);
// reduceScatterShards with `out`, started (ZeRO-2's reduction in flight):
// `buffer` may be written, and `out` read, only after commWait. With
// tracing on, the time in flight is recorded on the collectives track.
CommRequest reduceScatterPieceStart(const float *buffer, float *out, int64_t n,
                                    unsigned axes);
// Every rank's piece, in place, to every rank; with `from` this rank's piece
// is first copied from there. `shadow` must be null on the CPU. Counts c
// elements and (g-1) * c * 4 bytes.
void allGatherShards(float *buffer, const float *from, void *shadow, int64_t n,
                     unsigned axes);
// The started form (ZeRO-3's prefetch; ZeRO-1 and 2's gather of a run's
// updated pieces, without `from`): with `from` this rank's piece is copied
// from there at once; the buffer may be read (and `from` written) only after
// commWait. `shadow` must be null on the CPU. Counted like allGatherShards;
// with tracing on, the time in flight is recorded on the trace's
// collectives track.
CommRequest allGatherShardsStart(float *buffer, const float *from,
                                 void *shadow, int64_t n, unsigned axes);

// Point-to-point along one mesh axis, with the rank whose coordinate on
// `axis` is this rank's + offset and every other coordinate equal. sendTo is
// non-blocking (MPI_Isend) and sends from a copy, so the caller may reuse
// `buffer` at once: with `ringSlots` > 0 the copy takes the next of that
// many slots in turn (waiting first until the message the slot held has
// been received; the compiler chooses a count that cannot deadlock),
// otherwise a buffer of its own until waitSends(). recvFrom blocks until the
// data has arrived. Tags must match.
void sendTo(const float *buffer, int64_t n, MeshAxis axis, int offset, int tag,
            int64_t ringSlots = 0);
void recvFrom(float *buffer, int64_t n, MeshAxis axis, int offset, int tag);
// Completes every send started since the last call.
void waitSends();
// Allocates (and touches) the send buffers the compiler planned
// (Program::sendBytes, sendRingSlots, sendSlotBytes), so that the steps do
// not: sends outside the ring take `otherBytes` in turn (64-byte aligned)
// and start over after waitSends; a send that does not fit gets a buffer
// of its own.
void commReserveSends(int64_t otherBytes, int64_t ringSlots, int64_t slotBytes);
// Issues the sends queued so far. MPI sends are issued when called, so this
// does nothing on the CPU (the CUDA runtime orders its queue here).
inline void flushSends() {}
// The fp64 all-reduce under the name the generated code uses for every
// element type.
inline void allReduceSum(double *buffer, int64_t n, unsigned axes) {
  allReduceSumDouble(buffer, n, axes);
}

const CollectiveCounter &collectiveCounter(CollectiveKind kind);
const char *collectiveName(CollectiveKind kind);

} // namespace tessel::rt

#endif // TESSEL_RUNTIME_COMM_H
