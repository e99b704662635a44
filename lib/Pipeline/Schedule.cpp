//===- Schedule.cpp - Pipeline stage assignment and schedules -------------===//

#include "tessel/Pipeline/Schedule.h"

#include "dialects/Pipe/PipeOps.h"

#include "llvm/Support/FormatVariadic.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <map>
#include <tuple>

using namespace tessel;
using namespace tessel::pipeline;
using llvm::createStringError;
using llvm::formatv;
using llvm::inconvertibleErrorCode;

static llvm::Error error(const std::string &message) {
  return createStringError(inconvertibleErrorCode(), message);
}

//===--- Stage assignment -------------------------------------------------===//

llvm::Expected<std::vector<int>>
tessel::pipeline::balanceStages(const std::vector<double> &layerCost,
                                int stages) {
  int n = layerCost.size();
  if (stages < 1)
    return error(formatv("the number of stages must be >= 1, got {0}", stages));
  if (n < stages)
    return error(formatv("cannot split {0} layers into {1} stages: every "
                         "stage needs at least one layer",
                         n, stages));
  for (auto [layer, cost] : llvm::enumerate(layerCost))
    if (!(cost >= 0))
      return error(
          formatv("layer {0} has cost {1}; costs must be >= 0", layer, cost));

  std::vector<double> prefix(n + 1, 0);
  for (int i = 0; i < n; ++i)
    prefix[i + 1] = prefix[i] + layerCost[i];
  // best[k][i]: the smallest maximum stage cost of the first i layers in k
  // stages; cut[k][i]: where the last of those stages starts.
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(stages + 1,
                                        std::vector<double>(n + 1, inf));
  std::vector<std::vector<int>> cut(stages + 1, std::vector<int>(n + 1, 0));
  best[0][0] = 0;
  for (int k = 1; k <= stages; ++k)
    for (int i = k; i <= n; ++i)
      for (int j = k - 1; j < i; ++j) {
        double cost = std::max(best[k - 1][j], prefix[i] - prefix[j]);
        if (cost < best[k][i]) {
          best[k][i] = cost;
          cut[k][i] = j;
        }
      }
  std::vector<int> stageOf(n);
  for (int k = stages, i = n; k >= 1; i = cut[k][i], --k)
    for (int layer = cut[k][i]; layer < i; ++layer)
      stageOf[layer] = k - 1;
  return stageOf;
}

llvm::Expected<std::vector<int>> tessel::pipeline::stagesFromLayerLists(
    const std::vector<std::vector<int>> &stageLayers, int numLayers,
    int stages) {
  if (static_cast<int>(stageLayers.size()) != stages)
    return error(
        formatv("stage_layers lists {0} stages but the pipeline has {1}",
                stageLayers.size(), stages));
  std::vector<int> stageOf(numLayers, -1);
  for (auto [stage, layers] : llvm::enumerate(stageLayers)) {
    if (layers.empty())
      return error(formatv("stage_layers: stage {0} has no layers", stage));
    for (int layer : layers) {
      if (layer < 0 || layer >= numLayers)
        return error(formatv("stage_layers: layer {0} of stage {1} does not "
                             "exist (the model has layers 0..{2})",
                             layer, stage, numLayers - 1));
      if (stageOf[layer] >= 0)
        return error(formatv("stage_layers: layer {0} is listed twice "
                             "(stages {1} and {2})",
                             layer, stageOf[layer], stage));
      stageOf[layer] = stage;
    }
  }
  for (int layer = 0; layer < numLayers; ++layer)
    if (stageOf[layer] < 0)
      return error(formatv("stage_layers: layer {0} is in no stage", layer));
  int expected = 0;
  for (auto [stage, layers] : llvm::enumerate(stageLayers))
    for (int layer : layers) {
      if (layer != expected)
        return error(formatv("stage_layers: stages must hold contiguous "
                             "layers in order; stage {0} lists layer {1} "
                             "where layer {2} comes next",
                             stage, layer, expected));
      ++expected;
    }
  return stageOf;
}

//===--- Schedules --------------------------------------------------------===//

