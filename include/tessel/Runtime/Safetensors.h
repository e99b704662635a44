//===- Safetensors.h - Reading and writing .safetensors files ---*- C++ -*-===//
//
// The format: an 8-byte little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]},
//    "__metadata__": {"key": "value", ...}}
// then the raw little-endian tensor data; offsets are relative to the start
// of the data region.
//
// Reading validates the whole header when the file is opened and converts
// F32, F16, BF16 and F64 tensors to float. Writing produces F32 tensors with
// metadata {"format": "pt"}, atomically (temporary file, then rename).
// All errors are reported by throwing std::runtime_error.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_RUNTIME_SAFETENSORS_H
#define TESSEL_RUNTIME_SAFETENSORS_H

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

namespace tessel::rt {

struct SafetensorInfo {
  std::string dtype; // "F32", "F16", "BF16", "F64", "I64", ...
  std::vector<int64_t> shape;
  int64_t numel = 0;
  size_t begin = 0, end = 0; // byte offsets into the data region
};

// Formats a shape as "[2, 3]" for messages.
std::string formatShape(const std::vector<int64_t> &shape);

// A memory-mapped, validated safetensors file.
class SafetensorsReader {
public:
  // Maps the file and validates the header: its length against the file
  // size, the JSON, every dtype (an unknown one is an error naming the
  // tensor), and that every tensor's offsets lie within the data region,
  // match dtype size * numel, and do not overlap.
  explicit SafetensorsReader(const std::string &path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader &) = delete;
  SafetensorsReader &operator=(const SafetensorsReader &) = delete;

  const std::string &path() const { return filePath; }
  bool contains(const std::string &name) const {
    return tensors.count(name) != 0;
  }
  // Tensor names in sorted order.
  std::vector<std::string> names() const;
  const SafetensorInfo &info(const std::string &name) const;
  const std::map<std::string, std::string> &metadata() const { return meta; }

  // Converts tensor `name` to float into out[0, numel). Throws for a dtype
  // other than F32, F16, BF16 or F64.
  void read(const std::string &name, float *out) const;
  std::vector<float> read(const std::string &name) const;
  // Drops the pages of tensor `name` from this process's resident memory
  // (they are read again from the file if needed): reading many tensors of
  // a large file one after another then holds only the one being read.
  void release(const std::string &name) const;

private:
  std::string filePath;
  void *mapping = nullptr;
  size_t mappingBytes = 0;
  const unsigned char *data = nullptr; // start of the data region
  std::map<std::string, SafetensorInfo> tensors;
  std::map<std::string, std::string> meta;
};

// Hugging Face's Mixtral holds each expert's weights apart: expert `e` of a
// stacked parameter "P.experts.wK" [experts, out, in] is
// "P.experts.<e>.wK.weight" there; "" when `stacked` is not such a name.
inline std::string perExpertName(const std::string &stacked, int64_t e) {
  const std::string marker = ".experts.";
  size_t at = stacked.rfind(marker);
  if (at == std::string::npos ||
      stacked.find('.', at + marker.size()) != std::string::npos)
    return "";
  size_t cut = at + marker.size();
  return stacked.substr(0, cut) + std::to_string(e) + "." +
         stacked.substr(cut) + ".weight";
}

// One tensor to write; `data` holds product(shape) floats.
struct SafetensorView {
  std::string name;
  std::vector<int64_t> shape;
  const float *data;
};

// Throws (naming `path` as `what`) when `path` exists and is not a
// regular file, a device or a pipe (`/dev/stdout`): Tessel writes its files
// whole under a temporary name and renames them into place, which would
// replace it rather than write into it.
void checkReplaceable(const std::string &path, const std::string &what);

// Writes `tensors` as F32, in the given order, with metadata
// {"format": "pt"} plus `metadata`. Names must be unique and must not be
// "__metadata__".
// Returns the bytes the file begins with (the header's length, 8 bytes
// little endian, and the JSON header padded to a multiple of 8); the
// tensors' data follow them, in order.
std::string writeSafetensors(
    const std::string &path, const std::vector<SafetensorView> &tensors,
    const std::map<std::string, std::string> &metadata = {});

// Writes a .safetensors file (F32) tensor by tensor, so that no more than
// one tensor need be in memory: the header, from every tensor's name and
// shape (`data` unused), when constructed; then each tensor's floats, in
// the same order, one write() per tensor; commit() then puts the file
// under its name, synced, as writeSafetensors does. Until then the data
// go to a temporary file next to `path`, which a writer destroyed
// uncommitted removes. Errors throw std::runtime_error naming the file.
class SafetensorsWriter {
public:
  SafetensorsWriter(const std::string &path,
                    const std::vector<SafetensorView> &tensors,
                    const std::map<std::string, std::string> &metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter &) = delete;
  SafetensorsWriter &operator=(const SafetensorsWriter &) = delete;
  // The next tensor's product(shape) floats.
  void write(const float *data);
  // Returns the bytes the file begins with (see writeSafetensors).
  std::string commit();

private:
  std::string path, tmp, prefix;
  std::vector<std::string> names;
  std::vector<size_t> sizes; // each tensor's floats
  size_t next = 0;
  FILE *file = nullptr;
};

// Half-precision decoding, exposed for tests.
float halfToFloat(uint16_t bits);
float bfloat16ToFloat(uint16_t bits);

} // namespace tessel::rt

#endif // TESSEL_RUNTIME_SAFETENSORS_H
