//===- OrderMessages.cpp - Pipeline messages in the receivers' order ------===//
//
// NCCL matches point-to-point messages on a channel in the order they are
// posted, not by tag. On the rank programs (after convert-pipe-to-rt, whose
// step calls its parts in schedule order), each send learns its place in
// the receiver's sequence per microbatch (`order`), so the CUDA runtime can
// issue a channel's sends in that order. The ranks are then run as the
// CUDA runtime runs them on the device, op by op, to show the protocol
// cannot deadlock: a send goes out at the first flush after it (when its
// turn has come), a receive waits for its message, and a collective over
// the pipeline waits for every stage to reach it.
//
//===----------------------------------------------------------------------===//

#include "tessel/Transforms/Passes.h"

#include "dialects/Dist/DistOps.h"
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

// What a rank's device does, in program order, as far as other pipeline
// ranks are concerned.
struct Event {
  enum Kind { Recv, Send, Flush, WaitSends, Collective } kind;
  Channel channel = {0, 0};
  Message message = {0, 0};
  const std::string *what = nullptr; // the part, for messages
};

// A blocking collective whose group spans pipeline ranks: every stage must
// reach it (in the same order on every stage) before any passes it.
bool spansPipeline(Operation *op, const MeshShape &mesh) {
  auto comm = dyn_cast<rt::CommunicationOpInterface>(op);
  if (!comm || isa<rt::SendOp, rt::RecvOp>(op) ||
      llvm::any_of(op->getResultTypes(), llvm::IsaPred<rt::RequestType>))
    return false;
  SmallVector<rt::CollectiveRecord> records;
  comm.describeCommunication(mesh, records);
  return llvm::any_of(records, [](const rt::CollectiveRecord &r) {
    return r.axes.contains(MeshAxis::PP);
  });
}

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
    std::map<int64_t, std::vector<Event>> events;       // by rank
    MeshShape mesh = dist::meshOf(top);
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
      // The device's events: the step's ops and, at each call, the part's,
      // each with its microbatch and the index of its entry in `mine` (read
      // once `mine` has all its entries).
      std::vector<std::pair<Operation *, std::pair<int64_t, size_t>>> visits;
      for (Operation &op : step.getBody().getOps()) {
        auto call = dyn_cast<func::CallOp>(op);
        auto part = call ? program.lookupSymbol<func::FuncOp>(call.getCallee())
                         : func::FuncOp();
        if (!part || call.getNumOperands() != 2) {
          visits.push_back({&op, {0, 0}});
          continue;
        }
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
        part.walk([&](Operation *op) {
          record(op, mb, messages);
          visits.push_back({op, {mb, mine.size() - 1}});
        });
      }
      std::vector<Event> &device = events[rank];
      for (auto [op, where] : visits) {
        const std::string *what = &mine[where.second].what;
        if (isa<rt::RecvOp, rt::SendOp>(op)) {
          auto [from, to, tag] = rt::messageOf(op);
          device.push_back({isa<rt::RecvOp>(op) ? Event::Recv : Event::Send,
                            {from, to},
                            {tag, where.first},
                            what});
        } else if (isa<rt::FlushSendsOp>(op)) {
          device.push_back({Event::Flush, {0, 0}, {0, 0}, what});
        } else if (isa<rt::WaitSendsOp>(op)) {
          device.push_back({Event::WaitSends, {0, 0}, {0, 0}, what});
        } else if (spansPipeline(op, mesh)) {
          device.push_back({Event::Collective, {0, 0}, {0, 0}, what});
        }
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

    // Runs the ranks' devices as the CUDA runtime drives them: a send is
    // queued; a flush issues, per channel, the queued sends whose turn has
    // come (the runtime's count of the channel's issued sends; waiting for
    // the step's sends resets it, and any send still queued then is never
    // issued); a receive waits until its message has been issued; a
    // collective over the pipeline waits until every stage has reached it.
    // Every rank finishing shows the protocol cannot deadlock.
    std::map<Channel, int64_t> issued, turn;
    std::map<Channel, std::set<int64_t>> queued;
    std::map<int64_t, size_t> next;
    // Per rank, the collectives over the pipeline it has reached (the one
    // it waits in included) and passed.
    std::map<int64_t, int64_t> reached, passed;
    auto flush = [&](int64_t rank) {
      for (auto &[channel, q] : queued)
        if (channel.first == rank)
          while (q.count(turn[channel])) {
            q.erase(turn[channel]++);
            ++issued[channel];
          }
    };
    for (bool progress = true; progress;) {
      progress = false;
      for (auto &[rank, device] : events) {
        while (next[rank] < device.size()) {
          const Event &e = device[next[rank]];
          if (e.kind == Event::Recv &&
              orderOf(e.channel, e.message) >= issued[e.channel])
            break;
          if (e.kind == Event::Collective) {
            if (reached[rank] == passed[rank])
              ++reached[rank];
            int64_t k = reached[rank];
            if (llvm::any_of(events, [&](auto &other) {
                  return reached[other.first] < k;
                }))
              break;
            ++passed[rank];
          }
          if (e.kind == Event::Send)
            queued[e.channel].insert(orderOf(e.channel, e.message));
          if (e.kind == Event::Flush || e.kind == Event::WaitSends)
            flush(rank);
          if (e.kind == Event::WaitSends) {
            for (auto &[channel, q] : queued)
              if (channel.first == rank && !q.empty())
                return top.emitError(eval ? "evaluation: pipeline rank "
                                          : "pipeline rank ")
                       << rank << " never issues its send of order "
                       << *q.begin() << " to rank " << channel.second
                       << " (its turn on the channel is " << turn[channel]
                       << " when the step waits for its sends)";
            for (auto &[channel, t] : turn)
              if (channel.first == rank)
                t = 0;
          }
          ++next[rank];
          progress = true;
        }
      }
    }
    for (auto &[rank, device] : events) {
      if (next[rank] == device.size())
        continue;
      const Event &e = device[next[rank]];
      if (e.kind == Event::Recv)
        return top.emitError(eval ? "evaluation: pipeline rank "
                                  : "pipeline rank ")
               << rank << " would wait forever: its " << *e.what
               << " receives message " << e.message.first << " from rank "
               << e.channel.first << ", which is never sent in turn";
    }
    for (auto &[rank, device] : events) {
      if (next[rank] == device.size())
        continue;
      // Every rank left waits in a collective over the pipeline that
      // another never reaches.
      const Event &e = device[next[rank]];
      return top.emitError(eval ? "evaluation: pipeline rank "
                                : "pipeline rank ")
             << rank << " would wait forever: its " << *e.what
             << " waits in a collective over the pipeline that another "
                "stage never reaches";
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
