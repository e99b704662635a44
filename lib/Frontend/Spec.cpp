//===- Spec.cpp - Reading and validating the JSON spec --------------------===//
//
// The schema lives in one place: the reads below. Every key is read through a
// `Section`, which knows the JSON path for messages and which keys were
// consumed, so unknown keys (typos) are reported rather than ignored.
//
//===----------------------------------------------------------------------===//

#include "tessel/Frontend/Spec.h"
#include "tessel/Pipeline/Schedule.h"
#include "tessel/Support/MeshLayout.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/GlobPattern.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"

#include <nlohmann/json.hpp>
#include <algorithm>
#include <cmath>
#include <set>

using namespace tessel;
using json = nlohmann::json;

namespace {
// A value quoted in a message: its JSON, cut to 60 characters (bytes that
// are not UTF-8, which a --set value can hold, are shown as U+FFFD).
std::string brief(const json &value) {
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  return text.size() > 60 ? text.substr(0, 57) + "..." : text;
}

// A key as a step of a JSON path: `.key` for a plain name, `["..."]`
// (quoted briefly) for anything else.
std::string pathStep(const std::string &key) {
  bool plain = !key.empty() && key.size() <= 60 &&
               llvm::all_of(key, [](char c) {
                 return llvm::isAlnum(c) || c == '_' || c == '-';
               });
  return plain ? "." + key : "[" + brief(json(key)) + "]";
}
std::string joinPath(const std::string &path, const std::string &key) {
  std::string step = pathStep(key);
  return path.empty() && step[0] == '.' ? step.substr(1) : path + step;
}

// A spec nests four levels deep; a value nested far deeper is refused before
// it is built (copying, comparing and printing a JSON value recurse once per
// level).
constexpr int kMaxJsonDepth = 64;

// Reads JSON text, refusing what the library would take silently or could
// not take: a key given twice in one object (the library keeps the last)
// and nesting deeper than kMaxJsonDepth. `path` is where the text sits in
// the spec (empty for a whole file); problems are reported with the JSON
// path of the value.
class JsonChecker : public nlohmann::json_sax<json> {
public:
  explicit JsonChecker(std::string path) : base(std::move(path)) {}
  std::string problem;  // "<path>: <what>", the first one
  std::string syntax;   // the parser's message, without the library's tag
  bool overflow = false; // a number too large for a double (1e400)

  bool null() override { return value(); }
  bool boolean(bool) override { return value(); }
  bool number_integer(number_integer_t) override { return value(); }
  bool number_unsigned(number_unsigned_t) override { return value(); }
  bool number_float(number_float_t, const string_t &) override {
    return value();
  }
  bool string(string_t &) override { return value(); }
  bool binary(binary_t &) override { return value(); }
  bool start_object(std::size_t) override { return open(true); }
  bool key(string_t &key) override {
    Frame &f = frames.back();
    f.key = key;
    if (!f.keys.insert(key).second)
      return fail("duplicate key (given twice in one object)");
    return true;
  }
  bool end_object() override { return close(); }
  bool start_array(std::size_t) override { return open(false); }
  bool end_array() override { return close(); }
  bool parse_error(std::size_t position, const std::string &,
                   const nlohmann::detail::exception &e) override {
    // "parse error at line L, column C: ...", without the library's tag
    // ("[json.exception.parse_error.101] "), and cut short: the token it
    // quotes can be a whole file.
    llvm::StringRef what(e.what());
    if (what.starts_with("[json.exception.") && what.contains("] "))
      what = what.split("] ").second;
    syntax = what.str();
    if (syntax.size() > 200)
      syntax = syntax.substr(0, 197) + "...";
    overflow = e.id == 406;
    if (!what.starts_with("parse error"))
      syntax += " (at byte " + std::to_string(position) + ")";
    return false;
  }

private:
  struct Frame {
    bool object;
    std::string key;  // objects: the key being read
    size_t index = 0; // arrays: the element being read
    std::set<std::string> keys;
  };
  // The path of the value being read, its first `steps` steps.
  std::string path(size_t steps = SIZE_MAX) const {
    std::string p = base;
    for (const Frame &f : llvm::ArrayRef(frames).take_front(steps))
      p = f.object ? joinPath(p, f.key)
                   : p + "[" + std::to_string(f.index) + "]";
    return p + (steps < frames.size() ? "..." : "");
  }
  bool fail(const std::string &what, size_t steps = SIZE_MAX) {
    std::string p = path(steps);
    problem = (p.empty() ? "" : p + ": ") + what;
    return false;
  }
  bool open(bool object) {
    if ((int)frames.size() >= kMaxJsonDepth)
      return fail("nested more than " + std::to_string(kMaxJsonDepth) +
                      " levels deep",
                  /*steps=*/4);
    frames.push_back({object, "", 0, {}});
    return true;
  }
  bool close() {
    frames.pop_back();
    return value();
  }
  bool value() {
    if (!frames.empty() && !frames.back().object)
      ++frames.back().index;
    return true;
  }
  std::string base;
  std::vector<Frame> frames;
};

// Parses `text`; the error is "not valid JSON: ..." or "<path>: <what>".
llvm::Expected<json> parseJson(llvm::StringRef text, const std::string &path) {
  // The JSON reader takes a NUL byte for the end of the input: what follows
  // would be ignored.
  if (size_t nul = text.find('\0'); nul != llvm::StringRef::npos) {
    llvm::StringRef before = text.take_front(nul);
    size_t lineStart = before.rfind('\n');
    return llvm::createStringError(
        "not valid JSON: a NUL byte at line " +
        std::to_string(before.count('\n') + 1) + ", column " +
        std::to_string(nul - (lineStart == llvm::StringRef::npos
                                  ? 0
                                  : lineStart + 1) +
                       1));
  }
  JsonChecker checker(path);
  json::sax_parse(text.begin(), text.end(), &checker);
  if (checker.overflow && !path.empty())
    // In a --set value: 1e400 is a number out of range, not a string.
    return llvm::createStringError(path + ": " + checker.syntax);
  if (!checker.syntax.empty())
    return llvm::createStringError("not valid JSON: " + checker.syntax);
  if (!checker.problem.empty())
    return llvm::createStringError(checker.problem);
  json doc = json::parse(text.begin(), text.end(), nullptr,
                         /*allow_exceptions=*/false);
  if (doc.is_discarded())
    return llvm::createStringError("not valid JSON");
  return doc;
}
} // namespace

