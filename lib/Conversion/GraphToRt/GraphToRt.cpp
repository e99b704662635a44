//===- GraphToRt.cpp - graph ops as runtime kernel calls -----------------===//
//
// Every graph op of the (local, per-rank) program becomes the rt kernel that
// computes it into fresh buffers, with all its sizes as constants: the shape
// arithmetic that used to live in the C++ printer, once, here. Reshapes are
// views. Parameters become rt.param with their global shape and how this
// rank's piece is cut from it.
//
//===----------------------------------------------------------------------===//

#include "tessel/Conversion/Passes.h"
#include "tessel/Conversion/ToRt.h"
#include <algorithm>
#include <limits>

using namespace mlir;
using namespace tessel;
using namespace tessel::graph;
namespace rt = tessel::rtir;

namespace {

ArrayRef<int64_t> shapeOf(Value v) {
  return cast<ShapedType>(v.getType()).getShape();
}
int64_t numel(Value v) { return cast<ShapedType>(v.getType()).getNumElements(); }
int64_t product(ArrayRef<int64_t> dims) {
  int64_t p = 1;
  for (int64_t d : dims)
    p *= d;
  return p;
}

// A pattern for one graph op with helpers to make buffers and attributes.
template <typename SourceOp>
struct ToRtPattern : OpConversionPattern<SourceOp> {
  using OpConversionPattern<SourceOp>::OpConversionPattern;
  using Adaptor = typename SourceOp::Adaptor;

  Value alloc(ConversionPatternRewriter &b, Location loc, Value result) const {
    Type type = this->getTypeConverter()->convertType(result.getType());
    return rt::AllocOp::create(b, loc, type);
  }
  static IntegerAttr i(OpBuilder &b, int64_t v) { return b.getI64IntegerAttr(v); }
  static FloatAttr f(OpBuilder &b, double v) { return b.getF64FloatAttr(v); }
  static BoolAttr flag(OpBuilder &b, bool v) { return b.getBoolAttr(v); }
  // Where this rank's vocabulary slice of `local` rows starts.
  static rt::GroupOffsetAttr vocabStart(OpBuilder &b, dist::AxesAttr axes,
                                        int64_t local) {
    return rt::GroupOffsetAttr::get(b.getContext(), axes, local, 1);
  }
};

#define PATTERN(Op)                                                            \
  struct Op##Lowering : ToRtPattern<Op> {                                      \
    using ToRtPattern::ToRtPattern;                                            \
    LogicalResult                                                              \
    matchAndRewrite(Op op, Adaptor a,                                          \
                    ConversionPatternRewriter &b) const override;              \
  };                                                                           \
  LogicalResult Op##Lowering::matchAndRewrite(                                 \
      Op op, Adaptor a, ConversionPatternRewriter &b) const

//===----------------------------------------------------------------------===//
// Leaves
//===----------------------------------------------------------------------===//

// The table of a parameter: its global (checkpoint) shape and how this
// rank's piece is cut from it.
PATTERN(ParamOp) {
  SmallVector<int64_t> shape(op.getType().getShape());
  int64_t shardDim = -1, shardBlocks = 1;
  MeshAxis shardAxis = MeshAxis::DP;
  // A second cut (an expert's weights: the experts over ep, each one's
  // width over tp), of one block.
  std::optional<std::pair<int64_t, MeshAxis>> second;
  if (auto attrs = op->getAttrOfType<ArrayAttr>("dist.sharding")) {
    dist::Sharding s =
        dist::Sharding::fromAttr(cast<dist::ShardingAttr>(attrs[0]));
    MeshShape mesh = dist::meshOf(op);
    for (auto [d, axes] : llvm::enumerate(s.dims)) {
      if (axes.empty())
        continue;
      if (!axes.single() || second ||
          (shardDim >= 0 && (shardBlocks != 1 || s.blocksOf(d) != 1)))
        return op.emitOpError("parameters split along more than two "
                              "dimensions, over several axes in one, or "
                              "in blocks along two are not supported");
      if (shardDim >= 0) {
        second = {(int64_t)d, *axes.single()};
      } else {
        shardDim = d;
        shardAxis = *axes.single();
        shardBlocks = s.blocksOf(d);
      }
      shape[d] *= mesh.groupSize(axes);
    }
  }
  auto param = rt::ParamOp::create(
      b, op.getLoc(), getTypeConverter()->convertType(op.getType()),
      op.getNameAttr(), b.getDenseI64ArrayAttr(shape), op.getInitAttr(),
      op.getMeanAttr(), op.getStdAttr(), flag(b, shape.size() >= 2),
      i(b, shardDim), dist::AxisAttr::get(b.getContext(), shardAxis),
      i(b, shardBlocks), IntegerAttr(), ArrayAttr(), DenseI64ArrayAttr());
  if (second)
    param->setAttr("second_shard",
                   b.getDenseI64ArrayAttr(
                       {second->first, (int64_t)second->second}));
  b.replaceOp(op, param);
  return success();
}

