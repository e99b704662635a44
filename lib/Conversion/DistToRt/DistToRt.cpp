//===- DistToRt.cpp - dist ops as runtime communication calls ------------===//
//
// Collectives become the runtime's calls on buffers: a reduction works in
// place on its operand's buffer when nothing else reads the operand (else on
// a copy); gathers and scatters along a dimension see the tensor as
// [outer, length, inner]; local slices are copies of this rank's piece;
// pipeline transfers are keyed by their tag and the running microbatch.
//
//===----------------------------------------------------------------------===//

#include "tessel/Conversion/Passes.h"
#include "tessel/Conversion/ToRt.h"

using namespace mlir;
using namespace tessel;
namespace rt = tessel::rtir;

namespace {

ArrayRef<int64_t> shapeOf(Value v) {
  return cast<ShapedType>(v.getType()).getShape();
}
int64_t product(ArrayRef<int64_t> dims) {
  int64_t p = 1;
  for (int64_t d : dims)
    p *= d;
  return p;
}
// A dimension's extent and the element counts before and after it.
std::tuple<int64_t, int64_t, int64_t> around(Value v, int64_t dim) {
  auto shape = shapeOf(v);
  return {product(shape.take_front(dim)), shape[dim],
          product(shape.drop_front(dim + 1))};
}

Value alloc(ConversionPatternRewriter &b, const TypeConverter *converter,
            Location loc, Value result) {
  return rt::AllocOp::create(b, loc, converter->convertType(result.getType()));
}

// The buffers a reduction works on in place: an operand's own buffer when
// the reduction is its only reader and it is a working buffer, else a copy.
SmallVector<Value> reductionBuffers(Operation *op, ValueRange originals,
                                    ValueRange buffers,
                                    ConversionPatternRewriter &b,
                                    const TypeConverter *converter) {
  SmallVector<Value> result;
  for (auto [original, buffer] : llvm::zip(originals, buffers)) {
    // (A part's block argument is its own buffer: the update's inputs.)
    bool inPlace =
        original.hasOneUse() &&
        (isa<BlockArgument>(buffer) ||
         (buffer.getDefiningOp() && isa<rt::AllocOp>(buffer.getDefiningOp())));
    if (inPlace) {
      result.push_back(buffer);
      continue;
    }
    Value copy = alloc(b, converter, op->getLoc(), original);
    rt::CopyOp::create(b, op->getLoc(), buffer, copy,
                       b.getI64IntegerAttr(
                           cast<ShapedType>(original.getType()).getNumElements()));
    result.push_back(copy);
  }
  return result;
}

struct AllReduceLowering : OpConversionPattern<dist::AllReduceOp> {
  using OpConversionPattern::OpConversionPattern;
  LogicalResult
  matchAndRewrite(dist::AllReduceOp op, OpAdaptor a,
                  ConversionPatternRewriter &b) const override {
    SmallVector<Value> buffers = reductionBuffers(
        op, op.getInputs(), a.getInputs(), b, getTypeConverter());
    rt::AllReduceOp::create(b, op.getLoc(), buffers, op.getAxesAttr());
    b.replaceOp(op, buffers);
    return success();
  }
};

struct AllReduceStartLowering : OpConversionPattern<dist::AllReduceStartOp> {
  using OpConversionPattern::OpConversionPattern;
  LogicalResult
  matchAndRewrite(dist::AllReduceStartOp op, OpAdaptor a,
                  ConversionPatternRewriter &b) const override {
    SmallVector<Value> buffers = reductionBuffers(
        op, op.getInputs(), a.getInputs(), b, getTypeConverter());
    auto start = rt::AllReduceStartOp::create(
        b, op.getLoc(), rt::RequestType::get(getContext()), buffers,
        op.getAxesAttr(), IntegerAttr());
    SmallVector<Value> results(buffers);
    results.push_back(start.getRequest());
    b.replaceOp(op, results);
    return success();
  }
};

struct WaitLowering : OpConversionPattern<dist::WaitOp> {
  using OpConversionPattern::OpConversionPattern;
  LogicalResult
  matchAndRewrite(dist::WaitOp op, OpAdaptor a,
                  ConversionPatternRewriter &b) const override {
    b.replaceOpWithNewOp<rt::WaitOp>(op, a.getRequest());
    return success();
  }
};

struct AllGatherLowering : OpConversionPattern<dist::AllGatherOp> {
  using OpConversionPattern::OpConversionPattern;
  LogicalResult
  matchAndRewrite(dist::AllGatherOp op, OpAdaptor a,
                  ConversionPatternRewriter &b) const override {
    auto [outer, len, inner] = around(op.getInput(), op.getDim());
    Value out = alloc(b, getTypeConverter(), op.getLoc(), op);
    rt::AllGatherOp::create(b, op.getLoc(), a.getInput(), out,
                            b.getI64IntegerAttr(outer),
                            b.getI64IntegerAttr(len),
                            b.getI64IntegerAttr(inner), op.getAxesAttr());
    b.replaceOp(op, out);
    return success();
  }
};

struct ReduceScatterLowering : OpConversionPattern<dist::ReduceScatterOp> {
  using OpConversionPattern::OpConversionPattern;
  LogicalResult
  matchAndRewrite(dist::ReduceScatterOp op, OpAdaptor a,
                  ConversionPatternRewriter &b) const override {
    auto [outer, len, inner] = around(op.getResult(), op.getDim());
    Value out = alloc(b, getTypeConverter(), op.getLoc(), op);
    rt::ReduceScatterOp::create(b, op.getLoc(), a.getInput(), out,
                                b.getI64IntegerAttr(outer),
                                b.getI64IntegerAttr(len),
                                b.getI64IntegerAttr(inner), op.getAxesAttr());
    b.replaceOp(op, out);
    return success();
  }
};

// This rank's piece starts at groupRank(axes) * numerator / denominator.
rt::GroupOffsetAttr pieceStart(OpBuilder &b, dist::AxesAttr axes,
                               int64_t numerator, int64_t denominator) {
  return rt::GroupOffsetAttr::get(b.getContext(), axes, numerator,
                                  denominator);
}

struct LocalSliceLowering : OpConversionPattern<dist::LocalSliceOp> {
  using OpConversionPattern::OpConversionPattern;
  LogicalResult
  matchAndRewrite(dist::LocalSliceOp op, OpAdaptor a,
                  ConversionPatternRewriter &b) const override {
    auto [outer, whole, inner] = around(op.getInput(), op.getDim());
    Value out = alloc(b, getTypeConverter(), op.getLoc(), op);
    rt::SliceAxisOp::create(
        b, op.getLoc(), a.getInput(), out, b.getI64IntegerAttr(outer),
        b.getI64IntegerAttr(whole), b.getI64IntegerAttr(inner),
        pieceStart(b, op.getAxesAttr(), op.getNumerator(),
                   op.getDenominator()),
        b.getI64IntegerAttr(shapeOf(op)[op.getDim()]));
    b.replaceOp(op, out);
    return success();
  }
};

struct LocalInsertLowering : OpConversionPattern<dist::LocalInsertOp> {
  using OpConversionPattern::OpConversionPattern;
  LogicalResult
  matchAndRewrite(dist::LocalInsertOp op, OpAdaptor a,
                  ConversionPatternRewriter &b) const override {
    auto [outer, whole, inner] = around(op.getResult(), op.getDim());
    Value out = alloc(b, getTypeConverter(), op.getLoc(), op);
    rt::FillOp::create(b, op.getLoc(), out,
                       b.getI64IntegerAttr(outer * whole * inner),
                       b.getF64FloatAttr(0.0));
    rt::InsertAxisOp::create(
        b, op.getLoc(), a.getInput(), out, b.getI64IntegerAttr(outer),
        b.getI64IntegerAttr(whole), b.getI64IntegerAttr(inner),
        pieceStart(b, op.getAxesAttr(), op.getNumerator(),
                   op.getDenominator()),
        b.getI64IntegerAttr(shapeOf(op.getInput())[op.getDim()]));
    b.replaceOp(op, out);
    return success();
  }
};

struct SendLowering : OpConversionPattern<dist::SendOp> {
  using OpConversionPattern::OpConversionPattern;
  LogicalResult
  matchAndRewrite(dist::SendOp op, OpAdaptor a,
                  ConversionPatternRewriter &b) const override {
    Value mb = rt::MicrobatchOp::create(b, op.getLoc(), b.getI64Type());
    b.replaceOpWithNewOp<rt::SendOp>(op, a.getInput(), mb, op.getOffsetAttr(),
                                     op.getTagAttr(), DenseI64ArrayAttr(),
                                     DenseI64ArrayAttr());
    return success();
  }
};

struct RecvLowering : OpConversionPattern<dist::RecvOp> {
  using OpConversionPattern::OpConversionPattern;
  LogicalResult
  matchAndRewrite(dist::RecvOp op, OpAdaptor,
                  ConversionPatternRewriter &b) const override {
    Value out = alloc(b, getTypeConverter(), op.getLoc(), op);
    Value mb = rt::MicrobatchOp::create(b, op.getLoc(), b.getI64Type());
    rt::RecvOp::create(b, op.getLoc(), out, mb, op.getOffsetAttr(),
                       op.getTagAttr());
    b.replaceOp(op, out);
    return success();
  }
};

} // namespace

void tessel::populateDistToRtPatterns(const TypeConverter &converter,
                                      RewritePatternSet &patterns) {
  patterns.add<AllReduceLowering, AllReduceStartLowering, WaitLowering,
               AllGatherLowering, ReduceScatterLowering, LocalSliceLowering,
               LocalInsertLowering, SendLowering, RecvLowering>(
      converter, patterns.getContext());
}