// Limits on sizes (docs/spec.md): every size, offset and product the
// compiler and the generated programs compute stays far inside int64.
namespace {
constexpr int64_t kMaxVocab = int64_t(1) << 24;
constexpr int64_t kMaxSeqLen = int64_t(1) << 20;
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxHidden = int64_t(1) << 17;
constexpr int64_t kMaxHeads = 4096;
constexpr int64_t kMaxFfn = int64_t(1) << 20;
constexpr int64_t kMaxBatch = int64_t(1) << 24;
constexpr int64_t kMaxAxis = int64_t(1) << 16;
// Elements of the largest tensor of a step (batch x sequence x the widest
// of vocabulary, feed-forward, hidden) and parameters of the model.
constexpr double kMaxStepElements = double(int64_t(1) << 48);
constexpr double kMaxParameters = double(int64_t(1) << 44);
} // namespace

namespace {

constexpr const char *kScheduleNames[] = {"gpipe", "1f1b", "interleaved"};

// The first problem found, with its JSON path.
struct Problems {
  std::string first;
  void report(const std::string &path, const std::string &what) {
    if (first.empty())
      first = path + ": " + what;
  }
  bool any() const { return !first.empty(); }
};

class Section {
public:
  Section(const json *object, std::string path, Problems &problems)
      : object(object), path(std::move(path)), problems(problems) {}

  Section child(const std::string &key) {
    const json *value = find(key);
    if (value && !value->is_object()) {
      problems.report(at(key), "must be an object");
      value = nullptr;
    }
    return Section(value, at(key), problems);
  }
  int64_t integer(const std::string &key, int64_t fallback, int64_t min,
                  int64_t max = INT64_MAX) {
    const json *value = find(key);
    if (!value)
      return fallback;
    // Beyond int64 (2^63 and up, which the JSON reader keeps as unsigned
    // up to 2^64 and as a double past it, and below -2^63): out of range,
    // not a negative number nor "not an integer".
    bool huge = value->is_number_unsigned()
                    ? value->get<uint64_t>() > (uint64_t)INT64_MAX
                    : value->is_number_float() &&
                          std::abs(value->get<double>()) >= 0x1p63;
    if (huge) {
      problems.report(at(key), (value->get<double>() < 0
                                    ? "must be >= " + std::to_string(min)
                                    : "must be <= " + std::to_string(max)) +
                                   ", got " + brief(*value));
      return fallback;
    }
    if (!value->is_number_integer()) {
      problems.report(at(key), "must be an integer, got " +
                                   brief(*value));
      return fallback;
    }
    int64_t v = value->get<int64_t>();
    if (v < min || v > max) {
      problems.report(at(key), (v < min ? "must be >= " + std::to_string(min)
                                        : "must be <= " + std::to_string(max)) +
                                   ", got " + std::to_string(v));
      return fallback;
    }
    return v;
  }
  double number(const std::string &key, double fallback, double min) {
    const json *value = find(key);
    if (!value)
      return fallback;
    if (!value->is_number()) {
      problems.report(at(key), "must be a number, got " + brief(*value));
      return fallback;
    }
    double v = value->get<double>();
    if (!std::isfinite(v)) {
      // 1e400 reads as infinity.
      problems.report(at(key), "must be a finite number");
      return fallback;
    }
    if (!(v >= min))
      problems.report(at(key), "must be >= " + brief(json(min)) + ", got " +
                                   brief(*value));
    return v;
  }
  bool boolean(const std::string &key, bool fallback) {
    const json *value = find(key);
    if (!value)
      return fallback;
    if (!value->is_boolean()) {
      problems.report(at(key), "must be true or false, got " + brief(*value));
      return fallback;
    }
    return value->get<bool>();
  }
  std::string choice(const std::string &key, const std::string &fallback,
                     std::initializer_list<const char *> allowed) {
    const json *value = find(key);
    if (!value)
      return fallback;
    std::string options;
    for (const char *a : allowed)
      options += std::string(options.empty() ? "" : ", ") + "\"" + a + "\"";
    if (!value->is_string()) {
      problems.report(at(key), "must be one of " + options);
      return fallback;
    }
    std::string v = value->get<std::string>();
    for (const char *a : allowed)
      if (v == a)
        return v;
    problems.report(at(key),
                    "must be one of " + options + ", got " + brief(json(v)));
    return fallback;
  }
  std::string string(const std::string &key, const std::string &fallback) {
    const json *value = find(key);
    if (!value)
      return fallback;
    if (!value->is_string()) {
      problems.report(at(key), "must be a string, got " + brief(*value));
      return fallback;
    }
    return value->get<std::string>();
  }
  const json *raw(const std::string &key) { return find(key); }
  bool has(const std::string &key) const {
    return object && object->contains(key);
  }
  std::string at(const std::string &key) const {
    return joinPath(path, key);
  }
  // Reports keys that no read asked for.
  void rejectUnknown() {
    if (!object)
      return;
    for (auto &[key, value] : object->items())
      if (!consumed.count(key))
        problems.report(at(key), "unknown key");
  }

private:
  const json *find(const std::string &key) {
    consumed.insert(key);
    if (!object)
      return nullptr;
    auto it = object->find(key);
    return it == object->end() ? nullptr : &*it;
  }
  const json *object;
  std::string path;
  Problems &problems;
  std::set<std::string> consumed;
};

// Applies "a.b.c=value" to the document.
llvm::Error applyOverride(json &doc, const std::string &assignment) {
  size_t eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0)
    return llvm::createStringError("--set expects key=value, got '" +
                                   assignment + "'");
  std::string key = assignment.substr(0, eq), text = assignment.substr(eq + 1);
  llvm::SmallVector<llvm::StringRef> parts;
  llvm::StringRef(key).split(parts, '.');
  if (llvm::is_contained(parts, ""))
    return llvm::createStringError(
        "--set expects a dotted key such as train.optimizer.lr, got '" + key +
        "'");
  std::string path;
  for (llvm::StringRef part : parts)
    path = joinPath(path, part.str());
  json value;
  if (llvm::Expected<json> parsed = parseJson(text, path))
    value = std::move(*parsed);
  else if (std::string message = llvm::toString(parsed.takeError());
           llvm::StringRef(message).starts_with("not valid JSON"))
    value = text; // a bare string such as --set model.family=llama
  else
    return llvm::createStringError("--set " + message);
  json *node = &doc;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    json &next = (*node)[parts[i].str()];
    if (next.is_null())
      next = json::object();
    if (!next.is_object())
      return llvm::createStringError("--set " + key + ": '" + parts[i].str() +
                                     "' is not an object");
    node = &next;
  }
  (*node)[parts.back().str()] = value;
  return llvm::Error::success();
}

