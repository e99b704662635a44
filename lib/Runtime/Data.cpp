//===- Data.cpp - Token files and the training batch rule -----------------===//

#include "tessel/Runtime/Data.h"
#include "tessel/Runtime/Init.h"
#include "tessel/Runtime/Safetensors.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include <fcntl.h>
#include <fstream>
#include <nlohmann/json.hpp>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace tessel::rt {

namespace {

[[noreturn]] void fail(const std::string &message) {
  throw std::runtime_error(message);
}

std::string inQuotes(const std::string &path) { return "'" + path + "'"; }

// splitmix64: a tiny, portable generator whose output is the same everywhere.
struct SplitMix64 {
  uint64_t state;
  explicit SplitMix64(uint64_t seed) : state(seed) {}
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return (double)(next() >> 11) * 0x1.0p-53; }
  // Uniform integer in [0, n); the modulo bias is negligible for small n.
  int64_t below(int64_t n) { return (int64_t)(next() % (uint64_t)n); }
};

} // namespace

//===----------------------------------------------------------------------===//
// TokenData
//===----------------------------------------------------------------------===//

namespace {

bool exists(const std::string &path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool endsWith(const std::string &s, const std::string &tail) {
  return s.size() >= tail.size() &&
         s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// The file mapped read-only, with its size; throws naming it.
std::pair<void *, size_t> mapFile(const std::string &path, const char *what) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    fail(std::string("cannot open ") + what + " " + inQuotes(path) + ": " +
         std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    fail(std::string("cannot stat ") + what + " " + inQuotes(path) + ": " +
         std::strerror(err));
  }
  size_t bytes = (size_t)st.st_size;
  void *mapping = bytes ? ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd, 0)
                        : nullptr;
  int err = errno;
  ::close(fd);
  if (mapping == MAP_FAILED)
    fail(std::string("cannot map ") + what + " " + inQuotes(path) + ": " +
         std::strerror(err));
  return {mapping, bytes};
}

} // namespace

namespace {

// What a Megatron index says: the token type and the tokens in all.
struct MegatronIndex {
  uint8_t code = 0;
  int width = 0;
  uint64_t sequences = 0, documents = 0;
  int64_t tokens = 0;
};

// Reads and checks PREFIX.idx (not the tokens).
MegatronIndex readMegatronIndex(const std::string &prefix) {
  std::string idxPath = prefix + ".idx";
  auto [idx, idxBytes] = mapFile(idxPath, "Megatron index");
  // The index is read once, here; only the tokens stay mapped.
  std::vector<char> index((const char *)idx, (const char *)idx + idxBytes);
  if (idx)
    ::munmap(idx, idxBytes);
  auto bad = [&](const std::string &what) {
    fail("Megatron index " + inQuotes(idxPath) + ": " + what);
  };
  const char magic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
  const size_t head = 9 + 8 + 1 + 8 + 8;
  if (index.size() < head || std::memcmp(index.data(), magic, 9) != 0)
    bad("does not start with MMIDIDX (not a Megatron indexed dataset)");
  MegatronIndex m;
  uint64_t version;
  uint64_t &sequences = m.sequences, &documents = m.documents;
  std::memcpy(&version, index.data() + 9, 8);
  uint8_t code = m.code = (uint8_t)index[17];
  std::memcpy(&sequences, index.data() + 18, 8);
  std::memcpy(&documents, index.data() + 26, 8);
  if (version != 1)
    bad("version " + std::to_string(version) + " (this build reads 1)");
  // Megatron's dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
  // 6 float64, 7 float32, 8 uint16.
  int width = m.width =
      code == 1 ? 1 : code == 3 || code == 8 ? 2 : code == 4 ? 4 : 0;
  if (!width)
    bad("dtype code " + std::to_string(code) +
        " is not a token type this build reads (1 uint8, 3 int16, 4 int32, "
        "8 uint16)");
  if (sequences > (index.size() - head) / 12 ||
      head + sequences * 12 + documents * 8 != index.size())
    bad("its size (" + std::to_string(index.size()) + " bytes) does not fit " +
        std::to_string(sequences) + " sequences and " +
        std::to_string(documents) + " document entries");
  const char *lengths = index.data() + head;
  const char *pointers = lengths + sequences * 4;
  int64_t total = 0;
  for (uint64_t k = 0; k < sequences; ++k) {
    int32_t length;
    int64_t pointer;
    std::memcpy(&length, lengths + k * 4, 4);
    std::memcpy(&pointer, pointers + k * 8, 8);
    if (length < 0 || pointer != total * width)
      bad("sequence " + std::to_string(k) + " (length " +
          std::to_string(length) + ", offset " + std::to_string(pointer) +
          ") does not follow the one before it in the .bin");
    total += length;
  }
  m.tokens = total;
  return m;
}

} // namespace

