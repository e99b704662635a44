//===- ShardOptimizer.cpp - AdamW's state sharded over data parallel ------===//
//
// ZeRO-1 (Megatron's distributed optimizer) on the planned rank programs.
// Every gradient collective over dp whose buffer is a run of the gradient
// store becomes a reduce-scatter: the run's n elements are cut into
// ceil(n / dp) pieces in dp order, and rank k keeps the sum of piece k in
// place. AdamW then updates only the elements of the rank's pieces, with
// moments for those alone (the moment stores hold the pieces one after the
// other, in gradient-store order), the gradient norm sums the squares of the
// pieces and adds them over dp, and each run of the parameter store is
// all-gathered after the update. A parameter whose gradient is synchronised
// otherwise (not as a run of the gradient store) keeps whole moments, after
// the pieces, and its squares are counted by dp rank 0. See Passes.td.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "dialects/Rt/RtOps.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"

namespace tessel {
#define GEN_PASS_DEF_SHARDOPTIMIZER
#include "tessel/Transforms/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;
namespace rt = tessel::rtir;

namespace {

// A run of the gradient store reduced by one collective, and where its
// pieces' moments live.
struct Run {
  int64_t start, length, piece, state;
};

int64_t elementsOf(Value v) {
  return cast<MemRefType>(v.getType()).getNumElements();
}

// The gradient-store run of `v`, if it is a placed view of that store.
std::optional<std::pair<int64_t, int64_t>> gradRange(Value v) {
  auto view = v.getDefiningOp<rt::BufferOp>();
  if (!view || view.getSpace() != rt::Space::Grads)
    return std::nullopt;
  return std::make_pair((int64_t)view.getOffset(), elementsOf(v));
}

class Sharder {
public:
  Sharder(func::FuncOp func, int64_t dp)
      : func(func), ctx(func.getContext()), dp(dp) {}
  LogicalResult run();

private:
  Value view(OpBuilder &b, Location loc, Type type, rt::Space space,
             int64_t offset) {
    return rt::BufferOp::create(b, loc, type, space, offset);
  }
  const Run *runOf(int64_t offset, int64_t n) const {
    for (const Run &r : runs)
      if (r.start <= offset && offset + n <= r.start + r.length)
        return &r;
    return nullptr;
  }
  dist::AxesAttr dpAxes() { return dist::AxesAttr::get(ctx, MeshAxis::DP); }
  LogicalResult collectRuns();
  void shardSyncs();
  LogicalResult shardUpdates();
  void shardNorm();

