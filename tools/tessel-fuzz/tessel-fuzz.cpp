//===- tessel-fuzz.cpp - Deterministic fuzzing of Tessel's inputs ---------===//
//
//   tessel-fuzz spec CORPUS_DIR [--runs N] [--seed S] [--work DIR]
//   tessel-fuzz mlir CORPUS_DIR [--runs N] [--seed S] [--work DIR] [--lower]
//
// Reads every seed of CORPUS_DIR (*.json for `spec`, *.mlir for `mlir`),
// derives --runs inputs from each by stacking one to three mutations (bytes
// flipped, inserted, deleted, repeated, cut, spliced with another seed;
// numbers and strings replaced by extreme ones; values nested deeply; keys
// repeated or added; for specs also --set overrides and layout flags), and
// reads each in-process as `tessel compile` does:
//
//   spec  loadSpec (overrides and layout flags included); a spec it accepts
//         and that is small is also expanded to the graph (buildModel) and
//         verified;
//   mlir  the nesting check, then MLIR's parser with Tessel's dialects and
//         the verifier, then the recipe taken from the graph; with --lower
//         also the training pipeline (slow; for longer runs by hand).
//
// Inputs are refused through the errors these APIs return. Any crash,
// abort, uncaught exception or sanitizer report ends the run (the input is
// left in --work and its name printed), and so does a refusal that breaks
// the rules of docs/spec.md: an empty message, one that quotes the input at
// length, or one that shows the JSON library's own tags. Same seed, same
// inputs: a failure found once is found again.
//
//===----------------------------------------------------------------------===//

#include "tessel/Frontend/ModelBuilder.h"
#include "tessel/Frontend/Nesting.h"
#include "tessel/Frontend/Spec.h"
#include "tessel/InitAllDialects.h"
#include "tessel/Pipelines/TrainPipeline.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/IR/Verifier.h"
#include "mlir/Parser/Parser.h"
#include "mlir/Pass/PassManager.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/CommandLine.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/Signals.h"
#include "llvm/Support/raw_ostream.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

using namespace llvm;

// Leaks are not what this looks for, and LeakSanitizer cannot run in every
// container: AddressSanitizer without it.
extern "C" __attribute__((used)) const char *__asan_default_options() {
  return "detect_leaks=0";
}

