//===- KeepLossStatistics.cpp - The loss's row statistics, kept -----------===//
//
// The vocabulary-parallel loss combines each row's maximum and sum of
// exponentials over the tensor-parallel group in the forward; its
// backward needs the same two values. Rather than combine them again (two
// all-reduces of a value per row), the forward keeps them in a buffer its
// part hands on, as Megatron-LM's vocabulary-parallel cross-entropy saves
// them for its backward: 8 bytes per row held from the forward to the
// backward, and the textbook's three all-reduces per microbatch.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "dialects/Pipe/PipeOps.h"
#include "dialects/Rt/RtOps.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"

namespace tessel {
#define GEN_PASS_DEF_KEEPLOSSSTATISTICS
#include "tessel/Transforms/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;
namespace rt = tessel::rtir;

namespace {

// The forward loss whose logits a backward loss reads, when a forward
// part hands them on (the targets are the same microbatch's batch, which
// each part reads itself).
rt::CrossEntropyVocabParallelForwardOp
forwardOf(rt::CrossEntropyVocabParallelBackwardOp backward) {
  auto result = dyn_cast<OpResult>(backward.getLogits());
  auto part = result ? dyn_cast<pipe::ForwardPassOp>(result.getOwner())
                     : pipe::ForwardPassOp();
  if (!part)
    return {};
  auto yield = cast<pipe::YieldOp>(part.getBody().front().getTerminator());
  Value logits = yield.getValues()[result.getResultNumber()];
  for (Operation *user : logits.getUsers())
    if (auto forward = dyn_cast<rt::CrossEntropyVocabParallelForwardOp>(user);
        forward && forward->getParentOp() == part.getOperation() &&
        forward.getRows() == backward.getRows() &&
        forward.getLocalVocab() == backward.getLocalVocab() &&
        forward.getAxes() == backward.getAxes())
      return forward;
  return {};
}

// The forward part with `value` (of its body) as one more result.
pipe::ForwardPassOp handOn(pipe::ForwardPassOp part, Value value) {
  auto yield = cast<pipe::YieldOp>(part.getBody().front().getTerminator());
  yield.getValuesMutable().append(value);
  SmallVector<Type> types(part.getResultTypes());
  types.push_back(value.getType());
  OpBuilder b(part);
  auto wider =
      pipe::ForwardPassOp::create(b, part.getLoc(), types, part.getChunk());
  wider->setAttrs(part->getAttrs());
  wider.getBody().takeBody(part.getBody());
  part->replaceAllUsesWith(wider->getResults().drop_back());
  part->erase();
  return wider;
}

struct KeepLossStatisticsPass
    : tessel::impl::KeepLossStatisticsBase<KeepLossStatisticsPass> {
  void runOnOperation() override {
    SmallVector<rt::CrossEntropyVocabParallelBackwardOp> backwards;
    getOperation().walk([&](rt::CrossEntropyVocabParallelBackwardOp op) {
      if (!op.getStats())
        backwards.push_back(op);
    });
    for (rt::CrossEntropyVocabParallelBackwardOp backward : backwards) {
      rt::CrossEntropyVocabParallelForwardOp forward = forwardOf(backward);
      if (!forward || forward.getStats())
        continue;
      auto part = cast<pipe::ForwardPassOp>(forward->getParentOp());
      OpBuilder b(forward);
      Value stats = rt::AllocOp::create(
          b, forward.getLoc(),
          MemRefType::get({2 * (int64_t)forward.getRows()}, b.getF32Type()));
      forward.getStatsMutable().assign(stats);
      pipe::ForwardPassOp wider = handOn(part, stats);
      backward.getStatsMutable().assign(wider->getResults().back());
    }
  }
};

} // namespace
