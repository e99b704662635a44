#!/usr/bin/env python3
"""Independent plain-PyTorch reference trainer for Tessel end-to-end checks.

Builds a Hugging Face GPT-2 or Llama model (same semantics and tensor names as the
`transformers` implementations, without depending on that package), loads weights
from a safetensors file, trains on an llm.c token file with AdamW, and writes the
per-step losses, learning rates and gradient norms.

With `model.moe` in the spec, every `moe.every`-th block (layer 0 first) has a
routed mixture-of-experts MLP instead of its dense one (top-k routing, optional
expert capacity and shared experts, load-balancing and router z-losses; see
MoE below), the step's batch is split into `parallel.microbatches` and the JSON
also holds the loss's parts (lm_losses, aux_losses, z_losses) and the number of
dropped assignments per step.

Usage:
  python3 test/e2e/torch_reference.py --spec SPEC.json --write-init init.safetensors [--seed S]
  python3 test/e2e/torch_reference.py --spec SPEC.json --init-from init.safetensors \
      --data tokens.bin --out losses.json [--steps N] [--save-final final.safetensors] \
      [--threads N] [--dtype float32|float64] [--bench]
"""

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402


# --------------------------------------------------------------------------- spec

def load_spec(spec):
    """Accepts a path or a dict; returns (model_cfg, train_cfg) with defaults filled."""
    if not isinstance(spec, dict):
        with open(spec) as f:
            spec = json.load(f)
    m = dict(spec.get("model", {}))
    m.setdefault("family", "gpt")
    fam = m["family"].lower()
    if fam in ("gpt2", "gpt-2"):
        fam = "gpt"
    if fam not in ("gpt", "llama"):
        raise ValueError("unknown model family %r" % m["family"])
    m["family"] = fam
    m.setdefault("vocab_size", 256)
    m.setdefault("seq_len", 64)
    m.setdefault("layers", 2)
    m.setdefault("hidden", 64)
    m.setdefault("heads", 4)
    m.setdefault("kv_heads", m["heads"])
    m.setdefault("ffn_hidden", 4 * m["hidden"])
    # Dropout (PyTorch's own masks: a run with it matches Tessel's only in
    # distribution; the equality tests train without).
    m.setdefault("dropout", 0.0)
    m.setdefault("attention_dropout", 0.0)
    m.setdefault("tie_embeddings", fam == "gpt")
    m.setdefault("norm_eps", 1e-5)
    m.setdefault("rope_theta", 10000.0)
    # The token table's rows (model.vocab_pad_to_multiple); the loss reads
    # the first vocab_size logits only.
    pad = int(m.get("vocab_pad_to_multiple", 1))
    m["padded_vocab"] = (m["vocab_size"] + pad - 1) // pad * pad
    if m["hidden"] % m["heads"] != 0:
        raise ValueError("hidden must be divisible by heads")
    if m["heads"] % m["kv_heads"] != 0:
        raise ValueError("heads must be divisible by kv_heads")
    m["moe"] = load_moe(m.get("moe"), m["ffn_hidden"])

    t = dict(spec.get("train", {}))
    t.setdefault("global_batch", 8)
    t.setdefault("steps", 100)
    t.setdefault("seed", 1234)
    t.setdefault("grad_clip", 1.0)
    opt = {"name": "adamw", "lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
           "weight_decay": 0.1}
    opt.update(t.get("optimizer", {}) or {})
    sched = {"warmup_steps": 0, "decay": "cosine", "min_lr": 0.0}
    sched.update(t.get("lr_schedule", {}) or {})
    t["optimizer"] = opt
    t["lr_schedule"] = sched
    # Gradient accumulation (parallel.microbatches); only an MoE model's
    # training depends on it (its routing statistics are per microbatch).
    t["microbatches"] = int((spec.get("parallel") or {}).get("microbatches") or 1)
    return m, t


