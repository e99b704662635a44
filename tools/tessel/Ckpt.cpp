//===- Ckpt.cpp - `tessel ckpt`: list, verify, diff, export checkpoints ---===//
//
// Tools over the sharded checkpoints `tessel run --ckpt-dir` writes
// (docs/checkpoints.md). Everything is read through the runtime's checkpoint
// functions (tessel/Runtime/Checkpoint.h), so the tools see a checkpoint
// exactly as --resume does.
//
//===----------------------------------------------------------------------===//

#include "Commands.h"

#include "tessel/Runtime/Checkpoint.h"
#include "tessel/Runtime/Safetensors.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/raw_ostream.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <sys/stat.h>

using namespace llvm;
namespace fs = std::filesystem;
namespace rt = tessel::rt;
using tessel::fail;
using tessel::inQuotes;

namespace {

const char *kUsage =
    "usage: tessel ckpt list CKPT_DIR [--json]\n"
    "       tessel ckpt verify PATH\n"
    "       tessel ckpt diff A B [--tolerance X]\n"
    "       tessel ckpt export PATH -o FILE.safetensors [--force]\n"
    "  CKPT_DIR is a --ckpt-dir root; PATH, A and B are a root (its newest\n"
    "  committed checkpoint; for verify, every committed one) or one step-N\n"
    "  directory.\n";


int usageError(const Twine &message) {
  outs().flush();
  errs() << "tessel ckpt: " << message << "\n" << kUsage;
  return 2;
}


// printf's %.4g: "0" for zero, short for anything else.
std::string number(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.4g", value);
  return text;
}

using tessel::Arguments;

// tessel::parseArguments, with the usage on an error.
bool parseCkptArguments(ArrayRef<std::string> args,
                        ArrayRef<StringRef> valueFlags,
                        ArrayRef<StringRef> switchFlags, Arguments &out) {
  std::string error =
      tessel::parseArguments(args, valueFlags, switchFlags, out);
  if (!error.empty())
    usageError(error);
  return error.empty();
}

// The step of a directory named step-N, if it is one.
std::optional<int64_t> stepOfDirectoryName(StringRef name) {
  int64_t step = tessel::rt::checkpointStepOf(name.str());
  if (step < 0)
    return std::nullopt;
  return step;
}

// Whether `path` is named like a step directory (step-N), trailing
// slashes aside.
bool isStepDirectoryPath(StringRef path) {
  StringRef trimmed = path.rtrim('/');
  return stepOfDirectoryName(trimmed.substr(trimmed.rfind('/') + 1))
      .has_value();
}

bool hasManifest(const fs::path &dir) {
  std::error_code ec;
  return fs::is_regular_file(dir / "manifest.json", ec);
}

// Throws unless `path` is an existing directory.
void requireDirectory(const std::string &path) {
  std::error_code ec;
  if (!fs::exists(path, ec))
    throw std::runtime_error(inQuotes(path) + ": no such directory");
  if (!fs::is_directory(path, ec))
    throw std::runtime_error(inQuotes(path) +
                             " is not a directory (a checkpoint root or "
                             "a step-N directory)");
}

// The committed checkpoint `path` names: itself when it is a step
// directory, else the newest committed one under it (the one --resume
// tries first).
std::string resolveCheckpoint(const std::string &path) {
  requireDirectory(path);
  if (hasManifest(path))
    return path;
  if (isStepDirectoryPath(path))
    throw std::runtime_error(inQuotes(path) +
                             " is not a committed checkpoint (it has no "
                             "manifest.json)");
  return rt::committedCheckpoints(path).front();
}

// The element count of a shape; throws when it is negative or overflows.
int64_t elementCount(const std::string &tensor,
                     const std::vector<int64_t> &shape) {
  int64_t n = 1;
  for (int64_t d : shape)
    if (d < 0 || __builtin_mul_overflow(n, d, &n))
      throw std::runtime_error("tensor " + inQuotes(tensor) +
                               " has an invalid shape " +
                               rt::formatShape(shape));
  return n;
}

// Reads a whole tensor of a checkpoint.
std::vector<float> readWholeTensor(const rt::CheckpointManifest &m,
                                   const std::string &name) {
  const std::vector<int64_t> &shape = m.tensors.at(name).shape;
  std::vector<float> data((size_t)elementCount(name, shape));
  rt::Box whole{std::vector<int64_t>(shape.size(), 0), shape};
  rt::readCheckpointBox(m, name, shape, whole, data.data());
  return data;
}

// Throws, naming the file and what is wrong, unless every file of the
// manifest passes its size and CRC-32 check: a damaged file is never read.
void requireIntactFiles(const rt::CheckpointManifest &m) {
  for (const auto &entry : m.files) {
    std::string problem = rt::verifyCheckpointFile(m, entry.first);
    if (!problem.empty())
      throw std::runtime_error(problem + " ('tessel ckpt verify " + m.dir +
                               "' lists every problem)");
  }
}

bool isMoment(StringRef name) {
  return name.ends_with(".exp_avg") || name.ends_with(".exp_avg_sq");
}

//===----------------------------------------------------------------------===//
// list
//===----------------------------------------------------------------------===//

struct ListedCheckpoint {
  int64_t step = 0;
  std::string name;   // step-NNNNNNNN
  std::string status; // committed, uncommitted, invalid
  std::string error;  // why the manifest cannot be read (invalid)
  std::optional<double> loss;
  std::string layout;
  int64_t files = 0, bytes = 0;
  std::string modified; // UTC, ISO 8601
  bool latest = false;
};

std::string modificationTime(const fs::path &path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0)
    return "";
  struct tm utc;
  gmtime_r(&st.st_mtime, &utc);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &utc);
  return text;
}

