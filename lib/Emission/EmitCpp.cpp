//===- EmitCpp.cpp - Planned graph IR to a C++ rank program ---------------===//
//
// Each op of the planned @train_step becomes one call into libtessel_rt with
// every size a constant; buffers are the offsets that tessel-plan-buffers
// chose. The output is meant to be read: each call is preceded by the op it
// implements.
//
//===----------------------------------------------------------------------===//

#include "tessel/Emission/EmitCpp.h"
#include "tessel/Conversion/RtToEmitC/RtToEmitC.h"

#include "dialects/Dist/DistOps.h"
#include "dialects/Graph/GraphOps.h"
#include "dialects/Pipe/PipeOps.h"
#include "tessel/Runtime/CommVolume.h"
#include "tessel/Transforms/BufferPlan.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "llvm/ADT/StringExtras.h"
#include "llvm/ADT/TypeSwitch.h"
#include "llvm/Support/Format.h"

#include <map>
#include <set>

using namespace mlir;
using namespace tessel;
using namespace tessel::graph;
using tessel::AxisSet;
using tessel::MeshAxis;
using tessel::MeshShape;

namespace {

ArrayRef<int64_t> shapeOf(Value v) {
  return cast<RankedTensorType>(v.getType()).getShape();
}
int64_t numel(Value v) {
  return cast<RankedTensorType>(v.getType()).getNumElements();
}
int64_t product(ArrayRef<int64_t> dims) {
  int64_t p = 1;
  for (int64_t d : dims)
    p *= d;
  return p;
}
std::string num(double v) {
  std::string s;
  llvm::raw_string_ostream(s) << llvm::format("%.17g", v);
  return s;
}
std::string flt(double v) { return "static_cast<float>(" + num(v) + ")"; }
std::string scalar(double v) { return "static_cast<T>(" + num(v) + ")"; }
std::string boolStr(bool b) { return b ? "true" : "false"; }

// Prints the step as calls on scalar type T. Arena offsets were planned for
// 4-byte elements; `arenaScale` stretches them for wider scalars (double in
// gradient checks), which keeps every planned non-overlap.
class ProgramEmitter {
public:
  ProgramEmitter(raw_ostream &os, int arenaScale = 1, bool withOptimizer = true,
                 MeshShape mesh = {},
                 std::vector<CollectiveCall> *calls = nullptr)
      : os(os), arenaScale(arenaScale), withOptimizer(withOptimizer),
        mesh(mesh), calls(calls) {}

  // CUDA programs: calls go to tessel::cuda (types deduced from the
  // pointers), scalars stay on the device.
  bool cuda = false;
  // bf16 storage of activations; `fp32Values` lists the arena values that
  // stay fp32 (gradients of parameters, losses, norms).
  bool lowPrecision = false;
  const llvm::DenseSet<Value> *fp32Values = nullptr;
  // Expressions for the device scratch the ops need, each once (the largest
  // is allocated at start).
  std::set<std::string> scratch;

  void record(const char *kind, unsigned axes, int64_t elements,
              int64_t bytesSent, Operation *op, int64_t elementBytes = 4) {
    commAxes.insert(axes);
    if (!calls)
      return;
    std::string what = op->getName().getStringRef().str();
    if (auto loc = dyn_cast<NameLoc>(op->getLoc()))
      what += " @ " + loc.getName().getValue().str();
    for (int64_t k = 0; k < repeat; ++k)
      calls->push_back({kind, AxisSet::fromBits(axes), groupSize(axes),
                        elements, elementBytes, bytesSent, what});
  }

  // The C++ expression for the storage of `v`.
  std::string ptr(Value v) {
    BufferRef ref = bufferOf(v);
    switch (ref.space) {
    case BufferSpace::Param:
      return "(P + " + std::to_string(ref.offset) + ")";
    case BufferSpace::Grad:
      return "(G + " + std::to_string(ref.offset) + ")";
    case BufferSpace::Input:
      return ref.offset == 0 ? "tokens" : "targets";
    case BufferSpace::Arena:
      return "reinterpret_cast<" + storageType(v) + " *>(A + " +
             std::to_string(ref.offset * arenaScale) + ")";
    }
    return "";
  }

  // The element type `v` is stored in (arena values; T on the CPU).
  std::string storageType(Value v) const {
    if (!cuda)
      return "T";
    if (bufferOf(v).space != BufferSpace::Arena)
      return "float";
    if (!cast<RankedTensorType>(v.getType()).getElementType().isF32())
      return "int32_t";
    if (lowPrecision && !fp32Values->contains(v))
      return "bf16";
    return "float";
  }
  // fp32 storage (T is float in CPU programs).
  bool isFloat(Value v) const {
    std::string type = storageType(v);
    return type == "float" || type == "T";
  }
  int64_t elementBytes(Value v) const {
    BufferRef ref = bufferOf(v);
    if (lowPrecision && ref.space == BufferSpace::Param)
      return 2; // sent and multiplied through the bf16 shadow
    return ref.space == BufferSpace::Arena && storageType(v) == "bf16" ? 2 : 4;
  }

  // Microbatch loss accumulation: on the host for CPU programs, in a device
  // scalar (LS) for CUDA programs.
  void addLoss(Value loss, const std::string &first) {
    if (cuda)
      os << "  scalarAccumulate(" << ptr(loss) << ", LS, " << first << ");\n";
    else
      os << "  lossSum += " << ptr(loss) << "[0];\n";
  }
  void storeLoss(Value loss) {
    if (cuda)
      os << "  copy(LS, " << ptr(loss) << ", 1);\n";
    else
      os << "  " << ptr(loss) << "[0] = static_cast<T>(lossSum);\n";
  }

  // The element type a matmul reads `v` as (lowPtr's).
  std::string operandType(Value v) const {
    BufferRef ref = bufferOf(v);
    if (ref.space == BufferSpace::Param)
      return lowPrecision ? "bf16" : "float";
    return storageType(v);
  }
  // cuBLASLt multiplies two operands of one type, and fp32 operands give an
  // fp32 result: anything else would only fail when the program runs.
  bool gemmTypesOk(Value a, Value b, Value c) const {
    std::string ta = operandType(a), tb = operandType(b), tc = storageType(c);
    return !cuda || (ta == tb && (ta == "bf16" || tc == "float"));
  }
  LogicalResult checkGemmTypes(Operation *op, Value a, Value b, Value c) {
    if (gemmTypesOk(a, b, c))
      return success();
    std::string ta = operandType(a), tb = operandType(b), tc = storageType(c);
    return op->emitOpError("has operands stored as ")
           << ta << " and " << tb << " and a result stored as " << tc
           << ", which cuBLASLt cannot multiply";
  }

  // A matmul operand or a sent value: in bf16 programs parameters are read
  // through their bf16 shadow copy.
  std::string lowPtr(Value v) {
    BufferRef ref = bufferOf(v);
    if (lowPrecision && ref.space == BufferSpace::Param)
      return "(PB + " + std::to_string(ref.offset) + ")";
    return ptr(v);
  }

  void call(std::string fn, ArrayRef<std::string> args) {
    // CUDA kernels deduce their storage types from the pointers.
    if (cuda && StringRef(fn).ends_with("<T>"))
      fn.resize(fn.size() - 3);
    os << "  " << fn << "(";
    for (auto [i, a] : llvm::enumerate(args))
      os << (i ? ", " : "") << a;
    os << ");\n";
  }
  static std::string i(int64_t v) { return std::to_string(v); }

