#!/usr/bin/env python3
"""What evaluation costs: Tessel's compiled forward-only step (@eval_step,
per global batch) beside its training step, and PyTorch eager's forward
under torch.no_grad() beside its training step, on the same model, batch,
weights, data and thread count, in one run.

    /usr/bin/python3 bench/eval.py [--threads N] [--steps N]

Prints a markdown table for docs/benchmarks.md. Needs a built tree (build/)
and Debian's python3-torch.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESSEL = os.path.join(ROOT, "build", "bin", "tessel")
REFERENCE = os.path.join(ROOT, "test", "e2e", "torch_reference.py")
sys.path.insert(0, os.path.join(ROOT, "test", "e2e"))

from cpu_step_time import merge, run  # noqa: E402 (beside this file)

CASES = [
    ("gpt-tiny (B=8, T=64)", "examples/gpt-tiny.json", {}),
    ("llama-tiny (B=8, T=64)", "examples/llama-tiny.json", {}),
    ("gpt2-124m (B=4, T=256)", "examples/gpt2-124m.json",
     {"model": {"seq_len": 256}, "train": {"global_batch": 4}}),
]
EVAL_BATCHES = 4


def torch_forward_ms(spec_file, weights, tokens, threads, repeats):
    import torch
    import torch.nn.functional as F
    import torch_reference as ref
    torch.set_num_threads(threads)
    mcfg, tcfg = ref.load_spec(spec_file)
    model = ref.build_model(mcfg)
    ref.load_weights(model, weights)
    model.eval()
    data = ref.load_tokens(tokens)
    B, T = tcfg["global_batch"], mcfg["seq_len"]
    times = []
    with torch.no_grad():
        for k in range(repeats):
            x, y = ref.get_batch(data, k, B, T)
            start = time.perf_counter()
            logits = model(x)
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times[2:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
               OPENBLAS_NUM_THREADS=str(args.threads))
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for name, spec_path, overrides in CASES:
            spec = merge(json.load(open(os.path.join(ROOT, spec_path))), overrides)
            spec["data"] = {"format": "synthetic"}
            spec_file = os.path.join(work, "spec.json")
            json.dump(spec, open(spec_file, "w"))
            out = os.path.join(work, "out")
            tokens = os.path.join(work, "tokens.bin")
            weights = os.path.join(work, "init.safetensors")
            metrics = os.path.join(work, "metrics.jsonl")
            run([TESSEL, "compile", spec_file, "-o", out])
            run([TESSEL, "data", "synth", "-o", tokens, "--vocab",
                 str(spec["model"]["vocab_size"]), "--tokens", "2000000"])
            run([TESSEL, "run", out, "--steps", "0", "--save-final", weights, "--quiet"])
            run([TESSEL, "run", out, "--steps", str(args.steps), "--data", tokens,
                 "--valid-data", tokens, "--eval-every", "1", "--eval-batches",
                 str(EVAL_BATCHES), "--init-from", weights, "--metrics", metrics,
                 "--quiet", "--threads", str(args.threads)], env)
            steps = [json.loads(l) for l in open(metrics)]
            step_ms = statistics.median(s["step_ms"] for s in steps[2:])
            eval_ms = statistics.median(s["eval_ms"] for s in steps[2:]) / EVAL_BATCHES
            torch_out = run(["/usr/bin/python3", REFERENCE, "--spec", spec_file,
                             "--init-from", weights, "--data", tokens, "--steps",
                             str(args.steps), "--threads", str(args.threads),
                             "--bench", "--quiet"], env)
            torch_step = json.loads(torch_out.strip().splitlines()[-1])["step_ms"]
            torch_eval = torch_forward_ms(spec_file, weights, tokens, args.threads,
                                          args.steps)
            rows.append((name, step_ms, eval_ms, torch_step, torch_eval))
            print(f"{name}: tessel {step_ms:.1f}/{eval_ms:.1f} ms, "
                  f"torch {torch_step:.1f}/{torch_eval:.1f} ms", file=sys.stderr)
    print("| model | Tessel step (ms) | Tessel eval batch (ms) | eval / step | "
          "PyTorch step (ms) | PyTorch no_grad forward (ms) | eval / step |")
    print("|---|---|---|---|---|---|---|")
    for name, s, e, ts, te in rows:
        print(f"| {name} | {s:.1f} | {e:.1f} | {e / s:.2f} | {ts:.1f} | {te:.1f} | "
              f"{te / ts:.2f} |")


if __name__ == "__main__":
    main()
