//===- Driver.cpp - The training loop around a generated step -------------===//
//
// (Long by design: the whole run of a rank program, from the command line
// to the saved weights, reads top to bottom in one place; the parts it
// calls live in Data.cpp, Init.cpp, Safetensors.cpp and Comm.cpp.)
//
// runMain parses the command line, allocates parameter, gradient, moment and
// activation buffers, initialises or loads the parameters, then runs the
// program's step once per batch, printing and recording metrics, and finally
// saves the weights. Every failure is reported as one "error: " line on
// stderr with exit code 1 (2 for command-line mistakes); outputs are written
// atomically so a failed run never leaves half a file behind.
//
// A program compiled for a mesh of several ranks runs as one process per
// rank under mpirun. Each rank holds its shard of every sharded parameter and
// reads its data-parallel slice of each global batch; the step function does
// all communication. Rank 0 alone prints, writes metrics and saves weights
// (gathered from the shards); a failure on any rank is reported with the
// rank and aborts all of them, so that none waits forever in a collective.
//
//===----------------------------------------------------------------------===//

#include "tessel/Runtime/Checkpoint.h"
#include "tessel/Runtime/Comm.h"
#include "tessel/Runtime/Data.h"
#include "tessel/Runtime/Dropout.h"
#include "tessel/Runtime/Init.h"
#include "tessel/Runtime/Pieces.h"
#include "tessel/Runtime/Program.h"
#include "tessel/Runtime/Safetensors.h"
#include "tessel/Runtime/Sequence.h"
#include "tessel/Runtime/Sharding.h"
#include "tessel/Runtime/TensorBoard.h"
#include "tessel/Runtime/Trace.h"

#include "DriverInternal.h"

// Only the C API: keep mpi.h from pulling in the deprecated C++ bindings.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#include <nlohmann/json.hpp>
#include <omp.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

extern "C" void openblas_set_num_threads(int numThreads);

namespace tessel::rt {

[[noreturn]] void fail(const std::string &message) {
  throw std::runtime_error(message);
}

std::string inQuotes(const std::string &s) { return "'" + s + "'"; }

namespace {

struct Options {
  int64_t steps = 0;
  std::string data;
  // Validation: the data, how often (0: never) and how many global batches.
  std::string validData;
  int64_t evalEvery = 0;
  int64_t evalBatches = 8;
  std::string initFrom;
  std::string saveFinal;
  // The training state (parameters, AdamW moments, the step), written at
  // the end (--save-state) and continued from (--resume).
  std::string saveState;
  std::string resume;
  int64_t stopAfter = 0; // 0: run to --steps
  // Steps in a row whose gradient is not finite that are skipped (no
  // update) before the run stops; 0: stop at the first.
  int64_t skipNonfinite = 0;
  int64_t checkpointEvery = 0; // with --save-state: also every N steps
  // Sharded checkpoints (Checkpoint.h): where, how often, which to keep.
  std::string ckptDir;
  int64_t ckptEvery = 0;
  Retention ckptKeep;
  int prefetch = 2; // batches read ahead (0: on the training thread)
  int64_t logEvery = 1; // a progress line every this many steps
  double peakTflops = 0; // a rank's peak, for MFU (0: not given)
  double pricePerGpuHour = 0; // for the cost in the summary (0: not given)
  std::string progress = "auto"; // bar | lines | auto
  std::string tensorboard;        // a directory for a TensorBoard event file
  std::string recordSamples; // per rank: the samples of each step
  double dataDelayMs = 0;    // each batch read made this much slower
  std::string metrics;
  std::string commReport;
  std::string trace;
  uint64_t seed = 0;
  int threads = 0; // 0: leave the thread counts as they are
  // --init-from: tensors of the file that are not parameters are an error
  // rather than a warning.
  bool strict = false;
  // Longest wait for another rank before the job is ended (the watchdog).
  double timeout = 600;
  bool quiet = false;
  bool help = false;
};

// The options of a rank program that take a value.
const char *const kValueFlags[] = {"--steps",
                                   "--data",
                                   "--init-from",
                                   "--save-final",
                                   "--metrics",
                                   "--seed",
                                   "--threads",
                                   "--comm-report",
                                   "--trace",
                                   "--timeout",
                                   "--save-state",
                                   "--resume",
                                   "--stop-after",
                                   "--checkpoint-every",
                                   "--ckpt-dir",
                                   "--ckpt-every",
                                   "--ckpt-keep",
                                   "--prefetch",
                                   "--record-samples",
                                   "--data-delay-ms",
                                   "--log-every",
                                   "--peak-tflops",
                                   "--valid-data",
                                   "--eval-every",
                                   "--price-per-gpu-hour",
                                   "--progress",
                                   "--tensorboard",
                                   "--eval-batches",
                                   "--skip-nonfinite"};
const char *const kSwitchFlags[] = {"--help", "-h", "--quiet", "--strict"};

// "1:02:03" (hours:minutes:seconds), "0:42" under an hour.
std::string clockTime(double seconds) {
  int64_t t = std::isfinite(seconds) && seconds > 0 ? (int64_t)(seconds + 0.5)
                                                    : 0;
  char text[32];
  if (t >= 3600)
    std::snprintf(text, sizeof(text), "%" PRId64 ":%02d:%02d", t / 3600,
                  (int)(t / 60 % 60), (int)(t % 60));
  else
    std::snprintf(text, sizeof(text), "%d:%02d", (int)(t / 60), (int)(t % 60));
  return text;
}

// "512 MB", "1.25 GB": decimal units, as the plan's figures are printed.
std::string megabytes(int64_t bytes) {
  char text[32];
  if (bytes >= (int64_t)10000000000)
    std::snprintf(text, sizeof(text), "%.1f GB", bytes / 1e9);
  else if (bytes >= (int64_t)1000000000)
    std::snprintf(text, sizeof(text), "%.2f GB", bytes / 1e9);
  else
    std::snprintf(text, sizeof(text), "%.0f MB", bytes / 1e6);
  return text;
}

// Levenshtein distance, for suggestions.
size_t editDistance(const std::string &a, const std::string &b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); j++)
    row[j] = j;
  for (size_t i = 1; i <= a.size(); i++) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); j++) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1,
                         diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

void printUsage(FILE *out, const char *argv0, const Program &program) {
  std::fprintf(out,
               "usage: %s [options]\n"
               "Trains '%s' for a number of steps.\n"
               "\n",
               argv0, program.name ? program.name : "program");
  printRunOptions(out, &program);
}

} // namespace

bool runFlagTakesValue(const std::string &flag) {
  for (const char *f : kValueFlags)
    if (flag == f)
      return true;
  return false;
}

bool isRunFlag(const std::string &flag) {
  if (runFlagTakesValue(flag))
    return true;
  for (const char *f : kSwitchFlags)
    if (flag == f)
      return true;
  return false;
}

std::string suggestRunFlag(const std::string &flag) {
  std::string best;
  size_t bestDistance = std::max<size_t>(2, flag.size() / 3) + 1;
  auto consider = [&](const char *f) {
    size_t d = editDistance(flag, f);
    if (d < bestDistance) {
      bestDistance = d;
      best = f;
    }
  };
  for (const char *f : kValueFlags)
    consider(f);
  for (const char *f : kSwitchFlags)
    consider(f);
  return best;
}

void printRunOptions(FILE *out, const Program *program) {
  std::string steps =
      program ? std::to_string(program->config.steps) : "train.steps";
  std::string seed =
      program ? std::to_string(program->config.seed) : "train.seed";
  std::string evalEvery = program ? std::to_string(program->config.evalEvery)
                                  : "train.eval_every";
  std::string evalBatches =
      program ? std::to_string(program->config.evalBatches)
              : "train.eval_batches";
  std::fprintf(
      out,
      "options:\n"
      "  --steps N              number of steps, also the learning-rate\n"
      "                         schedule horizon (default %s)\n"
      "  --data PATH            the tokens: an llm.c token file, a Megatron\n"
      "                         dataset (PREFIX, .idx or .bin), or a\n"
      "                         directory or glob of shards; without it,\n"
      "                         the spec's data, else synthetic tokens\n"
      "  --valid-data PATH      validation data (any form --data takes);\n"
      "                         without it, the spec's data.valid\n"
      "  --eval-every N         the validation loss every N steps and at\n"
      "                         the end, by the forward-only step at this\n"
      "                         layout (default %s; 0: never)\n"
      "  --eval-batches N       global batches each evaluation reads from\n"
      "                         the start of the validation data (default\n"
      "                         %s)\n"
      "  --init-from FILE       load parameters from a .safetensors file\n"
      "                         instead of initialising them (its tensors\n"
      "                         that are not parameters are named and\n"
      "                         ignored; with --strict they are an error)\n"
      "  --save-final FILE      save the final parameters as .safetensors\n"
      "  --save-state FILE      at the end, save the training state: the\n"
      "                         parameters, AdamW's moments (NAME.exp_avg,\n"
      "                         NAME.exp_avg_sq) and the step, as global\n"
      "                         tensors (.safetensors), resumable at any\n"
      "                         layout\n"
      "  --resume PATH          continue from a checkpoint directory (its\n"
      "                         newest committed checkpoint whose files\n"
      "                         pass their checksums) or a --save-state\n"
      "                         file, saved at any layout: its step is the\n"
      "                         next one, with the same batches and\n"
      "                         learning rates as an uninterrupted run\n"
      "  --ckpt-dir DIR         write sharded checkpoints to DIR/step-N/\n"
      "                         (one file per writing rank, a manifest\n"
      "                         committed last, DIR/latest) at the end and\n"
      "                         every --ckpt-every steps, in the background\n"
      "  --ckpt-every N         with --ckpt-dir, a checkpoint every N steps\n"
      "  --record-samples FILE  each rank writes the samples it reads, one\n"
      "                         JSON line per step (FILE.rankR.jsonl)\n"
      "  --data-delay-ms MS     make each batch read MS milliseconds slower\n"
      "                         (a slow disk, to see the prefetch overlap)\n"
      "  --prefetch N           batches read ahead on a background thread\n"
      "                         (default 2; 0 reads on the training thread)\n"
      "  --ckpt-keep K[:M]      keep the last K checkpoints and every one at\n"
      "                         a multiple of M steps (default: keep all)\n"
      "  --stop-after N         stop after step N of the --steps schedule\n"
      "  --skip-nonfinite N     skip a step whose gradient is not finite (a\n"
      "                         nan or inf global norm: no update, as if\n"
      "                         its batch had not been trained on), at most\n"
      "                         N in a row (default 0: stop at the first,\n"
      "                         the parameters those of the last update)\n"
      "  --checkpoint-every N   with --save-state, also write the state\n"
      "                         every N steps (replacing the last one)\n"
      "  --metrics FILE         write one JSON object per step (step is\n"
      "                         0-based): step, loss, lr, grad_norm,\n"
      "                         tokens_per_s, step_ms, data_wait_ms,\n"
      "                         mem_peak_bytes, ckpt_* with --ckpt-dir,\n"
      "                         val_loss and eval_ms after an evaluation\n"
      "  --comm-report FILE     write each rank's collective counts and\n"
      "                         resident memory as JSON (FILE.rankR.json)\n"
      "  --trace FILE           write each rank's Chrome trace "
      "(FILE.rankR.json)\n"
      "                         to FILE with .rank<R> before the extension\n"
      "  --seed N               parameter initialisation seed (default "
      "%s)\n"
      "  --threads N            OpenMP and OpenBLAS threads (default: as set\n"
      "                         by the environment)\n"
      "  --timeout SECONDS      end the job when a rank waits longer than "
      "this\n"
      "                         for another (a stopped, hung or dead rank;\n"
      "                         default $TESSEL_TIMEOUT, else 600)\n"
      "  --log-every N          a progress line every N steps (default 1)\n"
      "  --peak-tflops X        a rank's peak TFLOP/s (its GPU's, or what\n"
      "                         the CPU reaches): MFU in the log and metrics\n"
      "  --tensorboard DIR      also write the metrics' scalars as a\n"
      "                         TensorBoard event file in DIR\n"
      "  --progress MODE        bar: one progress line rewritten in place (a\n"
      "                         terminal); lines: a line per logged step;\n"
      "                         auto (default): bar on a terminal, outside\n"
      "                         mpirun\n"
      "  --price-per-gpu-hour X the price of one rank (GPU) for an hour: the\n"
      "                         run's cost, per step and per million tokens\n"
      "                         in the summary\n"
      "  --quiet                no per-step output\n"
      "  --help                 show this message\n",
      steps.c_str(), evalEvery.c_str(), evalBatches.c_str(), seed.c_str());
}

FlagArgument splitFlag(const std::string &arg) {
  FlagArgument a;
  a.flag = arg;
  size_t eq = arg.find('=');
  if (arg.rfind("--", 0) == 0 && eq != std::string::npos) {
    a.flag = arg.substr(0, eq);
    a.value = arg.substr(eq + 1);
    a.hasValue = true;
  }
  return a;
}

std::string flagValue(const FlagArgument &a, int argc, char **argv, int &i) {
  if (a.hasValue)
    return a.value;
  if (i + 1 >= argc)
    throw UsageError(a.flag + " expects a value");
  return argv[++i];
}

int64_t parseInteger(const std::string &flag, const std::string &text,
                     int64_t min) {
  const char *s = text.c_str();
  char *end = nullptr;
  errno = 0;
  long long value = std::strtoll(s, &end, 10);
  if (text.empty() || !(s[0] >= '0' && s[0] <= '9') || *end != '\0' ||
      errno == ERANGE || value < min)
    throw UsageError(flag + " expects a " +
                     (min > 0 ? "positive" : "non-negative") +
                     " integer, got " + inQuotes(text));
  return value;
}
int64_t parsePositive(const std::string &flag, const std::string &text) {
  return parseInteger(flag, text, 1);
}

uint64_t parseUnsigned(const std::string &flag, const std::string &text) {
  const char *s = text.c_str();
  char *end = nullptr;
  errno = 0;
  unsigned long long value = std::strtoull(s, &end, 10);
  if (text.empty() || !(s[0] >= '0' && s[0] <= '9') || *end != '\0' ||
      errno == ERANGE)
    throw UsageError(flag + " expects a non-negative integer, got " +
                     inQuotes(text));
  return value;
}

// A positive finite number; `what` completes "expects a positive ...".
double parsePositiveNumber(const std::string &flag, const std::string &text,
                           const std::string &what) {
  char *end = nullptr;
  double value = std::strtod(text.c_str(), &end);
  if (text.empty() || *end || !std::isfinite(value) || value <= 0)
    throw UsageError(flag + " expects a positive " + what + ", got " +
                     inQuotes(text));
  return value;
}

