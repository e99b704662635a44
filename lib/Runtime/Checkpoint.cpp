//===- Checkpoint.cpp - Sharded, committed training checkpoints -----------===//
//
// See Checkpoint.h for the layout and the commit protocol.
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Checkpoint.h"

#include "tessel/Runtime/Comm.h"
#include "tessel/Runtime/Safetensors.h"

// Only the C API: keep mpi.h from pulling in the deprecated C++ bindings.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#include <nlohmann/json.hpp>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <memory>
#include <set>
#include <stdexcept>
#include <unistd.h>

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace tessel::rt {

namespace {

std::string inQuotes(const std::string &s) { return "'" + s + "'"; }

std::string stepDirName(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "step-%08" PRId64, step);
  return name;
}

} // namespace

int64_t checkpointStepOf(const std::string &name) {
  if (name.rfind("step-", 0) != 0 || name.size() == 5)
    return -1;
  int64_t step = 0;
  for (size_t k = 5; k < name.size(); ++k) {
    if (name[k] < '0' || name[k] > '9' || step > (INT64_MAX - 9) / 10)
      return -1;
    step = step * 10 + (name[k] - '0');
  }
  return step;
}

namespace {

void fsyncPath(const std::string &path, bool directory) {
  int fd = ::open(path.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd < 0 || ::fsync(fd) != 0) {
    int err = errno;
    if (fd >= 0)
      ::close(fd);
    throw std::runtime_error("cannot sync " + inQuotes(path) + ": " +
                             std::strerror(err));
  }
  ::close(fd);
}

// Writes `text` to path.tmp, syncs it, renames it to `path` and syncs the
// directory: `path` is either the old file or the whole new one.
void writeCommitted(const std::string &path, const std::string &text) {
  std::string tmp = path + ".tmp";
  FILE *f = std::fopen(tmp.c_str(), "w");
  if (!f)
    throw std::runtime_error("cannot write " + inQuotes(tmp) + ": " +
                             std::strerror(errno));
  bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size() &&
            std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
  int err = errno;
  ok = std::fclose(f) == 0 && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    if (!ok || err == 0)
      err = errno;
    std::remove(tmp.c_str());
    throw std::runtime_error("cannot write " + inQuotes(path) + ": " +
                             std::strerror(err));
  }
  fsyncPath(fs::path(path).parent_path().string(), /*directory=*/true);
}

bool multiRank() { return commWorldSize() > 1; }

// Every rank's `text`, on rank 0 (others get an empty list).
std::vector<std::string> gatherText(const std::string &text) {
  if (!multiRank())
    return {text};
  int size = (int)text.size(), ranks = commWorldSize();
  std::vector<int> sizes(ranks), offsets(ranks);
  MPI_Gather(&size, 1, MPI_INT, sizes.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
  int total = 0;
  for (int r = 0; r < ranks; ++r) {
    offsets[r] = total;
    total += sizes[r];
  }
  std::vector<char> all(commRank() == 0 ? std::max(total, 1) : 1);
  MPI_Gatherv(text.data(), size, MPI_CHAR, all.data(), sizes.data(),
              offsets.data(), MPI_CHAR, 0, MPI_COMM_WORLD);
  std::vector<std::string> texts;
  if (commRank() == 0)
    for (int r = 0; r < ranks; ++r)
      texts.emplace_back(all.data() + offsets[r], sizes[r]);
  return texts;
}

// Rank 0's `text` on every rank.
std::string broadcastText(std::string text) {
  if (!multiRank())
    return text;
  int size = (int)text.size();
  MPI_Bcast(&size, 1, MPI_INT, 0, MPI_COMM_WORLD);
  text.resize(size);
  MPI_Bcast(text.data(), size, MPI_CHAR, 0, MPI_COMM_WORLD);
  return text;
}

std::string crcText(uint32_t crc) {
  char text[16];
  std::snprintf(text, sizeof(text), "%08x", crc);
  return text;
}

json parsedOrNull(const std::string &text) {
  return text.empty() ? json() : json::parse(text);
}

uint32_t textCrc(const std::string &text) {
  return (uint32_t)crc32(crc32(0L, Z_NULL, 0), (const Bytef *)text.data(),
                         (uInt)text.size());
}

std::string boxKey(const std::string &tensor, const Box &box) {
  std::string key = tensor + "@";
  for (size_t d = 0; d < box.offsets.size(); ++d)
    key += (d ? "," : "") + std::to_string(box.offsets[d]);
  return key;
}

} // namespace

