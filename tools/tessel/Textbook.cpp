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
//          With the optimizer sharded over dp (parallel.zero 1, ZeRO-1) a
//          gradient is reduce-scattered over dp and the updated parameter
//          all-gathered: (d-1)/d * 4n each, the all-reduce's volume (a
//          gradient also summed over tp is all-reduced over tp first),
//          and the norm's partial sums are added over dp. Keeping gradients
//          as pieces (parallel.zero 2) reduce-scatters each microbatch's:
//          m times (d-1)/d * 4n, then the gather (a gradient summed over tp
//          too is all-reduced over tp as a piece, once); a tied embedding
//          on the first pipeline stage, to which the update adds the last
//          stage's gradient, is reduced once as under ZeRO-1. Sharding
//          the parameters too (parallel.zero 3) gathers them before each
//          part that reads them, forward and backward, per microbatch, and
//          drops the gather after the update: 3m (d-1)/d * 4n, the ZeRO
//          paper's 1.5x of the all-reduce (a run that a backward part does
//          not read is not gathered there, so Tessel moves at most that:
//          an embedding table only its lookup reads; under pipeline
//          stages, where every gradient is a run, GPT's biases, unless full
//          recompute reads them again)
//          With hybrid sharding (parallel.zero_group = g) the pieces are
//          cut over a group of g dp ranks ("dp_shard": d becomes g in the
//          terms above) and each piece is summed over the d/g groups
//          ("dp_replica"): 2(d/g-1)/(d/g) * 4n/g once per step
//   cp     per microbatch and transformer block, the keys and values
//          gathered forward and again backward and their gradients
//          reduce-scattered: 6(c-1)/c * b*s*kv_dim/t*e (c = cp); every
//          gradient summed over dp x cp, and b*s in the other terms a
//          rank's b*s/c tokens
//   pp     per microbatch, each chunk boundary an activation forward and its
//          gradient back, b*s*h*e (/t under sequence parallelism); a tied
//          embedding table V/t x h sent to the last stage once per step and
//          its gradient (fp32) back once
//
//===----------------------------------------------------------------------===//

#include "Textbook.h"

#include "tessel/Support/MeshLayout.h"

#include "llvm/ADT/StringRef.h"

#include <cmath>
#include <cstdio>
#include <optional>
#include <regex>
#include <set>
#include <vector>

using json = nlohmann::json;
using namespace llvm;
using tessel::AxisSet;
using tessel::MeshAxis;