void readMoe(Section s, ModelSpec &m, Problems &problems) {
  MoeSpec &e = m.moe;
  if (!s.has("experts"))
    problems.report(s.at("experts"), "is required (the number of experts)");
  e.experts = s.integer("experts", 0, 1, 4096);
  e.topK = s.integer("top_k", 2, 1, 4096);
  e.every = s.integer("every", 1, 1, kMaxLayers);
  e.ffnHidden = s.integer("ffn_hidden", m.ffnHidden, 1, kMaxFfn);
  e.sharedExperts = s.integer("shared_experts", 0, 0, 64);
  if (const json *cf = s.raw("capacity_factor"); cf && !cf->is_null())
    e.capacityFactor = s.number("capacity_factor", 0.0, 0.0);
  if (const json *cf = s.raw("capacity_factor");
      cf && cf->is_number() && !(e.capacityFactor > 0))
    problems.report(s.at("capacity_factor"),
                    "must be > 0 (or null for dropless routing), got " +
                        brief(*cf));
  e.auxLossCoef = s.number("aux_loss_coef", 0.01, 0.0);
  e.zLossCoef = s.number("z_loss_coef", 0.001, 0.0);
  s.rejectUnknown();
  if (!problems.any() && e.topK > e.experts)
    problems.report(s.at("top_k"), "top_k = " + std::to_string(e.topK) +
                                       " is more than moe.experts = " +
                                       std::to_string(e.experts));
}

void readModel(Section s, ModelSpec &m, const LayoutOverrides &layout,
               Problems &problems) {
  m.family = s.choice("family", "", {"gpt", "llama"});
  if (!s.has("family"))
    problems.report(s.at("family"), "is required (\"gpt\" or \"llama\")");
  bool gpt = m.family != "llama";
  m.vocabSize = s.integer("vocab_size", 256, 2, kMaxVocab);
  m.vocabPadTo = s.integer("vocab_pad_to_multiple", 1, 1, 65536);
  m.seqLen = s.integer("seq_len", 64, 1, kMaxSeqLen);
  m.layers = s.integer("layers", 2, 1, kMaxLayers);
  if (layout.layers) {
    m.layers = *layout.layers;
    if (m.layers < 1 || m.layers > kMaxLayers)
      problems.report(s.at("layers"), "must be 1 to " +
                                          std::to_string(kMaxLayers) +
                                          ", got " + std::to_string(m.layers));
  }
  m.hidden = s.integer("hidden", 64, 1, kMaxHidden);
  m.heads = s.integer("heads", 4, 1, kMaxHeads);
  m.kvHeads = s.integer("kv_heads", m.heads, 1, kMaxHeads);
  m.ffnHidden = s.integer("ffn_hidden", 4 * m.hidden, 1, kMaxFfn);
  m.tieEmbeddings = s.boolean("tie_embeddings", gpt);
  m.normEps = s.number("norm_eps", 1e-5, 0.0);
  m.ropeTheta = s.number("rope_theta", 10000.0, 1.0);
  for (auto [key, field] : {std::pair<const char *, double *>{"dropout", &m.dropout},
                            {"attention_dropout", &m.attentionDropout}}) {
    *field = s.number(key, 0.0, 0.0);
    if (*field >= 1)
      problems.report(s.at(key), std::string("must be below 1 (the share of "
                                             "elements dropped), got ") +
                                     brief(json(*field)));
  }
  if (s.has("moe"))
    readMoe(s.child("moe"), m, problems);
  s.rejectUnknown();
  if (problems.any())
    return;
  if (m.hidden % m.heads != 0)
    problems.report(s.at("hidden"), "hidden = " + std::to_string(m.hidden) +
                                        " is not divisible by model.heads = " +
                                        std::to_string(m.heads));
  else if (m.heads % m.kvHeads != 0)
    problems.report(
        s.at("kv_heads"),
        "model.heads = " + std::to_string(m.heads) +
            " is not a multiple of kv_heads = " + std::to_string(m.kvHeads));
  else if (gpt && m.kvHeads != m.heads)
    problems.report(s.at("kv_heads"),
                    "the gpt family has no grouped KV heads; kv_heads must "
                    "equal heads");
  else if (!gpt && m.headDim() % 2 != 0)
    problems.report(s.at("hidden"), "llama needs an even head dimension "
                                    "(hidden / heads) for RoPE");
}

