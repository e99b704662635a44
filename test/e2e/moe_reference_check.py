#!/usr/bin/env python3
"""Self-check of the mixture-of-experts layers of test/e2e/torch_reference.py.

1. The vectorised MoE layer against a naive per-token loop over the same rules
   (output, aux and z losses, and their gradients with respect to the input and
   every MoE weight, in float64 to 1e-10), for both families, with and without
   expert capacity, with tied router probabilities, with shared experts.
2. A few training steps end to end through torch_reference.main() (--write-init,
   then training on a synthetic token file): a Llama model with MoE layers and
   two microbatches, a GPT model with MoE and dense layers, shared experts and
   a capacity, and examples/mixtral-tiny.json and examples/deepseek-tiny.json.

Run: /usr/bin/python3 test/e2e/moe_reference_check.py [--threads N]
Prints "moe reference ok" and exits 0, or names the failures and exits 1.
"""

import argparse
import json
import math
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import safetensors_io  # noqa: E402
import torch_reference as ref  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples")
TOL = 1e-10
failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
        print("FAIL: " + what, file=sys.stderr)


def close(a, b, what, tol=TOL):
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    err = (a - b).abs().max().item() if a.numel() else 0.0
    check(a.shape == b.shape and err <= tol * max(1.0, b.abs().max().item()),
          "%s: shapes %s %s, max difference %.3e" % (what, tuple(a.shape), tuple(b.shape), err))


# --------------------------------------------------------------------------- naive layer

def silu(v):
    return v / (1.0 + torch.exp(-v))


def gelu_tanh(v):
    return 0.5 * v * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))


def naive_moe(h, p, family, moe):
    """One token, one assignment at a time. p: the layer's parameters by name
    (relative to the layer). Returns (y like h, aux, z, dropped, experts)."""
    E, k = moe["experts"], moe["top_k"]
    C = h.shape[-1]
    x = h.reshape(-1, C)
    N = x.shape[0]
    cap = None
    if moe["capacity_factor"] is not None:
        cap = math.ceil(moe["capacity_factor"] * N * k / E)
    taken = [0] * E   # kept assignments per expert so far
    counts = [0] * E  # all assignments per expert
    dropped = 0
    ys, probs, lses, chosen = [], [], [], []
    for n in range(N):
        xn = x[n]
        logit = torch.stack([torch.dot(p["gate.weight"][e], xn) for e in range(E)])
        top = logit.max().detach()
        ex = torch.exp(logit - top)
        prob = ex / ex.sum()
        lses.append(torch.log(ex.sum()) + top)
        probs.append(prob)
        order = sorted(range(E), key=lambda e: (-prob[e].item(), e))[:k]
        chosen.append(order)
        total = prob[order[0]]
        for e in order[1:]:
            total = total + prob[e]
        y = torch.zeros(C, dtype=x.dtype)
        for e in order:  # slot order
            counts[e] += 1
            if cap is not None and taken[e] >= cap:
                dropped += 1
                continue
            taken[e] += 1
            if family == "llama":
                a = silu(torch.mv(p["experts.w1"][e], xn)) * torch.mv(p["experts.w3"][e], xn)
                out = torch.mv(p["experts.w2"][e], a)
            else:
                a = gelu_tanh(torch.mv(p["experts.c_fc"][e].t(), xn))
                out = torch.mv(p["experts.c_proj"][e].t(), a)
            y = y + (prob[e] / total) * out
        if moe["shared_experts"] > 0:
            if family == "llama":
                a = (silu(torch.mv(p["shared_experts.gate_proj.weight"], xn))
                     * torch.mv(p["shared_experts.up_proj.weight"], xn))
                y = y + torch.mv(p["shared_experts.down_proj.weight"], a)
            else:
                a = gelu_tanh(torch.mv(p["shared_experts.c_fc.weight"].t(), xn)
                              + p["shared_experts.c_fc.bias"])
                y = y + torch.mv(p["shared_experts.c_proj.weight"].t(), a) \
                    + p["shared_experts.c_proj.bias"]
        ys.append(y)
    P = torch.stack(probs).mean(0)
    aux = 0.0
    for e in range(E):
        aux = aux + counts[e] / (N * k) * P[e]
    aux = moe["aux_loss_coef"] * E * aux
    z = moe["z_loss_coef"] * torch.stack(lses).pow(2).mean()
    return torch.stack(ys).view(h.shape), aux, z, dropped, chosen


