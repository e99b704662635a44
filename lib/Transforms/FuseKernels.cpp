//===- FuseKernels.cpp - One kernel for ops that run back to back ---------===//
//
// Rewrite patterns on the bufferized rank programs (rt), before the memory
// plan, so that the plan sees the fused kernels and their buffers' lives:
//
//   matmul + bias add (+ GELU)         -> matmul_bias (cuBLASLt epilogue)
//   residual add + LayerNorm/RMSNorm   -> add_layer_norm / add_rms_norm
//   norm backward + residual grad add  -> layer_norm / rms_norm _backward_add
//   SiLU(gate) * up                    -> swiglu_forward
//   its backward                       -> swiglu_backward (SiLU taken again)
//   weight gradient + bias gradient    -> matmul_bias_grad (BGRAD epilogue)
//   its copy into a fused gradient     -> matmul_bias_grad into its columns
//   input gradient + GELU backward     -> matmul_gelu_grad (DGELU epilogue)
//   product + add of another term      -> matmul_add (beta = 1)
//
// The forward fusions join an op with the one that reads its result right
// after it (only buffer bookkeeping in between), so nothing else can read or
// write the buffers meanwhile; the fused op takes the later op's place. The
// backward ones join ops a few kernels apart (a weight gradient runs between
// an input gradient and what reads it): everything in between may only read
// what the fused op reads and may not touch what it writes.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "dialects/Pipe/PipeOps.h"
#include "dialects/Rt/RtOps.h"

#include "mlir/IR/PatternMatch.h"
#include "mlir/Transforms/GreedyPatternRewriteDriver.h"

