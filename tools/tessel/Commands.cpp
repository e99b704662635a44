//===- Commands.cpp - `tessel run`, `tessel inspect`, `tessel data` -------===//

#include "Commands.h"
#include "Simulate.h"
#include "Textbook.h"
#include "Tokenizer.h"

#include "tessel/Pipeline/Schedule.h"
#include "tessel/Runtime/Checkpoint.h"
#include "tessel/Runtime/Data.h"
#include "tessel/Runtime/Program.h"

#include "llvm/ADT/ScopeExit.h"
#include "llvm/ADT/SmallString.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/Process.h"
#include "llvm/Support/Program.h"
#include "llvm/Support/SHA256.h"

#include "llvm/Support/raw_ostream.h"
#include <chrono>
#include <numeric>
#include <set>
#include <thread>
#include <csignal>
#include <cmath>
#include <cstring>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

using namespace llvm;
using json = nlohmann::json;

int tessel::fail(const Twine &message) {
  outs().flush();
  errs() << "tessel: error: " << message << "\n";
  return 1;
}

std::string tessel::inQuotes(const std::string &s) { return "'" + s + "'"; }

std::string tessel::parseArguments(ArrayRef<std::string> args,
                                   ArrayRef<StringRef> valueFlags,
                                   ArrayRef<StringRef> switchFlags,
                                   Arguments &out) {
  for (size_t i = 0; i < args.size(); ++i) {
    StringRef arg = args[i];
    if (arg.size() < 2 || arg[0] != '-') {
      out.positionals.push_back(arg.str());
      continue;
    }
    auto [flag, value] = arg.split('=');
    if (llvm::is_contained(switchFlags, arg)) {
      out.switches.insert(arg.str());
    } else if (llvm::is_contained(valueFlags, flag)) {
      if (arg.contains('='))
        out.values[flag.str()] = value.str();
      else if (i + 1 < args.size())
        out.values[flag.str()] = args[++i];
      else
        return (flag + " expects a value").str();
    } else {
      return ("unknown argument '" + arg + "'").str();
    }
  }
  return "";
}

using tessel::fail;

Expected<json> tessel::readPlan(StringRef dir) {
  SmallString<256> path(dir);
  sys::path::append(path, "plan.json");
  auto text = MemoryBuffer::getFile(path);
  if (!text)
    return createStringError(dir + " is not a compiled tessel output (" + path +
                             ": " + text.getError().message() + ")");
  json plan = json::parse((*text)->getBuffer().begin(),
                          (*text)->getBuffer().end(), nullptr, false);
  if (plan.is_discarded() || !plan.contains("ranks"))
    return createStringError(path + ": not a valid plan");
  return plan;
}

using tessel::readPlan;

namespace {

// What `tessel run` takes from a plan, checked as the rank programs are.
struct RunPlan : tessel::RankPrograms {
  std::string dataFormat, dataPath, validPath;
  int64_t vocab = 0; // model.vocab_size
};

bool isProgramName(StringRef name) {
  return !name.empty() && name.size() <= 64 && name != "." && name != ".." &&
         llvm::all_of(name, [](char c) {
           return llvm::isAlnum(c) || c == '_' || c == '-' || c == '.';
         });
}

// DIR/bin/NAME exists, runs, and is the binary the plan entry was compiled
// with.
Error checkBinary(StringRef dir, StringRef name, const json &program) {
  SmallString<256> binary(dir);
  sys::path::append(binary, "bin", name);
  if (!sys::fs::can_execute(binary))
    return createStringError(binary + " is missing or not executable; "
                                      "compile again");
  if (!program.contains("sha256"))
    return Error::success();
  Expected<std::string> digest = tessel::fileSha256(binary);
  if (!digest)
    return digest.takeError();
  if (!program["sha256"].is_string() ||
      program["sha256"].get<std::string>() != *digest)
    return createStringError(
        binary + " is not the binary this plan was compiled with "
                 "(its SHA-256 differs from plan.json's); compile again");
  return Error::success();
}

} // namespace

Expected<tessel::RankPrograms> tessel::checkRankPrograms(StringRef dir,
                                                         const json &plan) {
  std::string where = (dir + "/plan.json").str();
  auto bad = [&](const Twine &field, const Twine &what) {
    return createStringError(where + ": " + field + " " + what +
                             "; compile again");
  };
  try {
    RankPrograms run;
    const json &world = plan.at("world_size");
    if (!world.is_number_integer() || world.get<int64_t>() < 1 ||
        world.get<int64_t>() > (1 << 20))
      return bad("world_size", "must be a rank count, got " +
                                   world.dump().substr(0, 40));
    run.world = world.get<int64_t>();
    const json &ranks = plan.at("ranks");
    if (!ranks.is_array() || (int64_t)ranks.size() != run.world)
      return bad("ranks", "must list world_size = " + Twine(run.world) +
                              " ranks");
    const json &programs = plan.at("programs");
    if (!programs.is_object())
      return bad("programs", "must be an object");
    for (auto [k, r] : llvm::enumerate(ranks)) {
      const json &program = r.at("program");
      std::string field = "ranks[" + std::to_string(k) + "].program";
      if (!program.is_string() || !isProgramName(program.get<std::string>()))
        return bad(field, "must be the name of a compiled program, got " +
                              program.dump().substr(0, 60));
      std::string name = program.get<std::string>();
      if (!programs.contains(name))
        return bad(field, "names " + name + ", which programs does not list");
      // bin/NAME, in DIR/bin and nowhere else, as compiled.
      const json &entry = programs.at(name);
      std::string binary = name;
      if (entry.contains("binary")) {
        const json &path = entry.at("binary");
        StringRef text =
            path.is_string() ? StringRef(path.get_ref<const std::string &>())
                             : StringRef();
        if (!text.consume_front("bin/") || !isProgramName(text))
          return bad("programs." + name + ".binary",
                     "must be bin/NAME, got " + path.dump().substr(0, 60));
        binary = text.str();
      }
      if (run.binaries.empty() || run.binaries.back().first != binary) {
        if (Error err = checkBinary(dir, binary, entry))
          return std::move(err);
        run.binaries.push_back({binary, 0});
      }
      ++run.binaries.back().second;
    }
    return run;
  } catch (const json::exception &e) {
    // A missing field or one of the wrong type.
    return createStringError(where + ": malformed (" + e.what() +
                             "); compile again");
  }
}

namespace {

Expected<RunPlan> checkPlan(StringRef dir, const json &plan) {
  Expected<tessel::RankPrograms> programs =
      tessel::checkRankPrograms(dir, plan);
  if (!programs)
    return programs.takeError();
  std::string where = (dir + "/plan.json").str();
  try {
    RunPlan run;
    static_cast<tessel::RankPrograms &>(run) = std::move(*programs);
    const json &data = plan.at("data");
    run.dataFormat = data.at("format").get<std::string>();
    run.dataPath = data.at("path").get<std::string>();
    run.validPath = data.value("valid", std::string());
    run.vocab = plan.contains("model")
                    ? plan["model"].value("vocab_size", int64_t(0))
                    : 0;
    return run;
  } catch (const json::exception &e) {
    // A missing field or one of the wrong type.
    return createStringError(where + ": malformed (" + e.what() +
                             "); compile again");
  }
}

// The child tessel started (a run's job, generate's ranks); SIGTERM, SIGINT
// and SIGHUP to tessel go to it (mpirun passes them on to every rank), so
// that stopping tessel (as Slurm or a shell does) stops the job instead of
// orphaning it.
volatile sig_atomic_t runningChild = 0;
// A stop signal arrived: the job is not restarted.
volatile sig_atomic_t stopRequested = 0;

void forwardSignal(int sig) {
  stopRequested = 1;
  if (runningChild > 0)
    ::kill(runningChild, sig);
}

} // namespace