std::string readTextFile(const std::string &path) {
  FILE *f = std::fopen(path.c_str(), "r");
  if (!f)
    throw std::runtime_error("cannot read " + inQuotes(path) + ": " +
                             std::strerror(errno));
  std::string text;
  char buffer[65536];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), f)) > 0)
    text.append(buffer, n);
  std::fclose(f);
  return text;
}

bool everyRank(bool yes) {
  if (!multiRank())
    return yes;
  int v = yes ? 1 : 0, all = 0;
  MPI_Allreduce(&v, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all != 0;
}

int64_t Box::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes)
    n *= s;
  return n;
}

namespace {
// flatRangeBoxes within the sub-tensor of dimensions d.. whose outer
// indices are fixed in `at`: elements [lo, hi) of it, lo < hi.
void flatBoxesFrom(const std::vector<int64_t> &shape, size_t d,
                   std::vector<int64_t> &at, int64_t lo, int64_t hi,
                   std::vector<Box> &out) {
  int64_t stride = 1; // elements per index of dimension d
  for (size_t k = d + 1; k < shape.size(); ++k)
    stride *= shape[k];
  auto slab = [&](int64_t first, int64_t count) {
    Box box{at, shape};
    for (size_t k = 0; k < d; ++k)
      box.sizes[k] = 1;
    box.offsets[d] = first;
    box.sizes[d] = count;
    out.push_back(std::move(box));
  };
  int64_t first = lo / stride, last = (hi - 1) / stride;
  if (lo % stride == 0 && hi % stride == 0) {
    slab(first, last - first + 1);
    return;
  }
  if (first == last) {
    at[d] = first;
    flatBoxesFrom(shape, d + 1, at, lo - first * stride, hi - first * stride,
                  out);
    at[d] = 0;
    return;
  }
  int64_t whole = first; // the first index whose elements are all in range
  if (lo % stride) {
    at[d] = first;
    flatBoxesFrom(shape, d + 1, at, lo % stride, stride, out);
    at[d] = 0;
    whole = first + 1;
  }
  int64_t end = hi / stride; // indices [whole, end) are whole
  if (whole < end)
    slab(whole, end - whole);
  if (hi % stride) {
    at[d] = end;
    flatBoxesFrom(shape, d + 1, at, 0, hi % stride, out);
    at[d] = 0;
  }
}
} // namespace

std::vector<Box> flatRangeBoxes(const std::vector<int64_t> &shape, int64_t lo,
                                int64_t hi) {
  std::vector<Box> boxes;
  if (lo >= hi)
    return boxes;
  if (shape.empty())
    return {Box{{}, {}}};
  std::vector<int64_t> at(shape.size(), 0);
  flatBoxesFrom(shape, 0, at, lo, hi, boxes);
  return boxes;
}

