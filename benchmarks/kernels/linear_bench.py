#!/usr/bin/env python
"""CPU linear layers: every implementation batchgen has, and the one `--kernels auto` chose, interleaved.

One "step" is every linear of the model's decoder layers at the same row count (default: the
default model's 30 layers of qkv 576->960, o 576->576, gate/up 576->3072, down 1536->576), each
layer with its own random weights, so the weights stream from memory as in a real step. The
candidates are `kernels.cpu.linear.linear_candidates` (torch `F.linear`, oneDNN prepacked, and
batchgen's bf16 C kernel where the CPU has AVX512-BF16); "chosen" is what the kernel registry picks
for each shape and row bucket (`batchgen.model.kernel_choice.choice`, from the cached table or measured
now). Each round times the step once on every path in turn, so a slow spell of a shared machine
hits them alike; prints the best milliseconds of each path, its GFLOP/s, and chosen / fastest:

    python benchmarks/kernels/linear_bench.py --dtype bfloat16 --num-threads 2
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 python benchmarks/kernels/linear_bench.py   # as on a CPU without AMX
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from batchgen.kernels.cpu.linear import TunedLinear, linear_candidates  # noqa: E402
from batchgen.kernels.registry import ROW_BUCKETS, TuningTable  # noqa: E402
from batchgen.model.kernel_choice.choice import tuning_key  # noqa: E402
from batchgen.model.kernel_choice.linear import plan_layouts, tune_linear  # noqa: E402

DEFAULT_ROWS = [1, 2, 3, 4, 8, 16, 24, 32, 64, 100, 128, 256, 512, 1024, 2048]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=DEFAULT_ROWS)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--hidden-size", type=int, default=576)
    parser.add_argument("--intermediate-size", type=int, default=1536)
    parser.add_argument("--num-heads", type=int, default=9)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--one-weight-layout", action="store_true", help="chosen: one layout per linear")
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    dtype = getattr(torch, args.dtype)

    d, i, hd = args.hidden_size, args.intermediate_size, args.head_dim
    shapes = [
        (hd * (args.num_heads + 2 * args.num_kv_heads), d),
        (d, args.num_heads * hd),
        (2 * i, d),
        (d, i),
    ]
    gen = torch.Generator().manual_seed(0)
    weights = [
        (torch.randn(n, k, generator=gen) * 0.02).to(dtype) for _ in range(args.layers) for n, k in shapes
    ]
    builders = [linear_candidates(w, None) for w in weights]
    paths: dict[str, list[nn.Module]] = {
        name: [b[name]() for b in builders] for name in builders[0] if all(name in b for b in builders)
    }
    table = TuningTable.load(tuning_key(dtype))
    max_rows = max(args.rows)
    plans = {}
    for n, k in shapes:
        probe = nn.Linear(k, n, bias=False)
        probe.weight = nn.Parameter(weights[shapes.index((n, k))], requires_grad=False)
        plans[(n, k)] = plan_layouts(tune_linear(table, probe, max_rows), args.one_weight_layout)
    table.save()
    chosen = []
    for w, b in zip(weights, builders, strict=True):
        plan = plans[tuple(w.shape)]
        chosen.append(TunedLinear({name: b[name]() for name in dict.fromkeys(plan)}, plan))
    paths["chosen"] = chosen

    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    flops_per_row = 2 * sum(w.numel() for w in weights)
    print(
        f"{len(weights)} linears, {weight_bytes / 1e6:.0f} MB of {args.dtype} weights, "
        f"{torch.get_num_threads()} threads, best of {args.rounds} interleaved rounds; ms (GFLOP/s)"
    )
    for (n, k), plan in plans.items():
        cells = ", ".join(f"{rows}:{name}" for rows, name in zip(ROW_BUCKETS, plan, strict=False))
        print(f"  chosen for {n}x{k}: {cells}")
    worst = 0.0
    with torch.inference_mode():
        for rows in args.rows:
            inputs = {k: torch.randn(rows, k, generator=gen).to(dtype) for _, k in shapes}
            best = dict.fromkeys(paths, float("inf"))
            for _ in range(args.rounds + 1):  # the first round warms up
                for name, ops in paths.items():
                    start = time.perf_counter()
                    for op, w in zip(ops, weights, strict=True):
                        op(inputs[w.shape[1]])
                    best[name] = min(best[name], time.perf_counter() - start)
            fastest = min(sec for name, sec in best.items() if name != "chosen")
            ratio = best["chosen"] / fastest
            worst = max(worst, ratio)
            cells = [
                f"{name} {sec * 1e3:7.2f} ({rows * flops_per_row / sec / 1e9:5.0f})"
                for name, sec in best.items()
            ]
            print(f"rows {rows:5d}: " + "  ".join(cells) + f"  chosen/fastest {ratio:.2f}")
    print(f"worst chosen/fastest: {worst:.2f} (target: at most 1.10)")


if __name__ == "__main__":
    main()
