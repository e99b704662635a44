//===- TensorBoard.cpp - Scalars as a TensorBoard event file --------------===//

#include "tessel/Runtime/TensorBoard.h"

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <unistd.h>

namespace tessel::rt {

uint32_t crc32c(const void *data, size_t size) {
  static const auto table = [] {
    std::vector<uint32_t> t(256);
    for (uint32_t i = 0; i < 256; i++) {
      uint32_t c = i;
      for (int k = 0; k < 8; k++)
        c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t crc = 0xFFFFFFFFu;
  const auto *p = static_cast<const unsigned char *>(data);
  for (size_t i = 0; i < size; i++)
    crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

namespace {

uint32_t masked(uint32_t crc) {
  return ((crc >> 15) | (crc << 17)) + 0xA282EAD8u;
}

// Protocol buffer wire format: a field's key is (number << 3) | type.
void varint(std::string &out, uint64_t v) {
  while (v >= 0x80) {
    out += (char)(v | 0x80);
    v >>= 7;
  }
  out += (char)v;
}
template <typename T> void fixed(std::string &out, T v) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T)); // little-endian hosts
  out.append(bytes, sizeof(T));
}
void lengthDelimited(std::string &out, int field, const std::string &body) {
  varint(out, (uint64_t)field << 3 | 2);
  varint(out, body.size());
  out += body;
}

// tensorflow.Event: wall_time = 1 (double), step = 2 (int64),
// file_version = 3 (string), summary = 5 (Summary).
std::string event(int64_t step) {
  std::string e;
  double now = std::chrono::duration<double>(
                   std::chrono::system_clock::now().time_since_epoch())
                   .count();
  varint(e, 1 << 3 | 1);
  fixed(e, now);
  varint(e, 2 << 3 | 0);
  varint(e, (uint64_t)step);
  return e;
}

} // namespace

TensorBoardWriter::TensorBoardWriter(const std::string &dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    throw std::runtime_error("--tensorboard: cannot create '" + dir +
                             "': " + ec.message());
  char host[256] = "host";
  gethostname(host, sizeof(host) - 1);
  long seconds = (long)std::chrono::duration_cast<std::chrono::seconds>(
                     std::chrono::system_clock::now().time_since_epoch())
                     .count();
  file = dir + "/events.out.tfevents." + std::to_string(seconds) + "." +
         host + ".tessel";
  out = std::fopen(file.c_str(), "wb");
  if (!out)
    throw std::runtime_error("--tensorboard: cannot create '" + file +
                             "': " + std::strerror(errno));
  std::string first = event(0);
  lengthDelimited(first, 3, "brain.Event:2");
  record(first);
}

TensorBoardWriter::~TensorBoardWriter() {
  if (out)
    std::fclose(out);
}

void TensorBoardWriter::record(const std::string &data) {
  std::string frame;
  uint64_t length = data.size();
  fixed(frame, length);
  fixed(frame, masked(crc32c(&length, sizeof(length))));
  frame += data;
  fixed(frame, masked(crc32c(data.data(), data.size())));
  if (std::fwrite(frame.data(), 1, frame.size(), out) != frame.size() ||
      std::fflush(out) != 0)
    throw std::runtime_error("--tensorboard: cannot write '" + file +
                             "': " + std::strerror(errno));
}

void TensorBoardWriter::scalars(
    int64_t step, const std::vector<std::pair<std::string, double>> &values) {
  // Summary: value = 1 (repeated Value); Value: tag = 1 (string),
  // simple_value = 2 (float).
  std::string summary;
  for (const auto &[tag, v] : values) {
    std::string value;
    lengthDelimited(value, 1, tag);
    varint(value, 2 << 3 | 5);
    fixed(value, (float)v);
    lengthDelimited(summary, 1, value);
  }
  std::string e = event(step);
  lengthDelimited(e, 5, summary);
  record(e);
}

} // namespace tessel::rt
