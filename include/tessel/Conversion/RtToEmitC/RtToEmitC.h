//===- RtToEmitC.h - Per-rank programs as emitc -----------------*- C++ -*-===//
#ifndef TESSEL_CONVERSION_RTTOEMITC_RTTOEMITC_H
#define TESSEL_CONVERSION_RTTOEMITC_RTTOEMITC_H

#include "tessel/Conversion/RtToEmitC/TargetInfo.h"

#include "mlir/IR/BuiltinOps.h"
#include "mlir/Transforms/DialectConversion.h"

#include <string>

namespace tessel {

// Buffers become pointers to their element type; requests CommRequest.
class EmitCTypeConverter : public mlir::TypeConverter {
public:
  EmitCTypeConverter();
};

// rt ops inside step functions -> emitc calls (lib/Conversion/RtToEmitC).
void populateRtToEmitCPatterns(const mlir::TypeConverter &converter,
                               mlir::RewritePatternSet &patterns,
                               const TargetInfo &target);

// One planned rank program (a module after convert-pipe-to-rt) -> the emitc
// module of its source file; `top` holds the mesh and the training recipe,
// `device` what TargetInfo::deviceInfo read from the programs before any was
// converted. A gradient check has no optimizer step and a main() that
// checks the gradients (gradientCheckMain).
mlir::LogicalResult
convertProgramToEmitC(mlir::ModuleOp program, mlir::ModuleOp top,
                      const TargetInfo &target,
                      const TargetInfo::DeviceInfo &device,
                      bool gradientCheck = false);

// `text` as a C++ string literal, and as text safe in a // comment.
std::string cppStringLiteral(llvm::StringRef text);
std::string cppComment(llvm::StringRef text);

} // namespace tessel

#endif // TESSEL_CONVERSION_RTTOEMITC_RTTOEMITC_H
