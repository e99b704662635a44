#!/usr/bin/env python3
"""Stops a running `tessel run` with a signal, as Slurm or a shell does, and
checks that the whole job ends: tessel exits and no rank of the job is left.

    stop_job.py TESSEL DIR [--signal TERM]
"""
import argparse
import os
import signal
import subprocess
import sys
import threading
import time


def ranks_left(bindir):
    """Processes still running a binary of the job."""
    left = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if argv0.startswith(bindir):
            left.append(int(pid))
    return left


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tessel")
    ap.add_argument("dir")
    ap.add_argument("--signal", default="TERM")
    args = ap.parse_args()
    bindir = os.path.join(os.path.abspath(args.dir), "bin") + "/"
    job = subprocess.Popen([args.tessel, "run", args.dir, "--steps", "100000000"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # Wait until the job trains (a step line), so every rank is running.
    for line in job.stdout:
        if line.startswith("step"):
            break
    else:
        sys.exit(f"FAIL: the job ended before training: rc {job.wait()}")
    # The rest of the output is drained aside: orphaned ranks would keep the
    # pipe open.
    threading.Thread(target=job.stdout.read, daemon=True).start()
    sig = getattr(signal, "SIG" + args.signal)
    job.send_signal(sig)
    try:
        rc = job.wait(timeout=60)
    except subprocess.TimeoutExpired:
        job.kill()
        sys.exit(f"FAIL: tessel run did not end within 60 s of SIG{args.signal}")
    deadline = time.time() + 30
    while ranks_left(bindir) and time.time() < deadline:
        time.sleep(0.2)
    left = ranks_left(bindir)
    if left:
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        sys.exit(f"FAIL: ranks {left} kept running after tessel ended")
    print(f"tessel run ended with exit code {rc} after SIG{args.signal}; no rank left")
    if rc == 0:
        sys.exit("FAIL: a stopped job reported success")


if __name__ == "__main__":
    main()
