//===- TargetInfo.cpp - The CPU and CUDA backends -------------------------===//

#include "tessel/Conversion/RtToEmitC/TargetInfo.h"

#include "dialects/Rt/RtOps.h"

#include "mlir/Dialect/EmitC/IR/EmitC.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/BuiltinTypes.h"

#include <set>

using namespace mlir;
using namespace tessel;
namespace rt = tessel::rtir;

std::string TargetInfo::storageType(Type element) const {
  if (element.isF32())
    return "float";
  if (element.isF64())
    return "double";
  if (element.isBF16())
    return "bf16";
  return "int32_t";
}

namespace {

// The element type of a kernel's first floating buffer.
Type scalarOf(Operation *kernel) {
  for (Value v : kernel->getOperands())
    if (auto type = dyn_cast<MemRefType>(v.getType()))
      if (isa<FloatType>(type.getElementType()))
        return type.getElementType();
  return {};
}

class CpuTargetInfo : public TargetInfo {
public:
  std::vector<std::string> includes() const override {
    return {"tessel/Runtime/Comm.h", "tessel/Runtime/Kernels.h",
            "tessel/Runtime/Program.h", "tessel/Runtime/Trace.h",
            "tessel/Runtime/VocabParallel.h"};
  }
  std::vector<std::string> preludeLines() const override {
    return {"using namespace tessel::rt;"};
  }
  // The kernels of tessel/Runtime/Kernels.h deduce their scalar type (float
  // in programs, double in gradient checks) from the buffers; `fill` takes
  // its value as that type and names it.
  std::string kernelFunction(Operation *kernel) const override {
    std::string name =
        cast<rt::KernelCallOpInterface>(kernel).getFunction().str();
    if (isa<rt::FillOp>(kernel))
      return name + "<" + storageType(scalarOf(kernel)) + ">";
    return name;
  }
  std::string finishStepFunction() const override { return "finishStep"; }
  std::string recordMetricFunction() const override { return "recordMetric"; }
  bool keysByOrder() const override { return false; }
  std::string runMain() const override { return "runMain"; }

  // The pipeline sends' copies, in 64-byte aligned buffers the runtime
  // allocates at start (commReserveSends).
  DeviceInfo deviceInfo(ModuleOp program, ModuleOp) const override {
    DeviceInfo info;
    info.sends = rt::sendBuffersOf(program, 64);
    return info;
  }
  LogicalResult addDeviceSetup(const DeviceInfo &info, Value var,
                               OpBuilder &b) const override {
    if (info.sends.total() == 0)
      return success();
    for (auto [member, value] :
         {std::pair<const char *, int64_t>{"sendBytes", info.sends.otherBytes},
          {"sendRingSlots", info.sends.ringSlots},
          {"sendSlotBytes", info.sends.slotBytes}})
      b.create<emitc::VerbatimOp>(var.getLoc(),
                                  b.getStringAttr("{}." + std::string(member) +
                                                  " = " +
                                                  std::to_string(value) + ";"),
                                  ValueRange{var});
    return success();
  }
};

class CudaTargetInfo : public TargetInfo {
public:
  explicit CudaTargetInfo(int arch) : arch(arch) {}
  std::vector<std::string> includes() const override {
    return {"tessel/Runtime/Comm.h", "tessel/Runtime/Cuda/Device.h",
            "tessel/Runtime/Program.h", "tessel/Runtime/Trace.h", "algorithm",
            "cmath"};
  }
  std::vector<std::string> preludeLines() const override {
    return {"using namespace tessel::cuda;",
            "using tessel::MeshAxis;",
            "using tessel::rt::groupBlock;",
            "using tessel::rt::groupRank;",
            "using tessel::rt::InitKind;",
            "using tessel::rt::LrDecay;",
            "using tessel::rt::ParamInfo;",
            "using tessel::rt::Program;",
            "using tessel::rt::ProgramVariant;",
            "using tessel::rt::StepContext;",
            "using tessel::rt::TraceSpan;",
            "using tessel::rt::TrainConfig;"};
  }
  // CUDA kernels deduce their storage types from the pointers.
  std::string kernelFunction(Operation *kernel) const override {
    return cast<rt::KernelCallOpInterface>(kernel).getFunction().str();
  }
  std::vector<std::string> extraArguments(Operation *kernel) const override {
    if (usesScratch(kernel))
      return {"ctx.scratch"};
    return {};
  }
  std::string shadowType() const override { return "bf16"; }
  std::string finishStepFunction() const override {
    return "tessel::cuda::finishStep";
  }
  std::string recordMetricFunction() const override {
    return "tessel::cuda::recordMetric";
  }
  bool keysByOrder() const override { return true; }
  std::string runMain() const override { return "tessel::rt::runMain"; }
  std::string describe(const DeviceInfo &info) const override {
    return std::string("for CUDA (") +
           (info.bf16 ? "bf16 mixed precision" : "fp32") + ", sm_" +
           std::to_string(arch) + ")";
  }

