//===- LowerPrecision.cpp - bf16 buffers where a bf16 program keeps them --===//
//
// Mixed precision as element types: on the bufferized rank programs (rt),
// every working buffer becomes `bf16` except those a bf16 program keeps in
// fp32: what becomes a parameter gradient (and every term summed into one),
// what the gradient norm reads, norm weight gradients, the attention's row
// log-sum-exp, one-element values (losses, norms), and whatever shares
// storage or a message with those.
// Matmuls (the MoE experts' grouped ones too) and sends read parameters
// through their bf16 shadow (`rt.state_of <shadow>`), which AdamW refreshes
// after each update from the fp32 master weights.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "dialects/Pipe/PipeOps.h"
#include "dialects/Rt/RtOps.h"

#include "mlir/Dialect/Func/IR/FuncOps.h"

#include <map>
#include <tuple>

namespace tessel {
#define GEN_PASS_DEF_LOWERPRECISION
#include "tessel/Transforms/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;
namespace rt = tessel::rtir;

namespace {

// Values that are one storage: views and their sources, values handed from
// part to part (what a part yields and its results; the update's metrics
// too), the update's inputs and its block arguments.
class StorageClasses {
public:
  Value find(Value v) {
    auto it = parent.find(v);
    if (it == parent.end() || it->second == v)
      return v;
    Value root = find(it->second);
    parent[v] = root;
    return root;
  }
  void unite(Value a, Value b) {
    a = find(a);
    b = find(b);
    if (a != b)
      parent[a] = b;
  }
  DenseMap<Value, Value> parent;
};

bool isBuffer(Value v) { return isa<MemRefType>(v.getType()); }

struct LowerPrecisionPass
    : tessel::impl::LowerPrecisionBase<LowerPrecisionPass> {
  void runOnOperation() override;
};

void LowerPrecisionPass::runOnOperation() {
  ModuleOp module = getOperation();
  MLIRContext *ctx = &getContext();
  StorageClasses classes;
  SmallVector<Value> buffers;
  module.walk([&](Operation *op) {
    for (Value r : op->getResults())
      if (isBuffer(r))
        buffers.push_back(r);
    for (Region &region : op->getRegions())
      for (Block &block : region)
        for (BlockArgument arg : block.getArguments())
          if (isBuffer(arg))
            buffers.push_back(arg);
    if (auto view = dyn_cast<rt::ViewOp>(op))
      classes.unite(view.getResult(), view.getSource());
    if (isa<pipe::ForwardPassOp, pipe::BackwardPassOp, pipe::UpdateOp>(op)) {
      auto yield = cast<pipe::YieldOp>(op->getRegion(0).front().getTerminator());
      for (auto [result, value] :
           llvm::zip(op->getResults(), yield.getValues()))
        if (isBuffer(result))
          classes.unite(result, value);
    }
    if (auto update = dyn_cast<pipe::UpdateOp>(op))
      for (auto [arg, input] : llvm::zip(update.getBody().getArguments(),
                                          update.getInputs()))
        if (isBuffer(arg))
          classes.unite(arg, input);
  });
  DenseMap<Value, SmallVector<Value>> members;
  for (Value v : buffers)
    members[classes.find(v)].push_back(v);

  // Each message's ends: what is sent is what is received.
  std::map<std::tuple<int64_t, int64_t, int64_t>, SmallVector<Value>> sent,
      received;
  module.walk([&](Operation *op) {
    if (auto send = dyn_cast<rt::SendOp>(op))
      sent[rt::messageOf(send)].push_back(send.getBuffer());
    if (auto recv = dyn_cast<rt::RecvOp>(op))
      received[rt::messageOf(recv)].push_back(recv.getBuffer());
  });

  DenseSet<Value> fp32; // class representatives
  SmallVector<Value> work;
  auto keep = [&](Value v) {
    Value c = classes.find(v);
    if (fp32.insert(c).second)
      work.push_back(c);
  };
  // Values summed over microbatches for the update are summed in fp32.
  pipe::LayoutAttr layout = pipe::layoutOf(module);
  bool accumulates = layout && layout.getMicrobatches() > 1;
  module.walk([&](Operation *op) {
    if (auto update = dyn_cast<pipe::UpdateOp>(op); update && accumulates)
      for (Value input : update.getInputs())
        if (isBuffer(input))
          keep(input);
    if (auto state = dyn_cast<rt::StateOfOp>(op))
      // AdamW's moments are fp32 like the master weights.
      fp32.insert(classes.find(state.getResult()));
    if (auto p = dyn_cast<rt::ParamOp>(op))
      // Master weights are fp32; what is cut from them (a fused projection's
      // pieces) is a working buffer like any other.
      fp32.insert(classes.find(p.getResult()));
    else if (auto adamw = dyn_cast<rt::AdamWOp>(op))
      keep(adamw.getGrad());
    else if (auto mb = dyn_cast<rt::MatmulBiasOp>(op))
      // The epilogue reads the fp32 bias (a piece of one is cut in fp32).
      keep(mb.getBias());
    else if (auto s = dyn_cast<rt::SumSquaresOp>(op))
      keep(s.getX());
    else if (auto n = dyn_cast<rt::LayerNormBackwardOp>(op)) {
      keep(n.getDw());
      keep(n.getDb());
    } else if (auto n = dyn_cast<rt::LayerNormBackwardAddOp>(op)) {
      keep(n.getDw());
      keep(n.getDb());
    } else if (auto n = dyn_cast<rt::RmsNormBackwardOp>(op)) {
      keep(n.getDw());
    } else if (auto n = dyn_cast<rt::RmsNormBackwardAddOp>(op)) {
      keep(n.getDw());
    } else if (auto a = dyn_cast<rt::AttentionForwardOp>(op)) {
      // The attention's row log-sum-exp, as FlashAttention keeps it.
      keep(a.getLse());
    } else if (auto a = dyn_cast<rt::AttentionBackwardOp>(op)) {
      keep(a.getLse());
    } else if (auto top = dyn_cast<rt::MoeTopKOp>(op)) {
      // The router's probabilities, as Hugging Face's Mixtral takes the
      // softmax of the (bf16) logits in fp32: routing near-ties as fp32.
      keep(top.getProbs());
    } else if (auto stats = dyn_cast<rt::MoeLoadStatsOp>(op)) {
      // Assignments per expert (bf16 counts exactly only up to 256) and
      // the probabilities summed over the microbatch's tokens.
      keep(stats.getCounts());
      keep(stats.getProbSums());
    } else if (auto kept = dyn_cast<rt::MoeKeptCountsOp>(op)) {
      keep(kept.getKept());
    } else if (auto grad = dyn_cast<rt::MoeAuxLossBackwardOp>(op)) {
      keep(grad.getDprobSums());
    } else if (auto ret = dyn_cast<func::ReturnOp>(op)) {
      // What a function returns (the step's metrics) keeps the type its
      // signature declares.
      for (Value v : ret.getOperands())
        if (isBuffer(v))
          keep(v);
    }
    for (Value r : op->getResults())
      if (auto type = dyn_cast<MemRefType>(r.getType());
          type && type.getNumElements() == 1)
        keep(r);
  });
  auto same = [&](Value a, Value b) {
    return classes.find(a) == classes.find(b);
  };
  while (!work.empty()) {
    Value c = work.pop_back_val();
    for (Value v : members[c]) {
      for (Operation *user : v.getUsers()) {
        if (auto add = dyn_cast<rt::AddBroadcastOp>(user)) {
          // A sum of gradient contributions.
          if (same(add.getOut(), v)) {
            keep(add.getA());
            keep(add.getB());
          }
        } else if (auto sum = dyn_cast<rt::MatmulAddOp>(user)) {
          // The GEMM's C and D have one type.
          keep(sum.getAddend());
          keep(sum.getOut());
        } else if (isa<rt::InsertAxisOp, rt::SliceAxisOp, rt::TransposeOp,
                       rt::ZigzagOp, rt::AllGatherOp, rt::ReduceScatterOp>(
                       user)) {
          // Pieces of one tensor (or it reordered) share its type: GPT-2's
          // position-table gradient under context parallelism is gathered
          // and put back in sequence order into the fp32 gradient.
          keep(user->getOperand(0));
          keep(user->getOperand(1));
        } else if (auto recv = dyn_cast<rt::RecvOp>(user)) {
          for (Value s : sent[rt::messageOf(recv)])
            keep(s);
        } else if (auto send = dyn_cast<rt::SendOp>(user)) {
          for (Value r : received[rt::messageOf(send)])
            keep(r);
        }
      }
    }
  }

  // Matmuls and sends read parameters through the bf16 shadow; AdamW
  // refreshes it.
  auto bf16 = BFloat16Type::get(ctx);
  auto lowered = [&](MemRefType type) {
    return MemRefType::get(type.getShape(), bf16);
  };
  auto paramOf = [](Value v) -> rt::ParamOp {
    while (auto view = v.getDefiningOp<rt::ViewOp>())
      v = view.getSource();
    return v.getDefiningOp<rt::ParamOp>();
  };
  auto shadowOf = [&](OpBuilder &b, Location loc, Value v) -> Value {
    rt::ParamOp param = paramOf(v);
    auto paramType = cast<MemRefType>(param.getType());
    Value shadow = rt::StateOfOp::create(
        b, loc, lowered(paramType), param.getResult(),
        rt::SpaceAttr::get(ctx, rt::Space::Shadow), IntegerAttr());
    auto type = cast<MemRefType>(v.getType());
    if (type.getShape() != paramType.getShape())
      shadow = rt::ViewOp::create(b, loc, lowered(type), shadow);
    return shadow;
  };
  SmallVector<OpOperand *> readers;
  SmallVector<rt::AdamWOp> updates;
  module.walk([&](Operation *op) {
    if (isa<rt::MatmulOp, rt::MatmulBiasOp, rt::MatmulBiasGradOp,
            rt::MatmulGeluGradOp, rt::MatmulAddOp>(op)) {
      readers.push_back(&op->getOpOperand(0));
      readers.push_back(&op->getOpOperand(1));
    } else if (auto grouped = dyn_cast<rt::GroupedMatmulOp>(op)) {
      readers.push_back(&grouped.getWMutable()); // an MoE block's experts
    } else if (isa<rt::SendOp>(op)) {
      readers.push_back(&op->getOpOperand(0));
    } else if (auto adamw = dyn_cast<rt::AdamWOp>(op)) {
      updates.push_back(adamw);
    }
  });
  for (OpOperand *use : readers) {
    if (!paramOf(use->get()))
      continue;
    OpBuilder b(use->getOwner());
    use->set(shadowOf(b, use->getOwner()->getLoc(), use->get()));
  }
  for (rt::AdamWOp adamw : updates) {
    if (!paramOf(adamw.getParam()) || adamw.getShadow())
      continue;
    OpBuilder b(adamw);
    adamw.getShadowMutable().assign(
        shadowOf(b, adamw.getLoc(), adamw.getParam()));
  }

  // Everything else is bf16.
  for (auto &[c, values] : members) {
    if (fp32.contains(c))
      continue;
    for (Value v : values) {
      auto type = cast<MemRefType>(v.getType());
      if (type.getElementType().isF32())
        v.setType(lowered(type));
    }
  }

  // A parameter gathered or sliced into a bf16 buffer (a key or value
  // projection whose heads are fewer than the tp ranks, gathered over tp
  // before its matmul; GPT-2's q, k and v slices of its q|k|v weight) is
  // read through its bf16 copy: pieces of one tensor share its type, and
  // rounding commutes with taking pieces. So the fp32 master weights are
  // read by their update alone (ZeRO keeps them as pieces).
  module.walk([&](Operation *op) {
    if (!isa<rt::AllGatherOp, rt::SliceAxisOp>(op))
      return;
    OpOperand &input = op->getOpOperand(0);
    if (!paramOf(input.get()) || !cast<MemRefType>(op->getOperand(1).getType())
                                      .getElementType()
                                      .isBF16())
      return;
    OpBuilder b(op);
    input.set(shadowOf(b, op->getLoc(), input.get()));
  });
}

} // namespace
