//===- Report.cpp - `tessel report`: a run's charts as one HTML page ------===//
//
// tessel report DIR --metrics FILE [--trace PREFIX] [--comm-report PREFIX]
// [--price-per-gpu-hour X] -o report.html reads the compiled directory's
// plan.json and what the run wrote, and writes one self-contained page (no
// script or style from the network) of SVG charts:
//
//   loss       training loss and validation loss over steps
//   lr         the learning rate over steps
//   throughput tokens/s (and MFU with --peak-tflops) over steps
//   breakdown  per rank, the mean step split into compute, the
//              collectives it waits for, its pipeline messages (where a
//              stage waits out the bubble), optimizer, data wait and idle
//              (from the traces; idle is what no span of the rank covers)
//   memory     per rank, the plan's bytes beside the measured growth of
//              resident memory (from the comm reports)
//   comm       bytes per step of each collective and group, planned, beside
//              the measured bytes per kind (from the comm reports)
//   timeline   the last training step of every rank, on one clock
//
// Charts whose input was not given say what to pass instead. With a price,
// a table gives the cost per step, per million tokens and for the run, and
// its split by the breakdown's parts.
//
//===----------------------------------------------------------------------===//

#include "Commands.h"
#include "Simulate.h"

#include "tessel/Support/MeshLayout.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/FileSystem.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/Path.h"
#include "llvm/Support/raw_ostream.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <optional>

using namespace llvm;
using nlohmann::json;
using tessel::fail;
using tessel::inQuotes;

namespace {

const char *kUsage =
    "usage: tessel report DIR --metrics FILE [--trace PREFIX] "
    "[--comm-report PREFIX]\n"
    "                     [--price-per-gpu-hour X] [-o REPORT.html]\n"
    "  DIR is the compiled directory; FILE, PREFIX what tessel run wrote\n"
    "  with --metrics, --trace and --comm-report (PREFIX.rankR.json per\n"
    "  rank). Writes DIR/report.html unless -o says where.\n";

int usageError(const Twine &message) {
  outs().flush();
  errs() << "tessel report: " << message << "\n" << kUsage;
  return 2;
}

std::optional<json> readJson(const std::string &path, std::string &error) {
  auto text = MemoryBuffer::getFile(path);
  if (!text) {
    error = inQuotes(path) + ": " + text.getError().message();
    return std::nullopt;
  }
  json j = json::parse((*text)->getBuffer().begin(),
                       (*text)->getBuffer().end(), nullptr, false);
  if (j.is_discarded()) {
    error = inQuotes(path) + ": not valid JSON";
    return std::nullopt;
  }
  return j;
}

// Text for HTML and SVG: the five characters that matter escaped.
std::string escape(StringRef s) {
  std::string out;
  for (char c : s) {
    switch (c) {
    case '<': out += "&lt;"; break;
    case '>': out += "&gt;"; break;
    case '&': out += "&amp;"; break;
    case '"': out += "&quot;"; break;
    case '\'': out += "&#39;"; break;
    default: out += c;
    }
  }
  return out;
}

std::string num(double v, const char *format = "%.4g") {
  char text[48];
  std::snprintf(text, sizeof(text), format, v);
  return text;
}

std::string bytesText(double b) {
  const char *units[] = {"B", "KB", "MB", "GB", "TB"};
  int u = 0;
  while (std::fabs(b) >= 1000 && u < 4) {
    b /= 1000;
    u++;
  }
  return num(b, "%.3g") + " " + units[u];
}

const char *kColors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728",
                         "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"};

// A figure: its title, the SVG, and a caption.
std::string figure(StringRef id, StringRef title, const std::string &svg,
                   StringRef caption) {
  return "<figure class=\"chart\" id=\"" + id.str() + "\"><h2>" +
         escape(title) + "</h2>" + svg + "<figcaption>" + escape(caption) +
         "</figcaption></figure>\n";
}

std::string missing(StringRef id, StringRef title, StringRef what) {
  return "<figure class=\"missing\" id=\"" + id.str() + "\"><h2>" +
         escape(title) + "</h2><p>" + escape(what) + "</p></figure>\n";
}

struct Series {
  std::string name;
  std::vector<std::pair<double, double>> points;
  bool dots = false;
};

const double kW = 720, kH = 260, kLeft = 70, kRight = 20, kTop = 20,
             kBottom = 40;