void readTrain(Section s, TrainSpec &t, Problems &problems) {
  t.globalBatch = s.integer("global_batch", 8, 1, kMaxBatch);
  t.steps = s.integer("steps", 100, 0);
  t.seed = static_cast<uint64_t>(s.integer("seed", 1234, 0));
  t.gradClip = s.number("grad_clip", 1.0, 0.0);
  t.evalEvery = s.integer("eval_every", 0, 0);
  t.evalBatches = s.integer("eval_batches", 8, 1);
  t.precision = s.choice("precision", "bf16", {"bf16", "fp32"});
  t.recompute = s.choice("recompute", "none", {"none", "selective", "full"});
  t.attention = s.choice("attention", "flash", {"flash", "unfused"});
  if (const json *layers = s.raw("recompute_layers")) {
    std::set<int64_t> seen;
    bool valid = layers->is_array() && !layers->empty();
    for (const json &l : valid ? *layers : json::array())
      valid &= l.is_number_integer() && l.get<int64_t>() >= 0 &&
               l.get<int64_t>() < kMaxLayers &&
               seen.insert(l.get<int64_t>()).second;
    if (!valid)
      problems.report(s.at("recompute_layers"),
                      "must be a list of distinct transformer block indices, "
                      "got " + brief(*layers));
    else
      t.recomputeLayers.assign(seen.begin(), seen.end());
  }
  Section opt = s.child("optimizer");
  t.optimizer = opt.choice("name", "adamw", {"adamw"});
  t.lr = opt.number("lr", 1e-3, 0.0);
  if (const json *betas = opt.raw("betas")) {
    if (!betas->is_array() || betas->size() != 2 || !(*betas)[0].is_number() ||
        !(*betas)[1].is_number())
      problems.report(opt.at("betas"), "must be two numbers, e.g. [0.9, 0.95]");
    else {
      t.beta1 = (*betas)[0].get<double>();
      t.beta2 = (*betas)[1].get<double>();
      if (t.beta1 < 0 || t.beta1 >= 1 || t.beta2 < 0 || t.beta2 >= 1)
        problems.report(opt.at("betas"), "each beta must be in [0, 1)");
    }
  }
  t.eps = opt.number("eps", 1e-8, 0.0);
  t.weightDecay = opt.number("weight_decay", 0.1, 0.0);
  opt.rejectUnknown();
  Section sched = s.child("lr_schedule");
  t.warmupSteps = sched.integer("warmup_steps", 0, 0);
  t.decay = sched.choice("decay", "cosine", {"cosine", "linear", "constant"});
  t.minLr = sched.number("min_lr", 0.0, 0.0);
  sched.rejectUnknown();
  s.rejectUnknown();
}

void readData(Section s, DataSpec &d, llvm::StringRef specDir,
              Problems &problems) {
  auto absolute = [&](const std::string &path) {
    llvm::SmallString<256> full(path);
    if (!path.empty() && !llvm::sys::path::is_absolute(full)) {
      full = specDir;
      llvm::sys::path::append(full, path);
    }
    return std::string(full);
  };
  // A blend: [{"path": ..., "weight": ...}, ...], drawn by Megatron's rule.
  if (const json *blend = s.raw("blend")) {
    std::string where = s.at("blend");
    if (!blend->is_array() || blend->empty())
      problems.report(where, "must be a non-empty list of {\"path\", "
                             "\"weight\"} objects");
    else
      for (size_t k = 0; k < blend->size(); ++k) {
        const json &e = (*blend)[k];
        std::string at = where + "[" + std::to_string(k) + "]";
        if (!e.is_object() || !e.contains("path") || !e["path"].is_string() ||
            e["path"].get<std::string>().empty() || !e.contains("weight") ||
            !e["weight"].is_number() || e["weight"].get<double>() <= 0 ||
            e.size() != 2)
          problems.report(at, "must be {\"path\": a non-empty string, "
                              "\"weight\": a number > 0}, got " +
                                  e.dump());
        else
          d.blend.push_back({absolute(e["path"].get<std::string>()),
                             e["weight"].get<double>()});
      }
    if (s.has("path"))
      problems.report(s.at("path"), "cannot be given with data.blend");
  }
  d.format = s.choice("format",
                      !d.blend.empty() ? "blend"
                      : s.has("path")  ? "llmc"
                                       : "synthetic",
                      {"llmc", "megatron", "synthetic", "blend"});
  std::string path = s.string("path", "");
  if (d.format == "blend" && d.blend.empty())
    problems.report(s.at("format"), "\"blend\" needs data.blend");
  if (d.format != "blend" && !d.blend.empty())
    problems.report(s.at("format"), "must be \"blend\" (or left out) with "
                                    "data.blend, got \"" + d.format + "\"");
  if (d.format != "synthetic" && d.format != "blend") {
    if (path.empty())
      problems.report(s.at("path"),
                      "is required for format \"" + d.format + "\"");
    llvm::SmallString<256> full(path);
    if (!path.empty() && !llvm::sys::path::is_absolute(full)) {
      full = specDir;
      llvm::sys::path::append(full, path);
    }
    d.path = std::string(full);
  }
  if (s.has("valid")) {
    std::string valid = s.string("valid", "");
    if (valid.empty())
      problems.report(s.at("valid"), "must name the validation data (a "
                                     "token file, Megatron prefix, "
                                     "directory or glob)");
    else
      d.valid = absolute(valid);
  }
  d.shuffle = s.boolean("shuffle", false);
  d.seed = static_cast<uint64_t>(s.integer("seed", 1234, 0));
  s.rejectUnknown();
}

