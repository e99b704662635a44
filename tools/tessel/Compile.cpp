//===- Compile.cpp - The compilation pipeline behind `tessel compile` -----===//
//
// spec -> graph (@forward) -> autodiff (@train_step) -> buffer plan -> C++ ->
// binary, with every stage's IR kept in ir/ and a plan.json that maps ranks
// to programs.
//
//===----------------------------------------------------------------------===//

#include "Compile.h"
#include "Commands.h"

#include "dialects/Dist/DistOps.h"
#include "dialects/Pipe/PipeOps.h"
#include "dialects/Graph/GraphOps.h"
#include "dialects/Rt/RtOps.h"
#include "tessel/Conversion/RtToEmitC/TargetInfo.h"
#include "tessel/Emission/BuildProgram.h"
#include "tessel/Frontend/ModelBuilder.h"
#include "tessel/Frontend/Nesting.h"
#include "tessel/InitAllDialects.h"
#include "tessel/Pipelines/TrainPipeline.h"
#include "tessel/Frontend/Spec.h"
#include "tessel/Transforms/Passes.h"

#include "mlir/Dialect/EmitC/IR/EmitC.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/Target/Cpp/CppEmitter.h"
#include "mlir/IR/Diagnostics.h"
#include "mlir/IR/MLIRContext.h"
#include "mlir/IR/Verifier.h"
#include "mlir/Parser/Parser.h"
#include "mlir/Pass/PassManager.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/FormatVariadic.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/Process.h"
#include "llvm/Support/Signals.h"
#include "llvm/Support/Program.h"
#include "llvm/Support/SourceMgr.h"
#include "llvm/Support/ToolOutputFile.h"
#include "llvm/Support/raw_ostream.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include <cstring>
#include <map>
#include <optional>
#include <sys/wait.h>
#include <unistd.h>

using namespace mlir;
using namespace tessel;
using json = nlohmann::ordered_json;