// A line chart of one or more series against the step.
std::string lineChart(const std::vector<Series> &series, StringRef xLabel,
                      StringRef yLabel) {
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  for (const Series &s : series)
    for (auto [x, y] : s.points) {
      x0 = std::min(x0, x);
      x1 = std::max(x1, x);
      y0 = std::min(y0, y);
      y1 = std::max(y1, y);
    }
  if (!(x1 > x0))
    x1 = x0 + 1;
  if (!(y1 > y0)) {
    y1 = y0 + std::max(1e-12, std::fabs(y0) * 0.1);
    y0 -= std::max(1e-12, std::fabs(y0) * 0.1);
  }
  double pw = kW - kLeft - kRight, ph = kH - kTop - kBottom;
  auto X = [&](double x) { return kLeft + (x - x0) / (x1 - x0) * pw; };
  auto Y = [&](double y) { return kTop + (1 - (y - y0) / (y1 - y0)) * ph; };
  std::string svg = "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" +
                    num(kW) + "\" height=\"" + num(kH) + "\" viewBox=\"0 0 " +
                    num(kW) + " " + num(kH) + "\">";
  svg += "<rect class=\"frame\" x=\"" + num(kLeft) + "\" y=\"" + num(kTop) +
         "\" width=\"" + num(pw) + "\" height=\"" + num(ph) +
         "\" fill=\"none\" stroke=\"#999\"/>";
  for (int k = 0; k <= 4; k++) {
    double y = y0 + (y1 - y0) * k / 4, x = x0 + (x1 - x0) * k / 4;
    svg += "<text x=\"" + num(kLeft - 6) + "\" y=\"" + num(Y(y) + 4) +
           "\" text-anchor=\"end\" font-size=\"11\">" + num(y) + "</text>";
    svg += "<text x=\"" + num(X(x)) + "\" y=\"" + num(kH - kBottom + 16) +
           "\" text-anchor=\"middle\" font-size=\"11\">" + num(x, "%.0f") +
           "</text>";
  }
  svg += "<text x=\"" + num(kLeft + pw / 2) + "\" y=\"" + num(kH - 6) +
         "\" text-anchor=\"middle\" font-size=\"12\">" + escape(xLabel) +
         "</text>";
  svg += "<text x=\"14\" y=\"" + num(kTop + ph / 2) +
         "\" text-anchor=\"middle\" font-size=\"12\" transform=\"rotate(-90 "
         "14 " +
         num(kTop + ph / 2) + ")\">" + escape(yLabel) + "</text>";
  for (size_t k = 0; k < series.size(); k++) {
    const Series &s = series[k];
    const char *color = kColors[k % 8];
    if (s.points.empty())
      continue;
    std::string d;
    for (size_t i = 0; i < s.points.size(); i++)
      d += (i ? " L" : "M") + num(X(s.points[i].first), "%.2f") + " " +
           num(Y(s.points[i].second), "%.2f");
    svg += "<path class=\"series\" data-name=\"" + escape(s.name) +
           "\" d=\"" + d + "\" fill=\"none\" stroke=\"" + color +
           "\" stroke-width=\"1.5\"/>";
    if (s.dots)
      for (auto [x, y] : s.points)
        svg += "<circle cx=\"" + num(X(x), "%.2f") + "\" cy=\"" +
               num(Y(y), "%.2f") + "\" r=\"3\" fill=\"" + color + "\"/>";
    svg += "<text x=\"" + num(kLeft + 10 + 150 * k) + "\" y=\"" +
           num(kTop + 14) + "\" font-size=\"12\" fill=\"" + color + "\">" +
           escape(s.name) + "</text>";
  }
  return svg + "</svg>";
}