// A positive number of seconds (at most a week).
double parseSeconds(const std::string &what, const std::string &text) {
  const char *s = text.c_str();
  char *end = nullptr;
  double value = std::strtod(s, &end);
  if (text.empty() || *end != '\0' || !std::isfinite(value) || value <= 0 ||
      value > 604800)
    throw UsageError(what + " expects a positive number of seconds (at most " +
                     "604800), got " + inQuotes(text));
  return value;
}

namespace {

Options parseArgs(int argc, char **argv, const Program &program) {
  Options opts;
  opts.steps = program.config.steps;
  opts.seed = program.config.seed;
  opts.evalEvery = program.config.evalEvery;
  if (program.config.evalBatches > 0)
    opts.evalBatches = program.config.evalBatches;
  if (const char *timeout = std::getenv("TESSEL_TIMEOUT"))
    opts.timeout = parseSeconds("TESSEL_TIMEOUT", timeout);
  for (int i = 1; i < argc; i++) {
    std::string arg = argv[i];
    FlagArgument split = splitFlag(arg);
    const std::string &flag = split.flag;
    bool hasInlineValue = split.hasValue;
    if (flag == "--help" || flag == "-h" || flag == "--quiet" ||
        flag == "--strict") {
      if (hasInlineValue)
        throw UsageError(flag + " takes no value");
      if (flag == "--quiet")
        opts.quiet = true;
      else if (flag == "--strict")
        opts.strict = true;
      else
        opts.help = true;
      continue;
    }
    bool takesValue = runFlagTakesValue(flag);
    if (!takesValue && arg.rfind("-", 0) != 0)
      throw UsageError("unexpected argument " + inQuotes(arg) +
                       " (see --help)");
    if (!takesValue) {
      std::string near = suggestRunFlag(flag);
      throw UsageError("unknown option " + inQuotes(arg) +
                       (near.empty() ? "" : "; did you mean " + inQuotes(near) +
                                                "?") +
                       " (see --help)");
    }
    std::string value = flagValue(split, argc, argv, i);
    if (flag == "--steps") {
      // 0 steps loads and saves weights without training (conversion).
      opts.steps = parseInteger(flag, value, 0);
    } else if (flag == "--threads") {
      int64_t threads = parsePositive(flag, value);
      if (threads > 4096)
        throw UsageError(flag + " expects at most 4096 threads, got " +
                         inQuotes(value));
      opts.threads = (int)threads;
    } else if (flag == "--seed") {
      opts.seed = parseUnsigned(flag, value);
    } else if (flag == "--timeout") {
      opts.timeout = parseSeconds(flag, value);
    } else if (flag == "--stop-after") {
      opts.stopAfter = parsePositive(flag, value);
    } else if (flag == "--skip-nonfinite") {
      opts.skipNonfinite = parseInteger(flag, value, 0);
    } else if (flag == "--checkpoint-every") {
      opts.checkpointEvery = parsePositive(flag, value);
    } else if (flag == "--data-delay-ms") {
      char *end = nullptr;
      double ms = std::strtod(value.c_str(), &end);
      if (value.empty() || *end != '\0' || !std::isfinite(ms) || ms < 0 ||
          ms > 60000)
        throw UsageError(flag + " expects milliseconds in [0, 60000], got " +
                         inQuotes(value));
      opts.dataDelayMs = ms;
    } else if (flag == "--peak-tflops") {
      opts.peakTflops = parsePositiveNumber(flag, value, "number of TFLOP/s");
    } else if (flag == "--tensorboard") {
      opts.tensorboard = value;
    } else if (flag == "--progress") {
      if (value != "auto" && value != "bar" && value != "lines")
        throw UsageError(flag + " is auto, bar or lines, not " +
                         inQuotes(value));
      opts.progress = value;
    } else if (flag == "--price-per-gpu-hour") {
      opts.pricePerGpuHour = parsePositiveNumber(flag, value, "price");
    } else if (flag == "--eval-every") {
      opts.evalEvery = parseInteger(flag, value, 0);
    } else if (flag == "--eval-batches") {
      opts.evalBatches = parsePositive(flag, value);
    } else if (flag == "--log-every") {
      opts.logEvery = parsePositive(flag, value);
    } else if (flag == "--prefetch") {
      int64_t depth = parseInteger(flag, value, 0);
      if (depth > 64)
        throw UsageError(flag + " expects at most 64 batches, got " +
                         inQuotes(value));
      opts.prefetch = (int)depth;
    } else if (flag == "--ckpt-every") {
      opts.ckptEvery = parsePositive(flag, value);
    } else if (flag == "--ckpt-keep") {
      size_t colon = value.find(':');
      opts.ckptKeep.keepLast = parsePositive(flag, value.substr(0, colon));
      if (colon != std::string::npos)
        opts.ckptKeep.keepEvery = parsePositive(flag, value.substr(colon + 1));
    } else {
      if (value.empty())
        throw UsageError(flag + " expects a file name");
      if (flag == "--data")
        opts.data = value;
      else if (flag == "--valid-data")
        opts.validData = value;
      else if (flag == "--init-from")
        opts.initFrom = value;
      else if (flag == "--save-final")
        opts.saveFinal = value;
      else if (flag == "--save-state")
        opts.saveState = value;
      else if (flag == "--resume")
        opts.resume = value;
      else if (flag == "--ckpt-dir")
        opts.ckptDir = value;
      else if (flag == "--record-samples")
        opts.recordSamples = value;
      else if (flag == "--comm-report")
        opts.commReport = value;
      else if (flag == "--trace")
        opts.trace = value;
      else
        opts.metrics = value;
    }
  }
  return opts;
}

// The elements of parameter `p` that this rank holds.
ShardLayout shardLayoutOf(const ParamInfo &p) {
  if (p.shardDim < 0)
    return makeShardLayout(p.shape, p.rank, -1, 1, 1, 0);
  ShardLayout first =
      makeShardLayout(p.shape, p.rank, p.shardDim, p.shardBlocks,
                      meshSize(p.shardAxis), meshCoord(p.shardAxis));
  if (p.secondShardDim <= 0)
    return first;
  return cutAgain(first, p.shape, p.rank, p.shardDim, p.secondShardDim,
                  meshSize(p.secondShardAxis), meshCoord(p.secondShardAxis));
}

bool isSplit(const ShardLayout &layout) {
  return layout.parts > 1 || layout.parts2 > 1;
}

} // namespace

void validateProgram(const Program &program) {
  const TrainConfig &c = program.config;
  if (!program.step)
    fail("program has no step function");
  if (program.numParams < 0 || (program.numParams > 0 && !program.params))
    fail("program has an invalid parameter table");
  if (program.paramElems < 0 || program.activationBytes < 0 ||
      program.accumulatorElems < 0 || program.normSums < 0)
    fail("program has negative buffer sizes");
  if (c.batch <= 0 || c.seqLen <= 0 || c.vocab <= 0 || c.vocab > INT32_MAX)
    fail("program has an invalid configuration (batch " +
         std::to_string(c.batch) + ", sequence length " +
         std::to_string(c.seqLen) + ", vocabulary " + std::to_string(c.vocab) +
         ")");
  for (int i = 0; i < program.numParams; i++) {
    const ParamInfo &p = program.params[i];
    std::string name = p.name ? p.name : "#" + std::to_string(i);
    if (!p.name || p.rank < 0 || p.rank > 4)
      fail("parameter " + inQuotes(name) + " has an invalid name or rank");
    if (p.shardDim >= 0 &&
        ((int)p.shardAxis < 0 || (int)p.shardAxis >= kNumMeshAxes))
      fail("parameter " + inQuotes(name) + " is sharded along an invalid " +
           "mesh axis " + std::to_string((int)p.shardAxis));
    if (p.secondShardDim > 0 &&
        (p.shardDim < 0 || (int)p.secondShardAxis < 0 ||
         (int)p.secondShardAxis >= kNumMeshAxes ||
         p.secondShardAxis == p.shardAxis))
      fail("parameter " + inQuotes(name) + " has an invalid second cut " +
           "(dimension " + std::to_string(p.secondShardDim) + ", mesh axis " +
           std::to_string((int)p.secondShardAxis) + ")");
    int64_t numel = 0;
    try {
      numel = shardLayoutOf(p).numel();
    } catch (const std::runtime_error &e) {
      fail("parameter " + inQuotes(name) +
           " has an invalid sharding: " + e.what());
    }
    if (numel != p.numel || p.offset < 0 ||
        p.offset + p.numel > program.paramElems)
      fail("parameter " + inQuotes(name) + " does not fit its shape or the " +
           "parameter buffer (numel " + std::to_string(p.numel) + ", offset " +
           std::to_string(p.offset) + ", buffer " +
           std::to_string(program.paramElems) + ")");
    if (program.optimizerElems > 0 &&
        (p.stateOffset < 0 || p.stateRunOffset < 0 || p.statePiece < 0 ||
         p.stateOffset + (p.statePiece ? p.statePiece : p.numel) >
             program.optimizerElems))
      fail("parameter " + inQuotes(name) + " has its AdamW state outside " +
           "the sharded moment stores (offset " +
           std::to_string(p.stateOffset) + ", piece " +
           std::to_string(p.statePiece) + ", stores " +
           std::to_string(program.optimizerElems) + ")");
  }
  for (int i = 0; program.paramStoreElems > 0 && i < program.numParams; i++) {
    const ParamInfo &p = program.params[i];
    if (p.valueOffset < 0 || p.valuePiece < 0 ||
        p.valueOffset + (p.valuePiece ? p.valuePiece : p.numel) >
            program.paramStoreElems)
      fail("parameter " + inQuotes(p.name ? p.name : "?") +
           " has its values outside the sharded parameter store");
  }
  if (program.optimizerElems < 0 || program.gradElems < 0 ||
      program.paramStoreElems < 0 || program.paramPieceElems < 0 ||
      program.paramPieceElems > program.paramStoreElems)
    fail("program has negative buffer sizes");
}

namespace {

// With the optimizer (ZeRO-1/2) or the parameters too (ZeRO-3) sharded
// over dp, a store of pieces (StateStore::Layout) holds per parameter
// either this rank's part of its run's piece or the whole parameter.
using Layout = StateStore::Layout;

// The elements of parameter p this rank holds in a store laid out as
// `layout`, [lo, hi) of the parameter's shard, and where the first is in
// the store (see ParamInfo::offset, stateOffset and valueOffset).
struct Owned {
  int64_t lo, hi, at;
  bool whole; // the parameter is whole in the store, alike on every dp rank
};
Owned ownedIn(const ParamInfo &p, Layout layout) {
  if (layout == Layout::ByOffset)
    return {0, p.numel, p.offset, true};
  bool moments = layout == Layout::MomentPieces;
  int64_t base = moments ? p.stateOffset : p.valueOffset;
  int64_t piece = moments ? p.statePiece : p.valuePiece;
  if (piece == 0)
    return {0, p.numel, base, true};
  int64_t k = groupRank(p.stateAxes ? p.stateAxes
                                    : meshLayout().shape().shardAxes().bits());
  PieceRange own = inPiece(p.stateRunOffset, p.numel, piece, k);
  return {own.begin - p.stateRunOffset, own.end - p.stateRunOffset,
          base + own.begin - k * piece,
          false};
}

// Parameter i of a store laid out as `layout`, as the parameters' layout
// holds it (its numel floats): in place, or (the store holds this rank's
// pieces) put together in `scratch` from every rank's over its group: the
// owner of each element contributes it to a sum (a parameter whole on
// every rank, its group's first rank).
const float *paramOf(const Program &program, Layout layout, const float *store,
                     int i, std::vector<float> &scratch) {
  const ParamInfo &p = program.params[i];
  if (layout == Layout::ByOffset)
    return store + p.offset;
  Owned o = ownedIn(p, layout);
  unsigned axes = o.whole || !p.stateAxes
                      ? meshLayout().shape().shardAxes().bits()
                      : p.stateAxes;
  scratch.assign(p.numel, 0.0f);
  if (!o.whole || groupRank(axes) == 0)
    std::copy_n(store + o.at, o.hi - o.lo, scratch.data() + o.lo);
  UncountedCollectives notTraffic;
  allReduceSum(scratch.data(), p.numel, axes);
  return scratch.data();
}

} // namespace

AlignedBuffer allocateZeroed(int64_t bytes, const char *what) {
  size_t size = ((size_t)std::max<int64_t>(bytes, 1) + 63) / 64 * 64;
  void *p = std::aligned_alloc(64, size);
  if (!p)
    fail(std::string("cannot allocate ") + std::to_string(size) +
         " bytes for the " + what);
  std::memset(p, 0, size);
  return AlignedBuffer((char *)p);
}

namespace {

std::vector<int64_t> shapeOf(const ParamInfo &p) {
  return std::vector<int64_t>(p.shape, p.shape + p.rank);
}

// Names under which parameter `name` may appear in a checkpoint: itself,
// then with a "transformer." or "model." prefix stripped or added.
std::vector<std::string> candidateNames(const std::string &name) {
  std::vector<std::string> names = {name};
  for (const char *prefix : {"transformer.", "model."}) {
    std::string p = prefix;
    if (name.rfind(p, 0) == 0)
      names.push_back(name.substr(p.size()));
    else
      names.push_back(p + name);
  }
  return names;
}

// Hugging Face's Mixtral holds each expert's weights apart: a stacked
// parameter P.experts.wK [experts, out, in] is P.experts.E.wK.weight there,
// E = 0 .. experts - 1 (under any of the candidate names). The names when
// `reader` has every one of them; empty otherwise.
std::vector<std::string> perExpertNames(const SafetensorsReader &reader,
                                        const std::string &name,
                                        int64_t experts) {
  if (perExpertName(name, 0).empty())
    return {};
  for (const std::string &base : candidateNames(name)) {
    std::vector<std::string> names;
    for (int64_t e = 0; e < experts; ++e) {
      std::string n = perExpertName(base, e);
      if (!reader.contains(n))
        break;
      names.push_back(n);
    }
    if ((int64_t)names.size() == experts)
      return names;
  }
  return {};
}

// The suffixes of AdamW's moments in a saved training state (NAME + suffix).
const char *const kMomentSuffixes[] = {".exp_avg", ".exp_avg_sq"};

} // namespace

