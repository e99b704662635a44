//===- GraphSharding.cpp - Sharding rules of the graph ops ---------------===//
//
// One rule per op (ShardingRuleOpInterface): how its results are split given
// its operands' shardings, which shardings it needs of them, and, once the
// partition pass has given everything its local type, how the op computes
// this rank's piece. Partial sums are reduced as late as possible: a rule
// that is linear in an operand lets the partial axes through.
//
//===----------------------------------------------------------------------===//

#include "dialects/Graph/GraphOps.h"

#include "mlir/IR/TypeUtilities.h"

using namespace mlir;
using namespace tessel;
using namespace tessel::graph;
using tessel::dist::PartitionContext;
using tessel::dist::Sharding;
using tessel::dist::ShardingContext;

namespace {

int64_t rankOf(Value v) {
  return cast<RankedTensorType>(v.getType()).getRank();
}
ArrayRef<int64_t> shapeOf(Value v) {
  return cast<RankedTensorType>(v.getType()).getShape();
}

// Same-shape operands, the result like the first: elementwise ops and their
// gradients. `wholeDims` must not be split (a softmax row, a rotated token).
LogicalResult elementwise(Operation *op, ShardingContext &ctx,
                          std::initializer_list<int64_t> wholeDims) {
  Sharding s = ShardingContext::whole(ctx.reduced(op->getOperand(0)), wholeDims);
  for (unsigned i = 0; i < op->getNumOperands(); ++i)
    ctx.require(op, i, s);
  ctx.set(op->getResult(0), s);
  return success();
}

// The axes that split the vocabulary of a lookup table or of logits.
void recordVocabSlice(Operation *op, AxisSet axes) {
  if (!axes.empty())
    op->setAttr("vocab_axes", dist::AxesAttr::get(op->getContext(), axes));
}

// A loss over tokens split across ranks (and microbatches) is, per rank and
// microbatch, the sum of its tokens' losses over the global token count, so
// that the pieces add up to the global mean: the local mean scaled by
// 1 / pieces. The gradient is scaled alike.
LogicalResult scaleOverSplitTokens(Operation *op, PartitionContext &ctx,
                                   bool isGradient) {
  Sharding targets = ctx.shardingOf(op->getOperand(1));
  AxisSet axes = targets.leadingAxes(targets.dims.size());
  int64_t pieces = ctx.mesh().groupSize(axes) * ctx.microbatches();
  if (pieces == 1)
    return success();
  auto scalar = RankedTensorType::get(
      {}, cast<ShapedType>(op->getOperand(0).getType()).getElementType());
  Sharding replicated = Sharding::replicated(0);
  if (isGradient) {
    OpBuilder b = ctx.builderBefore(op);
    auto scale =
        FillOp::create(b, op->getLoc(), scalar, b.getF64FloatAttr(1.0 / pieces));
    auto dloss = MulOp::create(b, op->getLoc(), op->getOperand(2), scale);
    ctx.annotate(scale, {replicated});
    ctx.annotate(dloss, {replicated});
    op->setOperand(2, dloss);
    return success();
  }
  OpBuilder b = ctx.builderAfter(op);
  auto scale =
      FillOp::create(b, op->getLoc(), scalar, b.getF64FloatAttr(1.0 / pieces));
  Value loss = op->getResult(0);
  auto scaled = MulOp::create(b, op->getLoc(), loss, scale);
  ctx.annotate(scale, {replicated});
  ctx.annotate(scaled, {ctx.shardingOf(loss)});
  loss.replaceAllUsesExcept(scaled, scaled);
  return success();
}

// Scales a loss (or its gradient operand `gradOperand`) by 1 / pieces: the
// loss over `axes`-split tokens and the microbatches (see above).
LogicalResult scaleLoss(Operation *op, PartitionContext &ctx, int64_t pieces,
                        std::optional<unsigned> gradOperand) {
  if (pieces == 1)
    return success();
  Type element = getElementTypeOrSelf(op->getResult(0).getType());
  auto scalar = RankedTensorType::get({}, element);
  Sharding replicated = Sharding::replicated(0);
  OpBuilder b = gradOperand ? ctx.builderBefore(op) : ctx.builderAfter(op);
  auto scale =
      FillOp::create(b, op->getLoc(), scalar, b.getF64FloatAttr(1.0 / pieces));
  ctx.annotate(scale, {replicated});
  if (gradOperand) {
    auto d = MulOp::create(b, op->getLoc(), op->getOperand(*gradOperand), scale);
    ctx.annotate(d, {replicated});
    op->setOperand(*gradOperand, d);
    return success();
  }
  Value loss = op->getResult(0);
  auto scaled = MulOp::create(b, op->getLoc(), loss, scale);
  ctx.annotate(scaled, {ctx.shardingOf(loss)});
  loss.replaceAllUsesExcept(scaled, scaled);
  return success();
}

// KV heads replicated over a group larger than their number: this rank's
// query heads [r*Hl, (r+1)*Hl) all read KV head r*Hl / (H/Hkv). Slice it out
// of k and v; under the gradient, place dk and dv back into zeros (a partial
// sum over the group).
LogicalResult selectKVHead(Operation *op, AxisSet axes, PartitionContext &ctx) {
  auto q = cast<RankedTensorType>(op->getOperand(0).getType());
  auto k = cast<RankedTensorType>(op->getOperand(1).getType());
  int64_t localHeads = q.getDimSize(2);
  int64_t queriesPerKV =
      localHeads * ctx.mesh().groupSize(axes) / k.getDimSize(2);
  auto one = RankedTensorType::get(
      {k.getDimSize(0), k.getDimSize(1), 1, k.getDimSize(3)},
      k.getElementType());
  auto axesAttr = dist::AxesAttr::get(op->getContext(), axes);
  OpBuilder b = ctx.builderBefore(op);
  for (unsigned i : {1u, 2u}) {
    auto slice = dist::LocalSliceOp::create(
        b, op->getLoc(), one, op->getOperand(i), axesAttr,
        b.getI64IntegerAttr(2), b.getI64IntegerAttr(localHeads),
        b.getI64IntegerAttr(queriesPerKV));
    ctx.annotate(slice, {Sharding::replicated(4)});
    op->setOperand(i, slice);
  }
  if (!isa<AttentionGradOp>(op))
    return success();
  OpBuilder after = ctx.builderAfter(op);
  for (unsigned i : {1u, 2u}) {
    Value grad = op->getResult(i);
    Type whole = grad.getType();
    Sharding sharding = ctx.shardingOf(grad);
    grad.setType(one);
    auto insert = dist::LocalInsertOp::create(
        after, op->getLoc(), whole, grad, axesAttr, after.getI64IntegerAttr(2),
        after.getI64IntegerAttr(localHeads),
        after.getI64IntegerAttr(queriesPerKV));
    ctx.annotate(insert, {sharding});
    grad.replaceAllUsesExcept(insert, insert);
  }
  return success();
}

// A [batch, seq, ...] activation's sequence may stay split over the
// context-parallel axis (in one block); any other split of it is gathered.
Sharding sequenceOverCp(Sharding s) {
  AxisSet rows = s.blocksOf(1) == 1 ? s.dims[1] & AxisSet(MeshAxis::CP)
                                    : AxisSet();
  s = ShardingContext::whole(s, {1});
  s.setBlocks(1, 1);
  s.dims[1] = rows;
  return s;
}

// Where a rank's piece of a [batch, seq, ...] value starts along the
// sequence: the axes splitting it, recorded for the kernel (none: absent).
void recordSequenceAxes(Operation *op, const Sharding &s) {
  if (s.dims[1].empty())
    op->removeAttr("seq_axes");
  else
    op->setAttr("seq_axes",
                dist::AxesAttr::get(op->getContext(), s.dims[1]));
}

// Attention and its gradient: batch and heads may be split, and the queries'
// sequence over cp (each rank attends with its own queries over all keys,
// which are gathered); the head dimension must be whole.
LogicalResult propagateAttention(Operation *op, ShardingContext &ctx,
                                 bool grad) {
  Value q = op->getOperand(0), k = op->getOperand(1);
  Sharding sq = sequenceOverCp(ShardingContext::whole(ctx.reduced(q), {3}));
  AxisSet rows = sq.dims[1];
  AxisSet heads = sq.dims[2];
  Sharding sk = ShardingContext::whole(ctx.reduced(k), {1, 3});
  sk.dims[0] = sq.dims[0];
  int64_t kvHeads = shapeOf(k)[2], group = ctx.mesh().groupSize(heads);
  bool replicateKV = !heads.empty() && kvHeads % group != 0;
  if (replicateKV && group % kvHeads != 0)
    return op->emitOpError("kv heads (")
           << kvHeads << ") neither divide nor are a multiple of the "
           << heads.str() << " group of " << group;
  // Fewer KV heads than ranks: every rank holds all KV heads and reads the
  // one its query heads use (localize selects it).
  sk.dims[2] = replicateKV ? AxisSet() : heads;
  if (replicateKV)
    op->setAttr("kv_replicated", dist::AxesAttr::get(op->getContext(), heads));
  else
    op->removeAttr("kv_replicated");
  // The row log-sum-exp [B, H, T] follows the query's batch, heads and rows.
  Sharding lse = Sharding::replicated(3);
  lse.dims[0] = sq.dims[0];
  lse.dims[1] = sq.dims[2];
  lse.dims[2] = rows;
  ctx.require(op, 0, sq);
  ctx.require(op, 1, sk);
  ctx.require(op, 2, sk);
  if (grad) {
    ctx.require(op, 3, sq);  // the forward's result
    ctx.require(op, 4, lse); // and its log-sum-exp
    ctx.require(op, 5, sq);  // the result's gradient
  }
  ctx.set(op->getResult(0), sq);
  if (!grad)
    ctx.set(op->getResult(1), lse);
  if (grad) {
    // With replicated KV heads each rank contributes to its KV head only;
    // with the queries split over cp, each rank's queries to every key.
    Sharding dk = sk;
    if (replicateKV)
      dk.partial |= heads;
    dk.partial |= rows;
    ctx.set(op->getResult(1), dk);
    ctx.set(op->getResult(2), dk);
  }
  return success();
}

// Logits may be split along the vocabulary (vocab-parallel loss: the full
// logits are never gathered); tokens follow the targets.
Sharding logitsFor(Operation *op, ShardingContext &ctx) {
  Sharding t = ctx.get(op->getOperand(1));
  Sharding l = ctx.reduced(op->getOperand(0));
  for (size_t d = 0; d < t.dims.size(); ++d)
    l.dims[d] = t.dims[d];
  return l;
}

} // namespace

