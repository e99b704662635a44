//===- Generate.cpp - `tessel generate`: text from an inference plan ------===//
//
// tessel generate DIR --weights PATH --prompt TEXT runs the rank programs of
// a plan compiled with `tessel compile SPEC --inference` (as `tessel run`
// runs a training plan's) and shows what they generate as it comes. The
// prompt is encoded here and passed as ids (--prompt-tokens); rank 0 prints
// one JSON event per line on its stdout, which is a pipe read here:
//
//   {"event":"start","prompt":[ids],"max_len":T,"vocab":V,"ranks":R}
//   {"event":"token","index":k,"id":I}                  (one per new token)
//   {"event":"end","prompt_tokens":P,"new_tokens":n,"prefill_s":x,
//    "decode_s":y,"decode_tokens_per_s":z,"stopped":"max_new_tokens"|"eos"|
//    "context"}
//
// Ids become text through GPT-2's BPE (given, or the files a Hugging Face
// export keeps beside its weights) or one byte per id. A token's bytes may
// end inside a UTF-8 sequence; what is printed stops before such a sequence
// until its last byte arrives.
//
//===----------------------------------------------------------------------===//

#include "Commands.h"
#include "Tokenizer.h"

#include "llvm/ADT/StringExtras.h"
#include "llvm/ADT/StringRef.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/raw_ostream.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <optional>

using namespace llvm;
using nlohmann::json;
using tessel::fail;
using tessel::inQuotes;

namespace {

const char *kUsage =
    R"(usage: tessel generate DIR --weights PATH (--prompt TEXT | --prompt-tokens 1,2,3)
                       [--max-new-tokens N] [--temperature T] [--top-k K] [--seed S]
                       [--eos ID | --no-eos] [--tokenizer DIR | --vocab-json F --merges F]
                       [--logits FILE] [--json]
Generates text with a plan compiled by tessel compile SPEC --inference -o DIR.
  --weights PATH       the model's weights: a .safetensors file (tessel run
                       --save-final, or the model.safetensors of tessel export
                       --to hf) or a checkpoint directory
  --prompt TEXT        the prompt, encoded by the tokenizer
  --prompt-tokens IDS  the prompt as token ids, separated by commas
  --max-new-tokens N   at most N new tokens (default 32); generation also
                       stops at the end-of-text token and at the plan's
                       context length (plan.json's inference.max_len)
  --temperature T      sample from softmax(logits / T); 0, the default,
                       takes the most likely token
  --top-k K            sample from the K most likely tokens only
  --seed S             the seed of the sampling
  --eos ID             stop after token ID (default: the tokenizer's
                       <|endoftext|>, when it has one)
  --no-eos             do not stop at an end-of-text token
  --tokenizer DIR      GPT-2's BPE from DIR/vocab.json and DIR/merges.txt;
                       --tokenizer bytes: one token per byte
  --vocab-json F --merges F
                       GPT-2's BPE from these files. Without a tokenizer,
                       the vocab.json and merges.txt beside --weights (as
                       tessel export --to hf writes them), else one token
                       per byte (as tessel data prepare encodes)
  --logits FILE        rank 0 writes each new token's logits to FILE (raw
                       little-endian float32, one row of vocab_size values
                       per new token)
  --json               print one JSON object at the end instead:
                       {"prompt": [ids], "generated": [ids], "text": "...",
                       "tokens_per_s": x, "stopped": "max_new_tokens" | "eos" |
                       "context"} ("text", the new tokens' text, only with a
                       tokenizer)
Without --json, the prompt and then each new token's text go to stdout as
they come (token ids, separated by spaces, for --prompt-tokens without a
tokenizer), and a summary to stderr. The end-of-text token that stops the
text is not printed; an id the tokenizer does not have (a vocabulary padded
past the tokenizer's; an id of 256 or more, one token per byte) prints as
nothing.
)";

int usageError(const Twine &message) {
  return fail("generate: " + message + " (see tessel generate --help)");
}