std::map<std::string, std::string>
loadParams(const Program &program, const std::string &path,
           const std::vector<StateStore> &stores, bool strict) {
  SafetensorsReader reader(path);
  std::vector<std::string> tensors = reader.names();
  std::vector<float> used(tensors.size(), 0.0f);
  // A parameter kept as pieces (ZeRO) is read whole, one at a time, and its
  // part kept.
  std::vector<float> shard;
  for (const StateStore &store : stores)
  for (int i = 0; i < program.numParams; i++) {
    const ParamInfo &p = program.params[i];
    Owned o = ownedIn(p, store.layout);
    // Where the shard goes: its place in the store, or whole aside.
    bool aside = !o.whole;
    if (aside)
      shard.resize(p.numel);
    float *dest = aside ? shard.data() : store.data + o.at;
    // The shard is at dest: keep this rank's part.
    auto keep = [&]() {
      if (aside)
        std::copy(shard.begin() + o.lo, shard.begin() + o.hi,
                  store.data + o.at);
    };
    std::vector<std::string> names = candidateNames(p.name + store.suffix);
    const std::string *found = nullptr;
    for (const std::string &n : names)
      if (reader.contains(n)) {
        found = &n;
        break;
      }
    std::vector<std::string> experts;
    if (!found && p.rank == 3)
      experts = perExpertNames(reader, p.name + store.suffix, p.shape[0]);
    if (!experts.empty()) {
      // One expert after another into the stacked tensor.
      const std::vector<int64_t> want = shapeOf(p);
      const std::vector<int64_t> one(want.begin() + 1, want.end());
      std::vector<float> global(want[0] * want[1] * want[2]);
      for (size_t e = 0; e < experts.size(); ++e) {
        if (reader.info(experts[e]).shape != one)
          fail("tensor " + inQuotes(experts[e]) + " in " + inQuotes(path) +
               " has shape " + formatShape(reader.info(experts[e]).shape) +
               ", but one expert of " + inQuotes(p.name) + " is " +
               formatShape(one));
        reader.read(experts[e], global.data() + e * one[0] * one[1]);
        used[std::lower_bound(tensors.begin(), tensors.end(), experts[e]) -
             tensors.begin()] = 1.0f;
      }
      ShardLayout layout = shardLayoutOf(p);
      if (isSplit(layout))
        copyShardOut(layout, global.data(), dest);
      else
        std::copy(global.begin(), global.end(), dest);
      keep();
      continue;
    }
    if (!found) {
      std::string tried;
      for (size_t k = 1; k < names.size(); k++)
        tried += (k > 1 ? ", " : "") + inQuotes(names[k]);
      fail("parameter " + inQuotes(p.name + store.suffix) + " is not in " +
           inQuotes(path) + " (also tried " + tried + ")");
    }
    used[std::lower_bound(tensors.begin(), tensors.end(), *found) -
         tensors.begin()] = 1.0f;
    const SafetensorInfo &info = reader.info(*found);
    const std::vector<int64_t> want = shapeOf(p);
    // A table of the vocabulary's rows (a Hugging Face file) for a
    // parameter padded to model.vocab_pad_to_multiple: the padding rows keep
    // their initial values (moments: zeros).
    const TrainConfig &config = program.config;
    const bool padding = info.shape != want && want.size() == 2 &&
                         info.shape.size() == 2 &&
                         config.paddedVocab > config.vocab &&
                         want[0] == config.paddedVocab &&
                         info.shape[0] == config.vocab &&
                         info.shape[1] == want[1];
    if (info.shape != want && !padding)
      fail("tensor " + inQuotes(*found) + " in " + inQuotes(path) +
           " has shape " + formatShape(info.shape) +
           ", but the program expects " + formatShape(want));
    ShardLayout layout = shardLayoutOf(p);
    if (padding) {
      const int64_t real = info.shape[0] * want[1];
      std::vector<float> global(want[0] * want[1], 0.0f);
      reader.read(*found, global.data());
      if (store.suffix.empty())
        initRange(p.name, p.init, p.initMean, p.initStd, config.seed, real,
                  (int64_t)global.size() - real, global.data() + real);
      if (isSplit(layout))
        copyShardOut(layout, global.data(), dest);
      else
        std::copy(global.begin(), global.end(), dest);
      keep();
      continue;
    }
    if (!isSplit(layout)) {
      reader.read(*found, dest);
      keep();
      continue;
    }
    std::vector<float> global = reader.read(*found);
    copyShardOut(layout, global.data(), dest);
    keep();
  }
  // What no rank read (each holds its stage's parameters).
  {
    UncountedCollectives notTraffic;
    allReduceMax(used.data(), (int64_t)used.size(),
                 AxisSet::fromBits((1u << kNumMeshAxes) - 1).bits());
  }
  std::vector<std::string> unused;
  for (size_t k = 0; k < tensors.size(); k++)
    if (used[k] == 0.0f)
      unused.push_back(tensors[k]);
  if (unused.empty() || commRank() != 0)
    return reader.metadata();
  std::string list;
  for (size_t k = 0; k < unused.size() && k < 5; k++)
    list += (k ? ", " : "") + inQuotes(unused[k]);
  if (unused.size() > 5)
    list += ", ...";
  std::string what = std::to_string(unused.size()) + " tensor" +
                     (unused.size() > 1 ? "s" : "") + " of " + inQuotes(path) +
                     " (" + list + ") " +
                     (unused.size() > 1 ? "are" : "is") +
                     " not a parameter of this model";
  if (strict)
    fail(what + " (--strict)");
  std::fprintf(stderr, "warning: %s; ignored (--strict makes this an error)\n",
               what.c_str());
  return reader.metadata();
}