def layer_case(family, moe, zero_router=False, seed=0, B=2, T=5, C=8):
    """Compares the reference layer with the naive one; returns the dropped count."""
    name = "%s %s%s" % (family, json.dumps(moe, sort_keys=True),
                        " zero router" if zero_router else "")
    torch.manual_seed(seed)
    cfg = {"hidden": C, "ffn_hidden": 12, "norm_eps": 1e-5,
           "moe": ref.load_moe(moe, 12)}
    layer = (ref.LlamaMoE if family == "llama" else ref.GPTMoE)(cfg).double()
    with torch.no_grad():
        for n, w in layer.named_parameters():
            w.copy_(torch.randn(w.shape, dtype=torch.float64) * 0.5)
        if zero_router:
            layer.gate.weight.zero_()
    params = dict(layer.named_parameters())
    h = torch.randn(B, T, C, dtype=torch.float64, requires_grad=True)
    r = torch.randn(B, T, C, dtype=torch.float64)

    y = layer(h)
    aux, z, dropped = layer.aux_loss, layer.z_loss, layer.dropped
    y0, aux0, z0, dropped0, chosen = naive_moe(h, params, family, cfg["moe"])
    close(y, y0, name + " output")
    close(aux, aux0, name + " aux")
    close(z, z0, name + " z")
    check(dropped == dropped0, "%s dropped %d, naive %d" % (name, dropped, dropped0))
    if zero_router:
        k = cfg["moe"]["top_k"]
        check(all(c == list(range(k)) for c in chosen), name + " naive tie order")

    wrt = [h] + list(params.values())
    names = ["h"] + list(params)
    for what, a, b in (("output", (y * r).sum(), (y0 * r).sum()), ("aux", aux, aux0),
                       ("z", z, z0)):
        ga = torch.autograd.grad(a, wrt, retain_graph=True, allow_unused=True)
        gb = torch.autograd.grad(b, wrt, retain_graph=True, allow_unused=True)
        for n, w, u, v in zip(names, wrt, ga, gb):
            u = torch.zeros_like(w) if u is None else u
            v = torch.zeros_like(w) if v is None else v
            close(u, v, "%s d%s/d%s" % (name, what, n))
    return dropped


def layer_checks():
    base = {"experts": 4, "top_k": 2, "aux_loss_coef": 0.3, "z_loss_coef": 0.2}
    for family in ("llama", "gpt"):
        layer_case(family, dict(base))
        layer_case(family, dict(base, shared_experts=2, top_k=3))
        # 10 tokens x 2 assignments, 4 experts of capacity ceil(0.75 * 5) = 4:
        # at most 16 kept, so some are dropped.
        d = layer_case(family, dict(base, capacity_factor=0.75, shared_experts=1), seed=1)
        check(d >= 4, "%s capacity 0.75 dropped %d, expected >= 4" % (family, d))
        # Equal probabilities: every token picks experts 0 and 1 (weights 1/2).
        layer_case(family, dict(base), zero_router=True)
        d = layer_case(family, dict(base, capacity_factor=0.75), zero_router=True)
        check(d == 2 * (10 - 4), "%s tied capacity dropped %d, expected 12" % (family, d))

    # The reference's routing on a tie, directly.
    logits = torch.zeros(3, 5, dtype=torch.float64)
    _, w, ex, keep, counts = ref.moe_route(logits, 3, 2)
    check(ex.tolist() == [[0, 1, 2]] * 3, "tie order %s" % ex.tolist())
    check(keep.tolist() == [[True] * 3, [True] * 3, [False] * 3], "capacity keep %s"
          % keep.tolist())
    check(counts.tolist() == [3, 3, 3, 0, 0], "counts %s" % counts.tolist())
    close(w, torch.full((3, 3), 1.0 / 3, dtype=torch.float64), "tie weights")


# --------------------------------------------------------------------------- training

def run_spec(tmp, name, spec, data, steps, threads, extra=()):
    path = os.path.join(tmp, name + ".json")
    if isinstance(spec, str):
        shutil.copy(spec, path)
    else:
        with open(path, "w") as f:
            json.dump(spec, f)
    init = os.path.join(tmp, name + ".init.safetensors")
    out = os.path.join(tmp, name + ".out.json")
    rc = ref.main(["--spec", path, "--write-init", init])
    check(rc == 0, name + " --write-init")
    rc = ref.main(["--spec", path, "--init-from", init, "--data", data, "--steps", str(steps),
                   "--out", out, "--threads", str(threads), "--quiet"] + list(extra))
    check(rc == 0, name + " training")
    with open(out) as f:
        res = json.load(f)
    for key in ("losses", "lr", "grad_norm", "lm_losses", "aux_losses", "z_losses",
                "dropped"):
        check(len(res.get(key, [])) == steps, "%s: %s has %d entries"
              % (name, key, len(res.get(key, []))))
    for key in ("losses", "grad_norm", "lm_losses", "aux_losses", "z_losses"):
        check(all(math.isfinite(v) for v in res.get(key, [])), "%s: %s not finite: %s"
              % (name, key, res.get(key)))
    check(all(a > 0 and z > 0 for a, z in zip(res["aux_losses"], res["z_losses"])),
          name + ": aux and z losses positive")
    for i in range(steps):
        total = res["lm_losses"][i] + res["aux_losses"][i] + res["z_losses"][i]
        check(abs(res["losses"][i] - total) <= 1e-5 * abs(total),
              "%s step %d: loss %r != lm + aux + z %r" % (name, i, res["losses"][i], total))
    print("%s: losses %s dropped %s" % (name, ["%.4f" % v for v in res["losses"]],
                                        res["dropped"]))
    return path, init, res


