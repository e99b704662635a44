#!/usr/bin/env python3
"""Assertions of the end-to-end tests: each subcommand exits non-zero with a
message that says what differed when the property does not hold."""
import argparse
import fcntl
import glob
import json
import math
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402


def metrics_losses(path):
    with open(path) as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


def fail(message):
    print("FAIL: " + message)
    sys.exit(1)


def finite_pairs(a, b):
    """Two runs' per-step values without the steps where neither is finite
    (a skipped step: null in Tessel's metrics, nan in the reference's), and
    those steps; a step finite in one run only fails."""
    def bad(x):
        return x is None or not math.isfinite(x)
    kept_a, kept_b, skipped = [], [], []
    for s, (x, y) in enumerate(zip(a, b)):
        if bad(x) != bad(y):
            fail(f"step {s}: {x} vs {y}: not finite in one run only")
        if bad(x):
            skipped.append(s)
        else:
            kept_a.append(x)
            kept_b.append(y)
    return kept_a, kept_b, skipped


def compare(args):
    """Per-step losses of a tessel run against the PyTorch reference."""
    ref = json.load(open(args.reference))["losses"]
    got = metrics_losses(args.metrics)
    if len(ref) != len(got):
        fail(f"{len(got)} tessel steps vs {len(ref)} reference steps")
    ref, got, skipped = finite_pairs(ref, got)
    worst = max(abs(a - b) / abs(a) for a, b in zip(ref, got))
    print(f"steps {len(ref) + len(skipped)}: largest relative loss difference {worst:.3e}"
          + (f"; steps {skipped} not finite in both" if skipped else ""))
    if worst > args.rtol:
        for s, (a, b) in enumerate(zip(ref, got)):
            print(f"  step {s}: reference {a:.7f} tessel {b:.7f}")
        fail(f"losses differ by {worst:.3e} > {args.rtol}")
    if args.moe:
        compare_moe(json.load(open(args.reference)), args.metrics, args.rtol)


def compare_moe(ref, metrics_path, rtol):
    """An MoE run's metrics against the reference: the loss's parts
    (lm_loss, aux_loss, z_loss) per step to rtol, the dropped assignments
    (summed over the layers) exactly, and every layer's assignments per
    expert adding up to tokens x top_k."""
    with open(metrics_path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    for key, ref_key in (("lm_loss", "lm_losses"), ("aux_loss", "aux_losses"),
                         ("z_loss", "z_losses")):
        if not any(ref[ref_key]):
            continue
        got = [m[key] for m in lines]
        worst = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(ref[ref_key], got))
        print(f"{key}: largest relative difference {worst:.3e}")
        if worst > rtol:
            fail(f"{key} differs by {worst:.3e} > {rtol}")
    dropped = [int(sum(m.get("expert_dropped", []))) for m in lines]
    if dropped != ref["dropped"]:
        fail(f"dropped assignments per step: tessel {dropped}, reference {ref['dropped']}")
    routed = {sum(sum(layer) for layer in m["expert_tokens"]) // len(m["expert_tokens"])
              for m in lines}
    rates = [m["drop_rate"] for m in lines]
    print(f"dropped assignments per step equal ({min(dropped)} to {max(dropped)}), "
          f"{routed.pop() if len(routed) == 1 else sorted(routed)} assignments per layer, "
          f"drop rate {min(rates):.4f} to {max(rates):.4f}")


def falls(args):
    """The loss falls clearly: the mean of the last steps is far below the first."""
    losses = metrics_losses(args.metrics)
    first, last = losses[0], float(np.mean(losses[-10:]))
    print(f"first loss {first:.4f}, mean of last 10 {last:.4f}")
    if not last < first - args.drop:
        fail(f"loss fell by {first - last:.4f}, expected more than {args.drop}")


def same_tensors(args):
    """Two safetensors files hold the same tensors, bit for bit."""
    a, b = safetensors_io.load_file(args.a), safetensors_io.load_file(args.b)
    if sorted(a) != sorted(b):
        fail(f"tensor names differ: {sorted(set(a) ^ set(b))}")
    for name in sorted(a):
        if a[name].shape != b[name].shape or not np.array_equal(a[name], b[name]):
            fail(f"tensor {name} differs")
    print(f"{len(a)} tensors identical")


def close_tensors(args):
    """Two safetensors files hold the same tensors: each element within rtol
    of the tensor's largest magnitude (AdamW turns rounding differences in
    near-zero gradients into relative differences of small weights)."""
    a, b = safetensors_io.load_file(args.a), safetensors_io.load_file(args.b)
    if sorted(a) != sorted(b):
        fail(f"tensor names differ: {sorted(set(a) ^ set(b))}")
    worst = 0.0
    for name in sorted(a):
        if a[name].shape != b[name].shape:
            fail(f"tensor {name}: shape {list(a[name].shape)} vs {list(b[name].shape)}")
        x, y = a[name].astype(np.float64), b[name].astype(np.float64)
        # Elements that are not finite (a poisoned row that no update
        # touched) must be the same in both; the rest are compared.
        finite = np.isfinite(y)
        if not np.array_equal(np.isfinite(x), finite) or not np.array_equal(
                x[~finite], y[~finite], equal_nan=True):
            fail(f"tensor {name}: its elements that are not finite differ")
        x, y = x[finite], y[finite]
        scale = float(np.max(np.abs(y))) + args.atol if y.size else 1.0
        diff = float(np.max(np.abs(x - y))) / scale if x.size else 0.0
        worst = max(worst, diff)
        if diff > args.rtol:
            fail(f"tensor {name} differs by {diff:.3e} > {args.rtol}")
    print(f"{len(a)} tensors within {args.rtol} (largest difference {worst:.1e})")


