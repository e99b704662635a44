//===- Inference.cpp - Text generation around a generated step ------------===//
//
// runInferenceMain is the main() of an inference program (tessel compile
// --inference). It loads the weights, feeds the prompt through the program's
// step, which fills the KV cache and writes logits, then generates one token
// per step until --max-new-tokens, --eos or the end of the context. Rank 0
// prints one JSON object per line on stdout, and nothing else:
//
//   {"event":"start","prompt":[...],"max_len":T,"vocab":V,"ranks":R}
//   {"event":"token","index":k,"id":I}          one per generated token
//   {"event":"end","prompt_tokens":P,"new_tokens":n,"prefill_s":x,
//    "decode_s":y,"decode_tokens_per_s":z,"stopped":"max_new_tokens"}
//
// ("stopped" is "max_new_tokens", "eos" or "context".) The mesh is tensor
// parallel only: every rank holds its tp piece of the parameters and of the
// KV cache, and the step leaves the whole vocabulary's logits on every rank.
// Weights are loaded, programs checked and failures reported as runMain does
// (DriverInternal.h).
//
//===----------------------------------------------------------------------===//

#include "DriverInternal.h"

#include "tessel/Runtime/Comm.h"
#include "tessel/Runtime/Program.h"

// Only the C API: keep mpi.h from pulling in the deprecated C++ bindings.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <sys/stat.h>