namespace {

llvm::Error writeFile(llvm::StringRef path, llvm::StringRef text) {
  std::error_code ec;
  llvm::raw_fd_ostream os(path, ec);
  if (ec)
    return llvm::createStringError("cannot write " + path + ": " +
                                   ec.message());
  os << text;
  return llvm::Error::success();
}

std::string printModule(ModuleOp module) {
  std::string text;
  llvm::raw_string_ostream os(text);
  module.print(os);
  return text;
}

// Collects diagnostics so they can be returned as one error.
struct DiagnosticCollector {
  DiagnosticCollector(MLIRContext &ctx)
      : handler(&ctx, [this](Diagnostic &d) {
          std::string text;
          llvm::raw_string_ostream os(text);
          os << d.getLocation() << ": " << d;
          for (Diagnostic &note : d.getNotes())
            os << "\n  note: " << note;
          messages += (messages.empty() ? "" : "\n") + text;
          return success();
        }) {}
  llvm::Error error(const llvm::Twine &what) {
    return llvm::createStringError(what +
                                   (messages.empty() ? "" : ":\n" + messages));
  }
  ScopedDiagnosticHandler handler;
  std::string messages;
};

// One collective call of a step as the runtime counts it.
struct CollectiveCall {
  std::string kind; // all_reduce, all_gather, reduce_scatter, send_recv
  AxisSet axes;
  int64_t groupSize;
  int64_t elements; // as counted by the runtime (see Comm.h)
  int64_t elementBytes;
  int64_t bytesSent; // textbook volume (CommVolume.h)
  std::string what;  // the op it implements
  int64_t count = 1; // times a step runs it (a part runs per microbatch)
};

// The layout of the compiled module: its mesh and virtual stages.
MeshLayout layoutOf(ModuleOp module) {
  return MeshLayout(dist::meshOf(module),
                    pipe::layoutOf(module).getVirtualStages());
}

json commReport(const std::vector<CollectiveCall> &calls) {
  json perStep = json::array();
  json totals = json::object();
  for (const CollectiveCall &c : calls) {
    perStep.push_back({{"collective", c.kind},
                       {"axes", c.axes.str()},
                       {"group", c.groupSize},
                       {"elements", c.elements},
                       {"element_bytes", c.elementBytes},
                       {"bytes_sent", c.bytesSent},
                       {"count", c.count},
                       {"op", c.what}});
    json &t = totals[c.kind];
    if (t.is_null())
      t = {{"calls", 0}, {"elements", 0}, {"bytes_sent", 0}};
    t["calls"] = t["calls"].get<int64_t>() + c.count;
    t["elements"] = t["elements"].get<int64_t>() + c.count * c.elements;
    t["bytes_sent"] = t["bytes_sent"].get<int64_t>() + c.count * c.bytesSent;
  }
  return {{"per_step", perStep}, {"per_step_totals", totals}};
}

// One distinct program: the function it is emitted from and what it does.
struct ProgramOut {
  std::string name; // program0, or stage0, stage1, ...
  // The binary that runs it: its own, or one it shares with pipeline ranks
  // alike (stages1-14; see tessel-share-programs).
  std::string binary;
  std::vector<CollectiveCall> calls;
  json memory;
  json parameters = json::array(); // name, program, local_shape, ...
  int64_t paramElems = 0;
};

// What a rank program on rt (after convert-pipe-to-rt) holds: its
// parameters, its memory plan, and every collective of one step in the
// order the step runs them (each part's calls once per time it runs).
ProgramOut describeRtProgram(ModuleOp top, ModuleOp program,
                              const TargetInfo *device) {
  ProgramOut out;
  out.name = program.getSymName() ? program.getSymName()->str() : "program0";
  auto attr = [&](StringRef name) -> int64_t {
    auto a = program->getAttrOfType<IntegerAttr>(name);
    return a ? a.getInt() : 0;
  };
  MeshShape mesh = dist::meshOf(top);
  auto step = program.lookupSymbol<func::FuncOp>("train_step");
  bool inference = !step;
  if (inference)
    step = program.lookupSymbol<func::FuncOp>("decode_step");
  // An entry per collective: the n-th of its op, kind, axes and size in
  // one call of its part, the part named by its kind and chunk (a
  // backward part's copy for its last microbatch is that part too: only
  // the collectives it adds are new entries), or in the step itself.
  using Entry = std::tuple<std::string, std::string, int64_t>;
  std::map<Entry, size_t> entryOf;
  std::string part; // empty: the step's own ops
  std::map<std::string, int64_t> seen, seenInStep;
  std::function<void(Operation *)> visit = [&](Operation *op) {
    if (auto call = dyn_cast<func::CallOp>(op)) {
      if (auto callee = program.lookupSymbol<func::FuncOp>(call.getCallee())) {
        auto kind = callee->getAttrOfType<StringAttr>("rt.part");
        auto chunk = callee->getAttrOfType<IntegerAttr>("rt.part_chunk");
        part = (kind ? kind.getValue() : callee.getSymName()).str() +
               (chunk ? std::to_string(chunk.getInt()) : "");
        seen.clear();
        callee.walk([&](Operation *inner) { visit(inner); });
        part.clear();
      }
      return;
    }
    if (auto p = dyn_cast<rtir::ParamOp>(op)) {
      auto type = cast<MemRefType>(p.getType());
      out.paramElems += type.getNumElements();
      json entry = {{"name", p.getName().str()},
                    {"program", out.name},
                    {"local_shape", type.getShape().vec()}};
      if (static_cast<int64_t>(p.getShardDim()) >= 0)
        entry["shard"] = {{"dim", static_cast<int64_t>(p.getShardDim())},
                          {"axis", meshAxisName(p.getShardAxis())},
                          {"blocks", static_cast<int64_t>(p.getShardBlocks())}};
      // Cut a second time (an expert's width over tp, the experts over ep).
      if (auto second = p->getAttrOfType<DenseI64ArrayAttr>("second_shard");
          second && second.size() == 2)
        entry["shard"]["second"] = {
            {"dim", second[0]},
            {"axis", meshAxisName(static_cast<MeshAxis>(second[1]))}};
      // In bf16, its bf16 copy gathered in bf16 from its fp32 master
      // weights' dp pieces (ZeRO-1/2: kept as pieces only).
      if (p->hasAttr("bf16_gather"))
        entry["bf16_gather"] = true;
      out.parameters.push_back(entry);
      return;
    }
    auto comm = dyn_cast<rtir::CommunicationOpInterface>(op);
    if (!comm)
      return;
    SmallVector<rtir::CollectiveRecord> records;
    comm.describeCommunication(mesh, records);
    std::string what = op->getName().getStringRef().str();
    if (auto loc = dyn_cast<NameLoc>(op->getLoc()))
      what += " @ " + loc.getName().getValue().str();
    // One entry per collective of the program, counted each time the step
    // runs it: a part that runs per microbatch lists its collectives once.
    for (auto [k, r] : llvm::enumerate(records)) {
      std::string key = what + "|" + std::to_string(k) + "|" + r.kind + "|" +
                        r.axes.str() + "|" + std::to_string(r.elements);
      int64_t n = (part.empty() ? seenInStep : seen)[key]++;
      auto [it, inserted] =
          entryOf.try_emplace(Entry{part, key, n}, out.calls.size());
      if (!inserted) {
        ++out.calls[it->second].count;
        continue;
      }
      out.calls.push_back({r.kind, r.axes, r.groupSize, r.elements,
                           r.elementBytes, r.bytesSent, what});
    }
  };
  if (step)
    for (Operation &op : step.getBody().front())
      visit(&op);
  int64_t params = attr("rt.param_elems");
  if (inference) {
    // An inference program holds its parameters, the KV cache, the arena
    // of one step and the logits it hands out.
    int64_t logits = 0;
    program.walk([&](rtir::BufferOp b) {
      if (b.getSpace() == rtir::Space::Logits)
        logits = std::max<int64_t>(
            logits, cast<MemRefType>(b.getType()).getNumElements() * 4);
    });
    json m;
    m["params_bytes"] = params * 4;
    m["kv_cache_bytes"] = attr("rt.kv_cache_elems") * 4;
    m["activation_bytes"] = attr("rt.arena_bytes");
    m["logits_bytes"] = logits;
    m["total_bytes"] = params * 4 + attr("rt.kv_cache_elems") * 4 +
                       attr("rt.arena_bytes") + logits;
    out.memory = m;
    return out;
  }
  // Each microbatch in flight holds a slot of what crosses from one part to
  // another; what lives within one run of a part shares one region.
  // With an arena per chunk (the interleaved schedule), each chunk of a
  // microbatch in flight holds its own place instead.
  bool byChunk = program->hasAttr("rt.chunk_arena_offsets");
  int64_t slotsBytes = rtir::arenaSlotsBytes(program);
  int64_t arena = slotsBytes + attr("rt.transient_bytes");
  json m;
  // With the parameters sharded (parallel.zero 3): the pieces, the
  // parameters kept whole and the runs gathered for the parts.
  int64_t paramStore = attr("rt.param_store_elems") > 0
                           ? attr("rt.param_store_elems")
                           : params;
  m["params_bytes"] = paramStore * 4;
  if (attr("rt.param_store_elems") > 0) {
    m["param_piece_bytes"] = attr("rt.param_piece_elems") * 4;
    m["param_gather_bytes"] = attr("rt.param_gather_elems") * 4;
    // In bf16, the slots of the runs gathered in bf16 (in the copy alone).
    m["param_gather_bf16_bytes"] = attr("rt.shadow_extra_elems") * 2;
    m["param_whole_bytes"] = (attr("rt.param_store_elems") -
                              attr("rt.param_piece_elems") -
                              attr("rt.param_gather_elems")) *
                             4;
  }
  // With gradients kept as pieces (parallel.zero 2): the pieces, the runs
  // being reduced (staging) and the gradients outside the runs.
  int64_t grads =
      attr("rt.grad_elems") > 0 ? attr("rt.grad_elems") : params;
  m["grads_bytes"] = grads * 4;
  if (attr("rt.grad_elems") > 0) {
    m["grad_piece_bytes"] = attr("rt.grad_piece_elems") * 4;
    m["grad_whole_bytes"] = attr("rt.grad_whole_elems") * 4;
    m["grad_scratch_bytes"] = attr("rt.grad_scratch_elems") * 4;
    m["grad_staging_bytes"] = attr("rt.grad_staging_elems") * 4;
  }
  // With the optimizer sharded over dp (parallel.zero 1), the moments of
  // this rank's pieces.
  int64_t moments = attr("rt.optimizer_elems") > 0
                        ? attr("rt.optimizer_elems")
                        : params;
  m["optimizer_bytes"] = moments * 8;
  // Offloaded (parallel.offload = "optimizer"): the moments are in pinned
  // host memory, outside the device total.
  bool offloaded = false;
  if (auto recipe = top->getAttrOfType<DictionaryAttr>("graph.recipe"))
    if (auto offload = recipe.getAs<StringAttr>("offload"))
      offloaded = offload.getValue() == "optimizer";
  // With the parameters sharded too, their pieces (the master weights the
  // parts gather from) are offloaded beside the moments.
  int64_t offloadedPieces = offloaded ? attr("rt.param_piece_elems") : 0;
  if (offloaded)
    m["offloaded_bytes"] = moments * 8 + offloadedPieces * 4;
  m["activation_bytes"] = arena;
  // Microbatches whose activations the rank holds at once (1F1B: p - r),
  // what each holds from its forward to its backward pass (with several
  // slots; with one, the slot also holds what lives within a part), and the
  // region the parts share.
  // With an arena per chunk, the slots are whole stages' worth (the
  // chunks' places over a microbatch's whole stage), and the chunks in
  // flight at once are counted too.
  if (byChunk && attr("rt.arena_bytes") > 0) {
    m["activation_slots"] = double(slotsBytes) / attr("rt.arena_bytes");
    m["activation_chunks_in_flight"] = attr("rt.chunks_in_flight");
  } else {
    m["activation_slots"] = std::max<int64_t>(1, attr("rt.arena_slots"));
  }
  m["activation_slot_bytes"] = attr("rt.arena_bytes");
  m["transient_bytes"] = attr("rt.transient_bytes");
  m["accumulator_bytes"] = attr("rt.accumulator_elems") * 4;
  m["norm_sums_bytes"] = attr("rt.norm_sums") * 8;
  // Parameters of other ranks held for the step (a tied embedding's copy on
  // the last stage).
  m["received_param_bytes"] = attr("rt.received_bytes");
  int64_t total = (paramStore - offloadedPieces) * 4 + grads * 4 +
                  (offloaded ? 0 : moments * 8) +
                  arena + attr("rt.accumulator_elems") * 4 +
                  attr("rt.norm_sums") * 8 + attr("rt.received_bytes");
  // bf16 programs multiply with a bf16 copy of the parameters (with the
  // parameters sharded: of those kept whole and the gathered runs; with
  // the master weights of runs kept as pieces under ZeRO-1/2, also of
  // those runs, whole).
  bool shadow = false;
  program.walk([&](rtir::BufferOp b) {
    shadow |= b.getSpace() == rtir::Space::Shadow;
  });
  if (shadow) {
    int64_t copied = paramStore - attr("rt.param_piece_elems") +
                     attr("rt.shadow_extra_elems");
    m["param_shadow_bytes"] = copied * 2;
    total += copied * 2;
  }
  // The buffers sized at start for the step's communication: the send
  // ring's slots that the forward and backward sends' copies take in turn,
  // a buffer for each other pipeline send (held until the step waits for
  // its sends), and on a device the largest gather or reduce-scatter along
  // an inner dimension's staging.
  // On the CPU, the send buffers the runtime allocates at start
  // (commReserveSends).
  rtir::SendBuffers sends = rtir::sendBuffersOf(program, device ? 256 : 64);
  if (sends.total() > 0 || device) {
    m["send_buffer_bytes"] = sends.total();
    if (sends.ringSlots > 0) {
      m["send_ring_slots"] = sends.ringSlots;
      m["send_slot_bytes"] = sends.slotBytes;
    }
    total += sends.total();
  }
  if (device) {
    TargetInfo::DeviceInfo info = device->deviceInfo(program, top);
    m["staging_bytes"] = info.stagingBytes;
    total += info.stagingBytes;
  }
  m["total_bytes"] = total;
  out.memory = m;
  return out;
}

// Every rank program of `top` (after convert-pipe-to-rt), described.
std::vector<ProgramOut> describeRtPrograms(ModuleOp top,
                                           const TargetInfo *device) {
  std::vector<ProgramOut> programs;
  for (auto program : top.getOps<ModuleOp>())
    if (program->hasAttr("rt.arena_bytes"))
      programs.push_back(describeRtProgram(top, program, device));
  return programs;
}

json planJson(const Spec &spec, ModuleOp module,
              const std::vector<ProgramOut> &programs,
              const CompileOptions &options) {
  const ParallelSpec &par = spec.parallel;
  MeshLayout layout = layoutOf(module);
  int64_t world = layout.worldSize();
  json plan;
  plan["name"] = spec.name;
  plan["target"] = options.target;
  plan["fused_kernels"] =
      options.fuseKernels.value_or(options.target == "cuda");
  if (options.target == "cuda") {
    plan["cuda_arch"] = options.cudaArch;
    plan["precision"] = spec.train.precision;
  } else {
    plan["precision"] = "fp32";
  }
  plan["world_size"] = world;
  json mesh = json::object();
  for (MeshAxis axis : kRankOrder)
    if (axis == MeshAxis::PP || axis == MeshAxis::DP || axis == MeshAxis::TP ||
        layout.size(axis) > 1)
      mesh[meshAxisName(axis)] = layout.size(axis);
  plan["mesh"] = mesh;
  plan["order"] = layout.shape().orderName();
  plan["sequence_parallel"] = par.sequenceParallel;
  if (par.expertTp > 1)
    plan["expert_tp"] = par.expertTp;
  plan["microbatches"] = par.microbatches;
  plan["zero"] = par.zero;
  if (par.zero > 0 && par.zeroGroup > 0 && par.zeroGroup < par.dp)
    plan["zero_group"] = par.zeroGroup;
  if (par.offload != "none")
    plan["offload"] = par.offload;
  // Whether a bf16 program gathers the matmuls' weights in bf16 from their
  // master weights' pieces (ZeRO-1/2: keeping those as pieces only).
  if (par.zero >= 1 && options.target == "cuda" &&
      spec.train.precision == "bf16")
    plan["master_pieces"] = par.masterPieces;
  if (par.pp > 1) {
    plan["schedule"] = par.schedule;
    plan["virtual_stages"] = par.virtualStages;
  }
  json ranks = json::array();
  for (int64_t r = 0; r < world; ++r) {
    MeshCoords c = layout.coordsOf(r);
    json coords = json::object();
    for (auto &[name, size] : mesh.items())
      coords[name] = c[*parseMeshAxis(name)];
    ranks.push_back({{"rank", r},
                     {"program", programs[layout.programOf(r)].name},
                     {"coords", coords}});
  }
  plan["ranks"] = ranks;
  if (options.inference) {
    int64_t chunk = 1, prefill = 1, cache = 0;
    for (auto program : module.getOps<ModuleOp>()) {
      if (auto c = program->getAttrOfType<IntegerAttr>("rt.chunk"))
        chunk = c.getInt();
      if (auto c = program->getAttrOfType<IntegerAttr>("rt.prefill_chunk"))
        prefill = c.getInt();
    }
    if (!programs.empty())
      cache = programs.front().memory.value("kv_cache_bytes", int64_t(0));
    plan["inference"] = {{"batch", spec.train.globalBatch},
                         {"chunk", chunk},
                         {"prefill_chunk", prefill},
                         {"max_len", spec.model.seqLen},
                         {"kv_cache_bytes", cache}};
  }
  json paramList = json::array();
  for (const ProgramOut &program : programs) {
    for (const json &p : program.parameters)
      paramList.push_back(p);
    plan["programs"][program.name] = {
        {"binary", "bin/" + program.binary},
        {"source", "src/" + program.binary +
                       (options.target == "cuda" ? ".cu" : ".cpp")},
        {"ranks", layout.ranksPerProgram()},
        {"parameters", program.paramElems},
        {"parameter_tensors", program.parameters.size()},
        {"memory", program.memory},
        {"comm", commReport(program.calls)}};
  }
  const TrainSpec &t = spec.train;
  plan["train"] = {{"global_batch", t.globalBatch},
                   {"seq_len", spec.model.seqLen},
                   {"steps", t.steps},
                   {"seed", t.seed},
                   {"lr", t.lr},
                   {"decay", t.decay},
                   {"recompute", t.recompute},
                   {"recompute_layers", t.recomputeLayers},
                   {"attention", t.attention}};
  const ModelSpec &model = spec.model;
  plan["model"] = {{"family", model.family},
                   {"vocab_size", model.vocabSize},
                   {"seq_len", model.seqLen},
                   {"layers", model.layers},
                   {"hidden", model.hidden},
                   {"heads", model.heads},
                   {"kv_heads", model.kvHeads},
                   {"dropout", model.dropout},
                   {"attention_dropout", model.attentionDropout},
                   {"ffn_hidden", model.ffnHidden},
                   {"tie_embeddings", model.tieEmbeddings},
                   {"norm_eps", model.normEps},
                   {"rope_theta", model.ropeTheta}};
  // Only a padded vocabulary records its padded size (the embedding's rows).
  if (model.paddedVocab() != model.vocabSize)
    plan["model"]["padded_vocab_size"] = model.paddedVocab();
  // Only a mixture-of-experts model records its experts.
  if (model.moe.enabled())
    plan["model"]["moe"] = {
        {"experts", model.moe.experts},
        {"top_k", model.moe.topK},
        {"every", model.moe.every},
        {"ffn_hidden", model.moe.ffnHidden},
        {"shared_experts", model.moe.sharedExperts},
        {"capacity_factor", model.moe.capacityFactor > 0
                                ? json(model.moe.capacityFactor)
                                : json(nullptr)},
        {"aux_loss_coef", model.moe.auxLossCoef},
        {"z_loss_coef", model.moe.zLossCoef}};
  // Model FLOPs per trained token, as the programs count MFU by
  // (docs/metrics.md). Derived from the model, so not one of the model
  // fields a checkpoint is matched by.
  if (auto recipe = module->getAttrOfType<DictionaryAttr>("graph.recipe"))
    if (auto flops = recipe.getAs<FloatAttr>("flops_per_token"))
      plan["model_flops_per_token"] = flops.getValueAsDouble();
  // A blend's datasets are listed in data/blend.json, which the runtime
  // reads (the path is relative to the plan directory).
  plan["data"] = {{"format", spec.data.format},
                  {"path", spec.data.format == "blend" ? "data/blend.json"
                                                       : spec.data.path},
                  {"shuffle", spec.data.shuffle},
                  {"seed", spec.data.seed}};
  if (!spec.data.valid.empty())
    plan["data"]["valid"] = spec.data.valid;
  plan["parameters"] = paramList;
  return plan;
}

// `text` as one word of a POSIX shell command: in single quotes, each of its
// own single quotes written '\''.
std::string shellQuoted(llvm::StringRef text) {
  std::string out = "'";
  for (char c : text)
    out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Letters, digits, '.', '_' and '-': what may reach a launch file unquoted
// (the job name, binary names).
bool isPlainWord(llvm::StringRef text) {
  return !text.empty() && llvm::all_of(text, [](char c) {
    return llvm::isAlnum(c) || c == '.' || c == '_' || c == '-';
  });
}

// The #SBATCH resource lines of a plan of `world` ranks. CPU plans ask for
// one node; CUDA plans for one GPU per rank, up to 8 ranks per node, each
// rank seeing all GPUs of its node (NCCL's peer transfers need them) and
// taking the one of its node-local rank.
std::string sbatchResources(int64_t world, bool cuda) {
  constexpr int64_t kGpusPerNode = 8;
  int64_t perNode = cuda && world > kGpusPerNode ? kGpusPerNode : world;
  int64_t nodes = (world + perNode - 1) / perNode;
  std::string lines = "#SBATCH --nodes=" + std::to_string(nodes) +
                      "\n#SBATCH --ntasks=" + std::to_string(world) +
                      "\n#SBATCH --ntasks-per-node=" + std::to_string(perNode) +
                      "\n";
  if (cuda)
    lines += "#SBATCH --gpus-per-node=" + std::to_string(perNode) + "\n";
  return lines + "#SBATCH --cpus-per-task=1\n#SBATCH --time=01:00:00\n";
}

// The end of a launch script: `command` (which passes on "$@" and, on a
// restart, ${resume:+--resume "$resume"}) run as `tessel run` runs it. With
// --max-restarts K (taken out of the arguments; it needs --ckpt-dir DIR) a
// failed run starts again from the newest committed checkpoint in DIR, up
// to K times; a stop signal is passed to the run and ends the script.
// Without it the script execs the command, as before.
std::string restartingLaunch(llvm::StringRef name, llvm::StringRef command) {
  std::string n = name.str(), c = command.str();
  return "# --max-restarts K (with --ckpt-dir DIR): a failed run starts again "
         "from the\n# newest committed checkpoint in DIR, up to K times, as "
         "`tessel run` does.\n"
         "restarts=0\n"
         "ckpt=\n"
         "n=$#\n"
         "while [ \"$n\" -gt 0 ]; do\n"
         "  arg=$1\n"
         "  shift\n"
         "  n=$((n - 1))\n"
         "  case $arg in\n"
         "    --max-restarts=*) restarts=${arg#*=} ;;\n"
         "    --max-restarts)\n"
         "      restarts=${1-}\n"
         "      if [ \"$n\" -gt 0 ]; then shift; n=$((n - 1)); fi ;;\n"
         "    *)\n"
         "      case $arg in --ckpt-dir=*) ckpt=${arg#*=} ;; --ckpt-dir) "
         "ckpt=${1-} ;; esac\n"
         "      set -- \"$@\" \"$arg\" ;;\n"
         "  esac\n"
         "done\n"
         "case $restarts in\n"
         "  ''|*[!0-9]*)\n"
         "    echo \"" + n + ": --max-restarts expects a non-negative integer, "
         "got '$restarts'\" >&2\n"
         "    exit 2 ;;\n"
         "esac\n"
         "if [ \"$restarts\" -gt 0 ] && [ -z \"$ckpt\" ]; then\n"
         "  echo \"" + n + ": --max-restarts needs --ckpt-dir DIR (where a "
         "restarted run resumes from)\" >&2\n"
         "  exit 2\n"
         "fi\n"
         "resume=\n"
         "if [ \"$restarts\" -eq 0 ]; then\n"
         "  exec " + c + "\n"
         "fi\n"
         "child=\n"
         "stopped=\n"
         "trap 'stopped=1; [ -n \"$child\" ] && kill -TERM \"$child\" "
         "2>/dev/null' TERM INT HUP\n"
         "attempt=0\n"
         "while :; do\n"
         "  " + c + " &\n"
         "  child=$!\n"
         "  wait \"$child\"\n"
         "  rc=$?\n"
         "  while [ -n \"$stopped\" ] && kill -0 \"$child\" 2>/dev/null; do\n"
         "    wait \"$child\"\n"
         "    rc=$?\n"
         "  done\n"
         "  if [ \"$rc\" -eq 0 ] || [ -n \"$stopped\" ] || [ \"$rc\" -eq 2 ] ||\n"
         "     [ \"$attempt\" -ge \"$restarts\" ]; then\n"
         "    exit \"$rc\"\n"
         "  fi\n"
         "  attempt=$((attempt + 1))\n"
         "  resume=\n"
         "  for manifest in \"$ckpt\"/step-*/manifest.json; do\n"
         "    [ -f \"$manifest\" ] && resume=$ckpt\n"
         "  done\n"
         "  echo \"" + n + ": restart $attempt of $restarts after exit code "
         "$rc: resuming from ${resume:-the start}\" >&2\n"
         "done\n";
}

// launch/mpirun.sh (MPMD form: one `-np N binary` per distinct program),
// launch/slurm.sbatch (srun starting each rank's program) and
// launch/multi-prog.conf (the same ranks -> programs for srun --multi-prog).
// Both scripts run what `tessel run` runs: the binaries of the plan directory
// they are in, the spec's data file unless --data is given, and the other
// arguments as given, from any directory. Only the data path comes from the
// user (quoted); the job and binary names are checked plain words.
llvm::Error writeLaunchFiles(llvm::StringRef out, const Spec &spec, bool cuda,
                             const MeshLayout &layout,
                             const std::vector<ProgramOut> &programs) {
  if (!isPlainWord(spec.name))
    return llvm::createStringError("the job name '" + spec.name +
                                   "' is not letters, digits, '.', '_', '-'");
  for (const ProgramOut &program : programs)
    if (!isPlainWord(program.binary))
      return llvm::createStringError("the binary name '" + program.binary +
                                     "' is not a plain word");
  if (spec.data.path.find('\0') != std::string::npos)
    return llvm::createStringError("data.path holds a NUL character");
  if (spec.data.valid.find('\0') != std::string::npos)
    return llvm::createStringError("data.valid holds a NUL character");
  int64_t perProgram = layout.ranksPerProgram();
  std::string np = std::to_string(layout.worldSize());
  llvm::SmallString<256> mpirun(out), sbatch(out), conf(out);
  llvm::sys::path::append(mpirun, "launch", "mpirun.sh");
  llvm::sys::path::append(sbatch, "launch", "slurm.sbatch");
  llvm::sys::path::append(conf, "launch", "multi-prog.conf");
  // MPMD: one "-np N binary args" segment per distinct program, in rank order.
  // Binaries are found beside the script, and the arguments (a relative
  // --data too) mean what they mean where the script is started; the spec's
  // data file is passed as `tessel run` passes it, unless --data is given.
  // Consecutive programs that share a binary are one segment, and one range
  // of ranks in the Slurm files.
  std::string segments, confLines, rankCases;
  for (size_t k = 0, end = k; k < programs.size(); k = end) {
    while (end < programs.size() && programs[end].binary == programs[k].binary)
      ++end;
    int64_t first = layout.firstRankOfProgram(k),
            count = perProgram * static_cast<int64_t>(end - k);
    std::string from = std::to_string(first),
                to = std::to_string(first + count - 1);
    segments += std::string(k ? " \\\n  : " : "") + "-np " +
                std::to_string(count) + " \"$here/bin/" + programs[k].binary +
                "\" ${data:+--data \"$data\"} ${valid:+--valid-data \"$valid\"} \"$@\" "
                "${resume:+--resume \"$resume\"}";
    confLines += from + "-" + to + " bin/" + programs[k].binary + "\n";
    rankCases += "if [ \"$SLURM_PROCID\" -ge " + from +
                 " ] && [ \"$SLURM_PROCID\" -le " + to +
                 " ]; then exec \"$0/bin/" + programs[k].binary +
                 "\" \"$@\"; fi\n";
  }
  std::string data = spec.data.format == "blend" ? "\"$here/data/blend.json\""
                     : spec.data.format != "synthetic"
                         ? shellQuoted(spec.data.path)
                         : "''";
  std::string valid =
      spec.data.valid.empty() ? "''" : shellQuoted(spec.data.valid);
  std::string script = "#!/bin/sh\n# Launches all " + np +
                       " ranks of this plan (MPMD), as `tessel run` does:\n"
                       "#   launch/mpirun.sh [--steps N] [--data FILE] ...\n"
                       "here=$(cd \"$(dirname \"$0\")/..\" && pwd) || exit 1\n"
                       "data=" + data + "\n"
                       "valid=" + valid + "\n"
                       "for arg in \"$@\"; do\n"
                       "  case \"$arg\" in --data|--data=*) data= ;; "
                       "--valid-data|--valid-data=*) valid= ;; esac\n"
                       "done\n"
                       "extra=\"\"\n"
                       "export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}\n"
                       "[ \"$(id -u)\" = 0 ] && extra=\"--allow-run-as-root\"\n" +
                       restartingLaunch("mpirun.sh",
                                        "mpirun $extra --oversubscribe \\\n  " +
                                            segments);
  if (llvm::Error err = writeFile(mpirun, script))
    return err;
  llvm::sys::fs::setPermissions(mpirun, llvm::sys::fs::all_read |
                                            llvm::sys::fs::all_exe |
                                            llvm::sys::fs::owner_write);
  if (llvm::Error err = writeFile(
          conf, "# Ranks -> program, as launch/slurm.sbatch starts them (for "
                "srun --multi-prog\n# in the plan directory; arguments after "
                "the program)\n" +
                    confLines))
    return err;
  std::string batch =
      "#!/bin/bash\n"
      "# Trains all " + np +
      " ranks of this plan under Slurm, as `tessel run DIR` does:\n"
      "#   sbatch [OPTIONS] DIR/launch/slurm.sbatch [--steps N] [--data FILE] "
      "...\n"
      "# from any directory. The arguments go to every rank; relative paths in "
      "them\n"
      "# are relative to the job's working directory (where sbatch runs, or "
      "its\n"
      "# --chdir). sbatch's OPTIONS override the lines below; --cpus-per-task "
      "sets\n"
      "# each rank's threads. Ranks are ordered " +
      layout.shape().orderName() +
      " (innermost first): keep the\n"
      "# inner groups on one node. SLURM_MPI_TYPE chooses srun's --mpi "
      "(default pmix).\n"
      "#SBATCH --job-name=" + spec.name + "\n" +
      sbatchResources(layout.worldSize(), cuda) +
      "set -u\n"
      "# sbatch runs a copy of this script: the plan directory is found from "
      "the path\n"
      "# it was submitted as (scontrol's Command=: that path, relative to the "
      "submit\n"
      "# directory, and the arguments), or from $0 when it is run directly.\n"
      "unset CDPATH\n"
      "script=$0\n"
      "if [ ! -f \"$(dirname \"$script\")/../plan.json\" ] && "
      "[ -n \"${SLURM_JOB_ID:-}\" ]; then\n"
      "  script=$(scontrol show job \"$SLURM_JOB_ID\" 2>/dev/null |\n"
      "    sed -n 's/^ *Command=//p' | head -n 1)\n"
      "  [ $# -gt 0 ] && script=${script%\" $*\"}\n"
      "  case $script in \"\"|/*) ;; *) script=${SLURM_SUBMIT_DIR:-.}/$script "
      ";; esac\n"
      "fi\n"
      "here=\n"
      "[ -n \"$script\" ] &&\n"
      "  here=$(cd \"$(dirname \"$script\")/..\" 2>/dev/null && pwd)\n"
      "if [ -z \"$here\" ] || [ ! -f \"$here/plan.json\" ]; then\n"
      "  echo \"slurm.sbatch: cannot find the plan directory; submit this "
      "script as\" \\\n"
      "    \"sbatch DIR/launch/slurm.sbatch [ARGS]\" >&2\n"
      "  exit 1\n"
      "fi\n"
      "data=" + data + "\n"
      "valid=" + valid + "\n"
      "for arg in \"$@\"; do\n"
      "  case \"$arg\" in --data|--data=*) data= ;; "
      "--valid-data|--valid-data=*) valid= ;; esac\n"
      "done\n"
      "threads=${SLURM_CPUS_PER_TASK:-1}\n"
      "export OMP_NUM_THREADS=$threads\n"
      "export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}\n"
      "# Each task runs its rank's program ($0: the plan directory); a CUDA "
      "rank\n"
      "# takes the GPU of its node-local rank (SLURM_LOCALID).\n"
      "rank='" + rankCases +
      "echo \"slurm.sbatch: no program for rank $SLURM_PROCID\" >&2; exit 1'\n" +
      restartingLaunch(
          "slurm.sbatch",
          "srun --mpi=\"${SLURM_MPI_TYPE:-pmix}\" --ntasks=" + np +
              " --cpus-per-task=\"$threads\" \\\n"
              "  --kill-on-bad-exit=1 /bin/sh -c \"$rank\" \"$here\" \\\n"
              "  ${data:+--data \"$data\"} ${valid:+--valid-data \"$valid\"} "
              "--threads \"$threads\" \"$@\" "
              "${resume:+--resume \"$resume\"}");
  return writeFile(sbatch, batch);
}

// Replaces `dir` with the finished `staging` directory. Refuses to replace a
// directory that is not a previous tessel output.
llvm::Error publish(llvm::StringRef staging, llvm::StringRef dir) {
  if (llvm::sys::fs::exists(dir)) {
    if (!llvm::sys::fs::is_directory(dir))
      return llvm::createStringError(
          dir + " exists and is not a directory; refusing to overwrite it");
    llvm::SmallString<256> plan(dir);
    llvm::sys::path::append(plan, "plan.json");
    std::error_code ec;
    bool empty = llvm::sys::fs::directory_iterator(dir, ec) ==
                     llvm::sys::fs::directory_iterator() &&
                 !ec;
    if (!llvm::sys::fs::exists(plan) && !empty)
      return llvm::createStringError(
          dir + " exists and is not a tessel output directory (no plan.json); "
                "refusing to overwrite it");
    if (std::error_code err = llvm::sys::fs::remove_directories(dir))
      return llvm::createStringError("cannot replace " + dir + ": " +
                                     err.message());
  }
  if (std::error_code ec = llvm::sys::fs::rename(staging, dir))
    return llvm::createStringError("cannot write " + dir + ": " + ec.message());
  return llvm::Error::success();
}

// Writes the IR of each stage of the training pipeline as the pass that
// ends it finishes (ir/NN-name.mlir), and names a pass that fails.
class StageDumper : public PassInstrumentation {
public:
  StageDumper(const std::vector<PipelineStage> &stages,
              llvm::function_ref<llvm::Error(const char *)> write,
              llvm::function_ref<void(StringRef pass)> observe = {})
      : stages(stages), write(write), observe(observe) {}
  void runAfterPass(Pass *pass, Operation *) override {
    if (observe)
      observe(pass->getArgument());
    for (const PipelineStage &stage : stages)
      if (pass->getArgument() == stage.pass && !error)
        error = write(stage.file);
  }
  void runAfterPassFailed(Pass *pass, Operation *) override {
    failedPass = pass->getArgument().str();
  }
  const std::vector<PipelineStage> &stages;
  llvm::function_ref<llvm::Error(const char *)> write;
  llvm::function_ref<void(StringRef pass)> observe;
  llvm::Error error = llvm::Error::success();
  std::string failedPass = "compilation";
};

// The front half of the compile: spec or .mlir to the planned training step.
// `stage` sees the module after each stage.
llvm::Error lower(const CompileOptions &options, MLIRContext &context,
                  DiagnosticCollector &diagnostics, Spec &spec,
                  OwningOpRef<ModuleOp> &module,
                  llvm::function_ref<llvm::Error(const char *)> stage,
                  llvm::function_ref<void(StringRef pass)> observe = {},
                  bool gradientCheck = false) {
  if (options.inference &&
      llvm::StringRef(options.input).ends_with(".mlir"))
    return diagnostics.error(options.input +
                             ": --inference compiles a spec's model (.json), "
                             "not a graph program");
  if (options.inference && options.target != "cpu")
    return diagnostics.error("--inference: the inference program is built "
                             "for the CPU target so far (--target " +
                             options.target + " is not)");
  if (options.inference && options.fuseKernels.value_or(false))
    return diagnostics.error("--fuse-kernels goes with training programs: "
                             "the inference program runs unfused kernels");
  if (llvm::StringRef(options.input).ends_with(".mlir")) {
    spec = defaultSpecForIR(llvm::sys::path::stem(options.input));
    // MLIR's parser recurses per nesting level: a deeper file would
    // overflow the stack rather than fail.
    auto text = llvm::MemoryBuffer::getFile(options.input);
    if (!text)
      return diagnostics.error(options.input + ": cannot read: " +
                               text.getError().message());
    if (std::optional<int64_t> line =
            tooDeep((*text)->getBuffer(), kMaxMLIRNesting))
      return diagnostics.error(options.input + ":" + std::to_string(*line) +
                               ": nested more than " +
                               std::to_string(kMaxMLIRNesting) +
                               " levels deep (regions, attributes, lists); "
                               "Tessel reads at most that");
    if (std::optional<int64_t> line = badDenseArray((*text)->getBuffer()))
      return diagnostics.error(options.input + ":" + std::to_string(*line) +
                               ": a dense array of index elements (or of a "
                               "type alias) is not supported: write its "
                               "element type as an integer or float type, "
                               "e.g. array<i64: ...>");
    llvm::SourceMgr sources;
    sources.AddNewSourceBuffer(std::move(*text), llvm::SMLoc());
    module = parseSourceFile<ModuleOp>(sources, &context);
    if (!module)
      return diagnostics.error(options.input + ": cannot parse");
    if (!(*module)->hasAttr("graph.recipe"))
      setRecipeFromGraph(*module, spec);
  } else {
    llvm::Expected<Spec> loaded =
        loadSpec(options.input, options.overrides, options.layout);
    if (!loaded)
      return loaded.takeError();
    spec = std::move(*loaded);
    // Settings that compile but surprise.
    if (spec.train.warmupSteps > spec.train.steps)
      llvm::errs() << "tessel compile: warning: " << options.input
                   << ": train.lr_schedule.warmup_steps = "
                   << spec.train.warmupSteps << " is longer than train.steps = "
                   << spec.train.steps
                   << ": the learning rate never reaches train.optimizer.lr\n";
    if (options.inference)
      spec.train.globalBatch = 1; // one sequence at a time
    int64_t prefillChunk = options.prefillChunk > 0
                               ? options.prefillChunk
                               : std::min<int64_t>(64, spec.model.seqLen);
    module = options.inference
                 ? buildInferenceModel(context, spec, spec.train.globalBatch,
                                       prefillChunk)
                 : buildModel(context, spec);
    if (!module)
      return diagnostics.error(options.input +
                               ": the parallel plan is invalid");
    if (failed(verify(*module)))
      return diagnostics.error(options.input + ": the model does not verify");
  }
  if (llvm::Error err = stage("00-graph.mlir"))
    return err;
  TrainPipelineOptions pipeline;
  pipeline.target = options.target;
  pipeline.precision = options.target == "cuda" ? spec.train.precision : "fp32";
  if (options.fuseKernels)
    pipeline.fuseKernels = *options.fuseKernels ? "true" : "false";
  pipeline.bucketMB = spec.parallel.bucketMB;
  pipeline.overlapGradReduce = spec.parallel.overlapGradReduce;
  pipeline.overlapParamGather = spec.parallel.overlapParamGather;
  pipeline.overlapTpComm = spec.parallel.overlapTpComm;
  pipeline.collectiveMatmul = spec.parallel.collectiveMatmul;
  pipeline.collectiveMatmulMinRows = spec.parallel.collectiveMatmulMinRows;
  pipeline.recompute = spec.train.recompute;
  pipeline.zero = spec.parallel.zero;
  pipeline.masterPieces = spec.parallel.masterPieces;
  if (spec.parallel.offload != "none" && options.target != "cuda")
    return diagnostics.error(
        options.input + ": parallel.offload: parallel.offload = \"" +
        spec.parallel.offload +
        "\" moves the optimizer state from GPU memory to the host's; a " +
        options.target +
        " program keeps all of its state in host memory already (use it "
        "with --target cuda)");
  pipeline.recomputeBlocks = spec.train.recomputeLayers;
  pipeline.gradientCheck = gradientCheck;
  llvm::StringRef arch(options.cudaArch);
  unsigned archNumber = 90;
  if (arch.consume_front("sm_") && !arch.getAsInteger(10, archNumber))
    pipeline.cudaArch = archNumber;
  PassManager pm(&context);
  if (options.inference)
    buildInferencePipeline(pm, pipeline);
  else
    buildTrainPipeline(pm, pipeline);
  auto dumper = std::make_unique<StageDumper>(
      options.inference ? inferencePipelineStages() : trainPipelineStages(),
      stage, observe);
  StageDumper &stages = *dumper;
  pm.addInstrumentation(std::move(dumper));
  LogicalResult result = pm.run(*module);
  if (stages.error)
    return std::move(stages.error);
  if (failed(result))
    return diagnostics.error(stages.failedPass + " failed");
  return llvm::Error::success();
}

// The target named on the command line, checked before any work is done:
// the GPU architecture of a CUDA target (0 for the CPU).
llvm::Expected<int> cudaArchOf(const CompileOptions &options) {
  if (options.target == "cpu")
    return 0;
  if (options.target != "cuda")
    return llvm::createStringError("--target " + options.target +
                                   ": expected cpu or cuda");
  llvm::StringRef arch(options.cudaArch);
  unsigned number = 0;
  if (!arch.consume_front("sm_") || arch.getAsInteger(10, number) ||
      number < 70 || number > 199)
    return llvm::createStringError("--cuda-arch " + options.cudaArch +
                                   ": expected sm_NN, e.g. sm_90 (H100/H200) "
                                   "or sm_80 (A100)");
  if (!options.emitOnly)
    if (llvm::Error err = checkCudaTarget())
      return std::move(err);
  return static_cast<int>(number);
}

// A size in the unit that shows it: "37.4 GB", "812.5 MB", "3.1 kB",
// "412 bytes" (a tiny model's plan does not read as 0.0 GB).
std::string sizeText(double bytes) {
  double size = std::fabs(bytes);
  if (size >= 1e9)
    return llvm::formatv("{0:f1} GB", bytes / 1e9).str();
  if (size >= 1e6)
    return llvm::formatv("{0:f1} MB", bytes / 1e6).str();
  if (size >= 1e3)
    return llvm::formatv("{0:f1} kB", bytes / 1e3).str();
  return llvm::formatv("{0} bytes", static_cast<int64_t>(bytes)).str();
}

// The program that holds the most per rank, and how much.
std::pair<std::string, int64_t>
largestProgram(const std::vector<ProgramOut> &programs) {
  std::pair<std::string, int64_t> largest = {"", 0};
  for (const ProgramOut &program : programs) {
    int64_t total = program.memory.value("total_bytes", int64_t(0));
    if (total > largest.second)
      largest = {program.name, total};
  }
  return largest;
}

// The bytes program `name` sends over data parallelism (dp, or its shard
// groups and replicas) in a step.
int64_t dataParallelBytes(const std::vector<ProgramOut> &programs,
                          const std::string &name) {
  int64_t bytes = 0;
  for (const ProgramOut &program : programs)
    if (program.name == name)
      for (const CollectiveCall &c : program.calls)
        if (c.axes.intersects(AxisSet::dataParallel()))
          bytes += c.count * c.bytesSent;
  return bytes;
}

// Refuses a plan whose rank holds more than --memory-limit, saying by how
// much, what the rank holds, and whether full recomputation (compiled here
// to find out) would make it fit.
llvm::Error checkMemoryLimit(const CompileOptions &options, const Spec &spec,
                             const std::vector<ProgramOut> &programs) {
  auto [name, total] = largestProgram(programs);
  if (!options.memoryLimit || total <= options.memoryLimit)
    return llvm::Error::success();
  const json *memory = nullptr;
  for (const ProgramOut &program : programs)
    if (program.name == name)
      memory = &program.memory;
  std::string parts;
  for (auto [key, what] :
       {std::pair<const char *, const char *>{"params_bytes", "parameters"},
        {"grads_bytes", "gradients"},
        {"optimizer_bytes", "optimizer state"},
        {"param_shadow_bytes", "bf16 parameters"},
        {"activation_bytes", "activations"},
        {"send_buffer_bytes", "pipeline send buffers"}})
    if (memory->contains(key) && (*memory)[key].get<double>() > 0)
      parts += std::string(parts.empty() ? "" : ", ") + what + " " +
               sizeText((*memory)[key].get<double>());
  std::string message =
      options.memoryLimitFrom + " (" + sizeText(options.memoryLimit) +
      " per rank): " + name + " holds " + sizeText(total) + " per rank, " +
      sizeText(total - options.memoryLimit) + " over (" + parts + ")";
  // The settings that shed memory without changing the layout: each higher
  // ZeRO level, full recompute, the highest level with full recompute, and
  // (CUDA) offloading the optimizer state.
  std::vector<std::pair<std::string, std::vector<std::string>>> settings;
  int64_t highest = 3;
  bool zero = spec.parallel.zero < highest && spec.parallel.dp > 1;
  bool recompute = spec.train.recompute != "full";
  for (int64_t level = spec.parallel.zero + 1; zero && level <= highest;
       ++level)
    settings.push_back({"--zero " + std::to_string(level),
                        {"parallel.zero=" + std::to_string(level)}});
  if (recompute)
    settings.push_back({"--recompute full", {"train.recompute=\"full\""}});
  if (zero && recompute)
    settings.push_back({"--zero " + std::to_string(highest) +
                            " --recompute full",
                        {"parallel.zero=" + std::to_string(highest),
                         "train.recompute=\"full\""}});
  if (options.target == "cuda" && spec.parallel.offload == "none")
    settings.push_back(
        {"--offload optimizer", {"parallel.offload=\"optimizer\""}});
  std::unique_ptr<TargetInfo> device =
      options.target == "cuda" ? makeTargetInfo(options.target)
                               : nullptr;
  for (const auto &[flags, overrides] : settings) {
    CompileOptions other = options;
    other.overrides.insert(other.overrides.end(), overrides.begin(),
                           overrides.end());
    MLIRContext context;
    loadAllDialects(context);
    DiagnosticCollector diagnostics(context);
    Spec otherSpec;
    OwningOpRef<ModuleOp> module;
    std::vector<ProgramOut> otherPrograms;
    auto observe = [&](StringRef pass) {
      if (pass == "tessel-order-messages")
        otherPrograms = describeRtPrograms(*module, device.get());
    };
    auto noStage = [](const char *) { return llvm::Error::success(); };
    if (llvm::Error err = lower(other, context, diagnostics, otherSpec, module,
                                noStage, observe)) {
      llvm::consumeError(std::move(err));
      continue;
    }
    auto [otherName, otherTotal] = largestProgram(otherPrograms);
    message += "; with " + flags + " the largest rank (" + otherName +
               ") holds " + sizeText(otherTotal) +
               (otherTotal <= options.memoryLimit ? ", which fits"
                                                  : ", which does not fit");
    // What fitting would cost in traffic, when it is much more than now
    // (ZeRO 2 and 3 reduce or gather in every microbatch).
    int64_t now = dataParallelBytes(programs, otherName);
    int64_t then = dataParallelBytes(otherPrograms, otherName);
    if (otherTotal <= options.memoryLimit && now > 0 && then >= 2 * now)
      message += llvm::formatv(", but sends {0:f1} times this layout's "
                               "data-parallel bytes a step",
                               double(then) / double(now))
                     .str();
  }
  return llvm::createStringError(
      message + "; more pipeline or tensor parallelism spreads the model "
                "state over more ranks");
}

llvm::Error compileInto(const CompileOptions &options, llvm::StringRef out) {
  llvm::Expected<int> archOr = cudaArchOf(options);
  if (!archOr)
    return archOr.takeError();
  int cudaArch = *archOr;
  MLIRContext context;
  loadAllDialects(context);
  DiagnosticCollector diagnostics(context);

  for (const char *dir : {"ir", "src", "bin", "launch"}) {
    if (options.inference && llvm::StringRef(dir) == "launch")
      continue;
    llvm::SmallString<256> path(out);
    llvm::sys::path::append(path, dir);
    if (std::error_code ec = llvm::sys::fs::create_directories(path))
      return llvm::createStringError("cannot create " + path + ": " +
                                     ec.message());
  }
  Spec spec;
  OwningOpRef<ModuleOp> module;
  auto stage = [&](const char *file) -> llvm::Error {
    std::string text = printModule(*module);
    if (options.dumpIR)
      llvm::outs() << "// -----// " << file << " //----- //\n" << text << "\n";
    llvm::SmallString<256> path(out);
    llvm::sys::path::append(path, "ir", file);
    return writeFile(path, text);
  };
  bool cuda = options.target == "cuda";
  std::unique_ptr<TargetInfo> device =
      cuda ? makeTargetInfo(options.target) : nullptr;
  std::vector<ProgramOut> programs;
  // The plan is read from the rank programs on rt, before they become C++.
  auto observe = [&](StringRef pass) {
    if (pass == "tessel-order-messages" || pass == "tessel-inference-program")
      programs = describeRtPrograms(*module, device.get());
  };
  if (llvm::Error err =
          lower(options, context, diagnostics, spec, module, stage, observe))
    return err;
  if (llvm::Error err = checkMemoryLimit(options, spec, programs))
    return err;
  // Each emitted program is one binary; a shared one names the programs it
  // runs.
  std::map<std::string, ModuleOp> binaries;
  for (auto m : module->getOps<ModuleOp>()) {
    if (!m.getSymName())
      continue;
    binaries[m.getSymName()->str()] = m;
    if (auto serves = m->getAttrOfType<ArrayAttr>("rt.serves"))
      for (Attribute served : serves)
        for (ProgramOut &program : programs)
          if (program.name == cast<StringAttr>(served).getValue())
            program.binary = m.getSymName()->str();
  }
  std::vector<std::string> built;
  for (ProgramOut &program : programs) {
    if (program.binary.empty())
      program.binary = program.name;
    if (llvm::is_contained(built, program.binary))
      continue;
    built.push_back(program.binary);
    ModuleOp source = binaries[program.binary];
    std::string text;
    llvm::raw_string_ostream os(text);
    if (!source || failed(emitc::translateToCpp(source, os)))
      return diagnostics.error("printing " + program.binary + " failed");
    llvm::SmallString<256> sourcePath(out), binaryPath(out);
    llvm::sys::path::append(sourcePath, "src",
                            program.binary + (cuda ? ".cu" : ".cpp"));
    llvm::sys::path::append(binaryPath, "bin", program.binary);
    if (llvm::Error err = writeFile(sourcePath, text))
      return err;
    if (options.emitOnly)
      continue;
    if (llvm::Error err =
            cuda ? buildCudaProgram(sourcePath, binaryPath, cudaArch,
                                    options.verbose)
                 : buildCpuProgram(sourcePath, binaryPath, options.verbose))
      return err;
  }
  llvm::SmallString<256> planPath(out);
  llvm::sys::path::append(planPath, "plan.json");
  json plan = planJson(spec, *module, programs, options);
  // `tessel run` starts only the binaries compiled here.
  if (!options.emitOnly)
    for (const ProgramOut &program : programs) {
      llvm::SmallString<256> binaryPath(out);
      llvm::sys::path::append(binaryPath, "bin", program.binary);
      llvm::Expected<std::string> digest = tessel::fileSha256(binaryPath);
      if (!digest)
        return digest.takeError();
      plan["programs"][program.name]["sha256"] = *digest;
    }
  if (llvm::Error err = writeFile(planPath, plan.dump(2) + "\n"))
    return err;
  // A blend's datasets and weights, for the runtime.
  if (spec.data.format == "blend") {
    json blend = json::array();
    for (const auto &[path, weight] : spec.data.blend)
      blend.push_back({{"path", path}, {"weight", weight}});
    llvm::SmallString<256> blendPath(out);
    llvm::sys::path::append(blendPath, "data");
    if (std::error_code ec = llvm::sys::fs::create_directories(blendPath))
      return llvm::createStringError("cannot create " + blendPath + ": " +
                                     ec.message());
    llvm::sys::path::append(blendPath, "blend.json");
    if (llvm::Error err =
            writeFile(blendPath, json{{"blend", blend}}.dump(2) + "\n"))
      return err;
  }
  // The spec as compiled, to compile again from (tessel run --elastic).
  if (!spec.document.empty()) {
    llvm::SmallString<256> specPath(out);
    llvm::sys::path::append(specPath, "spec");
    if (std::error_code ec = llvm::sys::fs::create_directories(specPath))
      return llvm::createStringError("cannot create " + specPath + ": " +
                                     ec.message());
    llvm::sys::path::append(specPath, spec.name + ".json");
    if (llvm::Error err = writeFile(specPath, spec.document))
      return err;
  }
  // An inference program is started by tessel generate.
  if (options.inference)
    return llvm::Error::success();
  return writeLaunchFiles(out, spec, cuda, layoutOf(*module), programs);
}

} // namespace

namespace {
// The staging directory of the running compile, removed when a signal
// (interrupt, termination, crash) ends it, so that no DIR.tmp-PID is left.
char stagingToRemove[4096];

void removeStaging() {
  if (!stagingToRemove[0])
    return;
  // In a signal handler: only fork, exec and wait (async-signal-safe).
  pid_t pid = ::fork();
  if (pid == 0) {
    ::execl("/bin/rm", "rm", "-rf", "--", stagingToRemove, (char *)nullptr);
    ::_exit(127);
  }
  if (pid > 0)
    ::waitpid(pid, nullptr, 0);
  stagingToRemove[0] = 0;
}
} // namespace

llvm::Expected<int64_t> tessel::parseBytes(llvm::StringRef text) {
  llvm::StringRef number = text.trim();
  double scale = 1;
  for (auto [suffix, factor] :
       {std::pair<llvm::StringRef, double>{"GiB", double(1ull << 30)},
        {"MiB", double(1ull << 20)},
        {"TB", 1e12},
        {"GB", 1e9},
        {"KiB", double(1ull << 10)},
        {"MB", 1e6},
        {"kB", 1e3},
        {"KB", 1e3},
        {"B", 1}})
    if (number.consume_back(suffix)) {
      scale = factor;
      break;
    }
  double value = 0;
  if (number.trim().getAsDouble(value) || !(value > 0) ||
      value * scale > 9e18)
    return llvm::createStringError("--memory-limit expects a size such as "
                                   "80GB, 80GiB, 512MB or 64kB, got '" +
                                   text.str() + "'");
  return static_cast<int64_t>(value * scale);
}

llvm::Error tessel::compile(const CompileOptions &options) {
  llvm::SmallString<256> staging(options.output);
  llvm::sys::path::remove_dots(staging, true);
  staging += ".tmp-" + std::to_string(llvm::sys::Process::getProcessId());
  if (staging.size() < sizeof(stagingToRemove)) {
    std::memcpy(stagingToRemove, staging.c_str(), staging.size() + 1);
    llvm::sys::SetInterruptFunction(removeStaging);
    llvm::sys::AddSignalHandler([](void *) { removeStaging(); }, nullptr);
  }
  llvm::Error err = compileInto(options, staging);
  if (!err)
    err = publish(staging, options.output);
  if (err)
    llvm::sys::fs::remove_directories(staging);
  stagingToRemove[0] = 0;
  return err;
}

llvm::Error tessel::gradientCheck(const CompileOptions &options) {
  MLIRContext context;
  loadAllDialects(context);
  DiagnosticCollector diagnostics(context);
  Spec spec;
  OwningOpRef<ModuleOp> module;
  auto noStage = [](const char *) { return llvm::Error::success(); };
  if (llvm::Error err = lower(options, context, diagnostics, spec, module,
                              noStage, {}, /*gradientCheck=*/true))
    return err;
  std::string source;
  llvm::raw_string_ostream sourceStream(source);
  ModuleOp program;
  for (auto m : module->getOps<ModuleOp>())
    program = m;
  if (!program || failed(emitc::translateToCpp(program, sourceStream)))
    return diagnostics.error("printing the gradient check failed");

  llvm::SmallString<256> dir;
  if (std::error_code ec =
          llvm::sys::fs::createUniqueDirectory("tessel-gradcheck", dir))
    return llvm::createStringError("cannot create a temporary directory: " +
                                   ec.message());
  llvm::SmallString<256> sourcePath(dir), binaryPath(dir);
  llvm::sys::path::append(sourcePath, "gradcheck.cpp");
  llvm::sys::path::append(binaryPath, "gradcheck");
  llvm::Error err = writeFile(sourcePath, source);
  if (!err)
    err = buildCpuProgram(sourcePath, binaryPath, options.verbose);
  int rc = -1;
  std::string message;
  if (!err) {
    llvm::StringRef argv[] = {binaryPath};
    rc = llvm::sys::ExecuteAndWait(binaryPath, argv, std::nullopt, {}, 0, 0,
                                   &message);
  }
  llvm::sys::fs::remove_directories(dir);
  if (err)
    return err;
  if (rc != 0)
    return llvm::createStringError(
        rc > 0 ? "gradients differ from finite differences"
               : "the gradient check did not finish: " + message);
  return llvm::Error::success();
}