int64_t copyIntersection(const Box &from, const float *fromData, const Box &to,
                         float *toData) {
  size_t rank = from.offsets.size();
  if (to.offsets.size() != rank)
    throw std::runtime_error("copyIntersection: boxes of different ranks");
  if (rank == 0) {
    toData[0] = fromData[0];
    return 1;
  }
  std::vector<int64_t> lo(rank), hi(rank);
  for (size_t d = 0; d < rank; ++d) {
    lo[d] = std::max(from.offsets[d], to.offsets[d]);
    hi[d] = std::min(from.offsets[d] + from.sizes[d],
                     to.offsets[d] + to.sizes[d]);
    if (lo[d] >= hi[d])
      return 0;
  }
  // Walk the intersection's rows (all dimensions but the last).
  std::vector<int64_t> index(lo.begin(), lo.end());
  int64_t row = hi[rank - 1] - lo[rank - 1], copied = 0;
  while (true) {
    int64_t src = 0, dst = 0;
    for (size_t d = 0; d < rank; ++d) {
      src = src * from.sizes[d] + (index[d] - from.offsets[d]);
      dst = dst * to.sizes[d] + (index[d] - to.offsets[d]);
    }
    std::copy_n(fromData + src, row, toData + dst);
    copied += row;
    int d = (int)rank - 2;
    for (; d >= 0; --d) {
      if (++index[d] < hi[d])
        break;
      index[d] = lo[d];
    }
    if (d < 0)
      return copied;
  }
}

uint32_t fileCrc32(const std::string &path, int64_t *bytes) {
  FILE *f = std::fopen(path.c_str(), "rb");
  if (!f)
    throw std::runtime_error("cannot read " + inQuotes(path) + ": " +
                             std::strerror(errno));
  std::vector<unsigned char> buffer(1 << 20);
  uLong crc = crc32(0L, Z_NULL, 0);
  int64_t total = 0;
  size_t n;
  while ((n = std::fread(buffer.data(), 1, buffer.size(), f)) > 0) {
    crc = crc32(crc, buffer.data(), (uInt)n);
    total += (int64_t)n;
  }
  bool failed = std::ferror(f);
  std::fclose(f);
  if (failed)
    throw std::runtime_error("cannot read " + inQuotes(path));
  if (bytes)
    *bytes = total;
  return (uint32_t)crc;
}

//===----------------------------------------------------------------------===//
// Writing
//===----------------------------------------------------------------------===//

CheckpointWriter::CheckpointWriter(std::string root, Retention retention)
    : root(std::move(root)), retention(retention) {}

CheckpointWriter::~CheckpointWriter() {
  if (writer.joinable())
    writer.join();
}

void CheckpointWriter::begin(const CheckpointInfo &next,
                             std::vector<CheckpointPiece> nextPieces) {
  poll(/*wait=*/true);
  info = next;
  pieces = std::move(nextPieces);
  error.clear();
  fileName.clear();
  done = false;
  writing = true;
  std::string dir = (fs::path(root) / stepDirName(info.step)).string();
  int rank = commRank();
  fileBytes = 0;
  writer = std::thread([this, dir, rank] {
    auto start = std::chrono::steady_clock::now();
    try {
      std::error_code ec;
      fs::create_directories(dir, ec);
      if (ec)
        throw std::runtime_error("cannot create the checkpoint directory " +
                                 inQuotes(dir) + ": " + ec.message());
      // A manifest left from an earlier run at this step no longer
      // describes the files being written.
      if (rank == 0)
        fs::remove(fs::path(dir) / "manifest.json", ec);
      // A box whose contents are those of the last checkpoint's is
      // referenced there, not written again.
      pieceCrc.assign(pieces.size(), 0);
      reused.assign(pieces.size(), nullptr);
      std::vector<SafetensorView> views;
      for (size_t k = 0; k < pieces.size(); ++k) {
        const CheckpointPiece &p = pieces[k];
        std::string key = boxKey(p.tensor, p.box);
        pieceCrc[k] = (uint32_t)crc32_z(
            crc32(0L, Z_NULL, 0), (const Bytef *)p.data.data(),
            (z_size_t)(p.data.size() * sizeof(float)));
        auto it = stored.find(key);
        if (it != stored.end() && it->second.boxCrc == pieceCrc[k])
          reused[k] = &it->second;
        else
          views.push_back({key, p.box.sizes, p.data.data()});
      }
      if (!views.empty()) {
        char name[32];
        std::snprintf(name, sizeof(name), "rank-%05d.safetensors", rank);
        std::string path = (fs::path(dir) / name).string();
        std::map<std::string, std::string> metadata = {
            {"step", std::to_string(info.step)}};
        std::string prefix = writeSafetensors(path, views, metadata);
        // The file's CRC-32 from its parts' (the written boxes' are at
        // hand, in the file's order), not by reading the file back.
        uLong crc = crc32(crc32(0L, Z_NULL, 0), (const Bytef *)prefix.data(),
                          (uInt)prefix.size());
        fileBytes = (int64_t)prefix.size();
        for (size_t k = 0; k < pieces.size(); ++k)
          if (!reused[k]) {
            int64_t bytes = (int64_t)(pieces[k].data.size() * sizeof(float));
            crc = crc32_combine64(crc, pieceCrc[k], (z_off64_t)bytes);
            fileBytes += bytes;
          }
        fileCrc = (uint32_t)crc;
        fileName = name;
      }
    } catch (const std::exception &e) {
      error = e.what();
    }
    writeSeconds = std::chrono::duration<double>(
                       std::chrono::steady_clock::now() - start)
                       .count();
    done = true;
  });
}

