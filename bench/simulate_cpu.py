#!/usr/bin/env python3
"""The simulator against measured steps on this machine's CPU.

    /usr/bin/python3 bench/simulate_cpu.py [--steps N]

Calibrates a CPU cluster description for each way the layouts use the
cores (one rank with every core as a thread; N ranks with cores/N threads
each), then for each layout of bench/cpu_layouts.py (and pipeline layouts)
compiles the same GPT, trains it (median step over steps 3..N) and replays
the compiled step with `tessel simulate --cluster` (the description of its
ranks x threads). Prints a markdown table for docs/benchmarks.md with the
ratio simulated / measured.
"""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_layouts import MODEL, ROOT, TESSEL, median_step_ms, run  # noqa: E402

# The layouts of bench/cpu_layouts.py and two more.
LAYOUTS = [("dp1", []), ("dp2", ["--dp", "2"]), ("tp2", ["--tp", "2"]),
           ("tp2 + sp", ["--tp", "2", "--sp"]),
           ("pp2, 4 microbatches", ["--pp", "2", "--microbatches", "4"]),
           ("dp2, zero 1", ["--dp", "2", "--zero", "1"])]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--spec", default=os.path.join(ROOT, "examples", "gpt-tiny.json"))
    args = ap.parse_args()
    cores = os.cpu_count()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        clusters = {}
        for name, layout in LAYOUTS:
            out = os.path.join(work, name.replace(" ", "").replace(",", "_"))
            run([TESSEL, "compile", args.spec, "-o", out] + MODEL + layout)
            plan = json.load(open(os.path.join(out, "plan.json")))
            ranks = plan["world_size"]
            threads = max(1, cores // ranks)
            if ranks not in clusters:
                path = os.path.join(work, f"cpu-{ranks}x{threads}.json")
                print(run([TESSEL, "calibrate", "-o", path, "--ranks", str(ranks),
                           "--threads", str(threads)]).strip(), file=sys.stderr)
                clusters[ranks] = path
            measured = median_step_ms(out, args.steps, threads,
                                      os.path.join(work, "m.jsonl"))
            sim = json.loads(run([TESSEL, "simulate", out, "--cluster", clusters[ranks],
                                  "--json"]))
            simulated = sim["step_time_s"] * 1e3
            p0 = sim["programs"][0]
            rows.append((name, ranks, threads, measured, simulated, p0))
            print(f"{name}: measured {measured:.1f} ms, simulated {simulated:.1f} ms "
                  f"({simulated / measured:.2f})", file=sys.stderr)
    print("| layout | ranks x threads | measured step (ms) | simulated step (ms) | "
          "simulated / measured | simulated compute / optimizer / exposed comm / bubble (ms, rank 0) |")
    print("|---|---|---|---|---|---|")
    for name, ranks, threads, measured, simulated, p0 in rows:
        parts = " / ".join(f"{p0[k] * 1e3:.1f}" for k in
                           ("compute_s", "optimizer_s", "exposed_comm_s", "bubble_s"))
        print(f"| {name} | {ranks} x {threads} | {measured:.1f} | {simulated:.1f} | "
              f"{simulated / measured:.2f} | {parts} |")


if __name__ == "__main__":
    main()