int tessel::runForwardingSignals(const std::vector<std::string> &argv,
                                 const std::vector<std::string> &env,
                                 function_ref<void(StringRef)> onOutput) {
  // Under mpirun, Open MPI's session directory goes in a directory of this
  // launch's own (removed after it): launches that start at the same moment
  // (tests side by side, a sweep of layouts) otherwise race to create the
  // same ompi.HOST.UID directory in the temporary directory, and one of
  // them fails in orte_init ("File exists"). A user's own setting stays.
  SmallString<128> session;
  std::vector<std::string> environment = env;
  auto setsSession = [&](const std::string &e) {
    return StringRef(e).starts_with("OMPI_MCA_orte_tmpdir_base=");
  };
  if (!argv.empty() && sys::path::filename(argv[0]) == "mpirun" &&
      llvm::none_of(env, setsSession) &&
      !sys::fs::createUniqueDirectory("tessel-mpi", session))
    environment.push_back("OMPI_MCA_orte_tmpdir_base=" + session.str().str());
  else
    session.clear();
  auto removeSession = llvm::make_scope_exit([&] {
    if (!session.empty())
      sys::fs::remove_directories(session);
  });
  std::vector<char *> args, envs;
  for (const std::string &a : argv)
    args.push_back(const_cast<char *>(a.c_str()));
  args.push_back(nullptr);
  for (const std::string &e : environment)
    envs.push_back(const_cast<char *>(e.c_str()));
  envs.push_back(nullptr);
  const int stops[] = {SIGTERM, SIGINT, SIGHUP};
  // Blocked until the child's pid is known, so none is lost in between.
  sigset_t block, old;
  sigemptyset(&block);
  for (int sig : stops)
    sigaddset(&block, sig);
  int output[2] = {-1, -1};
  if (onOutput && ::pipe2(output, O_CLOEXEC) != 0)
    return -errno;
  sigprocmask(SIG_BLOCK, &block, &old);
  pid_t pid = ::fork();
  if (pid == 0) {
    sigprocmask(SIG_SETMASK, &old, nullptr);
    if (onOutput && ::dup2(output[1], STDOUT_FILENO) < 0)
      ::_exit(127);
    ::execve(args[0], args.data(), envs.data());
    ::_exit(127);
  }
  if (pid < 0) {
    int error = errno;
    sigprocmask(SIG_SETMASK, &old, nullptr);
    if (onOutput) {
      ::close(output[0]);
      ::close(output[1]);
    }
    return -error;
  }
  runningChild = pid;
  struct sigaction forward = {}, previous[3];
  forward.sa_handler = forwardSignal;
  sigemptyset(&forward.sa_mask);
  for (int k = 0; k < 3; ++k)
    sigaction(stops[k], &forward, &previous[k]);
  sigprocmask(SIG_SETMASK, &old, nullptr);
  if (onOutput) {
    // Until every writer has closed it: the child, and under mpirun the
    // ranks it started.
    ::close(output[1]);
    char buffer[4096];
    for (;;) {
      ssize_t n = ::read(output[0], buffer, sizeof(buffer));
      if (n > 0)
        onOutput(StringRef(buffer, n));
      else if (n == 0 || errno != EINTR)
        break;
    }
    ::close(output[0]);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  runningChild = 0;
  for (int k = 0; k < 3; ++k)
    sigaction(stops[k], &previous[k], nullptr);
  if (WIFSIGNALED(status))
    return 128 + WTERMSIG(status);
  return WEXITSTATUS(status);
}

namespace {

bool hasFlag(ArrayRef<std::string> args, StringRef flag) {
  for (const std::string &a : args)
    if (a == flag || StringRef(a).starts_with((flag + "=").str()))
      return true;
  return false;
}

// The value of `flag` in args (--flag V or --flag=V), or "".
std::string flagValue(ArrayRef<std::string> args, StringRef flag) {
  for (size_t k = 0; k < args.size(); ++k) {
    StringRef a = args[k];
    if (a == flag && k + 1 < args.size())
      return args[k + 1];
    if (a.starts_with((flag + "=").str()))
      return a.drop_front(flag.size() + 1).str();
  }
  return "";
}

// args without `flag` and its value.
std::vector<std::string> withoutFlag(ArrayRef<std::string> args,
                                     StringRef flag) {
  std::vector<std::string> kept;
  for (size_t k = 0; k < args.size(); ++k) {
    if (args[k] == flag) {
      ++k;
      continue;
    }
    if (!StringRef(args[k]).starts_with((flag + "=").str()))
      kept.push_back(args[k]);
  }
  return kept;
}

// The newest committed checkpoint under `root` (step-N with a manifest),
// or "".
std::string newestCheckpoint(StringRef root) {
  std::error_code ec;
  std::string newest;
  int64_t newestStep = -1;
  for (sys::fs::directory_iterator it(root, ec), end; it != end && !ec;
       it.increment(ec)) {
    int64_t step =
        tessel::rt::checkpointStepOf(sys::path::filename(it->path()).str());
    if (step < 0)
      continue;
    SmallString<256> manifest(it->path());
    sys::path::append(manifest, "manifest.json");
    if (sys::fs::exists(manifest) && step > newestStep) {
      newestStep = step;
      newest = it->path();
    }
  }
  return newest;
}

// --elastic: compiles the plan in `dir` again with the data-parallel size
// divided by its smallest prime factor and the microbatches multiplied by
// it (the global batch and each microbatch stay), into
// ORIGINAL.elastic-dpN; returns that directory, or "" when dp is 1 already.
Expected<std::string> shrinkDataParallel(StringRef dir, StringRef original) {
  Expected<json> plan = readPlan(dir);
  if (!plan)
    return plan.takeError();
  try {
    int64_t dp = plan->at("mesh").at("dp").get<int64_t>();
    int64_t microbatches = plan->value("microbatches", (int64_t)1);
    std::string name = plan->at("name").get<std::string>();
    std::string target = plan->value("target", std::string("cpu"));
    if (dp <= 1) {
      errs() << "tessel: elastic: the run is at dp 1 already; it restarts "
                "as it is\n";
      return std::string();
    }
    SmallString<256> spec(dir);
    sys::path::append(spec, "spec", name + ".json");
    if (!sys::fs::exists(spec))
      return createStringError(spec + " is missing (compile again with this "
                                      "tessel)");
    // Under hybrid sharding (parallel.zero_group) the smallest prime factor
    // of dp whose quotient the shard group still divides; failing that, the
    // smallest, with the shard group cut to what divides the rest.
    int64_t group = 0;
    if (auto text = MemoryBuffer::getFile(spec)) {
      json saved = json::parse((*text)->getBuffer().begin(),
                               (*text)->getBuffer().end(), nullptr, false);
      if (saved.is_object() && saved.contains("parallel") &&
          saved["parallel"].is_object())
        group = saved["parallel"].value("zero_group", (int64_t)0);
    }
    int64_t factor = 0;
    for (int64_t f = 2; f <= dp && !factor; ++f) {
      bool prime = dp % f == 0;
      for (int64_t d = 2; prime && d * d <= f; ++d)
        prime = f % d != 0;
      if (prime && (group <= 0 || (dp / f) % group == 0))
        factor = f;
    }
    std::vector<std::string> groupFlags;
    if (!factor) {
      factor = 2;
      while (dp % factor)
        ++factor;
      groupFlags = {"--zero-group",
                    std::to_string(std::gcd(group, dp / factor))};
    }
    std::string out = (original.rtrim('/') + ".elastic-dp" +
                       Twine(dp / factor)).str();
    SmallString<256> self;
    if (std::error_code ec = sys::fs::real_path("/proc/self/exe", self))
      return createStringError("cannot find the tessel executable: " +
                               ec.message());
    std::vector<std::string> argv = {
        self.str().str(), "compile", spec.str().str(),
        "--dp", std::to_string(dp / factor),
        "--microbatches", std::to_string(microbatches * factor),
        "--target", target, "-o", out};
    argv.insert(argv.end() - 2, groupFlags.begin(), groupFlags.end());
    errs() << "tessel: elastic: dp " << dp << " -> " << dp / factor
           << ", microbatches " << microbatches << " -> "
           << microbatches * factor << " (the same global batch)"
           << (groupFlags.empty()
                   ? std::string()
                   : ", zero_group " + std::to_string(group) + " -> " +
                         groupFlags[1])
           << "; compiling " << out << "\n";
    std::vector<StringRef> refs(argv.begin(), argv.end());
    std::string message;
    int rc = sys::ExecuteAndWait(argv[0], refs, std::nullopt, {}, 0, 0,
                                 &message);
    if (rc != 0)
      return createStringError("compiling " + out + " failed" +
                               (message.empty() ? "" : ": " + message));
    return out;
  } catch (const json::exception &e) {
    return createStringError(dir + "/plan.json: malformed (" + e.what() + ")");
  }
}

} // namespace

std::string tessel::describeExit(int rc) {
  if (rc > 128) {
    const char *name = strsignal(rc - 128);
    return "exit code " + std::to_string(rc) + " (" +
           (name ? name : "a signal") + ")";
  }
  return "exit code " + std::to_string(rc);
}

// One rank runs directly; a mesh runs under mpirun (MPMD: one segment per
// program; root and more ranks than cores are allowed, as on a developer's
// machine or in CI).
Expected<std::vector<std::string>>
tessel::rankCommandLine(StringRef dir, const RankPrograms &programs,
                        ArrayRef<std::string> rankArgs) {
  std::vector<std::string> argv;
  if (programs.world > 1) {
    auto mpirun = sys::findProgramByName("mpirun");
    if (!mpirun)
      return createStringError("this plan has " + Twine(programs.world) +
                               " ranks and needs mpirun (Debian: openmpi-bin)");
    argv = {*mpirun, "--oversubscribe"};
    if (getuid() == 0)
      argv.push_back("--allow-run-as-root");
  }
  for (auto [k, program] : llvm::enumerate(programs.binaries)) {
    SmallString<256> binary(dir);
    sys::path::append(binary, "bin", program.first);
    if (programs.world > 1) {
      if (k)
        argv.push_back(":");
      argv.insert(argv.end(), {"-np", std::to_string(program.second)});
    }
    argv.push_back(std::string(binary));
    argv.insert(argv.end(), rankArgs.begin(), rankArgs.end());
  }
  return argv;
}

// OpenBLAS's threads and the kernels' OpenMP threads take turns on the
// same cores; spinning OpenMP workers would starve the GEMMs (measured:
// 1.7x slower steps on 2 cores), so idle workers sleep unless the user
// chose otherwise.
std::vector<std::string> tessel::rankEnvironment() {
  std::vector<std::string> env;
  for (char **e = environ; *e; ++e)
    env.push_back(*e);
  if (!std::getenv("OMP_WAIT_POLICY"))
    env.push_back("OMP_WAIT_POLICY=PASSIVE");
  return env;
}

int tessel::runCommand(ArrayRef<std::string> args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    outs() << "usage: tessel run DIR [--steps N] [--data FILE] [--init-from F"
              " [--strict]] [--save-final F] [--metrics FILE] [--seed N]"
              " [--threads N] [--timeout SECONDS] [--quiet]\n"
              "       [--ckpt-dir DIR [--ckpt-every N] [--ckpt-keep K[:M]]"
              " [--max-restarts K [--elastic]]] [--resume PATH]\n"
              "(options after DIR go to every rank's program; see "
              "DIR/bin/<program> --help; --max-restarts K, tessel's own, "
              "starts a failed run again from the newest committed "
              "checkpoint of --ckpt-dir, up to K times; --elastic makes each "
              "restart continue on fewer data-parallel ranks)\n\n";
    outs().flush();
    tessel::rt::printRunOptions(stdout, nullptr);
    std::fflush(stdout);
    return args.empty() ? 2 : 0;
  }
  std::string dir = args[0];
  Expected<json> plan = readPlan(dir);
  if (!plan)
    return fail(toString(plan.takeError()));
  if (plan->contains("inference"))
    return fail(dir + " was compiled for inference; generate with it: "
                      "tessel generate " +
                dir + " --weights PATH --prompt TEXT");
  Expected<RunPlan> checked = checkPlan(dir, *plan);
  if (!checked)
    return fail(toString(checked.takeError()));
  tessel::RankPrograms programs = *checked;
  std::vector<std::string> forwarded(args.begin() + 1, args.end());
  // --elastic: each restart continues on fewer data-parallel ranks.
  bool elastic = hasFlag(forwarded, "--elastic");
  forwarded.erase(std::remove(forwarded.begin(), forwarded.end(), "--elastic"),
                  forwarded.end());
  // --max-restarts K: the launcher's own option. A run that fails (a rank
  // died, the watchdog ended it) is started again from the newest
  // committed checkpoint of --ckpt-dir, up to K times.
  int64_t maxRestarts = 0;
  if (hasFlag(forwarded, "--max-restarts")) {
    std::string value = flagValue(forwarded, "--max-restarts");
    if (StringRef(value).getAsInteger(10, maxRestarts) || maxRestarts < 0)
      return fail("--max-restarts expects a non-negative integer, got '" +
                  value + "'");
    forwarded = withoutFlag(forwarded, "--max-restarts");
  }
  // The ranks' options, checked here once rather than by every rank under
  // mpirun.
  for (size_t i = 0; i < forwarded.size(); i++) {
    const std::string &arg = forwarded[i];
    std::string flag = arg.substr(0, arg.find('='));
    if (arg.rfind("-", 0) != 0)
      return fail("unexpected argument '" + arg + "' (see tessel run --help)");
    if (!tessel::rt::isRunFlag(flag)) {
      std::string near = tessel::rt::suggestRunFlag(flag);
      return fail("unknown option '" + arg + "'" +
                  (near.empty() ? "" : "; did you mean '" + near + "'?") +
                  " (see tessel run --help)");
    }
    if (tessel::rt::runFlagTakesValue(flag) && flag == arg)
      i++; // its value
  }
  std::string ckptDir = flagValue(forwarded, "--ckpt-dir");
  if (maxRestarts > 0 && ckptDir.empty())
    return fail("--max-restarts needs --ckpt-dir DIR (where a restarted "
                "run resumes from)");
  if (elastic && maxRestarts == 0)
    return fail("--elastic needs --max-restarts K (it changes the layout of "
                "a restarted run)");
  if (checked->dataFormat != "synthetic" && !hasFlag(forwarded, "--data")) {
    std::string path = checked->dataPath;
    if (checked->dataFormat == "blend") // data/blend.json in the plan
      path = (Twine(dir) + "/" + path).str();
    // The spec's data is not there (an example's, before it was made):
    // say how to make it rather than let every rank fail to open it.
    bool pattern = StringRef(path).find_first_of("*?[") != StringRef::npos;
    if (!pattern && !sys::fs::exists(path) &&
        !sys::fs::exists(path + ".idx")) {
      SmallString<256> clean(path);
      sys::path::remove_dots(clean, /*remove_dot_dot=*/true);
      path = std::string(clean);
      return fail(
          "the spec's data.path '" + path +
          "' does not exist. Make it from text with 'tessel data prepare "
          "FILES... -o " +
          path +
          "' (GPT-2 tokens: --tokenizer gpt2 --vocab-json vocab.json "
          "--merges merges.txt, the files of Hugging Face's gpt2 "
          "tokenizer), use a token file made by llm.c's dev/data scripts "
          "(e.g. fineweb.py), write synthetic tokens there with 'tessel "
          "data synth -o " +
          path + " --vocab " + std::to_string(checked->vocab) +
          "', or pass --data PATH");
    }
    forwarded.insert(forwarded.begin(), {"--data", path});
  }
  if (!checked->validPath.empty() && !hasFlag(forwarded, "--valid-data"))
    forwarded.insert(forwarded.begin(), {"--valid-data", checked->validPath});
  // Under mpirun a rank cannot tell whether the output ends at a terminal:
  // tessel run can, and says so.
  if (!hasFlag(forwarded, "--progress"))
    forwarded.insert(forwarded.begin(),
                     {"--progress", sys::Process::StandardOutIsDisplayed()
                                        ? "bar"
                                        : "lines"});
  std::vector<std::string> env = tessel::rankEnvironment();
  std::string cause;
  for (int64_t restart = 0;; ++restart) {
    std::vector<std::string> attempt = forwarded;
    if (restart > 0) {
      std::string from = newestCheckpoint(ckptDir);
      if (!from.empty()) {
        attempt = withoutFlag(attempt, "--resume");
        attempt.insert(attempt.end(), {"--resume", ckptDir});
      }
      errs() << "tessel: restart " << restart << " of " << maxRestarts
             << " after " << cause << ": resuming from "
             << (from.empty() ? std::string("the start (no committed "
                                            "checkpoint yet)")
                              : from)
             << "\n";
      if (elastic) {
        Expected<std::string> smaller = shrinkDataParallel(dir, args[0]);
        if (!smaller)
          return fail("--elastic: " + toString(smaller.takeError()));
        if (!smaller->empty()) {
          Expected<json> next = readPlan(*smaller);
          Expected<RunPlan> nextChecked =
              next ? checkPlan(*smaller, *next)
                   : Expected<RunPlan>(next.takeError());
          if (!nextChecked)
            return fail("--elastic: " + toString(nextChecked.takeError()));
          dir = *smaller;
          programs = *nextChecked;
        }
      }
    }
    Expected<std::vector<std::string>> argv =
        tessel::rankCommandLine(dir, programs, attempt);
    if (!argv)
      return fail(toString(argv.takeError()));
    int rc = tessel::runForwardingSignals(*argv, env);
    if (rc < 0)
      return fail((*argv)[0] + " could not be started: " +
                  std::strerror(-rc));
    if (rc == 0)
      return 0;
    if (programs.world > 1)
      errs() << "tessel: error: the " << programs.world << "-rank run failed ("
             << tessel::describeExit(rc)
             << "); the messages above name the failing rank\n";
    // Usage mistakes and stops asked for are not failures to recover from.
    if (restart >= maxRestarts || rc == 2 || stopRequested)
      return rc;
    cause = tessel::describeExit(rc);
  }
}

