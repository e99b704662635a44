//===- ShardOptimizer.cpp - ZeRO: training state sharded over dp ----------===//
//
// (Long by design: the three ZeRO levels share one analysis of the
// gradient runs, one packing of what stays whole and one staging scheme,
// and each level extends the one below.)
//
// ZeRO-1 (Megatron's distributed optimizer) on the planned rank programs.
// (Under expert parallelism a dense parameter's run, summed over dp x ep,
// is cut over dp x ep, and under context parallelism every run over
// dp x cp: "dp" below is the run's group.)
// Every gradient collective over dp whose buffer is a run of the gradient
// store becomes a reduce-scatter: the run's n elements are cut into
// ceil(n / dp) pieces in dp order, and rank k keeps the sum of piece k in
// place. AdamW then updates only the elements of the rank's pieces, with
// moments for those alone (the moment stores hold the pieces one after the
// other, in gradient-store order), the gradient norm sums the squares of the
// pieces and adds them over dp, and each run of the parameter store is
// all-gathered after the update. A parameter whose gradient is synchronised
// otherwise (not as a run of the gradient store) keeps whole moments, after
// the pieces, and its squares are counted by dp rank 0.
//
// ZeRO-2 keeps the gradients as pieces too. The gradient store becomes:
// the pieces (laid out like the moments), a piece-sized buffer that a
// microbatch's piece is reduced into before it is added to the pieces
// (with several microbatches), the gradients outside every run, and a
// staging region where a backward part writes a run's gradients whole; the
// run's reduce-scatter into its piece starts right after the part's last
// write to it and is waited for after the next run's (one in flight), and
// runs whose writes and reductions do not overlap share staging.
//
// ZeRO-3 keeps the parameters of those runs as pieces as well: each part
// gathers a run whole into a slot of the parameter store before its first
// read of it (the next run's gather in flight while the previous run is
// computed on), and AdamW updates the pieces, which are a store of their
// own. A bf16 program's copy of the parameters (the shadow store, which
// its matmuls read) mirrors the rest: the gather refreshes the copy of the
// slot, and AdamW that of the parameters kept whole. See Passes.td.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "dialects/Rt/RtOps.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "llvm/ADT/MapVector.h"

#include <set>
#include <utility>

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
  AxisSet rest; // axes besides dp its gradients are summed over
  // ZeRO-2: written whole only in staging and kept as a piece (at `grad` in
  // the gradient store); otherwise kept whole, reduce-scattered in place.
  bool staged = false;
  int64_t grad = 0;
  // ZeRO-3: the parameters kept as a piece (at `value` in the parameter
  // store) and gathered whole where a part reads them.
  bool sharded = false;
  int64_t value = 0;
  // ZeRO-1 and 2 in a bf16 program: the fp32 master weights kept as a
  // piece only (at `value` in the parameter pieces), as Megatron-LM's
  // distributed optimizer keeps them, when nothing but AdamW reads them in
  // fp32; the parts read the run's bf16 copy, kept whole at `copy` in the
  // copy's own region and gathered in bf16 after each update.
  bool master = false;
  int64_t copy = 0;
  // ZeRO-3 in a bf16 program: a sharded run nothing reads in fp32 but its
  // update is gathered in bf16 into its slot of the copy only.
  bool bf16Gather = false;
  // The ranks the pieces are cut over: dp (or a hybrid shard group of it),
  // and with expert parallelism dp x ep for a gradient summed over ep too
  // (a dense parameter's: ep is more data parallelism for it, as in
  // Megatron-LM's distributed optimizer), with context parallelism x cp
  // (every gradient is summed over cp, and Megatron-LM cuts its
  // distributed optimizer over dp x cp alike), of `groupSize` ranks.
  AxisSet group;
  int64_t groupSize = 1;
};

int64_t elementsOf(Value v) {
  return cast<MemRefType>(v.getType()).getNumElements();
}

// The place (offset, elements) of `v` in the store `space` (the gradient
// or the parameter store), if it is a placed view of it laid out like the
// parameters (a piece this pass made is not).
std::optional<std::pair<int64_t, int64_t>> placeIn(rt::Space space, Value v) {
  auto view = v.getDefiningOp<rt::BufferOp>();
  if (!view || view.getSpace() != space || view->hasAttr("shard.piece"))
    return std::nullopt;
  return std::make_pair((int64_t)view.getOffset(), elementsOf(v));
}

// The ops that touch a view, through views of it (a part's yield hands a
// value on and does not touch it).
void usersOf(Value v, SmallVectorImpl<Operation *> &out) {
  for (Operation *user : v.getUsers()) {
    if (auto reshaped = dyn_cast<rt::ViewOp>(user))
      usersOf(reshaped.getResult(), out);
    else if (!user->hasTrait<OpTrait::IsTerminator>())
      out.push_back(user);
  }
}