// What a step directory holds: the manifest's files when it is committed,
// else the files in it (an interrupted write).
ListedCheckpoint describeStepDirectory(const fs::path &dir, int64_t step) {
  ListedCheckpoint c;
  c.step = step;
  c.name = dir.filename().string();
  c.modified = modificationTime(dir);
  if (hasManifest(dir)) {
    try {
      rt::CheckpointManifest m = rt::readManifest(dir.string());
      c.status = "committed";
      c.loss = m.loss;
      c.layout = m.layout;
      c.files = (int64_t)m.files.size();
      for (const auto &entry : m.files)
        c.bytes += entry.second.first;
    } catch (const std::exception &e) {
      c.status = "invalid";
      c.error = e.what();
    }
    return c;
  }
  c.status = "uncommitted";
  std::error_code ec;
  for (const fs::directory_entry &e : fs::directory_iterator(dir, ec)) {
    std::error_code sizeError;
    if (!e.is_regular_file(sizeError))
      continue;
    uintmax_t size = e.file_size(sizeError);
    ++c.files;
    c.bytes += sizeError ? 0 : (int64_t)size;
  }
  return c;
}

int listCheckpoints(ArrayRef<std::string> args) {
  Arguments parsed;
  if (!parseCkptArguments(args, {}, {"--json"}, parsed))
    return 2;
  if (parsed.positionals.size() != 1)
    return usageError("list expects one checkpoint directory");
  const std::string &root = parsed.positionals[0];
  requireDirectory(root);

  std::string latest;
  if (std::FILE *f = std::fopen((fs::path(root) / "latest").c_str(), "r")) {
    char text[256] = {};
    size_t n = std::fread(text, 1, sizeof(text) - 1, f);
    std::fclose(f);
    latest = StringRef(text, n).trim().str();
  }

  std::vector<ListedCheckpoint> listed;
  std::error_code ec;
  for (const fs::directory_entry &e : fs::directory_iterator(root, ec)) {
    std::optional<int64_t> step =
        stepOfDirectoryName(e.path().filename().string());
    std::error_code typeError;
    if (step && e.is_directory(typeError))
      listed.push_back(describeStepDirectory(e.path(), *step));
  }
  if (ec)
    return fail("cannot list " + inQuotes(root) + ": " + ec.message());
  if (listed.empty() && isStepDirectoryPath(root))
    return fail(inQuotes(root) + " is a step directory; list its parent, the "
                                 "--ckpt-dir root");
  if (listed.empty())
    return fail(inQuotes(root) +
                " holds no checkpoint (no step-N directory); is it a "
                "--ckpt-dir root?");
  llvm::sort(listed, [](const ListedCheckpoint &a, const ListedCheckpoint &b) {
    return a.step > b.step;
  });
  bool latestFound = false;
  for (ListedCheckpoint &c : listed)
    if (c.name == latest)
      c.latest = latestFound = true;

  for (const ListedCheckpoint &c : listed)
    if (!c.error.empty())
      errs() << "tessel: warning: " << c.error << "\n";
  if (!latest.empty() && !latestFound)
    errs() << "tessel: warning: " << (fs::path(root) / "latest").string()
           << " names " << inQuotes(latest) << ", which is not here\n";

  if (parsed.switches.count("--json")) {
    nlohmann::ordered_json out = nlohmann::ordered_json::array();
    for (const ListedCheckpoint &c : listed) {
      nlohmann::ordered_json row = {{"step", c.step},
                                    {"dir", c.name},
                                    {"status", c.status},
                                    {"committed", c.status == "committed"}};
      row["loss"] = c.loss ? nlohmann::ordered_json(*c.loss) : nullptr;
      row["layout"] = c.layout.empty() ? nlohmann::ordered_json()
                                       : nlohmann::ordered_json(c.layout);
      row["files"] = c.files;
      row["bytes"] = c.bytes;
      row["modified"] = c.modified;
      row["latest"] = c.latest;
      if (!c.error.empty())
        row["error"] = c.error;
      out.push_back(std::move(row));
    }
    outs() << out.dump(2) << "\n";
    return 0;
  }

  std::vector<std::vector<std::string>> rows = {{"step", "status", "loss",
                                                 "layout", "files", "bytes",
                                                 "modified (UTC)", ""}};
  for (const ListedCheckpoint &c : listed)
    rows.push_back({std::to_string(c.step), c.status,
                    c.loss ? formatv("{0:f6}", *c.loss).str() : "-",
                    c.layout.empty() ? "-" : c.layout, std::to_string(c.files),
                    std::to_string(c.bytes), c.modified,
                    c.latest ? "<- latest" : ""});
  std::vector<size_t> widths(rows[0].size(), 0);
  for (const auto &row : rows)
    for (size_t k = 0; k < row.size(); ++k)
      widths[k] = std::max(widths[k], row[k].size());
  for (const auto &row : rows) {
    std::string line;
    for (size_t k = 0; k < row.size(); ++k) {
      bool numeric = k == 0 || k == 4 || k == 5;
      std::string pad(widths[k] - row[k].size(), ' ');
      line += (k ? "  " : "") + (numeric ? pad + row[k] : row[k] + pad);
    }
    outs() << StringRef(line).rtrim() << "\n";
  }
  return 0;
}

