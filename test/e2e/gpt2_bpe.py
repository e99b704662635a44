#!/usr/bin/env python3
"""An independent GPT-2 byte-level BPE for the tests of `tessel data
prepare`: OpenAI's encoder.py algorithm (bytes_to_unicode, the published
pre-tokenizer pattern through Python's `regex` module, merges lowest rank
first), a small trainer to make a vocab.json and merges.txt from a corpus,
and readers of what tessel wrote."""
import argparse
import json
import os
import struct
import sys

import regex

PATTERN = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def bytes_to_unicode():
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


BYTE = bytes_to_unicode()


def words(text):
    return ["".join(BYTE[b] for b in piece.encode("utf-8"))
            for piece in PATTERN.findall(text)]


def pairs_of(word):
    return {(word[i], word[i + 1]) for i in range(len(word) - 1)}


def bpe(token, ranks):
    word = tuple(token)
    pairs = pairs_of(word)
    while pairs:
        bigram = min(pairs, key=lambda p: ranks.get(p, float("inf")))
        if bigram not in ranks:
            break
        first, second = bigram
        new, i = [], 0
        while i < len(word):
            try:
                j = word.index(first, i)
            except ValueError:
                new.extend(word[i:])
                break
            new.extend(word[i:j])
            i = j
            if word[i] == first and i < len(word) - 1 and word[i + 1] == second:
                new.append(first + second)
                i += 2
            else:
                new.append(word[i])
                i += 1
        word = tuple(new)
        pairs = pairs_of(word) if len(word) > 1 else set()
    return word


