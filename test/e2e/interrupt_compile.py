#!/usr/bin/env python3
"""Interrupts a `tessel compile` with a signal once it has started writing
its output and checks that nothing is left: no DIR.tmp-PID staging
directory and no DIR.

    interrupt_compile.py SPEC DIR [--signal TERM]
"""
import argparse
import glob
import os
import random
import signal
import subprocess
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("dir")
    ap.add_argument("--signal", default="TERM")
    args = ap.parse_args()
    # A vocabulary size no earlier compile used, so that the binary is built
    # (not taken from the build cache) and there is time to interrupt it.
    vocab = random.SystemRandom().randrange(1000, 1000000)
    compile_ = subprocess.Popen(["tessel", "compile", args.spec, "-o", args.dir,
                                 "--set", f"model.vocab_size={vocab}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    staging = f"{args.dir}.tmp-{compile_.pid}"
    # Wait until the compile builds its binary (its source is written).
    deadline = time.time() + 120
    while not glob.glob(os.path.join(staging, "src", "*")):
        if compile_.poll() is not None or time.time() > deadline:
            sys.exit(f"FAIL: the compile ended (rc {compile_.returncode}) before it could be interrupted")
        time.sleep(0.05)
    compile_.send_signal(getattr(signal, "SIG" + args.signal))
    rc = compile_.wait(timeout=60)
    time.sleep(0.5)
    left = glob.glob(args.dir + ".tmp-*") + ([args.dir] if os.path.exists(args.dir) else [])
    if left:
        sys.exit(f"FAIL: left behind after SIG{args.signal}: {left}")
    if rc == 0:
        sys.exit("FAIL: an interrupted compile reported success")
    print(f"compile interrupted by SIG{args.signal} (rc {rc}); nothing left")


if __name__ == "__main__":
    main()
