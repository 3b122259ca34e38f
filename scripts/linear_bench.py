#!/usr/bin/env python
"""CPU bf16 linear layers: batchgen's AVX512-BF16 kernel against oneDNN's prepacked matmul, interleaved.

One "step" is every linear of the model's decoder layers at the same row count (default: the
default model's 30 layers of qkv 576->960, o 576->576, gate/up 576->3072, down 1536->576), each
layer with its own random weights, so the weights stream from memory as in a decode step. Each
round times the step once on every path in turn, so a slow spell of a shared machine hits them
alike; prints the best milliseconds of each path, its GFLOP/s and weight GB/s, and the ratio:

    python scripts/linear_bench.py --rows 1 8 16 64 2048 --num-threads 2

Needs a CPU whose oneDNN has bf16 (for the baseline) and AVX512-BF16 (for the kernel).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchgen.kernels.cpu.linear import (  # noqa: E402
    Bf16Linear,
    bf16_kernel_available,
    can_prepack,
    pack_weight,
    prepacked_linear,
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 64, 2048])
    parser.add_argument("--hidden-size", type=int, default=576)
    parser.add_argument("--intermediate-size", type=int, default=1536)
    parser.add_argument("--num-heads", type=int, default=9)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if not (bf16_kernel_available() and can_prepack(torch.bfloat16, torch.device("cpu"))):
        sys.exit("needs AVX512-BF16 for batchgen's kernel and a oneDNN with bf16 for the baseline")

    d, i, hd = args.hidden_size, args.intermediate_size, args.head_dim
    shapes = [
        (hd * (args.num_heads + 2 * args.num_kv_heads), d),
        (d, args.num_heads * hd),
        (2 * i, d),
        (d, i),
    ]
    gen = torch.Generator().manual_seed(0)
    weights = [
        (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
        for _ in range(args.layers)
        for n, k in shapes
    ]
    paths = {
        "onednn": [lambda x, p=pack_weight(w): prepacked_linear(x, p) for w in weights],
        "batchgen": [Bf16Linear.from_weight(w) for w in weights],
    }
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    print(
        f"{len(weights)} linears, {weight_bytes / 1e6:.0f} MB of bf16 weights, {torch.get_num_threads()} threads, "
        f"best of {args.rounds} interleaved rounds"
    )
    with torch.inference_mode():
        for rows in args.rows:
            inputs = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for _, k in shapes}
            best = dict.fromkeys(paths, float("inf"))
            for _ in range(args.rounds + 1):  # the first round warms up
                for name, ops in paths.items():
                    start = time.perf_counter()
                    for op, w in zip(ops, weights, strict=True):
                        op(inputs[w.shape[1]])
                    best[name] = min(best[name], time.perf_counter() - start)
            flops = 2 * rows * weight_bytes / 2
            cells = [
                f"{name} {sec * 1e3:7.2f} ms ({flops / sec / 1e9:5.0f} GFLOP/s, {weight_bytes / sec / 1e9:4.1f} GB/s)"
                for name, sec in best.items()
            ]
            print(f"rows {rows:5d}: " + "  ".join(cells) + f"  x{best['onednn'] / best['batchgen']:.2f}")


if __name__ == "__main__":
    main()