  // The precision, the largest scratch any kernel needs, the axis sets of
  // the collectives (one NCCL communicator each) and every pipeline offset
  // any rank sends with (channels are created by all ranks together).
  DeviceInfo deviceInfo(ModuleOp program, ModuleOp top) const override {
    DeviceInfo info;
    std::set<unsigned> axes;
    MeshShape mesh = dist::meshOf(top);
    program.walk([&](Operation *op) {
      for (Type t : op->getResultTypes())
        if (auto type = dyn_cast<MemRefType>(t))
          info.bf16 |= type.getElementType().isBF16();
      if (auto comm = dyn_cast<rt::CommunicationOpInterface>(op)) {
        SmallVector<rt::CollectiveRecord> records;
        comm.describeCommunication(mesh, records);
        // Pipeline messages go over the channels below; a collective
        // matmul's steps (rt.shift_start, also send_recv) need their
        // group's communicator.
        for (const rt::CollectiveRecord &r : records)
          if (r.kind != "send_recv" || !isa<rt::SendOp, rt::RecvOp>(op))
            axes.insert(r.axes.bits());
      }
      if (usesScratch(op))
        info.scratch.push_back(scratchBytes(op, mesh));
      // What keeps the step from running as a CUDA graph: the host waits
      // for device data inside it (metrics, read after the step, do not).
      if (info.hostReadsInStep.empty() &&
          isa<rt::MoeExchangeOp, rt::MoeCombineOp>(op))
        info.hostReadsInStep =
            "the expert exchange reads its counts on the host";
      // The staging allGatherAlong / reduceScatterAlong ask for when the
      // gathered dimension is not the outermost: the gathered blocks, the
      // packed input, g x n elements of the piece's n.
      auto staged = [&](int64_t outer, Value piece, Value anyBuffer,
                        auto axes) {
        if (outer > 1)
          info.stagingBytes = std::max(
              info.stagingBytes, mesh.groupSize(axes) *
                                     rt::elementsOf(piece) *
                                     rt::elementBytesOf(anyBuffer));
      };
      if (auto a = dyn_cast<rt::AllGatherOp>(op))
        staged(a.getOuter(), a.getInput(), a.getInput(), a.getAxes());
      if (auto r = dyn_cast<rt::ReduceScatterOp>(op))
        staged(r.getOuter(), r.getOutput(), r.getInput(), r.getAxes());
    });
    // The pipeline sends' copies, in 256-byte aligned buffers.
    info.sends = rt::sendBuffersOf(program, 256);
    axes.erase(0);
    info.commAxes.assign(axes.begin(), axes.end());
    std::set<int64_t> offsets;
    top.walk([&](rt::SendOp send) { offsets.insert(send.getOffset()); });
    info.p2pOffsets.assign(offsets.begin(), offsets.end());
    if (auto recipe = top->getAttrOfType<DictionaryAttr>("graph.recipe"))
      if (auto offload = recipe.getAs<StringAttr>("offload"))
        info.offloadOptimizer = offload.getValue() == "optimizer";
    if (auto copies = program->getAttrOfType<ArrayAttr>("rt.master_copies"))
      for (Attribute a : copies)
        if (auto c = dyn_cast<DenseI64ArrayAttr>(a); c && c.size() == 4)
          info.masterCopies.push_back({c[0], c[1], c[2], c[3]});
    if (auto e = program->getAttrOfType<IntegerAttr>("rt.shadow_extra_elems"))
      info.shadowExtraElems = e.getInt();
    return info;
  }

