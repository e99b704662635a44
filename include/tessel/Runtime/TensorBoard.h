//===- TensorBoard.h - Scalars as a TensorBoard event file -----*- C++ -*-===//
//
// `tessel run --tensorboard DIR` writes DIR/events.out.tfevents.TIME.HOST,
// which TensorBoard reads: TFRecord framing (little-endian length, masked
// CRC-32C of the length, the record, masked CRC-32C of the record) around
// tensorflow.Event protocol buffers: the first carries file_version
// "brain.Event:2", each after it a step's scalars as Summary values
// (tag, simple_value). docs/metrics.md describes the encoding.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_RUNTIME_TENSORBOARD_H
#define TESSEL_RUNTIME_TENSORBOARD_H

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace tessel::rt {

// CRC-32C (Castagnoli), as TFRecord frames records with.
uint32_t crc32c(const void *data, size_t size);

class TensorBoardWriter {
public:
  // Creates DIR (and its parents) and the event file in it; throws naming
  // the path and the error.
  explicit TensorBoardWriter(const std::string &dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter &) = delete;
  TensorBoardWriter &operator=(const TensorBoardWriter &) = delete;

  // One event at `step` (0-based, as in the metrics) with these scalars;
  // flushed, so a running TensorBoard sees it. Throws on a write error.
  void scalars(int64_t step,
               const std::vector<std::pair<std::string, double>> &values);
  const std::string &path() const { return file; }

private:
  void record(const std::string &event);
  std::string file;
  FILE *out = nullptr;
};

} // namespace tessel::rt

#endif