Expected<std::string> tessel::fileSha256(StringRef path) {
  auto buffer = MemoryBuffer::getFile(path, /*IsText=*/false,
                                      /*RequiresNullTerminator=*/false);
  if (!buffer)
    return createStringError(path + ": " + buffer.getError().message());
  SHA256 hash;
  hash.update(arrayRefFromStringRef((*buffer)->getBuffer()));
  return toHex(hash.final(), /*LowerCase=*/true);
}

namespace {

// An inference plan's memory per rank beside the textbook's: 4 bytes per
// parameter of the rank's shard, the KV cache 2 (k, v) x layers x max_len x
// kv_heads / tp x head_dim x 4, the prefill step's logits prefill_chunk x
// vocab x 4; the arena has no formula.
int printInferenceMemory(const json &plan) {
  try {
    const json &model = plan.at("model");
    const json &inference = plan.at("inference");
    double tp = plan.at("mesh").value("tp", 1);
    double layers = model.at("layers").get<double>();
    double headDim = model.at("hidden").get<double>() /
                     model.at("heads").get<double>();
    double cache = 2 * layers * inference.at("max_len").get<double>() *
                   model.at("kv_heads").get<double>() / tp * headDim * 4;
    double logits = std::max<double>(inference.at("chunk").get<double>(),
                                     inference.at("prefill_chunk").get<double>()) *
                    inference.at("batch").get<double>() *
                    model.value("padded_vocab_size",
                                model.at("vocab_size").get<double>()) *
                    4;
    for (auto &[name, program] : plan.at("programs").items()) {
      const json &memory = program.at("memory");
      outs() << "program " << name << " (" << program.at("ranks").get<int64_t>()
             << " ranks, inference): bytes held per rank\n";
      outs() << formatv("  {0,-32} {1,14} {2,14} {3,8}\n", "", "plan",
                        "textbook", "ratio");
      auto row = [&](StringRef what, double planned, double textbook) {
        std::string ratio = textbook <= 0
                                ? std::string("-")
                                : formatv("{0:f3}", planned / textbook).str();
        outs() << formatv("  {0,-32} {1,14:f0} {2,14:f0} {3,8}\n", what,
                          planned, textbook, ratio);
      };
      row("parameters", memory.at("params_bytes").get<double>(),
          program.at("parameters").get<double>() * 4);
      row("KV cache", memory.at("kv_cache_bytes").get<double>(), cache);
      row("activations (one step)", memory.at("activation_bytes").get<double>(),
          0);
      row("logits", memory.at("logits_bytes").get<double>(), logits);
      outs() << formatv("  {0,-32} {1,14:f0}\n", "total",
                        memory.at("total_bytes").get<double>());
    }
  } catch (const json::exception &e) {
    return fail("plan.json: the inference plan lacks a field (" +
                std::string(e.what()) + "); compile again");
  }
  return 0;
}

} // namespace

