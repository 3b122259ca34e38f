#!/usr/bin/env python
"""int8 linears against the float kernel the registry picks today, in one process, interleaved.

For each of the default model's linear shapes (outputs x inputs: q/o 576x576, k/v 192x576,
gate/up 1536x576, down 576x1536) and row count, `--layers` weights of the shape (so they stream
from memory, as in a model step) run through:
- "float": the implementation `--kernels auto` chooses for the float weight at that row bucket
  (`kernel_choice.linear.tune_linear` + `plan_layouts`, from the cached tuning table or measured
  now): batchgen's bf16 kernel or oneDNN in bf16, oneDNN in float32; or `--float-impl` throughout;
- "int8_c" (W8A16), "int8_c_dpbf16" (W8A16 through VDPBF16PS, bf16 only) and "int8_w8a8" (W8A8)
  on the same weights quantized (`Int8Weight.quantize`), where this build has them.
Each round times every path once in turn, so a slow spell of a shared machine hits them alike;
prints the best microseconds a layer, and float / int8 (above 1: int8 is faster):

    python benchmarks/kernels/int8_linear_bench.py --dtype bfloat16 --num-threads 2
    ONEDNN_MAX_CPU_ISA=AVX2 BATCHGEN_MAX_CPU_ISA=AVX2 python benchmarks/kernels/int8_linear_bench.py --dtype float32
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
from batchgen.kernels.cpu.quantized_linear import Int8Weight, quantized_candidates  # noqa: E402
from batchgen.kernels.registry import TuningTable  # noqa: E402
from batchgen.model.kernel_choice.choice import tuning_key  # noqa: E402
from batchgen.model.kernel_choice.linear import plan_layouts, tune_linear  # noqa: E402

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]
KINDS = ("int8_c", "int8_c_dpbf16", "int8_w8a8")


def _float_path(
    table: TuningTable, weights: list[torch.Tensor], max_rows: int, impl: str | None
) -> tuple[list[nn.Module], str]:
    """The registry's float implementation per bucket for `weights`' shape (or `impl` throughout),
    as one module a weight."""
    if impl is not None:
        return [linear_candidates(w, None)[impl]() for w in weights], impl
    probe = nn.Linear(weights[0].shape[1], weights[0].shape[0], bias=False)
    probe.weight = nn.Parameter(weights[0], requires_grad=False)
    plan = plan_layouts(tune_linear(table, probe, max_rows))
    modules = []
    for w in weights:
        builders = linear_candidates(w, None)
        modules.append(TunedLinear({name: builders[name]() for name in dict.fromkeys(plan)}, plan))
    return modules, ",".join(dict.fromkeys(plan))


def _best_us(paths: dict[str, list[nn.Module]], x: torch.Tensor, rounds: int) -> dict[str, float]:
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(rounds + 1):  # the first round warms up
        for name, modules in paths.items():
            start = time.perf_counter()
            for module in modules:
                module(x)
            best[name] = min(best[name], (time.perf_counter() - start) / len(modules))
    return {name: 1e6 * seconds for name, seconds in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument(
        "--float-impl", default=None, help="e.g. bf16_c: this float kernel, not the registry's"
    )
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    dtype = getattr(torch, args.dtype)
    table = TuningTable.load(tuning_key(dtype))
    generator = torch.Generator().manual_seed(0)
    print(
        f"{args.layers} weights a shape, {args.dtype}, {torch.get_num_threads()} threads, best of {args.rounds}"
    )
    print("shape (NxK)  rows  microseconds a layer (float / int8: above 1, int8 is faster)")
    with torch.inference_mode():
        for n, k in SHAPES:
            floats = [(torch.randn(n, k, generator=generator) * 0.05) for _ in range(args.layers)]
            quantized = [Int8Weight.quantize(w) for w in floats]
            dequantized = [q.dequantize().to(dtype) for q in quantized]
            float_modules, names = _float_path(table, dequantized, max(args.rows), args.float_impl)
            paths = {"float": float_modules}
            for kind in KINDS:
                builders = [
                    quantized_candidates(q, d, None, w8a8=True)
                    for q, d in zip(quantized, dequantized, strict=True)
                ]
                if all(kind in b for b in builders):
                    paths[kind] = [b[kind]() for b in builders]
            for rows in args.rows:
                x = torch.randn(rows, k, generator=generator).to(dtype)
                us = _best_us(paths, x, args.rounds)
                cells = "  ".join(
                    f"{kind} {us[kind]:7.1f} ({us['float'] / us[kind]:4.2f}x)" for kind in KINDS if kind in us
                )
                print(f"{n:5d}x{k:<5d} {rows:5d}  float {us['float']:7.1f} ({names})  {cells}")
    table.save()


if __name__ == "__main__":
    main()