namespace {

Error missing(const std::string &what) {
  return createStringError("plan.json has no " + what +
                           " (compiled by an older tessel? compile again)");
}

// The transformer block a parameter belongs to, by its (Hugging Face) name.
std::optional<int64_t> blockOf(const std::string &name) {
  static const std::regex block("(^|\\.)(h|layers)\\.([0-9]+)\\.");
  std::smatch match;
  if (!std::regex_search(name, match, block))
    return std::nullopt;
  return std::stoll(match[3]);
}

double allReduce(double n, double g, double bytes) {
  return g > 1 ? 2.0 * (g - 1) / g * n * bytes : 0;
}

// What the formulas read from the plan: the model's sizes, the layout and
// where this program's ranks sit in the pipeline.
struct Sizes {
  double d, t, p, m, v, e, b, s, h, V, f, kvDim;
  bool sp, tied, llama, bf16;
  int64_t r; // pipeline rank
  bool first, last;
  double ep; // expert parallelism (1 without)
  double c;  // context parallelism (1 without)
  // The sequence pieces GPT-2's position table's gradient rows are split
  // in: cp, times tp under sequence parallelism.
  double positionPieces() const { return c * (sp && t > 1 ? t : 1); }
};

// A mixture-of-experts model's routing (plan.json's model.moe).
struct Moe {
  bool enabled = false;
  int64_t every = 1;
  double experts = 0, topK = 0, shared = 0, ffn = 0;
  bool capacity = false, auxLoss = false, zLoss = false;
  bool isMoeBlock(int64_t block) const {
    return enabled && block % every == 0;
  }
};

Moe moeOf(const json &plan) {
  Moe moe;
  const json &model = plan["model"];
  if (!model.contains("moe") || !model["moe"].is_object())
    return moe;
  const json &m = model["moe"];
  moe.enabled = true;
  moe.every = m.value("every", int64_t(1));
  moe.experts = m["experts"].get<double>();
  moe.topK = m["top_k"].get<double>();
  moe.shared = m.value("shared_experts", 0.0);
  moe.capacity = m.contains("capacity_factor") && m["capacity_factor"].is_number();
  moe.auxLoss = m.value("aux_loss_coef", 0.0) > 0;
  moe.zLoss = m.value("z_loss_coef", 0.0) > 0;
  moe.ffn = m.value("ffn_hidden", model["ffn_hidden"].get<double>());
  return moe;
}

Expected<Sizes> sizesOf(const json &plan, const std::string &program) {
  if (!plan.contains("model") || !plan["model"].is_object())
    return missing("model");
  if (!plan.contains("programs") || !plan["programs"].contains(program))
    return missing("program " + program);
  const json &model = plan["model"];
  const json &mesh = plan["mesh"];
  auto axis = [&](const char *name) -> double {
    return mesh.contains(name) ? mesh[name].get<double>() : 1.0;
  };
  Sizes z;
  z.d = axis("dp"), z.t = axis("tp"), z.p = axis("pp"), z.ep = axis("ep");
  z.c = axis("cp");
  z.sp = plan.value("sequence_parallel", false);
  z.m = plan.value("microbatches", 1);
  z.v = plan.value("virtual_stages", 1);
  z.bf16 = plan.value("precision", std::string("fp32")) == "bf16";
  z.e = z.bf16 ? 2 : 4;
  z.b = plan["train"]["global_batch"].get<double>() / (z.d * z.ep * z.m);
  z.s = model["seq_len"].get<double>();
  z.h = model["hidden"].get<double>();
  // The embedding's rows: the vocabulary padded to
  // model.vocab_pad_to_multiple.
  z.V = model.value("padded_vocab_size", model["vocab_size"].get<double>());
  z.f = model["ffn_hidden"].get<double>();
  z.kvDim = z.h / model["heads"].get<double>() * model["kv_heads"].get<double>();
  z.tied = model["tie_embeddings"].get<bool>();
  z.llama = model["family"] == "llama";
  z.r = 0;
  for (const json &rank : plan["ranks"])
    if (rank["program"] == program) {
      z.r = rank["coords"].value("pp", 0);
      break;
    }
  z.first = z.r == 0;
  z.last = z.r == (int64_t)z.p - 1;
  return z;
}

// Elements of a parameter's local piece.
double elementsOf(const json &param) {
  double n = 1;
  for (const json &dim : param["local_shape"])
    n *= dim.get<double>();
  return n;
}

// The transformer blocks whose parameters a program holds, and how many
// parameter elements it holds.
struct Held {
  std::set<int64_t> blocks;
  double elements = 0;
  double expertElements = 0; // of experts split over ep
};
Held heldBy(const json &plan, const std::string &program) {
  Held held;
  for (const json &param : plan["parameters"]) {
    if (param["program"] != program)
      continue;
    if (std::optional<int64_t> k = blockOf(param["name"].get<std::string>()))
      held.blocks.insert(*k);
    held.elements += elementsOf(param);
    if (param.contains("shard") &&
        param["shard"].value("axis", std::string()) == "ep")
      held.expertElements += elementsOf(param);
  }
  return held;
}

// Whether full recompute applies to transformer block `block`
// (train.recompute, train.recompute_layers).
bool recomputes(const json &plan, int64_t block) {
  const json &train = plan["train"];
  if (train.value("recompute", std::string("none")) != "full")
    return false;
  if (!train.contains("recompute_layers") ||
      train["recompute_layers"].empty())
    return true;
  for (const json &l : train["recompute_layers"])
    if (l.get<int64_t>() == block)
      return true;
  return false;
}

// Elements of the parameters ZeRO-2/3 keep whole on a program: GPT-2's
// position table under sequence parallelism (reduced as sequence pieces)
// and a tied embedding on the first of several stages (the update adds the
// last stage's gradient to it).
double keptWholeUnderZero(const json &plan, const std::string &program,
                          const Sizes &z) {
  double kept = 0;
  for (const json &param : plan["parameters"]) {
    if (param["program"] != program)
      continue;
    std::string name = param["name"].get<std::string>();
    if ((z.positionPieces() > 1 && !z.llama && name == "wpe.weight") ||
        (z.tied && z.p > 1 && z.first &&
         (name == "wte.weight" || name == "model.embed_tokens.weight")))
      kept += elementsOf(param);
  }
  return kept;
}

// ZeRO-1/2 in a bf16 program keep the fp32 master weights of what only
// matmuls read as pieces (as Megatron-LM's distributed optimizer keeps
// all of them) and gather its bf16 copy after the update: every matrix but
// the embedding tables (the lookup reads them in fp32); the routed
// experts' weights are among them (the grouped GEMMs read the bf16 copy),
// and so is GPT-2's q|k|v weight (its q, k and v slices are cut from the
// bf16 copy). Norms' weights and biases, read in fp32, stay whole. That is the
// rule; a run is cut into pieces as a whole, so without pipeline stages
// (gradient buckets) a matrix sharing its bucket's run with one of those stays
// whole too: the plan says which were cut (`bf16_gather`). ZeRO-3 keeps
// every run as pieces and gathers the same matrices in bf16.
bool bf16GatherRule(const json &plan, const json &param, const Sizes &z) {
  int64_t zero = plan.value("zero", 0);
  if (!z.bf16 || z.d <= 1 || zero < 1 || !plan.value("master_pieces", false) ||
      param["local_shape"].size() < 2)
    return false;
  llvm::StringRef name = param["name"].get_ref<const std::string &>();
  return name != "wte.weight" && name != "wpe.weight" &&
         name != "model.embed_tokens.weight";
}

bool gatheredInBf16(const json &plan, const json &param, const Sizes &z) {
  return bf16GatherRule(plan, param, z) &&
         (z.p > 1 || param.value("bf16_gather", false));
}

// The elements of the parameters of `program` gathered in bf16: at ZeRO-1
// and 2, those whose master weights are pieces; with `expertsOnly`, of the
// routed experts split over ep among them.
double gatheredInBf16Elements(const json &plan, const std::string &program,
                              const Sizes &z, bool expertsOnly = false) {
  double n = 0;
  for (const json &param : plan["parameters"])
    if (param["program"] == program && gatheredInBf16(plan, param, z) &&
        (!expertsOnly || (param.contains("shard") &&
                          param["shard"].value("axis", std::string()) == "ep")))
      n += elementsOf(param);
  return n;
}

// The axes whose condition holds, as a group of the comm report ("dp,cp").
AxisSet axesWhere(std::initializer_list<std::pair<MeshAxis, bool>> axes) {
  AxisSet set;
  for (auto [axis, holds] : axes)
    if (holds)
      set |= axis;
  return set;
}

// The ranks ZeRO shards over (parallel.zero_group, else all of dp), and the
// group the shard collectives are reported under.
double shardGroupOf(const json &plan, double d) {
  double g = plan.value("zero_group", 0);
  return g > 0 && g < d ? g : d;
}

} // namespace