int tessel::inspectCommand(ArrayRef<std::string> args) {
  const char *usage = "usage: tessel inspect DIR (--ir STAGE | --plan | "
                      "--source | --comm [--textbook] | --memory | --schedule)\n  "
                      "stages: graph, "
                      "train, sharded, partitioned, stages, planned\n";
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
    outs() << usage;
    return 0;
  }
  if (args.size() < 2) {
    errs() << usage;
    return 2;
  }
  StringRef dir = args[0];
  if (Expected<json> plan = readPlan(dir); !plan)
    return fail(toString(plan.takeError()));
  SmallString<256> path(dir);
  if (args[1] == "--schedule") {
    // The pipeline schedule of the plan: per-rank timeline, bubble, chart.
    Expected<json> plan = readPlan(dir);
    int pp = (*plan)["mesh"]["pp"].get<int>();
    int microbatches = (*plan).value("microbatches", 1);
    std::string kindName = (*plan).value("schedule", std::string("1f1b"));
    if (pp <= 1) {
      outs() << "no pipeline: pp = 1 (" << microbatches
             << " microbatches run one after another)\n";
      return 0;
    }
    auto kind = tessel::pipeline::parseScheduleKind(kindName);
    if (!kind)
      return fail(toString(kind.takeError()));
    auto schedule = tessel::pipeline::generateSchedule(
        *kind, pp, microbatches, (*plan).value("virtual_stages", 1));
    if (!schedule)
      return fail(toString(schedule.takeError()));
    auto timeline = tessel::pipeline::simulate(*schedule);
    if (!timeline)
      return fail(toString(timeline.takeError()));
    outs() << tessel::pipeline::textTimeline(*schedule, *timeline);
    SmallString<256> svg(dir);
    sys::path::append(svg, "schedule.svg");
    std::error_code ec;
    raw_fd_ostream file(svg, ec);
    if (ec)
      return fail("cannot write " + svg + ": " + ec.message());
    file << tessel::pipeline::scheduleSvg(*schedule, *timeline);
    outs() << formatv("bubble fraction {0:f3} (1F1B and GPipe without virtual "
                      "stages: (p-1)/(m+p-1) = {1:f3}); chart written to {2}\n",
                      timeline->bubble,
                      double(pp - 1) / (microbatches + pp - 1), svg);
    return 0;
  }
  if (args[1] == "--comm" && args.size() > 2 && args[2] == "--textbook") {
    // Predicted bytes beside the textbook's, per group of mesh axes.
    Expected<json> plan = readPlan(dir);
    for (auto &[name, program] : (*plan)["programs"].items()) {
      Expected<CommTable> table = commTextbook(*plan, name);
      if (!table)
        return fail(dir + "/plan.json: " + toString(table.takeError()));
      outs() << "program " << name << " (" << program["ranks"].get<int64_t>()
             << " ranks): bytes sent per rank and step\n";
      size_t width = 8; // as wide as the widest group ("dp_replica")
      for (auto &[group, textbook] : table->textbook)
        width = std::max(width, group.size());
      auto axes = [&](std::string text) {
        return text.append(width - std::min(width, text.size()), ' ');
      };
      outs() << formatv("  {0} {1,14} {2,14} {3,8}\n", axes("axes"),
                        "predicted", "textbook", "ratio");
      for (auto &[group, textbook] : table->textbook) {
        double predicted = table->predicted[group];
        std::string ratio =
            textbook > 0 ? formatv("{0:f3}", predicted / textbook).str()
                         : (predicted > 0 ? "extra" : "-");
        outs() << formatv("  {0} {1,14:f0} {2,14:f0} {3,8}\n", axes(group),
                          predicted, textbook, ratio);
      }
      if (table->textbook.empty())
        outs() << "  (none)\n";
      if (table->scalarBytes > 0)
        outs() << formatv("  and {0} bytes of one-element collectives (the "
                          "loss, the gradient norm), not compared\n",
                          table->scalarBytes);
    }
    return 0;
  }
  if (args[1] == "--memory") {
    // The plan's memory per rank by class, beside the textbook's.
    Expected<json> plan = readPlan(dir);
    if (!plan)
      return fail(toString(plan.takeError()));
    if (plan->contains("inference"))
      return printInferenceMemory(*plan);
    for (auto &[name, program] : (*plan)["programs"].items()) {
      Expected<std::vector<MemoryRow>> rows = memoryTextbook(*plan, name);
      if (!rows)
        return fail(dir + "/plan.json: " + toString(rows.takeError()));
      outs() << "program " << name << " (" << program["ranks"].get<int64_t>()
             << " ranks): bytes held per rank\n";
      // The first column as wide as its widest label.
      size_t width = 32;
      for (const MemoryRow &row : *rows)
        width = std::max(width, row.what.size());
      auto label = [&](std::string text) {
        return text.append(width - text.size(), ' ');
      };
      outs() << formatv("  {0} {1,14} {2,14} {3,8}\n", label(""), "plan",
                        "textbook", "ratio");
      for (const MemoryRow &row : *rows) {
        std::string ratio =
            row.textbook <= 0
                ? std::string("-")
                : formatv("{0:f3}", row.predicted / row.textbook).str();
        // Counts that are not whole (an interleaved schedule's microbatches
        // in flight in units of the stage) keep their fraction.
        auto number = [](double x) {
          return x == std::floor(x) ? formatv("{0:f0}", x).str()
                                    : formatv("{0:f2}", x).str();
        };
        outs() << formatv("  {0} {1,14} {2,14} {3,8}", label(row.what),
                          number(row.predicted), number(row.textbook), ratio);
        if (!row.note.empty())
          outs() << "  (" << row.note << ")";
        outs() << "\n";
      }
      outs() << formatv("  {0} {1,14:f0}\n", label("total"),
                        program["memory"]["total_bytes"].get<double>());
    }
    return 0;
  }
  if (args[1] == "--comm") {
    Expected<json> plan = readPlan(dir);
    for (auto &[name, program] : (*plan)["programs"].items()) {
      outs() << "program " << name << " (" << program["ranks"].get<int64_t>()
             << " ranks): collectives per rank and step\n";
      // The axes column as wide as its widest entry ("dp_replica").
      size_t width = 6;
      for (const json &c : program["comm"]["per_step"])
        width = std::max(width, c["axes"].get<std::string>().size());
      auto axes = [&](std::string text) {
        return text.append(width - std::min(width, text.size()), ' ');
      };
      outs() << formatv("  {0,-15} {1} {2,5} {3,12} {4,14}  {5}\n",
                        "collective", axes("axes"), "group", "elements",
                        "bytes sent", "op (x times per step)");
      for (const json &c : program["comm"]["per_step"]) {
        int64_t count = c.value("count", 1);
        outs() << formatv(
            "  {0,-15} {1} {2,5} {3,12} {4,14}  {5}{6}\n",
            c["collective"].get<std::string>(),
            axes(c["axes"].get<std::string>()),
            c["group"].get<int64_t>(), c["elements"].get<int64_t>(),
            c["bytes_sent"].get<int64_t>(), c["op"].get<std::string>(),
            count > 1 ? " x" + std::to_string(count) : std::string());
      }
      if (program["comm"]["per_step"].empty())
        outs() << "  (none)\n";
    }
    return 0;
  }
  if (args[1] == "--plan") {
    sys::path::append(path, "plan.json");
  } else if (args[1] == "--source") {
    // The first program's source; others are beside it in src/.
    Expected<json> plan = readPlan(dir);
    if (!plan) {
      errs() << "tessel inspect: error: " << toString(plan.takeError()) << "\n";
      return 1;
    }
    bool cuda = plan->value("target", std::string("cpu")) == "cuda";
    sys::path::append(path, "src",
                      (*plan)["ranks"][0]["program"].get<std::string>() +
                          (cuda ? ".cu" : ".cpp"));
  } else if (args[1] == "--ir" || StringRef(args[1]).starts_with("--ir=")) {
    std::string stage = args[1] == "--ir" ? (args.size() > 2 ? args[2] : "")
                                          : args[1].substr(5);
    // The stages are what the compile wrote: ir/NN-<stage>.mlir, in order.
    SmallString<256> irDir(path);
    sys::path::append(irDir, "ir");
    std::vector<std::string> files;
    std::error_code ec;
    for (sys::fs::directory_iterator it(irDir, ec), end; it != end && !ec;
         it.increment(ec))
      if (StringRef(it->path()).ends_with(".mlir"))
        files.push_back(sys::path::filename(it->path()).str());
    llvm::sort(files);
    std::string names, file;
    for (const std::string &f : files) {
      StringRef name = StringRef(f).drop_front(3).drop_back(5); // NN-....mlir
      names += (names.empty() ? "" : ", ") + name.str();
      if (name == stage)
        file = f;
    }
    if (file.empty())
      return fail("--ir: unknown stage '" + stage + "' (stages: " + names +
                  ")");
    sys::path::append(path, "ir", file);
  } else {
    errs() << usage;
    return 2;
  }
  auto text = MemoryBuffer::getFile(path);
  if (!text)
    return fail(path + ": " + text.getError().message());
  outs() << (*text)->getBuffer();
  return 0;
}

