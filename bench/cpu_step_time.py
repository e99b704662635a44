#!/usr/bin/env python3
"""Step time of Tessel's CPU programs next to PyTorch eager on the same model,
batch, weights, data and thread count, in one run.

    /usr/bin/python3 bench/cpu_step_time.py [--threads N] [--steps N]

Prints a markdown table for docs/benchmarks.md. Needs a built tree (build/)
and Debian's python3-torch.
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
REFERENCE = os.path.join(ROOT, "test", "e2e", "torch_reference.py")

CASES = [
    # name, spec, overrides
    ("gpt-tiny (B=8, T=64)", "examples/gpt-tiny.json", {}),
    ("llama-tiny (B=8, T=64)", "examples/llama-tiny.json", {}),
    ("gpt2-124m (B=4, T=64)", "examples/gpt2-124m.json",
     {"model": {"seq_len": 64}, "train": {"global_batch": 4}, "data": {"format": "synthetic"}}),
    ("gpt2-124m (B=4, T=256)", "examples/gpt2-124m.json",
     {"model": {"seq_len": 256}, "train": {"global_batch": 4}, "data": {"format": "synthetic"}}),
    # Both sides materialising the attention scores (PyTorch eager's
    # attention here always does) and dropping out 0.1 of the hidden
    # states and of the attention probabilities (each with its own masks).
    ("gpt-tiny (B=8, T=64), unfused attention, dropout 0.1", "examples/gpt-tiny.json",
     {"model": {"dropout": 0.1, "attention_dropout": 0.1},
      "train": {"attention": "unfused"}}),
    ("gpt2-124m (B=4, T=256), unfused attention, dropout 0.1", "examples/gpt2-124m.json",
     {"model": {"seq_len": 256, "dropout": 0.1, "attention_dropout": 0.1},
      "train": {"global_batch": 4, "attention": "unfused"}, "data": {"format": "synthetic"}}),
]


def merge(base, extra):
    for key, value in extra.items():
        if isinstance(value, dict):
            merge(base.setdefault(key, {}), value)
        else:
            base[key] = value
    return base


def run(cmd, env=None):
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"command failed: {' '.join(cmd)}\n{result.stdout}\n{result.stderr}")
    return result.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--only", help="run only cases whose name contains this")
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
               OPENBLAS_NUM_THREADS=str(args.threads))
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for name, spec_path, overrides in CASES:
            if args.only and args.only not in name:
                continue
            spec = merge(json.load(open(os.path.join(ROOT, spec_path))), overrides)
            spec["data"] = {"format": "synthetic"}
            spec_file = os.path.join(work, "spec.json")
            json.dump(spec, open(spec_file, "w"))
            out = os.path.join(work, "out")
            tokens = os.path.join(work, "tokens.bin")
            weights = os.path.join(work, "init.safetensors")
            metrics = os.path.join(work, "metrics.jsonl")
            run([TESSEL, "compile", spec_file, "-o", out])
            run([TESSEL, "data", "synth", "-o", tokens, "--vocab",
                 str(spec["model"]["vocab_size"]), "--tokens", "2000000"])
            run([TESSEL, "run", out, "--steps", "0", "--save-final", weights, "--quiet"])
            run([TESSEL, "run", out, "--steps", str(args.steps), "--data", tokens,
                 "--init-from", weights, "--metrics", metrics, "--quiet",
                 "--threads", str(args.threads)], env)
            steps = [json.loads(l) for l in open(metrics)]
            tessel_ms = statistics.median(s["step_ms"] for s in steps[2:])
            torch_out = run(["/usr/bin/python3", REFERENCE, "--spec", spec_file,
                             "--init-from", weights, "--data", tokens, "--steps",
                             str(args.steps), "--threads", str(args.threads),
                             "--bench", "--quiet"], env)
            torch_ms = json.loads(torch_out.strip().splitlines()[-1])["step_ms"]
            rows.append((name, tessel_ms, torch_ms))
            print(f"{name}: tessel {tessel_ms:.1f} ms, torch {torch_ms:.1f} ms",
                  file=sys.stderr)
    print(f"| model | Tessel step (ms) | PyTorch eager step (ms) | PyTorch / Tessel |")
    print(f"|---|---|---|---|")
    for name, t, p in rows:
        print(f"| {name} | {t:.1f} | {p:.1f} | {p / t:.2f} |")


if __name__ == "__main__":
    main()