llvm::StringRef tessel::pipeline::scheduleKindName(ScheduleKind kind) {
  return pipe::kScheduleKinds[static_cast<int>(kind)];
}

llvm::Expected<ScheduleKind>
tessel::pipeline::parseScheduleKind(llvm::StringRef name) {
  for (int i = 0; i < 3; ++i)
    if (name == pipe::kScheduleKinds[i])
      return static_cast<ScheduleKind>(i);
  return error(formatv("unknown schedule \"{0}\"; expected gpipe, 1f1b or "
                       "interleaved",
                       name));
}

static llvm::StringRef payloadName(Payload payload) {
  return payload == Payload::Activation ? pipe::kActivation : pipe::kGradient;
}

std::string tessel::pipeline::describeStep(const Step &step) {
  switch (step.kind) {
  case StepKind::Forward:
    return formatv("pipe.forward stage {0} microbatch {1}", step.stage,
                   step.microbatch);
  case StepKind::Backward:
    return formatv("pipe.backward stage {0} microbatch {1}", step.stage,
                   step.microbatch);
  case StepKind::Send:
    return formatv("pipe.send \"{0}\" stage {1} microbatch {2} to {3}",
                   payloadName(step.payload), step.stage, step.microbatch,
                   step.peer);
  case StepKind::Recv:
    return formatv("pipe.recv \"{0}\" stage {1} microbatch {2} from {3}",
                   payloadName(step.payload), step.stage, step.microbatch,
                   step.peer);
  }
  return "";
}

namespace {
// Appends a rank's computations with the transfers around them: a receive
// right before the computation that needs it (the latest point, so a rank
// never waits earlier than it must) and a send right after the computation
// that produced it.
struct RankSteps {
  int rank, ranks, numStages;
  std::vector<Step> &out;

  int owner(int stage) const {
    return pipe::pipelineLayout(ranks).stageOwner(stage);
  }
  bool remote(int stage) const {
    return stage >= 0 && stage < numStages && owner(stage) != rank;
  }

  void forward(int stage, int mb) {
    if (remote(stage - 1))
      out.push_back({StepKind::Recv, stage - 1, mb, Payload::Activation,
                     owner(stage - 1)});
    out.push_back({StepKind::Forward, stage, mb});
    if (remote(stage + 1))
      out.push_back(
          {StepKind::Send, stage, mb, Payload::Activation, owner(stage + 1)});
  }
  void backward(int stage, int mb) {
    if (remote(stage + 1))
      out.push_back(
          {StepKind::Recv, stage + 1, mb, Payload::Gradient, owner(stage + 1)});
    out.push_back({StepKind::Backward, stage, mb});
    if (remote(stage - 1))
      out.push_back(
          {StepKind::Send, stage, mb, Payload::Gradient, owner(stage - 1)});
  }
};
} // namespace

static void gpipeRank(RankSteps &rank, int microbatches) {
  for (int mb = 0; mb < microbatches; ++mb)
    rank.forward(rank.rank, mb);
  for (int mb = microbatches - 1; mb >= 0; --mb)
    rank.backward(rank.rank, mb);
}

// Megatron-LM's non-interleaved schedule: rank r runs p - r - 1 warmup
// forwards, then alternates one forward and one backward, then drains the
// remaining backwards.
static void oneFOneBRank(RankSteps &rank, int microbatches) {
  int warmup = std::min(rank.ranks - rank.rank - 1, microbatches);
  int steady = microbatches - warmup;
  for (int mb = 0; mb < warmup; ++mb)
    rank.forward(rank.rank, mb);
  for (int i = 0; i < steady; ++i) {
    rank.forward(rank.rank, warmup + i);
    rank.backward(rank.rank, i);
  }
  for (int mb = steady; mb < microbatches; ++mb)
    rank.backward(rank.rank, mb);
}

