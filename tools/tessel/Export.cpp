//===- Export.cpp - `tessel export`: a Hugging Face model directory -------===//
//
// tessel export SOURCE --to hf DIR writes what `transformers` loads with
// AutoModelForCausalLM.from_pretrained(DIR): config.json (GPT2Config or
// LlamaConfig fields, as transformers names them), model.safetensors (the
// Hugging Face names and layouts, F32, metadata format "pt"),
// generation_config.json and, given the GPT-2 tokenizer's files, the
// tokenizer. SOURCE is a checkpoint (a --ckpt-dir root or a step
// directory) or a .safetensors file of `tessel run --save-final`; both
// record the model's fields. DIR appears whole or not at all: the files are
// written to a sibling directory that is renamed at the end.
//
//===----------------------------------------------------------------------===//

#include "Commands.h"
#include "Tokenizer.h"

#include "tessel/Runtime/Safetensors.h"

#include "llvm/ADT/StringRef.h"
#include "llvm/Support/MemoryBuffer.h"
#include "llvm/Support/raw_ostream.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <unistd.h>

using namespace llvm;
namespace fs = std::filesystem;
namespace rt = tessel::rt;
using tessel::fail;
using tessel::inQuotes;
using nlohmann::json;

namespace {

const char *kUsage =
    "usage: tessel export SOURCE --to hf DIR [--plan PLAN_DIR]\n"
    "                     [--vocab-json vocab.json --merges merges.txt] "
    "[--force]\n"
    "  SOURCE: a checkpoint (a --ckpt-dir root: its newest; or a step-N\n"
    "  directory) or a .safetensors file of tessel run --save-final.\n"
    "  DIR receives config.json, model.safetensors, generation_config.json\n"
    "  and, with the GPT-2 tokenizer's files, vocab.json, merges.txt and\n"
    "  tokenizer_config.json. --plan takes the model from a compiled\n"
    "  directory's plan.json when SOURCE does not record it.\n";


int usageError(const Twine &message) {
  outs().flush();
  errs() << "tessel export: " << message << "\n" << kUsage;
  return 2;
}


std::string shapeText(const std::vector<int64_t> &shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i)
    text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

struct Model {
  std::string family;
  int64_t vocab, seqLen, layers, hidden, heads, kvHeads, ffn;
  int64_t paddedVocab; // the embedding's rows (model.vocab_pad_to_multiple)
  bool tied;
  double normEps, ropeTheta;
  // Hugging Face's dropout fields (training only; 0 in older plans).
  double dropout = 0, attentionDropout = 0;
  // A mixture-of-experts model (model.moe; 0 experts: dense), exported as
  // Mixtral: every layer's MLP routed to `topK` of `experts` SwiGLU experts
  // of width `expertFfn`.
  int64_t experts = 0, topK = 0, expertFfn = 0;
  double routerAuxLossCoef = 0;
};

// The model fields plan.json and checkpoints record (docs/spec.md).
Model modelOf(const json &j, const std::string &where) {
  auto field = [&](const char *name) -> const json & {
    if (!j.contains(name))
      throw std::runtime_error(where + " has no model." + name);
    return j.at(name);
  };
  Model m;
  m.family = field("family").get<std::string>();
  if (m.family != "gpt" && m.family != "llama")
    throw std::runtime_error(where + ": model.family '" + m.family +
                             "' has no Hugging Face export");
  m.vocab = field("vocab_size").get<int64_t>();
  m.paddedVocab = j.value("padded_vocab_size", m.vocab);
  m.seqLen = field("seq_len").get<int64_t>();
  m.layers = field("layers").get<int64_t>();
  m.hidden = field("hidden").get<int64_t>();
  m.heads = field("heads").get<int64_t>();
  m.kvHeads = field("kv_heads").get<int64_t>();
  m.ffn = field("ffn_hidden").get<int64_t>();
  m.tied = field("tie_embeddings").get<bool>();
  // Older plans did not record these; they were the defaults then.
  m.normEps = j.value("norm_eps", 1e-5);
  m.dropout = j.value("dropout", 0.0);
  m.attentionDropout = j.value("attention_dropout", 0.0);
  m.ropeTheta = j.value("rope_theta", 10000.0);
  if (j.contains("moe") && !j["moe"].is_null()) {
    // Hugging Face's Mixtral routes as Tessel does (softmax over the
    // experts, the top_k renormalised) in every layer, with nothing beside
    // the routed experts.
    const json &moe = j["moe"];
    int64_t every = moe.value("every", int64_t(1)),
            shared = moe.value("shared_experts", int64_t(0));
    if (m.family != "llama" || every != 1 || shared != 0)
      throw std::runtime_error(
          where + ": a mixture-of-experts model exports to Hugging Face as "
                  "Mixtral, whose every layer routes to SwiGLU experts alone: "
                  "it needs model.family \"llama\", model.moe.every 1 and no "
                  "model.moe.shared_experts (this one has family \"" +
          m.family + "\", every " + std::to_string(every) +
          ", shared_experts " + std::to_string(shared) + ")");
    m.experts = moe.at("experts").get<int64_t>();
    m.topK = moe.at("top_k").get<int64_t>();
    m.expertFfn = moe.value("ffn_hidden", m.ffn);
    m.routerAuxLossCoef = moe.value("aux_loss_coef", 0.0);
  }
  return m;
}

// Every parameter's Tessel name and shape, in the model's order.
std::vector<std::pair<std::string, std::vector<int64_t>>>
expectedTensors(const Model &m) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> t;
  int64_t h = m.hidden, f = m.ffn, kv = h / m.heads * m.kvHeads;
  if (m.family == "gpt") {
    t.push_back({"wte.weight", {m.vocab, h}});
    t.push_back({"wpe.weight", {m.seqLen, h}});
    for (int64_t l = 0; l < m.layers; ++l) {
      std::string p = "h." + std::to_string(l) + ".";
      t.push_back({p + "ln_1.weight", {h}});
      t.push_back({p + "ln_1.bias", {h}});
      t.push_back({p + "attn.c_attn.weight", {h, 3 * h}});
      t.push_back({p + "attn.c_attn.bias", {3 * h}});
      t.push_back({p + "attn.c_proj.weight", {h, h}});
      t.push_back({p + "attn.c_proj.bias", {h}});
      t.push_back({p + "ln_2.weight", {h}});
      t.push_back({p + "ln_2.bias", {h}});
      t.push_back({p + "mlp.c_fc.weight", {h, f}});
      t.push_back({p + "mlp.c_fc.bias", {f}});
      t.push_back({p + "mlp.c_proj.weight", {f, h}});
      t.push_back({p + "mlp.c_proj.bias", {h}});
    }
    t.push_back({"ln_f.weight", {h}});
    t.push_back({"ln_f.bias", {h}});
  } else {
    t.push_back({"model.embed_tokens.weight", {m.vocab, h}});
    for (int64_t l = 0; l < m.layers; ++l) {
      std::string p = "model.layers." + std::to_string(l) + ".";
      t.push_back({p + "input_layernorm.weight", {h}});
      t.push_back({p + "self_attn.q_proj.weight", {h, h}});
      t.push_back({p + "self_attn.k_proj.weight", {kv, h}});
      t.push_back({p + "self_attn.v_proj.weight", {kv, h}});
      t.push_back({p + "self_attn.o_proj.weight", {h, h}});
      t.push_back({p + "post_attention_layernorm.weight", {h}});
      if (m.experts > 0) {
        std::string moe = p + "block_sparse_moe.";
        int64_t e = m.experts, fe = m.expertFfn;
        t.push_back({moe + "gate.weight", {e, h}});
        t.push_back({moe + "experts.w1", {e, fe, h}});
        t.push_back({moe + "experts.w2", {e, h, fe}});
        t.push_back({moe + "experts.w3", {e, fe, h}});
        continue;
      }
      t.push_back({p + "mlp.gate_proj.weight", {f, h}});
      t.push_back({p + "mlp.up_proj.weight", {f, h}});
      t.push_back({p + "mlp.down_proj.weight", {h, f}});
    }
    t.push_back({"model.norm.weight", {h}});
  }
  if (!m.tied)
    t.push_back({"lm_head.weight", {m.vocab, h}});
  return t;
}

