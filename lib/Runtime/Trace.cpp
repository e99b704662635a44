//===- Trace.cpp - Chrome traces of a rank's step -------------------------===//

#include "tessel/Runtime/Trace.h"
#include "tessel/Runtime/Safetensors.h"

#include <chrono>
#include <cstdio>

#include <unistd.h>
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
double syncMicros = 0;
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
                           const std::string &group, int track) {
  events.push_back(
      {name, -1, startMicros, traceNowMicros(), track, bytes, group});
}

void traceSetSync(double micros) { syncMicros = micros; }

void traceWrite(const std::string &path, int rank) {
  checkReplaceable(path, "the trace");
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
    if (!e.group.empty())
      args = "\"bytes\": " + std::to_string(e.bytes) + ", \"group\": \"" +
             e.group + "\"";
    std::fprintf(f,
                 "  {\"name\": \"%s\", \"ph\": \"X\", \"pid\": %d, \"tid\": %d, "
                 "\"ts\": %.3f, \"dur\": %.3f, \"args\": {%s}}%s\n",
                 e.name, rank, e.track, e.start, e.end - e.start, args.c_str(),
                 i + 1 < events.size() ? "," : "");
  }
  // Where the trace's time 0 is on this host's monotonic clock (shared by
  // the processes of one host), and the host.
  char host[256] = "";
  ::gethostname(host, sizeof(host) - 1);
  std::string hostName;
  for (const char *c = host; *c; ++c)
    if (*c != '"' && *c != '\\' && (unsigned char)*c >= 0x20)
      hostName += *c;
  double origin_us = std::chrono::duration<double, std::micro>(
                         origin.time_since_epoch())
                         .count();
  std::fprintf(f,
               "], \"displayTimeUnit\": \"ms\", \"otherData\": {\"rank\": %d, "
               "\"sync_us\": %.3f, \"clock_origin_us\": %.3f, \"host\": "
               "\"%s\"}}\n",
               rank, syncMicros, origin_us, hostName.c_str());
  if (std::fclose(f) != 0 || std::rename(tmp.c_str(), path.c_str()) != 0)
    throw std::runtime_error("cannot write the trace '" + path + "'");
}

} // namespace tessel::rt
