//===- EmitCpp.h - Planned graph IR to a C++ rank program --------*- C++
//-*-===//
#ifndef TESSEL_EMISSION_EMITCPP_H
#define TESSEL_EMISSION_EMITCPP_H

#include "tessel/Frontend/Spec.h"
#include "tessel/Support/MeshLayout.h"

#include "mlir/IR/BuiltinOps.h"
#include "llvm/Support/raw_ostream.h"

#include <map>
#include <string>
#include <vector>

namespace tessel {

// One collective call of the emitted step, as the runtime will count it.
struct CollectiveCall {
  std::string kind; // all_reduce, all_gather, reduce_scatter
  AxisSet axes;
  int64_t groupSize;
  int64_t elements; // as counted by the runtime (see Comm.h)
  int64_t elementBytes;
  int64_t bytesSent; // textbook volume (CommVolume.h)
  std::string what;  // the op it implements
};

// Writes the C++ source of one rank program: `@train_step` of `module` (after
// tessel-plan-buffers) as a straight-line sequence of runtime kernel calls,
// the parameter table, the training recipe of `spec`, and a `main` that hands
// them to tessel::rt::runMain.
// One step of a pipeline stage's schedule.
struct ScheduledStep {
  bool backward;
  int microbatch;
  int chunk = 0; // which of the rank's stages (interleaved schedules)
};

// `calls`, when given, receives every collective call of one step in order.
// `funcName` is the planned function to emit (`train_step`, or `stage_N`
// with that stage's `schedule` of forward and backward steps).
mlir::LogicalResult
emitCpuProgram(mlir::ModuleOp module, const Spec &spec, llvm::raw_ostream &os,
               std::vector<CollectiveCall> *calls = nullptr,
               llvm::StringRef funcName = "train_step",
               const std::vector<ScheduledStep> *schedule = nullptr);

// Pipeline messages: per tag, per microbatch, the message's place among
// everything its sender sends to that receiver in a step, counted in the
// order the receiver takes them.
using SendOrders = std::map<int64_t, std::vector<int64_t>>;

// NCCL matches point-to-point messages between two ranks in the order they
// are issued, without tags. Replays every stage's schedule (`schedules[r]`
// is the steps of @stage_r) and returns the receive order of every message,
// which CUDA programs issue their sends in; fails, naming the stages, when
// sends and receives do not pair up.
llvm::Expected<SendOrders>
pipelineSendOrders(mlir::ModuleOp module,
                   const std::vector<std::vector<ScheduledStep>> &schedules);

// The CUDA target: storage precision, the GPU architecture (sm_<arch>) and,
// for pipelines, the order of the messages.
struct CudaTarget {
  bool bf16 = true;
  int arch = 90;
  SendOrders sendOrders;
};

// Writes the CUDA C++ source of one rank program: the same step as
// emitCpuProgram, as calls into libtessel_cuda_rt (cuBLASLt GEMMs, fused
// kernels, NCCL collectives) on device buffers. In bf16 programs
// activations are bf16 and matmuls read a bf16 shadow of the fp32 master
// weights; gradients of parameters, losses and norms stay fp32.
mlir::LogicalResult
emitCudaProgram(mlir::ModuleOp module, const Spec &spec, llvm::raw_ostream &os,
                const CudaTarget &target,
                std::vector<CollectiveCall> *calls = nullptr,
                llvm::StringRef funcName = "train_step",
                const std::vector<ScheduledStep> *schedule = nullptr);

// Writes a standalone float64 program that runs the planned step without the
// optimizer on random parameters and tokens, and compares the gradient of
// every parameter (sampled entries) with central finite differences of the
// loss. It exits non-zero when the worst relative error exceeds 1e-5.
mlir::LogicalResult emitGradientCheckProgram(mlir::ModuleOp module,
                                             llvm::raw_ostream &os);

// Compiles `sourcePath` into `binaryPath` with the system C++ compiler against
// libtessel_rt. Binaries are cached by the hash of source and flags, so an
// identical program is compiled once. Returns an error with the compiler's
// output on failure.
llvm::Error buildCpuProgram(llvm::StringRef sourcePath,
                            llvm::StringRef binaryPath, bool verbose);

// Fails, saying how to fix it, when this build has no CUDA runtime (nvcc
// was not found when Tessel was built).
llvm::Error checkCudaTarget();
// Compiles a generated CUDA program with nvcc for sm_<arch> against
// libtessel_cuda_rt, cuBLASLt, NCCL and libtessel_rt; cached like CPU
// programs. No GPU is needed to build.
llvm::Error buildCudaProgram(llvm::StringRef sourcePath,
                             llvm::StringRef binaryPath, int arch,
                             bool verbose);

} // namespace tessel

#endif // TESSEL_EMISSION_EMITCPP_H