//===----------------------------------------------------------------------===//
// Leaves
//===----------------------------------------------------------------------===//

LogicalResult ParamOp::propagateSharding(ShardingContext &ctx) {
  Sharding s = Sharding::replicated(getType().getRank());
  if (auto attr = (*this)->getAttrOfType<dist::ShardingAttr>(
          "dist.param_sharding"))
    s = Sharding::fromAttr(attr);
  // The plan names axes the mesh may not have: those split nothing.
  for (auto [d, axes] : llvm::enumerate(s.dims)) {
    axes &= ctx.activeAxes();
    if (axes.empty())
      s.setBlocks(d, 1);
  }
  ctx.set(getResult(), s);
  return success();
}

LogicalResult InputOp::propagateSharding(ShardingContext &ctx) {
  // Token ids are split along the batch over dp (and ep, which splits the
  // batch further for all but the experts), and along the sequence over cp.
  Sharding s = Sharding::replicated(2);
  s.dims[0] = ctx.activeAxes() & (AxisSet(MeshAxis::DP) | MeshAxis::EP);
  s.dims[1] = ctx.activeAxes() & AxisSet(MeshAxis::CP);
  ctx.set(getResult(), s);
  return success();
}

LogicalResult FillOp::propagateSharding(ShardingContext &) {
  return success(); // replicated
}

//===----------------------------------------------------------------------===//
// Elementwise
//===----------------------------------------------------------------------===//