// Replaces the fields the command line gives, with the spec's checks.
void applyLayout(Section &s, ParallelSpec &p, const LayoutOverrides &layout,
                 Problems &problems) {
  auto count = [&](const char *key, std::optional<int64_t> value,
                   int64_t &field, int64_t max) {
    if (!value)
      return;
    field = *value;
    if (field < 1)
      problems.report(s.at(key), "must be >= 1, got " + std::to_string(field));
    else if (field > max)
      problems.report(s.at(key), "must be <= " + std::to_string(max) +
                                     ", got " + std::to_string(field));
  };
  count("dp", layout.dp, p.dp, kMaxAxis);
  count("tp", layout.tp, p.tp, kMaxAxis);
  count("pp", layout.pp, p.pp, kMaxAxis);
  count("ep", layout.ep, p.ep, kMaxAxis);
  count("cp", layout.cp, p.cp, kMaxAxis);
  count("microbatches", layout.microbatches, p.microbatches, kMaxBatch);
  count("virtual_stages", layout.virtualStages, p.virtualStages, kMaxLayers);
  // Without tp the experts are whole: a spec's expert_tp goes with its tp.
  if (layout.tp && *layout.tp == 1)
    p.expertTp = 1;
  if (layout.sequenceParallel)
    p.sequenceParallel = *layout.sequenceParallel;
  if (layout.schedule) {
    p.schedule = *layout.schedule;
    if (!llvm::is_contained(kScheduleNames, p.schedule))
      problems.report(s.at("schedule"),
                      "must be one of \"gpipe\", \"1f1b\", \"interleaved\", "
                      "got \"" +
                          p.schedule + "\"");
  }
}

// The layers of each pipeline stage, when there is a pipeline: every layer
// once, in order, contiguously, one list per stage (virtual stages
// included). `stages` is a list of integer lists.
void readStageLayers(const json &stages, const std::string &where,
                     ParallelSpec &p, int64_t layers, Problems &problems) {
  int64_t count = p.pp * p.virtualStages;
  if ((int64_t)stages.size() != count) {
    problems.report(where,
                    "lists " + std::to_string(stages.size()) +
                        (stages.size() == 1 ? " stage" : " stages") +
                        " but the pipeline has " +
                        std::to_string(count) +
                        (p.virtualStages > 1
                             ? " (parallel.pp * parallel.virtual_stages)"
                             : " (parallel.pp)"));
    return;
  }
  for (auto [i, stage] : llvm::enumerate(stages)) {
    std::vector<int> list;
    for (const json &l : stage) {
      // Checked before narrowing: 4294967297 is not layer 1.
      bool big = l.is_number_unsigned() &&
                 l.get<uint64_t>() > (uint64_t)INT64_MAX;
      int64_t layer = big ? INT64_MAX : l.get<int64_t>();
      if (layer < 0 || layer >= layers) {
        problems.report(where, "layer " + brief(l) + " of stage " +
                                   std::to_string(i) +
                                   " does not exist (the model has layers 0.." +
                                   std::to_string(layers - 1) + ")");
        return;
      }
      list.push_back(static_cast<int>(layer));
    }
    p.stageLayers.push_back(std::move(list));
  }
  llvm::Expected<std::vector<int>> checked = pipeline::stagesFromLayerLists(
      p.stageLayers, static_cast<int>(layers),
      static_cast<int>(p.pp * p.virtualStages));
  if (!checked) {
    // "stage_layers: layer 0 is listed twice ...": the field is named once.
    std::string text = llvm::toString(checked.takeError());
    llvm::StringRef message(text);
    message.consume_front("stage_layers: ");
    problems.report(where, message.str());
  }
}

// What is wrong with a parallel.order that MeshShape::setOrder refuses.
std::string orderProblem(const std::string &order) {
  std::string quoted = brief(json(order));
  // A sound order but for where pp is: say why pp goes last.
  llvm::SmallVector<llvm::StringRef> names;
  llvm::StringRef(order).split(names, '-');
  std::string ppLast;
  for (llvm::StringRef name : names)
    if (name != "pp")
      ppLast += name.str() + "-";
  if (llvm::is_contained(names, "pp") && names.back() != "pp" &&
      MeshShape().setOrder(ppLast + "pp"))
    return "pp must be last (outermost), got " + quoted +
           ": each pipeline stage is one program, started on a contiguous "
           "block of ranks";
  return "must name dp, tp, cp, ep and pp once each, separated by '-', "
         "innermost first and pp last (the default is \"" +
         MeshShape().orderName() + "\"), got " + quoted;
}

