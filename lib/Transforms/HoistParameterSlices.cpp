//===- HoistParameterSlices.cpp - Slices of a parameter, once per step ----===//
//
// GPT-2's fused q|k|v weight and bias are one parameter each; the q, k and v
// GEMMs read slices of them, and lowering puts the slices (an rt.slice_axis
// into a buffer of the part, in bf16 when the program runs in bf16) where
// the GEMMs are: in every forward and every backward part, so once per
// microbatch and pass. The parameters do not change within a step, so the
// slices need not either: here each such slice moves before the step's
// first part, and the same slice named again in a later part is the first
// one's buffer. A bf16 slice is cut from the weight's bf16 copy (its shadow
// slot) and lands in that same slot, which no GEMM reads (they read the
// slices), so it costs no memory held for the step: it is cut into a buffer
// that lives before the first part only (the memory plan puts it where the
// parts' buffers go) and copied into the slot once the weight's last slice
// is cut. A slice of another type (the fp32 bias pieces, or any slice of an
// fp32 program) gets a buffer held for the step. For GPT-3 175B at tp8 x
// pp16 that is 2 x 192 slicing passes over a stage's q|k|v weights a step
// saved. The update refreshes the shadow slot (AdamW from the master
// weights, or the gather of its bf16 copy under ZeRO); the next step cuts
// the slices again before its first part.
//
// Only a slice whose source is a parameter or its whole bf16 copy (defined
// at the step's top, not gathered inside a part as ZeRO-3 does) and whose
// result the part's kernels only read moves.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "dialects/Pipe/PipeOps.h"
#include "dialects/Rt/RtOps.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/IRMapping.h"
#include "llvm/ADT/MapVector.h"

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

// What a slice reads: a parameter, or its whole bf16 copy (`rt.state_of
// <shadow>`, as a bf16 program reads it), either seen through views.
struct Source {
  rt::ParamOp param;
  bool copy = false;
};

std::optional<Source> sourceOf(Value x) {
  while (auto view = x.getDefiningOp<rt::ViewOp>())
    x = view.getSource();
  if (auto param = x.getDefiningOp<rt::ParamOp>())
    return Source{param, false};
  auto state = x.getDefiningOp<rt::StateOfOp>();
  if (!state || state.getSpace() != rt::Space::Shadow || state.getOffset())
    return std::nullopt;
  if (auto param = state.getParam().getDefiningOp<rt::ParamOp>())
    return Source{param, true};
  return std::nullopt;
}

