#!/usr/bin/env python3
"""Generation speed: Tessel's inference program (tessel compile --inference:
prefill and decode steps over a KV cache) beside PyTorch eager with a KV
cache written the usual way (the prompt in one forward, then one token per
forward, keys and values concatenated per layer), and PyTorch without a
cache (the whole sequence again for every token, as a plain forward
generates), on the same weights (GPT-2, Llama and a Mixtral-style mixture of
experts), prompt and thread count, in one run. All three generate greedily;
the run checks that they pick the same tokens.

    /usr/bin/python3 bench/generate.py [--threads N] [--repeats N] [--cases a,b]

Prints a markdown table for docs/benchmarks.md. Needs a built tree (build/)
and Debian's python3-torch.
"""
import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESSEL = os.path.join(ROOT, "build", "bin", "tessel")
sys.path.insert(0, os.path.join(ROOT, "test", "e2e"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cpu_step_time import run  # noqa: E402 (beside this file)

# Model, spec, prompt tokens, new tokens (within the context).
CASES = [
    ("gpt-tiny", "examples/gpt-tiny.json", 16, 48),
    ("gpt2-124m", "examples/gpt2-124m.json", 64, 128),
    ("llama-tiny", "examples/llama-tiny.json", 16, 48),
    ("mixtral-tiny", "examples/mixtral-tiny.json", 16, 48),
]


def timed_greedy(forward, prompt, new):
    """Greedy generation through forward(ids, start) -> last logits, the
    prompt in one call and then a token per call: (ids, prefill s, decode s)."""
    import torch
    with torch.no_grad():
        start = time.perf_counter()
        logits = forward(torch.tensor([prompt]), 0)
        prefill = time.perf_counter() - start
        ids = []
        start = time.perf_counter()
        for k in range(new):
            ids.append(int(logits.argmax()))
            if k + 1 < new:
                logits = forward(torch.tensor([[ids[-1]]]), len(prompt) + k)
        decode = time.perf_counter() - start
    return ids, prefill, decode


def torch_cached(model, prompt, new):
    """Greedy generation with a KV cache: returns (ids, prefill s, decode s)."""
    import torch
    cfg = model.cfg
    C, H = cfg["hidden"], cfg["heads"]
    D = C // H
    cache = [[None, None] for _ in model.h]

    def forward(ids, start):
        T = ids.shape[1]
        pos = torch.arange(start, start + T)
        x = model.wte(ids) + model.wpe(pos)[None]
        for block, kv in zip(model.h, cache):
            q, k, v = block.attn.c_attn(block.ln_1(x)).split(C, dim=-1)
            q, k, v = (t.view(1, T, H, D).transpose(1, 2) for t in (q, k, v))
            kv[0] = k if kv[0] is None else torch.cat([kv[0], k], dim=2)
            kv[1] = v if kv[1] is None else torch.cat([kv[1], v], dim=2)
            att = torch.matmul(q, kv[0].transpose(-1, -2)) * (1.0 / math.sqrt(D))
            if T > 1:
                keys = kv[0].shape[2]
                mask = torch.ones(T, keys, dtype=torch.bool).tril(keys - T)
                att = att.masked_fill(~mask, float("-inf"))
            y = torch.matmul(torch.softmax(att, dim=-1), kv[1])
            x = x + block.attn.c_proj(y.transpose(1, 2).reshape(1, T, C))
            x = x + block.mlp(block.ln_2(x))
        # The tied head as Hugging Face's nn.Linear applies it.
        return torch.nn.functional.linear(model.ln_f(x[:, -1]), model.wte.weight)

    return timed_greedy(forward, prompt, new)


def torch_cached_llama(model, prompt, new):
    """torch_cached for the Llama family (RoPE at the cached positions,
    grouped KV heads; an MoE layer's routed experts as the reference runs
    them): (ids, prefill s, decode s)."""
    import torch
    import torch_reference as ref
    cfg = model.cfg
    C, H, Hkv = cfg["hidden"], cfg["heads"], cfg["kv_heads"]
    D = C // H
    cos_all, sin_all = ref.rope_cos_sin(len(prompt) + new, D, cfg["rope_theta"],
                                        torch.float32)
    layers = model.model.layers
    cache = [[None, None] for _ in layers]

    def forward(ids, start):
        T = ids.shape[1]
        cos, sin = cos_all[start:start + T], sin_all[start:start + T]
        x = model.model.embed_tokens(ids)
        for layer, kv in zip(layers, cache):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = ref.apply_rope(a.q_proj(h).view(1, T, H, D).transpose(1, 2), cos, sin)
            k = ref.apply_rope(a.k_proj(h).view(1, T, Hkv, D).transpose(1, 2), cos, sin)
            v = a.v_proj(h).view(1, T, Hkv, D).transpose(1, 2)
            kv[0] = k if kv[0] is None else torch.cat([kv[0], k], dim=2)
            kv[1] = v if kv[1] is None else torch.cat([kv[1], v], dim=2)
            keys = kv[0].repeat_interleave(H // Hkv, dim=1)
            values = kv[1].repeat_interleave(H // Hkv, dim=1)
            att = torch.matmul(q, keys.transpose(-1, -2)) * (1.0 / math.sqrt(D))
            if T > 1:
                n = keys.shape[2]
                mask = torch.ones(T, n, dtype=torch.bool).tril(n - T)
                att = att.masked_fill(~mask, float("-inf"))
            y = torch.matmul(torch.softmax(att, dim=-1), values)
            x = x + a.o_proj(y.transpose(1, 2).reshape(1, T, C))
            ffn = getattr(layer, "block_sparse_moe", None) or layer.mlp
            x = x + ffn(layer.post_attention_layernorm(x))
        head = (model.model.embed_tokens.weight if cfg["tie_embeddings"]
                else model.lm_head.weight)
        return torch.nn.functional.linear(model.model.norm(x[:, -1]), head)

    return timed_greedy(forward, prompt, new)


def torch_uncached(model, prompt, new):
    """Greedy generation by a whole forward per token: (ids, seconds)."""
    import torch
    ids = []
    with torch.no_grad():
        start = time.perf_counter()
        for _ in range(new):
            seq = torch.tensor([prompt + ids])
            ids.append(int(model(seq)[0, -1].argmax()))
        return ids, time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", help="names of CASES to run, comma-separated "
                    "(default: all)")
    args = ap.parse_args()
    import torch
    import torch_reference as ref
    torch.set_num_threads(args.threads)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
               OPENBLAS_NUM_THREADS=str(args.threads), OMP_WAIT_POLICY="PASSIVE")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for name, spec_path, prompt_len, new in CASES:
            if args.cases and name not in args.cases.split(","):
                continue
            spec_file = os.path.join(ROOT, spec_path)
            mcfg, _ = ref.load_spec(spec_file)
            weights = os.path.join(work, name + ".safetensors")
            model = ref.write_init(mcfg, 1234, weights)
            model.eval()
            out = os.path.join(work, name)
            run([TESSEL, "compile", spec_file, "--inference", "-o", out])
            gen = torch.Generator().manual_seed(7)
            prompt = torch.randint(0, mcfg["vocab_size"], (prompt_len,),
                                   generator=gen).tolist()
            # Tessel: the rank program's own timings (its end event).
            tessel = []
            for _ in range(args.repeats):
                lines = run([os.path.join(out, "bin", "program0"), "--weights",
                             weights, "--prompt-tokens",
                             ",".join(map(str, prompt)), "--max-new-tokens",
                             str(new)], env).strip().splitlines()
                events = [json.loads(l) for l in lines]
                ids = [e["id"] for e in events if e["event"] == "token"]
                end = events[-1]
                tessel.append((end["prefill_s"], end["decode_s"]))
            cached_fn = (torch_cached if mcfg["family"] == "gpt"
                         else torch_cached_llama)
            cached = [cached_fn(model, prompt, new)
                      for _ in range(args.repeats)]
            plain_ids, plain_s = torch_uncached(model, prompt, new)
            same = ids == cached[0][0] == plain_ids
            first_diff = next((k for k, (a, b) in enumerate(zip(ids, cached[0][0]))
                               if a != b), None)
            # Decode tokens/s: the tokens after the first (which the prefill's
            # logits give), over the decode time.
            t_pre = statistics.median(p for p, _ in tessel)
            t_dec = (new - 1) / statistics.median(d for _, d in tessel)
            c_pre = statistics.median(p for _, p, _ in cached)
            c_dec = (new - 1) / statistics.median(d for _, _, d in cached)
            plain = new / plain_s
            rows.append((f"{name} ({prompt_len} + {new} tokens)", t_pre, t_dec,
                         c_pre, c_dec, plain, same))
            print(f"{name}: tessel prefill {t_pre * 1000:.1f} ms, {t_dec:.1f} tok/s; "
                  f"torch cached {c_pre * 1000:.1f} ms, {c_dec:.1f} tok/s; "
                  f"uncached {plain:.1f} tok/s; same tokens {same} "
                  f"(first difference at {first_diff})", file=sys.stderr)
    print("| model (prompt + new) | Tessel prefill (ms) | Tessel decode "
          "(tokens/s) | PyTorch KV cache prefill (ms) | PyTorch KV cache decode "
          "(tokens/s) | PyTorch without cache (tokens/s) | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for name, tp, td, cp, cd, pl, same in rows:
        print(f"| {name} | {tp * 1000:.1f} | {td:.1f} | {cp * 1000:.1f} | {cd:.1f} | "
              f"{pl:.1f} | {'yes' if same else 'no'} |")


if __name__ == "__main__":
    main()