void readParallel(Section s, ParallelSpec &p, const Spec &spec,
                  const LayoutOverrides &layout, Problems &problems) {
  p.dp = s.integer("dp", 1, 1, kMaxAxis);
  p.tp = s.integer("tp", 1, 1, kMaxAxis);
  p.pp = s.integer("pp", 1, 1, kMaxAxis);
  p.ep = s.integer("ep", 1, 1, kMaxAxis);
  p.cp = s.integer("cp", 1, 1, kMaxAxis);
  p.cpLayout = s.choice("cp_layout",
                        spec.model.moe.enabled() ? "contiguous" : "balanced",
                        {"balanced", "contiguous"});
  p.expertTp = s.integer("expert_tp", 1, 1, kMaxAxis);
  p.microbatches = s.integer("microbatches", 1, 1, kMaxBatch);
  p.schedule = s.choice("schedule", "1f1b", {"gpipe", "1f1b", "interleaved"});
  p.sequenceParallel = s.boolean("sequence_parallel", false);
  p.virtualStages = s.integer("virtual_stages", 1, 1, kMaxLayers);
  applyLayout(s, p, layout, problems);
  p.bucketMB = s.number("bucket_mb", 25.0, 0.0);
  p.overlapGradReduce = s.boolean("overlap_grad_reduce", true);
  p.overlapParamGather = s.boolean("overlap_param_gather", true);
  p.overlapTpComm = s.boolean("overlap_tp_comm", true);
  p.collectiveMatmul = s.boolean("collective_matmul", true);
  p.collectiveMatmulMinRows =
      s.integer("collective_matmul_min_rows", 512, 1, kMaxBatch);
  p.zero = s.integer("zero", 0, 0, 3);
  p.zeroGroup = s.integer("zero_group", 0, 0, kMaxAxis);
  // Without dp nothing is sharded: a spec's shard group goes with its dp.
  if (layout.dp && *layout.dp == 1)
    p.zeroGroup = 0;
  p.masterPieces = s.boolean("master_pieces", true);
  p.offload = s.choice("offload", "none", {"none", "optimizer"});
  p.order = s.string("order", p.order);
  if (layout.order)
    p.order = *layout.order;
  if (!MeshShape().setOrder(p.order))
    problems.report(s.at("order"), orderProblem(p.order));

  // parallel.stage_layers: checked against the model below, once the
  // layout is known to be sound.
  const json *stages = s.raw("stage_layers");
  if (stages) {
    bool ok = stages->is_array();
    if (ok)
      for (const json &stage : *stages) {
        ok &= stage.is_array();
        if (stage.is_array())
          for (const json &l : stage)
            ok &= l.is_number_integer();
      }
    if (!ok)
      problems.report(s.at("stage_layers"),
                      "must be a list of layer lists, e.g. [[0, 1], [2, 3]]");
  }
  if (const json *shard = s.raw("shard")) {
    if (!shard->is_object())
      problems.report(s.at("shard"), "must be an object mapping parameter "
                                     "name patterns to per-dimension axes");
    else
      for (auto &[pattern, dims] : shard->items()) {
        std::string where = s.at("shard") + "[" + brief(json(pattern)) + "]";
        if (auto glob = llvm::GlobPattern::create(pattern); !glob) {
          problems.report(where, "not a valid pattern: " +
                                     llvm::toString(glob.takeError()));
          continue;
        }
        ParallelSpec::ShardOverride o{pattern, {}};
        if (!dims.is_array()) {
          problems.report(where, "must be a list with one entry per "
                                 "dimension: null or \"tp\"");
          continue;
        }
        int split = 0;
        for (const json &d : dims) {
          if (d.is_null()) {
            o.dims.push_back("");
          } else if (d.is_string() && d.get<std::string>() == "tp") {
            o.dims.push_back("tp");
            ++split;
          } else {
            problems.report(where, "each entry must be null or \"tp\", got " +
                                       brief(d));
          }
        }
        if (split > 1)
          problems.report(where, "at most one dimension can be split");
        p.shard.push_back(o);
      }
  }
  s.rejectUnknown();
  if (problems.any())
    return;
  // The layout checks that hold for any backend come first, so that a user
  // learns about a bad layout before learning what is not built yet.
  if (spec.train.globalBatch % (p.dp * p.ep * p.microbatches) != 0)
    problems.report(s.at("dp"),
                    std::string(p.ep > 1 ? "parallel.dp * parallel.ep"
                                         : "parallel.dp") +
                        " * parallel.microbatches = " +
                        std::to_string(p.dp * p.ep * p.microbatches) +
                        " does not divide train.global_batch = " +
                        std::to_string(spec.train.globalBatch));
  else if (p.ep > 1 && !spec.model.moe.enabled())
    problems.report(s.at("ep"), "expert parallelism splits the experts of "
                                "a mixture-of-experts model: model.moe is "
                                "not set");
  else if (p.ep > 1 && spec.model.moe.experts % p.ep != 0)
    problems.report(s.at("ep"), "parallel.ep = " + std::to_string(p.ep) +
                                    " does not divide model.moe.experts = " +
                                    std::to_string(spec.model.moe.experts));
  else if (p.expertTp > 1 && !spec.model.moe.enabled())
    problems.report(s.at("expert_tp"),
                    "tensor parallelism inside the experts splits the "
                    "experts of a mixture-of-experts model: model.moe is "
                    "not set");
  else if (p.expertTp != 1 && p.expertTp != p.tp)
    problems.report(s.at("expert_tp"),
                    "parallel.expert_tp = " + std::to_string(p.expertTp) +
                        " must be 1 (experts whole) or parallel.tp = " +
                        std::to_string(p.tp) + " (experts split over tp)");
  else if (p.expertTp > 1 && spec.model.moe.ffnHidden % p.expertTp != 0)
    problems.report(s.at("expert_tp"),
                    "parallel.expert_tp = " + std::to_string(p.expertTp) +
                        " does not divide model.moe.ffn_hidden = " +
                        std::to_string(spec.model.moe.ffnHidden));
  else if (spec.model.heads % p.tp != 0)
    problems.report(s.at("tp"), "parallel.tp = " + std::to_string(p.tp) +
                                    " does not divide model.heads = " +
                                    std::to_string(spec.model.heads));
  else if (spec.model.kvHeads % p.tp != 0 && p.tp % spec.model.kvHeads != 0)
    problems.report(s.at("tp"), "parallel.tp = " + std::to_string(p.tp) +
                                    " neither divides nor is a multiple of "
                                    "model.kv_heads = " +
                                    std::to_string(spec.model.kvHeads));
  else if (spec.train.attention == "unfused" && spec.model.kvHeads % p.tp != 0)
    problems.report(s.at("tp"), "parallel.tp = " + std::to_string(p.tp) +
                                    " does not divide model.kv_heads = " +
                                    std::to_string(spec.model.kvHeads) +
                                    ", which train.attention = \"unfused\" "
                                    "needs (each rank's query heads read its "
                                    "own key heads)");
  else if (spec.model.ffnHidden % p.tp != 0)
    problems.report(s.at("tp"), "parallel.tp = " + std::to_string(p.tp) +
                                    " does not divide model.ffn_hidden = " +
                                    std::to_string(spec.model.ffnHidden));
  else if (spec.model.paddedVocab() % p.tp != 0)
    problems.report(
        s.at("tp"),
        "parallel.tp = " + std::to_string(p.tp) +
            " does not divide model.vocab_size = " +
            std::to_string(spec.model.vocabSize) +
            (spec.model.vocabPadTo > 1
                 ? " padded to a multiple of " +
                       std::to_string(spec.model.vocabPadTo) + " (" +
                       std::to_string(spec.model.paddedVocab()) + ")"
                 : std::string()) +
            "; set model.vocab_pad_to_multiple to a multiple of " +
            std::to_string(p.tp) + " (128 x tp is usual)");
  else if (spec.model.seqLen % p.cp != 0)
    problems.report(s.at("cp"), "parallel.cp = " + std::to_string(p.cp) +
                                    " does not divide model.seq_len = " +
                                    std::to_string(spec.model.seqLen));
  else if (p.sequenceParallel && (spec.model.seqLen / p.cp) % p.tp != 0)
    problems.report(s.at("sequence_parallel"),
                    "parallel.tp = " + std::to_string(p.tp) +
                        " does not divide model.seq_len = " +
                        std::to_string(spec.model.seqLen) +
                        (p.cp > 1 ? " / parallel.cp = " +
                                        std::to_string(spec.model.seqLen /
                                                       p.cp)
                                  : std::string()));
  else if (p.cpBalanced() && spec.model.seqLen % (2 * p.cp) != 0)
    problems.report(s.at("cp_layout"),
                    "\"balanced\" cuts model.seq_len = " +
                        std::to_string(spec.model.seqLen) + " into 2 x "
                        "parallel.cp = " + std::to_string(2 * p.cp) +
                        " chunks, which it does not divide; use "
                        "\"contiguous\"");
  else if (p.cpBalanced() && spec.model.moe.enabled())
    problems.report(s.at("cp_layout"),
                    "\"balanced\" is not supported for mixture-of-experts "
                    "models (their capacity counts tokens in the sequence's "
                    "order): use \"contiguous\"");
  else if (p.cp > 1 && spec.train.attention == "unfused")
    problems.report(s.at("cp"),
                    "context parallelism needs train.attention = \"flash\" "
                    "(unfused attention's causal softmax would gather each "
                    "rank's scores whole)");
  else if (p.pp > spec.model.layers)
    problems.report(s.at("pp"), "parallel.pp = " + std::to_string(p.pp) +
                                    " exceeds model.layers = " +
                                    std::to_string(spec.model.layers) +
                                    " (every stage needs a layer)");
  else if (p.virtualStages > 1 && p.pp == 1)
    problems.report(s.at("virtual_stages"),
                    "parallel.virtual_stages = " +
                        std::to_string(p.virtualStages) +
                        " needs parallel.pp > 1 (virtual stages interleave "
                        "the chunks of several pipeline ranks)");
  else if (p.virtualStages > 1 && p.schedule != "interleaved")
    problems.report(s.at("virtual_stages"),
                    "virtual stages need parallel.schedule = \"interleaved\"");
  else if (p.pp > 1 && p.schedule == "interleaved" && p.virtualStages < 2)
    problems.report(s.at("virtual_stages"),
                    "the interleaved schedule needs parallel.virtual_stages "
                    ">= 2");
  else if (p.pp * p.virtualStages > spec.model.layers && p.pp > 1)
    problems.report(
        s.at("virtual_stages"),
        "parallel.pp * parallel.virtual_stages = " +
            std::to_string(p.pp * p.virtualStages) +
            " exceeds model.layers = " + std::to_string(spec.model.layers));
  else if (p.pp > 1 && p.schedule == "interleaved" &&
           p.microbatches % p.pp != 0)
    problems.report(s.at("microbatches"),
                    "the interleaved schedule needs parallel.microbatches = " +
                        std::to_string(p.microbatches) +
                        " to be a multiple of parallel.pp = " +
                        std::to_string(p.pp));
  else if (p.zeroGroup > 0 && p.zero == 0)
    problems.report(s.at("zero_group"),
                    "shards ZeRO's state over groups of dp ranks: it needs "
                    "parallel.zero >= 1");
  else if (p.zeroGroup == 1)
    problems.report(s.at("zero_group"),
                    "= 1 would shard nothing (every rank its own group); use "
                    "parallel.zero = 0, or a group of 2 or more dp ranks");
  else if (p.zeroGroup > 0 && p.dp % p.zeroGroup != 0)
    problems.report(s.at("zero_group"),
                    "parallel.zero_group = " + std::to_string(p.zeroGroup) +
                        " does not divide parallel.dp = " +
                        std::to_string(p.dp));
  else if (stages && p.pp > 1)
    readStageLayers(*stages, s.at("stage_layers"), p, spec.model.layers,
                    problems);
}

} // namespace