TokenData TokenData::fromMegatron(const std::string &prefix, int64_t vocab) {
  if (vocab <= 0)
    fail("dataset " + inQuotes(prefix) + ": vocabulary size must be positive");
  MegatronIndex index = readMegatronIndex(prefix);
  uint8_t code = index.code;
  int width = index.width;
  int64_t total = index.tokens;
  std::string binPath = prefix + ".bin";
  auto [bin, binBytes] = mapFile(binPath, "Megatron data file");
  TokenData data;
  data.source = prefix;
  const char *type = code == 1 ? "uint8" : code == 3 ? "int16"
                     : code == 8 ? "uint16" : "int32";
  data.description = std::string("Megatron dataset (") + type + ", " +
                     std::to_string(index.sequences) + " sequences, " +
                     std::to_string(index.documents ? index.documents - 1 : 0) +
                     " documents)";
  data.mapping = bin;
  data.mappingBytes = binBytes;
  data.width = width;
  if ((int64_t)binBytes != total * width)
    fail("Megatron data file " + inQuotes(binPath) + " has " +
         std::to_string(binBytes) + " bytes; its index says " +
         std::to_string(total) + " tokens of " + std::to_string(width) +
         (width == 1 ? " byte" : " bytes"));
  data.count = total;
  data.base = bin;
  for (int64_t i = 0; i < total; i++) {
    int64_t token = data.at(i);
    if (code == 3 && token >= 32768)
      token -= 65536;
    if (token < 0 || token >= vocab)
      fail("dataset " + inQuotes(prefix) + ": token " + std::to_string(token) +
           " at position " + std::to_string(i) +
           " is out of range for vocabulary size " + std::to_string(vocab));
  }
  return data;
}

struct TokenData::Shards {
  std::vector<std::string> paths;
  std::vector<int64_t> begin; // each shard's first token; then the total
  int64_t vocab = 0;
  std::mutex mutex;
  std::vector<std::unique_ptr<TokenData>> open; // null until reached

  const TokenData &shard(size_t k) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!open[k]) {
      auto data = std::make_unique<TokenData>(fromFile(paths[k], vocab));
      if (data->size() != begin[k + 1] - begin[k])
        fail("shard " + inQuotes(paths[k]) + " holds " +
             std::to_string(data->size()) + " tokens; its header said " +
             std::to_string(begin[k + 1] - begin[k]) +
             " when the run started (was it changed?)");
      open[k] = std::move(data);
    }
    return *open[k];
  }
};

struct TokenData::Blend {
  std::vector<std::unique_ptr<TokenData>> parts;
  std::vector<std::string> paths;
  std::vector<double> weights; // normalised
  std::mutex mutex;
  int64_t drawn = 0;           // draws made so far
  std::vector<int64_t> counts; // per dataset, of those draws
  // The latest draws, so that readers a few steps apart (the prefetcher,
  // --record-samples) do not start again from the first draw.
  std::deque<std::pair<int64_t, int64_t>> recent;
};

TokenData TokenData::fromBlend(const std::string &path, int64_t vocab) {
  std::ifstream in(path);
  if (!in)
    fail("cannot open the blend " + inQuotes(path) + ": " +
         std::strerror(errno));
  nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  if (!j.is_object() || !j.contains("blend") || !j["blend"].is_array() ||
      j["blend"].empty())
    fail("blend " + inQuotes(path) +
         ": expected {\"blend\": [{\"path\": ..., \"weight\": ...}, ...]}");
  auto blend = std::make_shared<Blend>();
  double total = 0;
  for (const nlohmann::json &e : j["blend"]) {
    if (!e.is_object() || !e.contains("path") || !e["path"].is_string() ||
        !e.contains("weight") || !e["weight"].is_number() ||
        e["weight"].get<double>() <= 0)
      fail("blend " + inQuotes(path) + ": an entry is not {\"path\": a "
           "string, \"weight\": a number > 0}: " + e.dump());
    blend->paths.push_back(e["path"].get<std::string>());
    blend->parts.push_back(
        std::make_unique<TokenData>(fromFile(blend->paths.back(), vocab)));
    blend->weights.push_back(e["weight"].get<double>());
    total += blend->weights.back();
  }
  for (double &w : blend->weights)
    w /= total;
  blend->counts.assign(blend->parts.size(), 0);
  TokenData data;
  data.source = path;
  data.description = "blend of " + std::to_string(blend->parts.size()) +
                     " datasets (weights";
  for (size_t d = 0; d < blend->weights.size(); ++d) {
    char w[32];
    std::snprintf(w, sizeof(w), "%s %.4g", d ? "," : "", blend->weights[d]);
    data.description += w;
  }
  data.description += ")";
  for (const auto &part : blend->parts)
    data.count += part->size();
  data.blend = std::move(blend);
  return data;
}