// Megatron-LM's interleaved schedule: a rank's k-th forward (or backward)
// belongs to the group of p microbatches k / (p * v), and within it to model
// chunk (k mod p*v) / p (backwards take the chunks in reverse).
static void interleavedRank(RankSteps &rank, int microbatches, int chunks) {
  int p = rank.ranks, total = microbatches * chunks;
  auto microbatchOf = [&](int k) { return (k / (p * chunks)) * p + k % p; };
  auto stageOf = [&](int k, bool forward) {
    int chunk = (k % (p * chunks)) / p;
    if (!forward)
      chunk = chunks - 1 - chunk;
    return chunk * p + rank.rank;
  };
  // With exactly p microbatches Megatron runs all forwards first.
  int warmup =
      microbatches == p
          ? total
          : std::min((p - rank.rank - 1) * 2 + (chunks - 1) * p, total);
  int steady = total - warmup;
  for (int k = 0; k < warmup; ++k)
    rank.forward(stageOf(k, true), microbatchOf(k));
  for (int k = 0; k < steady; ++k) {
    rank.forward(stageOf(warmup + k, true), microbatchOf(warmup + k));
    rank.backward(stageOf(k, false), microbatchOf(k));
  }
  for (int k = steady; k < total; ++k)
    rank.backward(stageOf(k, false), microbatchOf(k));
}

llvm::Expected<Schedule> tessel::pipeline::generateSchedule(ScheduleKind kind,
                                                            int ranks,
                                                            int microbatches,
                                                            int virtualStages) {
  if (ranks < 1)
    return error(
        formatv("the number of pipeline ranks must be >= 1, got {0}", ranks));
  if (microbatches < 1)
    return error(formatv("the number of microbatches must be >= 1, got {0}",
                         microbatches));
  if (virtualStages < 1)
    return error(formatv("the number of virtual stages must be >= 1, got {0}",
                         virtualStages));
  if (kind != ScheduleKind::Interleaved && virtualStages != 1)
    return error(formatv("the {0} schedule has one stage per rank; virtual "
                         "stages ({1}) need the interleaved schedule",
                         scheduleKindName(kind), virtualStages));
  if (kind == ScheduleKind::Interleaved) {
    if (virtualStages < 2)
      return error("the interleaved schedule needs at least 2 virtual stages "
                   "per rank");
    if (microbatches < ranks || microbatches % ranks != 0)
      return error(formatv("the interleaved schedule needs the microbatches "
                           "to be a multiple of the pipeline ranks (and at "
                           "least as many): {0} microbatches, {1} ranks",
                           microbatches, ranks));
  }

  Schedule schedule{kind, ranks, microbatches, virtualStages, {}};
  schedule.steps.resize(ranks);
  for (int r = 0; r < ranks; ++r) {
    RankSteps rank{r, ranks, schedule.numStages(), schedule.steps[r]};
    switch (kind) {
    case ScheduleKind::GPipe:
      gpipeRank(rank, microbatches);
      break;
    case ScheduleKind::OneFOneB:
      oneFOneBRank(rank, microbatches);
      break;
    case ScheduleKind::Interleaved:
      interleavedRank(rank, microbatches, virtualStages);
      break;
    }
  }
  return schedule;
}

//===--- Simulation -------------------------------------------------------===//

namespace {
// A transfer as both ends name it: (payload, stage, microbatch, from, to).
using TransferKey = std::tuple<int, int, int, int, int>;

TransferKey transferKey(const Step &step, int rank) {
  int from = step.kind == StepKind::Send ? rank : step.peer;
  int to = step.kind == StepKind::Send ? step.peer : rank;
  return {static_cast<int>(step.payload), step.stage, step.microbatch, from,
          to};
}
} // namespace

