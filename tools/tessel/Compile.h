//===- Compile.h - `tessel compile` ------------------------------*- C++
//-*-===//
#ifndef TESSEL_TOOLS_TESSEL_COMPILE_H
#define TESSEL_TOOLS_TESSEL_COMPILE_H

#include "tessel/Frontend/Spec.h"

#include "llvm/ADT/ArrayRef.h"
#include "llvm/Support/Error.h"

#include <optional>
#include <string>

namespace tessel {

struct CompileOptions {
  std::string input;                  // .json spec or .mlir graph program
  std::string output;                 // output directory
  std::vector<std::string> overrides; // --set key=value
  LayoutOverrides layout;             // --dp, --tp, ...
  std::string target = "cpu";
  std::string cudaArch = "sm_90"; // --target cuda: the GPU architecture
  // --fuse-kernels: join kernels into fused calls (unset: the CUDA target
  // does, the CPU target does not).
  std::optional<bool> fuseKernels;
  // An inference program (forward over a KV cache, for tessel generate)
  // instead of a training step.
  bool inference = false;
  // Tokens per call of the inference program's prefill step (0: the
  // default, 64 or model.seq_len if shorter; 1: no prefill step).
  int64_t prefillChunk = 0;
  bool emitOnly = false; // write sources and the plan, build no binaries
  bool dumpIR = false;   // also print every stage to stdout
  bool verbose = false;
  // --memory-limit: bytes one rank may hold (0: no limit). A plan whose
  // rank needs more is refused, saying by how much and what would fit.
  int64_t memoryLimit = 0;
  std::string memoryLimitFrom = "--memory-limit"; // or "--gpu h100"
};

// "80GB", "80GiB", "512MB", "1e9": bytes; an error naming the text otherwise.
llvm::Expected<int64_t> parseBytes(llvm::StringRef text);

// Runs the whole pipeline and writes the output directory (plan.json, ir/,
// src/, bin/, launch/) atomically: on failure nothing is left behind.
llvm::Error compile(const CompileOptions &options);

// Lowers the input like `compile`, then builds and runs a float64 program that
// checks the gradient of every parameter against central finite differences.
llvm::Error gradientCheck(const CompileOptions &options);

} // namespace tessel

#endif
