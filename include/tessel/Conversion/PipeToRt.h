//===- PipeToRt.h - A rank's parts as scheduled functions -------*- C++ -*-===//
#ifndef TESSEL_CONVERSION_PIPETORT_H
#define TESSEL_CONVERSION_PIPETORT_H

#include "mlir/IR/PatternMatch.h"

#include <string>

namespace tessel {

// Each planned rank program (a function with pipe.rank) becomes a module of
// its own with a function per part and a train_step calling them in the
// rank's schedule order (lib/Conversion/PipeToRt).
void populatePipeToRtPatterns(mlir::RewritePatternSet &patterns);

// The name of a distinct program: program0 without pipeline stages, else
// stageN for pipeline rank N.
std::string programName(int64_t pipelineRank, int64_t pipelineRanks);

} // namespace tessel

#endif // TESSEL_CONVERSION_PIPETORT_H
