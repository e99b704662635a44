//===- Safetensors.cpp - Reading and writing .safetensors files -----------===//

#include "tessel/Runtime/Safetensors.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <set>
#include <stdexcept>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace tessel::rt {

namespace {

[[noreturn]] void fail(const std::string &message) {
  throw std::runtime_error(message);
}

std::string inQuotes(const std::string &s) { return "'" + s + "'"; }

// Bytes per element of every dtype the format defines; 0 for unknown.
size_t dtypeSize(const std::string &dtype) {
  static const std::map<std::string, size_t> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
      {"U32", 4},  {"F32", 4}, {"I64", 8}, {"U64", 8},     {"F64", 8}};
  auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

// Header lengths above this are treated as corruption (the reference
// implementation uses the same limit).
constexpr uint64_t kMaxHeaderBytes = 100u << 20;

} // namespace

float halfToFloat(uint16_t bits) {
  uint32_t sign = (uint32_t)(bits >> 15) << 31;
  uint32_t exponent = (bits >> 10) & 0x1F;
  uint32_t mantissa = bits & 0x3FF;
  uint32_t out;
  if (exponent == 0x1F) {
    out = sign | 0x7F800000u | (mantissa << 13); // inf or NaN
  } else if (exponent != 0) {
    out = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    out = sign; // signed zero
  } else {
    // Subnormal: mantissa * 2^-24, exact in float.
    float value = std::ldexp((float)mantissa, -24);
    return sign ? -value : value;
  }
  float f;
  std::memcpy(&f, &out, sizeof(f));
  return f;
}

float bfloat16ToFloat(uint16_t bits) {
  uint32_t out = (uint32_t)bits << 16;
  float f;
  std::memcpy(&f, &out, sizeof(f));
  return f;
}

std::string formatShape(const std::vector<int64_t> &shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); i++)
    s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

//===----------------------------------------------------------------------===//
// SafetensorsReader
//===----------------------------------------------------------------------===//

SafetensorsReader::SafetensorsReader(const std::string &path) : filePath(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    fail("cannot open safetensors file " + inQuotes(path) + ": " +
         std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    fail("cannot stat " + inQuotes(path) + ": " + std::strerror(err));
  }
  size_t fileBytes = (size_t)st.st_size;
  if (fileBytes < 8) {
    ::close(fd);
    fail("safetensors file " + inQuotes(path) + " is too small (" +
         std::to_string(fileBytes) + " bytes) to hold the header length");
  }
  void *map = ::mmap(nullptr, fileBytes, PROT_READ, MAP_PRIVATE, fd, 0);
  int mapErr = errno;
  ::close(fd);
  if (map == MAP_FAILED)
    fail("cannot map " + inQuotes(path) + ": " + std::strerror(mapErr));
  mapping = map;
  mappingBytes = fileBytes;

  // From here on, errors must unmap: the destructor does not run when the
  // constructor throws.
  try {
    const unsigned char *bytes = (const unsigned char *)map;
    uint64_t headerBytes = 0;
    for (int i = 7; i >= 0; i--)
      headerBytes = (headerBytes << 8) | bytes[i];
    if (headerBytes > kMaxHeaderBytes || headerBytes > fileBytes - 8)
      fail("safetensors file " + inQuotes(path) + ": header length " +
           std::to_string(headerBytes) + " exceeds the file size (" +
           std::to_string(fileBytes) + " bytes)");
    data = bytes + 8 + headerBytes;
    size_t dataBytes = fileBytes - 8 - headerBytes;

    nlohmann::json header;
    try {
      header = nlohmann::json::parse(bytes + 8, bytes + 8 + headerBytes);
    } catch (const nlohmann::json::exception &e) {
      fail("safetensors file " + inQuotes(path) +
           ": invalid JSON header: " + e.what());
    }
    if (!header.is_object())
      fail("safetensors file " + inQuotes(path) +
           ": the header is not a JSON object");

    for (auto it = header.begin(); it != header.end(); ++it) {
      const std::string &name = it.key();
      const nlohmann::json &entry = it.value();
      std::string where =
          "safetensors file " + inQuotes(path) + ", tensor " + inQuotes(name);
      if (name == "__metadata__") {
        if (!entry.is_object())
          fail("safetensors file " + inQuotes(path) +
               ": __metadata__ is not an object");
        for (auto m = entry.begin(); m != entry.end(); ++m)
          meta[m.key()] = m.value().is_string() ? m.value().get<std::string>()
                                                : m.value().dump();
        continue;
      }
      if (!entry.is_object())
        fail(where + ": entry is not an object");
      if (!entry.contains("dtype") || !entry["dtype"].is_string())
        fail(where + ": missing or non-string \"dtype\"");
      if (!entry.contains("shape") || !entry["shape"].is_array())
        fail(where + ": missing or non-array \"shape\"");
      if (!entry.contains("data_offsets") ||
          !entry["data_offsets"].is_array() ||
          entry["data_offsets"].size() != 2)
        fail(where + ": \"data_offsets\" must be an array [begin, end]");

      SafetensorInfo info;
      info.dtype = entry["dtype"].get<std::string>();
      size_t elemBytes = dtypeSize(info.dtype);
      if (elemBytes == 0)
        fail(where + ": unknown dtype " + inQuotes(info.dtype));
      uint64_t numel = 1;
      for (const auto &dim : entry["shape"]) {
        if (!dim.is_number_integer() || dim.get<int64_t>() < 0)
          fail(where + ": shape entries must be non-negative integers, got " +
               dim.dump());
        uint64_t d = dim.get<uint64_t>();
        if (d != 0 && numel > (uint64_t)INT64_MAX / d)
          fail(where + ": shape " + entry["shape"].dump() + " is too large");
        numel *= d;
        info.shape.push_back((int64_t)d);
      }
      info.numel = (int64_t)numel;
      for (const auto &offset : entry["data_offsets"])
        if (!offset.is_number_integer() || offset.get<int64_t>() < 0)
          fail(where + ": data_offsets must be non-negative integers, got " +
               entry["data_offsets"].dump());
      uint64_t begin = entry["data_offsets"][0].get<uint64_t>();
      uint64_t end = entry["data_offsets"][1].get<uint64_t>();
      if (begin > end || end > dataBytes)
        fail(where + ": data_offsets [" + std::to_string(begin) + ", " +
             std::to_string(end) + "] lie outside the data region of " +
             std::to_string(dataBytes) + " bytes");
      if (numel > (uint64_t)INT64_MAX / elemBytes ||
          end - begin != numel * elemBytes)
        fail(where + ": data_offsets [" + std::to_string(begin) + ", " +
             std::to_string(end) + "] hold " + std::to_string(end - begin) +
             " bytes, but dtype " + info.dtype + " with shape " +
             formatShape(info.shape) + " needs " +
             std::to_string(numel * elemBytes));
      info.begin = begin;
      info.end = end;
      tensors[name] = std::move(info);
    }

    // No two tensors may share bytes.
    std::vector<std::pair<size_t, const std::string *>> starts;
    for (const auto &[name, info] : tensors)
      if (info.end > info.begin)
        starts.push_back({info.begin, &name});
    std::sort(starts.begin(), starts.end());
    for (size_t i = 1; i < starts.size(); i++) {
      const SafetensorInfo &prev = tensors.at(*starts[i - 1].second);
      if (prev.end > starts[i].first)
        fail("safetensors file " + inQuotes(path) + ": tensors " +
             inQuotes(*starts[i - 1].second) + " and " +
             inQuotes(*starts[i].second) + " overlap");
    }
  } catch (...) {
    ::munmap(mapping, mappingBytes);
    mapping = nullptr;
    throw;
  }
}