// Horizontal bars, one row per label, stacked by part (or side by side
// when `grouped`).
std::string barChart(const std::vector<std::string> &labels,
                     const std::vector<std::string> &parts,
                     const std::vector<std::vector<double>> &values,
                     StringRef unit, bool grouped,
                     std::function<std::string(double)> format) {
  double maxValue = 0;
  for (const auto &row : values) {
    double total = 0;
    for (double v : row) {
      total = grouped ? std::max(total, v) : total + v;
    }
    maxValue = std::max(maxValue, total);
  }
  if (maxValue <= 0)
    maxValue = 1;
  double rowH = grouped ? 10.0 * parts.size() + 10 : 22;
  double left = 150, width = kW - left - 90;
  double height = kTop + rowH * labels.size() + 50;
  std::string svg = "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" +
                    num(kW) + "\" height=\"" + num(height) +
                    "\" viewBox=\"0 0 " + num(kW) + " " + num(height) + "\">";
  for (size_t r = 0; r < labels.size(); r++) {
    double y = kTop + rowH * r;
    svg += "<text x=\"" + num(left - 6) + "\" y=\"" + num(y + rowH / 2 + 4) +
           "\" text-anchor=\"end\" font-size=\"11\">" + escape(labels[r]) +
           "</text>";
    double x = left, total = 0;
    for (size_t p = 0; p < parts.size(); p++) {
      double v = values[r][p];
      double w = v / maxValue * width;
      double by = grouped ? y + 10.0 * p : y + 2;
      double bh = grouped ? 9 : rowH - 4;
      double bx = grouped ? left : x;
      if (v > 0)
        svg += "<rect class=\"bar\" x=\"" + num(bx, "%.2f") + "\" y=\"" +
               num(by, "%.2f") + "\" width=\"" + num(std::max(w, 0.5), "%.2f") +
               "\" height=\"" + num(bh) + "\" fill=\"" + kColors[p % 8] +
               "\"><title>" + escape(labels[r] + " " + parts[p] + ": " +
                                     format(v)) +
               "</title></rect>";
      if (grouped)
        svg += "<text x=\"" + num(left + w + 4, "%.2f") + "\" y=\"" +
               num(by + 8) + "\" font-size=\"9\">" + escape(format(v)) +
               "</text>";
      x += w;
      total += v;
    }
    if (!grouped)
      svg += "<text x=\"" + num(x + 4, "%.2f") + "\" y=\"" +
             num(y + rowH / 2 + 4) + "\" font-size=\"10\">" +
             escape(format(total)) + "</text>";
  }
  double ly = kTop + rowH * labels.size() + 20;
  double step = std::min(120.0, (kW - 20) / (double)parts.size());
  for (size_t p = 0; p < parts.size(); p++) {
    svg += "<rect x=\"" + num(20 + step * p) + "\" y=\"" + num(ly - 9) +
           "\" width=\"10\" height=\"10\" fill=\"" + kColors[p % 8] + "\"/>";
    svg += "<text x=\"" + num(34 + step * p) + "\" y=\"" + num(ly) +
           "\" font-size=\"11\">" + escape(parts[p]) + "</text>";
  }
  svg += "<text x=\"" + num(left) + "\" y=\"" + num(ly + 20) +
         "\" font-size=\"11\">" + escape(unit) + "</text>";
  return svg + "</svg>";
}

struct Span {
  std::string name;
  double begin, end; // microseconds, on the common clock
};

// What a trace span is: a part of the step, an evaluation, a pipeline
// message (send, recv, the wait for the step's sends: where a stage waits
// out the bubble), or a collective (everything else on the program's
// thread).
enum class Kind { Forward, Backward, Update, Eval, Pipeline, Comm, Other };
Kind kindOf(StringRef name) {
  if (name == "forward")
    return Kind::Forward;
  if (name == "backward")
    return Kind::Backward;
  if (name == "update")
    return Kind::Update;
  if (name == "eval")
    return Kind::Eval;
  if (name == "send" || name == "recv" || name == "wait")
    return Kind::Pipeline;
  return Kind::Comm;
}

} // namespace