// Every send must have exactly one matching receive and vice versa.
static llvm::Error checkTransfersMatch(const Schedule &schedule) {
  struct Ends {
    std::vector<std::pair<int, int>> sends, recvs; // (rank, step index)
  };
  std::map<TransferKey, Ends> transfers;
  for (int r = 0; r < schedule.ranks; ++r)
    for (auto [i, step] : llvm::enumerate(schedule.steps[r])) {
      if (step.kind == StepKind::Send)
        transfers[transferKey(step, r)].sends.push_back({r, i});
      else if (step.kind == StepKind::Recv)
        transfers[transferKey(step, r)].recvs.push_back({r, i});
    }
  std::string problems;
  auto report = [&](std::pair<int, int> at, const std::string &what) {
    const Step &step = schedule.steps[at.first][at.second];
    problems += formatv("\n  rank {0} step {1} ({2}) {3}", at.first, at.second,
                        describeStep(step), what);
  };
  for (auto &[key, ends] : transfers) {
    if (ends.recvs.empty())
      report(ends.sends.front(), "has no matching pipe.recv");
    else if (ends.sends.empty())
      report(ends.recvs.front(), "has no matching pipe.send");
    else if (ends.sends.size() > 1)
      report(ends.sends[1], "repeats a send");
    else if (ends.recvs.size() > 1)
      report(ends.recvs[1], "repeats a receive");
  }
  if (!problems.empty())
    return error("sends and receives do not match:" + problems);
  return llvm::Error::success();
}

llvm::Expected<Timeline> tessel::pipeline::simulate(const Schedule &schedule,
                                                    const Costs &costs) {
  if (llvm::Error err = checkTransfersMatch(schedule))
    return std::move(err);

  int ranks = schedule.ranks;
  Timeline timeline;
  timeline.ranks.resize(ranks);
  timeline.busy.assign(ranks, 0);
  std::vector<size_t> next(ranks, 0);
  std::vector<double> clock(ranks, 0);
  std::map<TransferKey, double> sentAt;
  // Each rank runs until it finishes or waits on a receive; times depend
  // only on each rank's order and the send times, not on this sweep order.
  for (bool progressed = true; progressed;) {
    progressed = false;
    for (int r = 0; r < ranks; ++r) {
      const std::vector<Step> &steps = schedule.steps[r];
      for (; next[r] < steps.size(); ++next[r], progressed = true) {
        const Step &step = steps[next[r]];
        if (step.kind == StepKind::Send) {
          sentAt[transferKey(step, r)] = clock[r];
        } else if (step.kind == StepKind::Recv) {
          auto sent = sentAt.find(transferKey(step, r));
          if (sent == sentAt.end())
            break;
          clock[r] = std::max(clock[r], sent->second);
        } else {
          double cost =
              step.kind == StepKind::Forward ? costs.forward : costs.backward;
          timeline.ranks[r].push_back(
              {static_cast<int>(next[r]), clock[r], clock[r] + cost});
          clock[r] += cost;
          timeline.busy[r] += cost;
        }
      }
    }
  }

  std::string stuck;
  for (int r = 0; r < ranks; ++r)
    if (next[r] < schedule.steps[r].size())
      stuck += formatv("\n  rank {0} waits at step {1}: {2}", r, next[r],
                       describeStep(schedule.steps[r][next[r]]));
  if (!stuck.empty())
    return error("deadlock: no rank can progress" + stuck);

  timeline.makespan = *std::max_element(clock.begin(), clock.end());
  double idle = 0;
  for (int r = 0; r < ranks; ++r) {
    double rankIdle = timeline.makespan - timeline.busy[r];
    idle += rankIdle;
    timeline.rankBubble.push_back(
        timeline.makespan > 0 ? rankIdle / timeline.makespan : 0);
  }
  timeline.bubble =
      timeline.makespan > 0 ? idle / (ranks * timeline.makespan) : 0;
  return timeline;
}

//===--- Drawing ----------------------------------------------------------===//

static std::string stepLabel(const Schedule &schedule, const Step &step) {
  std::string label = (step.kind == StepKind::Forward ? "F" : "B") +
                      std::to_string(step.microbatch);
  if (schedule.virtualStages > 1)
    label +=
        "." + std::to_string(
                  pipe::pipelineLayout(schedule.ranks).stageChunk(step.stage));
  return label;
}

static std::string number(double value) {
  char text[32];
  snprintf(text, sizeof(text), "%g", value);
  return text;
}

static std::string bubbleSummary(const Schedule &schedule,
                                 const Timeline &timeline) {
  std::string text;
  for (int r = 0; r < schedule.ranks; ++r)
    text += formatv("rank {0}: busy {1}, idle {2}, bubble {3:f6}\n", r,
                    number(timeline.busy[r]),
                    number(timeline.makespan - timeline.busy[r]),
                    timeline.rankBubble[r]);
  double total = timeline.makespan * schedule.ranks;
  double busy = 0;
  for (double b : timeline.busy)
    busy += b;
  text += formatv("bubble fraction: {0:f6} (idle {1} of {2} rank-time units, "
                  "makespan {3})\n",
                  timeline.bubble, number(total - busy), number(total),
                  number(timeline.makespan));
  return text;
}