  LogicalResult emitOp(Operation *op) {
    if (fused.contains(op))
      return success(); // emitted with the op before it
    os << "  // " << op->getName().getStringRef();
    if (auto loc = dyn_cast<NameLoc>(op->getLoc()))
      os << " @ " << loc.getName().getValue().substr(0, 80);
    os << "\n";
    if (cuda && emitFused(op))
      return success();
    return llvm::TypeSwitch<Operation *, LogicalResult>(op)
        .Case<ParamOp, InputOp, ReshapeOp>([&](Operation *) {
          return success(); // storage only; reshapes alias their input
        })
        .Case<FillOp>([&](FillOp f) {
          call("fill<T>",
               {ptr(f), i(numel(f)), scalar(f.getValue().convertToDouble())});
          return success();
        })
        .Case<EmbeddingOp>([&](EmbeddingOp e) {
          auto t = shapeOf(e.getTable());
          if (unsigned v = vocabAxes(e)) {
            call("embeddingForwardRange",
                 {ptr(e.getTable()), ptr(e.getIds()), ptr(e),
                  i(numel(e.getIds())), vocabStart(v, t[0]), i(t[0]), i(t[1])});
            return success();
          }
          call("embeddingForward<T>",
               {ptr(e.getTable()), ptr(e.getIds()), ptr(e),
                i(numel(e.getIds())), i(t[0]), i(t[1])});
          return success();
        })
        .Case<EmbeddingGradOp>([&](EmbeddingGradOp e) {
          auto t = shapeOf(e.getResult());
          if (unsigned v = vocabAxes(e)) {
            call("embeddingBackwardRange",
                 {ptr(e.getIds()), ptr(e.getGrad()), ptr(e),
                  i(numel(e.getIds())), vocabStart(v, t[0]), i(t[0]), i(t[1])});
            return success();
          }
          call("embeddingBackward<T>",
               {ptr(e.getIds()), ptr(e.getGrad()), ptr(e), i(numel(e.getIds())),
                i(t[0]), i(t[1])});
          return success();
        })
        .Case<MatmulOp>([&](MatmulOp m) { return emitMatmul(m); })
        .Case<AddOp>([&](AddOp a) {
          call("addBroadcast<T>", {ptr(a.getLhs()), ptr(a.getRhs()), ptr(a),
                                   i(numel(a.getLhs())), i(numel(a.getRhs()))});
          return success();
        })
        .Case<MulOp>([&](MulOp a) {
          call("mulBroadcast<T>", {ptr(a.getLhs()), ptr(a.getRhs()), ptr(a),
                                   i(numel(a.getLhs())), i(numel(a.getRhs()))});
          return success();
        })
        .Case<ReduceSumOp>([&](ReduceSumOp r) {
          int64_t cols = numel(r);
          call("reduceSumLeading<T>", {ptr(r.getInput()), ptr(r),
                                       i(numel(r.getInput()) / cols), i(cols)});
          return success();
        })
        .Case<GeluOp>([&](GeluOp g) {
          call("geluForward<T>", {ptr(g.getInput()), ptr(g), i(numel(g))});
          return success();
        })
        .Case<GeluGradOp>([&](GeluGradOp g) {
          call("geluBackward<T>",
               {ptr(g.getInput()), ptr(g.getGrad()), ptr(g), i(numel(g))});
          return success();
        })
        .Case<SiluOp>([&](SiluOp g) {
          call("siluForward<T>", {ptr(g.getInput()), ptr(g), i(numel(g))});
          return success();
        })
        .Case<SiluGradOp>([&](SiluGradOp g) {
          call("siluBackward<T>",
               {ptr(g.getInput()), ptr(g.getGrad()), ptr(g), i(numel(g))});
          return success();
        })
        .Case<LayerNormOp>([&](LayerNormOp n) {
          int64_t C = shapeOf(n).back();
          call("layerNormForward<T>",
               {ptr(n.getInput()), ptr(n.getWeight()), ptr(n.getBias()), ptr(n),
                i(numel(n) / C), i(C), num(n.getEpsilon().convertToDouble())});
          return success();
        })
        .Case<LayerNormGradOp>([&](LayerNormGradOp n) {
          int64_t C = shapeOf(n.getInput()).back();
          call("layerNormBackward<T>",
               {ptr(n.getInput()), ptr(n.getWeight()), ptr(n.getGrad()),
                ptr(n.getInputGrad()), ptr(n.getWeightGrad()),
                ptr(n.getBiasGrad()), i(numel(n.getInput()) / C), i(C),
                num(n.getEpsilon().convertToDouble())});
          return success();
        })
        .Case<RmsNormOp>([&](RmsNormOp n) {
          int64_t C = shapeOf(n).back();
          call("rmsNormForward<T>",
               {ptr(n.getInput()), ptr(n.getWeight()), ptr(n), i(numel(n) / C),
                i(C), num(n.getEpsilon().convertToDouble())});
          return success();
        })
        .Case<RmsNormGradOp>([&](RmsNormGradOp n) {
          int64_t C = shapeOf(n.getInput()).back();
          call("rmsNormBackward<T>",
               {ptr(n.getInput()), ptr(n.getWeight()), ptr(n.getGrad()),
                ptr(n.getInputGrad()), ptr(n.getWeightGrad()),
                i(numel(n.getInput()) / C), i(C),
                num(n.getEpsilon().convertToDouble())});
          return success();
        })
        .Case<RopeOp>([&](RopeOp r) {
          auto s = shapeOf(r);
          call("rope<T>",
               {ptr(r.getInput()), ptr(r), i(s[0]), i(s[1]), i(s[2]), i(s[3]),
                num(r.getTheta().convertToDouble()), boolStr(r.getInverse())});
          return success();
        })
        .Case<AttentionOp>([&](AttentionOp a) {
          auto q = shapeOf(a.getQuery());
          call("attentionForward<T>",
               {ptr(a.getQuery()), ptr(a.getKey()), ptr(a.getValue()), ptr(a),
                i(q[0]), i(q[1]), i(q[2]), i(shapeOf(a.getKey())[2]), i(q[3]),
                boolStr(a.getCausal())});
          return success();
        })
        .Case<AttentionGradOp>([&](AttentionGradOp a) {
          auto q = shapeOf(a.getQuery());
          SmallVector<std::string> args = {ptr(a.getQuery()),
                                           ptr(a.getKey()),
                                           ptr(a.getValue()),
                                           ptr(a.getGrad()),
                                           ptr(a.getQueryGrad()),
                                           ptr(a.getKeyGrad()),
                                           ptr(a.getValueGrad()),
                                           i(q[0]),
                                           i(q[1]),
                                           i(q[2]),
                                           i(shapeOf(a.getKey())[2]),
                                           i(q[3]),
                                           boolStr(a.getCausal())};
          if (cuda)
            args.push_back("S");
          call("attentionBackward<T>", args);
          if (cuda) {
            // The backward recomputes the forward into device scratch.
            scratch.insert("attentionScratchBytes(" + i(q[0]) + ", " + i(q[1]) +
                           ", " + i(q[2]) + ", " + i(shapeOf(a.getKey())[2]) +
                           ", " + i(q[3]) + ", " +
                           (isFloat(a.getQuery()) ? "4" : "2") + ")");
          }
          return success();
        })
        .Case<SoftmaxOp>([&](SoftmaxOp s) {
          int64_t cols = shapeOf(s).back();
          call("softmaxForward<T>",
               {ptr(s.getInput()), ptr(s), i(numel(s) / cols), i(cols)});
          return success();
        })
        .Case<SoftmaxGradOp>([&](SoftmaxGradOp s) {
          int64_t cols = shapeOf(s).back();
          call("softmaxBackward<T>", {ptr(s.getOutput()), ptr(s.getGrad()),
                                      ptr(s), i(numel(s) / cols), i(cols)});
          return success();
        })
        .Case<CrossEntropyOp>([&](CrossEntropyOp c) {
          int64_t V = shapeOf(c.getLogits()).back();
          if (unsigned v = vocabAxes(c)) {
            int64_t rows = numel(c.getTargets());
            SmallVector<std::string> args = {ptr(c.getLogits()),
                                             ptr(c.getTargets()),
                                             ptr(c),
                                             i(rows),
                                             i(V),
                                             vocabStart(v, V),
                                             mask(v)};
            if (cuda) {
              args.push_back("S");
              scratch.insert("crossEntropyScratchBytes(" + i(rows) + ")");
            }
            call("crossEntropyVocabParallelForward", args);
            int64_t g = groupSize(v);
            record("all_reduce", v, rows, rt::allReduceBytesSent(rows, g), c);
            record("all_reduce", v, 2 * rows,
                   rt::allReduceBytesSent(2 * rows, g), c);
            return success();
          }
          call("crossEntropyForward<T>",
               {ptr(c.getLogits()), ptr(c.getTargets()), ptr(c),
                i(numel(c.getTargets())), i(V)});
          return success();
        })
        .Case<CrossEntropyGradOp>([&](CrossEntropyGradOp c) {
          int64_t V = shapeOf(c.getLogits()).back();
          if (unsigned v = vocabAxes(c)) {
            int64_t rows = numel(c.getTargets());
            SmallVector<std::string> args = {ptr(c.getLogits()),
                                             ptr(c.getTargets()),
                                             ptr(c.getGrad()),
                                             ptr(c),
                                             i(rows),
                                             i(V),
                                             vocabStart(v, V),
                                             mask(v)};
            if (cuda) {
              args.push_back("S");
              scratch.insert("crossEntropyScratchBytes(" + i(rows) + ")");
            }
            call("crossEntropyVocabParallelBackward", args);
            int64_t g = groupSize(v);
            for (int k = 0; k < 2; ++k)
              record("all_reduce", v, rows, rt::allReduceBytesSent(rows, g), c);
            return success();
          }
          call("crossEntropyBackward<T>",
               {ptr(c.getLogits()), ptr(c.getTargets()), ptr(c.getGrad()),
                ptr(c), i(numel(c.getTargets())), i(V)});
          return success();
        })
        .Case<TransposeOp>([&](TransposeOp t) {
          auto s = shapeOf(t.getInput());
          std::string name = "shape" + std::to_string(counter++);
          os << "  static const int64_t " << name << "[] = {";
          for (auto [k, d] : llvm::enumerate(s))
            os << (k ? ", " : "") << d;
          os << "}, " << name << "Perm[] = {";
          for (auto [k, d] : llvm::enumerate(t.getPermutation()))
            os << (k ? ", " : "") << d;
          os << "};\n";
          call("transpose<T>",
               {ptr(t.getInput()), ptr(t), name, name + "Perm", i(s.size())});
          return success();
        })
        .Case<SplitOp>([&](SplitOp s) {
          auto in = shapeOf(s.getInput());
          int64_t axis = s.getAxis(), start = 0;
          int64_t outer = product(in.take_front(axis)),
                  inner = product(in.drop_front(axis + 1));
          for (Value r : s.getResults()) {
            int64_t len = shapeOf(r)[axis];
            call("sliceAxis<T>", {ptr(s.getInput()), ptr(r), i(outer),
                                  i(in[axis]), i(inner), i(start), i(len)});
            start += len;
          }
          return success();
        })
        .Case<ConcatOp>([&](ConcatOp c) {
          auto out = shapeOf(c);
          int64_t axis = c.getAxis(), start = 0;
          int64_t outer = product(out.take_front(axis)),
                  inner = product(out.drop_front(axis + 1));
          for (Value in : c.getInputs()) {
            int64_t len = shapeOf(in)[axis];
            call("insertAxis<T>", {ptr(in), ptr(c), i(outer), i(out[axis]),
                                   i(inner), i(start), i(len)});
            start += len;
          }
          return success();
        })
        .Case<GlobalNormOp>([&](GlobalNormOp g) {
          if (!withOptimizer)
            return success();
          // Squares of gradients split over some axes are summed over them
          // (in one double all-reduce per distinct axis set).
          ArrayAttr axes = g.getReduceAxesAttr();
          std::map<int64_t, SmallVector<Value>> byAxes;
          for (auto [k, v] : llvm::enumerate(g.getInputs()))
            byAxes[axes ? cast<dist::AxesAttr>(axes[k]).getValue().bits() : 0]
                .push_back(v);
          if (cuda) {
            // One fp64 partial sum per axis set, on the device; the norm
            // never visits the host.
            os << "  {\n    double *acc = deviceBuffers().normAcc;\n"
               << "    TESSEL_CUDA_CHECK(cudaMemsetAsync(acc, 0, "
                  "sizeof(double) * "
               << byAxes.size() << ", computeStream()));\n";
            int part = 0;
            for (auto &[m, values] : byAxes) {
              // Gradients side by side in the store are one call.
              SmallVector<Value> sorted(values);
              llvm::sort(sorted, [](Value a, Value b) {
                BufferRef x = bufferOf(a), y = bufferOf(b);
                return std::make_pair(x.space, x.offset) <
                       std::make_pair(y.space, y.offset);
              });
              for (size_t k = 0; k < sorted.size();) {
                BufferRef first = bufferOf(sorted[k]);
                int64_t n = numel(sorted[k]);
                size_t end = k + 1;
                while (first.space != BufferSpace::Arena &&
                       end < sorted.size() &&
                       bufferOf(sorted[end]).space == first.space &&
                       bufferOf(sorted[end]).offset == first.offset + n)
                  n += numel(sorted[end++]);
                os << "    sumSquaresInto(" << ptr(sorted[k]) << ", " << n
                   << ", acc + " << part << ");\n";
                k = end;
              }
              if (m) {
                os << "    allReduceSum(acc + " << part << ", 1, " << m
                   << "u);\n";
                record("all_reduce", m, 1,
                       rt::allReduceBytesSent(1, groupSize(m), 8), g, 8);
              }
              ++part;
            }
            os << "    sqrtInto(acc, " << part << ", " << ptr(g) << ");\n  }\n";
            return success();
          }
          os << "  {\n    double sumSq = 0.0;\n";
          for (auto &[m, values] : byAxes) {
            os << "    {\n      double part = 0.0;\n";
            for (Value v : values)
              os << "      part += sumSquares<T>(" << ptr(v) << ", " << numel(v)
                 << ");\n";
            if (m) {
              os << "      allReduceSumDouble(&part, 1, " << m << "u);\n";
              record("all_reduce", m, 1,
                     rt::allReduceBytesSent(1, groupSize(m), 8), g, 8);
            }
            os << "      sumSq += part;\n    }\n";
          }
          os << "    " << ptr(g)
             << "[0] = static_cast<T>(std::sqrt(sumSq));\n  }\n";
          return success();
        })
        .Case<AdamWOp>([&](AdamWOp a) {
          if (!withOptimizer)
            return success();
          BufferRef param = bufferOf(a.getParam());
          std::string off = std::to_string(param.offset);
          if (cuda) {
            call("adamwUpdate",
                 {ptr(a.getParam()),
                  lowPrecision ? "PB + " + off : std::string("nullptr"),
                  ptr(a.getGrad()), "ctx.adamM + " + off, "ctx.adamV + " + off,
                  i(numel(a.getParam())), "ctx.lr",
                  flt(a.getBeta1().convertToDouble()),
                  flt(a.getBeta2().convertToDouble()),
                  flt(a.getEps().convertToDouble()),
                  flt(a.getWeightDecay().convertToDouble()), "ctx.step + 1",
                  ptr(a.getNorm()), flt(a.getMaxGradNorm().convertToDouble())});
            return success();
          }
          call("adamwUpdate",
               {ptr(a.getParam()), ptr(a.getGrad()), "ctx.adamM + " + off,
                "ctx.adamV + " + off, i(numel(a.getParam())), "ctx.lr",
                flt(a.getBeta1().convertToDouble()),
                flt(a.getBeta2().convertToDouble()),
                flt(a.getEps().convertToDouble()),
                flt(a.getWeightDecay().convertToDouble()), "ctx.step + 1",
                "clipCoefficient(" + ptr(a.getNorm()) + "[0], " +
                    flt(a.getMaxGradNorm().convertToDouble()) + ")"});
          return success();
        })
        .Case<dist::AllReduceOp>([&](dist::AllReduceOp ar) {
          emitAllReduce(ar.getInputs(), ar.getResults(), ar.getAxes(), "", ar);
          return success();
        })
        .Case<dist::AllReduceStartOp>([&](dist::AllReduceStartOp ar) {
          std::string name = "requests" + std::to_string(counter++);
          requests[ar.getRequest()] = name;
          os << "  CommRequest " << name << "[" << ar.getInputs().size()
             << "];\n  int " << name << "Count = 0;\n";
          emitAllReduce(ar.getInputs(), ar.getResults(), ar.getAxes(), name,
                        ar);
          return success();
        })
        .Case<dist::WaitOp>([&](dist::WaitOp w) {
          std::string name = requests.lookup(w.getRequest());
          os << "  for (int i = 0; i < " << name << "Count; ++i)\n"
             << "    commWait(" << name << "[i]);\n";
          return success();
        })
        .Case<dist::SendOp>([&](dist::SendOp send) {
          if (cuda) {
            // NCCL matches point-to-point messages in order, not by tag:
            // each message carries its place in the peer's receive order,
            // and the runtime issues them in that order.
            auto it = sendOrders ? sendOrders->find(send.getTag())
                                 : SendOrders::const_iterator();
            if (!sendOrders || it == sendOrders->end())
              return LogicalResult(send.emitOpError(
                  "has no place in the receive order (no pipeline schedule)"));
            std::string table = "kSendOrder" + std::to_string(send.getTag());
            os << "  static const int64_t " << table << "[] = {";
            for (auto [k, order] : llvm::enumerate(it->second))
              os << (k ? ", " : "") << order;
            os << "};\n";
            call("sendTo",
                 {lowPtr(send.getInput()), i(numel(send.getInput())),
                  "MeshAxis::PP", i(send.getOffset()), table + "[mb]"});
          } else
            call("sendTo", {ptr(send.getInput()), i(numel(send.getInput())),
                            "MeshAxis::PP", i(send.getOffset()),
                            i(send.getTag() * microbatchTags) + " + mb"});
          record("send_recv", 1u << 2, numel(send.getInput()),
                 numel(send.getInput()) * elementBytes(send.getInput()), send);
          return success();
        })
        .Case<dist::RecvOp>([&](dist::RecvOp recv) {
          if (cuda)
            call("recvFrom", {ptr(recv), i(numel(recv)), "MeshAxis::PP",
                              i(recv.getOffset())});
          else
            call("recvFrom", {ptr(recv), i(numel(recv)), "MeshAxis::PP",
                              i(recv.getOffset()),
                              i(recv.getTag() * microbatchTags) + " + mb"});
          return success();
        })
        .Case<dist::LocalSliceOp>([&](dist::LocalSliceOp l) {
          auto [outer, whole, inner] = around(l.getInput(), l.getDim());
          call("sliceAxis<T>",
               {ptr(l.getInput()), ptr(l), i(outer), i(whole), i(inner),
                pieceStart(l.getAxes(), l.getNumerator(), l.getDenominator()),
                i(shapeOf(l)[l.getDim()])});
          return success();
        })
        .Case<dist::LocalInsertOp>([&](dist::LocalInsertOp l) {
          auto [outer, whole, inner] = around(l, l.getDim());
          call("fill<T>", {ptr(l), i(numel(l)), scalar(0.0)});
          call("insertAxis<T>",
               {ptr(l.getInput()), ptr(l), i(outer), i(whole), i(inner),
                pieceStart(l.getAxes(), l.getNumerator(), l.getDenominator()),
                i(shapeOf(l.getInput())[l.getDim()])});
          return success();
        })
        .Case<dist::AllGatherOp>([&](dist::AllGatherOp g) {
          auto [outer, len, inner] = around(g.getInput(), g.getDim());
          call("allGatherAlong", {ptr(g.getInput()), ptr(g), i(outer), i(len),
                                  i(inner), mask(g.getAxes())});
          unsigned axes = g.getAxes().bits();
          int64_t n = outer * len * inner;
          record("all_gather", axes, n,
                 rt::allGatherBytesSent(n, groupSize(axes),
                                        elementBytes(g.getInput())),
                 g, elementBytes(g.getInput()));
          return success();
        })
        .Case<dist::ReduceScatterOp>([&](dist::ReduceScatterOp r) {
          auto [outer, len, inner] = around(r.getResult(), r.getDim());
          call("reduceScatterAlong", {ptr(r.getInput()), ptr(r), i(outer),
                                      i(len), i(inner), mask(r.getAxes())});
          unsigned axes = r.getAxes().bits();
          int64_t g = groupSize(axes), n = outer * len * inner;
          record("reduce_scatter", axes, g * n,
                 rt::reduceScatterBytesSent(n, g, elementBytes(r.getInput())),
                 r, elementBytes(r.getInput()));
          return success();
        })
        .Default([&](Operation *op) {
          return op->emitOpError("has no CPU emission rule");
        });
  }