namespace {
constexpr size_t kMaxNameLength = 64;
bool isNameChar(char c) {
  return llvm::isAlnum(c) || c == '.' || c == '_' || c == '-';
}
// A file's stem as a run name: '-' for each character outside the set.
std::string safeName(llvm::StringRef stem) {
  std::string name = stem.str();
  for (char &c : name)
    if (!isNameChar(c))
      c = '-';
  if (name.empty() || name.size() > kMaxNameLength)
    name = "model";
  return name;
}
} // namespace

llvm::Expected<Spec> tessel::loadSpec(llvm::StringRef path,
                                      llvm::ArrayRef<std::string> overrides,
                                      const LayoutOverrides &layout) {
  auto buffer = llvm::MemoryBuffer::getFile(path);
  if (!buffer)
    return llvm::createStringError(
        path + ": cannot read: " + buffer.getError().message());
  llvm::Expected<json> parsed = parseJson((*buffer)->getBuffer(), "");
  if (!parsed)
    return llvm::createStringError(path + ": " +
                                   llvm::toString(parsed.takeError()));
  json doc = std::move(*parsed);
  if (!doc.is_object())
    return llvm::createStringError(path + ": the spec must be a JSON object");
  for (const std::string &assignment : overrides)
    if (llvm::Error err = applyOverride(doc, assignment))
      return std::move(err);
  // The spec as compiled: the layout flags in their fields.
  json resolved = doc;
  if (!resolved.contains("parallel") || !resolved["parallel"].is_object())
    resolved["parallel"] = json::object();
  json &parallel = resolved["parallel"];
  auto put = [&](const char *key, const auto &value) {
    if (value)
      parallel[key] = *value;
  };
  put("dp", layout.dp);
  put("tp", layout.tp);
  put("pp", layout.pp);
  put("ep", layout.ep);
  put("cp", layout.cp);
  put("microbatches", layout.microbatches);
  put("virtual_stages", layout.virtualStages);
  put("schedule", layout.schedule);
  put("order", layout.order);
  put("sequence_parallel", layout.sequenceParallel);
  if (layout.layers && resolved.contains("model") &&
      resolved["model"].is_object())
    resolved["model"]["layers"] = *layout.layers;

  Spec spec;
  spec.name = llvm::sys::path::stem(path).str();
  Problems problems;
  Section root(&doc, "", problems);
  if (!root.has("model"))
    problems.report("model", "is required");
  readModel(root.child("model"), spec.model, layout, problems);
  readTrain(root.child("train"), spec.train, problems);
  llvm::SmallString<256> dir(path);
  llvm::sys::path::remove_filename(dir);
  if (dir.empty())
    dir = ".";
  llvm::sys::fs::make_absolute(dir);
  readData(root.child("data"), spec.data, dir, problems);
  if (!spec.data.path.empty() && resolved.contains("data") &&
      resolved["data"].is_object())
    resolved["data"]["path"] = spec.data.path;
  if (!spec.data.valid.empty() && resolved.contains("data") &&
      resolved["data"].is_object())
    resolved["data"]["valid"] = spec.data.valid;
  if (!spec.data.blend.empty()) {
    json blend = json::array();
    for (const auto &[path, weight] : spec.data.blend)
      blend.push_back({{"path", path}, {"weight", weight}});
    resolved["data"]["blend"] = blend;
  }
  // (A spec with text that is not UTF-8 is refused below; its document is
  // never used, but must not throw.)
  spec.document =
      resolved.dump(2, ' ', false, json::error_handler_t::replace) + "\n";
  if (!problems.any()) {
    const ModelSpec &m = spec.model;
    double widest = std::max({double(m.paddedVocab()), double(m.ffnHidden),
                              4.0 * double(m.hidden)});
    double step = double(spec.train.globalBatch) * double(m.seqLen) * widest;
    double params = double(m.layers) * (4.0 * m.hidden * m.hidden +
                                        3.0 * m.hidden * m.ffnHidden) +
                    2.0 * double(m.paddedVocab()) * m.hidden;
    if (step > kMaxStepElements)
      problems.report("train.global_batch",
                      "global_batch x model.seq_len x the widest layer = " +
                          llvm::formatv("{0:e2}", step).str() +
                          " elements exceeds the limit of 2^48");
    else if (params > kMaxParameters)
      problems.report("model", "about " + llvm::formatv("{0:e2}", params).str() +
                                   " parameters exceeds the limit of 2^44");
    const TrainSpec &t = spec.train;
    if (!t.recomputeLayers.empty() && t.recomputeLayers.back() >= m.layers)
      problems.report("train.recompute_layers",
                      "block " + std::to_string(t.recomputeLayers.back()) +
                          " does not exist (the model has blocks 0.." +
                          std::to_string(m.layers - 1) + ")");
    else if (!t.recomputeLayers.empty() && t.recompute != "full")
      problems.report("train.recompute_layers",
                      "applies to train.recompute = \"full\", which is \"" +
                          t.recompute + "\"");
    if (m.attentionDropout > 0 && t.attention != "unfused")
      problems.report("model.attention_dropout",
                      "drops attention probabilities, which only "
                      "train.attention = \"unfused\" materialises (it is "
                      "\"" + t.attention + "\")");
  }
  if (!problems.any())
    readParallel(root.child("parallel"), spec.parallel, spec, layout, problems);
  // The name reaches launch files (#SBATCH --job-name), plan.json and
  // messages: letters, digits, '.', '_' and '-' only. A spec's file name
  // outside that set gives a name with '-' for each other character.
  spec.name = safeName(spec.name);
  if (root.has("name")) {
    std::string name = root.string("name", spec.name);
    if (name.empty() || name.size() > kMaxNameLength ||
        !llvm::all_of(name, isNameChar))
      problems.report("name", "must be 1 to " +
                                  std::to_string(kMaxNameLength) +
                                  " letters, digits, '.', '_' or '-', got " +
                                  brief(json(name)));
    else
      spec.name = name;
  }
  root.rejectUnknown();
  if (problems.any())
    return llvm::createStringError(path + ": " + problems.first);
  return spec;
}