LogicalResult GeluOp::propagateSharding(ShardingContext &ctx) {
  return elementwise(*this, ctx, {});
}
LogicalResult SiluOp::propagateSharding(ShardingContext &ctx) {
  return elementwise(*this, ctx, {});
}
LogicalResult GeluGradOp::propagateSharding(ShardingContext &ctx) {
  return elementwise(*this, ctx, {});
}
LogicalResult SiluGradOp::propagateSharding(ShardingContext &ctx) {
  return elementwise(*this, ctx, {});
}
// The mask follows from global coordinates, so any split of the input
// will do; partitioning records it for the kernel.
LogicalResult DropoutOp::propagateSharding(ShardingContext &ctx) {
  return elementwise(*this, ctx, {});
}
LogicalResult DropoutOp::localize(PartitionContext &ctx) {
  Sharding s = ctx.shardingOf(getInput());
  SmallVector<int64_t> axes;
  for (const AxisSet &dim : s.dims)
    axes.push_back(dim.bits());
  setSplitAxes(axes);
  setMicrobatches(ctx.microbatches());
  return success();
}
LogicalResult SoftmaxOp::propagateSharding(ShardingContext &ctx) {
  // A causal row's mask follows from its index along the rows.
  if (getCausal())
    return elementwise(*this, ctx, {-2, -1});
  return elementwise(*this, ctx, {-1});
}
LogicalResult SoftmaxGradOp::propagateSharding(ShardingContext &ctx) {
  return elementwise(*this, ctx, {-1});
}
LogicalResult RopeOp::propagateSharding(ShardingContext &ctx) {
  // Linear in its input: a partial sum (the gradient of KV heads replicated
  // over tp) rotates as it is and is summed later, where a consumer can
  // take it split (a reduce-scatter) rather than whole.
  Sharding in = ctx.get(getInput());
  if (!in.partial.empty() && in == sequenceOverCp(in) && in.dims[3].empty()) {
    ctx.set(getResult(), in);
    return success();
  }
  // A token's rotation needs its position: the sequence is whole, or split
  // over cp (a piece's positions start at its offset), and a head whole.
  Sharding s =
      sequenceOverCp(ShardingContext::whole(ctx.reduced(getInput()), {3}));
  ctx.require(*this, 0, s);
  ctx.set(getResult(), s);
  return success();
}
// A permutation of the sequence: it must be whole (each row comes from
// another piece); linear, so a partial sum passes through as it is.
LogicalResult ZigzagOp::propagateSharding(ShardingContext &ctx) {
  int64_t dim = getDim();
  Sharding in = ctx.get(getInput());
  if (!in.partial.empty() && in.dims[dim].empty()) {
    ctx.set(getResult(), in);
    return success();
  }
  return elementwise(*this, ctx, {dim});
}
LogicalResult RopeOp::localize(PartitionContext &ctx) {
  recordSequenceAxes(*this, ctx.shardingOf(getResult()));
  return success();
}

// An operand broadcast over leading dimensions is split like the trailing
// dimensions of the other.
static LogicalResult propagateBroadcast(Operation *op, ShardingContext &ctx) {
  Value lhs = op->getOperand(0), rhs = op->getOperand(1);
  Sharding lt = ctx.reduced(lhs);
  Sharding rt;
  size_t lead = lt.dims.size() - rankOf(rhs);
  rt.dims.assign(lt.dims.begin() + lead, lt.dims.end());
  for (size_t d = 0; d < rt.dims.size(); ++d)
    rt.setBlocks(d, lt.blocksOf(lead + d));
  ctx.require(op, 0, lt);
  ctx.require(op, 1, rt);
  ctx.set(op->getResult(0), lt);
  return success();
}

LogicalResult AddOp::propagateSharding(ShardingContext &ctx) {
  // A sum of partial sums stays partial: reduced once, later. Unless a
  // summand is reduced for another consumer anyway (a residual stream read
  // by the next norm): then the sum is of reduced terms, as Megatron adds
  // the reduced sublayer output to the residual, and what flows on (to the
  // next stage too) is reduced, not b*s*h partial sums.
  Sharding l = ctx.get(getLhs()), r = ctx.get(getRhs());
  if (getLhs().getType() == getRhs().getType() && l == r &&
      !(!l.partial.empty() &&
        (ctx.isReducedAnyway(getLhs()) || ctx.isReducedAnyway(getRhs())))) {
    ctx.set(getResult(), l);
    return success();
  }
  return propagateBroadcast(*this, ctx);
}

LogicalResult MulOp::propagateSharding(ShardingContext &ctx) {
  return propagateBroadcast(*this, ctx);
}

LogicalResult ReduceSumOp::propagateSharding(ShardingContext &ctx) {
  // Summing over split leading dimensions leaves a partial sum.
  Sharding in = ctx.get(getInput()), out;
  size_t lead = in.dims.size() - rankOf(getResult());
  out.dims.assign(in.dims.begin() + lead, in.dims.end());
  out.partial = in.partial | in.leadingAxes(lead);
  for (size_t d = 0; d < out.dims.size(); ++d)
    out.setBlocks(d, in.blocksOf(lead + d));
  ctx.set(getResult(), out);
  return success();
}

//===----------------------------------------------------------------------===//
// Norms
//===----------------------------------------------------------------------===//

// The normalised dimension is whole; the weights are replicated.
static LogicalResult propagateNorm(Operation *op, ShardingContext &ctx) {
  Sharding s = ShardingContext::whole(ctx.reduced(op->getOperand(0)), {-1});
  ctx.require(op, 0, s);
  for (unsigned i = 1; i < op->getNumOperands(); ++i)
    ctx.require(op, i, Sharding::replicated(1));
  ctx.set(op->getResult(0), s);
  return success();
}

// The weight gradients sum over the rows: partial over the axes splitting
// them.
static LogicalResult propagateNormGrad(Operation *op, ShardingContext &ctx) {
  Sharding s = ShardingContext::whole(ctx.reduced(op->getOperand(0)), {-1});
  ctx.require(op, 0, s);
  ctx.require(op, 1, Sharding::replicated(1));
  ctx.require(op, 2, s);
  ctx.set(op->getResult(0), s);
  Sharding w = Sharding::replicated(1);
  w.partial = s.leadingAxes(s.dims.size() - 1);
  for (unsigned i = 1; i < op->getNumResults(); ++i)
    ctx.set(op->getResult(i), w);
  return success();
}