namespace {

cl::opt<std::string> mode(cl::Positional, cl::Required,
                          cl::desc("<spec | mlir>"));
cl::opt<std::string> corpus(cl::Positional, cl::Required,
                            cl::desc("<corpus directory>"));
cl::opt<unsigned> runs("runs", cl::desc("Mutated inputs per seed"),
                       cl::init(200));
cl::opt<uint64_t> seedOpt("seed", cl::desc("Seed of the mutations"),
                          cl::init(1));
cl::opt<std::string> workDir("work",
                             cl::desc("Directory for the input being read "
                                      "(default: a new temporary one)"));
cl::opt<bool> lowerOpt("lower",
                       cl::desc("mlir: also run the training pipeline on "
                                "what parses"));
cl::opt<bool> verbose("v", cl::desc("Print every refusal"));

//===--- Randomness (the same on every platform) --------------------------===//

struct Random {
  uint64_t state;
  explicit Random(uint64_t seed) : state(seed) {}
  uint64_t next() { // splitmix64
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  size_t below(size_t n) { return n ? next() % n : 0; }
  bool chance(unsigned percent) { return below(100) < percent; }
  template <typename T> const T &pick(const std::vector<T> &items) {
    return items[below(items.size())];
  }
};

uint64_t hashOf(StringRef text) {
  uint64_t h = 1469598103934665603ull; // FNV-1a
  for (char c : text)
    h = (h ^ (unsigned char)c) * 1099511628211ull;
  return h;
}

//===--- Interesting values -----------------------------------------------===//

const std::vector<std::string> kNumbers = {
    "0", "-1", "1", "2", "3", "4", "6", "7", "8", "12", "16", "32", "64",
    "128", "256", "1000", "-0", "0.0", "1.5", "-2.5", "1e-30",
    "4096", "4097", "65536", "65537", "131072", "131073", "1048576",
    "1048577", "16777216", "16777217", "2147483647", "2147483648",
    "-2147483649", "4294967296", "4294967297", "281474976710656",
    "17592186044416", "9223372036854775807", "9223372036854775808",
    "-9223372036854775808", "-9223372036854775809", "18446744073709551615",
    "18446744073709551616", "1e308", "1e309", "-1e400", "1e-400", "0.5",
    "0.99999999", "1.0"};
// Values that are not numbers, in JSON.
const std::vector<std::string> kJsonValues = {
    "null", "true", "false", "\"\"", "[]", "{}", "\"NaN\"", "\"Infinity\"",
    "NaN", "\"8\"", "[0.9]", "[0.9, 0.95, 0.99]", "[[0], [1]]",
    "[[0, 1], []]", "[[4294967297]]", "[[0], [0, 1]]", "[[1], [0]]",
    "[[-1], [0, 1]]", "{\"*\": [null, \"tp\"]}",
    "{\"h.*.attn.c_attn.weight\": [null, null]}",
    "{\"h.*.attn.c_attn.bias\": [null]}", "{\"*.bias\": [\"tp\"]}",
    "{\"wte.weight\": [\"tp\", \"tp\"]}", "{\"[\": [null]}",
    "{\"lm_head.weight\": [\"dp\", null]}",
    "{\"model.layers.*.self_attn.q_proj.weight\": [null, \"tp\"]}",
    "{\"wpe.weight\": [\"tp\", null]}"};
const std::vector<std::string> kStrings = {
    "gpt", "llama", "bert", "gpipe", "1f1b", "interleaved", "zigzag",
    "cosine", "linear", "constant", "step", "adamw", "sgd", "bf16", "fp32",
    "int8", "llmc", "synthetic", "none", "selective", "full", "flash",
    "unfused", "balanced", "contiguous", "tp", "dp", "", "*", "[", "h.*",
    "tp-cp-ep-dp-pp", "dp-tp-cp-ep-pp", "pp-tp-cp-ep-dp", "tp-dp-pp",
    "tp-cp-ep-dp-pp-", "tp--cp-ep-dp-pp",
    "a b", "x\\ny", "\\u0000", "\\ud800", "..", "/dev/null", "tokens.bin",
    "a-very-long-name-that-is-longer-than-sixty-four-characters-for-sure"};
const std::vector<std::string> kKeys = {
    "model", "train", "data", "parallel", "name", "family", "vocab_size",
    "seq_len", "layers", "hidden", "heads", "kv_heads", "ffn_hidden",
    "tie_embeddings", "norm_eps", "rope_theta", "global_batch", "steps",
    "seed", "grad_clip", "precision", "recompute", "optimizer", "lr", "betas", "eps",
    "weight_decay", "lr_schedule", "warmup_steps", "decay", "min_lr",
    "format", "path", "dp", "tp", "pp", "microbatches", "schedule",
    "virtual_stages", "sequence_parallel", "bucket_mb", "zero", "stage_layers",
    "shard", "attention", "dropout", "attention_dropout",
    "overlap_grad_reduce", "overlap_param_gather", "overlap_tp_comm", "collective_matmul", "collective_matmul_min_rows", "cp", "cp_layout", "order", "hiden", ""};
const std::vector<std::string> kSetPaths = {
    "model.family", "model.vocab_size", "model.seq_len", "model.layers",
    "model.hidden", "model.heads", "model.kv_heads", "model.ffn_hidden",
    "model.norm_eps", "model.rope_theta", "model.tie_embeddings",
    "train.global_batch", "train.steps", "train.seed", "train.grad_clip",
    "train.precision", "train.recompute", "train.attention",
    "model.dropout", "model.attention_dropout",
    "parallel.overlap_grad_reduce", "parallel.overlap_param_gather", "parallel.overlap_tp_comm", "parallel.collective_matmul", "parallel.collective_matmul_min_rows", "train.optimizer.lr", "train.optimizer.betas",
    "train.optimizer.name", "train.lr_schedule.decay",
    "train.lr_schedule.warmup_steps", "data.format", "data.path",
    "parallel.dp", "parallel.tp", "parallel.pp", "parallel.cp",
    "parallel.cp_layout", "parallel.order",
    "parallel.microbatches",
    "parallel.schedule", "parallel.virtual_stages",
    "parallel.sequence_parallel", "parallel.bucket_mb",
    "parallel.stage_layers", "parallel.shard", "name", "model",
    "model.hidden.x", "model..hidden", ".", "model.hiden"};
const std::vector<int64_t> kLayoutValues = {
    0, -1, 1, 1, 2, 2, 3, 4, 8, 16, 4096, 65536, 65537, 16777217, INT32_MAX};
const std::vector<std::string> kSchedules = {"gpipe", "1f1b", "interleaved",
                                             "zigzag", ""};
// MLIR: types, attribute values and op names swapped in.
const std::vector<std::string> kMlirTokens = {
    "f32", "f64", "bf16", "i32", "i1", "index", "none", "tensor<f32>",
    "tensor<?xf32>", "tensor<0x4xf32>", "tensor<*xf32>",
    "tensor<9223372036854775807xf32>", "tensor<4x6xi32>", "memref<4xf32>",
    "tuple<f32>", "vector<4xf32>", "!dist.request", "#dist.axes<tp>",
    "#dist.axes<dp, dp>", "#dist.mesh<dp = 0>", "#dist.mesh<tp = -1>",
    "#dist.sharding<[[tp]], partial = []>",
    "#dist.sharding<[[tp]], partial = [], blocks = [0]>",
    "#graph.layer<block 9223372036854775807>", "#graph.layer<embedding>",
    "array<i64: 0, 2, 1>", "array<i64: 5, 5, 5>", "dense<1.0> : tensor<f32>",
    "unit", "\"\"", "@forward", "%0", "^bb0", "{}", "()", "[]", "->",
    "graph.param", "graph.input", "graph.matmul", "graph.add",
    "graph.cross_entropy", "graph.embedding", "graph.split", "graph.reshape",
    "graph.transpose", "dist.reshard", "dist.all_reduce", "pipe.schedule",
    "pipe.rank", "rt.param", "func.func", "func.return", "return",
    "builtin.module", "module"};

//===--- Mutations --------------------------------------------------------===//

// The [begin, end) ranges of the tokens of `text`: each starts where `start`
// accepts a character and goes on while `cont` does.
template <typename Start, typename Continue>
std::vector<std::pair<size_t, size_t>> tokens(const std::string &text,
                                              Start start, Continue cont) {
  std::vector<std::pair<size_t, size_t>> out;
  for (size_t i = 0; i < text.size();) {
    if (!start(text, i)) {
      ++i;
      continue;
    }
    size_t j = i + 1;
    while (j < text.size() && cont(text, j))
      ++j;
    out.push_back({i, j});
    i = j;
  }
  return out;
}

auto numberTokens(const std::string &t) {
  return tokens(
      t,
      [](const std::string &s, size_t i) {
        return (isDigit(s[i]) || s[i] == '-') && (i == 0 || !isAlnum(s[i - 1]));
      },
      [](const std::string &s, size_t j) {
        return isDigit(s[j]) || strchr(".eE+-", s[j]) != nullptr;
      });
}
// JSON strings, quotes included (escapes respected).
std::vector<std::pair<size_t, size_t>> stringTokens(const std::string &t) {
  std::vector<std::pair<size_t, size_t>> out;
  for (size_t i = 0; i < t.size(); ++i) {
    if (t[i] != '"')
      continue;
    size_t j = i + 1;
    while (j < t.size() && t[j] != '"')
      j += t[j] == '\\' ? 2 : 1;
    if (j >= t.size())
      break;
    out.push_back({i, j + 1});
    i = j;
  }
  return out;
}
auto wordTokens(const std::string &t) {
  return tokens(
      t,
      [](const std::string &s, size_t i) {
        return (isAlpha(s[i]) || strchr("%@^#!", s[i])) &&
               (i == 0 || !isAlnum(s[i - 1]));
      },
      [](const std::string &s, size_t j) {
        return isAlnum(s[j]) || s[j] == '_' || s[j] == '.';
      });
}

void replace(std::string &text, std::pair<size_t, size_t> range,
             const std::string &with) {
  text.replace(range.first, range.second - range.first, with);
}

std::string nested(Random &r, bool json) {
  static const std::vector<size_t> depths = {2, 63, 64, 65, 255, 256, 257,
                                             1000, 100000};
  size_t depth = r.pick(depths);
  std::string open, close;
  switch (r.below(json ? 2 : 5)) {
  case 0:
    open = "[", close = "]";
    break;
  case 1:
    open = json ? "{\"a\": " : "{", close = "}";
    break;
  case 2:
    open = "tuple<", close = ">";
    break;
  case 3:
    open = "(", close = ")";
    break;
  default:
    open = "[affine_map<(d0) -> (d0)>, ", close = "]";
    break;
  }
  std::string text;
  text.reserve(depth * (open.size() + close.size()) + 4);
  for (size_t i = 0; i < depth; ++i)
    text += open;
  text += json ? "1" : "f32";
  for (size_t i = 0; i < depth; ++i)
    text += close;
  return text;
}

constexpr size_t kMaxInput = 1 << 20;

void mutate(std::string &text, Random &r, bool json,
            const std::vector<std::string> &seeds) {
  size_t n = text.size();
  size_t at = r.below(n + 1);
  // How often each mutation below is picked (per 100): for specs mostly
  // the ones that keep the JSON well-formed, so that the checks behind the
  // parser are reached.
  static const unsigned jsonWeights[] = {3, 4, 3, 3, 2, 5, 15, 10,
                                         5, 2, 10, 7, 11, 15, 5};
  static const unsigned mlirWeights[] = {8, 8, 8, 8, 4, 6, 10, 5,
                                         4, 5, 12, 10, 6, 6, 0};
  const unsigned *weights = json ? jsonWeights : mlirWeights;
  unsigned roll = r.below(100), kind = 0;
  while (kind < 14 && roll >= weights[kind])
    roll -= weights[kind++];
  switch (kind) {
  case 0: // flip a bit
    if (n)
      text[r.below(n)] ^= char(1 << r.below(8));
    break;
  case 1: { // an interesting byte
    static const char bytes[] = {0,   '"', '{', '}', '[', ']', ',', ':',
                                 '\\', '<', '>', '(', ')', '%', '-', '\n'};
    char c = r.chance(20) ? char(0x80 + r.below(0x80))
                          : bytes[r.below(sizeof(bytes))];
    if (n && r.chance(50))
      text[r.below(n)] = c;
    else
      text.insert(at, 1, c);
    break;
  }
  case 2: // delete a range
    if (n)
      text.erase(at == n ? n - 1 : at, 1 + r.below(std::min<size_t>(n, 64)));
    break;
  case 3: { // repeat a range
    if (!n)
      break;
    size_t from = r.below(n), len = 1 + r.below(std::min<size_t>(n - from, 64));
    text.insert(at, text.substr(from, len));
    break;
  }
  case 4: // cut short
    text.resize(at);
    break;
  case 5: { // splice with another seed
    const std::string &other = r.pick(seeds);
    text = text.substr(0, at) + other.substr(r.below(other.size() + 1));
    break;
  }
  case 6:
  case 7: { // a number replaced by an extreme one
    auto numbers = numberTokens(text);
    if (!numbers.empty())
      replace(text, r.pick(numbers), r.pick(kNumbers));
    break;
  }
  case 8: { // a value nested deeply
    auto numbers = numberTokens(text);
    std::string deep = nested(r, json);
    if (!numbers.empty())
      replace(text, r.pick(numbers), deep);
    else
      text.insert(at, deep);
    break;
  }
  case 9: { // two lines swapped
    SmallVector<StringRef> lines;
    StringRef(text).split(lines, '\n');
    std::swap(lines[r.below(lines.size())], lines[r.below(lines.size())]);
    text = join(lines, "\n");
    break;
  }
  case 10:
  case 11: { // a string (JSON) or a word (MLIR) replaced
    if (json) {
      auto strings = stringTokens(text);
      if (strings.empty())
        break;
      std::string with = r.chance(70) ? "\"" + r.pick(kStrings) + "\""
                         : r.chance(50)
                             ? r.pick(kJsonValues)
                             : "\"" + std::string(r.chance(50) ? 100 : 100000,
                                                  'x') +
                                   "\"";
      replace(text, r.pick(strings), with);
    } else {
      auto words = wordTokens(text);
      if (!words.empty())
        replace(text, r.pick(words), r.pick(kMlirTokens));
    }
    break;
  }
  case 12: { // JSON: a value replaced; MLIR: a token inserted
    if (json) {
      auto numbers = numberTokens(text);
      if (!numbers.empty())
        replace(text, r.pick(numbers),
                r.chance(50) ? r.pick(kJsonValues)
                             : "\"" + r.pick(kStrings) + "\"");
    } else {
      text.insert(at, " " + r.pick(kMlirTokens) + " ");
    }
    break;
  }
  case 13: { // JSON: a key added; MLIR: a line repeated
    if (json) {
      std::vector<size_t> objects;
      for (size_t i = 0; i < n; ++i)
        if (text[i] == '{')
          objects.push_back(i + 1);
      if (objects.empty())
        break;
      std::string value = r.chance(50)   ? r.pick(kNumbers)
                          : r.chance(50) ? r.pick(kJsonValues)
                                         : "\"" + r.pick(kStrings) + "\"";
      text.insert(r.pick(objects),
                  "\"" + r.pick(kKeys) + "\": " + value + ", ");
    } else {
      size_t start = text.rfind('\n', at ? at - 1 : 0);
      start = start == std::string::npos ? 0 : start + 1;
      size_t end = text.find('\n', start);
      end = end == std::string::npos ? n : end + 1;
      text.insert(end, text.substr(start, end - start));
    }
    break;
  }
  case 14: { // JSON: a key of the same object given twice
    auto strings = stringTokens(text);
    std::vector<std::pair<size_t, size_t>> keys;
    for (auto s : strings) {
      size_t k = s.second;
      while (k < n && text[k] == ' ')
        ++k;
      if (k < n && text[k] == ':')
        keys.push_back(s);
    }
    if (keys.empty())
      break;
    auto key = r.pick(keys);
    size_t end = text.find_first_of(",}", key.second);
    if (end == std::string::npos)
      break;
    text.insert(key.first, text.substr(key.first, end - key.first) + ", ");
    break;
  }
  }
  if (text.size() > kMaxInput)
    text.resize(kMaxInput);
}

//===--- Reading the inputs -----------------------------------------------===//

// What a crash report names: the input being read.
std::string currentCase;
void printCurrentCase(void *) {
  if (!currentCase.empty())
    fprintf(stderr, "\ntessel-fuzz: crashed while reading %s\n",
            currentCase.c_str());
}

bool writeInput(StringRef path, StringRef text) {
  std::error_code ec;
  raw_fd_ostream os(path, ec);
  if (ec) {
    errs() << "tessel-fuzz: cannot write " << path << ": " << ec.message()
           << "\n";
    return false;
  }
  os << text;
  return true;
}

std::string shellQuote(StringRef text) {
  std::string out = "'";
  for (char c : text)
    out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

struct Tally {
  size_t inputs = 0, refused = 0, accepted = 0, built = 0, badMessages = 0;
};

// A refusal's message must name what is wrong briefly: not empty, not the
// input quoted at length, not the JSON library's own tags.
bool checkMessage(StringRef message, StringRef prefix, Tally &tally) {
  StringRef what = message;
  what.consume_front(prefix);
  std::string problem;
  if (what.trim().empty())
    problem = "an empty message";
  else if (what.size() > 600)
    problem = "a message of " + std::to_string(what.size()) + " bytes";
  else if (what.contains("[json.exception"))
    problem = "the JSON library's tag";
  if (problem.empty())
    return true;
  ++tally.badMessages;
  errs() << "tessel-fuzz: " << currentCase << ": refused with " << problem
         << ":\n  " << message.take_front(1000) << "\n";
  return false;
}

// Small enough to expand to the graph in a moment.
bool small(const tessel::Spec &spec) {
  const tessel::ModelSpec &m = spec.model;
  const tessel::ParallelSpec &p = spec.parallel;
  return m.layers <= 4 && m.hidden <= 256 && m.vocabSize <= 4096 &&
         m.seqLen <= 256 && m.ffnHidden <= 1024 &&
         spec.train.globalBatch <= 256 && p.dp * p.tp * p.pp <= 256;
}

int fuzzSpecs(const std::vector<std::pair<std::string, std::string>> &seeds,
              StringRef dir) {
  mlir::MLIRContext context;
  context.disableMultithreading();
  tessel::loadAllDialects(context);
  mlir::ScopedDiagnosticHandler quiet(
      &context, [](mlir::Diagnostic &) { return mlir::success(); });
  SmallString<256> path(dir);
  sys::path::append(path, "spec-case.json");
  std::vector<std::string> texts;
  for (auto &seed : seeds)
    texts.push_back(seed.second);
  Tally tally;
  for (auto &[name, seedText] : seeds)
    for (unsigned run = 0; run < runs; ++run) {
      Random r(seedOpt ^ hashOf(name) ^ (uint64_t(run) * 0x2545F4914F6CDD1Dull));
      std::string text = seedText;
      // The first run reads the seed itself.
      for (size_t k = 0, count = run ? 1 + r.below(3) : 0; k < count; ++k)
        mutate(text, r, /*json=*/true, texts);
      std::vector<std::string> overrides;
      tessel::LayoutOverrides layout;
      if (run && r.chance(25))
        for (size_t k = 0, count = 1 + r.below(3); k < count; ++k) {
          std::string value =
              r.chance(40)   ? r.pick(kNumbers)
              : r.chance(40) ? r.pick(kJsonValues)
              : r.chance(70) ? r.pick(kStrings)
              : r.chance(50) ? std::string("\xff\xfe")
                             : nested(r, /*json=*/true);
          overrides.push_back(r.pick(kSetPaths) + "=" + value);
        }
      if (run && r.chance(25)) {
        auto flag = [&](std::optional<int64_t> &field) {
          if (r.chance(40))
            field = r.pick(kLayoutValues);
        };
        flag(layout.dp), flag(layout.tp), flag(layout.pp);
        flag(layout.microbatches), flag(layout.virtualStages);
        if (r.chance(20))
          layout.cp = r.pick(kLayoutValues);
        if (r.chance(30))
          layout.schedule = r.pick(kSchedules);
        if (r.chance(15))
          layout.order = r.pick(kStrings);
        if (r.chance(30))
          layout.sequenceParallel = r.chance(50);
        if (r.chance(10))
          layout.layers = r.pick(kLayoutValues);
      }
      currentCase = "tessel compile " + std::string(path) +
                    " -o OUT --emit-only (seed " + name + ", run " +
                    std::to_string(run) + ")";
      for (const std::string &o : overrides)
        currentCase += " --set " + shellQuote(o);
      // The layout as the flags that give it (--layers is tessel check's).
      auto printFlag = [&](const char *name, std::optional<int64_t> value) {
        if (value)
          currentCase += std::string(" --") + name + "=" +
                         std::to_string(*value);
      };
      printFlag("dp", layout.dp), printFlag("tp", layout.tp);
      printFlag("pp", layout.pp);
      printFlag("cp", layout.cp);
      printFlag("microbatches", layout.microbatches);
      printFlag("virtual-stages", layout.virtualStages);
      printFlag("layers", layout.layers);
      if (layout.schedule)
        currentCase += " --schedule=" + shellQuote(*layout.schedule);
      if (layout.order)
        currentCase += " --order=" + shellQuote(*layout.order);
      if (layout.sequenceParallel)
        currentCase += *layout.sequenceParallel ? " --sp" : " --sp=false";
      if (!writeInput(path, text))
        return 2;
      ++tally.inputs;
      Expected<tessel::Spec> spec = tessel::loadSpec(path, overrides, layout);
      if (!spec) {
        ++tally.refused;
        std::string message = toString(spec.takeError());
        if (verbose)
          outs() << message << "\n";
        checkMessage(message, std::string(path) + ": ", tally);
        continue;
      }
      ++tally.accepted;
      if (!small(*spec))
        continue;
      mlir::OwningOpRef<mlir::ModuleOp> module =
          tessel::buildModel(context, *spec);
      if (module && succeeded(mlir::verify(*module)))
        ++tally.built;
    }
  currentCase.clear();
  outs() << "tessel-fuzz spec: " << tally.inputs << " inputs from "
         << seeds.size() << " seeds: " << tally.refused << " refused, "
         << tally.accepted << " accepted (" << tally.built
         << " expanded to the graph), " << tally.badMessages
         << " unclear refusals, no crash\n";
  return tally.badMessages ? 1 : 0;
}

int fuzzMlir(const std::vector<std::pair<std::string, std::string>> &seeds,
             StringRef dir) {
  mlir::MLIRContext context;
  context.disableMultithreading();
  tessel::loadAllDialects(context);
  size_t diagnostics = 0;
  mlir::ScopedDiagnosticHandler quiet(&context, [&](mlir::Diagnostic &) {
    ++diagnostics;
    return mlir::success();
  });
  SmallString<256> path(dir);
  sys::path::append(path, "mlir-case.mlir");
  std::vector<std::string> texts;
  for (auto &seed : seeds)
    texts.push_back(seed.second);
  size_t inputs = 0, deep = 0, parsed = 0, lowered = 0;
  for (auto &[name, seedText] : seeds)
    for (unsigned run = 0; run < runs; ++run) {
      Random r(seedOpt ^ hashOf(name) ^ (uint64_t(run) * 0x2545F4914F6CDD1Dull));
      std::string text = seedText;
      for (size_t k = 0, count = run ? 1 + r.below(3) : 0; k < count; ++k)
        mutate(text, r, /*json=*/false, texts);
      currentCase = "tessel compile " + std::string(path) +
                    " -o OUT --emit-only (seed " + name + ", run " +
                    std::to_string(run) + ")";
      if (!writeInput(path, text))
        return 2;
      ++inputs;
      // As `tessel compile` reads an .mlir file: refused when nested too
      // deep for the parser or holding a dense array it would crash on,
      // then parsed and verified.
      if (tessel::tooDeep(text, tessel::kMaxMLIRNesting) ||
          tessel::badDenseArray(text)) {
        ++deep;
        continue;
      }
      mlir::ParserConfig config(&context);
      mlir::OwningOpRef<mlir::ModuleOp> module =
          mlir::parseSourceString<mlir::ModuleOp>(text, config,
                                                  "mlir-case.mlir");
      if (!module)
        continue;
      ++parsed;
      if (!(*module)->hasAttr("graph.recipe"))
        tessel::setRecipeFromGraph(*module,
                                   tessel::defaultSpecForIR("mlir-case"));
      if (!lowerOpt)
        continue;
      mlir::PassManager pm(&context);
      tessel::TrainPipelineOptions options;
      tessel::buildTrainPipeline(pm, options);
      if (succeeded(pm.run(*module)))
        ++lowered;
    }
  currentCase.clear();
  outs() << "tessel-fuzz mlir: " << inputs << " inputs from " << seeds.size()
         << " seeds: " << deep
         << " refused before parsing (too deep, or an index dense array), "
         << parsed
         << " parsed and verified";
  if (lowerOpt)
    outs() << ", " << lowered << " lowered";
  outs() << ", no crash\n";
  return 0;
}

} // namespace

int main(int argc, char **argv) {
  sys::PrintStackTraceOnErrorSignal(argv[0]);
  sys::AddSignalHandler(printCurrentCase, nullptr);
  cl::ParseCommandLineOptions(
      argc, argv,
      "tessel-fuzz: reads mutated specs or .mlir files in-process; a crash "
      "fails the run\n");
  if (mode != "spec" && mode != "mlir") {
    errs() << "tessel-fuzz: expected spec or mlir, got '" << mode << "'\n";
    return 2;
  }
  bool json = mode == "spec";
  // The seeds, in name order.
  std::vector<std::pair<std::string, std::string>> seeds;
  std::error_code ec;
  for (sys::fs::directory_iterator it(corpus, ec), end; it != end && !ec;
       it.increment(ec)) {
    if (sys::path::extension(it->path()) != (json ? ".json" : ".mlir"))
      continue;
    auto buffer = MemoryBuffer::getFile(it->path());
    if (!buffer) {
      errs() << "tessel-fuzz: cannot read " << it->path() << "\n";
      return 2;
    }
    seeds.push_back({sys::path::filename(it->path()).str(),
                     (*buffer)->getBuffer().str()});
  }
  if (ec || seeds.empty()) {
    errs() << "tessel-fuzz: no " << (json ? "*.json" : "*.mlir")
           << " seeds in " << corpus << "\n";
    return 2;
  }
  llvm::sort(seeds);
  SmallString<256> dir(workDir);
  if (dir.empty()) {
    if (std::error_code err =
            sys::fs::createUniqueDirectory("tessel-fuzz", dir)) {
      errs() << "tessel-fuzz: cannot create a directory: " << err.message()
             << "\n";
      return 2;
    }
  } else if (std::error_code err = sys::fs::create_directories(dir)) {
    errs() << "tessel-fuzz: cannot create " << dir << ": " << err.message()
           << "\n";
    return 2;
  }
  auto start = std::chrono::steady_clock::now();
  int rc = json ? fuzzSpecs(seeds, dir) : fuzzMlir(seeds, dir);
  double seconds = std::chrono::duration<double>(
                       std::chrono::steady_clock::now() - start)
                       .count();
  outs().flush();
  errs() << formatv("tessel-fuzz {0}: {1:f1} s\n", mode.getValue(), seconds);
  if (workDir.empty())
    sys::fs::remove_directories(dir);
  return rc;
}