PATTERN(InputOp) {
  b.replaceOpWithNewOp<rt::BatchOp>(
      op, getTypeConverter()->convertType(op.getType()), op.getNameAttr());
  return success();
}

PATTERN(FillOp) {
  Value out = alloc(b, op.getLoc(), op);
  rt::FillOp::create(b, op.getLoc(), out, i(b, numel(op)), op.getValueAttr());
  b.replaceOp(op, out);
  return success();
}

//===----------------------------------------------------------------------===//
// Elementwise and reductions
//===----------------------------------------------------------------------===//

PATTERN(AddOp) {
  Value out = alloc(b, op.getLoc(), op);
  rt::AddBroadcastOp::create(b, op.getLoc(), a.getLhs(), a.getRhs(), out,
                             i(b, numel(op.getLhs())),
                             i(b, numel(op.getRhs())));
  b.replaceOp(op, out);
  return success();
}

PATTERN(MulOp) {
  Value out = alloc(b, op.getLoc(), op);
  rt::MulBroadcastOp::create(b, op.getLoc(), a.getLhs(), a.getRhs(), out,
                             i(b, numel(op.getLhs())),
                             i(b, numel(op.getRhs())));
  b.replaceOp(op, out);
  return success();
}

PATTERN(ReduceSumOp) {
  Value out = alloc(b, op.getLoc(), op);
  int64_t cols = numel(op);
  rt::ReduceSumLeadingOp::create(b, op.getLoc(), a.getInput(), out,
                                 i(b, numel(op.getInput()) / cols),
                                 i(b, cols));
  b.replaceOp(op, out);
  return success();
}

template <typename SourceOp, typename KernelOp>
struct UnaryLowering : ToRtPattern<SourceOp> {
  using ToRtPattern<SourceOp>::ToRtPattern;
  LogicalResult
  matchAndRewrite(SourceOp op, typename SourceOp::Adaptor a,
                  ConversionPatternRewriter &b) const override {
    Value out = this->alloc(b, op.getLoc(), op);
    KernelOp::create(b, op.getLoc(), a.getInput(), out,
                     this->i(b, numel(op)));
    b.replaceOp(op, out);
    return success();
  }
};

template <typename SourceOp, typename KernelOp>
struct UnaryGradLowering : ToRtPattern<SourceOp> {
  using ToRtPattern<SourceOp>::ToRtPattern;
  LogicalResult
  matchAndRewrite(SourceOp op, typename SourceOp::Adaptor a,
                  ConversionPatternRewriter &b) const override {
    Value out = this->alloc(b, op.getLoc(), op);
    KernelOp::create(b, op.getLoc(), a.getInput(), a.getGrad(), out,
                     this->i(b, numel(op)));
    b.replaceOp(op, out);
    return success();
  }
};

//===----------------------------------------------------------------------===//
// Matmul, norms, attention, softmax
//===----------------------------------------------------------------------===//

PATTERN(MatmulOp) {
  auto lhs = shapeOf(op.getLhs()), rhs = shapeOf(op.getRhs()),
       out = shapeOf(op);
  bool tl = op.getTransposeLhs(), tr = op.getTransposeRhs();
  int64_t M = out[out.size() - 2], N = out.back();
  int64_t K = tl ? lhs[lhs.size() - 2] : lhs.back();
  int64_t batch = product(out.drop_back(2));
  // Summed over the batch too: the batch's rows are more rows of K (both
  // operands are [batch..., K, .] row-major).
  if (op.getSumBatch())
    K *= product(ArrayRef<int64_t>(lhs).drop_back(2));
  int64_t strideB = rhs.size() == 2 ? 0 : K * N;
  Value result = alloc(b, op.getLoc(), op);
  rt::MatmulOp::create(b, op.getLoc(), a.getLhs(), a.getRhs(), result,
                       i(b, batch), i(b, M), i(b, N), i(b, K), flag(b, tl),
                       flag(b, tr), i(b, M * K), i(b, strideB), i(b, M * N));
  b.replaceOp(op, result);
  return success();
}

PATTERN(LayerNormOp) {
  int64_t C = shapeOf(op).back();
  Value out = alloc(b, op.getLoc(), op);
  rt::LayerNormForwardOp::create(b, op.getLoc(), a.getInput(), a.getWeight(),
                                 a.getBias(), out, i(b, numel(op) / C),
                                 i(b, C), op.getEpsilonAttr());
  b.replaceOp(op, out);
  return success();
}

PATTERN(LayerNormGradOp) {
  int64_t C = shapeOf(op.getInput()).back();
  Value dx = alloc(b, op.getLoc(), op.getInputGrad());
  Value dw = alloc(b, op.getLoc(), op.getWeightGrad());
  Value db = alloc(b, op.getLoc(), op.getBiasGrad());
  rt::LayerNormBackwardOp::create(
      b, op.getLoc(), a.getInput(), a.getWeight(), a.getGrad(), dx, dw, db,
      i(b, numel(op.getInput()) / C), i(b, C), op.getEpsilonAttr());
  b.replaceOp(op, {dx, dw, db});
  return success();
}