// The flags of `tessel generate`, for parseArguments and "did you mean".
const StringRef kValueFlags[] = {
    "--weights",     "--prompt",     "--prompt-tokens", "--max-new-tokens",
    "--temperature", "--top-k",      "--seed",          "--eos",
    "--tokenizer",   "--vocab-json", "--merges",        "--logits"};
const StringRef kSwitches[] = {"--json", "--no-eos", "--help", "-h"};

std::string nearestFlag(StringRef arg) {
  StringRef name = arg.split('=').first;
  StringRef best;
  unsigned bestDistance = std::max<unsigned>(2, name.size() / 3) + 1;
  auto consider = [&](StringRef flag) {
    unsigned d = name.edit_distance(flag);
    if (d < bestDistance) {
      bestDistance = d;
      best = flag;
    }
  };
  for (StringRef flag : kValueFlags)
    consider(flag);
  for (StringRef flag : kSwitches)
    consider(flag);
  return best.str();
}

// "1,2,3" as ids; false when it is not a list of non-negative integers.
bool parseIds(StringRef text, std::vector<int32_t> &ids) {
  SmallVector<StringRef> parts;
  text.split(parts, ',');
  for (StringRef part : parts) {
    int32_t id;
    if (part.trim().getAsInteger(10, id) || id < 0)
      return false;
    ids.push_back(id);
  }
  return !ids.empty();
}

// How ids become text: GPT-2's BPE, or one byte per id.
struct Detokenizer {
  std::optional<tessel::Gpt2Bpe> bpe;
  // Given or found beside the weights (rather than bytes by default).
  bool chosen = false;
  std::string vocabPath; // the BPE's vocab.json
  bool found = false;    // beside the weights, not given

  std::string bytesOf(int32_t id) const {
    if (bpe)
      return bpe->decode({id});
    return id < 256 ? std::string(1, (char)id) : std::string();
  }
  std::vector<int32_t> encode(StringRef text) {
    std::vector<int32_t> ids;
    if (bpe)
      bpe->encode(std::string_view(text.data(), text.size()), ids);
    else
      for (unsigned char c : text)
        ids.push_back(c);
    return ids;
  }
};

// How much of `bytes` can be printed now: all but a UTF-8 sequence at the
// end that more bytes would complete.
size_t completeUtf8Length(StringRef bytes) {
  size_t n = bytes.size();
  for (size_t back = 1; back <= std::min<size_t>(4, n); ++back) {
    unsigned char c = bytes[n - back];
    if ((c & 0xc0) == 0x80)
      continue; // a continuation byte
    size_t length = (c >> 5) == 6    ? 2
                    : (c >> 4) == 14 ? 3
                    : (c >> 3) == 30 ? 4
                                     : 1;
    return back < length ? n - back : n;
  }
  return n; // continuation bytes with no lead: nothing completes them
}

// Text to stdout as it comes, flushed, each UTF-8 sequence whole.
class TextOut {
public:
  void write(StringRef bytes) {
    pending_ += bytes;
    size_t ready = completeUtf8Length(pending_);
    if (!ready)
      return;
    outs() << StringRef(pending_).take_front(ready);
    outs().flush();
    pending_.erase(0, ready);
    wrote_ = true;
  }
  // The rest, complete or not.
  void finish() {
    outs() << pending_;
    pending_.clear();
    outs().flush();
  }
  bool wrote() const { return wrote_ || !pending_.empty(); }

private:
  std::string pending_;
  bool wrote_ = false;
};

