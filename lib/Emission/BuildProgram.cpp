//===- BuildProgram.cpp - Compile a generated program, once ---------------===//
//
// Generated sources are mostly schedule and compile in seconds; the kernels
// are precompiled in libtessel_rt. Binaries are cached by a hash of the
// source, the flags and the runtime library, so compiling many layouts of
// one model (or the same program for many ranks) builds each distinct
// program once.
//
//===----------------------------------------------------------------------===//

#include "tessel/Emission/BuildProgram.h"

#include "llvm/ADT/SmallString.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/Process.h"
#include "llvm/Support/Program.h"
#include "llvm/Support/xxhash.h"

#include <cstdlib>

using namespace llvm;

namespace {

std::string envOr(const char *name, const std::string &fallback) {
  const char *value = std::getenv(name);
  return value && *value ? value : fallback;
}

// The root of the runtime generated programs build against: the
// TESSEL_RUNTIME_DIR environment variable, else the tree this tessel is
// installed in (<prefix>/bin/tessel beside <prefix>/include/tessel/Runtime
// and <prefix>/lib/libtessel_rt.a), else none (a tessel in its build tree
// uses the paths it was built with).
std::string runtimeRoot() {
  static const std::string root = [] {
    std::string dir = envOr("TESSEL_RUNTIME_DIR", "");
    if (!dir.empty())
      return dir;
    static int anchor;
    SmallString<256> prefix(sys::fs::getMainExecutable(nullptr, &anchor));
    sys::path::remove_filename(prefix); // bin
    sys::path::remove_filename(prefix); // the prefix
    SmallString<256> header(prefix), library(prefix);
    sys::path::append(header, "include", "tessel", "Runtime", "Program.h");
    sys::path::append(library, "lib", "libtessel_rt.a");
    if (!prefix.empty() && sys::fs::exists(header) && sys::fs::exists(library))
      return std::string(prefix);
    return std::string();
  }();
  return root;
}

std::string runtimeInclude() {
  std::string root = runtimeRoot();
  return root.empty() ? TESSEL_RUNTIME_INCLUDE : root + "/include";
}
std::string runtimeLibrary() {
  std::string root = runtimeRoot();
  return root.empty() ? TESSEL_RUNTIME_LIB : root + "/lib/libtessel_rt.a";
}

std::string cacheDir() {
  std::string dir = envOr("TESSEL_CACHE_DIR", "");
  if (!dir.empty())
    return dir;
  SmallString<256> path;
  if (const char *xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg)
    path = xdg;
  else if (!sys::path::home_directory(path))
    return "";
  else
    sys::path::append(path, ".cache");
  sys::path::append(path, "tessel");
  return std::string(path);
}

void appendFlags(std::vector<std::string> &args, StringRef flags) {
  SmallVector<StringRef> parts;
  flags.split(parts, ' ', -1, false);
  for (StringRef flag : parts)
    args.push_back(flag.str());
}

std::vector<std::string> compileArgs(StringRef source, StringRef output) {
  std::vector<std::string> args = {envOr("CXX", TESSEL_CXX),
                                   "-O2",
                                   "-march=native",
                                   "-std=c++17",
                                   "-fopenmp",
                                   "-I" + runtimeInclude(),
                                   source.str(),
                                   "-o",
                                   output.str(),
                                   runtimeLibrary()};
  appendFlags(args, TESSEL_BLAS_LINK);
  return args;
}

#ifdef TESSEL_HAVE_CUDA
std::string cudaRuntimeLibrary() {
  std::string root = runtimeRoot();
  return root.empty() ? TESSEL_CUDA_RUNTIME_LIB
                      : root + "/lib/libtessel_cuda_rt.a";
}
#endif

// The hash of the source, the flags (not the source and output paths) and
// the runtime libraries the program links.
Expected<uint64_t> hashInputs(StringRef source, StringRef output,
                              const std::vector<std::string> &args,
                              ArrayRef<std::string> libraries) {
  auto text = MemoryBuffer::getFile(source);
  if (!text)
    return createStringError(source + ": " + text.getError().message());
  std::string key = (*text)->getBuffer().str();
  for (const std::string &arg : args)
    if (arg != source && arg != output)
      key += "\n" + arg;
  for (const std::string &library : libraries) {
    auto runtime = MemoryBuffer::getFile(library);
    if (!runtime)
      return createStringError("the runtime library " + library +
                               " is missing: " + runtime.getError().message() +
                               " (set TESSEL_RUNTIME_DIR?)");
    key += "\n" + std::to_string(xxh3_64bits((*runtime)->getBuffer()));
  }
  return xxh3_64bits(key);
}

Error buildProgram(StringRef sourcePath, StringRef binaryPath,
                   const std::vector<std::string> &args, StringRef tmpBinary,
                   ArrayRef<std::string> libraries, bool verbose);

} // namespace

