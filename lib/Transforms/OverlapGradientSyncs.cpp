//===- OverlapGradientSyncs.cpp - Gradient syncs in the last backward -----===//
//
// With microbatches (and so with a pipeline), the gradients of a step are
// summed over its microbatches in the gradient store, and the planned
// programs reduce them over data parallelism in the update, blocking, after
// the last backward part. Each gradient is final, though, as soon as the
// last microbatch's backward part has written it: here that part gets a
// copy of its own (run for the last microbatch of its chunk only), which
// starts each such reduction right after its last write, on the
// data-parallel stream, while that backward goes on; the update waits for
// it where it reduced before. This is what PyTorch's DDP does with
// no_sync() on all but the last microbatch, and Megatron-LM's overlapped
// gradient reduction. The same collectives on the same buffers: only when
// the data moves changes. See Passes.td.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "dialects/Dist/DistOps.h"
#include "dialects/Pipe/PipeOps.h"
#include "dialects/Rt/RtOps.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"

#include <map>

namespace tessel {
#define GEN_PASS_DEF_OVERLAPGRADIENTSYNCS
#include "tessel/Transforms/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;
namespace rt = tessel::rtir;

namespace {

using Range = std::pair<int64_t, int64_t>; // offset, elements

// The range of the gradient store a buffer operand lies in (its root's).
std::optional<Range> gradsRange(Value v) {
  if (!isa<MemRefType>(v.getType()))
    return std::nullopt;
  auto view = rt::rootBuffer(v).getDefiningOp<rt::BufferOp>();
  if (!view || view.getSpace() != rt::Space::Grads)
    return std::nullopt;
  return Range{(int64_t)view.getOffset(), rt::elementsOf(view.getResult())};
}

bool overlap(Range a, Range b) {
  return a.first < b.first + b.second && b.first < a.first + a.second;
}

bool touches(Operation *op, Range r) {
  for (Value v : op->getOperands())
    if (std::optional<Range> g = gradsRange(v); g && overlap(*g, r))
      return true;
  return false;
}

// (A part's yield hands values on: it touches nothing.)
bool touchesIn(Operation *top, Range r) {
  bool found = false;
  top->walk([&](Operation *op) {
    found |= !op->hasTrait<OpTrait::IsTerminator>() && touches(op, r);
  });
  return found;
}

// A data-parallel reduction of a run of the gradient store, in place: an
// all-reduce of one gradient, or ZeRO-1's reduce-scatter into its pieces.
std::optional<Range> syncOf(Operation *op) {
  Value buffer;
  AxisSet axes;
  if (auto ar = dyn_cast<rt::AllReduceOp>(op)) {
    if (ar.getBuffers().size() != 1)
      return std::nullopt;
    buffer = ar.getBuffers()[0];
    axes = ar.getAxes();
  } else if (auto rs = dyn_cast<rt::ReduceScatterShardsOp>(op)) {
    if (rs.getOut())
      return std::nullopt;
    buffer = rs.getBuffer();
    axes = rs.getAxes();
  } else {
    return std::nullopt;
  }
  if (!axes.intersects(AxisSet::dataParallel()))
    return std::nullopt;
  if (!buffer.getDefiningOp<rt::BufferOp>())
    return std::nullopt;
  return gradsRange(buffer);
}

LogicalResult overlapSyncs(func::FuncOp func) {
  pipe::UpdateOp update;
  SmallVector<Operation *> parts;
  for (Operation &op : func.getBody().front()) {
    if (auto u = dyn_cast<pipe::UpdateOp>(op))
      update = u;
    else if (isa<pipe::ForwardPassOp, pipe::BackwardPassOp>(op))
      parts.push_back(&op);
  }
  if (!update)
    return success();
  Block &body = update.getBody().front();

  // The syncs that may move: the first op of the update to touch their
  // run, written by one backward part alone.
  struct Move {
    Operation *sync;
    Range range;
    Operation *part;
  };
  SmallVector<Move> moves;
  SmallVector<Range> seen;
  for (Operation &op : body) {
    std::optional<Range> r = syncOf(&op);
    bool first =
        r && llvm::none_of(seen, [&](Range s) { return overlap(s, *r); });
    for (Value v : op.getOperands())
      if (std::optional<Range> g = gradsRange(v))
        seen.push_back(*g);
    if (!first)
      continue;
    Operation *writer = nullptr;
    bool alone = true;
    for (Operation *part : parts) {
      if (!touchesIn(part, *r))
        continue;
      if (writer || !isa<pipe::BackwardPassOp>(part))
        alone = false;
      writer = part;
    }
    if (writer && alone)
      moves.push_back({&op, *r, writer});
  }
  if (moves.empty())
    return success();

  MLIRContext *ctx = func.getContext();
  int64_t slot = 0;
  if (auto slots = func->getAttrOfType<IntegerAttr>("rt.request_slots"))
    slot = slots.getInt();
  // One copy of each backward part that writes a moved run, for the last
  // microbatch: its top-level ops stand where the original's do.
  // (The copy's ops as they were copied, by position: the starts inserted
  // into it do not move what the next one goes after.)
  std::map<Operation *, SmallVector<Operation *>> copyOf;
  for (const Move &m : moves) {
    SmallVector<Operation *> &copied = copyOf[m.part];
    if (copied.empty()) {
      OpBuilder b(m.part);
      b.setInsertionPointAfter(m.part);
      Operation *copy = b.clone(*m.part);
      copy->setAttr("pipe.last_microbatch", UnitAttr::get(ctx));
      for (Operation &op : copy->getRegion(0).front())
        copied.push_back(&op);
    }
    // After the last op of the part that touches the run.
    int64_t last = -1, index = 0;
    for (Operation &op : m.part->getRegion(0).front()) {
      if (touchesIn(&op, m.range))
        last = index;
      ++index;
    }
    Operation *after = copied[last];
    OpBuilder b(ctx);
    b.setInsertionPointAfter(after);
    Location loc = m.sync->getLoc();
    auto view =
        cast<rt::BufferOp>(b.clone(*m.sync->getOperand(0).getDefiningOp()));
    Type request = rt::RequestType::get(ctx);
    IntegerAttr at = b.getI64IntegerAttr(slot);
    if (auto ar = dyn_cast<rt::AllReduceOp>(m.sync))
      rt::AllReduceStartOp::create(b, loc, request, ValueRange{view},
                                   ar.getAxesAttr(), at);
    else
      rt::ReduceScatterShardsStartOp::create(
          b, loc, request, ValueRange{view},
          cast<rt::ReduceScatterShardsOp>(m.sync).getAxesAttr(), at);
    // The update waits where it reduced.
    OpBuilder w(m.sync);
    rt::WaitRequestsOp::create(w, loc, slot, 1);
    Operation *source = m.sync->getOperand(0).getDefiningOp();
    m.sync->erase();
    if (source->use_empty())
      source->erase();
    ++slot;
  }
  func->setAttr("rt.request_slots",
                IntegerAttr::get(IntegerType::get(ctx, 64), slot));
  return success();
}

struct OverlapGradientSyncsPass
    : tessel::impl::OverlapGradientSyncsBase<OverlapGradientSyncsPass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    for (auto func : module.getOps<func::FuncOp>())
      if (func->hasAttr("pipe.rank") && failed(overlapSyncs(func)))
        return signalPassFailure();
  }
};

} // namespace