// The tokenizer the flags choose: --tokenizer, --vocab-json and --merges,
// the files beside the weights, or one token per byte.
Expected<Detokenizer>
chooseTokenizer(std::map<std::string, std::string> &values, StringRef weights) {
  Detokenizer tokenizer;
  std::string vocabJson, merges;
  if (values.count("--tokenizer") && values["--tokenizer"] != "bytes") {
    SmallString<256> vocab(values["--tokenizer"]), mergesPath(vocab);
    sys::path::append(vocab, "vocab.json");
    sys::path::append(mergesPath, "merges.txt");
    if (!sys::fs::exists(vocab) || !sys::fs::exists(mergesPath))
      return createStringError(
          "--tokenizer " + values["--tokenizer"] +
          ": expected a directory with vocab.json and merges.txt (a Hugging "
          "Face GPT-2 tokenizer's files), or bytes");
    vocabJson = vocab.str().str();
    merges = mergesPath.str().str();
  } else if (values.count("--vocab-json")) {
    vocabJson = values["--vocab-json"];
    merges = values["--merges"];
  } else if (!values.count("--tokenizer")) {
    SmallString<256> beside(weights);
    if (!sys::fs::is_directory(beside))
      sys::path::remove_filename(beside);
    if (beside.empty())
      beside = ".";
    SmallString<256> vocab(beside), mergesPath(beside);
    sys::path::append(vocab, "vocab.json");
    sys::path::append(mergesPath, "merges.txt");
    if (sys::fs::exists(vocab) && sys::fs::exists(mergesPath)) {
      vocabJson = vocab.str().str();
      merges = mergesPath.str().str();
    }
  }
  tokenizer.chosen = values.count("--tokenizer") || !vocabJson.empty();
  tokenizer.vocabPath = vocabJson;
  tokenizer.found = !vocabJson.empty() && !values.count("--tokenizer") &&
                    !values.count("--vocab-json");
  if (!vocabJson.empty()) {
    try {
      tokenizer.bpe = tessel::Gpt2Bpe::load(vocabJson, merges);
    } catch (const std::exception &e) {
      return createStringError(e.what());
    }
  }
  return tokenizer;
}

// What rank 0 reports, line by line, and what is shown of it as it comes.
class Generation {
public:
  Generation(const std::vector<int32_t> &prompt, const Detokenizer &tokenizer,
             bool showText, bool quiet, int64_t eos)
      : prompt_(prompt), tokenizer_(tokenizer), showText_(showText),
        quiet_(quiet), eos_(eos) {}

  // Bytes of rank 0's stdout.
  void read(StringRef bytes) {
    line_ += bytes;
    size_t newline;
    while ((newline = line_.find('\n')) != std::string::npos) {
      readLine(StringRef(line_).take_front(newline));
      line_.erase(0, newline + 1);
    }
  }
  // After the ranks have ended: what is left.
  void finish() {
    if (!line_.empty())
      readLine(line_);
    line_.clear();
    text_.finish();
  }

  std::vector<int32_t> generated;
  bool ended = false;
  json end;
  std::string malformed; // the first event that is not as documented
  // Whether anything went to stdout (a line to end before an error).
  bool wrote() const { return text_.wrote() || wroteIds_; }

private:
  // One event; any other line (another rank's output) goes to stderr.
  void readLine(StringRef line) {
    json event = json::parse(line, nullptr, false);
    if (event.is_discarded() || !event.is_object() ||
        !event.contains("event") || !event["event"].is_string()) {
      if (!line.trim().empty())
        errs() << line << "\n";
      return;
    }
    std::string kind = event["event"].get<std::string>();
    if (kind == "start") {
      if (!quiet_)
        showPrompt();
    } else if (kind == "token") {
      json id = event.value("id", json());
      if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
          id.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
        if (malformed.empty())
          malformed = line.str();
        return;
      }
      generated.push_back(id.get<int32_t>());
      if (!quiet_)
        showToken(generated.back());
    } else if (kind == "end") {
      ended = true;
      end = std::move(event);
    } else {
      errs() << line << "\n";
    }
  }

  void showPrompt() {
    for (int32_t id : prompt_) {
      if (showText_) {
        text_.write(tokenizer_.bytesOf(id));
      } else {
        outs() << (wroteIds_ ? " " : "") << id;
        wroteIds_ = true;
      }
    }
    outs().flush();
  }

  void showToken(int32_t id) {
    if (!showText_) {
      outs() << (wroteIds_ ? " " : "") << id;
      outs().flush();
      wroteIds_ = true;
    } else if (id != eos_) {
      text_.write(tokenizer_.bytesOf(id));
    }
  }

  const std::vector<int32_t> &prompt_;
  const Detokenizer &tokenizer_;
  bool showText_, quiet_;
  int64_t eos_;
  std::string line_;
  TextOut text_;
  bool wroteIds_ = false;
};

