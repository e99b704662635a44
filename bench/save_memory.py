#!/usr/bin/env python3
"""Peak host memory of each rank while `--save-final` writes one file.

    /usr/bin/python3 bench/save_memory.py [--model examples/gpt2-124m.json]

For each layout it compiles the model and runs it for zero steps twice,
without and with `--save-final`, sampling every rank's VmHWM (peak
resident set) from /proc every 5 ms until the rank exits. The difference
is what the save adds on that rank. Prints a markdown table with the
model's fp32 bytes and its largest tensor's for scale.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESSEL = os.path.join(ROOT, "build", "bin", "tessel")
LAYOUTS = [["--pp", "2"], ["--pp", "4"], ["--pp", "2", "--tp", "2"], ["--dp", "2", "--zero", "3"]]


def world_rank(pid):
    """The MPI world rank of process `pid` (0 for a one-rank run)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(b"OMPI_COMM_WORLD_RANK="):
                    return int(item.split(b"=", 1)[1])
    except OSError:
        pass
    return 0


def peaks_while(cmd, binaries):
    """Runs `cmd`; returns {world rank: last VmHWM in bytes} of the
    processes whose executable is one of `binaries`."""
    seen = {}
    ranks = {}
    done = threading.Event()

    def sample():
        while not done.is_set():
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    if os.readlink(f"/proc/{pid}/exe") not in binaries:
                        continue
                    if pid not in ranks:
                        ranks[pid] = world_rank(pid)
                    with open(f"/proc/{pid}/status") as f:
                        for line in f:
                            if line.startswith("VmHWM:"):
                                seen[ranks[pid]] = int(line.split()[1]) * 1024
                except OSError:
                    pass
            time.sleep(0.005)

    t = threading.Thread(target=sample)
    t.start()
    r = subprocess.run(cmd, capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1"))
    done.set()
    t.join()
    if r.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return seen


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "examples", "gpt2-124m.json"))
    args = ap.parse_args()
    print("| layout | ranks | model (fp32) | largest tensor | rank 0: peak without the save | with it | added | largest added on another rank |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for layout in LAYOUTS:
            out = os.path.join(tmp, "_".join(layout).replace("-", ""))
            subprocess.run([TESSEL, "compile", args.model, "-o", out,
                            "--set", "data={\"format\": \"synthetic\"}",
                            # A small step, so that the peak before the
                            # save is the model's state, not activations.
                            "--set", "model.seq_len=64",
                            "--set", "train.global_batch=4"] + layout,
                           check=True, capture_output=True)
            plan = json.load(open(os.path.join(out, "plan.json")))
            binaries = {os.path.realpath(os.path.join(out, "bin", f))
                        for f in os.listdir(os.path.join(out, "bin"))}
            ranks = len(plan["ranks"])
            base = peaks_while([TESSEL, "run", out, "--steps", "0", "--quiet"], binaries)
            saved = os.path.join(tmp, "w.safetensors")
            withsave = peaks_while([TESSEL, "run", out, "--steps", "0", "--quiet",
                                    "--save-final", saved], binaries)
            # The file's tensors: the model's bytes and its largest tensor.
            with open(saved, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            spans = [v["data_offsets"][1] - v["data_offsets"][0]
                     for k, v in header.items() if k != "__metadata__"]
            os.remove(saved)
            added = {r: withsave[r] - base[r] for r in withsave if r in base}
            other_added = max((v for r, v in added.items() if r != 0), default=0)
            rank0_base, rank0_with = base[0], withsave[0]
            mb = lambda v: f"{v / 2**20:.0f} MB"
            print(f"| {' '.join(layout)} | {ranks} | {mb(sum(spans))} | {mb(max(spans))} | "
                  f"{mb(rank0_base)} | {mb(rank0_with)} | {mb(rank0_with - rank0_base)} | "
                  f"{mb(other_added)} |")


if __name__ == "__main__":
    main()
