#!/usr/bin/env python3
"""The mean loss of a Hugging Face model directory on a token file, from the
exported files alone: config.json (GPT2Config or LlamaConfig fields) and
model.safetensors (Hugging Face names and layouts), by a PyTorch forward
written here from those models' definitions, or by transformers itself.

    hf_reference.py DIR TOKENS.bin --batch B --batches K [--transformers]

Batch k, row i is sample k*B + i of the file: inputs tokens[j*T : j*T+T],
targets shifted by one, with T the config's context length. Prints
"loss X" (the mean over the K batches of each batch's mean loss).
"""
import argparse
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402


def load_tokens(path):
    header = np.fromfile(path, dtype=np.int32, count=256)
    width = 2 if header[0] == 20240520 else 4
    data = np.fromfile(path, dtype=np.uint16 if width == 2 else np.uint32,
                       offset=1024)
    return data[: header[2]].astype(np.int64)


def layer_norm(x, w, b, eps):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def gpt2_logits(cfg, t, ids):
    p = "transformer."
    h, nh = cfg["n_embd"], cfg["n_head"]
    eps = cfg["layer_norm_epsilon"]
    B, T = ids.shape
    x = t[p + "wte.weight"][ids] + t[p + "wpe.weight"][:T]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for l in range(cfg["n_layer"]):
        q = f"{p}h.{l}."
        a = layer_norm(x, t[q + "ln_1.weight"], t[q + "ln_1.bias"], eps)
        # Conv1D: y = x W + b with W [in, out].
        qkv = a @ t[q + "attn.c_attn.weight"] + t[q + "attn.c_attn.bias"]
        qs, ks, vs = qkv.split(h, dim=-1)
        heads = lambda z: z.view(B, T, nh, h // nh).transpose(1, 2)
        s = heads(qs) @ heads(ks).transpose(-1, -2) / math.sqrt(h // nh)
        s = s.masked_fill(~mask, float("-inf")).softmax(-1)
        o = (s @ heads(vs)).transpose(1, 2).reshape(B, T, h)
        x = x + o @ t[q + "attn.c_proj.weight"] + t[q + "attn.c_proj.bias"]
        a = layer_norm(x, t[q + "ln_2.weight"], t[q + "ln_2.bias"], eps)
        assert cfg["activation_function"] == "gelu_new"
        m = F.gelu(a @ t[q + "mlp.c_fc.weight"] + t[q + "mlp.c_fc.bias"],
                   approximate="tanh")
        x = x + m @ t[q + "mlp.c_proj.weight"] + t[q + "mlp.c_proj.bias"]
    x = layer_norm(x, t[p + "ln_f.weight"], t[p + "ln_f.bias"], eps)
    head = (t[p + "wte.weight"] if cfg.get("tie_word_embeddings", True)
            else t["lm_head.weight"])
    return x @ head.T


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def llama_logits(cfg, t, ids):
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    nkv = cfg["num_key_value_heads"]
    d = cfg.get("head_dim", h // nh)
    eps = cfg["rms_norm_eps"]
    B, T = ids.shape
    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.outer(torch.arange(T, dtype=torch.float64), inv)
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().float(), ang.sin().float()

    def rope(z):  # rotate-half convention
        half = torch.cat([-z[..., d // 2:], z[..., : d // 2]], -1)
        return z * cos + half * sin

    mask = torch.ones(T, T, dtype=torch.bool).tril()
    x = t["model.embed_tokens.weight"][ids]
    for l in range(cfg["num_hidden_layers"]):
        q = f"model.layers.{l}."
        a = rms_norm(x, t[q + "input_layernorm.weight"], eps)
        # Linear: y = x W^T with W [out, in].
        qs = (a @ t[q + "self_attn.q_proj.weight"].T).view(B, T, nh, d).transpose(1, 2)
        ks = (a @ t[q + "self_attn.k_proj.weight"].T).view(B, T, nkv, d).transpose(1, 2)
        vs = (a @ t[q + "self_attn.v_proj.weight"].T).view(B, T, nkv, d).transpose(1, 2)
        qs, ks = rope(qs), rope(ks)
        ks = ks.repeat_interleave(nh // nkv, dim=1)
        vs = vs.repeat_interleave(nh // nkv, dim=1)
        s = qs @ ks.transpose(-1, -2) / math.sqrt(d)
        s = s.masked_fill(~mask, float("-inf")).softmax(-1)
        o = (s @ vs).transpose(1, 2).reshape(B, T, nh * d)
        x = x + o @ t[q + "self_attn.o_proj.weight"].T
        a = rms_norm(x, t[q + "post_attention_layernorm.weight"], eps)
        assert cfg["hidden_act"] == "silu"
        g = F.silu(a @ t[q + "mlp.gate_proj.weight"].T) * (a @ t[q + "mlp.up_proj.weight"].T)
        x = x + g @ t[q + "mlp.down_proj.weight"].T
    x = rms_norm(x, t["model.norm.weight"], eps)
    head = (t["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings")
            else t["lm_head.weight"])
    return x @ head.T


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("tokens")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--batches", type=int, required=True)
    p.add_argument("--transformers", action="store_true")
    args = p.parse_args()
    cfg = json.load(open(os.path.join(args.dir, "config.json")))
    T = cfg.get("n_positions", cfg.get("max_position_embeddings"))
    data = load_tokens(args.tokens)
    n = (len(data) - 1) // T
    if args.transformers:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(args.dir).eval()
    else:
        tensors = {k: torch.from_numpy(np.ascontiguousarray(v)).float()
                   for k, v in safetensors_io.load_file(
                       os.path.join(args.dir, "model.safetensors")).items()}
        forward = {"gpt2": gpt2_logits, "llama": llama_logits}[cfg["model_type"]]
    losses = []
    with torch.no_grad():
        for k in range(args.batches):
            rows = [(k * args.batch + i) % n for i in range(args.batch)]
            ids = torch.tensor(np.stack([data[j * T: j * T + T] for j in rows]))
            targets = torch.tensor(np.stack([data[j * T + 1: j * T + T + 1] for j in rows]))
            logits = (model(ids).logits if args.transformers
                      else forward(cfg, tensors, ids))
            losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                          targets.reshape(-1)).item())
    print("loss %.9g" % (sum(losses) / len(losses)))


if __name__ == "__main__":
    main()
