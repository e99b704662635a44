//===- Commands.h - The subcommands of `tessel` -----------------*- C++ -*-===//
#ifndef TESSEL_TOOLS_TESSEL_COMMANDS_H
#define TESSEL_TOOLS_TESSEL_COMMANDS_H

#include "tessel/Frontend/Spec.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/ADT/STLFunctionalExtras.h"
#include "llvm/Support/Error.h"
#include <functional>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <set>
#include <string>
#include <vector>

namespace tessel {
// The arguments of a subcommand: positionals, flags with a value (`--flag
// V` or `--flag=V`) and switches. parseArguments sorts `args` into `out`
// and returns what is wrong (an unknown flag, a flag without its value), or
// "" when nothing is.
struct Arguments {
  std::vector<std::string> positionals;
  std::map<std::string, std::string> values;
  std::set<std::string> switches;
};
std::string parseArguments(llvm::ArrayRef<std::string> args,
                           llvm::ArrayRef<llvm::StringRef> valueFlags,
                           llvm::ArrayRef<llvm::StringRef> switchFlags,
                           Arguments &out);
// "tessel: error: MESSAGE" on stderr after what stdout has so far; 1.
int fail(const llvm::Twine &message);
std::string inQuotes(const std::string &s);
int runCommand(llvm::ArrayRef<std::string> args);
// The rank programs of a compiled plan, checked: plan.json is read from a
// directory a user may have edited or copied, so nothing in it is trusted
// (types, rank counts, program names that could leave DIR/bin, binaries
// other than those compiled).
struct RankPrograms {
  int64_t world = 0;
  // The binaries in rank order (one, or one per pipeline stage but for
  // stages that share one), with how many consecutive ranks run each.
  std::vector<std::pair<std::string, int64_t>> binaries;
};
llvm::Expected<RankPrograms> checkRankPrograms(llvm::StringRef dir,
                                               const nlohmann::json &plan);
// The command line that starts the ranks of the plan in `dir`, each with
// `rankArgs`: one rank directly, a mesh under mpirun.
llvm::Expected<std::vector<std::string>>
rankCommandLine(llvm::StringRef dir, const RankPrograms &programs,
                llvm::ArrayRef<std::string> rankArgs);
// This process's environment as the ranks get it.
std::vector<std::string> rankEnvironment();
// Runs argv with env, forwarding SIGTERM, SIGINT and SIGHUP to it; its
// exit code (128 + the signal when a signal ended it), or -errno when it
// could not start. With `onOutput`, its stdout is a pipe whose bytes are
// passed to onOutput as they arrive.
int runForwardingSignals(
    const std::vector<std::string> &argv, const std::vector<std::string> &env,
    llvm::function_ref<void(llvm::StringRef)> onOutput = nullptr);
// Why a run ended, from its exit code ("exit code 134 (Aborted)").
std::string describeExit(int rc);
// `tessel generate DIR`: text from an inference plan (Generate.cpp).
int generateCommand(llvm::ArrayRef<std::string> args);
// DIR/plan.json, parsed; an error names DIR when it is not a compiled
// output, or the file when it is not a plan.
llvm::Expected<nlohmann::json> readPlan(llvm::StringRef dir);
// The SHA-256 of a file, in hex (plan.json records each binary's).
llvm::Expected<std::string> fileSha256(llvm::StringRef path);
int inspectCommand(llvm::ArrayRef<std::string> args);
int dataCommand(llvm::ArrayRef<std::string> args);
// `tessel ckpt list|verify|diff|export`: tools over sharded checkpoints
// (Ckpt.cpp).
int ckptCommand(llvm::ArrayRef<std::string> args);
// The parameters of a committed checkpoint (a --ckpt-dir root: its newest;
// or one step directory), without the optimizer's moments, and the model
// fields its manifest records (JSON; empty if none): their names and
// shapes, and `read(k)` puts parameter k together whole from its boxes,
// one at a time, so that an export holds one tensor in memory. Throws
// naming the checkpoint and what is wrong; a damaged file is never read.
struct CheckpointParameters {
  std::string dir, model;
  int64_t step = 0;
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  std::function<std::vector<float>(size_t)> read;
};
CheckpointParameters readCheckpointParameters(const std::string &path);
// `tessel export SOURCE --to hf DIR`: a Hugging Face model directory
// (Export.cpp).
int exportCommand(llvm::ArrayRef<std::string> args);
// The lines after a compile: ranks, binaries, planned memory per rank and,
// for a CPU plan, against this machine's memory.
void summarizePlan(llvm::StringRef dir, bool emitOnly);
// tessel trace merge: the ranks' Chrome traces as one, clocks aligned.
int traceCommand(llvm::ArrayRef<std::string> args);
// What to add to each rank trace's timestamps (tessel run --trace; their
// otherData checked) to put them on one clock: a host's monotonic clock
// when all ran on one host, else the start barrier's exit.
std::vector<double>
traceClockShifts(const std::vector<nlohmann::json> &traces);
// `tessel report DIR`: one HTML page of a run's charts (Report.cpp).
int reportCommand(llvm::ArrayRef<std::string> args);
// `tessel simulate DIR` and `tessel calibrate` (Simulate.cpp).
int simulateCommand(llvm::ArrayRef<std::string> args);
int calibrateCommand(llvm::ArrayRef<std::string> args);

struct CheckOptions {
  std::string input;
  std::vector<std::string> overrides; // applied to both programs
  LayoutOverrides layout;             // the layout checked
  std::optional<int64_t> layers;      // shrink the model (both programs)
  int64_t steps = 20;
  double tolerance = -1;      // < 0: by what the layout computes in (Check.cpp)
  std::string target = "cpu"; // the layout's backend; the reference is cpu
  std::string cudaArch = "sm_90";
  std::optional<bool> fuseKernels; // the layout's (the reference's: none)
};
// Trains the layout and the one-rank program and compares losses and final
// parameters (relative to each tensor's largest magnitude).
int checkCommand(const CheckOptions &options);
} // namespace tessel

#endif
