//===- ToRt.h - Lowering the step to rt -------------------------*- C++ -*-===//
//
// The patterns that bufferize the per-rank program into rt: one set per
// source dialect, sharing one type converter (tensor -> memref, dist request
// -> rt request).
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_CONVERSION_TORT_H
#define TESSEL_CONVERSION_TORT_H

#include "mlir/Transforms/DialectConversion.h"

namespace tessel {

// Tensors become buffers of the same shape and element type.
class BufferTypeConverter : public mlir::TypeConverter {
public:
  BufferTypeConverter();
};

// graph ops -> rt kernels on fresh buffers (lib/Conversion/GraphToRt).
void populateGraphToRtPatterns(const mlir::TypeConverter &converter,
                               mlir::RewritePatternSet &patterns);
// dist ops -> rt communication (lib/Conversion/DistToRt).
void populateDistToRtPatterns(const mlir::TypeConverter &converter,
                              mlir::RewritePatternSet &patterns);
// pipe parts keep their structure with buffer types (lib/Conversion/PipeToRt).
void populatePipeTypeConversionPatterns(const mlir::TypeConverter &converter,
                                        mlir::RewritePatternSet &patterns);

} // namespace tessel

#endif // TESSEL_CONVERSION_TORT_H