def load_moe(moe, ffn_hidden):
    """model.moe with defaults filled, or None for a dense model."""
    if moe is None:
        return None
    moe = dict(moe)
    for key in ("experts", "top_k"):
        if key not in moe:
            raise ValueError("model.moe needs %r" % key)
    defaults = {"every": 1, "ffn_hidden": ffn_hidden, "shared_experts": 0,
                "aux_loss_coef": 0.01, "z_loss_coef": 0.001}
    for key, value in defaults.items():
        if moe.get(key) is None:
            moe[key] = value
    for key in ("experts", "top_k", "every", "ffn_hidden", "shared_experts"):
        moe[key] = int(moe[key])
    moe["aux_loss_coef"] = float(moe["aux_loss_coef"])
    moe["z_loss_coef"] = float(moe["z_loss_coef"])
    # null: no capacity, nothing is dropped.
    cf = moe.get("capacity_factor")
    moe["capacity_factor"] = None if cf is None else float(cf)
    if moe["experts"] < 1 or not 1 <= moe["top_k"] <= moe["experts"]:
        raise ValueError("model.moe needs 1 <= top_k <= experts")
    if moe["every"] < 1 or moe["ffn_hidden"] < 1 or moe["shared_experts"] < 0:
        raise ValueError("model.moe: every and ffn_hidden must be positive, "
                         "shared_experts not negative")
    if moe["capacity_factor"] is not None and moe["capacity_factor"] <= 0:
        raise ValueError("model.moe.capacity_factor must be positive (or null)")
    return moe


# --------------------------------------------------------------------------- mixture of experts
#
# A routed MLP over the N = B*T rows of its input h ([B, T, C], token n = b*T + t):
#   logits = h Wr^T ([N, E]), probs = softmax(logits);
#   each token's k largest probabilities, in descending order with the lower expert
#   first on a tie, renormalised to sum to 1, are its weights, their experts its
#   assignments (n, s), s < k;
#   with a capacity factor cf, expert e keeps only its first ceil(cf * N * k / E)
#   assignments in (token, slot) order; a dropped one adds nothing (the kept
#   weights are not renormalised);
#   y[n] = sum over n's kept assignments, s ascending, of weights[n, s] * expert(h[n]),
#   plus the shared experts' dense MLP of h[n] when there are any.
# Its losses over those N tokens (added to the cross-entropy):
#   aux = aux_loss_coef * E * sum_e f_e P_e, f_e = assignments to e before drops / (N k)
#         (held fixed), P_e = mean over tokens of probs[:, e];
#   z = z_loss_coef * mean over tokens of logsumexp(logits[n])^2.

def is_moe_layer(cfg, layer):
    moe = cfg.get("moe")
    return moe is not None and layer % moe["every"] == 0


def moe_capacity(moe, tokens):
    """Assignments each expert keeps out of `tokens` routed rows; None keeps all."""
    cf = moe["capacity_factor"]
    if cf is None:
        return None
    return int(math.ceil(cf * tokens * moe["top_k"] / moe["experts"]))


def moe_route(logits, k, capacity):
    """Top-k routing of router logits [N, E].

    Returns probs [N, E], weights [N, k] (differentiable), experts [N, k] (int64),
    keep [N, k] (bool: within the expert's capacity) and counts [E] (assignments
    per expert before any is dropped)."""
    N, E = logits.shape
    probs = torch.softmax(logits, dim=-1)
    # A stable ascending sort of -probs keeps equal probabilities in expert
    # order, so a tie goes to the lower expert (torch.topk does not promise it).
    experts = torch.sort(-probs.detach(), dim=-1, stable=True).indices[:, :k]
    chosen = probs.gather(1, experts)
    weights = chosen / chosen.sum(dim=-1, keepdim=True)
    onehot = F.one_hot(experts.reshape(-1), E)  # assignment a = n * k + s
    counts = onehot.sum(0)
    if capacity is None:
        keep = torch.ones(N, k, dtype=torch.bool, device=logits.device)
    else:
        # Each assignment's place among its expert's, in (token, slot) order.
        place = (onehot.cumsum(0) * onehot).sum(-1) - 1
        keep = (place < capacity).view(N, k)
    return probs, weights, experts, keep, counts


