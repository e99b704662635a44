#!/usr/bin/env python3
"""Context parallelism: what a long sequence costs per rank at cp 1, 2, 4.

    /usr/bin/python3 bench/context_parallel.py [--steps N] [--skip-run]

Two parts, printed as markdown tables for docs/benchmarks.md:

1. Measured on this machine: a GPT (4 layers, hidden 256, 8 heads, vocab
   4096) on sequences of 2048 tokens, batch 2, compiled at cp1 (one rank,
   all cores as threads) and cp2 (two ranks, mpirun, the cores split), in
   balanced and in contiguous pieces. Per rank: the activations kept per
   microbatch (plan.json, equal to the textbook's), the bytes sent per
   step (the runtime's count) and the median step time. tp2 + sp, which
   splits the same activations over two ranks another way, is measured
   beside them.
2. Compiled only (--emit-only): GPT-3 175B's per-rank activation memory
   at tp8 x pp16 on sequences of 16384 tokens, for cp 1, 2, 4 and 8, with the
   bytes of the attention's key/value gathers, from plan.json. The CPU
   target's program (fp32 activations): the CUDA target refuses cp > 1.
"""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_layouts import ROOT, TESSEL, median_step_ms, run  # noqa: E402

SMALL = ["--set", "model.layers=4", "--set", "model.hidden=256", "--set", "model.heads=8",
         "--set", "model.kv_heads=8", "--set", "model.ffn_hidden=1024",
         "--set", "model.vocab_size=4096", "--set", "model.seq_len=2048",
         "--set", "train.global_batch=2"]
LAYOUTS = [("cp1", []), ("cp2, balanced", ["--cp", "2"]),
           ("cp2, contiguous", ["--cp", "2", "--set", 'parallel.cp_layout="contiguous"']),
           ("tp2 + sp", ["--tp", "2", "--sp"])]


def kept_bytes(plan):
    """Activations kept per microbatch in flight on program 0 (plan.json)."""
    return plan["programs"][sorted(plan["programs"])[0]]["memory"]["activation_slot_bytes"]


def measured(args, work):
    cores = os.cpu_count()
    rows = []
    for name, layout in LAYOUTS:
        out = os.path.join(work, name.replace(" ", "").replace(",", "-"))
        run([TESSEL, "compile", os.path.join(ROOT, "examples", "gpt-tiny.json"), "-o", out]
            + SMALL + layout)
        plan = json.load(open(os.path.join(out, "plan.json")))
        ranks = plan["world_size"]
        threads = max(1, cores // ranks)
        kept = kept_bytes(plan)
        ms = sent = float("nan")
        if not args.skip_run:
            report = os.path.join(work, "comm.json")
            ms = median_step_ms(out, args.steps, threads, out + ".jsonl",
                                ["--comm-report", report])
            counted = json.load(open(os.path.join(work, "comm.rank0.json")))
            sent = sum(c["bytes_sent"] for c in counted["collectives"].values()) / counted["steps"]
        rows.append((name, ranks, threads, kept, sent, ms))
        print(f"{name}: kept {kept / 1e6:.2f} MB, {sent / 1e6:.2f} MB/step, {ms:.1f} ms",
              file=sys.stderr)
    print("| layout | ranks x threads | activations kept per rank | bytes sent per rank per step | step (ms) |")
    print("|---|---|---|---|---|")
    for name, ranks, threads, kept, sent, ms in rows:
        print(f"| {name} | {ranks} x {threads} | {kept / 1e6:.2f} MB | {sent / 1e6:.2f} MB | {ms:.1f} |")


def compiled_only(work):
    spec = os.path.join(ROOT, "examples", "gpt3-175b.json")
    print()
    print("| cp | ranks | activations kept per microbatch, middle stage (plan / textbook) | "
          "in flight | cp bytes per rank per step | all bytes per rank per step |")
    print("|---|---|---|---|---|---|")
    for cp in (1, 2, 4, 8):
        out = os.path.join(work, f"g175-cp{cp}")
        run([TESSEL, "compile", spec, "--emit-only", "-o", out, "--tp", "8", "--sp",
             "--pp", "16", "--dp", "1", "--microbatches", "16", "--set", "model.seq_len=16384",
             "--set", "train.global_batch=16", "--recompute", "selective",
             "--cp", str(cp)])
        plan = json.load(open(os.path.join(out, "plan.json")))
        program = "stage1"
        memory = plan["programs"][program]["memory"]
        text = run([TESSEL, "inspect", out, "--memory"])
        ratio = "?"
        section = False
        for line in text.splitlines():
            if line.startswith("program "):
                section = line.split()[1] == program
            elif section and line.strip().startswith("kept per microbatch"):
                ratio = line.split()[7]
        comm = plan["programs"][program]["comm"]["per_step"]
        cp_bytes = sum(c.get("count", 1) * c["bytes_sent"] for c in comm if c["axes"] == "cp")
        total = sum(c.get("count", 1) * c["bytes_sent"] for c in comm)
        print(f"| {cp} | {plan['world_size']} | {memory['activation_slot_bytes'] / 1e9:.2f} GB "
              f"(ratio {ratio}) | {memory.get('activation_slots', 1):g} | {cp_bytes / 1e9:.2f} GB | "
              f"{total / 1e9:.2f} GB |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip-run", action="store_true",
                    help="compile only (no step times or counted bytes)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        measured(args, work)
        compiled_only(work)


if __name__ == "__main__":
    main()