def close_losses(args):
    """Two runs' per-step losses agree within rtol."""
    def values(path):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return [r[args.key] for r in rows if args.key in r]

    a, b = values(args.a), values(args.b)
    if len(a) != len(b) or not a:
        fail(f"{len(a)} vs {len(b)} values of {args.key}")
    a, b, skipped = finite_pairs(a, b)
    if skipped:
        print(f"steps {skipped} not finite in both")
    worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    if worst > args.rtol:
        fail(f"losses differ by {worst:.3e} > {args.rtol}: {a[:4]} vs {b[:4]}")
    print(f"{len(a)} losses within {args.rtol}")


def same_losses(args):
    """Two runs produced bitwise identical per-step losses."""
    a, b = metrics_losses(args.a), metrics_losses(args.b)
    if a != b:
        fail(f"losses differ: {a[:5]} ... vs {b[:5]} ...")
    print(f"{len(a)} identical losses")


TEXTBOOK = {
    # bytes each rank sends under the ring algorithms, from the call's
    # element count (as the runtime counts it) and group size g
    "all_reduce": lambda n, g, b: 2 * (g - 1) * n * b // g,
    "all_gather": lambda n, g, b: (g - 1) * n * b,
    "reduce_scatter": lambda n, g, b: (g - 1) * (n // g) * b,
    # point-to-point: the whole buffer, once
    "send_recv": lambda n, g, b: n * b,
}


def comm(args):
    """Counted collectives equal the compile-time prediction, and the
    prediction equals the textbook volume of each collective."""
    plan = json.load(open(args.plan))
    predicted = {}  # program -> collective -> totals per step
    for name, program in plan["programs"].items():
        totals = predicted.setdefault(name, {})
        for call in program["comm"]["per_step"]:
            expect = TEXTBOOK[call["collective"]](call["elements"], call["group"],
                                                  call["element_bytes"])
            if call["bytes_sent"] != expect:
                fail(f"predicted {call['bytes_sent']} bytes for {call}, textbook says {expect}")
            # A collective a part runs per microbatch is listed once, with
            # how many times a step runs it.
            count = call.get("count", 1)
            t = totals.setdefault(call["collective"], {"calls": 0, "elements": 0, "bytes_sent": 0})
            t["calls"] += count
            t["elements"] += count * call["elements"]
            t["bytes_sent"] += count * call["bytes_sent"]
    base, ext = os.path.splitext(args.report)
    zero = {"calls": 0, "elements": 0, "bytes_sent": 0}
    for rank in range(plan["world_size"]):
        program = plan["ranks"][rank]["program"]
        report = json.load(open(f"{base}.rank{rank}{ext}"))
        steps = report["steps"]
        for kind, counted in report["collectives"].items():
            want = {k: v * steps for k, v in predicted[program].get(kind, zero).items()}
            if counted != want:
                fail(f"rank {rank} ({program}) {kind}: counted {counted}, predicted {want}")
    print(f"{plan['world_size']} ranks: counted collectives equal the prediction: "
          + "; ".join(f"{p}: " + ", ".join(f"{k} {v}" for k, v in sorted(t.items()))
                      for p, t in sorted(predicted.items())))


def memory(args):
    """Each rank's resident memory grew by the plan's total for its program
    when it allocated its stores (within 1%), and at its peak while training
    (within the tolerance: what the runtime holds beside the plan, BLAS
    packing buffers, MPI's and message copies, stays below it)."""
    plan = json.load(open(args.plan))
    base, ext = os.path.splitext(args.report)
    for rank in range(plan["world_size"]):
        program = plan["ranks"][rank]["program"]
        planned = plan["programs"][program]["memory"]["total_bytes"]
        m = json.load(open(f"{base}.rank{rank}{ext}"))["memory"]
        allocated = m["rss_allocated_bytes"] - m["rss_before_bytes"]
        peak = m["rss_peak_bytes"] - m["rss_before_bytes"]
        print(f"rank {rank} ({program}): planned {planned / 1e6:.1f} MB, allocated "
              f"{allocated / 1e6:.1f} MB ({allocated / planned:.3f}), peak "
              f"{peak / 1e6:.1f} MB ({peak / planned:.3f})")
        if abs(allocated / planned - 1) > 0.01:
            fail(f"rank {rank}: the stores took {allocated} bytes, the plan says {planned}")
        if abs(peak / planned - 1) > args.tolerance:
            fail(f"rank {rank}: resident memory grew {peak} bytes, the plan says {planned}")


def snapshot_memory(args):
    """What checkpointing costs a rank's memory: its peak rises above the
    same run's without checkpoints by at most one snapshot (the bytes of the
    file it wrote) and --tolerance of its plan."""
    plan = json.load(open(args.plan))
    latest = open(os.path.join(args.ckpt, "latest")).read().strip()
    files = json.load(open(os.path.join(args.ckpt, latest, "manifest.json")))["files"]
    def peak(report, rank):
        base, ext = os.path.splitext(report)
        m = json.load(open(f"{base}.rank{rank}{ext}"))["memory"]
        return m["rss_peak_bytes"] - m["rss_before_bytes"]
    for rank in range(plan["world_size"]):
        program = plan["ranks"][rank]["program"]
        planned = plan["programs"][program]["memory"]["total_bytes"]
        snapshot = files[f"rank-{rank:05d}.safetensors"]["bytes"]
        more = peak(args.report, rank) - peak(args.without, rank)
        print(f"rank {rank}: {more / 1e6:.1f} MB more with checkpoints, snapshot "
              f"{snapshot / 1e6:.1f} MB ({snapshot / planned:.2f} of the plan)")
        if more > snapshot + args.tolerance * planned:
            fail(f"rank {rank}: checkpoints took {more} bytes more, its snapshot is "
                 f"{snapshot} bytes")


def textbook(args):
    """Every group of `tessel inspect --comm --textbook` moves the textbook
    bytes: ratio within the tolerance, no group the textbook lacks."""
    rows = 0
    program = None
    for line in sys.stdin:
        words = line.split()
        if line.startswith("program "):
            program = words[1]
            continue
        if len(words) != 4 or words[0] == "axes":
            continue
        group, predicted, book, ratio = words
        rows += 1
        if ratio == "extra" or abs(float(ratio) - 1) > args.tolerance:
            fail(f"{program} {group}: predicted {predicted} bytes, textbook {book} (ratio {ratio})")
    if rows == 0:
        fail("no rows compared")
    print(f"{rows} groups within {args.tolerance} of the textbook")


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


def stop_run(args):
    """Stops a running `tessel run` with a signal, as Slurm or a shell does:
    tessel exits with a failure code and no rank of the job is left."""
    sig = getattr(signal, "SIG" + args.signal)
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


def hang_run(args):
    """Stops one rank of a running job (SIGSTOP: a hung rank, as far as the
    others can tell): the job ends by the watchdog's limit with a message
    naming a waiting rank, what it waits for and the step, and no rank (the
    stopped one included) is left."""
    bindir = os.path.join(os.path.abspath(args.dir), "bin") + "/"
    job = subprocess.Popen([args.tessel, "run", args.dir, "--steps", "100000000",
                            "--timeout", str(args.timeout)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in job.stdout:
        if line.startswith("step"):
            break
    else:
        sys.exit(f"FAIL: the job ended before training: rc {job.wait()}")
    reader = threading.Thread(target=lambda: lines.extend(job.stdout), daemon=True)
    reader.start()
    ranks = sorted(ranks_left(bindir))
    if len(ranks) < 2:
        job.kill()
        sys.exit(f"FAIL: expected at least 2 ranks, found {ranks}")
    stopped = time.time()
    os.kill(ranks[-1], signal.SIGSTOP)
    try:
        rc = job.wait(timeout=args.timeout + 60)
    except subprocess.TimeoutExpired:
        for pid in ranks_left(bindir):
            os.kill(pid, signal.SIGKILL)
        job.kill()
        sys.exit(f"FAIL: the job did not end within {args.timeout + 60} s of a rank stopping")
    ended = time.time() - stopped
    reader.join(timeout=10)
    deadline = time.time() + 30
    while ranks_left(bindir) and time.time() < deadline:
        time.sleep(0.2)
    left = ranks_left(bindir)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    if left:
        sys.exit(f"FAIL: ranks {left} were left after the job ended")
    if rc == 0:
        sys.exit("FAIL: a job with a hung rank reported success")
    if ended < args.timeout:
        sys.exit(f"FAIL: the job ended after {ended:.1f} s, before the limit")
    for line in lines:
        if "error: waited" in line:
            print(line.strip())
    print(f"the job ended {'within' if ended < args.timeout + 30 else 'after'} "
          f"the limit + 30 s; no rank left")


def save_rescue(args):
    """Removes the directory of --save-final while the job trains: the save
    at the end fails there and the weights land in $TMPDIR, which the error
    names; the rescued file holds every parameter."""
    target = os.path.join(args.work, "target")
    rescue = os.path.join(args.work, "rescue")
    os.makedirs(target, exist_ok=True)
    os.makedirs(rescue, exist_ok=True)
    env = dict(os.environ, TMPDIR=rescue)
    job = subprocess.Popen([args.tessel, "run", args.dir, "--steps", str(args.steps),
                            "--save-final", os.path.join(target, "w.safetensors")],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=env)
    lines = []
    for line in job.stdout:
        lines.append(line)
        if line.startswith("step"):
            break
    shutil.rmtree(target)
    lines.extend(job.stdout)
    rc = job.wait()
    if rc == 0:
        sys.exit("FAIL: a save that did not reach its file reported success")
    message = [l.strip() for l in lines if "saved in" in l]
    rescued = glob.glob(os.path.join(rescue, "w.rescued-*.safetensors"))
    if not message or len(rescued) != 1 or os.path.basename(rescued[0]) not in message[0]:
        sys.exit(f"FAIL: no rescued file named in the output: {message} {rescued}")
    print(message[0].replace(rescue, "RESCUE").replace(target, "TARGET"))
    shutil.copy(rescued[0], args.rescued)


def state_step(path):
    """The step a --save-state file holds, or -1 while there is none."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            return int(json.loads(f.read(n))["__metadata__"]["steps"])
    except (OSError, ValueError, KeyError):
        return -1


def committed_step(root):
    """The step of the newest committed checkpoint under `root`, or -1."""
    steps = [-1]
    for d in glob.glob(os.path.join(root, "step-*")):
        try:
            steps.append(json.load(open(os.path.join(d, "manifest.json")))["step"])
        except (OSError, ValueError, KeyError):
            pass
    return max(steps)


def crash_resume(args):
    """Kills a run (SIGKILL, every rank) once its periodic state reaches
    --after steps, resumes from that state, and checks the resumed steps'
    losses equal the uninterrupted run's (bitwise: same layout). With
    --sharded the state is a checkpoint directory (--ckpt-dir), whose
    writes run in the background: the kill may fall in one."""
    state = os.path.join(args.work, "state.safetensors")
    saving = ["--save-state", state, "--checkpoint-every", str(args.every)]
    step_of = state_step
    if args.sharded:
        state = os.path.join(args.work, "ckpt")
        saving = ["--ckpt-dir", state, "--ckpt-every", str(args.every)]
        step_of = committed_step
    straight = os.path.join(args.work, "straight.jsonl")
    resumed = os.path.join(args.work, "resumed.jsonl")
    subprocess.run([args.tessel, "run", args.dir, "--steps", str(args.steps),
                    "--metrics", straight, "--quiet"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    bindir = os.path.join(os.path.abspath(args.dir), "bin") + "/"
    # What each run says is kept beside its state, so that a failure can be
    # read after the kills' random moments are gone.
    killed_log = open(os.path.join(args.work, "killed.log"), "w")
    # The killed run writes its metrics into a pipe that is read here a
    # line or two at a time, between looks at its state: its leader flushes
    # a line per step and blocks on a full pipe, so the run is never more
    # than the pipe's few lines ahead of this loop, however the machine's
    # load schedules the two (a loaded machine can leave this process
    # waiting for longer than the whole run takes).
    paced = os.path.join(args.work, "paced-metrics")
    os.mkfifo(paced)
    pace = os.open(paced, os.O_RDONLY | os.O_NONBLOCK)
    fcntl.fcntl(pace, fcntl.F_SETPIPE_SZ, 4096)
    job = subprocess.Popen([args.tessel, "run", args.dir, "--steps", str(args.steps),
                            *saving, "--metrics", paced, "--quiet"],
                           stdout=killed_log, stderr=subprocess.STDOUT,
                           start_new_session=True)
    while step_of(state) < args.after:
        if job.poll() is not None:
            sys.exit(f"FAIL: the run ended (rc {job.returncode}) before its state reached "
                     f"step {args.after}")
        if not select.select([pace], [], [], 0.05)[0]:
            continue
        try:
            if not os.read(pace, 256):
                time.sleep(0.005)  # no writer yet
        except BlockingIOError:
            pass
    os.killpg(job.pid, signal.SIGKILL)
    for pid in ranks_left(bindir):
        os.kill(pid, signal.SIGKILL)
    job.wait()
    # A signal is delivered after kill() returns: a rank may still commit a
    # checkpoint it was writing until it is gone, so the state is read once
    # no rank is left.
    deadline = time.time() + 30
    while ranks_left(bindir) and time.time() < deadline:
        time.sleep(0.01)
    os.close(pace)
    step = step_of(state)
    if step >= args.steps:
        sys.exit("FAIL: the run finished before it could be killed")
    killed_log.close()
    again = subprocess.run([args.tessel, "run", args.dir, "--steps", str(args.steps),
                            "--resume", state, "--metrics", resumed, "--quiet"],
                           capture_output=True, text=True)
    if again.returncode:
        sys.exit(f"FAIL: the resumed run ended with rc {again.returncode} (killed at "
                 f"step {step}):\n{again.stdout}{again.stderr}\nthe killed run said:\n"
                 + open(killed_log.name).read())
    a = [json.loads(l) for l in open(straight)]
    b = [json.loads(l) for l in open(resumed)]
    if [r["step"] for r in b] != list(range(step, args.steps)):
        sys.exit(f"FAIL: the resumed run ran steps {b[0]['step']}..{b[-1]['step']}, "
                 f"not {step}..{args.steps - 1}")
    if [r["loss"] for r in a[step:]] != [r["loss"] for r in b]:
        sys.exit(f"FAIL: the resumed losses (from step {step}) differ from the "
                 f"uninterrupted run's:\n{again.stdout}{again.stderr}")
    print(f"killed with the state at a multiple of {args.every} steps; resumed there: "
          f"{args.steps - step} losses identical to the uninterrupted run's")


def kill_restarts(args):
    """SIGKILLs a random rank of a job at a random moment, --kills times, while
    `tessel run --max-restarts` (or the launch script, --launch mpirun or
    slurm) starts the job again from its newest committed checkpoint each
    time; the finished job's losses and final parameters equal the
    uninterrupted run's bitwise."""
    work = args.work
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    subprocess.run(["tessel", "run", args.dir, "--steps", str(args.steps),
                    "--metrics", f"{work}/straight.jsonl",
                    "--save-final", f"{work}/straight.safetensors", "--quiet"],
                   check=True, **quiet)
    ckpt = f"{work}/ckpt"
    log_path = f"{work}/job.log"
    launch = {"tessel": ["tessel", "run", args.dir],
              "mpirun": ["sh", f"{args.dir}/launch/mpirun.sh"],
              "slurm": ["sbatch", "--wait", f"--output={log_path}",
                        f"{args.dir}/launch/slurm.sbatch"]}[args.launch]
    with open(log_path if args.launch != "slurm" else f"{work}/sbatch.log", "w") as log:
        job = subprocess.Popen(
            launch + ["--steps", str(args.steps),
                      "--ckpt-dir", ckpt, "--ckpt-every", str(args.every),
                      "--max-restarts", str(args.kills), "--metrics", f"{work}/job.jsonl",
                      "--save-final", f"{work}/job.safetensors", "--quiet",
                      *(["--elastic"] if args.elastic else [])],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    bindir = os.path.join(os.path.abspath(args.dir), "bin") + "/"
    if args.elastic:
        # Also the ranks of the plans compiled for the restarts (DIR.elastic-dpN).
        bindir = os.path.abspath(args.dir)
    rng = random.SystemRandom()
    killed, last = 0, -1

    def restarted():
        try:
            return len(re.findall(r": restart [0-9]+ of ", open(log_path).read()))
        except OSError:
            return 0
    while killed < args.kills:
        # Once the job has started again after the last kill (the other
        # ranks of a killed job may still commit the checkpoint they were
        # writing, which is no progress of the new one) and committed a
        # checkpoint since, at a random moment, a random rank.
        step = committed_step(ckpt)
        if job.poll() is not None:
            sys.exit(f"FAIL: the job ended (rc {job.returncode}) after {killed} kills:\n"
                     + open(log_path).read())
        if restarted() < killed or step <= last or \
                step >= args.steps - 4 * args.every:
            time.sleep(0.005)
            continue
        time.sleep(rng.uniform(0, 0.05))
        ranks = ranks_left(bindir)
        if not ranks:
            continue
        try:
            os.kill(rng.choice(ranks), signal.SIGKILL)
        except ProcessLookupError:
            continue
        killed, last = killed + 1, step
    rc = job.wait(timeout=600)
    log = open(log_path).read()
    if rc:
        sys.exit(f"FAIL: the job ended with rc {rc}:\n{log}")
    restarts = len(re.findall(r": restart [0-9]+ of ", log))
    if restarts != args.kills:
        sys.exit(f"FAIL: {restarts} restarts logged for {args.kills} kills:\n{log}")
    a = [json.loads(l) for l in open(f"{work}/straight.jsonl")]
    b = [json.loads(l) for l in open(f"{work}/job.jsonl")]
    if args.elastic:
        # Another layout after each restart: equal within the tolerance.
        if [r["step"] for r in a] != [r["step"] for r in b]:
            sys.exit("FAIL: the elastic job's steps differ from the uninterrupted run's")
        worst = max(abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b))
        p = safetensors_io.load_file(f"{work}/straight.safetensors")
        q = safetensors_io.load_file(f"{work}/job.safetensors")
        scale = max(float(np.abs(p[k]).max()) for k in p)
        params = max(float(np.abs(p[k] - q[k]).max()) for k in p) / scale
        # Losses to the equivalence tolerance; the parameters to 1e-4 of the
        # largest magnitude, as the layouts' roundings accumulate over the
        # run's hundreds of steps.
        if sorted(p) != sorted(q) or worst > 1e-5 or params > 1e-4:
            sys.exit(f"FAIL: the elastic job differs from the uninterrupted run: "
                     f"losses {worst:.2e}, parameters {params:.2e} (relative)")
        print(f"{args.kills} ranks killed, {restarts} restarts on fewer ranks: losses within "
              "1e-5 and final parameters within 1e-4 of the uninterrupted run's")
        return
    if [(r["step"], r["loss"]) for r in a] != [(r["step"], r["loss"]) for r in b]:
        sys.exit("FAIL: the restarted job's losses differ from the uninterrupted run's")
    if open(f"{work}/job.safetensors", "rb").read() != \
            open(f"{work}/straight.safetensors", "rb").read():
        sys.exit("FAIL: the restarted job's final parameters differ from the "
                 "uninterrupted run's")
    print(f"{args.kills} ranks killed, {restarts} restarts: losses and final "
          "parameters identical to the uninterrupted run's")


def stop_compile(args):
    """Interrupts a `tessel compile` building its binary: neither its
    DIR.tmp-PID staging directory nor DIR is left."""
    sig = getattr(signal, "SIG" + args.signal)
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
            sys.exit(f"FAIL: the compile ended (rc {compile_.returncode}) "
                     "before it could be interrupted")
        time.sleep(0.05)
    compile_.send_signal(sig)
    rc = compile_.wait(timeout=60)
    time.sleep(0.5)
    left = glob.glob(args.dir + ".tmp-*") + ([args.dir] if os.path.exists(args.dir) else [])
    if left:
        sys.exit(f"FAIL: left behind after SIG{args.signal}: {left}")
    if rc == 0:
        sys.exit("FAIL: an interrupted compile reported success")
    print(f"compile interrupted by SIG{args.signal} (rc {rc}); nothing left")


IN_FLIGHT = {
    # kind: call that starts one, its flight on the collectives track, its
    # wait on the program's track
    "gather": ("allGatherShardsStart(", "all_gather_shards", "gather wait"),
    "reduce": ("reduceScatterPieceStart(", "reduce_scatter_piece",
               "reduce wait"),
    # ZeRO-1 and 2: each run's gather of the last update's pieces, started
    # at the step's start and in flight under its first forward parts
    "update-gather": ("allGatherShardsStart(", "all_gather_shards",
                      "gather wait"),
    # tensor parallelism's collectives in flight under a GEMM
    "tp-gather": ("allGatherAlongStart(", "all_gather_start", "gather wait"),
    "tp-reduce": ("reduceScatterAlongStart(", "reduce_scatter_start",
                  "reduce wait"),
    # a gather done piece by piece under the GEMMs (collective matmul)
    "tp-shift": ("shiftStart(", "shift_start", "shift wait"),
    # the gradients' data-parallel reductions started in a backward part
    # (all-reduced, or reduce-scattered into ZeRO-1's pieces)
    "dp-reduce": ("allReduceSumStart(", "all_reduce_start", "all-reduce wait"),
    "dp-shard": ("reduceScatterShardsStart(", "reduce_scatter_shards_start",
                  "shards wait"),
}

# Kinds whose compute is counted up to the wait for the start's own request
# slot (the others' up to the next wait of any).
OWN_WAIT = {"update-gather", "tp-gather", "tp-reduce", "tp-shift",
            "dp-reduce", "dp-shard"}


def prefetch(args):
    """Collectives in flight while a rank computes, in its trace: ZeRO-3's
    prefetched gathers (`--kind gather`) or ZeRO-2's reductions (`--kind
    reduce`). Each one the planned program starts is drawn on the
    collectives track with its group and bytes, and the rank waited for it
    only inside the time it was in flight, after it began. Also counts, in
    the program, the started ones followed by a kernel before their wait
    (those the rank computes on meanwhile)."""
    call, flight, waited = IN_FLIGHT[args.kind]
    source = open(args.program).read()
    functions = dict(re.findall(
        r"^(?:static )?void (\w+)\(StepContext[^)]*\) \{\n(.*?)^\}", source,
        re.S | re.M))
    if args.kind == "update-gather":
        # Started by the training step itself (the evaluation step starts
        # its own), each waited for in a part on its first run or in the
        # step: in flight under compute when a kernel comes before its wait
        # in that part.
        step = functions.get("trainStep", "")
        slots = re.findall(r"allGatherShardsStart\(.*\n\s*gRequests\[(\d+)\] = ",
                           step)
        if not slots:
            fail(f"{args.program}'s trainStep starts no {args.kind}")
        started, overlapped = len(slots), 0
        for slot in slots:
            for name, body in functions.items():
                load = re.search(rf"(\w+) = gRequests\[{slot}\];", body)
                if name in ("trainStep", "evalStep", "syncParams") or not load:
                    continue
                before = body[:load.start()]
                overlapped += bool(re.search(
                    r"^\s*(?!CommRequest|gRequests|commWait|TraceSpan)\w+\(",
                    before, re.M))
                break
    else:
        pieces = source.split(call)[1:]
        started = len(pieces)
        if not started:
            fail(f"{args.program} starts no {args.kind}")
    # A kernel call between the start and the next commWait (for the
    # tensor-parallel kinds and the update's gathers, the wait for its own
    # request slot).
    def before_wait(p):
        rest = p.split("\n", 1)[1]
        slot = re.match(r"\s*gRequests\[(\d+)\] = ", rest)
        if args.kind in OWN_WAIT and slot:
            return rest.split(f"= gRequests[{slot.group(1)}];")[0]
        return rest.split("commWait(")[0]
    if args.kind != "update-gather":
        overlapped = sum(
            bool(re.search(r"^\s*(?!CommRequest|gRequests|commWait)\w+\(",
                           before_wait(p), re.M))
            for p in pieces)
    events = [e for e in json.load(open(args.trace))["traceEvents"]
              if e["ph"] == "X"]
    flights = sorted((e for e in events if e["tid"] == 1
                      and e["name"] == flight),
                     key=lambda e: e["ts"])
    waits = sorted((e for e in events if e["name"] == waited),
                   key=lambda e: e["ts"])
    steps = sum(e["name"] == "update" for e in events)
    if len(flights) != started * steps:
        fail(f"{len(flights)} {args.kind}s in flight in {steps} steps, "
             f"expected {started} per step")
    if len(waits) > len(flights):
        fail(f"more {waited}s than {args.kind}s")
    for f in flights:
        if f["args"]["group"] != args.group or f["args"]["bytes"] <= 0:
            fail(f"{args.kind} without its group or bytes: {f}")
    for w in waits:
        f = next((f for f in flights if f["ts"] <= w["ts"] and
                  w["ts"] + w["dur"] <= f["ts"] + f["dur"] + 1e-3), None)
        if f is None:
            fail(f"a {waited} outside every {args.kind}'s flight: {w}")
        if not w["ts"] > f["ts"]:
            fail(f"a {args.kind} waited for as soon as it started: {f}")
    if args.kind == "gather":
        print(f"{len(flights)} gathers prefetched over {steps} steps")
    elif args.kind in OWN_WAIT:
        print(f"{len(flights)} {args.kind}s in flight over {steps} steps, "
              f"{overlapped} of {started} a step with compute before the wait")
    else:
        print(f"{len(flights)} reductions in flight over {steps} steps, "
              f"{overlapped} of {started} a step with compute before the wait")


def merged_trace(args):
    """`tessel trace merge`: one process per rank, every event of every rank
    file there with its time moved onto the host's clock (time 0: the first
    rank to leave the start barrier), blocking collectives with their group
    and bytes, and the clocks aligned: the ranks of a data-parallel group
    leave each gradient all-reduce together (median difference of its end
    under --within ms)."""
    merged = json.load(open(args.merged))["traceEvents"]
    base, ext = os.path.splitext(args.trace)
    files = sorted(glob.glob(f"{base}.rank*{ext}"))
    names = {e["pid"]: e["args"]["name"] for e in merged
             if e["ph"] == "M" and e["name"] == "process_name"}
    if sorted(names) != list(range(len(files))) or \
            any(names[r] != f"rank {r}" for r in names):
        fail(f"processes {names} for {len(files)} rank files")
    by_rank = {}
    traces = [json.load(open(f)) for f in files]
    zero = min(t["otherData"]["clock_origin_us"] + t["otherData"]["sync_us"] for t in traces)
    for t in traces:
        rank, origin = t["otherData"]["rank"], t["otherData"]["clock_origin_us"]
        want = sorted((e["name"], e["tid"], round(e["ts"] + origin - zero, 3))
                      for e in t["traceEvents"] if e["ph"] == "X")
        got = sorted((e["name"], e["tid"], round(e["ts"], 3)) for e in merged
                     if e["ph"] == "X" and e["pid"] == rank)
        if want != got:
            fail(f"rank {rank}: {len(got)} merged events differ from its file's {len(want)}")
        by_rank[rank] = [e for e in merged if e["ph"] == "X" and e["pid"] == rank]
    reduces = {r: sorted((e for e in ev if e["name"] == "all_reduce" and e["tid"] == 0
                          and e["args"].get("group") == args.group
                          and e["args"].get("bytes", 0) > 0), key=lambda e: e["ts"])
               for r, ev in by_rank.items()}
    a, b = args.peers
    if not reduces[a] or len(reduces[a]) != len(reduces[b]):
        fail(f"ranks {a} and {b}: {len(reduces[a])} and {len(reduces[b])} all-reduces "
             f"over {args.group} with their bytes")
    gaps = sorted(abs((x["ts"] + x["dur"]) - (y["ts"] + y["dur"])) / 1e3
                  for x, y in zip(reduces[a], reduces[b]))
    median = gaps[len(gaps) // 2]
    if median > args.within:
        fail(f"ranks {a} and {b} end their all-reduces {median:.3f} ms apart "
             f"(median), more than {args.within} ms: the clocks are not aligned")
    print(f"{len(files)} ranks merged; {len(gaps)} all-reduces over {args.group} end "
          f"together within {args.within} ms (median)")


def resume_matrix(args):
    """Sharded checkpoints resume at any layout: each layout trains --half
    steps of --steps into a checkpoint directory; every layout resumes from
    every checkpoint. Same layout: the losses and the final parameters equal
    the uninterrupted run's bitwise. Another layout: the losses equal the
    uninterrupted first layout's within --tolerance."""
    def run(layout, *extra):
        r = subprocess.run(["tessel", "run", layout, "--steps", str(args.steps),
                            "--quiet", *extra], capture_output=True, text=True)
        if r.returncode:
            fail(f"tessel run {layout} {' '.join(extra)} failed:\n{r.stderr}")
    def losses(path):
        return [json.loads(l)["loss"] for l in open(path)]
    work = args.work
    straight = {}
    for k, layout in enumerate(args.layouts):
        run(layout, "--metrics", f"{work}/straight{k}.jsonl",
            "--save-final", f"{work}/straight{k}.safetensors")
        straight[k] = losses(f"{work}/straight{k}.jsonl")[args.half:]
        run(layout, "--stop-after", str(args.half), "--ckpt-dir", f"{work}/ckpt{k}")
    reference = straight[0]
    worst = 0.0
    for a in range(len(args.layouts)):
        for b, layout in enumerate(args.layouts):
            out = f"{work}/from{a}to{b}"
            run(layout, "--resume", f"{work}/ckpt{a}", "--metrics", out + ".jsonl",
                "--save-final", out + ".safetensors")
            got = losses(out + ".jsonl")
            if len(got) != args.steps - args.half:
                fail(f"{layout} resumed from {args.layouts[a]} ran {len(got)} steps")
            if a == b:
                if got != straight[b]:
                    fail(f"{layout}: the resumed losses differ from the uninterrupted "
                         f"run's: {got} vs {straight[b]}")
                if open(out + ".safetensors", "rb").read() != \
                        open(f"{work}/straight{b}.safetensors", "rb").read():
                    fail(f"{layout}: the resumed final parameters differ from the "
                         "uninterrupted run's")
            worst = max(worst, max(abs(x - y) / abs(y) for x, y in zip(got, reference)))
    if worst > args.tolerance:
        fail(f"a resumed run's loss differs from the uninterrupted run's by {worst:.2e} "
             f"(relative), more than {args.tolerance}")
    n = len(args.layouts)
    print(f"{n} layouts, {n * n} resumes: same layout bitwise, "
          f"across layouts within {args.tolerance}")


def png_colors(args):
    """Decodes an 8-bit RGB(A) PNG (zlib, the five scanline filters) and
    prints its size and how many distinct colours cover at least
    --min-pixels pixels each: a blank or failed screenshot has one or two."""
    import struct
    import zlib
    data = open(args.png, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        fail(f"{args.png} is not a PNG")
    at, idat, width = 8, b"", 0
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        chunk = data[at + 8:at + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", chunk[:10])
            if depth != 8 or colour not in (2, 6):
                fail(f"{args.png}: depth {depth}, colour type {colour} not handled")
            bpp = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += chunk
        at += 12 + length
    raw = zlib.decompress(idat)
    stride = width * bpp
    prev = bytearray(stride)
    counts = {}
    for y in range(height):
        line = raw[y * (stride + 1):(y + 1) * (stride + 1)]
        f, cur = line[0], bytearray(line[1:])
        for i in range(stride):
            a = cur[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                cur[i] = (cur[i] + a) & 255
            elif f == 2:
                cur[i] = (cur[i] + b) & 255
            elif f == 3:
                cur[i] = (cur[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                cur[i] = (cur[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        for x in range(0, stride, bpp * args.sample):
            px = bytes(cur[x:x + 3])
            counts[px] = counts.get(px, 0) + 1
        prev = cur
    colours = sum(1 for n in counts.values() if n >= args.min_pixels)
    print(f"{width}x{height}, {colours} colours")
    for hex_colour in args.expect:
        px = bytes.fromhex(hex_colour.lstrip("#"))
        n = counts.get(px, 0)
        print(f"{hex_colour}: {'present' if n >= args.min_pixels else 'absent'}")


def zero_router(args):
    """A copy of a safetensors file with every MoE router weight
    (*.gate.weight of rank 2) zero: every router probability ties, so every
    token goes to experts 0 .. top_k - 1."""
    tensors = safetensors_io.load_file(args.src)
    zeroed = 0
    for name, t in tensors.items():
        if name.endswith(".gate.weight") and t.ndim == 2:
            tensors[name] = np.zeros_like(t)
            zeroed += 1
    if not zeroed:
        fail(f"{args.src} has no router weights")
    safetensors_io.save_file(tensors, args.dst)
    print(f"zeroed {zeroed} routers")


def poison(args):
    """A bad sample: row `row` of tensor `tensor` set to +inf in a copy of the
    weights, and an llm.c token file of `count` tokens below `vocab` with
    token `row` only at the positions `at` (so only the steps that read
    them meet it)."""
    tensors = safetensors_io.load_file(args.src)
    tensors[args.tensor][args.row, :] = np.inf
    safetensors_io.save_file(tensors, args.dst, safetensors_io.load_metadata(args.src))
    tokens = np.random.default_rng(args.seed).integers(0, args.vocab, size=args.count)
    tokens = tokens.astype(np.uint16)
    tokens[args.at] = args.row
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (20240520, 1, args.count)
    with open(args.tokens, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.tobytes())
    print(f"{args.tensor}[{args.row}] = inf; token {args.row} at {args.at} only")


def skipped(args):
    """The steps a run's metrics mark skipped are exactly `steps`, with the
    learning rate of each equal to the next step's (the schedule follows
    the updates applied)."""
    with open(args.metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    marked = [r["step"] for r in rows if r.get("skipped")]
    if marked != args.steps:
        fail(f"skipped steps {marked}, expected {args.steps}")
    for k, r in enumerate(rows[:-1]):
        if r.get("skipped") and r["lr"] != rows[k + 1]["lr"]:
            fail(f"step {r['step']} skipped but the next step's lr "
                 f"{rows[k + 1]['lr']} is not its {r['lr']}")
    print(f"steps {marked} skipped, the schedule held")


def a2a_bytes(args):
    """Every rank's counted all-to-all bytes per step equal `expect`."""
    base, ext = os.path.splitext(args.report)
    for rank in range(args.ranks):
        report = json.load(open(f"{base}.rank{rank}{ext}"))
        counted = report["collectives"]["all_to_all"]["bytes_sent"] / report["steps"]
        if counted != args.expect:
            fail(f"rank {rank}: {counted} all-to-all bytes per step, expected {args.expect}")
    print(f"{args.ranks} ranks: {args.expect} all-to-all bytes per step each")


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("compare")
    p.add_argument("reference")
    p.add_argument("metrics")
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--moe", action="store_true",
                   help="also the MoE metrics: the loss's parts and the drops")
    p.set_defaults(run=compare)
    p = sub.add_parser("poison")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--tensor", required=True)
    p.add_argument("--row", type=int, required=True)
    p.add_argument("--tokens", required=True)
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--at", type=int, nargs="+", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=poison)
    p = sub.add_parser("skipped")
    p.add_argument("metrics")
    p.add_argument("--steps", type=int, nargs="*", default=[])
    p.set_defaults(run=skipped)
    p = sub.add_parser("falls")
    p.add_argument("metrics")
    p.add_argument("--drop", type=float, default=1.0)
    p.set_defaults(run=falls)
    p = sub.add_parser("png-colors")
    p.add_argument("png")
    p.add_argument("--min-pixels", type=int, default=50)
    p.add_argument("--sample", type=int, default=1)
    p.add_argument("--expect", nargs="*", default=[])
    p.set_defaults(run=png_colors)
    p = sub.add_parser("zero-router")
    p.add_argument("src")
    p.add_argument("dst")
    p.set_defaults(run=zero_router)
    p = sub.add_parser("a2a-bytes")
    p.add_argument("report")
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--expect", type=int, required=True)
    p.set_defaults(run=a2a_bytes)
    p = sub.add_parser("same-tensors")
    p.add_argument("a")
    p.add_argument("b")
    p.set_defaults(run=same_tensors)
    p = sub.add_parser("close-tensors")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--rtol", type=float, default=1e-6)
    p.add_argument("--atol", type=float, default=1e-6)
    p.set_defaults(run=close_tensors)
    p = sub.add_parser("close-losses")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--rtol", type=float, default=1e-6)
    p.add_argument("--key", default="loss")
    p.set_defaults(run=close_losses)
    p = sub.add_parser("same-losses")
    p.add_argument("a")
    p.add_argument("b")
    p.set_defaults(run=same_losses)
    p = sub.add_parser("stop-run")
    p.add_argument("tessel")
    p.add_argument("dir")
    p.add_argument("--signal", default="TERM")
    p.set_defaults(run=stop_run)
    p = sub.add_parser("hang-run")
    p.add_argument("tessel")
    p.add_argument("dir")
    p.add_argument("--timeout", type=int, default=3)
    p.set_defaults(run=hang_run)
    p = sub.add_parser("save-rescue")
    p.add_argument("tessel")
    p.add_argument("dir")
    p.add_argument("work")
    p.add_argument("rescued")
    p.add_argument("--steps", type=int, default=300)
    p.set_defaults(run=save_rescue)
    p = sub.add_parser("crash-resume")
    p.add_argument("tessel")
    p.add_argument("dir")
    p.add_argument("work")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--after", type=int, default=100)
    p.add_argument("--sharded", action="store_true")
    p.set_defaults(run=crash_resume)
    p = sub.add_parser("kill-restarts")
    p.add_argument("dir")
    p.add_argument("work")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--launch", choices=["tessel", "mpirun", "slurm"], default="tessel")
    p.add_argument("--elastic", action="store_true")
    p.set_defaults(run=kill_restarts)
    p = sub.add_parser("stop-compile")
    p.add_argument("spec")
    p.add_argument("dir")
    p.add_argument("--signal", default="TERM")
    p.set_defaults(run=stop_compile)
    p = sub.add_parser("memory")
    p.add_argument("plan")
    p.add_argument("report")
    p.add_argument("--tolerance", type=float, default=0.05)
    p.set_defaults(run=memory)
    p = sub.add_parser("snapshot-memory")
    p.add_argument("plan")
    p.add_argument("report", help="--comm-report of the checkpointing run")
    p.add_argument("without", help="--comm-report of the same run without checkpoints")
    p.add_argument("ckpt", help="the checkpoint root the run wrote")
    p.add_argument("--tolerance", type=float, default=0.02)
    p.set_defaults(run=snapshot_memory)
    p = sub.add_parser("textbook")
    p.add_argument("--tolerance", type=float, default=0.01)
    p.set_defaults(run=textbook)
    p = sub.add_parser("merged-trace")
    p.add_argument("merged")
    p.add_argument("trace")
    p.add_argument("--group", default="dp")
    p.add_argument("--peers", type=int, nargs=2, default=[0, 1])
    p.add_argument("--within", type=float, default=2.0)
    p.set_defaults(run=merged_trace)
    p = sub.add_parser("resume-matrix")
    p.add_argument("work")
    p.add_argument("layouts", nargs="+")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--half", type=int, default=4)
    p.add_argument("--tolerance", type=float, default=1e-5)
    p.set_defaults(run=resume_matrix)
    p = sub.add_parser("prefetch")
    p.add_argument("program")
    p.add_argument("trace")
    p.add_argument("--group", default="dp")
    p.add_argument("--kind", choices=sorted(IN_FLIGHT), default="gather")
    p.set_defaults(run=prefetch)
    p = sub.add_parser("comm")
    p.add_argument("plan")
    p.add_argument("report")
    p.set_defaults(run=comm)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
