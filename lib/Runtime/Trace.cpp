//===- Trace.cpp - Chrome traces of a rank's step -------------------------===//

#include "tessel/Runtime/Trace.h"

#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

namespace tessel::rt {

namespace {
struct Event {
  const char *name;
  int64_t detail;
  double start, end;
  int track = 0; // 0: the rank's program, 1: collectives in flight
  int64_t bytes = 0;
  std::string group;
};
bool enabled = false;
std::vector<Event> events;
const auto origin = std::chrono::steady_clock::now();
} // namespace

void traceEnable(bool on) {
  enabled = on;
  if (on)
    events.reserve(1 << 16);
}
bool traceEnabled() { return enabled; }

double traceNowMicros() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now() - origin)
      .count();
}

void traceRecord(const char *name, int64_t detail, double startMicros) {
  events.push_back({name, detail, startMicros, traceNowMicros()});
}

void traceRecordCollective(const char *name, double startMicros, int64_t bytes,
                           const std::string &group) {
  events.push_back({name, -1, startMicros, traceNowMicros(), 1, bytes, group});
}

void traceWrite(const std::string &path, int rank) {
  std::string tmp = path + ".tmp";
  FILE *f = std::fopen(tmp.c_str(), "w");
  if (!f)
    throw std::runtime_error("cannot write the trace '" + path + "'");
  std::fprintf(f, "{\"traceEvents\": [\n");
  const char *tracks[] = {"program", "collectives in flight"};
  for (int t = 0; t < 2; ++t)
    std::fprintf(f,
                 "  {\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, "
                 "\"tid\": %d, \"args\": {\"name\": \"%s\"}},\n",
                 rank, t, tracks[t]);
  for (size_t i = 0; i < events.size(); ++i) {
    const Event &e = events[i];
    std::string args = "\"id\": " + std::to_string(e.detail);
    if (e.track == 1)
      args = "\"bytes\": " + std::to_string(e.bytes) + ", \"group\": \"" +
             e.group + "\"";
    std::fprintf(f,
                 "  {\"name\": \"%s\", \"ph\": \"X\", \"pid\": %d, \"tid\": %d, "
                 "\"ts\": %.3f, \"dur\": %.3f, \"args\": {%s}}%s\n",
                 e.name, rank, e.track, e.start, e.end - e.start, args.c_str(),
                 i + 1 < events.size() ? "," : "");
  }
  std::fprintf(f, "], \"displayTimeUnit\": \"ms\"}\n");
  if (std::fclose(f) != 0 || std::rename(tmp.c_str(), path.c_str()) != 0)
    throw std::runtime_error("cannot write the trace '" + path + "'");
}

} // namespace tessel::rt