  // The op emitted right after `op` (ops without code are skipped), when
  // it runs in the same part of the step (phase and pipeline chunk).
  static Operation *nextEmitted(Operation *op) {
    auto sameRegion = [&](Operation *other) {
      for (StringRef attr : {"tessel.phase", "tessel.chunk"})
        if (op->getAttr(attr) != other->getAttr(attr))
          return false;
      return true;
    };
    for (Operation *next = op->getNextNode(); next;
         next = next->getNextNode()) {
      if (isa<ReshapeOp, ParamOp, InputOp>(next))
        continue;
      return sameRegion(next) ? next : nullptr;
    }
    return nullptr;
  }
  // Whether the planned storage of two values overlaps. The planner lets an
  // op's output reuse an input that dies there, which a fused call that
  // reads after writing must not see.
  bool overlaps(Value a, Value b) const {
    BufferRef x = bufferOf(a), y = bufferOf(b);
    if (x.space != y.space)
      return false;
    auto size = [&](Value v) {
      return numel(v) * (x.space == BufferSpace::Arena ? elementBytes(v) : 1);
    };
    return x.offset < y.offset + size(b) && y.offset < x.offset + size(a);
  }
  bool anyOverlap(ArrayRef<Value> outputs, ArrayRef<Value> inputs) const {
    for (Value out : outputs)
      for (Value in : inputs)
        if (overlaps(out, in))
          return true;
    return false;
  }
  // The fused add + norm kernels read a row of their inputs completely
  // before writing that row of the output, so the output may be exactly
  // one of the inputs (same place, same element type), never partly.
  bool sameOrDisjoint(Value out, ArrayRef<Value> inputs) const {
    for (Value in : inputs)
      if (overlaps(out, in) &&
          (bufferOf(out).space != bufferOf(in).space ||
           bufferOf(out).offset != bufferOf(in).offset ||
           storageType(out) != storageType(in) || numel(out) != numel(in)))
        return false;
    return true;
  }
  static bool onlyUsedBy(Value v, Operation *user) {
    return llvm::all_of(v.getUsers(), [&](Operation *u) { return u == user; });
  }