// The data tools' command line: DATA and integer flags, each with its
// smallest value. Returns false after a usage message.
static bool parseDataTool(
    ArrayRef<std::string> args, StringRef tool, std::string &path,
    std::initializer_list<std::tuple<StringRef, int64_t *, int64_t>> flags) {
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string &arg = args[i];
    auto flag = llvm::find_if(flags, [&](const auto &f) {
      return std::get<0>(f) == arg;
    });
    if (flag != flags.end()) {
      auto [name, field, min] = *flag;
      int64_t value;
      if (i + 1 >= args.size() ||
          StringRef(args[i + 1]).getAsInteger(10, value) || value < min) {
        errs() << "tessel data " << tool << ": " << arg
               << " expects an integer >= " << min << "\n";
        return false;
      }
      *field = value;
      ++i;
    } else if (arg[0] != '-' && path.empty()) {
      path = arg;
    } else {
      errs() << "tessel data " << tool << ": unknown argument '" << arg
             << "'\n";
      return false;
    }
  }
  return true;
}

// tessel data bench DATA: how many tokens per second the loader reads, as
// a run reads them (one rank's batches, in step order, on one thread).
static int dataBench(ArrayRef<std::string> args) {
  std::string path;
  int64_t vocab = 50257, seqLen = 1024, batch = 8, steps = 200, seed = -1;
  if (!parseDataTool(args, "bench", path,
                     {{"--vocab", &vocab, 1},
                      {"--seq-len", &seqLen, 1},
                      {"--batch", &batch, 1},
                      {"--steps", &steps, 1},
                      {"--shuffle", &seed, 0}}))
    return 2;
  std::optional<uint64_t> shuffle;
  if (seed >= 0)
    shuffle = (uint64_t)seed;
  if (path.empty())
    return fail("data bench: which data (a token file, Megatron prefix, "
                "directory, pattern or blend)?");
  try {
    auto opened = std::chrono::steady_clock::now();
    tessel::rt::TokenData data = tessel::rt::TokenData::fromFile(path, vocab);
    double openSeconds = std::chrono::duration<double>(
                             std::chrono::steady_clock::now() - opened)
                             .count();
    if (shuffle)
      data.shuffle(*shuffle);
    std::vector<int32_t> inputs(batch * seqLen), targets(batch * seqLen);
    auto start = std::chrono::steady_clock::now();
    for (int64_t step = 0; step < steps; ++step)
      data.rowsForStep(step, batch, 0, batch, seqLen, inputs.data(),
                       targets.data());
    double seconds = std::chrono::duration<double>(
                         std::chrono::steady_clock::now() - start)
                         .count();
    outs() << formatv("{0}: opened in {1:f3} s; {2} steps of {3} x {4} "
                      "tokens{5} in {6:f3} s: {7:f0} tokens/s\n",
                      path, openSeconds, steps, batch, seqLen,
                      shuffle ? " (shuffled)" : "", seconds,
                      seconds > 0 ? steps * batch * seqLen / seconds : 0.0);
    return 0;
  } catch (const std::exception &e) {
    return fail(e.what());
  }
}

