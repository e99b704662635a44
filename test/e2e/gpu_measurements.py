"""Writes what tessel-calibrate-cuda would measure on a GPU node that
follows the simulator's cost model exactly, from known figures, so that a
test can check that `tessel calibrate --target cuda --measurements` fits
them back.

usage: gpu_measurements.py OUT.json
"""
import json
import sys

PEAK_BF16 = 700e12   # FLOP/s
PEAK_FP32 = 55e12
HALF = 300.0         # GEMM half-size
ATTENTION = 0.45     # attention's fraction of the bf16 peak
BANDWIDTH = 3.0e12   # bytes/s
OVERHEAD = 3e-6      # s per launch
GRAPH_OVERHEAD = 1e-6  # a kernel inside a CUDA graph
RANKS = 8
LINK = 150e9         # bytes/s a GPU gets from NCCL in the node
ALPHA = 8e-6         # s per message


def gemm_time(peak, m, n, k):
    f = (m / (m + HALF)) * (n / (n + HALF)) * (k / (k + HALF))
    return 2.0 * m * n * k / (peak * f)


def main():
    shapes = [(256, 256, 256), (1024, 1024, 1024), (4096, 4096, 4096),
              (8192, 2304, 768), (8192, 768, 3072), (4096, 12288, 1536),
              (1024, 128, 1024), (16384, 1024, 256)]
    attention = []
    for b, t, h, d in [(8, 1024, 12, 64), (4, 2048, 16, 128)]:
        forward_flops = 4.0 * b * h * t * t * d * 0.5
        total = 3.5 * forward_flops / (PEAK_BF16 * ATTENTION)
        attention.append({"batch": b, "seq": t, "heads": h, "head_dim": d,
                          "forward": total / 3.5, "backward": total * 2.5 / 3.5})
    all_reduce = []
    for n in [1, 1 << 10, 1 << 20, 1 << 26]:
        g = RANKS
        seconds = 2 * (g - 1) * ALPHA
        if n > 1:
            seconds += 2 * (g - 1) / g * n * 4 / LINK
        all_reduce.append({"elements": n, "seconds": seconds})
    out = {
        "device": "Synthetic GPU",
        "memory_bytes": 80e9,
        "ranks": RANKS,
        "gemm_bf16": [{"m": m, "n": n, "k": k,
                       "seconds": gemm_time(PEAK_BF16, m, n, k)}
                      for m, n, k in shapes],
        "gemm_fp32": [{"m": m, "n": n, "k": k,
                       "seconds": gemm_time(PEAK_FP32, m, n, k)}
                      for m, n, k in shapes[:4]],
        "attention": attention,
        "bandwidth": BANDWIDTH,
        "overhead": OVERHEAD,
        "graph_overhead": GRAPH_OVERHEAD,
        "kernels": {"layerNormForward": {"bytes": 1e8,
                                         "seconds": OVERHEAD + 1e8 / 2.5e12}},
        "all_reduce": all_reduce,
    }
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
