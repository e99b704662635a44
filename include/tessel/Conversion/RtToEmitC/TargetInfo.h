//===- TargetInfo.h - What differs between the backends ---------*- C++ -*-===//
//
// The rt -> emitc conversion is one set of patterns for every backend; what
// differs between the CPU program (libtessel_rt: OpenBLAS, MPI) and the CUDA
// program (libtessel_cuda_rt: cuBLASLt, NCCL) is answered here, in the
// spirit of Triton's TargetInfoBase: the runtime's headers and namespace,
// how a kernel is named, the C++ type of stored elements, extra arguments
// (device scratch), how pipeline messages are keyed, and the device set-up
// a program's main adds.
//
//===----------------------------------------------------------------------===//
#ifndef TESSEL_CONVERSION_RTTOEMITC_TARGETINFO_H
#define TESSEL_CONVERSION_RTTOEMITC_TARGETINFO_H

#include "dialects/Rt/RtOps.h"

#include "mlir/IR/Builders.h"
#include "mlir/IR/BuiltinOps.h"
#include "llvm/ADT/StringRef.h"

#include <array>
#include <memory>
#include <string>
#include <vector>

namespace tessel {

class TargetInfo {
public:
  virtual ~TargetInfo() = default;

  // What the generated source includes (a name without '/' is a system
  // header) and the declarations that name the runtime.
  virtual std::vector<std::string> includes() const = 0;
  virtual std::vector<std::string> preludeLines() const = 0;

  // The C++ function a kernel op calls.
  virtual std::string kernelFunction(mlir::Operation *kernel) const = 0;
  // Arguments a kernel takes on this target after the common ones (CUDA:
  // the device scratch of attention backward and vocabulary-parallel loss).
  virtual std::vector<std::string> extraArguments(mlir::Operation *) const {
    return {};
  }
  // The C++ type an element type is stored as.
  virtual std::string storageType(mlir::Type element) const;
  // The element type of the low-precision parameter copy.
  virtual std::string shadowType() const { return "float"; }
  // The call that hands the loss and norm to the runtime.
  virtual std::string finishStepFunction() const = 0;
  // Records one of the step's observations (rt.record_metric):
  // (ctx, "name", buffer, elements).
  virtual std::string recordMetricFunction() const = 0;

  // How a pipeline message is keyed: CPU: an MPI tag (the op's tag times
  // the microbatches plus the microbatch); CUDA: a send's place in the
  // receiver's order (NCCL matches in order).
  virtual bool keysByOrder() const = 0;

  // What main() tells the device about a program, read from its rt ops
  // before they are converted: its precision, the kernels' scratch, the
  // axis sets of its collectives and every pipeline offset of the job.
  struct DeviceInfo {
    bool bf16 = false;
    std::vector<std::string> scratch; // byte-count expressions
    std::vector<unsigned> commAxes;   // AxisSet bits
    std::vector<int64_t> p2pOffsets;
    // Buffers sized at start rather than inside a step: the largest
    // all_gather / reduce_scatter staging along a dimension (a device's),
    // and the pipeline sends' copies as the target's runtime aligns them
    // (rtir::sendBuffersOf: 256 bytes on a device, 64 on the CPU).
    int64_t stagingBytes = 0;
    tessel::rtir::SendBuffers sends;
    // parallel.offload = "optimizer": AdamW's moments in pinned host memory.
    bool offloadOptimizer = false;
    // Empty when the training step can be captured as a CUDA graph, else
    // what in it reads device data on the host.
    std::string hostReadsInStep;
    // ZeRO-1/2 in bf16: the runs whose master weights are pieces only
    // ({piece offset, copy offset, elements, group axes}, from the
    // program's rt.master_copies).
    std::vector<std::array<int64_t, 4>> masterCopies;
    // The bf16 copy's elements past the parameter store's (those runs'
    // copies; ZeRO-3's slots of the runs gathered in bf16).
    int64_t shadowExtraElems = 0;
  };
  virtual DeviceInfo deviceInfo(mlir::ModuleOp program,
                                mlir::ModuleOp top) const {
    return {};
  }
  // What main() adds to the Program `programVar` (an lvalue) before it runs
  // it: the device description of a CUDA program, the send buffers of a
  // CPU one.
  virtual mlir::LogicalResult addDeviceSetup(const DeviceInfo &info,
                                             mlir::Value programVar,
                                             mlir::OpBuilder &b) const {
    return mlir::success();
  }
  // What the source's first line adds about the target (e.g. "for CUDA
  // (bf16 mixed precision, sm_90)").
  virtual std::string describe(const DeviceInfo &info) const { return ""; }
  // The function main() returns through.
  virtual std::string runMain() const = 0;
};

// "cpu" or "cuda" (built for sm_`cudaArch`); null otherwise.
std::unique_ptr<TargetInfo> makeTargetInfo(llvm::StringRef name,
                                           int cudaArch = 90);

} // namespace tessel

#endif // TESSEL_CONVERSION_RTTOEMITC_TARGETINFO_H
