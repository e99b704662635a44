//===- Textbook.cpp - What a layout should cost, by the formulas ----------===//
//
// Megatron-LM's volumes (Narayanan et al. 2021; Korthikanti et al. 2022 for
// sequence parallelism), per rank and step, with b the microbatch a
// data-parallel rank runs, s the sequence, h the hidden size, V the
// vocabulary, t = tp, d = dp, m microbatches, e the bytes of an activation
// element (2 in bf16 programs, else 4):
//
//   dp     every gradient of the rank all-reduced once per step over the
//          ranks holding the same piece: 2(g-1)/g * 4n, g = d (g = d*t for
//          a parameter replicated over tp under sequence parallelism, whose
//          gradient is summed over the sequence pieces as well: "dp,tp";
//          GPT-2's position table, whose gradient rows are split by the
//          sequence, is reduced over dp as pieces of s*h/t and gathered over
//          tp, (t-1)/t * 4sh)
//   tp     per microbatch and transformer block, two all-reduces forward
//          and two backward of b*s*h: 8(t-1)/t bshe; under sequence
//          parallelism four all-gathers and four reduce-scatters of b*s*h/t
//          and, as Megatron does, the two column-parallel inputs gathered
//          again in backward rather than kept: 10(t-1)/t bshe; the
//          vocabulary-parallel embedding 2(t-1)/t bshe (first stage), the
//          head the same (3(t-1)/t under sequence parallelism; last stage),
//          and the vocabulary-parallel cross-entropy three all-reduces of
//          b*s fp32 values
//   pp     per microbatch, each chunk boundary an activation forward and its
//          gradient back, b*s*h*e (/t under sequence parallelism); a tied
//          embedding table V/t x h sent to the last stage once per step and
//          its gradient (fp32) back once
//
//===----------------------------------------------------------------------===//

#include "Textbook.h"

#include <regex>
#include <set>

using json = nlohmann::json;
using namespace llvm;

namespace {

Error missing(const std::string &what) {
  return createStringError("plan.json has no " + what +
                           " (compiled by an older tessel? compile again)");
}

double allReduce(double n, double g, double bytes) {
  return g > 1 ? 2.0 * (g - 1) / g * n * bytes : 0;
}

} // namespace

Expected<tessel::CommTable> tessel::commTextbook(const json &plan,
                                                 const std::string &program) {
  if (!plan.contains("model") || !plan["model"].is_object())
    return missing("model");
  if (!plan.contains("programs") || !plan["programs"].contains(program))
    return missing("program " + program);
  const json &model = plan["model"];
  const json &mesh = plan["mesh"];
  auto axis = [&](const char *name) -> double {
    return mesh.contains(name) ? mesh[name].get<double>() : 1.0;
  };
  double d = axis("dp"), t = axis("tp"), p = axis("pp");
  bool sp = plan.value("sequence_parallel", false);
  double m = plan.value("microbatches", 1);
  double v = plan.value("virtual_stages", 1);
  double e = plan.value("precision", std::string("fp32")) == "bf16" ? 2 : 4;
  double b = plan["train"]["global_batch"].get<double>() / (d * m);
  double s = model["seq_len"].get<double>();
  double h = model["hidden"].get<double>();
  double V = model["vocab_size"].get<double>();
  bool tied = model["tie_embeddings"].get<bool>();

  // This program's pipeline rank and the blocks it holds.
  int64_t r = 0;
  for (const json &rank : plan["ranks"])
    if (rank["program"] == program) {
      r = rank["coords"].value("pp", 0);
      break;
    }
  bool first = r == 0, last = r == (int64_t)p - 1;
  std::set<int64_t> blocks;
  static const std::regex block("(^|\\.)(h|layers)\\.([0-9]+)\\.");
  CommTable table;
  for (const json &param : plan["parameters"]) {
    if (param["program"] != program)
      continue;
    std::string name = param["name"].get<std::string>();
    std::smatch match;
    if (std::regex_search(name, match, block))
      blocks.insert(std::stoll(match[3]));
    double n = 1;
    for (const json &dim : param["local_shape"])
      n *= dim.get<double>();
    bool splitOverTp = param.contains("shard") &&
                       param["shard"].value("axis", std::string()) == "tp";
    if (sp && t > 1 && name == "wpe.weight" && model["family"] == "gpt") {
      // GPT-2's position table under sequence parallelism: each rank's
      // gradient rows are its own positions, reduced over dp and gathered
      // over tp.
      table.textbook["dp"] += allReduce(n / t, d, 4);
      table.textbook["tp"] += (t - 1) * n / t * 4;
    } else if (sp && t > 1 && !splitOverTp)
      table.textbook[d > 1 ? "dp,tp" : "tp"] += allReduce(n, d * t, 4);
    else
      table.textbook["dp"] += allReduce(n, d, 4);
  }

  double bsh = b * s * h;
  if (t > 1) {
    // Under sequence parallelism the backward pass gathers a column-parallel
    // matmul's input again (two per block, one for the head).
    double regather = sp ? 1 : 0;
    double perMicrobatch =
        blocks.size() * (8 + 2 * regather) * (t - 1) / t * bsh * e;
    if (first)
      perMicrobatch += 2 * (t - 1) / t * bsh * e;
    if (last)
      perMicrobatch += (2 + regather) * (t - 1) / t * bsh * e +
                       3 * allReduce(b * s, t, 4);
    table.textbook["tp"] += m * perMicrobatch;
  }
  if (p > 1) {
    double message = bsh / (sp ? t : 1) * e;
    double sends = (v - (last ? 1 : 0)) + (v - (first ? 1 : 0));
    table.textbook["pp"] += m * sends * message;
    if (tied && first)
      table.textbook["pp"] += V / t * h * e;
    if (tied && last)
      table.textbook["pp"] += V / t * h * 4;
  }

  for (const json &c : plan["programs"][program]["comm"]["per_step"]) {
    double bytes = c.value("count", 1) * c["bytes_sent"].get<double>();
    if (c["elements"].get<int64_t>() == 1)
      table.scalarBytes += bytes;
    else
      table.predicted[c["axes"].get<std::string>()] += bytes;
  }
  // Every group either side has, on both sides.
  for (auto &[group, bytes] : table.predicted)
    table.textbook[group] += 0;
  for (auto &[group, bytes] : table.textbook)
    table.predicted[group] += 0;
  for (auto it = table.textbook.begin(); it != table.textbook.end();) {
    if (it->second == 0 && table.predicted[it->first] == 0) {
      table.predicted.erase(it->first);
      it = table.textbook.erase(it);
    } else {
      ++it;
    }
  }
  return table;
}
