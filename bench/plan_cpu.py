#!/usr/bin/env python3
"""tessel plan on this machine, checked by running what it ranked.

    /usr/bin/python3 bench/plan_cpu.py [--steps N] [--candidates K]

Calibrates this machine as 2 ranks x cores/2 threads, asks `tessel plan
--cluster` for the GPT of bench/cpu_layouts.py on 2 ranks (CPU target),
then compiles, trains (median step over steps 3..N) each layout it
simulated and prints its simulated and measured steps side by side, with
the ranks of both orders, as markdown for docs/benchmarks.md.
"""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_layouts import MODEL, ROOT, TESSEL, median_step_ms, run  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--candidates", type=int, default=6)
    ap.add_argument("--spec", default=os.path.join(ROOT, "examples", "gpt-tiny.json"))
    args = ap.parse_args()
    ranks = 2
    threads = max(1, (os.cpu_count() or 2) // ranks)
    with tempfile.TemporaryDirectory() as work:
        cluster = os.path.join(work, "cpu.json")
        print(run([TESSEL, "calibrate", "-o", cluster, "--ranks", str(ranks),
                   "--threads", str(threads)]).strip(), file=sys.stderr)
        sets = [a for a in MODEL if a != "--set"]
        cmd = [TESSEL, "plan", args.spec, "--gpus", str(ranks), "--cluster", cluster,
               "--target", "cpu", "--candidates", str(args.candidates), "--json"]
        for s in sets:
            cmd += ["--set", s]
        plan = json.loads(run(cmd))
        print(f"plan: searched {plan['searched']}, compiled {plan['compiled']} in "
              f"{plan['seconds']:.1f} s", file=sys.stderr)
        rows = []
        for i, r in enumerate(x for x in plan["ranked"] if x["fits"]):
            l = r["layout"]
            out = os.path.join(work, f"c{i}")
            flags = ["--dp", str(l["dp"]), "--tp", str(l["tp"]), "--pp", str(l["pp"]),
                     "--microbatches", str(l["microbatches"]), "--schedule", l["schedule"],
                     "--recompute", l["recompute"], "--zero", str(l["zero"])]
            if l["virtual_stages"] > 1:
                flags += ["--virtual-stages", str(l["virtual_stages"])]
            if l["sequence_parallel"]:
                flags += ["--sp"]
            run([TESSEL, "compile", args.spec, "-o", out] + MODEL + flags)
            measured = median_step_ms(out, args.steps, threads,
                                      os.path.join(work, f"m{i}.jsonl"))
            rows.append((r["describe"], r["step_time_s"] * 1e3, measured))
            print(f"{r['describe']}: simulated {r['step_time_s'] * 1e3:.1f} ms, "
                  f"measured {measured:.1f} ms", file=sys.stderr)
    by_measured = sorted(range(len(rows)), key=lambda i: rows[i][2])
    print("| plan's rank | layout | simulated step (ms) | measured step (ms) | "
          "simulated / measured | measured rank |")
    print("|---|---|---|---|---|---|")
    for i, (name, sim, measured) in enumerate(rows):
        print(f"| {i + 1} | {name} | {sim:.1f} | {measured:.1f} | {sim / measured:.2f} | "
              f"{by_measured.index(i) + 1} |")


if __name__ == "__main__":
    main()