  // CUDA fusions of an op with the one emitted right after it, so that no
  // other op can read or overwrite the buffers in between:
  //   matmul + bias add (+ GELU)   -> one cuBLASLt call with an epilogue
  //   residual add + LayerNorm/RMSNorm -> one kernel writing both
  //   silu + mul                   -> SwiGLU
  bool emitFused(Operation *op) {
    if (auto m = dyn_cast<MatmulOp>(op)) {
      auto add = dyn_cast_or_null<AddOp>(nextEmitted(op));
      auto rhs = shapeOf(m.getRhs());
      if (!add || add.getLhs() != m.getResult() ||
          !onlyUsedBy(m.getResult(), add) || m.getTransposeLhs() ||
          rhs.size() != 2 || shapeOf(add.getRhs()).size() != 1 ||
          bufferOf(add.getRhs()).space != BufferSpace::Param)
        return false;
      int64_t N = shapeOf(m).back();
      int64_t K = m.getTransposeRhs() ? rhs[1] : rhs[0];
      auto gelu = dyn_cast_or_null<GeluOp>(nextEmitted(add));
      if (gelu && gelu.getInput() != add.getResult())
        gelu = nullptr;
      if (!gemmTypesOk(m.getLhs(), m.getRhs(), add) ||
          (gelu && storageType(gelu) != storageType(add)))
        return false; // the plain matmul reports the types
      SmallVector<Value> outputs = {add.getResult()};
      if (gelu)
        outputs.push_back(gelu.getResult());
      if (anyOverlap(outputs, {m.getLhs(), m.getRhs(), add.getRhs()}) ||
          (gelu && overlaps(gelu, add)))
        return false;
      call("matmulBias",
           {lowPtr(m.getLhs()), lowPtr(m.getRhs()), ptr(add.getRhs()), ptr(add),
            gelu ? ptr(gelu)
                 : "static_cast<" + storageType(add) + " *>(nullptr)",
            i(numel(m) / N), i(N), i(K), boolStr(m.getTransposeRhs())});
      os << "  // (fused: bias add" << (gelu ? " and GELU" : "") << ")\n";
      fused.insert(add);
      if (gelu)
        fused.insert(gelu);
      return true;
    }
    if (auto a = dyn_cast<AddOp>(op)) {
      Operation *next = nextEmitted(op);
      if (!next || numel(a.getLhs()) != numel(a.getRhs()))
        return false;
      if (auto n = dyn_cast<LayerNormOp>(next); n && n.getInput() == a) {
        int64_t C = shapeOf(n).back();
        if (storageType(n) != storageType(a) ||
            anyOverlap({a.getResult()},
                       {a.getLhs(), a.getRhs(), n.getWeight(), n.getBias()}) ||
            !sameOrDisjoint(n, {a.getLhs(), a.getRhs()}) ||
            anyOverlap({n.getResult()}, {n.getWeight(), n.getBias()}) ||
            overlaps(a, n))
          return false;
        call("addLayerNormForward",
             {ptr(a.getLhs()), ptr(a.getRhs()), ptr(a), ptr(n.getWeight()),
              ptr(n.getBias()), ptr(n), i(numel(n) / C), i(C),
              num(n.getEpsilon().convertToDouble())});
        os << "  // (fused: the layer_norm that follows)\n";
        fused.insert(n);
        return true;
      }
      if (auto n = dyn_cast<RmsNormOp>(next); n && n.getInput() == a) {
        int64_t C = shapeOf(n).back();
        if (storageType(n) != storageType(a) ||
            anyOverlap({a.getResult()},
                       {a.getLhs(), a.getRhs(), n.getWeight()}) ||
            !sameOrDisjoint(n, {a.getLhs(), a.getRhs()}) ||
            anyOverlap({n.getResult()}, {n.getWeight()}) || overlaps(a, n))
          return false;
        call("addRmsNormForward",
             {ptr(a.getLhs()), ptr(a.getRhs()), ptr(a), ptr(n.getWeight()),
              ptr(n), i(numel(n) / C), i(C),
              num(n.getEpsilon().convertToDouble())});
        os << "  // (fused: the rms_norm that follows)\n";
        fused.insert(n);
        return true;
      }
      return false;
    }
    if (isa<LayerNormGradOp, RmsNormGradOp>(op))
      return emitNormGradAdd(op);
    if (auto mul = dyn_cast<MulOp>(op)) {
      auto it = deferredSilu.find(mul);
      if (it == deferredSilu.end())
        return false;
      SiluOp silu = it->second;
      Value up = mul.getLhs() == silu.getResult() ? mul.getRhs() : mul.getLhs();
      call("swigluForward",
           {ptr(silu.getInput()), ptr(up), ptr(mul), ptr(silu), i(numel(mul))});
      os << "  // (fused: the silu deferred to here)\n";
      return true;
    }
    if (auto silu = dyn_cast<SiluOp>(op)) {
      auto mul = dyn_cast_or_null<MulOp>(nextEmitted(op));
      // Llama's up projection runs between the two: defer the SiLU to the
      // product when nothing reads its result before and the gate is still
      // live there.
      if (!mul)
        return deferSilu(silu);
      if (numel(mul.getLhs()) != numel(mul.getRhs()))
        return false;
      Value up = mul.getLhs() == silu.getResult() ? mul.getRhs() : mul.getLhs();
      if (up == silu.getResult() ||
          (mul.getLhs() != silu.getResult() &&
           mul.getRhs() != silu.getResult()) ||
          storageType(up) != storageType(silu.getInput()) ||
          storageType(mul) != storageType(silu) ||
          anyOverlap({silu.getResult(), mul.getResult()},
                     {silu.getInput(), up}) ||
          overlaps(silu, mul))
        return false;
      call("swigluForward",
           {ptr(silu.getInput()), ptr(up), ptr(mul), ptr(silu), i(numel(mul))});
      os << "  // (fused: the mul that follows)\n";
      fused.insert(mul);
      return true;
    }
    return false;
  }

  // A norm's input gradient summed with the residual stream's gradient (the
  // add autodiff forms right after it): one kernel writes the sum.
  bool emitNormGradAdd(Operation *op) {
    auto layer = dyn_cast<LayerNormGradOp>(op);
    auto rms = dyn_cast<RmsNormGradOp>(op);
    Value x = layer ? layer.getInput() : rms.getInput();
    Value w = layer ? layer.getWeight() : rms.getWeight();
    Value dout = layer ? layer.getGrad() : rms.getGrad();
    Value dx = layer ? layer.getInputGrad() : rms.getInputGrad();
    auto add = dyn_cast_or_null<AddOp>(nextEmitted(op));
    if (!add || numel(add.getLhs()) != numel(add.getRhs()) ||
        (add.getLhs() != dx && add.getRhs() != dx) ||
        add.getLhs() == add.getRhs() || !onlyUsedBy(dx, add))
      return false;
    Value dres = add.getLhs() == dx ? add.getRhs() : add.getLhs();
    // The kernel writes each element after reading it from every input, so
    // the sum may be exactly an input but must not overlap one otherwise.
    if (storageType(dres) != storageType(add) ||
        !sameOrDisjoint(add, {x, dout, dres}) ||
        anyOverlap({add.getResult()}, {w}))
      return false;
    int64_t C = shapeOf(x).back();
    SmallVector<std::string> args = {ptr(x), ptr(w), ptr(dout), ptr(dres),
                                     ptr(add)};
    if (layer) {
      args.append({ptr(layer.getWeightGrad()), ptr(layer.getBiasGrad()),
                   i(numel(x) / C), i(C),
                   num(layer.getEpsilon().convertToDouble())});
      call("layerNormBackwardAdd", args);
    } else {
      args.append({ptr(rms.getWeightGrad()), i(numel(x) / C), i(C),
                   num(rms.getEpsilon().convertToDouble())});
      call("rmsNormBackwardAdd", args);
    }
    os << "  // (fused: the residual gradient add that follows)\n";
    fused.insert(add);
    return true;
  }