PATTERN(RmsNormOp) {
  int64_t C = shapeOf(op).back();
  Value out = alloc(b, op.getLoc(), op);
  rt::RmsNormForwardOp::create(b, op.getLoc(), a.getInput(), a.getWeight(),
                               out, i(b, numel(op) / C), i(b, C),
                               op.getEpsilonAttr());
  b.replaceOp(op, out);
  return success();
}

PATTERN(RmsNormGradOp) {
  int64_t C = shapeOf(op.getInput()).back();
  Value dx = alloc(b, op.getLoc(), op.getInputGrad());
  Value dw = alloc(b, op.getLoc(), op.getWeightGrad());
  rt::RmsNormBackwardOp::create(b, op.getLoc(), a.getInput(), a.getWeight(),
                                a.getGrad(), dx, dw,
                                i(b, numel(op.getInput()) / C), i(b, C),
                                op.getEpsilonAttr());
  b.replaceOp(op, {dx, dw});
  return success();
}

// The position of a rank's first row along a sequence split over `axes`
// (context parallelism): its piece's offset; 0 when whole.
Attribute firstPosition(OpBuilder &b, dist::AxesAttr axes, int64_t rows) {
  if (!axes)
    return b.getI64IntegerAttr(0);
  return rt::GroupOffsetAttr::get(b.getContext(), axes, rows, 1);
}

PATTERN(RopeOp) {
  auto s = shapeOf(op);
  Value out = alloc(b, op.getLoc(), op);
  rt::RopeOp::create(b, op.getLoc(), a.getInput(), out, i(b, s[0]),
                     i(b, s[1]), i(b, s[2]), i(b, s[3]), op.getThetaAttr(),
                     op.getInverseAttr(),
                     firstPosition(b, op.getSeqAxesAttr(), s[1]),
                     i(b, op.getZigzag().value_or(0)),
                     i(b, s[1] * (op.getSeqAxesAttr()
                                      ? dist::meshOf(op).groupSize(
                                            op.getSeqAxesAttr().getValue())
                                      : 1)));
  b.replaceOp(op, out);
  return success();
}

PATTERN(AttentionOp) {
  auto q = shapeOf(op.getQuery());
  Value out = alloc(b, op.getLoc(), op.getResult());
  Value lse = alloc(b, op.getLoc(), op.getLse());
  rt::AttentionForwardOp::create(b, op.getLoc(), a.getQuery(), a.getKey(),
                                 a.getValue(), out, lse, i(b, q[0]),
                                 i(b, q[1]), i(b, q[2]),
                                 i(b, shapeOf(op.getKey())[2]), i(b, q[3]),
                                 op.getCausalAttr(),
                                 i(b, shapeOf(op.getKey())[1]),
                                 firstPosition(b, op.getSeqAxesAttr(), q[1]),
                                 i(b, op.getZigzag().value_or(0)));
  b.replaceOp(op, {out, lse});
  return success();
}

// Inference: the caches are state of the program, the logits are copied to
// where the runtime reads them.
PATTERN(KvCacheOp) {
  b.replaceOpWithNewOp<rt::KvCacheOp>(
      op, getTypeConverter()->convertType(op.getType()), op.getNameAttr());
  return success();
}

PATTERN(RopeAtOp) {
  auto s = shapeOf(op);
  Value out = alloc(b, op.getLoc(), op);
  rt::RopeAtOp::create(b, op.getLoc(), a.getInput(), a.getPositions(), out,
                       i(b, s[0]), i(b, s[1]), i(b, s[2]), i(b, s[3]),
                       op.getThetaAttr());
  b.replaceOp(op, out);
  return success();
}

PATTERN(CachedAttentionOp) {
  auto q = shapeOf(op.getQuery());
  auto cache = shapeOf(op.getKCache());
  Value out = alloc(b, op.getLoc(), op);
  rt::CachedAttentionOp::create(
      b, op.getLoc(), a.getQuery(), a.getKey(), a.getValue(), a.getKCache(),
      a.getVCache(), a.getPositions(), out, i(b, q[0]), i(b, q[1]),
      i(b, cache[1]), i(b, q[2]), i(b, cache[2]), i(b, q[3]));
  b.replaceOp(op, out);
  return success();
}

PATTERN(OutputOp) {
  auto type = cast<MemRefType>(a.getValue().getType());
  Value place = rt::BufferOp::create(b, op.getLoc(), type, rt::Space::Logits,
                                     0);
  rt::CopyOp::create(b, op.getLoc(), a.getValue(), place,
                     i(b, type.getNumElements()));
  b.eraseOp(op);
  return success();
}