SafetensorsReader::~SafetensorsReader() {
  if (mapping)
    ::munmap(mapping, mappingBytes);
}

void SafetensorsReader::release(const std::string &name) const {
  const SafetensorInfo &t = info(name);
  const size_t page = (size_t)::sysconf(_SC_PAGESIZE);
  size_t begin = (size_t)(data - (const unsigned char *)mapping) + t.begin;
  size_t end = begin + (size_t)(t.end - t.begin);
  begin = begin / page * page;
  end = std::min(mappingBytes, (end + page - 1) / page * page);
  if (end > begin)
    ::madvise((char *)mapping + begin, end - begin, MADV_DONTNEED);
}

std::vector<std::string> SafetensorsReader::names() const {
  std::vector<std::string> out;
  for (const auto &entry : tensors)
    out.push_back(entry.first);
  return out;
}

const SafetensorInfo &SafetensorsReader::info(const std::string &name) const {
  auto it = tensors.find(name);
  if (it == tensors.end())
    fail("safetensors file " + inQuotes(filePath) + " has no tensor " +
         inQuotes(name));
  return it->second;
}

void SafetensorsReader::read(const std::string &name, float *out) const {
  const SafetensorInfo &t = info(name);
  const unsigned char *src = data + t.begin;
  int64_t n = t.numel;
  if (t.dtype == "F32") {
    std::memcpy(out, src, (size_t)n * sizeof(float));
  } else if (t.dtype == "F64") {
    for (int64_t i = 0; i < n; i++) {
      double d;
      std::memcpy(&d, src + 8 * i, sizeof(d));
      out[i] = (float)d;
    }
  } else if (t.dtype == "F16" || t.dtype == "BF16") {
    bool bf16 = t.dtype == "BF16";
    for (int64_t i = 0; i < n; i++) {
      uint16_t bits = (uint16_t)(src[2 * i] | (src[2 * i + 1] << 8));
      out[i] = bf16 ? bfloat16ToFloat(bits) : halfToFloat(bits);
    }
  } else {
    fail("safetensors file " + inQuotes(filePath) + ", tensor " +
         inQuotes(name) + ": dtype " + t.dtype +
         " cannot be read as float (supported: F32, F16, BF16, F64)");
  }
}

std::vector<float> SafetensorsReader::read(const std::string &name) const {
  std::vector<float> out((size_t)info(name).numel);
  read(name, out.data());
  return out;
}

