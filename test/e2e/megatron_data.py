#!/usr/bin/env python3
"""Writes a Megatron-LM indexed dataset (PREFIX.bin + PREFIX.idx, the MMIDIDX
index, version 1) and the same tokens as an llm.c token file, for the data
tests.

    megatron_data.py PREFIX LLMC_FILE [--dtype uint16|int32|int16|uint8]
        [--vocab N] [--tokens N] [--break bad-magic|short-bin|int64|big-token]
"""
import argparse
import struct

import numpy as np

CODES = {"uint8": 1, "int16": 3, "int32": 4, "int64": 5, "uint16": 8}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("prefix")
    p.add_argument("llmc")
    p.add_argument("--dtype", default="uint16", choices=sorted(CODES))
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--tokens", type=int, default=40000)
    p.add_argument("--break", dest="broken", default="")
    p.add_argument("--shards", default="",
                   help="also write the tokens as llm.c shards DIR/shard-K.bin "
                        "(3 of them; the last one as a Megatron prefix too)")
    p.add_argument("--bad-shard", action="store_true",
                   help="with --shards: a token out of range in the last shard")
    args = p.parse_args()
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, args.vocab, size=args.tokens)
    # Documents of random lengths, one sequence each (as Megatron's
    # preprocessing writes them without sentence splitting).
    cuts = np.sort(rng.choice(np.arange(1, args.tokens), size=args.tokens // 500,
                              replace=False))
    lengths = np.diff(np.concatenate([[0], cuts, [args.tokens]]))
    dtype = "int64" if args.broken == "int64" else args.dtype
    if args.broken == "big-token":
        tokens[1234] = args.vocab
    data = tokens.astype(dtype)
    item = data.itemsize
    with open(args.prefix + ".bin", "wb") as f:
        f.write(data.tobytes()[: -item if args.broken == "short-bin" else None])
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * item
    with open(args.prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" if args.broken != "bad-magic" else b"NOTANIDX\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", CODES[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(lengths) + 1))
        f.write(lengths.astype(np.int32).tobytes())
        f.write(pointers.astype(np.int64).tobytes())
        f.write(np.arange(len(lengths) + 1, dtype=np.int64).tobytes())
    write_llmc(args.llmc, tokens)
    if args.shards:
        import os
        os.makedirs(args.shards, exist_ok=True)
        cuts = [0, args.tokens // 3 + 17, 2 * args.tokens // 3 + 5, args.tokens]
        for k in range(3):
            part = tokens[cuts[k]:cuts[k + 1]].copy()
            if args.bad_shard and k == 2:
                part[100] = args.vocab
            write_llmc(os.path.join(args.shards, f"shard-{k}.bin"), part)


def write_llmc(path, tokens):
    header = np.zeros(256, dtype=np.int32)
    header[:3] = [20240520, 1, len(tokens)]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.minimum(tokens, 65535).astype(np.uint16).tobytes())


if __name__ == "__main__":
    main()