namespace {

// Generates exactly this rank's elements of every parameter: counter-based
// initialisation makes each element a function of its global index, so the
// shards together equal the one-rank initialisation bit for bit.
// With the parameters kept as pieces (ZeRO-3), only this rank's part of
// each shard is generated, in place.
void initParams(const Program &program, uint64_t seed,
                const StateStore &store) {
  for (int i = 0; i < program.numParams; i++) {
    const ParamInfo &p = program.params[i];
    Owned o = ownedIn(p, store.layout);
    forEachShardRun(shardLayoutOf(p), [&](int64_t globalOffset,
                                          int64_t shardOffset, int64_t count) {
      int64_t begin = std::max(shardOffset, o.lo);
      int64_t end = std::min(shardOffset + count, o.hi);
      if (begin < end)
        initRange(p.name, p.init, p.initMean, p.initStd, seed,
                  globalOffset + (begin - shardOffset), end - begin,
                  store.data + o.at + (begin - o.lo));
    });
  }
}

// Tags of the transfers that bring each pipeline stage's tensors to rank 0,
// above those of sendTo/recvFrom in the step functions.
constexpr int kSaveSizeTag = 32000, kSaveHeaderTag = 32001,
              kSaveDataTag = 32002;

// Whether this rank leads its pipeline stage: the first rank of its program.
bool isStageLeader() {
  const MeshLayout &layout = meshLayout();
  return commRank() == layout.firstRankOfProgram(layout.programOf(commRank()));
}

// The world rank of the leader of pipeline stage `stage`.
int stageLeaderRank(int64_t stage) {
  return (int)meshLayout().firstRankOfProgram(stage);
}

// Floats travel in int-sized chunks (MPI counts are int).
void sendFloats(const float *data, int64_t n, int dest) {
  for (int64_t begin = 0; begin < n; begin += INT_MAX) {
    int chunk = (int)std::min<int64_t>(n - begin, INT_MAX);
    if (MPI_Send(data + begin, chunk, MPI_FLOAT, dest, kSaveDataTag,
                 MPI_COMM_WORLD) != MPI_SUCCESS)
      fail("sending the final weights to rank " + std::to_string(dest) +
           " failed");
  }
}

void recvFloats(float *data, int64_t n, int source) {
  for (int64_t begin = 0; begin < n; begin += INT_MAX) {
    int chunk = (int)std::min<int64_t>(n - begin, INT_MAX);
    if (MPI_Recv(data + begin, chunk, MPI_FLOAT, source, kSaveDataTag,
                 MPI_COMM_WORLD, MPI_STATUS_IGNORE) != MPI_SUCCESS)
      fail("receiving the final weights of rank " + std::to_string(source) +
           " failed");
  }
}

void appendInt(std::vector<char> &out, int64_t value) {
  const char *bytes = (const char *)&value;
  out.insert(out.end(), bytes, bytes + sizeof(value));
}

int64_t readInt(const std::vector<char> &in, size_t &pos) {
  if (pos + sizeof(int64_t) > in.size())
    fail("the final weights received from a pipeline stage are truncated");
  int64_t value;
  std::memcpy(&value, in.data() + pos, sizeof(value));
  pos += sizeof(value);
  return value;
}

int64_t numelOf(const std::vector<int64_t> &shape) {
  int64_t numel = 1;
  for (int64_t d : shape)
    numel *= d;
  return numel;
}

// A stage leader other than rank 0 tells rank 0 the names and shapes of
// its stage's global tensors: the size of a header, then the header
// (count, then per tensor a length-prefixed name, rank and shape). Their
// floats follow one tensor at a time, as the stage gathers them.
void sendStageHeader(const std::vector<SafetensorView> &views) {
  std::vector<char> header;
  appendInt(header, (int64_t)views.size());
  for (const SafetensorView &v : views) {
    appendInt(header, (int64_t)v.name.size());
    header.insert(header.end(), v.name.begin(), v.name.end());
    appendInt(header, (int64_t)v.shape.size());
    for (int64_t d : v.shape)
      appendInt(header, d);
  }
  int64_t size = (int64_t)header.size();
  if (size > INT_MAX)
    fail("too many parameters to send to rank 0");
  if (MPI_Send(&size, 1, MPI_INT64_T, 0, kSaveSizeTag, MPI_COMM_WORLD) !=
          MPI_SUCCESS ||
      MPI_Send(header.data(), (int)size, MPI_CHAR, 0, kSaveHeaderTag,
               MPI_COMM_WORLD) != MPI_SUCCESS)
    fail("sending the final weights to rank 0 failed");
}

// The tensors (names and shapes, no data) a stage leader announces.
std::vector<SafetensorView> recvStageHeader(int source) {
  std::string failed = "receiving the final weights of rank " +
                       std::to_string(source) + " failed";
  std::string invalid = "the final weights received from rank " +
                        std::to_string(source) + " have an invalid header";
  int64_t size = 0;
  if (MPI_Recv(&size, 1, MPI_INT64_T, source, kSaveSizeTag, MPI_COMM_WORLD,
               MPI_STATUS_IGNORE) != MPI_SUCCESS ||
      size < 0 || size > INT_MAX)
    fail(failed);
  std::vector<char> header(size);
  if (MPI_Recv(header.data(), (int)size, MPI_CHAR, source, kSaveHeaderTag,
               MPI_COMM_WORLD, MPI_STATUS_IGNORE) != MPI_SUCCESS)
    fail(failed);
  size_t pos = 0;
  int64_t count = readInt(header, pos);
  if (count < 0 || count > size)
    fail(invalid);
  std::vector<SafetensorView> tensors(count);
  for (SafetensorView &t : tensors) {
    int64_t length = readInt(header, pos);
    if (length < 0 || pos + length > header.size())
      fail(invalid);
    t.name.assign(header.data() + pos, length);
    pos += length;
    int64_t rank = readInt(header, pos);
    if (rank < 0 || rank > 8)
      fail(invalid);
    for (int64_t d = 0; d < rank; d++)
      t.shape.push_back(readInt(header, pos));
    t.data = nullptr;
  }
  return tensors;
}

// Saves the global parameters from rank 0, one tensor at a time: no rank
// holds more than its own stores and one global tensor. Every rank takes
// part: a store of ZeRO's pieces gives each parameter put together over
// its group (paramOf), a split parameter is all-gathered over its shard axis
// (group order is coordinate order along that axis) and the stage leader (every
// coordinate but pp 0) puts the pieces back in checkpoint layout.
// Replicated parameters are written from the leader's copy. Rank 0 writes
// one file with every stage's parameters in stage order: the other stage
// leaders first send it their tensors' names and shapes, so that the file's
// header is written before any data, then each tensor as they gather it,
// which rank 0 writes once it has written the stages before.
nlohmann::json ownPlan();

void saveParams(const Program &program, const std::string &path,
                const std::vector<StateStore> &stores, int64_t steps,
                int64_t updates) {
  bool writer = commRank() == 0;
  bool stageLeader = isStageLeader();
  // This stage's tensors, in the file's order.
  std::vector<SafetensorView> mine;
  for (size_t st = 0; st < stores.size(); st++)
    for (int i = 0; i < program.numParams; i++)
      mine.push_back({program.params[i].name + stores[st].suffix,
                      shapeOf(program.params[i]), nullptr});
  std::vector<std::vector<SafetensorView>> stages;
  if (stageLeader && !writer)
    sendStageHeader(mine);
  std::vector<SafetensorView> all;
  std::map<std::string, std::string> metadata;
  if (writer) {
    stages.push_back(mine);
    for (int64_t stage = 1; stage < meshSize(MeshAxis::PP); stage++)
      stages.push_back(recvStageHeader(stageLeaderRank(stage)));
    for (const std::vector<SafetensorView> &tensors : stages)
      all.insert(all.end(), tensors.begin(), tensors.end());
    metadata = {{"program", program.name ? program.name : ""},
                {"steps", std::to_string(steps)}};
    // A state's updates, where steps were skipped (--skip-nonfinite).
    if (updates >= 0 && updates != steps)
      metadata["updates"] = std::to_string(updates);
    // The model's fields, as plan.json records them: what `tessel export`
    // writes a Hugging Face config from.
    nlohmann::json plan = ownPlan();
    if (plan.is_object() && plan.contains("model"))
      metadata["model"] = plan["model"].dump();
  }

  // One pass over the tensors, written to `target`: rank 0's error, if
  // any (the other ranks' is always empty). After an error rank 0 still
  // takes every tensor, so that no rank waits for it.
  auto pass = [&](const std::string &target) {
    std::unique_ptr<SafetensorsWriter> file;
    std::string error;
    auto attempt = [&](auto &&write) {
      if (!error.empty())
        return;
      try {
        write();
      } catch (const std::runtime_error &e) {
        error = e.what();
        file.reset();
      }
    };
    if (writer)
      attempt([&] {
        file = std::make_unique<SafetensorsWriter>(target, all, metadata);
      });
    auto emit = [&](const float *data, int64_t numel) {
      if (writer)
        attempt([&] { file->write(data); });
      else if (stageLeader)
        sendFloats(data, numel, 0);
    };
    for (size_t st = 0; st < stores.size(); st++)
      for (int i = 0; i < program.numParams; i++) {
        const ParamInfo &p = program.params[i];
        std::vector<float> expanded;
        const float *data =
            paramOf(program, stores[st].layout, stores[st].data, i, expanded);
        ShardLayout layout = shardLayoutOf(p);
        std::vector<float> firstPiece;
        if (layout.parts2 > 1) {
          // Cut twice: the first cut's piece from the second's over its
          // axis, then as below.
          std::vector<float> pieces(layout.parts2 * p.numel);
          allGather(data, pieces.data(), p.numel,
                    AxisSet(p.secondShardAxis).bits());
          std::vector<int64_t> shape = shapeOf(p);
          shape[p.shardDim] = layout.pieceRows();
          firstPiece.resize(p.numel * layout.parts2);
          for (int64_t k = 0; k < layout.parts2; k++)
            copyShardIn(cutAgain(makeShardLayout(shape.data(), p.rank,
                                                 p.shardDim, 1, 1, 0),
                                 shape.data(), p.rank, p.shardDim,
                                 p.secondShardDim, layout.parts2, k),
                        pieces.data() + k * p.numel, firstPiece.data());
          data = firstPiece.data();
          layout.parts2 = 1;
        }
        int64_t numel = layout.numel();
        std::vector<float> global;
        if (isSplit(layout)) {
          std::vector<float> pieces(layout.parts * numel);
          allGather(data, pieces.data(), numel, AxisSet(p.shardAxis).bits());
          if (stageLeader) {
            global.resize(layout.globalNumel());
            for (int64_t k = 0; k < layout.parts; k++) {
              ShardLayout piece = layout;
              piece.index = k;
              copyShardIn(piece, pieces.data() + k * numel, global.data());
            }
            data = global.data();
          }
        }
        if (stageLeader)
          emit(data, numelOf(shapeOf(p)));
      }
    if (writer) {
      std::vector<float> buffer;
      for (size_t stage = 1; stage < stages.size(); stage++)
        for (const SafetensorView &t : stages[stage]) {
          buffer.resize(numelOf(t.shape));
          recvFloats(buffer.data(), (int64_t)buffer.size(),
                     stageLeaderRank(stage));
          attempt([&] { file->write(buffer.data()); });
        }
      attempt([&] { file->commit(); });
    }
    return error;
  };

  // The trained weights are not lost when the file cannot be written (its
  // directory removed, the disk full): the ranks save them again, next to
  // it, then in $TMPDIR, and the error says where.
  std::vector<std::string> targets = {path};
  if (writer) {
    std::string base = path;
    while (base.size() > 1 && base.back() == '/')
      base.pop_back();
    const std::string extension = ".safetensors";
    if (base.size() > extension.size() &&
        base.compare(base.size() - extension.size(), extension.size(),
                     extension) == 0)
      base.resize(base.size() - extension.size());
    std::string suffix =
        ".rescued-" + std::to_string(::getpid()) + ".safetensors";
    const char *tmpdir = std::getenv("TMPDIR");
    targets.push_back(base + suffix);
    targets.push_back(std::string(tmpdir && *tmpdir ? tmpdir : "/tmp") + "/" +
                      base.substr(base.find_last_of('/') + 1) + suffix);
  }
  std::string failure;
  for (int attempt = 0; attempt < 3; attempt++) {
    std::string error = pass(writer ? targets[attempt] : path);
    // Every rank learns whether rank 0 wrote the file.
    int written = error.empty() ? 1 : 0;
    if (commWorldSize() > 1 &&
        MPI_Bcast(&written, 1, MPI_INT, 0, MPI_COMM_WORLD) != MPI_SUCCESS)
      fail("saving the final weights failed");
    if (written) {
      if (writer && attempt > 0)
        fail(failure + "; the final weights are saved in " +
             inQuotes(targets[attempt]) + " instead");
      return;
    }
    failure += (failure.empty() ? "" : "; ") + error;
  }
  if (writer)
    fail(failure + "; the final weights could not be saved");
}

// The boxes of the global tensor that this rank's shard of `p` holds, one
// per block, in the shard's block order.
std::vector<Box> shardBoxes(const ParamInfo &p, const ShardLayout &layout) {
  Box whole{std::vector<int64_t>(p.rank, 0), shapeOf(p)};
  if (!isSplit(layout))
    return {whole};
  std::vector<Box> boxes;
  int64_t blockRows = layout.dim / layout.blocks;
  for (int64_t b = 0; b < layout.blocks; b++) {
    Box box = whole;
    box.offsets[p.shardDim] = b * blockRows + layout.index * layout.pieceRows();
    box.sizes[p.shardDim] = layout.pieceRows();
    if (layout.parts2 > 1) {
      int64_t rows2 = layout.dim2 / layout.parts2;
      box.offsets[p.secondShardDim] = layout.index2 * rows2;
      box.sizes[p.secondShardDim] = rows2;
    }
    boxes.push_back(box);
  }
  return boxes;
}

// Block b of a shard (laid out [outer][block][piece rows x inner]) as its
// own row-major box: copied out of the shard, or into it.
void copyBlock(const ShardLayout &layout, int64_t b, float *shard, float *box,
               bool intoShard) {
  // Cut twice, the shard is one box (of one block), row-major alike.
  if (layout.parts2 > 1) {
    if (intoShard)
      std::copy_n(box, layout.numel(), shard);
    else
      std::copy_n(shard, layout.numel(), box);
    return;
  }
  int64_t run = layout.pieceRows() * layout.inner;
  for (int64_t o = 0; o < layout.outer; o++) {
    float *at = shard + (o * layout.blocks + b) * run;
    if (intoShard)
      std::copy_n(box + o * run, run, at);
    else
      std::copy_n(at, run, box + o * run);
  }
}

// A box of a checkpoint tensor as a store holds it: block `block` of a
// whole shard (copyBlock), or, for a part of the shard, the box `local` of
// the shard viewed as the tensor `localShape` (the shard's blocks stacked
// along the shard dimension).
struct StoredBox {
  Box global;
  int64_t block = -1; // -1: a part of the shard
  Box local;
};

// The shard of `p` viewed as a tensor: the global shape with the shard
// dimension (and the second cut's) as this rank holds them.
std::vector<int64_t> localShapeOf(const ParamInfo &p,
                                  const ShardLayout &layout) {
  std::vector<int64_t> shape = shapeOf(p);
  if (!isSplit(layout))
    return shape;
  shape[p.shardDim] = layout.blocks * layout.pieceRows();
  if (layout.parts2 > 1)
    shape[p.secondShardDim] = layout.dim2 / layout.parts2;
  return shape;
}

// The boxes of the global tensor that store `o` of `p` holds: the shard's
// blocks when it is whole, else the part [o.lo, o.hi) of the shard in as
// few boxes as row-major order allows (flatRangeBoxes), each cut where the
// shard's blocks meet.
std::vector<StoredBox> storedBoxes(const ParamInfo &p,
                                   const ShardLayout &layout, const Owned &o) {
  std::vector<Box> blocks = shardBoxes(p, layout);
  std::vector<StoredBox> boxes;
  if (o.whole) {
    for (size_t b = 0; b < blocks.size(); ++b)
      boxes.push_back({blocks[b], (int64_t)b, {}});
    return boxes;
  }
  int64_t rows = isSplit(layout) ? layout.pieceRows() : 0;
  for (const Box &local :
       flatRangeBoxes(localShapeOf(p, layout), o.lo, o.hi)) {
    if (!isSplit(layout)) {
      boxes.push_back({local, -1, local});
      continue;
    }
    int d = p.shardDim;
    for (size_t b = 0; b < blocks.size(); ++b) {
      int64_t first = std::max(local.offsets[d], (int64_t)b * rows);
      int64_t end = std::min(local.offsets[d] + local.sizes[d],
                             (int64_t)(b + 1) * rows);
      if (first >= end)
        continue;
      StoredBox box{blocks[b], -1, local};
      box.local.offsets[d] = first;
      box.local.sizes[d] = end - first;
      // Block b lies at blocks[b] in the global tensor.
      for (size_t k = 0; k < local.offsets.size(); ++k)
        box.global.offsets[k] +=
            (int)k == d ? first - (int64_t)b * rows : local.offsets[k];
      box.global.sizes = box.local.sizes;
      boxes.push_back(std::move(box));
    }
  }
  return boxes;
}

// Copies a stored box between the store (`at`: where element o.lo of the
// shard is) and `box` (row-major over its sizes), either way.
void copyStored(const ShardLayout &layout, const std::vector<int64_t> &shape,
                const StoredBox &stored, const Owned &o, float *at, float *box,
                bool intoStore) {
  if (stored.block >= 0) {
    copyBlock(layout, stored.block, at, box, intoStore);
    return;
  }
  const Box &local = stored.local;
  size_t rank = shape.size();
  if (rank == 0) {
    intoStore ? (void)(*at = *box) : (void)(*box = *at);
    return;
  }
  std::vector<int64_t> index(local.offsets);
  int64_t row = local.sizes[rank - 1];
  for (int64_t done = 0; done < local.numel(); done += row) {
    int64_t flat = 0;
    for (size_t d = 0; d < rank; ++d)
      flat = flat * shape[d] + index[d];
    float *s = at + (flat - o.lo);
    if (intoStore)
      std::copy_n(box + done, row, s);
    else
      std::copy_n(s, row, box + done);
    for (int d = (int)rank - 2; d >= 0; --d) {
      if (++index[d] < local.offsets[d] + local.sizes[d])
        break;
      index[d] = local.offsets[d];
    }
  }
}

// This rank's share of a checkpoint: the boxes of its shards that it
// writes. A box that several ranks hold (replicas over every axis but the
// ones that split the tensor, ZeRO's shard group for a piece, and pp) is
// written by one of them: each tensor goes to the replica with the fewest
// bytes so far (the lowest first), which every replica works out alike.
// ZeRO's pieces are written as they are, never gathered: a checkpoint of a
// sharded optimizer costs each rank its own state and no communication.
std::vector<CheckpointPiece>
checkpointPieces(const Program &program, const std::vector<StateStore> &stores,
                 std::vector<CheckpointPiece> recycled) {
  std::vector<CheckpointPiece> pieces;
  std::map<unsigned, std::vector<int64_t>> bytesOf; // per replica group
  const MeshShape &shape = meshLayout().shape();
  for (size_t st = 0; st < stores.size(); st++)
    for (int i = 0; i < program.numParams; i++) {
      const ParamInfo &p = program.params[i];
      ShardLayout layout = shardLayoutOf(p);
      Owned o = ownedIn(p, stores[st].layout);
      unsigned replicaAxes = 0;
      for (MeshAxis axis : kMeshAxes)
        if (axis != MeshAxis::PP && !(isSplit(layout) && axis == p.shardAxis) &&
            !(layout.parts2 > 1 && axis == p.secondShardAxis))
          replicaAxes |= AxisSet(axis).bits();
      if (!o.whole) {
        // The pieces differ over the shard group; under hybrid sharding
        // they repeat over the groups (dp's replica half).
        AxisSet group = AxisSet::fromBits(
            p.stateAxes ? p.stateAxes : shape.shardAxes().bits());
        for (MeshAxis axis : kMeshAxes)
          if (group.contains(axis))
            replicaAxes &= ~AxisSet(axis).bits();
        if (group.bits() & kDpShardBit)
          replicaAxes = (replicaAxes & ~AxisSet(MeshAxis::DP).bits()) |
                        kDpReplicaBit;
      }
      replicaAxes = shape.effective(AxisSet::fromBits(replicaAxes)).bits();
      int64_t replicas = shape.groupSize(AxisSet::fromBits(replicaAxes));
      if (replicas > 1) {
        std::vector<int64_t> &bytes = bytesOf[replicaAxes];
        bytes.resize(replicas, 0);
        int64_t writer =
            std::min_element(bytes.begin(), bytes.end()) - bytes.begin();
        bytes[writer] += o.hi - o.lo;
        if (groupRank(replicaAxes) != writer)
          continue;
      }
      std::vector<int64_t> localShape = localShapeOf(p, layout);
      for (const StoredBox &stored : storedBoxes(p, layout, o)) {
        CheckpointPiece piece;
        // The previous snapshot's memory, in the same order.
        if (pieces.size() < recycled.size())
          piece.data = std::move(recycled[pieces.size()].data);
        piece.tensor = p.name + stores[st].suffix;
        piece.shape = shapeOf(p);
        piece.box = stored.global;
        piece.data.resize(piece.box.numel());
        copyStored(layout, localShape, stored, o, stores[st].data + o.at,
                   piece.data.data(), /*intoStore=*/false);
        pieces.push_back(std::move(piece));
      }
    }
  return pieces;
}

} // namespace

// The newest committed checkpoint under `path` whose files pass their size
// and checksum checks; an older one when not, saying why. Each file is read
// for its checksum by one rank (file k of the manifest's sorted list by
// rank k mod the world size), not by every rank that loads from it: with
// replicas (dp without ZeRO) every rank loads every file, and the files
// would otherwise be read once per rank before they are loaded. Each rank
// still checks that the manifest lists the files it will read.
CheckpointManifest chooseCheckpoint(const Program &program,
                                    const std::string &path,
                                    const std::vector<StateStore> &stores) {
  std::vector<std::string> dirs = committedCheckpoints(path);
  for (const std::string &dir : dirs) {
    CheckpointManifest m;
    std::string problem;
    try {
      m = readManifest(dir);
      std::set<std::string> files;
      for (const StateStore &store : stores)
        for (int i = 0; i < program.numParams; i++) {
          const ParamInfo &p = program.params[i];
          auto t = m.tensors.find(p.name + store.suffix);
          if (t == m.tensors.end())
            continue;
          ShardLayout layout = shardLayoutOf(p);
          for (const StoredBox &stored :
               storedBoxes(p, layout, ownedIn(p, store.layout)))
            for (const CheckpointManifest::Source &s : t->second.boxes) {
              const Box &want = stored.global;
              bool meets = s.box.offsets.size() == want.offsets.size();
              for (size_t d = 0; meets && d < want.offsets.size(); d++)
                meets = s.box.offsets[d] < want.offsets[d] + want.sizes[d] &&
                        want.offsets[d] < s.box.offsets[d] + s.box.sizes[d];
              if (meets)
                files.insert(s.file);
            }
        }
      for (const std::string &file : files)
        if (!m.files.count(file)) {
          problem = "the manifest does not list " + inQuotes(file);
          break;
        }
      int64_t k = 0, world = commWorldSize(), me = commRank();
      for (auto it = m.files.begin(); problem.empty() && it != m.files.end();
           ++it, ++k)
        if (k % world == me)
          problem = verifyCheckpointFile(m, it->first);
    } catch (const std::exception &e) {
      problem = e.what();
    }
    if (!problem.empty())
      std::fprintf(stderr,
                   "warning: rank %d: the checkpoint '%s' is not used: %s\n",
                   commRank(), dir.c_str(), problem.c_str());
    if (everyRank(problem.empty())) {
      if (dir != dirs.front() && commRank() == 0)
        std::fprintf(stderr, "warning: resuming from the older checkpoint "
                             "'%s'\n", dir.c_str());
      return m;
    }
  }
  throw AgreedError("no checkpoint under " + inQuotes(path) +
                    " passes its checks (see the warnings above)");
}

