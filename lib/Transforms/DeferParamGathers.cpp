//===- DeferParamGathers.cpp - ZeRO-1/2 gathers under the next forward ----===//
//
// Under ZeRO-1 and 2 the update gathers each run's updated pieces and waits
// for all of them before the step ends: the last runs' gathers are exposed.
// Megatron-LM overlaps them with the next step's forward instead (its
// distributed optimizer's overlapped parameter gather). Here the gathers
// move to the start of the next step, before its parts, each waited for
// right before the first op that touches the run: in the forward part that
// reads it first, on that part's first run (`rt.wait_requests if %first`),
// or before a top-level op of the step. Every request is started and waited
// for within one step, so a step stays one unit (a CUDA graph captures it).
// The pieces the gathers read are the last update's; at the very first step
// they are the initial parameters' own pieces, which the gathers leave as
// they are. @sync_params gathers them blocking, for the runtime to run
// before it reads the parameters between steps (a checkpoint, a save).
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "dialects/Rt/RtOps.h"
#include "tessel/Transforms/BufferRegion.h"

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/IRMapping.h"
#include "llvm/ADT/DenseSet.h"
#include "llvm/ADT/Sequence.h"

#include <numeric>

namespace tessel {
#define GEN_PASS_DEF_DEFERPARAMGATHERS
#include "tessel/Transforms/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;
namespace rt = tessel::rtir;

namespace {

// A constant i1 operand's value, if it is one.
std::optional<bool> constantFlag(Value v) {
  auto c = v.getDefiningOp<arith::ConstantOp>();
  if (!c)
    return std::nullopt;
  auto i = dyn_cast<IntegerAttr>(c.getValue());
  if (!i || !c.getType().isInteger(1))
    return std::nullopt;
  return i.getInt() != 0;
}

// Clones the buffers and views `op` reads into `b`'s place, mapped.
void cloneOperands(OpBuilder &b, Operation *op, IRMapping &map) {
  for (Value v : op->getOperands()) {
    SmallVector<Operation *> chain;
    for (Operation *def = v.getDefiningOp();
         def && !map.contains(def->getResult(0));
         def = def->getNumOperands() ? def->getOperand(0).getDefiningOp()
                                     : nullptr)
      chain.push_back(def);
    for (Operation *def : llvm::reverse(chain))
      b.clone(*def, map);
  }
}

struct Gather {
  rt::AllGatherShardsStartOp start;
  SmallVector<BufferRegion> regions; // the run, its piece, its bf16 copy
  int64_t slot = 0;
  bool touchedBy(Operation *op) const {
    return llvm::any_of(regions,
                        [&](const BufferRegion &r) { return touches(op, r); });
  }
};

// The update's waits for the gathers leave it: a wait's slot whose last
// start is one of the gathers (a slot may serve another collective first).
void dropWaits(Block &update, ArrayRef<Gather> gathers) {
  DenseSet<Operation *> deferred;
  for (const Gather &g : gathers)
    deferred.insert(rt::AllGatherShardsStartOp(g.start).getOperation());
  DenseMap<int64_t, bool> lastStartDeferred;
  for (Operation &op : llvm::make_early_inc_range(update)) {
    if (auto slot = op.getAttrOfType<IntegerAttr>("slot")) {
      lastStartDeferred[slot.getInt()] = deferred.contains(&op);
      continue;
    }
    auto wait = dyn_cast<rt::WaitRequestsOp>(op);
    if (!wait)
      continue;
    int64_t first = wait.getFirst(), end = first + wait.getCount();
    auto isDeferred = [&](int64_t s) { return lastStartDeferred.lookup(s); };
    if (llvm::none_of(llvm::seq(first, end), isDeferred))
      continue;
    OpBuilder b(wait);
    for (int64_t s = first; s < end;) {
      if (isDeferred(s)) {
        lastStartDeferred[s] = false;
        ++s;
        continue;
      }
      int64_t k = s;
      while (k < end && !isDeferred(k))
        ++k;
      rt::WaitRequestsOp::create(b, wait.getLoc(), wait.getWhen(), s, k - s);
      s = k;
    }
    wait.erase();
  }
}

// Each gather moves before `first` (the step's first op that is not a
// declaration), with a slot of its own from `base` on, after the clones of
// the buffers it reads. Returns the last of those clones.
Operation *moveToStep(Operation *first, int64_t base,
                      MutableArrayRef<Gather> gathers) {
  OpBuilder b(first);
  SmallVector<IRMapping> maps(gathers.size());
  for (auto [k, g] : llvm::enumerate(gathers))
    cloneOperands(b, g.start, maps[k]);
  Operation *lastBuffer = first->getPrevNode();
  for (auto [k, g] : llvm::enumerate(gathers)) {
    g.slot = base + (int64_t)k;
    auto moved = cast<rt::AllGatherShardsStartOp>(b.clone(*g.start, maps[k]));
    moved.setSlotAttr(b.getI64IntegerAttr(g.slot));
    SmallVector<Value> operands(g.start->getOperands());
    g.start.erase();
    for (Value v : operands)
      for (Operation *def = v.getDefiningOp(); def && def->use_empty();) {
        Operation *next = def->getNumOperands()
                              ? def->getOperand(0).getDefiningOp()
                              : nullptr;
        def->erase();
        def = next;
      }
    g.start = moved;
  }
  return lastBuffer;
}

// Whether `call` may wait in its part on the part's first run: the part's
// first call passes true and every other false.
bool firstRunGates(ModuleOp program, Block &body, func::CallOp call,
                   func::FuncOp callee) {
  if (partOf(program, call) == "update" || call.getNumOperands() < 2 ||
      callee.getNumArguments() < 2 ||
      constantFlag(call.getOperand(1)) != std::optional<bool>(true))
    return false;
  return llvm::all_of(body.getOps<func::CallOp>(), [&](func::CallOp other) {
    return other == call || other.getCallee() != call.getCallee() ||
           constantFlag(other.getOperand(1)) == std::optional<bool>(false);
  });
}

// Waits for each gather before the first op of the step that touches its
// run, or in the part that does, on its first run; a run nothing touches at
// the step's end. Returns, per gather, when the step needs it: the index of
// the step's op (or call) it is waited for before, then of the part's op.
std::vector<std::pair<int64_t, int64_t>>
placeWaits(ModuleOp program, Block &body, ArrayRef<Gather> gathers) {
  DenseSet<Operation *> moved;
  for (const Gather &g : gathers)
    moved.insert(rt::AllGatherShardsStartOp(g.start).getOperation());
  DenseMap<Operation *, int64_t> indexOf;
  for (Operation &op : body)
    indexOf[&op] = indexOf.size();
  std::vector<std::pair<int64_t, int64_t>> neededAt(gathers.size(),
                                                    {INT64_MAX, INT64_MAX});
  auto waitBefore = [&](Operation *op, Value when, int64_t slot) {
    OpBuilder w(op);
    rt::WaitRequestsOp::create(w, op->getLoc(), when, slot, 1);
  };
  std::vector<size_t> pending(gathers.size());
  std::iota(pending.begin(), pending.end(), 0);
  for (Operation &op : llvm::make_early_inc_range(body)) {
    if (pending.empty())
      break;
    if (moved.contains(&op) || isa<rt::ParamOp, rt::BufferOp, rt::ViewOp,
                                   arith::ConstantOp, rt::WaitRequestsOp>(op))
      continue;
    auto call = dyn_cast<func::CallOp>(op);
    func::FuncOp callee =
        call ? program.lookupSymbol<func::FuncOp>(call.getCallee())
             : func::FuncOp();
    std::vector<size_t> touched, left;
    for (size_t k : pending)
      (gathers[k].touchedBy(callee ? callee.getOperation() : &op) ? touched
                                                                  : left)
          .push_back(k);
    if (touched.empty())
      continue;
    pending = std::move(left);
    if (!callee || !firstRunGates(program, body, call, callee)) {
      for (size_t k : touched) {
        waitBefore(&op, Value(), gathers[k].slot);
        neededAt[k] = {indexOf.lookup(&op), 0};
      }
      continue;
    }
    Block &part = callee.getBody().front();
    for (size_t k : touched)
      for (auto [i, inner] : llvm::enumerate(part))
        if (gathers[k].touchedBy(&inner)) {
          waitBefore(&inner, part.getArgument(1), gathers[k].slot);
          neededAt[k] = {indexOf.lookup(&op), (int64_t)i};
          break;
        }
  }
  for (size_t k : pending)
    waitBefore(body.getTerminator(), Value(), gathers[k].slot);
  return neededAt;
}

// @sync_params: the same gathers, blocking, for the runtime.
void addSyncParams(func::FuncOp step, ArrayRef<Gather> gathers) {
  OpBuilder b(step);
  b.setInsertionPointAfter(step);
  auto sync = func::FuncOp::create(b, step.getLoc(), "sync_params",
                                   b.getFunctionType({}, {}));
  b.setInsertionPointToStart(sync.addEntryBlock());
  for (const Gather &g : gathers) {
    rt::AllGatherShardsStartOp start = g.start;
    IRMapping map;
    cloneOperands(b, start, map);
    rt::AllGatherShardsOp::create(
        b, start.getLoc(), map.lookupOrDefault(start.getBuffer()),
        start.getFrom() ? map.lookupOrDefault(start.getFrom()) : Value(),
        start.getShadow() ? map.lookupOrDefault(start.getShadow()) : Value(),
        start.getNAttr(), start.getAxesAttr());
  }
  func::ReturnOp::create(b, step.getLoc());
}

struct DeferParamGathersPass
    : tessel::impl::DeferParamGathersBase<DeferParamGathersPass> {
  void runOnOperation() override {
    ModuleOp top = getOperation();
    SmallVector<ModuleOp> programs(top.getOps<ModuleOp>());
    if (programs.empty())
      programs.push_back(top);
    for (ModuleOp program : programs)
      if (failed(defer(program)))
        return signalPassFailure();
  }

  LogicalResult defer(ModuleOp program) {
    auto step = program.lookupSymbol<func::FuncOp>("train_step");
    if (!step)
      return success();
    func::CallOp updateCall;
    for (auto call : step.getBody().getOps<func::CallOp>())
      if (partOf(program, call) == "update")
        updateCall = call;
    if (!updateCall)
      return success();
    auto update = program.lookupSymbol<func::FuncOp>(updateCall.getCallee());
    Block &updateBody = update.getBody().front();

    std::vector<Gather> gathers;
    for (auto start : updateBody.getOps<rt::AllGatherShardsStartOp>()) {
      Gather g{start, {}, 0};
      for (Value v : start->getOperands()) {
        std::optional<BufferRegion> r = regionOf(v);
        if (!r)
          return start.emitOpError("gathers a buffer that is not placed; "
                                   "run tessel-plan-memory first");
        g.regions.push_back(*r);
      }
      if (!start.getSlot())
        return start.emitOpError("has no request slot");
      gathers.push_back(std::move(g));
    }
    if (gathers.empty())
      return success();
    // What the update does after a gather, but for waiting for it, must not
    // touch the run (the gather is the update's last word on it); should it,
    // the gathers stay where they are.
    for (const Gather &g : gathers)
      for (Operation *op = g.start->getNextNode(); op; op = op->getNextNode())
        if (!isa<rt::WaitRequestsOp, rt::BufferOp, rt::ViewOp>(op) &&
            g.touchedBy(op))
          return success();
    dropWaits(updateBody, gathers);

    // Slots of their own after the program's, at the step's start.
    int64_t base = 0;
    if (auto a = program->getAttrOfType<IntegerAttr>("rt.request_slots"))
      base = a.getInt();
    program->setAttr(
        "rt.request_slots",
        IntegerAttr::get(IntegerType::get(program.getContext(), 64),
                         base + (int64_t)gathers.size()));
    Block &body = step.getBody().front();
    Operation *first = body.getTerminator();
    for (Operation &op : body)
      if (!isa<rt::ParamOp, rt::BufferOp, rt::ViewOp, arith::ConstantOp>(op)) {
        first = &op;
        break;
      }
    Operation *lastBuffer = moveToStep(first, base, gathers);
    std::vector<std::pair<int64_t, int64_t>> neededAt =
        placeWaits(program, body, gathers);
    // One after the other on the wire: the first needed starts first.
    std::vector<size_t> order(gathers.size());
    std::iota(order.begin(), order.end(), 0);
    llvm::stable_sort(
        order, [&](size_t a, size_t c) { return neededAt[a] < neededAt[c]; });
    for (size_t k : order) {
      gathers[k].start->moveAfter(lastBuffer);
      lastBuffer = gathers[k].start;
    }
    addSyncParams(step, gathers);
    return success();
  }
};

} // namespace
