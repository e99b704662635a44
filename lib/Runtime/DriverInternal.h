//===- DriverInternal.h - What the training and inference drivers share -===//
//
// Internal to lib/Runtime. Driver.cpp (runMain) defines these; Inference.cpp
// (runInferenceMain) uses them too, so that both mains check programs, parse
// numbers, load weights and report failures alike.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_RUNTIME_DRIVERINTERNAL_H
#define TESSEL_RUNTIME_DRIVERINTERNAL_H

#include "tessel/Runtime/Checkpoint.h"
#include "tessel/Runtime/Program.h"

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace tessel::rt {

// A command-line mistake: reported like any error, but with the exit code of
// usage mistakes.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// One command-line argument: "--flag=value" split at the '=' (hasValue), or
// the argument whole as the flag.
struct FlagArgument {
  std::string flag, value;
  bool hasValue = false;
};
FlagArgument splitFlag(const std::string &arg);
// The value of `flag`: the one after '=', else the next argument (argv[++i]).
std::string flagValue(const FlagArgument &a, int argc, char **argv, int &i);


[[noreturn]] void fail(const std::string &message);
std::string inQuotes(const std::string &s);

// Command-line values; each throws UsageError naming `flag` (or `what`).
// An integer >= min.
int64_t parseInteger(const std::string &flag, const std::string &text,
                     int64_t min);
int64_t parsePositive(const std::string &flag, const std::string &text);
uint64_t parseUnsigned(const std::string &flag, const std::string &text);
// A positive finite number; `what` completes "expects a positive ...".
double parsePositiveNumber(const std::string &flag, const std::string &text,
                           const std::string &what);
// A positive number of seconds (at most a week).
double parseSeconds(const std::string &what, const std::string &text);

// Checks what the generated code promises, so that a bad program fails with
// a message instead of writing out of bounds.
void validateProgram(const Program &program);

struct FreeDeleter {
  void operator()(void *p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<char, FreeDeleter>;
// A zeroed, 64-byte aligned buffer of at least `bytes` bytes.
AlignedBuffer allocateZeroed(int64_t bytes, const char *what);

// One store of the training state, saved or loaded with its tensors named
// NAME + suffix. Laid out like the parameters (by ParamInfo::offset), or,
// with ZeRO, as the step holds it: this rank's pieces of the moments
// (stateOffset, statePiece) or of the parameters (valueOffset, valuePiece).
// Checkpoints write and read the pieces as they are, loadParams cuts them
// from each tensor it reads, and saveParams puts each tensor together
// from them as it writes it.
struct StateStore {
  enum class Layout { ByOffset, MomentPieces, ValuePieces };
  float *data;
  std::string suffix;
  Layout layout = Layout::ByOffset;
};

// Loads the stores from a .safetensors file (each rank its shards), trying
// a parameter's alternative names; tensors that are not parameters are a
// warning, or an error when `strict`. Returns the file's metadata.
std::map<std::string, std::string>
loadParams(const Program &program, const std::string &path,
           const std::vector<StateStore> &stores, bool strict);
// The newest committed checkpoint under `path` whose files (those this rank
// reads for `stores`) pass their checks on every rank.
CheckpointManifest chooseCheckpoint(const Program &program,
                                    const std::string &path,
                                    const std::vector<StateStore> &stores);
// Loads the stores from a checkpoint saved at any layout; a checkpoint of
// another model is refused naming the tensors that differ.
void loadCheckpoint(const Program &program, const CheckpointManifest &m,
                    const std::vector<StateStore> &stores);

bool isDirectory(const std::string &path);

// Reports a fatal error on stderr ("error: ..."; with several ranks, naming
// the rank and aborting them all, or ending them together when `agreed`)
// and returns the exit code.
int reportFatal(const std::string &message, bool agreed = false);
// Runs the part of a main() after its command line is read and reports
// whatever it throws as reportFatal does; returns the exit code.
int runReportingFailures(const std::function<int()> &body);

} // namespace tessel::rt

#endif // TESSEL_RUNTIME_DRIVERINTERNAL_H