  bool deferSilu(SiluOp silu) {
    Block *block = silu->getBlock();
    MulOp mul;
    // The first product that reads it (the backward's come later).
    for (Operation *user : silu.getResult().getUsers())
      if (auto m = dyn_cast<MulOp>(user);
          m && m->getBlock() == block && (!mul || m->isBeforeInBlock(mul)) &&
          m->getAttr("tessel.phase") == silu->getAttr("tessel.phase") &&
          m->getAttr("tessel.chunk") == silu->getAttr("tessel.chunk"))
        mul = m;
    if (!mul || numel(mul.getLhs()) != numel(mul.getRhs()) ||
        mul.getLhs() == mul.getRhs())
      return false;
    Value up = mul.getLhs() == silu.getResult() ? mul.getRhs() : mul.getLhs();
    // Every other reader of the SiLU comes after the product; the gate is
    // read after it too (by the SiLU's gradient), so its buffer is intact.
    for (Operation *user : silu.getResult().getUsers())
      if (user != mul && user->getBlock() == block &&
          !mul->isBeforeInBlock(user))
        return false;
    bool gateLive = false;
    for (Operation *user : silu.getInput().getUsers())
      gateLive |= user->getBlock() == block && mul->isBeforeInBlock(user);
    if (!gateLive || storageType(up) != storageType(silu.getInput()) ||
        storageType(mul) != storageType(silu) ||
        anyOverlap({silu.getResult(), mul.getResult()},
                   {silu.getInput(), up}) ||
        overlaps(silu, mul))
      return false;
    deferredSilu[mul] = silu;
    os << "  // (deferred: fused with the gating product below)\n";
    return true;
  }

  static unsigned vocabAxes(Operation *op) {
    auto attr = op->getAttrOfType<dist::AxesAttr>("vocab_axes");
    return attr ? attr.getValue().bits() : 0;
  }
  int64_t groupSize(unsigned axes) const {
    return mesh.groupSize(AxisSet::fromBits(axes));
  }
  static std::string mask(unsigned axes) { return std::to_string(axes) + "u"; }
  // First global vocabulary row of this rank's slice of `local` rows.
  static std::string vocabStart(unsigned axes, int64_t local) {
    return "groupRank(" + mask(axes) + ") * " + std::to_string(local);
  }
  static std::string pieceStart(AxisSet axes, int64_t num, int64_t den) {
    return "groupRank(" + mask(axes) + ") * " + std::to_string(num) + " / " +
           std::to_string(den);
  }
  static std::string mask(AxisSet axes) {
    return std::to_string(axes.bits()) + "u";
  }
  // A dimension's extent and the element counts before and after it.
  static std::tuple<int64_t, int64_t, int64_t> around(Value v, int64_t dim) {
    auto shape = shapeOf(v);
    return {product(shape.take_front(dim)), shape[dim],
            product(shape.drop_front(dim + 1))};
  }

  // One sum over the group per contiguous run of the results' storage (a
  // bucket of gradients laid out side by side is a single call). Results
  // that do not alias their operand get a copy first.
  void emitAllReduce(ValueRange inputs, ValueRange results, AxisSet axes,
                     const std::string &requestArray, Operation *op) {
    struct Piece {
      BufferSpace space;
      int64_t offset, size; // elements (param/grad store) or bytes (arena)
      Value value;
    };
    SmallVector<Piece> pieces;
    for (auto [in, out] : llvm::zip(inputs, results)) {
      BufferRef src = bufferOf(in), dst = bufferOf(out);
      if (src.space != dst.space || src.offset != dst.offset)
        call("copy<T>", {ptr(in), ptr(out), i(numel(out))});
      int64_t unit = dst.space == BufferSpace::Arena ? 4 : 1;
      pieces.push_back({dst.space, dst.offset, numel(out) * unit, out});
    }
    llvm::sort(pieces, [](const Piece &a, const Piece &b) {
      return std::make_pair(a.space, a.offset) <
             std::make_pair(b.space, b.offset);
    });
    for (size_t k = 0; k < pieces.size();) {
      size_t end = k + 1;
      int64_t elements = numel(pieces[k].value);
      // Planned offsets assume 4-byte elements: bf16 pieces are never
      // adjacent.
      while (end < pieces.size() && pieces[end].space == pieces[k].space &&
             isFloat(pieces[k].value) && isFloat(pieces[end].value) &&
             pieces[end].offset ==
                 pieces[end - 1].offset + pieces[end - 1].size) {
        elements += numel(pieces[end].value);
        ++end;
      }
      std::string buffer = ptr(pieces[k].value);
      unsigned m = axes.bits();
      int64_t bytes = isFloat(pieces[k].value) ? 4 : 2;
      record("all_reduce", m, elements,
             rt::allReduceBytesSent(elements, groupSize(m), bytes), op, bytes);
      if (requestArray.empty())
        call("allReduceSum", {buffer, i(elements), mask(axes)});
      else
        os << "  " << requestArray << "[" << requestArray
           << "Count++] = allReduceSumStart(" << buffer << ", " << elements
           << ", " << mask(axes) << ");\n";
      k = end;
    }
  }

  LogicalResult emitMatmul(MatmulOp m) {
    auto lhs = shapeOf(m.getLhs()), rhs = shapeOf(m.getRhs()), out = shapeOf(m);
    bool tl = m.getTransposeLhs(), tr = m.getTransposeRhs();
    int64_t M = out[out.size() - 2], N = out.back();
    int64_t K = tl ? lhs[lhs.size() - 2] : lhs.back();
    int64_t batch = product(out.drop_back(2));
    int64_t strideB = rhs.size() == 2 ? 0 : K * N;
    if (failed(checkGemmTypes(m, m.getLhs(), m.getRhs(), m)))
      return failure();
    call("matmul<T>",
         {lowPtr(m.getLhs()), lowPtr(m.getRhs()), ptr(m), i(batch), i(M), i(N),
          i(K), boolStr(tl), boolStr(tr), i(M * K), i(strideB), i(M * N)});
    return success();
  }