LogicalResult LayerNormOp::propagateSharding(ShardingContext &ctx) {
  return propagateNorm(*this, ctx);
}
LogicalResult RmsNormOp::propagateSharding(ShardingContext &ctx) {
  return propagateNorm(*this, ctx);
}
LogicalResult LayerNormGradOp::propagateSharding(ShardingContext &ctx) {
  return propagateNormGrad(*this, ctx);
}
LogicalResult RmsNormGradOp::propagateSharding(ShardingContext &ctx) {
  return propagateNormGrad(*this, ctx);
}

//===----------------------------------------------------------------------===//
// Attention
//===----------------------------------------------------------------------===//

LogicalResult AttentionOp::propagateSharding(ShardingContext &ctx) {
  return propagateAttention(*this, ctx, /*grad=*/false);
}
LogicalResult AttentionGradOp::propagateSharding(ShardingContext &ctx) {
  return propagateAttention(*this, ctx, /*grad=*/true);
}
LogicalResult AttentionOp::localize(PartitionContext &ctx) {
  recordSequenceAxes(*this, ctx.shardingOf(getQuery()));
  if (auto axes = getKvReplicatedAttr())
    return selectKVHead(*this, axes.getValue(), ctx);
  return success();
}
LogicalResult AttentionGradOp::localize(PartitionContext &ctx) {
  recordSequenceAxes(*this, ctx.shardingOf(getQuery()));
  if (auto axes = getKvReplicatedAttr())
    return selectKVHead(*this, axes.getValue(), ctx);
  return success();
}

//===----------------------------------------------------------------------===//
// Loss and embedding
//===----------------------------------------------------------------------===//

LogicalResult CrossEntropyOp::propagateSharding(ShardingContext &ctx) {
  ctx.require(*this, 0, logitsFor(*this, ctx));
  // The mean over split tokens is a partial sum over the axes splitting
  // them.
  Sharding t = ctx.get(getTargets());
  Sharding loss = Sharding::replicated(0);
  loss.partial = t.leadingAxes(t.dims.size());
  ctx.set(getResult(), loss);
  return success();
}

LogicalResult CrossEntropyGradOp::propagateSharding(ShardingContext &ctx) {
  Sharding l = logitsFor(*this, ctx);
  ctx.require(*this, 0, l);
  ctx.require(*this, 2, Sharding::replicated(0));
  ctx.set(getResult(), l);
  return success();
}

LogicalResult CrossEntropyOp::localize(PartitionContext &ctx) {
  recordVocabSlice(*this, ctx.shardingOf(getLogits()).dims.back());
  return scaleOverSplitTokens(*this, ctx, /*isGradient=*/false);
}

LogicalResult CrossEntropyGradOp::localize(PartitionContext &ctx) {
  recordVocabSlice(*this, ctx.shardingOf(getLogits()).dims.back());
  return scaleOverSplitTokens(*this, ctx, /*isGradient=*/true);
}

LogicalResult EmbeddingOp::propagateSharding(ShardingContext &ctx) {
  // A table split along the vocabulary gives each rank the rows of its own
  // tokens and zeros elsewhere: a partial sum.
  Sharding table = ShardingContext::whole(ctx.reduced(getTable()), {1});
  ctx.require(*this, 0, table);
  Sharding out = ctx.get(getIds());
  out.dims.push_back({});
  out.partial = table.dims[0];
  ctx.set(getResult(), out);
  return success();
}

LogicalResult EmbeddingOp::localize(PartitionContext &ctx) {
  recordVocabSlice(*this, ctx.shardingOf(getTable()).dims[0]);
  return success();
}

LogicalResult EmbeddingGradOp::propagateSharding(ShardingContext &ctx) {
  Sharding ids = ctx.get(getIds());
  Sharding dy = ShardingContext::whole(ctx.reduced(getGrad()), {-1});
  for (size_t d = 0; d < ids.dims.size(); ++d)
    dy.dims[d] = ids.dims[d];
  ctx.require(*this, 1, dy);
  // The table gradient is split along the vocabulary as the table the ids
  // were looked up in, and partial over the axes splitting the tokens.
  Sharding out = Sharding::replicated(2);
  for (Operation *user : getIds().getUsers())
    if (auto lookup = dyn_cast<EmbeddingOp>(user))
      out.dims[0] = ctx.get(lookup.getTable()).dims[0];
  out.partial = ids.leadingAxes(ids.dims.size());
  ctx.set(getResult(), out);
  return success();
}

LogicalResult EmbeddingGradOp::localize(PartitionContext &ctx) {
  recordVocabSlice(*this, ctx.shardingOf(getResult()).dims[0]);
  return success();
}

//===----------------------------------------------------------------------===//
// Matmul and layout
//===----------------------------------------------------------------------===//