//===----------------------------------------------------------------------===//
// verify
//===----------------------------------------------------------------------===//

bool boxesOverlap(const rt::Box &a, const rt::Box &b) {
  if (a.numel() == 0 || b.numel() == 0)
    return false;
  for (size_t d = 0; d < a.offsets.size(); ++d)
    if (a.offsets[d] >= b.offsets[d] + b.sizes[d] ||
        b.offsets[d] >= a.offsets[d] + a.sizes[d])
      return false;
  return true;
}

// Every problem of one committed checkpoint: its manifest, each file's size
// and CRC-32, each tensor's cover by its boxes, each box in its file.
std::vector<std::string> checkpointProblems(const std::string &dir) {
  rt::CheckpointManifest m;
  try {
    m = rt::readManifest(dir);
  } catch (const std::exception &e) {
    return {e.what()};
  }
  std::vector<std::string> problems;
  std::map<std::string, std::unique_ptr<rt::SafetensorsReader>> readers;
  for (const auto &entry : m.files) {
    const std::string &file = entry.first;
    std::string problem = rt::verifyCheckpointFile(m, file);
    if (!problem.empty()) {
      problems.push_back(problem);
      continue;
    }
    std::string path = (fs::path(dir) / file).string();
    try {
      readers[file] = std::make_unique<rt::SafetensorsReader>(path);
    } catch (const std::exception &e) {
      problems.push_back(e.what());
    }
  }
  for (const auto &[name, tensor] : m.tensors) {
    int64_t numel = 0, covered = 0;
    try {
      numel = elementCount(name, tensor.shape);
    } catch (const std::exception &e) {
      problems.push_back(e.what());
      continue;
    }
    for (size_t i = 0; i < tensor.boxes.size(); ++i) {
      const rt::CheckpointManifest::Source &s = tensor.boxes[i];
      covered += s.box.numel();
      for (size_t j = 0; j < i; ++j)
        if (boxesOverlap(tensor.boxes[j].box, s.box))
          problems.push_back("tensor " + inQuotes(name) + ": the boxes " +
                             inQuotes(tensor.boxes[j].key) + " and " +
                             inQuotes(s.key) + " overlap");
      auto reader = readers.find(s.file);
      if (reader == readers.end())
        continue; // the file's problem is already listed
      std::string path = (fs::path(dir) / s.file).string();
      if (!reader->second->contains(s.key))
        problems.push_back("tensor " + inQuotes(name) + ": " + inQuotes(path) +
                           " lacks the box " + inQuotes(s.key));
      else if (reader->second->info(s.key).shape != s.box.sizes)
        problems.push_back(
            "tensor " + inQuotes(name) + ": the box " + inQuotes(s.key) +
            " in " + inQuotes(path) + " has shape " +
            rt::formatShape(reader->second->info(s.key).shape) +
            ", the manifest says " + rt::formatShape(s.box.sizes));
    }
    if (covered != numel)
      problems.push_back("tensor " + inQuotes(name) + ": its boxes hold " +
                         std::to_string(covered) + " elements, its shape " +
                         rt::formatShape(tensor.shape) + " has " +
                         std::to_string(numel));
  }
  return problems;
}

