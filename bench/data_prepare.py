#!/usr/bin/env python3
"""How fast `tessel data prepare` tokenizes with GPT-2's byte-level BPE:
tokens per second on a generated multilingual corpus (test/e2e/gpt2_bpe.py
corpus) with a vocabulary of 1,000 merges trained on it, with 1 and 2
workers, against the reference Python encoder (OpenAI's encoder.py
algorithm with its per-word cache, Python's regex module), which is what
GPT-2 data was prepared with. The tokens are checked equal.

    /usr/bin/python3 bench/data_prepare.py [--lines 200000]

Prints markdown for docs/benchmarks.md.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESSEL = os.path.join(ROOT, "build", "bin", "tessel")
sys.path.insert(0, os.path.join(ROOT, "test", "e2e"))
import gpt2_bpe  # noqa: E402


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--merges", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        text, jsonl = os.path.join(work, "c.txt"), os.path.join(work, "c.jsonl")
        run([sys.executable, gpt2_bpe.__file__, "corpus", text, jsonl,
             "--lines", str(args.lines)])
        sample = os.path.join(work, "sample.txt")
        with open(text, encoding="utf-8") as f, open(sample, "w", encoding="utf-8") as out:
            out.writelines(line for _, line in zip(range(20000), f))
        run([sys.executable, gpt2_bpe.__file__, "train", work, sample,
             "--merges", str(args.merges)])
        vocab, merges = os.path.join(work, "vocab.json"), os.path.join(work, "merges.txt")
        size = os.path.getsize(jsonl)
        rows = []
        for workers in (1, 2):
            out = os.path.join(work, f"t{workers}.bin")
            start = time.perf_counter()
            report = run([TESSEL, "data", "prepare", jsonl, "--tokenizer", "gpt2",
                          "--vocab-json", vocab, "--merges", merges, "-o", out,
                          "--workers", str(workers)])
            seconds = time.perf_counter() - start
            tokens = int(re.search(r"wrote (\d+) tokens", report).group(1))
            rows.append((f"tessel data prepare, {workers} worker{'s' if workers > 1 else ''}",
                         tokens, seconds))
        # The reference encoder over the same documents.
        v = json.load(open(vocab, encoding="utf-8"))
        ranks = {tuple(l.rstrip("\n").split(" ")): i for i, l in
                 enumerate(open(merges, encoding="utf-8").readlines()[1:]) if l.strip()}
        cache, ids = {}, []
        start = time.perf_counter()
        eot = v["<|endoftext|>"]
        for doc in gpt2_bpe.documents([jsonl]):
            ids.append(eot)
            for w in gpt2_bpe.words(doc):
                if w not in cache:
                    cache[w] = [v[t] for t in gpt2_bpe.bpe(w, ranks)]
                ids.extend(cache[w])
        seconds = time.perf_counter() - start
        rows.append(("Python encoder.py algorithm (regex module), 1 process",
                     len(ids), seconds))
        got, _ = gpt2_bpe.read_llmc(os.path.join(work, "t1.bin"))
        assert got == ids, "tessel's tokens differ from the reference encoder's"
    print(f"{args.lines} lines ({size / 1e6:.1f} MB of JSON lines), "
          f"{args.merges} merges; tokens equal\n")
    print("| tokenizer | tokens | seconds | tokens/s | MB/s |")
    print("|---|---:|---:|---:|---:|")
    for name, tokens, seconds in rows:
        print(f"| {name} | {tokens} | {seconds:.2f} | {tokens / seconds:,.0f} | "
              f"{size / 1e6 / seconds:.1f} |")


if __name__ == "__main__":
    main()
