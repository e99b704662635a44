#!/usr/bin/env python3
"""Greedy generation from a Hugging Face model directory with no KV cache:
the independent reference of `tessel generate`.

    generate_reference.py DIR --prompt-tokens 1,2,3 [--max-new-tokens N]
        [--eos ID] [--max-len T] [--logits FILE]
    generate_reference.py --spec SPEC --weights FILE --prompt-tokens ...

The model is built from DIR/config.json's fields (hf_reference.py's
model_config) as torch_reference.py's GPT-2 or Llama and loaded from
DIR/model.safetensors, as `tessel export --to hf` writes them (a Mixtral's
experts stacked as the reference holds them); or, for any model (a
mixture-of-experts model with shared experts has no Hugging Face form),
built from a Tessel spec and loaded from the weights `tessel run
--save-final` writes, every token routed to its top_k experts with nothing
dropped. Each new
token is the argmax of the last position's logits after the WHOLE sequence
so far is run forward again, so nothing is cached. Generation stops after N
new tokens, after the token --eos names, or when the sequence fills the
context (--max-len, default the config's) so that no position is left for
the next token's input.

Prints {"generated": [ids], "stopped": "max_new_tokens" | "eos" | "context"}.
--logits FILE writes the last position's logits of each step, one row of
vocab_size little-endian float32 per new token with no header, the format
of the rank programs' --logits.
"""
import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402
import torch_reference as ref  # noqa: E402
from hf_reference import hf_tensors, model_config  # noqa: E402


def load_model(directory):
    """torch_reference's model of a Hugging Face directory, in eval mode."""
    mcfg = model_config(json.load(open(os.path.join(directory, "config.json"))))
    model = ref.build_model(mcfg)
    weights, tensors = hf_tensors(directory, mcfg)
    ref.load_tensors(model, tensors, weights)
    return model.eval(), mcfg


def load_spec_model(spec, weights):
    """torch_reference's model of a Tessel spec with the weights of
    `tessel run --save-final`, in eval mode; an MoE layer drops nothing."""
    mcfg, _ = ref.load_spec(spec)
    if mcfg["moe"] is not None:
        mcfg["moe"]["capacity_factor"] = None
    model = ref.build_model(mcfg)
    ref.load_weights(model, weights)
    return model.eval(), mcfg


def generate(model, prompt, max_new_tokens, max_len, eos=None):
    """(new ids, each step's last-position logits, why it stopped)."""
    sequence = list(prompt)
    generated, rows = [], []
    with torch.no_grad():
        while True:
            if len(generated) == max_new_tokens:
                return generated, rows, "max_new_tokens"
            if len(sequence) > max_len:
                return generated, rows, "context"
            logits = model(torch.tensor([sequence]))[0, -1]
            token = int(torch.argmax(logits))
            rows.append(logits.to(torch.float32).numpy())
            generated.append(token)
            sequence.append(token)
            if eos is not None and token == eos:
                return generated, rows, "eos"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", nargs="?", help="a Hugging Face model directory")
    p.add_argument("--spec", help="a Tessel spec (instead of DIR)")
    p.add_argument("--weights", help="with --spec: Tessel's weights file")
    p.add_argument("--prompt-tokens", required=True,
                   help="the prompt's ids, separated by commas")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--eos", type=int, help="stop after this token")
    p.add_argument("--max-len", type=int,
                   help="the context length (default: the config's)")
    p.add_argument("--logits", help="write each step's logits here")
    args = p.parse_args()
    prompt = [int(t) for t in args.prompt_tokens.split(",")]
    if args.spec:
        if args.dir or not args.weights:
            sys.exit("--spec takes --weights and no DIR")
        model, mcfg = load_spec_model(args.spec, args.weights)
    elif args.dir:
        model, mcfg = load_model(args.dir)
    else:
        sys.exit("give a Hugging Face DIR, or --spec and --weights")
    max_len = args.max_len or mcfg["seq_len"]
    if not prompt or len(prompt) > max_len:
        sys.exit("the prompt has %d tokens; the context holds 1 to %d"
                 % (len(prompt), max_len))
    if any(not 0 <= t < mcfg["vocab_size"] for t in prompt):
        sys.exit("a prompt token is outside the vocabulary of %d"
                 % mcfg["vocab_size"])
    generated, rows, stopped = generate(model, prompt, args.max_new_tokens,
                                        max_len, args.eos)
    if args.logits:
        rows = np.stack(rows) if rows else np.zeros((0, mcfg["vocab_size"]))
        rows.astype("<f4").tofile(args.logits)
    print(json.dumps({"generated": generated, "stopped": stopped}))


if __name__ == "__main__":
    main()