// Loads the stores from a checkpoint saved at any layout: each rank reads
// the boxes that meet its shards. A checkpoint of another model (tensors
// missing, of other shapes, or not in this model) is refused naming them.
void loadCheckpoint(const Program &program, const CheckpointManifest &m,
                    const std::vector<StateStore> &stores) {
  // What differs, by kind: missing here, of another shape, not in this model.
  std::vector<std::string> missing, reshaped, extra;
  std::vector<std::string> names;
  for (auto &[name, t] : m.tensors)
    names.push_back(name);
  std::vector<float> used(names.size(), 0.0f);
  for (const StateStore &store : stores)
    for (int i = 0; i < program.numParams; i++) {
      const ParamInfo &p = program.params[i];
      std::string name = p.name + store.suffix;
      auto t = m.tensors.find(name);
      if (t == m.tensors.end()) {
        missing.push_back(inQuotes(name));
        continue;
      }
      used[std::lower_bound(names.begin(), names.end(), name) -
           names.begin()] = 1.0f;
      if (t->second.shape != shapeOf(p))
        reshaped.push_back(inQuotes(name) + " " +
                           formatShape(t->second.shape) + " there, " +
                           formatShape(shapeOf(p)) + " here");
    }
  // The moments of this program's parameters are this model's tensors even
  // when `stores` does not read them (inference reads the parameters only).
  for (int i = 0; i < program.numParams; i++)
    for (const char *suffix : kMomentSuffixes) {
      std::string name = program.params[i].name + std::string(suffix);
      auto at = std::lower_bound(names.begin(), names.end(), name);
      if (at != names.end() && *at == name)
        used[at - names.begin()] = 1.0f;
    }
  {
    UncountedCollectives notTraffic;
    allReduceMax(used.data(), (int64_t)used.size(),
                 AxisSet::fromBits((1u << kNumMeshAxes) - 1).bits());
  }
  if (commRank() == 0)
    for (size_t k = 0; k < names.size(); k++)
      if (used[k] == 0.0f)
        extra.push_back(inQuotes(names[k]));
  if (!missing.empty() || !reshaped.empty() || !extra.empty()) {
    std::string list;
    auto add = [&](const std::vector<std::string> &items, const char *what) {
      if (items.empty())
        return;
      list += "\n  " + std::to_string(items.size()) + " " + what + ": ";
      for (size_t k = 0; k < items.size() && k < 4; k++)
        list += (k ? ", " : "") + items[k];
      if (items.size() > 4)
        list += ", ...";
    };
    add(missing, "of this program's tensors not in the checkpoint");
    add(reshaped, "of other shapes");
    add(extra, "of the checkpoint's tensors not in this program");
    fail("the checkpoint " + inQuotes(m.dir) +
         " is of another model than this program's (saved at " + m.layout +
         "):" + list);
  }
  if (!everyRank(true))
    fail("another rank found the checkpoint of another model");
  for (const StateStore &store : stores)
    for (int i = 0; i < program.numParams; i++) {
      const ParamInfo &p = program.params[i];
      ShardLayout layout = shardLayoutOf(p);
      Owned o = ownedIn(p, store.layout);
      std::vector<int64_t> localShape = localShapeOf(p, layout);
      std::vector<float> box;
      for (const StoredBox &stored : storedBoxes(p, layout, o)) {
        box.resize(stored.global.numel());
        readCheckpointBox(m, p.name + store.suffix, shapeOf(p), stored.global,
                          box.data());
        copyStored(layout, localShape, stored, o, store.data + o.at,
                   box.data(), /*intoStore=*/true);
      }
    }
}

namespace {

// The plan.json of the directory this program was compiled into
// (DIR/bin/PROGRAM -> DIR/plan.json), or null when there is none.
nlohmann::json ownPlan() {
  std::error_code ec;
  std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec)
    return nullptr;
  std::filesystem::path plan = exe.parent_path().parent_path() / "plan.json";
  std::string text;
  try {
    text = readTextFile(plan.string());
  } catch (const std::runtime_error &) {
    return nullptr;
  }
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  return j.is_object() ? j : nlohmann::json(nullptr);
}

// The fields of two JSON objects that differ, as "NAME: A there, B here".
std::vector<std::string> fieldDifferences(const std::string &prefix,
                                          const nlohmann::json &there,
                                          const nlohmann::json &here) {
  std::vector<std::string> out;
  std::set<std::string> keys;
  for (auto &[k, v] : there.items())
    keys.insert(k);
  for (auto &[k, v] : here.items())
    keys.insert(k);
  for (const std::string &k : keys) {
    std::string a = there.contains(k) ? there[k].dump() : "(none)",
                b = here.contains(k) ? here[k].dump() : "(none)";
    if (a != b)
      out.push_back(prefix + k + ": " + a + " there, " + b + " here");
  }
  return out;
}

} // namespace

