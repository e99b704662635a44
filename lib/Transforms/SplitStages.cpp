//===- SplitStages.cpp - One function per pipeline stage ------------------===//
//
// Cuts the per-rank training step into pipeline stages: every op goes to the
// stage of the layer it belongs to (its location names the layer; the
// embedding goes to the first stage, the final norm, head and loss to the
// last), a value used on another stage than its own is sent there
// (dist.send right after it is produced, dist.recv before its first use),
// each stage computes the norm of its own gradients (summed over pp) and
// every stage returns the loss, all-reduced over pp. Each op is tagged with
// its phase (forward, backward or update) for the schedule. See Passes.td.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"
#include "mlir/IR/IRMapping.h"

namespace tessel {
#define GEN_PASS_DEF_SPLITSTAGES
#include "tessel/Transforms/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;
using namespace tessel::graph;

namespace {

const tessel::AxisSet kPP = tessel::MeshAxis::PP;

// The layer a location names ("h.3.", "model.layers.3."), or -1.
int64_t layerOf(StringRef name) {
  for (StringRef prefix : {"h.", "model.layers."}) {
    if (!name.starts_with(prefix))
      continue;
    StringRef rest = name.drop_front(prefix.size());
    StringRef digits = rest.take_while([](char c) { return isdigit(c); });
    int64_t layer;
    if (!digits.empty() && !digits.getAsInteger(10, layer))
      return layer;
  }
  return -1;
}

std::optional<int64_t>
stageFromLocation(Location loc, ArrayRef<int64_t> layerStages, int64_t stages) {
  auto name = dyn_cast<NameLoc>(loc);
  if (!name)
    return std::nullopt;
  StringRef n = name.getName().getValue();
  if (int64_t layer = layerOf(n);
      layer >= 0 && layer < (int64_t)layerStages.size())
    return layerStages[layer];
  for (StringRef first : {"wte", "wpe", "model.embed_tokens"})
    if (n.starts_with(first))
      return 0;
  for (StringRef last : {"ln_f", "model.norm", "lm_head", "loss"})
    if (n.starts_with(last))
      return stages - 1;
  return std::nullopt;
}

class Splitter {
public:
  // `stages` = ranks x virtual stages; stage s runs on rank s % ranks (the
  // interleaved layout), and each rank gets one function with all its stages.
  Splitter(ModuleOp module, func::FuncOp step, tessel::MeshLayout layout,
           ArrayRef<int64_t> layerStages)
      : module(module), step(step), ctx(module.getContext()), layout(layout),
        ranks(layout.pipelineRanks()), stages(layout.numStages()),
        layers(layerStages) {}

  LogicalResult run();

private:
  LogicalResult assignStages();
  Value lookup(Value v, int64_t s, Operation *user);
  StringRef phaseOf(Operation *op);