PATTERN(AttentionGradOp) {
  auto q = shapeOf(op.getQuery());
  Value dq = alloc(b, op.getLoc(), op.getQueryGrad());
  Value dk = alloc(b, op.getLoc(), op.getKeyGrad());
  Value dv = alloc(b, op.getLoc(), op.getValueGrad());
  rt::AttentionBackwardOp::create(
      b, op.getLoc(), a.getQuery(), a.getKey(), a.getValue(), a.getResult(),
      a.getLse(), a.getGrad(), dq, dk, dv, i(b, q[0]), i(b, q[1]), i(b, q[2]),
      i(b, shapeOf(op.getKey())[2]), i(b, q[3]), op.getCausalAttr(),
      i(b, shapeOf(op.getKey())[1]),
      firstPosition(b, op.getSeqAxesAttr(), q[1]),
      i(b, op.getZigzag().value_or(0)));
  b.replaceOp(op, {dq, dk, dv});
  return success();
}

PATTERN(DropoutOp) {
  auto shape = shapeOf(op);
  SmallVector<int64_t> axes(shape.size(), 0);
  if (auto split = op.getSplitAxesAttr())
    axes.assign(split.asArrayRef().begin(), split.asArrayRef().end());
  int64_t microbatches = op.getMicrobatches().value_or(1);
  Value out = alloc(b, op.getLoc(), op);
  Value mb = rt::MicrobatchOp::create(b, op.getLoc(), b.getI64Type());
  rt::DropoutOp::create(b, op.getLoc(), a.getInput(), out, mb,
                        b.getDenseI64ArrayAttr(shape),
                        b.getDenseI64ArrayAttr(axes), i(b, shape.size()),
                        i(b, microbatches), op.getPAttr(), op.getSeedAttr(),
                        op.getSiteAttr(), i(b, op.getZigzag().value_or(0)));
  b.replaceOp(op, out);
  return success();
}

PATTERN(ZigzagOp) {
  auto shape = shapeOf(op);
  int64_t dim = op.getDim(), outer = 1, inner = 1;
  for (int64_t d = 0; d < dim; ++d)
    outer *= shape[d];
  for (int64_t d = dim + 1; d < (int64_t)shape.size(); ++d)
    inner *= shape[d];
  Value out = alloc(b, op.getLoc(), op);
  rt::ZigzagOp::create(b, op.getLoc(), a.getInput(), out, i(b, outer),
                       i(b, shape[dim]), i(b, inner), op.getPiecesAttr(),
                       op.getInverseAttr());
  b.replaceOp(op, out);
  return success();
}

PATTERN(SoftmaxOp) {
  int64_t cols = shapeOf(op).back();
  Value out = alloc(b, op.getLoc(), op);
  rt::SoftmaxForwardOp::create(b, op.getLoc(), a.getInput(), out,
                               i(b, numel(op) / cols), i(b, cols),
                               op.getScaleAttr(), op.getCausalAttr());
  b.replaceOp(op, out);
  return success();
}

PATTERN(SoftmaxGradOp) {
  int64_t cols = shapeOf(op).back();
  Value out = alloc(b, op.getLoc(), op);
  rt::SoftmaxBackwardOp::create(b, op.getLoc(), a.getOutput(), a.getGrad(),
                                out, i(b, numel(op) / cols), i(b, cols),
                                op.getScaleAttr());
  b.replaceOp(op, out);
  return success();
}

//===----------------------------------------------------------------------===//
// Loss and embedding: whole, or over this rank's vocabulary slice
//===----------------------------------------------------------------------===//

// The classes that take part in the softmax: the first valid_vocab (global)
// of a padded vocabulary; all of them otherwise.
static int64_t validVocab(std::optional<uint64_t> attr) {
  return attr ? int64_t(*attr) : std::numeric_limits<int32_t>::max();
}

PATTERN(CrossEntropyOp) {
  int64_t V = shapeOf(op.getLogits()).back(), rows = numel(op.getTargets());
  Value loss = alloc(b, op.getLoc(), op);
  int64_t valid = validVocab(op.getValidVocab());
  if (dist::AxesAttr axes = op.getVocabAxesAttr())
    rt::CrossEntropyVocabParallelForwardOp::create(
        b, op.getLoc(), a.getLogits(), a.getTargets(), loss, Value(),
        i(b, rows), i(b, V), vocabStart(b, axes, V), axes, i(b, valid));
  else
    rt::CrossEntropyForwardOp::create(b, op.getLoc(), a.getLogits(),
                                      a.getTargets(), loss, i(b, rows),
                                      i(b, V), i(b, std::min(valid, V)));
  b.replaceOp(op, loss);
  return success();
}

PATTERN(CrossEntropyGradOp) {
  int64_t V = shapeOf(op.getLogits()).back(), rows = numel(op.getTargets());
  Value dlogits = alloc(b, op.getLoc(), op);
  int64_t valid = validVocab(op.getValidVocab());
  if (dist::AxesAttr axes = op.getVocabAxesAttr())
    rt::CrossEntropyVocabParallelBackwardOp::create(
        b, op.getLoc(), a.getLogits(), a.getTargets(), a.getGrad(), dlogits,
        Value(), i(b, rows), i(b, V), vocabStart(b, axes, V), axes,
        i(b, valid));
  else
    rt::CrossEntropyBackwardOp::create(
        b, op.getLoc(), a.getLogits(), a.getTargets(), a.getGrad(), dlogits,
        i(b, rows), i(b, V), i(b, std::min(valid, V)));
  b.replaceOp(op, dlogits);
  return success();
}

