//===- Trace.h - Chrome traces of a rank's step -----------------*- C++ -*-===//
//
// With `--trace FILE`, each rank records spans (forward, backward, update,
// send, recv, wait) and writes them in the Chrome trace event format
// (FILE with .rankR before the extension), viewable in Perfetto. Started
// collectives are drawn from start to completion on a second track of the
// rank ("collectives in flight"), with their group and bytes; blocking
// collectives are spans of the program's track, with their group and bytes
// too. Each trace records when the ranks left a common barrier at start
// (`otherData.sync_us`), which `tessel trace merge` aligns the ranks'
// clocks by. Without it, a span costs one branch.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_RUNTIME_TRACE_H
#define TESSEL_RUNTIME_TRACE_H

#include <cstdint>
#include <string>

namespace tessel::rt {

void traceEnable(bool enabled);
bool traceEnabled();
// Records [start, now) as a complete event; `detail` is the microbatch (or
// -1 when there is none).
void traceRecord(const char *name, int64_t detail, double startMicros);
// Records a collective's [start, now) with its bytes and group: on the
// collectives track (1) for a started one, on the program's (0) for a
// blocking one.
void traceRecordCollective(const char *name, double startMicros, int64_t bytes,
                           const std::string &group, int track = 1);
// The time (traceNowMicros) at which every rank left a common barrier.
void traceSetSync(double micros);
double traceNowMicros();
// Writes the recorded events for `rank` to `path` (atomically).
void traceWrite(const std::string &path, int rank);

// A span from construction to destruction (none for a null name).
class TraceSpan {
public:
  TraceSpan(const char *name, int64_t detail = -1)
      : name(name), detail(detail),
        start(traceEnabled() ? traceNowMicros() : 0.0) {}
  ~TraceSpan() {
    if (name && traceEnabled())
      traceRecord(name, detail, start);
  }
  TraceSpan(const TraceSpan &) = delete;
  TraceSpan &operator=(const TraceSpan &) = delete;

private:
  const char *name;
  int64_t detail;
  double start;
};

} // namespace tessel::rt

#endif // TESSEL_RUNTIME_TRACE_H