int64_t CheckpointWriter::poll(bool wait) {
  if (!writing)
    return -1;
  if (!wait && !everyRank(done.load()))
    return -1;
  writer.join();
  writing = false;
  // Kept for the next snapshot, also when the commit fails (it throws).
  struct Keep {
    CheckpointWriter &w;
    ~Keep() { w.spare = std::move(w.pieces); w.pieces.clear(); }
  } keep{*this};
  commit();
  return info.step;
}

void CheckpointWriter::commit() {
  json record = json::object();
  record["error"] = error;
  record["file"] = fileName;
  record["bytes"] = fileBytes;
  record["crc32"] = crcText(fileCrc);
  json boxes = json::array(), referenced = json::object();
  for (size_t k = 0; k < pieces.size(); ++k) {
    const CheckpointPiece &p = pieces[k];
    std::string file = fileName;
    if (k < reused.size() && reused[k]) {
      file = "../" + reused[k]->file;
      referenced[file] = {{"bytes", reused[k]->fileBytes},
                          {"crc32", crcText(reused[k]->fileCrc)}};
    }
    boxes.push_back({{"tensor", p.tensor},
                     {"shape", p.shape},
                     {"key", boxKey(p.tensor, p.box)},
                     {"file", file},
                     {"offsets", p.box.offsets},
                     {"sizes", p.box.sizes}});
  }
  record["boxes"] = std::move(boxes);
  record["referenced"] = std::move(referenced);
  std::vector<std::string> records = gatherText(record.dump());
  std::string dirName = stepDirName(info.step);
  std::string dir = (fs::path(root) / dirName).string();
  std::string status;
  if (commRank() == 0) {
    try {
      json tensors = json::object(), files = json::object();
      for (size_t r = 0; r < records.size(); ++r) {
        json rec = json::parse(records[r]);
        if (!rec["error"].get<std::string>().empty())
          throw std::runtime_error("rank " + std::to_string(r) + ": " +
                                   rec["error"].get<std::string>());
        std::string own = rec["file"];
        if (!own.empty())
          files[own] = {{"bytes", rec["bytes"]}, {"crc32", rec["crc32"]}};
        for (auto &[file, f] : rec["referenced"].items())
          files[file] = f;
        for (json &b : rec["boxes"]) {
          std::string file = b["file"];
          std::string name = b["tensor"];
          if (!tensors.contains(name))
            tensors[name] = {{"shape", b["shape"]},
                             {"dtype", "F32"},
                             {"boxes", json::array()}};
          json &list = tensors[name]["boxes"];
          // A tensor two pipeline stages hold (a tied embedding) arrives
          // twice with equal values: one box is enough.
          bool seen = false;
          for (const json &other : list)
            seen = seen || (other["offsets"] == b["offsets"] &&
                            other["sizes"] == b["sizes"]);
          if (!seen)
            list.push_back({{"file", file},
                            {"key", b["key"]},
                            {"offsets", b["offsets"]},
                            {"sizes", b["sizes"]}});
        }
      }
      json manifest = {{"format", "tessel-checkpoint"},
                       {"version", 1},
                       {"step", info.step},
                       {"updates", info.updates},
                       {"consumed_samples", info.consumedSamples},
                       {"loss", info.loss},
                       {"program", info.program},
                       {"layout", info.layout},
                       {"world_size", info.worldSize},
                       {"config", info.config},
                       {"tessel_version", TESSEL_VERSION},
                       {"model", parsedOrNull(info.model)},
                       {"model_crc32", crcText(textCrc(info.model))},
                       {"train", parsedOrNull(info.train)},
                       {"data", parsedOrNull(info.data)},
                       {"tensors", tensors},
                       {"files", files}};
      writeCommitted((fs::path(dir) / "manifest.json").string(),
                     manifest.dump(1) + "\n");
      writeCommitted((fs::path(root) / "latest").string(), dirName + "\n");
      committed = dir;
      // Retention: the newest keepLast checkpoints, every keepEvery-th
      // step, the directories their files refer to (incremental saves),
      // and nothing uncommitted older than this one (an interrupted write).
      if (retention.keepLast > 0) {
        std::vector<std::pair<int64_t, fs::path>> found;
        for (const fs::directory_entry &e : fs::directory_iterator(root)) {
          int64_t step = checkpointStepOf(e.path().filename().string());
          if (step >= 0 && e.is_directory() && step <= info.step)
            found.push_back({step, e.path()});
        }
        std::sort(found.rbegin(), found.rend());
        std::set<std::string> keep;
        int64_t kept = 0;
        for (auto &[step, path] : found) {
          if (!fs::exists(path / "manifest.json"))
            continue;
          if (kept < retention.keepLast ||
              (retention.keepEvery > 0 && step % retention.keepEvery == 0)) {
            keep.insert(path.filename().string());
            json m = json::parse(readTextFile((path / "manifest.json").string()));
            for (auto &[file, f] : m.at("files").items())
              if (file.rfind("../", 0) == 0)
                keep.insert(fs::path(file.substr(3)).begin()->string());
          }
          if (kept < retention.keepLast)
            ++kept;
        }
        for (auto &[step, path] : found)
          if (!keep.count(path.filename().string()))
            fs::remove_all(path);
      }
    } catch (const std::exception &e) {
      status = e.what();
    }
  }
  status = broadcastText(status);
  if (!status.empty())
    throw AgreedError("the checkpoint " + inQuotes(dir) +
                      " was not committed: " + status);
  committed = dir;
  // Where this checkpoint's boxes lie, for the next one to refer to.
  std::map<std::string, Stored> next;
  for (size_t k = 0; k < pieces.size() && k < pieceCrc.size(); ++k) {
    Stored s = reused[k] ? *reused[k]
                         : Stored{dirName + "/" + fileName, fileBytes, fileCrc,
                                  0};
    s.boxCrc = pieceCrc[k];
    next[boxKey(pieces[k].tensor, pieces[k].box)] = s;
  }
  stored = std::move(next);
}