namespace tessel::rt {

namespace {

struct GenerateOptions {
  std::string weights; // a .safetensors file or a checkpoint directory
  std::vector<int32_t> prompt;
  int64_t maxNewTokens = 32;
  double temperature = 0; // 0: greedy
  int64_t topK = 0;       // 0: the whole vocabulary
  uint64_t seed = 0;
  int64_t eos = -1; // -1: none
  std::string logits;
  // Longest wait for another rank before the job is ended (the watchdog).
  double timeout = 600;
  bool help = false;
};

const char *const kGenerateValueFlags[] = {
    "--weights",     "--prompt-tokens", "--max-new-tokens",
    "--temperature", "--top-k",         "--seed",
    "--eos",         "--logits"};

void printGenerateUsage(FILE *out, const char *argv0, const Program &program) {
  std::fprintf(
      out,
      "usage: %s --weights PATH --prompt-tokens IDS [options]\n"
      "Generates tokens with '%s' after a prompt, through a KV cache of\n"
      "%lld positions; prints one JSON object per line.\n"
      "\n"
      "options:\n"
      "  --weights PATH         the parameters: a .safetensors file (tessel's\n"
      "                         --save-final, or a Hugging Face export's\n"
      "                         model.safetensors) or a checkpoint directory\n"
      "                         (its newest committed checkpoint; only the\n"
      "                         parameters are read); required\n"
      "  --prompt-tokens IDS    the prompt's token ids, comma-separated, each\n"
      "                         below the vocabulary size %lld; required\n"
      "  --max-new-tokens N     tokens to generate at most (default 32)\n"
      "  --temperature T        0 (default): the most likely token; above 0:\n"
      "                         sample from softmax(logits / T)\n"
      "  --top-k K              sample among the K most likely tokens only\n"
      "                         (default 0: all)\n"
      "  --seed S               the sampling seed (default 0)\n"
      "  --eos ID               stop after generating this token\n"
      "  --logits FILE          write the logits each generated token was\n"
      "                         chosen from (before the temperature), one row\n"
      "                         of %lld little-endian float32 per token\n"
      "  --help                 show this message\n",
      argv0, program.name ? program.name : "program",
      (long long)program.config.seqLen, (long long)program.config.vocab,
      (long long)program.config.vocab);
}

// A finite number >= 0.
double parseNonNegativeNumber(const std::string &flag,
                              const std::string &text) {
  char *end = nullptr;
  double value = std::strtod(text.c_str(), &end);
  if (text.empty() || *end || !std::isfinite(value) || value < 0)
    throw UsageError(flag + " expects a non-negative number, got " +
                     inQuotes(text));
  return value;
}

// A token id below the vocabulary size.
int32_t parseTokenId(const std::string &flag, const std::string &text,
                     int64_t vocab) {
  int64_t id = parseInteger(flag, text, 0);
  if (id >= vocab)
    throw UsageError(flag + ": token id " + std::to_string(id) +
                     " is not below the vocabulary size " +
                     std::to_string(vocab) + " (model.vocab)");
  return (int32_t)id;
}

// "1,2,3" (spaces around the ids allowed).
std::vector<int32_t> parseTokenList(const std::string &flag,
                                    const std::string &text, int64_t vocab) {
  if (text.find_first_not_of(' ') == std::string::npos)
    throw UsageError(flag + " expects at least one token id");
  std::vector<int32_t> ids;
  for (size_t begin = 0;;) {
    size_t comma = text.find(',', begin);
    std::string id = text.substr(
        begin, comma == std::string::npos ? std::string::npos : comma - begin);
    id.erase(0, id.find_first_not_of(' '));
    id.erase(id.find_last_not_of(' ') + 1);
    ids.push_back(parseTokenId(flag, id, vocab));
    if (comma == std::string::npos)
      return ids;
    begin = comma + 1;
  }
}

GenerateOptions parseGenerateArgs(int argc, char **argv,
                                  const Program &program) {
  const TrainConfig &config = program.config;
  GenerateOptions opts;
  if (const char *timeout = std::getenv("TESSEL_TIMEOUT"))
    opts.timeout = parseSeconds("TESSEL_TIMEOUT", timeout);
  bool havePrompt = false;
  for (int i = 1; i < argc; i++) {
    std::string arg = argv[i];
    FlagArgument split = splitFlag(arg);
    const std::string &flag = split.flag;
    bool hasInlineValue = split.hasValue;
    if (flag == "--help" || flag == "-h") {
      if (hasInlineValue)
        throw UsageError(flag + " takes no value");
      opts.help = true;
      continue;
    }
    if (std::find_if(std::begin(kGenerateValueFlags),
                     std::end(kGenerateValueFlags), [&](const char *f) {
                       return flag == f;
                     }) == std::end(kGenerateValueFlags))
      throw UsageError((arg.rfind("-", 0) == 0 ? "unknown option "
                                               : "unexpected argument ") +
                       inQuotes(arg) + " (see --help)");
    std::string value = flagValue(split, argc, argv, i);
    if (flag == "--weights") {
      struct stat st;
      if (value.empty() || ::stat(value.c_str(), &st) != 0)
        throw UsageError(flag + ": " + inQuotes(value) +
                         " is neither a .safetensors file nor a checkpoint "
                         "directory (it does not exist)");
      opts.weights = value;
    } else if (flag == "--prompt-tokens") {
      opts.prompt = parseTokenList(flag, value, config.vocab);
      havePrompt = true;
    } else if (flag == "--max-new-tokens") {
      opts.maxNewTokens = parseInteger(flag, value, 0);
    } else if (flag == "--temperature") {
      opts.temperature = parseNonNegativeNumber(flag, value);
    } else if (flag == "--top-k") {
      opts.topK = parseInteger(flag, value, 0);
    } else if (flag == "--seed") {
      opts.seed = parseUnsigned(flag, value);
    } else if (flag == "--eos") {
      opts.eos = parseTokenId(flag, value, config.vocab);
    } else {
      if (value.empty())
        throw UsageError(flag + " expects a file name");
      opts.logits = value;
    }
  }
  if (opts.help)
    return opts;
  if (opts.weights.empty())
    throw UsageError("--weights PATH is required (a .safetensors file or a "
                     "checkpoint directory)");
  if (!havePrompt)
    throw UsageError("--prompt-tokens IDS is required (the prompt's token "
                     "ids, comma-separated)");
  if ((int64_t)opts.prompt.size() > config.seqLen)
    throw UsageError("--prompt-tokens: the prompt has " +
                     std::to_string(opts.prompt.size()) +
                     " tokens; the program's context is " +
                     std::to_string(config.seqLen) +
                     " positions (model.seq_len)");
  return opts;
}

// What an inference program promises beyond validateProgram's checks.
void validateInferenceProgram(const Program &program) {
  if (program.chunk < 1 || program.chunk > program.config.seqLen)
    fail("program reads an invalid chunk of " + std::to_string(program.chunk) +
         " tokens per step");
  if (program.kvCacheElems < 0)
    fail("program has negative buffer sizes");
  if (program.prefill &&
      (program.prefillChunk < 1 || program.prefillChunk > program.config.seqLen))
    fail("program's prefill step reads an invalid chunk of " +
         std::to_string(program.prefillChunk) + " tokens");
  if (program.device)
    fail("this inference program was compiled for a GPU; inference runs on "
         "the CPU only");
  if (meshSize(MeshAxis::PP) != 1 || meshSize(MeshAxis::DP) != 1)
    fail("an inference program runs on a tensor-parallel mesh only; this "
         "one's is " +
         meshLayout().shape().describe());
}

// The next token from one row of logits, as every rank chooses it:
// - temperature 0: the largest logit (the lowest index among equal ones);
//   nothing is drawn from `rng`.
// - otherwise z = logits / temperature in double; with topK > 0 only the topK
//   largest z are kept (among equal ones, lower indices first); p =
//   softmax(z) over the kept ones; u = (rng() >> 11) * 2^-53, one draw per
//   token; the token is the first kept index, in ascending order, whose
//   cumulative probability exceeds u (the last kept index when none does).
int32_t chooseToken(const float *logits, int64_t vocab, double temperature,
                    int64_t topK, std::mt19937_64 &rng) {
  for (int64_t i = 0; i < vocab; i++)
    if (std::isnan(logits[i]) || logits[i] == INFINITY)
      fail("the step wrote a logit of " +
           std::string(std::isnan(logits[i]) ? "nan" : "inf") + " for token " +
           std::to_string(i));
  if (temperature == 0)
    return (int32_t)(std::max_element(logits, logits + vocab) - logits);
  std::vector<int32_t> kept(vocab);
  std::iota(kept.begin(), kept.end(), 0);
  if (topK > 0 && topK < vocab) {
    std::partial_sort(kept.begin(), kept.begin() + topK, kept.end(),
                      [&](int32_t a, int32_t b) {
                        return logits[a] > logits[b] ||
                               (logits[a] == logits[b] && a < b);
                      });
    kept.resize(topK);
    std::sort(kept.begin(), kept.end());
  }
  std::vector<double> p(kept.size());
  double largest = -INFINITY;
  for (size_t k = 0; k < kept.size(); k++) {
    p[k] = (double)logits[kept[k]] / temperature;
    largest = std::max(largest, p[k]);
  }
  if (!std::isfinite(largest))
    fail("the step wrote no finite logit");
  double sum = 0;
  for (double &x : p) {
    x = std::exp(x - largest);
    sum += x;
  }
  const double u = (double)(rng() >> 11) * 0x1.0p-53;
  double cumulative = 0;
  for (size_t k = 0; k < kept.size(); k++) {
    cumulative += p[k] / sum;
    if (cumulative > u)
      return kept[k];
  }
  return kept.back();
}

// Rank 0's token, on every rank.
int32_t agreeOnToken(int32_t id) {
  if (commWorldSize() > 1 &&
      MPI_Bcast(&id, 1, MPI_INT32_T, 0, MPI_COMM_WORLD) != MPI_SUCCESS)
    fail("broadcasting the chosen token from rank 0 failed");
  return id;
}

double secondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

int generate(const Program &program, const GenerateOptions &opts) {
  validateProgram(program);
  validateInferenceProgram(program);
  const TrainConfig &config = program.config;
  const int64_t B = config.batch, C = program.chunk, V = config.vocab,
                Tmax = config.seqLen;
  const int64_t P = (int64_t)opts.prompt.size();
  const bool leader = commRank() == 0;

  std::unique_ptr<FILE, int (*)(FILE *)> logitsFile(nullptr, &std::fclose);
  if (leader && !opts.logits.empty()) {
    logitsFile.reset(std::fopen(opts.logits.c_str(), "wb"));
    if (!logitsFile)
      fail("cannot write the --logits file " + inQuotes(opts.logits) + ": " +
           std::strerror(errno));
  }

  AlignedBuffer params =
      allocateZeroed((int64_t)sizeof(float) * program.paramElems, "parameters");
  AlignedBuffer kvCache =
      allocateZeroed((int64_t)sizeof(float) * program.kvCacheElems, "KV cache");
  AlignedBuffer activations =
      allocateZeroed(program.activationBytes, "activations");
  // The prefill step reads the prompt `prefillChunk` tokens at a time (or,
  // without one, the decode step token by token).
  const int64_t PC = program.prefill ? program.prefillChunk : C;
  const int64_t widest = std::max(C, PC);
  std::vector<int32_t> tokens(B * widest), positions(B * widest);
  // A padded vocabulary's logits rows are wider; only the first V are
  // tokens.
  const int64_t VP = config.paddedVocab > V ? config.paddedVocab : V;
  std::vector<float> logits(B * widest * VP);

  std::vector<StateStore> stores = {{(float *)params.get(), ""}};
  if (isDirectory(opts.weights))
    loadCheckpoint(program, chooseCheckpoint(program, opts.weights, stores),
                   stores);
  else
    loadParams(program, opts.weights, stores, /*strict=*/false);

  StepContext ctx = {};
  ctx.params = (float *)params.get();
  ctx.tokens = tokens.data();
  ctx.activations = activations.get();
  ctx.positions = positions.data();
  ctx.kvCache = (float *)kvCache.get();
  ctx.logits = logits.data();

  // Runs `step`, which reads `chunk` tokens per sequence, on `count` (1 to
  // chunk) tokens at positions first, first + 1, ...; every row of the
  // batch reads the same. A shorter chunk is padded with its last token at
  // that token's position again (which writes the same keys and values into
  // the same cache row). Returns the logits of the last token.
  auto feed = [&](void (*step)(StepContext &), int64_t chunk,
                  const int32_t *ids, int64_t count,
                  int64_t first) -> const float * {
    for (int64_t b = 0; b < B; b++)
      for (int64_t s = 0; s < chunk; s++) {
        int64_t i = std::min(s, count - 1);
        tokens[b * chunk + s] = ids[i];
        positions[b * chunk + s] = (int32_t)(first + i);
      }
    step(ctx);
    return logits.data() + (count - 1) * VP;
  };
  void (*prefill)(StepContext &) = program.prefill ? program.prefill
                                                   : program.step;
  auto print = [&](const nlohmann::ordered_json &event) {
    if (!leader)
      return;
    std::printf("%s\n", event.dump().c_str());
    std::fflush(stdout);
  };

  print({{"event", "start"},
         {"prompt", opts.prompt},
         {"max_len", Tmax},
         {"vocab", V},
         {"ranks", commWorldSize()}});

  auto prefillStart = std::chrono::steady_clock::now();
  const float *row = nullptr;
  for (int64_t first = 0; first < P; first += PC)
    row = feed(prefill, PC, opts.prompt.data() + first,
               std::min(PC, P - first), first);
  double prefillSeconds = secondsSince(prefillStart);

  // Generated token k (0-based) is chosen from the logits of the token
  // before it and, to generate more, read at position P + k.
  auto decodeStart = std::chrono::steady_clock::now();
  std::mt19937_64 rng(opts.seed);
  int64_t generated = 0;
  const char *stopped = "max_new_tokens";
  while (generated < opts.maxNewTokens) {
    int32_t id =
        agreeOnToken(chooseToken(row, V, opts.temperature, opts.topK, rng));
    if (logitsFile &&
        std::fwrite(row, sizeof(float), V, logitsFile.get()) != (size_t)V)
      fail("cannot write the --logits file " + inQuotes(opts.logits) + ": " +
           std::strerror(errno));
    print({{"event", "token"}, {"index", generated}, {"id", id}});
    generated++;
    if (id == opts.eos) {
      stopped = "eos";
      break;
    }
    if (generated == opts.maxNewTokens)
      break;
    int64_t position = P + generated - 1;
    if (position >= Tmax) {
      stopped = "context";
      break;
    }
    row = feed(program.step, C, &id, 1, position);
  }
  double decodeSeconds = secondsSince(decodeStart);

  if (logitsFile) {
    FILE *f = logitsFile.release();
    if (std::fclose(f) != 0)
      fail("cannot write the --logits file " + inQuotes(opts.logits) + ": " +
           std::strerror(errno));
  }
  // The decode steps: every generated token but the first came from one.
  int64_t decodeSteps = std::max<int64_t>(generated - 1, 0);
  print({{"event", "end"},
         {"prompt_tokens", P},
         {"new_tokens", generated},
         {"prefill_s", prefillSeconds},
         {"decode_s", decodeSeconds},
         {"decode_tokens_per_s",
          decodeSeconds > 0 ? (double)decodeSteps / decodeSeconds : 0.0},
         {"stopped", stopped}});
  return 0;
}

} // namespace

int runInferenceMain(int argc, char **argv, const Program &program) {
  const char *argv0 = argc > 0 && argv[0] ? argv[0] : "program";
  if (!program.inference) {
    std::fprintf(stderr, "error: this is a training program; run it with "
                         "tessel run\n");
    return 1;
  }
  // --help needs no mpirun. A mistake on the command line is reported once
  // MPI has started, by rank 0 alone (every rank finds the same one).
  GenerateOptions opts;
  std::string mistake;
  try {
    opts = parseGenerateArgs(argc, argv, program);
  } catch (const UsageError &e) {
    mistake = e.what();
  }
  if (opts.help && mistake.empty()) {
    printGenerateUsage(stdout, argv0, program);
    return 0;
  }
  return runReportingFailures([&] {
    commInit(&argc, &argv, program.mesh);
    if (!mistake.empty()) {
      if (commRank() == 0)
        std::fprintf(stderr, "error: %s\n", mistake.c_str());
      commFinalize();
      return 1;
    }
    commStartWatchdog(opts.timeout);
    int code = generate(program, opts);
    commFinalize();
    return code;
  });
}

} // namespace tessel::rt