class MoE(nn.Module):
    """The routed layer; the family's subclass sets `experts` (called as
    experts(x, e) for the rows x sent to expert e) and `shared_experts` (a dense
    MLP, or None). After each forward, aux_loss and z_loss hold this layer's
    losses (tensors) and dropped its number of dropped assignments."""

    def __init__(self, cfg):
        super().__init__()
        self.moe = cfg["moe"]
        self.gate = nn.Linear(cfg["hidden"], self.moe["experts"], bias=False)
        self.aux_loss = self.z_loss = None
        self.dropped = 0

    def forward(self, h):
        E, k = self.moe["experts"], self.moe["top_k"]
        C = h.shape[-1]
        x = h.reshape(-1, C)
        N = x.shape[0]
        logits = self.gate(x)
        probs, weights, experts, keep, counts = moe_route(logits, k,
                                                          moe_capacity(self.moe, N))
        # Each expert's kept assignments, through the expert, into an
        # assignment-major buffer [N * k, C] (zero rows where dropped).
        flat_experts, flat_keep = experts.reshape(-1), keep.reshape(-1)
        rows, outs = [], []
        for e in range(E):
            a = torch.nonzero((flat_experts == e) & flat_keep).squeeze(1)
            if a.numel() > 0:
                rows.append(a)
                outs.append(self.experts(x[a // k], e))
        ys = x.new_zeros(N * k, C)
        if rows:
            ys = ys.index_copy(0, torch.cat(rows), torch.cat(outs))
        ys = ys.view(N, k, C) * weights.unsqueeze(-1)
        y = ys[:, 0]
        for s in range(1, k):
            y = y + ys[:, s]
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        # Losses: the assignment counts are constants (no gradient).
        f = counts.to(probs.dtype) / (N * k)
        self.aux_loss = self.moe["aux_loss_coef"] * E * (f * probs.mean(0)).sum()
        self.z_loss = self.moe["z_loss_coef"] * torch.logsumexp(logits, dim=-1).pow(2).mean()
        self.dropped = int((~keep).sum().item())
        return y.view(h.shape)


class GPTExperts(nn.Module):
    """E GPT-2 MLPs without biases: gelu_tanh(x @ c_fc[e]) @ c_proj[e]."""

    def __init__(self, E, C, Fh):
        super().__init__()
        self.c_fc = nn.Parameter(torch.randn(E, C, Fh) * 0.02)
        self.c_proj = nn.Parameter(torch.randn(E, Fh, C) * 0.02)

    def forward(self, x, e):
        return torch.matmul(F.gelu(torch.matmul(x, self.c_fc[e]), approximate="tanh"),
                            self.c_proj[e])


class GPTMoE(MoE):
    """h.{l}.mlp of a GPT MoE layer: gate, experts, shared_experts (c_fc, c_proj)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        E, Fh, S = self.moe["experts"], self.moe["ffn_hidden"], self.moe["shared_experts"]
        self.experts = GPTExperts(E, cfg["hidden"], Fh)
        self.shared_experts = GPTMLP(dict(cfg, ffn_hidden=S * Fh)) if S > 0 else None


class LlamaExperts(nn.Module):
    """E SwiGLU MLPs (Mixtral's layout): (silu(x w1[e]^T) * (x w3[e]^T)) w2[e]^T."""

    def __init__(self, E, C, Fh):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, Fh, C) * 0.02)
        self.w2 = nn.Parameter(torch.randn(E, C, Fh) * 0.02)
        self.w3 = nn.Parameter(torch.randn(E, Fh, C) * 0.02)

    def forward(self, x, e):
        return F.linear(F.silu(F.linear(x, self.w1[e])) * F.linear(x, self.w3[e]), self.w2[e])


class LlamaMoE(MoE):
    """model.layers.{l}.block_sparse_moe: gate, experts (w1, w2, w3), shared_experts."""

    def __init__(self, cfg):
        super().__init__(cfg)
        E, Fh, S = self.moe["experts"], self.moe["ffn_hidden"], self.moe["shared_experts"]
        self.experts = LlamaExperts(E, cfg["hidden"], Fh)
        self.shared_experts = LlamaMLP(dict(cfg, ffn_hidden=S * Fh)) if S > 0 else None


def moe_layers(model):
    """The model's MoE layers, first layer first."""
    return [m for m in model.modules() if isinstance(m, MoE)]


# --------------------------------------------------------------------------- GPT-2

class Conv1D(nn.Module):
    """HF GPT-2 Conv1D: y = x @ W + b with W of shape [in, out]."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(
            *x.shape[:-1], self.weight.shape[1])


def causal_attention(q, k, v, dropout=0.0):
    """q, k, v: [B, H, T, D] -> [B, H, T, D]; softmax(q k^T / sqrt(D) + causal mask) v."""
    T, D = q.shape[-2], q.shape[-1]
    att = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(D))
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    att = att.masked_fill(~mask, float("-inf"))
    att = torch.softmax(att, dim=-1)
    if dropout > 0:
        att = F.dropout(att, dropout)
    return torch.matmul(att, v)


def drop(x, p, training):
    """Dropout on a residual branch (only when the spec asks for it)."""
    return F.dropout(x, p) if p > 0 and training else x


class GPTAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C = cfg["hidden"]
        self.n_head = cfg["heads"]
        self.p = cfg.get("attention_dropout", 0.0)
        self.c_attn = Conv1D(C, 3 * C)
        self.c_proj = Conv1D(C, C)

    def forward(self, x):
        B, T, C = x.shape
        H = self.n_head
        D = C // H
        q, k, v = self.c_attn(x).split(C, dim=-1)
        q = q.view(B, T, H, D).transpose(1, 2)
        k = k.view(B, T, H, D).transpose(1, 2)
        v = v.view(B, T, H, D).transpose(1, 2)
        y = causal_attention(q, k, v, self.p if self.training else 0.0).transpose(1, 2).reshape(B, T, C)
        return self.c_proj(y)


class GPTMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = Conv1D(cfg["hidden"], cfg["ffn_hidden"])
        self.c_proj = Conv1D(cfg["ffn_hidden"], cfg["hidden"])

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPTBlock(nn.Module):
    def __init__(self, cfg, layer=0):
        super().__init__()
        C, eps = cfg["hidden"], cfg["norm_eps"]
        self.ln_1 = nn.LayerNorm(C, eps=eps)
        self.attn = GPTAttention(cfg)
        self.ln_2 = nn.LayerNorm(C, eps=eps)
        self.mlp = GPTMoE(cfg) if is_moe_layer(cfg, layer) else GPTMLP(cfg)
        self.p = cfg.get("dropout", 0.0)

    def forward(self, x):
        x = x + drop(self.attn(self.ln_1(x)), self.p, self.training)
        x = x + drop(self.mlp(self.ln_2(x)), self.p, self.training)
        return x


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        V, T, C = cfg.get("padded_vocab", cfg["vocab_size"]), cfg["seq_len"], cfg["hidden"]
        self.wte = nn.Embedding(V, C)
        self.wpe = nn.Embedding(T, C)
        self.h = nn.ModuleList([GPTBlock(cfg, l) for l in range(cfg["layers"])])
        self.ln_f = nn.LayerNorm(C, eps=cfg["norm_eps"])
        if not cfg["tie_embeddings"]:
            self.lm_head = nn.Linear(C, V, bias=False)

    def forward(self, idx):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = drop(self.wte(idx) + self.wpe(pos)[None], self.cfg.get("dropout", 0.0),
                 self.training)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        head = self.wte.weight if self.cfg["tie_embeddings"] else self.lm_head.weight
        return torch.matmul(x, head.t())

    def hf_init_(self, gen):
        std = 0.02
        proj_std = 0.02 / math.sqrt(2 * self.cfg["layers"])
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                # Every projection back to the residual stream (an MoE layer's
                # experts.c_proj and shared_experts.c_proj.weight too).
                s = proj_std if name.endswith(("c_proj.weight", "experts.c_proj")) else std
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * s)
            elif ("ln_" in name) and name.endswith(".weight"):
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)


# --------------------------------------------------------------------------- Llama

class RMSNorm(nn.Module):
    def __init__(self, C, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(C))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_cos_sin(T, D, theta, dtype):
    """HF Llama rotary tables [T, D]: angle[p, j] = p * theta^(-2 (j mod D/2) / D).
    Computed in float64 and rounded once to `dtype`."""
    inv_freq = 1.0 / (float(theta) ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    freqs = torch.outer(torch.arange(T, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x, cos, sin):
    """x: [B, H, T, D]; cos/sin: [T, D]."""
    return x * cos + rotate_half(x) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C, H, Hkv = cfg["hidden"], cfg["heads"], cfg["kv_heads"]
        D = C // H
        self.H, self.Hkv, self.D = H, Hkv, D
        self.p = cfg.get("attention_dropout", 0.0)
        self.p_hidden = cfg.get("dropout", 0.0)
        self.q_proj = nn.Linear(C, H * D, bias=False)
        self.k_proj = nn.Linear(C, Hkv * D, bias=False)
        self.v_proj = nn.Linear(C, Hkv * D, bias=False)
        self.o_proj = nn.Linear(H * D, C, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        H, Hkv, D = self.H, self.Hkv, self.D
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)
        k = self.k_proj(x).view(B, T, Hkv, D).transpose(1, 2)
        v = self.v_proj(x).view(B, T, Hkv, D).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        if Hkv != H:  # query head h uses kv head h // (H / Hkv)
            k = k.repeat_interleave(H // Hkv, dim=1)
            v = v.repeat_interleave(H // Hkv, dim=1)
        y = causal_attention(q, k, v, self.p if self.training else 0.0).transpose(1, 2).reshape(B, T, H * D)
        return self.o_proj(y)


class LlamaMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C, Fh = cfg["hidden"], cfg["ffn_hidden"]
        self.gate_proj = nn.Linear(C, Fh, bias=False)
        self.up_proj = nn.Linear(C, Fh, bias=False)
        self.down_proj = nn.Linear(Fh, C, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nn.Module):
    def __init__(self, cfg, layer=0):
        super().__init__()
        C, eps = cfg["hidden"], cfg["norm_eps"]
        self.input_layernorm = RMSNorm(C, eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(C, eps)
        # An MoE layer has block_sparse_moe (Mixtral's name) and no mlp.
        if is_moe_layer(cfg, layer):
            self.block_sparse_moe = LlamaMoE(cfg)
        else:
            self.mlp = LlamaMLP(cfg)

    def forward(self, x, cos, sin):
        p = self.self_attn.p_hidden
        x = x + drop(self.self_attn(self.input_layernorm(x), cos, sin), p,
                     self.training)
        ffn = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        x = x + drop(ffn(self.post_attention_layernorm(x)), p, self.training)
        return x


class LlamaBody(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.get("padded_vocab", cfg["vocab_size"]), cfg["hidden"])
        self.layers = nn.ModuleList([LlamaLayer(cfg, l) for l in range(cfg["layers"])])
        self.norm = RMSNorm(cfg["hidden"], cfg["norm_eps"])


class Llama(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaBody(cfg)
        if not cfg["tie_embeddings"]:
            self.lm_head = nn.Linear(cfg["hidden"], cfg.get("padded_vocab", cfg["vocab_size"]), bias=False)

    def forward(self, idx):
        B, T = idx.shape
        D = self.cfg["hidden"] // self.cfg["heads"]
        x = drop(self.model.embed_tokens(idx), self.cfg.get("dropout", 0.0),
                 self.training)
        cos, sin = rope_cos_sin(T, D, self.cfg["rope_theta"], x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.model.norm(x)
        head = (self.model.embed_tokens.weight if self.cfg["tie_embeddings"]
                else self.lm_head.weight)
        return torch.matmul(x, head.t())

    def hf_init_(self, gen):
        for name, p in self.named_parameters():
            with torch.no_grad():
                if p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.02)
                else:
                    p.fill_(1.0)


def build_model(mcfg):
    return GPT(mcfg) if mcfg["family"] == "gpt" else Llama(mcfg)


def state_tensors(model):
    """name -> parameter, in the Hugging Face naming (tied heads are not duplicated)."""
    return dict(model.named_parameters())


def load_weights(model, path):
    load_tensors(model, safetensors_io.load_file(path), path)


def load_tensors(model, tensors, path):
    """Copies name -> array into the model's parameters; every parameter and
    nothing else, each of its shape, or a ValueError naming `path`."""
    params = state_tensors(model)
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise ValueError("%s: missing tensors %s, unexpected tensors %s"
                         % (path, missing, unexpected))
    with torch.no_grad():
        for name, p in params.items():
            a = tensors[name]
            if tuple(a.shape) != tuple(p.shape):
                raise ValueError("%s: shape %s, expected %s"
                                 % (name, tuple(a.shape), tuple(p.shape)))
            p.copy_(torch.from_numpy(np.asarray(a)).to(p.dtype))


def save_weights(model, path):
    safetensors_io.save_file(
        {n: p.detach().to(torch.float32).cpu().numpy() for n, p in state_tensors(model).items()},
        path, metadata={"format": "pt"})


# --------------------------------------------------------------------------- data

def load_tokens(path):
    """llm.c token file -> int64 numpy array."""
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(256 * 4), dtype="<i4")
        magic, version, n = int(header[0]), int(header[1]), int(header[2])
        if magic == 20240520 and version == 1:
            dt = np.dtype("<u2")
        elif magic == 20240801 and version == 7:
            dt = np.dtype("<u4")
        else:
            raise ValueError("%s: unknown llm.c header magic=%d version=%d"
                             % (path, magic, version))
        data = np.frombuffer(f.read(n * dt.itemsize), dtype=dt)
    if data.size != n:
        raise ValueError("%s: header says %d tokens, file has %d" % (path, n, data.size))
    return data.astype(np.int64)


def write_tokens(path, tokens, uint32=False):
    """Writes an llm.c token file (helper for tests)."""
    tokens = np.asarray(tokens)
    header = np.zeros(256, dtype="<i4")
    header[0], header[1] = (20240801, 7) if uint32 else (20240520, 1)
    header[2] = tokens.size
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u4" if uint32 else "<u2").tobytes())


def get_batch(tokens, step, B, T):
    n_samples = (tokens.size - 1) // T
    if n_samples < 1:
        raise ValueError("token file too short for seq_len %d" % T)
    xs, ys = [], []
    for i in range(B):
        j = (step * B + i) % n_samples
        xs.append(tokens[j * T: j * T + T])
        ys.append(tokens[j * T + 1: j * T + T + 1])
    return torch.from_numpy(np.stack(xs)), torch.from_numpy(np.stack(ys))


# --------------------------------------------------------------------------- training

def lr_at(step, total, tcfg):
    opt, sched = tcfg["optimizer"], tcfg["lr_schedule"]
    lr, min_lr = float(opt["lr"]), float(sched["min_lr"])
    warmup = int(sched["warmup_steps"])
    if step < warmup:
        return lr * (step + 1) / warmup
    decay = str(sched["decay"]).lower()
    decay_steps = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    if decay == "cosine":
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)
    if decay == "linear":
        return lr + (min_lr - lr) * progress
    if decay in ("constant", "none"):
        return lr
    raise ValueError("unknown lr decay %r" % sched["decay"])


def make_optimizer(model, tcfg):
    opt = tcfg["optimizer"]
    if str(opt["name"]).lower() != "adamw":
        raise ValueError("only adamw is supported, got %r" % opt["name"])
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": float(opt["weight_decay"])},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=float(opt["lr"]), betas=tuple(opt["betas"]),
                             eps=float(opt["eps"]), weight_decay=float(opt["weight_decay"]),
                             foreach=False)


def total_grad_norm(params):
    grads = [p.grad.detach() for p in params if p.grad is not None]
    return torch.norm(torch.stack([torch.norm(g, 2.0) for g in grads]), 2.0)


def train(model, tokens, mcfg, tcfg, steps, bench=False, log=None, skip_nonfinite=False):
    """Runs `steps` steps; returns dict(losses, lr, grad_norm[, step_ms, tokens_per_s]),
    for an MoE model also lm_losses, aux_losses, z_losses and dropped.

    With skip_nonfinite, a step whose gradient norm is not finite is skipped as
    PyTorch's GradScaler skips one: optimizer.step() is not called (AdamW's step
    count stays) and the learning-rate schedule does not advance (it follows the
    updates applied, as Megatron-LM's scheduler does).

    An MoE model's step runs tcfg["microbatches"] consecutive slices of the batch:
    each one's loss is its cross-entropy (mean over its tokens) plus its MoE
    layers' aux and z losses (routing statistics and capacity over its tokens),
    and the step's loss and gradient are those of their mean. A dense model's
    step is the whole batch at once (the same mean)."""
    B, T = int(tcfg["global_batch"]), int(mcfg["seq_len"])
    params = list(model.parameters())
    optimizer = make_optimizer(model, tcfg)
    clip = float(tcfg["grad_clip"] or 0.0)
    moes = moe_layers(model)
    M = int(tcfg.get("microbatches", 1)) if moes else 1
    if M < 1 or B % M != 0:
        raise ValueError("parallel.microbatches = %d does not divide train.global_batch = %d"
                         % (M, B))
    b = B // M
    out = {"losses": [], "lr": [], "grad_norm": []}
    if moes:
        out.update({"lm_losses": [], "aux_losses": [], "z_losses": [], "dropped": []})
    times = []
    updates = 0
    model.train()
    for s in range(steps):
        t0 = time.perf_counter()
        x, y = get_batch(tokens, s, B, T)
        optimizer.zero_grad(set_to_none=True)
        parts = []  # per microbatch: (loss, lm, aux, z, dropped)
        for i in range(M):
            logits = model(x[i * b:(i + 1) * b])[..., :mcfg["vocab_size"]]
            lm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                 y[i * b:(i + 1) * b].reshape(-1))
            loss = lm
            if moes:
                aux, z = moes[0].aux_loss, moes[0].z_loss
                for m in moes[1:]:
                    aux, z = aux + m.aux_loss, z + m.z_loss
                loss = lm + aux + z
                parts.append((loss.detach(), lm.detach(), aux.detach(), z.detach(),
                              sum(m.dropped for m in moes)))
            (loss / M if M > 1 else loss).backward()
        if moes:
            loss, lm, aux, z = (sum(p[j] for p in parts) / M for j in range(4))
            out["lm_losses"].append(float(lm.item()))
            out["aux_losses"].append(float(aux.item()))
            out["z_losses"].append(float(z.item()))
            out["dropped"].append(int(sum(p[4] for p in parts)))
        if clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
        else:
            norm = total_grad_norm(params)
        lr = lr_at(updates if skip_nonfinite else s, steps, tcfg)
        for g in optimizer.param_groups:
            g["lr"] = lr
        if skip_nonfinite and not torch.isfinite(norm):
            pass  # skipped: no update
        else:
            optimizer.step()
            updates += 1
        times.append(time.perf_counter() - t0)
        out["losses"].append(float(loss.item()))
        out["lr"].append(float(lr))
        out["grad_norm"].append(float(norm.item()))
        if log is not None:
            log("step %d loss %.6f lr %.3e grad_norm %.4f" % (s, out["losses"][-1], lr,
                                                               out["grad_norm"][-1])
                + (" aux %.6f z %.6f dropped %d" % (out["aux_losses"][-1], out["z_losses"][-1],
                                                    out["dropped"][-1]) if moes else ""))
    if bench:
        timed = times[2:] if len(times) > 2 else times
        step_s = sum(timed) / max(1, len(timed))
        out["step_ms"] = step_s * 1e3
        out["tokens_per_s"] = B * T / step_s if step_s > 0 else float("inf")
    return out


def write_init(mcfg, seed, path):
    model = build_model(mcfg)
    gen = torch.Generator().manual_seed(int(seed))
    model.hf_init_(gen)
    save_weights(model, path)
    return model


# --------------------------------------------------------------------------- CLI

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", required=True, help="Tessel JSON spec")
    ap.add_argument("--init-from", help="initial weights (safetensors)")
    ap.add_argument("--write-init", help="write HF-initialised float32 weights here and exit")
    ap.add_argument("--seed", type=int, default=None, help="init seed (default train.seed)")
    ap.add_argument("--data", help="llm.c token file")
    ap.add_argument("--steps", type=int, default=None, help="default train.steps")
    ap.add_argument("--out", help="write {losses, lr, grad_norm} JSON here (an MoE model's "
                    "also lm_losses, aux_losses, z_losses, dropped)")
    ap.add_argument("--save-final", help="write the trained weights (float32 safetensors)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--bench", action="store_true",
                    help="time steps (skipping the first 2) and print step_ms/tokens_per_s")
    ap.add_argument("--quiet", action="store_true", help="no per-step log on stderr")
    ap.add_argument("--skip-nonfinite", action="store_true",
                    help="skip a step whose gradient norm is not finite (no update)")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    mcfg, tcfg = load_spec(args.spec)

    if args.write_init:
        seed = tcfg["seed"] if args.seed is None else args.seed
        write_init(mcfg, seed, args.write_init)
        return 0

    if not args.init_from or not args.data:
        ap.error("training needs --init-from and --data (or use --write-init)")
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    model = build_model(mcfg)
    load_weights(model, args.init_from)
    model.to(dtype)
    tokens = load_tokens(args.data)
    steps = tcfg["steps"] if args.steps is None else args.steps
    log = None if (args.quiet or args.bench) else (lambda s: print(s, file=sys.stderr))
    res = train(model, tokens, mcfg, tcfg, int(steps), bench=args.bench, log=log,
                skip_nonfinite=args.skip_nonfinite)
    if args.out:
        with open(args.out, "w") as f:
            keys = ("losses", "lr", "grad_norm", "lm_losses", "aux_losses", "z_losses",
                    "dropped")
            json.dump({k: res[k] for k in keys if k in res}, f, indent=1)
    if args.save_final:
        save_weights(model, args.save_final)
    if args.bench:
        print(json.dumps({"step_ms": res["step_ms"], "tokens_per_s": res["tokens_per_s"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