namespace tessel {
#define GEN_PASS_DEF_FUSEKERNELS
#include "tessel/Transforms/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;
namespace rt = tessel::rtir;

namespace {

// Ops that only name storage.
bool isBookkeeping(Operation *op) {
  return isa<rt::AllocOp, rt::ViewOp, rt::ParamOp, rt::BatchOp, rt::BufferOp,
             rt::StateOfOp>(op);
}

// The op computed right before `op` in its block.
Operation *previousKernel(Operation *op) {
  for (Operation *prev = op->getPrevNode(); prev; prev = prev->getPrevNode())
    if (!isBookkeeping(prev))
      return prev;
  return nullptr;
}

// The ops that read or write `buffer` (through views).
SmallVector<Operation *> accessesOf(Value buffer) {
  SmallVector<Operation *> ops;
  SmallVector<Value> work = {buffer};
  while (!work.empty()) {
    Value v = work.pop_back_val();
    for (Operation *user : v.getUsers()) {
      if (auto view = dyn_cast<rt::ViewOp>(user))
        work.push_back(view.getResult());
      else
        ops.push_back(user);
    }
  }
  return ops;
}

// Whether `buffer` is a working buffer of the step that only `ops` touch.
bool onlyAccessedBy(Value buffer, ArrayRef<Operation *> ops) {
  if (!rt::rootBuffer(buffer).getDefiningOp<rt::AllocOp>())
    return false;
  return llvm::all_of(accessesOf(rt::rootBuffer(buffer)), [&](Operation *op) {
    return llvm::is_contained(ops, op);
  });
}

bool sameBuffer(Value a, Value b) { return rt::rootBuffer(a) == rt::rootBuffer(b); }

// Whether every op strictly between `from` and `to` (one block, `from`
// first) leaves `reads` unwritten and never touches `writes`.
bool clearBetween(Operation *from, Operation *to, ArrayRef<Value> reads,
                  ArrayRef<Value> writes) {
  for (Operation *op = from->getNextNode(); op && op != to;
       op = op->getNextNode()) {
    if (isBookkeeping(op))
      continue;
    for (OpOperand &use : op->getOpOperands()) {
      Value v = use.get();
      if (!isa<MemRefType>(v.getType()))
        continue;
      for (Value w : writes)
        if (sameBuffer(v, w))
          return false;
      for (Value r : reads)
        if (sameBuffer(v, r) && !rt::onlyReadsOperand(op, use.getOperandNumber()))
          return false;
    }
  }
  return true;
}

// Whether `v`, used in the block of `point`, can be made to exist before
// `point`: it does already, or it is an allocation (or a view of one) later
// in the block, which `rewriter` (when given) moves up.
bool availableBefore(Value v, Operation *point, PatternRewriter *rewriter) {
  Operation *def = v.getDefiningOp();
  // Defined in an enclosing block: before the whole block.
  if (!def || def->getBlock() != point->getBlock() ||
      def->isBeforeInBlock(point))
    return true;
  if (auto view = dyn_cast<rt::ViewOp>(def)) {
    if (!availableBefore(view.getSource(), point, rewriter))
      return false;
  } else if (!isa<rt::AllocOp>(def)) {
    return false;
  }
  if (rewriter)
    rewriter->moveOpBefore(def, point);
  return true;
}

// The last kernel before `op` in its block that accesses `buffer`, when it
// is a product whose batch is just more rows of one GEMM (the contiguous
// [batch x m, k] rows times a shared weight) writing `buffer` as its C.
rt::MatmulOp rowsProductWriting(Operation *op, Value buffer) {
  for (Operation *prev = op->getPrevNode(); prev; prev = prev->getPrevNode()) {
    if (isBookkeeping(prev))
      continue;
    bool touches = llvm::any_of(prev->getOperands(), [&](Value v) {
      return isa<MemRefType>(v.getType()) && sameBuffer(v, buffer);
    });
    if (!touches)
      continue;
    auto m = dyn_cast<rt::MatmulOp>(prev);
    if (!m || !sameBuffer(m.getC(), buffer) || m.getTransA() ||
        m.getStrideB() != 0 ||
        m.getStrideA() != m.getM() * m.getK() ||
        m.getStrideC() != m.getM() * m.getN())
      return {};
    return m;
  }
  return {};
}

// A parameter, or a run of one cut into a working buffer that only the cut
// writes (the q, k or v piece of a fused projection's bias).
bool isParameterVector(Value bias) {
  Value root = rt::rootBuffer(bias);
  if (root.getDefiningOp<rt::ParamOp>())
    return true;
  if (!root.getDefiningOp<rt::AllocOp>())
    return false;
  SmallVector<rt::SliceAxisOp> cuts;
  for (Operation *op : accessesOf(root))
    if (auto cut = dyn_cast<rt::SliceAxisOp>(op))
      cuts.push_back(cut);
  return cuts.size() == 1 && sameBuffer(cuts[0].getOut(), bias) &&
         cuts[0].getOuter() == 1 &&
         rt::rootBuffer(cuts[0].getX()).getDefiningOp<rt::ParamOp>();
}

// matmul(a, b) -> c; add(c, bias) -> out [; gelu(out) -> g]: one cuBLASLt
// call with a bias (and GELU) epilogue. The weight is 2-D and the batch of
// rows contiguous; the bias is a parameter of N elements.
struct MatmulBiasFusion : OpRewritePattern<rt::AddBroadcastOp> {
  using OpRewritePattern::OpRewritePattern;
  LogicalResult matchAndRewrite(rt::AddBroadcastOp add,
                                PatternRewriter &rewriter) const override {
    auto m = dyn_cast_or_null<rt::MatmulOp>(previousKernel(add));
    if (!m || !sameBuffer(m.getC(), add.getA()) || m.getTransA() ||
        m.getStrideB() != 0 ||
        m.getStrideA() != m.getM() * m.getK() ||
        m.getStrideC() != m.getM() * m.getN() ||
        add.getNb() != m.getN() ||
        !isParameterVector(add.getB()) ||
        !onlyAccessedBy(m.getC(), {m, add}) ||
        rt::elementTypeOf(add.getOut()) != rt::elementTypeOf(m.getC()))
      return failure();
    // A GELU of the sum right after it is the epilogue's too.
    rt::GeluForwardOp gelu;
    for (Operation *next = add->getNextNode(); next;
         next = next->getNextNode()) {
      if (isBookkeeping(next))
        continue;
      gelu = dyn_cast<rt::GeluForwardOp>(next);
      break;
    }
    if (gelu && (!sameBuffer(gelu.getX(), add.getOut()) ||
                 rt::elementTypeOf(gelu.getOut()) != rt::elementTypeOf(add.getOut())))
      gelu = nullptr;
    Operation *last = gelu ? gelu.getOperation() : add.getOperation();
    rewriter.setInsertionPoint(last);
    rt::MatmulBiasOp::create(rewriter, add.getLoc(), m.getA(), m.getB(),
                             add.getB(), add.getOut(),
                             gelu ? gelu.getOut() : Value(),
                             m.getBatch() * m.getM(), m.getN(), m.getK(),
                             m.getTransB());
    rewriter.eraseOp(m);
    rewriter.eraseOp(add);
    if (gelu)
      rewriter.eraseOp(gelu);
    return success();
  }
};

// add(a, r) -> sum; norm(sum) -> out: one kernel writes both.
template <typename Norm>
struct AddNormFusion : OpRewritePattern<Norm> {
  using OpRewritePattern<Norm>::OpRewritePattern;
  LogicalResult matchAndRewrite(Norm norm,
                                PatternRewriter &rewriter) const override {
    auto add = dyn_cast_or_null<rt::AddBroadcastOp>(previousKernel(norm));
    if (!add || add.getN() != add.getNb() ||
        !sameBuffer(add.getOut(), norm.getX()) ||
        rt::elementTypeOf(add.getOut()) != rt::elementTypeOf(norm.getOut()))
      return failure();
    rewriter.setInsertionPoint(norm);
    if constexpr (std::is_same_v<Norm, rt::LayerNormForwardOp>)
      rt::AddLayerNormForwardOp::create(
          rewriter, norm.getLoc(), add.getA(), add.getB(), add.getOut(),
          norm.getW(), norm.getB(), norm.getOut(), norm.getRows(),
          norm.getCols(), norm.getEps());
    else
      rt::AddRmsNormForwardOp::create(
          rewriter, norm.getLoc(), add.getA(), add.getB(), add.getOut(),
          norm.getW(), norm.getOut(), norm.getRows(), norm.getCols(),
          norm.getEps());
    rewriter.eraseOp(add);
    rewriter.eraseOp(norm);
    return success();
  }
};

// norm_backward(..) -> dx; add(dx, dres) -> sum: the kernel writes the sum
// instead of dx.
struct NormBackwardAddFusion : OpRewritePattern<rt::AddBroadcastOp> {
  using OpRewritePattern::OpRewritePattern;
  LogicalResult matchAndRewrite(rt::AddBroadcastOp add,
                                PatternRewriter &rewriter) const override {
    Operation *prev = previousKernel(add);
    auto layer = dyn_cast_or_null<rt::LayerNormBackwardOp>(prev);
    auto rms = dyn_cast_or_null<rt::RmsNormBackwardOp>(prev);
    if ((!layer && !rms) || add.getN() != add.getNb())
      return failure();
    Value dx = layer ? layer.getDx() : rms.getDx();
    bool lhs = sameBuffer(add.getA(), dx), rhs = sameBuffer(add.getB(), dx);
    if (lhs == rhs || !onlyAccessedBy(dx, {prev, add}))
      return failure();
    Value dres = lhs ? add.getB() : add.getA();
    if (rt::elementTypeOf(dres) != rt::elementTypeOf(add.getOut()) ||
        rt::elementTypeOf(dx) != rt::elementTypeOf(add.getOut()))
      return failure();
    rewriter.setInsertionPoint(add);
    if (layer)
      rt::LayerNormBackwardAddOp::create(
          rewriter, add.getLoc(), layer.getX(), layer.getW(), layer.getDout(),
          dres, add.getOut(), layer.getDw(), layer.getDb(), layer.getRows(),
          layer.getCols(), layer.getEps());
    else
      rt::RmsNormBackwardAddOp::create(
          rewriter, add.getLoc(), rms.getX(), rms.getW(), rms.getDout(), dres,
          add.getOut(), rms.getDw(), rms.getRows(), rms.getCols(),
          rms.getEps());
    rewriter.eraseOp(prev);
    rewriter.eraseOp(add);
    return success();
  }
};

// silu(gate) -> s; ...; mul(s, up) -> out: one kernel writes s and out at
// the product. Llama's up projection runs in between, so the SiLU moves to
// the product when nothing reads s or writes the gate before it.
struct SwigluFusion : OpRewritePattern<rt::MulBroadcastOp> {
  using OpRewritePattern::OpRewritePattern;
  LogicalResult matchAndRewrite(rt::MulBroadcastOp mul,
                                PatternRewriter &rewriter) const override {
    if (mul.getN() != mul.getNb())
      return failure();
    for (bool siluIsLhs : {true, false}) {
      Value s = siluIsLhs ? mul.getA() : mul.getB();
      Value up = siluIsLhs ? mul.getB() : mul.getA();
      rt::SiluForwardOp silu;
      for (Operation *op : accessesOf(rt::rootBuffer(s)))
        if (auto candidate = dyn_cast<rt::SiluForwardOp>(op);
            candidate && sameBuffer(candidate.getOut(), s))
          silu = candidate;
      if (!silu || silu->getBlock() != mul->getBlock() ||
          !silu->isBeforeInBlock(mul) || sameBuffer(up, s) ||
          rt::elementTypeOf(up) != rt::elementTypeOf(silu.getX()) ||
          rt::elementTypeOf(mul.getOut()) != rt::elementTypeOf(s))
        continue;
      // Between the two, nothing reads s or writes the gate or up.
      bool clear = true;
      for (Operation *op = silu->getNextNode(); op != mul.getOperation();
           op = op->getNextNode()) {
        if (isBookkeeping(op))
          continue;
        for (Value v : op->getOperands())
          if (isa<MemRefType>(v.getType()) &&
              (sameBuffer(v, s) || sameBuffer(v, silu.getX())))
            clear = false;
      }
      if (!clear)
        continue;
      rewriter.setInsertionPoint(mul);
      rt::SwigluForwardOp::create(rewriter, mul.getLoc(), silu.getX(), up,
                                  mul.getOut(), s, mul.getN());
      rewriter.eraseOp(silu);
      rewriter.eraseOp(mul);
      return success();
    }
    return failure();
  }
};

// The gate whose SiLU `s` holds, as `s`'s readers see it, when `s` is
// written only by an rt.swiglu_forward (its silu_out) or an
// rt.silu_forward of that gate and otherwise only read (or handed on), and
// nothing writes the gate after: in the block of `at`, before `at`, or
// in a forward part that hands on both (then the part's result holding the
// gate). Null otherwise.
Value siluGateOf(Value s, Operation *at) {
  // The gate of the one producer of `buffer`, which nothing writes between
  // the producer and `end` (in the producer's block).
  auto gateIn = [](Value buffer, Operation *end) -> Value {
    Operation *producer = nullptr;
    Value gate;
    for (Operation *op : accessesOf(rt::rootBuffer(buffer))) {
      Value g;
      if (auto sw = dyn_cast<rt::SwigluForwardOp>(op);
          sw && sw.getSiluOut() && sameBuffer(sw.getSiluOut(), buffer) &&
          !sameBuffer(sw.getGate(), buffer) && !sameBuffer(sw.getUp(), buffer))
        g = sw.getGate();
      else if (auto sf = dyn_cast<rt::SiluForwardOp>(op);
               sf && sameBuffer(sf.getOut(), buffer) &&
               !sameBuffer(sf.getX(), buffer))
        g = sf.getX();
      else if (isa<pipe::YieldOp>(op) ||
               llvm::all_of(op->getOpOperands(), [&](OpOperand &use) {
                 return !sameBuffer(use.get(), buffer) ||
                        rt::onlyReadsOperand(op, use.getOperandNumber());
               }))
        continue;
      else
        return {};
      if (producer)
        return {};
      producer = op;
      gate = g;
    }
    if (!producer || producer->getBlock() != end->getBlock() ||
        !producer->isBeforeInBlock(end) ||
        !clearBetween(producer, end, {gate}, {}))
      return {};
    return gate;
  };
  auto result = dyn_cast<OpResult>(s);
  auto part = result ? dyn_cast<pipe::ForwardPassOp>(result.getOwner())
                     : pipe::ForwardPassOp();
  if (!part)
    return gateIn(s, at);
  Operation *yield = part.getBody().front().getTerminator();
  Value gate = gateIn(yield->getOperand(result.getResultNumber()), yield);
  if (!gate)
    return {};
  for (OpOperand &handed : yield->getOpOperands())
    if (handed.get() == gate)
      return part->getResult(handed.getOperandNumber());
  return {};
}

// mul(dout, up) -> t; mul(dout, s) -> dup; ...; silu_backward(gate, t) ->
// dgate, with s = silu(gate): one kernel computes both gradients from the
// gate, up and dout, taking the SiLU again (as Megatron-LM's fused SwiGLU),
// so the forward no longer keeps s. The kernel takes the place of the
// first product: until the SiLU backward nothing may write what it reads
// or touch dgate, and until the second product nothing may touch dup.
struct SwigluBackwardFusion : OpRewritePattern<rt::SiluBackwardOp> {
  using OpRewritePattern::OpRewritePattern;
  LogicalResult matchAndRewrite(rt::SiluBackwardOp back,
                                PatternRewriter &rewriter) const override {
    Value gate = back.getX(), t = back.getDout(), dgate = back.getDx();
    int64_t n = back.getN();
    Value tRoot = rt::rootBuffer(t);
    if (!tRoot.getDefiningOp<rt::AllocOp>())
      return failure();
    rt::MulBroadcastOp first;
    for (Operation *op : accessesOf(tRoot)) {
      if (op == back.getOperation())
        continue;
      auto mul = dyn_cast<rt::MulBroadcastOp>(op);
      if (!mul || first || !sameBuffer(mul.getOut(), t))
        return failure();
      first = mul;
    }
    if (!first || first.getN() != n || first.getNb() != n ||
        first->getBlock() != back->getBlock() ||
        !first->isBeforeInBlock(back) || rt::elementsOf(t) != n)
      return failure();
    for (bool doutIsLhs : {true, false}) {
      Value dout = doutIsLhs ? first.getA() : first.getB();
      Value up = doutIsLhs ? first.getB() : first.getA();
      if (sameBuffer(dout, up))
        continue;
      // The product of dout and silu(gate), and where the fused kernel goes:
      // the first of the two products.
      rt::MulBroadcastOp second;
      Operation *at = nullptr;
      for (Operation *op : accessesOf(rt::rootBuffer(dout))) {
        auto mul = dyn_cast<rt::MulBroadcastOp>(op);
        if (!mul || mul == first || mul->getBlock() != back->getBlock() ||
            mul.getN() != n || mul.getNb() != n ||
            sameBuffer(mul.getOut(), dout))
          continue;
        Value s = sameBuffer(mul.getA(), dout)   ? mul.getB()
                  : sameBuffer(mul.getB(), dout) ? mul.getA()
                                                 : Value();
        Operation *earlier = mul->isBeforeInBlock(first)
                                 ? mul.getOperation()
                                 : first.getOperation();
        Value g = s ? siluGateOf(s, earlier) : Value();
        if (g && sameBuffer(g, gate)) {
          second = mul;
          at = earlier;
          break;
        }
      }
      if (!second)
        continue;
      Value dup = second.getOut();
      if (rt::elementTypeOf(gate) != rt::elementTypeOf(up) ||
          rt::elementTypeOf(dgate) != rt::elementTypeOf(dup) ||
          rt::elementsOf(dgate) != n || rt::elementsOf(dup) != n ||
          sameBuffer(dgate, dup) ||
          llvm::any_of(ValueRange{gate, up, dout}, [&](Value v) {
            return sameBuffer(v, dgate) || sameBuffer(v, dup);
          }))
        continue;
      if (!clearBetween(at, back, {gate, up, dout}, {dgate}) ||
          (at != second.getOperation() &&
           !clearBetween(at, second, {}, {dup})) ||
          !availableBefore(dgate, at, nullptr) ||
          !availableBefore(dup, at, nullptr))
        continue;
      availableBefore(dgate, at, &rewriter);
      availableBefore(dup, at, &rewriter);
      rewriter.setInsertionPoint(at);
      rt::SwigluBackwardOp::create(rewriter, back.getLoc(), gate, up, dout,
                                   dgate, dup, n);
      rewriter.eraseOp(first);
      rewriter.eraseOp(second);
      rewriter.eraseOp(back);
      return success();
    }
    return failure();
  }
};

// reduce_sum_leading(dy) -> db; ...; matmul(x^T, dy) -> dw: the weight
// gradient's GEMM sums dy's columns as it reads them. The column sums move
// to the product, so nothing in between may write dy or touch db.
struct BiasGradFusion : OpRewritePattern<rt::ReduceSumLeadingOp> {
  using OpRewritePattern::OpRewritePattern;
  LogicalResult matchAndRewrite(rt::ReduceSumLeadingOp sum,
                                PatternRewriter &rewriter) const override {
    Value dy = sum.getX(), db = sum.getOut();
    if (sameBuffer(dy, db))
      return failure();
    for (Operation *op = sum->getNextNode(); op; op = op->getNextNode()) {
      auto m = dyn_cast<rt::MatmulOp>(op);
      if (!m || !sameBuffer(m.getB(), dy))
        continue;
      if (m.getBatch() != 1 || !m.getTransA() || m.getTransB() ||
          m.getK() != sum.getRows() ||
          m.getN() != sum.getCols() ||
          rt::elementsOf(m.getB()) != rt::elementsOf(dy) ||
          rt::elementTypeOf(m.getC()) != rt::elementTypeOf(db) || sameBuffer(m.getC(), db) ||
          sameBuffer(m.getA(), db) || !clearBetween(sum, m, {dy}, {db}))
        return failure();
      rewriter.setInsertionPoint(m);
      rt::MatmulBiasGradOp::create(rewriter, m.getLoc(), m.getA(), m.getB(),
                                   m.getC(), db, m.getM(), m.getN(), m.getK(),
                                   /*ldc=*/m.getN(), /*col=*/0);
      rewriter.eraseOp(m);
      rewriter.eraseOp(sum);
      return success();
    }
    return failure();
  }
};

// The rt.insert_axis that copies all of `v`, a working buffer that only
// `producer` (before it, in its block) and the copy touch, as `rows` rows
// into a column block of another buffer; null otherwise.
rt::InsertAxisOp columnCopyOf(Value v, Operation *producer, int64_t rows) {
  Value root = rt::rootBuffer(v);
  if (!root.getDefiningOp<rt::AllocOp>())
    return {};
  rt::InsertAxisOp copy;
  for (Operation *op : accessesOf(root)) {
    if (op == producer)
      continue;
    auto insert = dyn_cast<rt::InsertAxisOp>(op);
    if (!insert || copy || !sameBuffer(insert.getX(), v) ||
        sameBuffer(insert.getOut(), v))
      return {};
    copy = insert;
  }
  if (!copy || copy.getInner() != 1 || copy.getOuter() != rows ||
      !isa<IntegerAttr>(copy.getStart()) ||
      copy->getBlock() != producer->getBlock() ||
      !producer->isBeforeInBlock(copy) ||
      rt::elementTypeOf(copy.getOut()) != rt::elementTypeOf(v))
    return {};
  return copy;
}

// The columns [first, last) of `buffer` (rows of `width`) that `op` writes,
// when that is all it does with it: a column copy into it, or a weight
// gradient's GEMM writing a column block of it.
std::optional<std::pair<int64_t, int64_t>>
columnsWritten(Operation *op, Value buffer, int64_t width) {
  auto uses = [&](Value v) { return sameBuffer(v, buffer) ? 1 : 0; };
  int64_t touches = 0;
  for (Value v : op->getOperands())
    if (isa<MemRefType>(v.getType()))
      touches += uses(v);
  if (auto insert = dyn_cast<rt::InsertAxisOp>(op)) {
    auto start = dyn_cast<IntegerAttr>(insert.getStart());
    if (touches == 1 && uses(insert.getOut()) && start &&
        insert.getInner() == 1 && insert.getExtent() == width)
      return std::make_pair(start.getInt(),
                            start.getInt() + insert.getLength());
  }
  if (auto g = dyn_cast<rt::MatmulBiasGradOp>(op))
    if (touches == 1 && (uses(g.getC()) || uses(g.getDb())) &&
        g.getLdc() == width)
      return std::make_pair(g.getCol(), g.getCol() + g.getN());
  return std::nullopt;
}

// matmul_bias_grad(x, dy) -> dw, db; ...; insert_axis(dw) -> W [m, E] at
// column s; insert_axis(db) -> B [E] at s: the q, k or v piece of a fused
// projection's weight and bias gradients, written by its GEMM straight into
// its columns of the fused ones (ldc = E, col = s), without the copies.
// The writes move up to the GEMM, so in between W and B may only take
// other columns' writes.
struct ColumnBlockFusion : OpRewritePattern<rt::MatmulBiasGradOp> {
  using OpRewritePattern::OpRewritePattern;
  LogicalResult matchAndRewrite(rt::MatmulBiasGradOp g,
                                PatternRewriter &rewriter) const override {
    if (g.getLdc() != g.getN() || g.getCol() != 0)
      return failure();
    rt::InsertAxisOp intoW = columnCopyOf(g.getC(), g, g.getM());
    rt::InsertAxisOp intoB = columnCopyOf(g.getDb(), g, 1);
    if (!intoW || !intoB || intoW.getLength() != g.getN() ||
        intoB.getLength() != g.getN() ||
        intoW.getExtent() != intoB.getExtent() ||
        intoW.getStart() != intoB.getStart())
      return failure();
    Value w = intoW.getOut(), b = intoB.getOut();
    int64_t width = intoW.getExtent();
    int64_t col = cast<IntegerAttr>(intoW.getStart()).getInt();
    if (sameBuffer(w, b) ||
        llvm::any_of(ValueRange{g.getA(), g.getB()}, [&](Value v) {
          return sameBuffer(v, w) || sameBuffer(v, b);
        }))
      return failure();
    for (auto [copy, dest] :
         {std::make_pair(intoW, w), std::make_pair(intoB, b)})
      for (Operation *op = g->getNextNode(); op != copy.getOperation();
           op = op->getNextNode()) {
        if (isBookkeeping(op) || llvm::none_of(op->getOperands(), [&](Value v) {
              return isa<MemRefType>(v.getType()) && sameBuffer(v, dest);
            }))
          continue;
        auto cols = columnsWritten(op, dest, width);
        if (!cols || (cols->first < col + g.getN() && col < cols->second))
          return failure();
      }
    if (!availableBefore(w, g, nullptr) || !availableBefore(b, g, nullptr))
      return failure();
    availableBefore(w, g, &rewriter);
    availableBefore(b, g, &rewriter);
    rewriter.setInsertionPoint(g);
    rt::MatmulBiasGradOp::create(rewriter, g.getLoc(), g.getA(), g.getB(), w, b,
                                 g.getM(), g.getN(), g.getK(), width, col);
    rewriter.eraseOp(intoW);
    rewriter.eraseOp(intoB);
    rewriter.eraseOp(g);
    return success();
  }
};

// matmul(dy, W^T) -> dg; ...; gelu_backward(pre, dg) -> dx: the product
// applies GELU's derivative as it writes. The product moves to the GELU's
// place, so nothing in between may write its operands or the GELU's input,
// or touch dx.
struct GeluGradFusion : OpRewritePattern<rt::GeluBackwardOp> {
  using OpRewritePattern::OpRewritePattern;
  LogicalResult matchAndRewrite(rt::GeluBackwardOp gelu,
                                PatternRewriter &rewriter) const override {
    rt::MatmulOp m = rowsProductWriting(gelu, gelu.getDout());
    if (!m || !onlyAccessedBy(m.getC(), {m, gelu}) ||
        m.getBatch() * m.getM() * m.getN() != gelu.getN() ||
        sameBuffer(gelu.getDx(), gelu.getX()) ||
        sameBuffer(gelu.getDx(), m.getA()) ||
        sameBuffer(gelu.getDx(), m.getB()) ||
        rt::elementTypeOf(gelu.getDx()) != rt::elementTypeOf(m.getC()) ||
        rt::elementTypeOf(gelu.getX()) != rt::elementTypeOf(m.getC()) ||
        !clearBetween(m, gelu, {m.getA(), m.getB(), gelu.getX()},
                      {gelu.getDx()}))
      return failure();
    rewriter.setInsertionPoint(gelu);
    rt::MatmulGeluGradOp::create(rewriter, gelu.getLoc(), m.getA(), m.getB(),
                                 gelu.getX(), gelu.getDx(),
                                 m.getBatch() * m.getM(), m.getN(), m.getK(),
                                 m.getTransB());
    rewriter.eraseOp(m);
    rewriter.eraseOp(gelu);
    return success();
  }
};

// matmul(a, W) -> c; ...; add(x, c) -> out: the product is added to x as
// the GEMM writes it (the q, k and v input gradients of a fused
// projection, summed).
struct MatmulAddFusion : OpRewritePattern<rt::AddBroadcastOp> {
  using OpRewritePattern::OpRewritePattern;
  LogicalResult matchAndRewrite(rt::AddBroadcastOp add,
                                PatternRewriter &rewriter) const override {
    if (add.getN() != add.getNb())
      return failure();
    for (bool productIsRhs : {true, false}) {
      Value c = productIsRhs ? add.getB() : add.getA();
      Value x = productIsRhs ? add.getA() : add.getB();
      rt::MatmulOp m = rowsProductWriting(add, c);
      if (!m || sameBuffer(x, c) || !onlyAccessedBy(m.getC(), {m, add}) ||
          llvm::any_of(ValueRange{x, m.getA(), m.getB()},
                       [&](Value v) { return sameBuffer(v, add.getOut()); }) ||
          rt::elementsOf(x) != rt::elementsOf(add.getOut()) ||
          rt::elementTypeOf(x) != rt::elementTypeOf(add.getOut()) ||
          rt::elementTypeOf(m.getC()) != rt::elementTypeOf(add.getOut()) ||
          !clearBetween(m, add, {m.getA(), m.getB(), x}, {add.getOut()}))
        continue;
      rewriter.setInsertionPoint(add);
      rt::MatmulAddOp::create(rewriter, add.getLoc(), m.getA(), m.getB(), x,
                              add.getOut(), m.getBatch() * m.getM(), m.getN(),
                              m.getK(), m.getTransB());
      rewriter.eraseOp(m);
      rewriter.eraseOp(add);
      return success();
    }
    return failure();
  }
};

struct FuseKernelsPass : tessel::impl::FuseKernelsBase<FuseKernelsPass> {
  // Forward parts' results that nothing reads any more (the SiLU that a
  // fused SwiGLU backward takes again) are no longer handed on: the value
  // then lives within its forward part.
  void dropUnreadResults() {
    SmallVector<pipe::ForwardPassOp> parts;
    getOperation().walk([&](pipe::ForwardPassOp part) {
      if (llvm::any_of(part->getResults(),
                       [](Value r) { return r.use_empty(); }))
        parts.push_back(part);
    });
    for (pipe::ForwardPassOp part : parts) {
      Operation *yield = part.getBody().front().getTerminator();
      SmallVector<Type> kept;
      SmallVector<Value> keptResults;
      llvm::BitVector dropped(part->getNumResults());
      for (OpResult r : part->getResults()) {
        if (r.use_empty()) {
          dropped.set(r.getResultNumber());
          continue;
        }
        kept.push_back(r.getType());
        keptResults.push_back(r);
      }
      OpBuilder b(part);
      OperationState state(part.getLoc(), part->getName());
      state.addAttributes(part->getAttrs());
      state.addTypes(kept);
      state.addRegion();
      Operation *replacement = b.create(state);
      replacement->getRegion(0).takeBody(part->getRegion(0));
      yield->eraseOperands(dropped);
      for (auto [old, now] : llvm::zip(keptResults, replacement->getResults()))
        old.replaceAllUsesWith(now);
      part->erase();
    }
  }