int verifyCheckpoints(ArrayRef<std::string> args) {
  Arguments parsed;
  if (!parseCkptArguments(args, {}, {}, parsed))
    return 2;
  if (parsed.positionals.size() != 1)
    return usageError("verify expects one checkpoint directory");
  const std::string &path = parsed.positionals[0];
  requireDirectory(path);
  if (!hasManifest(path) && isStepDirectoryPath(path))
    return fail(inQuotes(path) +
                " is not a committed checkpoint (it has no manifest.json)");
  int64_t failed = 0;
  std::vector<std::string> dirs = rt::committedCheckpoints(path);
  for (const std::string &dir : dirs) {
    std::vector<std::string> problems = checkpointProblems(dir);
    if (problems.empty())
      outs() << dir << ": ok\n";
    for (const std::string &problem : problems)
      outs() << dir << ": " << problem << "\n";
    failed += !problems.empty();
  }
  if (failed)
    return fail(Twine(failed) + " of " + Twine(dirs.size()) +
                " checkpoints failed verification");
  return 0;
}

//===----------------------------------------------------------------------===//
// diff
//===----------------------------------------------------------------------===//

struct Difference {
  double maxAbs = 0, maxRel = 0;
};

// The largest element difference of a and b, absolute and relative to a's
// largest magnitude. NaN equals NaN; NaN against a number is infinite.
Difference compareTensors(const std::vector<float> &a,
                          const std::vector<float> &b) {
  Difference d;
  double scale = 0;
  for (size_t k = 0; k < a.size(); ++k) {
    double x = a[k], y = b[k];
    if (std::isfinite(x))
      scale = std::max(scale, std::fabs(x));
    double diff;
    if (x == y || (std::isnan(x) && std::isnan(y)))
      diff = 0;
    else if (std::isnan(x) || std::isnan(y) || !std::isfinite(x - y))
      diff = INFINITY;
    else
      diff = std::fabs(x - y);
    d.maxAbs = std::max(d.maxAbs, diff);
  }
  d.maxRel = d.maxAbs == 0 ? 0 : scale > 0 ? d.maxAbs / scale : INFINITY;
  return d;
}