class Sharder {
public:
  Sharder(func::FuncOp func, const MeshShape &mesh, int64_t zero,
          int64_t microbatches, bool masterPieces)
      : func(func), ctx(func.getContext()), dp(mesh.shardGroupSize()),
        ep(mesh.hybrid() ? 1 : mesh[MeshAxis::EP]),
        cp(mesh.hybrid() ? 1 : mesh[MeshAxis::CP]), shardAxes(mesh.shardAxes()),
        replicaAxes(mesh.hybrid() ? AxisSet::dpReplica() : AxisSet()),
        zero(zero), microbatches(microbatches), masterPieces(masterPieces) {}
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
  Run *runOf(int64_t offset, int64_t n) {
    return const_cast<Run *>(std::as_const(*this).runOf(offset, n));
  }
  // The piece of `r` this rank holds, in the gradient store (ZeRO-2).
  Value pieceView(OpBuilder &b, Location loc, const Run &r) {
    Value v = view(b, loc, MemRefType::get({r.piece}, b.getF32Type()),
                   rt::Space::Grads, r.grad);
    v.getDefiningOp()->setAttr("shard.piece", UnitAttr::get(ctx));
    return v;
  }
  void chooseStaged();
  void chooseSharded();
  void chooseMasters();
  // The runs some op besides their update reads in fp32.
  DenseSet<Run *> readInFp32();
  LogicalResult placeMasters();
  LogicalResult stageGradients();
  LogicalResult gatherParams();
  // A view of a run's whole gradient or parameter in a part.
  struct Use {
    rt::BufferOp view;
    Run *run;
  };
  // Where the runs a part writes (reads) whole are staged: slots of the
  // largest run they hold, shared by runs whose touches do not overlap in
  // any part; each run's first and last touching op in its part.
  struct Staging {
    struct Slot {
      int64_t size = 0, offset = 0;
      int kind = 0; // runs of one kind share a slot
    };
    SmallVector<Slot> slots;
    struct Span {
      Operation *first, *last;
      Run *run;
      int64_t slot;
      // With prefetch: the op before which the run's gather starts (the
      // previous run's first touch in the part), or null for the first.
      Operation *issue = nullptr;
    };
    SmallVector<Span> spans;
    SmallVector<std::pair<Use, int64_t>> placed; // view, slot
    // Gives the slots their offsets from `base`, kind by kind (kind 0
    // first); returns the size. `sizes` gets each kind's.
    int64_t place(int64_t base, SmallVectorImpl<int64_t> *sizes = nullptr) {
      int64_t size = 0;
      for (int kind = 0;
           llvm::any_of(slots, [&](const Slot &s) { return s.kind >= kind; });
           ++kind) {
        int64_t before = size;
        for (Slot &slot : slots)
          if (slot.kind == kind) {
            slot.offset = base + size;
            size += slot.size;
          }
        if (sizes)
          sizes->push_back(size - before);
      }
      for (auto &[use, slot] : placed)
        use.view.setOffset(slots[slot].offset +
                           (use.view.getOffset() - use.run->start));
      return size;
    }
  };
  // How long a run holds its slot: from its first touch to its last
  // (Plain), from the previous run's first touch on (Prefetch: its gather
  // is in flight meanwhile), or until the next run's last touch
  // (Deferred: its reduction is in flight meanwhile).
  enum class Hold { Plain, Prefetch, Deferred };
  // `kindOf` sorts the runs into kinds that take slots of their own.
  Staging stage(ArrayRef<Block *> blocks,
                DenseMap<Block *, SmallVector<Use>> &usesIn,
                Hold hold = Hold::Plain,
                function_ref<int(const Run &)> kindOf = nullptr);
  // Ranges kept whole (the runs `keep` selects and parameters outside every
  // run), packed from `base`, each keeping its layout.
  struct Packing {
    SmallVector<std::pair<int64_t, int64_t>> ranges; // old offset, elements
    DenseMap<int64_t, int64_t> at;                   // old offset -> new
    int64_t size = 0;
    std::optional<int64_t> offsetOf(int64_t offset) const {
      for (auto [start, n] : ranges)
        if (start <= offset && offset < start + n)
          return at.lookup(start) + (offset - start);
      return std::nullopt;
    }
  };
  Packing packWhole(function_ref<bool(const Run &)> keep, int64_t base);
  Packing placeValues(function_ref<bool(const Run &)> asPieces);
  // The placed views of one store (`space`): of runs `staged` selects, by
  // part (unread ones erased); the others moved into `whole`.
  LogicalResult
  sortViews(rt::Space space, function_ref<bool(const Run &)> staged,
            const Packing &whole,
            DenseMap<Block *, SmallVector<Use>> &usesIn,
            SmallVector<Block *> &blocks, StringRef what);
  // A run's piece of the parameters (ZeRO-3).
  Value valuePieceView(OpBuilder &b, Location loc, const Run &r) {
    Value v = view(b, loc, MemRefType::get({r.piece}, b.getF32Type()),
                   rt::Space::ParamPieces, r.value);
    v.getDefiningOp()->setAttr("shard.piece", UnitAttr::get(ctx));
    return v;
  }
  // The group the pieces are cut over: dp, or a hybrid shard group of it.
  dist::AxesAttr dpAxes() { return dist::AxesAttr::get(ctx, shardAxes); }
  dist::AxesAttr groupOf(const Run &r) {
    return dist::AxesAttr::get(ctx, r.group);
  }
  LogicalResult collectRuns();
  void shardSyncs();
  LogicalResult shardUpdates();
  void shardNorm();