std::pair<int64_t, int64_t> TokenData::blendDraw(int64_t g) const {
  Blend &b = *blend;
  std::lock_guard<std::mutex> lock(b.mutex);
  if (g < b.drawn && g >= b.drawn - (int64_t)b.recent.size())
    return b.recent[b.recent.size() - (size_t)(b.drawn - g)];
  if (g < b.drawn) {
    b.drawn = 0;
    std::fill(b.counts.begin(), b.counts.end(), 0);
    b.recent.clear();
  }
  while (true) {
    size_t best = 0;
    double bestError = -1e300;
    for (size_t d = 0; d < b.weights.size(); ++d) {
      double error = b.weights[d] * (double)(b.drawn + 1) - (double)b.counts[d];
      if (error > bestError) {
        bestError = error;
        best = d;
      }
    }
    int64_t index = b.counts[best]++;
    b.recent.push_back({(int64_t)best, index});
    if (b.recent.size() > (1u << 16))
      b.recent.pop_front();
    if (b.drawn++ == g)
      return {(int64_t)best, index};
  }
}

namespace {

// A shard's token count from its header alone (llm.c) or its index
// (Megatron), without reading or checking its tokens.
int64_t shardTokens(const std::string &path) {
  if (exists(path + ".idx") || endsWith(path, ".idx"))
    return readMegatronIndex(endsWith(path, ".idx")
                                 ? path.substr(0, path.size() - 4)
                                 : path)
        .tokens;
  FILE *f = std::fopen(path.c_str(), "rb");
  if (!f)
    fail("cannot open token file " + inQuotes(path) + ": " +
         std::strerror(errno));
  int32_t header[kTokenHeaderInts] = {};
  size_t got = std::fread(header, sizeof(int32_t), kTokenHeaderInts, f);
  std::fclose(f);
  if (got != (size_t)kTokenHeaderInts ||
      (header[0] != kTokenMagicU16 && header[0] != kTokenMagicU32) ||
      header[2] < 0)
    fail("token file " + inQuotes(path) +
         ": not an llm.c token file (bad header)");
  return header[2];
}

// The shards a directory or a glob pattern names, sorted by name: llm.c
// files (*.bin) and Megatron prefixes (a .bin with its .idx, once).
std::vector<std::string> shardPaths(const std::string &path) {
  std::vector<std::string> found;
  glob_t matches = {};
  std::string pattern = path;
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
    pattern = path + (endsWith(path, "/") ? "*.bin" : "/*.bin");
  int rc = ::glob(pattern.c_str(), 0, nullptr, &matches);
  if (rc == 0)
    for (size_t k = 0; k < matches.gl_pathc; ++k) {
      std::string file = matches.gl_pathv[k];
      std::string prefix = file.substr(0, file.size() - 4);
      if (endsWith(file, ".idx"))
        continue;
      found.push_back(endsWith(file, ".bin") && exists(prefix + ".idx")
                          ? prefix
                          : file);
    }
  ::globfree(&matches);
  if (found.empty())
    fail(inQuotes(path) + " names no token files (a directory is read as its "
         "*.bin files, a pattern as the files it matches)");
  return found;
}

} // namespace

TokenData TokenData::fromShards(std::vector<std::string> paths, int64_t vocab,
                                std::string name) {
  if (vocab <= 0)
    fail(name + ": vocabulary size must be positive");
  auto shards = std::make_shared<Shards>();
  shards->vocab = vocab;
  shards->begin.push_back(0);
  for (const std::string &path : paths)
    shards->begin.push_back(shards->begin.back() + shardTokens(path));
  shards->open.resize(paths.size());
  shards->paths = std::move(paths);
  TokenData data;
  data.source = std::move(name);
  data.description = std::to_string(shards->paths.size()) + " shards";
  data.count = shards->begin.back();
  data.shards = std::move(shards);
  return data;
}

void TokenData::copyTokens(int64_t start, int64_t n, int32_t *out) const {
  if (!shards) {
    for (int64_t t = 0; t < n; t++)
      out[t] = at(start + t);
    return;
  }
  const std::vector<int64_t> &begin = shards->begin;
  size_t k = std::upper_bound(begin.begin(), begin.end(), start) -
             begin.begin() - 1;
  while (n > 0) {
    const TokenData &shard = shards->shard(k);
    int64_t offset = start - begin[k];
    int64_t take = std::min(n, begin[k + 1] - start);
    for (int64_t t = 0; t < take; t++)
      out[t] = shard.at(offset + t);
    out += take;
    start += take;
    n -= take;
    ++k;
  }
}