LayoutOverrides LayoutOverrides::oneRank() {
  LayoutOverrides one;
  one.dp = one.tp = one.pp = one.microbatches = one.virtualStages = 1;
  one.ep = one.cp = 1;
  one.schedule = "1f1b";
  one.sequenceParallel = false;
  return one;
}

std::string LayoutOverrides::describe() const {
  std::string text;
  auto add = [&](const std::string &item) {
    text += (text.empty() ? "" : " ") + item;
  };
  auto count = [&](const char *name, std::optional<int64_t> value) {
    if (value)
      add(std::string(name) + "=" + std::to_string(*value));
  };
  count("dp", dp);
  count("tp", tp);
  count("pp", pp);
  count("ep", ep);
  count("cp", cp);
  count("microbatches", microbatches);
  if (sequenceParallel && *sequenceParallel)
    add("sp");
  if (schedule)
    add("schedule=" + *schedule);
  if (order)
    add("order=" + *order);
  count("virtual_stages", virtualStages);
  count("layers", layers);
  return text.empty() ? "as in the spec" : text;
}

Spec tessel::defaultSpecForIR(llvm::StringRef name) {
  Spec spec;
  spec.name = safeName(name);
  return spec;
}

int64_t MoeSpec::capacity(int64_t tokens) const {
  if (!(capacityFactor > 0))
    return 0;
  return (int64_t)std::ceil(capacityFactor * (double)tokens * (double)topK /
                            (double)experts);
}