LogicalResult MatmulOp::propagateSharding(ShardingContext &ctx) {
  bool tl = getTransposeLhs(), tr = getTransposeRhs();
  int64_t lr = rankOf(getLhs()), rr = rankOf(getRhs());
  int64_t lM = tl ? lr - 1 : lr - 2, lK = tl ? lr - 2 : lr - 1;
  int64_t rK = tr ? rr - 1 : rr - 2, rN = tr ? rr - 2 : rr - 1;
  Sharding l = ctx.reduced(getLhs()), r = ctx.reduced(getRhs());
  bool sumBatch = getSumBatch();
  // An operand that is a partial sum over axes P (the gradient of KV heads
  // replicated over tp) need not be summed whole: split along a dimension
  // by P it is a reduce-scatter, half an all-reduce. Along K where the
  // other side splits K by P (the product is then partial over P, summed
  // with the sums it joins), or, for a weight gradient (sum_batch), along M
  // (the gradient comes out split like a column-parallel weight).
  auto splitPartial = [&](Value v, Sharding &self, int64_t kDim,
                          int64_t mDim, const Sharding &other,
                          int64_t otherK) {
    AxisSet partial = ctx.get(v).partial, used;
    for (const AxisSet &d : self.dims)
      used |= d;
    partial -= used;
    ArrayRef<int64_t> shape = shapeOf(v);
    auto divides = [&](AxisSet axes, int64_t d) {
      return !axes.empty() && shape[d] % ctx.mesh().groupSize(axes) == 0;
    };
    AxisSet viaK = partial & other.dims[otherK];
    if (self.dims[kDim].empty() && divides(viaK, kDim)) {
      self.dims[kDim] = viaK;
      partial -= viaK;
    }
    if (sumBatch && mDim >= 0 && self.dims[mDim].empty() &&
        divides(partial, mDim))
      self.dims[mDim] = partial;
  };
  splitPartial(getLhs(), l, lK, lM, r, rK);
  splitPartial(getRhs(), r, rK, -1, l, lK);
  // Contract over the axes both sides split K by (and, with sum_batch, each
  // batch dimension by); gather the others.
  AxisSet k;
  for (int64_t d = 0; d < lr - 2; ++d)
    if (sumBatch) {
      l.dims[d] = r.dims[d] = l.dims[d] & r.dims[d];
      k |= l.dims[d];
    }
  k |= l.dims[lK] & r.dims[rK];
  l.dims[lK] = r.dims[rK] = l.dims[lK] & r.dims[rK];
  // An axis cannot split both the rows and the columns of the result: the
  // rows (the activation) are gathered, as before Megatron's column-parallel
  // matmul under sequence parallelism.
  AxisSet n = r.dims[rN];
  for (int64_t d = 0; d < lr; ++d)
    if (d != lK)
      l.dims[d] -= n;
  if (rr == lr && !sumBatch)
    for (int64_t d = 0; d < lr - 2; ++d)
      r.dims[d] = l.dims[d];
  ctx.require(*this, 0, l);
  ctx.require(*this, 1, r);
  Sharding out;
  for (int64_t d = 0; d < lr - 2 && !sumBatch; ++d)
    out.dims.push_back(l.dims[d]);
  out.dims.append({l.dims[lM], n});
  out.partial = k;
  out.setBlocks(out.dims.size() - 1, r.blocksOf(rN));
  ctx.set(getResult(), out);
  return success();
}

// Maps a sharding through a reshape. Dimensions are matched in groups of
// equal products; a split of a group's outermost dimension stays on the
// outermost dimension of the result's group. Anything else is gathered first.
LogicalResult ReshapeOp::propagateSharding(ShardingContext &ctx) {
  ArrayRef<int64_t> in = shapeOf(getInput()), out = shapeOf(getResult());
  Sharding s = ctx.get(getInput());
  // What the reshape needs of its input: splits it can carry over, the
  // others gathered.
  Sharding required = s;
  Sharding result;
  result.partial = s.partial;
  result.dims.assign(out.size(), AxisSet());
  size_t i = 0, o = 0;
  while (i < in.size() || o < out.size()) {
    size_t i0 = i, o0 = o;
    int64_t pi = i < in.size() ? in[i++] : 1,
            po = o < out.size() ? out[o++] : 1;
    while (pi != po) {
      if (pi < po && i < in.size())
        pi *= in[i++];
      else if (o < out.size())
        po *= out[o++];
      else
        break;
    }
    if (i0 >= in.size())
      continue;
    // Only a split of the group's outermost dimension is a split into
    // contiguous blocks of the merged or re-split dimension. A split of an
    // inner one (say the sequence under a merged [batch * seq]) would
    // permute rows: only that one is gathered, and the outer split (the
    // batch's data-parallel split) is kept.
    for (size_t d = i0 + 1; d < i; ++d)
      required.dims[d] = AxisSet();
    AxisSet outer = s.dims[i0];
    if (outer.empty())
      continue;
    if (s.blocksOf(i0) == 1 && out[o0] % ctx.mesh().groupSize(outer) == 0)
      result.dims[o0] = outer;
    else
      required.dims[i0] = AxisSet();
  }
  if (!(required == s)) {
    required.blocks.clear();
    for (size_t d = 0; d < required.dims.size(); ++d)
      if (!required.dims[d].empty())
        required.setBlocks(d, s.blocksOf(d));
    ctx.require(*this, 0, required);
  }
  ctx.set(getResult(), result);
  return success();
}

LogicalResult TransposeOp::propagateSharding(ShardingContext &ctx) {
  Sharding in = ctx.get(getInput()), out = in;
  out.blocks.clear();
  for (auto [i, p] : llvm::enumerate(getPermutation())) {
    out.dims[i] = in.dims[p];
    out.setBlocks(i, in.blocksOf(p));
  }
  ctx.set(getResult(), out);
  return success();
}

LogicalResult SplitOp::propagateSharding(ShardingContext &ctx) {
  // A dimension split in as many blocks as there are equal pieces (GPT-2's
  // fused q|k|v) splits into pieces split the same way.
  int64_t axis = getAxis();
  Sharding in = ctx.reduced(getInput());
  bool equal = llvm::all_equal(
      llvm::map_range(getResults(), [&](Value r) { return shapeOf(r)[axis]; }));
  if (!(!in.dims[axis].empty() && equal &&
        in.blocksOf(axis) == (int64_t)getNumResults()))
    in = ShardingContext::whole(in, {axis});
  ctx.require(*this, 0, in);
  Sharding piece = in;
  piece.setBlocks(axis, 1);
  for (Value r : getResults())
    ctx.set(r, piece);
  return success();
}

LogicalResult ConcatOp::propagateSharding(ShardingContext &ctx) {
  int64_t axis = getAxis();
  // Partial sums joined along a dimension that is whole, or split alike in
  // every piece (each rank joins its part of each piece, as blocks), stay
  // partial: the joined tensor is reduced once, later (GPT-2's q|k|v weight
  // gradients join before the data-parallel reduction, in its bucket, with
  // or without tensor parallelism).
  Sharding first = ctx.get(getInputs().front());
  Sharding s;
  if (!first.partial.empty() &&
      (first.dims[axis].empty() || first.blocksOf(axis) == 1) &&
      llvm::all_equal(getInputs().getTypes()) &&
      llvm::all_of(getInputs(),
                   [&](Value v) { return ctx.get(v) == first; })) {
    s = first;
  } else {
    s = ctx.reduced(getInputs().front());
    bool same = llvm::all_equal(getInputs().getTypes()) &&
                llvm::all_of(getInputs(), [&](Value v) {
                  Sharding o = ctx.get(v);
                  o.partial = {};
                  return o == s;
                });
    if (!(!s.dims[axis].empty() && s.blocksOf(axis) == 1 && same))
      s = ShardingContext::whole(s, {axis});
  }
  for (unsigned i = 0; i < getNumOperands(); ++i)
    ctx.require(*this, i, s);
  Sharding out = s;
  if (!out.dims[axis].empty())
    out.setBlocks(axis, getInputs().size());
  ctx.set(getResult(), out);
  return success();
}

