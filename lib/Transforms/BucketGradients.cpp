//===- BucketGradients.cpp - Bucketed, overlapped gradient all-reduces ----===//
//
// Gradients become final in reverse layer order during backward. Each bucket
// of consecutive gradients is reduced by one collective started as soon as
// its last gradient exists, so it runs while backward continues, and is
// waited for only before the gradient norm. See Passes.td.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"

namespace tessel {
#define GEN_PASS_DEF_BUCKETGRADIENTS
#include "tessel/Transforms/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;
using namespace tessel::graph;

namespace {

int64_t bytesOf(Value v) {
  return cast<RankedTensorType>(v.getType()).getNumElements() * 4;
}

// A gradient sync: a one-operand all-reduce whose result updates a parameter.
bool isGradientSync(dist::AllReduceOp ar) {
  return ar.getInputs().size() == 1 &&
         llvm::any_of(ar.getResult(0).getUsers(),
                      [](Operation *user) { return isa<AdamWOp>(user); });
}

// Whether the parameter a gradient sync's result updates is a table of
// the input embedding that only the lookup (or, for positions, an add)
// reads: an untied token table, GPT-2's position table. Their backward
// needs the tokens (or nothing), not the table.
bool updatesLookupOnly(dist::AllReduceOp ar) {
  for (Operation *user : ar.getResult(0).getUsers())
    if (auto adamw = dyn_cast<AdamWOp>(user)) {
      Operation *param = adamw.getParam().getDefiningOp();
      LayerAttr layer = param ? layerOf(param) : LayerAttr();
      return layer && layer.getKind() == LayerKind::Embedding &&
             llvm::all_of(adamw.getParam().getUsers(), [](Operation *u) {
               return isa<EmbeddingOp, AddOp, AdamWOp>(u);
             });
    }
  return false;
}

void bucket(func::FuncOp func, int64_t bucketBytes, bool overlap,
            bool lookupsAlone) {
  Block &body = func.getBody().front();
  DenseMap<Operation *, int64_t> position;
  for (Operation &op : body)
    position[&op] = position.size();
  auto ready = [&](dist::AllReduceOp ar) {
    Operation *def = ar.getInputs()[0].getDefiningOp();
    return def ? position[def] : -1;
  };
  // A gradient that is only made in the update (reduce-scattered over tp
  // there, as a key/value projection's whose heads are fewer than tp ranks
  // is under sequence parallelism) keeps its blocking all-reduce: started
  // in backward, it would wait for the update.
  SmallVector<dist::AllReduceOp> syncs;
  for (auto ar : body.getOps<dist::AllReduceOp>()) {
    Operation *def = ar.getInputs()[0].getDefiningOp();
    if (isGradientSync(ar) && !(def && phaseOf(def) == Phase::Update))
      syncs.push_back(ar);
  }
  llvm::stable_sort(syncs, [&](auto a, auto b) { return ready(a) < ready(b); });

  SmallVector<SmallVector<dist::AllReduceOp>> buckets;
  int64_t bytes = 0;
  // ZeRO-3 gathers a run of parameters for each part that reads it: a
  // lookup-only table in a bucket of its own is gathered for the forward
  // alone.
  bool lastAlone = false;
  for (dist::AllReduceOp ar : syncs) {
    bool alone = lookupsAlone && updatesLookupOnly(ar);
    bool fits = !buckets.empty() && !alone && !lastAlone &&
                bytes + bytesOf(ar.getResult(0)) <= bucketBytes &&
                buckets.back().front().getAxes() == ar.getAxes();
    lastAlone = alone;
    if (!fits) {
      buckets.emplace_back();
      bytes = 0;
    }
    buckets.back().push_back(ar);
    bytes += bytesOf(ar.getResult(0));
  }

  MLIRContext *ctx = func.getContext();
  for (auto [index, group] : llvm::enumerate(buckets)) {
    // Start right after the last gradient of the bucket is produced.
    Operation *last = nullptr;
    SmallVector<Value> inputs;
    SmallVector<Type> types;
    SmallVector<Attribute> shardings;
    for (dist::AllReduceOp ar : group) {
      Value in = ar.getInputs()[0];
      inputs.push_back(in);
      types.push_back(in.getType());
      if (auto attrs = ar->getAttrOfType<ArrayAttr>("dist.sharding"))
        shardings.push_back(attrs[0]);
      Operation *def = in.getDefiningOp();
      if (def && (!last || position[def] > position[last]))
        last = def;
    }
    OpBuilder b(ctx);
    if (last)
      b.setInsertionPointAfter(last);
    else
      b.setInsertionPointToStart(&body);
    Location loc = NameLoc::get(
        StringAttr::get(ctx, "gradient bucket " + std::to_string(index)));
    if (!overlap) {
      // One blocking all-reduce per bucket, where the first gradient is read.
      Operation *firstUser = nullptr;
      for (dist::AllReduceOp ar : group)
        for (Operation *user : ar.getResult(0).getUsers())
          if (!firstUser || position[user] < position[firstUser])
            firstUser = user;
      b.setInsertionPoint(firstUser);
      auto reduce = dist::AllReduceOp::create(b, loc, types, inputs,
                                              group.front().getAxes());
      if (shardings.size() == group.size())
        reduce->setAttr("dist.sharding", ArrayAttr::get(ctx, shardings));
      setPhase(reduce, Phase::Update);
      for (auto [ar, result] : llvm::zip(group, reduce.getResults())) {
        ar.getResult(0).replaceAllUsesWith(result);
        ar.erase();
      }
      continue;
    }
    auto start = dist::AllReduceStartOp::create(
        b, loc, types, dist::RequestType::get(ctx), inputs,
        group.front().getAxes());
    if (shardings.size() == group.size())
      start->setAttr("dist.sharding", ArrayAttr::get(ctx, shardings));
    // Started during backward; the results are read in the update.
    setPhase(start, Phase::Backward);
    // Wait before the first reader of any result.
    Operation *firstUser = nullptr;
    for (auto [ar, result] : llvm::zip(group, start.getResults())) {
      for (Operation *user : ar.getResult(0).getUsers())
        if (!firstUser || position[user] < position[firstUser])
          firstUser = user;
      ar.getResult(0).replaceAllUsesWith(result);
      ar.erase();
    }
    b.setInsertionPoint(firstUser ? firstUser : body.getTerminator());
    auto wait = dist::WaitOp::create(b, start.getLoc(), start.getRequest());
    setPhase(wait, Phase::Update);
  }
}

struct BucketGradientsPass
    : tessel::impl::BucketGradientsBase<BucketGradientsPass> {
  using BucketGradientsBase::BucketGradientsBase;
  void runOnOperation() override {
    ModuleOp module = getOperation();
    auto func = module.lookupSymbol<func::FuncOp>("train_step");
    // Pipeline stages synchronise their own gradients in their update, one
    // collective per gradient.
    if (!func || dist::meshOf(module)[MeshAxis::PP] > 1 ||
        func->hasAttr("pipe.rank"))
      return;
    bucket(func, bucketBytes,
           overlap && pipe::layoutOf(module).getMicrobatches() == 1,
           lookupTablesAlone);
  }
};

} // namespace
