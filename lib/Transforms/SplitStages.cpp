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

#include "dialects/Pipe/PipeOps.h"
#include "tessel/Pipeline/Schedule.h"

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
  // The stage a part of the model runs on (none: not a model part).
  std::optional<int64_t> stageOfLayer(LayerAttr layer) const;

  ModuleOp module;
  func::FuncOp step;
  MLIRContext *ctx;
  tessel::MeshLayout layout;
  int64_t ranks, stages;
  ArrayRef<int64_t> layers; // the stage of each layer
  int64_t rankOf(int64_t stage) const { return layout.stageOwner(stage); }
  int64_t chunkOf(int64_t stage) const { return layout.stageChunk(stage); }
  DenseMap<Operation *, int64_t> stageOf;
  // Collectives whose results only the update reads: gradient
  // synchronisation, run once per step rather than per microbatch.
  llvm::SmallPtrSet<Operation *, 32> syncOps;
  SmallVector<func::FuncOp> funcs;
  SmallVector<IRMapping> maps;
  DenseMap<std::pair<Value, int64_t>, Value> received;
  int64_t nextTag = 0;
};

StringRef Splitter::phaseOf(Operation *op) {
  if (syncOps.contains(op))
    return "update";
  std::optional<Phase> phase = graph::phaseOf(op);
  return stringifyPhase(phase.value_or(Phase::Update));
}

std::optional<int64_t> Splitter::stageOfLayer(LayerAttr layer) const {
  if (!layer)
    return std::nullopt;
  switch (layer.getKind()) {
  case LayerKind::Embedding:
    return 0;
  case LayerKind::Head:
    return stages - 1;
  case LayerKind::Block:
    if (layer.getIndex() < (int64_t)layers.size())
      return layers[layer.getIndex()];
    return std::nullopt;
  }
  return std::nullopt;
}

LogicalResult Splitter::assignStages() {
  Block &body = step.getBody().front();
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
    if (auto adamw = dyn_cast<AdamWOp>(op))
      s = stageOf.lookup(adamw.getParam().getDefiningOp());
    else if (!isa<dist::DistDialect>(op.getDialect()))
      s = stageOfLayer(layerOf(&op));
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
      ArrayAttr axes = norm.getReduceAxesAttr();
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
        auto local = GlobalNormOp::create(sb, norm.getLoc(), scalar, grads,
                                          ArrayAttr::get(ctx, gradAxes));
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

// A matmul's multiply-adds: what a layer costs, to balance stages.
double matmulWork(MatmulOp m) {
  auto lhs = cast<RankedTensorType>(m.getLhs().getType()).getShape();
  int64_t K = m.getTransposeLhs() ? lhs[lhs.size() - 2] : lhs.back();
  return double(cast<RankedTensorType>(m.getType()).getNumElements()) * K;
}

// The stage of each transformer block: the layout's `layer_stages`, else
// contiguous runs balanced by the forward matmul work of each block (the
// head's counted with the last block, which shares its stage).
FailureOr<SmallVector<int64_t>> layerStagesOf(ModuleOp module,
                                              func::FuncOp step,
                                              int64_t stages) {
  pipe::LayoutAttr layout = pipe::layoutOf(module);
  if (!layout.getLayerStages().empty())
    return SmallVector<int64_t>(layout.getLayerStages());
  std::vector<double> costs;
  double head = 0;
  step.walk([&](MatmulOp m) {
    LayerAttr layer = layerOf(m);
    if (!layer || phaseOf(m) != Phase::Forward)
      return;
    if (layer.getKind() == LayerKind::Head)
      head += matmulWork(m);
    if (layer.getKind() != LayerKind::Block)
      return;
    if ((int64_t)costs.size() <= layer.getIndex())
      costs.resize(layer.getIndex() + 1, 0.0);
    costs[layer.getIndex()] += matmulWork(m);
  });
  if (costs.empty())
    return module.emitError("tessel-split-stages: the step has no "
                            "transformer blocks (graph.layer) to cut into "
                            "pipeline stages");
  costs.back() += head;
  llvm::Expected<std::vector<int>> balanced =
      pipeline::balanceStages(costs, stages);
  if (!balanced)
    return module.emitError("tessel-split-stages: ")
           << llvm::toString(balanced.takeError());
  return SmallVector<int64_t>(balanced->begin(), balanced->end());
}

struct SplitStagesPass : tessel::impl::SplitStagesBase<SplitStagesPass> {
  void runOnOperation() override {
    ModuleOp module = getOperation();
    tessel::MeshLayout layout(dist::meshOf(module),
                              pipe::layoutOf(module).getVirtualStages());
    if (layout.pipelineRanks() <= 1)
      return;
    auto step = module.lookupSymbol<func::FuncOp>("train_step");
    if (!step) {
      module.emitError("tessel-split-stages: no @train_step");
      return signalPassFailure();
    }
    FailureOr<SmallVector<int64_t>> layerStages =
        layerStagesOf(module, step, layout.numStages());
    if (failed(layerStages))
      return signalPassFailure();
    if (failed(Splitter(module, step, layout, *layerStages).run()))
      signalPassFailure();
  }
};

} // namespace
