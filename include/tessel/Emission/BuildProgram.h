//===- BuildProgram.h - Generated sources to rank binaries ------*- C++ -*-===//
#ifndef TESSEL_EMISSION_BUILDPROGRAM_H
#define TESSEL_EMISSION_BUILDPROGRAM_H

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/Error.h"

namespace tessel {

// Compiles `sourcePath` into `binaryPath` with the system C++ compiler against
// libtessel_rt. Binaries are cached by the hash of source and flags, so an
// identical program is compiled once. Returns an error with the compiler's
// output on failure.
llvm::Error buildCpuProgram(llvm::StringRef sourcePath,
                            llvm::StringRef binaryPath, bool verbose);

// Fails, saying how to fix it, when this build has no CUDA runtime (nvcc
// was not found when Tessel was built).
llvm::Error checkCudaTarget();
// Compiles a generated CUDA program with nvcc for sm_<arch> against
// libtessel_cuda_rt, cuBLASLt, NCCL and libtessel_rt; cached like CPU
// programs. No GPU is needed to build.
llvm::Error buildCudaProgram(llvm::StringRef sourcePath,
                             llvm::StringRef binaryPath, int arch,
                             bool verbose);

} // namespace tessel

#endif // TESSEL_EMISSION_BUILDPROGRAM_H
