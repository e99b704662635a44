//===- InferenceProgram.cpp - The rank program of an inference step -------===//
//
// An inference step has no parts and no schedule: after their memory plans,
// the decode step (and the prefill step) are the rank program's functions.
// See Passes.td.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "dialects/Rt/RtOps.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"

namespace tessel {
#define GEN_PASS_DEF_INFERENCEPROGRAM
#include "tessel/Transforms/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;
namespace rt = tessel::rtir;

namespace {

// The tokens per sequence a step reads (0: none).
int64_t chunkOf(func::FuncOp step) {
  int64_t chunk = 0;
  step.walk([&](rt::BatchOp batch) {
    if (batch.getName() == "tokens")
      chunk = cast<MemRefType>(batch.getType()).getDimSize(1);
  });
  return chunk;
}

int64_t intAttr(Operation *op, StringRef name) {
  auto attr = op->getAttrOfType<IntegerAttr>(name);
  return attr ? attr.getInt() : 0;
}

struct InferenceProgramPass
    : tessel::impl::InferenceProgramBase<InferenceProgramPass> {
  void runOnOperation() override {
    ModuleOp top = getOperation();
    auto decode = top.lookupSymbol<func::FuncOp>("decode_step");
    auto prefill = top.lookupSymbol<func::FuncOp>("prefill_step");
    SmallVector<func::FuncOp> steps = {decode};
    if (prefill)
      steps.push_back(prefill);
    for (func::FuncOp step : steps)
      if (!step || !step->hasAttr("rt.arena_bytes")) {
        top.emitError("tessel-inference-program: no planned @decode_step "
                      "(run tessel-plan-memory first)");
        return signalPassFailure();
      }
    for (func::FuncOp step : steps)
      if (chunkOf(step) == 0) {
        step.emitOpError("reads no tokens");
        return signalPassFailure();
      }
    // Both steps read and write the same stores: the parameters and the
    // caches are declared in the same order, so each lies at the same place
    // in both.
    if (prefill)
      for (StringRef name : {"rt.param_elems", "rt.kv_cache_elems"})
        if (intAttr(decode, name) != intAttr(prefill, name)) {
          prefill.emitOpError("plans ")
              << name << " = " << intAttr(prefill, name) << " but "
              << "@decode_step plans " << intAttr(decode, name);
          return signalPassFailure();
        }
    OpBuilder b(decode);
    auto program = ModuleOp::create(b, decode.getLoc(), StringRef("program0"));
    program->setAttr("pipe.rank", b.getI64IntegerAttr(0));
    for (StringRef name :
         {"rt.param_elems", "rt.kv_cache_elems", "rt.request_slots"})
      if (Attribute attr = decode->getAttr(name))
        program->setAttr(name, attr);
    // One step runs at a time: the arena is the larger of the two.
    int64_t arena = 0;
    for (func::FuncOp step : steps)
      arena = std::max(arena, intAttr(step, "rt.arena_bytes"));
    program->setAttr("rt.arena_bytes", b.getI64IntegerAttr(arena));
    program->setAttr("rt.arena_slots", b.getI64IntegerAttr(1));
    program->setAttr("rt.microbatches", b.getI64IntegerAttr(1));
    program->setAttr("rt.chunk", b.getI64IntegerAttr(chunkOf(decode)));
    if (prefill)
      program->setAttr("rt.prefill_chunk",
                       b.getI64IntegerAttr(chunkOf(prefill)));
    for (func::FuncOp step : steps) {
      for (StringRef name :
           {"pipe.rank", "rt.param_elems", "rt.arena_bytes",
            "rt.accumulator_elems", "rt.norm_sums", "rt.received_bytes",
            "rt.request_slots", "rt.kv_cache_elems"})
        step->removeAttr(name);
      step->moveBefore(program.getBody(), program.getBody()->end());
    }
  }
};

} // namespace