  LogicalResult addDeviceSetup(const DeviceInfo &info, Value var,
                               OpBuilder &b) const override {
    Location loc = var.getLoc();
    std::vector<std::string> lines;
    std::string list;
    for (unsigned m : info.commAxes)
      list += (list.empty() ? "" : ", ") + std::to_string(m) + "u";
    lines.push_back("static const unsigned kCommAxes[] = {" +
                    (list.empty() ? std::string("0u") : list) + "};");
    lines.push_back("static tessel::cuda::DeviceProgram device{};");
    lines.push_back(std::string("device.bf16 = ") +
                    (info.bf16 ? "true" : "false") + ";");
    std::string bytes = "0";
    for (const std::string &e : info.scratch)
      bytes += ", " + e;
    lines.push_back("device.scratchBytes = std::max<int64_t>({" + bytes +
                    "});");
    lines.push_back("device.cudaArch = " + std::to_string(arch) + ";");
    lines.push_back("device.stagingBytes = " +
                    std::to_string(info.stagingBytes) + ";");
    lines.push_back(
        "device.sendBytes = " + std::to_string(info.sends.otherBytes) + ";");
    if (info.sends.ringSlots > 0) {
      lines.push_back("device.sendRingSlots = " +
                      std::to_string(info.sends.ringSlots) + ";");
      lines.push_back("device.sendSlotBytes = " +
                      std::to_string(info.sends.slotBytes) + ";");
    }
    if (info.offloadOptimizer)
      lines.push_back("device.offloadOptimizer = true;");
    if (!info.masterCopies.empty()) {
      std::string rows;
      for (const std::array<int64_t, 4> &c : info.masterCopies)
        rows += (rows.empty() ? "{" : ", {") + std::to_string(c[0]) + ", " +
                std::to_string(c[1]) + ", " + std::to_string(c[2]) + ", " +
                std::to_string(c[3]) + "}";
      lines.push_back("static const int64_t kMasterCopies[][4] = {" + rows +
                      "};");
      lines.push_back("device.masterCopies = kMasterCopies;");
      lines.push_back("device.numMasterCopies = " +
                      std::to_string(info.masterCopies.size()) + ";");
    }
    if (info.shadowExtraElems > 0)
      lines.push_back("device.shadowExtraElems = " +
                      std::to_string(info.shadowExtraElems) + ";");
    // A fixed text of the compiler's, never a name from the spec.
    if (!info.hostReadsInStep.empty())
      lines.push_back("device.hostReadsInStep = \"" + info.hostReadsInStep +
                      "\";");
    lines.push_back("device.commAxes = kCommAxes;");
    lines.push_back("device.numCommAxes = " +
                    std::to_string(info.commAxes.size()) + ";");
    if (!info.p2pOffsets.empty()) {
      std::string o;
      for (int64_t v : info.p2pOffsets)
        o += (o.empty() ? "" : ", ") + std::to_string(v);
      lines.push_back("static const int kP2POffsets[] = {" + o + "};");
      lines.push_back("device.p2pOffsets = kP2POffsets;");
      lines.push_back("device.numP2POffsets = " +
                      std::to_string(info.p2pOffsets.size()) + ";");
    }
    for (const std::string &line : lines)
      b.create<emitc::VerbatimOp>(loc, b.getStringAttr(line));
    b.create<emitc::VerbatimOp>(
        loc, b.getStringAttr("{}.device = deviceHooks(device);"),
        ValueRange{var});
    return success();
  }

private:
  // Kernels that take the device scratch: the attention backward
  // recomputes the forward there; the vocabulary-parallel loss keeps its
  // row statistics there; the MoE dispatch its counts per chunk of
  // assignments and, over a group, the gathered counts.
  static bool usesScratch(Operation *kernel) {
    return isa<rt::AttentionBackwardOp, rt::CrossEntropyVocabParallelForwardOp,
               rt::CrossEntropyVocabParallelBackwardOp, rt::MoeDispatchOp>(
        kernel);
  }

  // The bytes of scratch a kernel that uses it needs (a C++ expression).
  static std::string scratchBytes(Operation *kernel, const MeshShape &mesh) {
    if (auto a = dyn_cast<rt::AttentionBackwardOp>(kernel))
      return "attentionScratchBytes(" + std::to_string(a.getBatch()) + ", " +
             std::to_string(a.getSeq()) + ", " + std::to_string(a.getHeads()) +
             ", " + std::to_string(a.getKvHeads()) + ", " +
             std::to_string(a.getHeadDim()) + ", " +
             std::to_string(rt::elementBytesOf(a.getQ())) + ")";
    if (auto c = dyn_cast<rt::CrossEntropyVocabParallelForwardOp>(kernel))
      return "crossEntropyScratchBytes(" + std::to_string(c.getRows()) + ")";
    if (auto c = dyn_cast<rt::CrossEntropyVocabParallelBackwardOp>(kernel))
      return "crossEntropyScratchBytes(" + std::to_string(c.getRows()) + ")";
    auto d = cast<rt::MoeDispatchOp>(kernel);
    return "moeDispatchScratchBytes(" + std::to_string(d.getTokens()) + ", " +
           std::to_string(d.getRows()) + ", " + std::to_string(d.getTopK()) +
           ", " + std::to_string(d.getNumExperts()) + ", " +
           std::to_string(mesh.groupSize(d.getAxes())) + ")";
  }

  int arch;
};

} // namespace

std::unique_ptr<TargetInfo> tessel::makeTargetInfo(StringRef name,
                                                   int cudaArch) {
  if (name == "cpu")
    return std::make_unique<CpuTargetInfo>();
  if (name == "cuda")
    return std::make_unique<CudaTargetInfo>(cudaArch);
  return nullptr;
}