int diffCheckpoints(ArrayRef<std::string> args) {
  Arguments parsed;
  if (!parseCkptArguments(args, {"--tolerance"}, {}, parsed))
    return 2;
  if (parsed.positionals.size() != 2)
    return usageError("diff expects two checkpoints, A and B");
  std::optional<double> tolerance;
  if (auto it = parsed.values.find("--tolerance"); it != parsed.values.end()) {
    double value;
    if (StringRef(it->second).getAsDouble(value) || !(value >= 0) ||
        !std::isfinite(value))
      return usageError("--tolerance expects a non-negative number, got '" +
                        it->second + "'");
    tolerance = value;
  }
  rt::CheckpointManifest a =
      rt::readManifest(resolveCheckpoint(parsed.positionals[0]));
  rt::CheckpointManifest b =
      rt::readManifest(resolveCheckpoint(parsed.positionals[1]));
  requireIntactFiles(a);
  requireIntactFiles(b);
  outs() << "A: " << a.dir << " (step " << a.step << ", " << a.layout << ")\n"
         << "B: " << b.dir << " (step " << b.step << ", " << b.layout << ")\n";

  std::set<std::string> names;
  for (const auto &entry : a.tensors)
    names.insert(entry.first);
  for (const auto &entry : b.tensors)
    names.insert(entry.first);
  size_t nameWidth = 0;
  for (const std::string &name : names)
    nameWidth = std::max(nameWidth, name.size());

  int64_t compared = 0, onlyA = 0, onlyB = 0, reshaped = 0, differing = 0,
          aboveTolerance = 0;
  double largest = 0;
  std::string largestName;
  for (const std::string &name : names) {
    std::string line = name + std::string(nameWidth - name.size() + 2, ' ');
    auto ta = a.tensors.find(name), tb = b.tensors.find(name);
    if (tb == b.tensors.end()) {
      line += "only in A";
      ++onlyA;
    } else if (ta == a.tensors.end()) {
      line += "only in B";
      ++onlyB;
    } else if (ta->second.shape != tb->second.shape) {
      line += "shape " + rt::formatShape(ta->second.shape) + " in A, " +
              rt::formatShape(tb->second.shape) + " in B";
      ++reshaped;
    } else {
      Difference d =
          compareTensors(readWholeTensor(a, name), readWholeTensor(b, name));
      ++compared;
      differing += d.maxAbs != 0;
      if (tolerance && d.maxRel > *tolerance)
        ++aboveTolerance;
      if (d.maxRel > largest || largestName.empty()) {
        largest = d.maxRel;
        largestName = name;
      }
      line += formatv("{0,-14}  max abs {1,-10}  max rel {2}",
                      rt::formatShape(ta->second.shape), number(d.maxAbs),
                      number(d.maxRel));
    }
    outs() << line << "\n";
  }
  outs() << names.size() << " tensors: " << compared << " compared, " << onlyA
         << " only in A, " << onlyB << " only in B, " << reshaped
         << " with different shapes; " << differing << " differ";
  if (differing)
    outs() << " (largest relative difference " << number(largest) << ", in "
           << inQuotes(largestName) << ")";
  if (tolerance)
    outs() << "; " << aboveTolerance << " above the tolerance "
           << number(*tolerance);
  outs() << "\n";
  if (!tolerance)
    return 0;
  if (onlyA || onlyB || reshaped)
    return fail("the checkpoints hold different tensors (" + Twine(onlyA) +
                " only in A, " + Twine(onlyB) + " only in B, " +
                Twine(reshaped) + " with different shapes)");
  if (aboveTolerance)
    return fail(Twine(aboveTolerance) + " tensors differ by more than " +
                "--tolerance " + number(*tolerance) +
                " (largest relative difference " + number(largest) + ", in " +
                inQuotes(largestName) + ")");
  return 0;
}

