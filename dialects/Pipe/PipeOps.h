//===- PipeOps.h - The pipe dialect -----------------------------*- C++ -*-===//
#ifndef TESSEL_DIALECTS_PIPE_PIPEOPS_H
#define TESSEL_DIALECTS_PIPE_PIPEOPS_H

#include "mlir/Bytecode/BytecodeOpInterface.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/BuiltinAttributes.h"
#include "mlir/IR/Dialect.h"
#include "mlir/IR/OpDefinition.h"

#include "dialects/Pipe/PipeDialect.h.inc"

#define GET_OP_CLASSES
#include "dialects/Pipe/PipeOps.h.inc"

namespace tessel::pipe {

// The one place that knows the stage layout: stage `s` runs on rank
// `s % ranks`, so with virtual stages rank `r` holds the model chunks
// r, r + ranks, ... (Megatron's interleaved layout).
inline int64_t stageOwner(int64_t stage, int64_t ranks) {
  return stage % ranks;
}
// Which of its rank's model chunks stage `s` is.
inline int64_t stageChunk(int64_t stage, int64_t ranks) {
  return stage / ranks;
}

constexpr const char *kScheduleKinds[] = {"gpipe", "1f1b", "interleaved"};
constexpr const char *kActivation = "activation";
constexpr const char *kGradient = "gradient";

} // namespace tessel::pipe

#endif // TESSEL_DIALECTS_PIPE_PIPEOPS_H
