//===- Programs.cpp - A rank program as the emitc module of its source ----===//
//
// Around the converted ops (RtToEmitC.cpp): each part becomes an emitc
// function of the step context with a preamble naming the stores it reads,
// the step calls them in schedule order, the parameter table and main()
// describe the program to the runtime; and the convert-rt-to-emitc pass.
//
//===----------------------------------------------------------------------===//

#include "Spelling.h"

#include "tessel/Conversion/Passes.h"
#include "tessel/Conversion/RtToEmitC/RtToEmitC.h"
#include "tessel/Conversion/RtToEmitC/TargetInfo.h"

#include "dialects/Pipe/PipeOps.h"

#include "mlir/Dialect/EmitC/IR/EmitC.h"
#include "mlir/Transforms/DialectConversion.h"

#include <map>
#include <set>

namespace tessel {
#define GEN_PASS_DEF_CONVERTRTTOEMITC
#include "tessel/Conversion/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;
using namespace tessel::emission;
namespace rt = tessel::rtir;

//===----------------------------------------------------------------------===//
// Programs: functions, the parameter table, main
//===----------------------------------------------------------------------===//

namespace {

// The C++ name of a step function.
std::string functionName(StringRef symbol) {
  return symbol == "train_step"     ? "trainStep"
         : symbol == "eval_step"    ? "evalStep"
         : symbol == "sync_params"  ? "syncParams"
         : symbol == "decode_step"  ? "decodeStep"
         : symbol == "prefill_step" ? "prefillStep"
                                    : symbol.str();
}

int64_t intAttr(Operation *op, StringRef name, int64_t fallback = 0) {
  if (auto a = op->getAttrOfType<IntegerAttr>(name))
    return a.getInt();
  return fallback;
}

// rt.schedule as C++: the tables of all variants in one array, where each
// variant's starts, and a loop over the running variant's (part,
// microbatch, first) triples.
std::vector<std::string> scheduleLoop(rt::ScheduleOp schedule,
                                      const std::string &name) {
  std::vector<std::string> lines;
  std::string entries, starts = "0";
  int64_t total = 0;
  for (Attribute table : schedule.getTables()) {
    ArrayRef<int64_t> triples = cast<DenseI64ArrayAttr>(table).asArrayRef();
    for (auto [k, v] : llvm::enumerate(triples))
      entries += (k % 24 ? " " : "\n    ") + std::to_string(v) + ",";
    total += triples.size();
    starts += ", " + std::to_string(total);
  }
  lines.push_back("static const int64_t " + name + "[] = {" + entries +
                  "\n};");
  lines.push_back("static const int64_t " + name + "Start[] = {" + starts +
                  "};");
  lines.push_back("for (int64_t i = " + name + "Start[ctx.variant]; i < " +
                  name + "Start[ctx.variant + 1]; i += 3) {");
  lines.push_back("  switch (" + name + "[i]) {");
  for (auto [k, part] : llvm::enumerate(schedule.getParts()))
    lines.push_back("  case " + std::to_string(k) + ": " +
                    functionName(cast<FlatSymbolRefAttr>(part).getValue()) +
                    "(ctx, " + name + "[i + 1], " + name +
                    "[i + 2] != 0); break;");
  lines.push_back("  }");
  lines.push_back("}");
  return lines;
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

  // What the body reads, so that the preamble declares only that, and the
  // element type of each store (float; double in float64 programs).
  std::set<rt::Space> spaces;
  std::map<rt::Space, Type> storeTypes;
  int64_t tokens = 0, targets = 0, positions = 0;
  bool lr = false, updates = false;
  fn.walk([&](Operation *op) {
    if (auto buffer = dyn_cast<rt::BufferOp>(op)) {
      spaces.insert(buffer.getSpace());
      storeTypes.try_emplace(buffer.getSpace(),
                             buffer.getType().getElementType());
    }
    else if (auto batch = dyn_cast<rt::BatchOp>(op))
      (batch.getName() == "tokens"      ? tokens
       : batch.getName() == "positions" ? positions
                                        : targets) =
          rt::elementsOf(batch.getBuffer());
    else if (isa<rt::LearningRateOp>(op))
      lr = true;
    else if (isa<rt::UpdateCountOp>(op))
      updates = true;
    else if (isa<rt::FinishStepOp, rt::FinishEvalOp, func::CallOp>(op))
      ; // read ctx
  });

  int64_t slots = intAttr(program, "rt.arena_slots", 1);
  int64_t arenaBytes = intAttr(program, "rt.arena_bytes");
  // A program shared by pipeline ranks holds as many slots as the running
  // rank needs (kArenaSlots, by variant).
  bool variantSlots = program->hasAttr("rt.variant_arena_slots");
  // With an arena per chunk, a part finds its (chunk, microbatch)'s place
  // in kArenaOffsets (kArenaTotal: all the places, by variant).
  auto chunkOffsets =
      program->getAttrOfType<DenseI64ArrayAttr>("rt.chunk_arena_offsets");
  auto partChunk = func->getAttrOfType<IntegerAttr>("rt.part_chunk");
  std::string slotBytes =
      variantSlots && chunkOffsets ? "kArenaTotal[ctx.variant]"
      : variantSlots ? "kArenaSlots[ctx.variant] * " +
                           std::to_string(arenaBytes)
                     : std::to_string(rt::arenaSlotsBytes(program));
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
        !(spaces.count(rt::Space::Arena) && (slots > 1 || chunkOffsets)) &&
        !tokens && !targets)
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
      if (chunkOffsets) {
        // Only a chunk's parts keep anything in the arena.
        if (!hasMicrobatch || !partChunk)
          return func.emitOpError("uses the activation arena, which a "
                                  "program with an arena per chunk keeps "
                                  "for its chunks' parts only");
        int64_t microbatches = intAttr(program, "rt.microbatches", 1);
        std::string index = std::to_string(partChunk.getInt() * microbatches) +
                            " + mb";
        if (variantSlots)
          index = "ctx.variant * " + std::to_string(chunkOffsets.size()) +
                  " + " + index;
        line("char *A = ctx.activations + kArenaOffsets[" + index + "];");
      } else if (hasMicrobatch && slots > 1 && variantSlots)
        line("char *A = ctx.activations + (mb % kArenaSlots[ctx.variant]) * " +
             Twine(arenaBytes) + ";");
      else if (hasMicrobatch && slots > 1 &&
               slots < intAttr(program, "rt.microbatches", 1))
        // Microbatch mb uses slot mb % slots (fewer slots than microbatches:
        // those in flight on this rank at once).
        line("char *A = ctx.activations + (mb % " + Twine(slots) + ") * " +
             Twine(arenaBytes) + ";");
      else if (hasMicrobatch && slots > 1)
        line("char *A = ctx.activations + mb * " + Twine(arenaBytes) + ";");
      else
        line("char *A = ctx.activations;");
      break;
    case rt::Space::Params:
    case rt::Space::Grads:
    case rt::Space::AdamM:
    case rt::Space::AdamV:
    case rt::Space::Accumulators: {
      static const std::map<rt::Space, std::pair<StringRef, StringRef>>
          stores = {{rt::Space::Params, {"P", "params"}},
                    {rt::Space::Grads, {"G", "grads"}},
                    {rt::Space::AdamM, {"M", "adamM"}},
                    {rt::Space::AdamV, {"V", "adamV"}},
                    {rt::Space::Accumulators, {"ACC", "accumulators"}}};
      auto [name, member] = stores.at(space);
      std::string type = target.storageType(storeTypes[space]);
      if (type == "float")
        line("float *" + name + " = ctx." + member + ";");
      else
        line(type + " *" + name + " = reinterpret_cast<" + type +
             " *>(ctx." + member + ");");
      break;
    }
    case rt::Space::NormSums:
      line("double *NS = ctx.normSums;");
      break;
    case rt::Space::Received:
      // Held for the step, after the microbatches' arena slots.
      line("char *R = ctx.activations + " + slotBytes + ";");
      break;
    case rt::Space::Transient:
      // What lives within one run of a part, shared by all of them, after
      // the received parameters.
      line("char *T = ctx.activations + " + slotBytes + " + " +
           Twine(intAttr(program, "rt.received_bytes")) + ";");
      break;
    case rt::Space::Shadow:
      line(target.shadowType() + " *PB = static_cast<" + target.shadowType() +
           " *>(ctx.paramShadow);");
      break;
    case rt::Space::ParamPieces:
      line("float *PP = ctx.paramPieces;");
      break;
    case rt::Space::KvCache:
      line("float *KV = ctx.kvCache;");
      break;
    case rt::Space::Logits:
      line("float *LG = ctx.logits;");
      break;
    }
  }
  for (auto [name, count] : {std::pair<StringRef, int64_t>{"tokens", tokens},
                             {"targets", targets},
                             {"positions", positions}}) {
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
    line("const int64_t updates = ctx.updates + 1;");

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

  // Calls, schedule tables, returns and constants.
  SmallVector<Operation *> rewrite;
  fn.walk([&](Operation *op) {
    if (isa<func::CallOp, rt::ScheduleOp, func::ReturnOp, arith::ConstantOp>(
            op))
      rewrite.push_back(op);
  });
  int64_t tables = 0;
  for (Operation *op : rewrite) {
    b.setInsertionPoint(op);
    if (auto schedule = dyn_cast<rt::ScheduleOp>(op)) {
      for (const std::string &text :
           scheduleLoop(schedule, "kSchedule" + std::to_string(tables++)))
        line(text);
    } else if (auto c = dyn_cast<arith::ConstantOp>(op)) {
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
  if (fn.getSymName() == "trainStep" || fn.getSymName() == "evalStep")
    fn->moveBefore(program.getBody(), program.getBody()->end());
  return success();
}

// The parameter table: what the runtime needs to initialise, load and save
// each parameter (tessel/Runtime/Program.h, ParamInfo).
// A program shared by pipeline ranks has one table per variant, one after
// the other, that differ only in the names.
FailureOr<std::string> parameterTable(ModuleOp program,
                                      SmallVectorImpl<rt::ParamOp> &params,
                                      int64_t variants) {
  std::string table;
  llvm::raw_string_ostream os(table);
  os << "{\n";
  for (int64_t v = 0; v < variants; ++v)
  for (rt::ParamOp p : params) {
    StringRef name = p.getName();
    if (auto names = p.getVariantNames()) {
      if ((int64_t)names->size() != variants)
        return p.emitOpError("has ")
               << names->size() << " variant names for " << variants
               << " variants";
      name = cast<StringAttr>((*names)[v]).getValue();
    }
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
    os << "    {" << cppStringLiteral(name) << ", " << shape.size()
       << ", {";
    for (int k = 0; k < 4; ++k)
      os << (k ? ", " : "") << (k < (int)shape.size() ? shape[k] : 0);
    os << "}, " << rt::elementsOf(p.getBuffer()) << ", " << *p.getOffset()
       << ", InitKind::" << kind << ", "
       << floatLiteral(p.getMean().convertToDouble()) << ", "
       << floatLiteral(p.getStd().convertToDouble()) << ", "
       << (p.getDecay() ? "true" : "false") << ", "
       << static_cast<int64_t>(p.getShardDim()) << ", "
       << axisLiteral(p.getShardAxis()) << ", " << p.getShardBlocks();
    // Where the moments are (tessel-shard-optimizer): [state offset, offset
    // in run, piece(, group)]; by default at the parameter's offset, whole.
    ArrayRef<int64_t> shard;
    if (auto s = p.getOptimizerShard())
      shard = *s;
    if (shard.size() >= 3)
      os << ", " << shard[0] << ", " << shard[1] << ", " << shard[2];
    else
      os << ", " << *p.getOffset() << ", 0, 0";
    // Where its values are in the step's parameter store (ZeRO-3: a piece
    // of its run, laid out like the moments): [offset, piece].
    auto value = p->getAttrOfType<DenseI64ArrayAttr>("value_shard");
    if (value && value.size() == 2)
      os << ", " << value[0] << ", " << value[1];
    else
      os << ", " << *p.getOffset() << ", 0";
    // The ranks its pieces are cut over, when not the shard group.
    os << ", " << (shard.size() == 4 ? shard[3] : 0) << "u";
    // A second cut: [dimension, axis].
    auto second = p->getAttrOfType<DenseI64ArrayAttr>("second_shard");
    if (second && second.size() == 2)
      os << ", " << second[0] << ", "
         << axisLiteral(static_cast<MeshAxis>(second[1]));
    else
      os << ", 0, MeshAxis::DP";
    os << "},\n";
  }
  os << "}";
  return table;
}

// main(): the program's description, handed to the runtime.
LogicalResult buildMain(ModuleOp program, ModuleOp top, int64_t numParams,
                        const TargetInfo &target,
                        const TargetInfo::DeviceInfo &device,
                        bool gradientCheck, OpBuilder &b) {
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
  // The batch is split over dp and, in an MoE model, ep.
  auto dp = mesh[MeshAxis::DP] * mesh[MeshAxis::EP];
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
  // A padded vocabulary (absent from recipes written before it: none).
  if (auto padded = recipe.getAs<IntegerAttr>("padded_vocab"))
    setInt(config, "paddedVocab", padded.getInt());
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
  // Shuffled sampling (absent from recipes written before it: off).
  if (auto shuffle = recipe.getAs<BoolAttr>("data_shuffle");
      shuffle && shuffle.getValue()) {
    set(config, "dataShuffle", "true");
    auto seed = recipe.getAs<IntegerAttr>("data_seed");
    set(config, "dataSeed",
        std::to_string(seed ? static_cast<uint64_t>(seed.getInt()) : 0) +
            "ull");
  }
  // Validation (absent from recipes written before it: never).
  for (auto [key, member] :
       {std::pair<StringRef, StringRef>{"eval_every", "evalEvery"},
        {"eval_batches", "evalBatches"},
        {"sequence_pieces", "sequencePieces"}})
    if (auto v = recipe.getAs<IntegerAttr>(key))
      setInt(config, member, v.getInt());
  // Model FLOPs per token (absent from recipes written before it: 0).
  if (auto flops = recipe.getAs<FloatAttr>("flops_per_token"))
  {
    std::string text;
    llvm::raw_string_ostream os(text);
    os << llvm::format("%.17g", flops.getValueAsDouble());
    set(config, "flopsPerToken", text);
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
  setInt(var, "activationBytes", rt::arenaSlotsBytes(program) +
                                     intAttr(program, "rt.received_bytes") +
                                     intAttr(program, "rt.transient_bytes"));
  bool inference = program.lookupSymbol("decodeStep") != nullptr;
  set(var, "step", inference ? "decodeStep" : "trainStep");
  if (program.lookupSymbol("evalStep"))
    set(var, "evalStep", "evalStep");
  if (program.lookupSymbol("syncParams"))
    set(var, "syncParams", "syncParams");
  if (inference) {
    set(var, "inference", "true");
    setInt(var, "chunk", intAttr(program, "rt.chunk", 1));
    setInt(var, "kvCacheElems", intAttr(program, "rt.kv_cache_elems"));
    if (program.lookupSymbol("prefillStep")) {
      set(var, "prefill", "prefillStep");
      setInt(var, "prefillChunk", intAttr(program, "rt.prefill_chunk"));
    }
  }
  if (auto variants = program->getAttrOfType<DenseI64ArrayAttr>("rt.variants")) {
    set(var, "variants", "kVariants");
    setInt(var, "numVariants", variants.size());
  }
  setInt(var, "microbatches", intAttr(program, "rt.microbatches", 1));
  setInt(var, "accumulatorElems", intAttr(program, "rt.accumulator_elems"));
  setInt(var, "normSums", intAttr(program, "rt.norm_sums"));
  setInt(var, "optimizerElems", intAttr(program, "rt.optimizer_elems"));
  setInt(var, "gradElems", intAttr(program, "rt.grad_elems"));
  setInt(var, "paramStoreElems", intAttr(program, "rt.param_store_elems"));
  setInt(var, "paramPieceElems", intAttr(program, "rt.param_piece_elems"));
  for (MeshAxis axis : kMeshAxes)
    if (mesh[axis] > 1)
      b.create<emitc::VerbatimOp>(
          loc,
          b.getStringAttr("{}.mesh[" + axisLiteral(axis) +
                          "] = " + std::to_string(mesh[axis]) + ";"),
          ValueRange{var});
  if (mesh.hybrid())
    b.create<emitc::VerbatimOp>(
        loc,
        b.getStringAttr("{}.mesh.dpShard = " + std::to_string(mesh.dpShard) +
                        ";"),
        ValueRange{var});
  if (!mesh.defaultOrder())
    for (int i = 0; i < kNumMeshAxes; ++i)
      b.create<emitc::VerbatimOp>(
          loc,
          b.getStringAttr("{}.mesh.order[" + std::to_string(i) +
                          "] = " + axisLiteral(mesh.order[i]) + ";"),
          ValueRange{var});
  if (failed(target.addDeviceSetup(device, var, b)))
    return failure();
  if (gradientCheck) {
    Value result =
        b.create<emitc::CallOpaqueOp>(
             loc, TypeRange{b.getI32Type()}, "gradientCheckMain",
             b.getArrayAttr({b.getIndexAttr(0)}), nullptr,
             ValueRange{b.create<emitc::LoadOp>(loc, programType, var)})
            .getResult(0);
    b.create<emitc::ReturnOp>(loc, result);
    return success();
  }
  Value result =
      b.create<emitc::CallOpaqueOp>(
           loc, TypeRange{b.getI32Type()},
           inference ? "runInferenceMain" : target.runMain(),
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
                              const TargetInfo::DeviceInfo &device,
                              bool gradientCheck) {
  MLIRContext *ctx = program.getContext();
  auto step = program.lookupSymbol<func::FuncOp>("train_step");
  bool inference = !step;
  if (inference)
    step = program.lookupSymbol<func::FuncOp>("decode_step");
  if (!step)
    return program.emitOpError("has no train_step or decode_step function");

  // The parameters, declared by the step.
  SmallVector<rt::ParamOp> params;
  step.walk([&](rt::ParamOp p) { params.push_back(p); });
  auto variants = program->getAttrOfType<DenseI64ArrayAttr>("rt.variants");
  FailureOr<std::string> table =
      parameterTable(program, params, variants ? variants.size() : 1);
  if (failed(table))
    return failure();
  // An inference program's prefill step declares the same parameters.
  SmallVector<rt::ParamOp> declared = params;
  if (auto prefill = program.lookupSymbol<func::FuncOp>("prefill_step"))
    prefill.walk([&](rt::ParamOp p) { declared.push_back(p); });
  for (rt::ParamOp p : declared) {
    if (!p->use_empty())
      return p.emitOpError("is read directly; buffer planning resolves "
                           "parameters to their store");
    p.erase();
  }

  OpBuilder b(ctx);
  Location loc = program.getLoc();
  Block *body = program.getBody();
  std::string targetNote = target.describe(device);

  // A gradient check computes the loss and the gradients only.
  if (gradientCheck) {
    SmallVector<Operation *> optimizer;
    program.walk([&](Operation *op) {
      if (isa<rt::AdamWOp>(op))
        optimizer.push_back(op);
    });
    for (Operation *op : optimizer) {
      SmallVector<Operation *> inputs;
      for (Value v : op->getOperands())
        if (Operation *def = v.getDefiningOp())
          inputs.push_back(def);
      op->erase();
      for (Operation *def : inputs)
        if (isa<rt::LearningRateOp, rt::UpdateCountOp, rt::BufferOp,
                rt::ViewOp>(def) &&
            def->use_empty())
          def->erase();
    }
  }

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
  std::string what = inference ? "One rank's inference step (the forward "
                                 "pass of new tokens over a KV cache)"
                               : "One rank's training step";
  if (auto rank = program->getAttrOfType<IntegerAttr>("pipe.rank");
      rank && dist::meshOf(top)[MeshAxis::PP] > 1)
    what = "Pipeline rank " + std::to_string(rank.getInt()) +
           ": one rank's training step";
  if (variants) {
    what = "Pipeline ranks";
    for (int64_t r : variants.asArrayRef())
      what += (r == variants[0] ? " " : ", ") + std::to_string(r);
    what += ": one rank's training step, the same on each but for its "
            "parameters' names, its activation slots and its schedule "
            "(kVariants)";
  }
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
  int64_t numVariants = variants ? variants.size() : 1;
  b.create<emitc::GlobalOp>(
      loc, "kParams",
      emitc::ArrayType::get(
          {numVariants * (int64_t)std::max<size_t>(params.size(), 1)},
          opaque(ctx, "ParamInfo")),
      params.empty() ? Attribute() : opaqueAttr(ctx, *table), false, true,
      true);
  if (variants) {
    // Per pipeline rank served: its parameters (names) and activation
    // slots.
    auto slots =
        program->getAttrOfType<DenseI64ArrayAttr>("rt.variant_arena_slots");
    if (!slots || slots.size() != variants.size())
      return program.emitOpError("has rt.variants but no "
                                 "rt.variant_arena_slots of the same length");
    std::string slotList, variantList = "{\n";
    for (auto [k, rank] : llvm::enumerate(variants.asArrayRef())) {
      slotList += (k ? ", " : "") + std::to_string(slots[k]);
      variantList +=
          "    {" + std::to_string(rank) + ", kParams + " +
          std::to_string(k * params.size()) + ", " +
          std::to_string(rt::arenaSlotsBytes(program, k) +
                         intAttr(program, "rt.received_bytes") +
                         intAttr(program, "rt.transient_bytes")) +
          "},\n";
    }
    b.create<emitc::GlobalOp>(
        loc, "kArenaSlots",
        emitc::ArrayType::get({numVariants}, b.getI64Type()),
        opaqueAttr(ctx, "{" + slotList + "}"), false, true, true);
    b.create<emitc::GlobalOp>(
        loc, "kVariants",
        emitc::ArrayType::get({numVariants}, opaque(ctx, "ProgramVariant")),
        opaqueAttr(ctx, variantList + "}"), false, true, true);
    if (auto totals = program->getAttrOfType<DenseI64ArrayAttr>(
            "rt.variant_chunk_arena_total")) {
      std::string list;
      for (int64_t total : totals.asArrayRef())
        list += (list.empty() ? "" : ", ") + std::to_string(total);
      b.create<emitc::GlobalOp>(
          loc, "kArenaTotal",
          emitc::ArrayType::get({numVariants}, b.getI64Type()),
          opaqueAttr(ctx, "{" + list + "}"), false, true, true);
    }
  }
  // With an arena per chunk: the byte offset of each (chunk, microbatch)'s
  // place, chunk-major (by variant in a shared program).
  if (auto offsets = program->getAttrOfType<DenseI64ArrayAttr>(
          variants ? "rt.variant_chunk_arena_offsets"
                   : "rt.chunk_arena_offsets")) {
    std::string list = "{";
    for (auto [k, offset] : llvm::enumerate(offsets.asArrayRef()))
      list += (k ? (k % 12 ? ", " : ",\n    ") : "") + std::to_string(offset);
    b.create<emitc::GlobalOp>(
        loc, "kArenaOffsets",
        emitc::ArrayType::get({(int64_t)offsets.size()}, b.getI64Type()),
        opaqueAttr(ctx, list + "}"), false, true, true);
  }
  if (int64_t requests = intAttr(program, "rt.request_slots"))
    b.create<emitc::GlobalOp>(
        loc, kRequests,
        emitc::ArrayType::get({requests}, opaque(ctx, "CommRequest")),
        Attribute(), false, true, false);
  b.setInsertionPointToEnd(body);
  b.create<emitc::VerbatimOp>(loc, "} // namespace");
  if (failed(buildMain(program, top, params.size(), target, device,
                       gradientCheck, b)))
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
      if (failed(convertProgramToEmitC(program, top, *info, device,
                                       gradientCheck)))
        return signalPassFailure();
  }
};

} // namespace