// tessel data inspect DATA: what the data is, how many tokens and samples,
// and one sample's tokens (decoded as bytes for a byte-level vocabulary).
static int dataInspect(ArrayRef<std::string> args) {
  std::string path;
  int64_t vocab = 50257, seqLen = 1024, sample = 0;
  if (!parseDataTool(args, "inspect", path,
                     {{"--vocab", &vocab, 1},
                      {"--seq-len", &seqLen, 1},
                      {"--sample", &sample, 0}}))
    return 2;
  if (path.empty())
    return fail("data inspect: which data?");
  try {
    tessel::rt::TokenData data = tessel::rt::TokenData::fromFile(path, vocab);
    int64_t samples = data.numSamples(seqLen);
    outs() << path << ": " << data.kind() << "\n"
           << "tokens: " << data.size() << "; samples of " << seqLen
           << " tokens (+1 target): " << samples << "\n";
    if (samples == 0)
      return 0;
    if (sample >= samples)
      return fail("data inspect: --sample " + Twine(sample) + " is past the " +
                  Twine(samples) + " samples");
    std::vector<int32_t> inputs(seqLen), targets(seqLen);
    data.rowsForStep(sample, 1, 0, 1, seqLen, inputs.data(), targets.data());
    outs() << "sample " << sample << ":";
    for (int64_t t = 0; t < std::min<int64_t>(seqLen, 32); ++t)
      outs() << " " << inputs[t];
    outs() << (seqLen > 32 ? " ..." : "") << "\n";
    if (vocab <= 256) {
      std::string text;
      for (int64_t t = 0; t < seqLen; ++t) {
        unsigned char c = (unsigned char)inputs[t];
        if (c == '\\')
          text += "\\\\";
        else if (c >= 32 && c < 127)
          text += (char)c;
        else
          text += formatv("\\x{0:x-2}", (unsigned)c).str();
      }
      outs() << "as bytes: \"" << text << "\"\n";
    }
    return 0;
  } catch (const std::exception &e) {
    return fail(e.what());
  }
}

// The directories an output file goes into, made as needed; throws naming
// the directory.
static void makeParentDirectories(StringRef path) {
  StringRef parent = sys::path::parent_path(path);
  if (!parent.empty())
    if (std::error_code ec = sys::fs::create_directories(parent))
      throw std::runtime_error("cannot create the directory '" + parent.str() +
                               "': " + ec.message());
}

// tessel data prepare INPUT... -o OUT: text files (one document each) or
// JSON lines (a document per line, its `text` field) tokenized by bytes or
// by GPT-2's BPE, written as an llm.c token file or a Megatron dataset.
static int dataPrepare(ArrayRef<std::string> args) {
  const char *usage =
      "usage: tessel data prepare INPUT... -o OUTPUT [--format llmc|megatron] "
      "[--tokenizer bytes|gpt2 --vocab-json vocab.json --merges merges.txt] "
      "[--json-key text] [--workers N] [--valid-fraction F "
      "[--valid-output VALID]]\n";
  std::vector<std::string> inputs;
  std::string output, format = "llmc", tokenizer = "bytes", vocabJson, merges,
                      jsonKey = "text", workersText, validFractionText,
                      validOutput;
  const std::pair<StringRef, std::string *> flags[] = {
      {"-o", &output},          {"--format", &format},
      {"--tokenizer", &tokenizer}, {"--vocab-json", &vocabJson},
      {"--merges", &merges},    {"--json-key", &jsonKey},
      {"--workers", &workersText}, {"--valid-fraction", &validFractionText},
      {"--valid-output", &validOutput}};
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string &arg = args[i];
    auto flag = llvm::find_if(flags, [&](const auto &f) { return f.first == arg; });
    if (flag != std::end(flags)) {
      if (i + 1 >= args.size()) {
        errs() << "tessel data prepare: " << arg << " expects a value\n";
        return 2;
      }
      *flag->second = args[++i];
    } else if (!arg.empty() && arg[0] != '-') {
      inputs.push_back(arg);
    } else {
      errs() << "tessel data prepare: unknown argument '" << arg << "'\n"
             << usage;
      return 2;
    }
  }
  if (inputs.empty() || output.empty()) {
    errs() << usage;
    return 2;
  }
  if (format != "llmc" && format != "megatron")
    return fail("data prepare: --format is llmc or megatron, not '" + format +
                "'");
  int workers = std::max(1u, std::thread::hardware_concurrency());
  if (!workersText.empty() &&
      (StringRef(workersText).getAsInteger(10, workers) || workers < 1 ||
       workers > 1024))
    return fail("data prepare: --workers expects 1 to 1024, got '" +
                workersText + "'");
  if (tokenizer != "bytes" && tokenizer != "gpt2")
    return fail("data prepare: --tokenizer is bytes or gpt2, not '" +
                tokenizer + "'");
  if (tokenizer == "gpt2" && (vocabJson.empty() || merges.empty()))
    return fail("data prepare: --tokenizer gpt2 needs --vocab-json and "
                "--merges (a Hugging Face GPT-2 tokenizer's vocab.json and "
                "merges.txt)");
  if (tokenizer == "bytes" && (!vocabJson.empty() || !merges.empty()))
    return fail("data prepare: --vocab-json and --merges are for "
                "--tokenizer gpt2");
  // --valid-fraction F: the last documents, F of them (at least one), are
  // written to the validation output instead, as Megatron's split takes
  // contiguous ranges of documents.
  double validFraction = 0;
  if (!validFractionText.empty() &&
      (StringRef(validFractionText).getAsDouble(validFraction) ||
       !(validFraction > 0 && validFraction < 1)))
    return fail("data prepare: --valid-fraction expects a fraction of the "
                "documents between 0 and 1 (exclusive), got '" +
                validFractionText + "'");
  if (!validOutput.empty() && validFraction == 0)
    return fail("data prepare: --valid-output needs --valid-fraction");
  if (validFraction > 0 && validOutput.empty()) {
    // train.bin -> train.valid.bin; a Megatron PREFIX -> PREFIX_valid.
    StringRef out(output);
    if (format == "llmc" && out.ends_with(".bin"))
      validOutput = out.drop_back(4).str() + ".valid.bin";
    else
      validOutput = output + (format == "llmc" ? ".valid" : "_valid");
  }
  if (validFraction > 0 && validOutput == output)
    return fail("data prepare: --valid-output names the training output '" +
                output + "'");
  // No output may be one of the files read (the text, the tokenizer's):
  // it would be replaced by the tokens.
  {
    std::vector<std::string> outputs;
    for (const std::string &out : {output, validOutput})
      if (!out.empty()) {
        if (format == "megatron") {
          outputs.push_back(out + ".bin");
          outputs.push_back(out + ".idx");
        } else {
          outputs.push_back(out);
        }
      }
    std::vector<std::string> read = inputs;
    for (const std::string &f : {vocabJson, merges})
      if (!f.empty())
        read.push_back(f);
    for (const std::string &out : outputs)
      for (const std::string &in : read) {
        bool same = false;
        if (!sys::fs::equivalent(out, in, same) && same)
          return fail("data prepare: the output '" + out + "' is the input '" +
                      in +
                      "', which writing it would destroy; give another "
                      "output");
      }
  }
  try {
    std::optional<tessel::Gpt2Bpe> bpe;
    if (tokenizer == "gpt2")
      bpe = tessel::Gpt2Bpe::load(vocabJson, merges);
    // llm.c starts each document with <|endoftext|>, Megatron ends each
    // with it (--append-eod); bytes have no such token.
    int32_t eot = bpe ? bpe->endOfText() : -1;
    std::vector<int32_t> tokens;
    std::vector<int64_t> ends;
    // Documents are encoded a batch at a time by `workers` threads, each
    // with its own tokenizer (and cache), and appended in order.
    std::vector<tessel::Gpt2Bpe> encoders;
    if (bpe)
      encoders.assign(workers, *bpe);
    std::vector<std::string> batch;
    int64_t batchBytes = 0, readBytes = 0, totalBytes = 0;
    for (const std::string &input : inputs) {
      uint64_t size = 0;
      if (!sys::fs::file_size(input, size))
        totalBytes += (int64_t)size;
    }
    auto start = std::chrono::steady_clock::now();
    bool progress = sys::Process::StandardErrIsDisplayed();
    auto flush = [&] {
      std::vector<std::vector<int32_t>> encoded(batch.size());
      auto work = [&](int w) {
        for (size_t d = w; d < batch.size(); d += workers) {
          if (bpe)
            encoders[w].encode(batch[d], encoded[d]);
          else
            encoded[d] = tessel::rt::encodeTextBytes(batch[d]);
        }
      };
      std::vector<std::thread> threads;
      for (int w = 1; w < workers; w++)
        threads.emplace_back(work, w);
      work(0);
      for (std::thread &t : threads)
        t.join();
      for (const std::vector<int32_t> &ids : encoded) {
        if (eot >= 0 && format == "llmc")
          tokens.push_back(eot);
        tokens.insert(tokens.end(), ids.begin(), ids.end());
        if (eot >= 0 && format == "megatron")
          tokens.push_back(eot);
        ends.push_back((int64_t)tokens.size());
      }
      readBytes += batchBytes;
      batch.clear();
      batchBytes = 0;
      if (progress) {
        double seconds = std::chrono::duration<double>(
                             std::chrono::steady_clock::now() - start)
                             .count();
        errs() << formatv("\r{0} documents, {1} tokens, {2:f0}% of the "
                          "input, {3:f0} tokens/s   ",
                          ends.size(), tokens.size(),
                          totalBytes ? 100.0 * readBytes / totalBytes : 100.0,
                          tokens.size() / std::max(seconds, 1e-9));
      }
    };
    auto document = [&](std::string text) {
      batchBytes += (int64_t)text.size();
      batch.push_back(std::move(text));
      if (batch.size() >= 4096 || batchBytes >= (64 << 20))
        flush();
    };
    for (const std::string &input : inputs) {
      auto text = MemoryBuffer::getFile(input, /*IsText=*/false,
                                        /*RequiresNullTerminator=*/false);
      if (!text)
        return fail(input + ": " + text.getError().message());
      StringRef body = (*text)->getBuffer();
      if (!StringRef(input).ends_with(".jsonl") &&
          !StringRef(input).ends_with(".json")) {
        document(body.str());
        continue;
      }
      // JSON lines: one document per non-empty line.
      int64_t number = 0;
      while (!body.empty()) {
        auto [line, rest] = body.split('\n');
        body = rest;
        number++;
        if (line.trim().empty())
          continue;
        nlohmann::json record =
            nlohmann::json::parse(line.begin(), line.end(), nullptr, false);
        if (!record.is_object() || !record.contains(jsonKey) ||
            !record[jsonKey].is_string())
          return fail(input + " line " + Twine(number) +
                      ": not a JSON object with a string field '" + jsonKey +
                      "' (--json-key names the field)");
        document(record[jsonKey].get<std::string>());
      }
    }
    flush();
    if (progress)
      errs() << "\n";
    double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count();
    int64_t vocab = bpe ? bpe->vocabSize() : 256;
    int64_t allTokens = (int64_t)tokens.size();
    std::vector<int32_t> validTokens;
    std::vector<int64_t> validEnds;
    if (validFraction > 0) {
      int64_t documents = (int64_t)ends.size();
      if (documents < 2)
        return fail("data prepare: --valid-fraction needs at least two "
                    "documents (one to train on, one to validate on); the "
                    "input holds " +
                    Twine(documents));
      int64_t held = std::clamp<int64_t>(
          (int64_t)std::llround(validFraction * (double)documents), 1,
          documents - 1);
      int64_t cut = ends[documents - held - 1];
      validTokens.assign(tokens.begin() + cut, tokens.end());
      tokens.resize(cut);
      for (int64_t d = documents - held; d < documents; d++)
        validEnds.push_back(ends[d] - cut);
      ends.resize(documents - held);
    }
    auto write = [&](const std::string &path, const std::vector<int32_t> &t,
                     const std::vector<int64_t> &e) {
      makeParentDirectories(path);
      if (format == "llmc")
        tessel::rt::writeTokenFile(path, t);
      else
        tessel::rt::writeMegatronDataset(path, t, e);
      return format == "llmc" ? path : path + ".bin and " + path + ".idx";
    };
    std::string wrote = write(output, tokens, ends);
    std::string heldIn =
        validFraction > 0 ? write(validOutput, validTokens, validEnds) : "";
    outs() << "wrote " << tokens.size() << " tokens of " << ends.size()
           << " documents to " << wrote << " (" << tokenizer
           << " tokens: model.vocab_size >= " << vocab << ")\n";
    if (validFraction > 0)
      outs() << "  and held out " << validTokens.size() << " tokens of "
             << validEnds.size() << " documents for validation in " << heldIn
             << " (data.valid, --valid-data)\n";
    outs() << formatv("  {0} MB of text in {1:f2} s: {2:f0} tokens/s with {3} "
                      "worker{4}\n",
                      formatv("{0:f1}", readBytes / 1e6), seconds,
                      allTokens / std::max(seconds, 1e-9), workers,
                      workers == 1 ? "" : "s");
  } catch (const std::exception &e) {
    return fail(e.what());
  }
  return 0;
}

