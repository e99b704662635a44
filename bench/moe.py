#!/usr/bin/env python3
"""Step time and all-to-all bytes of a mixture-of-experts model on the CPU,
beside PyTorch eager on the same model.

    /usr/bin/python3 bench/moe.py [--steps N] [--spec SPEC]

Tessel at ep1 (one rank, every core a thread), at ep2 (the experts split
over two ranks, the tokens exchanged by all-to-all) and at dp2 (the experts
replicated on both ranks), each with cores/ranks threads per rank; PyTorch
(test/e2e/torch_reference.py, the independent reference of the same model)
on one process with every core. Bytes are what each rank's runtime counted
per step (rank 0; the all-to-alls move what the routing sends, the plan
lists the most they can). Prints a markdown table for docs/benchmarks.md.
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
LAYOUTS = [("ep1", []), ("ep2", ["--ep", "2"]), ("dp2 (experts replicated)", ["--dp", "2"]),
           ("tp2 + sp (experts whole)", ["--tp", "2", "--sp"]),
           ("tp2 + sp, expert_tp 2", ["--tp", "2", "--sp", "--set", "parallel.expert_tp=2"])]


def run(cmd, env=None):
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--spec", default=os.path.join(ROOT, "examples", "mixtral-tiny.json"))
    args = ap.parse_args()
    cores = os.cpu_count()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        tokens = os.path.join(work, "tokens.bin")
        run([TESSEL, "data", "synth", "-o", tokens, "--tokens", "200000", "--seed", "7"])
        for name, layout in LAYOUTS:
            out = os.path.join(work, f"layout{len(rows)}")
            run([TESSEL, "compile", args.spec, "-o", out] + layout)
            ranks = json.load(open(os.path.join(out, "plan.json")))["world_size"]
            threads = max(1, cores // ranks)
            metrics = os.path.join(work, "m.jsonl")
            report = os.path.join(work, "comm.json")
            env = dict(os.environ, OMP_NUM_THREADS=str(threads),
                       OPENBLAS_NUM_THREADS=str(threads))
            run([TESSEL, "run", out, "--steps", str(args.steps), "--data", tokens,
                 "--metrics", metrics, "--comm-report", report, "--threads", str(threads),
                 "--quiet"], env)
            steps = [json.loads(l) for l in open(metrics)]
            ms = statistics.median(s["step_ms"] for s in steps[2:])
            counted = json.load(open(os.path.join(work, "comm.rank0.json")))
            per_step = {k: c["bytes_sent"] / counted["steps"]
                        for k, c in counted["collectives"].items()}
            rows.append((f"Tessel {name}", f"{ranks} x {threads}", ms,
                         per_step["all_to_all"], sum(per_step.values())))
            print(f"{name}: {ms:.1f} ms", file=sys.stderr)
        init = os.path.join(work, "init.safetensors")
        run(["/usr/bin/python3", REFERENCE, "--spec", args.spec, "--write-init", init])
        res = json.loads(run(["/usr/bin/python3", REFERENCE, "--spec", args.spec,
                              "--init-from", init, "--data", tokens, "--steps",
                              str(args.steps), "--threads", str(cores), "--bench"]).splitlines()[-1])
        rows.append(("PyTorch eager (one process)", f"1 x {cores}", res["step_ms"], 0, 0))
    print("| run | ranks x threads | step (ms) | all-to-all bytes per rank per step | all collectives |")
    print("|---|---|---|---|---|")
    for name, shape, ms, a2a, total in rows:
        print(f"| {name} | {shape} | {ms:.1f} | {a2a / 1e6:.3f} MB | {total / 1e6:.3f} MB |")


if __name__ == "__main__":
    main()
