//===- PropagateSharding.cpp - Every value of the step gets a sharding ----===//
//
// One rule per op, all in this file: the sharding rule table. A rule reads
// its operands' shardings, states the shardings it needs them in (`require`,
// which inserts a dist.reshard when they differ) and sets its results'. See
// Passes.td for the contract.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "llvm/ADT/TypeSwitch.h"

namespace tessel {
#define GEN_PASS_DEF_PROPAGATESHARDING
#include "tessel/Transforms/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;
using namespace tessel::graph;
using tessel::AxisSet;
using tessel::MeshAxis;
using tessel::MeshShape;
using tessel::dist::Sharding;

namespace {

const AxisSet kDP = MeshAxis::DP, kTP = MeshAxis::TP;

int64_t rankOf(Value v) {
  return cast<RankedTensorType>(v.getType()).getRank();
}
ArrayRef<int64_t> shapeOf(Value v) {
  return cast<RankedTensorType>(v.getType()).getShape();
}

class Propagator {
public:
  Propagator(ModuleOp module)
      : ctx(module.getContext()), mesh(dist::meshOf(module)),
        active(mesh.activeAxes()),
        sequenceParallel(module->hasAttr("dist.sequence_parallel")) {}

  LogicalResult run(func::FuncOp func) {
    SmallVector<Operation *> ops;
    for (Operation &op : func.getBody().front())
      ops.push_back(&op);
    for (Operation *op : ops) {
      if (failed(visit(op)))
        return failure();
      if (op->getNumResults() > 0) {
        SmallVector<Attribute> attrs;
        for (Value r : op->getResults())
          attrs.push_back(get(r).toAttr(ctx));
        op->setAttr("dist.sharding", ArrayAttr::get(ctx, attrs));
      }
    }
    return success();
  }

private:
  Sharding get(Value v) {
    auto it = shardings.find(v);
    return it != shardings.end() ? it->second : Sharding::replicated(rankOf(v));
  }
  void set(Value v, Sharding s) { shardings[v] = std::move(s); }

  // Gives operand `i` of `op` the sharding `target`, through a dist.reshard.
  void require(Operation *op, unsigned i, const Sharding &target) {
    Value v = op->getOperand(i);
    Sharding current = get(v);
    if (current == target)
      return;
    // One reshard per value and target, shared by all its consumers (a
    // gradient read by the norm and by the update is reduced once).
    auto key = std::make_pair(v, target.toAttr(ctx));
    if (Value existing = reshards.lookup(key)) {
      op->setOperand(i, existing);
      return;
    }
    OpBuilder b(op);
    PlacementListener placement = PlacementListener::of(op);
    b.setListener(&placement);
    auto reshard = dist::ReshardOp::create(
        b, op->getLoc(), v, current.toAttr(ctx), target.toAttr(ctx));
    reshard->setAttr("dist.sharding",
                     ArrayAttr::get(ctx, {target.toAttr(ctx)}));
    set(reshard.getResult(), target);
    reshards[key] = reshard.getResult();
    op->setOperand(i, reshard.getResult());
  }

  // The sharding a partial value is reduced to when a consumer needs the
  // sum: replicated, or under sequence parallelism an activation
  // [batch, seq, hidden] split along the sequence over tp.
  Sharding reduced(Value v) {
    Sharding s = get(v);
    AxisSet partial = s.partial;
    s.partial = {};
    if (sequenceParallel && partial.intersects(kTP) && s.dims.size() == 3 &&
        !s.allAxes().intersects(kTP) && shapeOf(v)[1] % mesh[MeshAxis::TP] == 0)
      s.dims[1] = kTP;
    return s;
  }
  static Sharding whole(Sharding s, std::initializer_list<int64_t> dims) {
    for (int64_t d : dims)
      s.dims[d < 0 ? s.dims.size() + d : d] = {};
    return s;
  }

  LogicalResult visit(Operation *op);
  LogicalResult visitMatmul(MatmulOp op);
  LogicalResult visitReshape(ReshapeOp op);
  LogicalResult visitAttention(Operation *op, bool grad);