PATTERN(EmbeddingOp) {
  auto t = shapeOf(op.getTable());
  Value out = alloc(b, op.getLoc(), op);
  int64_t n = numel(op.getIds());
  if (dist::AxesAttr axes = op.getVocabAxesAttr())
    rt::EmbeddingForwardRangeOp::create(b, op.getLoc(), a.getTable(),
                                        a.getIds(), out, i(b, n),
                                        vocabStart(b, axes, t[0]), i(b, t[0]),
                                        i(b, t[1]));
  else
    rt::EmbeddingForwardOp::create(b, op.getLoc(), a.getTable(), a.getIds(),
                                   out, i(b, n), i(b, t[0]), i(b, t[1]));
  b.replaceOp(op, out);
  return success();
}

PATTERN(EmbeddingGradOp) {
  auto t = shapeOf(op.getResult());
  Value out = alloc(b, op.getLoc(), op);
  int64_t n = numel(op.getIds());
  if (dist::AxesAttr axes = op.getVocabAxesAttr())
    rt::EmbeddingBackwardRangeOp::create(b, op.getLoc(), a.getIds(),
                                         a.getGrad(), out, i(b, n),
                                         vocabStart(b, axes, t[0]),
                                         i(b, t[0]), i(b, t[1]));
  else
    rt::EmbeddingBackwardOp::create(b, op.getLoc(), a.getIds(), a.getGrad(),
                                    out, i(b, n), i(b, t[0]), i(b, t[1]));
  b.replaceOp(op, out);
  return success();
}

//===----------------------------------------------------------------------===//
// Layout
//===----------------------------------------------------------------------===//

PATTERN(ReshapeOp) {
  b.replaceOpWithNewOp<rt::ViewOp>(
      op, getTypeConverter()->convertType(op.getType()), a.getInput());
  return success();
}

PATTERN(TransposeOp) {
  auto s = shapeOf(op.getInput());
  Value out = alloc(b, op.getLoc(), op);
  rt::TransposeOp::create(b, op.getLoc(), a.getInput(), out,
                          b.getDenseI64ArrayAttr(s), op.getPermutationAttr(),
                          i(b, s.size()));
  b.replaceOp(op, out);
  return success();
}

PATTERN(SplitOp) {
  auto in = shapeOf(op.getInput());
  int64_t axis = op.getAxis(), start = 0;
  int64_t outer = product(in.take_front(axis)),
          inner = product(in.drop_front(axis + 1));
  SmallVector<Value> pieces;
  for (Value r : op.getResults()) {
    int64_t len = shapeOf(r)[axis];
    Value out = alloc(b, op.getLoc(), r);
    rt::SliceAxisOp::create(b, op.getLoc(), a.getInput(), out, i(b, outer),
                            i(b, in[axis]), i(b, inner), i(b, start),
                            i(b, len));
    pieces.push_back(out);
    start += len;
  }
  b.replaceOp(op, pieces);
  return success();
}

PATTERN(ConcatOp) {
  auto out = shapeOf(op);
  int64_t axis = op.getAxis(), start = 0;
  int64_t outer = product(out.take_front(axis)),
          inner = product(out.drop_front(axis + 1));
  Value result = alloc(b, op.getLoc(), op);
  for (auto [in, piece] : llvm::zip(op.getInputs(), a.getInputs())) {
    int64_t len = shapeOf(in)[axis];
    rt::InsertAxisOp::create(b, op.getLoc(), piece, result, i(b, outer),
                             i(b, out[axis]), i(b, inner), i(b, start),
                             i(b, len));
    start += len;
  }
  b.replaceOp(op, result);
  return success();
}

//===----------------------------------------------------------------------===//
// Optimizer
//===----------------------------------------------------------------------===//