//===----------------------------------------------------------------------===//
// Optimizer
//===----------------------------------------------------------------------===//

LogicalResult GlobalNormOp::propagateSharding(ShardingContext &ctx) {
  // Each gradient summed and split as AdamW needs it for its parameter (one
  // reduction serves both). Not `reduced`: under sequence parallelism that
  // would split a stacked expert weight's gradient ([E, in, out]) as if it
  // were a [batch, seq, hidden] activation, a second collective.
  for (unsigned i = 0; i < getNumOperands(); ++i) {
    Value grad = getOperand(i);
    Sharding s = ctx.get(grad);
    s.partial = {};
    for (Operation *user : grad.getUsers())
      if (auto update = dyn_cast<AdamWOp>(user);
          update && update.getGrad() == grad)
        s = ctx.get(update.getParam());
    ctx.require(*this, i, s);
  }
  return success();
}

LogicalResult GlobalNormOp::localize(PartitionContext &ctx) {
  // A split gradient's squares are summed over the axes that split it.
  SmallVector<Attribute> axes;
  for (Value g : getInputs()) {
    Sharding s = ctx.shardingOf(g);
    axes.push_back(dist::AxesAttr::get(getContext(), s.allAxes() - s.partial));
  }
  setReduceAxesAttr(ArrayAttr::get(getContext(), axes));
  return success();
}

LogicalResult AdamWOp::propagateSharding(ShardingContext &ctx) {
  // The update needs the whole gradient of this rank's shard: here the
  // data-parallel gradient all-reduce appears.
  ctx.require(*this, 1, ctx.get(getParam()));
  ctx.require(*this, 2, Sharding::replicated(0));
  return success();
}

//===----------------------------------------------------------------------===//
// Inference
//===----------------------------------------------------------------------===//

// A cache is split as the keys it holds: its plan (dist.param_sharding, the
// heads over tp) on the axes the mesh has.
LogicalResult KvCacheOp::propagateSharding(ShardingContext &ctx) {
  Sharding s = Sharding::replicated(4);
  if (auto attr = (*this)->getAttrOfType<dist::ShardingAttr>(
          "dist.param_sharding"))
    s = Sharding::fromAttr(attr);
  for (AxisSet &axes : s.dims)
    axes &= ctx.activeAxes();
  ctx.set(getResult(), s);
  return success();
}

// As graph.attention, with the caches split like the keys (they are written
// in place, so they must already be: the query heads of a rank read only
// the KV heads it holds).
LogicalResult CachedAttentionOp::propagateSharding(ShardingContext &ctx) {
  Sharding sq = ShardingContext::whole(ctx.reduced(getQuery()), {1, 3});
  AxisSet heads = sq.dims[2];
  int64_t kvHeads = shapeOf(getKey())[2], group = ctx.mesh().groupSize(heads);
  if (!heads.empty() && kvHeads % group != 0)
    return emitOpError("kv heads (")
           << kvHeads << ") must be a multiple of the " << heads.str()
           << " group of " << group << " to keep a KV cache per rank";
  Sharding sk = sq;
  Sharding cache = ctx.get(getKCache());
  if (cache.dims[0] != sq.dims[0] || cache.dims[2] != heads ||
      !cache.dims[1].empty() || !cache.dims[3].empty() ||
      ctx.get(getVCache()) != cache)
    return emitOpError("the KV caches must be split as the keys are: "
                       "along the batch and the heads only");
  Sharding pos = Sharding::replicated(2);
  pos.dims[0] = sq.dims[0];
  ctx.require(*this, 0, sq);
  ctx.require(*this, 1, sk);
  ctx.require(*this, 2, sk);
  ctx.require(*this, 5, pos);
  ctx.set(getResult(), sq);
  return success();
}

LogicalResult RopeAtOp::propagateSharding(ShardingContext &ctx) {
  Sharding s = ShardingContext::whole(ctx.reduced(getInput()), {1, 3});
  Sharding pos = Sharding::replicated(2);
  pos.dims[0] = s.dims[0];
  ctx.require(*this, 0, s);
  ctx.require(*this, 1, pos);
  ctx.set(getResult(), s);
  return success();
}

// The runtime reads the whole logits on every rank.
LogicalResult OutputOp::propagateSharding(ShardingContext &ctx) {
  ctx.require(*this, 0, Sharding::replicated(rankOf(getValue())));
  return success();
}

//===----------------------------------------------------------------------===//
// Mixture of experts: tokens may be split (over dp, and over tp under
// sequence parallelism); an expert-major buffer's rows are this rank's
// tokens' assignments, split over the same axes; expert weights are whole
// but for ep (their experts) and, with parallel.expert_tp, tp (their hidden
// width). Then every tp rank routes the same tokens, and the experts'
// outputs are partial sums over tp until the block's output is reduced, as
// a dense MLP's are: dispatch, exchange, combine and unpermute are linear in
// the rows and carry the partial sum.
//===----------------------------------------------------------------------===//