int tessel::reportCommand(ArrayRef<std::string> args) {
  Arguments parsed;
  std::string argumentError = parseArguments(
      args, {"--metrics", "--trace", "--comm-report", "--price-per-gpu-hour",
             "-o"},
      {"--help", "-h"}, parsed);
  if (!argumentError.empty())
    return usageError(argumentError);
  if (parsed.switches.count("--help") || parsed.switches.count("-h")) {
    outs() << kUsage;
    return 0;
  }
  std::vector<std::string> &positionals = parsed.positionals;
  std::map<std::string, std::string> &values = parsed.values;
  if (positionals.size() != 1)
    return usageError("expects one compiled directory");
  if (!values.count("--metrics"))
    return usageError("--metrics FILE is required (what tessel run "
                      "--metrics wrote)");
  const std::string dir = positionals[0];
  double price = 0;
  if (values.count("--price-per-gpu-hour") &&
      (StringRef(values["--price-per-gpu-hour"]).getAsDouble(price) ||
       !(price > 0)))
    return usageError("--price-per-gpu-hour expects a positive number, got '" +
                      values["--price-per-gpu-hour"] + "'");
  std::string output = values.count("-o") ? values["-o"] : dir + "/report.html";

  std::string error;
  Expected<json> plan = readPlan(dir);
  if (!plan)
    return fail(toString(plan.takeError()));
  if (!plan->contains("programs"))
    return fail(inQuotes(dir + "/plan.json") + " has no programs");
  int64_t world = plan->value("world_size", int64_t(1));

  // The metrics: training records and evaluations.
  std::vector<json> steps;
  std::vector<std::pair<double, double>> validation;
  {
    auto text = MemoryBuffer::getFile(values["--metrics"]);
    if (!text)
      return fail(inQuotes(values["--metrics"]) + ": " +
                  text.getError().message());
    StringRef body = (*text)->getBuffer();
    int line = 0;
    while (!body.empty()) {
      auto [l, rest] = body.split('\n');
      body = rest;
      line++;
      if (l.trim().empty())
        continue;
      json r = json::parse(l.begin(), l.end(), nullptr, false);
      if (!r.is_object() || !r.contains("step"))
        return fail(inQuotes(values["--metrics"]) + " line " +
                    std::to_string(line) +
                    ": not a metrics record (a JSON object with a step)");
      if (r.contains("val_loss"))
        validation.push_back({r["step"].get<double>() + 1,
                              r["val_loss"].get<double>()});
      if (r.contains("loss"))
        steps.push_back(std::move(r));
    }
  }
  if (steps.empty() && validation.empty())
    return fail(inQuotes(values["--metrics"]) + " holds no steps");

  // Per-rank files: PREFIX.rankR.json.
  auto rankFiles = [&](const std::string &prefix,
                       std::vector<std::optional<json>> &out) -> bool {
    StringRef ext = sys::path::extension(prefix);
    std::string stem = prefix.substr(0, prefix.size() - ext.size());
    out.assign(world, std::nullopt);
    bool any = false;
    for (int64_t r = 0; r < world; r++) {
      std::string path = stem + ".rank" + std::to_string(r) + ext.str();
      if (!sys::fs::exists(path))
        continue;
      std::string e;
      out[r] = readJson(path, e);
      if (!out[r]) {
        error = e;
        return false;
      }
      any = true;
    }
    if (!any)
      error = "no " + stem + ".rankR" + ext.str() + " files";
    return any;
  };
  std::vector<std::optional<json>> traces, comms;
  bool haveTraces = false, haveComms = false;
  if (values.count("--trace")) {
    if (!(haveTraces = rankFiles(values["--trace"], traces)))
      return fail("--trace " + values["--trace"] + ": " + error);
  }
  if (values.count("--comm-report")) {
    if (!(haveComms = rankFiles(values["--comm-report"], comms)))
      return fail("--comm-report " + values["--comm-report"] + ": " + error);
  }

  // The run's figures.
  double stepsRun = (double)steps.size(), wallMs = 0, tokens = 0;
  double tokensPerStep = 0;
  for (const json &s : steps) {
    wallMs += s.value("step_ms", 0.0);
    double tps = s.value("tokens_per_s", 0.0);
    tokensPerStep = tps * s.value("step_ms", 0.0) / 1000.0;
    tokens += tokensPerStep;
  }
  double meanMfu = 0;
  int mfus = 0;
  for (const json &s : steps)
    if (s.contains("mfu")) {
      meanMfu += s["mfu"].get<double>();
      mfus++;
    }

  std::string body;
  std::vector<Series> loss = {{"train loss", {}, false},
                              {"validation loss", validation, true}};
  std::vector<Series> lr = {{"lr", {}, false}};
  std::vector<Series> speed = {{"tokens/s", {}, false}};
  std::vector<Series> mfu = {{"MFU %", {}, false}};
  for (const json &s : steps) {
    double x = s["step"].get<double>() + 1;
    loss[0].points.push_back({x, s["loss"].get<double>()});
    if (s.contains("lr"))
      lr[0].points.push_back({x, s["lr"].get<double>()});
    if (s.contains("tokens_per_s"))
      speed[0].points.push_back({x, s["tokens_per_s"].get<double>()});
    if (s.contains("mfu"))
      mfu[0].points.push_back({x, 100 * s["mfu"].get<double>()});
  }
  body += figure("loss", "Loss", lineChart(loss, "step", "loss"),
                 validation.empty()
                     ? "training loss per step (no evaluation in this run: "
                       "--eval-every N adds the validation loss)"
                     : "training loss per step; validation loss after the "
                       "steps it follows");
  body += figure("lr", "Learning rate", lineChart(lr, "step", "lr"),
                 "the learning rate of each step");
  body += figure("throughput", "Throughput",
                 lineChart(speed, "step", "tokens/s"),
                 "tokens of the global batch over each step's wall time");
  if (!mfu[0].points.empty())
    body += figure("mfu", "Model FLOP/s utilisation",
                   lineChart(mfu, "step", "MFU %"),
                   "model FLOPs per token x tokens/s over the peak "
                   "--peak-tflops stated (docs/metrics.md)");

  // A mixture-of-experts model's routing (docs/metrics.md): the loss's
  // side parts, and per MoE layer how unevenly the experts are loaded (the
  // busiest expert's assignments over the mean) and the drop rate.
  std::vector<Series> sideLosses = {{"aux_loss", {}, false},
                                    {"z_loss", {}, false}};
  std::vector<Series> load, drops = {{"drop rate %", {}, false}};
  for (const json &s : steps) {
    double x = s["step"].get<double>() + 1;
    for (Series &series : sideLosses)
      if (s.contains(series.name) && s[series.name].is_number())
        series.points.push_back({x, s[series.name].get<double>()});
    if (s.contains("drop_rate") && s["drop_rate"].is_number())
      drops[0].points.push_back({x, 100 * s["drop_rate"].get<double>()});
    if (!s.contains("expert_tokens") || !s["expert_tokens"].is_array())
      continue;
    const json &layers = s["expert_tokens"];
    for (size_t l = 0; l < layers.size(); ++l) {
      if (!layers[l].is_array() || layers[l].empty())
        continue;
      double total = 0, busiest = 0;
      for (const json &c : layers[l]) {
        total += c.get<double>();
        busiest = std::max(busiest, c.get<double>());
      }
      if (load.size() <= l)
        load.push_back({"MoE layer " + std::to_string(l + 1), {}, false});
      if (total > 0)
        load[l].points.push_back(
            {x, busiest / (total / (double)layers[l].size())});
    }
  }
  llvm::erase_if(sideLosses,
                 [](const Series &series) { return series.points.empty(); });
  if (!sideLosses.empty())
    body += figure("moe-losses", "Load-balancing and z losses",
                   lineChart(sideLosses, "step", "loss"),
                   "the mixture-of-experts losses added to the language "
                   "model's, summed over the MoE layers");
  if (!load.empty())
    body += figure("moe-load", "Expert load",
                   lineChart(load, "step", "busiest / mean"),
                   "per MoE layer, the busiest expert's assignments over "
                   "the mean (1 = balanced)");
  if (!drops[0].points.empty() &&
      llvm::any_of(drops[0].points, [](auto p) { return p.second > 0; }))
    body += figure("moe-drops", "Dropped assignments",
                   lineChart(drops, "step", "dropped %"),
                   "assignments dropped by the experts' capacity "
                   "(model.moe.capacity_factor), of all the step's");

  // The step-time breakdown and the timeline, from the traces.
  const std::vector<std::string> parts = {
      "compute",   "collectives", "pipeline waits",
      "optimizer", "data wait",   "idle"};
  const size_t numParts = parts.size();
  std::vector<std::vector<double>> breakdown(
      world, std::vector<double>(numParts, 0.0));
  double dataWaitMs = 0;
  for (const json &s : steps)
    dataWaitMs += s.value("data_wait_ms", 0.0);
  std::vector<std::vector<Span>> rankSpans(world);
  if (haveTraces) {
    std::vector<json> present;
    std::vector<int64_t> presentRanks;
    for (int64_t r = 0; r < world; r++)
      if (traces[r]) {
        const json &t = *traces[r];
        if (!t.is_object() || !t.contains("traceEvents") ||
            !t.contains("otherData") ||
            !t["otherData"].contains("clock_origin_us") ||
            !t["otherData"].contains("sync_us"))
          return fail("--trace: rank " + std::to_string(r) +
                      "'s file is not a tessel run --trace file");
        present.push_back(t);
        presentRanks.push_back(r);
      }
    std::vector<double> shifts = traceClockShifts(present);
    for (size_t k = 0; k < present.size(); k++) {
      int64_t r = presentRanks[k];
      std::vector<Span> spans;
      for (const json &e : present[k]["traceEvents"]) {
        if (e.value("ph", "") != "X" || e.value("tid", 0) != 0)
          continue;
        double b = e.value("ts", 0.0) + shifts[k];
        spans.push_back({e.value("name", ""), b, b + e.value("dur", 0.0)});
      }
      std::sort(spans.begin(), spans.end(), [](const Span &a, const Span &b) {
        return a.begin < b.begin || (a.begin == b.begin && a.end > b.end);
      });
      // Parts contain communication spans; communication counts once, in
      // its own part, and nothing inside an evaluation counts.
      double compute = 0, comm = 0, pipeline = 0, optimizer = 0;
      const Span *container = nullptr;
      for (const Span &s : spans) {
        Kind kind = kindOf(s.name);
        double d = (s.end - s.begin) / 1000.0;
        if (kind != Kind::Comm && kind != Kind::Pipeline) {
          container = &s;
          if (kind == Kind::Forward || kind == Kind::Backward)
            compute += d;
          else if (kind == Kind::Update)
            optimizer += d;
          continue;
        }
        bool inside = container && s.begin >= container->begin &&
                      s.end <= container->end + 1e-3;
        Kind outer = inside ? kindOf(container->name) : Kind::Other;
        if (outer == Kind::Eval)
          continue;
        (kind == Kind::Pipeline ? pipeline : comm) += d;
        if (outer == Kind::Forward || outer == Kind::Backward)
          compute -= d;
        else if (outer == Kind::Update)
          optimizer -= d;
      }
      double wait = r == 0 ? dataWaitMs : 0;
      double idle = std::max(
          0.0, wallMs - compute - comm - pipeline - optimizer - wait);
      double n = std::max(1.0, stepsRun);
      breakdown[r] = {std::max(0.0, compute) / n, comm / n, pipeline / n,
                      std::max(0.0, optimizer) / n, wait / n, idle / n};
      rankSpans[r] = std::move(spans);
    }
    std::vector<std::string> labels;
    std::vector<std::vector<double>> rows;
    for (int64_t r = 0; r < world; r++)
      if (traces[r]) {
        labels.push_back("rank " + std::to_string(r));
        rows.push_back(breakdown[r]);
      }
    body += figure(
        "breakdown", "Step time per rank",
        barChart(labels, parts, rows, "milliseconds per step", false,
                 [](double v) { return num(v, "%.3g") + " ms"; }),
        "the mean step of each rank: forward and backward compute, the "
        "collectives it waited for, its pipeline messages (a receive waits "
        "out the bubble), the optimizer's own work, rank 0's wait for data, "
        "and idle (what no span covers)");

    // The last training step of every rank: from the end of the "update"
    // before it to the end of its own.
    double t0 = INFINITY, t1 = -INFINITY;
    for (int64_t r = 0; r < world; r++) {
      std::vector<const Span *> updates;
      for (const Span &s : rankSpans[r])
        if (s.name == "update")
          updates.push_back(&s);
      if (updates.empty())
        continue;
      t1 = std::max(t1, updates.back()->end);
      if (updates.size() >= 2)
        t0 = std::min(t0, updates[updates.size() - 2]->end);
    }
    if (!std::isfinite(t0)) {
      for (int64_t r = 0; r < world; r++)
        for (const Span &s : rankSpans[r])
          t0 = std::min(t0, s.begin);
    }
    if (std::isfinite(t0) && t1 > t0) {
      double left = 80, width = kW - left - 20, rowH = 26;
      double height = 20 + rowH * world + 60;
      std::string svg = "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" +
                        num(kW) + "\" height=\"" + num(height) +
                        "\" viewBox=\"0 0 " + num(kW) + " " + num(height) +
                        "\">";
      auto X = [&](double t) { return left + (t - t0) / (t1 - t0) * width; };
      const std::map<std::string, const char *> colors = {
          {"forward", kColors[0]}, {"backward", kColors[1]},
          {"update", kColors[2]}};
      for (int64_t r = 0; r < world; r++) {
        double y = 20 + rowH * r;
        svg += "<text x=\"" + num(left - 6) + "\" y=\"" + num(y + 15) +
               "\" text-anchor=\"end\" font-size=\"11\">rank " +
               std::to_string(r) + "</text>";
        for (const Span &s : rankSpans[r]) {
          if (s.end <= t0 || s.begin >= t1 || s.name == "eval")
            continue;
          auto c = colors.find(s.name);
          bool part = c != colors.end();
          double x0 = X(std::max(s.begin, t0)), x1 = X(std::min(s.end, t1));
          svg += "<rect class=\"span\" x=\"" + num(x0, "%.2f") + "\" y=\"" +
                 num(part ? y + 2 : y + 14) + "\" width=\"" +
                 num(std::max(0.5, x1 - x0), "%.2f") + "\" height=\"" +
                 num(part ? 20 : 8) + "\" fill=\"" +
                 (part ? c->second : kColors[3]) + "\"><title>" +
                 escape(s.name + " " + num((s.end - s.begin) / 1000, "%.3g") +
                        " ms") +
                 "</title></rect>";
        }
      }
      double ly = 20 + rowH * world + 20;
      const char *legend[] = {"forward", "backward", "update",
                              "communication"};
      for (int k = 0; k < 4; k++) {
        svg += "<rect x=\"" + num(left + 120 * k) + "\" y=\"" + num(ly - 9) +
               "\" width=\"10\" height=\"10\" fill=\"" + kColors[k] + "\"/>";
        svg += "<text x=\"" + num(left + 14 + 120 * k) + "\" y=\"" + num(ly) +
               "\" font-size=\"11\">" + legend[k] + "</text>";
      }
      svg += "<text x=\"" + num(left) + "\" y=\"" + num(ly + 20) +
             "\" font-size=\"11\">" +
             num((t1 - t0) / 1000, "%.3g") + " ms</text>";
      body += figure("timeline", "Pipeline timeline (last step)", svg + "</svg>",
                     "each rank's spans in the run's last step on one clock; "
                     "gaps are the pipeline bubble and waits");
    }
  } else {
    body += missing("breakdown", "Step time per rank",
                    "run with --trace PREFIX and pass it here (--trace PREFIX)");
    body += missing("timeline", "Pipeline timeline",
                    "run with --trace PREFIX and pass it here (--trace PREFIX)");
  }

  // Memory: the plan's bytes per rank beside the measured growth.
  {
    std::vector<std::string> labels;
    std::vector<std::vector<double>> rows;
    for (const json &r : (*plan)["ranks"]) {
      int64_t rank = r.value("rank", int64_t(0));
      std::string program = r.value("program", "");
      const json &programs = (*plan)["programs"];
      double planned = programs.contains(program) &&
                               programs[program].contains("memory")
                           ? programs[program]["memory"].value("total_bytes",
                                                               0.0)
                           : 0.0;
      double measured = 0;
      if (haveComms && rank < world && comms[rank] &&
          (*comms[rank]).contains("memory")) {
        const json &m = (*comms[rank])["memory"];
        measured = m.value("rss_peak_bytes", 0.0) -
                   m.value("rss_before_bytes", 0.0);
      }
      labels.push_back("rank " + std::to_string(rank));
      rows.push_back({planned, measured});
    }
    body += figure(
        "memory", "Memory per rank",
        barChart(labels, {"planned", "measured"}, rows, "bytes", true,
                 bytesText),
        haveComms ? "plan.json's bytes per rank (its stores and arena) beside "
                    "the growth of the rank's resident memory from before "
                    "the stores to its peak (--comm-report)"
                  : "plan.json's bytes per rank; run with --comm-report "
                    "PREFIX to add what each rank measured");
  }

  // Bytes per collective and group, per step.
  {
    std::map<std::string, double> planned;
    for (auto &[name, program] : (*plan)["programs"].items()) {
      if (!program.contains("comm") || !program["comm"].contains("per_step"))
        continue;
      int64_t ranks = program.value("ranks", int64_t(1));
      for (const json &c : program["comm"]["per_step"]) {
        std::string key = c.value("collective", "?") + " over " +
                          c.value("axes", "?");
        planned[key] += c.value("bytes_sent", 0.0) * c.value("count", 1.0) *
                        (double)ranks;
      }
    }
    std::map<std::string, double> measured;
    if (haveComms)
      for (int64_t r = 0; r < world; r++)
        if (comms[r] && comms[r]->contains("collectives")) {
          double n = std::max(1.0, comms[r]->value("steps", 1.0));
          for (auto &[kind, c] : (*comms[r])["collectives"].items())
            measured[kind] += c.value("bytes_sent", 0.0) / n;
        }
    std::vector<std::string> labels;
    std::vector<std::vector<double>> rows;
    for (auto &[key, bytes] : planned) {
      labels.push_back(key);
      rows.push_back({bytes, 0});
    }
    for (auto &[kind, bytes] : measured)
      if (bytes > 0) {
        labels.push_back(kind + " (all groups)");
        rows.push_back({0, bytes});
      }
    if (labels.empty())
      body += missing("comm", "Communication",
                      "this layout moves no bytes between ranks");
    else
      body += figure("comm", "Communication per step",
                     barChart(labels, {"planned", "measured"}, rows,
                              "bytes sent per step, all ranks", true,
                              bytesText),
                     "plan.json's bytes per step of each collective and its "
                     "mesh axes, summed over ranks" +
                         std::string(haveComms
                                         ? "; the bytes the ranks counted, "
                                           "per kind"
                                         : ""));
  }

  // The summary (and the cost).
  std::string summary = "<table class=\"summary\">";
  auto row = [&](StringRef k, const std::string &v) {
    summary += "<tr><th>" + escape(k) + "</th><td>" + escape(v) + "</td></tr>";
  };
  row("program", plan->value("name", std::string("?")));
  std::string mesh;
  if (plan->contains("mesh") && (*plan)["mesh"].is_object())
    for (auto &[axis, size] : (*plan)["mesh"].items())
      mesh += (mesh.empty() ? "" : " ") + axis + "=" + size.dump();
  if (plan->contains("order") && (*plan)["order"].is_string() &&
      (*plan)["order"] != tessel::MeshShape().orderName())
    mesh += ", order " + (*plan)["order"].get<std::string>();
  row("layout", mesh + " (" + std::to_string(world) + " ranks)");
  row("steps", num(stepsRun, "%.0f"));
  row("tokens", num(tokens, "%.0f"));
  row("wall time of the steps", num(wallMs / 1000, "%.3g") + " s");
  if (wallMs > 0)
    row("mean tokens/s", num(tokens / (wallMs / 1000), "%.0f"));
  if (mfus)
    row("mean MFU", num(100 * meanMfu / mfus, "%.1f") + " %");
  if (!steps.empty())
    row("final loss", num(steps.back()["loss"].get<double>(), "%.4f"));
  if (!validation.empty()) {
    auto best = std::min_element(
        validation.begin(), validation.end(),
        [](auto &a, auto &b) { return a.second < b.second; });
    row("final validation loss", num(validation.back().second, "%.4f"));
    row("best validation loss",
        num(best->second, "%.4f") + " after step " + num(best->first, "%.0f"));
  }
  if (price > 0 && wallMs > 0) {
    double hours = wallMs / 3.6e6;
    double cost = hours * (double)world * price;
    row("cost of the run", "$" + num(cost, "%.4g"));
    row("cost per step", "$" + num(cost / std::max(1.0, stepsRun), "%.4g"));
    if (tokens > 0)
      row("cost per million tokens", "$" + num(cost / tokens * 1e6, "%.4g"));
    if (haveTraces) {
      std::vector<double> total(numParts, 0.0);
      for (const auto &b : breakdown)
        for (size_t p = 0; p < numParts; p++)
          total[p] += b[p];
      double all = 0;
      for (double v : total)
        all += v;
      if (all > 0) {
        std::string split;
        for (size_t p = 0; p < numParts; p++)
          split += (p ? ", " : "") + parts[p] + " $" +
                   num(cost * total[p] / all, "%.3g");
        row("cost by part", split);
      }
    }
  }
  summary += "</table>\n";

  std::string html =
      "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>" +
      escape("Tessel run report: " + plan->value("name", std::string())) +
      "</title>\n<style>body{font-family:sans-serif;margin:24px;max-width:"
      "800px}figure{margin:0 0 28px 0}figcaption{font-size:12px;color:#555}"
      "h2{font-size:16px;margin:4px 0}table.summary td,table.summary th{"
      "text-align:left;padding:2px 12px 2px 0;font-size:13px}"
      ".missing p{color:#a00;font-size:13px}</style></head>\n<body>\n<h1>" +
      escape(plan->value("name", std::string("run"))) + "</h1>\n" + summary +
      body +
      // Marks the page once every chart has a size and marks in it, so that
      // a headless browser can tell the page rendered.
      "<script>window.addEventListener('load',function(){var f=document."
      "querySelectorAll('figure.chart'),n=0;f.forEach(function(e){var s=e."
      "querySelector('svg'),b=s&&s.getBBox();if(b&&b.width>0&&b.height>0&&s."
      "querySelectorAll('path,rect,circle').length>1){e.dataset.rendered="
      "'yes';n++}});document.body.dataset.charts=n+' of '+f.length+' "
      "rendered'});</script>\n</body></html>\n";

  // Written whole, then renamed.
  if (Error e = checkReplaceable(output))
    return fail(toString(std::move(e)));
  std::string temporary = output + ".tmp";
  {
    std::error_code ec;
    raw_fd_ostream out(temporary, ec);
    if (ec)
      return fail("cannot write " + inQuotes(temporary) + ": " + ec.message());
    out << html;
    out.close();
    if (out.has_error()) {
      sys::fs::remove(temporary);
      return fail("cannot write " + inQuotes(temporary));
    }
  }
  if (std::error_code ec = sys::fs::rename(temporary, output)) {
    sys::fs::remove(temporary);
    return fail("cannot write " + inQuotes(output) + ": " + ec.message());
  }
  size_t charts = 0;
  for (size_t at = html.find("class=\"chart\""); at != std::string::npos;
       at = html.find("class=\"chart\"", at + 1))
    charts++;
  outs() << "wrote " << output << ": " << charts << " charts of "
         << num(stepsRun, "%.0f") << " steps on " << world << " ranks\n";
  return 0;
}