//===----------------------------------------------------------------------===//
// export
//===----------------------------------------------------------------------===//

int exportCheckpoint(ArrayRef<std::string> args) {
  Arguments parsed;
  if (!parseCkptArguments(args, {"-o"}, {"--force"}, parsed))
    return 2;
  if (parsed.positionals.size() != 1)
    return usageError("export expects one checkpoint");
  auto output = parsed.values.find("-o");
  if (output == parsed.values.end() || output->second.empty())
    return usageError("export: -o FILE.safetensors is required");
  const std::string &path = output->second;
  std::error_code ec;
  if (fs::exists(path, ec) && !parsed.switches.count("--force"))
    return fail(inQuotes(path) + " exists; --force overwrites it");

  tessel::CheckpointParameters c =
      tessel::readCheckpointParameters(parsed.positionals[0]);
  // One tensor in memory at a time: the header from the names and shapes,
  // then each tensor as it is put together.
  std::vector<rt::SafetensorView> views;
  for (size_t k = 0; k < c.names.size(); ++k)
    views.push_back({c.names[k], c.shapes[k], nullptr});
  rt::SafetensorsWriter writer(path, views, {{"step", std::to_string(c.step)}});
  int64_t elements = 0;
  for (size_t k = 0; k < c.names.size(); ++k) {
    std::vector<float> data = c.read(k);
    writer.write(data.data());
    elements += (int64_t)data.size();
  }
  writer.commit();
  outs() << "exported " << c.names.size() << " parameters (" << elements
         << " elements) of " << c.dir << " (step " << c.step << ") to " << path
         << "\n";
  return 0;
}

} // namespace

tessel::CheckpointParameters
tessel::readCheckpointParameters(const std::string &path) {
  rt::CheckpointManifest m = rt::readManifest(resolveCheckpoint(path));
  requireIntactFiles(m);
  CheckpointParameters c;
  c.dir = m.dir;
  c.step = m.step;
  c.model = m.model;
  for (const auto &entry : m.tensors) {
    if (isMoment(entry.first))
      continue;
    c.names.push_back(entry.first);
    c.shapes.push_back(entry.second.shape);
  }
  if (c.names.empty())
    throw std::runtime_error("the checkpoint " + inQuotes(m.dir) +
                             " holds no parameters (only optimizer moments)");
  c.read = [m, names = c.names](size_t k) {
    return readWholeTensor(m, names.at(k));
  };
  return c;
}

int tessel::ckptCommand(ArrayRef<std::string> args) {
  if (args.empty()) {
    errs() << kUsage;
    return 2;
  }
  if (args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    outs() << kUsage;
    return 0;
  }
  ArrayRef<std::string> rest = args.drop_front();
  if (llvm::is_contained(rest, "--help") || llvm::is_contained(rest, "-h")) {
    outs() << kUsage;
    return 0;
  }
  // The runtime reports a missing or malformed file by throwing, naming
  // the file.
  try {
    if (args[0] == "list")
      return listCheckpoints(rest);
    if (args[0] == "verify")
      return verifyCheckpoints(rest);
    if (args[0] == "diff")
      return diffCheckpoints(rest);
    if (args[0] == "export")
      return exportCheckpoint(rest);
  } catch (const std::exception &e) {
    return fail(e.what());
  }
  return usageError("unknown subcommand '" + args[0] +
                    "' (list, verify, diff, export)");
}
