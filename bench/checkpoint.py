#!/usr/bin/env python3
"""What a sharded checkpoint costs: GPT-2 124M (shortened sequences, so that
a CPU step takes seconds) on one rank and at dp2, checkpointing every 4 of
12 steps into --ckpt-dir, against the same run without checkpoints, side by
side with the disk's own `dd` bandwidth.

    /usr/bin/python3 bench/checkpoint.py [--work DIR] [--steps N] [--every N]

Per checkpoint, from the metrics: the training thread's snapshot of the
state (`ckpt_snapshot_ms`) and commit (`ckpt_commit_ms`: gathering the
ranks' records, the manifest and `latest` written and synced), the
background write (`ckpt_write_ms`, `ckpt_bytes` per rank), and the step time
while a write is in flight against the median step without checkpoints.
Then the load: a resume's check (CRC-32 of every file it reads) and read,
against `dd`'s read. And the memory: the largest rank's peak (resident
growth past start-up, from --comm-report) without and with checkpoints.
The layouts include ZeRO-1 and ZeRO-3 at dp2, whose ranks write their
pieces as they hold them. Prints markdown for docs/benchmarks.md.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESSEL = os.path.join(ROOT, "build", "bin", "tessel")
SHORT = ["--set", "model.seq_len=64", "--set", "train.global_batch=4",
         "--set", "data.format=synthetic"]


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    if r.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r.stdout + r.stderr


LAYOUTS = {"1rank": [], "dp2": ["--dp", "2"],
           "dp2-zero1": ["--dp", "2", "--zero", "1"],
           "dp2-zero3": ["--dp", "2", "--zero", "3"]}


def peak_mb(report):
    """The largest rank's resident growth past start-up (--comm-report)."""
    base, ext = os.path.splitext(report)
    peaks = []
    for rank in range(64):
        path = f"{base}.rank{rank}{ext}"
        if not os.path.exists(path):
            break
        m = json.load(open(path))["memory"]
        peaks.append(m["rss_peak_bytes"] - m["rss_before_bytes"])
    return max(peaks) / 1e6


def dd_bandwidth(work):
    """MB/s of a 1 GiB synced write and of reading it back (cold if the page
    cache can be dropped, else from the cache, and said so)."""
    path = os.path.join(work, "dd.bin")
    out = run(["dd", "if=/dev/zero", f"of={path}", "bs=16M", "count=64",
               "conv=fsync"])
    write = float(re.search(r"([0-9.]+) s, ", out).group(1))
    cold = False
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        cold = True
    except OSError:
        pass
    out = run(["dd", f"if={path}", "of=/dev/null", "bs=16M"])
    read = float(re.search(r"([0-9.]+) s, ", out).group(1))
    os.remove(path)
    return 1073.741824 / write, 1073.741824 / read, cold


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--work", default=None)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--layouts", default="1rank,dp2,dp2-zero1,dp2-zero3",
                   help="comma-separated, of " + ", ".join(LAYOUTS))
    args = p.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="tessel-ckpt-bench-")
    os.makedirs(work, exist_ok=True)
    dd_write, dd_read, cold = dd_bandwidth(work)
    print(f"disk (dd, 1 GiB): write {dd_write:.0f} MB/s with fsync, read "
          f"{dd_read:.0f} MB/s ({'cold' if cold else 'page cache'})\n")
    print("| layout | step, no checkpoints | step while writing | snapshot | commit | "
          "write per rank | write throughput per rank | load (check + read) | "
          "load throughput | peak memory, no checkpoints / with |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.layouts.split(","):
        layout = LAYOUTS[name]
        d = os.path.join(work, name)
        run([TESSEL, "compile", os.path.join(ROOT, "examples", "gpt2-124m.json"),
             *SHORT, *layout, "-o", d])
        plain = os.path.join(work, "plain.jsonl")
        run([TESSEL, "run", d, "--steps", str(args.steps), "--metrics", plain, "--quiet",
             "--comm-report", os.path.join(work, "plain.json")])
        peak_plain = peak_mb(os.path.join(work, "plain.json"))
        base = statistics.median(r["step_ms"] for r in map(json.loads, open(plain))
                                 if r["step"] >= 2)
        ckpt = os.path.join(work, "ckpt-" + name)
        shutil.rmtree(ckpt, ignore_errors=True)
        metrics = os.path.join(work, "ckpt.jsonl")
        run([TESSEL, "run", d, "--steps", str(args.steps), "--ckpt-dir", ckpt,
             "--ckpt-every", str(args.every), "--metrics", metrics, "--quiet",
             "--comm-report", os.path.join(work, "ckpt.json")])
        peak_ckpt = peak_mb(os.path.join(work, "ckpt.json"))
        rows = [json.loads(l) for l in open(metrics)]
        # A checkpoint starts after every --every steps; the next step trains
        # while the write runs.
        stall = statistics.median(r["ckpt_snapshot_ms"] for r in rows
                                  if "ckpt_snapshot_ms" in r)
        waits = [r["ckpt_wait_ms"] for r in rows if "ckpt_wait_ms" in r]
        if waits:
            print(f"(a write outlasted {args.every} steps: waited {max(waits):.0f} ms)")
        during = statistics.median(r["step_ms"] for r in rows
                                   if r["step"] % args.every == 0 and r["step"] > 0)
        writes = [r for r in rows if "ckpt_write_ms" in r]
        commit = statistics.median(r["ckpt_commit_ms"] for r in writes)
        write_ms = statistics.median(r["ckpt_write_ms"] for r in writes)
        write_mb = statistics.median(r["ckpt_bytes"] for r in writes) / 1e6
        last = os.path.join(ckpt, "step-%08d" % args.steps)
        total_mb = sum(os.path.getsize(os.path.join(last, f))
                       for f in os.listdir(last)) / 1e6
        if cold:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        out = run([TESSEL, "run", d, "--steps", str(args.steps + 1), "--resume",
                   last])
        load = float(re.search(r"checked and read in ([0-9.]+) s", out).group(1))
        print(f"| {name} | {base:.0f} ms | {during:.0f} ms | {stall:.0f} ms | {commit:.0f} ms | "
              f"{write_mb:.0f} MB in {write_ms:.0f} ms | {write_mb / write_ms * 1000:.0f} MB/s | "
              f"{total_mb:.0f} MB in {load:.2f} s | {total_mb / load:.0f} MB/s | "
              f"{peak_plain:.0f} / {peak_ckpt:.0f} MB |")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