// The norm of all gradients: the squares of the gradients split over the
// same axes are summed into one fp64 partial sum, which is reduced over
// those axes; the norm is the square root of the partial sums' total.
PATTERN(GlobalNormOp) {
  Location loc = op.getLoc();
  ArrayAttr axes = op.getReduceAxesAttr();
  // Partial sums in the order the axis sets first appear.
  SmallVector<AxisSet> sets;
  SmallVector<unsigned> setOf;
  for (size_t k = 0; k < op.getInputs().size(); ++k) {
    AxisSet s = axes ? cast<dist::AxesAttr>(axes[k]).getValue() : AxisSet();
    auto it = llvm::find(sets, s);
    setOf.push_back(it - sets.begin());
    if (it == sets.end())
      sets.push_back(s);
  }
  if (sets.empty())
    sets.push_back({});
  std::sort(sets.begin(), sets.end());
  for (size_t k = 0; k < setOf.size(); ++k) {
    AxisSet s = axes ? cast<dist::AxesAttr>(axes[k]).getValue() : AxisSet();
    setOf[k] = llvm::find(sets, s) - sets.begin();
  }
  auto f64 = b.getF64Type();
  auto sumsType = MemRefType::get({(int64_t)sets.size()}, f64);
  Value sums = rt::BufferOp::create(b, loc, sumsType, rt::Space::NormSums, 0);
  rt::ZeroSumsOp::create(b, loc, sums, i(b, sets.size()));
  for (auto [part, set] : llvm::enumerate(sets)) {
    Value slot = rt::BufferOp::create(b, loc, MemRefType::get({1}, f64),
                                      rt::Space::NormSums, part);
    for (auto [k, grad] : llvm::enumerate(a.getInputs()))
      if (setOf[k] == part)
        rt::SumSquaresOp::create(b, loc, grad, slot,
                                 i(b, numel(op.getInputs()[k])));
    if (!set.empty())
      rt::AllReduceOp::create(b, loc, ValueRange{slot},
                              dist::AxesAttr::get(b.getContext(), set));
  }
  Value norm = alloc(b, loc, op);
  rt::SqrtSumOp::create(b, loc, sums, norm, i(b, sets.size()));
  b.replaceOp(op, norm);
  return success();
}

PATTERN(AdamWOp) {
  Location loc = op.getLoc();
  Value param = a.getParam();
  auto stateOf = [&](rt::Space space) {
    return rt::StateOfOp::create(b, loc, param.getType(), param, space,
                                 IntegerAttr())
        .getResult();
  };
  Value m = stateOf(rt::Space::AdamM), v = stateOf(rt::Space::AdamV);
  Value lr = rt::LearningRateOp::create(b, loc, b.getF32Type());
  Value count = rt::UpdateCountOp::create(b, loc, b.getI64Type());
  auto f32 = [&](APFloat v) {
    return b.getF32FloatAttr(v.convertToDouble());
  };
  rt::AdamWOp::create(b, loc, param, /*shadow=*/Value(), a.getGrad(), m, v,
                      a.getNorm(), lr, count, i(b, numel(op.getParam())),
                      f32(op.getBeta1()), f32(op.getBeta2()), f32(op.getEps()),
                      f32(op.getWeightDecay()), f32(op.getMaxGradNorm()));
  b.eraseOp(op);
  return success();
}

//===----------------------------------------------------------------------===//
// Mixture of experts
//===----------------------------------------------------------------------===//

// The tokens of a routed tensor [..., X]: all its leading dimensions.
static int64_t tokensOf(Value v) { return numel(v) / shapeOf(v).back(); }

PATTERN(MoeTopKOp) {
  Value w = alloc(b, op.getLoc(), op.getWeights());
  Value e = alloc(b, op.getLoc(), op.getExperts());
  rt::MoeTopKOp::create(b, op.getLoc(), a.getProbs(), e, w,
                        i(b, tokensOf(op.getProbs())),
                        i(b, shapeOf(op.getProbs()).back()), op.getTopKAttr());
  b.replaceOp(op, {w, e});
  return success();
}

PATTERN(MoeTopKGradOp) {
  Value out = alloc(b, op.getLoc(), op);
  rt::MoeTopKBackwardOp::create(
      b, op.getLoc(), a.getProbs(), a.getExperts(), a.getGrad(), out,
      i(b, tokensOf(op.getProbs())), i(b, shapeOf(op.getProbs()).back()),
      i(b, shapeOf(op.getExperts()).back()), flag(b, false));
  b.replaceOp(op, out);
  return success();
}

PATTERN(MoeLoadStatsOp) {
  Value counts = alloc(b, op.getLoc(), op.getCounts());
  Value sums = alloc(b, op.getLoc(), op.getProbSums());
  rt::MoeLoadStatsOp::create(b, op.getLoc(), a.getProbs(), a.getExperts(),
                             counts, sums, i(b, tokensOf(op.getProbs())),
                             i(b, shapeOf(op.getProbs()).back()),
                             i(b, shapeOf(op.getExperts()).back()));
  b.replaceOp(op, {counts, sums});
  return success();
}

PATTERN(MoeProbSumsGradOp) {
  Value out = alloc(b, op.getLoc(), op);
  rt::MoeProbSumsBackwardOp::create(b, op.getLoc(), a.getGrad(), out,
                                    i(b, tokensOf(op.getProbs())),
                                    i(b, shapeOf(op.getProbs()).back()));
  b.replaceOp(op, out);
  return success();
}

PATTERN(MoeAuxLossOp) {
  Value out = alloc(b, op.getLoc(), op);
  rt::MoeAuxLossOp::create(b, op.getLoc(), a.getCounts(), a.getProbSums(),
                           out, op.getTokensAttr(),
                           i(b, shapeOf(op.getCounts())[0]), op.getTopKAttr(),
                           op.getCoefAttr());
  b.replaceOp(op, out);
  return success();
}