int tessel::dataCommand(ArrayRef<std::string> args) {
  const char *usage =
      "usage: tessel data prepare INPUT... -o OUTPUT [--format llmc|megatron] "
      "[--tokenizer bytes|gpt2 --vocab-json F --merges F] [--json-key K]\n"
      "           [--workers N] [--valid-fraction F [--valid-output V]]\n"
      "       tessel data encode TEXT_FILE -o TOKENS.bin\n"
      "       tessel data synth -o TOKENS.bin [--vocab 256] [--tokens N] "
      "[--seed S]\n"
      "       tessel data bench DATA [--vocab V] [--seq-len T] [--batch B] "
      "[--steps N] [--shuffle SEED]\n"
      "       tessel data inspect DATA [--vocab V] [--seq-len T] "
      "[--sample N]\n";
  if (args.empty()) {
    errs() << usage;
    return 2;
  }
  // `tessel data --help`, `tessel data TOOL --help`.
  for (const std::string &arg : args)
    if (arg == "--help" || arg == "-h") {
      outs() << usage;
      return 0;
    }
  if (args[0] == "bench")
    return dataBench(args);
  if (args[0] == "inspect")
    return dataInspect(args);
  if (args[0] == "prepare")
    return dataPrepare(args);
  std::string output, input;
  int64_t vocab = 256, count = 1 << 20;
  uint64_t seed = 1234;
  for (size_t i = 1; i < args.size(); ++i) {
    auto value = [&](const char *flag) -> std::optional<std::string> {
      if (i + 1 >= args.size()) {
        fail(Twine(flag) + " expects a value");
        return std::nullopt;
      }
      return args[++i];
    };
    auto integer = [&](const char *flag, int64_t &out) {
      auto v = value(flag);
      if (!v || StringRef(*v).getAsInteger(10, out) || out <= 0) {
        if (v)
          fail(Twine(flag) + " expects a positive integer, got '" + *v + "'");
        return false;
      }
      return true;
    };
    int64_t s;
    if (args[i] == "-o") {
      auto v = value("-o");
      if (!v)
        return 2;
      output = *v;
    } else if (args[i] == "--vocab") {
      if (!integer("--vocab", vocab))
        return 2;
    } else if (args[i] == "--tokens") {
      if (!integer("--tokens", count))
        return 2;
    } else if (args[i] == "--seed") {
      if (!integer("--seed", s))
        return 2;
      seed = s;
    } else if (input.empty() && args[0] == "encode" && args[i][0] != '-') {
      input = args[i];
    } else {
      errs() << "tessel data: unknown argument '" << args[i] << "'\n" << usage;
      return 2;
    }
  }
  if (output.empty())
    return fail("data: -o OUTPUT is required");
  try {
    std::vector<int32_t> tokens;
    if (args[0] == "encode") {
      if (input.empty())
        return fail("data encode: which text file?");
      auto text = MemoryBuffer::getFile(input);
      if (!text)
        return fail(input + ": " + text.getError().message());
      tokens = tessel::rt::encodeTextBytes((*text)->getBuffer().str());
    } else if (args[0] == "synth") {
      tokens = tessel::rt::syntheticTokens(vocab, count, seed);
    } else {
      errs() << usage;
      return 2;
    }
    makeParentDirectories(output);
    tessel::rt::writeTokenFile(output, tokens);
    outs() << "wrote " << tokens.size() << " tokens to " << output << "\n";
  } catch (const std::exception &e) {
    return fail(e.what());
  }
  return 0;
}