  func::FuncOp func;
  MLIRContext *ctx;
  // dp: the ranks of a shard group (all of dp unless hybrid).
  int64_t dp;
  // Expert parallelism a dense gradient's pieces are cut over besides dp
  // (1 without, or with hybrid sharding).
  int64_t ep;
  // Context parallelism, which every gradient's pieces are cut over besides
  // dp (1 without, or with hybrid sharding).
  int64_t cp;
  AxisSet shardAxes;
  // Hybrid sharding: the groups' replicas, over which each piece of a
  // gradient is summed as well; empty otherwise.
  AxisSet replicaAxes;
  int64_t zero, microbatches;
  // parallel.master_pieces; and whether the program has a bf16 copy of its
  // parameters (a bf16 program's matmuls read it).
  bool masterPieces, copies = false;
  SmallVector<Run> runs;
  SmallVector<Operation *> syncs;
  int64_t stateElems = 0;
  std::set<int64_t> erasedSlots;
  // ZeRO-2: sizes of the gradient store's regions.
  int64_t pieceElems = 0, scratchElems = 0, wholeElems = 0, stagingElems = 0;
  // ZeRO-3: sizes of the parameter store's regions.
  int64_t valuePieceElems = 0, valueWholeElems = 0, gatherElems = 0;
  // ZeRO-3: the slots of the runs gathered in bf16, in the copy alone.
  int64_t copyOnlyElems = 0;
  // ZeRO-1/2, bf16: the bf16 copies of the runs whose master weights are
  // pieces, after the copy of the parameters kept whole.
  int64_t masterCopyElems = 0;
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
    bool overEp = ep > 1 && axes.contains(MeshAxis::EP);
    bool overCp = cp > 1 && axes.contains(MeshAxis::CP);
    for (Value b : buffers)
      if (auto range = placeIn(rt::Space::Grads, b)) {
        any = true;
        Run r{range->first, range->second, 0, 0};
        r.group = shardAxes;
        r.groupSize = dp;
        if (overEp) {
          r.group |= AxisSet(MeshAxis::EP);
          r.groupSize *= ep;
        }
        if (overCp) {
          r.group |= AxisSet(MeshAxis::CP);
          r.groupSize *= cp;
        }
        runs.push_back(r);
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
    // ceil(n / g), as the runtime cuts it (tessel/Runtime/Pieces.h).
    runs[k].piece = (runs[k].length + runs[k].groupSize - 1) / runs[k].groupSize;
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
    Type request = rt::RequestType::get(ctx);
    // The request is still handed on through the parts' yields (the waits
    // use slots): the first new start's stands for it.
    Value newRequest;
    for (auto [k, buffer] : llvm::enumerate(op->getOperands())) {
      std::optional<std::pair<int64_t, int64_t>> range = placeIn(rt::Space::Grads, buffer);
      bool isRun = range.has_value();
      Run *run = isRun ? runOf(range->first, range->second) : nullptr;
      // The axes the pieces' group does not cover sum the run first.
      AxisSet runRest = run ? rest - run->group : rest;
      if (isRun && zero >= 2 && run->staged) {
        // Reduced where the backward pass finishes the run instead; the
        // slot's waits go. Its piece is summed over the other axes (and
        // the replicas) once, in the update.
        run->rest = runRest | replicaAxes;
        if (slot)
          erasedSlots.insert(*slot + k);
        continue;
      }
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
      if (!runRest.empty())
        rt::AllReduceOp::create(b, loc, ValueRange{buffer},
                                dist::AxesAttr::get(ctx, runRest));
      // In place, the pieces are summed over the replicas by the
      // reduce-scatter itself (see rt.reduce_scatter_shards).
      auto reducedAxes = dist::AxesAttr::get(ctx, run->group | replicaAxes);
      if (started) {
        auto start = rt::ReduceScatterShardsStartOp::create(
            b, loc, request, ValueRange{buffer}, reducedAxes, slotOf());
        if (!newRequest)
          newRequest = start.getRequest();
      } else
        rt::ReduceScatterShardsOp::create(
            b, loc, buffer, Value(), b.getI64IntegerAttr(elementsOf(buffer)),
            reducedAxes);
    }
    if (started) {
      // Something must still stand for the request the parts hand on.
      if (!newRequest)
        newRequest = rt::AllReduceStartOp::create(
                         b, loc, request, ValueRange{}, dpAxes(),
                         b.getI64IntegerAttr(*slot))
                         .getRequest();
      op->getResult(0).replaceAllUsesWith(newRequest);
    }
    op->erase();
  }
  if (erasedSlots.empty())
    return;
  // Waits for slots nobody starts any more.
  SmallVector<rt::WaitRequestsOp> waits;
  func.walk([&](rt::WaitRequestsOp w) { waits.push_back(w); });
  for (rt::WaitRequestsOp w : waits) {
    OpBuilder b(w);
    int64_t first = w.getFirst(), end = first + w.getCount();
    for (int64_t k = first; k < end;) {
      if (erasedSlots.count(k)) {
        ++k;
        continue;
      }
      int64_t runEnd = k;
      while (runEnd < end && !erasedSlots.count(runEnd))
        ++runEnd;
      rt::WaitRequestsOp::create(b, w.getLoc(), k, runEnd - k);
      k = runEnd;
    }
    w.erase();
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
  // The last update of each run's parameters: its gather starts there.
  DenseMap<const Run *, Operation *> lastOfRun;
  for (rt::AdamWOp op : updates) {
    if (op->getBlock() != block)
      return op.emitError("tessel-shard-optimizer: the updates are not in "
                          "one block");
    if (last->isBeforeInBlock(op))
      last = op;
    OpBuilder b(op);
    Location loc = op.getLoc();
    int64_t n = op.getN();
    std::optional<std::pair<int64_t, int64_t>> range = placeIn(rt::Space::Grads, op.getGrad());
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
    bool pieces = zero >= 2 && r->staged;
    Value grad = pieces ? pieceView(b, loc, *r) : op.getGrad();
    bool pieceParams = r->sharded || r->master;
    Value value = pieceParams ? valuePieceView(b, loc, *r) : op.getParam();
    // A piece's bf16 copy is never read: the gathers refresh the copies
    // of the runs they gather.
    Value copy = pieceParams ? Value() : op.getShadow();
    auto sharded = rt::AdamWShardOp::create(
        b, loc, value, copy, grad, m, v, op.getNorm(), op.getLr(),
        op.getCount(), op.getNAttr(), b.getI64IntegerAttr(inRun),
        b.getI64IntegerAttr(r->piece), groupOf(*r), b.getBoolAttr(pieces),
        b.getBoolAttr(pieceParams), op.getBeta1Attr(), op.getBeta2Attr(),
        op.getEpsAttr(), op.getWeightDecayAttr(), op.getMaxGradNormAttr());
    if (param && r->group == shardAxes)
      param.setOptimizerShard(ArrayRef<int64_t>{r->state, inRun, r->piece});
    else if (param)
      param.setOptimizerShard(ArrayRef<int64_t>{r->state, inRun, r->piece,
                                                (int64_t)r->group.bits()});
    if (last == op.getOperation())
      last = sharded;
    Operation *&runLast = lastOfRun[r];
    if (!runLast || runLast->isBeforeInBlock(sharded))
      runLast = sharded;
    op.erase();
  }
  // Every rank's pieces of the updated parameters, to every rank: each
  // run's gather starts right after the update of its last piece, so that
  // it runs while the later runs are updated, and the update waits for
  // them all at its end (one request slot each).
  OpBuilder b(ctx);
  Location loc = last->getLoc();
  int64_t first = 0;
  if (auto slots = func->getAttrOfType<IntegerAttr>("rt.request_slots"))
    first = slots.getInt();
  int64_t request = first;
  Operation *lastStart = last;
  for (const Run &r : runs) {
    if (r.sharded)
      continue; // gathered where the parts read it
    Operation *after = lastOfRun.lookup(&r);
    b.setInsertionPointAfter(after ? after : last);
    if (r.master) {
      // The run's bf16 copy, gathered in bf16 from every rank's piece of
      // the master weights (this rank's rounded in first); placeMasters
      // moves the view to the copy's place.
      Type type = MemRefType::get({r.length}, b.getBF16Type());
      auto start = rt::AllGatherShardsStartOp::create(
          b, loc, rt::RequestType::get(ctx),
          view(b, loc, type, rt::Space::Shadow, r.start),
          valuePieceView(b, loc, r), Value(), b.getI64IntegerAttr(r.length),
          groupOf(r), b.getI64IntegerAttr(request++));
      if (lastStart->isBeforeInBlock(start))
        lastStart = start;
      continue;
    }
    Value params = view(b, loc, MemRefType::get({r.length}, b.getF32Type()),
                        rt::Space::Params, r.start);
    Value copy;
    if (shadow)
      copy = view(b, loc,
                  MemRefType::get({r.length}, cast<MemRefType>(shadow.getType())
                                                  .getElementType()),
                  rt::Space::Shadow, r.start);
    auto start = rt::AllGatherShardsStartOp::create(
        b, loc, rt::RequestType::get(ctx), params, Value(), copy,
        b.getI64IntegerAttr(r.length), groupOf(r),
        b.getI64IntegerAttr(request++));
    if (lastStart->isBeforeInBlock(start))
      lastStart = start;
  }
  if (request > first) {
    b.setInsertionPointAfter(lastStart);
    rt::WaitRequestsOp::create(b, loc, first, request - first);
    func->setAttr("rt.request_slots", b.getI64IntegerAttr(request));
  }
  func->setAttr("rt.optimizer_elems", b.getI64IntegerAttr(whole));
  return success();
}

// The norm's squares: of this rank's pieces, and (for gradients outside the
// runs, which every rank of the group holds alike) on the group's rank 0;
// then summed over the group. A partial sum of dense gradients cut over
// dp x ep is summed over dp x ep (those gradients are alike over ep); one of
// experts' gradients over dp (it is summed over ep already).
void Sharder::shardNorm() {
  auto slotOf = [](Value acc) -> std::optional<int64_t> {
    auto view = acc.getDefiningOp<rt::BufferOp>();
    if (!view || view.getSpace() != rt::Space::NormSums)
      return std::nullopt;
    return (int64_t)view.getOffset();
  };
  SmallVector<rt::SumSquaresOp> squares;
  func.walk([&](rt::SumSquaresOp op) { squares.push_back(op); });
  // The group of each partial sum: that of the runs it adds.
  std::map<int64_t, AxisSet> slotGroup;
  for (rt::SumSquaresOp op : squares)
    if (auto range = placeIn(rt::Space::Grads, op.getX()))
      if (const Run *r = runOf(range->first, op.getN()))
        if (auto slot = slotOf(op.getAcc()))
          slotGroup[*slot] |= r->group;
  auto groupOfSlot = [&](Value acc) {
    std::optional<int64_t> slot = slotOf(acc);
    return slot && slotGroup.count(*slot) ? slotGroup[*slot] : shardAxes;
  };
  for (rt::SumSquaresOp op : squares) {
    OpBuilder b(op);
    int64_t n = op.getN();
    std::optional<std::pair<int64_t, int64_t>> range = placeIn(rt::Space::Grads, op.getX());
    const Run *r = range ? runOf(range->first, n) : nullptr;
    int64_t inRun = r ? range->first - r->start : 0;
    int64_t piece = r ? r->piece : n;
    bool pieces = r && zero >= 2 && r->staged;
    Value x = pieces ? pieceView(b, op.getLoc(), *r) : op.getX();
    rt::SumSquaresShardOp::create(
        b, op.getLoc(), x, op.getAcc(), op.getNAttr(),
        b.getI64IntegerAttr(inRun), b.getI64IntegerAttr(piece),
        dist::AxesAttr::get(ctx, r ? r->group : groupOfSlot(op.getAcc())),
        b.getBoolAttr(pieces));
    op.erase();
  }
  SmallVector<rt::SqrtSumOp> roots;
  func.walk([&](rt::SqrtSumOp op) { roots.push_back(op); });
  for (rt::SqrtSumOp op : roots) {
    OpBuilder b(op);
    Location loc = op.getLoc();
    std::optional<int64_t> first = slotOf(op.getAcc());
    int64_t n = cast<MemRefType>(op.getAcc().getType()).getNumElements();
    auto groupAt = [&](int64_t slot) {
      return slotGroup.count(slot) ? slotGroup[slot] : shardAxes;
    };
    bool alike = first && llvm::all_of(llvm::seq<int64_t>(0, n), [&](int64_t k) {
      return groupAt(*first + k) == groupAt(*first);
    });
    if (!first || alike) {
      rt::AllReduceOp::create(
          b, loc, ValueRange{op.getAcc()},
          dist::AxesAttr::get(ctx, first ? groupAt(*first) : shardAxes));
      continue;
    }
    // Consecutive partial sums with the same group, one reduction each.
    Type f64 = cast<MemRefType>(op.getAcc().getType()).getElementType();
    for (int64_t k = 0; k < n;) {
      int64_t end = k + 1;
      while (end < n && groupAt(*first + end) == groupAt(*first + k))
        ++end;
      Value sums = view(b, loc, MemRefType::get({end - k}, f64),
                        rt::Space::NormSums, *first + k);
      rt::AllReduceOp::create(b, loc, ValueRange{sums},
                              dist::AxesAttr::get(ctx, groupAt(*first + k)));
      k = end;
    }
  }
}

LogicalResult Sharder::run() {
  func.walk(
      [&](rt::BufferOp v) { copies |= v.getSpace() == rt::Space::Shadow; });
  if (failed(collectRuns()))
    return failure();
  if (runs.empty())
    return success();
  if (zero >= 2)
    chooseStaged();
  if (zero >= 3)
    chooseSharded();
  else
    chooseMasters();
  shardSyncs();
  shardNorm();
  if (failed(shardUpdates()) || failed(placeMasters()))
    return failure();
  if (zero < 2) {
    func.walk([&](rt::BufferOp v) { v->removeAttr("shard.piece"); });
    return success();
  }
  // Pieces of gradients summed over tp as well: over tp, once, now.
  Block *update = nullptr;
  func.walk([&](pipe::UpdateOp u) { update = &u.getBody().front(); });
  if (update) {
    OpBuilder b(ctx);
    b.setInsertionPointToStart(update);
    for (const Run &r : runs)
      if (r.staged && !r.rest.empty())
        rt::AllReduceOp::create(b, func.getLoc(),
                                ValueRange{pieceView(b, func.getLoc(), r)},
                                dist::AxesAttr::get(ctx, r.rest));
  }
  if (failed(stageGradients()))
    return failure();
  if (zero >= 3 && failed(gatherParams()))
    return failure();
  func.walk([&](rt::BufferOp v) { v->removeAttr("shard.piece"); });
  OpBuilder b(ctx);
  func->setAttr("rt.grad_elems",
                b.getI64IntegerAttr(pieceElems + scratchElems + wholeElems +
                                    stagingElems));
  func->setAttr("rt.grad_staging_elems", b.getI64IntegerAttr(stagingElems));
  func->setAttr("rt.grad_piece_elems", b.getI64IntegerAttr(pieceElems));
  func->setAttr("rt.grad_scratch_elems", b.getI64IntegerAttr(scratchElems));
  func->setAttr("rt.grad_whole_elems", b.getI64IntegerAttr(wholeElems));
  if (zero >= 3) {
    func->setAttr("rt.param_store_elems",
                  b.getI64IntegerAttr(valuePieceElems + valueWholeElems +
                                      gatherElems));
    func->setAttr("rt.param_piece_elems", b.getI64IntegerAttr(valuePieceElems));
    func->setAttr("rt.param_gather_elems", b.getI64IntegerAttr(gatherElems));
    func->setAttr("rt.shadow_extra_elems", b.getI64IntegerAttr(copyOnlyElems));
  }
  return success();
}

// ZeRO-2: a run is staged when the update reads its gradients only to
// reduce them, take their norm and apply them, and one backward part writes
// them; otherwise (a tied embedding's gradient, to which the update adds
// the other stage's contribution) it stays whole, as under ZeRO-1.
void Sharder::chooseStaged() {
  DenseMap<Run *, SmallPtrSet<Block *, 2>> writers;
  DenseSet<Run *> readInUpdate;
  auto onlyReduced = [](Value v) {
    SmallVector<Operation *> users;
    usersOf(v, users);
    return llvm::all_of(users, [](Operation *user) {
      return isa<rt::AllReduceOp, rt::AllReduceStartOp, rt::SumSquaresOp,
                 rt::AdamWOp>(user);
    });
  };
  func.walk([&](rt::BufferOp v) {
    std::optional<std::pair<int64_t, int64_t>> range = placeIn(rt::Space::Grads, v);
    if (!range)
      return;
    Run *r = runOf(range->first, range->second);
    if (!r)
      return;
    if (v->getParentOfType<pipe::UpdateOp>()) {
      if (!onlyReduced(v.getBuffer()))
        readInUpdate.insert(r);
    } else if (!v->use_empty()) {
      writers[r].insert(v->getBlock());
    }
  });
  pieceElems = 0;
  for (Run &r : runs) {
    r.staged = !readInUpdate.count(&r) && writers[&r].size() == 1;
    if (r.staged) {
      r.grad = pieceElems;
      pieceElems += r.piece;
    }
  }
}

Sharder::Packing Sharder::packWhole(function_ref<bool(const Run &)> keep,
                                     int64_t base) {
  Packing packing;
  for (const Run &r : runs)
    if (keep(r))
      packing.ranges.push_back({r.start, r.length});
  func.walk([&](rt::ParamOp p) {
    if (!p.getOffset())
      return;
    int64_t n = elementsOf(p.getBuffer());
    if (!runOf(*p.getOffset(), n))
      packing.ranges.push_back({*p.getOffset(), n});
  });
  llvm::sort(packing.ranges);
  for (auto [offset, n] : packing.ranges) {
    packing.at[offset] = base + packing.size;
    packing.size += n;
  }
  return packing;
}

LogicalResult Sharder::sortViews(
    rt::Space space, function_ref<bool(const Run &)> staged,
    const Packing &whole,
    DenseMap<Block *, SmallVector<Use>> &usesIn, SmallVector<Block *> &blocks,
    StringRef what) {
  SmallVector<rt::BufferOp> dead;
  WalkResult result = func.walk([&](rt::BufferOp v) {
    std::optional<std::pair<int64_t, int64_t>> range =
        placeIn(space, v.getBuffer());
    if (!range)
      return WalkResult::advance();
    auto [offset, n] = *range;
    Run *r = runOf(offset, n);
    if (r && staged(*r)) {
      if (v.use_empty()) {
        dead.push_back(v); // what the norm and the update read before
        return WalkResult::advance();
      }
      if (v->getParentOfType<pipe::UpdateOp>()) {
        v.emitError("tessel-shard-optimizer: the update reads a sharded ")
            << what << " run whole";
        return WalkResult::interrupt();
      }
      Block *block = v->getBlock();
      if (!usesIn.count(block))
        blocks.push_back(block);
      usesIn[block].push_back({v, r});
      return WalkResult::advance();
    }
    if (std::optional<int64_t> at = whole.offsetOf(offset)) {
      v.setOffset(*at);
      return WalkResult::advance();
    }
    v.emitError("tessel-shard-optimizer: a ")
        << what << " view at " << offset << " (+" << n
        << ") lies across runs";
    return WalkResult::interrupt();
  });
  if (result.wasInterrupted())
    return failure();
  for (rt::BufferOp v : dead)
    v.erase();
  return success();
}

Sharder::Staging Sharder::stage(ArrayRef<Block *> blocks,
                                DenseMap<Block *, SmallVector<Use>> &usesIn,
                                Hold hold,
                                function_ref<int(const Run &)> kindOf) {
  bool prefetch = hold == Hold::Prefetch;
  Staging staging;
  for (Block *block : blocks) {
    DenseMap<Operation *, int64_t> position;
    for (Operation &op : *block)
      position[&op] = position.size();
    // Each run's first and last touching op in the part.
    DenseMap<Run *, std::pair<Operation *, Operation *>> span;
    for (Use u : usesIn[block]) {
      SmallVector<Operation *> users;
      usersOf(u.view.getBuffer(), users);
      for (Operation *user : users) {
        Operation *top = block->findAncestorOpInBlock(*user);
        if (!top)
          continue;
        auto &[first, last] = span[u.run];
        if (!first || position[top] < position[first])
          first = top;
        if (!last || position[top] > position[last])
          last = top;
      }
    }
    // By first touch; runs first touched by one op by their place in the
    // store (the map's order is the pointers', which differs from run to
    // run of the compiler).
    SmallVector<Run *> order;
    for (auto &[run, s] : span)
      order.push_back(run);
    llvm::sort(order, [&](Run *a, Run *b) {
      return std::make_pair(position[span[a].first], a->start) <
             std::make_pair(position[span[b].first], b->start);
    });
    // Deferred: the runs in the order their reductions start (their last
    // touches); each is waited for after the next one's last touch.
    DenseMap<Run *, Operation *> waitAfter;
    if (hold == Hold::Deferred) {
      SmallVector<Run *> reduced(order);
      llvm::stable_sort(reduced, [&](Run *a, Run *b) {
        return position[span[a].second] < position[span[b].second];
      });
      for (size_t i = 0; i + 1 < reduced.size(); ++i)
        waitAfter[reduced[i]] = span[reduced[i + 1]].second;
    }
    // A run takes a slot of its kind whose last run's last touch came
    // before its first (the slots of the earlier parts are free here).
    SmallVector<int64_t> busyUntil(staging.slots.size(), -1);
    DenseMap<Run *, int64_t> slotOf;
    for (auto [i, run] : llvm::enumerate(order)) {
      Operation *issue =
          prefetch && i > 0 ? span[order[i - 1]].first : nullptr;
      int64_t lo = position[issue ? issue : span[run].first], slot = -1;
      int kind = kindOf ? kindOf(*run) : 0;
      for (auto [k, until] : llvm::enumerate(busyUntil))
        if (until < lo && staging.slots[k].kind == kind) {
          slot = k;
          break;
        }
      if (slot < 0) {
        slot = busyUntil.size();
        busyUntil.push_back(-1);
        staging.slots.push_back({0, 0, kind});
      }
      busyUntil[slot] = position[span[run].second];
      if (hold == Hold::Deferred)
        busyUntil[slot] = waitAfter.lookup(run)
                              ? position[waitAfter.lookup(run)]
                              : (int64_t)position.size();
      slotOf[run] = slot;
      staging.slots[slot].size =
          std::max(staging.slots[slot].size, run->length);
      staging.spans.push_back(
          {span[run].first, span[run].second, run, slot, issue});
    }
    for (Use u : usesIn[block])
      if (slotOf.count(u.run))
        staging.placed.push_back({u, slotOf[u.run]});
  }
  return staging;
}

// ZeRO-3: a staged run's parameters are sharded too when nothing but the
// parts (and the run's own update) reads them.
void Sharder::chooseSharded() {
  DenseSet<Run *> readElsewhere;
  func.walk([&](rt::BufferOp v) {
    // The parameters, or their bf16 copy.
    std::optional<std::pair<int64_t, int64_t>> range =
        placeIn(rt::Space::Params, v);
    if (!range)
      range = placeIn(rt::Space::Shadow, v);
    if (!range)
      return;
    Run *r = runOf(range->first, range->second);
    if (!r || v.use_empty())
      return;
    bool inPart = v->getParentOfType<pipe::ForwardPassOp>() ||
                  v->getParentOfType<pipe::BackwardPassOp>();
    bool inUpdate = v->getParentOfType<pipe::UpdateOp>();
    SmallVector<Operation *> users;
    usersOf(v.getBuffer(), users);
    bool updated = inUpdate && llvm::all_of(users, [](Operation *u) {
                     return isa<rt::AdamWOp>(u);
                   });
    if (!inPart && !updated)
      readElsewhere.insert(r);
  });
  bool inBf16 = copies && masterPieces;
  DenseSet<Run *> fp32 = inBf16 ? readInFp32() : DenseSet<Run *>();
  for (Run &r : runs) {
    r.sharded = r.staged && !readElsewhere.count(&r);
    if (r.sharded) {
      r.value = valuePieceElems;
      valuePieceElems += r.piece;
      r.bf16Gather = inBf16 && !fp32.count(&r);
    }
  }
}

// The parameter store as [pieces | parameters kept whole]: the runs
// `asPieces` selects as pieces (their places chosen already), the rest
// packed after them. Each rt.param records where its values are
// (`value_shard`: [offset, piece], piece 0 for whole).
Sharder::Packing
Sharder::placeValues(function_ref<bool(const Run &)> asPieces) {
  Packing whole =
      packWhole([&](const Run &r) { return !asPieces(r); }, valuePieceElems);
  valueWholeElems = whole.size;
  func.walk([&](rt::ParamOp p) {
    if (!p.getOffset())
      return;
    int64_t offset = *p.getOffset(), n = elementsOf(p.getBuffer());
    Run *r = runOf(offset, n);
    if (r && asPieces(*r)) {
      p->setAttr("value_shard",
                 DenseI64ArrayAttr::get(ctx, {r->value, r->piece}));
      // Its bf16 copy gathered in bf16 from the pieces.
      if (r->master || r->bf16Gather)
        p->setAttr("bf16_gather", UnitAttr::get(ctx));
    } else
      p->setAttr("value_shard",
                 DenseI64ArrayAttr::get(ctx, {*whole.offsetOf(offset), 0}));
  });
  return whole;
}

// ZeRO-1/2 in a bf16 program: a run keeps its fp32 master weights as
// pieces only when nothing reads them in fp32 but their update (the parts
// read the bf16 copy: matmuls' weights); norms' weights, biases and
// embedding tables, which the kernels read in fp32, keep their run whole.
DenseSet<Run *> Sharder::readInFp32() {
  DenseSet<Run *> read;
  func.walk([&](rt::BufferOp v) {
    std::optional<std::pair<int64_t, int64_t>> range =
        placeIn(rt::Space::Params, v);
    if (!range || v.use_empty())
      return;
    SmallVector<Operation *> users;
    usersOf(v.getBuffer(), users);
    if (v->getParentOfType<pipe::UpdateOp>() &&
        llvm::all_of(users, [](Operation *u) { return isa<rt::AdamWOp>(u); }))
      return;
    // Every run the view touches.
    for (Run &r : runs)
      if (r.start < range->first + range->second &&
          range->first < r.start + r.length)
        read.insert(&r);
  });
  return read;
}

void Sharder::chooseMasters() {
  if (!copies || !masterPieces)
    return;
  DenseSet<Run *> fp32 = readInFp32();
  for (Run &r : runs) {
    r.master = !fp32.count(&r);
    if (r.master) {
      r.value = valuePieceElems;
      valuePieceElems += r.piece;
      r.copy = masterCopyElems;
      masterCopyElems += r.length;
    }
  }
}

// The parameter store becomes [pieces | parameters kept whole] (the
// pieces a store of their own, as under ZeRO-3), and the bf16 copy [copy
// of those kept whole, at the same places | the runs' copies].
LogicalResult Sharder::placeMasters() {
  if (masterCopyElems == 0)
    return success();
  int64_t wholeBase = valuePieceElems;
  Packing whole = placeValues([](const Run &r) { return r.master; });
  SmallVector<rt::BufferOp> dead;
  WalkResult placed = func.walk([&](rt::BufferOp v) {
    bool copy = v.getSpace() == rt::Space::Shadow;
    if (!copy && v.getSpace() != rt::Space::Params)
      return WalkResult::advance();
    int64_t offset = v.getOffset(), n = elementsOf(v.getBuffer());
    Run *r = runOf(offset, n);
    if (r && r->master) {
      if (v.use_empty()) {
        dead.push_back(v); // what AdamW updated before it took the piece
        return WalkResult::advance();
      }
      if (copy) {
        v.setOffset(valueWholeElems + r->copy + (offset - r->start));
        return WalkResult::advance();
      }
      v.emitError("tessel-shard-optimizer: the fp32 master weights of a "
                  "run kept as pieces are read whole");
      return WalkResult::interrupt();
    }
    if (std::optional<int64_t> at = whole.offsetOf(offset)) {
      v.setOffset(*at - wholeBase);
      return WalkResult::advance();
    }
    v.emitError("tessel-shard-optimizer: a parameter view at ")
        << offset << " (+" << n << ") lies across runs";
    return WalkResult::interrupt();
  });
  if (placed.wasInterrupted())
    return failure();
  for (rt::BufferOp v : dead)
    v.erase();
  // Where the runtime fills each run's copy at start (from the pieces the
  // parameters were loaded into): [piece offset, copy offset, elements,
  // group axes] per run.
  OpBuilder b(ctx);
  SmallVector<Attribute> copies;
  for (const Run &r : runs)
    if (r.master)
      copies.push_back(
          DenseI64ArrayAttr::get(ctx, {r.value, valueWholeElems + r.copy,
                                       r.length, (int64_t)r.group.bits()}));
  func->setAttr("rt.master_copies", b.getArrayAttr(copies));
  func->setAttr("rt.param_store_elems",
                b.getI64IntegerAttr(valuePieceElems + valueWholeElems));
  func->setAttr("rt.param_piece_elems", b.getI64IntegerAttr(valuePieceElems));
  func->setAttr("rt.param_gather_elems", b.getI64IntegerAttr(0));
  func->setAttr("rt.shadow_extra_elems", b.getI64IntegerAttr(masterCopyElems));
  return success();
}

// ZeRO-3: the parameter store holds [pieces | parameters kept whole |
// gather staging]. Each part gathers a sharded run whole into a staging
// slot right before its first read of it.
LogicalResult Sharder::gatherParams() {
  int64_t wholeBase = valuePieceElems;
  Packing whole = placeValues([](const Run &r) { return r.sharded; });

  // A bf16 program reads parameters in the parts through their copy too:
  // its views take the same places (the copy's store is shifted below).
  DenseMap<Block *, SmallVector<Use>> usesIn;
  SmallVector<Block *> blocks;
  auto sharded = [](const Run &r) { return r.sharded; };
  if (failed(sortViews(rt::Space::Params, sharded, whole, usesIn, blocks,
                       "parameter")) ||
      (copies && failed(sortViews(rt::Space::Shadow, sharded, whole, usesIn,
                                  blocks, "parameter copy"))))
    return failure();
  // A run gathered in bf16 may take a slot of the copy alone: such slots
  // come after the fp32 ones, past the end of the parameter store, where
  // the copy runs on (`rt.shadow_extra_elems`). Slots of their own hold
  // less when those runs are large (with pipeline stages: the matrices),
  // but more when runs of both kinds would take turns in one slot (a
  // gradient bucket that holds a bias is read in fp32): the layout that
  // holds fewer bytes (6 per element of an fp32 slot and its copy, 2 of
  // a copy alone) is kept.
  auto bytesOf = [](const Staging &staging) {
    int64_t bytes = 0;
    for (const Staging::Slot &slot : staging.slots)
      bytes += slot.size * (slot.kind == 0 ? 6 : 2);
    return bytes;
  };
  Staging staging = stage(blocks, usesIn, Hold::Prefetch);
  if (copies) {
    Staging apart = stage(blocks, usesIn, Hold::Prefetch,
                          [](const Run &r) { return r.bf16Gather ? 1 : 0; });
    if (bytesOf(apart) < bytesOf(staging))
      staging = std::move(apart);
  }
  SmallVector<int64_t> kinds;
  int64_t slotElems = staging.place(wholeBase + valueWholeElems, &kinds);
  gatherElems = kinds.empty() ? 0 : kinds.front();
  copyOnlyElems = slotElems - gatherElems;
  for (auto &[use, slot] : staging.placed)
    if (use.view.getSpace() == rt::Space::Params &&
        staging.slots[slot].kind == 1)
      return use.view.emitError(
          "tessel-shard-optimizer: a run gathered in bf16 is read in fp32");
  // In a shared slot, a run gathered in bf16 leaves its fp32 place unused.
  // The first run of a part is gathered right before its first read; each
  // later one is started before the previous run's first read (after that
  // run's wait), so one gather is in flight at a time: one request slot.
  int64_t request = 0;
  if (auto slots = func->getAttrOfType<IntegerAttr>("rt.request_slots"))
    request = slots.getInt();
  bool started = false;
  for (const Staging::Span &g : staging.spans) {
    OpBuilder b(g.issue ? g.issue : g.first);
    Location loc = g.first->getLoc();
    // Into the fp32 slot, refreshing the copy's; a run only the copy's
    // slot is read of, straight into that, in bf16.
    Value gathered;
    if (!g.run->bf16Gather)
      gathered = view(b, loc, MemRefType::get({g.run->length}, b.getF32Type()),
                      rt::Space::Params, staging.slots[g.slot].offset);
    Value from = valuePieceView(b, loc, *g.run);
    Value copy;
    if (copies)
      copy = view(b, loc, MemRefType::get({g.run->length}, b.getBF16Type()),
                  rt::Space::Shadow, staging.slots[g.slot].offset);
    if (g.run->bf16Gather)
      std::swap(gathered, copy);
    auto n = b.getI64IntegerAttr(g.run->length);
    if (!g.issue) {
      rt::AllGatherShardsOp::create(b, loc, gathered, from, copy, n,
                                    groupOf(*g.run));
      continue;
    }
    rt::AllGatherShardsStartOp::create(b, loc, rt::RequestType::get(ctx),
                                       gathered, from, copy, n,
                                       groupOf(*g.run),
                                       b.getI64IntegerAttr(request));
    b.setInsertionPoint(g.first);
    rt::WaitRequestsOp::create(b, loc, request, 1);
    started = true;
  }
  if (started)
    func->setAttr("rt.request_slots",
                  IntegerAttr::get(IntegerType::get(ctx, 64), request + 1));
  // The pieces are a store of their own (`param_pieces`); the step's
  // parameters (and a bf16 program's copy of them) are [parameters kept
  // whole | gathered runs], each at its place in the parameter store less
  // the pieces.
  WalkResult shifted = func.walk([&](rt::BufferOp v) {
    if (v.getSpace() != rt::Space::Params &&
        v.getSpace() != rt::Space::Shadow)
      return WalkResult::advance();
    if ((int64_t)v.getOffset() < wholeBase) {
      v.emitError("tessel-shard-optimizer: a parameter view at ")
          << v.getOffset() << " lies among the pieces";
      return WalkResult::interrupt();
    }
    v.setOffset(v.getOffset() - wholeBase);
    return WalkResult::advance();
  });
  return failure(shifted.wasInterrupted());
}

// ZeRO-2: the gradient store holds [pieces | scratch piece | gradients
// outside the runs | staging]. Each backward part writes a run whole into
// staging and starts reduce-scattering it into its piece (adding a
// microbatch's piece to the pieces when there are several, at the wait)
// right after its last write; runs whose holds of staging in a part do not
// overlap share a slot.
LogicalResult Sharder::stageGradients() {
  int64_t maxPiece = 0;
  for (const Run &r : runs)
    if (r.staged)
      maxPiece = std::max(maxPiece, r.piece);
  scratchElems = microbatches > 1 ? maxPiece : 0;
  int64_t scratch = pieceElems;
  int64_t wholeBase = pieceElems + scratchElems;
  // Gradients kept whole (runs that are not staged, and parameters outside
  // every run), packed after the pieces; where each staged run is written,
  // part by part.
  Packing whole = packWhole([](const Run &r) { return !r.staged; }, wholeBase);
  wholeElems = whole.size;
  DenseMap<Block *, SmallVector<Use>> usesIn;
  SmallVector<Block *> blocks;
  if (failed(sortViews(rt::Space::Grads, [](const Run &r) { return r.staged; }, whole,
                       usesIn, blocks, "gradient")))
    return failure();

  // A microbatch's writes accumulate nothing across microbatches: staging
  // is another run's between them. Each write replaces. (A GEMM that sums
  // its product in the store would write the staged run at once, while the
  // run before it is still in flight: the memory plan leaves those GEMMs
  // unfused at ZeRO 2 and 3.)
  if (microbatches > 1) {
    SmallVector<rt::AccumulateOp> accumulates;
    for (Block *block : blocks)
      for (Use u : usesIn[block]) {
        SmallVector<Operation *> users;
        usersOf(u.view.getBuffer(), users);
        for (Operation *user : users) {
          if (auto acc = dyn_cast<rt::AccumulateOp>(user))
            if (!llvm::is_contained(accumulates, acc))
              accumulates.push_back(acc);
          if (isa<rt::MatmulAccumulateOp, rt::MatmulBiasGradAccumulateOp,
                  rt::GroupedMatmulWeightGradAccumulateOp,
                  rt::EmbeddingBackwardAccumulateOp,
                  rt::EmbeddingBackwardRangeAccumulateOp>(user))
            return user->emitOpError(
                       "sums a staged gradient run over microbatches; plan "
                       "the memory with fuse-accumulation=false at ZeRO ")
                   << zero;
        }
      }
    for (rt::AccumulateOp acc : accumulates) {
      OpBuilder b(acc);
      rt::CopyOp::create(b, acc.getLoc(), acc.getSrc(), acc.getAcc(),
                         acc.getNAttr());
      acc.erase();
    }
  }

  Staging staging = stage(blocks, usesIn, Hold::Deferred);
  stagingElems = staging.place(wholeBase + wholeElems);

  // The reductions: each started right after its run's last write in its
  // part and waited for right after the next run's last write (before that
  // run's start: one reduction in flight, so one scratch piece), the last
  // one at the part's end. The run's slot is not written meanwhile (Hold::
  // Deferred); with several microbatches the wait adds the scratch piece
  // to the run's piece.
  int64_t request = 0;
  if (auto slots = func->getAttrOfType<IntegerAttr>("rt.request_slots"))
    request = slots.getInt();
  auto wait = [&](OpBuilder &b, const Staging::Span &r) {
    Location loc = r.last->getLoc();
    rt::WaitRequestsOp::create(b, loc, request, 1);
    if (microbatches == 1)
      return;
    Value buffer = view(b, loc, MemRefType::get({r.run->piece}, b.getF32Type()),
                        rt::Space::Grads, scratch);
    Value first = rt::FirstRunOp::create(b, loc, b.getI1Type());
    rt::AccumulateOp::create(b, loc, buffer, pieceView(b, loc, *r.run), first,
                             b.getI64IntegerAttr(r.run->piece));
  };
  llvm::MapVector<Block *, SmallVector<const Staging::Span *>> byPart;
  for (const Staging::Span &r : staging.spans)
    byPart[r.last->getBlock()].push_back(&r);
  for (auto &[block, spans] : byPart) {
    llvm::stable_sort(spans, [](const Staging::Span *a, const Staging::Span *b) {
      return a->last != b->last && a->last->isBeforeInBlock(b->last);
    });
    OpBuilder b(ctx);
    const Staging::Span *previous = nullptr;
    for (const Staging::Span *r : spans) {
      // After the run's last write, or after what was placed there for a
      // run with the same last write.
      if (!previous || previous->last != r->last)
        b.setInsertionPointAfter(r->last);
      Location loc = r->last->getLoc();
      if (previous)
        wait(b, *previous);
      Type whole = MemRefType::get({r->run->length}, b.getF32Type());
      Value staged = view(b, loc, whole, rt::Space::Grads,
                          staging.slots[r->slot].offset);
      Value out =
          microbatches == 1
              ? pieceView(b, loc, *r->run)
              : view(b, loc, MemRefType::get({r->run->piece}, b.getF32Type()),
                     rt::Space::Grads, scratch);
      rt::ReduceScatterPieceStartOp::create(
          b, loc, rt::RequestType::get(ctx), staged, out,
          b.getI64IntegerAttr(r->run->length), groupOf(*r->run),
          b.getI64IntegerAttr(request));
      previous = r;
    }
    if (block->mightHaveTerminator())
      b.setInsertionPoint(block->getTerminator());
    else
      b.setInsertionPointToEnd(block);
    wait(b, *previous);
  }
  if (!byPart.empty())
    func->setAttr("rt.request_slots",
                  IntegerAttr::get(IntegerType::get(ctx, 64), request + 1));
  return success();
}

struct ShardOptimizerPass
    : tessel::impl::ShardOptimizerBase<ShardOptimizerPass> {
  using ShardOptimizerBase::ShardOptimizerBase;
  void runOnOperation() override {
    ModuleOp module = getOperation();
    if (zero < 0 || zero > 3) {
      module.emitError("tessel-shard-optimizer: zero = ")
          << zero << " is not built (0 to 3)";
      return signalPassFailure();
    }
    MeshShape mesh = dist::meshOf(module);
    if (zero == 0 || mesh[MeshAxis::DP] == 1)
      return;
    int64_t microbatches = pipe::layoutOf(module).getMicrobatches();
    for (auto func : module.getOps<func::FuncOp>())
      if (func->hasAttr("pipe.rank") &&
          failed(Sharder(func, mesh, zero, microbatches, masterPieces).run()))
        return signalPassFailure();
  }
};

} // namespace
