//===- BuildProgram.cpp - Compile a generated program, once ---------------===//
//
// Generated sources are mostly schedule and compile in seconds; the kernels
// are precompiled in libtessel_rt. Binaries are cached by a hash of the
// source, the flags and the runtime library, so compiling many layouts of
// one model (or the same program for many ranks) builds each distinct
// program once.
//
//===----------------------------------------------------------------------===//

#include "tessel/Emission/EmitCpp.h"

#include "llvm/ADT/SmallString.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/Process.h"
#include "llvm/Support/Program.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/xxhash.h"

#include <cstdlib>

using namespace llvm;

namespace {

std::string envOr(const char *name, const std::string &fallback) {
  const char *value = std::getenv(name);
  return value && *value ? value : fallback;
}

std::string runtimeInclude() {
  std::string dir = envOr("TESSEL_RUNTIME_DIR", "");
  return dir.empty() ? TESSEL_RUNTIME_INCLUDE : dir + "/include";
}
std::string runtimeLibrary() {
  std::string dir = envOr("TESSEL_RUNTIME_DIR", "");
  return dir.empty() ? TESSEL_RUNTIME_LIB : dir + "/lib/libtessel_rt.a";
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

std::vector<std::string> compileArgs(StringRef source, StringRef output) {
  std::vector<std::string> args = {envOr("CXX", TESSEL_CXX), "-O2",
                                   "-march=native", "-std=c++17", "-fopenmp",
                                   "-I" + runtimeInclude(), source.str(),
                                   "-o", output.str(), runtimeLibrary()};
  SmallVector<StringRef> blas;
  StringRef(TESSEL_BLAS_LINK).split(blas, ' ', -1, false);
  for (StringRef flag : blas)
    args.push_back(flag.str());
  return args;
}

Expected<uint64_t> hashInputs(StringRef source,
                              const std::vector<std::string> &args) {
  auto text = MemoryBuffer::getFile(source);
  if (!text)
    return createStringError(source + ": " + text.getError().message());
  auto runtime = MemoryBuffer::getFile(runtimeLibrary());
  if (!runtime)
    return createStringError("the runtime library " + runtimeLibrary() +
                             " is missing: " + runtime.getError().message() +
                             " (set TESSEL_RUNTIME_DIR?)");
  std::string key = (*text)->getBuffer().str();
  for (size_t i = 0; i < args.size(); ++i)
    if (i != 6 && i != 8) // the source and output paths do not matter
      key += "\n" + args[i];
  key += "\n" + std::to_string(xxh3_64bits((*runtime)->getBuffer()));
  return xxh3_64bits(key);
}

} // namespace

Error tessel::buildCpuProgram(StringRef sourcePath, StringRef binaryPath,
                              bool verbose) {
  SmallString<256> tmpBinary(binaryPath);
  tmpBinary += ".tmp";
  std::vector<std::string> args = compileArgs(sourcePath, tmpBinary);
  Expected<uint64_t> hash = hashInputs(sourcePath, args);
  if (!hash)
    return hash.takeError();

  std::string cache = cacheDir();
  SmallString<256> cached(cache);
  if (!cache.empty()) {
    sys::path::append(cached, formatv("{0:x16}", *hash).str());
    if (sys::fs::exists(cached) &&
        !sys::fs::copy_file(cached, tmpBinary) &&
        !sys::fs::setPermissions(tmpBinary, sys::fs::all_exe | sys::fs::owner_all) &&
        !sys::fs::rename(tmpBinary, binaryPath)) {
      if (verbose)
        errs() << "tessel: " << binaryPath << " from cache\n";
      return Error::success();
    }
  }

  auto compiler = sys::findProgramByName(args[0]);
  if (!compiler)
    return createStringError("C++ compiler '" + args[0] + "' not found");
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
    return createStringError("cannot write " + binaryPath + ": " + ec.message());
  return Error::success();
}