Error tessel::buildCpuProgram(StringRef sourcePath, StringRef binaryPath,
                              bool verbose) {
  SmallString<256> tmpBinary(binaryPath);
  tmpBinary += ".tmp";
  return buildProgram(sourcePath, binaryPath,
                      compileArgs(sourcePath, tmpBinary), tmpBinary,
                      {runtimeLibrary()}, verbose);
}

Error tessel::checkCudaTarget() {
#ifdef TESSEL_HAVE_CUDA
  return Error::success();
#else
  return createStringError(
      "--target cuda: this build of tessel has no CUDA runtime (nvcc was not "
      "found when it was built; install the CUDA toolkit at /usr/local/cuda "
      "and rebuild)");
#endif
}

Error tessel::buildCudaProgram(StringRef sourcePath, StringRef binaryPath,
                               int arch, bool verbose) {
#ifdef TESSEL_HAVE_CUDA
  SmallVector<StringRef> archs;
  StringRef(TESSEL_CUDA_ARCHS).split(archs, ',', -1, false);
  if (!llvm::is_contained(archs, std::to_string(arch)))
    return createStringError(
        formatv("--cuda-arch sm_{0}: the CUDA runtime of this build has "
                "kernels for sm_{1} only; rebuild Tessel with "
                "-DTESSEL_CUDA_ARCHITECTURES=\"{1};{0}\"",
                arch, join(archs, ";sm_"))
            .str());
  SmallString<256> tmpBinary(binaryPath);
  tmpBinary += ".tmp";
  std::vector<std::string> args = {envOr("NVCC", TESSEL_NVCC),
                                   "-O2",
                                   "-std=c++17",
                                   "-arch=sm_" + std::to_string(arch),
                                   "-I" + runtimeInclude(),
                                   sourcePath.str(),
                                   "-o",
                                   tmpBinary.str().str(),
                                   cudaRuntimeLibrary(),
                                   runtimeLibrary(),
                                   "-Xcompiler=-fopenmp",
                                   "-lgomp"};
  appendFlags(args, TESSEL_CUDA_LINK);
  appendFlags(args, TESSEL_BLAS_LINK);
  return buildProgram(sourcePath, binaryPath, args, tmpBinary,
                      {cudaRuntimeLibrary(), runtimeLibrary()}, verbose);
#else
  (void)sourcePath;
  (void)binaryPath;
  (void)arch;
  (void)verbose;
  return checkCudaTarget();
#endif
}

namespace {

Error buildProgram(StringRef sourcePath, StringRef binaryPath,
                   const std::vector<std::string> &args, StringRef tmpBinary,
                   ArrayRef<std::string> libraries, bool verbose) {
  Expected<uint64_t> hash = hashInputs(sourcePath, tmpBinary, args, libraries);
  if (!hash)
    return hash.takeError();

  std::string cache = cacheDir();
  SmallString<256> cached(cache);
  if (!cache.empty()) {
    sys::path::append(cached, formatv("{0:x16}", *hash).str());
    if (sys::fs::exists(cached) && !sys::fs::copy_file(cached, tmpBinary) &&
        !sys::fs::setPermissions(tmpBinary,
                                 sys::fs::all_exe | sys::fs::owner_all) &&
        !sys::fs::rename(tmpBinary, binaryPath)) {
      if (verbose)
        errs() << "tessel: " << binaryPath << " from cache\n";
      return Error::success();
    }
  }

  auto compiler = sys::findProgramByName(args[0]);
  if (!compiler)
    return createStringError("compiler '" + args[0] + "' not found");
  SmallString<128> log;
  sys::fs::createTemporaryFile("tessel-cc", "log", log);
  std::optional<StringRef> redirects[] = {std::nullopt, StringRef(log),
                                          StringRef(log)};
  SmallVector<StringRef> argv(args.begin(), args.end());
  if (verbose)
    errs() << "tessel: " << join(argv, " ") << "\n";
  std::string message;
  int rc = sys::ExecuteAndWait(*compiler, argv, std::nullopt, redirects, 0, 0,
                               &message);
  if (rc != 0) {
    auto output = MemoryBuffer::getFile(log);
    std::string text = output ? (*output)->getBuffer().str() : message;
    sys::fs::remove(log);
    sys::fs::remove(tmpBinary);
    return createStringError("compiling " + sourcePath + " failed:\n" + text);
  }
  sys::fs::remove(log);
  if (!cache.empty() && !sys::fs::create_directories(cache)) {
    SmallString<256> tmpCached(cached);
    tmpCached += ".tmp" + std::to_string(sys::Process::getProcessId());
    if (!sys::fs::copy_file(tmpBinary, tmpCached))
      sys::fs::rename(tmpCached, cached);
  }
  if (std::error_code ec = sys::fs::rename(tmpBinary, binaryPath))
    return createStringError("cannot write " + binaryPath + ": " +
                             ec.message());
  return Error::success();
}

} // namespace