  func::FuncOp func;
  MLIRContext *ctx;
  int64_t dp;
  SmallVector<Run> runs;
  SmallVector<Operation *> syncs;
  int64_t stateElems = 0;
};

// The gradient collectives over dp, and the runs they reduce.
LogicalResult Sharder::collectRuns() {
  func.walk([&](Operation *op) {
    AxisSet axes;
    OperandRange buffers = op->getOperands();
    if (auto ar = dyn_cast<rt::AllReduceOp>(op))
      axes = ar.getAxes();
    else if (auto start = dyn_cast<rt::AllReduceStartOp>(op))
      axes = start.getAxes();
    else
      return;
    if (!axes.contains(MeshAxis::DP))
      return;
    bool any = false;
    for (Value b : buffers)
      if (auto range = gradRange(b)) {
        any = true;
        runs.push_back({range->first, range->second, 0, 0});
      }
    if (any)
      syncs.push_back(op);
  });
  llvm::sort(runs, [](const Run &a, const Run &b) { return a.start < b.start; });
  for (size_t k = 0; k < runs.size(); ++k) {
    if (k && runs[k].start < runs[k - 1].start + runs[k - 1].length)
      return func.emitError("tessel-shard-optimizer: gradient runs [")
             << runs[k - 1].start << ", +" << runs[k - 1].length << ") and ["
             << runs[k].start << ", +" << runs[k].length
             << ") overlap; each gradient must be synchronised once";
    runs[k].piece = (runs[k].length + dp - 1) / dp;
    runs[k].state = stateElems;
    stateElems += runs[k].piece;
  }
  return success();
}

// Each gradient run is reduce-scattered over dp instead of all-reduced (a
// collective over dp and other axes first sums over the others, in full).
void Sharder::shardSyncs() {
  for (Operation *op : syncs) {
    OpBuilder b(op);
    Location loc = op->getLoc();
    AxisSet axes;
    std::optional<int64_t> slot;
    bool started = false;
    if (auto ar = dyn_cast<rt::AllReduceOp>(op)) {
      axes = ar.getAxes();
    } else {
      auto start = cast<rt::AllReduceStartOp>(op);
      axes = start.getAxes();
      slot = start.getSlot();
      started = true;
    }
    AxisSet rest = axes - AxisSet(MeshAxis::DP);
    auto restAttr = dist::AxesAttr::get(ctx, rest);
    Type request = rt::RequestType::get(ctx);
    // The request is still handed on through the parts' yields (the waits
    // use slots): the first new start's stands for it.
    Value newRequest;
    for (auto [k, buffer] : llvm::enumerate(op->getOperands())) {
      bool isRun = gradRange(buffer).has_value();
      auto slotOf = [&]() -> IntegerAttr {
        return slot ? b.getI64IntegerAttr(*slot + k) : IntegerAttr();
      };
      if (!isRun) {
        if (started) {
          auto start = rt::AllReduceStartOp::create(
              b, loc, request, ValueRange{buffer},
              dist::AxesAttr::get(ctx, axes), slotOf());
          if (!newRequest)
            newRequest = start.getRequest();
        }
        else
          rt::AllReduceOp::create(b, loc, ValueRange{buffer},
                                  dist::AxesAttr::get(ctx, axes));
        continue;
      }
      if (!rest.empty())
        rt::AllReduceOp::create(b, loc, ValueRange{buffer}, restAttr);
      if (started) {
        auto start = rt::ReduceScatterShardsStartOp::create(
            b, loc, request, ValueRange{buffer}, dpAxes(), slotOf());
        if (!newRequest)
          newRequest = start.getRequest();
      } else
        rt::ReduceScatterShardsOp::create(
            b, loc, buffer, b.getI64IntegerAttr(elementsOf(buffer)), dpAxes());
    }
    if (started)
      op->getResult(0).replaceAllUsesWith(newRequest);
    op->erase();
  }
}

// AdamW on this rank's pieces; the parameter runs gathered after the update.
LogicalResult Sharder::shardUpdates() {
  DenseMap<int64_t, rt::ParamOp> paramAt;
  func.walk([&](rt::ParamOp p) {
    if (auto offset = p.getOffset())
      paramAt[*offset] = p;
  });
  SmallVector<rt::AdamWOp> updates;
  func.walk([&](rt::AdamWOp op) { updates.push_back(op); });
  if (updates.empty())
    return success();
  Block *block = updates.front()->getBlock();
  Operation *last = updates.front();
  Value shadow;
  int64_t whole = stateElems; // moments of parameters outside every run
  for (rt::AdamWOp op : updates) {
    if (op->getBlock() != block)
      return op.emitError("tessel-shard-optimizer: the updates are not in "
                          "one block");
    if (last->isBeforeInBlock(op))
      last = op;
    OpBuilder b(op);
    Location loc = op.getLoc();
    int64_t n = op.getN();
    std::optional<std::pair<int64_t, int64_t>> range = gradRange(op.getGrad());
    const Run *r = range ? runOf(range->first, n) : nullptr;
    auto paramView = op.getParam().getDefiningOp<rt::BufferOp>();
    rt::ParamOp param =
        paramView ? paramAt.lookup(paramView.getOffset()) : rt::ParamOp();
    if (op.getShadow())
      shadow = op.getShadow();
    if (!r) {
      // Whole moments after the pieces.
      Type type = op.getM().getType();
      op.getMMutable().assign(view(b, loc, type, rt::Space::AdamM, whole));
      op.getVMutable().assign(view(b, loc, type, rt::Space::AdamV, whole));
      if (param)
        param.setOptimizerShard(ArrayRef<int64_t>{whole, 0, 0});
      whole += n;
      continue;
    }
    int64_t inRun = range->first - r->start;
    Type pieceType = MemRefType::get({r->piece}, b.getF32Type());
    Value m = view(b, loc, pieceType, rt::Space::AdamM, r->state);
    Value v = view(b, loc, pieceType, rt::Space::AdamV, r->state);
    auto sharded = rt::AdamWShardOp::create(
        b, loc, op.getParam(), op.getShadow(), op.getGrad(), m, v,
        op.getNorm(), op.getLr(), op.getCount(), op.getNAttr(),
        b.getI64IntegerAttr(inRun), b.getI64IntegerAttr(r->piece), dpAxes(),
        op.getBeta1Attr(), op.getBeta2Attr(), op.getEpsAttr(),
        op.getWeightDecayAttr(), op.getMaxGradNormAttr());
    if (param)
      param.setOptimizerShard(ArrayRef<int64_t>{r->state, inRun, r->piece});
    if (last == op.getOperation())
      last = sharded;
    op.erase();
  }
  // Every rank's pieces of the updated parameters, to every rank.
  OpBuilder b(ctx);
  b.setInsertionPointAfter(last);
  Location loc = last->getLoc();
  for (const Run &r : runs) {
    Value params = view(b, loc, MemRefType::get({r.length}, b.getF32Type()),
                        rt::Space::Params, r.start);
    Value copy;
    if (shadow)
      copy = view(b, loc,
                  MemRefType::get({r.length}, cast<MemRefType>(shadow.getType())
                                                  .getElementType()),
                  rt::Space::Shadow, r.start);
    rt::AllGatherShardsOp::create(b, loc, params, copy,
                                  b.getI64IntegerAttr(r.length), dpAxes());
  }
  func->setAttr("rt.optimizer_elems", b.getI64IntegerAttr(whole));
  return success();
}

// The norm's squares: of this rank's pieces, and (for gradients outside the
// runs, which every dp rank holds alike) on dp rank 0; then summed over dp.
void Sharder::shardNorm() {
  SmallVector<rt::SumSquaresOp> squares;
  func.walk([&](rt::SumSquaresOp op) { squares.push_back(op); });
  for (rt::SumSquaresOp op : squares) {
    OpBuilder b(op);
    int64_t n = op.getN();
    std::optional<std::pair<int64_t, int64_t>> range = gradRange(op.getX());
    const Run *r = range ? runOf(range->first, n) : nullptr;
    int64_t inRun = r ? range->first - r->start : 0;
    int64_t piece = r ? r->piece : n;
    rt::SumSquaresShardOp::create(b, op.getLoc(), op.getX(), op.getAcc(),
                                  op.getNAttr(), b.getI64IntegerAttr(inRun),
                                  b.getI64IntegerAttr(piece), dpAxes());
    op.erase();
  }
  SmallVector<rt::SqrtSumOp> roots;
  func.walk([&](rt::SqrtSumOp op) { roots.push_back(op); });
  for (rt::SqrtSumOp op : roots) {
    OpBuilder b(op);
    rt::AllReduceOp::create(b, op.getLoc(), ValueRange{op.getAcc()},
                            dpAxes());
  }
}

LogicalResult Sharder::run() {
  if (failed(collectRuns()))
    return failure();
  if (runs.empty())
    return success();
  shardSyncs();
  shardNorm();
  return shardUpdates();
}

struct ShardOptimizerPass
    : tessel::impl::ShardOptimizerBase<ShardOptimizerPass> {
  using ShardOptimizerBase::ShardOptimizerBase;
  void runOnOperation() override {
    ModuleOp module = getOperation();
    if (zero < 0 || zero > 1) {
      module.emitError("tessel-shard-optimizer: zero = ")
          << zero << " is not built (0 or 1)";
      return signalPassFailure();
    }
    int64_t dp = dist::meshOf(module)[MeshAxis::DP];
    if (zero == 0 || dp == 1)
      return;
    for (auto func : module.getOps<func::FuncOp>())
      if (func->hasAttr("pipe.rank") &&
          failed(Sharder(func, dp).run()))
        return signalPassFailure();
  }
};

} // namespace
