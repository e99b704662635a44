#!/usr/bin/env python3
"""What ZeRO costs and saves: memory per rank of GPT-2 124M at dp4 by ZeRO
level (the plan beside the ZeRO paper's formulas), and the step time, bytes
moved and peak memory of a mid-size GPT at dp2 on the CPU by level, side by
side in one run.

    /usr/bin/python3 bench/zero.py [--steps N]

The paper's model-state formulas per rank for Psi parameters over N_d
data-parallel ranks, as Tessel stores them on the CPU (fp32 parameters and
gradients, two fp32 moments): zero 0: (4 + 4 + 8) Psi; zero 1: (4 + 4 +
8/N_d) Psi; zero 2: (4 + 4/N_d + 8/N_d) Psi plus the staging of the runs
being reduced; zero 3: 16/N_d Psi plus the staging of the gradient runs and
of the gathered parameter runs. Prints markdown tables for
docs/benchmarks.md.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESSEL = os.path.join(ROOT, "build", "bin", "tessel")
MID = ["--set", "model.layers=8", "--set", "model.hidden=512", "--set", "model.heads=8",
       "--set", "model.kv_heads=8", "--set", "model.ffn_hidden=2048",
       "--set", "model.vocab_size=8192", "--set", "model.seq_len=128",
       "--set", "train.global_batch=8"]


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def mb(x):
    return f"{x / 1e6:.1f} MB"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="tessel-zero-")

    print("GPT-2 124M at dp4, per rank (plan.json; formula in parentheses):\n")
    print("| zero | parameters | gradients | AdamW moments | model state | formula |")
    print("|---|---|---|---|---|---|")
    for level in (0, 1, 2, 3):
        out = os.path.join(work, f"gpt2-z{level}")
        run([TESSEL, "compile", os.path.join(ROOT, "examples", "gpt2-124m.json"),
             "--dp", "4", "--zero", str(level), "--emit-only", "-o", out])
        plan = json.load(open(os.path.join(out, "plan.json")))
        m = plan["programs"]["program0"]["memory"]
        psi = plan["programs"]["program0"]["parameters"]
        formula = {0: 16 * psi, 1: (8 + 8 / 4) * psi, 2: (4 + 12 / 4) * psi,
                   3: 16 / 4 * psi}[level]
        state = m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"]
        grads = mb(m["grads_bytes"])
        if level >= 2:
            grads += (f" ({mb(m['grad_piece_bytes'])} pieces + "
                      f"{mb(m['grad_staging_bytes'])} staging)")
        params = mb(m["params_bytes"])
        if level == 3:
            params += (f" ({mb(m['param_piece_bytes'])} pieces + "
                       f"{mb(m['param_gather_bytes'])} gathered)")
        print(f"| {level} | {params} | {grads} | "
              f"{mb(m['optimizer_bytes'])} | {mb(state)} | {mb(formula)} |")

    print(f"\nMid-size GPT (8 layers, hidden 512, 29.5M parameters) at dp2 on "
          f"the CPU, median of {args.steps - 2} steps after two warm-up steps:\n")
    print("| zero | step time | bytes sent per rank and step | planned total | "
          "measured peak (rank 0) |")
    print("|---|---|---|---|---|")
    for level in (0, 1, 2, 3):
        out = os.path.join(work, f"mid-z{level}")
        run([TESSEL, "compile", os.path.join(ROOT, "examples", "gpt-tiny.json"),
             "--dp", "2", "--zero", str(level), "-o", out] + MID)
        metrics = os.path.join(out, "metrics.jsonl")
        report = os.path.join(out, "comm.json")
        run([TESSEL, "run", out, "--steps", str(args.steps), "--metrics", metrics,
             "--comm-report", report, "--quiet"])
        steps = [json.loads(l)["step_ms"] for l in open(metrics)][2:]
        plan = json.load(open(os.path.join(out, "plan.json")))
        total = plan["programs"]["program0"]["memory"]["total_bytes"]
        rank0 = json.load(open(os.path.join(out, "comm.rank0.json")))
        peak = rank0["memory"]["rss_peak_bytes"] - rank0["memory"]["rss_before_bytes"]
        sent = sum(c["bytes_sent"] for c in rank0["collectives"].values()) / args.steps \
            if isinstance(rank0.get("collectives"), dict) else float("nan")
        print(f"| {level} | {statistics.median(steps):.0f} ms | {mb(sent)} | "
              f"{mb(total)} | {mb(peak)} |")


if __name__ == "__main__":
    main()
