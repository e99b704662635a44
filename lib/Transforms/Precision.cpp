//===- Precision.cpp - Which values a bf16 program keeps in fp32 ----------===//
//
// See fp32ValuesOf in BufferPlan.h.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/BufferPlan.h"

#include "dialects/Dist/DistOps.h"
#include "dialects/Graph/GraphOps.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"

using namespace mlir;
using namespace tessel;
using namespace tessel::graph;

llvm::DenseSet<Value> tessel::fp32ValuesOf(ModuleOp module) {
  llvm::DenseSet<Value> fp32;
  SmallVector<Value> work;
  auto add = [&](Value v) {
    if (isa<RankedTensorType>(v.getType()) && fp32.insert(v).second)
      work.push_back(v);
  };
  llvm::DenseMap<int64_t, dist::SendOp> sends;
  llvm::DenseMap<int64_t, dist::RecvOp> recvs;
  module.walk([&](Operation *op) {
    if (auto send = dyn_cast<dist::SendOp>(op))
      sends[send.getTag()] = send;
    if (auto recv = dyn_cast<dist::RecvOp>(op))
      recvs[recv.getTag()] = recv;
    if (auto adamw = dyn_cast<AdamWOp>(op))
      add(adamw.getGrad());
    if (auto norm = dyn_cast<GlobalNormOp>(op))
      for (Value v : norm.getInputs())
        add(v);
    if (auto ret = dyn_cast<func::ReturnOp>(op))
      for (Value v : ret.getOperands())
        add(v);
    if (auto n = dyn_cast<LayerNormGradOp>(op)) {
      add(n.getWeightGrad());
      add(n.getBiasGrad());
    }
    if (auto n = dyn_cast<RmsNormGradOp>(op))
      add(n.getWeightGrad());
    for (Value r : op->getResults())
      if (auto t = dyn_cast<RankedTensorType>(r.getType());
          t && t.getNumElements() == 1)
        add(r);
  });
  // Operand i and result i of a collective share a type.
  auto linkCollective = [&](Operation *op, Value v) {
    if (isa<dist::AllReduceOp, dist::AllReduceStartOp>(op)) {
      for (auto [in, out] : llvm::zip(op->getOperands(), op->getResults()))
        if (in == v || out == v) {
          add(in);
          add(out);
        }
      return true;
    }
    if (isa<dist::AllGatherOp, dist::ReduceScatterOp, ReshapeOp,
            dist::LocalSliceOp, dist::LocalInsertOp, TransposeOp>(op)) {
      add(op->getOperand(0));
      add(op->getResult(0));
      return true;
    }
    return false;
  };
  while (!work.empty()) {
    Value v = work.pop_back_val();
    if (Operation *def = v.getDefiningOp()) {
      if (!linkCollective(def, v)) {
        if (auto a = dyn_cast<AddOp>(def)) {
          // A sum of gradient contributions.
          add(a.getLhs());
          add(a.getRhs());
        } else if (auto c = dyn_cast<ConcatOp>(def)) {
          for (Value in : c.getInputs())
            add(in);
        } else if (auto recv = dyn_cast<dist::RecvOp>(def)) {
          if (auto send = sends.lookup(recv.getTag()))
            add(send.getInput());
        }
      }
    }
    for (Operation *user : v.getUsers()) {
      if (isa<ReshapeOp, dist::AllReduceOp, dist::AllReduceStartOp>(user))
        linkCollective(user, v);
      if (auto send = dyn_cast<dist::SendOp>(user))
        if (auto recv = recvs.lookup(send.getTag()))
          add(recv.getResult());
    }
  }
  return fp32;
}