//===----------------------------------------------------------------------===//
// Reading
//===----------------------------------------------------------------------===//

bool isCheckpointDirectory(const std::string &path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec))
    return false;
  if (fs::exists(fs::path(path) / "manifest.json", ec) ||
      fs::exists(fs::path(path) / "latest", ec))
    return true;
  for (const fs::directory_entry &e : fs::directory_iterator(path, ec))
    if (checkpointStepOf(e.path().filename().string()) >= 0)
      return true;
  return false;
}

std::vector<std::string> committedCheckpoints(const std::string &path) {
  if (fs::exists(fs::path(path) / "manifest.json"))
    return {path};
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  for (const fs::directory_entry &e : fs::directory_iterator(path, ec)) {
    int64_t step = checkpointStepOf(e.path().filename().string());
    if (step >= 0 && fs::exists(e.path() / "manifest.json"))
      found.push_back({step, e.path().string()});
  }
  if (ec)
    throw std::runtime_error("cannot list the checkpoint directory " +
                             inQuotes(path) + ": " + ec.message());
  if (found.empty())
    throw std::runtime_error(inQuotes(path) +
                             " holds no committed checkpoint (no step-N "
                             "directory with a manifest.json)");
  std::sort(found.rbegin(), found.rend());
  std::vector<std::string> dirs;
  for (auto &[step, dir] : found)
    dirs.push_back(dir);
  return dirs;
}