TokenData TokenData::fromFile(const std::string &path, int64_t vocab) {
  if (endsWith(path, ".json"))
    return fromBlend(path, vocab);
  // Shards: a directory or a glob pattern.
  struct stat info;
  bool directory = ::stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode);
  if (directory ||
      (path.find_first_of("*?[") != std::string::npos && !exists(path)))
    return fromShards(shardPaths(path), vocab, path);
  // A Megatron dataset: PREFIX, PREFIX.idx or PREFIX.bin with PREFIX.idx.
  for (const char *ext : {".idx", ".bin"})
    if (endsWith(path, ext) &&
        exists(path.substr(0, path.size() - 4) + ".idx"))
      return fromMegatron(path.substr(0, path.size() - 4), vocab);
  if (!exists(path) && exists(path + ".idx"))
    return fromMegatron(path, vocab);
  if (vocab <= 0)
    fail("token file " + inQuotes(path) + ": vocabulary size must be positive");
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    fail("cannot open token file " + inQuotes(path) + ": " +
         std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    fail("cannot stat token file " + inQuotes(path) + ": " +
         std::strerror(err));
  }
  size_t fileBytes = (size_t)st.st_size;
  const size_t headerBytes = kTokenHeaderInts * sizeof(int32_t);
  if (fileBytes < headerBytes) {
    ::close(fd);
    fail("token file " + inQuotes(path) + " is too small (" +
         std::to_string(fileBytes) + " bytes) to hold the " +
         std::to_string(headerBytes) + "-byte header");
  }
  void *mapping = ::mmap(nullptr, fileBytes, PROT_READ, MAP_PRIVATE, fd, 0);
  int mapErr = errno;
  ::close(fd);
  if (mapping == MAP_FAILED)
    fail("cannot map token file " + inQuotes(path) + ": " +
         std::strerror(mapErr));

  TokenData data;
  data.source = path;
  data.mapping = mapping;
  data.mappingBytes = fileBytes;
  data.description = std::string("llm.c token file (") +
                     (((const int32_t *)mapping)[0] == kTokenMagicU16 ? "uint16"
                                                                      : "uint32") +
                     ")";

  int32_t header[kTokenHeaderInts];
  std::memcpy(header, mapping, headerBytes);
  int32_t magic = header[0], version = header[1];
  if (magic == kTokenMagicU16) {
    if (version != kTokenVersionU16)
      fail("token file " + inQuotes(path) + ": magic " + std::to_string(magic) +
           " expects version " + std::to_string(kTokenVersionU16) + ", got " +
           std::to_string(version));
    data.width = 2;
  } else if (magic == kTokenMagicU32) {
    if (version != kTokenVersionU32)
      fail("token file " + inQuotes(path) + ": magic " + std::to_string(magic) +
           " expects version " + std::to_string(kTokenVersionU32) + ", got " +
           std::to_string(version));
    data.width = 4;
  } else {
    fail("token file " + inQuotes(path) + ": bad magic number " +
         std::to_string(magic) + " (expected " +
         std::to_string(kTokenMagicU16) + " or " +
         std::to_string(kTokenMagicU32) + ")");
  }
  // The count is stored as int32; a negative value can only be corruption.
  int64_t count = header[2];
  if (count < 0)
    fail("token file " + inQuotes(path) + ": negative token count " +
         std::to_string(count));
  size_t expected = headerBytes + (size_t)count * (size_t)data.width;
  if (expected != fileBytes) {
    // Tokens of the other width behind this header: a writer's mistake
    // worth naming.
    int otherWidth = 6 - data.width;
    std::string hint =
        headerBytes + (size_t)count * (size_t)otherWidth == fileBytes
            ? std::string("; the size fits ") +
                  (otherWidth == 4 ? "uint32" : "uint16") +
                  " tokens, but the header's magic " + std::to_string(magic) +
                  " says " + (data.width == 4 ? "uint32" : "uint16")
            : std::string();
    fail("token file " + inQuotes(path) + ": header says " +
         std::to_string(count) + " tokens (" + std::to_string(expected) +
         " bytes with the header) but the file has " +
         std::to_string(fileBytes) + " bytes" + hint);
  }
  data.count = count;
  data.base = (const char *)mapping + headerBytes;

  for (int64_t i = 0; i < count; i++) {
    int64_t token = data.width == 2 ? ((const uint16_t *)data.base)[i]
                                    : ((const uint32_t *)data.base)[i];
    if (token >= vocab)
      fail("token file " + inQuotes(path) + ": token " + std::to_string(token) +
           " at position " + std::to_string(i) +
           " is out of range for vocabulary size " + std::to_string(vocab));
  }
  return data;
}

TokenData TokenData::fromTokens(std::vector<int32_t> tokens, int64_t vocab,
                                std::string name) {
  if (vocab <= 0)
    fail(name + ": vocabulary size must be positive");
  TokenData data;
  data.source = std::move(name);
  data.description = "tokens in memory";
  data.owned.resize(tokens.size());
  for (size_t i = 0; i < tokens.size(); i++) {
    if (tokens[i] < 0 || tokens[i] >= vocab)
      fail(data.source + ": token " + std::to_string(tokens[i]) +
           " at position " + std::to_string(i) +
           " is out of range for vocabulary size " + std::to_string(vocab));
    data.owned[i] = (uint32_t)tokens[i];
  }
  data.width = 4;
  data.count = (int64_t)data.owned.size();
  data.base = data.owned.data();
  return data;
}

