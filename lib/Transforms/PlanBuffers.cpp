//===- PlanBuffers.cpp - Static memory plan of the training step ----------===//
//
// Gives every value of @train_step a place: the parameter store, the gradient
// store, an input, or an offset in one activation arena reused by liveness.
// See Passes.td for the contract and the attribute format.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/BufferPlan.h"
#include "tessel/Transforms/Passes.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Builders.h"

#include <map>

namespace tessel {
#define GEN_PASS_DEF_PLANBUFFERS
#include "tessel/Transforms/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;
using namespace tessel::graph;

namespace {

constexpr int64_t kAlignment = 64;

// f32 and i32 take 4 bytes; in a bf16 plan, values outside `fp32` take 2.
int64_t bytesOf(Value v, const llvm::DenseSet<Value> *fp32) {
  auto type = cast<RankedTensorType>(v.getType());
  bool bf16 = fp32 && !fp32->contains(v) && type.getElementType().isF32();
  return type.getNumElements() * (bf16 ? 2 : 4);
}

// First-fit allocator over one arena, merging neighbours on free.
class ArenaAllocator {
public:
  int64_t allocate(int64_t bytes) {
    bytes = llvm::alignTo(bytes, kAlignment);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < bytes)
        continue;
      int64_t offset = it->first, size = it->second;
      free_.erase(it);
      if (size > bytes)
        free_[offset + bytes] = size - bytes;
      return offset;
    }
    int64_t offset = top_;
    top_ += bytes;
    return offset;
  }
  void release(int64_t offset, int64_t bytes) {
    bytes = llvm::alignTo(bytes, kAlignment);
    auto it = free_.emplace(offset, bytes).first;
    auto next = std::next(it);
    if (next != free_.end() && it->first + it->second == next->first) {
      it->second += next->second;
      free_.erase(next);
    }
    if (it != free_.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second == it->first) {
        prev->second += it->second;
        free_.erase(it);
      }
    }
  }
  int64_t size() const { return top_; }

private:
  std::map<int64_t, int64_t> free_;
  int64_t top_ = 0;
};

LogicalResult planBuffers(ModuleOp module, func::FuncOp func,
                          const llvm::DenseSet<Value> *fp32) {
  Block &body = func.getBody().front();
  MLIRContext *ctx = module.getContext();

  // Number the ops; a reshape's result shares its input's storage (root).
  DenseMap<Operation *, int64_t> position;
  for (Operation &op : body)
    position[&op] = position.size();
  DenseMap<Value, Value> root;
  auto rootOf = [&](Value v) {
    auto it = root.find(v);
    return it == root.end() ? v : it->second;
  };
  for (Operation &op : body) {
    if (auto reshape = dyn_cast<ReshapeOp>(op))
      root[reshape.getResult()] = rootOf(reshape.getInput());
    // An all-reduce works in place when nothing else reads its operand.
    if (isa<dist::AllReduceOp, dist::AllReduceStartOp>(op))
      for (auto [in, out] : llvm::zip(op.getOperands(), op.getResults())) {
        Operation *def = in.getDefiningOp();
        if (in.hasOneUse() && rootOf(in) == in && def &&
            !isa<ParamOp, InputOp>(def))
          root[out] = in;
      }
  }

  // Last use of each root over all its aliases.
  DenseMap<Value, int64_t> lastUse;
  for (Operation &op : body)
    for (Value operand : op.getOperands()) {
      int64_t &last = lastUse[rootOf(operand)];
      last = std::max(last, position[&op]);
    }

  DenseMap<Value, BufferRef> place;
  int64_t paramElems = 0;
  for (Operation &op : body) {
    if (auto param = dyn_cast<ParamOp>(op)) {
      place[param.getResult()] = {BufferSpace::Param, paramElems};
      paramElems += param.getType().getNumElements();
    } else if (auto input = dyn_cast<InputOp>(op)) {
      place[input.getResult()] = {BufferSpace::Input,
                                  input.getName() == "tokens" ? 0 : 1};
    }
  }
  // A parameter's final gradient goes straight to the gradient store.
  for (Operation &op : body)
    if (auto adamw = dyn_cast<AdamWOp>(op)) {
      Value grad = rootOf(adamw.getGrad());
      Operation *def = grad.getDefiningOp();
      if (def && !isa<ParamOp, InputOp>(def) && !place.count(grad))
        place[grad] = {BufferSpace::Grad, place[adamw.getParam()].offset};
    }

  ArenaAllocator arena;
  for (Operation &op : body) {
    for (Value result : op.getResults()) {
      Value r = rootOf(result);
      if (r != result || place.count(r) || !isa<RankedTensorType>(r.getType()))
        continue;
      place[r] = {BufferSpace::Arena, arena.allocate(bytesOf(r, fp32))};
    }
    // Free the roots whose last use is this op (or results never used).
    SmallVector<Value> dying;
    for (Value operand : op.getOperands())
      if (lastUse.lookup(rootOf(operand)) == position[&op])
        dying.push_back(rootOf(operand));
    for (Value result : op.getResults())
      if (rootOf(result) == result && !lastUse.count(result))
        dying.push_back(result);
    llvm::SmallPtrSet<void *, 8> freed;
    for (Value v : dying) {
      if (!place.count(v))
        continue;
      BufferRef ref = place[v];
      if (ref.space == BufferSpace::Arena &&
          freed.insert(v.getAsOpaquePointer()).second)
        arena.release(ref.offset, bytesOf(v, fp32));
    }
  }

  for (Operation &op : body) {
    if (op.getNumResults() == 0)
      continue;
    SmallVector<int64_t> pairs;
    for (Value result : op.getResults()) {
      auto it = place.find(rootOf(result));
      if (it == place.end()) // a request, not storage
        pairs.append({-1, 0});
      else
        pairs.append(
            {static_cast<int64_t>(it->second.space), it->second.offset});
    }
    op.setAttr(kBufferAttr, DenseI64ArrayAttr::get(ctx, pairs));
  }
  OpBuilder b(ctx);
  func->setAttr(kArenaBytesAttr, b.getI64IntegerAttr(arena.size()));
  func->setAttr(kParamElemsAttr, b.getI64IntegerAttr(paramElems));
  if (func.getSymName() == "train_step") {
    module->setAttr(kArenaBytesAttr, b.getI64IntegerAttr(arena.size()));
    module->setAttr(kParamElemsAttr, b.getI64IntegerAttr(paramElems));
  }
  return success();
}

struct PlanBuffersPass : tessel::impl::PlanBuffersBase<PlanBuffersPass> {
  using PlanBuffersBase::PlanBuffersBase;
  void runOnOperation() override {
    ModuleOp module = getOperation();
    // The training step, or one function per pipeline stage.
    SmallVector<func::FuncOp> steps;
    for (auto func : module.getOps<func::FuncOp>())
      if (func.getSymName() == "train_step" ||
          func.getSymName().starts_with("stage_"))
        steps.push_back(func);
    if (steps.empty()) {
      module.emitError("tessel-plan-buffers: no @train_step "
                       "(run tessel-autodiff first)");
      return signalPassFailure();
    }
    llvm::DenseSet<Value> fp32;
    if (bf16Activations) {
      fp32 = fp32ValuesOf(module);
      module->setAttr(kBf16ActivationsAttr, UnitAttr::get(module.getContext()));
    }
    for (auto func : steps)
      if (!func.getBody().hasOneBlock() ||
          failed(planBuffers(module, func, bf16Activations ? &fp32 : nullptr)))
        return signalPassFailure();
  }
};

} // namespace