namespace {
// Tokens split as `s` (leading dimensions), the last dimension whole.
Sharding perToken(const Sharding &tokens, size_t rank) {
  Sharding s = Sharding::replicated(rank);
  for (size_t d = 0; d + 1 < tokens.dims.size() && d + 1 < rank; ++d)
    s.dims[d] = tokens.dims[d];
  return s;
}
// An expert-major buffer [R, X] holding the assignments of tokens split as
// `tokens`.
Sharding rowsOf(const Sharding &tokens) {
  Sharding s = Sharding::replicated(2);
  s.dims[0] = tokens.leadingAxes(tokens.dims.size() - 1);
  return s;
}
AxisSet tokenAxes(const Sharding &tokens) {
  return tokens.leadingAxes(tokens.dims.size() - 1);
}
// What routing reads of per-token values `s`: the last dimension whole and,
// with the experts split over tp, the tokens too (every tp rank routes them
// all).
Sharding routed(ShardingContext &ctx, Sharding s) {
  s = ShardingContext::whole(s, {-1});
  if (ctx.expertTensorParallel())
    for (AxisSet &axes : s.dims)
      axes -= AxisSet(MeshAxis::TP);
  return s;
}
// The part of `v`'s partial sum the MoE ops carry through: over tp, with the
// experts split over tp.
AxisSet carried(ShardingContext &ctx, Value v) {
  return ctx.expertTensorParallel()
             ? ctx.get(v).partial & AxisSet(MeshAxis::TP)
             : AxisSet();
}
} // namespace

LogicalResult MoeTopKOp::propagateSharding(ShardingContext &ctx) {
  Sharding p = routed(ctx, ctx.reduced(getProbs()));
  ctx.require(*this, 0, p);
  ctx.set(getWeights(), p);
  ctx.set(getExperts(), p);
  return success();
}

LogicalResult MoeTopKGradOp::propagateSharding(ShardingContext &ctx) {
  Sharding p = routed(ctx, ctx.reduced(getProbs()));
  for (unsigned i = 0; i < 3; ++i)
    ctx.require(*this, i, p);
  ctx.set(getResult(), p);
  return success();
}

LogicalResult MoeLoadStatsOp::propagateSharding(ShardingContext &ctx) {
  // Sums over split tokens: partial sums.
  Sharding p = routed(ctx, ctx.reduced(getProbs()));
  ctx.require(*this, 0, p);
  ctx.require(*this, 1, p);
  Sharding stats = Sharding::replicated(1);
  stats.partial = tokenAxes(p);
  ctx.set(getCounts(), stats);
  ctx.set(getProbSums(), stats);
  return success();
}

LogicalResult MoeProbSumsGradOp::propagateSharding(ShardingContext &ctx) {
  Sharding p = routed(ctx, ctx.reduced(getProbs()));
  ctx.require(*this, 0, p);
  ctx.require(*this, 1, Sharding::replicated(1));
  ctx.set(getResult(), p);
  return success();
}

LogicalResult MoeAuxLossOp::propagateSharding(ShardingContext &ctx) {
  // The loss of the whole microbatch from its summed statistics; each rank
  // of those splitting the tokens holds a share (localize), as of the
  // cross-entropy.
  Sharding loss = Sharding::replicated(0);
  loss.partial = ctx.get(getCounts()).partial;
  ctx.require(*this, 0, Sharding::replicated(1));
  ctx.require(*this, 1, Sharding::replicated(1));
  ctx.set(getResult(), loss);
  return success();
}

LogicalResult MoeAuxLossOp::localize(PartitionContext &ctx) {
  AxisSet axes = ctx.shardingOf(getResult()).partial;
  return scaleLoss(*this, ctx,
                   ctx.mesh().groupSize(axes) * ctx.microbatches(),
                   std::nullopt);
}

LogicalResult MoeAuxLossGradOp::propagateSharding(ShardingContext &ctx) {
  ctx.require(*this, 0, Sharding::replicated(1));
  ctx.require(*this, 1, Sharding::replicated(0));
  ctx.set(getResult(), Sharding::replicated(1));
  return success();
}

LogicalResult MoeAuxLossGradOp::localize(PartitionContext &ctx) {
  // Each rank's tokens take the whole loss's gradient; a microbatch's loss
  // is a share of the step's.
  return scaleLoss(*this, ctx, ctx.microbatches(), 1u);
}

LogicalResult MoeZLossOp::propagateSharding(ShardingContext &ctx) {
  Sharding l = ShardingContext::whole(ctx.reduced(getLogits()), {-1});
  ctx.require(*this, 0, l);
  Sharding loss = Sharding::replicated(0);
  loss.partial = tokenAxes(l);
  ctx.set(getResult(), loss);
  return success();
}

LogicalResult MoeZLossOp::localize(PartitionContext &ctx) {
  AxisSet axes = tokenAxes(ctx.shardingOf(getLogits()));
  return scaleLoss(*this, ctx,
                   ctx.mesh().groupSize(axes) * ctx.microbatches(),
                   std::nullopt);
}

LogicalResult MoeZLossGradOp::propagateSharding(ShardingContext &ctx) {
  Sharding l = ShardingContext::whole(ctx.reduced(getLogits()), {-1});
  ctx.require(*this, 0, l);
  ctx.require(*this, 1, Sharding::replicated(0));
  ctx.set(getResult(), l);
  return success();
}

LogicalResult MoeZLossGradOp::localize(PartitionContext &ctx) {
  AxisSet axes = tokenAxes(ctx.shardingOf(getLogits()));
  return scaleLoss(*this, ctx,
                   ctx.mesh().groupSize(axes) * ctx.microbatches(), 1u);
}

LogicalResult MoeDispatchOp::propagateSharding(ShardingContext &ctx) {
  Sharding e = routed(ctx, ctx.reduced(getExperts()));
  ctx.require(*this, 0, e);
  ctx.set(getRowOf(), e);
  // This rank's row ranges: not a slice of anything, never resharded.
  ctx.set(getOffsets(), Sharding::replicated(1));
  return success();
}

LogicalResult MoeDispatchOp::localize(PartitionContext &ctx) {
  AxisSet axes = tokenAxes(ctx.shardingOf(getExperts()));
  if (getCapacity() <= 0 || ctx.mesh().groupSize(axes) == 1)
    return success();
  // The ranks splitting the batch hold consecutive rows in group order; a
  // sequence split over cp or tp (context, sequence parallelism) holds
  // consecutive pieces of each row (the kernel counts per row then).
  setTokenAxesAttr(dist::AxesAttr::get(getContext(), axes));
  return success();
}

LogicalResult MoeKeptCountsOp::propagateSharding(ShardingContext &ctx) {
  // Read as moe_dispatch reads the experts (one reshard serves both); the
  // counts of this rank's tokens are a share of the microbatch's.
  Sharding e = routed(ctx, ctx.reduced(getExperts()));
  ctx.require(*this, 0, e);
  ctx.require(*this, 1, Sharding::replicated(1));
  Sharding kept = Sharding::replicated(1);
  kept.partial = tokenAxes(e);
  ctx.set(getResult(), kept);
  return success();
}

