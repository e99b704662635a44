//===- JoinUpdates.cpp - One optimizer call per run of like parameters ----===//
//
// On the planned rank programs, the update calls one kernel per parameter:
// the gradient norm's sum of squares of each gradient and AdamW on each
// parameter (148 of each for GPT-2 small). Parameters sit side by side in
// the parameter store, their gradients, moments and bf16 shadow at the same
// offsets in stores of their own, so calls that follow each other on
// adjacent runs, with the same hyperparameters, are one call on the joined
// run: every sum of squares of a contiguous gradient store into one partial
// sum becomes one call, and AdamW one call per run of parameters with the
// same weight decay. AdamW is elementwise, so the joined call computes
// exactly what the calls did; the sum of squares adds in another order (in
// fp64).
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "dialects/Rt/RtOps.h"

#include "mlir/IR/Builders.h"

namespace tessel {
#define GEN_PASS_DEF_JOINUPDATES
#include "tessel/Transforms/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;
namespace rt = tessel::rtir;

namespace {

bool isBookkeeping(Operation *op) {
  return isa<rt::BufferOp, rt::LearningRateOp, rt::UpdateCountOp>(op);
}

// The placed buffer `v` is, when it is one.
rt::BufferOp placed(Value v) {
  return v ? v.getDefiningOp<rt::BufferOp>() : nullptr;
}

// Whether `next` continues `prev`'s run in the same space: it starts where
// the `n` elements of `prev` end.
bool continues(Value prev, Value next, int64_t n) {
  rt::BufferOp a = placed(prev), b = placed(next);
  return a && b && a.getSpace() == b.getSpace() &&
         a.getSpace() != rt::Space::Arena &&
         rt::elementTypeOf(prev) == rt::elementTypeOf(next) &&
         b.getOffset() == a.getOffset() + n;
}

bool sameBuffer(Value a, Value b) {
  if (a == b)
    return true;
  rt::BufferOp x = placed(a), y = placed(b);
  return x && y && x.getSpace() == y.getSpace() &&
         x.getOffset() == y.getOffset() && a.getType() == b.getType();
}

// The buffer `first` names, `n` elements long.
Value joinedBuffer(OpBuilder &b, Value first, int64_t n) {
  rt::BufferOp buffer = placed(first);
  auto type = MemRefType::get({n}, rt::elementTypeOf(first));
  return rt::BufferOp::create(b, buffer.getLoc(), type, buffer.getSpace(),
                              buffer.getOffset());
}

bool joins(rt::SumSquaresOp prev, int64_t n, rt::SumSquaresOp next) {
  return sameBuffer(prev.getAcc(), next.getAcc()) &&
         continues(prev.getX(), next.getX(), n);
}

bool joins(rt::AdamWOp prev, int64_t n, rt::AdamWOp next) {
  if (prev.getBeta1() != next.getBeta1() ||
      prev.getBeta2() != next.getBeta2() || prev.getEps() != next.getEps() ||
      prev.getWeightDecay() != next.getWeightDecay() ||
      prev.getMaxGradNorm() != next.getMaxGradNorm() ||
      !sameBuffer(prev.getNorm(), next.getNorm()) ||
      bool(prev.getShadow()) != bool(next.getShadow()))
    return false;
  // This step's learning rate and update count, whoever reads them.
  if (!prev.getLr().getDefiningOp<rt::LearningRateOp>() ||
      !next.getLr().getDefiningOp<rt::LearningRateOp>() ||
      !prev.getCount().getDefiningOp<rt::UpdateCountOp>() ||
      !next.getCount().getDefiningOp<rt::UpdateCountOp>())
    return false;
  if (prev.getShadow() &&
      !continues(prev.getShadow(), next.getShadow(), n))
    return false;
  return continues(prev.getParam(), next.getParam(), n) &&
         continues(prev.getGrad(), next.getGrad(), n) &&
         continues(prev.getM(), next.getM(), n) &&
         continues(prev.getV(), next.getV(), n);
}

// Replaces `group` (one kind, adjacent runs) by one call on the joined run,
// at the last call's place; the bookkeeping only the calls read goes too.
void join(ArrayRef<Operation *> group) {
  Operation *last = group.back();
  OpBuilder b(last);
  int64_t total = 0;
  for (Operation *op : group)
    total += op->getAttrOfType<IntegerAttr>("n").getInt();
  if (auto first = dyn_cast<rt::SumSquaresOp>(group.front())) {
    rt::SumSquaresOp::create(b, first.getLoc(),
                             joinedBuffer(b, first.getX(), total),
                             first.getAcc(), total);
  } else {
    auto a = cast<rt::AdamWOp>(group.front());
    // In operand order, so that the joined buffers read in that order.
    Value param = joinedBuffer(b, a.getParam(), total);
    Value shadow =
        a.getShadow() ? joinedBuffer(b, a.getShadow(), total) : Value();
    Value grad = joinedBuffer(b, a.getGrad(), total);
    Value m = joinedBuffer(b, a.getM(), total);
    Value v = joinedBuffer(b, a.getV(), total);
    rt::AdamWOp::create(b, a.getLoc(), param, shadow, grad, m, v, a.getNorm(),
                        a.getLr(), a.getCount(), total, a.getBeta1(),
                        a.getBeta2(), a.getEps(), a.getWeightDecay(),
                        a.getMaxGradNorm());
  }
  SmallVector<Operation *> read;
  for (Operation *op : group)
    for (Value v : op->getOperands())
      if (Operation *def = v.getDefiningOp(); def && isBookkeeping(def))
        read.push_back(def);
  for (Operation *op : group)
    op->erase();
  for (Operation *def : read)
    if (def->use_empty())
      def->erase();
}

template <typename Op> void joinRuns(Block &block) {
  SmallVector<SmallVector<Operation *>> groups;
  SmallVector<Operation *> group;
  auto close = [&] {
    if (group.size() > 1)
      groups.push_back(group);
    group.clear();
  };
  for (Operation &op : block) {
    if (isBookkeeping(&op))
      continue;
    auto call = dyn_cast<Op>(&op);
    if (!call) {
      close();
      continue;
    }
    if (!group.empty()) {
      auto prev = cast<Op>(group.back());
      if (!joins(prev, int64_t(prev.getN()), call))
        close();
    }
    group.push_back(call);
  }
  close();
  for (ArrayRef<Operation *> g : groups)
    join(g);
}

struct JoinUpdatesPass : tessel::impl::JoinUpdatesBase<JoinUpdatesPass> {
  void runOnOperation() override {
    SmallVector<Block *> blocks;
    getOperation().walk([&](Block *block) { blocks.push_back(block); });
    for (Block *block : blocks) {
      joinRuns<rt::SumSquaresOp>(*block);
      joinRuns<rt::AdamWOp>(*block);
    }
  }
};

} // namespace