  DenseMap<Value, std::string> requests;
  // Gating products that emit the SiLU deferred to them (SwiGLU).
  llvm::DenseMap<Operation *, SiluOp> deferredSilu;
  // Ops emitted as part of a fused call of the op before them.
  llvm::SmallPtrSet<Operation *, 16> fused;
  // Per message tag and microbatch: its place in the receiver's order.
  const SendOrders *sendOrders = nullptr;
  // Every axis set a collective of the step runs over.
  std::set<unsigned> commAxes;
  // How often the ops being emitted run per step (once per microbatch in a
  // microbatch loop), for the communication report.
  int64_t repeat = 1;
  int64_t microbatchTags = 1;
  raw_ostream &os;
  int arenaScale;
  bool withOptimizer;
  MeshShape mesh;
  std::vector<CollectiveCall> *calls;
  int counter = 0;
};

std::string meshShapeInit(ModuleOp module) {
  MeshShape mesh = dist::meshOf(module);
  std::string text;
  for (MeshAxis axis : tessel::kMeshAxes)
    if (mesh[axis] != 1)
      text += std::string("  program.mesh[MeshAxis::") +
              llvm::StringRef(meshAxisName(axis)).upper() +
              "] = " + std::to_string(mesh[axis]) + ";\n";
  return text;
}

// The update (gradient synchronisation, norm, AdamW, the loss reduction) runs
// once per step; everything before it once per microbatch. Returns the first
// op of the update, or failure when an op of the step follows it.
FailureOr<Operation *> updateStart(func::FuncOp func) {
  Block &body = func.getBody().front();
  // From the end: the optimizer ops, and the collectives whose results only
  // they read (gradient synchronisation, which must happen once per step).
  llvm::SmallPtrSet<Operation *, 32> update;
  for (Operation &op : llvm::reverse(body)) {
    bool isUpdate =
        isa<GlobalNormOp, AdamWOp, dist::WaitOp, func::ReturnOp>(op);
    if (isa<dist::AllReduceOp, dist::AllGatherOp, dist::ReduceScatterOp>(op))
      isUpdate = llvm::all_of(op.getUsers(), [&](Operation *user) {
        return update.contains(user);
      });
    if (isUpdate)
      update.insert(&op);
  }
  Operation *start = nullptr;
  for (Operation &op : body) {
    if (update.contains(&op)) {
      if (!start)
        start = &op;
    } else if (start) {
      return op.emitOpError("follows the optimizer update; this step cannot "
                            "be split into microbatches");
    }
  }
  return start;
}

// The value an update op reads before synchronisation: a gradient or the
// loss as the microbatch body leaves it.
Value beforeSync(Value v) {
  if (auto ar = v.getDefiningOp<dist::AllReduceOp>())
    return beforeSync(ar.getInputs()[cast<OpResult>(v).getResultNumber()]);
  if (auto ag = v.getDefiningOp<dist::AllGatherOp>())
    return beforeSync(ag.getInput());
  if (auto rs = v.getDefiningOp<dist::ReduceScatterOp>())
    return beforeSync(rs.getInput());
  return v;
}

LogicalResult emitMicrobatchLoop(func::FuncOp func, ProgramEmitter &emitter,
                                 raw_ostream &os, int64_t microbatches,
                                 int64_t tokensPerMicrobatch) {
  FailureOr<Operation *> update = updateStart(func);
  if (failed(update))
    return failure();
  Block &body = func.getBody().front();
  auto ret = cast<func::ReturnOp>(body.getTerminator());
  Value loss = beforeSync(ret.getOperand(0));
  os << "  // " << microbatches << " microbatches: gradients and the loss "
     << "accumulate,\n  // the update runs once.\n"
     << "  double lossSum = 0.0;\n  (void)lossSum;\n"
     << "  for (int64_t mb = 0; mb < " << microbatches << "; ++mb) {\n"
     << "  const int32_t *tokens = ctx.tokens + mb * " << tokensPerMicrobatch
     << ";\n"
     << "  const int32_t *targets = ctx.targets + mb * " << tokensPerMicrobatch
     << ";\n  (void)tokens; (void)targets;\n";
  emitter.repeat = microbatches;
  for (Operation &op : body) {
    if (&op == *update)
      break;
    if (failed(emitter.emitOp(&op)))
      return failure();
  }
  emitter.repeat = 1;
  SmallVector<std::pair<AdamWOp, Value>> grads;
  for (auto adamw : body.getOps<AdamWOp>())
    grads.push_back({adamw, beforeSync(adamw.getGrad())});
  for (auto [adamw, grad] : grads)
    emitter.call(
        "accumulateInto",
        {emitter.ptr(grad),
         "ctx.gradAccum + " + std::to_string(bufferOf(adamw.getParam()).offset),
         std::to_string(numel(grad)), "mb == 0"});
  emitter.addLoss(loss, "mb == 0");
  os << "  }\n";
  for (auto [adamw, grad] : grads)
    emitter.call(
        "copy<T>",
        {"ctx.gradAccum + " + std::to_string(bufferOf(adamw.getParam()).offset),
         emitter.ptr(grad), std::to_string(numel(grad))});
  emitter.storeLoss(loss);
  for (Operation &op : llvm::make_range(Block::iterator(*update),
                                        body.without_terminator().end()))
    if (failed(emitter.emitOp(&op)))
      return failure();
  return success();
}

// One pipeline stage: its forward and backward per microbatch as lambdas,
// each microbatch in its own arena slot, called in the schedule's order;
// then the update once.
LogicalResult emitStageSchedule(func::FuncOp func, ProgramEmitter &emitter,
                                raw_ostream &os,
                                const std::vector<ScheduledStep> &schedule,
                                int64_t arenaBytes, int64_t tokensPerMicrobatch,
                                int64_t microbatches) {
  Block &body = func.getBody().front();
  auto phase = [](Operation &op) {
    auto attr = op.getAttrOfType<StringAttr>("tessel.phase");
    return attr ? attr.getValue() : StringRef("update");
  };
  auto ret = cast<func::ReturnOp>(body.getTerminator());
  Value loss = beforeSync(ret.getOperand(0));
  bool hasLoss =
      loss.getDefiningOp() && phase(*loss.getDefiningOp()) == "forward";
  auto chunkOf = [](Operation &op) -> int64_t {
    auto attr = op.getAttrOfType<IntegerAttr>("tessel.chunk");
    return attr ? attr.getInt() : 0;
  };
  int64_t chunks = 1;
  for (const ScheduledStep &step : schedule)
    chunks = std::max<int64_t>(chunks, step.chunk + 1);
  emitter.microbatchTags = microbatches;
  emitter.repeat = microbatches;
  os << "  double lossSum = 0.0;\n  (void)lossSum;\n  int64_t backwardsDone["
     << chunks << "] = {};\n";
  // One forward and one backward per stage this rank holds (its chunks).
  for (int64_t chunk = 0; chunk < chunks; ++chunk)
    for (StringRef part : {"forward", "backward"}) {
      os << "  auto " << part << chunk << " = [&](int64_t mb) {\n"
         << "  char *A = ctx.activations + mb * " << arenaBytes << ";\n"
         << "  const int32_t *tokens = ctx.tokens + mb * "
         << tokensPerMicrobatch << ";\n  const int32_t *targets = ctx.targets "
         << "+ mb * " << tokensPerMicrobatch
         << ";\n  (void)A; (void)tokens; (void)targets;\n";
      for (Operation &op : body.without_terminator())
        if (phase(op) == part && chunkOf(op) == chunk &&
            failed(emitter.emitOp(&op)))
          return failure();
      if (part == "forward" && hasLoss &&
          chunkOf(*loss.getDefiningOp()) == chunk)
        emitter.addLoss(loss, "mb == 0");
      if (emitter.cuda)
        os << "  flushSends();\n";
      if (part == "backward") {
        for (auto adamw : body.getOps<AdamWOp>())
          if (chunkOf(*adamw) == chunk)
            emitter.call("accumulateInto",
                         {emitter.ptr(beforeSync(adamw.getGrad())),
                          "ctx.gradAccum + " +
                              std::to_string(bufferOf(adamw.getParam()).offset),
                          std::to_string(numel(adamw.getGrad())),
                          "backwardsDone[" + std::to_string(chunk) + "] == 0"});
        os << "  ++backwardsDone[" << chunk << "];\n";
      }
      os << "  };\n";
    }
  emitter.repeat = 1;
  os << "  // The schedule of this stage: 0 = forward, 1 = backward.\n"
     << "  static const int8_t kKinds[] = {";
  for (auto [k, step] : llvm::enumerate(schedule))
    os << (k ? ", " : "") << (step.backward ? 1 : 0);
  os << "};\n  static const int32_t kMicrobatches[] = {";
  for (auto [k, step] : llvm::enumerate(schedule))
    os << (k ? ", " : "") << step.microbatch;
  os << "};\n  static const int8_t kChunks[] = {";
  for (auto [k, step] : llvm::enumerate(schedule))
    os << (k ? ", " : "") << step.chunk;
  os << "};\n  for (size_t s = 0; s < " << schedule.size() << "; ++s) {\n"
     << "    TraceSpan span(kKinds[s] ? \"backward\" : \"forward\", "
        "kMicrobatches[s]);\n"
     << "    switch (kChunks[s] * 2 + kKinds[s]) {\n";
  for (int64_t chunk = 0; chunk < chunks; ++chunk)
    os << "    case " << 2 * chunk << ": forward" << chunk
       << "(kMicrobatches[s]); break;\n"
       << "    case " << 2 * chunk + 1 << ": backward" << chunk
       << "(kMicrobatches[s]); break;\n";
  os << "    }\n  }\n"
     << "  waitSends();\n"
     << "  TraceSpan updateSpan(\"update\");\n"
     << "  const int64_t mb = 0; // the update uses microbatch 0's slot\n"
     << "  (void)mb;\n";
  for (auto adamw : body.getOps<AdamWOp>())
    emitter.call(
        "copy<T>",
        {"ctx.gradAccum + " + std::to_string(bufferOf(adamw.getParam()).offset),
         emitter.ptr(beforeSync(adamw.getGrad())),
         std::to_string(numel(adamw.getGrad()))});
  if (hasLoss)
    emitter.storeLoss(loss);
  for (Operation &op : body.without_terminator())
    if (phase(op) == "update" && failed(emitter.emitOp(&op)))
      return failure();
  return success();
}

const char *decayName(const std::string &decay) {
  if (decay == "cosine")
    return "LrDecay::Cosine";
  if (decay == "linear")
    return "LrDecay::Linear";
  return "LrDecay::Constant";
}

} // namespace

