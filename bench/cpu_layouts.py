#!/usr/bin/env python3
"""Step time and bytes moved of one model at several layouts on the CPU.

    /usr/bin/python3 bench/cpu_layouts.py [--steps N]

All layouts use the machine's cores: dp1 runs one rank with every core as a
thread; dpN/tpN run N ranks (mpirun) with cores/N threads each. Bytes are
the per-rank, per-step collective volumes the runtime counted (equal to the
compile-time prediction, see test/e2e/data-parallel.test). Prints a markdown
table for docs/benchmarks.md.
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
MODEL = ["--set", "model.layers=4", "--set", "model.hidden=256", "--set", "model.heads=8",
         "--set", "model.kv_heads=8", "--set", "model.ffn_hidden=1024",
         "--set", "model.vocab_size=4096", "--set", "model.seq_len=128",
         "--set", "train.global_batch=8"]
# The tensor-parallel layouts twice: with their collectives overlapping
# the GEMMs (the default) and all blocking (parallel.overlap_tp_comm=false).
BLOCKING = ["--set", "parallel.overlap_tp_comm=false"]
LAYOUTS = [("dp1", []), ("dp2", ["--dp", "2"]), ("tp2", ["--tp", "2"]),
           ("tp2, blocking", ["--tp", "2"] + BLOCKING),
           ("tp2 + sp", ["--tp", "2", "--sp"]),
           ("tp2 + sp, blocking", ["--tp", "2", "--sp"] + BLOCKING)]


def run(cmd, env=None):
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def median_step_ms(out, steps, threads, metrics, extra=()):
    """Trains the compiled `out` for `steps` steps with `threads` threads per
    rank; the median step time (ms) over steps 3..steps."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads),
               OPENBLAS_NUM_THREADS=str(threads))
    run([TESSEL, "run", out, "--steps", str(steps), "--metrics", metrics,
         "--threads", str(threads), "--quiet"] + list(extra), env)
    records = [json.loads(line) for line in open(metrics)]
    return statistics.median(r["step_ms"] for r in records[2:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--spec", default=os.path.join(ROOT, "examples", "gpt-tiny.json"))
    args = ap.parse_args()
    cores = os.cpu_count()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for name, layout in LAYOUTS:
            out = os.path.join(work, name.replace(" ", ""))
            run([TESSEL, "compile", args.spec, "-o", out] + MODEL + layout)
            plan = json.load(open(os.path.join(out, "plan.json")))
            ranks = plan["world_size"]
            threads = max(1, cores // ranks)
            report = os.path.join(work, "comm.json")
            ms = median_step_ms(out, args.steps, threads, os.path.join(work, "m.jsonl"),
                                ["--comm-report", report])
            counted = json.load(open(os.path.join(work, "comm.rank0.json")))
            sent = sum(c["bytes_sent"] for c in counted["collectives"].values()) / counted["steps"]
            rows.append((name, ranks, threads, ms, sent))
            print(f"{name}: {ms:.1f} ms, {sent / 1e6:.2f} MB/step", file=sys.stderr)
    print("| layout | ranks x threads | step (ms) | bytes sent per rank per step |")
    print("|---|---|---|---|")
    for name, ranks, threads, ms, sent in rows:
        print(f"| {name} | {ranks} x {threads} | {ms:.1f} | {sent / 1e6:.2f} MB |")


if __name__ == "__main__":
    main()
