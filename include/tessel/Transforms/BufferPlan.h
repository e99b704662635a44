//===- BufferPlan.h - The static buffer plan's attributes -------*- C++ -*-===//
//
// What tessel-plan-buffers writes and the emitters read.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_TRANSFORMS_BUFFERPLAN_H
#define TESSEL_TRANSFORMS_BUFFERPLAN_H

#include "mlir/IR/BuiltinOps.h"
#include "mlir/IR/Operation.h"
#include "mlir/IR/Value.h"
#include "llvm/ADT/DenseSet.h"
#include <cstdint>

namespace tessel {

enum class BufferSpace : int64_t { Arena = 0, Param = 1, Grad = 2, Input = 3 };

// Arena offsets are in bytes, parameter and gradient offsets in elements,
// inputs are 0 (tokens) or 1 (targets).
struct BufferRef {
  BufferSpace space = BufferSpace::Arena;
  int64_t offset = 0;
};

constexpr const char *kBufferAttr = "tessel.buffer";
constexpr const char *kArenaBytesAttr = "tessel.arena_bytes";
constexpr const char *kParamElemsAttr = "tessel.param_elems";

// Module attribute: the arena was planned with 2-byte slots for bf16
// activations (tessel-plan-buffers bf16-activations=true).
constexpr const char *kBf16ActivationsAttr = "tessel.bf16_activations";

// The values a bf16 program keeps in fp32: everything that becomes a
// parameter's gradient (so that gradients are produced, reduced and
// accumulated in fp32), losses and norms. Storage is shared along reshapes
// and collectives, and a value sent to another pipeline stage has one type
// on both sides, so the set is closed over those links across every
// function of the module. The planner and the CUDA emitter both use it.
llvm::DenseSet<mlir::Value> fp32ValuesOf(mlir::ModuleOp module);

// The planned place of `value` (an op result carrying kBufferAttr).
inline BufferRef bufferOf(mlir::Value value) {
  auto result = mlir::cast<mlir::OpResult>(value);
  auto pairs =
      result.getOwner()->getAttrOfType<mlir::DenseI64ArrayAttr>(kBufferAttr);
  int64_t i = result.getResultNumber() * 2;
  return {static_cast<BufferSpace>(pairs[i]), pairs[i + 1]};
}

} // namespace tessel

#endif // TESSEL_TRANSFORMS_BUFFERPLAN_H
