#!/usr/bin/env python3
"""The mean loss of a Hugging Face model directory on a token file, from the
exported files alone: the model is built from config.json's GPT2Config or
LlamaConfig fields and loaded from model.safetensors' Hugging Face names,
then run by the independent PyTorch reference (torch_reference.py), or by
transformers itself.

    hf_reference.py DIR TOKENS.bin --batch B --batches K [--transformers]

Batch k, row i is sample k*B + i of the file: inputs tokens[j*T : j*T+T],
targets shifted by one, with T the config's context length. Prints
"loss X" (the mean over the K batches of each batch's mean loss).
"""
import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402
import torch_reference as ref  # noqa: E402


def model_config(cfg):
    """torch_reference's model fields from a transformers config.json."""
    if cfg["model_type"] == "gpt2":
        assert cfg["activation_function"] == "gelu_new", cfg["activation_function"]
        return {"family": "gpt", "vocab_size": cfg["vocab_size"],
                "seq_len": cfg["n_positions"], "layers": cfg["n_layer"],
                "hidden": cfg["n_embd"], "heads": cfg["n_head"],
                "kv_heads": cfg["n_head"],
                "ffn_hidden": cfg.get("n_inner") or 4 * cfg["n_embd"],
                "tie_embeddings": cfg.get("tie_word_embeddings", True),
                "norm_eps": cfg["layer_norm_epsilon"], "rope_theta": 10000.0}
    assert cfg["model_type"] in ("llama", "mixtral"), cfg["model_type"]
    assert cfg["hidden_act"] == "silu", cfg["hidden_act"]
    assert cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]) \
        == cfg["hidden_size"] // cfg["num_attention_heads"]
    m = {"family": "llama", "vocab_size": cfg["vocab_size"],
         "seq_len": cfg["max_position_embeddings"],
         "layers": cfg["num_hidden_layers"], "hidden": cfg["hidden_size"],
         "heads": cfg["num_attention_heads"],
         "kv_heads": cfg["num_key_value_heads"],
         "ffn_hidden": cfg["intermediate_size"],
         "tie_embeddings": cfg.get("tie_word_embeddings", False),
         "norm_eps": cfg["rms_norm_eps"], "rope_theta": cfg["rope_theta"],
         "moe": None}
    if cfg["model_type"] == "mixtral":
        # Every layer routed to num_experts_per_tok of num_local_experts
        # SwiGLU experts of width intermediate_size, nothing dropped.
        m["moe"] = ref.load_moe({"experts": cfg["num_local_experts"],
                                 "top_k": cfg["num_experts_per_tok"]},
                                cfg["intermediate_size"])
    return m


def hf_tensors(directory, mcfg):
    """(path, name -> array) of DIR/model.safetensors in torch_reference's
    names: GPT2LMHeadModel's "transformer." prefix dropped, and Mixtral's
    experts (experts.E.w1.weight, one per expert) stacked as the reference
    holds them (experts.w1 [experts, out, in])."""
    weights = os.path.join(directory, "model.safetensors")
    tensors = {k[len("transformer."):] if k.startswith("transformer.") else k: v
               for k, v in safetensors_io.load_file(weights).items()}
    if mcfg.get("moe"):
        stacked = {}
        for name in list(tensors):
            parts = name.split(".")
            if "experts" in parts and parts[-1] == "weight":
                at = parts.index("experts")
                key = ".".join(parts[:at + 1] + [parts[at + 2]])
                stacked.setdefault(key, {})[int(parts[at + 1])] = tensors.pop(name)
        for key, experts in stacked.items():
            tensors[key] = np.stack([experts[e] for e in range(len(experts))])
    return weights, tensors


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("tokens")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--batches", type=int, required=True)
    p.add_argument("--transformers", action="store_true")
    args = p.parse_args()
    cfg = json.load(open(os.path.join(args.dir, "config.json")))
    mcfg = model_config(cfg)
    if args.transformers:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(args.dir).eval()
        forward = lambda ids: model(ids).logits  # noqa: E731
    else:
        model = ref.build_model(mcfg)
        weights, tensors = hf_tensors(args.dir, mcfg)
        ref.load_tensors(model, tensors, weights)
        model.eval()
        forward = model
    data = ref.load_tokens(args.tokens)
    losses = []
    with torch.no_grad():
        for k in range(args.batches):
            ids, targets = ref.get_batch(data, k, args.batch, mcfg["seq_len"])
            logits = forward(ids)
            losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                          targets.reshape(-1)).item())
    print("loss %.9g" % (sum(losses) / len(losses)))


if __name__ == "__main__":
    main()
