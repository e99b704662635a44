//===- Simulate.h - What simulate, calibrate and plan share -----*- C++ -*-===//
#ifndef TESSEL_TOOLS_TESSEL_SIMULATE_H
#define TESSEL_TOOLS_TESSEL_SIMULATE_H

#include "tessel/Simulate/Simulator.h"

#include <map>
#include <string>

namespace tessel {

// The cluster the flags name: --cluster FILE, or --gpu NAME with
// --gpus-per-node (default 8) and --nodes (default: enough for `devices`).
llvm::Expected<sim::Cluster>
clusterFromFlags(std::map<std::string, std::string> &values, int64_t devices);

// How to replay the programs of a compiled plan (plan.json): a CUDA
// program's step runs as a CUDA graph (docs/cuda.md).
sim::SimOptions simOptionsFor(const nlohmann::json &plan);

// Replays the training step compiled into `dir` (its ir/07-programs.mlir).
llvm::Expected<sim::SimResult> simulateCompiled(const std::string &dir,
                                                const sim::Cluster &cluster,
                                                const sim::SimOptions &options);

// "12.34 ms", "1.234 s"; "12.3 MB", "1.2 GB".
std::string formatSeconds(double seconds);
std::string formatBytes(double bytes);

// Writes `text` to `path` through a temporary file and a rename.
llvm::Error writeFileAtomically(const std::string &path,
                                const std::string &text);

// An error when `path` exists and is not a regular file (a device or a
// pipe, `/dev/stdout`): a file written through a temporary one and a
// rename would replace it rather than write into it.
llvm::Error checkReplaceable(const std::string &path);

// `tessel plan SPEC --gpus N ...` (Plan.cpp).
int planCommand(llvm::ArrayRef<std::string> args);

} // namespace tessel

#endif