// The name transformers' GPT2LMHeadModel / LlamaForCausalLM gives it.
std::string hfName(const Model &m, const std::string &name) {
  if (m.family == "gpt" && name != "lm_head.weight")
    return "transformer." + name;
  return name;
}

// GPT-2's <|endoftext|> both begins and ends a text.
void setEndOfText(json &config, std::optional<int64_t> eos) {
  if (eos) {
    config["bos_token_id"] = *eos;
    config["eos_token_id"] = *eos;
  }
}

json configOf(const Model &m, std::optional<int64_t> eos) {
  json c;
  if (m.family == "gpt") {
    c = {{"architectures", {"GPT2LMHeadModel"}},
         {"model_type", "gpt2"},
         {"vocab_size", m.vocab},
         {"n_positions", m.seqLen},
         {"n_ctx", m.seqLen},
         {"n_embd", m.hidden},
         {"n_layer", m.layers},
         {"n_head", m.heads},
         {"n_inner", m.ffn},
         // Tessel's GELU is the tanh approximation (docs/spec.md).
         {"activation_function", "gelu_new"},
         {"layer_norm_epsilon", m.normEps},
         {"resid_pdrop", m.dropout},
         {"embd_pdrop", m.dropout},
         {"attn_pdrop", m.attentionDropout},
         {"scale_attn_weights", true},
         {"initializer_range", 0.02},
         {"tie_word_embeddings", m.tied}};
  } else {
    c = {{"architectures", {"LlamaForCausalLM"}},
         {"model_type", "llama"},
         {"vocab_size", m.vocab},
         {"hidden_size", m.hidden},
         {"intermediate_size", m.ffn},
         {"num_hidden_layers", m.layers},
         {"num_attention_heads", m.heads},
         {"num_key_value_heads", m.kvHeads},
         {"head_dim", m.hidden / m.heads},
         {"max_position_embeddings", m.seqLen},
         {"hidden_act", "silu"},
         {"rms_norm_eps", m.normEps},
         {"rope_theta", m.ropeTheta},
         {"attention_bias", false},
         {"mlp_bias", false},
         {"attention_dropout", m.attentionDropout},
         {"initializer_range", 0.02},
         {"tie_word_embeddings", m.tied}};
    if (m.experts > 0) {
      // Mixtral: Llama's fields, its MLPs routed experts of
      // intermediate_size each (and no biases to name).
      c["architectures"] = {"MixtralForCausalLM"};
      c["model_type"] = "mixtral";
      c["intermediate_size"] = m.expertFfn;
      c["num_local_experts"] = m.experts;
      c["num_experts_per_tok"] = m.topK;
      c["router_aux_loss_coef"] = m.routerAuxLossCoef;
      c["output_router_logits"] = false;
      c["sliding_window"] = nullptr;
      c.erase("attention_bias");
      c.erase("mlp_bias");
    }
  }
  c["torch_dtype"] = "float32";
  setEndOfText(c, eos);
  return c;
}

