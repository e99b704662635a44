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

#include "Spelling.h"

#include "dialects/Pipe/PipeOps.h"

#include "mlir/Dialect/EmitC/IR/EmitC.h"
#include "mlir/Transforms/DialectConversion.h"
#include "llvm/Support/Format.h"
#include "llvm/Support/raw_ostream.h"

using namespace mlir;
using namespace tessel;
using namespace tessel::emission;
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

//===----------------------------------------------------------------------===//
// Patterns
//===----------------------------------------------------------------------===//

namespace {

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
    // (One table per distinct content: kernels called alike share it.)
    std::string init = "{";
    for (auto [k, v] : llvm::enumerate(array.asArrayRef()))
      init += (k ? ", " : "") + std::to_string(v);
    init += "}";
    int index = 0;
    for (auto global : module.getOps<emitc::GlobalOp>()) {
      if (!global.getSymName().starts_with("kTable"))
        continue;
      auto value = dyn_cast_or_null<emitc::OpaqueAttr>(global.getInitialValueAttr());
      if (value && value.getValue() == init &&
          global.getType() ==
              emitc::ArrayType::get({array.size()}, b.getI64Type()))
        return opaqueAttr(ctx, global.getSymName());
      ++index;
    }
    std::string name;
    do
      name = "kTable" + std::to_string(index++);
    while (module.lookupSymbol(name));
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
        // the untemplated bf16 shadows of AdamW and of the parameter gather
        // and the loss's fp32 row statistics.
        if (previous &&
            !isa<rt::AdamWOp, rt::AdamWShardOp, rt::AllGatherShardsOp,
                 rt::CrossEntropyVocabParallelForwardOp,
                 rt::CrossEntropyVocabParallelBackwardOp>(op))
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
    if (op.getSpace() == rt::Space::Arena ||
        op.getSpace() == rt::Space::Received ||
        op.getSpace() == rt::Space::Transient)
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

// The block is found when the program runs, from the rank's place in the
// group: groupBlock(source, n, blocks, shift, axes), an expression like the
// planned buffer's address it offsets (no variable of the storage type is
// declared, which C++ spells differently from the target's).
struct GroupBlockPattern : RtPattern<rt::GroupBlockOp> {
  using RtPattern::RtPattern;
  LogicalResult
  matchAndRewrite(rt::GroupBlockOp op, OpAdaptor adaptor,
                  ConversionPatternRewriter &rewriter) const override {
    auto source = adaptor.getSource().getDefiningOp<emitc::LiteralOp>();
    if (!source)
      return op.emitOpError("cuts a buffer that is not planned (run "
                            "tessel-plan-memory)");
    std::string text =
        ("groupBlock(" + source.getValue() + ", " +
         Twine(rt::elementsOf(op.getSource())) + ", " + Twine(op.getBlocks()) +
         ", " + Twine(op.getShift()) + ", " + axesLiteral(op.getAxes()) + ")")
            .str();
    rewriter.replaceOp(
        op, literal(rewriter, op.getLoc(),
                    getTypeConverter()->convertType(op.getType()), text));
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

// rt.finish_step hands the loss and the norm to the runtime, rt.finish_eval
// the loss alone (no norm: nullptr).
template <typename Op>
struct FinishPattern : RtPattern<Op> {
  using RtPattern<Op>::RtPattern;
  LogicalResult
  matchAndRewrite(Op op, typename Op::Adaptor adaptor,
                  ConversionPatternRewriter &rewriter) const override {
    CallBuilder call(rewriter, op.getLoc());
    call.text("ctx").operand(adaptor.getLoss());
    if constexpr (std::is_same_v<Op, rt::FinishStepOp>)
      call.operand(adaptor.getNorm());
    else
      call.text("nullptr");
    call.build(this->target.finishStepFunction());
    rewriter.eraseOp(op);
    return success();
  }
};

// rt.record_metric hands a value of the step to the runtime's metrics
// (its name checked by the op's verifier: a plain identifier).
struct RecordMetricPattern : RtPattern<rt::RecordMetricOp> {
  using RtPattern::RtPattern;
  LogicalResult
  matchAndRewrite(rt::RecordMetricOp op, OpAdaptor adaptor,
                  ConversionPatternRewriter &rewriter) const override {
    CallBuilder(rewriter, op.getLoc())
        .text("ctx")
        .text("\"" + op.getName() + "\"")
        .operand(adaptor.getValue())
        .integer(rt::elementsOf(op.getValue()))
        .build(this->target.recordMetricFunction());
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

// A started collective per buffer, its request kept in the request table.
template <typename Op>
struct StartPattern : RtPattern<Op> {
  StartPattern(const TypeConverter &converter, MLIRContext *ctx,
               const TargetInfo &target, StringRef function)
      : RtPattern<Op>(converter, ctx, target), function(function) {}
  std::string function;
  LogicalResult
  matchAndRewrite(Op op, typename Op::Adaptor adaptor,
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
                          .build(function, request)
                          .getResult(0);
      Value slot = requestSlot(rewriter, op.getLoc(), *op.getSlot() + k);
      rewriter.create<emitc::AssignOp>(op.getLoc(), slot, started);
    }
    rewriter.eraseOp(op);
    return success();
  }
};

// A collective started into its request slot and waited for by
// rt.wait_requests: ZeRO-3's prefetched gather (buffer, from, shadow or
// nullptr, n, axes), ZeRO-2's reduction in flight (buffer, out, n, axes),
// a tensor-parallel gather or reduce-scatter along a dimension (input,
// output, blocks or nullptr, outer, length, inner, axes) and one step of a
// gather piece by piece (input, output, n, shift, axes).
template <typename Op> struct SlotStartPattern : RtPattern<Op> {
  SlotStartPattern(const TypeConverter &converter, MLIRContext *ctx,
                   const TargetInfo &target, StringRef function)
      : RtPattern<Op>(converter, ctx, target), function(function) {}
  std::string function;
  static constexpr bool kAlong =
      std::is_same_v<Op, rt::AllGatherStartOp> ||
      std::is_same_v<Op, rt::ReduceScatterStartOp>;
  LogicalResult
  matchAndRewrite(Op op, typename Op::Adaptor adaptor,
                  ConversionPatternRewriter &rewriter) const override {
    if (!op.getSlot())
      return op.emitOpError(kAlong || std::is_same_v<Op, rt::ShiftStartOp>
                                ? "has no request slot (run tessel-plan-memory)"
                                : "has no request slot (run "
                                  "tessel-shard-optimizer)");
    if (!op.getRequest().use_empty())
      return op.emitOpError("is still waited on by rt.wait");
    CallBuilder call(rewriter, op.getLoc());
    auto optional = [&](Value v) {
      if (v)
        call.operand(v);
      else
        call.text("nullptr");
    };
    // The gather's piece to copy in (ZeRO-3) and its bf16 copy of the run
    // (a bf16 program's), or the blocks of a collective along an inner
    // dimension; each or nullptr.
    if constexpr (std::is_same_v<Op, rt::AllGatherShardsStartOp>) {
      call.operand(adaptor.getBuffer());
      optional(adaptor.getFrom());
      optional(adaptor.getShadow());
    } else if constexpr (kAlong) {
      call.operand(adaptor.getInput()).operand(adaptor.getOutput());
      optional(adaptor.getBlocks());
    } else {
      ValueRange operands = adaptor.getOperands();
      call.operand(operands[0]).operand(operands[1]);
    }
    if constexpr (kAlong)
      call.integer(op.getOuter())
          .integer(op.getLength())
          .integer(op.getInner());
    else if constexpr (std::is_same_v<Op, rt::ShiftStartOp>)
      call.integer(rt::elementsOf(op.getInput())).integer(op.getShift());
    else
      call.integer(op.getN());
    Value started =
        call.text(axesLiteral(op.getAxes()))
            .build(function, opaque(rewriter.getContext(), "CommRequest"))
            .getResult(0);
    rewriter.create<emitc::AssignOp>(
        op.getLoc(), requestSlot(rewriter, op.getLoc(), *op.getSlot()),
        started);
    rewriter.eraseOp(op);
    return success();
  }
};

struct WaitRequestsPattern : RtPattern<rt::WaitRequestsOp> {
  using RtPattern::RtPattern;
  LogicalResult
  matchAndRewrite(rt::WaitRequestsOp op, OpAdaptor adaptor,
                  ConversionPatternRewriter &rewriter) const override {
    for (int64_t k = 0; k < op.getCount(); ++k) {
      Value slot = requestSlot(rewriter, op.getLoc(), op.getFirst() + k);
      Value request = rewriter.create<emitc::LoadOp>(
          op.getLoc(), opaque(rewriter.getContext(), "CommRequest"), slot);
      CallBuilder call(rewriter, op.getLoc());
      if (Value when = adaptor.getWhen())
        call.operand(when).operand(request).build("commWaitIf");
      else
        call.operand(request).build("commWait");
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
    std::string mb = "mb";
    Value microbatch = adaptor.getMicrobatch();
    if (auto l = microbatch.template getDefiningOp<emitc::LiteralOp>())
      mb = l.getValue().str();
    else if (auto c = microbatch.template getDefiningOp<emitc::ConstantOp>())
      if (auto i = dyn_cast<IntegerAttr>(c.getValue()))
        mb = std::to_string(i.getInt());
    if (this->target.keysByOrder()) {
      if constexpr (std::is_same_v<Op, rt::SendOp>) {
        if (!op.getOrder() && !op.getEvalOrder())
          return op.emitOpError(
              "has no place in the receiver's order (run "
              "tessel-order-messages)");
        // Tags are numbered per channel: the table is the channel's. A send
        // of a forward part runs in both steps, which order differently.
        int64_t offset = op.getOffset();
        std::string channel = std::to_string(op.getTag()) +
                              (offset < 0 ? "Back" : "On") +
                              std::to_string(offset < 0 ? -offset : offset);
        auto tableOf = [&](StringRef prefix,
                           ArrayRef<int64_t> order) -> std::string {
          std::string table = prefix.str() + channel;
          if (!module.lookupSymbol(table)) {
            OpBuilder::InsertionGuard guard(rewriter);
            rewriter.setInsertionPoint(
                op->template getParentOfType<emitc::FuncOp>());
            std::string init = "{";
            for (auto [k, v] : llvm::enumerate(order))
              init += (k ? ", " : "") + std::to_string(v);
            rewriter.create<emitc::GlobalOp>(
                op.getLoc(), table,
                emitc::ArrayType::get({(int64_t)order.size()},
                                      rewriter.getI64Type()),
                opaqueAttr(rewriter.getContext(), init + "}"), false, true,
                true);
          }
          return table + "[" + mb + "]";
        };
        std::string train, eval;
        if (op.getOrder())
          train = tableOf("kSendOrderTag", *op.getOrder());
        // One table where both steps order the channel alike.
        if (op.getEvalOrder() &&
            !(op.getOrder() && *op.getOrder() == *op.getEvalOrder()))
          eval = tableOf("kEvalSendOrderTag", *op.getEvalOrder());
        call.text(train.empty()  ? eval
                  : eval.empty() ? train
                                 : "(ctx.evaluating ? " + eval + " : " +
                                       train + ")");
      }
    } else {
      // MPI promises tags below 32768; the runtime keeps 32000 and up for
      // its own messages (a save's).
      int64_t last = (op.getTag() + 1) * microbatches - 1;
      if (last >= 32000)
        return op.emitOpError("needs MPI tags up to ")
               << last << " (tag " << op.getTag() << " of " << microbatches
               << " microbatches); pipeline messages must stay below 32000: "
                  "fewer microbatches (parallel.microbatches)";
      call.text(Twine(op.getTag() * microbatches) + " + " + mb);
    }
    // A ring send names the ring's slot count (tessel-order-messages).
    if constexpr (std::is_same_v<Op, rt::SendOp>) {
      if (op.getRing()) {
        auto slots =
            module->template getAttrOfType<IntegerAttr>("rt.send_ring_slots");
        if (!slots || slots.getInt() < 1)
          return op.emitOpError("is a ring send but its program has no "
                                "rt.send_ring_slots");
        call.integer(slots.getInt());
      }
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
  patterns.add<KernelCallPattern, BufferPattern, ViewPattern, GroupBlockPattern,
               BatchPattern, FinishPattern<rt::FinishStepOp>,
               FinishPattern<rt::FinishEvalOp>, RecordMetricPattern,
               AllReducePattern, WaitRequestsPattern>(converter, ctx, target);
  patterns.add<SlotStartPattern<rt::AllGatherShardsStartOp>>(
      converter, ctx, target, "allGatherShardsStart");
  patterns.add<SlotStartPattern<rt::ReduceScatterPieceStartOp>>(
      converter, ctx, target, "reduceScatterPieceStart");
  patterns.add<StartPattern<rt::AllReduceStartOp>>(converter, ctx, target,
                                                   "allReduceSumStart");
  patterns.add<StartPattern<rt::ReduceScatterShardsStartOp>>(
      converter, ctx, target, "reduceScatterShardsStart");
  patterns.add<ScalarPattern<rt::LearningRateOp>>(converter, ctx, target,
                                                  "lr");
  patterns.add<ScalarPattern<rt::UpdateCountOp>>(converter, ctx, target,
                                                 "updates");
  patterns.add<SlotStartPattern<rt::AllGatherStartOp>>(
      converter, ctx, target, "allGatherAlongStart");
  patterns.add<SlotStartPattern<rt::ReduceScatterStartOp>>(
      converter, ctx, target, "reduceScatterAlongStart");
  patterns.add<SlotStartPattern<rt::ShiftStartOp>>(converter, ctx, target,
                                                   "shiftStart");
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