//===----------------------------------------------------------------------===//
// Writing
//===----------------------------------------------------------------------===//

namespace {
// The header's length and the header, padded (writeSafetensors).
std::string safetensorsPrefix(const std::string &path,
                              const std::vector<SafetensorView> &tensors,
                              const std::map<std::string, std::string> &metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  nlohmann::ordered_json meta = nlohmann::ordered_json::object();
  meta["format"] = "pt";
  for (const auto &[key, value] : metadata)
    meta[key] = value;
  header["__metadata__"] = meta;

  std::set<std::string> seen;
  uint64_t offset = 0;
  for (const SafetensorView &t : tensors) {
    if (t.name == "__metadata__" || !seen.insert(t.name).second)
      fail("cannot write " + inQuotes(path) +
           ": duplicate or reserved tensor "
           "name " +
           inQuotes(t.name));
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0)
        fail("cannot write " + inQuotes(path) + ": tensor " + inQuotes(t.name) +
             " has negative shape " + formatShape(t.shape));
      numel *= (uint64_t)d;
    }
    nlohmann::ordered_json entry;
    entry["dtype"] = "F32";
    entry["shape"] = t.shape;
    entry["data_offsets"] = {offset, offset + numel * 4};
    header[t.name] = entry;
    offset += numel * 4;
  }
  std::string text = header.dump();
  // Pad with spaces so the data region starts 8-byte aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string prefix(8, '\0');
  for (int i = 0; i < 8; i++)
    prefix[i] = (char)(unsigned char)((uint64_t)text.size() >> (8 * i));
  return prefix + text;
}
} // namespace

void checkReplaceable(const std::string &path, const std::string &what) {
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    fail("cannot write " + what + " " + inQuotes(path) + ": it is " +
         (S_ISDIR(st.st_mode) ? std::string("a directory")
                              : std::string("not a regular file (a device or "
                                            "a pipe)")) +
         "; the file is written whole under a temporary name and renamed "
         "into place (give a file name)");
}

SafetensorsWriter::SafetensorsWriter(
    const std::string &path, const std::vector<SafetensorView> &tensors,
    const std::map<std::string, std::string> &metadata)
    : path(path), tmp(path + ".tmp." + std::to_string(::getpid())),
      prefix(safetensorsPrefix(path, tensors, metadata)) {
  checkReplaceable(path, "the safetensors file");
  for (const SafetensorView &t : tensors) {
    size_t numel = 1;
    for (int64_t d : t.shape)
      numel *= (size_t)d;
    names.push_back(t.name);
    sizes.push_back(numel);
  }
  file = std::fopen(tmp.c_str(), "wb");
  if (!file)
    fail("cannot create " + inQuotes(tmp) + ": " + std::strerror(errno));
  if (std::fwrite(prefix.data(), 1, prefix.size(), file) != prefix.size())
    fail("cannot write " + inQuotes(path) + ": " + std::strerror(errno));
}

SafetensorsWriter::~SafetensorsWriter() {
  if (file) {
    std::fclose(file);
    std::remove(tmp.c_str());
  }
}

void SafetensorsWriter::write(const float *data) {
  if (!file || next >= sizes.size())
    fail("cannot write " + inQuotes(path) +
         ": more tensors than its header "
         "lists");
  size_t numel = sizes[next];
  const std::string &name = names[next++];
  if (numel > 0 && !data)
    fail("cannot write " + inQuotes(path) + ": tensor " + inQuotes(name) +
         " has no data");
  if (numel > 0 && std::fwrite(data, sizeof(float), numel, file) != numel)
    fail("cannot write " + inQuotes(path) + ": " + std::strerror(errno));
}

std::string SafetensorsWriter::commit() {
  if (!file || next != sizes.size())
    fail("cannot write " + inQuotes(path) + ": " +
         std::to_string(sizes.size() - next) + " of its tensors missing");
  // On the disk before it takes the name: a crash after the rename leaves
  // the whole file or the previous one, never a torn one.
  errno = 0;
  bool ok = std::fflush(file) == 0 && ::fsync(::fileno(file)) == 0;
  int err = errno;
  ok = (std::fclose(file) == 0) && ok;
  file = nullptr;
  if (!ok) {
    err = err ? err : errno;
    std::remove(tmp.c_str());
    fail("cannot write " + inQuotes(path) + ": " + std::strerror(err));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    err = errno;
    std::remove(tmp.c_str());
    fail("cannot rename " + inQuotes(tmp) + " to " + inQuotes(path) + ": " +
         std::strerror(err));
  }
  // And the directory entry too.
  std::string dir = path.substr(0, path.find_last_of('/') + 1);
  int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
  return prefix;
}

std::string
writeSafetensors(const std::string &path,
                 const std::vector<SafetensorView> &tensors,
                 const std::map<std::string, std::string> &metadata) {
  SafetensorsWriter writer(path, tensors, metadata);
  for (const SafetensorView &t : tensors)
    writer.write(t.data);
  return writer.commit();
}

} // namespace tessel::rt
