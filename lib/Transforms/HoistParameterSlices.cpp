//===- HoistParameterSlices.cpp - Slices of a parameter, once per step ----===//
//
// GPT-2's fused q|k|v weight and bias are one parameter each; the q, k and v
// GEMMs read slices of them, and lowering puts the slices (an rt.slice_axis
// into a buffer of the part, in bf16 when the program runs in bf16) where
// the GEMMs are: in every forward and every backward part, so once per
// microbatch and pass. The parameters do not change within a step, so the
// slices need not either: here each such slice moves before the step's
// first part, and the same slice named again in a later part is the first
// one's buffer. A bf16 slice lands in the weight's own bf16 shadow slot,
// which no GEMM reads (they read the slices), so it costs no memory; a
// slice of another type (the fp32 bias pieces, or any slice of an fp32
// program) gets a buffer held for the step. For GPT-3 175B at tp8 x pp16
// that is 2 x 192 slicing passes over a stage's q|k|v weights a step saved.
// AdamW refreshes the shadow slot from the master weights at the end of the
// step; the next step cuts the slices again before its first part.
//
// Only a slice whose source is a parameter (defined at the step's top, not
// gathered inside a part as ZeRO-3 does) and whose result the part's kernels
// only read moves.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "dialects/Pipe/PipeOps.h"
#include "dialects/Rt/RtOps.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"

namespace tessel {
#define GEN_PASS_DEF_HOISTPARAMETERSLICES
#include "tessel/Transforms/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;
namespace rt = tessel::rtir;

namespace {

bool isPart(Operation *op) {
  return isa<pipe::ForwardPassOp, pipe::BackwardPassOp>(op);
}

// Whether `slice` reads a parameter of the step's top block defined before
// `first`, and writes a buffer of its own part that the part's kernels only
// read afterwards.
bool hoistable(rt::SliceAxisOp slice, Block &top, Operation *first) {
  Operation *source = slice.getX().getDefiningOp();
  if (!isa_and_nonnull<rt::ParamOp>(source) || source->getBlock() != &top ||
      !source->isBeforeInBlock(first))
    return false;
  auto alloc = slice.getOut().getDefiningOp<rt::AllocOp>();
  if (!alloc || alloc->getBlock() != slice->getBlock())
    return false;
  for (OpOperand &use : alloc.getResult().getUses()) {
    Operation *user = use.getOwner();
    if (user == slice.getOperation())
      continue;
    if (user->getBlock() != slice->getBlock() ||
        !slice->isBeforeInBlock(user) ||
        !rt::onlyReadsOperand(user, use.getOperandNumber()))
      return false;
  }
  return true;
}

// Makes the readers of `from` read `to`, a buffer of the step's top: a
// slot of a parameter's state is named again next to each reader (each
// part refers only to its own ops and the step's parameters; the memory
// plan places an allocation's readers itself).
void readInstead(Value from, Value to) {
  auto state = to.getDefiningOp<rt::StateOfOp>();
  if (!state) {
    from.replaceAllUsesWith(to);
    return;
  }
  for (OpOperand &use : llvm::make_early_inc_range(from.getUses())) {
    OpBuilder b(use.getOwner());
    use.set(b.clone(*state)->getResult(0));
  }
}

struct HoistParameterSlicesPass
    : public tessel::impl::HoistParameterSlicesBase<HoistParameterSlicesPass> {
  void runOnOperation() override {
    getOperation().walk([&](func::FuncOp func) {
      if (func.getBody().empty())
        return;
      Block &top = func.getBody().front();
      // Before the first part, and before what the step sends or receives
      // ahead of its parts (a tied weight), so that those stay together.
      Operation *first = nullptr;
      bool parts = false;
      for (Operation &op : top) {
        if (!first && (isPart(&op) || isa<pipe::PipeDialect>(op.getDialect()) ||
                       isa<rt::CommunicationOpInterface>(op)))
          first = &op;
        parts |= isPart(&op);
      }
      if (!first || !parts)
        return;
      // Parameters whose bf16 shadow something reads already (not only
      // AdamW, which refreshes it): their slot is theirs.
      DenseSet<Operation *> shadowRead;
      func.walk([&](rt::StateOfOp state) {
        if (state.getSpace() == rt::Space::Shadow &&
            llvm::any_of(state->getUsers(), [](Operation *user) {
              return !isa<rt::AdamWOp, rt::AdamWShardOp>(user);
            }))
          shadowRead.insert(state.getParam().getDefiningOp());
      });
      // The slices moved so far, by what they read and how.
      DenseMap<std::pair<Operation *, Attribute>, rt::SliceAxisOp> hoisted;
      // Elements of each parameter's bf16 shadow slot given to its slices.
      DenseMap<Operation *, int64_t> shadowUsed;
      for (Operation &part : llvm::make_early_inc_range(top)) {
        if (!isPart(&part))
          continue;
        SmallVector<rt::SliceAxisOp> slices;
        for (Operation &op : part.getRegion(0).front())
          if (auto slice = dyn_cast<rt::SliceAxisOp>(&op);
              slice && hoistable(slice, top, first))
            slices.push_back(slice);
        for (rt::SliceAxisOp slice : slices) {
          auto key = std::make_pair(slice.getX().getDefiningOp(),
                                    Attribute(slice->getAttrDictionary()));
          Operation *alloc = slice.getOut().getDefiningOp();
          auto it = hoisted.find(key);
          if (it != hoisted.end() &&
              it->second.getOut().getType() == slice.getOut().getType()) {
            slice->erase();
            readInstead(alloc->getResult(0), it->second.getOut());
            alloc->erase();
            continue;
          }
          slice->moveBefore(first);
          hoisted[key] = slice;
          // A bf16 slice goes into the parameter's bf16 shadow slot when
          // nothing reads that slot (the GEMMs read the slices); anything
          // else into a buffer of its own for the step.
          auto param = cast<rt::ParamOp>(slice.getX().getDefiningOp());
          auto type = cast<MemRefType>(slice.getOut().getType());
          int64_t &used = shadowUsed[param];
          if (type.getElementType().isBF16() && !shadowRead.contains(param) &&
              used + type.getNumElements() <= rt::elementsOf(param)) {
            OpBuilder b(slice);
            Value shadow = rt::StateOfOp::create(
                b, slice.getLoc(), type, param.getResult(),
                rt::SpaceAttr::get(b.getContext(), rt::Space::Shadow),
                b.getI64IntegerAttr(used));
            used += type.getNumElements();
            slice.getOutMutable().assign(shadow);
            readInstead(alloc->getResult(0), shadow);
            alloc->erase();
          } else {
            alloc->moveBefore(slice);
          }
        }
      }
    });
  }
};

} // namespace
