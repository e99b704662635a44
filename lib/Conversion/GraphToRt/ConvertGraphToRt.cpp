//===- ConvertGraphToRt.cpp - Bufferizing the per-rank program ------------===//

#include "tessel/Conversion/Passes.h"
#include "tessel/Conversion/ToRt.h"

#include "mlir/Dialect/Func/Transforms/FuncConversions.h"

namespace tessel {
#define GEN_PASS_DEF_CONVERTGRAPHTORT
#include "tessel/Conversion/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;

tessel::BufferTypeConverter::BufferTypeConverter() {
  addConversion([](Type type) { return type; });
  addConversion([](RankedTensorType type) -> Type {
    return MemRefType::get(type.getShape(), type.getElementType());
  });
  addConversion([](dist::RequestType type) -> Type {
    return rtir::RequestType::get(type.getContext());
  });
}

namespace {

struct ConvertGraphToRtPass
    : tessel::impl::ConvertGraphToRtBase<ConvertGraphToRtPass> {
  void runOnOperation() override {
    MLIRContext *ctx = &getContext();
    BufferTypeConverter converter;
    ConversionTarget target(*ctx);
    target.addLegalDialect<rtir::RtDialect>();
    target.addLegalOp<ModuleOp>();
    target.addLegalDialect<pipe::PipeDialect>(); // the schedule
    target.addIllegalDialect<graph::GraphDialect, dist::DistDialect>();
    auto typesLegal = [&](Operation *op) { return converter.isLegal(op); };
    target.addDynamicallyLegalOp<pipe::ForwardPassOp, pipe::BackwardPassOp,
                                 pipe::YieldOp, func::ReturnOp>(typesLegal);
    target.addDynamicallyLegalOp<pipe::UpdateOp>([&](pipe::UpdateOp op) {
      return converter.isLegal(op) &&
             converter.isLegal(&op.getBody());
    });
    target.addDynamicallyLegalOp<func::FuncOp>([&](func::FuncOp op) {
      return converter.isSignatureLegal(op.getFunctionType());
    });
    RewritePatternSet patterns(ctx);
    populateGraphToRtPatterns(converter, patterns);
    populateDistToRtPatterns(converter, patterns);
    populatePipeTypeConversionPatterns(converter, patterns);
    populateFunctionOpInterfaceTypeConversionPattern<func::FuncOp>(patterns,
                                                                   converter);
    populateReturnOpTypeConversionPattern(patterns, converter);
    if (failed(applyFullConversion(getOperation(), target,
                                   std::move(patterns))))
      signalPassFailure();
  }
};

} // namespace