CheckpointManifest readManifest(const std::string &dir) {
  std::string path = (fs::path(dir) / "manifest.json").string();
  CheckpointManifest m;
  m.dir = dir;
  auto bad = [&](const std::string &what) -> std::runtime_error {
    return std::runtime_error(inQuotes(path) + ": " + what);
  };
  json j;
  try {
    j = json::parse(readTextFile(path));
  } catch (const json::exception &e) {
    throw bad(std::string("not valid JSON (") + e.what() + ")");
  }
  try {
    if (j.value("format", "") != "tessel-checkpoint")
      throw bad("'format' is not \"tessel-checkpoint\"");
    if (j.at("version").get<int>() != 1)
      throw bad("'version' " + j.at("version").dump() +
                " is not one this build reads (1)");
    m.step = j.at("step").get<int64_t>();
    // Written since steps can be skipped; before, every step updated.
    m.updates = j.value("updates", m.step);
    if (m.updates < 0 || m.updates > m.step)
      throw bad("'updates' " + std::to_string(m.updates) +
                " is not between 0 and the step " + std::to_string(m.step));
    m.consumedSamples = j.at("consumed_samples").get<int64_t>();
    m.loss = j.at("loss").get<double>();
    m.layout = j.at("layout").get<std::string>();
    if (j.contains("model") && !j["model"].is_null())
      m.model = j["model"].dump();
    if (j.contains("train") && !j["train"].is_null())
      m.train = j["train"].dump();
    m.tesselVersion = j.value("tessel_version", "");
    for (auto &[file, f] : j.at("files").items()) {
      // A rank's file here, or one of an earlier checkpoint's that an
      // incremental save refers to: nothing else is read.
      std::string name = file;
      if (name.rfind("../", 0) == 0) {
        size_t slash = name.find('/', 3);
        if (slash == std::string::npos ||
            checkpointStepOf(name.substr(3, slash - 3)) < 0)
          throw bad("the file " + inQuotes(file) +
                    " is neither a rank's file nor one of an earlier step's");
        name = name.substr(slash + 1);
      }
      const std::string head = "rank-", tail = ".safetensors";
      bool rankFile = name.size() > head.size() + tail.size() &&
                      name.rfind(head, 0) == 0 &&
                      name.compare(name.size() - tail.size(), tail.size(),
                                   tail) == 0 &&
                      std::all_of(name.begin() + head.size(),
                                  name.end() - tail.size(),
                                  [](char c) { return c >= '0' && c <= '9'; });
      if (!rankFile)
        throw bad("the file " + inQuotes(file) +
                  " is neither a rank's file nor one of an earlier step's");
      m.files[file] = {f.at("bytes").get<int64_t>(),
                       (uint32_t)std::stoul(f.at("crc32").get<std::string>(),
                                            nullptr, 16)};
    }
    for (auto &[name, t] : j.at("tensors").items()) {
      CheckpointManifest::Tensor &tensor = m.tensors[name];
      tensor.shape = t.at("shape").get<std::vector<int64_t>>();
      for (const json &b : t.at("boxes")) {
        CheckpointManifest::Source s;
        s.file = b.at("file").get<std::string>();
        s.key = b.at("key").get<std::string>();
        s.box.offsets = b.at("offsets").get<std::vector<int64_t>>();
        s.box.sizes = b.at("sizes").get<std::vector<int64_t>>();
        if (!m.files.count(s.file))
          throw bad("tensor " + inQuotes(name) + " names the file " +
                    inQuotes(s.file) + ", which 'files' does not list");
        if (s.box.offsets.size() != tensor.shape.size() ||
            s.box.sizes.size() != tensor.shape.size())
          throw bad("a box of tensor " + inQuotes(name) +
                    " does not have the tensor's rank");
        for (size_t d = 0; d < tensor.shape.size(); ++d)
          if (s.box.offsets[d] < 0 || s.box.sizes[d] < 0 ||
              s.box.offsets[d] + s.box.sizes[d] > tensor.shape[d])
            throw bad("a box of tensor " + inQuotes(name) +
                      " lies outside its shape");
        tensor.boxes.push_back(std::move(s));
      }
    }
  } catch (const json::exception &e) {
    throw bad(std::string("malformed (") + e.what() + ")");
  } catch (const std::invalid_argument &) {
    throw bad("a file's crc32 is not hexadecimal");
  }
  return m;
}

