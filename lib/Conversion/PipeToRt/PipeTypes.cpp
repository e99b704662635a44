//===- PipeTypes.cpp - pipe parts on buffers ------------------------------===//
//
// While the step is bufferized, the parts of a rank's program keep their
// structure: their results, the update's inputs and block arguments, and
// what they yield become buffers.
//
//===----------------------------------------------------------------------===//

#include "tessel/Conversion/Passes.h"
#include "tessel/Conversion/ToRt.h"

using namespace mlir;
using namespace tessel;

namespace {

template <typename PartOp>
struct PassTypes : OpConversionPattern<PartOp> {
  using OpConversionPattern<PartOp>::OpConversionPattern;
  LogicalResult
  matchAndRewrite(PartOp op, typename PartOp::Adaptor,
                  ConversionPatternRewriter &b) const override {
    SmallVector<Type> types;
    if (failed(this->getTypeConverter()->convertTypes(op.getResultTypes(),
                                                      types)))
      return failure();
    auto part = PartOp::create(b, op.getLoc(), types, op.getChunk());
    part->setAttrs(op->getAttrs());
    b.inlineRegionBefore(op.getBody(), part.getBody(), part.getBody().end());
    b.replaceOp(op, part.getResults());
    return success();
  }
};

struct UpdateTypes : OpConversionPattern<pipe::UpdateOp> {
  using OpConversionPattern::OpConversionPattern;
  LogicalResult
  matchAndRewrite(pipe::UpdateOp op, OpAdaptor a,
                  ConversionPatternRewriter &b) const override {
    SmallVector<Type> types;
    if (failed(getTypeConverter()->convertTypes(op.getResultTypes(), types)))
      return failure();
    auto update = pipe::UpdateOp::create(b, op.getLoc(), types, a.getInputs());
    b.inlineRegionBefore(op.getBody(), update.getBody(),
                         update.getBody().end());
    if (failed(b.convertRegionTypes(&update.getBody(), *getTypeConverter())))
      return failure();
    b.replaceOp(op, update.getResults());
    return success();
  }
};

struct YieldTypes : OpConversionPattern<pipe::YieldOp> {
  using OpConversionPattern::OpConversionPattern;
  LogicalResult
  matchAndRewrite(pipe::YieldOp op, OpAdaptor a,
                  ConversionPatternRewriter &b) const override {
    b.replaceOpWithNewOp<pipe::YieldOp>(op, a.getValues());
    return success();
  }
};

} // namespace

void tessel::populatePipeTypeConversionPatterns(const TypeConverter &converter,
                                                RewritePatternSet &patterns) {
  patterns.add<PassTypes<pipe::ForwardPassOp>, PassTypes<pipe::BackwardPassOp>,
               UpdateTypes, YieldTypes>(converter, patterns.getContext());
}
