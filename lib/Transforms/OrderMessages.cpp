//===- OrderMessages.cpp - Pipeline messages in the receivers' order ------===//
//
// NCCL matches point-to-point messages on a channel in the order they are
// posted, not by tag. On the rank programs (after convert-pipe-to-rt, whose
// step calls its parts in schedule order), each send learns its place in
// the receiver's sequence per microbatch (`order`), so the CUDA runtime can
// issue a channel's sends in that order. The ranks are then run as the
// runtime will run them, to show the protocol cannot deadlock.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "dialects/Rt/RtOps.h"

#include "mlir/Dialect/Arith/IR/Arith.h"
#include "mlir/Dialect/Func/IR/FuncOps.h"
#include "mlir/IR/Matchers.h"

#include <map>
#include <set>

namespace tessel {
#define GEN_PASS_DEF_ORDERMESSAGES
#include "tessel/Transforms/Passes.h.inc"
} // namespace tessel

using namespace mlir;
using namespace tessel;
namespace rt = tessel::rtir;

namespace {

using Message = std::pair<int64_t, int64_t>; // tag, microbatch
using Channel = std::pair<int64_t, int64_t>; // from rank, to rank

// What one call of a part receives and sends, in its order.
struct StepMessages {
  SmallVector<std::pair<Channel, Message>> receives;
  SmallVector<std::tuple<Channel, Message, rt::SendOp>> sends;
  std::string what; // for messages: "backward of microbatch 2"
};

struct OrderMessagesPass
    : tessel::impl::OrderMessagesBase<OrderMessagesPass> {
  void runOnOperation() override {
    ModuleOp top = getOperation();
    if (failed(order(top, "train_step", /*eval=*/false)) ||
        failed(order(top, "eval_step", /*eval=*/true)))
      signalPassFailure();
  }

  // Orders the messages of each program's step function `stepName`: `order`
  // on its sends, or `eval_order` for the forward-only step.
  LogicalResult order(ModuleOp top, StringRef stepName, bool eval) {
    std::map<Channel, std::vector<Message>> sent, received;
    std::map<int64_t, std::vector<StepMessages>> steps; // by rank
    for (auto program : top.getOps<ModuleOp>()) {
      auto rankAttr = program->getAttrOfType<IntegerAttr>("pipe.rank");
      auto step = program.lookupSymbol<func::FuncOp>(stepName);
      if (!rankAttr || !step)
        continue;
      int64_t rank = rankAttr.getInt();
      std::vector<StepMessages> &mine = steps[rank];
      // What the step exchanges once before its parts (a parameter another
      // rank reads), as microbatch 0.
      auto record = [&](Operation *op, int64_t mb, StepMessages &messages) {
        if (!isa<rt::RecvOp, rt::SendOp>(op))
          return;
        auto [from, to, tag] = rt::messageOf(op);
        Channel c = {from, to};
        if (isa<rt::RecvOp>(op)) {
          received[c].push_back({tag, mb});
          messages.receives.push_back({c, {tag, mb}});
        } else {
          sent[c].push_back({tag, mb});
          messages.sends.push_back({c, {tag, mb}, cast<rt::SendOp>(op)});
        }
      };
      StepMessages &start = mine.emplace_back();
      start.what = "start of the step";
      for (Operation &op : step.getBody().getOps())
        record(&op, 0, start);
      for (auto call : step.getBody().getOps<func::CallOp>()) {
        auto part = program.lookupSymbol<func::FuncOp>(call.getCallee());
        if (!part || call.getNumOperands() != 2)
          continue;
        IntegerAttr mbAttr;
        if (!matchPattern(call.getOperand(0), m_Constant(&mbAttr))) {
          return call.emitOpError("runs a part for a microbatch not known "
                                  "when compiling; the messages cannot be "
                                  "ordered");
        }
        int64_t mb = mbAttr.getInt();
        StepMessages &messages = mine.emplace_back();
        auto kind = part->getAttrOfType<StringAttr>("rt.part");
        messages.what = (kind ? kind.getValue().str() : "part") +
                        " of microbatch " + std::to_string(mb);
        part.walk([&](Operation *op) { record(op, mb, messages); });
      }
    }
    for (auto &entry : received)
      sent[entry.first]; // channels that only receive are compared too

    // A message's order is its place in the receiver's sequence (tags are
    // numbered per channel).
    std::map<std::pair<Channel, int64_t>, std::vector<int64_t>>
        orders; // (channel, tag) -> per microbatch
    for (auto &[channel, messages] : sent) {
      std::map<Message, int64_t> place;
      for (auto [k, m] : llvm::enumerate(received[channel]))
        place.emplace(m, k);
      std::string where = std::string(eval ? "evaluation: " : "") +
                          "pipeline rank " + std::to_string(channel.first) +
                          " -> rank " + std::to_string(channel.second) + ": ";
      if (messages.size() != received[channel].size() ||
          place.size() != messages.size()) {
        return top.emitError(where)
               << messages.size() << " messages are sent and "
               << received[channel].size() << " received";
      }
      for (const Message &m : messages) {
        auto it = place.find(m);
        if (it == place.end()) {
          return top.emitError(where)
                 << "message " << m.first << " of microbatch " << m.second
                 << " is sent but never received";
        }
        std::vector<int64_t> &perMicrobatch = orders[{channel, m.first}];
        if ((int64_t)perMicrobatch.size() <= m.second)
          perMicrobatch.resize(m.second + 1, -1);
        perMicrobatch[m.second] = it->second;
      }
    }
    auto orderOf = [&](const Channel &c, const Message &m) {
      return orders[{c, m.first}][m.second];
    };

    // Runs the ranks as the CUDA runtime will: a part starts once every
    // message it receives has been issued; its sends are queued and each
    // channel issues its queued messages in order while the next one is
    // there. Every rank finishing shows the protocol cannot deadlock.
    std::map<Channel, int64_t> issued;
    std::map<Channel, std::set<int64_t>> queued;
    std::map<int64_t, size_t> next;
    for (bool progress = true; progress;) {
      progress = false;
      for (auto &[rank, calls] : steps) {
        while (next[rank] < calls.size()) {
          const StepMessages &call = calls[next[rank]];
          if (!llvm::all_of(call.receives, [&](auto &r) {
                return orderOf(r.first, r.second) < issued[r.first];
              }))
            break;
          for (auto &[channel, m, send] : call.sends) {
            std::set<int64_t> &q = queued[channel];
            q.insert(orderOf(channel, m));
            while (q.count(issued[channel]))
              q.erase(issued[channel]++);
          }
          ++next[rank];
          progress = true;
        }
      }
    }
    for (auto &[rank, calls] : steps) {
      if (next[rank] == calls.size())
        continue;
      const StepMessages &call = calls[next[rank]];
      for (auto &[channel, m] : call.receives)
        if (orderOf(channel, m) >= issued[channel]) {
          return top.emitError(eval ? "evaluation: pipeline rank "
                                    : "pipeline rank ")
                 << rank << " would wait forever: its " << call.what
                 << " receives message " << m.first << " from rank "
                 << channel.first << ", which is never sent in turn";
        }
    }

    Builder b(&getContext());
    for (auto &[rank, calls] : steps)
      for (StepMessages &call : calls)
        for (auto &[channel, m, send] : call.sends) {
          auto order = b.getDenseI64ArrayAttr(orders[{channel, m.first}]);
          if (eval)
            send.setEvalOrderAttr(order);
          else
            send.setOrderAttr(order);
        }
    return success();
  }
};

} // namespace
