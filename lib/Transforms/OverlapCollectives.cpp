//===- OverlapCollectives.cpp - Collectives in flight under the GEMMs -----===//
//
// A layer's backward under tensor (and sequence) parallelism runs, per
// linear layer,
//
//   dX = dY W^T          the input gradient's GEMM
//   X  = all_gather(x)   the input re-gathered (sequence parallel)
//   dW = X^T dY          the weight gradient's GEMM
//   dx = reduce_scatter(dX)
//
// with every collective blocking. Neither collective needs the GEMM next to
// it: the re-gather reads only the saved x, and the reduce-scatter only dX.
// Here each becomes a start and a wait, the start moved up and the wait
// down past the ops that do not conflict with it:
//
//   start all_gather(x)  ; dX = dY W^T ; wait ; start reduce_scatter(dX)
//   dW = X^T dY ; wait
//
// A start moves past an op unless the op writes what the collective reads
// or touches what it writes; a wait likewise. Both stop at another
// collective or message (the ranks of a group then start their collectives
// in one order), at an op with regions and at the part's end, and each
// passes at most one GEMM: the point is to hide the transfer, not to hold
// its buffers longer than that takes. Where nothing can overlap a
// collective where it stands, a weight gradient's GEMM from above (off the
// input gradient's chain that the collective is on) comes under it, with
// the ops consuming its result (independentGemmAbove). A collective that
// would overlap no GEMM stays as it is.
//
// A gather whose result only GEMMs need row by row (the column-parallel
// GEMMs after a sequence-parallel gather, forward, and the input
// gradient's GEMM after the gather of the output gradient, backward) has
// nothing independent to overlap. With `collective-matmul` it is done piece
// by piece instead, as Wang et al.'s collective matmul (and Megatron-LM's
// userbuffers, TorchTitan's async tensor parallelism) do: the rank's own
// piece goes through the GEMMs at once while the others travel, g - 1
// point-to-point steps on the group (step s brings the piece of the rank s
// places back), and each arrived piece's rows go through the GEMMs while
// the next travels:
//
//   start shift 1 .. g-1 (x)  ; Y[r] = x W
//   wait 1 ; Y[r-1] = X[r-1] W ; wait 2 ; Y[r-2] = X[r-2] W ; ...
//
// The GEMMs' rows are cut into the same blocks (rt.group_block: which block
// is known only when the program runs), so each element is computed as
// before: only when the data moves changes.
//
// A reduce-scatter of the partial sums a row-parallel GEMM writes (the
// attention's output projection and the MLP's second GEMM, forward) goes
// the same way in reverse: the rows of the block each other rank keeps are
// computed first and sent at once, this rank's own block last, and one
// column sum adds the g partial sums of its block, in rank order:
//
//   Y[r+1] = A[r+1] W ; start shift 1 (Y[r+1]) ; Y[r+2] = ... ; P[r] = A[r] W
//   wait 1 .. g-1 ; y = P[0] + P[1] + ... + P[g-1]
//
// A GEMM of a piece's rows is less efficient than the whole one (fewer
// tiles for the GPU's cores), so only pieces of at least
// `collective-matmul-min-rows` rows are cut, and a collective the plain
// overlap already runs under a GEMM is left to it.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "dialects/Dist/DistOps.h"
#include "dialects/Pipe/PipeOps.h"
#include "dialects/Rt/RtOps.h"

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/IR/Builders.h"

