#!/usr/bin/env python3
"""Training throughput of a GPT in plain PyTorch on one GPU: the baseline that
bench/gpu/run.sh puts next to Tessel's CUDA programs.

    python3 bench/gpu/torch_gpt.py --spec examples/gpt2-124m.json --batch 16 \
        [--seq-len 1024] [--precision bf16|fp32] [--warmup 3] [--steps 10] \
        [--compile] [--no-eager] [--device cuda|cpu] [--verbose]

The model is Tessel's `gpt` family (Hugging Face GPT-2 semantics, as in
test/e2e/torch_reference.py): learned positions, pre-LayerNorm blocks, one
fused QKV projection, causal attention scaled by 1/sqrt(head_dim), GELU
(tanh approximation), a final LayerNorm and the LM head tied to the token
embedding. It is written for speed rather than for weight compatibility:
nn.Linear layers and torch.nn.functional.scaled_dot_product_attention
(flash attention on H100/H200). The recipe is the spec's: AdamW (fused when
this PyTorch has it) with weight decay on parameters of rank >= 2 only,
clip_grad_norm_ at train.grad_clip, the learning rate schedule of
torch_reference.lr_at. bf16 runs compute under torch.autocast with fp32
master weights, gradients and optimizer state, as Tessel's bf16 programs do;
fp32 runs disable TF32.

Tokens are random (the throughput does not depend on them). A step is timed
like Tessel's: from the start of the forward pass to the end of the
optimizer update, reading the loss on the host, between two
torch.cuda.synchronize() calls. The first --warmup steps are not timed.

Prints one JSON line per mode on stdout as soon as it is measured (so a
timeout that ends the compiled run keeps the eager result):

  {"mode": "eager" | "compiled", "tokens_per_s": median over the timed
   steps, "step_ms": median, "params": every parameter, ...}

or {"mode": ..., "error": "..."} when a mode fails. Exit status: 0 every
mode measured, 1 a mode failed.

Needs PyTorch >= 2.0 with CUDA for the GPU numbers (scaled_dot_product_attention,
fused AdamW, torch.compile; older versions fall back to explicit attention and
foreach AdamW, which is enough for `--device cpu` smoke tests) and numpy
(imported by torch_reference).
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "test", "e2e"))
# The spec's defaults and the learning rate schedule, shared with the
# end-to-end reference rather than written twice.
from torch_reference import load_spec, lr_at  # noqa: E402

HAVE_SDPA = hasattr(F, "scaled_dot_product_attention")


def causal_attention(q, k, v):
    """q, k, v: [B, H, T, D] -> [B, H, T, D]."""
    if HAVE_SDPA:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # PyTorch before 2.0 (CPU smoke tests only): the explicit form.
    T, D = q.shape[-2], q.shape[-1]
    att = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(D))
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return torch.matmul(att, v)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C, eps = cfg["hidden"], cfg["norm_eps"]
        self.n_head = cfg["heads"]
        self.ln_1 = nn.LayerNorm(C, eps=eps)
        self.c_attn = nn.Linear(C, 3 * C)
        self.attn_proj = nn.Linear(C, C)
        self.ln_2 = nn.LayerNorm(C, eps=eps)
        self.c_fc = nn.Linear(C, cfg["ffn_hidden"])
        self.mlp_proj = nn.Linear(cfg["ffn_hidden"], C)

    def forward(self, x):
        B, T, C = x.shape
        H = self.n_head
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=-1)
        q = q.view(B, T, H, C // H).transpose(1, 2)
        k = k.view(B, T, H, C // H).transpose(1, 2)
        v = v.view(B, T, H, C // H).transpose(1, 2)
        y = causal_attention(q, k, v).transpose(1, 2).reshape(B, T, C)
        x = x + self.attn_proj(y)
        x = x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))
        return x


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        V, T, C = cfg["vocab_size"], cfg["seq_len"], cfg["hidden"]
        # A padded vocabulary (model.vocab_pad_to_multiple) as nanoGPT pads
        # GPT-2's: the table has the padded rows, which no target names.
        pad = cfg.get("vocab_pad_to_multiple", 1)
        V = (V + pad - 1) // pad * pad
        self.wte = nn.Embedding(V, C)
        self.wpe = nn.Embedding(T, C)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg["layers"])])
        self.ln_f = nn.LayerNorm(C, eps=cfg["norm_eps"])
        self.lm_head = None if cfg["tie_embeddings"] else nn.Linear(C, V, bias=False)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        head = self.wte.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(x, head)
        # Autocast computes the cross-entropy in fp32, as Tessel does.
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    @torch.no_grad()
    def init_(self, seed):
        """Hugging Face GPT-2 initialisation (the distribution Tessel uses):
        N(0, 0.02), the residual projections N(0, 0.02 / sqrt(2 layers)),
        biases 0, LayerNorm 1 and 0. Drawn on the model's device: host
        sampling of 1.3B values would take longer than the benchmark."""
        gen = torch.Generator(device=self.wte.weight.device).manual_seed(seed)
        proj_std = 0.02 / math.sqrt(2 * self.cfg["layers"])
        for name, p in self.named_parameters():
            if name.startswith("ln_") or ".ln_" in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif p.dim() >= 2:
                std = proj_std if name.endswith(("attn_proj.weight", "mlp_proj.weight")) else 0.02
                p.normal_(0.0, std, generator=gen)
            else:
                p.zero_()


def build_model(mcfg, device):
    """The model with its parameters allocated on `device` directly where
    PyTorch allows it (>= 2.0): building 1.3B parameters on the host first,
    with nn.Linear's own initialisation, would take longer than the
    benchmark."""
    if hasattr(torch.device, "__enter__"):
        with device:
            return GPT(mcfg)
    return GPT(mcfg).to(device)


def make_optimizer(model, tcfg, device):
    """AdamW as the spec says; returns (optimizer, implementation name)."""
    opt = tcfg["optimizer"]
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2],
               "weight_decay": float(opt["weight_decay"])},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    kwargs = dict(lr=float(opt["lr"]), betas=tuple(opt["betas"]), eps=float(opt["eps"]))
    if device.type == "cuda":
        try:  # one kernel per step for all parameters (PyTorch >= 2.0)
            return torch.optim.AdamW(groups, fused=True, **kwargs), "fused"
        except (TypeError, RuntimeError):
            pass
    try:
        return torch.optim.AdamW(groups, foreach=True, **kwargs), "foreach"
    except TypeError:
        return torch.optim.AdamW(groups, **kwargs), "default"


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(step_fn, model, optimizer, batches, tcfg, args, device, log):
    """Runs warmup + timed steps; returns (step seconds of the timed steps,
    first loss, last loss, seconds of the first step)."""
    params = [p for p in model.parameters()]
    clip = float(tcfg["grad_clip"] or 0.0)
    total = args.warmup + args.steps
    amp = args.precision == "bf16"
    times, losses, first_step_s = [], [], None
    for s in range(total):
        x, y = batches[s % len(batches)]
        synchronize(device)
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            loss = step_fn(x, y)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        lr = lr_at(s, total, tcfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        value = loss.item()  # Tessel's step also hands its loss to the host
        synchronize(device)
        dt = time.perf_counter() - t0
        if not math.isfinite(value):
            raise RuntimeError("loss is %r at step %d" % (value, s))
        if first_step_s is None:
            first_step_s = dt
        if s >= args.warmup:
            times.append(dt)
        losses.append(value)
        log("step %d loss %.4f %.1f ms" % (s, value, dt * 1e3))
    return times, losses[0], losses[-1], first_step_s


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", required=True, help="Tessel JSON spec of a gpt model")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step "
                    "(default train.global_batch)")
    ap.add_argument("--seq-len", type=int, default=None, help="default model.seq_len")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--compile", action="store_true",
                    help="after eager, measure the torch.compile'd model")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager measurement")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke tests)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--verbose", action="store_true", help="one line per step on stderr")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    if args.no_eager and not args.compile:
        ap.error("--no-eager leaves nothing to measure without --compile")

    mcfg, tcfg = load_spec(args.spec)
    if mcfg["family"] != "gpt":
        ap.error("%s: only the gpt family is implemented here, not %r"
                 % (args.spec, mcfg["family"]))
    if args.seq_len is not None:
        mcfg["seq_len"] = args.seq_len
    B = args.batch if args.batch is not None else int(tcfg["global_batch"])
    T = int(mcfg["seq_len"])

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("torch_gpt.py: PyTorch %s sees no CUDA device" % torch.__version__)
    if args.precision == "fp32" and device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.verbose else (lambda s: None)

    torch.manual_seed(args.seed)
    model = build_model(mcfg, device)
    model.init_(args.seed)
    optimizer, optimizer_kind = make_optimizer(model, tcfg, device)
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    batches = []
    for _ in range(4):
        tokens = torch.randint(0, mcfg["vocab_size"], (B, T + 1), device=device, generator=gen)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))

    n_params = sum(p.numel() for p in model.parameters())
    common = {
        "batch": B, "seq_len": T, "precision": args.precision,
        "params": n_params, "params_wpe": model.wpe.weight.numel(),
        "optimizer": "adamw-" + optimizer_kind,
        "attention": "sdpa" if HAVE_SDPA else "explicit",
        "torch": torch.__version__,
        "device": (torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        "warmup": args.warmup, "timed_steps": args.steps,
    }

    modes = ([] if args.no_eager else ["eager"]) + (["compiled"] if args.compile else [])
    status = 0
    for mode in modes:
        record = dict(mode=mode, **common)
        try:
            if mode == "compiled":
                if not hasattr(torch, "compile"):
                    raise RuntimeError("torch.compile needs PyTorch >= 2.0, this is %s"
                                       % torch.__version__)
                step_fn = torch.compile(model)
            else:
                step_fn = model
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times, first_loss, last_loss, first_s = measure(
                step_fn, model, optimizer, batches, tcfg, args, device, log)
        except Exception as e:  # report the mode as failed, keep the others
            message = "%s: %s" % (type(e).__name__, str(e).strip().splitlines()[0]
                                  if str(e).strip() else "")
            record["error"] = message[:500]
            print(json.dumps(record), flush=True)
            print("torch_gpt.py: %s failed: %s" % (mode, message), file=sys.stderr)
            status = 1
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        step_s = statistics.median(times)
        record.update({
            "tokens_per_s": B * T / step_s,
            "step_ms": step_s * 1e3,
            "step_ms_min": min(times) * 1e3,
            "first_step_s": first_s,  # includes compilation for the compiled mode
            "loss_first": first_loss,
            "loss_last": last_loss,
        })
        if device.type == "cuda":
            record["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        print(json.dumps(record), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