std::string tessel::pipeline::textTimeline(const Schedule &schedule,
                                           const Timeline &timeline) {
  size_t width = 0;
  for (int r = 0; r < schedule.ranks; ++r)
    for (const StepTime &time : timeline.ranks[r])
      width = std::max(
          width, stepLabel(schedule, schedule.steps[r][time.step]).size());
  ++width;
  int cells = static_cast<int>(timeline.makespan + 0.5);
  std::string text = formatv("timeline ({0}, {1} ranks, {2} microbatches, {3} "
                             "virtual stages; one cell per time unit):\n",
                             scheduleKindName(schedule.kind), schedule.ranks,
                             schedule.microbatches, schedule.virtualStages);
  for (int r = 0; r < schedule.ranks; ++r) {
    std::vector<std::string> row(cells, "." + std::string(width - 1, ' '));
    for (const StepTime &time : timeline.ranks[r]) {
      int first = static_cast<int>(time.start + 0.5);
      int last = static_cast<int>(time.end + 0.5);
      std::string label = stepLabel(schedule, schedule.steps[r][time.step]);
      for (int c = first; c < last && c < cells; ++c)
        row[c] = c == first ? label + std::string(width - label.size(), ' ')
                            : std::string(width - 1, '-') + " ";
    }
    std::string line = formatv("rank {0} | ", r);
    for (const std::string &cell : row)
      line += cell;
    while (!line.empty() && line.back() == ' ')
      line.pop_back();
    text += line + "\n";
  }
  return text + bubbleSummary(schedule, timeline);
}

std::string tessel::pipeline::scheduleSvg(const Schedule &schedule,
                                          const Timeline &timeline) {
  const double unit = 40, row = 32, left = 70, top = 50, pad = 3;
  double width = left + timeline.makespan * unit + 20;
  double height = top + schedule.ranks * row + 50;
  std::string svg = formatv(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" "
      "height=\"{1}\" font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{2}\" y=\"24\" font-size=\"15\">{3}: {4} ranks, {5} "
      "microbatches, {6} virtual stages; bubble {7:f1}%</text>\n",
      number(width), number(height), number(left),
      scheduleKindName(schedule.kind), schedule.ranks, schedule.microbatches,
      schedule.virtualStages, timeline.bubble * 100);
  for (int r = 0; r < schedule.ranks; ++r) {
    double y = top + r * row;
    svg += formatv("<text x=\"8\" y=\"{0}\">rank {1}</text>\n",
                   number(y + row / 2 + 4), r);
    for (const StepTime &time : timeline.ranks[r]) {
      const Step &step = schedule.steps[r][time.step];
      bool forward = step.kind == StepKind::Forward;
      // Later model chunks are drawn lighter.
      double opacity =
          1.0 -
          0.45 * pipe::pipelineLayout(schedule.ranks).stageChunk(step.stage) /
              std::max(1, schedule.virtualStages - 1);
      double x = left + time.start * unit;
      double w = (time.end - time.start) * unit;
      svg += formatv("<rect x=\"{0}\" y=\"{1}\" width=\"{2}\" height=\"{3}\" "
                     "fill=\"{4}\" fill-opacity=\"{5}\" stroke=\"#333\"/>\n",
                     number(x + 1), number(y + pad), number(w - 2),
                     number(row - 2 * pad), forward ? "#4e79a7" : "#59a14f",
                     number(opacity));
      svg += formatv("<text x=\"{0}\" y=\"{1}\" text-anchor=\"middle\">{2}"
                     "</text>\n",
                     number(x + w / 2), number(y + row / 2 + 4),
                     stepLabel(schedule, step));
    }
  }
  double legend = top + schedule.ranks * row + 25;
  svg += formatv(
      "<rect x=\"{0}\" y=\"{1}\" width=\"14\" height=\"14\" fill=\"#4e79a7\"/>"
      "<text x=\"{2}\" y=\"{3}\">forward</text>\n"
      "<rect x=\"{4}\" y=\"{1}\" width=\"14\" height=\"14\" fill=\"#59a14f\"/>"
      "<text x=\"{5}\" y=\"{3}\">backward (label: microbatch{6})</text>\n",
      number(left), number(legend - 11), number(left + 18), number(legend),
      number(left + 90), number(left + 108),
      schedule.virtualStages > 1 ? ".chunk" : "");
  return svg + "</svg>\n";
}

