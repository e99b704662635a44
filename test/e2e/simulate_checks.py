#!/usr/bin/env python3
"""Assertions of test/e2e/simulate.test over `tessel simulate --json`
results: each subcommand exits non-zero, saying what differed, when the
property does not hold."""
import argparse
import json
import sys


def fail(message):
    print("FAIL: " + message)
    sys.exit(1)


def load(path):
    with open(path) as f:
        return json.load(f)


def bytes_(args):
    """The replay sends, per rank and step, exactly the bytes plan.json
    predicts for each program (every collective and pipeline message)."""
    plan = load(args.plan)
    sim = load(args.sim)
    for p in sim["programs"]:
        totals = plan["programs"][p["program"]]["comm"]["per_step_totals"]
        predicted = sum(t["bytes_sent"] for t in totals.values())
        if p["comm_bytes_per_rank"] != predicted:
            fail(f"{p['program']}: the replay sent {p['comm_bytes_per_rank']} bytes, "
                 f"plan.json predicts {predicted}")
    print(f"bytes match plan.json for {len(sim['programs'])} programs")


def scale(args):
    """A cluster twice as fast in every figure runs the step in half the
    time: the replay is driven by the description's costs alone."""
    a, b = load(args.slow)["step_time_s"], load(args.fast)["step_time_s"]
    if abs(b / a - 0.5) > 1e-9:
        fail(f"step {a} s on the slow cluster, {b} s on one twice as fast")
    print("twice as fast: half the step")


def flops(args):
    """Each rank of `split` computes `ratio` of the model FLOPs a rank of
    `whole` computes (the layouts split the same global batch)."""
    a = load(args.whole)["programs"][0]["flops_per_rank"]
    b = load(args.split)["programs"][0]["flops_per_rank"]
    if abs(b / a - args.ratio) > 1e-9:
        fail(f"{b:.0f} FLOPs per rank against {a:.0f}: ratio {b / a}, not {args.ratio}")
    print(f"FLOPs per rank: {args.ratio} of the one-rank program's")


def faster(args):
    """Make a cluster description twice as fast in every figure."""
    c = load(args.cluster)
    d = c["device"]
    d["peak_tflops"] = {k: 2 * v for k, v in d["peak_tflops"].items()}
    d["memory_bandwidth_gbs"] *= 2
    d["kernel_overhead_us"] /= 2
    d["kernel_gbs"] = {k: 2 * v for k, v in d.get("kernel_gbs", {}).items()}
    for link in ("intra_node", "inter_node"):
        c[link]["bandwidth_gbs"] *= 2
        c[link]["latency_us"] /= 2
    json.dump(c, open(args.out, "w"), indent=1)


def edit(args):
    """Write a cluster description with one field set (a JSON value) or
    added: PATH.TO.FIELD=VALUE."""
    c = load(args.cluster)
    c.pop("measurements", None)
    for assignment in args.set:
        path, value = assignment.split("=", 1)
        keys = path.split(".")
        node = c
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = json.loads(value)
    json.dump(c, open(args.out, "w"), indent=1)


def breakdown(args):
    """Per program, compute + optimizer + exposed communication + bubble
    is the step: every moment of the step is accounted once."""
    sim = load(args.sim)
    step = sim["step_time_s"]
    for p in sim["programs"]:
        parts = p["compute_s"] + p["optimizer_s"] + p["exposed_comm_s"] + p["bubble_s"]
        if abs(parts - step) > 1e-9 * max(1.0, step):
            fail(f"{p['program']}: parts sum to {parts} s, the step is {step} s")
    tokens = sim["tokens_per_step"] / step
    if abs(sim["tokens_per_s"] - tokens) > 1e-6 * tokens:
        fail(f"tokens_per_s {sim['tokens_per_s']} != {tokens}")
    mfu = sim["tflops_per_gpu"] / sim["peak_tflops"]
    if abs(sim["mfu"] - mfu) > 1e-9:
        fail(f"mfu {sim['mfu']} != {mfu}")
    print(f"breakdown adds up for {len(sim['programs'])} programs")


def less(args):
    """A field of program 0 (or the whole result) is smaller in A than in B."""
    a, b = load(args.a), load(args.b)

    def get(sim):
        if args.field in sim:
            return sim[args.field]
        p = sim["programs"][0]
        return p[args.field] / sim["step_time_s"] if args.fraction else p[args.field]

    va, vb = get(a), get(b)
    if not va < vb:
        fail(f"{args.field}: {va} is not below {vb}")
    print(f"{args.field}: {va:.4g} < {vb:.4g}")


