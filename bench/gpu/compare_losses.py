#!/usr/bin/env python3
"""Compares two `tessel run --metrics` files step by step: a CUDA program's
against the CPU reference program of the same spec, seed and data.

    python3 bench/gpu/compare_losses.py REFERENCE.jsonl CANDIDATE.jsonl \
        [--name NAME] [--steps N] [--rtol R] [--first-rtol R] [--grad-rtol R]

For each of the first N steps (default: every step of the reference):

  loss       |candidate - reference| / |reference| <= rtol
             (<= first-rtol at step 0, when given: before the first update
             both programs hold the same weights, so step 0 measures the
             forward pass alone and can be held tighter)
  grad_norm  the same relative difference <= grad-rtol, when given
  lr         equal to 1e-6 relative: the schedule is host code both
             programs share, so a difference means the runs do not match
             (different --steps, a different spec)

and every value must be finite. Prints one line, `PASS NAME: ...` or
`FAIL NAME: ...`, with the largest differences and the step they occur at.
Exit status: 0 pass, 1 fail, 2 a file cannot be read.

Uses only the standard library, so it runs on any python3.
"""
import argparse
import json
import math
import sys

LR_RTOL = 1e-6


def read_metrics(path):
    """step -> record, from one JSON object per line."""
    steps = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
                steps[int(record["step"])] = record
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError("%s:%d: not a metrics record (%s)" % (path, number, e))
    return steps


def rel_diff(reference, candidate):
    scale = abs(reference)
    if scale < 1e-30:  # a zero reference: fall back to the absolute difference
        return abs(candidate - reference)
    return abs(candidate - reference) / scale


def finite(value):
    return isinstance(value, (int, float)) and math.isfinite(value)


def compare(ref, cand, steps, rtol, first_rtol, grad_rtol):
    """Returns (problems, summary) where problems is a list of strings."""
    problems = []
    worst = {"loss": (0.0, None), "grad_norm": (0.0, None), "lr": (0.0, None)}
    for s in range(steps):
        if s not in ref:
            problems.append("the reference has no step %d" % s)
            break
        if s not in cand:
            problems.append("the candidate has only %d of %d steps" % (len(cand), steps))
            break
        for key in ("loss", "grad_norm", "lr"):
            a, b = ref[s].get(key), cand[s].get(key)
            if not finite(a) or not finite(b):
                # A missing or non-finite value fails the check only where it is checked.
                if key == "loss" or (key == "grad_norm" and grad_rtol is not None):
                    problems.append("step %d: %s is %r (reference %r)" % (s, key, b, a))
                continue
            d = rel_diff(a, b)
            if worst[key][1] is None or d > worst[key][0]:
                worst[key] = (d, s)
            if key == "loss":
                tol = first_rtol if (s == 0 and first_rtol is not None) else rtol
            elif key == "grad_norm":
                tol = grad_rtol
            else:
                tol = LR_RTOL
            if tol is not None and d > tol:
                problems.append("step %d: %s %.9g vs reference %.9g, relative difference "
                                "%.2e > %.0e" % (s, key, b, a, d, tol))
    return problems, worst


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("reference", help="metrics of the CPU reference program")
    ap.add_argument("candidate", help="metrics of the program under test")
    ap.add_argument("--name", default=None, help="label for the printed line")
    ap.add_argument("--steps", type=int, default=None,
                    help="compare the first N steps (default: all of the reference's)")
    ap.add_argument("--rtol", type=float, default=1e-4,
                    help="largest relative loss difference at any step (default 1e-4)")
    ap.add_argument("--first-rtol", type=float, default=None,
                    help="largest relative loss difference at step 0 (default: --rtol)")
    ap.add_argument("--grad-rtol", type=float, default=None,
                    help="largest relative grad_norm difference (default: not checked)")
    args = ap.parse_args(argv)
    name = args.name or args.candidate

    try:
        ref = read_metrics(args.reference)
        cand = read_metrics(args.candidate)
    except (OSError, ValueError) as e:
        print("FAIL %s: %s" % (name, e))
        return 2
    steps = args.steps if args.steps is not None else len(ref)
    if steps < 1:
        print("FAIL %s: the reference %s has no steps" % (name, args.reference))
        return 1

    problems, worst = compare(ref, cand, steps, args.rtol, args.first_rtol, args.grad_rtol)

    def at(key):
        value, step = worst[key]
        return "%.1e (step %s)" % (value, step)

    summary = "%d steps, loss max rel diff %s, tol %.0e" % (steps, at("loss"), args.rtol)
    if args.first_rtol is not None:
        summary += " (step 0: %.0e)" % args.first_rtol
    summary += "; grad_norm %s" % at("grad_norm")
    summary += (", tol %.0e" % args.grad_rtol) if args.grad_rtol is not None else " (not checked)"
    if 0 in ref and 0 in cand and finite(ref[0].get("loss")) and finite(cand[0].get("loss")):
        summary += "; step 0 loss %.6f vs %.6f" % (cand[0]["loss"], ref[0]["loss"])
    if problems:
        shown = problems[:3] + (["... %d more" % (len(problems) - 3)] if len(problems) > 3 else [])
        print("FAIL %s: %s; %s" % (name, summary, "; ".join(shown)))
        return 1
    print("PASS %s: %s" % (name, summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