  void runOnOperation() override {
    RewritePatternSet patterns(&getContext());
    populateFuseKernelsPatterns(patterns);
    GreedyRewriteConfig config;
    config.setUseTopDownTraversal(true);
    if (failed(applyPatternsGreedily(getOperation(), std::move(patterns),
                                     config)))
      return signalPassFailure();
    dropUnreadResults();
    // A SiLU nothing reads any more (its backward takes it again) is not
    // written.
    getOperation().walk([&](rt::SwigluForwardOp swiglu) {
      Value s = swiglu.getSiluOut();
      if (s && rt::rootBuffer(s).getDefiningOp<rt::AllocOp>() &&
          onlyAccessedBy(s, {swiglu}))
        swiglu.getSiluOutMutable().clear();
    });
    // The buffers fused away (a matmul's output before its bias, a norm's
    // input gradient before the residual's).
    SmallVector<Operation *> dead;
    getOperation().walk([&](Operation *op) {
      if (isa<rt::AllocOp, rt::ViewOp>(op) && op->use_empty())
        dead.push_back(op);
    });
    while (!dead.empty()) {
      Operation *op = dead.pop_back_val();
      Value source = isa<rt::ViewOp>(op) ? op->getOperand(0) : Value();
      op->erase();
      if (source && source.use_empty() && source.getDefiningOp() &&
          isa<rt::AllocOp, rt::ViewOp>(source.getDefiningOp()))
        dead.push_back(source.getDefiningOp());
    }
  }
};

} // namespace

void tessel::populateFuseKernelsPatterns(RewritePatternSet &patterns) {
  patterns.add<MatmulBiasFusion, AddNormFusion<rt::LayerNormForwardOp>,
               AddNormFusion<rt::RmsNormForwardOp>, NormBackwardAddFusion,
               SwigluFusion, SwigluBackwardFusion, BiasGradFusion,
               ColumnBlockFusion, GeluGradFusion, MatmulAddFusion>(
      patterns.getContext());
}