PATTERN(MoeAuxLossGradOp) {
  Value out = alloc(b, op.getLoc(), op);
  rt::MoeAuxLossBackwardOp::create(b, op.getLoc(), a.getCounts(), a.getGrad(),
                                   out, op.getTokensAttr(),
                                   i(b, shapeOf(op.getCounts())[0]),
                                   op.getTopKAttr(), op.getCoefAttr());
  b.replaceOp(op, out);
  return success();
}

PATTERN(MoeZLossOp) {
  Value out = alloc(b, op.getLoc(), op);
  rt::MoeZLossOp::create(b, op.getLoc(), a.getLogits(), out,
                         i(b, tokensOf(op.getLogits())),
                         i(b, shapeOf(op.getLogits()).back()),
                         op.getCoefAttr());
  b.replaceOp(op, out);
  return success();
}

PATTERN(MoeZLossGradOp) {
  Value out = alloc(b, op.getLoc(), op);
  rt::MoeZLossBackwardOp::create(b, op.getLoc(), a.getLogits(), a.getGrad(),
                                 out, i(b, tokensOf(op.getLogits())),
                                 i(b, shapeOf(op.getLogits()).back()),
                                 op.getCoefAttr());
  b.replaceOp(op, out);
  return success();
}

PATTERN(MoeDispatchOp) {
  Value rows = alloc(b, op.getLoc(), op.getRowOf());
  Value offsets = alloc(b, op.getLoc(), op.getOffsets());
  dist::AxesAttr axes = op.getTokenAxesAttr();
  rt::MoeDispatchOp::create(
      b, op.getLoc(), a.getExperts(), rows, offsets,
      i(b, tokensOf(op.getExperts())), i(b, shapeOf(op.getExperts()).front()),
      i(b, shapeOf(op.getExperts()).back()),
      op.getNumExpertsAttr(), op.getCapacityAttr(),
      axes ? axes : dist::AxesAttr::get(b.getContext(), AxisSet()));
  b.replaceOp(op, {rows, offsets});
  return success();
}

PATTERN(MoeKeptCountsOp) {
  Value out = alloc(b, op.getLoc(), op);
  rt::MoeKeptCountsOp::create(b, op.getLoc(), a.getOffsets(), out,
                              i(b, shapeOf(op.getResult())[0]));
  b.replaceOp(op, out);
  return success();
}

PATTERN(MoePermuteOp) {
  Value out = alloc(b, op.getLoc(), op);
  // Rows of dropped assignments stay zero.
  rt::FillOp::create(b, op.getLoc(), out, i(b, numel(op)), f(b, 0.0));
  rt::MoePermuteOp::create(b, op.getLoc(), a.getInput(), a.getRowOf(), out,
                           i(b, tokensOf(op.getRowOf())),
                           i(b, shapeOf(op.getRowOf()).back()),
                           i(b, shapeOf(op.getInput()).back()));
  b.replaceOp(op, out);
  return success();
}

PATTERN(MoePermuteGradOp) {
  Value out = alloc(b, op.getLoc(), op);
  rt::MoePermuteBackwardOp::create(b, op.getLoc(), a.getGrad(), a.getRowOf(),
                                   out, i(b, tokensOf(op.getRowOf())),
                                   i(b, shapeOf(op.getRowOf()).back()),
                                   i(b, shapeOf(op).back()));
  b.replaceOp(op, out);
  return success();
}

PATTERN(MoeUnpermuteOp) {
  Value out = alloc(b, op.getLoc(), op);
  rt::MoeUnpermuteOp::create(b, op.getLoc(), a.getRows(), a.getRowOf(),
                             a.getWeights(), out,
                             i(b, tokensOf(op.getRowOf())),
                             i(b, shapeOf(op.getRowOf()).back()),
                             i(b, shapeOf(op).back()));
  b.replaceOp(op, out);
  return success();
}

PATTERN(MoeUnpermuteGradOp) {
  Value drows = alloc(b, op.getLoc(), op.getRowsGrad());
  Value dw = alloc(b, op.getLoc(), op.getWeightsGrad());
  // Rows of dropped assignments get no gradient: zero, not stale.
  rt::FillOp::create(b, op.getLoc(), drows, i(b, numel(op.getRowsGrad())),
                     f(b, 0.0));
  rt::MoeUnpermuteBackwardOp::create(
      b, op.getLoc(), a.getRows(), a.getRowOf(), a.getWeights(), a.getGrad(),
      drows, dw, i(b, tokensOf(op.getRowOf())),
      i(b, shapeOf(op.getRowOf()).back()), i(b, shapeOf(op.getRows()).back()));
  b.replaceOp(op, {drows, dw});
  return success();
}