LogicalResult MoePermuteOp::propagateSharding(ShardingContext &ctx) {
  Sharding x = routed(ctx, ctx.reduced(getInput()));
  ctx.require(*this, 0, x);
  ctx.require(*this, 1, perToken(x, rankOf(getRowOf())));
  ctx.set(getResult(), rowsOf(x));
  return success();
}

LogicalResult MoePermuteGradOp::propagateSharding(ShardingContext &ctx) {
  Sharding r = ShardingContext::whole(ctx.get(getRowOf()), {-1});
  Sharding rows = rowsOf(r);
  rows.partial = carried(ctx, getGrad());
  ctx.require(*this, 0, rows);
  ctx.require(*this, 1, r);
  Sharding out = perToken(r, rankOf(getResult()));
  out.partial = rows.partial;
  ctx.set(getResult(), out);
  return success();
}

LogicalResult MoeUnpermuteOp::propagateSharding(ShardingContext &ctx) {
  Sharding r = ShardingContext::whole(ctx.get(getRowOf()), {-1});
  Sharding rows = rowsOf(r);
  rows.partial = carried(ctx, getRows());
  ctx.require(*this, 0, rows);
  ctx.require(*this, 1, r);
  ctx.require(*this, 2, r);
  Sharding out = perToken(r, rankOf(getResult()));
  out.partial = rows.partial;
  ctx.set(getResult(), out);
  return success();
}

LogicalResult MoeUnpermuteGradOp::propagateSharding(ShardingContext &ctx) {
  // The weights' gradient is a product with the experts' rows: partial as
  // they are; the rows' gradient (a weighted copy of the output's) is not.
  Sharding r = ShardingContext::whole(ctx.get(getRowOf()), {-1});
  Sharding rows = rowsOf(r);
  rows.partial = carried(ctx, getRows());
  ctx.require(*this, 0, rows);
  ctx.require(*this, 1, r);
  ctx.require(*this, 2, r);
  ctx.require(*this, 3, perToken(r, rankOf(getGrad())));
  ctx.set(getRowsGrad(), rowsOf(r));
  Sharding weights = r;
  weights.partial = rows.partial;
  ctx.set(getWeightsGrad(), weights);
  return success();
}

LogicalResult MoeExchangeOp::propagateSharding(ShardingContext &ctx) {
  Sharding r = ShardingContext::whole(ctx.reduced(getRows()), {1});
  r.partial = carried(ctx, getRows());
  AxisSet ep = r.dims[0] & ctx.activeAxes() & AxisSet(MeshAxis::EP);
  ctx.require(*this, 0, r);
  ctx.require(*this, 1, Sharding::replicated(1));
  Sharding out = r;
  out.dims[0] = r.dims[0] - ep;
  ctx.set(getRecvRows(), out);
  ctx.set(getRecvOffsets(), Sharding::replicated(1));
  if (ep.empty())
    removeEpAxesAttr();
  else
    setEpAxesAttr(dist::AxesAttr::get(getContext(), ep));
  return success();
}

LogicalResult MoeCombineOp::propagateSharding(ShardingContext &ctx) {
  Sharding r = ShardingContext::whole(ctx.reduced(getRows()), {1});
  r.partial = carried(ctx, getRows());
  AxisSet ep = (ctx.activeAxes() & AxisSet(MeshAxis::EP)) - r.dims[0];
  ctx.require(*this, 0, r);
  ctx.require(*this, 1, Sharding::replicated(1));
  ctx.require(*this, 2, Sharding::replicated(1));
  Sharding out = r;
  out.dims[0] = r.dims[0] | ep;
  ctx.set(getResult(), out);
  if (ep.empty())
    removeEpAxesAttr();
  else
    setEpAxesAttr(dist::AxesAttr::get(getContext(), ep));
  return success();
}

// A stacked expert weight [E, K, N] ([E, N, K] transposed): split over ep
// by expert and, with parallel.expert_tp, over tp along one of K and N. A
// split of N splits the rows' outputs (column-parallel); a split of K needs
// the rows' inputs split alike and sums over it (row-parallel).
LogicalResult GroupedMatmulOp::propagateSharding(ShardingContext &ctx) {
  Sharding w = ctx.get(getWeight());
  w.partial = {};
  bool tr = getTransposeRhs();
  AxisSet k = w.dims[tr ? 2 : 1], n = w.dims[tr ? 1 : 2];
  Sharding x = ctx.reduced(getInput());
  x.dims[1] = k;
  x.dims[0] -= k | n;
  ctx.require(*this, 0, x);
  ctx.require(*this, 1, w);
  ctx.require(*this, 2, Sharding::replicated(1));
  Sharding out = x;
  out.dims[1] = n;
  out.partial = k;
  ctx.set(getResult(), out);
  return success();
}

LogicalResult GroupedMatmulWeightGradOp::propagateSharding(
    ShardingContext &ctx) {
  // A sum over the rows: partial over the axes splitting them. The inputs'
  // and the outputs' widths split over tp (parallel.expert_tp) split the
  // gradient as they split the weight.
  AxisSet widths = ctx.expertTensorParallel() ? AxisSet(MeshAxis::TP)
                                              : AxisSet();
  Sharding x = ctx.reduced(getInput()), dy = ctx.reduced(getGrad());
  x.dims[1] &= widths;
  dy.dims[1] &= widths - x.dims[1];
  dy.dims[0] = x.dims[0] -= x.dims[1] | dy.dims[1];
  ctx.require(*this, 0, x);
  ctx.require(*this, 1, dy);
  ctx.require(*this, 2, Sharding::replicated(1));
  bool tr = getTransposeRhs();
  Sharding w = Sharding::replicated(3);
  w.dims[0] = ctx.activeAxes() & AxisSet(MeshAxis::EP);
  w.dims[tr ? 2 : 1] = x.dims[1];
  w.dims[tr ? 1 : 2] = dy.dims[1];
  w.partial = x.dims[0];
  ctx.set(getResult(), w);
  return success();
}