// After a compile: ranks, binaries and the planned memory per rank, against
// this machine's memory when its ranks run here (a CPU plan), with a
// warning when they would not fit.
void tessel::summarizePlan(StringRef dir, bool emitOnly) {
  Expected<json> read = readPlan(dir);
  if (!read) {
    consumeError(read.takeError());
    return;
  }
  const json &plan = *read;
  if (!plan.contains("programs"))
    return;
  std::set<std::string> binaries;
  double most = 0, all = 0;
  for (const json &rank : plan["ranks"]) {
    std::string program = rank.value("program", std::string());
    auto found = plan["programs"].find(program);
    if (found == plan["programs"].end())
      continue;
    const json &p = *found;
    binaries.insert(p.value("binary", program));
    double bytes = p.contains("memory")
                       ? p["memory"].value("total_bytes", 0.0)
                       : 0.0;
    most = std::max(most, bytes);
    all += bytes;
  }
  // Decimal units, as --memory-limit, --gpu and `tessel inspect` count.
  auto gb = [](double bytes) {
    if (bytes < 1e9)
      return formatv("{0:f1} MB", bytes / 1e6).str();
    return formatv("{0:f2} GB", bytes / 1e9).str();
  };
  outs() << "  " << plan["ranks"].size() << " ranks, " << binaries.size()
         << (binaries.size() == 1 ? " binary" : " binaries")
         << (emitOnly ? " (sources only)" : "") << "; planned memory per rank "
         << "up to " << gb(most);
  std::string target = plan.value("target", std::string("cpu"));
  long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  double machine = pages > 0 && page > 0 ? (double)pages * page : 0;
  if (target == "cpu" && machine > 0) {
    outs() << ", " << gb(all) << " for all ranks (this machine has "
           << gb(machine) << ")\n";
    if (all > machine)
      errs() << "tessel compile: warning: the " << plan["ranks"].size()
             << " ranks together plan " << gb(all) << ", more than this "
             << "machine's " << gb(machine)
             << ": run them on more machines, or see --memory-limit\n";
  } else {
    outs() << "\n";
  }
}

std::vector<double>
tessel::traceClockShifts(const std::vector<nlohmann::json> &traces) {
  std::set<std::string> hosts;
  for (const nlohmann::json &t : traces)
    hosts.insert(t["otherData"].value("host", std::string()));
  bool oneHost = hosts.size() == 1;
  // One host: times relative to the earliest barrier exit, on its clock.
  double zero = 0;
  for (size_t k = 0; k < traces.size(); k++) {
    const nlohmann::json &o = traces[k]["otherData"];
    double at = o["clock_origin_us"].get<double>() + o["sync_us"].get<double>();
    zero = k == 0 ? at : std::min(zero, at);
  }
  std::vector<double> shifts;
  for (const nlohmann::json &t : traces) {
    const nlohmann::json &o = t["otherData"];
    shifts.push_back(oneHost ? o["clock_origin_us"].get<double>() - zero
                             : -o["sync_us"].get<double>());
  }
  return shifts;
}

// tessel trace merge TRACE... -o OUT: the Chrome traces `--trace` wrote,
// one per rank, as one trace with a process per rank, the ranks' times on
// one clock.
int tessel::traceCommand(ArrayRef<std::string> args) {
  const char *usage = "usage: tessel trace merge TRACE... -o MERGED.json\n"
                      "  TRACE: the --trace FILE of a run (its FILE.rankR "
                      "files are read) or rank files\n";
  if (args.empty() || args[0] != "merge") {
    errs() << usage;
    return 2;
  }
  std::vector<std::string> inputs;
  std::string output;
  for (size_t i = 1; i < args.size(); ++i) {
    if (args[i] == "-o" && i + 1 < args.size())
      output = args[++i];
    else if (!args[i].empty() && args[i][0] != '-')
      inputs.push_back(args[i]);
    else {
      errs() << "tessel trace merge: unknown argument '" << args[i] << "'\n"
             << usage;
      return 2;
    }
  }
  if (inputs.empty() || output.empty()) {
    errs() << usage;
    return 2;
  }
  // A run's --trace FILE stands for FILE.rank0..., as the runtime names
  // them (tessel/Runtime/Driver.cpp, rankFileName).
  std::vector<std::string> files;
  for (const std::string &input : inputs) {
    if (sys::fs::exists(input)) {
      files.push_back(input);
      continue;
    }
    StringRef ext = sys::path::extension(input);
    std::string stem = input.substr(0, input.size() - ext.size());
    size_t before = files.size();
    for (int r = 0;; r++) {
      std::string rank = stem + ".rank" + std::to_string(r) + ext.str();
      if (!sys::fs::exists(rank))
        break;
      files.push_back(rank);
    }
    if (files.size() == before)
      return fail("trace merge: " + input + " does not exist, nor do its "
                  "rank files (" + stem + ".rank0" + ext + ", ...)");
  }
  // Each rank's time 0 on a common clock. Ranks of one host share its
  // monotonic clock (otherData.clock_origin_us), which aligns them
  // exactly; across hosts the instant every rank left the start barrier
  // (sync_us) is taken as simultaneous.
  std::vector<nlohmann::json> traces;
  std::set<std::string> hosts;
  for (const std::string &file : files) {
    auto text = MemoryBuffer::getFile(file);
    if (!text)
      return fail(file + ": " + text.getError().message());
    nlohmann::json trace = nlohmann::json::parse(
        (*text)->getBuffer().begin(), (*text)->getBuffer().end(), nullptr,
        false);
    if (!trace.is_object() || !trace.contains("traceEvents") ||
        !trace["traceEvents"].is_array())
      return fail(file + ": not a Chrome trace (no traceEvents list)");
    const nlohmann::json *other =
        trace.contains("otherData") ? &trace["otherData"] : nullptr;
    if (!other || !other->contains("rank") || !other->contains("sync_us") ||
        !other->contains("clock_origin_us") ||
        !(*other)["rank"].is_number_integer() ||
        !(*other)["sync_us"].is_number() ||
        !(*other)["clock_origin_us"].is_number())
      return fail(file + ": has no otherData.rank and sync_us (not written "
                  "by tessel run --trace, or by an older version)");
    hosts.insert(other->value("host", std::string()));
    traces.push_back(std::move(trace));
  }
  bool oneHost = hosts.size() == 1;
  std::vector<double> shifts = tessel::traceClockShifts(traces);
  nlohmann::json merged = nlohmann::json::array();
  std::set<int64_t> ranks;
  size_t events = 0;
  for (size_t k = 0; k < traces.size(); k++) {
    const std::string &file = files[k];
    nlohmann::json &trace = traces[k];
    const nlohmann::json &other = trace["otherData"];
    int64_t rank = other["rank"].get<int64_t>();
    double shift = shifts[k];
    if (!ranks.insert(rank).second)
      return fail(file + ": rank " + Twine(rank) + " is given twice");
    merged.push_back({{"name", "process_name"},
                      {"ph", "M"},
                      {"pid", rank},
                      {"args", {{"name", "rank " + std::to_string(rank)}}}});
    merged.push_back({{"name", "process_sort_index"},
                      {"ph", "M"},
                      {"pid", rank},
                      {"args", {{"sort_index", rank}}}});
    for (nlohmann::json event : trace["traceEvents"]) {
      if (!event.is_object())
        return fail(file + ": a trace event is not an object");
      event["pid"] = rank;
      if (event.contains("ts") && event["ts"].is_number())
        event["ts"] = event["ts"].get<double>() + shift;
      merged.push_back(std::move(event));
      events++;
    }
  }
  nlohmann::json out = {{"traceEvents", std::move(merged)},
                        {"displayTimeUnit", "ms"},
                        {"otherData",
                         {{"ranks", ranks.size()},
                          {"aligned", oneHost ? "one host's monotonic clock"
                                              : "the start barrier"}}}};
  if (Error e = checkReplaceable(output))
    return fail(toString(std::move(e)));
  std::string tmp = output + ".tmp";
  {
    std::error_code ec;
    raw_fd_ostream file(tmp, ec);
    if (ec)
      return fail("cannot write " + tmp + ": " + ec.message());
    file << out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
         << "\n";
    file.close();
    if (file.has_error()) {
      sys::fs::remove(tmp);
      return fail("cannot write " + output);
    }
  }
  if (std::error_code ec = sys::fs::rename(tmp, output)) {
    sys::fs::remove(tmp);
    return fail("cannot write " + output + ": " + ec.message());
  }
  outs() << "merged " << ranks.size() << " ranks (" << events
         << " events) into " << output << ", clocks aligned by "
         << (oneHost ? "the host's monotonic clock"
                     : "the start barrier (ranks on " +
                           std::to_string(hosts.size()) + " hosts)")
         << "\n";
  return 0;
}