TokenData::TokenData(TokenData &&other) noexcept { *this = std::move(other); }

TokenData &TokenData::operator=(TokenData &&other) noexcept {
  if (this == &other)
    return *this;
  release();
  source = std::move(other.source);
  description = std::move(other.description);
  width = other.width;
  count = other.count;
  mapping = other.mapping;
  mappingBytes = other.mappingBytes;
  // Moving a vector keeps its buffer, so `base` stays valid.
  owned = std::move(other.owned);
  shards = std::move(other.shards);
  blend = std::move(other.blend);
  shuffled = other.shuffled;
  shuffleSeed = other.shuffleSeed;
  base = other.base;
  other.base = nullptr;
  other.mapping = nullptr;
  other.mappingBytes = 0;
  other.count = 0;
  return *this;
}

TokenData::~TokenData() { release(); }

void TokenData::release() {
  if (mapping)
    ::munmap(mapping, mappingBytes);
  mapping = nullptr;
  mappingBytes = 0;
  base = nullptr;
  count = 0;
  owned.clear();
}

int64_t TokenData::numSamples(int64_t T) const {
  if (T <= 0 || count < 1)
    return 0;
  return (count - 1) / T;
}

int64_t permute(int64_t index, int64_t n, uint64_t seed, int64_t epoch) {
  if (n <= 1)
    return 0;
  int half = 1;
  while ((uint64_t)1 << (2 * half) < (uint64_t)n)
    ++half;
  uint64_t mask = ((uint64_t)1 << half) - 1;
  uint64_t keys[4];
  uint64_t k = mix64(seed ^ mix64((uint64_t)epoch));
  for (uint64_t &key : keys)
    key = k = mix64(k);
  uint64_t x = (uint64_t)index;
  do {
    uint64_t left = x >> half, right = x & mask;
    for (uint64_t key : keys) {
      uint64_t next = left ^ (mix64(right ^ key) & mask);
      left = right;
      right = next;
    }
    x = (left << half) | right;
  } while (x >= (uint64_t)n);
  return (int64_t)x;
}

std::string TokenData::describeSample(int64_t g, int64_t T) const {
  if (!blend)
    return std::to_string(sampleOf(g, T));
  auto [d, c] = blendDraw(g);
  return "[" + std::to_string(d) + ", " +
         std::to_string(blend->parts[d]->sampleOf(c, T)) + "]";
}

void TokenData::shuffle(uint64_t seed) {
  shuffled = true;
  shuffleSeed = seed;
  // A blend's datasets each in an order of their own.
  if (blend)
    for (size_t d = 0; d < blend->parts.size(); ++d)
      blend->parts[d]->shuffle(mix64(seed ^ mix64(d + 1)));
}

int64_t TokenData::sampleOf(int64_t g, int64_t T) const {
  int64_t n = numSamples(T);
  if (!shuffled)
    return g % n;
  return permute(g % n, n, shuffleSeed, g / n);
}

void TokenData::rowsForStep(int64_t step, int64_t B, int64_t first,
                            int64_t rows, int64_t T, int32_t *inputs,
                            int32_t *targets) const {
  if (step < 0 || B <= 0 || T <= 0 || first < 0 || rows < 0 ||
      first + rows > B)
    fail(source + ": invalid batch request (step " + std::to_string(step) +
         ", rows " + std::to_string(first) + " to " +
         std::to_string(first + rows) + " of " + std::to_string(B) +
         ", sequence length " + std::to_string(T) + ")");
  if (numSamples(T) == 0)
    fail(source + " has " + std::to_string(count) + " tokens, fewer than the " +
         std::to_string(T + 1) + " needed for one sequence of length " +
         std::to_string(T));
  std::vector<int32_t> window(T + 1);
  if (blend) {
    for (int64_t i = 0; i < rows; i++) {
      auto [d, c] = blendDraw(step * B + first + i);
      const TokenData &part = *blend->parts[d];
      int64_t n = part.numSamples(T);
      if (n == 0)
        fail(part.name() + " (in the blend " + inQuotes(source) + ") has " +
             std::to_string(part.size()) + " tokens, fewer than the " +
             std::to_string(T + 1) + " needed for one sequence");
      part.copyTokens(part.sampleOf(c, T) * T, T + 1, window.data());
      std::copy_n(window.begin(), T, inputs + i * T);
      std::copy_n(window.begin() + 1, T, targets + i * T);
    }
    return;
  }
  for (int64_t i = 0; i < rows; i++) {
    // Steps times batch stays far below 2^63 for any run this reads.
    int64_t start = sampleOf(step * B + first + i, T) * T;
    copyTokens(start, T + 1, window.data());
    std::copy_n(window.begin(), T, inputs + i * T);
    std::copy_n(window.begin() + 1, T, targets + i * T);
  }
}

