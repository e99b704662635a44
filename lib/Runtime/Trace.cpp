//===- Trace.cpp - Chrome traces of a rank's step -------------------------===//

#include "tessel/Runtime/Trace.h"

#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <vector>

namespace tessel::rt {

namespace {
struct Event {
  const char *name;
  int64_t detail;
  double start, end;
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

void traceWrite(const std::string &path, int rank) {
  std::string tmp = path + ".tmp";
  FILE *f = std::fopen(tmp.c_str(), "w");
  if (!f)
    throw std::runtime_error("cannot write the trace '" + path + "'");
  std::fprintf(f, "{\"traceEvents\": [\n");
  for (size_t i = 0; i < events.size(); ++i) {
    const Event &e = events[i];
    std::fprintf(f,
                 "  {\"name\": \"%s\", \"ph\": \"X\", \"pid\": %d, \"tid\": 0, "
                 "\"ts\": %.3f, \"dur\": %.3f, \"args\": {\"id\": %lld}}%s\n",
                 e.name, rank, e.start, e.end - e.start, (long long)e.detail,
                 i + 1 < events.size() ? "," : "");
  }
  std::fprintf(f, "], \"displayTimeUnit\": \"ms\"}\n");
  if (std::fclose(f) != 0 || std::rename(tmp.c_str(), path.c_str()) != 0)
    throw std::runtime_error("cannot write the trace '" + path + "'");
}

} // namespace tessel::rt
