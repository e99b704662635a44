//===- RtToEmitC.cpp - Per-rank programs as emitc -------------------------===//
//
// The last conversion: each planned rank program (a nested module of rt ops
// in functions) becomes an emitc module that mlir::emitc::translateToCpp
// prints as one C++ (or CUDA) source. Every buffer is an address expression
// into one of the step's stores (`reinterpret_cast<float *>(A + 4096)`,
// `(P + 128)`), every rt kernel one call of its runtime function, every
// communication op its runtime call. What differs between the CPU and the
// CUDA programs is asked of the TargetInfo.
//
//===----------------------------------------------------------------------===//

#include "tessel/Conversion/Passes.h"
#include "tessel/Conversion/RtToEmitC/RtToEmitC.h"
#include "tessel/Conversion/RtToEmitC/TargetInfo.h"

#include "dialects/Pipe/PipeOps.h"

#include "mlir/Dialect/EmitC/IR/EmitC.h"
#include "mlir/Transforms/DialectConversion.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/raw_ostream.h"

namespace tessel {
#define GEN_PASS_DEF_CONVERTRTTOEMITC
#include "tessel/Conversion/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;
namespace rt = tessel::rtir;

//===----------------------------------------------------------------------===//
// Spelling
//===----------------------------------------------------------------------===//

// Every byte outside [A-Za-z0-9._-] is an octal escape, so no name from a
// spec can break out of the literal.
std::string tessel::cppStringLiteral(StringRef text) {
  std::string out = "\"";
  for (unsigned char c : text) {
    if (llvm::isAlnum(c) || c == '.' || c == '_' || c == '-') {
      out += static_cast<char>(c);
    } else {
      char buf[5];
      snprintf(buf, sizeof(buf), "\\%03o", c);
      out += buf;
    }
  }
  return out + "\"";
}

std::string tessel::cppComment(StringRef text) {
  std::string out;
  for (unsigned char c : text)
    out += (c >= 0x20 && c < 0x7f && c != '\\') ? static_cast<char>(c) : '?';
  return out;
}

static std::string axesLiteral(AxisSet axes) {
  return std::to_string(axes.bits()) + "u";
}

static std::string axisLiteral(MeshAxis axis) {
  std::string name = meshAxisName(axis);
  for (char &c : name)
    c = static_cast<char>(toupper(c));
  return "MeshAxis::" + name;
}

static std::string floatLiteral(double value) {
  std::string text;
  llvm::raw_string_ostream os(text);
  os << "static_cast<float>(" << llvm::format("%.17g", value) << ")";
  return text;
}

// The variable of the generated function that points at a store.
static StringRef storeName(rt::Space space) {
  switch (space) {
  case rt::Space::Arena:
    return "A";
  case rt::Space::Params:
    return "P";
  case rt::Space::Grads:
    return "G";
  case rt::Space::AdamM:
    return "M";
  case rt::Space::AdamV:
    return "V";
  case rt::Space::Accumulators:
    return "ACC";
  case rt::Space::Shadow:
    return "PB";
  case rt::Space::NormSums:
    return "NS";
  }
  llvm_unreachable("unknown space");
}

//===----------------------------------------------------------------------===//
// Patterns
//===----------------------------------------------------------------------===//

namespace {

Value literal(OpBuilder &b, Location loc, Type type, const Twine &text) {
  return b.create<emitc::LiteralOp>(loc, type, text.str());
}

Type opaque(MLIRContext *ctx, StringRef text) {
  return emitc::OpaqueType::get(ctx, text);
}

Attribute opaqueAttr(MLIRContext *ctx, const Twine &text) {
  return emitc::OpaqueAttr::get(ctx, text.str());
}

// A call of a runtime function whose arguments are the op's (converted)
// operands and attributes, in order.
struct CallBuilder {
  CallBuilder(OpBuilder &b, Location loc) : b(b), loc(loc) {}
  CallBuilder &operand(Value v) {
    args.push_back(b.getIndexAttr(operands.size()));
    operands.push_back(v);
    return *this;
  }
  CallBuilder &attr(Attribute a) {
    args.push_back(a);
    return *this;
  }
  CallBuilder &text(const Twine &t) {
    return attr(opaqueAttr(b.getContext(), t));
  }
  CallBuilder &integer(int64_t v) { return attr(b.getI64IntegerAttr(v)); }
  emitc::CallOpaqueOp build(StringRef callee, TypeRange results = {}) {
    return b.create<emitc::CallOpaqueOp>(loc, results, callee,
                                         b.getArrayAttr(args), nullptr,
                                         operands);
  }