bool isDirectory(const std::string &path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

namespace {

// FILE with ".rank<R>" before its extension: comm.json -> comm.rank3.json.
std::string rankFileName(const std::string &path, int rank) {
  std::string tag = ".rank" + std::to_string(rank);
  size_t slash = path.find_last_of('/');
  size_t dot = path.find_last_of('.');
  bool hasExtension = dot != std::string::npos && dot > 0 &&
                      (slash == std::string::npos || dot > slash + 1);
  if (!hasExtension)
    return path + tag;
  return path.substr(0, dot) + tag + path.substr(dot);
}

// A field of /proc/self/status in bytes ("VmRSS", "VmHWM"); -1 where the
// system has none.
int64_t statusBytes(const char *field) {
  FILE *f = std::fopen("/proc/self/status", "r");
  if (!f)
    return -1;
  char line[256];
  int64_t kb = -1;
  size_t n = std::strlen(field);
  while (std::fgets(line, sizeof(line), f))
    if (std::strncmp(line, field, n) == 0 && line[n] == ':') {
      kb = std::strtoll(line + n + 1, nullptr, 10);
      break;
    }
  std::fclose(f);
  return kb < 0 ? -1 : kb * 1024;
}

// Writes the collective counts of this rank and its resident memory before
// the plan's stores were allocated, right after, its peak once the state
// was initialised or loaded (before the first step), and its peak,
// atomically.
void writeCommReport(const std::string &path, int64_t steps,
                     const CollectiveCounter *counters, int64_t rssBefore,
                     int64_t rssAllocated, int64_t peakStarted) {
  std::string json = "{\"rank\": " + std::to_string(commRank()) +
                     ", \"steps\": " + std::to_string(steps) +
                     ", \"collectives\": {";
  for (int k = 0; k < kNumCollectiveKinds; k++) {
    const CollectiveCounter &c = counters[k];
    json += std::string(k ? ", " : "") + "\"" +
            collectiveName((CollectiveKind)k) +
            "\": {\"calls\": " + std::to_string(c.calls) +
            ", \"elements\": " + std::to_string(c.elements) +
            ", \"bytes_sent\": " + std::to_string(c.bytesSent) + "}";
  }
  json += "}, \"memory\": {\"rss_before_bytes\": " +
          std::to_string(rssBefore) +
          ", \"rss_allocated_bytes\": " + std::to_string(rssAllocated) +
          ", \"rss_started_peak_bytes\": " + std::to_string(peakStarted) +
          ", \"rss_peak_bytes\": " + std::to_string(statusBytes("VmHWM")) +
          "}}\n";
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  FILE *f = std::fopen(tmp.c_str(), "wb");
  bool ok = f && std::fputs(json.c_str(), f) >= 0;
  if (f && std::fclose(f) != 0)
    ok = false;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    int error = errno;
    std::remove(tmp.c_str());
    fail("cannot write the communication report " + inQuotes(path) + ": " +
         std::strerror(error));
  }
}

// "dp=2 tp=2" for messages.
std::string describeMesh() { return meshLayout().shape().describe(); }

// Fails early, before any training, when `path` cannot be created. A file
// written `whole` goes to a temporary name first and is renamed over
// `path`: a device or a pipe there (`/dev/stdout`) is refused, since the
// rename would replace it rather than write into it. One written as it
// goes (the metrics) may be one; it is opened as it is.
void checkWritable(const std::string &path, const char *what,
                   bool whole = false) {
  struct stat st;
  bool exists = ::stat(path.c_str(), &st) == 0;
  if (exists && S_ISDIR(st.st_mode))
    fail(std::string("cannot write the ") + what + " " + inQuotes(path) +
         ": it is a directory (give a file name)");
  if (exists && !S_ISREG(st.st_mode)) {
    if (whole)
      checkReplaceable(path, std::string("the ") + what);
    return;
  }
  std::string probe = path + ".tmp." + std::to_string(::getpid());
  FILE *f = std::fopen(probe.c_str(), "wb");
  if (!f)
    fail(std::string("cannot write the ") + what + " " + inQuotes(path) + ": " +
         std::strerror(errno));
  std::fclose(f);
  std::remove(probe.c_str());
}

std::string jsonNumber(double value, const char *format) {
  if (!std::isfinite(value))
    return "null";
  char buf[64];
  std::snprintf(buf, sizeof(buf), format, value);
  return buf;
}

// The step's other observations as metrics (docs/metrics.md): a metric
// named `base.N` is layer N's entry of the list `base`; an MoE layer's
// kept assignments (`expert_kept`, recorded only with a capacity) become
// its dropped ones, and the drop rate covers every MoE layer.
struct StepMetricsView {
  std::string json;                                   // ", \"key\": value"...
  std::vector<std::pair<std::string, double>> scalars; // for TensorBoard
};

StepMetricsView viewMetrics(const std::vector<StepMetric> &metrics) {
  StepMetricsView view;
  if (metrics.empty())
    return view;
  auto number = [](double v) {
    // Counts are whole numbers; losses keep their digits.
    return v == std::floor(v) && std::fabs(v) < 1e15 ? jsonNumber(v, "%.0f")
                                                     : jsonNumber(v, "%.9g");
  };
  auto sumOf = [](const std::vector<double> &v) {
    double total = 0;
    for (double x : v)
      total += x;
    return total;
  };
  // Each name's entries: one value (or array) alone, or a list by layer.
  struct Entries {
    bool byLayer = false;
    std::vector<std::string> texts;
  };
  std::vector<std::string> order;
  std::map<std::string, Entries> entries;
  std::map<std::string, std::vector<double>> tokensByLayer, keptByLayer;
  std::vector<std::string> layers; // of expert_tokens, in order
  for (const StepMetric &m : metrics) {
    size_t dot = m.name.rfind('.');
    bool byLayer = dot != std::string::npos;
    std::string base = byLayer ? m.name.substr(0, dot) : m.name;
    std::string layer = byLayer ? m.name.substr(dot + 1) : "";
    if (base == "expert_tokens") {
      tokensByLayer[layer] = m.values;
      layers.push_back(layer);
    }
    if (base == "expert_kept") {
      keptByLayer[layer] = m.values;
      continue;
    }
    std::string text;
    if (m.values.size() == 1) {
      text = number(m.values[0]);
      if (!byLayer)
        view.scalars.push_back({base, m.values[0]});
    } else {
      text = "[";
      for (size_t i = 0; i < m.values.size(); ++i)
        text += (i ? ", " : "") + number(m.values[i]);
      text += "]";
    }
    if (!entries.count(base))
      order.push_back(base);
    Entries &e = entries[base];
    e.byLayer |= byLayer;
    e.texts.push_back(text);
  }
  for (const std::string &base : order) {
    const Entries &e = entries[base];
    std::string value;
    if (!e.byLayer && e.texts.size() == 1) {
      value = e.texts[0];
    } else {
      value = "[";
      for (size_t i = 0; i < e.texts.size(); ++i)
        value += (i ? ", " : "") + e.texts[i];
      value += "]";
    }
    view.json += ", \"" + base + "\": " + value;
  }
  if (!layers.empty()) {
    double routed = 0, dropped = 0;
    std::string perLayer = "[";
    for (size_t i = 0; i < layers.size(); ++i) {
      double tokens = sumOf(tokensByLayer[layers[i]]);
      auto kept = keptByLayer.find(layers[i]);
      double d = kept == keptByLayer.end() ? 0 : tokens - sumOf(kept->second);
      routed += tokens;
      dropped += d;
      perLayer += (i ? ", " : "") + number(d);
    }
    perLayer += "]";
    double rate = routed > 0 ? dropped / routed : 0;
    if (!keptByLayer.empty())
      view.json += ", \"expert_dropped\": " + perLayer;
    view.json += ", \"drop_rate\": " + jsonNumber(rate, "%.9g");
    view.scalars.push_back({"drop_rate", rate});
  }
  return view;
}

// The program as this rank runs it: a shared program with the parameter
// table and arena of the pipeline rank the process finds itself on.
Program programOfThisRank(const Program &shared, int64_t &variant) {
  variant = 0;
  if (!shared.variants)
    return shared;
  int64_t stage = meshCoord(MeshAxis::PP);
  for (int k = 0; k < shared.numVariants; ++k)
    if (shared.variants[k].pipelineRank == stage) {
      Program program = shared;
      program.params = shared.variants[k].params;
      program.activationBytes = shared.variants[k].activationBytes;
      variant = k;
      return program;
    }
  std::string ranks;
  for (int k = 0; k < shared.numVariants; ++k)
    ranks += (k ? ", " : "") + std::to_string(shared.variants[k].pipelineRank);
  fail("this binary runs pipeline ranks " + ranks + ", and was started on " +
       "pipeline rank " + std::to_string(stage) +
       " (launch the binaries as plan.json maps ranks to them)");
}

int train(const Program &sharedProgram, const Options &opts) {
  int64_t variant = 0;
  const Program program = programOfThisRank(sharedProgram, variant);
  validateProgram(program);
  const TrainConfig &config = program.config;
  if (opts.threads > 0) {
    omp_set_num_threads(opts.threads);
    openblas_set_num_threads(opts.threads);
  }
  const int64_t B = config.batch, T = config.seqLen;
  // Data-parallel rank d trains on its share [d * B, (d + 1) * B) of each
  // global batch of B * dp sequences, taken from each microbatch alike (its
  // d-th B / microbatches rows of each), so every layout sees the one-rank
  // data in the one-rank microbatches.
  // Expert parallelism splits the batch further (inside dp).
  const unsigned dataAxes = AxisSet(MeshAxis::DP).bits() |
                            AxisSet(MeshAxis::EP).bits();
  const int64_t dataRanks = meshSize(MeshAxis::DP) * meshSize(MeshAxis::EP);
  const int64_t globalB = B * dataRanks;
  const int64_t firstRow = groupRank(dataAxes) * B;
  // Context parallelism splits each sequence: this rank reads whole rows
  // and keeps its piece of Tc tokens of each, at the row's start: piece c
  // of the sequence's order, or of the balanced order (Sequence.h), chunks
  // c and 2 cp - 1 - c.
  const unsigned cpAxes = AxisSet(MeshAxis::CP).bits();
  const int64_t cpRanks = meshSize(MeshAxis::CP);
  const int64_t Tc = T / cpRanks;
  const int64_t firstSequenceRow = groupRank(cpAxes) * Tc;
  const int64_t pieces = config.sequencePieces;
  if (pieces > 0 && (pieces != cpRanks || T % (2 * pieces) != 0))
    fail("the program holds sequences in the balanced order of " +
         std::to_string(pieces) + " pieces, but it runs with cp = " +
         std::to_string(cpRanks) + " over sequences of " + std::to_string(T));
  std::vector<int32_t> piece(static_cast<size_t>(Tc));
  auto keepSequencePiece = [&](int32_t *tokens, int32_t *targets) {
    if (Tc == T)
      return;
    for (int32_t *rows : {tokens, targets})
      for (int64_t r = 0; r < B; r++) {
        const int32_t *row = rows + r * T;
        for (int64_t t = 0; t < Tc; t++)
          piece[size_t(t)] = row[zigzagPosition(firstSequenceRow + t, T, pieces)];
        std::memcpy(rows + r * Tc, piece.data(), size_t(Tc) * sizeof(int32_t));
      }
  };
  const bool leader = commRank() == 0;
  const bool multiRank = commWorldSize() > 1;

  // Check every output before spending time on training. None may be one
  // of the run's inputs: the metrics file is truncated as the run starts,
  // and a saved file replaces what was there.
  {
    auto sameFile = [](const std::string &a, const std::string &b) {
      struct stat sa, sb;
      return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 &&
             sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
    };
    std::vector<std::pair<std::string, std::string>> inputs;
    for (auto [path, flag] : {std::pair{opts.data, "--data"},
                              std::pair{opts.validData, "--valid-data"}})
      if (!path.empty())
        for (const char *suffix : {"", ".bin", ".idx"})
          inputs.push_back({path + suffix, flag});
    std::vector<std::pair<std::string, std::string>> weights = inputs;
    if (!opts.initFrom.empty())
      weights.push_back({opts.initFrom, "--init-from"});
    if (!opts.resume.empty())
      weights.push_back({opts.resume, "--resume"});
    auto refuse =
        [&](const std::string &out, const char *flag,
            const std::vector<std::pair<std::string, std::string>> &ins) {
          if (out.empty())
            return;
          for (const auto &[in, inFlag] : ins)
            if (sameFile(out, in))
              throw UsageError(std::string(flag) + " " + inQuotes(out) +
                               " is the file of " + inFlag + " " +
                               inQuotes(in) +
                               ", which writing it would destroy; give another "
                               "file");
        };
    refuse(opts.metrics, "--metrics", weights);
    refuse(opts.saveFinal, "--save-final", inputs);
    refuse(opts.saveState, "--save-state", inputs);
  }
  if (leader && !opts.metrics.empty())
    checkWritable(opts.metrics, "metrics file");
  if (leader && !opts.saveFinal.empty())
    checkWritable(opts.saveFinal, "final weights", /*whole=*/true);
  if (leader && !opts.saveState.empty())
    checkWritable(opts.saveState, "training state", /*whole=*/true);
  if (opts.checkpointEvery > 0 && opts.saveState.empty())
    throw UsageError("--checkpoint-every needs --save-state FILE (where the "
                     "state goes)");
  if (opts.ckptDir.empty() && (opts.ckptEvery > 0 || opts.ckptKeep.keepLast))
    throw UsageError(std::string(opts.ckptEvery > 0 ? "--ckpt-every"
                                                    : "--ckpt-keep") +
                     " needs --ckpt-dir DIR (where the checkpoints go)");
  std::unique_ptr<CheckpointWriter> checkpoints;
  if (!opts.ckptDir.empty()) {
    if (leader) {
      std::error_code ec;
      std::filesystem::create_directories(opts.ckptDir, ec);
      if (ec || !isDirectory(opts.ckptDir) ||
          ::access(opts.ckptDir.c_str(), W_OK) != 0)
        fail("cannot write checkpoints to " + inQuotes(opts.ckptDir) +
             (ec ? ": " + ec.message() : std::string(": not a writable directory")));
    }
    checkpoints = std::make_unique<CheckpointWriter>(opts.ckptDir, opts.ckptKeep);
  }
  std::string commReport;
  if (!opts.commReport.empty()) {
    commReport = rankFileName(opts.commReport, commRank());
    checkWritable(commReport, "communication report", /*whole=*/true);
  }
  // --record-samples: the samples each rank reads, step by step.
  std::unique_ptr<FILE, int (*)(FILE *)> sampleLog(nullptr, &std::fclose);
  if (!opts.recordSamples.empty()) {
    std::string path = rankFileName(opts.recordSamples, commRank());
    checkWritable(path, "sample record");
    sampleLog.reset(std::fopen(path.c_str(), "w"));
    if (!sampleLog)
      fail("cannot write the sample record " + inQuotes(path) + ": " +
           std::strerror(errno));
  }
  std::string trace;
  if (!opts.trace.empty()) {
    trace = rankFileName(opts.trace, commRank());
    checkWritable(trace, "trace", /*whole=*/true);
    // A common instant for `tessel trace merge` to align the ranks' clocks
    // by: leaving a barrier (the second of two, which all enter together).
    {
      UncountedCollectives notTraffic;
      float zero = 0;
      for (int k = 0; k < 2; k++)
        allReduceSum(&zero, 1, AxisSet::all().bits());
    }
    traceSetSync(traceNowMicros());
    traceEnable(true);
  }

  // A run shorter than its warmup never reaches the peak learning rate.
  if (leader && opts.steps > 0 && opts.steps < config.warmupSteps)
    std::fprintf(stderr,
                 "warning: --steps %" PRId64 " is shorter than the %" PRId64
                 " warmup steps (train.lr_schedule.warmup_steps): the "
                 "learning rate never reaches train.optimizer.lr\n",
                 opts.steps, config.warmupSteps);

  std::unique_ptr<TokenData> data;
  auto shuffled = [&]() {
    if (config.dataShuffle)
      data->shuffle(config.dataSeed);
  };
  if (!opts.data.empty()) {
    data = std::make_unique<TokenData>(
        TokenData::fromFile(opts.data, config.vocab));
  } else {
    if (leader)
      std::printf("no --data given: training on 1048576 synthetic tokens "
                  "(seed 1234)\n");
    data = std::make_unique<TokenData>(
        TokenData::fromTokens(syntheticTokens(config.vocab, 1 << 20, 1234),
                              config.vocab, "synthetic data"));
  }
  shuffled();
  if (data->numSamples(T) == 0)
    fail(inQuotes(data->name()) + " has " + std::to_string(data->size()) +
         " tokens, fewer than the " + std::to_string(T + 1) +
         " needed for one sequence of length " + std::to_string(T));

  // Validation data: --valid-data (the spec's data.valid); with synthetic
  // training data, the synthetic tokens that follow the training ones.
  std::unique_ptr<TokenData> valid;
  if (opts.evalEvery > 0) {
    if (!program.evalStep)
      fail("--eval-every: this program has no forward-only step (it was "
           "compiled for a gradient check, or by an older tessel); compile "
           "it again");
    if (!opts.validData.empty()) {
      valid = std::make_unique<TokenData>(
          TokenData::fromFile(opts.validData, config.vocab));
    } else if (opts.data.empty()) {
      const int64_t trainTokens = 1 << 20, heldOut = 1 << 17;
      std::vector<int32_t> tokens =
          syntheticTokens(config.vocab, trainTokens + heldOut, 1234);
      tokens.erase(tokens.begin(), tokens.begin() + trainTokens);
      valid = std::make_unique<TokenData>(TokenData::fromTokens(
          std::move(tokens), config.vocab, "synthetic validation data"));
    } else {
      fail("--eval-every " + std::to_string(opts.evalEvery) +
           " needs validation data: data.valid in the spec, or --valid-data "
           "PATH");
    }
    if (valid->numSamples(T) == 0)
      fail("validation data " + inQuotes(valid->name()) + " has " +
           std::to_string(valid->size()) + " tokens, fewer than the " +
           std::to_string(T + 1) + " needed for one sequence of length " +
           std::to_string(T));
    if (leader && !opts.quiet &&
        valid->numSamples(T) < opts.evalBatches * globalB)
      std::printf("note: the validation data holds %" PRId64
                  " sequences; each evaluation reads %" PRId64
                  " (--eval-batches %" PRId64 " x %" PRId64
                  "), so some are read more than once\n",
                  valid->numSamples(T), opts.evalBatches * globalB,
                  opts.evalBatches, globalB);
  }

  const DeviceHooks *device = program.device;
  // What the process holds before the plan's stores: the program, MPI, the
  // data. The report compares the growth from here with the plan.
  int64_t rssBefore = statusBytes("VmRSS");
  size_t floatBytes = (size_t)program.paramElems * sizeof(float);
  // A device program keeps only the parameters on the host (to initialise,
  // load and save them); the step's buffers live on the device.
  size_t hostBytes = device ? 0 : floatBytes;
  // With the parameters sharded over dp (parallel.zero 3) the step's store
  // holds this rank's pieces; whole parameters are laid out by `offset`
  // only while they are initialised, loaded or saved.
  bool shardedParams = program.paramStoreElems > 0;
  AlignedBuffer params = allocateZeroed(
      shardedParams ? (size_t)program.paramStoreElems * sizeof(float)
                    : floatBytes,
      "parameters");
  AlignedBuffer grads = allocateZeroed(
      device                       ? 0
      : program.gradElems > 0 ? (size_t)program.gradElems * sizeof(float)
                                   : hostBytes,
      "gradients");
  // With the optimizer sharded over dp, the moments of this rank's pieces.
  bool shardedMoments = program.optimizerElems > 0;
  // Saved and resumed states go through host copies of the moments; a
  // device program keeps them on the host only then.
  bool stateFiles = !opts.saveState.empty() || !opts.resume.empty() ||
                    checkpoints;
  size_t momentBytes =
      device && !stateFiles ? 0
      : shardedMoments      ? (size_t)program.optimizerElems * sizeof(float)
                            : floatBytes;
  AlignedBuffer adamM = allocateZeroed(momentBytes, "AdamW first moments");
  AlignedBuffer adamV = allocateZeroed(momentBytes, "AdamW second moments");
  AlignedBuffer activations =
      allocateZeroed(device ? 0 : program.activationBytes, "activations");
  AlignedBuffer accumulators = allocateZeroed(
      device ? 0 : (size_t)program.accumulatorElems * sizeof(float),
      "accumulators");
  AlignedBuffer normSums = allocateZeroed(
      device ? 0 : (size_t)program.normSums * sizeof(double),
      "gradient norm partial sums");
  // The pipeline sends' copies (a device's are its own).
  if (!device)
    commReserveSends(program.sendBytes, program.sendRingSlots,
                     program.sendSlotBytes);
  // With the stores allocated (and zeroed, so resident).
  int64_t rssAllocated = statusBytes("VmRSS");
  std::vector<int32_t> tokens(B * T), targets(B * T);

  // With the parameters sharded (ZeRO-3) no whole copy exists: initialising,
  // loading, checkpoints and single-file saves read and write the pieces.
  float *paramData = shardedParams ? nullptr : (float *)params.get();
  // The state as the step holds it: ZeRO's pieces are initialised, read
  // (--init-from, --resume) and checkpointed as they are, never gathered;
  // a single file (--save-state, --save-final) gets each tensor put
  // together from them in turn.
  Layout momentLayout =
      shardedMoments ? Layout::MomentPieces : Layout::ByOffset;
  std::vector<StateStore> pieceState = {
      {(float *)params.get(), "",
       shardedParams ? Layout::ValuePieces : Layout::ByOffset},
      {(float *)adamM.get(), kMomentSuffixes[0], momentLayout},
      {(float *)adamV.get(), kMomentSuffixes[1], momentLayout}};
  // Under ZeRO 1 and 2 a step gathers the last update's pieces at its start
  // (tessel-defer-param-gathers): before the parameters are read between
  // steps they are made whole (set once the step's context exists).
  std::function<void()> syncParams = [] {};
  // A device program's state, copied to the host to be saved (the store:
  // the pieces with the parameters sharded).
  auto fromDevice = [&]() {
    syncParams();
    if (!device)
      return;
    device->download(program, shardedParams ? (float *)params.get()
                                            : paramData);
    device->copyMoments(program, (float *)adamM.get(), (float *)adamV.get(),
                        /*toDevice=*/false);
  };
  // The updates applied so far: the steps trained less those skipped
  // (--skip-nonfinite); set from a resumed state below.
  int64_t updates = 0;
  auto writeState = [&](int64_t step) {
    fromDevice();
    saveParams(program, opts.saveState, pieceState, step, updates);
  };
  nlohmann::json plan = checkpoints || !opts.resume.empty()
                            ? ownPlan()
                            : nlohmann::json(nullptr);
  auto planSection = [&](const char *name) {
    return plan.is_object() && plan.contains(name) ? plan[name].dump()
                                                   : std::string();
  };
  // A checkpoint of this rank's shards, written in the background.
  auto writeCheckpoint = [&](int64_t step, float loss) {
    UncountedCollectives notTraffic;
    fromDevice();
    CheckpointInfo info;
    info.step = step;
    info.updates = updates;
    info.consumedSamples = step * globalB;
    info.loss = loss;
    info.program = program.name ? program.name : "";
    info.layout = describeMesh();
    info.worldSize = commWorldSize();
    const TrainConfig &c = program.config;
    info.config = {{"global_batch", std::to_string(globalB)},
                   {"seq_len", std::to_string(T)},
                   {"vocab", std::to_string(c.vocab)},
                   {"steps", std::to_string(opts.steps)},
                   {"seed", std::to_string(opts.seed)},
                   {"data", opts.data.empty() ? "synthetic" : opts.data}};
    info.model = planSection("model");
    info.train = planSection("train");
    info.data = planSection("data");
    std::vector<CheckpointPiece> pieces =
        checkpointPieces(program, pieceState, checkpoints->recycle());
    checkpoints->begin(info, std::move(pieces));
  };
  int64_t firstStep = 0;
  if (!opts.resume.empty() && isDirectory(opts.resume)) {
    auto loadStart = std::chrono::steady_clock::now();
    CheckpointManifest m = chooseCheckpoint(program, opts.resume, pieceState);
    // Another model is refused by its settings first (the tensors would
    // differ too); other training settings are allowed, and named.
    if (!m.model.empty() && !planSection("model").empty()) {
      std::vector<std::string> model = fieldDifferences(
          "model.", nlohmann::json::parse(m.model), plan["model"]);
      if (!model.empty()) {
        std::string list;
        for (const std::string &d : model)
          list += "\n  " + d;
        fail("the checkpoint " + inQuotes(m.dir) +
             " is of another model than this program's:" + list);
      }
    }
    if (!m.train.empty() && !planSection("train").empty() && leader)
      for (const std::string &d : fieldDifferences(
               "train.", nlohmann::json::parse(m.train), plan["train"]))
        std::fprintf(stderr, "warning: resuming with another setting: %s\n",
                     d.c_str());
    loadCheckpoint(program, m, pieceState);
    double loadSeconds = std::chrono::duration<double>(
                             std::chrono::steady_clock::now() - loadStart)
                             .count();
    if (m.consumedSamples != m.step * globalB)
      fail("the checkpoint " + inQuotes(m.dir) + " read " +
           std::to_string(m.consumedSamples) + " sequences in " +
           std::to_string(m.step) + " steps, but this run's global batch is " +
           std::to_string(globalB) +
           ": its batches would not continue the saved run's");
    firstStep = m.step;
    updates = m.updates;
    if (firstStep >= opts.steps)
      fail(inQuotes(m.dir) + " is at step " + std::to_string(firstStep) +
           ", and --steps is " + std::to_string(opts.steps) +
           ": nothing is left to train");
    if (leader && !opts.quiet)
      std::printf("resuming from %s (step %" PRId64 ", saved at %s; "
                  "checked and read in %.2f s)\n",
                  m.dir.c_str(), firstStep, m.layout.c_str(), loadSeconds);
  } else if (!opts.resume.empty()) {
    // Into the stores as the step holds them: ZeRO's pieces are cut from
    // each tensor as it is read.
    std::map<std::string, std::string> metadata =
        loadParams(program, opts.resume, pieceState, /*strict=*/true);
    auto step = metadata.find("steps");
    if (step == metadata.end())
      fail(inQuotes(opts.resume) + " is not a --save-state file (its "
           "metadata has no step)");
    firstStep = parseInteger("the step of " + inQuotes(opts.resume),
                             step->second, 0);
    auto applied = metadata.find("updates");
    updates = applied == metadata.end()
                  ? firstStep
                  : parseInteger("the updates of " + inQuotes(opts.resume),
                                 applied->second, 0);
    if (updates > firstStep)
      fail(inQuotes(opts.resume) + " records " + std::to_string(updates) +
           " updates in " + std::to_string(firstStep) + " steps");
    if (firstStep >= opts.steps)
      fail(inQuotes(opts.resume) + " is at step " +
           std::to_string(firstStep) + ", and --steps is " +
           std::to_string(opts.steps) + ": nothing is left to train");
  } else if (!opts.initFrom.empty()) {
    loadParams(program, opts.initFrom, {pieceState[0]}, opts.strict);
  } else {
    // Counter-based: each rank generates the elements it holds, pieces
    // included, and nothing else.
    initParams(program, opts.seed, pieceState[0]);
  }
  // The peak so far: the stores and what initialising or loading needed.
  int64_t peakStarted = statusBytes("VmHWM");

  if (leader && !opts.quiet) {
    const char *name = program.name ? program.name : "program";
    if (!multiRank)
      std::printf("%s: %d parameters (%" PRId64 " elements), batch %" PRId64
                  " x %" PRId64 ", %" PRId64 " steps, %d threads\n",
                  name, program.numParams, program.paramElems, B, T, opts.steps,
                  omp_get_max_threads());
    else
      // With pipeline stages each program holds its stage's parameters
      // only, so the count is stage 0's.
      std::printf(
          "%s: %d ranks (%s), %d parameters%s (%" PRId64
          " elements on rank 0), batch %" PRId64 " x %" PRId64 " (%" PRId64
          " per data-parallel rank), %" PRId64 " steps, %d threads per rank\n",
          name, commWorldSize(), describeMesh().c_str(), program.numParams,
          meshSize(MeshAxis::PP) > 1 ? " in pipeline stage 0" : "",
          program.paramElems, globalB, T, B, opts.steps, omp_get_max_threads());
  }
  std::fflush(stdout);

  StepContext ctx = {};
  // With the parameters sharded the store begins with this rank's pieces,
  // which the step reads apart from the rest.
  ctx.paramPieces = (float *)params.get();
  ctx.params = (float *)params.get() +
               (shardedParams ? program.paramPieceElems : 0);
  ctx.grads = (float *)grads.get();
  ctx.adamM = (float *)adamM.get();
  ctx.adamV = (float *)adamV.get();
  ctx.tokens = tokens.data();
  ctx.targets = targets.data();
  ctx.activations = activations.get();
  ctx.accumulators = (float *)accumulators.get();
  ctx.normSums = (double *)normSums.get();
  ctx.variant = variant;
  if (device) {
    device->start(program,
                  shardedParams ? (const float *)params.get() : paramData, ctx);
    // A resumed state's moments (its parameters went in with start).
    if (firstStep > 0)
      device->copyMoments(program, (float *)adamM.get(), (float *)adamV.get(),
                          /*toDevice=*/true);
    if (leader && !opts.quiet)
      std::printf("device: %s\n", device->describe());
  }
  // Whole until a step has run since the last sync (a checkpoint and the
  // final save after the last step gather once).
  bool paramsWhole = true;
  if (program.syncParams)
    syncParams = [&] {
      if (paramsWhole)
        return;
      UncountedCollectives notTraffic;
      program.syncParams(ctx);
      paramsWhole = true;
    };

  std::unique_ptr<FILE, int (*)(FILE *)> metrics(nullptr, &std::fclose);
  if (leader && !opts.metrics.empty()) {
    // A resumed run continues the metrics of the run it resumes: the lines
    // of the steps before the resumed one are kept, later ones (trained
    // after the checkpoint by a run that then died) are dropped. Only a
    // regular file is read back: a pipe or a terminal (--metrics
    // /dev/stdout) has passed its lines on, and reading it would wait on
    // this run's own output.
    std::string kept;
    struct stat metricsStat;
    if (firstStep > 0 && ::stat(opts.metrics.c_str(), &metricsStat) == 0 &&
        S_ISREG(metricsStat.st_mode))
      if (FILE *old = std::fopen(opts.metrics.c_str(), "r")) {
        char line[4096];
        long long step;
        while (std::fgets(line, sizeof(line), old))
          if (std::sscanf(line, "{\"step\": %lld", &step) == 1 &&
              step < firstStep && std::strchr(line, '\n'))
            kept += line;
        std::fclose(old);
      }
    metrics.reset(std::fopen(opts.metrics.c_str(), "w"));
    if (metrics && !kept.empty() &&
        std::fputs(kept.c_str(), metrics.get()) < 0)
      fail("cannot write the metrics file " + inQuotes(opts.metrics) + ": " +
           std::strerror(errno));
    if (!metrics)
      fail("cannot open the metrics file " + inQuotes(opts.metrics) + ": " +
           std::strerror(errno));
  }

  std::unique_ptr<TensorBoardWriter> board;
  if (leader && !opts.tensorboard.empty())
    board = std::make_unique<TensorBoardWriter>(opts.tensorboard);

  int width = std::max<int>(4, (int)std::to_string(opts.steps).size());
  // A progress bar rewrites one line on a terminal; plain lines otherwise.
  // Under mpirun the output may look like a terminal when it is not, so
  // auto means lines there (tessel run says which it is).
  bool bar = opts.progress == "bar" ||
             (opts.progress == "auto" && isatty(STDOUT_FILENO) &&
              !std::getenv("OMPI_COMM_WORLD_SIZE") && !std::getenv("PMIX_RANK"));
  bool barOpen = false; // the bar's line is not yet ended
  auto endBar = [&]() {
    if (barOpen) {
      std::printf("\n");
      barOpen = false;
    }
  };
  auto runStart = std::chrono::steady_clock::now();
  float lastLoss = 0.0f, lowestLoss = INFINITY;
  // Steps skipped for a gradient that was not finite: in a row, in all.
  int64_t skippedInRow = 0, skippedSteps = 0;
  int64_t lowestStep = -1;
  // The steps this run trains: from a resumed state's, to --stop-after.
  int64_t lastStep =
      opts.stopAfter > 0 ? std::min(opts.steps, opts.stopAfter) : opts.steps;
  if (firstStep >= lastStep && opts.steps > 0)
    fail("--stop-after " + std::to_string(opts.stopAfter) +
         " is not after the resumed step " + std::to_string(firstStep));
  // This rank's rows of each step's batch, read ahead on a background
  // thread (--prefetch batches at most).
  BatchPrefetcher batches(*data, globalB, firstRow, B, T, firstStep, lastStep,
                          opts.prefetch, opts.dataDelayMs,
                          program.microbatches);
  // The validation loss: the forward-only step on this rank's rows of the
  // first --eval-batches global batches of the validation data, averaged.
  // Its messages are not the training step's traffic.
  std::vector<int32_t> validTokens, validTargets;
  float lastValLoss = NAN, bestValLoss = NAN;
  int64_t bestValStep = 0; // the steps trained before the best evaluation
  auto evaluateBatches = [&]() {
    UncountedCollectives notTraffic;
    TraceSpan span("eval");
    validTokens.resize(B * T);
    validTargets.resize(B * T);
    StepContext saved = ctx;
    double sum = 0;
    ctx.evaluating = true;
    setRunningStep(ctx.step, /*evaluating=*/true); // no dropout
    for (int64_t k = 0; k < opts.evalBatches; k++) {
      valid->microbatchRowsForStep(k, globalB, firstRow, B,
                                   program.microbatches, T,
                                   validTokens.data(), validTargets.data());
      keepSequencePiece(validTokens.data(), validTargets.data());
      if (device) {
        device->loadBatch(ctx, validTokens.data(), validTargets.data(), B * Tc);
      } else {
        ctx.tokens = validTokens.data();
        ctx.targets = validTargets.data();
      }
      ctx.loss = NAN;
      program.evalStep(ctx);
      sum += ctx.loss;
    }
    ctx = saved;
    return (float)(sum / (double)opts.evalBatches);
  };
  // An evaluation of the parameters after `trained` steps: timed, checked,
  // the best kept, its log line printed; returns its milliseconds.
  auto evaluate = [&](int64_t trained) {
    auto begin = std::chrono::steady_clock::now();
    lastValLoss = evaluateBatches();
    double ms = std::chrono::duration<double, std::milli>(
                    std::chrono::steady_clock::now() - begin)
                    .count();
    if (!std::isfinite(lastValLoss))
      fail("validation loss is " +
           std::string(std::isnan(lastValLoss) ? "nan" : "inf") +
           " after step " + std::to_string(trained));
    if (!(lastValLoss >= bestValLoss)) {
      bestValLoss = lastValLoss;
      bestValStep = trained;
    }
    return ms;
  };
  auto printEval = [&](int64_t trained, double ms) {
    if (!leader || opts.quiet)
      return;
    endBar();
    std::printf("eval %*" PRId64 "/%" PRId64 " | val_loss %.4f | %" PRId64
                " batch%s | %.0f ms\n",
                width, trained, opts.steps, lastValLoss, opts.evalBatches,
                opts.evalBatches == 1 ? "" : "es", ms);
    std::fflush(stdout);
  };
  auto evalJson = [&](double ms) {
    return ", \"val_loss\": " + jsonNumber(lastValLoss, "%.9g") +
           ", \"eval_ms\": " + jsonNumber(ms, "%.3f");
  };
  auto writeMetricsLine = [&](const std::string &line) {
    if (std::fputs(line.c_str(), metrics.get()) < 0 ||
        std::fflush(metrics.get()) != 0)
      fail("cannot write the metrics file " + inQuotes(opts.metrics) + ": " +
           std::strerror(errno));
  };
  for (int64_t step = firstStep; step < lastStep; step++) {
    double dataWaitMs = batches.get(step, tokens.data(), targets.data());
    if (sampleLog) {
      std::string line = "{\"step\": " + std::to_string(step) +
                         ", \"first_row\": " + std::to_string(firstRow) +
                         ", \"samples\": [";
      for (int64_t i = 0; i < B; i++)
        line += (i ? ", " : "") +
                data->describeSample(
                    step * globalB + TokenData::microbatchRow(
                                         i, globalB, firstRow, B,
                                         program.microbatches),
                    T);
      line += "]}\n";
      if (std::fputs(line.c_str(), sampleLog.get()) < 0)
        fail("cannot write the sample record: " +
             std::string(std::strerror(errno)));
    }
    keepSequencePiece(tokens.data(), targets.data());
    if (device)
      device->loadBatch(ctx, tokens.data(), targets.data(), B * Tc);
    ctx.step = step;
    ctx.updates = updates;
    commSetStep(step);
    // The schedule counts updates: a skipped step does not advance it (as
    // Megatron-LM's scheduler does not step on a skipped iteration).
    ctx.lr = learningRate(config, updates, opts.steps);
    ctx.loss = NAN;
    ctx.gradNorm = NAN;
    ctx.metrics.clear();

    setRunningStep(step, /*evaluating=*/false);
    auto start = std::chrono::steady_clock::now();
    if (device && device->runStep)
      device->runStep(program, ctx);
    else
      program.step(ctx);
    auto stop = std::chrono::steady_clock::now();
    paramsWhole = false;

    double ms = std::chrono::duration<double, std::milli>(stop - start).count();
    double tokensPerSecond =
        ms > 0 ? (double)(globalB * T) / (ms / 1000.0) : 0.0;
    // The global norm is every rank's, so every rank skips (or stops at)
    // the same step; AdamW applied nothing (adamwStep).
    bool skipped = !std::isfinite(ctx.gradNorm);
    if (skipped) {
      ++skippedInRow;
      ++skippedSteps;
      std::string what = "the gradient norm is " +
                         std::string(std::isnan(ctx.gradNorm) ? "nan" : "inf") +
                         " at step " + std::to_string(step + 1) + " of " +
                         std::to_string(opts.steps) + " (loss " +
                         (std::isfinite(ctx.loss) ? jsonNumber(ctx.loss, "%.4f")
                          : std::isnan(ctx.loss)  ? "nan"
                                                  : "inf") +
                         ")";
      if (skippedInRow > opts.skipNonfinite) {
        // Every rank stops here (the norm is global): a checkpoint being
        // written, of a step before, is committed first, so that the run
        // resumes from the last good step.
        if (checkpoints)
          checkpoints->poll(/*wait=*/true);
        throw AgreedError(
            what +
            ": the update was not applied, so the parameters and "
            "AdamW's state are those of the last update (after step " +
            std::to_string(step + 1 - skippedInRow) + ")" +
            (opts.skipNonfinite > 0
                 ? "; " + std::to_string(skippedInRow) +
                       " such steps in a row, and --skip-nonfinite is " +
                       std::to_string(opts.skipNonfinite)
                 : "; --skip-nonfinite N skips such steps") +
            (checkpoints ? "; the last checkpoint: " +
                               (checkpoints->lastCommitted().empty()
                                    ? std::string("none")
                                    : checkpoints->lastCommitted())
                         : std::string()));
      }
      if (leader)
        std::fprintf(stderr,
                     "warning: %s: step skipped (%" PRId64 " skipped in all)\n",
                     what.c_str(), skippedSteps);
    } else {
      skippedInRow = 0;
      ++updates;
    }
    // The step all-reduces the loss, so every rank stops at the same step.
    if (!skipped && !std::isfinite(ctx.loss))
      fail("loss is " + std::string(std::isnan(ctx.loss) ? "nan" : "inf") +
           " at step " + std::to_string(step + 1) + " of " +
           std::to_string(opts.steps));
    if (!skipped)
      lastLoss = ctx.loss;
    StepMetricsView stepMetrics = viewMetrics(ctx.metrics);
    // The validation loss, every --eval-every steps and after the last.
    std::string evalFields;
    double evalMs = 0;
    if (valid && ((step + 1) % opts.evalEvery == 0 || step + 1 == lastStep)) {
      evalMs = evaluate(step + 1);
      evalFields = evalJson(evalMs);
    }
    // A state to resume from if the run dies; written to a temporary name
    // and renamed, so the previous one stays whole until it is replaced.
    // Its gathers are not the step's traffic.
    if (opts.checkpointEvery > 0 && (step + 1) % opts.checkpointEvery == 0 &&
        step + 1 < lastStep) {
      UncountedCollectives notTraffic;
      writeState(step + 1);
    }
    // Sharded checkpoints: commit one whose writes have finished, start the
    // next at its step. What the training thread spends on them (the
    // snapshot, a commit) goes into the metrics.
    std::string checkpointFields;
    if (checkpoints) {
      auto since = [](std::chrono::steady_clock::time_point t) {
        return jsonNumber(std::chrono::duration<double, std::milli>(
                              std::chrono::steady_clock::now() - t)
                              .count(),
                          "%.3f");
      };
      auto begin = std::chrono::steady_clock::now();
      if (checkpoints->poll(/*wait=*/false) >= 0)
        checkpointFields +=
            ", \"ckpt_write_ms\": " +
            jsonNumber(checkpoints->lastWriteSeconds() * 1000, "%.3f") +
            ", \"ckpt_bytes\": " + std::to_string(checkpoints->lastBytes()) +
            ", \"ckpt_commit_ms\": " + since(begin);
      if (opts.ckptEvery > 0 && (step + 1) % opts.ckptEvery == 0 &&
          step + 1 < lastStep) {
        // At most one write in flight: a slower write than the interval
        // makes the next checkpoint wait for it.
        if (checkpoints->pending()) {
          auto wait = std::chrono::steady_clock::now();
          checkpoints->poll(/*wait=*/true);
          checkpointFields += ", \"ckpt_wait_ms\": " + since(wait);
        }
        auto snapshot = std::chrono::steady_clock::now();
        writeCheckpoint(step + 1, lastLoss);
        checkpointFields += ", \"ckpt_snapshot_ms\": " + since(snapshot);
      }
      checkpointFields += ", \"ckpt_stall_ms\": " + since(begin);
    }

    if (!skipped && ctx.loss < lowestLoss) {
      lowestLoss = ctx.loss;
      lowestStep = step;
    }
    // Time so far and, at this run's mean step time, the time left.
    double elapsed = std::chrono::duration<double>(
                         std::chrono::steady_clock::now() - runStart)
                         .count();
    double eta = elapsed / (double)(step + 1 - firstStep) *
                 (double)(lastStep - step - 1);
    // The model FLOP/s each rank reached (docs/metrics.md).
    double modelTflops = tokensPerSecond * config.flopsPerToken /
                         (double)commWorldSize() / 1e12;
    if (leader && !opts.quiet &&
        ((step + 1) % opts.logEvery == 0 || step + 1 == lastStep)) {
      std::string memory;
      if (!device)
        memory = " | " + megabytes(statusBytes("VmHWM")) + " peak";
      if (opts.peakTflops > 0 && config.flopsPerToken > 0) {
        char text[32];
        std::snprintf(text, sizeof(text), " | MFU %.1f%%",
                      100 * modelTflops / opts.peakTflops);
        memory = text + memory;
      }
      std::string prefix;
      if (bar) {
        const int cells = 20;
        int filled = opts.steps > 0 ? (int)((step + 1) * cells / opts.steps)
                                    : cells;
        prefix = "\r\033[K[" + std::string(filled, '#') +
                 std::string(cells - filled, '.') + "] ";
      }
      std::printf("%sstep %*" PRId64 "/%" PRId64
                  " | loss %.4f | lr %.4e | norm %.4f | %.0f tok/s | %.0f ms"
                  " | %s elapsed, %s left%s%s",
                  prefix.c_str(), width, step + 1, opts.steps, ctx.loss,
                  ctx.lr, ctx.gradNorm, tokensPerSecond, ms,
                  clockTime(elapsed).c_str(), clockTime(eta).c_str(),
                  memory.c_str(), bar ? "" : "\n");
      barOpen = bar;
      if (step + 1 == lastStep)
        endBar();
      std::fflush(stdout);
    }
    if (!evalFields.empty())
      printEval(step + 1, evalMs);
    if (metrics) {
      std::string line =
          "{\"step\": " + std::to_string(step) +
          ", \"loss\": " + jsonNumber(ctx.loss, "%.9g") +
          ", \"lr\": " + jsonNumber(ctx.lr, "%.9g") +
          ", \"grad_norm\": " + jsonNumber(ctx.gradNorm, "%.9g") +
          (skipped ? ", \"skipped\": true" : std::string()) +
          ", \"tokens_per_s\": " + jsonNumber(tokensPerSecond, "%.1f") +
          ", \"step_ms\": " + jsonNumber(ms, "%.3f") +
          ", \"data_wait_ms\": " + jsonNumber(dataWaitMs, "%.3f") +
          ", \"elapsed_s\": " + jsonNumber(elapsed, "%.3f") +
          (config.flopsPerToken > 0 ? ", \"model_tflops_per_rank\": " +
                                          jsonNumber(modelTflops, "%.6g")
                                    : std::string()) +
          (opts.peakTflops > 0 && config.flopsPerToken > 0
               ? ", \"mfu\": " +
                     jsonNumber(modelTflops / opts.peakTflops, "%.6g")
               : std::string()) +
          ", \"eta_s\": " + jsonNumber(eta, "%.3f") +
          // CPU: what rank 0 has held at most since before the plan's
          // stores (its resident high-water mark), to set beside plan.json.
          (device ? std::string()
                  : ", \"mem_peak_bytes\": " +
                        std::to_string(statusBytes("VmHWM") - rssBefore)) +
          stepMetrics.json + evalFields + checkpointFields + "}\n";
      writeMetricsLine(line);
    }
    if (board) {
      std::vector<std::pair<std::string, double>> scalars = {
          {"loss", ctx.loss},
          {"lr", ctx.lr},
          {"grad_norm", ctx.gradNorm},
          {"tokens_per_s", tokensPerSecond},
          {"step_ms", ms},
          {"data_wait_ms", dataWaitMs}};
      if (opts.peakTflops > 0 && config.flopsPerToken > 0)
        scalars.push_back({"mfu", modelTflops / opts.peakTflops});
      if (!evalFields.empty())
        scalars.push_back({"val_loss", lastValLoss});
      scalars.insert(scalars.end(), stepMetrics.scalars.begin(),
                     stepMetrics.scalars.end());
      board->scalars(step, scalars);
    }
  }
  // A run of no steps with --eval-every evaluates the parameters it starts
  // from (loaded by --init-from or --resume, or initialised): one eval line
  // and one metrics record at step firstStep - 1, the step after which
  // these parameters are.
  if (valid && firstStep == lastStep) {
    double evalMs = evaluate(firstStep);
    printEval(firstStep, evalMs);
    if (board)
      board->scalars(firstStep - 1, {{"val_loss", lastValLoss}});
    if (metrics)
      writeMetricsLine("{\"step\": " + std::to_string(firstStep - 1) +
                       evalJson(evalMs) + "}\n");
  }
  if (leader && !opts.quiet)
    endBar();
  double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - runStart)
          .count();

  // Counted before saving, whose gathers are not part of training.
  CollectiveCounter counters[kNumCollectiveKinds];
  for (int k = 0; k < kNumCollectiveKinds; k++)
    counters[k] = collectiveCounter((CollectiveKind)k);

  if (metrics) {
    FILE *f = metrics.release();
    if (std::fclose(f) != 0)
      fail("cannot write the metrics file " + inQuotes(opts.metrics) + ": " +
           std::strerror(errno));
  }
  syncParams();
  if (device)
    device->download(program, shardedParams ? (float *)params.get()
                                             : paramData);
  if (!opts.saveFinal.empty()) {
    saveParams(program, opts.saveFinal, {pieceState[0]}, lastStep, -1);
  }
  if (!opts.saveState.empty())
    writeState(lastStep);
  if (checkpoints && lastStep > firstStep) {
    // The last snapshot reuses the memory of the one before, once that is
    // written: one snapshot at a time.
    checkpoints->poll(/*wait=*/true);
    writeCheckpoint(lastStep, lastLoss);
    checkpoints->poll(/*wait=*/true);
    if (leader && !opts.quiet)
      std::printf("checkpoint: %s\n", checkpoints->lastCommitted().c_str());
  }
  if (!commReport.empty())
    writeCommReport(commReport, lastStep - firstStep, counters, rssBefore,
                    rssAllocated, peakStarted);
  if (!trace.empty())
    traceWrite(trace, commRank());
  if (device)
    device->stop();
  if (leader && !opts.quiet) {
    int64_t steps = lastStep - firstStep;
    double tokens = (double)steps * (double)(globalB * T);
    std::string mfu;
    if (opts.peakTflops > 0 && config.flopsPerToken > 0 && seconds > 0) {
      char text[48];
      std::snprintf(text, sizeof(text), ", MFU %.1f%% mean",
                    100 * tokens / seconds * config.flopsPerToken /
                        (double)commWorldSize() / 1e12 / opts.peakTflops);
      mfu = text;
    }
    std::string validation;
    if (std::isfinite(lastValLoss)) {
      char text[96];
      if (std::isfinite(bestValLoss) && bestValLoss < lastValLoss)
        std::snprintf(text, sizeof(text),
                      ", val_loss %.4f (best %.4f after step %" PRId64 ")",
                      lastValLoss, bestValLoss, bestValStep);
      else
        std::snprintf(text, sizeof(text), ", val_loss %.4f", lastValLoss);
      validation = text;
    }
    std::string peak =
        device ? std::string()
               : ", peak memory " + megabytes(statusBytes("VmHWM")) +
                     " (rank 0)";
    if (steps > 0)
      std::printf("done: %" PRId64 " steps in %.2f s (%.0f tokens, %.0f "
                  "tok/s mean%s), final loss %.4f%s, lowest %.4f at step "
                  "%" PRId64 "%s\n",
                  steps, seconds, tokens, seconds > 0 ? tokens / seconds : 0.0,
                  mfu.c_str(), lastLoss, validation.c_str(), lowestLoss,
                  lowestStep + 1, peak.c_str());
    else
      std::printf("done: no steps%s%s\n", validation.c_str(), peak.c_str());
    if (!opts.saveFinal.empty())
      std::printf("saved final weights to %s\n", opts.saveFinal.c_str());
    // The price of every rank for the steps' wall time.
    if (opts.pricePerGpuHour > 0 && steps > 0) {
      double cost = seconds / 3600 * (double)commWorldSize() *
                    opts.pricePerGpuHour;
      std::printf("cost: %.4g for %" PRId64 " ranks x %.3g h at %.4g per "
                  "rank-hour: %.4g per step, %.4g per million tokens\n",
                  cost, (int64_t)commWorldSize(), seconds / 3600,
                  opts.pricePerGpuHour, cost / (double)steps,
                  tokens > 0 ? cost / tokens * 1e6 : 0.0);
    }
  }
  std::fflush(stdout);
  return 0;
}

} // namespace