namespace {

LogicalResult emitProgram(ModuleOp module, const Spec &spec, raw_ostream &os,
                          std::vector<CollectiveCall> *calls,
                          StringRef funcName,
                          const std::vector<ScheduledStep> *schedule,
                          const CudaTarget *cuda) {
  auto func = module.lookupSymbol<func::FuncOp>(funcName);
  IntegerAttr arenaBytes, paramElems;
  if (func) {
    arenaBytes = func->getAttrOfType<IntegerAttr>(kArenaBytesAttr);
    paramElems = func->getAttrOfType<IntegerAttr>(kParamElemsAttr);
  }
  if (!func || !arenaBytes || !paramElems)
    return module.emitError("emission needs a planned @")
           << funcName << " (run tessel-autodiff and tessel-plan-buffers)";
  auto ret = cast<func::ReturnOp>(func.getBody().front().getTerminator());

  // The batch shape comes from the program's inputs.
  int64_t batch = 0, seqLen = 0, vocab = 0;
  func.walk([&](InputOp input) {
    batch = input.getType().getDimSize(0);
    seqLen = input.getType().getDimSize(1);
  });
  func.walk([&](CrossEntropyOp ce) {
    // The global vocabulary: a vocab-parallel loss sees its slice.
    vocab = cast<RankedTensorType>(ce.getLogits().getType()).getShape().back();
    if (auto axes = ce.getVocabAxesAttr())
      vocab *= dist::meshOf(module).groupSize(axes.getValue());
  });
  // A pipeline stage without the inputs or the loss still reads the data
  // (the runtime checks every token): take the shapes from the spec.
  if (!batch)
    batch = spec.train.globalBatch /
            (spec.parallel.dp * spec.parallel.microbatches);
  if (!seqLen)
    seqLen = spec.model.seqLen;
  if (!vocab)
    vocab = spec.model.vocabSize;

  if (cuda)
    os << "// Generated by tessel from " << cppStringLiteral(spec.name)
       << ". One rank's training step\n// for CUDA ("
       << (cuda->bf16 ? "bf16 mixed precision" : "fp32") << ", sm_"
       << cuda->arch << ").\n"
       << "#include \"tessel/Runtime/Comm.h\"\n"
       << "#include \"tessel/Runtime/Cuda/Device.h\"\n"
       << "#include \"tessel/Runtime/Program.h\"\n"
       << "#include \"tessel/Runtime/Trace.h\"\n\n"
       << "#include <algorithm>\n#include <cmath>\n\n"
       << "using namespace tessel::cuda;\n"
       << "using tessel::MeshAxis;\nusing tessel::rt::groupRank;\n"
       << "using tessel::rt::InitKind;\nusing tessel::rt::LrDecay;\n"
       << "using tessel::rt::ParamInfo;\nusing tessel::rt::Program;\n"
       << "using tessel::rt::StepContext;\nusing tessel::rt::TraceSpan;\n"
       << "using tessel::rt::TrainConfig;\n\n"
       << "namespace {\n\nusing T = float;\n\n"
       << "const ParamInfo kParams[] = {\n";
  else
    os << "// Generated by tessel from " << cppStringLiteral(spec.name)
       << ". One rank's training step.\n"
       << "#include \"tessel/Runtime/Comm.h\"\n"
       << "#include \"tessel/Runtime/Kernels.h\"\n"
       << "#include \"tessel/Runtime/Program.h\"\n"
       << "#include \"tessel/Runtime/Trace.h\"\n"
       << "#include \"tessel/Runtime/VocabParallel.h\"\n\n#include <cmath>\n\n"
       << "using namespace tessel::rt;\n\nnamespace {\n\nusing T = float;\n\n"
       << "const ParamInfo kParams[] = {\n";
  int numParams = 0;
  MeshShape mesh = dist::meshOf(module);
  for (ParamOp p : func.getOps<ParamOp>()) {
    // The table holds the global (checkpoint) shape and how this rank's
    // shard is cut from it.
    SmallVector<int64_t> shape(p.getType().getShape());
    int shardDim = -1, shardBlocks = 1;
    MeshAxis shardAxis = MeshAxis::DP;
    if (auto attrs = p->getAttrOfType<ArrayAttr>("dist.sharding")) {
      dist::Sharding s =
          dist::Sharding::fromAttr(cast<dist::ShardingAttr>(attrs[0]));
      for (auto [d, axes] : llvm::enumerate(s.dims)) {
        if (axes.empty())
          continue;
        if (shardDim >= 0 || !axes.single())
          return p.emitOpError("parameters split along more than one "
                               "dimension or axis are not supported yet");
        shardDim = d;
        shardAxis = *axes.single();
        shardBlocks = s.blocksOf(d);
        shape[d] *= mesh.groupSize(axes);
      }
    }
    StringRef init = p.getInit();
    os << "    {" << cppStringLiteral(p.getName()) << ", " << shape.size()
       << ", {";
    for (int k = 0; k < 4; ++k)
      os << (k ? ", " : "") << (k < (int)shape.size() ? shape[k] : 0);
    os << "}, " << p.getType().getNumElements() << ", "
       << bufferOf(p.getResult()).offset << ", "
       << (init == "zeros"  ? "InitKind::Zeros"
           : init == "ones" ? "InitKind::Ones"
                            : "InitKind::Normal")
       << ", " << flt(p.getMean().convertToDouble()) << ", "
       << flt(p.getStd().convertToDouble()) << ", "
       << boolStr(shape.size() >= 2) << ", " << shardDim
       << ", MeshAxis::" << llvm::StringRef(meshAxisName(shardAxis)).upper()
       << ", " << shardBlocks << "},\n";
    ++numParams;
  }
  os << "};\n\nvoid trainStep(StepContext &ctx) {\n"
     << "  float *P = ctx.params;\n  float *G = ctx.grads;\n"
     << "  char *A = ctx.activations;\n"
     << "  (void)P; (void)G; (void)A;\n";
  if (cuda)
    os << "  bf16 *PB = deviceBuffers().paramShadow; // bf16 weights\n"
       << "  char *S = deviceBuffers().scratch;\n"
       << "  float *LS = deviceBuffers().scalars; // the loss over "
          "microbatches\n"
       << "  (void)PB; (void)S; (void)LS;\n";
  ProgramEmitter emitter(os, 1, true, dist::meshOf(module), calls);
  llvm::DenseSet<Value> fp32Values;
  if (cuda && cuda->bf16 != module->hasAttr(kBf16ActivationsAttr))
    return module.emitError("the buffer plan was made for ")
           << (cuda->bf16 ? "fp32" : "bf16")
           << " activations; run tessel-plan-buffers with bf16-activations="
           << (cuda->bf16 ? "true" : "false");
  if (!cuda && module->hasAttr(kBf16ActivationsAttr))
    return module.emitError("a CPU program needs a buffer plan with fp32 "
                            "activations (tessel-plan-buffers "
                            "bf16-activations=false)");
  if (cuda) {
    emitter.cuda = true;
    emitter.lowPrecision = cuda->bf16;
    if (cuda->bf16)
      fp32Values = fp32ValuesOf(module);
    emitter.fp32Values = &fp32Values;
    emitter.sendOrders = &cuda->sendOrders;
  }
  int64_t microbatches = pipe::layoutOf(module).getMicrobatches();
  if (schedule) {
    if (failed(emitStageSchedule(func, emitter, os, *schedule,
                                 arenaBytes.getInt(), batch * seqLen,
                                 microbatches)))
      return failure();
  } else if (microbatches > 1) {
    if (failed(emitMicrobatchLoop(func, emitter, os, microbatches,
                                  batch * seqLen)))
      return failure();
  } else {
    os << "  const int32_t *tokens = ctx.tokens;\n"
       << "  const int32_t *targets = ctx.targets;\n"
       << "  (void)tokens; (void)targets;\n";
    for (Operation &op : func.getBody().front().without_terminator())
      if (failed(emitter.emitOp(&op)))
        return failure();
  }
  if (cuda)
    os << "  tessel::cuda::finishStep(ctx, " << emitter.ptr(ret.getOperand(0)) << ", "
       << emitter.ptr(ret.getOperand(1)) << ");\n}\n\n"
       << "} // namespace\n\n";
  else
    os << "  ctx.loss = " << emitter.ptr(ret.getOperand(0)) << "[0];\n"
       << "  ctx.gradNorm = " << emitter.ptr(ret.getOperand(1)) << "[0];\n}\n\n"
       << "} // namespace\n\n";

  const TrainSpec &t = spec.train;
  os << "int main(int argc, char **argv) {\n"
     << "  TrainConfig config{};\n"
     << "  config.batch = " << batch * microbatches << ";\n"
     << "  config.seqLen = " << seqLen << ";\n"
     << "  config.vocab = " << vocab << ";\n"
     << "  config.steps = " << t.steps << ";\n"
     << "  config.seed = " << t.seed << "ull;\n"
     << "  config.gradClip = " << flt(t.gradClip) << ";\n"
     << "  config.lr = " << flt(t.lr) << ";\n"
     << "  config.beta1 = " << flt(t.beta1) << ";\n"
     << "  config.beta2 = " << flt(t.beta2) << ";\n"
     << "  config.eps = " << flt(t.eps) << ";\n"
     << "  config.weightDecay = " << flt(t.weightDecay) << ";\n"
     << "  config.warmupSteps = " << t.warmupSteps << ";\n"
     << "  config.decay = " << decayName(t.decay) << ";\n"
     << "  config.minLr = " << flt(t.minLr) << ";\n"
     << "  Program program{};\n"
     << "  program.name = " << cppStringLiteral(spec.name) << ";\n"
     << "  program.params = kParams;\n"
     << "  program.numParams = " << numParams << ";\n"
     << "  program.paramElems = " << paramElems.getInt() << ";\n"
     << "  program.activationBytes = "
     << arenaBytes.getInt() * (schedule ? microbatches : 1) << ";\n"
     << "  program.config = config;\n"
     << "  program.step = trainStep;\n"
     << meshShapeInit(module) << "  program.microbatches = " << microbatches
     << ";\n";
  if (cuda) {
    os << "  // The device side: precision, scratch, the axis sets of the\n"
       << "  // collectives (one NCCL communicator each).\n"
       << "  static const unsigned kCommAxes[] = {";
    std::set<unsigned> axes(emitter.commAxes.begin(), emitter.commAxes.end());
    axes.erase(0);
    for (auto [k, m] : llvm::enumerate(axes))
      os << (k ? ", " : "") << m << "u";
    if (axes.empty())
      os << "0u"; // (an array cannot be empty; none is used)
    os << "};\n  DeviceProgram device{};\n"
       << "  device.bf16 = " << boolStr(cuda->bf16) << ";\n"
       << "  device.scratchBytes = std::max<int64_t>({0";
    for (const std::string &e : emitter.scratch)
      os << ", " << e;
    // Every pipeline offset any stage sends with: point-to-point channels
    // are created by all ranks together.
    std::set<int64_t> offsets;
    module.walk([&](dist::SendOp send) { offsets.insert(send.getOffset()); });
    os << "});\n  device.cudaArch = " << cuda->arch << ";\n"
       << "  device.commAxes = kCommAxes;\n"
       << "  device.numCommAxes = " << axes.size() << ";\n";
    if (!offsets.empty()) {
      os << "  static const int kP2POffsets[] = {";
      for (auto [k, o] : llvm::enumerate(offsets))
        os << (k ? ", " : "") << o;
      os << "};\n  device.p2pOffsets = kP2POffsets;\n"
         << "  device.numP2POffsets = " << offsets.size() << ";\n";
    }
    os << "  program.device = deviceHooks(device);\n"
       << "  return tessel::rt::runMain(argc, argv, program);\n}\n";
  } else {
    os << "  return runMain(argc, argv, program);\n}\n";
  }
  return success();
}

} // namespace

LogicalResult
tessel::emitCpuProgram(ModuleOp module, const Spec &spec, raw_ostream &os,
                       std::vector<CollectiveCall> *calls, StringRef funcName,
                       const std::vector<ScheduledStep> *schedule) {
  return emitProgram(module, spec, os, calls, funcName, schedule, nullptr);
}

LogicalResult
tessel::emitCudaProgram(ModuleOp module, const Spec &spec, raw_ostream &os,
                        const CudaTarget &target,
                        std::vector<CollectiveCall> *calls, StringRef funcName,
                        const std::vector<ScheduledStep> *schedule) {
  return emitProgram(module, spec, os, calls, funcName, schedule, &target);
}