def train(args):
    """Learns `--merges` merges from the documents (most frequent adjacent
    pair first, ties by the pair itself) and writes vocab.json, merges.txt."""
    counts = {}
    for doc in documents(args.inputs):
        for w in words(doc):
            counts[tuple(w)] = counts.get(tuple(w), 0) + 1
    vocab = {BYTE[b]: i for i, b in enumerate(sorted(BYTE))}
    merges = []
    for _ in range(args.merges):
        pair_counts = {}
        for w, c in counts.items():
            for i in range(len(w) - 1):
                pair_counts[w[i:i + 2]] = pair_counts.get(w[i:i + 2], 0) + c
        if not pair_counts:
            break
        best = max(sorted(pair_counts), key=lambda p: pair_counts[p])
        merges.append(best)
        vocab[best[0] + best[1]] = len(vocab)
        merged = {}
        for w, c in counts.items():
            new, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i:i + 2] == best:
                    new.append(best[0] + best[1])
                    i += 2
                else:
                    new.append(w[i])
                    i += 1
            merged[tuple(new)] = merged.get(tuple(new), 0) + c
        counts = merged
    vocab["<|endoftext|>"] = len(vocab)
    with open(os.path.join(args.out, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(args.out, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for a, b in merges:
            f.write(f"{a} {b}\n")
    print(f"{len(merges)} merges, vocabulary {len(vocab)}")


def corpus(args):
    """Writes --lines lines of varied text (a seeded mix of words in several
    scripts, numbers, contractions, punctuation, emoji and whitespace runs)
    as a text file and as JSON lines, a document per 50 lines."""
    import random
    rng = random.Random(args.seed)
    words_ = ("the of and to in is was for on that with as by at from it "
              "model train data tensor pipeline parallel gradient token Tessel "
              "Über naïve café façade résumé Straße ÆØÅ "
              "Ελληνικά αβγ русский язык 中文 字符 日本語 テキスト 한국어 "
              "עברית العربية हिन्दी ไทย").split()
    pieces = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "n't", "'S", "''"]
    marks = list(".,;:!?-()[]{}\"'/\\@#$%^&*_+=<>|~`") + ["...", "--", "—", "–", "…", "«", "»"]
    numbers = lambda: rng.choice([str(rng.randint(0, 10 ** rng.randint(1, 7))),
                                  f"{rng.random() * 1000:.3f}", "٣٤٥", "½", "²³", "Ⅻ", "1,024"])
    spaces = [" ", " ", " ", " ", "  ", "   ", "\t", " \t ", "\u00a0", "\u3000"]
    emoji = ["🙂", "🚀", "👍🏽", "❤️", "©", "™"]
    lines = []
    for _ in range(args.lines):
        parts = []
        for _ in range(rng.randint(0, 18)):
            r = rng.random()
            if r < 0.6:
                w = rng.choice(words_)
                w = w.upper() if rng.random() < 0.05 else w.capitalize() if rng.random() < 0.1 else w
                parts.append(w + (rng.choice(pieces) if rng.random() < 0.08 else ""))
            elif r < 0.75:
                parts.append(numbers())
            elif r < 0.92:
                parts.append(rng.choice(marks) * rng.randint(1, 2))
            else:
                parts.append(rng.choice(emoji))
            parts.append(rng.choice(spaces))
        lines.append("".join(parts).rstrip(" ") if rng.random() < 0.7 else "".join(parts))
    text = "\n".join(lines) + "\n"
    with open(args.text, "w", encoding="utf-8") as f:
        f.write(text)
    with open(args.jsonl, "w", encoding="utf-8") as f:
        for k in range(0, len(lines), 50):
            f.write(json.dumps({"text": "\n".join(lines[k:k + 50])}, ensure_ascii=False) + "\n")
    print(f"{len(lines)} lines, {len(text)} characters")


def documents(paths, key="text"):
    for path in paths:
        if path.endswith(".jsonl") or path.endswith(".json"):
            for line in open(path, encoding="utf-8"):
                if line.strip():
                    yield json.loads(line)[key]
        else:
            yield open(path, encoding="utf-8").read()


def encode(vocab, ranks, text):
    return [vocab[t] for w in words(text) for t in bpe(w, ranks)]


def read_llmc(path):
    data = open(path, "rb").read()
    magic, version, n = struct.unpack("<3i", data[:12])
    width = 2 if magic == 20240520 else 4
    fmt = "<%d%s" % (n, "H" if width == 2 else "I")
    return list(struct.unpack(fmt, data[1024:1024 + n * width])), None


def read_megatron(prefix):
    idx = open(prefix + ".idx", "rb").read()
    assert idx[:9] == b"MMIDIDX\x00\x00", "not an MMIDIDX index"
    version, code, sequences, docs = struct.unpack("<QBQQ", idx[9:34])
    lengths = struct.unpack("<%di" % sequences, idx[34:34 + 4 * sequences])
    width = {8: 2, 4: 4}[code]
    data = open(prefix + ".bin", "rb").read()
    tokens = list(struct.unpack("<%d%s" % (len(data) // width, "H" if width == 2 else "i"),
                                data))
    ends, total = [], 0
    for n in lengths:
        total += n
        ends.append(total)
    return tokens, ends


def compare(args):
    """The tokens tessel wrote equal this encoder's: llm.c puts
    <|endoftext|> before each document, Megatron after each, one sequence
    per document."""
    vocab = json.load(open(args.vocab, encoding="utf-8"))
    merges = [tuple(l.rstrip("\n").split(" ")) for l in
              open(args.merges, encoding="utf-8").readlines()[1:] if l.strip()]
    ranks = {m: i for i, m in enumerate(merges)}
    eot = vocab["<|endoftext|>"]
    want, ends = [], []
    for doc in documents(args.inputs):
        ids = encode(vocab, ranks, doc)
        want += ([eot] + ids) if args.format == "llmc" else (ids + [eot])
        ends.append(len(want))
    got, got_ends = (read_llmc(args.output) if args.format == "llmc"
                     else read_megatron(args.output))
    if got != want:
        k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                 min(len(got), len(want)))
        print(f"FAIL: token {k} differs: tessel {got[k:k + 8]}, reference "
              f"{want[k:k + 8]} ({len(got)} vs {len(want)} tokens)")
        sys.exit(1)
    if got_ends is not None and got_ends != ends:
        print(f"FAIL: document ends {got_ends} vs {ends}")
        sys.exit(1)
    merged = sum(1 for t in want if t >= 256 and t != eot)
    print(f"{len(ends)} documents, {len(want)} tokens equal the reference "
          f"({merged} of them merged)")


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(required=True)
    p = sub.add_parser("train")
    p.add_argument("out")
    p.add_argument("inputs", nargs="+")
    p.add_argument("--merges", type=int, default=300)
    p.set_defaults(run=train)
    p = sub.add_parser("corpus")
    p.add_argument("text")
    p.add_argument("jsonl")
    p.add_argument("--lines", type=int, default=3000)
    p.add_argument("--seed", type=int, default=1)
    p.set_defaults(run=corpus)
    p = sub.add_parser("compare")
    p.add_argument("format", choices=["llmc", "megatron"])
    p.add_argument("output")
    p.add_argument("vocab")
    p.add_argument("merges")
    p.add_argument("inputs", nargs="+")
    p.set_defaults(run=compare)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