// Reports a fatal error. On a multi-rank run the message names the rank,
// its host, process id and mesh coordinates (what mpirun's own notice does
// not say right), and every rank is aborted, so that none waits forever in a
// collective.
int reportFatal(const std::string &message, bool agreed) {
  std::fflush(stdout);
  if (commWorldSize() > 1) {
    char host[256] = "unknown host";
    ::gethostname(host, sizeof(host) - 1);
    host[sizeof(host) - 1] = 0;
    std::string coords;
    try {
      for (MeshAxis axis : kMeshAxes)
        if (meshSize(axis) > 1)
          coords += std::string(", ") + meshAxisName(axis) + " " +
                    std::to_string(meshCoord(axis));
    } catch (const std::exception &) {
      // The mesh is not set up yet: the rank and host say enough.
    }
    std::fprintf(stderr, "rank %d: error: %s\n  (on %s, pid %d%s)\n",
                 commRank(), message.c_str(), host, (int)::getpid(),
                 coords.c_str());
    if (agreed) {
      // Every rank is here: end together once all have said it.
      std::fflush(stderr);
      try {
        UncountedCollectives notTraffic;
        float zero = 0;
        allReduceSum(&zero, 1, AxisSet::all().bits());
        commFinalize();
        return 1;
      } catch (const std::exception &) {
        // The ranks cannot meet: end this one alone.
      }
    }
    commAbort(1);
  }
  std::fprintf(stderr, "error: %s\n", message.c_str());
  commFinalize();
  return 1;
}

