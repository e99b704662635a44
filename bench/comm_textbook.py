#!/usr/bin/env python3
"""Bytes each layout moves per rank and step, beside the textbook's.

    /usr/bin/python3 bench/comm_textbook.py [--skip-175b]

Compiles (with --emit-only: no C++ is built) a mid-size GPT (8 layers,
hidden 512) at several layouts and GPT-3 175B (examples/gpt3-175b.json) at
tp8 x pp16 x dp8 with sequence parallelism and 192 microbatches, then prints,
per layout and program (the first, a middle and the last pipeline stage), the
bytes per group of mesh axes from `tessel inspect --comm --textbook`: the
plan's prediction (what the runtime counts), the textbook's and their ratio.
Also reports the compile time and the size of plan.json. Prints markdown for
docs/benchmarks.md.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESSEL = os.path.join(ROOT, "build", "bin", "tessel")
MID = [os.path.join(ROOT, "examples", "gpt-tiny.json"),
       "--set", "model.layers=8", "--set", "model.hidden=512", "--set", "model.heads=8",
       "--set", "model.kv_heads=8", "--set", "model.ffn_hidden=2048",
       "--set", "model.vocab_size=8192", "--set", "model.seq_len=256",
       "--set", "train.global_batch=16"]
LAYOUTS = [
    ("mid GPT dp2, 1 microbatch", MID + ["--dp", "2"]),
    ("mid GPT dp2, 4 microbatches", MID + ["--dp", "2", "--microbatches", "4"]),
    ("mid GPT dp2 x tp2 + sp, 4 microbatches", MID + ["--dp", "2", "--tp", "2", "--sp",
                                                      "--microbatches", "4"]),
    ("mid GPT pp2, 4 microbatches", MID + ["--pp", "2", "--microbatches", "4"]),
    ("mid GPT dp2 x tp2 x pp2 + sp, 8 microbatches",
     MID + ["--dp", "2", "--tp", "2", "--pp", "2", "--sp", "--microbatches", "8"]),
    ("mid GPT dp8 x tp2 + sp", MID + ["--dp", "8", "--tp", "2", "--sp",
                                      "--set", "train.global_batch=64"]),
]
GPT3 = ("GPT-3 175B tp8 x pp16 x dp8 + sp, 192 microbatches",
        [os.path.join(ROOT, "examples", "gpt3-175b.json"), "--target", "cuda"])


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def parse(text):
    """program -> [(axes, predicted, textbook, ratio)]"""
    tables, program = {}, None
    for line in text.splitlines():
        words = line.split()
        if line.startswith("program "):
            program = words[1]
            tables[program] = []
        elif len(words) == 4 and words[0] != "axes":
            tables[program].append(tuple(words))
    return tables


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-175b", action="store_true")
    args = ap.parse_args()
    layouts = LAYOUTS + ([] if args.skip_175b else [GPT3])
    print("| layout | program | axes | predicted (MB) | textbook (MB) | ratio |")
    print("|---|---|---|---|---|---|")
    notes = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, (name, flags) in enumerate(layouts):
            out = os.path.join(tmp, str(k))
            start = time.time()
            run([TESSEL, "compile", *flags, "--emit-only", "-o", out])
            seconds = time.time() - start
            plan_mb = os.path.getsize(os.path.join(out, "plan.json")) / 1e6
            notes.append(f"{name}: compiled in {seconds:.1f} s, plan.json {plan_mb:.2f} MB")
            tables = parse(run([TESSEL, "inspect", out, "--comm", "--textbook"]))
            programs = sorted(tables, key=lambda p: int(p[5:]) if p.startswith("stage") else 0)
            shown = programs if len(programs) <= 2 else \
                [programs[0], programs[len(programs) // 2], programs[-1]]
            for program in shown:
                for axes, predicted, book, ratio in tables[program]:
                    print(f"| {name} | {program} | {axes} | {float(predicted) / 1e6:.2f} | "
                          f"{float(book) / 1e6:.2f} | {ratio} |")
    print()
    for n in notes:
        print(f"- {n}")


if __name__ == "__main__":
    main()