def ratio(args):
    """A field of program 0 in B is `ratio` times its value in A, to a
    relative `tol`."""
    va = load(args.a)["programs"][0][args.field]
    vb = load(args.b)["programs"][0][args.field]
    if abs(vb / va - args.ratio) > args.tol * args.ratio:
        fail(f"{args.field}: {vb} against {va}: ratio {vb / va}, not {args.ratio}")
    print(f"{args.field}: {args.ratio} of it")


def trace(args):
    """The trace is Chrome's format: each program's track holds one forward
    and one backward span per microbatch, one after the other."""
    t = load(args.trace)
    events = [e for e in t["traceEvents"] if e["ph"] == "X"]
    pids = sorted({e["pid"] for e in events})
    for pid in pids:
        parts = sorted((e for e in events if e["pid"] == pid and e["tid"] == 0
                        and e["name"] in ("forward", "backward", "update")),
                       key=lambda e: e["ts"])
        for name in ("forward", "backward"):
            mbs = sorted(e["args"]["microbatch"] for e in parts if e["name"] == name)
            if mbs != list(range(args.microbatches)):
                fail(f"program {pid}: {name} spans for microbatches {mbs}")
        for x, y in zip(parts, parts[1:]):
            if x["ts"] + x["dur"] > y["ts"] + 1e-6:
                fail(f"program {pid}: {x['name']} {x['args']} overlaps {y['name']}")
    print(f"trace: {len(pids)} programs, {args.microbatches} microbatches each")


def ranked(args):
    """tessel plan --json: sorted by simulated step among the layouts that
    fit, each within the limit, the best no slower than the included."""
    plan = load(args.plan)
    rows = plan["ranked"]
    fits = [r for r in rows if r["fits"]]
    steps = [r["step_time_s"] for r in fits]
    if steps != sorted(steps):
        fail(f"not sorted by step: {steps}")
    for r in fits:
        if r["memory_bytes"] > args.limit:
            fail(f"{r['describe']} holds {r['memory_bytes']} bytes > {args.limit}")
    included = [r for r in rows if r["included"]]
    if not included:
        fail("the included layout is not in the ranking")
    if fits[0]["step_time_s"] > included[0]["step_time_s"]:
        fail("the best is slower than the included layout")
    print(f"ranked {len(rows)} layouts; the best {fits[0]['step_time_s']:.6f} s <= "
          f"the included {included[0]['step_time_s']:.6f} s")


def applied(args):
    """The spec tessel plan --apply wrote simulates to the best's step."""
    best = load(args.plan)["ranked"][0]["step_time_s"]
    got = load(args.sim)["step_time_s"]
    if abs(got - best) > 1e-12 * best:
        fail(f"the applied spec simulates to {got} s, the plan said {best} s")
    print("the applied spec simulates to the best layout's step")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("bytes")
    p.add_argument("plan")
    p.add_argument("sim")
    p.set_defaults(fn=bytes_)
    p = sub.add_parser("scale")
    p.add_argument("slow")
    p.add_argument("fast")
    p.set_defaults(fn=scale)
    p = sub.add_parser("flops")
    p.add_argument("whole")
    p.add_argument("split")
    p.add_argument("ratio", type=float)
    p.set_defaults(fn=flops)
    p = sub.add_parser("faster")
    p.add_argument("cluster")
    p.add_argument("out")
    p.set_defaults(fn=faster)
    p = sub.add_parser("edit")
    p.add_argument("cluster")
    p.add_argument("out")
    p.add_argument("set", nargs="+")
    p.set_defaults(fn=edit)
    p = sub.add_parser("breakdown")
    p.add_argument("sim")
    p.set_defaults(fn=breakdown)
    p = sub.add_parser("less")
    p.add_argument("field")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--fraction", action="store_true")
    p.set_defaults(fn=less)
    p = sub.add_parser("ratio")
    p.add_argument("field")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("ratio", type=float)
    p.add_argument("--tol", type=float, default=1e-3)
    p.set_defaults(fn=ratio)
    p = sub.add_parser("trace")
    p.add_argument("trace")
    p.add_argument("--microbatches", type=int, required=True)
    p.set_defaults(fn=trace)
    p = sub.add_parser("ranked")
    p.add_argument("plan")
    p.add_argument("limit", type=float)
    p.set_defaults(fn=ranked)
    p = sub.add_parser("applied")
    p.add_argument("plan")
    p.add_argument("sim")
    p.set_defaults(fn=applied)
    args = ap.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