def training_checks(threads):
    tmp = tempfile.mkdtemp(prefix="moe_ref_check_")
    try:
        data = os.path.join(tmp, "tokens.bin")
        ref.write_tokens(data, np.random.default_rng(3).integers(0, 256, 20000))
        model = {"vocab_size": 256, "seq_len": 32, "layers": 2, "hidden": 32, "heads": 4,
                 "ffn_hidden": 48}
        train = {"global_batch": 4, "steps": 3, "seed": 7,
                 "lr_schedule": {"warmup_steps": 1, "decay": "cosine", "min_lr": 1e-4}}

        # Llama: every layer MoE, two microbatches.
        llama = {"model": dict(model, family="llama", kv_heads=2,
                               moe={"experts": 4, "top_k": 2, "ffn_hidden": 16}),
                 "train": train, "parallel": {"microbatches": 2}}
        path, init, res = run_spec(tmp, "llama-moe", llama, data, 3, threads)
        w = safetensors_io.load_file(init)
        for l in range(2):
            pre = "model.layers.%d.block_sparse_moe." % l
            for n, shape in (("gate.weight", (4, 32)), ("experts.w1", (4, 16, 32)),
                             ("experts.w3", (4, 16, 32)), ("experts.w2", (4, 32, 16))):
                check(pre + n in w and w[pre + n].shape == shape, "llama tensor " + pre + n)
            check(not any(k.startswith("model.layers.%d.mlp." % l) for k in w),
                  "llama MoE layer %d has no mlp" % l)
        # Step 0's loss is the mean of the two microbatches' losses.
        mcfg, tcfg = ref.load_spec(path)
        net = ref.build_model(mcfg)
        ref.load_weights(net, init)
        x, y = ref.get_batch(ref.load_tokens(data), 0, 4, 32)
        want = 0.0
        with torch.no_grad():
            for i in range(2):
                logits = net(x[2 * i:2 * i + 2])
                loss = F.cross_entropy(logits.reshape(-1, 256), y[2 * i:2 * i + 2].reshape(-1))
                for m in ref.moe_layers(net):
                    loss = loss + m.aux_loss + m.z_loss
                want += loss.item() / 2
        check(abs(res["losses"][0] - want) <= 1e-6 * want,
              "llama microbatch loss %r, expected %r" % (res["losses"][0], want))

        # GPT: MoE at layer 0 only (every 2), shared experts, capacity (drops).
        gpt = {"model": dict(model, family="gpt",
                             moe={"experts": 4, "top_k": 2, "every": 2, "ffn_hidden": 24,
                                  "shared_experts": 1, "capacity_factor": 0.5}),
               "train": train}
        path, init, res = run_spec(tmp, "gpt-moe", gpt, data, 3, threads)
        check(all(d > 0 for d in res["dropped"]), "gpt capacity 0.5 drops: %s" % res["dropped"])
        w = safetensors_io.load_file(init)
        for n, shape in (("h.0.mlp.gate.weight", (4, 32)), ("h.0.mlp.experts.c_fc", (4, 32, 24)),
                         ("h.0.mlp.experts.c_proj", (4, 24, 32)),
                         ("h.0.mlp.shared_experts.c_fc.weight", (32, 24)),
                         ("h.0.mlp.shared_experts.c_fc.bias", (24,)),
                         ("h.0.mlp.shared_experts.c_proj.weight", (24, 32)),
                         ("h.0.mlp.shared_experts.c_proj.bias", (32,)),
                         ("h.1.mlp.c_fc.weight", (32, 48)), ("h.1.mlp.c_proj.weight", (48, 32))):
            check(n in w and w[n].shape == shape, "gpt tensor " + n)
        check("h.0.mlp.c_fc.weight" not in w, "gpt MoE layer 0 has no dense c_fc")
        proj_std = 0.02 / math.sqrt(4)
        check(abs(float(w["h.0.mlp.experts.c_proj"].std()) / proj_std - 1) < 0.1,
              "gpt experts.c_proj init std")
        check(float(np.abs(w["h.0.mlp.shared_experts.c_fc.bias"]).max()) == 0.0,
              "gpt shared bias init zero")

        # float64 follows float32.
        _, _, res64 = run_spec(tmp, "gpt-moe", gpt, data, 3, threads, ["--dtype", "float64"])
        check(np.allclose(res["losses"], res64["losses"], rtol=1e-4),
              "float32 %s vs float64 %s" % (res["losses"], res64["losses"]))

        for example in ("mixtral-tiny", "deepseek-tiny"):
            src = os.path.join(EXAMPLES, example + ".json")
            if not os.path.exists(src):
                check(False, src + " missing")
                continue
            run_spec(tmp, example, src, data, 2, threads)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    layer_checks()
    training_checks(args.threads)
    if failures:
        print("%d failure(s)" % len(failures), file=sys.stderr)
        return 1
    print("moe reference ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
