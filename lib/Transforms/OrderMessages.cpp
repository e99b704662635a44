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
// The same replay then sizes the send ring, on both targets: the forward
// and backward sends' copies take its slots in turn, a send waiting until
// the message its slot held has been received, and the ring gets the
// fewest slots with which every rank still finishes (on the CPU target,
// whose MPI messages are matched by tag, a send goes out when it is made
// and no order is set).
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
  // A send of a forward or backward part: its copy goes to the send ring.
  bool ring = false;
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

// One step function's messages over all ranks, and its devices' events.
struct StepReplay {
  bool eval = false;
  std::map<int64_t, std::vector<StepMessages>> steps; // by rank
  std::map<int64_t, std::vector<Event>> events;       // by rank
  std::map<Channel, std::vector<Message>> sent, received;
  // (channel, tag) -> the message's place in the receiver's order, per
  // microbatch.
  std::map<std::pair<Channel, int64_t>, std::vector<int64_t>> orders;
  int64_t orderOf(const Channel &c, const Message &m) const {
    return orders.at({c, m.first})[m.second];
  }
};

struct OrderMessagesPass
    : tessel::impl::OrderMessagesBase<OrderMessagesPass> {
  using OrderMessagesBase::OrderMessagesBase;

  void runOnOperation() override {
    ModuleOp top = getOperation();
    bool cuda = target == "cuda";
    // A CPU program's messages are matched by MPI tags, which any order
    // fits: there the pass only plans the send ring, and a program it
    // cannot replay keeps a buffer per send, as without it.
    StepReplay train, eval;
    eval.eval = true;
    if (failed(collect(top, "train_step", cuda, train)) ||
        failed(collect(top, "eval_step", cuda, eval))) {
      if (cuda)
        signalPassFailure();
      return;
    }
    for (StepReplay *step : {&train, &eval}) {
      std::string error = replay(*step, /*ringSlots=*/0, cuda);
      if (error.empty())
        continue;
      if (cuda) {
        top.emitError(error);
        return signalPassFailure();
      }
      return;
    }
    if (cuda) {
      Builder b(&getContext());
      for (StepReplay *step : {&train, &eval})
        for (auto &[rank, calls] : step->steps)
          for (StepMessages &call : calls)
            for (auto &[channel, m, send] : call.sends) {
              auto order =
                  b.getDenseI64ArrayAttr(step->orders[{channel, m.first}]);
              if (step->eval)
                send.setEvalOrderAttr(order);
              else
                send.setOrderAttr(order);
            }
    }
    planRing(top, train, eval, cuda);
  }

  // The send ring: the copies of the forward and backward parts' sends
  // take `k` slots in turn, each as large as the rank's largest such send,
  // and a send whose slot still holds an earlier message waits (on the
  // device) until that message has been received. k is the smallest count
  // with which every rank still finishes both steps when replayed; every
  // program of the job uses it. Sends outside those parts (the update's,
  // the step's own) keep a buffer each. With k = the most ring sends a
  // rank makes in a step, no send ever waits, so a k is always found.
  void planRing(ModuleOp top, StepReplay &train, StepReplay &eval, bool cuda) {
    int64_t most = 0;
    for (StepReplay *step : {&train, &eval})
      for (auto &[rank, device] : step->events) {
        int64_t count = 0;
        for (const Event &e : device) {
          if (e.kind == Event::WaitSends)
            count = 0;
          if (e.kind == Event::Send && e.ring)
            most = std::max(most, ++count);
        }
      }
    if (most == 0)
      return;
    int64_t slots = 1;
    while (slots < most && (!replay(train, slots, cuda).empty() ||
                            !replay(eval, slots, cuda).empty()))
      ++slots;
    Builder b(&getContext());
    for (auto program : top.getOps<ModuleOp>()) {
      int64_t slotBytes = 0;
      for (StringRef name : {"train_step", "eval_step"}) {
        auto step = program.lookupSymbol<func::FuncOp>(name);
        if (!step)
          continue;
        for (Operation &op : step.getBody().getOps()) {
          auto call = dyn_cast<func::CallOp>(op);
          auto part = call
                          ? program.lookupSymbol<func::FuncOp>(call.getCallee())
                          : func::FuncOp();
          if (!part || !inRing(part))
            continue;
          part.walk([&](rt::SendOp send) {
            send.setRing(true);
            slotBytes =
                std::max(slotBytes, rt::elementsOf(send.getBuffer()) *
                                        rt::elementBytesOf(send.getBuffer()));
          });
        }
      }
      if (slotBytes == 0)
        continue;
      program->setAttr("rt.send_ring_slots", b.getI64IntegerAttr(slots));
      program->setAttr("rt.send_slot_bytes", b.getI64IntegerAttr(slotBytes));
    }
  }

  // Whether a part's sends go to the ring: a forward or backward part's,
  // which run once per microbatch.
  static bool inRing(func::FuncOp part) {
    auto kind = part->getAttrOfType<StringAttr>("rt.part");
    return kind && kind.getValue() != "update";
  }

  // Reads the messages and device events of each program's step function
  // `stepName` and each message's place in its receiver's order. Errors
  // are reported only with `report`.
  LogicalResult collect(ModuleOp top, StringRef stepName, bool report,
                        StepReplay &out) {
    bool eval = out.eval;
    auto &sent = out.sent, &received = out.received;
    MeshShape mesh = dist::meshOf(top);
    for (auto program : top.getOps<ModuleOp>()) {
      auto rankAttr = program->getAttrOfType<IntegerAttr>("pipe.rank");
      auto step = program.lookupSymbol<func::FuncOp>(stepName);
      if (!rankAttr || !step)
        continue;
      int64_t rank = rankAttr.getInt();
      std::vector<StepMessages> &mine = out.steps[rank];
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
      // each with its microbatch, the index of its entry in `mine` (read
      // once `mine` has all its entries) and whether its sends go to the
      // ring.
      struct Visit {
        Operation *op;
        int64_t mb = 0;
        size_t entry = 0;
        bool ring = false;
      };
      std::vector<Visit> visits;
      for (Operation &op : step.getBody().getOps()) {
        auto call = dyn_cast<func::CallOp>(op);
        auto part = call ? program.lookupSymbol<func::FuncOp>(call.getCallee())
                         : func::FuncOp();
        if (!part || call.getNumOperands() != 2) {
          visits.push_back({&op});
          continue;
        }
        IntegerAttr mbAttr;
        if (!matchPattern(call.getOperand(0), m_Constant(&mbAttr))) {
          if (report)
            call.emitOpError("runs a part for a microbatch not known "
                             "when compiling; the messages cannot be "
                             "ordered");
          return failure();
        }
        int64_t mb = mbAttr.getInt();
        StepMessages &messages = mine.emplace_back();
        auto kind = part->getAttrOfType<StringAttr>("rt.part");
        messages.what = (kind ? kind.getValue().str() : "part") +
                        " of microbatch " + std::to_string(mb);
        bool ring = inRing(part);
        part.walk([&](Operation *op) {
          record(op, mb, messages);
          visits.push_back({op, mb, mine.size() - 1, ring});
        });
      }
      std::vector<Event> &device = out.events[rank];
      for (const Visit &v : visits) {
        const std::string *what = &mine[v.entry].what;
        Operation *op = v.op;
        if (isa<rt::RecvOp, rt::SendOp>(op)) {
          auto [from, to, tag] = rt::messageOf(op);
          bool isSend = isa<rt::SendOp>(op);
          device.push_back({isSend ? Event::Send : Event::Recv,
                            {from, to},
                            {tag, v.mb},
                            what,
                            isSend && v.ring});
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
    for (auto &[channel, messages] : sent) {
      std::map<Message, int64_t> place;
      for (auto [k, m] : llvm::enumerate(received[channel]))
        place.emplace(m, k);
      std::string where = std::string(eval ? "evaluation: " : "") +
                          "pipeline rank " + std::to_string(channel.first) +
                          " -> rank " + std::to_string(channel.second) + ": ";
      if (messages.size() != received[channel].size() ||
          place.size() != messages.size()) {
        if (report)
          top.emitError(where) << messages.size() << " messages are sent and "
                               << received[channel].size() << " received";
        return failure();
      }
      for (const Message &m : messages) {
        auto it = place.find(m);
        if (it == place.end()) {
          if (report)
            top.emitError(where) << "message " << m.first << " of microbatch "
                                 << m.second << " is sent but never received";
          return failure();
        }
        std::vector<int64_t> &perMicrobatch = out.orders[{channel, m.first}];
        if ((int64_t)perMicrobatch.size() <= m.second)
          perMicrobatch.resize(m.second + 1, -1);
        perMicrobatch[m.second] = it->second;
      }
    }
    return success();
  }

  // Runs the ranks' devices as the runtime drives them; empty when every
  // rank finishes, else why one cannot.
  //
  // CUDA: a send is queued; a flush issues, per channel, the queued sends
  // whose turn has come (the runtime's count of the channel's issued
  // sends; waiting for the step's sends resets it, and any send still
  // queued then is never issued). CPU: a send is issued at once (MPI
  // matches tags, so any order is taken). Both: a receive waits until its
  // message has been issued; a collective over the pipeline waits until
  // every stage has reached it. With `ringSlots` > 0, a ring send whose
  // slot holds the message `ringSlots` ring sends before it (since the
  // step last waited for its sends) waits until that message has been
  // received; that message must have been issued by then (the runtime
  // cannot wait for a send it has not issued yet).
  std::string replay(const StepReplay &step, int64_t ringSlots, bool cuda) {
    bool eval = step.eval;
    const auto &events = step.events;
    std::string prefix = eval ? "evaluation: pipeline rank " : "pipeline rank ";
    std::map<Channel, int64_t> issued, turn;
    std::map<Channel, std::set<int64_t>> queued, issuedNow;
    std::set<std::pair<Channel, Message>> consumed;
    std::map<int64_t, std::vector<std::pair<Channel, Message>>> ring;
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
    auto isIssued = [&](const Channel &c, const Message &m) {
      int64_t order = step.orderOf(c, m);
      return cuda ? order < issued[c] : issuedNow[c].count(order) > 0;
    };
    for (bool progress = true; progress;) {
      progress = false;
      for (auto &[rank, device] : events) {
        while (next[rank] < device.size()) {
          const Event &e = device[next[rank]];
          if (e.kind == Event::Recv && !isIssued(e.channel, e.message))
            break;
          if (e.kind == Event::Send && e.ring && ringSlots > 0) {
            auto &held = ring[rank];
            if ((int64_t)held.size() >= ringSlots) {
              auto &[c, m] = held[held.size() - ringSlots];
              if (!isIssued(c, m))
                return prefix + std::to_string(rank) +
                       " reuses a send slot before its message is issued";
              if (!consumed.count({c, m}))
                break;
            }
            held.push_back({e.channel, e.message});
          }
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
          if (e.kind == Event::Recv)
            consumed.insert({e.channel, e.message});
          if (e.kind == Event::Send) {
            if (cuda)
              queued[e.channel].insert(step.orderOf(e.channel, e.message));
            else
              issuedNow[e.channel].insert(step.orderOf(e.channel, e.message));
          }
          if (cuda && (e.kind == Event::Flush || e.kind == Event::WaitSends))
            flush(rank);
          if (e.kind == Event::WaitSends) {
            for (auto &[channel, q] : queued)
              if (channel.first == rank && !q.empty())
                return prefix + std::to_string(rank) +
                       " never issues its send of order " +
                       std::to_string(*q.begin()) + " to rank " +
                       std::to_string(channel.second) +
                       " (its turn on the channel is " +
                       std::to_string(turn[channel]) +
                       " when the step waits for its sends)";
            for (auto &[channel, t] : turn)
              if (channel.first == rank)
                t = 0;
            ring[rank].clear();
          }
          ++next[rank];
          progress = true;
        }
      }
    }
    // A rank left waiting: one that waits for a message first (the cause,
    // where there is one), else one waiting for a send slot or in a
    // collective over the pipeline that another never reaches.
    const Event *stuck = nullptr;
    int64_t stuckRank = 0;
    for (auto &[rank, device] : events)
      if (next[rank] < device.size() &&
          (!stuck || (stuck->kind != Event::Recv &&
                      device[next[rank]].kind == Event::Recv))) {
        stuck = &device[next[rank]];
        stuckRank = rank;
      }
    if (!stuck)
      return "";
    std::string waits = prefix + std::to_string(stuckRank) +
                        " would wait forever: its " + *stuck->what;
    if (stuck->kind == Event::Recv)
      return waits + " receives message " +
             std::to_string(stuck->message.first) + " from rank " +
             std::to_string(stuck->channel.first) +
             ", which is never sent in turn";
    if (stuck->kind == Event::Send)
      return waits + " waits for a send slot whose message is never received";
    return waits + " waits in a collective over the pipeline that another "
                   "stage never reaches";
  }
};

} // namespace