PATTERN(MoeExchangeOp) {
  dist::AxesAttr axes = op.getEpAxesAttr();
  if (!axes) {
    b.replaceOp(op, {a.getRows(), a.getOffsets()});
    return success();
  }
  Value recv = alloc(b, op.getLoc(), op.getRecvRows());
  Value recvOffsets = alloc(b, op.getLoc(), op.getRecvOffsets());
  rt::MoeExchangeOp::create(b, op.getLoc(), a.getRows(), a.getOffsets(), recv,
                            recvOffsets, i(b, shapeOf(op.getOffsets())[0] - 1),
                            i(b, shapeOf(op.getRows())[1]),
                            i(b, shapeOf(op.getRecvRows())[0]), axes);
  b.replaceOp(op, {recv, recvOffsets});
  return success();
}

PATTERN(MoeCombineOp) {
  dist::AxesAttr axes = op.getEpAxesAttr();
  if (!axes) {
    b.replaceOp(op, a.getRows());
    return success();
  }
  Value out = alloc(b, op.getLoc(), op);
  rt::MoeCombineOp::create(b, op.getLoc(), a.getRows(), a.getRecvOffsets(),
                           a.getOffsets(), out,
                           i(b, shapeOf(op.getOffsets())[0] - 1),
                           i(b, shapeOf(op)[1]), i(b, shapeOf(op)[0]), axes);
  b.replaceOp(op, out);
  return success();
}

PATTERN(GroupedMatmulOp) {
  auto w = shapeOf(op.getWeight());
  bool tr = op.getTransposeRhs();
  int64_t K = tr ? w[2] : w[1], N = tr ? w[1] : w[2];
  Value out = alloc(b, op.getLoc(), op);
  // Rows past the kept assignments' are zero.
  rt::FillOp::create(b, op.getLoc(), out, i(b, numel(op)), f(b, 0.0));
  rt::GroupedMatmulOp::create(b, op.getLoc(), a.getInput(), a.getWeight(),
                              out, a.getOffsets(),
                              i(b, shapeOf(op.getOffsets())[0] - 1),
                              i(b, w[0]), i(b, K), i(b, N), flag(b, tr));
  b.replaceOp(op, out);
  return success();
}

PATTERN(GroupedMatmulWeightGradOp) {
  auto w = shapeOf(op.getResult());
  bool tr = op.getTransposeRhs();
  int64_t K = tr ? w[2] : w[1], N = tr ? w[1] : w[2];
  Value out = alloc(b, op.getLoc(), op);
  rt::GroupedMatmulWeightGradOp::create(
      b, op.getLoc(), a.getInput(), a.getGrad(), out, a.getOffsets(),
      i(b, shapeOf(op.getOffsets())[0] - 1), i(b, w[0]), i(b, K), i(b, N),
      flag(b, tr));
  b.replaceOp(op, out);
  return success();
}

#undef PATTERN

} // namespace

void tessel::populateGraphToRtPatterns(const TypeConverter &converter,
                                       RewritePatternSet &patterns) {
  MLIRContext *ctx = patterns.getContext();
  patterns.add<
      ParamOpLowering, InputOpLowering, FillOpLowering, AddOpLowering,
      MulOpLowering, ReduceSumOpLowering,
      UnaryLowering<GeluOp, rt::GeluForwardOp>,
      UnaryLowering<SiluOp, rt::SiluForwardOp>,
      UnaryGradLowering<GeluGradOp, rt::GeluBackwardOp>,
      UnaryGradLowering<SiluGradOp, rt::SiluBackwardOp>, MatmulOpLowering,
      LayerNormOpLowering, LayerNormGradOpLowering, RmsNormOpLowering,
      RmsNormGradOpLowering, RopeOpLowering, AttentionOpLowering,
      AttentionGradOpLowering, SoftmaxOpLowering, SoftmaxGradOpLowering,
      DropoutOpLowering, ZigzagOpLowering,
      CrossEntropyOpLowering, CrossEntropyGradOpLowering, EmbeddingOpLowering,
      EmbeddingGradOpLowering, ReshapeOpLowering, TransposeOpLowering,
      SplitOpLowering, ConcatOpLowering, GlobalNormOpLowering,
      AdamWOpLowering, KvCacheOpLowering, RopeAtOpLowering,
      CachedAttentionOpLowering, OutputOpLowering, MoeTopKOpLowering,
      MoeTopKGradOpLowering, MoeLoadStatsOpLowering, MoeKeptCountsOpLowering,
      MoeProbSumsGradOpLowering, MoeAuxLossOpLowering,
      MoeAuxLossGradOpLowering, MoeZLossOpLowering, MoeZLossGradOpLowering,
      MoeDispatchOpLowering, MoePermuteOpLowering, MoePermuteGradOpLowering,
      MoeUnpermuteOpLowering, MoeUnpermuteGradOpLowering,
      MoeExchangeOpLowering, MoeCombineOpLowering,
      GroupedMatmulOpLowering, GroupedMatmulWeightGradOpLowering>(converter,
                                                                   ctx);
}