// Whether `slice` reads a parameter (or its copy) of the step's top block
// defined before `first`, and writes a buffer of its own part that the
// part's kernels only read afterwards.
bool hoistable(rt::SliceAxisOp slice, Block &top, Operation *first) {
  std::optional<Source> source = sourceOf(slice.getX());
  if (!source || source->param->getBlock() != &top ||
      !source->param->isBeforeInBlock(first))
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
void readInstead(Value from, Value to, Operation *except = nullptr) {
  auto state = to.getDefiningOp<rt::StateOfOp>();
  for (OpOperand &use : llvm::make_early_inc_range(from.getUses())) {
    if (use.getOwner() == except)
      continue;
    OpBuilder b(use.getOwner());
    use.set(state ? b.clone(*state)->getResult(0) : to);
  }
}

// Moves the ops defining a slice's source (views of a state of the
// parameter) before `at`, as copies, and makes the slice read them.
void sourceBefore(rt::SliceAxisOp slice, Operation *at) {
  SmallVector<Operation *> chain;
  Value x = slice.getX();
  while (Operation *def = x.getDefiningOp()) {
    if (isa<rt::ParamOp>(def))
      break;
    chain.push_back(def);
    if (auto view = dyn_cast<rt::ViewOp>(def))
      x = view.getSource();
    else
      break; // the state_of, whose parameter is at the top already
  }
  OpBuilder b(at);
  IRMapping map;
  for (Operation *def : llvm::reverse(chain))
    b.clone(*def, map);
  if (chain.empty())
    return;
  slice.getXMutable().assign(map.lookup(slice.getX()));
  for (Operation *def : chain)
    if (def->use_empty())
      def->erase();
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
      // The slices that move, part by part.
      SmallVector<SmallVector<rt::SliceAxisOp>> slicesOf;
      DenseSet<Operation *> moving;
      for (Operation &part : top) {
        if (!isPart(&part))
          continue;
        slicesOf.emplace_back();
        for (Operation &op : part.getRegion(0).front())
          if (auto slice = dyn_cast<rt::SliceAxisOp>(&op);
              slice && hoistable(slice, top, first)) {
            slicesOf.back().push_back(slice);
            moving.insert(slice);
          }
      }
      // Parameters whose bf16 shadow something reads already (not only
      // AdamW, which refreshes it, or a slice that moves): their slot is
      // theirs.
      DenseSet<Operation *> shadowRead;
      func.walk([&](rt::StateOfOp state) {
        if (state.getSpace() != rt::Space::Shadow)
          return;
        SmallVector<Operation *> users(state->getUsers().begin(),
                                       state->getUsers().end());
        while (!users.empty()) {
          Operation *user = users.pop_back_val();
          if (isa<rt::ViewOp>(user)) {
            users.append(user->getUsers().begin(), user->getUsers().end());
            continue;
          }
          if (!isa<rt::AdamWOp, rt::AdamWShardOp>(user) &&
              !moving.contains(user)) {
            shadowRead.insert(state.getParam().getDefiningOp());
            return;
          }
        }
      });
      // The slices moved so far, by what they read and how, and what their
      // readers read.
      DenseMap<std::pair<Operation *, Attribute>,
               std::pair<rt::SliceAxisOp, Value>>
          hoisted;
      // Elements of each parameter's bf16 shadow slot given to its slices.
      DenseMap<Operation *, int64_t> shadowUsed;
      // Slices cut from a weight's copy into its own slot: cut into a
      // buffer first, copied into the slot after the weight's last slice.
      struct InSlot {
        rt::SliceAxisOp slice;
        Value slot;
      };
      llvm::MapVector<Operation *, SmallVector<InSlot>> inSlot;
      for (ArrayRef<rt::SliceAxisOp> slices : slicesOf) {
        for (rt::SliceAxisOp slice : slices) {
          Source source = *sourceOf(slice.getX());
          auto key = std::make_pair(source.param.getOperation(),
                                    Attribute(slice->getAttrDictionary()));
          Operation *alloc = slice.getOut().getDefiningOp();
          auto it = hoisted.find(key);
          if (it != hoisted.end() &&
              it->second.first.getOut().getType() == slice.getOut().getType()) {
            slice->erase();
            readInstead(alloc->getResult(0), it->second.second);
            alloc->erase();
            continue;
          }
          // A bf16 slice goes into the parameter's bf16 shadow slot when
          // nothing reads that slot (the GEMMs read the slices); anything
          // else into a buffer of its own for the step.
          rt::ParamOp param = source.param;
          auto type = cast<MemRefType>(slice.getOut().getType());
          int64_t &used = shadowUsed[param];
          bool toSlot = type.getElementType().isBF16() &&
                        !shadowRead.contains(param) &&
                        used + type.getNumElements() <= rt::elementsOf(param);
          if (!toSlot) {
            hoisted[key] = {slice, slice.getOut()};
            sourceBefore(slice, first);
            alloc->moveBefore(first);
            slice->moveBefore(first);
            continue;
          }
          OpBuilder b(first);
          Value shadow = rt::StateOfOp::create(
              b, slice.getLoc(), type, param.getResult(),
              rt::SpaceAttr::get(b.getContext(), rt::Space::Shadow),
              b.getI64IntegerAttr(used));
          used += type.getNumElements();
          hoisted[key] = {slice, shadow};
          readInstead(alloc->getResult(0), shadow, slice);
          if (source.copy) {
            inSlot[param].push_back({slice, shadow});
            continue;
          }
          // Cut from the fp32 parameter: straight into the slot.
          slice.getOutMutable().assign(shadow);
          alloc->erase();
          sourceBefore(slice, first);
          slice->moveBefore(first);
        }
      }
      // Each weight's slices cut from its copy, then copied over it.
      for (auto &[param, slices] : inSlot) {
        for (InSlot &s : slices) {
          sourceBefore(s.slice, first);
          s.slice.getOut().getDefiningOp()->moveBefore(first);
          s.slice->moveBefore(first);
        }
        for (InSlot &s : slices) {
          OpBuilder b(first);
          s.slot.getDefiningOp()->moveBefore(first);
          rt::CopyOp::create(
              b, s.slice.getLoc(), s.slice.getOut(), s.slot,
              b.getI64IntegerAttr(
                  cast<MemRefType>(s.slot.getType()).getNumElements()));
        }
      }
    });
  }
};

} // namespace