// "stopped at ..." of the summary.
std::string stopReason(const std::string &stopped, int64_t maxNewTokens,
                       int64_t eos, int64_t maxLen) {
  if (stopped == "max_new_tokens")
    return "--max-new-tokens " + std::to_string(maxNewTokens);
  if (stopped == "eos")
    return "the end-of-text token " + std::to_string(eos);
  if (stopped == "context")
    return "the context length " + std::to_string(maxLen) +
           " (inference.max_len)";
  return stopped;
}

} // namespace

int tessel::generateCommand(ArrayRef<std::string> args) {
  if (llvm::is_contained(args, "--help") || llvm::is_contained(args, "-h")) {
    outs() << kUsage;
    return 0;
  }
  if (args.empty())
    return usageError("which compiled directory? (tessel compile SPEC "
                      "--inference -o DIR makes one)");
  Arguments parsed;
  std::string argumentError =
      parseArguments(args, kValueFlags, kSwitches, parsed);
  if (!argumentError.empty()) {
    StringRef unknown = argumentError;
    if (unknown.consume_front("unknown argument '") &&
        unknown.consume_back("'")) {
      std::string near = nearestFlag(unknown);
      return usageError("unknown option '" + unknown + "'" +
                        (near.empty() ? "" : "; did you mean '" + near + "'?"));
    }
    return usageError(argumentError);
  }
  std::map<std::string, std::string> &values = parsed.values;
  bool jsonOutput = parsed.switches.count("--json");
  if (parsed.positionals.size() != 1)
    return usageError(parsed.positionals.empty()
                          ? "which compiled directory?"
                          : "expects one compiled directory, got " +
                                inQuotes(parsed.positionals[1]) + " too");
  std::string dir = parsed.positionals[0];

  // The flags, checked before anything is read.
  bool byText = values.count("--prompt"),
       byIds = values.count("--prompt-tokens");
  if (byText && byIds)
    return usageError("give --prompt TEXT or --prompt-tokens IDS, not both");
  if (!byText && !byIds)
    return usageError("which prompt? Give --prompt TEXT or --prompt-tokens "
                      "1,2,3");
  std::vector<int32_t> prompt;
  if (byIds && !parseIds(values["--prompt-tokens"], prompt))
    return usageError("--prompt-tokens expects token ids separated by commas "
                      "(e.g. 464,2068,318), got '" +
                      values["--prompt-tokens"] + "'");
  if (!values.count("--weights"))
    return usageError("--weights PATH is required (a .safetensors file or a "
                      "checkpoint directory)");
  int64_t maxNewTokens = 32;
  if (values.count("--max-new-tokens") &&
      (StringRef(values["--max-new-tokens"]).getAsInteger(10, maxNewTokens) ||
       maxNewTokens < 1))
    return usageError("--max-new-tokens expects a positive integer, got '" +
                      values["--max-new-tokens"] + "'");
  double temperature = 0;
  if (values.count("--temperature") &&
      (StringRef(values["--temperature"]).getAsDouble(temperature) ||
       !std::isfinite(temperature) || temperature < 0))
    return usageError("--temperature expects a number >= 0 (0: the most "
                      "likely token), got '" +
                      values["--temperature"] + "'");
  int64_t topK = 0;
  if (values.count("--top-k") &&
      (StringRef(values["--top-k"]).getAsInteger(10, topK) || topK < 1))
    return usageError("--top-k expects a positive integer, got '" +
                      values["--top-k"] + "'");
  uint64_t seed = 0;
  if (values.count("--seed") &&
      StringRef(values["--seed"]).getAsInteger(10, seed))
    return usageError("--seed expects a non-negative integer, got '" +
                      values["--seed"] + "'");
  int64_t eos = -1;
  if (values.count("--eos") &&
      (StringRef(values["--eos"]).getAsInteger(10, eos) || eos < 0 ||
       eos > std::numeric_limits<int32_t>::max()))
    return usageError("--eos expects a token id, got '" + values["--eos"] +
                      "'");
  if (values.count("--eos") && parsed.switches.count("--no-eos"))
    return usageError("give --eos ID or --no-eos, not both");
  if (values.count("--tokenizer") &&
      (values.count("--vocab-json") || values.count("--merges")))
    return usageError("give --tokenizer DIR or --vocab-json F --merges F, not "
                      "both");
  if (values.count("--vocab-json") != values.count("--merges"))
    return usageError(values.count("--merges")
                          ? "--merges needs --vocab-json F too"
                          : "--vocab-json needs --merges F too");

  // The plan: an inference plan whose programs are there, as compiled.
  Expected<json> plan = readPlan(dir);
  if (!plan)
    return fail(toString(plan.takeError()));
  if (!plan->contains("inference"))
    return fail(dir + " was compiled for training; compile with tessel "
                      "compile SPEC --inference");
  int64_t maxLen = 0, vocab = 0;
  try {
    const json &inference = plan->at("inference");
    maxLen = inference.at("max_len").get<int64_t>();
    if (plan->contains("model"))
      vocab = (*plan)["model"].value("vocab_size", int64_t(0));
  } catch (const json::exception &e) {
    return fail(dir + "/plan.json: malformed (" + e.what() +
                "); compile again");
  }
  Expected<RankPrograms> programs = checkRankPrograms(dir, *plan);
  if (!programs)
    return fail(toString(programs.takeError()));

  std::string weights = values["--weights"];
  if (!sys::fs::exists(weights))
    return fail("--weights " + weights + ": no such file or directory");
  Expected<Detokenizer> chosen = chooseTokenizer(values, weights);
  if (!chosen)
    return fail(toString(chosen.takeError()));
  Detokenizer tokenizer = std::move(*chosen);
  if (tokenizer.bpe && vocab > 0 && tokenizer.bpe->vocabSize() > vocab)
    return fail(
        "the tokenizer " + inQuotes(tokenizer.vocabPath) +
        (tokenizer.found ? ", found beside --weights," : "") + " has " +
        std::to_string(tokenizer.bpe->vocabSize()) +
        " tokens, more than the model's vocab_size = " + std::to_string(vocab) +
        (tokenizer.found ? " (--tokenizer bytes or --tokenizer DIR "
                           "chooses another)"
                         : ""));
  // Text is shown for a text prompt, or a tokenizer asked for or found.
  bool showText = byText || tokenizer.chosen;

  // The prompt as ids, each one the model has.
  std::string promptFlag = byText ? "--prompt" : "--prompt-tokens";
  if (byText) {
    try {
      prompt = tokenizer.encode(values["--prompt"]);
    } catch (const std::exception &e) {
      return fail(Twine("--prompt: ") + e.what());
    }
    if (prompt.empty())
      return usageError("--prompt is empty; the model needs at least one "
                        "token to start from");
  }
  if (vocab > 0)
    for (int32_t id : prompt)
      if (id >= vocab)
        return fail(promptFlag + ": token " + std::to_string(id) +
                    " is past the model's vocabulary (vocab_size " +
                    std::to_string(vocab) + ")" +
                    (byText && !tokenizer.bpe
                         ? "; one token per byte needs vocab_size 256 for "
                           "any text (see --tokenizer)"
                         : ""));
  if (maxLen > 0 && (int64_t)prompt.size() > maxLen)
    return fail(promptFlag + ": the prompt has " +
                std::to_string(prompt.size()) +
                " tokens, more than the plan's context of " +
                std::to_string(maxLen) + " (inference.max_len)");
  if (!values.count("--eos") && !parsed.switches.count("--no-eos") &&
      tokenizer.bpe && tokenizer.bpe->endOfText() >= 0 &&
      (vocab == 0 || tokenizer.bpe->endOfText() < vocab))
    eos = tokenizer.bpe->endOfText();
  if (eos >= 0 && vocab > 0 && eos >= vocab)
    return usageError("--eos " + std::to_string(eos) +
                      " is past the model's vocabulary (vocab_size " +
                      std::to_string(vocab) + ")");

  // The ranks' options (the rank programs take them as tessel passes them).
  std::string ids;
  for (auto [k, id] : llvm::enumerate(prompt))
    ids += (k ? "," : "") + std::to_string(id);
  if (!values.count("--temperature"))
    values["--temperature"] = "0";
  std::vector<std::string> rankArgs = {
      "--weights",        weights,
      "--prompt-tokens",  ids,
      "--max-new-tokens", std::to_string(maxNewTokens)};
  for (StringRef flag : {"--temperature", "--top-k", "--seed", "--logits"})
    if (values.count(flag.str()))
      rankArgs.insert(rankArgs.end(), {flag.str(), values[flag.str()]});
  if (eos >= 0)
    rankArgs.insert(rankArgs.end(), {"--eos", std::to_string(eos)});
  Expected<std::vector<std::string>> argv =
      rankCommandLine(dir, *programs, rankArgs);
  if (!argv)
    return fail(toString(argv.takeError()));

  Generation run(prompt, tokenizer, showText, /*quiet=*/jsonOutput, eos);
  int rc = runForwardingSignals(*argv, rankEnvironment(),
                                [&](StringRef bytes) { run.read(bytes); });
  run.finish();
  if (run.wrote()) {
    outs() << "\n";
    outs().flush();
  }
  if (rc < 0)
    return fail((*argv)[0] + " could not be started: " + std::strerror(-rc));
  if (rc != 0) {
    fail((programs->world > 1
              ? "the " + std::to_string(programs->world) + "-rank generation"
              : std::string("the rank program")) +
         " failed (" + describeExit(rc) + ")" +
         (programs->world > 1 ? "; the messages above name the failing rank"
                              : ""));
    return rc;
  }
  if (!run.malformed.empty())
    return fail("rank 0 printed an event that is not as documented: " +
                run.malformed);
  if (!run.ended)
    return fail("the rank program ended without its \"end\" event (is " + dir +
                " an inference plan of this tessel? compile again)");
  double tokensPerSecond = 0, prefillSeconds = 0, decodeSeconds = 0;
  std::string stopped;
  try {
    tokensPerSecond = run.end.at("decode_tokens_per_s").get<double>();
    prefillSeconds = run.end.at("prefill_s").get<double>();
    decodeSeconds = run.end.at("decode_s").get<double>();
    stopped = run.end.at("stopped").get<std::string>();
  } catch (const json::exception &e) {
    return fail("rank 0's \"end\" event is not as documented (" +
                std::string(e.what()) + "): " + run.end.dump());
  }

  if (jsonOutput) {
    nlohmann::ordered_json result = {{"prompt", prompt},
                                     {"generated", run.generated}};
    if (showText) {
      std::string bytes;
      for (int32_t id : run.generated)
        if (id != eos)
          bytes += tokenizer.bytesOf(id);
      result["text"] = bytes;
    }
    result["tokens_per_s"] = tokensPerSecond;
    result["stopped"] = stopped;
    outs() << result.dump(-1, ' ', false,
                          nlohmann::ordered_json::error_handler_t::replace)
           << "\n";
    return 0;
  }
  size_t n = run.generated.size();
  errs() << formatv("{0} new token{1} in {2:f2} s ({3:f1} tokens/s; prompt "
                    "{4} token{5} in {6:f2} s), stopped at {7}\n",
                    n, n == 1 ? "" : "s", decodeSeconds, tokensPerSecond,
                    prompt.size(), prompt.size() == 1 ? "" : "s",
                    prefillSeconds,
                    stopReason(stopped, maxNewTokens, eos, maxLen));
  return 0;
}