//===--- The pipe dialect -------------------------------------------------===//

pipe::ScheduleOp tessel::pipeline::buildScheduleOp(mlir::OpBuilder &builder,
                                                   mlir::Location loc,
                                                   const Schedule &schedule) {
  mlir::OpBuilder::InsertionGuard guard(builder);
  auto op = pipe::ScheduleOp::create(
      builder, loc, scheduleKindName(schedule.kind), schedule.ranks,
      schedule.microbatches, schedule.virtualStages);
  builder.setInsertionPointToStart(&op.getBody().emplaceBlock());
  for (int r = 0; r < schedule.ranks; ++r) {
    auto rank = pipe::RankOp::create(builder, loc, r);
    mlir::OpBuilder::InsertionGuard rankGuard(builder);
    builder.setInsertionPointToStart(&rank.getBody().emplaceBlock());
    for (const Step &step : schedule.steps[r]) {
      switch (step.kind) {
      case StepKind::Forward:
        pipe::ForwardOp::create(builder, loc, step.stage, step.microbatch);
        break;
      case StepKind::Backward:
        pipe::BackwardOp::create(builder, loc, step.stage, step.microbatch);
        break;
      case StepKind::Send:
        pipe::SendOp::create(builder, loc, payloadName(step.payload),
                             step.stage, step.microbatch, step.peer);
        break;
      case StepKind::Recv:
        pipe::RecvOp::create(builder, loc, payloadName(step.payload),
                             step.stage, step.microbatch, step.peer);
        break;
      }
    }
  }
  return op;
}

Schedule tessel::pipeline::scheduleFromOp(pipe::ScheduleOp op) {
  Schedule schedule{*parseScheduleKind(op.getKind()),
                    static_cast<int>(op.getRanks()),
                    static_cast<int>(op.getMicrobatches()),
                    static_cast<int>(op.getVirtualStages()),
                    {}};
  schedule.steps.resize(schedule.ranks);
  for (auto rank : op.getBody().front().getOps<pipe::RankOp>()) {
    std::vector<Step> &steps = schedule.steps[rank.getRank()];
    if (rank.getBody().empty())
      continue;
    for (mlir::Operation &stepOp : rank.getBody().front()) {
      auto payload = [](llvm::StringRef kind) {
        return kind == pipe::kActivation ? Payload::Activation
                                         : Payload::Gradient;
      };
      if (auto f = llvm::dyn_cast<pipe::ForwardOp>(stepOp))
        steps.push_back({StepKind::Forward, static_cast<int>(f.getStage()),
                         static_cast<int>(f.getMicrobatch())});
      else if (auto b = llvm::dyn_cast<pipe::BackwardOp>(stepOp))
        steps.push_back({StepKind::Backward, static_cast<int>(b.getStage()),
                         static_cast<int>(b.getMicrobatch())});
      else if (auto s = llvm::dyn_cast<pipe::SendOp>(stepOp))
        steps.push_back({StepKind::Send, static_cast<int>(s.getStage()),
                         static_cast<int>(s.getMicrobatch()),
                         payload(s.getKind()),
                         static_cast<int>(s.getToRank())});
      else if (auto r = llvm::dyn_cast<pipe::RecvOp>(stepOp))
        steps.push_back({StepKind::Recv, static_cast<int>(r.getStage()),
                         static_cast<int>(r.getMicrobatch()),
                         payload(r.getKind()),
                         static_cast<int>(r.getFromRank())});
    }
  }
  return schedule;
}