int runReportingFailures(const std::function<int()> &body) {
  try {
    return body();
  } catch (const std::bad_alloc &) {
    return reportFatal("out of memory");
  } catch (const AgreedError &e) {
    return reportFatal(e.what(), /*agreed=*/true);
  } catch (const std::exception &e) {
    return reportFatal(e.what());
  } catch (...) {
    return reportFatal("unknown exception");
  }
}

void finishStep(StepContext &ctx, const float *loss, const float *norm) {
  ctx.loss = loss[0];
  ctx.lossExact = loss[0];
  ctx.gradNorm = norm ? norm[0] : NAN;
}

void finishStep(StepContext &ctx, const double *loss, const double *norm) {
  ctx.loss = (float)loss[0];
  ctx.lossExact = loss[0];
  ctx.gradNorm = norm ? (float)norm[0] : NAN;
}

void recordMetric(StepContext &ctx, const char *name, const float *values,
                  int64_t n) {
  ctx.metrics.push_back({name, std::vector<double>(values, values + n)});
}

void recordMetric(StepContext &ctx, const char *name, const double *values,
                  int64_t n) {
  ctx.metrics.push_back({name, std::vector<double>(values, values + n)});
}

int runMain(int argc, char **argv, const Program &program) {
  const char *argv0 = argc > 0 && argv[0] ? argv[0] : "program";
  if (program.inference) {
    std::fprintf(stderr, "error: this is an inference program; run it with "
                         "tessel generate\n");
    return 1;
  }
  // The command line is checked before MPI starts, so that --help and usage
  // mistakes need no mpirun; every rank parses the same arguments.
  Options opts;
  try {
    opts = parseArgs(argc, argv, program);
  } catch (const UsageError &e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  if (opts.help) {
    printUsage(stdout, argv0, program);
    return 0;
  }
  return runReportingFailures([&] {
    commInit(&argc, &argv, program.mesh);
    commStartWatchdog(opts.timeout);
    // The CUDA runtime's watchdog of NCCL operations takes the same limit
    // unless given its own.
    std::string seconds = std::to_string(opts.timeout);
    if (program.device)
      ::setenv("TESSEL_NCCL_TIMEOUT", seconds.c_str(), /*overwrite=*/0);
    int code = train(program, opts);
    commFinalize();
    return code;
  });
}

} // namespace tessel::rt