std::string verifyCheckpointFile(const CheckpointManifest &m,
                                 const std::string &file) {
  auto it = m.files.find(file);
  if (it == m.files.end())
    return "the manifest does not list " + inQuotes(file);
  std::string path = (fs::path(m.dir) / file).string();
  int64_t bytes = 0;
  uint32_t crc = 0;
  try {
    crc = fileCrc32(path, &bytes);
  } catch (const std::exception &e) {
    return e.what();
  }
  if (bytes != it->second.first)
    return inQuotes(path) + " has " + std::to_string(bytes) +
           " bytes, the manifest says " + std::to_string(it->second.first);
  if (crc != it->second.second)
    return inQuotes(path) + " fails its checksum (CRC-32 " + crcText(crc) +
           ", the manifest says " + crcText(it->second.second) + ")";
  return "";
}

void readCheckpointBox(const CheckpointManifest &m, const std::string &name,
                       const std::vector<int64_t> &shape, const Box &want,
                       float *out) {
  auto it = m.tensors.find(name);
  if (it == m.tensors.end())
    throw std::runtime_error("the checkpoint " + inQuotes(m.dir) +
                             " has no tensor " + inQuotes(name));
  if (it->second.shape != shape)
    throw std::runtime_error("tensor " + inQuotes(name) + " in " +
                             inQuotes(m.dir) + " has shape " +
                             formatShape(it->second.shape) +
                             ", but the program expects " + formatShape(shape));
  int64_t covered = 0;
  for (const CheckpointManifest::Source &s : it->second.boxes) {
    bool meets = true;
    for (size_t d = 0; d < shape.size(); ++d)
      meets = meets && s.box.offsets[d] < want.offsets[d] + want.sizes[d] &&
              want.offsets[d] < s.box.offsets[d] + s.box.sizes[d];
    if (!meets)
      continue;
    std::unique_ptr<SafetensorsReader> &opened = (*m.opened)[s.file];
    if (!opened)
      opened = std::make_unique<SafetensorsReader>(
          (fs::path(m.dir) / s.file).string());
    const SafetensorsReader &reader = *opened;
    if (!reader.contains(s.key) || reader.info(s.key).shape != s.box.sizes)
      throw std::runtime_error(inQuotes(s.file) + " in " + inQuotes(m.dir) +
                               " lacks the box " + inQuotes(s.key) +
                               " the manifest lists");
    std::vector<float> data = reader.read(s.key);
    reader.release(s.key);
    covered += copyIntersection(s.box, data.data(), want, out);
  }
  if (covered != want.numel())
    throw std::runtime_error("the boxes of tensor " + inQuotes(name) + " in " +
                             inQuotes(m.dir) + " cover " +
                             std::to_string(covered) + " of the " +
                             std::to_string(want.numel()) +
                             " elements this rank needs");
}

} // namespace tessel::rt