void TokenData::batchForStep(int64_t step, int64_t B, int64_t T,
                             int32_t *inputs, int32_t *targets) const {
  if (shuffled || shards || blend) {
    rowsForStep(step, B, 0, B, T, inputs, targets);
    return;
  }
  if (step < 0 || B <= 0 || T <= 0)
    fail(source + ": invalid batch request (step " + std::to_string(step) +
         ", batch " + std::to_string(B) + ", sequence length " +
         std::to_string(T) + ")");
  int64_t nSamples = numSamples(T);
  if (nSamples == 0)
    fail(source + " has " + std::to_string(count) + " tokens, fewer than the " +
         std::to_string(T + 1) + " needed for one sequence of length " +
         std::to_string(T));
  // (step * B + i) mod nSamples, computed without overflowing step * B.
  int64_t first =
      (int64_t)(((unsigned __int128)step * (uint64_t)B) % (uint64_t)nSamples);
  for (int64_t i = 0; i < B; i++) {
    int64_t j = (first + i) % nSamples;
    int64_t start = j * T;
    for (int64_t t = 0; t < T; t++) {
      inputs[i * T + t] = at(start + t);
      targets[i * T + t] = at(start + t + 1);
    }
  }
}

void TokenData::microbatchRowsForStep(int64_t step, int64_t B, int64_t first,
                                      int64_t rows, int64_t chunks, int64_t T,
                                      int32_t *inputs,
                                      int32_t *targets) const {
  if (chunks <= 1 || rows == B) {
    rowsForStep(step, B, first, rows, T, inputs, targets);
    return;
  }
  if (B % chunks != 0 || rows % chunks != 0 || first % chunks != 0)
    throw std::runtime_error(
        "a batch of " + std::to_string(B) + " rows (this rank's " +
        std::to_string(rows) + " from row " + std::to_string(first) +
        ") does not split into " + std::to_string(chunks) + " microbatches");
  int64_t per = rows / chunks;
  for (int64_t m = 0; m < chunks; ++m)
    rowsForStep(step, B, m * (B / chunks) + first / chunks, per, T,
                inputs + m * per * T, targets + m * per * T);
}

int64_t TokenData::microbatchRow(int64_t i, int64_t B, int64_t first,
                                 int64_t rows, int64_t chunks) {
  if (chunks <= 1 || rows == B)
    return first + i;
  int64_t per = rows / chunks;
  return (i / per) * (B / chunks) + first / chunks + i % per;
}

//===----------------------------------------------------------------------===//
// Prefetching
//===----------------------------------------------------------------------===//

struct BatchPrefetcher::State {
  const TokenData &data;
  int64_t B, first, rows, T, next, last;
  int depth;
  double delayMs;
  int64_t chunks;
  std::mutex mutex;
  std::condition_variable changed;
  struct Batch {
    int64_t step;
    std::vector<int32_t> inputs, targets;
  };
  std::deque<Batch> ready;
  std::vector<Batch> spare; // buffers to reuse
  bool stop = false;
  std::string error;
  std::thread reader;
};

BatchPrefetcher::BatchPrefetcher(const TokenData &data, int64_t B,
                                 int64_t first, int64_t rows, int64_t T,
                                 int64_t firstStep, int64_t lastStep,
                                 int depth, double delayMs, int64_t chunks)
    : state(new State{data, B, first, rows, T, firstStep, lastStep, depth,
                      delayMs, chunks}) {
  if (depth <= 0)
    return;
  State &s = *state;
  s.reader = std::thread([&s] {
    std::unique_lock<std::mutex> lock(s.mutex);
    while (!s.stop && s.next < s.last) {
      if ((int)s.ready.size() >= s.depth) {
        s.changed.wait(lock);
        continue;
      }
      State::Batch batch;
      if (!s.spare.empty()) {
        batch = std::move(s.spare.back());
        s.spare.pop_back();
      }
      batch.step = s.next++;
      lock.unlock();
      std::string error;
      try {
        batch.inputs.resize(s.rows * s.T);
        batch.targets.resize(s.rows * s.T);
        s.data.microbatchRowsForStep(batch.step, s.B, s.first, s.rows,
                                     s.chunks, s.T,
                           batch.inputs.data(), batch.targets.data());
        if (s.delayMs > 0)
          std::this_thread::sleep_for(
              std::chrono::duration<double, std::milli>(s.delayMs));
      } catch (const std::exception &e) {
        error = e.what();
      }
      lock.lock();
      if (!error.empty()) {
        s.error = error;
        s.changed.notify_all();
        return;
      }
      s.ready.push_back(std::move(batch));
      s.changed.notify_all();
    }
  });
}

BatchPrefetcher::~BatchPrefetcher() {
  if (!state->reader.joinable())
    return;
  {
    std::lock_guard<std::mutex> lock(state->mutex);
    state->stop = true;
  }
  state->changed.notify_all();
  state->reader.join();
}