  OpBuilder &b;
  Location loc;
  SmallVector<Attribute> args;
  SmallVector<Value> operands;
};

template <typename Op>
struct RtPattern : OpConversionPattern<Op> {
  RtPattern(const TypeConverter &converter, MLIRContext *ctx,
            const TargetInfo &target)
      : OpConversionPattern<Op>(converter, ctx), target(target) {}
  const TargetInfo &target;
};

// A scalar attribute of a call as C++ says it.
FailureOr<Attribute> callAttribute(Operation *op, Attribute attr,
                                   ModuleOp module, OpBuilder &b) {
  MLIRContext *ctx = op->getContext();
  if (isa<IntegerAttr, FloatAttr, BoolAttr>(attr))
    return attr;
  if (auto axes = dyn_cast<dist::AxesAttr>(attr))
    return opaqueAttr(ctx, axesLiteral(axes.getValue()));
  if (auto offset = dyn_cast<rt::GroupOffsetAttr>(attr))
    return opaqueAttr(ctx, "groupRank(" +
                               axesLiteral(offset.getAxes().getValue()) +
                               ") * " + Twine(offset.getNumerator()) + " / " +
                               Twine(offset.getDenominator()));
  if (auto array = dyn_cast<DenseI64ArrayAttr>(attr)) {
    // A constant table beside the functions.
    std::string name;
    int index = 0;
    do
      name = "kTable" + std::to_string(index++);
    while (module.lookupSymbol(name));
    std::string init = "{";
    for (auto [k, v] : llvm::enumerate(array.asArrayRef()))
      init += (k ? ", " : "") + std::to_string(v);
    init += "}";
    OpBuilder::InsertionGuard guard(b);
    b.setInsertionPoint(op->getParentOfType<emitc::FuncOp>());
    b.create<emitc::GlobalOp>(
        op->getLoc(), name,
        emitc::ArrayType::get({array.size()}, b.getI64Type()),
        opaqueAttr(ctx, init), /*extern_specifier=*/false,
        /*static_specifier=*/true, /*const_specifier=*/true);
    return opaqueAttr(ctx, name);
  }
  return op->emitOpError("has an attribute the C++ call cannot take: ")
         << attr;
}

// Every kernel: one call of its runtime function.
struct KernelCallPattern
    : OpInterfaceConversionPattern<rt::KernelCallOpInterface> {
  KernelCallPattern(const TypeConverter &converter, MLIRContext *ctx,
                    const TargetInfo &target)
      : OpInterfaceConversionPattern(converter, ctx), target(target) {}

  LogicalResult
  matchAndRewrite(rt::KernelCallOpInterface kernel, ArrayRef<Value> operands,
                  ConversionPatternRewriter &rewriter) const override {
    Operation *op = kernel;
    ModuleOp module = op->getParentOfType<ModuleOp>();
    SmallVector<rt::CallArgument> arguments;
    kernel.getCallArguments(arguments);
    CallBuilder call(rewriter, op->getLoc());
    Type previous;
    for (const rt::CallArgument &arg : arguments) {
      if (arg.attr) {
        FailureOr<Attribute> attr =
            callAttribute(op, arg.attr, module, rewriter);
        if (failed(attr))
          return failure();
        call.attr(*attr);
      } else if (!arg.value) {
        // An absent optional buffer: a null pointer of the type of the
        // buffer before it (templates deduce their types from it), except
        // AdamW's untemplated shadow.
        if (previous && !isa<rt::AdamWOp>(op))
          call.text("static_cast<" + target.storageType(previous) +
                    " *>(nullptr)");
        else
          call.text("nullptr");
      } else {
        if (auto type = dyn_cast<MemRefType>(arg.value.getType()))
          previous = type.getElementType();
        unsigned index = llvm::find(op->getOperands(), arg.value) -
                         op->getOperands().begin();
        call.operand(operands[index]);
      }
    }
    for (const std::string &extra : target.extraArguments(op))
      call.text(extra);
    call.build(target.kernelFunction(op));
    rewriter.eraseOp(op);
    return success();
  }

  const TargetInfo &target;
};

struct BufferPattern : RtPattern<rt::BufferOp> {
  using RtPattern::RtPattern;
  LogicalResult
  matchAndRewrite(rt::BufferOp op, OpAdaptor,
                  ConversionPatternRewriter &rewriter) const override {
    Type type = getTypeConverter()->convertType(op.getType());
    std::string address;
    StringRef store = storeName(op.getSpace());
    if (op.getSpace() == rt::Space::Arena)
      address = "reinterpret_cast<" +
                target.storageType(op.getType().getElementType()) + " *>(" +
                store.str() + " + " + std::to_string(op.getOffset()) + ")";
    else
      address =
          "(" + store.str() + " + " + std::to_string(op.getOffset()) + ")";
    rewriter.replaceOp(op, literal(rewriter, op.getLoc(), type, address));
    return success();
  }
};

struct ViewPattern : RtPattern<rt::ViewOp> {
  using RtPattern::RtPattern;
  LogicalResult
  matchAndRewrite(rt::ViewOp op, OpAdaptor adaptor,
                  ConversionPatternRewriter &rewriter) const override {
    rewriter.replaceOp(op, adaptor.getSource());
    return success();
  }
};

struct BatchPattern : RtPattern<rt::BatchOp> {
  using RtPattern::RtPattern;
  LogicalResult
  matchAndRewrite(rt::BatchOp op, OpAdaptor,
                  ConversionPatternRewriter &rewriter) const override {
    rewriter.replaceOp(op, literal(rewriter, op.getLoc(),
                                   getTypeConverter()->convertType(op.getType()),
                                   op.getName()));
    return success();
  }
};

// What the runtime tells the step: the variables of the function preamble.
template <typename Op>
struct ScalarPattern : RtPattern<Op> {
  ScalarPattern(const TypeConverter &converter, MLIRContext *ctx,
                const TargetInfo &target, StringRef name)
      : RtPattern<Op>(converter, ctx, target), name(name) {}
  LogicalResult
  matchAndRewrite(Op op, typename Op::Adaptor,
                  ConversionPatternRewriter &rewriter) const override {
    rewriter.replaceOp(
        op, literal(rewriter, op.getLoc(), op.getType(), name));
    return success();
  }
  StringRef name;
};

struct FinishStepPattern : RtPattern<rt::FinishStepOp> {
  using RtPattern::RtPattern;
  LogicalResult
  matchAndRewrite(rt::FinishStepOp op, OpAdaptor adaptor,
                  ConversionPatternRewriter &rewriter) const override {
    CallBuilder(rewriter, op.getLoc())
        .text("ctx")
        .operand(adaptor.getLoss())
        .operand(adaptor.getNorm())
        .build(target.finishStepFunction());
    rewriter.eraseOp(op);
    return success();
  }
};

struct AllReducePattern : RtPattern<rt::AllReduceOp> {
  using RtPattern::RtPattern;
  LogicalResult
  matchAndRewrite(rt::AllReduceOp op, OpAdaptor adaptor,
                  ConversionPatternRewriter &rewriter) const override {
    for (auto [buffer, converted] :
         llvm::zip(op.getBuffers(), adaptor.getBuffers()))
      CallBuilder(rewriter, op.getLoc())
          .operand(converted)
          .integer(rt::elementsOf(buffer))
          .text(axesLiteral(op.getAxes()))
          .build("allReduceSum");
    rewriter.eraseOp(op);
    return success();
  }
};

// The program's table of started collectives.
constexpr StringLiteral kRequests = "gRequests";

Value requestSlot(OpBuilder &b, Location loc, int64_t slot) {
  MLIRContext *ctx = b.getContext();
  Type request = opaque(ctx, "CommRequest");
  // The table's size does not matter to a subscript; it is declared by the
  // program (see declareRequests).
  Value table = literal(b, loc, emitc::PointerType::get(request), kRequests);
  Value index = literal(b, loc, b.getIndexType(), Twine(slot));
  return b.create<emitc::SubscriptOp>(loc, emitc::LValueType::get(request),
                                      table, ValueRange{index});
}

struct AllReduceStartPattern : RtPattern<rt::AllReduceStartOp> {
  using RtPattern::RtPattern;
  LogicalResult
  matchAndRewrite(rt::AllReduceStartOp op, OpAdaptor adaptor,
                  ConversionPatternRewriter &rewriter) const override {
    if (!op.getSlot())
      return op.emitOpError("has no request slot (run tessel-plan-memory)");
    if (!op.getRequest().use_empty())
      return op.emitOpError("is still waited on by rt.wait (run "
                            "tessel-plan-memory)");
    Type request = opaque(rewriter.getContext(), "CommRequest");
    for (auto [k, pair] : llvm::enumerate(
             llvm::zip(op.getBuffers(), adaptor.getBuffers()))) {
      auto [buffer, converted] = pair;
      Value started = CallBuilder(rewriter, op.getLoc())
                          .operand(converted)
                          .integer(rt::elementsOf(buffer))
                          .text(axesLiteral(op.getAxes()))
                          .build("allReduceSumStart", request)
                          .getResult(0);
      Value slot = requestSlot(rewriter, op.getLoc(), *op.getSlot() + k);
      rewriter.create<emitc::AssignOp>(op.getLoc(), slot, started);
    }
    rewriter.eraseOp(op);
    return success();
  }
};

struct WaitRequestsPattern : RtPattern<rt::WaitRequestsOp> {
  using RtPattern::RtPattern;
  LogicalResult
  matchAndRewrite(rt::WaitRequestsOp op, OpAdaptor,
                  ConversionPatternRewriter &rewriter) const override {
    for (int64_t k = 0; k < op.getCount(); ++k) {
      Value slot = requestSlot(rewriter, op.getLoc(), op.getFirst() + k);
      Value request = rewriter.create<emitc::LoadOp>(
          op.getLoc(), opaque(rewriter.getContext(), "CommRequest"), slot);
      CallBuilder(rewriter, op.getLoc()).operand(request).build("commWait");
    }
    rewriter.eraseOp(op);
    return success();
  }
};

template <typename Op>
struct AlongPattern : RtPattern<Op> {
  AlongPattern(const TypeConverter &converter, MLIRContext *ctx,
               const TargetInfo &target, StringRef callee)
      : RtPattern<Op>(converter, ctx, target), callee(callee) {}
  LogicalResult
  matchAndRewrite(Op op, typename Op::Adaptor adaptor,
                  ConversionPatternRewriter &rewriter) const override {
    CallBuilder(rewriter, op.getLoc())
        .operand(adaptor.getInput())
        .operand(adaptor.getOutput())
        .integer(op.getOuter())
        .integer(op.getLength())
        .integer(op.getInner())
        .text(axesLiteral(op.getAxes()))
        .build(callee);
    rewriter.eraseOp(op);
    return success();
  }
  StringRef callee;
};

// The message key of a send or receive: CPU programs tag each message by
// its tag and microbatch (MPI matches tags); CUDA programs give a send its
// place in the receiver's order (NCCL matches in order).
template <typename Op>
struct PointToPointPattern : RtPattern<Op> {
  PointToPointPattern(const TypeConverter &converter, MLIRContext *ctx,
                      const TargetInfo &target, StringRef callee)
      : RtPattern<Op>(converter, ctx, target), callee(callee) {}
  LogicalResult
  matchAndRewrite(Op op, typename Op::Adaptor adaptor,
                  ConversionPatternRewriter &rewriter) const override {
    auto module = op->template getParentOfType<ModuleOp>();
    int64_t microbatches = 1;
    if (auto m = module->template getAttrOfType<IntegerAttr>("rt.microbatches"))
      microbatches = m.getInt();
    CallBuilder call(rewriter, op.getLoc());
    call.operand(adaptor.getBuffer())
        .integer(rt::elementsOf(op.getBuffer()))
        .text(axisLiteral(MeshAxis::PP))
        .integer(op.getOffset());
    StringRef mb = "mb";
    if (auto l = adaptor.getMicrobatch().template getDefiningOp<emitc::LiteralOp>())
      mb = l.getValue();
    if (this->target.keysByOrder()) {
      if constexpr (std::is_same_v<Op, rt::SendOp>) {
        if (!op.getOrder())
          return op.emitOpError(
              "has no place in the receiver's order (run "
              "tessel-order-messages)");
        std::string table = "kSendOrder" + std::to_string(op.getTag());
        if (!module.lookupSymbol(table)) {
          OpBuilder::InsertionGuard guard(rewriter);
          rewriter.setInsertionPoint(
              op->template getParentOfType<emitc::FuncOp>());
          std::string init = "{";
          for (auto [k, v] : llvm::enumerate(*op.getOrder()))
            init += (k ? ", " : "") + std::to_string(v);
          rewriter.create<emitc::GlobalOp>(
              op.getLoc(), table,
              emitc::ArrayType::get({(int64_t)op.getOrder()->size()},
                                    rewriter.getI64Type()),
              opaqueAttr(rewriter.getContext(), init + "}"), false, true,
              true);
        }
        call.text(table + "[" + mb + "]");
      }
    } else {
      call.text(Twine(op.getTag() * microbatches) + " + " + mb);
    }
    call.build(callee);
    rewriter.eraseOp(op);
    return success();
  }
  StringRef callee;
};

template <typename Op>
struct NoArgumentCallPattern : RtPattern<Op> {
  NoArgumentCallPattern(const TypeConverter &converter, MLIRContext *ctx,
                        const TargetInfo &target, StringRef callee)
      : RtPattern<Op>(converter, ctx, target), callee(callee) {}
  LogicalResult
  matchAndRewrite(Op op, typename Op::Adaptor,
                  ConversionPatternRewriter &rewriter) const override {
    CallBuilder(rewriter, op.getLoc()).build(callee);
    rewriter.eraseOp(op);
    return success();
  }
  StringRef callee;
};

} // namespace

tessel::EmitCTypeConverter::EmitCTypeConverter() {
  addConversion([](Type type) { return type; });
  addConversion([](MemRefType type) -> Type {
    return emitc::PointerType::get(type.getElementType());
  });
  addConversion([](rt::RequestType type) -> Type {
    return emitc::OpaqueType::get(type.getContext(), "CommRequest");
  });
  auto cast = [](OpBuilder &b, Type type, ValueRange inputs,
                 Location loc) -> Value {
    return b.create<UnrealizedConversionCastOp>(loc, type, inputs)
        .getResult(0);
  };
  addSourceMaterialization(cast);
  addTargetMaterialization(cast);
}

void tessel::populateRtToEmitCPatterns(const TypeConverter &converter,
                                       RewritePatternSet &patterns,
                                       const TargetInfo &target) {
  MLIRContext *ctx = patterns.getContext();
  patterns.add<KernelCallPattern, BufferPattern, ViewPattern, BatchPattern,
               FinishStepPattern, AllReducePattern, AllReduceStartPattern,
               WaitRequestsPattern>(converter, ctx, target);
  patterns.add<ScalarPattern<rt::LearningRateOp>>(converter, ctx, target,
                                                  "lr");
  patterns.add<ScalarPattern<rt::UpdateCountOp>>(converter, ctx, target,
                                                 "updates");
  patterns.add<AlongPattern<rt::AllGatherOp>>(converter, ctx, target,
                                              "allGatherAlong");
  patterns.add<AlongPattern<rt::ReduceScatterOp>>(converter, ctx, target,
                                                  "reduceScatterAlong");
  patterns.add<PointToPointPattern<rt::SendOp>>(converter, ctx, target,
                                                "sendTo");
  patterns.add<PointToPointPattern<rt::RecvOp>>(converter, ctx, target,
                                                "recvFrom");
  patterns.add<NoArgumentCallPattern<rt::FlushSendsOp>>(converter, ctx, target,
                                                        "flushSends");
  patterns.add<NoArgumentCallPattern<rt::WaitSendsOp>>(converter, ctx, target,
                                                       "waitSends");
}

//===----------------------------------------------------------------------===//
// Programs: functions, the parameter table, main
//===----------------------------------------------------------------------===//

namespace {

// The C++ name of a step function.
std::string functionName(StringRef symbol) {
  return symbol == "train_step" ? "trainStep" : symbol.str();
}

int64_t intAttr(Operation *op, StringRef name, int64_t fallback = 0) {
  if (auto a = op->getAttrOfType<IntegerAttr>(name))
    return a.getInt();
  return fallback;
}

// func.func -> emitc.func taking the step context first. The body's
// microbatch and first-run arguments are named `mb` and `first`.
LogicalResult convertFunction(func::FuncOp func, ModuleOp program,
                              const TargetInfo &target) {
  MLIRContext *ctx = func.getContext();
  OpBuilder b(func);
  Location loc = func.getLoc();
  Type ctxType = opaque(ctx, "StepContext &");
  if (func.getNumResults() != 0)
    return func.emitOpError("returns values; a step function cannot");
  SmallVector<Type> inputs = {ctxType};
  llvm::append_range(inputs, func.getArgumentTypes());
  auto fn = b.create<emitc::FuncOp>(loc, functionName(func.getSymName()),
                                    b.getFunctionType(inputs, {}));
  if (func.isPrivate())
    fn.setSpecifiersAttr(b.getStrArrayAttr({"static"}));
  Region &body = fn.getBody();
  body.takeBody(func.getBody());
  Block &entry = body.front();
  Value ctxArg = entry.insertArgument(0u, ctxType, loc);

  // What the body reads, so that the preamble declares only that.
  std::set<rt::Space> spaces;
  int64_t tokens = 0, targets = 0;
  bool lr = false, updates = false;
  fn.walk([&](Operation *op) {
    if (auto buffer = dyn_cast<rt::BufferOp>(op))
      spaces.insert(buffer.getSpace());
    else if (auto batch = dyn_cast<rt::BatchOp>(op))
      (batch.getName() == "tokens" ? tokens : targets) =
          rt::elementsOf(batch.getBuffer());
    else if (isa<rt::LearningRateOp>(op))
      lr = true;
    else if (isa<rt::UpdateCountOp>(op))
      updates = true;
    else if (isa<rt::FinishStepOp, func::CallOp>(op))
      ; // read ctx
  });

  int64_t slots = intAttr(program, "rt.arena_slots", 1);
  int64_t arenaBytes = intAttr(program, "rt.arena_bytes");
  b.setInsertionPointToStart(&entry);
  auto line = [&](const Twine &text, ValueRange args = {}) {
    b.create<emitc::VerbatimOp>(loc, b.getStringAttr(text), args);
  };
  line("StepContext &ctx = {};", ctxArg);
  bool hasMicrobatch = entry.getNumArguments() == 3;
  bool usesMb = hasMicrobatch && !entry.getArgument(1).use_empty();
  bool usesFirst = hasMicrobatch && !entry.getArgument(2).use_empty();
  if (hasMicrobatch) {
    line("const int64_t mb = {};", entry.getArgument(1));
    line("const bool first = {};", entry.getArgument(2));
    if (!usesMb &&
        !(spaces.count(rt::Space::Arena) && slots > 1) && !tokens && !targets)
      line("(void)mb;");
    if (!usesFirst)
      line("(void)first;");
    if (auto part = func->getAttrOfType<StringAttr>("rt.part"))
      line("TraceSpan span(" + cppStringLiteral(part.getValue()) +
           (part.getValue() == "update" ? "" : ", mb") + ");");
  } else if (entry.getNumArguments() != 1) {
    return func.emitOpError("must take no arguments or (microbatch, first)");
  }
  for (rt::Space space : spaces) {
    switch (space) {
    case rt::Space::Arena:
      if (hasMicrobatch && slots > 1)
        line("char *A = ctx.activations + mb * " + Twine(arenaBytes) + ";");
      else
        line("char *A = ctx.activations;");
      break;
    case rt::Space::Params:
      line("float *P = ctx.params;");
      break;
    case rt::Space::Grads:
      line("float *G = ctx.grads;");
      break;
    case rt::Space::AdamM:
      line("float *M = ctx.adamM;");
      break;
    case rt::Space::AdamV:
      line("float *V = ctx.adamV;");
      break;
    case rt::Space::Accumulators:
      line("float *ACC = ctx.accumulators;");
      break;
    case rt::Space::NormSums:
      line("double *NS = ctx.normSums;");
      break;
    case rt::Space::Shadow:
      line(target.shadowType() + " *PB = static_cast<" + target.shadowType() +
           " *>(ctx.paramShadow);");
      break;
    }
  }
  for (auto [name, count] : {std::pair<StringRef, int64_t>{"tokens", tokens},
                             {"targets", targets}}) {
    if (!count)
      continue;
    if (hasMicrobatch)
      line("const int32_t *" + name + " = ctx." + name + " + mb * " +
           Twine(count) + ";");
    else
      line("const int32_t *" + name + " = ctx." + name + ";");
  }
  if (lr)
    line("const float lr = ctx.lr;");
  if (updates)
    line("const int64_t updates = ctx.step + 1;");

  if (hasMicrobatch) {
    Value mb = literal(b, loc, b.getI64Type(), "mb");
    Value first = literal(b, loc, b.getI1Type(), "first");
    entry.getArgument(1).replaceAllUsesExcept(
        mb, SmallPtrSet<Operation *, 2>{});
    entry.getArgument(2).replaceAllUsesExcept(
        first, SmallPtrSet<Operation *, 2>{});
    // The preamble's own reads stay on the arguments.
    for (Operation &op : entry)
      if (auto v = dyn_cast<emitc::VerbatimOp>(op))
        for (OpOperand &use : v->getOpOperands())
          if (use.get() == mb)
            use.set(entry.getArgument(1));
          else if (use.get() == first)
            use.set(entry.getArgument(2));
  }

  // Calls, returns and constants.
  SmallVector<Operation *> rewrite;
  fn.walk([&](Operation *op) {
    if (isa<func::CallOp, func::ReturnOp, arith::ConstantOp>(op))
      rewrite.push_back(op);
  });
  for (Operation *op : rewrite) {
    b.setInsertionPoint(op);
    if (auto c = dyn_cast<arith::ConstantOp>(op)) {
      std::string text;
      if (auto i = dyn_cast<IntegerAttr>(c.getValue()))
        text = c.getType().isInteger(1) ? (i.getInt() ? "true" : "false")
                                        : std::to_string(i.getInt());
      else
        return c.emitOpError("is not an integer constant");
      c.replaceAllUsesWith(literal(b, c.getLoc(), c.getType(), text));
    } else if (auto call = dyn_cast<func::CallOp>(op)) {
      SmallVector<Value> args = {literal(b, call.getLoc(), ctxType, "ctx")};
      llvm::append_range(args, call.getOperands());
      b.create<emitc::CallOp>(call.getLoc(), TypeRange{},
                              functionName(call.getCallee()), args, nullptr,
                              nullptr);
    } else {
      b.create<emitc::ReturnOp>(op->getLoc(), Value());
    }
    op->erase();
  }
  func.erase();
  // The step comes after the parts it calls.
  if (fn.getSymName() == "trainStep")
    fn->moveBefore(program.getBody(), program.getBody()->end());
  return success();
}

// The parameter table: what the runtime needs to initialise, load and save
// each parameter (tessel/Runtime/Program.h, ParamInfo).
FailureOr<std::string> parameterTable(ModuleOp program,
                                      SmallVectorImpl<rt::ParamOp> &params) {
  std::string table;
  llvm::raw_string_ostream os(table);
  os << "{\n";
  for (rt::ParamOp p : params) {
    if (!p.getOffset())
      return p.emitOpError("has no place in the parameter store (run "
                           "tessel-plan-memory)");
    ArrayRef<int64_t> shape = p.getGlobalShape();
    if (shape.size() > 4)
      return p.emitOpError("has more than 4 dimensions");
    StringRef init = p.getInit();
    StringRef kind = init == "zeros" ? "Zeros"
                     : init == "ones" ? "Ones"
                                      : "Normal";
    os << "    {" << cppStringLiteral(p.getName()) << ", " << shape.size()
       << ", {";
    for (int k = 0; k < 4; ++k)
      os << (k ? ", " : "") << (k < (int)shape.size() ? shape[k] : 0);
    os << "}, " << rt::elementsOf(p.getBuffer()) << ", " << *p.getOffset()
       << ", InitKind::" << kind << ", "
       << floatLiteral(p.getMean().convertToDouble()) << ", "
       << floatLiteral(p.getStd().convertToDouble()) << ", "
       << (p.getDecay() ? "true" : "false") << ", "
       << static_cast<int64_t>(p.getShardDim()) << ", "
       << axisLiteral(p.getShardAxis()) << ", " << p.getShardBlocks()
       << "},\n";
  }
  os << "}";
  return table;
}

// main(): the program's description, handed to the runtime.
LogicalResult buildMain(ModuleOp program, ModuleOp top, int64_t numParams,
                        const TargetInfo &target,
                        const TargetInfo::DeviceInfo &device, OpBuilder &b) {
  MLIRContext *ctx = b.getContext();
  Location loc = program.getLoc();
  auto recipe = top->getAttrOfType<DictionaryAttr>("graph.recipe");
  if (!recipe)
    return top.emitOpError("has no graph.recipe (the training settings)");
  auto argvType = emitc::PointerType::get(
      emitc::PointerType::get(opaque(ctx, "char")));
  auto main = b.create<emitc::FuncOp>(
      loc, "main", b.getFunctionType({b.getI32Type(), argvType},
                                     {b.getI32Type()}));
  Block *entry = main.addEntryBlock();
  b.setInsertionPointToStart(entry);

  Type programType = opaque(ctx, "Program");
  Value var = b.create<emitc::VariableOp>(
      loc, emitc::LValueType::get(programType), opaqueAttr(ctx, "{}"));
  auto set = [&](Value object, StringRef member, StringRef value) {
    Type any = opaque(ctx, "auto");
    Value field = b.create<emitc::MemberOp>(loc, emitc::LValueType::get(any),
                                            member, object);
    b.create<emitc::AssignOp>(loc, field, literal(b, loc, any, value));
  };
  auto setInt = [&](Value object, StringRef member, int64_t v) {
    set(object, member, std::to_string(v));
  };
  Value config = b.create<emitc::MemberOp>(
      loc, emitc::LValueType::get(opaque(ctx, "TrainConfig")), "config", var);

  auto number = [&](StringRef key) -> FailureOr<double> {
    Attribute a = recipe.get(key);
    if (auto i = dyn_cast_or_null<IntegerAttr>(a))
      return static_cast<double>(i.getInt());
    if (auto f = dyn_cast_or_null<FloatAttr>(a))
      return f.getValueAsDouble();
    return top.emitOpError("graph.recipe has no number '") << key << "'";
  };
  MeshShape mesh = dist::meshOf(top);
  auto dp = mesh[MeshAxis::DP];
  FailureOr<double> globalBatch = number("global_batch");
  if (failed(globalBatch))
    return failure();
  setInt(config, "batch", static_cast<int64_t>(*globalBatch) / dp);
  for (auto [key, member] :
       {std::pair<StringRef, StringRef>{"seq_len", "seqLen"},
        {"vocab", "vocab"},
        {"steps", "steps"},
        {"warmup_steps", "warmupSteps"}}) {
    FailureOr<double> v = number(key);
    if (failed(v))
      return failure();
    setInt(config, member, static_cast<int64_t>(*v));
  }
  FailureOr<double> seed = number("seed");
  if (failed(seed))
    return failure();
  set(config, "seed", std::to_string(static_cast<uint64_t>(*seed)) + "ull");
  for (auto [key, member] :
       {std::pair<StringRef, StringRef>{"grad_clip", "gradClip"},
        {"lr", "lr"},
        {"beta1", "beta1"},
        {"beta2", "beta2"},
        {"eps", "eps"},
        {"weight_decay", "weightDecay"},
        {"min_lr", "minLr"}}) {
    FailureOr<double> v = number(key);
    if (failed(v))
      return failure();
    set(config, member, floatLiteral(*v));
  }
  auto decay = recipe.getAs<StringAttr>("decay");
  StringRef decayKind = "Cosine";
  if (decay && decay.getValue() == "linear")
    decayKind = "Linear";
  else if (decay && decay.getValue() == "constant")
    decayKind = "Constant";
  set(config, "decay", ("LrDecay::" + decayKind).str());

  auto name = recipe.getAs<StringAttr>("name");
  set(var, "name", cppStringLiteral(name ? name.getValue() : "model"));
  set(var, "params", "kParams");
  setInt(var, "numParams", numParams);
  setInt(var, "paramElems", intAttr(program, "rt.param_elems"));
  setInt(var, "activationBytes", intAttr(program, "rt.arena_bytes") *
                                     intAttr(program, "rt.arena_slots", 1));
  set(var, "step", "trainStep");
  setInt(var, "microbatches", intAttr(program, "rt.microbatches", 1));
  setInt(var, "accumulatorElems", intAttr(program, "rt.accumulator_elems"));
  setInt(var, "normSums", intAttr(program, "rt.norm_sums"));
  for (MeshAxis axis : kMeshAxes)
    if (mesh[axis] > 1)
      b.create<emitc::VerbatimOp>(
          loc,
          b.getStringAttr("{}.mesh[" + axisLiteral(axis) +
                          "] = " + std::to_string(mesh[axis]) + ";"),
          ValueRange{var});
  if (failed(target.addDeviceSetup(device, var, b)))
    return failure();
  Value result =
      b.create<emitc::CallOpaqueOp>(
           loc, TypeRange{b.getI32Type()}, target.runMain(),
           b.getArrayAttr({b.getIndexAttr(0), b.getIndexAttr(1),
                           b.getIndexAttr(2)}),
           nullptr,
           ValueRange{entry->getArgument(0), entry->getArgument(1),
                      b.create<emitc::LoadOp>(loc, programType, var)})
          .getResult(0);
  b.create<emitc::ReturnOp>(loc, result);
  return success();
}

} // namespace

LogicalResult
tessel::convertProgramToEmitC(ModuleOp program, ModuleOp top,
                              const TargetInfo &target,
                              const TargetInfo::DeviceInfo &device) {
  MLIRContext *ctx = program.getContext();
  auto step = program.lookupSymbol<func::FuncOp>("train_step");
  if (!step)
    return program.emitOpError("has no train_step function");

  // The parameters, declared by the step.
  SmallVector<rt::ParamOp> params;
  step.walk([&](rt::ParamOp p) { params.push_back(p); });
  FailureOr<std::string> table = parameterTable(program, params);
  if (failed(table))
    return failure();
  for (rt::ParamOp p : params) {
    if (!p->use_empty())
      return p.emitOpError("is read directly; buffer planning resolves "
                           "parameters to their store");
    p.erase();
  }

  OpBuilder b(ctx);
  Location loc = program.getLoc();
  Block *body = program.getBody();
  std::string targetNote = target.describe(device);

  // The functions, each a function of the step context.
  for (auto func : llvm::make_early_inc_range(body->getOps<func::FuncOp>()))
    if (failed(convertFunction(func, program, target)))
      return failure();

  // The ops inside them.
  EmitCTypeConverter converter;
  ConversionTarget legal(*ctx);
  legal.addLegalDialect<emitc::EmitCDialect>();
  legal.addIllegalDialect<rt::RtDialect>();
  RewritePatternSet patterns(ctx);
  populateRtToEmitCPatterns(converter, patterns, target);
  if (failed(applyPartialConversion(program, legal, std::move(patterns))))
    return failure();
  // Values that were retyped pointers on both sides.
  SmallVector<UnrealizedConversionCastOp> casts;
  program.walk([&](UnrealizedConversionCastOp c) { casts.push_back(c); });
  for (UnrealizedConversionCastOp c : casts) {
    c.getResult(0).replaceAllUsesWith(c.getOperand(0));
    c.erase();
  }

  // The file around them.
  b.setInsertionPointToStart(body);
  auto name = top->getAttrOfType<DictionaryAttr>("graph.recipe")
                  ? top->getAttrOfType<DictionaryAttr>("graph.recipe")
                        .getAs<StringAttr>("name")
                  : StringAttr();
  std::string what = "One rank's training step";
  if (auto rank = program->getAttrOfType<IntegerAttr>("pipe.rank");
      rank && dist::meshOf(top)[MeshAxis::PP] > 1)
    what = "Pipeline rank " + std::to_string(rank.getInt()) +
           ": one rank's training step";
  what += (targetNote.empty() ? "" : " " + targetNote) + ".";
  b.create<emitc::VerbatimOp>(
      loc, b.getStringAttr("// Generated by tessel from \"" +
                           cppComment(name ? name.getValue() : "model") +
                           "\". " + what));
  for (const std::string &header : target.includes())
    b.create<emitc::IncludeOp>(loc, header,
                               header.find('/') == std::string::npos);
  for (const std::string &line : target.preludeLines())
    b.create<emitc::VerbatimOp>(loc, line);
  b.create<emitc::VerbatimOp>(loc, "namespace {");
  b.create<emitc::GlobalOp>(
      loc, "kParams",
      emitc::ArrayType::get({(int64_t)std::max<size_t>(params.size(), 1)},
                            opaque(ctx, "ParamInfo")),
      params.empty() ? Attribute() : opaqueAttr(ctx, *table), false, true,
      true);
  if (int64_t requests = intAttr(program, "rt.request_slots"))
    b.create<emitc::GlobalOp>(
        loc, kRequests,
        emitc::ArrayType::get({requests}, opaque(ctx, "CommRequest")),
        Attribute(), false, true, false);
  b.setInsertionPointToEnd(body);
  b.create<emitc::VerbatimOp>(loc, "} // namespace");
  if (failed(buildMain(program, top, params.size(), target, device, b)))
    return failure();
  return success();
}

namespace {

struct ConvertRtToEmitCPass
    : tessel::impl::ConvertRtToEmitCBase<ConvertRtToEmitCPass> {
  using ConvertRtToEmitCBase::ConvertRtToEmitCBase;
  void runOnOperation() override {
    ModuleOp top = getOperation();
    std::unique_ptr<TargetInfo> info = makeTargetInfo(target, cudaArch);
    if (!info) {
      top.emitError("unknown target '") << target << "' (cpu or cuda)";
      return signalPassFailure();
    }
    SmallVector<ModuleOp> programs;
    for (auto m : top.getOps<ModuleOp>())
      if (m->hasAttr("rt.arena_bytes"))
        programs.push_back(m);
    if (programs.empty()) {
      top.emitError("has no rank programs (run convert-pipe-to-rt)");
      return signalPassFailure();
    }
    // What each device needs to know, read before any program is converted
    // (the pipeline offsets are those of the whole job).
    std::vector<TargetInfo::DeviceInfo> devices;
    for (ModuleOp program : programs)
      devices.push_back(info->deviceInfo(program, top));
    for (auto [program, device] : llvm::zip(programs, devices))
      if (failed(convertProgramToEmitC(program, top, *info, device)))
        return signalPassFailure();
  }
};

} // namespace
