#!/usr/bin/env python3
"""tessel plan's choices for a 1.3B and a 175B GPT on 64 and 1,024 DGX A100
GPUs, beside Megatron-LM's layout for the same model and GPU count.

    /usr/bin/python3 bench/plan.py

For each case `tessel plan` searches the spec's layouts, compiles and
simulates the most promising that fit 80 GB, and simulates Megatron's layout
(--include: tensor parallel within a node, pipeline stages as the model
needs to fit, full activation recomputation, no sequence parallelism, as
Narayanan et al. SC21 train). Prints the best, the runner-up, Megatron's
layout with their simulated steps and the plan's wall time, as markdown for
docs/benchmarks.md.
"""
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESSEL = os.path.join(ROOT, "build", "bin", "tessel")
EX = os.path.join(ROOT, "examples")

# (name, spec, GPUs, global batch, Megatron's layout)
CASES = [
    ("GPT 1.3B", "gpt-1.3b.json", 64, 512, "tp=1,pp=1,mbs=4,zero=0,recompute=full"),
    ("GPT 1.3B", "gpt-1.3b.json", 1024, 1024, "tp=1,pp=1,mbs=1,zero=0,recompute=full"),
    ("GPT-3 175B", "gpt3-175b.json", 64, 1536, "tp=8,pp=8,mbs=1,zero=0,recompute=full,sp=false"),
    ("GPT-3 175B", "gpt3-175b.json", 1024, 1536, "tp=8,pp=16,mbs=1,zero=0,recompute=full,sp=false"),
]


def main():
    print("| model | GPUs | batch | | layout | simulated step (s) | TFLOP/s per GPU | MFU "
          "| memory per GPU | plan's wall time |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, spec, gpus, batch, megatron in CASES:
        t0 = time.time()
        r = subprocess.run([TESSEL, "plan", os.path.join(EX, spec), "--gpus", str(gpus),
                            "--gpu", "a100-80g", "--global-batch", str(batch),
                            "--include", megatron, "--json"], capture_output=True, text=True)
        wall = time.time() - t0
        if r.returncode:
            sys.exit(r.stdout + r.stderr)
        plan = json.loads(r.stdout)
        ranked = [x for x in plan["ranked"] if x["fits"]]
        rows = [("best", ranked[0]), ("runner-up", ranked[1])]
        rows += [("Megatron's", x) for x in plan["ranked"] if x["included"]]
        for label, x in rows:
            print(f"| {name} | {gpus} | {batch} | {label} | {x['describe']} | "
                  f"{x['step_time_s']:.3f} | {x['tflops_per_gpu']:.1f} | {100 * x['mfu']:.1f}% | "
                  f"{x['memory_bytes'] / 1e9:.1f} GB | {wall:.1f} s |")
        print(f"{name} on {gpus}: {plan.get('why', '')} (searched {plan['searched']}, "
              f"compiled {plan['compiled']})", file=sys.stderr)


if __name__ == "__main__":
    main()