double BatchPrefetcher::get(int64_t step, int32_t *inputs, int32_t *targets) {
  State &s = *state;
  auto start = std::chrono::steady_clock::now();
  if (s.depth <= 0) {
    s.data.microbatchRowsForStep(step, s.B, s.first, s.rows, s.chunks, s.T,
                                 inputs, targets);
    if (s.delayMs > 0)
      std::this_thread::sleep_for(
          std::chrono::duration<double, std::milli>(s.delayMs));
    return std::chrono::duration<double, std::milli>(
               std::chrono::steady_clock::now() - start)
        .count();
  }
  std::unique_lock<std::mutex> lock(s.mutex);
  s.changed.wait(lock, [&] { return !s.ready.empty() || !s.error.empty(); });
  if (s.ready.empty())
    fail(s.error);
  State::Batch batch = std::move(s.ready.front());
  s.ready.pop_front();
  if (batch.step != step)
    fail(s.data.name() + ": the batch of step " + std::to_string(step) +
         " was asked for out of order (step " + std::to_string(batch.step) +
         " is next)");
  std::copy(batch.inputs.begin(), batch.inputs.end(), inputs);
  std::copy(batch.targets.begin(), batch.targets.end(), targets);
  s.spare.push_back(std::move(batch));
  s.changed.notify_all();
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now() - start)
      .count();
}

//===----------------------------------------------------------------------===//
// Writing, byte encoding, synthetic data
//===----------------------------------------------------------------------===//

namespace {

// Writes `parts` one after another to `path` through a temporary file
// beside it, renamed into place only once complete.
void writeAtomically(const std::string &path, const std::string &what,
                     const std::vector<std::pair<const void *, size_t>> &parts) {
  checkReplaceable(path, what);
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  FILE *f = std::fopen(tmp.c_str(), "wb");
  if (!f)
    fail("cannot create " + inQuotes(tmp) + ": " + std::strerror(errno));
  bool ok = true;
  for (auto [data, bytes] : parts)
    ok = ok && (bytes == 0 || std::fwrite(data, bytes, 1, f) == 1);
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) {
    int err = errno;
    std::remove(tmp.c_str());
    fail("cannot write " + what + " " + inQuotes(path) + ": " +
         std::strerror(err));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    std::remove(tmp.c_str());
    fail("cannot rename " + inQuotes(tmp) + " to " + inQuotes(path) + ": " +
         std::strerror(err));
  }
}

// The largest token, after checking that none is negative.
int32_t checkedMaxToken(const std::vector<int32_t> &tokens,
                        const std::string &path) {
  int32_t maxToken = 0;
  for (size_t i = 0; i < tokens.size(); i++) {
    if (tokens[i] < 0)
      fail("cannot write " + inQuotes(path) + ": negative token " +
           std::to_string(tokens[i]) + " at position " + std::to_string(i));
    maxToken = std::max(maxToken, tokens[i]);
  }
  return maxToken;
}

} // namespace

void writeTokenFile(const std::string &path,
                    const std::vector<int32_t> &tokens) {
  if (tokens.size() > (size_t)INT32_MAX)
    fail("cannot write token file " + inQuotes(path) + ": " +
         std::to_string(tokens.size()) +
         " tokens exceed the int32 count in the header");
  bool narrow = checkedMaxToken(tokens, path) < 65536;
  int32_t header[kTokenHeaderInts] = {};
  header[0] = narrow ? kTokenMagicU16 : kTokenMagicU32;
  header[1] = narrow ? kTokenVersionU16 : kTokenVersionU32;
  header[2] = (int32_t)tokens.size();
  std::vector<uint16_t> u16;
  std::vector<uint32_t> u32;
  std::pair<const void *, size_t> body;
  if (narrow) {
    u16.assign(tokens.begin(), tokens.end());
    body = {u16.data(), u16.size() * sizeof(uint16_t)};
  } else {
    u32.assign(tokens.begin(), tokens.end());
    body = {u32.data(), u32.size() * sizeof(uint32_t)};
  }
  writeAtomically(path, "token file", {{header, sizeof(header)}, body});
}

