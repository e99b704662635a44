//===- InitAllPasses.h - Every pass and pipeline of Tessel ------*- C++ -*-===//
#ifndef TESSEL_INITALLPASSES_H
#define TESSEL_INITALLPASSES_H

#include "tessel/Conversion/Passes.h"
#include "tessel/Pipelines/TrainPipeline.h"
#include "tessel/Transforms/Passes.h"

namespace tessel {

inline void registerAllPasses() {
  registerTesselPasses();
  registerTesselConversionPasses();
  registerTrainPipeline();
}

} // namespace tessel

#endif // TESSEL_INITALLPASSES_H
