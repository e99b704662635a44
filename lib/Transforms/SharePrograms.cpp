//===- SharePrograms.cpp - One program for pipeline ranks that are alike --===//
//
// The middle stages of a uniform model compute the same thing on different
// layers: their programs differ in the names of the parameters they hold,
// in how many microbatches' activations they keep at once, and in the order
// their step runs its parts (1F1B warms up with p - r - 1 forwards). Such
// programs become one, with those differences as tables the runtime picks
// by pipeline rank, so that a 96-layer model at pp16 builds three binaries
// rather than sixteen.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "dialects/Rt/RtOps.h"

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Matchers.h"

namespace tessel {
#define GEN_PASS_DEF_SHAREPROGRAMS
#include "tessel/Transforms/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;
namespace rt = tessel::rtir;

namespace {

// A call of a part for a microbatch and first-run flag known when compiling.
struct PartCall {
  StringRef part;
  int64_t mb;
  bool first;
  bool operator==(const PartCall &o) const {
    return part == o.part && mb == o.mb && first == o.first;
  }
};

std::optional<PartCall> partCall(Operation *op) {
  auto call = dyn_cast<func::CallOp>(op);
  if (!call || call.getNumOperands() != 2 || call.getNumResults() != 0)
    return std::nullopt;
  IntegerAttr mb, first;
  if (!matchPattern(call.getOperand(0), m_Constant(&mb)) ||
      !matchPattern(call.getOperand(1), m_Constant(&first)))
    return std::nullopt;
  return PartCall{call.getCallee(), mb.getInt(), !first.getValue().isZero()};
}

// The step as programs are compared: its ops, each run of consecutive part
// calls taken as one item (constants aside).
struct StepItem {
  Operation *op = nullptr; // null: a run of part calls
  SmallVector<func::CallOp> calls;
};

SmallVector<StepItem> stepItems(func::FuncOp step) {
  SmallVector<StepItem> items;
  for (Operation &op : step.getBody().front()) {
    if (isa<arith::ConstantOp>(op))
      continue;
    if (partCall(&op)) {
      if (items.empty() || items.back().op)
        items.emplace_back();
      items.back().calls.push_back(cast<func::CallOp>(op));
      continue;
    }
    items.push_back({&op, {}});
  }
  return items;
}

SmallVector<PartCall> runOf(const StepItem &item) {
  SmallVector<PartCall> run;
  for (func::CallOp call : item.calls)
    run.push_back(*partCall(call));
  return run;
}

// What may differ between programs that share: the rank, the slots (and,
// with an arena per chunk, the places of the chunks in flight).
DictionaryAttr comparedAttributes(ModuleOp program) {
  NamedAttrList attrs(program->getDiscardableAttrDictionary());
  attrs.erase("pipe.rank");
  attrs.erase("rt.arena_slots");
  if (attrs.erase("rt.chunk_arena_offsets"))
    attrs.set("rt.chunk_arena", UnitAttr::get(program.getContext()));
  attrs.erase("rt.chunk_arena_total");
  attrs.erase("rt.chunks_in_flight");
  return attrs.getDictionary(program.getContext());
}

// Two steps are alike when their ops are, pairwise (a parameter's name
// aside), and their runs of part calls sit in the same places.
bool sameStep(func::FuncOp a, func::FuncOp b) {
  SmallVector<StepItem> itemsA = stepItems(a), itemsB = stepItems(b);
  if (itemsA.size() != itemsB.size())
    return false;
  DenseMap<Value, Value> same;
  auto check = [&](Value l, Value r) -> LogicalResult {
    if (same.lookup(l) == r)
      return success();
    Attribute cl, cr;
    return success(matchPattern(l, m_Constant(&cl)) &&
                   matchPattern(r, m_Constant(&cr)) && cl == cr);
  };
  auto mark = [&](Value l, Value r) { same[l] = r; };
  for (auto [x, y] : llvm::zip(itemsA, itemsB)) {
    if (!x.op || !y.op) {
      if (x.op || y.op)
        return false;
      continue;
    }
    auto px = dyn_cast<rt::ParamOp>(x.op), py = dyn_cast<rt::ParamOp>(y.op);
    StringAttr nameY = py ? py.getNameAttr() : StringAttr();
    if (px && py)
      py.setNameAttr(px.getNameAttr());
    bool equal = OperationEquivalence::isEquivalentTo(
        x.op, y.op, check, mark, OperationEquivalence::IgnoreLocations);
    if (py)
      py.setNameAttr(nameY);
    if (!equal)
      return false;
  }
  return true;
}

// The step functions: training's and the forward-only evaluation's.
bool isStep(func::FuncOp f) {
  return f.getSymName() == "train_step" || f.getSymName() == "eval_step";
}

bool samePrograms(ModuleOp a, ModuleOp b) {
  if (comparedAttributes(a) != comparedAttributes(b))
    return false;
  Block &bodyA = *a.getBody(), &bodyB = *b.getBody();
  if (bodyA.getOperations().size() != bodyB.getOperations().size())
    return false;
  for (auto [x, y] : llvm::zip(bodyA, bodyB)) {
    auto fx = dyn_cast<func::FuncOp>(x), fy = dyn_cast<func::FuncOp>(y);
    if (fx && fy && isStep(fx) && fx.getSymName() == fy.getSymName()) {
      if (!sameStep(fx, fy))
        return false;
    } else if (!OperationEquivalence::isEquivalentTo(
                   &x, &y, OperationEquivalence::IgnoreLocations)) {
      return false;
    }
  }
  return true;
}

// "stages1-14" for pipeline ranks 1 to 14.
std::string sharedName(ArrayRef<int64_t> ranks) {
  bool contiguous = true;
  for (size_t k = 1; k < ranks.size(); ++k)
    contiguous &= ranks[k] == ranks[k - 1] + 1;
  std::string name = "stages" + std::to_string(ranks.front());
  if (contiguous)
    return name + "-" + std::to_string(ranks.back());
  for (int64_t r : ranks.drop_front())
    name += "_" + std::to_string(r);
  if (name.size() <= 64)
    return name;
  return "stages" + std::to_string(ranks.front()) + "-" +
         std::to_string(ranks.back()) + "x" + std::to_string(ranks.size());
}

// In step function `name` of each program of the group, each run of part
// calls that the ranks order differently becomes a table of group[0]'s.
void shareSchedule(ArrayRef<ModuleOp> group, StringRef name) {
  ModuleOp shared = group.front();
  MLIRContext *ctx = shared.getContext();
  Builder b(ctx);
  SmallVector<SmallVector<StepItem>> items;
  for (ModuleOp program : group)
    items.push_back(stepItems(ModuleOp(program).lookupSymbol<func::FuncOp>(name)));
  for (auto [k, item] : llvm::enumerate(items.front())) {
    if (item.op)
      continue;
    SmallVector<SmallVector<PartCall>> runs;
    for (auto &programItems : items)
      runs.push_back(runOf(programItems[k]));
    if (llvm::all_equal(runs))
      continue;
    SmallVector<StringRef> parts;
    SmallVector<Attribute> tables;
    for (const SmallVector<PartCall> &run : runs) {
      SmallVector<int64_t> table;
      for (const PartCall &call : run) {
        auto it = llvm::find(parts, call.part);
        if (it == parts.end())
          it = parts.insert(parts.end(), call.part);
        table.append({it - parts.begin(), call.mb, call.first ? 1 : 0});
      }
      tables.push_back(b.getDenseI64ArrayAttr(table));
    }
    SmallVector<Attribute> partRefs;
    for (StringRef part : parts)
      partRefs.push_back(FlatSymbolRefAttr::get(ctx, part));
    OpBuilder at(item.calls.front());
    rt::ScheduleOp::create(at, item.calls.front().getLoc(),
                           at.getArrayAttr(partRefs), at.getArrayAttr(tables));
    for (func::CallOp call : item.calls)
      call.erase();
  }
  auto step = shared.lookupSymbol<func::FuncOp>(name);
  for (Operation &op : llvm::make_early_inc_range(step.getOps()))
    if (isa<arith::ConstantOp>(op) && op.use_empty())
      op.erase();
}

// Makes group[0] the program of every rank of the group and erases the rest.
void share(ArrayRef<ModuleOp> group) {
  ModuleOp shared = group.front();
  MLIRContext *ctx = shared.getContext();
  Builder b(ctx);
  SmallVector<func::FuncOp> steps;
  SmallVector<int64_t> ranks, slots, chunkOffsets, chunkTotals;
  SmallVector<Attribute> serves;
  for (ModuleOp program : group) {
    steps.push_back(program.lookupSymbol<func::FuncOp>("train_step"));
    ranks.push_back(program->getAttrOfType<IntegerAttr>("pipe.rank").getInt());
    auto s = program->getAttrOfType<IntegerAttr>("rt.arena_slots");
    slots.push_back(s ? s.getInt() : 1);
    if (auto offsets = program->getAttrOfType<DenseI64ArrayAttr>(
            "rt.chunk_arena_offsets")) {
      llvm::append_range(chunkOffsets, offsets.asArrayRef());
      chunkTotals.push_back(
          program->getAttrOfType<IntegerAttr>("rt.chunk_arena_total")
              .getInt());
    }
    serves.push_back(b.getStringAttr(*program.getSymName()));
  }
  for (StringRef name : {"train_step", "eval_step"})
    if (shared.lookupSymbol<func::FuncOp>(name))
      shareSchedule(group, name);

  // Each parameter's name on every rank, in the order of rt.variants.
  SmallVector<SmallVector<rt::ParamOp>> params;
  for (func::FuncOp step : steps) {
    params.emplace_back();
    step.walk([&](rt::ParamOp p) { params.back().push_back(p); });
  }
  for (auto [k, param] : llvm::enumerate(params.front())) {
    SmallVector<StringRef> names;
    for (auto &programParams : params)
      names.push_back(programParams[k].getName());
    param.setVariantNamesAttr(b.getStrArrayAttr(names));
  }

  shared->removeAttr("pipe.rank");
  shared->setAttr("rt.variants", b.getDenseI64ArrayAttr(ranks));
  shared->setAttr("rt.variant_arena_slots", b.getDenseI64ArrayAttr(slots));
  if (!chunkTotals.empty()) {
    shared->setAttr("rt.variant_chunk_arena_offsets",
                    b.getDenseI64ArrayAttr(chunkOffsets));
    shared->setAttr("rt.variant_chunk_arena_total",
                    b.getDenseI64ArrayAttr(chunkTotals));
  }
  shared->setAttr("rt.arena_slots",
                  b.getI64IntegerAttr(*llvm::max_element(slots)));
  shared->setAttr("rt.serves", b.getArrayAttr(serves));
  shared.setSymName(sharedName(ranks));
  for (ModuleOp program : group.drop_front())
    program.erase();
}

struct ShareProgramsPass
    : tessel::impl::ShareProgramsBase<ShareProgramsPass> {
  void runOnOperation() override {
    ModuleOp top = getOperation();
    // Programs of pipeline ranks, grouped with the first they match.
    SmallVector<SmallVector<ModuleOp>> groups;
    for (auto program : top.getOps<ModuleOp>()) {
      if (!program->hasAttr("pipe.rank") || !program.getSymName() ||
          !program.lookupSymbol<func::FuncOp>("train_step"))
        continue;
      auto group = llvm::find_if(groups, [&](ArrayRef<ModuleOp> g) {
        return samePrograms(g.front(), program);
      });
      if (group == groups.end())
        groups.push_back({program});
      else
        group->push_back(program);
    }
    for (ArrayRef<ModuleOp> group : groups)
      if (group.size() > 1)
        share(group);
  }
};

} // namespace