void writeMegatronDataset(const std::string &prefix,
                          const std::vector<int32_t> &tokens,
                          const std::vector<int64_t> &documentEnds) {
  bool narrow = checkedMaxToken(tokens, prefix + ".bin") < 65536;
  int64_t previous = 0;
  for (int64_t end : documentEnds) {
    if (end < previous || end > (int64_t)tokens.size() ||
        end - previous > INT32_MAX)
      fail("cannot write Megatron dataset " + inQuotes(prefix) +
           ": document ends are not increasing within the tokens");
    previous = end;
  }
  if (previous != (int64_t)tokens.size())
    fail("cannot write Megatron dataset " + inQuotes(prefix) +
         ": the last document does not end with the tokens");
  // The tokens: uint16 (dtype code 8) or int32 (code 4).
  int width = narrow ? 2 : 4;
  std::vector<uint16_t> u16;
  std::vector<int32_t> i32;
  std::pair<const void *, size_t> body;
  if (narrow) {
    u16.assign(tokens.begin(), tokens.end());
    body = {u16.data(), u16.size() * 2};
  } else {
    i32 = tokens;
    body = {i32.data(), i32.size() * 4};
  }
  // The index (MMIDIDX version 1): one sequence per document, its length
  // and byte offset, and the document index [0, 1, ..., documents].
  uint64_t sequences = documentEnds.size();
  std::string index("MMIDIDX\0\0", 9);
  auto put = [&](const void *data, size_t bytes) {
    index.append((const char *)data, bytes);
  };
  uint64_t version = 1, documents = sequences + 1;
  uint8_t code = narrow ? 8 : 4;
  put(&version, 8);
  put(&code, 1);
  put(&sequences, 8);
  put(&documents, 8);
  previous = 0;
  for (int64_t end : documentEnds) {
    int32_t length = (int32_t)(end - previous);
    put(&length, 4);
    previous = end;
  }
  previous = 0;
  for (int64_t end : documentEnds) {
    int64_t pointer = previous * width;
    put(&pointer, 8);
    previous = end;
  }
  for (uint64_t d = 0; d < documents; d++) {
    int64_t entry = (int64_t)d;
    put(&entry, 8);
  }
  // The data first: an index names a complete .bin.
  writeAtomically(prefix + ".bin", "Megatron data file", {body});
  writeAtomically(prefix + ".idx", "Megatron index", {{index.data(), index.size()}});
}

std::vector<int32_t> encodeTextBytes(std::string_view text) {
  std::vector<int32_t> tokens(text.size());
  for (size_t i = 0; i < text.size(); i++)
    tokens[i] = (int32_t)(unsigned char)text[i];
  return tokens;
}

std::vector<int32_t> syntheticTokens(int64_t vocab, int64_t count,
                                     uint64_t seed) {
  if (vocab <= 0)
    fail("synthetic data: vocabulary size must be positive");
  if (count < 0)
    fail("synthetic data: token count must be non-negative");
  SplitMix64 rng(seed ^ 0x7E55E1DA7A5EEDull);

  // The alphabet: up to 256 distinct token ids spread over the vocabulary
  // (a partial Fisher-Yates shuffle), so that a model first learns which
  // tokens occur at all, then the transitions between them.
  int64_t A = std::min<int64_t>(vocab, 256);
  std::vector<int32_t> ids(vocab);
  for (int64_t i = 0; i < vocab; i++)
    ids[i] = (int32_t)i;
  for (int64_t i = 0; i < A; i++)
    std::swap(ids[i], ids[i + rng.below(vocab - i)]);
  ids.resize(A);

  // States are Zipf-distributed (weight 1 / (k + 1)), so that even the
  // unigram statistics are far from uniform. Only divisions and additions in
  // a fixed order: the table is identical on every IEEE-754 machine.
  std::vector<double> cdf(A);
  double total = 0;
  for (int64_t k = 0; k < A; k++)
    cdf[k] = total += 1.0 / (double)(k + 1);
  auto zipf = [&]() -> int64_t {
    double u = rng.uniform() * total;
    int64_t k = std::upper_bound(cdf.begin(), cdf.end(), u) - cdf.begin();
    return std::min(k, A - 1);
  };

  // Each state has three likely successors; the rest of the time the next
  // state is a fresh Zipf draw.
  const int kSucc = 3;
  const double cumulative[kSucc] = {0.7, 0.85, 0.95};
  std::vector<int64_t> succ(A * kSucc);
  for (int64_t &s : succ)
    s = zipf();

  // A few phrases that recur verbatim.
  const int kPhrases = 24;
  std::vector<std::vector<int64_t>> phrases(kPhrases);
  for (auto &phrase : phrases) {
    phrase.resize(8 + rng.below(9));
    for (int64_t &s : phrase)
      s = rng.below(A);
  }

  std::vector<int32_t> tokens;
  tokens.reserve(count);
  int64_t state = zipf();
  while ((int64_t)tokens.size() < count) {
    if (rng.uniform() < 0.04) {
      const auto &phrase = phrases[rng.below(kPhrases)];
      for (size_t k = 0; k < phrase.size() && (int64_t)tokens.size() < count;
           k++) {
        state = phrase[k];
        tokens.push_back(ids[state]);
      }
      continue;
    }
    double u = rng.uniform();
    int k = 0;
    while (k < kSucc && u >= cumulative[k])
      k++;
    state = k < kSucc ? succ[state * kSucc + k] : zipf();
    tokens.push_back(ids[state]);
  }
  return tokens;
}

} // namespace tessel::rt