LogicalResult tessel::emitGradientCheckProgram(ModuleOp module,
                                               raw_ostream &os) {
  auto func = module.lookupSymbol<func::FuncOp>("train_step");
  auto arenaBytes = module->getAttrOfType<IntegerAttr>(kArenaBytesAttr);
  auto paramElems = module->getAttrOfType<IntegerAttr>(kParamElemsAttr);
  if (!func || !arenaBytes || !paramElems)
    return module.emitError("emission needs a planned @train_step (run "
                            "tessel-autodiff and tessel-plan-buffers)");
  auto ret = cast<func::ReturnOp>(func.getBody().front().getTerminator());
  int64_t vocab = 0, tokens = 0;
  func.walk([&](CrossEntropyOp ce) {
    vocab = cast<RankedTensorType>(ce.getLogits().getType()).getShape().back();
  });
  func.walk([&](InputOp input) { tokens = input.getType().getNumElements(); });

  os << "// Generated by tessel: float64 gradient check of every parameter.\n"
     << "#include \"tessel/Runtime/Kernels.h\"\n\n"
     << "#include <algorithm>\n#include <cmath>\n#include <cstdio>\n"
     << "#include <vector>\n\nusing namespace tessel::rt;\n\nnamespace {\n\n"
     << "using T = double;\n\n"
     << "struct Param { const char *name; int64_t offset, numel; };\n"
     << "const Param kParams[] = {\n";
  for (ParamOp p : func.getOps<ParamOp>())
    os << "    {" << cppStringLiteral(p.getName()) << ", "
       << bufferOf(p.getResult()).offset << ", " << p.getType().getNumElements()
       << "},\n";
  os << "};\n\n"
     << "// The planned step without the optimizer: loss and every gradient.\n"
     << "T lossAndGradients(T *P, T *G, char *A, const int32_t *tokens,\n"
     << "                   const int32_t *targets) {\n"
     << "  (void)P; (void)G; (void)A; (void)tokens; (void)targets;\n";
  ProgramEmitter emitter(os, /*arenaScale=*/2, /*withOptimizer=*/false);
  for (Operation &op : func.getBody().front().without_terminator()) {
    if (failed(emitter.emitOp(&op)))
      return failure();
    // A gradient the planner could not place in the gradient store is
    // copied there.
    if (auto adamw = dyn_cast<AdamWOp>(op)) {
      BufferRef grad = bufferOf(adamw.getGrad()),
                param = bufferOf(adamw.getParam());
      if (grad.space != BufferSpace::Grad || grad.offset != param.offset)
        emitter.call("copy<T>", {emitter.ptr(adamw.getGrad()),
                                 "G + " + std::to_string(param.offset),
                                 std::to_string(numel(adamw.getGrad()))});
    }
  }
  os << "  return " << emitter.ptr(ret.getOperand(0)) << "[0];\n}\n\n"
     << "} // namespace\n\n"
     << "int main() {\n"
     << "  std::vector<T> P(" << paramElems.getInt() << "), G(P.size());\n"
     << "  std::vector<double> arena(" << arenaBytes.getInt() / 4 + 16 << ");\n"
     << "  char *A = reinterpret_cast<char *>(arena.data());\n"
     << "  uint64_t state = 0x9E3779B97F4A7C15ull;\n"
     << "  auto next = [&] { state ^= state << 13; state ^= state >> 7;\n"
     << "                    state ^= state << 17; return state; };\n"
     << "  auto uniform = [&] { return (next() >> 11) * 0x1.0p-53 * 2 - 1; };\n"
     << "  for (T &p : P) p = 0.5 * uniform();\n"
     << "  std::vector<int32_t> tokens(" << tokens << "), targets(" << tokens
     << ");\n"
     << "  for (size_t i = 0; i < tokens.size(); ++i) {\n"
     << "    tokens[i] = next() % " << vocab << ";\n"
     << "    targets[i] = next() % " << vocab << ";\n  }\n"
     << "  lossAndGradients(P.data(), G.data(), A, tokens.data(), "
        "targets.data());\n"
     << "  const std::vector<T> analytic = G;\n"
     << "  const T h = 1e-5;\n"
     << "  double worst = 0;\n  int64_t checked = 0;\n"
     << "  for (const Param &p : kParams) {\n"
     << "    double paramWorst = 0;\n"
     << "    int64_t samples = std::min<int64_t>(p.numel, 12);\n"
     << "    for (int64_t k = 0; k < samples; ++k) {\n"
     << "      int64_t i = p.offset + k * p.numel / samples;\n"
     << "      T saved = P[i];\n"
     << "      P[i] = saved + h;\n"
     << "      T plus = lossAndGradients(P.data(), G.data(), A, tokens.data(), "
        "targets.data());\n"
     << "      P[i] = saved - h;\n"
     << "      T minus = lossAndGradients(P.data(), G.data(), A, "
        "tokens.data(), targets.data());\n"
     << "      P[i] = saved;\n"
     << "      T numeric = (plus - minus) / (2 * h);\n"
     << "      // Central differences in double: error ~1e-10 at these sizes.\n"
     << "      double error = std::fabs(numeric - analytic[i]) /\n"
     << "                     (1e-4 + std::fabs(numeric));\n"
     << "      paramWorst = std::max(paramWorst, error);\n"
     << "      ++checked;\n    }\n"
     << "    std::printf(\"%-40s %.3e\\n\", p.name, paramWorst);\n"
     << "    worst = std::max(worst, paramWorst);\n  }\n"
     << "  std::printf(\"gradient check: %lld entries, worst relative error "
        "%.3e\\n\", (long long)checked, worst);\n"
     << "  return worst < 1e-5 ? 0 : 1;\n}\n";
  return success();
}

llvm::Expected<SendOrders> tessel::pipelineSendOrders(
    ModuleOp module, const std::vector<std::vector<ScheduledStep>> &schedules) {
  using Message = std::pair<int64_t, int64_t>; // tag, microbatch
  using Channel = std::pair<int64_t, int64_t>; // from, to
  // (from, to) -> the messages in the order the sender produces them and
  // the order the receiver takes them.
  std::map<Channel, std::vector<Message>> sent, received;
  // Per rank, per step: what it receives and what it sends.
  struct StepMessages {
    SmallVector<std::pair<Channel, Message>> receives, sends;
  };
  std::vector<std::vector<StepMessages>> stepMessages(schedules.size());
  for (auto [rank, steps] : llvm::enumerate(schedules)) {
    auto func =
        module.lookupSymbol<func::FuncOp>("stage_" + std::to_string(rank));
    if (!func)
      return llvm::createStringError("no @stage_" + std::to_string(rank));
    for (const ScheduledStep &step : steps) {
      StringRef phase = step.backward ? "backward" : "forward";
      StepMessages &messages = stepMessages[rank].emplace_back();
      for (Operation &op : func.getBody().front()) {
        auto opPhase = op.getAttrOfType<StringAttr>("tessel.phase");
        auto chunk = op.getAttrOfType<IntegerAttr>("tessel.chunk");
        if (!opPhase || opPhase.getValue() != phase ||
            (chunk ? chunk.getInt() : 0) != step.chunk)
          continue;
        if (auto recv = dyn_cast<dist::RecvOp>(op)) {
          Channel channel = {(int64_t)rank + recv.getOffset(), (int64_t)rank};
          Message m = {recv.getTag(), step.microbatch};
          received[channel].push_back(m);
          messages.receives.push_back({channel, m});
        }
        if (auto send = dyn_cast<dist::SendOp>(op)) {
          Channel channel = {(int64_t)rank, (int64_t)rank + send.getOffset()};
          Message m = {send.getTag(), step.microbatch};
          sent[channel].push_back(m);
          messages.sends.push_back({channel, m});
        }
      }
    }
  }
  for (auto &entry : received)
    sent[entry.first]; // channels that only receive are compared too
  SendOrders orders;
  for (auto &[channel, messages] : sent) {
    // A message's order is its place in the receiver's sequence.
    std::map<Message, int64_t> place;
    for (auto [k, m] : llvm::enumerate(received[channel]))
      place.emplace(m, k);
    std::string where = "pipeline stage " + std::to_string(channel.first) +
                        " -> stage " + std::to_string(channel.second) + ": ";
    if (messages.size() != received[channel].size() ||
        place.size() != messages.size())
      return llvm::createStringError(
          where + std::to_string(messages.size()) + " messages are sent and " +
          std::to_string(received[channel].size()) + " received");
    for (const Message &m : messages) {
      auto it = place.find(m);
      if (it == place.end())
        return llvm::createStringError(
            where + "message " + std::to_string(m.first) + " of microbatch " +
            std::to_string(m.second) + " is sent but never received");
      std::vector<int64_t> &perMicrobatch = orders[m.first];
      if ((int64_t)perMicrobatch.size() <= m.second)
        perMicrobatch.resize(m.second + 1, -1);
      perMicrobatch[m.second] = it->second;
    }
  }

  // Runs the ranks as the CUDA runtime will: a step goes once every message
  // it receives has been issued; its sends are queued and, after the step,
  // each channel issues its queued messages in order while the next one is
  // there. Every rank finishing shows the protocol cannot deadlock (each
  // channel is its own stream, so nothing else waits on a send).
  std::map<Channel, int64_t> issued;
  std::map<Channel, std::set<int64_t>> queued;
  std::vector<size_t> next(schedules.size(), 0);
  auto orderOf = [&](const Message &m) { return orders[m.first][m.second]; };
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t rank = 0; rank < schedules.size(); ++rank) {
      while (next[rank] < stepMessages[rank].size()) {
        const StepMessages &step = stepMessages[rank][next[rank]];
        if (!llvm::all_of(step.receives, [&](auto &r) {
              return orderOf(r.second) < issued[r.first];
            }))
          break;
        for (auto &[channel, m] : step.sends) {
          std::set<int64_t> &q = queued[channel];
          q.insert(orderOf(m));
          while (q.count(issued[channel]))
            q.erase(issued[channel]++);
        }
        ++next[rank];
        progress = true;
      }
    }
  }
  for (size_t rank = 0; rank < schedules.size(); ++rank) {
    if (next[rank] == stepMessages[rank].size())
      continue;
    const ScheduledStep &step = schedules[rank][next[rank]];
    for (auto &[channel, m] : stepMessages[rank][next[rank]].receives)
      if (orderOf(m) >= issued[channel])
        return llvm::createStringError(
            "pipeline stage " + std::to_string(rank) +
            " would wait forever "
            "on the CUDA target: its " +
            (step.backward ? "backward" : "forward") + " of microbatch " +
            std::to_string(step.microbatch) + " receives message " +
            std::to_string(m.first) + " from stage " +
            std::to_string(channel.first) + ", which is never sent in turn");
  }
  return orders;
}