  MLIRContext *ctx;
  MeshShape mesh;
  AxisSet active;
  bool sequenceParallel;
  DenseMap<Value, Sharding> shardings;
  DenseMap<std::pair<Value, Attribute>, Value> reshards;
  // The vocabulary split of the table each token-id tensor is looked up in,
  // for the embedding's gradient.
  DenseMap<Value, AxisSet> vocabAxes;
};

LogicalResult Propagator::visit(Operation *op) {
  // Same-shape operands, result like the first: elementwise and its grads.
  auto elementwise = [&](std::initializer_list<int64_t> wholeDims) {
    Sharding s = whole(reduced(op->getOperand(0)), wholeDims);
    for (unsigned i = 0; i < op->getNumOperands(); ++i)
      require(op, i, s);
    set(op->getResult(0), s);
    return success();
  };
  return llvm::TypeSwitch<Operation *, LogicalResult>(op)
      .Case<ParamOp>([&](ParamOp p) {
        Sharding s = Sharding::replicated(p.getType().getRank());
        if (auto attr =
                p->getAttrOfType<dist::ShardingAttr>("dist.param_sharding"))
          s = Sharding::fromAttr(attr);
        // The plan names axes the mesh may not have: those split nothing.
        for (auto [d, axes] : llvm::enumerate(s.dims)) {
          axes &= active;
          if (axes.empty())
            s.setBlocks(d, 1);
        }
        set(p.getResult(), s);
        return success();
      })
      .Case<InputOp>([&](InputOp in) {
        Sharding s = Sharding::replicated(2);
        s.dims[0] = active & kDP;
        set(in.getResult(), s);
        return success();
      })
      .Case<FillOp>([&](FillOp) { return success(); })
      .Case<GeluOp, SiluOp, GeluGradOp, SiluGradOp>(
          [&](Operation *) { return elementwise({}); })
      .Case<SoftmaxOp, SoftmaxGradOp>(
          [&](Operation *) { return elementwise({-1}); })
      // The position of a token must be whole to rotate it.
      .Case<RopeOp>([&](Operation *) {
        return elementwise({1, 3});
      })
      .Case<AddOp, MulOp>([&](Operation *) {
        Value lhs = op->getOperand(0), rhs = op->getOperand(1);
        Sharding l = get(lhs), r = get(rhs);
        // A sum of partial sums stays partial: reduce once, later.
        if (isa<AddOp>(op) && lhs.getType() == rhs.getType() && l == r) {
          set(op->getResult(0), l);
          return success();
        }
        Sharding lt = reduced(lhs);
        Sharding rt;
        size_t lead = lt.dims.size() - rankOf(rhs);
        rt.dims.assign(lt.dims.begin() + lead, lt.dims.end());
        for (size_t d = 0; d < rt.dims.size(); ++d)
          rt.setBlocks(d, lt.blocksOf(lead + d));
        require(op, 0, lt);
        require(op, 1, rt);
        set(op->getResult(0), lt);
        return success();
      })
      .Case<ReduceSumOp>([&](ReduceSumOp r) {
        Sharding in = get(r.getInput()), out;
        size_t lead = in.dims.size() - rankOf(r.getResult());
        out.dims.assign(in.dims.begin() + lead, in.dims.end());
        out.partial = in.partial | in.leadingAxes(lead);
        for (size_t d = 0; d < out.dims.size(); ++d)
          out.setBlocks(d, in.blocksOf(lead + d));
        set(r.getResult(), out);
        return success();
      })
      .Case<LayerNormOp, RmsNormOp>([&](Operation *) {
        Sharding s = whole(reduced(op->getOperand(0)), {-1});
        require(op, 0, s);
        for (unsigned i = 1; i < op->getNumOperands(); ++i)
          require(op, i, Sharding::replicated(1));
        set(op->getResult(0), s);
        return success();
      })
      .Case<LayerNormGradOp, RmsNormGradOp>([&](Operation *) {
        Sharding s = whole(reduced(op->getOperand(0)), {-1});
        require(op, 0, s);
        require(op, 1, Sharding::replicated(1));
        require(op, 2, s);
        set(op->getResult(0), s);
        Sharding w = Sharding::replicated(1);
        w.partial = s.leadingAxes(s.dims.size() - 1);
        for (unsigned i = 1; i < op->getNumResults(); ++i)
          set(op->getResult(i), w);
        return success();
      })
      .Case<AttentionOp>([&](Operation *) { return visitAttention(op, false); })
      .Case<AttentionGradOp>(
          [&](Operation *) { return visitAttention(op, true); })
      .Case<CrossEntropyOp, CrossEntropyGradOp>(
          [&](Operation *) -> LogicalResult {
            // Logits may be split along the vocabulary (vocab-parallel loss:
            // the full logits are never gathered); tokens follow the targets.
            Value logits = op->getOperand(0), targets = op->getOperand(1);
            Sharding t = get(targets);
            Sharding l = reduced(logits);
            for (size_t d = 0; d < t.dims.size(); ++d)
              l.dims[d] = t.dims[d];
            require(op, 0, l);
            if (isa<CrossEntropyGradOp>(op)) {
              require(op, 2, Sharding::replicated(0));
              set(op->getResult(0), l);
            } else {
              Sharding loss = Sharding::replicated(0);
              loss.partial = t.leadingAxes(t.dims.size());
              set(op->getResult(0), loss);
            }
            return success();
          })
      .Case<EmbeddingOp>([&](EmbeddingOp e) -> LogicalResult {
        // A table split along the vocabulary gives each rank the rows of its
        // own tokens and zeros elsewhere: a partial sum.
        Sharding table = whole(reduced(e.getTable()), {1});
        require(op, 0, table);
        Sharding out = get(e.getIds());
        out.dims.push_back({});
        out.partial = table.dims[0];
        vocabAxes[e.getIds()] = table.dims[0];
        set(e.getResult(), out);
        return success();
      })
      .Case<EmbeddingGradOp>([&](EmbeddingGradOp e) {
        Sharding ids = get(e.getIds());
        Sharding dy = whole(reduced(e.getGrad()), {-1});
        for (size_t d = 0; d < ids.dims.size(); ++d)
          dy.dims[d] = ids.dims[d];
        require(op, 1, dy);
        Sharding out = Sharding::replicated(2);
        out.dims[0] = vocabAxes.lookup(e.getIds());
        out.partial = ids.leadingAxes(ids.dims.size());
        set(e.getResult(), out);
        return success();
      })
      .Case<MatmulOp>([&](MatmulOp m) { return visitMatmul(m); })
      .Case<ReshapeOp>([&](ReshapeOp r) { return visitReshape(r); })
      .Case<TransposeOp>([&](TransposeOp t) {
        Sharding in = get(t.getInput()), out = in;
        out.blocks.clear();
        for (auto [i, p] : llvm::enumerate(t.getPermutation())) {
          out.dims[i] = in.dims[p];
          out.setBlocks(i, in.blocksOf(p));
        }
        set(t.getResult(), out);
        return success();
      })
      .Case<SplitOp>([&](SplitOp sp) {
        // A dimension split in as many blocks as there are equal pieces
        // (GPT-2's fused q|k|v) splits into pieces split the same way.
        int64_t axis = sp.getAxis();
        Sharding in = reduced(sp.getInput());
        bool equal = llvm::all_equal(llvm::map_range(
            sp.getResults(), [&](Value r) { return shapeOf(r)[axis]; }));
        if (!(!in.dims[axis].empty() && equal &&
              in.blocksOf(axis) == (int64_t)sp.getNumResults()))
          in = whole(in, {axis});
        require(op, 0, in);
        Sharding piece = in;
        piece.setBlocks(axis, 1);
        for (Value r : sp.getResults())
          set(r, piece);
        return success();
      })
      .Case<ConcatOp>([&](ConcatOp c) {
        int64_t axis = c.getAxis();
        Sharding s = reduced(c.getInputs().front());
        bool same = llvm::all_equal(c.getInputs().getTypes()) &&
                    llvm::all_of(c.getInputs(), [&](Value v) {
                      Sharding o = get(v);
                      o.partial = {};
                      return o == s;
                    });
        if (!(!s.dims[axis].empty() && s.blocksOf(axis) == 1 && same))
          s = whole(s, {axis});
        for (unsigned i = 0; i < op->getNumOperands(); ++i)
          require(op, i, s);
        Sharding out = s;
        if (!out.dims[axis].empty())
          out.setBlocks(axis, c.getInputs().size());
        set(c.getResult(), out);
        return success();
      })
      .Case<GlobalNormOp>([&](GlobalNormOp g) {
        for (unsigned i = 0; i < op->getNumOperands(); ++i)
          require(op, i, reduced(op->getOperand(i)));
        return success();
      })
      .Case<AdamWOp>([&](AdamWOp a) {
        // The update needs the whole gradient of this rank's shard: here the
        // data-parallel gradient all-reduce appears.
        require(op, 1, get(a.getParam()));
        require(op, 2, Sharding::replicated(0));
        return success();
      })
      .Case<func::ReturnOp>([&](Operation *) {
        for (unsigned i = 0; i < op->getNumOperands(); ++i)
          require(op, i, Sharding::replicated(0));
        return success();
      })
      .Default([&](Operation *op) {
        return op->emitOpError("has no sharding rule");
      });
}

LogicalResult Propagator::visitMatmul(MatmulOp m) {
  bool tl = m.getTransposeLhs(), tr = m.getTransposeRhs();
  int64_t lr = rankOf(m.getLhs()), rr = rankOf(m.getRhs());
  int64_t lM = tl ? lr - 1 : lr - 2, lK = tl ? lr - 2 : lr - 1;
  int64_t rK = tr ? rr - 1 : rr - 2, rN = tr ? rr - 2 : rr - 1;
  Sharding l = reduced(m.getLhs()), r = reduced(m.getRhs());
  // Contract over the axes both sides split K by; gather the others.
  AxisSet k = l.dims[lK] & r.dims[rK];
  l.dims[lK] = r.dims[rK] = k;
  // An axis cannot split both the rows and the columns of the result: the
  // rows (the activation) are gathered, as before Megatron's column-parallel
  // matmul under sequence parallelism.
  AxisSet n = r.dims[rN];
  for (int64_t d = 0; d < lr; ++d)
    if (d != lK)
      l.dims[d] -= n;
  if (rr == lr)
    for (int64_t d = 0; d < lr - 2; ++d)
      r.dims[d] = l.dims[d];
  require(m, 0, l);
  require(m, 1, r);
  Sharding out;
  for (int64_t d = 0; d < lr - 2; ++d)
    out.dims.push_back(l.dims[d]);
  out.dims.append({l.dims[lM], n});
  out.partial = k;
  out.setBlocks(lr - 1, r.blocksOf(rN));
  set(m.getResult(), out);
  return success();
}

// Maps a sharding through a reshape. Dimensions are matched in groups of
// equal products; a split of a group's outermost dimension stays on the
// outermost dimension of the result's group. Anything else is gathered first.
LogicalResult Propagator::visitReshape(ReshapeOp r) {
  ArrayRef<int64_t> in = shapeOf(r.getInput()), out = shapeOf(r.getResult());
  Sharding s = get(r.getInput());
  Sharding result;
  result.partial = s.partial;
  result.dims.assign(out.size(), AxisSet());
  bool mappable = true;
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
    AxisSet axes;
    int sharded = 0;
    for (size_t d = i0; d < i; ++d)
      if (!s.dims[d].empty()) {
        axes |= s.dims[d];
        ++sharded;
      }
    if (axes.empty())
      continue;
    // Only a split of the group's outermost dimension is a split into
    // contiguous blocks of the merged or re-split dimension; anything else
    // (say the sequence split under a merged [batch * seq]) would permute
    // rows, so it is gathered first.
    bool onlyOuter = sharded == 1 && !s.dims[i0].empty() && s.blocksOf(i0) == 1;
    if (onlyOuter && out[o0] % mesh.groupSize(axes) == 0)
      result.dims[o0] = axes;
    else
      mappable = false;
  }
  if (!mappable) {
    Sharding gathered = Sharding::replicated(in.size());
    gathered.partial = s.partial;
    require(r, 0, gathered);
    result = Sharding::replicated(out.size());
    result.partial = s.partial;
  }
  set(r.getResult(), result);
  return success();
}

LogicalResult Propagator::visitAttention(Operation *op, bool grad) {
  Value q = op->getOperand(0), k = op->getOperand(1);
  Sharding sq = whole(reduced(q), {1, 3});
  AxisSet heads = sq.dims[2];
  Sharding sk = whole(reduced(k), {1, 3});
  sk.dims[0] = sq.dims[0];
  int64_t kvHeads = shapeOf(k)[2], group = mesh.groupSize(heads);
  bool replicateKV = !heads.empty() && kvHeads % group != 0;
  if (replicateKV && group % kvHeads != 0)
    return op->emitOpError("kv heads (")
           << kvHeads << ") neither divide nor are a multiple of the "
           << heads.str() << " group of " << group;
  // Fewer KV heads than ranks: every rank holds all KV heads and reads the
  // one its query heads use (the partition pass selects it).
  sk.dims[2] = replicateKV ? AxisSet() : heads;
  if (replicateKV)
    op->setAttr("dist.kv_replicated", dist::AxesAttr::get(ctx, heads));
  require(op, 0, sq);
  require(op, 1, sk);
  require(op, 2, sk);
  if (grad)
    require(op, 3, sq);
  set(op->getResult(0), sq);
  if (grad) {
    // With replicated KV heads each rank contributes to its KV head only.
    Sharding dk = sk;
    if (replicateKV)
      dk.partial |= heads;
    set(op->getResult(1), dk);
    set(op->getResult(2), dk);
  }
  return success();
}

struct PropagateShardingPass
    : tessel::impl::PropagateShardingBase<PropagateShardingPass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    auto func = module.lookupSymbol<func::FuncOp>("train_step");
    if (!func || !func.getBody().hasOneBlock()) {
      module.emitError("tessel-propagate-sharding: no single-block "
                       "@train_step (run tessel-autodiff first)");
      return signalPassFailure();
    }
    if (failed(Propagator(module).run(func)))
      signalPassFailure();
  }
};

} // namespace
