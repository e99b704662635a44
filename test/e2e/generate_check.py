#!/usr/bin/env python3
"""Compares generations with a reference: generate_check.py REF RUN...

Each argument X names X.json (a JSON object with "generated", as tessel
generate --json and generate_reference.py print) and X.logits (--logits:
float32 rows of the vocabulary). Every run must have generated exactly the
reference's tokens, and its logits must be within 1e-5 of the reference's
(relative to the largest magnitude of each row).
"""
import json
import sys

import numpy as np


def load(prefix):
    with open(prefix + ".json") as f:
        ids = json.load(f)["generated"]
    logits = np.fromfile(prefix + ".logits", dtype="<f4")
    assert logits.size % max(len(ids), 1) == 0, (prefix, logits.size, len(ids))
    return ids, logits.reshape(len(ids), -1)


ref_ids, ref_logits = load(sys.argv[1])
assert ref_ids, "the reference generated nothing"
for run in sys.argv[2:]:
    ids, logits = load(run)
    assert ids == ref_ids, (run, ids, ref_ids)
    scale = np.abs(ref_logits).max(axis=1, keepdims=True)
    worst = (np.abs(logits - ref_logits) / scale).max()
    assert worst <= 1e-5, (run, worst)
print(f"{len(ref_ids)} tokens equal to the reference's, logits within 1e-05")