void writeText(const fs::path &path, const std::string &text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  out.close();
  if (!out)
    throw std::runtime_error("cannot write " + inQuotes(path.string()));
}

} // namespace

int tessel::exportCommand(ArrayRef<std::string> args) {
  Arguments parsed;
  std::string error = parseArguments(
      args, {"--to", "-o", "--plan", "--vocab-json", "--merges"},
      {"--force", "--help", "-h"}, parsed);
  if (!error.empty())
    return usageError(error);
  if (parsed.switches.count("--help") || parsed.switches.count("-h")) {
    outs() << kUsage;
    return 0;
  }
  std::vector<std::string> &positionals = parsed.positionals;
  std::map<std::string, std::string> &values = parsed.values;
  bool force = parsed.switches.count("--force");
  // `--to hf DIR` or `--to hf -o DIR`.
  if (values.count("-o"))
    positionals.push_back(values["-o"]);
  if (positionals.size() != 2)
    return usageError("expects a SOURCE and a DIR");
  if (values["--to"] != "hf")
    return usageError(values["--to"].empty()
                          ? "--to is required (hf)"
                          : "--to " + values["--to"] +
                                ": the one format is hf");
  const std::string &source = positionals[0];
  const fs::path dir = positionals[1];
  bool tokenizer = values.count("--vocab-json") || values.count("--merges");
  if (tokenizer && !(values.count("--vocab-json") && values.count("--merges")))
    return usageError("--vocab-json and --merges go together");
  std::error_code ec;
  if (fs::exists(dir, ec) && !force)
    return fail(inQuotes(dir.string()) + " exists; --force replaces it");

  try {
    // The tensors and the model they are of; `load(k)` reads tensor k,
    // so that the export holds one tensor in memory at a time.
    std::vector<std::string> names;
    std::vector<std::vector<int64_t>> shapes;
    std::function<std::vector<float>(size_t)> load;
    std::string modelJson, modelWhere;
    if (fs::is_directory(source, ec)) {
      CheckpointParameters c = readCheckpointParameters(source);
      names = std::move(c.names);
      shapes = std::move(c.shapes);
      load = std::move(c.read);
      modelJson = c.model;
      modelWhere = "the checkpoint " + inQuotes(c.dir);
    } else {
      auto reader = std::make_shared<rt::SafetensorsReader>(source);
      for (const std::string &name : reader->names()) {
        names.push_back(name);
        shapes.push_back(reader->info(name).shape);
      }
      load = [reader, names](size_t k) { return reader->read(names.at(k)); };
      auto model = reader->metadata().find("model");
      if (model != reader->metadata().end())
        modelJson = model->second;
      modelWhere = inQuotes(source);
    }
    if (values.count("--plan")) {
      Expected<json> plan = readPlan(values["--plan"]);
      if (!plan)
        return fail(toString(plan.takeError()));
      modelWhere = inQuotes((fs::path(values["--plan"]) / "plan.json").string());
      if (!plan->contains("model"))
        return fail(modelWhere + " has no model section");
      modelJson = (*plan)["model"].dump();
    }
    if (modelJson.empty())
      return fail(modelWhere +
                  " does not record its model (written by an older tessel?); "
                  "--plan DIR takes it from a compiled directory");
    json modelFields = json::parse(modelJson, nullptr, false);
    if (!modelFields.is_object())
      return fail(modelWhere + ": the recorded model is not a JSON object");
    Model m = modelOf(modelFields, modelWhere);

    // Every parameter present with its shape, and nothing else.
    std::map<std::string, size_t> index;
    for (size_t k = 0; k < names.size(); ++k)
      index[names[k].rfind("transformer.", 0) == 0 ? names[k].substr(12)
                                                    : names[k]] = k;
    // What the file holds, in order, and where each comes from: the
    // source tensor and the element it starts at.
    std::vector<rt::SafetensorView> views;
    std::vector<std::pair<size_t, int64_t>> from;
    auto expected = expectedTensors(m);
    for (const auto &[name, shape] : expected) {
      auto it = index.find(name);
      if (it == index.end())
        return fail(modelWhere + " has no tensor " + inQuotes(name) +
                    " of the " + m.family + " model it records");
      // A padded table is exported as its first vocab_size rows.
      const bool padded = m.paddedVocab > m.vocab && shape.size() == 2 &&
                          shape[0] == m.vocab &&
                          shapes[it->second] ==
                              std::vector<int64_t>{m.paddedVocab, shape[1]};
      if (shapes[it->second] != shape && !padded)
        return fail(modelWhere + ": tensor " + inQuotes(name) + " is " +
                    shapeText(shapes[it->second]) + ", the model's is " +
                    shapeText(shape));
      if (m.experts > 0 && !rt::perExpertName(name, 0).empty()) {
        // Stacked experts [E, out, in], one [out, in] tensor each.
        std::vector<int64_t> one(shape.begin() + 1, shape.end());
        for (int64_t e = 0; e < shape[0]; ++e) {
          views.push_back({rt::perExpertName(name, e), one, nullptr});
          from.push_back({it->second, e * one[0] * one[1]});
        }
      } else {
        views.push_back({hfName(m, name), shape, nullptr});
        from.push_back({it->second, 0});
      }
      index.erase(it);
    }
    if (!index.empty())
      return fail(modelWhere + ": " + inQuotes(index.begin()->first) +
                  " is not a parameter of the " + m.family +
                  " model it records" +
                  (index.size() > 1
                       ? " (and " + std::to_string(index.size() - 1) +
                             " more)"
                       : std::string()));

    std::optional<int64_t> eos;
    std::optional<Gpt2Bpe> bpe;
    if (tokenizer) {
      bpe = Gpt2Bpe::load(values["--vocab-json"], values["--merges"]);
      if (bpe->vocabSize() > m.vocab)
        return fail("the tokenizer has " + std::to_string(bpe->vocabSize()) +
                    " tokens, more than model.vocab_size = " +
                    std::to_string(m.vocab));
      eos = bpe->endOfText();
    } else if (m.family == "gpt" && m.vocab > 50256) {
      eos = 50256; // GPT-2's <|endoftext|>
    }

    json config = configOf(m, eos);
    // Everything goes to a sibling directory first, renamed at the end.
    fs::path parent = dir.parent_path().empty() ? fs::path(".")
                                                : dir.parent_path();
    fs::create_directories(parent);
    fs::path staging =
        parent / (dir.filename().string() + ".tmp." + std::to_string(getpid()));
    fs::remove_all(staging, ec);
    fs::create_directory(staging);
    try {
      writeText(staging / "config.json", config.dump(2) + "\n");
      json generation = {{"do_sample", false}, {"max_length", m.seqLen}};
      setEndOfText(generation, eos);
      writeText(staging / "generation_config.json",
                generation.dump(2) + "\n");
      rt::SafetensorsWriter writer((staging / "model.safetensors").string(),
                                   views, {{"format", "pt"}});
      size_t loaded = SIZE_MAX;
      std::vector<float> tensor;
      for (auto [k, offset] : from) {
        if (k != loaded) {
          tensor = load(k);
          loaded = k;
        }
        writer.write(tensor.data() + offset);
      }
      writer.commit();
      if (tokenizer) {
        fs::copy_file(values["--vocab-json"], staging / "vocab.json");
        fs::copy_file(values["--merges"], staging / "merges.txt");
        json config = {{"tokenizer_class", "GPT2Tokenizer"},
                       {"model_max_length", m.seqLen},
                       {"bos_token", "<|endoftext|>"},
                       {"eos_token", "<|endoftext|>"},
                       {"unk_token", "<|endoftext|>"},
                       {"add_prefix_space", false}};
        writeText(staging / "tokenizer_config.json", config.dump(2) + "\n");
      }
      if (fs::exists(dir, ec))
        fs::remove_all(dir);
      fs::rename(staging, dir);
    } catch (...) {
      fs::remove_all(staging, ec);
      throw;
    }
    int64_t elements = 0;
    for (const rt::SafetensorView &v : views) {
      int64_t n = 1;
      for (int64_t d : v.shape)
        n *= d;
      elements += n;
    }
    outs() << "exported the " << m.family << " model of " << modelWhere
           << " (" << views.size() << " tensors, " << elements
           << " parameters) to " << dir.string() << " for Hugging Face ("
           << config["architectures"][0].get<std::string>()
           << (tokenizer ? ", with the GPT-2 tokenizer" : "") << ")\n";
  } catch (const std::exception &e) {
    return fail(e.what());
  }
  return 0;
}