  ModuleOp module;
  func::FuncOp step;
  MLIRContext *ctx;
  tessel::MeshLayout layout;
  int64_t ranks, stages;
  ArrayRef<int64_t> layers; // the stage of each layer
  int64_t rankOf(int64_t stage) const { return layout.stageOwner(stage); }
  int64_t chunkOf(int64_t stage) const { return layout.stageChunk(stage); }
  DenseMap<Operation *, int64_t> stageOf;
  DenseMap<Operation *, int64_t> position;
  int64_t seedPosition = -1, updatePosition = -1;
  // Collectives whose results only the update reads: gradient
  // synchronisation, run once per step rather than per microbatch.
  llvm::SmallPtrSet<Operation *, 32> syncOps;
  SmallVector<func::FuncOp> funcs;
  SmallVector<IRMapping> maps;
  DenseMap<std::pair<Value, int64_t>, Value> received;
  int64_t nextTag = 0;
};

StringRef Splitter::phaseOf(Operation *op) {
  int64_t p = position.lookup(op);
  if ((updatePosition >= 0 && p >= updatePosition) || syncOps.contains(op))
    return "update";
  return p > seedPosition ? "backward" : "forward";
}

LogicalResult Splitter::assignStages() {
  Block &body = step.getBody().front();
  for (Operation &op : body) {
    position[&op] = position.size();
    if (auto fill = dyn_cast<FillOp>(op);
        fill && seedPosition < 0 && fill.getValue().convertToDouble() == 1.0 &&
        fill.getType().getRank() == 0)
      seedPosition = position[&op];
    if (isa<GlobalNormOp>(op) && updatePosition < 0)
      updatePosition = position[&op];
  }
  llvm::SmallPtrSet<Operation *, 32> update;
  for (Operation &op : llvm::reverse(body)) {
    bool isUpdate = isa<GlobalNormOp, AdamWOp, func::ReturnOp>(op);
    if (isa<dist::AllReduceOp, dist::AllGatherOp, dist::ReduceScatterOp>(op)) {
      isUpdate = llvm::all_of(op.getUsers(), [&](Operation *user) {
        return update.contains(user);
      });
      if (isUpdate)
        syncOps.insert(&op);
    }
    if (isUpdate)
      update.insert(&op);
  }
  for (Operation &op : body) {
    if (isa<func::ReturnOp, GlobalNormOp, InputOp, FillOp>(op))
      continue;
    std::optional<int64_t> s;
    if (auto param = dyn_cast<ParamOp>(op))
      s = stageFromLocation(NameLoc::get(param.getNameAttr()), layers, stages);
    else if (auto adamw = dyn_cast<AdamWOp>(op))
      s = stageOf.lookup(adamw.getParam().getDefiningOp());
    else if (!isa<dist::DistDialect>(op.getDialect()))
      s = stageFromLocation(op.getLoc(), layers, stages);
    // Collectives run where their operand is.
    if (!s) {
      // No layer of its own: where its operands are (the latest stage).
      for (Value v : op.getOperands())
        if (Operation *def = v.getDefiningOp(); def && stageOf.count(def))
          s = std::max<int64_t>(s.value_or(0), stageOf[def]);
    }
    if (!s)
      return op.emitOpError("cannot be placed on a pipeline stage");
    stageOf[&op] = *s;
  }
  return success();
}

// The value `v` of the original step as seen on stage `s`, just before
// `user`: cloned (inputs and constants), or received from its rank.
Value Splitter::lookup(Value v, int64_t s, Operation *user) {
  int64_t r = rankOf(s);
  if (Value mapped = maps[r].lookupOrNull(v))
    return mapped;
  Operation *def = v.getDefiningOp();
  OpBuilder b(ctx);
  b.setInsertionPointToEnd(&funcs[r].getBody().front());
  if (isa<InputOp, FillOp>(def)) {
    Operation *clone = b.clone(*def);
    clone->setAttr("tessel.phase", StringAttr::get(ctx, phaseOf(user)));
    clone->setAttr("tessel.chunk", b.getI64IntegerAttr(chunkOf(s)));
    maps[r].map(v, clone->getResult(0));
    return clone->getResult(0);
  }
  int64_t from = stageOf.lookup(def), fromRank = rankOf(from);
  auto key = std::make_pair(v, r);
  if (Value received = this->received.lookup(key))
    return received;
  int64_t tag = nextTag++;
  // Send right after the value is produced on its own rank.
  OpBuilder sb(ctx);
  Value sent = maps[fromRank].lookup(v);
  sb.setInsertionPointAfter(sent.getDefiningOp());
  auto send = dist::SendOp::create(sb, def->getLoc(), sent,
                                   tessel::MeshAxis::PP, r - fromRank, tag);
  send->setAttr("tessel.phase", StringAttr::get(ctx, phaseOf(def)));
  send->setAttr("tessel.chunk", sb.getI64IntegerAttr(chunkOf(from)));
  auto recv = dist::RecvOp::create(b, def->getLoc(), v.getType(),
                                   tessel::MeshAxis::PP, fromRank - r, tag);
  recv->setAttr("tessel.phase", StringAttr::get(ctx, phaseOf(def)));
  recv->setAttr("tessel.chunk", b.getI64IntegerAttr(chunkOf(s)));
  this->received[key] = recv.getResult();
  maps[r].map(v, recv.getResult());
  return recv.getResult();
}

LogicalResult Splitter::run() {
  if (failed(assignStages()))
    return failure();
  OpBuilder b(ctx);
  b.setInsertionPoint(step);
  auto scalar = RankedTensorType::get({}, Float32Type::get(ctx));
  for (int64_t s = 0; s < ranks; ++s) {
    auto func =
        func::FuncOp::create(b, step.getLoc(), ("stage_" + std::to_string(s)),
                             b.getFunctionType({}, {scalar, scalar}));
    func->setAttr("tessel.stage", b.getI64IntegerAttr(s));
    func.addEntryBlock();
    funcs.push_back(func);
    maps.emplace_back();
  }
  Block &body = step.getBody().front();
  for (Operation &op : body) {
    if (isa<InputOp, FillOp>(op))
      continue; // cloned where used
    if (auto norm = dyn_cast<GlobalNormOp>(op)) {
      // Each stage's gradients, summed over pp as well.
      auto axes = norm->getAttrOfType<ArrayAttr>("dist.norm_axes");
      for (int64_t s = 0; s < ranks; ++s) {
        SmallVector<Value> grads;
        SmallVector<Attribute> gradAxes;
        for (auto [k, g] : llvm::enumerate(norm.getInputs()))
          if (rankOf(stageOf.lookup(g.getDefiningOp())) == s) {
            grads.push_back(maps[s].lookup(g));
            tessel::AxisSet split =
                axes ? cast<dist::AxesAttr>(axes[k]).getValue()
                     : tessel::AxisSet();
            gradAxes.push_back(dist::AxesAttr::get(ctx, split | kPP));
          }
        OpBuilder sb(ctx);
        sb.setInsertionPointToEnd(&funcs[s].getBody().front());
        auto local = GlobalNormOp::create(sb, norm.getLoc(), scalar, grads);
        local->setAttr("dist.norm_axes", ArrayAttr::get(ctx, gradAxes));
        local->setAttr("tessel.phase", StringAttr::get(ctx, "update"));
        maps[s].map(norm.getResult(), local.getResult());
      }
      continue;
    }
    if (auto ret = dyn_cast<func::ReturnOp>(op)) {
      // The loss lives on the last stage: all-reduce it over pp (the other
      // stages contribute zero) so that every rank reports it.
      for (int64_t s = 0; s < ranks; ++s) {
        OpBuilder sb(ctx);
        sb.setInsertionPointToEnd(&funcs[s].getBody().front());
        Value loss;
        if (s == rankOf(stages - 1)) {
          loss = lookup(ret.getOperand(0), stages - 1, &op);
        } else {
          loss =
              FillOp::create(sb, ret.getLoc(), scalar, sb.getF64FloatAttr(0.0));
          loss.getDefiningOp()->setAttr("tessel.phase",
                                        StringAttr::get(ctx, "update"));
        }
        auto ar = dist::AllReduceOp::create(sb, ret.getLoc(), TypeRange{scalar},
                                            ValueRange{loss}, kPP);
        ar->setAttr("tessel.phase", StringAttr::get(ctx, "update"));
        func::ReturnOp::create(
            sb, ret.getLoc(),
            ValueRange{ar.getResult(0), maps[s].lookup(ret.getOperand(1))});
      }
      continue;
    }
    int64_t s = stageOf.lookup(&op);
    for (Value v : op.getOperands())
      (void)lookup(v, s, &op);
    OpBuilder sb(ctx);
    sb.setInsertionPointToEnd(&funcs[rankOf(s)].getBody().front());
    Operation *clone = sb.clone(op, maps[rankOf(s)]);
    clone->setAttr("tessel.phase", StringAttr::get(ctx, phaseOf(&op)));
    clone->setAttr("tessel.chunk", sb.getI64IntegerAttr(chunkOf(s)));
  }
  step.erase();
  return success();
}

struct SplitStagesPass : tessel::impl::SplitStagesBase<SplitStagesPass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    auto virtualStages =
        module->getAttrOfType<IntegerAttr>("tessel.virtual_stages");
    tessel::MeshLayout layout(dist::meshOf(module),
                              virtualStages ? virtualStages.getInt() : 1);
    if (layout.pipelineRanks() <= 1)
      return;
    int64_t stages = layout.numStages();
    auto step = module.lookupSymbol<func::FuncOp>("train_step");
    // The stage of each layer: given, or contiguous equal groups.
    SmallVector<int64_t> layerStages;
    if (auto given =
            module->getAttrOfType<DenseI64ArrayAttr>("tessel.layer_stages"))
      layerStages.assign(given.asArrayRef().begin(), given.asArrayRef().end());
    else if (auto layers = module->getAttrOfType<IntegerAttr>("tessel.layers"))
      for (int64_t l = 0; l < layers.getInt(); ++l)
        layerStages.push_back(l * stages / layers.getInt());
    if (!step || layerStages.empty()) {
      module.emitError("tessel-split-stages: needs @train_step and the "
                       "module's tessel.layers or tessel.layer_stages");
      return signalPassFailure();
    }
    if (failed(Splitter(module, step, layout, layerStages).run()))
      signalPassFailure();
  }
};

} // namespace