namespace tessel {
#define GEN_PASS_DEF_OVERLAPCOLLECTIVES
#include "tessel/Transforms/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;
namespace rt = tessel::rtir;

namespace {

// The kernels worth hiding a transfer under.
bool isHeavy(Operation *op) {
  return isa<rt::MatmulOp, rt::MatmulBiasOp, rt::MatmulBiasGradOp,
             rt::MatmulGeluGradOp, rt::MatmulAddOp, rt::GroupedMatmulOp,
             rt::GroupedMatmulWeightGradOp, rt::AttentionForwardOp,
             rt::AttentionBackwardOp>(op);
}

// An op a collective may move past when the buffers allow: computation of
// the rt dialect (not a collective, a message or a wait for one) and
// constants.
bool movable(Operation *op) {
  if (op->getNumRegions() > 0 || op->hasTrait<OpTrait::IsTerminator>())
    return false;
  if (isa<arith::ArithDialect>(op->getDialect()))
    return true;
  if (!isa<rt::RtDialect>(op->getDialect()))
    return false;
  return !isa<rt::CommunicationOpInterface, rt::WaitRequestsOp,
              rt::FlushSendsOp, rt::WaitSendsOp, rt::FinishStepOp,
              rt::RecordMetricOp>(op);
}

// A blocking collective to start early and wait for late: what it reads
// and what it writes (roots of buffers).
struct Collective {
  Operation *op;
  SmallVector<Value> reads, writes;
};

// Whether `op` conflicts with `c` in flight: it writes what `c` reads or
// touches what `c` writes. The wait for another started collective does
// when that collective touches any of `c`'s buffers (`c` must not read
// what is still arriving, nor write what is still being sent).
bool conflicts(Operation *op, const Collective &c) {
  if (auto wait = dyn_cast<rt::WaitOp>(op)) {
    Operation *other = wait.getRequest().getDefiningOp();
    if (!other)
      return true;
    return llvm::any_of(other->getOperands(), [&](Value v) {
      return isa<MemRefType>(v.getType()) &&
             (llvm::is_contained(c.reads, rt::rootBuffer(v)) ||
              llvm::is_contained(c.writes, rt::rootBuffer(v)));
    });
  }
  for (OpOperand &use : op->getOpOperands()) {
    Value v = use.get();
    if (!isa<MemRefType>(v.getType()))
      continue;
    Value root = rt::rootBuffer(v);
    if (llvm::is_contained(c.writes, root))
      return true;
    if (llvm::is_contained(c.reads, root) &&
        !rt::onlyReadsOperand(op, use.getOperandNumber()))
      return true;
  }
  return false;
}

// Where the start of `c` can go: the op it would then precede (c.op itself
// when it cannot move), and the allocations and views that must move with
// it. Passes at most one heavy op; `heavy` says whether it did.
Operation *startPlace(const Collective &c, SmallVectorImpl<Operation *> &carried,
                      bool &heavy) {
  Operation *place = c.op;
  heavy = false;
  auto definesOperand = [&](Operation *prev) {
    auto defines = [&](Operation *user) {
      return llvm::any_of(user->getOperands(), [&](Value v) {
        return v.getDefiningOp() == prev;
      });
    };
    return defines(c.op) || llvm::any_of(carried, defines);
  };
  for (Operation *prev = c.op->getPrevNode(); prev;
       prev = prev->getPrevNode()) {
    if (definesOperand(prev)) {
      // Storage is named anywhere before its first use (a view's source,
      // if defined on the way up, is carried too or stops the walk).
      if (isa<rt::AllocOp, rt::ViewOp>(prev)) {
        carried.push_back(prev);
        continue;
      }
      break;
    }
    if (!movable(prev) || conflicts(prev, c))
      break;
    if (isHeavy(prev)) {
      if (heavy)
        break;
      heavy = true;
    }
    place = prev;
  }
  return place;
}

// The op after which the wait of `c` can go (c.op when it cannot move).
Operation *waitPlace(const Collective &c, bool &heavy) {
  Operation *place = c.op;
  heavy = false;
  for (Operation *next = c.op->getNextNode(); next;
       next = next->getNextNode()) {
    if (!movable(next) || conflicts(next, c))
      break;
    if (isHeavy(next)) {
      if (heavy)
        break;
      heavy = true;
    }
    place = next;
  }
  return place;
}

// The buffers `op` may write (roots): every memref operand it does not
// only read.
SmallVector<Value> writesOf(Operation *op) {
  SmallVector<Value> out;
  for (OpOperand &use : op->getOpOperands())
    if (isa<MemRefType>(use.get().getType()) &&
        !rt::onlyReadsOperand(op, use.getOperandNumber()))
      out.push_back(rt::rootBuffer(use.get()));
  return out;
}

// What `op` reads and writes (roots), as a Collective for conflicts().
Collective accessesOf(Operation *op) {
  Collective c{op, {}, writesOf(op)};
  for (Value v : op->getOperands())
    if (isa<MemRefType>(v.getType()))
      c.reads.push_back(rt::rootBuffer(v));
  return c;
}

// When nothing can overlap `c` where it stands (its input is computed
// right before it and read right after), a GEMM above it that it does not
// depend on (a weight gradient's), with what consumes that GEMM's result
// before `c` (the gradient's insertion into a fused weight's, its
// accumulation): moved, in their order, to just after the start, the GEMM
// runs while the collective is in flight. The ops they pass must neither
// write what they read nor touch what they write; every op that touches
// what they write goes with them, and must be light (a second GEMM there
// would be the chain `c` is on). Walking up from `c`, a GEMM inside the
// window of a collective already started (between its start and its
// wait) is what that collective overlaps and stays; the search passes
// such windows and stops at anything else that cannot move, and after a
// few GEMMs, so that the buffers are not held much longer.
SmallVector<Operation *> independentGemmAbove(const Collective &c) {
  constexpr int kMaxTried = 4;
  // The starts whose waits lie between the walk and `c`.
  SmallPtrSet<Operation *, 4> open;
  int tried = 0;
  for (Operation *prev = c.op->getPrevNode(); prev;
       prev = prev->getPrevNode()) {
    if (auto wait = dyn_cast<rt::WaitOp>(prev)) {
      if (Operation *started = wait.getRequest().getDefiningOp())
        open.insert(started);
      continue;
    }
    if (open.erase(prev))
      continue; // a start whose wait was passed
    if (!movable(prev))
      return {};
    if (!isHeavy(prev) || !open.empty())
      continue;
    if (++tried > kMaxTried)
      return {};
    if (conflicts(prev, c))
      continue;
    // The GEMM and what follows it to `c` touching what they write.
    SmallVector<Operation *> cone = {prev};
    Collective moved = accessesOf(prev);
    SmallPtrSet<Operation *, 16> inCone = {prev};
    bool ok = true;
    for (Operation *between = prev->getNextNode(); ok && between != c.op;
         between = between->getNextNode()) {
      bool touches =
          !isa<rt::WaitOp>(between) &&
          llvm::any_of(between->getOperands(), [&](Value v) {
            return isa<MemRefType>(v.getType()) &&
                   llvm::is_contained(moved.writes, rt::rootBuffer(v));
          });
      if (!touches) {
        // It stays: it must not write what the moved ops read nor touch
        // what they write (a wait: its collective must not).
        ok = !conflicts(between, moved);
        continue;
      }
      if (!movable(between) || isHeavy(between)) {
        ok = false;
        break;
      }
      cone.push_back(between);
      inCone.insert(between);
      Collective more = accessesOf(between);
      moved.reads.append(more.reads);
      moved.writes.append(more.writes);
    }
    // What the moved ops define is read by none that stays before `c`, and
    // none of them disturbs `c` in flight.
    for (Operation *op : cone) {
      if (conflicts(op, c))
        ok = false;
      for (Operation *user : op->getUsers())
        if (!inCone.count(user) && user->getBlock() == c.op->getBlock() &&
            user->isBeforeInBlock(c.op))
          ok = false;
    }
    if (ok)
      return cone;
  }
  return {};
}

Collective describe(Operation *op) {
  Collective c{op, {}, {}};
  if (auto ag = dyn_cast<rt::AllGatherOp>(op)) {
    c.reads.push_back(rt::rootBuffer(ag.getInput()));
    c.writes.push_back(rt::rootBuffer(ag.getOutput()));
  } else if (auto rs = dyn_cast<rt::ReduceScatterOp>(op)) {
    c.reads.push_back(rt::rootBuffer(rs.getInput()));
    c.writes.push_back(rt::rootBuffer(rs.getOutput()));
  } else {
    for (Value b : cast<rt::AllReduceOp>(op).getBuffers())
      c.writes.push_back(rt::rootBuffer(b));
  }
  return c;
}

// The collectives this pass starts early: over axes without dp or pp (the
// data-parallel gradients have their own buckets; a pp group joins stages
// that run different programs), and in a forward part the all-reduces
// over dp too (no gradient is reduced there: an MoE router's statistics,
// summed over the tokens of every data-parallel rank).
bool candidate(Operation *op) {
  if (!isa<rt::AllGatherOp, rt::ReduceScatterOp, rt::AllReduceOp>(op))
    return false;
  auto axes = op->getAttrOfType<dist::AxesAttr>("axes");
  if (!axes)
    return false;
  if (axes.getValue().contains(MeshAxis::PP))
    return false;
  if (!axes.getValue().intersects(AxisSet::dataParallel()))
    return true;
  return isa<rt::AllReduceOp>(op) &&
         isa<pipe::ForwardPassOp>(op->getParentOp());
}

// The started form of `c.op`, created before `startBefore`, and its wait
// after `waitAfter`.
void start(const Collective &c, Operation *startBefore, Operation *waitAfter,
           ArrayRef<Operation *> carried) {
  Operation *op = c.op;
  MLIRContext *ctx = op->getContext();
  // What the start names and is not above it already moves with it, in
  // its order.
  for (Operation *moved : llvm::reverse(carried))
    if (startBefore->isBeforeInBlock(moved))
      moved->moveBefore(startBefore);
  OpBuilder b(startBefore);
  Location loc = op->getLoc();
  Type request = rt::RequestType::get(ctx);
  // The ranks' pieces side by side when the dimension is an inner one.
  auto blocksFor = [&](Value whole, int64_t outer) -> Value {
    if (outer == 1)
      return {};
    auto type = cast<MemRefType>(whole.getType());
    return rt::AllocOp::create(
        b, loc, MemRefType::get({type.getNumElements()}, type.getElementType()));
  };
  Value started;
  if (auto ag = dyn_cast<rt::AllGatherOp>(op)) {
    Value blocks = blocksFor(ag.getOutput(), ag.getOuter());
    started = rt::AllGatherStartOp::create(
        b, loc, request, ag.getInput(), ag.getOutput(), blocks,
        ag.getOuterAttr(), ag.getLengthAttr(), ag.getInnerAttr(),
        ag.getAxesAttr(), IntegerAttr());
  } else if (auto rs = dyn_cast<rt::ReduceScatterOp>(op)) {
    Value blocks = blocksFor(rs.getInput(), rs.getOuter());
    started = rt::ReduceScatterStartOp::create(
        b, loc, request, rs.getInput(), rs.getOutput(), blocks,
        rs.getOuterAttr(), rs.getLengthAttr(), rs.getInnerAttr(),
        rs.getAxesAttr(), IntegerAttr());
  } else {
    auto ar = cast<rt::AllReduceOp>(op);
    started = rt::AllReduceStartOp::create(b, loc, request, ar.getBuffers(),
                                           ar.getAxesAttr(), IntegerAttr());
  }
  b.setInsertionPointAfter(waitAfter);
  rt::WaitOp::create(b, loc, started);
  op->erase();
}

// A GEMM whose rows are independent (one batch, A not transposed): its m
// rows, its A's columns, the operands cut into row blocks with it (A, the
// output and any other operand with a row per output row) and the output's
// index.
struct RowShape {
  int64_t m = 0, k = 0;
  SmallVector<unsigned> cut;
  unsigned out = 0;
};
std::optional<RowShape> rowShape(Operation *op) {
  RowShape r;
  if (auto mm = dyn_cast<rt::MatmulOp>(op)) {
    if (mm.getBatch() != 1 || mm.getTransA())
      return std::nullopt;
    r = {mm.getM(), mm.getK(), {0, 2}, 2};
  } else if (auto mm = dyn_cast<rt::MatmulBiasOp>(op)) {
    r = {mm.getM(), mm.getK(), {0, 3}, 3};
    if (mm.getGelu())
      r.cut.push_back(4);
  } else if (auto mm = dyn_cast<rt::MatmulGeluGradOp>(op)) {
    r = {mm.getM(), mm.getK(), {0, 2, 3}, 3};
  } else if (auto mm = dyn_cast<rt::MatmulAddOp>(op)) {
    r = {mm.getM(), mm.getK(), {0, 2, 3}, 3};
  } else {
    return std::nullopt;
  }
  if (r.m <= 0 || llvm::any_of(r.cut, [&](unsigned i) {
        return rt::elementsOf(op->getOperand(i)) % r.m != 0;
      }))
    return std::nullopt;
  return r;
}

// The operands of `op` cut into row blocks when `op` is such a GEMM whose A
// is `whole` with `rows` rows (and no other operand views it); none
// otherwise.
std::optional<SmallVector<unsigned>> rowOperands(Operation *op, Value whole,
                                                 int64_t rows) {
  std::optional<RowShape> r = rowShape(op);
  if (!r || op->getOperand(0) != whole || r->m != rows ||
      rt::elementsOf(whole) != r->m * r->k)
    return std::nullopt;
  for (unsigned i = 1; i < op->getNumOperands(); ++i)
    if (rt::rootBuffer(op->getOperand(i)) == rt::rootBuffer(whole))
      return std::nullopt;
  return r->cut;
}

struct RowGemm {
  Operation *op;
  SmallVector<unsigned> rowOperands;
};

// The GEMMs after `ag`, up to the next op that cannot move, that read its
// result row by row and can move up to it (with the allocations and views
// they name, `carried`), in order.
SmallVector<RowGemm> rowGemmsAfter(rt::AllGatherOp ag, int64_t rows,
                                   SmallVectorImpl<Operation *> &carried) {
  SmallVector<RowGemm> gemms;
  Value whole = ag.getOutput();
  SmallVector<Operation *> between;
  for (Operation *next = ag->getNextNode(); next; next = next->getNextNode()) {
    if (!movable(next))
      break;
    std::optional<SmallVector<unsigned>> cut = rowOperands(next, whole, rows);
    if (!cut) {
      // Nothing may write the gathered buffer before the GEMMs read it.
      if (llvm::is_contained(writesOf(next), rt::rootBuffer(whole)))
        break;
      between.push_back(next);
      continue;
    }
    Collective gemm = accessesOf(next);
    SmallVector<Operation *> needs;
    // Each moved GEMM runs block by block beside the others: none may read
    // what another writes, nor write what another touches.
    bool ok = llvm::none_of(gemms, [&](const RowGemm &prev) {
      return conflicts(prev.op, gemm) || conflicts(next, accessesOf(prev.op));
    });
    for (Operation *op : between) {
      if (!ok)
        break;
      bool defines = llvm::any_of(next->getOperands(), [&](Value v) {
        return v.getDefiningOp() == op;
      });
      if (!defines) {
        ok = !conflicts(op, gemm);
        continue;
      }
      // Storage named on the way (a buffer, a view of one, a parameter's
      // bf16 shadow) moves up with the GEMM, when what it names is above it
      // already.
      if (isa<rt::AllocOp, rt::ViewOp, rt::StateOfOp>(op) &&
          llvm::none_of(op->getOperands(), [&](Value v) {
            return llvm::is_contained(between, v.getDefiningOp());
          }))
        needs.push_back(op);
      else
        ok = false;
    }
    if (!ok) {
      between.push_back(next);
      continue;
    }
    for (Operation *op : needs)
      if (!llvm::is_contained(carried, op))
        carried.push_back(op);
    gemms.push_back({next, *cut});
  }
  return gemms;
}

// Block `shift` of `v` cut into the `g` blocks of the group over `axes`
// (rt.group_block), typed `type` or, by default, flat.
Value groupBlock(OpBuilder &b, Location loc, Value v, dist::AxesAttr axes,
                 int64_t g, int64_t shift, Type type = {}) {
  if (!type)
    type = MemRefType::get({rt::elementsOf(v) / g}, rt::elementTypeOf(v));
  return rt::GroupBlockOp::create(b, loc, type, v, axes, b.getI64IntegerAttr(g),
                                  b.getI64IntegerAttr(shift));
}

// `gemm` again on `operands`, for `rows` of its rows.
void cloneRows(OpBuilder &b, Operation *gemm, ValueRange operands,
               int64_t rows) {
  Operation *chunk = b.clone(*gemm);
  chunk->setOperands(operands);
  chunk->setAttr("m", b.getI64IntegerAttr(rows));
}

// Whether the started form of `op` would run under a GEMM where it stands
// (or, with `moveGemms`, under one moved to it): then it is left to that,
// which costs no GEMM any efficiency.
bool overlapsAsIs(Operation *op, bool moveGemms) {
  Collective c = describe(op);
  SmallVector<Operation *> carried;
  bool before = false, after = false;
  startPlace(c, carried, before);
  waitPlace(c, after);
  return before || after || (moveGemms && !independentGemmAbove(c).empty());
}

// Whether a gather or reduce-scatter between `piece` and `whole` may go
// piece by piece: over a group of several, along the outermost dimension
// (a piece is then a run of rows), in pieces of at least `minRows` rows, on
// a buffer of its own, and not already under a GEMM as it stands.
template <typename Op>
bool cuttable(Op op, Value whole, Value piece, const MeshShape &mesh,
              int64_t minRows, bool moveGemms) {
  int64_t g = mesh.groupSize(op.getAxes());
  return g > 1 && op.getOuter() == 1 && op.getLength() >= minRows &&
         whole.getDefiningOp<rt::AllocOp>() &&
         rt::elementsOf(whole) == g * rt::elementsOf(piece) &&
         !overlapsAsIs(op, moveGemms);
}

// `ag` done piece by piece under the GEMMs that read its result row by row
// (see the file comment); false when there are none.
bool chunkGather(rt::AllGatherOp ag, const MeshShape &mesh, int64_t minRows,
                 bool moveGemms) {
  int64_t g = mesh.groupSize(ag.getAxes());
  Value whole = ag.getOutput(), piece = ag.getInput();
  if (!cuttable(ag, whole, piece, mesh, minRows, moveGemms))
    return false;
  int64_t rows = g * ag.getLength();
  SmallVector<Operation *> carried;
  SmallVector<RowGemm> gemms = rowGemmsAfter(ag, rows, carried);
  if (gemms.empty())
    return false;
  // Storage the GEMMs name moves above the gather, in its order.
  llvm::sort(carried,
             [](Operation *a, Operation *b) { return a->isBeforeInBlock(b); });
  for (Operation *op : carried)
    op->moveBefore(ag);
  OpBuilder b(ag);
  Location loc = ag.getLoc();
  auto blockOf = [&](Value v, int64_t shift) {
    return groupBlock(b, loc, v, ag.getAxesAttr(), g, shift,
                      v == whole ? piece.getType() : Type());
  };
  bool readElsewhere = llvm::any_of(whole.getUsers(), [&](Operation *user) {
    return user != ag.getOperation() &&
           llvm::none_of(gemms,
                         [&](const RowGemm &gemm) { return gemm.op == user; });
  });
  // Others read the gathered tensor whole: this rank's piece goes in too.
  if (readElsewhere)
    rt::CopyOp::create(b, loc, piece, blockOf(whole, 0),
                       b.getI64IntegerAttr(rt::elementsOf(piece)));
  SmallVector<Value> requests;
  Type request = rt::RequestType::get(ag.getContext());
  for (int64_t shift = 1; shift < g; ++shift)
    requests.push_back(rt::ShiftStartOp::create(
        b, loc, request, piece, blockOf(whole, shift),
        b.getI64IntegerAttr(shift), ag.getAxesAttr(), IntegerAttr()));
  for (int64_t shift = 0; shift < g; ++shift) {
    if (shift > 0)
      rt::WaitOp::create(b, loc, requests[shift - 1]);
    for (const RowGemm &gemm : gemms) {
      SmallVector<Value> operands(gemm.op->getOperands());
      for (unsigned i : gemm.rowOperands)
        operands[i] =
            i == 0 && shift == 0 ? piece : blockOf(operands[i], shift);
      cloneRows(b, gemm.op, operands, ag.getLength());
    }
  }
  for (const RowGemm &gemm : gemms)
    gemm.op->erase();
  ag->erase();
  return true;
}

// `rs` done piece by piece under the GEMM that writes its input row by
// row: the rows of the block each other rank keeps are computed first and
// sent to it at once (step s sends the block of the rank s places on and
// receives this rank's block from the rank s places back), this rank's own
// block last; the received partial sums land in a buffer of g pieces, one
// per source rank, which one column sum adds in rank order into the piece.
// False when no such GEMM writes the input just before.
bool chunkReduceScatter(rt::ReduceScatterOp rs, const MeshShape &mesh,
                        int64_t minRows, bool moveGemms) {
  int64_t g = mesh.groupSize(rs.getAxes());
  Value whole = rs.getInput(), piece = rs.getOutput();
  if (!cuttable(rs, whole, piece, mesh, minRows, moveGemms))
    return false;
  // The last op before that writes the summed tensor, past ops that touch
  // neither it nor what that op reads and writes.
  Operation *gemm = nullptr;
  SmallVector<Operation *> between;
  for (Operation *prev = rs->getPrevNode(); prev; prev = prev->getPrevNode()) {
    if (!movable(prev))
      return false;
    if (llvm::is_contained(writesOf(prev), whole)) {
      gemm = prev;
      break;
    }
    between.push_back(prev);
  }
  int64_t rows = g * rs.getLength();
  std::optional<RowShape> shape = gemm ? rowShape(gemm) : std::nullopt;
  if (!shape || shape->m != rows || gemm->getOperand(shape->out) != whole)
    return false;
  // The summed tensor is the GEMM's alone: written by it, read by `rs`.
  if (llvm::any_of(whole.getUsers(), [&](Operation *user) {
        return user != gemm && user != rs.getOperation();
      }))
    return false;
  for (unsigned i = 0; i < gemm->getNumOperands(); ++i)
    if (i != shape->out &&
        rt::rootBuffer(gemm->getOperand(i)) == rt::rootBuffer(whole))
      return false;
  // The GEMM moves down to the reduction: nothing in between may write
  // what it reads or touch what it writes.
  Collective moved = accessesOf(gemm);
  for (Operation *op : between)
    if (conflicts(op, moved))
      return false;
  OpBuilder b(rs);
  Location loc = rs.getLoc();
  auto blockOf = [&](Value v, int64_t shift) {
    return groupBlock(b, loc, v, rs.getAxesAttr(), g, shift);
  };
  int64_t n = rt::elementsOf(piece);
  Value parts = rt::AllocOp::create(
      b, loc, MemRefType::get({g * n}, rt::elementTypeOf(piece)));
  // The GEMM's rows of the block `shift` places back, into `out`.
  auto rowsOf = [&](int64_t shift, Value out) {
    SmallVector<Value> operands(gemm->getOperands());
    for (unsigned i : shape->cut)
      operands[i] = i == shape->out ? out : blockOf(operands[i], shift);
    cloneRows(b, gemm, operands, rs.getLength());
  };
  SmallVector<Value> requests;
  Type request = rt::RequestType::get(rs.getContext());
  for (int64_t shift = 1; shift < g; ++shift) {
    // The block of the rank `shift` places on is `g - shift` places back.
    Value block = blockOf(whole, g - shift);
    rowsOf(g - shift, block);
    requests.push_back(rt::ShiftStartOp::create(
        b, loc, request, block, blockOf(parts, shift),
        b.getI64IntegerAttr(shift), rs.getAxesAttr(), IntegerAttr()));
  }
  rowsOf(0, blockOf(parts, 0));
  for (Value r : requests)
    rt::WaitOp::create(b, loc, r);
  // parts[j] holds rank j's partial sums of this rank's block.
  rt::ReduceSumLeadingOp::create(b, loc, parts, piece, b.getI64IntegerAttr(g),
                                 b.getI64IntegerAttr(n));
  gemm->erase();
  rs->erase();
  return true;
}

struct OverlapCollectivesPass
    : public tessel::impl::OverlapCollectivesBase<OverlapCollectivesPass> {
  using OverlapCollectivesBase::OverlapCollectivesBase;
  void runOnOperation() override {
    ModuleOp module = getOperation();
    SmallVector<Operation *> parts;
    module.walk([&](Operation *op) {
      if (isa<pipe::ForwardPassOp, pipe::BackwardPassOp>(op))
        parts.push_back(op);
    });
    for (Operation *part : parts) {
      MeshShape mesh = dist::meshOf(part);
      Block &body = part->getRegion(0).front();
      if (collectiveMatmul) {
        // The gathers first, then the reduce-scatters, each in program order.
        auto each = [&](auto cut) {
          using Op =
              typename llvm::function_traits<decltype(cut)>::template arg_t<0>;
          SmallVector<Op> ops;
          for (Operation &op : body)
            if (auto c = dyn_cast<Op>(&op); c && candidate(c))
              ops.push_back(c);
          for (Op op : ops)
            cut(op);
        };
        each([&](rt::AllGatherOp ag) {
          chunkGather(ag, mesh, collectiveMatmulMinRows, moveGemms);
        });
        each([&](rt::ReduceScatterOp rs) {
          chunkReduceScatter(rs, mesh, collectiveMatmulMinRows, moveGemms);
        });
      }
      SmallVector<Operation *> collectives;
      for (Operation &op : body)
        if (candidate(&op) &&
            mesh.effective(op.getAttrOfType<dist::AxesAttr>("axes")
                               .getValue())
                    .bits() != 0)
          collectives.push_back(&op);
      // In program order: a later collective's start may then rise above
      // an earlier one's wait, never above its start.
      for (Operation *op : collectives) {
        Collective c = describe(op);
        SmallVector<Operation *> carried;
        bool heavyBefore = false, heavyAfter = false;
        Operation *startBefore = startPlace(c, carried, heavyBefore);
        Operation *waitAfter = waitPlace(c, heavyAfter);
        if (!heavyBefore && !heavyAfter) {
          SmallVector<Operation *> cone;
          if (moveGemms)
            cone = independentGemmAbove(c);
          if (cone.empty())
            continue;
          // The GEMM and its consumers follow the start, and the wait
          // them (the GEMM is the one it may pass).
          Operation *after = op;
          for (Operation *moved : cone) {
            moved->moveAfter(after);
            after = moved;
          }
          startBefore = op;
          waitAfter = waitPlace(c, heavyAfter);
        }
        start(c, startBefore, waitAfter, carried);
      }
    }
  }
};

} // namespace