Expected<tessel::CommTable> tessel::commTextbook(const json &plan,
                                                 const std::string &program) {
  Expected<Sizes> sizes = sizesOf(plan, program);
  if (!sizes)
    return sizes.takeError();
  const json &model = plan["model"];
  const auto [d, t, p, m, v, e, b, sWhole, h, V, f, kvDim, sp, tied, llama,
              bf16, r, first, last, ep, c] = *sizes;
  // Context parallelism: a rank's activations hold s / cp of each sequence.
  const double s = sWhole / c;
  std::set<int64_t> blocks = heldBy(plan, program).blocks;
  Moe moe = moeOf(plan);
  // The routed experts split over tp (parallel.expert_tp): every tp rank
  // routes all of the microbatch's tokens.
  bool expertTp = moe.enabled && t > 1 && plan.value("expert_tp", 1) > 1;
  bool zero = plan.value("zero", 0) >= 1 && d > 1;
  bool zero2 = plan.value("zero", 0) >= 2 && d > 1;
  bool zero3 = plan.value("zero", 0) >= 3 && d > 1;
  // Hybrid sharding: pieces over a group of g, summed over d/g groups.
  double g = shardGroupOf(plan, d), replicas = d / g;
  std::string shard = g < d ? "dp_shard" : "dp";
  CommTable table;
  for (const json &param : plan["parameters"]) {
    if (param["program"] != program)
      continue;
    std::string name = param["name"].get<std::string>();
    double n = elementsOf(param);
    bool splitOverTp =
        param.contains("shard") &&
        (param["shard"].value("axis", std::string()) == "tp" ||
         (param["shard"].contains("second") &&
          param["shard"]["second"].value("axis", std::string()) == "tp"));
    // Expert parallelism: an expert's gradient is summed over dp only, a
    // dense one over dp x ep (ep is more data parallelism for it).
    bool expert = param.contains("shard") &&
                  param["shard"].value("axis", std::string()) == "ep";
    double epSum = expert ? 1 : ep;
    double pieces = sizes->positionPieces();
    if (pieces > 1 && name == "wpe.weight" && model["family"] == "gpt") {
      // GPT-2's position table under sequence (or context) parallelism:
      // each rank's gradient rows are its own positions, reduced over dp
      // and gathered over tp (and cp).
      table.textbook[epSum > 1 ? "dp,ep" : "dp"] +=
          allReduce(n / pieces, d * epSum, 4);
      std::string gather = sp && t > 1 ? (c > 1 ? "tp,cp" : "tp") : "cp";
      table.textbook[gather] += (pieces - 1) * n / pieces * 4;
      continue;
    }
    // Under ZeRO-2 a gradient is reduce-scattered per microbatch, but for
    // a tied embedding on the first of several stages.
    bool tiedFirst = tied && p > 1 && first &&
                     (name == "wte.weight" || name == "model.embed_tokens.weight");
    bool asPieces = zero2 && !tiedFirst;
    // Under ZeRO a dense parameter's pieces are cut over dp x ep, and
    // every parameter's over dp x cp, as Megatron-LM's distributed
    // optimizer cuts them over the whole data-parallel group (not with
    // hybrid sharding).
    bool overDpEp = zero && epSum > 1 && g == d;
    bool overDpCp = zero && c > 1 && g == d;
    double G = g * (overDpEp ? epSum : 1) * (overDpCp ? c : 1);
    std::string group = overDpEp || overDpCp
                            ? axesWhere({{MeshAxis::DP, true},
                                         {MeshAxis::EP, overDpEp},
                                         {MeshAxis::CP, overDpCp}})
                                  .str()
                            : shard;
    // A reduce-scatter and a gather each move half an all-reduce's bytes;
    // the gather of a bf16 copy (gatheredInBf16) a quarter.
    double gather = gatheredInBf16(plan, param, *sizes) ? 0.25 : 0.5;
    // ZeRO-3 gathers a run for each forward and backward part that reads
    // it: a table only the embedding lookup reads (its backward needs the
    // tokens, not the table), a run of its own, in the forward alone.
    bool lookupOnly = name == "wpe.weight" ||
                      (!tied && (name == "wte.weight" ||
                                 name == "model.embed_tokens.weight"));
    // Under pipeline parallelism every gradient is a run of its own (one
    // collective per gradient), so a parameter backward does not read is
    // gathered for the forward alone: GPT's biases (a linear layer's bias
    // gradient is its output gradient's column sum; a LayerNorm's backward
    // reads its gain only). Full recompute reruns a block's forward in its
    // backward, and reads them again, up to the block's last op (the MLP's
    // output projection, whose output the backward does not read).
    bool notReadBackward = false;
    if (p > 1 && !llama && llvm::StringRef(name).ends_with(".bias")) {
      std::optional<int64_t> block = blockOf(name);
      notReadBackward =
          !block || !recomputes(plan, *block) ||
          name == "h." + std::to_string(*block) + ".mlp.c_proj.bias";
    }
    double gathers = lookupOnly || notReadBackward ? 1 : 2;
    double dpBytes = asPieces && zero3
                         ? (0.5 + gathers * gather) * m * allReduce(n, G, 4)
                     : asPieces ? (m / 2 + gather) * allReduce(n, G, 4)
                     : zero     ? (0.5 + gather) * allReduce(n, G, 4)
                                : allReduce(n, G, 4);
    // The axes besides dp that sum the gradient: ep for a dense parameter
    // (but where its pieces are cut over dp x ep), tp for one replicated
    // over tp under sequence parallelism, cp for every one (each cp rank
    // adds its piece of the sequence; but where the pieces are cut over
    // dp x cp).
    bool overTp = sp && t > 1 && !splitOverTp;
    double restEp = overDpEp ? 1 : epSum;
    double restCp = overDpCp ? 1 : c;
    AxisSet rest = axesWhere({{MeshAxis::TP, overTp},
                              {MeshAxis::CP, restCp > 1},
                              {MeshAxis::EP, restEp > 1}});
    double restGroup = restEp * (overTp ? t : 1) * restCp;
    // Hybrid sharding sums each piece over the replicas as well; a piece
    // (ZeRO-2 and 3) that the other axes sum too is summed over both at
    // once.
    bool replicasWithRest = asPieces && replicas > 1 && !rest.empty();
    if (zero && replicas > 1 && !replicasWithRest)
      table.textbook["dp_replica"] += allReduce(n / g, replicas, 4);
    if (replicasWithRest) {
      table.textbook[(rest | AxisSet::dpReplica()).str()] +=
          allReduce(n / G, restGroup * replicas, 4);
      table.textbook[group] += dpBytes;
    } else if (!rest.empty() && zero) {
      table.textbook[rest.str()] +=
          allReduce(asPieces ? n / G : n, restGroup, 4);
      table.textbook[group] += dpBytes;
    } else if (zero && (overDpEp || overDpCp)) {
      table.textbook[group] += dpBytes;
    } else if (!rest.empty())
      table.textbook[(d > 1 ? rest | MeshAxis::DP : rest).str()] +=
          allReduce(n, d * restGroup, 4);
    else
      table.textbook[zero ? shard : "dp"] += dpBytes;
  }

  // The norm's partial sums (fp64; two under tp: parameters split over tp
  // and those replicated) added over the shard group (the dense ones over
  // dp x ep under expert parallelism, the experts' one over dp; all over
  // dp x cp under context parallelism); one value counts as a scalar.
  if (zero && t > 1 && (ep > 1 || c > 1) && g == d)
    table.textbook[axesWhere({{MeshAxis::DP, true},
                              {MeshAxis::EP, ep > 1},
                              {MeshAxis::CP, c > 1}})
                       .str()] += allReduce(2, g * ep * c, 8); // the dense ones
  else if (zero && g < d) {
    // Hybrid sharding adds every partial sum over the shard group at once:
    // the dense ones (two under tp) and, under expert parallelism, the
    // experts'.
    bool experts = false;
    for (const json &param : plan["parameters"])
      experts |= param["program"] == program && param.contains("shard") &&
                 param["shard"].value("axis", std::string()) == "ep";
    double sums = (t > 1 ? 2 : 1) + (ep > 1 && experts ? 1 : 0);
    if (sums > 1)
      table.textbook[shard] += allReduce(sums, g, 8);
  } else if (zero && t > 1)
    table.textbook[shard] += allReduce(2, g, 8);

  double bsh = b * s * h;
  if (t > 1) {
    // Under sequence parallelism the backward pass gathers a column-parallel
    // matmul's input again (two per block, one for the head). Full
    // recompute runs a block's forward again up to what its backward reads:
    // every collective but the block's last reduction (its output, which
    // its backward does not read): one more all-reduce without sp; with sp
    // the two gathers (which replace the re-gathers) and one
    // reduce-scatter. Megatron, which reruns the whole forward, moves one
    // all-reduce (or gather and reduce-scatter) more.
    double regather = sp ? 1 : 0;
    double perMicrobatch = 0;
    for (int64_t block : blocks) {
      double again = recomputes(plan, block) ? (sp ? 3 : 2) : 2 * regather;
      // An MoE block without shared experts has no tp-split MLP: its routed
      // experts are whole on every tp rank, so only attention's collectives
      // remain (under sequence parallelism the experts take the rank's
      // piece of the sequence as it is).
      // Recomputed, such a block runs attention's reduction again (what
      // the experts' backward reads comes after it): one all-reduce, or a
      // gather and a reduce-scatter that replace the re-gather.
      if (moe.isMoeBlock(block) && moe.shared == 0 && !expertTp) {
        double rerun = recomputes(plan, block) ? 2 : again / 2;
        perMicrobatch += (4 + rerun) * (t - 1) / t * bsh * e;
        continue;
      }
      // Split over tp, the experts reduce their output as an MLP does
      // (forward and backward), the shared experts' with it; the rows they
      // read are the gathered tokens the dispatch keeps, gathered again
      // only for the shared experts. Routing the whole microbatch adds the
      // router's probabilities gathered (forward and backward, b s E fp32
      // values, under sequence parallelism) and the routing weights'
      // gradient summed (b s k, in the activations' precision, as the
      // weights are), a partial sum like the rows it comes from.
      if (moe.isMoeBlock(block) && expertTp) {
        double shared = moe.shared > 0 && !recomputes(plan, block) ? regather : 0;
        double rerun = recomputes(plan, block) ? again : again / 2;
        perMicrobatch += (8 + rerun + shared) * (t - 1) / t * bsh * e +
                         (sp ? 2 * (t - 1) / t * b * s * moe.experts * 4 : 0) +
                         allReduce(b * s * moe.topK, t, e);
        continue;
      }
      perMicrobatch += (8 + again) * (t - 1) / t * bsh * e;
    }
    if (first)
      perMicrobatch += 2 * (t - 1) / t * bsh * e;
    if (last)
      perMicrobatch += (2 + regather) * (t - 1) / t * bsh * e +
                       3 * allReduce(b * s, t, 4);
    table.textbook["tp"] += m * perMicrobatch;
  }
  if (c > 1) {
    // Context parallelism: per block and microbatch, each attention's keys
    // and values gathered over cp in the forward and again in the backward
    // (a rank keeps only its piece), and their gradients reduce-scattered:
    // six collectives of (cp-1)/cp of the b*s keys' kv_dim/tp values (all
    // KV heads where they are fewer than the tp ranks).
    double kvHeads = model["kv_heads"].get<double>();
    double kvLocal = std::fmod(kvHeads, t) == 0 ? kvDim / t : kvDim;
    double collective = (c - 1) / c * b * sWhole * kvLocal * e;
    table.textbook["cp"] += m * 6 * collective * double(blocks.size());
  }
  // Per MoE block and microbatch, over the ranks that split the tokens
  // (dp, ep, cp, and tp under sequence parallelism): the router's statistics
  // (assignments and probability sums per expert, E floats each) summed
  // for the load-balancing loss, and with a capacity each rank's counts
  // per expert (per row under sequence parallelism) all-gathered. Per
  // step, the metrics' assignments per expert (when no loss sums them
  // already) and kept ones (with a capacity), E floats each.
  // Over ep, the dispatch: two exchanges (forward, and the gradient's in
  // backward), each the counts (E/g per peer, int32) and at most every row
  // of the rank's tokens (R = b s k rows of h floats, a t-th under
  // sequence parallelism), and two combines, each sending back at most the
  // rows of the g - 1 other ranks: the worst case the static plan bounds
  // (balanced routing moves (g-1)/g of R rows in each of the four).
  // Full recompute runs the block's forward again up to what its backward
  // reads, the experts' outputs among them: one exchange and one combine
  // more, and the assignments' sum (the load-balancing loss's gradient
  // reads them; the probability sums it does not).
  if (moe.enabled) {
    bool tokensOverTp = sp && t > 1 && !expertTp;
    double tokens = b * s / (tokensOverTp ? t : 1);
    double tokenGroup = d * ep * (tokensOverTp ? t : 1) * c;
    AxisSet tokenAxes = axesWhere({{MeshAxis::DP, d > 1},
                                   {MeshAxis::TP, tokensOverTp},
                                   {MeshAxis::CP, c > 1},
                                   {MeshAxis::EP, ep > 1}});
    double E = moe.experts, rows = tokens * moe.topK;
    for (int64_t block : blocks) {
      if (!moe.isMoeBlock(block))
        continue;
      bool again = recomputes(plan, block);
      if (!tokenAxes.empty()) {
        if (moe.auxLoss)
          table.textbook[tokenAxes.str()] +=
              m * (again ? 3 : 2) * allReduce(E, tokenGroup, 4);
        else
          table.textbook[tokenAxes.str()] += allReduce(E, tokenGroup, 4);
        if (moe.capacity) {
          // Per row when the sequence is split (over tp or cp); gathered
          // again by a full recompute, whose dispatch keeps them.
          double n = tokensOverTp || c > 1 ? b * E : E;
          table.textbook[tokenAxes.str()] +=
              m * (again ? 2 : 1) * (tokenGroup - 1) * n * 4 +
              allReduce(E, tokenGroup, 4);
        }
      }
      if (ep > 1)
        table.textbook["ep"] +=
            m * (again ? 3 : 2) *
            ((E / ep * (ep - 1) * 4 + rows * h * 4) + (ep - 1) * rows * h * 4);
    }
  }
  if (p > 1) {
    double message = bsh / (sp ? t : 1) * e;
    double sends = (v - (last ? 1 : 0)) + (v - (first ? 1 : 0));
    table.textbook["pp"] += m * sends * message;
    if (tied && first)
      table.textbook["pp"] += V / t * h * e;
    if (tied && last)
      table.textbook["pp"] += V / t * h * 4;
    // The metrics, summed over pp so that every rank reports them all (as
    // Megatron reduces its MoE trackers): the tokens routed to each expert
    // of each MoE layer. The scalars (losses, norm) are not compared.
    if (moe.enabled) {
      double moeLayers = 0;
      for (int64_t l = 0; l < model["layers"].get<int64_t>(); ++l)
        moeLayers += moe.isMoeBlock(l);
      table.textbook["pp"] += allReduce(moeLayers * moe.experts, p, 4);
    }
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

Expected<std::vector<tessel::MemoryRow>>
tessel::memoryTextbook(const json &plan, const std::string &program) {
  Expected<Sizes> sizes = sizesOf(plan, program);
  if (!sizes)
    return sizes.takeError();
  const json &memory = plan["programs"][program]["memory"];
  if (!memory.contains("activation_slot_bytes"))
    return missing("activation_slot_bytes");
  const auto [d, t, p, m, v, e, b, sWhole, h, V, f, kvDim, sp, tied, llama,
              bf16, r, first, last, ep, c] = *sizes;
  // Context parallelism: a rank's activations hold s / cp of each sequence.
  const double s = sWhole / c;
  Held held = heldBy(plan, program);
  double P = held.elements;
  const std::set<int64_t> &blocks = held.blocks;

  std::vector<MemoryRow> rows;
  // ZeRO-3: the parameters as pieces, those kept whole (as the gradients
  // below) and the runs gathered for the parts.
  double keptWhole = keptWholeUnderZero(plan, program, *sizes);
  // The pieces are 1/g of a run, g the shard group (dp unless hybrid),
  // times cp under context parallelism; a dense run's 1/(g ep) under
  // expert parallelism (neither with hybrid sharding).
  const double dz = shardGroupOf(plan, d);
  const double dzCp = dz == d ? dz * c : dz;
  const double dzEp = dz == d ? dzCp * ep : dz;
  const double experts = dzEp > dzCp ? held.expertElements : 0;
  const std::string shardGroup = dz < d      ? "zero_group"
                                 : dzCp > dz ? "(dp x cp)"
                                             : "dp";
  const std::string part = "1/" + shardGroup;
  const std::string overEp =
      dzEp > dzCp ? "a dense run's pieces over dp x ep" : "";
  // A run's elements as pieces: experts' over dp (x cp), the rest over
  // dp x ep (x cp).
  auto asPieces = [&](double elements) {
    return (elements - experts) / dzEp + experts / dzCp;
  };
  // ZeRO-1/2 in bf16: the master weights of the matrices only matmuls
  // read as pieces, the rest whole (no gathered runs).
  bool masters =
      plan.value("zero", 0) < 3 && memory.contains("param_piece_bytes");
  double M = masters ? gatheredInBf16Elements(plan, program, *sizes) : 0;
  // The routed experts among them, cut over dp x cp (the rest over
  // dp x ep x cp).
  double expertsM = masters && dzEp > dzCp
                        ? gatheredInBf16Elements(plan, program, *sizes, true)
                        : 0;
  if (!memory.contains("param_piece_bytes")) {
    rows.push_back({"parameters (fp32)", memory["params_bytes"].get<double>(),
                    4 * P, ""});
  } else if (masters) {
    rows.push_back({"master weights, pieces (fp32, " + part + ")",
                    memory["param_piece_bytes"].get<double>(),
                    4 * ((M - expertsM) / dzEp + expertsM / dzCp),
                    memory.contains("offloaded_bytes")
                        ? "offloaded with the moments: in pinned host "
                          "memory, not in the total"
                        : std::string(p > 1 ? "of the matrices only "
                                              "matmuls read"
                                            : "of the matrices only matmuls "
                                              "read, in runs of their own") +
                              (overEp.empty() ? "" : "; " + overEp)});
    rows.push_back({"parameters kept whole (fp32)",
                    memory["param_whole_bytes"].get<double>(), 4 * (P - M),
                    "read in fp32: norms, biases, embedding tables"});
  } else {
    rows.push_back({"parameter pieces (fp32, " + part + ")",
                    memory["param_piece_bytes"].get<double>(),
                    4 * asPieces(P - keptWhole),
                    memory.contains("offloaded_bytes")
                        ? "offloaded with the moments: in pinned host "
                          "memory, not in the total"
                        : overEp});
    rows.push_back({"parameters kept whole (fp32)",
                    memory["param_whole_bytes"].get<double>(), 4 * keptWhole,
                    ""});
    rows.push_back({"gathered parameters (fp32)",
                    memory["param_gather_bytes"].get<double>(), 0,
                    "runs a part reads, gathered: a bucket per slot (in "
                    "bf16, of the runs read in fp32 only)"});
  }
  bool zero2 = plan.value("zero", 0) >= 2 && d > 1 &&
               memory.contains("grad_piece_bytes");
  if (!zero2) {
    rows.push_back({"gradients (fp32)", memory["grads_bytes"].get<double>(),
                    4 * P, ""});
  } else {
    // ZeRO-2: the pieces (4P/d), what is kept whole (GPT-2's position
    // table under sequence parallelism; a tied embedding on the first of
    // several stages), and the staging of the runs being reduced.
    double kept = keptWhole;
    rows.push_back({"gradient pieces (fp32, " + part + ")",
                    memory["grad_piece_bytes"].get<double>(),
                    4 * asPieces(P - kept), overEp});
    rows.push_back({"gradients kept whole (fp32)",
                    memory["grad_whole_bytes"].get<double>(), 4 * kept, ""});
    rows.push_back({"gradient staging",
                    memory["grad_staging_bytes"].get<double>() +
                        memory.value("grad_scratch_bytes", 0.0),
                    0,
                    "runs being reduced: a bucket (or a gradient) per slot, "
                    "and a piece per microbatch"});
  }
  // ZeRO-1 keeps the moments of a 1/d piece of every gradient run (the
  // paper's K*Psi/N_d with K = 8 for two fp32 moments).
  // GPT-2's position table under sequence parallelism, whose gradient is
  // reduced as sequence pieces, keeps whole moments.
  bool zero = plan.value("zero", 0) >= 1 && d > 1;
  double whole = 0;
  if (zero && sizes->positionPieces() > 1 && !llama)
    for (const json &param : plan["parameters"])
      if (param["program"] == program && param["name"] == "wpe.weight")
        whole += elementsOf(param);
  rows.push_back(
      {zero ? "AdamW moments (fp32, " + part + ")" : "AdamW moments (fp32)",
       memory["optimizer_bytes"].get<double>(),
       zero ? 8 * asPieces(P - whole) + 8 * whole : 8 * P,
       (zero ? "ceil(n/" + shardGroup + ") of each gradient run"
             : std::string()) +
           (zero && !overEp.empty() ? "; " + overEp : "") +
           (memory.contains("offloaded_bytes")
                ? std::string(zero ? "; " : "") +
                      "offloaded: in pinned host memory, not "
                      "in the total"
                : "")});
  // With the parameters sharded the copy is of what the parts read: the
  // parameters kept whole and the gathered runs (the pieces have none).
  if (bf16 && masters)
    rows.push_back({"parameters (bf16 copy)",
                    memory.value("param_shadow_bytes", 0.0), 2 * P,
                    "of every parameter, whole"});
  else if (bf16 && memory.contains("param_piece_bytes"))
    rows.push_back(
        {"parameters (bf16 copy)", memory.value("param_shadow_bytes", 0.0),
         2 * keptWhole + memory["param_gather_bytes"].get<double>() / 2 +
             memory.value("param_gather_bf16_bytes", 0.0),
         "of the parameters kept whole and the gathered runs"});
  else if (bf16)
    rows.push_back({"parameters (bf16 copy)",
                    memory.value("param_shadow_bytes", 0.0), 2 * P, ""});
  // Per block and microbatch: the two norms' inputs and outputs (split by
  // the sequence under sp), q, k, v and the attention output, and the MLP's
  // hidden activations (GELU: its input and output; SwiGLU: gate, up, their
  // activation and product, or with fused kernels gate, up and product, the
  // backward taking the activation again), all split over tp; and the
  // attention's row
  // log-sum-exp, one fp32 value per token and head (FlashAttention's), or
  // with unfused attention its probabilities, s values per token and head
  // (Korthikanti et al.'s 2as^2b), and with attention dropout the dropped
  // ones too (their 2as^2b; the mask is drawn again, not kept), which
  // selective recomputation makes again instead. Dropout on the hidden
  // states keeps nothing: its backward draws the mask again.
  double heads = plan["model"]["heads"].get<double>();
  const json &train = plan["train"];
  bool unfused = train.value("attention", std::string("flash")) == "unfused";
  bool selective = train.value("recompute", std::string("none")) == "selective";
  double probabilities =
      plan["model"].value("attention_dropout", 0.0) > 0 ? 2 : 1;
  double attentionKept = !unfused   ? b * s * heads / t * 4
                         : selective ? 0
                                     : probabilities * b * s * heads / t * sWhole * e;
  double mlpKept = llama ? (plan.value("fused_kernels", false) ? 3 : 4) : 2;
  double perBlock =
      b * s *
          (4 * h / (sp ? t : 1) + (2 * h + 2 * kvDim) / t + mlpKept * f / t) *
          e +
      attentionKept;
  // An MoE block keeps, instead of the MLP's hidden activations: per token
  // the router reads, its probabilities (fp32) and, for the z-loss, its
  // logits; per token it routes, the top-k experts, their weights and the
  // rows the dispatch puts them in, and the k rows the experts return (the
  // routing weights' gradient reads them); per row the experts take, the
  // row and its hidden activations (as the MLP's, split over tp under
  // parallel.expert_tp); per microbatch the dispatch's offsets (and
  // under ep the received ones) and the load-balancing loss's statistics
  // (each in a place of 64 bytes at least); and the shared
  // experts' activations as an MLP's. Under sequence parallelism a tp rank
  // routes its own piece of the sequence, but with expert_tp (the router
  // reads its piece, then every tp rank routes all the tokens). Under
  // expert parallelism the experts take at most one row per token of the
  // ep group's ranks and expert: g x min(k, E/g) rows per token of the
  // rank's own; the static plan holds that bound (balanced routing fills
  // k/(g min(k, E/g)) of it).
  Moe moeKept = moeOf(plan);
  // A buffer of a few values takes a place of 64 bytes in the plan.
  auto placed = [](double bytes) { return std::ceil(bytes / 64) * 64; };
  bool expertTpKept =
      moeKept.enabled && t > 1 && plan.value("expert_tp", 1) > 1;
  double local = b * s / (sp ? t : 1);
  double routed = expertTpKept ? b * s : local;
  double k = moeKept.topK, E = moeKept.experts;
  double moeBlock =
      perBlock - b * s * mlpKept * f / t * e +
      local * (E * 4 + (moeKept.zLoss ? E * e : 0)) +
      routed * (k * (4 + e + 4) + k * h * e) +
      ep * std::min(k, E / ep) * routed *
          (h * e + mlpKept * moeKept.ffn / (expertTpKept ? t : 1) * e) +
      (ep > 1 ? 2 : 1) * placed((E + 1) * 4) +
      (moeKept.auxLoss ? placed(E * 4) : 0) +
      b * s * mlpKept * moeKept.shared * moeKept.ffn / t * e;
  // Full recompute keeps only each block's input (Korthikanti et al.'s
  // 2sbh in 16 bits; split by the sequence under sp).
  double keptPerMicrobatch = 0;
  for (int64_t block : blocks)
    keptPerMicrobatch += recomputes(plan, block) ? b * s * h / (sp ? t : 1) * e
                         : moeKept.isMoeBlock(block) ? moeBlock
                                                     : perBlock;
  double slots = memory.value("activation_slots", 1.0);
  MemoryRow kept{"kept per microbatch in flight",
                 memory["activation_slot_bytes"].get<double>(),
                 keptPerMicrobatch, ""};
  if (slots <= 1)
    kept.note = "one microbatch in flight: the slot also holds what lives "
                "within a part";
  else if (first || last)
    kept.note = std::string("with the ") +
                (first && last ? "embedding and the head"
                 : first       ? "embedding"
                               : "head") +
                ", which the formula leaves out";
  bool moeHeld = false;
  for (int64_t block : blocks)
    moeHeld |= moeKept.isMoeBlock(block) && !recomputes(plan, block);
  if (moeHeld && ep > 1)
    kept.note += std::string(kept.note.empty() ? "" : "; ") +
                 "MoE under ep: the experts' rows at their bound, "
                 "min(k, E/ep) per token of the ep group";
  rows.push_back(kept);
  // 1F1B holds p - r microbatches at rank r (at most m), GPipe all m. The
  // interleaved schedule (Narayanan et al.) runs 2(p - r - 1) + (v - 1)p
  // chunk forwards before its first backward and holds one more chunk: with
  // an arena per chunk Tessel holds the chunks in flight, compared in
  // chunks (the bytes are the slots', above, times the slots in whole
  // stages).
  std::string schedule = plan.value("schedule", std::string("1f1b"));
  MemoryRow inFlight{"microbatches in flight", slots, 0, ""};
  if (p == 1)
    inFlight.textbook = 1;
  else if (schedule == "1f1b" && v == 1)
    inFlight.textbook = std::min(p - r, m);
  else if (schedule == "gpipe")
    inFlight.textbook = m;
  else if (memory.contains("activation_chunks_in_flight")) {
    inFlight.what = "chunks in flight";
    inFlight.predicted = memory["activation_chunks_in_flight"].get<double>();
    inFlight.textbook = std::min(2 * (p - r - 1) + (v - 1) * p + 1, m * v);
    char stages[64];
    std::snprintf(stages, sizeof stages, "%.2f", slots);
    inFlight.note = std::string("interleaved: a place per chunk of a "
                                "microbatch, ") +
                    stages + " whole stages' worth";
  } else {
    inFlight.textbook =
        std::min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) / v;
    inFlight.note = "interleaved: textbook in whole-stage units (chunks / "
                    "v); a slot here holds the whole stage";
  }
  rows.push_back(inFlight);
  return rows;
}
