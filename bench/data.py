#!/usr/bin/env python3
"""Whether the data loader keeps up: the tokens per second `tessel data bench`
reads from a 1 GB llm.c token file (GPT-2's vocabulary, 1024-token
sequences, batches of 8), in order and shuffled, from the page cache and
cold (when the page cache can be dropped), as 4 shards too, against the
tokens per second GPT-2 124M trains at on this CPU (from
docs/benchmarks.md's first table) and what a GPU would need.

    /usr/bin/python3 bench/data.py [--work DIR]

Prints markdown for docs/benchmarks.md.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESSEL = os.path.join(ROOT, "build", "bin", "tessel")
TOKENS = 500_000_000


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def drop_caches():
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def bench(path, steps, shuffle=None):
    cmd = [TESSEL, "data", "bench", path, "--vocab", "50257", "--seq-len", "1024",
           "--batch", "8", "--steps", str(steps)]
    if shuffle is not None:
        cmd += ["--shuffle", str(shuffle)]
    out = run(cmd)
    return float(re.search(r"([0-9]+) tokens/s", out).group(1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--work", default=None)
    args = p.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="tessel-data-bench-")
    os.makedirs(work, exist_ok=True)
    big = os.path.join(work, "tokens.bin")
    run([TESSEL, "data", "synth", "-o", big, "--vocab", "50257", "--tokens", str(TOKENS)])
    shards = os.path.join(work, "shards")
    os.makedirs(shards, exist_ok=True)
    for k in range(4):
        run([TESSEL, "data", "synth", "-o", os.path.join(shards, f"shard-{k}.bin"),
             "--vocab", "50257", "--tokens", str(TOKENS // 4), "--seed", str(k + 1)])
    steps = TOKENS // (8 * 1024) - 1  # one pass over the file
    rows = []
    for name, path in [("one file", big), ("4 shards", shards)]:
        for order, shuffle in [("in order", None), ("shuffled", 7)]:
            cold = drop_caches()
            first = bench(path, steps, shuffle)
            cached = bench(path, steps, shuffle)
            rows.append((name, order, first, cold, cached))
    print("| data | order | first pass | page cache |")
    print("|---|---|---|---|")
    for name, order, first, cold, cached in rows:
        print(f"| {name} (1 GB) | {order} | {first / 1e6:.0f} M tokens/s "
              f"({'cold' if cold else 'cache not dropped'}) | {cached / 1e6:.0f} M tokens/s |")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
