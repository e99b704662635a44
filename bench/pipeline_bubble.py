#!/usr/bin/env python3
"""Measured pipeline idle fraction next to the compile-time bubble.

    /usr/bin/python3 bench/pipeline_bubble.py

For each (pp, microbatches, virtual stages) it compiles a Llama (4 layers,
hidden 128) with the 1F1B or interleaved schedule, runs it with --trace, and measures per rank the fraction
of each step's pipeline phase (first forward to the update) spent not
computing: waiting in recv, or between steps. It prints that next to the
simulated bubble of the compiled schedule (forward 1, backward 2 time units;
`tessel inspect --schedule`) and (p-1)/(m+p-1). Prints a markdown table.
"""
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESSEL = os.path.join(ROOT, "build", "bin", "tessel")
MODEL = ["--set", "model.layers=4", "--set", "model.hidden=128", "--set", "model.heads=4",
         "--set", "model.kv_heads=4", "--set", "model.ffn_hidden=512",
         "--set", "model.seq_len=128", "--set", "train.global_batch=16"]


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"))
    if r.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def measured_idle(trace_path, skip_steps=2):
    events = [e for e in json.load(open(trace_path))["traceEvents"]
              if e["ph"] == "X"]
    # Steps end with an "update" span; split the events by them.
    steps, current = [], []
    for e in sorted(events, key=lambda e: e["ts"]):
        current.append(e)
        if e["name"] == "update":
            steps.append(current)
            current = []
    fractions = []
    for step in steps[skip_steps:]:
        compute = [e for e in step if e["name"] in ("forward", "backward")]
        update = next(e for e in step if e["name"] == "update")
        start = min(e["ts"] for e in compute)
        window = update["ts"] - start
        busy = sum(e["dur"] for e in compute)
        waited = sum(e["dur"] for e in step if e["name"] == "recv")
        fractions.append(1 - (busy - waited) / window)
    return sum(fractions) / len(fractions)


def main():
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for pp, m, v in [(2, 2, 1), (2, 4, 1), (2, 8, 1), (4, 4, 1), (4, 8, 1),
                         (2, 4, 2), (2, 8, 2)]:
            out = os.path.join(work, f"pp{pp}m{m}v{v}")
            schedule = ["--schedule", "interleaved", "--virtual-stages", str(v)] if v > 1 else []
            run([TESSEL, "compile", os.path.join(ROOT, "examples", "llama-tiny.json"), "-o", out,
                 "--pp", str(pp), "--microbatches", str(m)] + schedule + MODEL)
            text = run([TESSEL, "inspect", out, "--schedule"])
            simulated = float(text.split("bubble fraction ")[-1].split()[0])
            trace = os.path.join(work, "trace.json")
            run([TESSEL, "run", out, "--steps", "6", "--trace", trace, "--quiet"])
            idle = [measured_idle(os.path.join(work, f"trace.rank{r}.json")) for r in range(pp)]
            rows.append((pp, m, v, simulated, (pp - 1) / (m + pp - 1), idle))
            print(f"pp{pp} m{m} v{v}: simulated {simulated:.3f}, measured "
                  + ", ".join(f"{x:.3f}" for x in idle), file=sys.stderr)
    print("| pp | microbatches | schedule | (p-1)/(m+p-1) | compile-time bubble | measured idle per rank |")
    print("|---|---|---|---|---|---|")
    for pp, m, v, sim, formula, idle in rows:
        name = f"interleaved, {v} virtual stages" if v > 1 else "1F1B"
        print(f"| {pp} | {m} | {name} | {formula:.3f} | {sim:.3f} | "
              + ", ".join(f"{x:.3f}" for x in idle) + " |")


if __name__ == "__main__":
    main()
