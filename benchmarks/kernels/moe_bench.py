#!/usr/bin/env python
"""One mixture-of-experts layer's experts at a few tokens: each path's time against the bytes it must read.

The layer has Qwen3-30B-A3B's shapes by default (hidden 2048, 128 experts of width 768, top-8) with
random weights and a random router, so routing is near-uniform. For each token count a round draws
new tokens, routes them, and times every path once on them in turn (so a slow spell of a shared
machine hits them alike), with a 64 MiB buffer read between calls so that no path finds another's
experts in the last-level cache. The bound of a call is the bytes it must read (the router and the
routed experts' gate, up and down weights; activations are negligible) over the machine's memory copy
rate, measured in the same round by the bench's own probe (`roofline.measure_memory_bandwidth`).
Prints each path's median milliseconds and its median ratio to that bound (1.0 = bandwidth-bound):

    python benchmarks/kernels/moe_bench.py --tokens 1 8 32 --num-threads 2
    BATCHGEN_MAX_CPU_ISA=AVX2 python benchmarks/kernels/moe_bench.py --dtype float32

Paths: "torch" (the router's `default_experts_matmul`: torch's grouped matmul where this torch has
it), "loop" (one `F.linear` pair per routed expert), "fused_c" (`kernels/cpu/moe.py fused_experts`,
one C call for the layer) and, with `--phases`, the routing, grouping and combine steps of the torch
path timed alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from batchgen.bench.report.roofline import measure_memory_bandwidth  # noqa: E402
from batchgen.kernels.cpu import moe as cpu_moe  # noqa: E402
from batchgen.kernels.cpu.moe import fused_experts, fused_experts_apply  # noqa: E402
from batchgen.model import moe  # noqa: E402


def build_block(args: argparse.Namespace, dtype: torch.dtype) -> moe.SparseMoeBlock:
    """A `SparseMoeBlock` of the given shapes with random weights (std 0.02, as transformers' init)."""
    spec = moe.MoeSpec(args.experts, args.top_k, args.intermediate_size, True, False)
    block = moe.SparseMoeBlock(args.hidden_size, spec).to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    return block


def paths(block: moe.SparseMoeBlock) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Path name -> `x [T, H]` -> the block's output, each on the block's own weights."""
    experts = block.experts

    def with_matmul(matmul: moe.ExpertsMatmul) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(x: torch.Tensor) -> torch.Tensor:
            experts.matmul = matmul
            return block(x)

        return run

    def fused(x: torch.Tensor) -> torch.Tensor:
        logits = block.gate(x)
        weights, ids = moe.route(logits, block.spec.top_k, block.spec.norm_topk_prob, logits.dtype)
        return fused_experts(x, weights, ids, experts.gate_up_proj, experts.down_proj)

    found = {"torch": with_matmul(moe.default_experts_matmul("cpu")), "loop": with_matmul(moe.experts_loop)}
    if cpu_moe.bf16_experts_apply(experts.gate_up_proj, experts.down_proj):
        packed = (cpu_moe.pack_experts(experts.gate_up_proj), cpu_moe.pack_experts(experts.down_proj))

        def per_expert_c(x: torch.Tensor) -> torch.Tensor:
            logits = block.gate(x)
            weights, ids = moe.route(logits, block.spec.top_k, block.spec.norm_topk_prob, logits.dtype)
            groups = moe.group_by_expert(ids, block.spec.num_experts)
            rows = x[groups.order // ids.shape[1]]
            out = cpu_moe.bf16_experts(rows, *packed, groups.counts.tolist())
            return moe.combine(out, weights, groups, x.dtype)

        found["bf16_c"] = per_expert_c

        def fused_packed(x: torch.Tensor) -> torch.Tensor:
            logits = block.gate(x)
            weights, ids = moe.route(logits, block.spec.top_k, block.spec.norm_topk_prob, logits.dtype)
            return fused_experts(x, weights, ids, *packed)

        if fused_experts_apply(*packed):
            found["fused_packed"] = fused_packed
    if fused_experts_apply(experts.gate_up_proj, experts.down_proj):
        found["fused_c"] = fused
    return found


def routed_bytes(block: moe.SparseMoeBlock, x: torch.Tensor) -> int:
    """Bytes a call on `x` must read: the router and each routed expert's gate, up and down rows."""
    logits = block.gate(x)
    _, ids = moe.route(logits, block.spec.top_k, block.spec.norm_topk_prob, logits.dtype)
    experts = block.experts
    per_expert = (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()) * x.element_size()
    return int(ids.unique().numel()) * per_expert + block.gate.weight.numel() * x.element_size()


def phase_times(block: moe.SparseMoeBlock, x: torch.Tensor) -> dict[str, float]:
    """Seconds of the torch path's steps outside the experts' matmuls: router + top-k, grouping and
    gather, combine (weights, scatter, slot sum)."""
    times = {}
    t0 = time.perf_counter()
    logits = block.gate(x)
    weights, ids = moe.route(logits, block.spec.top_k, block.spec.norm_topk_prob, logits.dtype)
    times["route"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    groups = moe.group_by_expert(ids, block.spec.num_experts)
    rows = x[groups.order // ids.shape[1]]
    times["group+gather"] = time.perf_counter() - t0
    out = torch.zeros(rows.shape[0], x.shape[1], dtype=x.dtype)
    t0 = time.perf_counter()
    moe.combine(out, weights, groups, x.dtype)
    times["combine"] = time.perf_counter() - t0
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--intermediate-size", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--paths", nargs="+", default=None, help="only these paths")
    parser.add_argument("--phases", action="store_true", help="also time the torch path's steps")
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    torch.manual_seed(0)
    block = build_block(args, getattr(torch, args.dtype))
    runs = {n: f for n, f in paths(block).items() if args.paths is None or n in args.paths}
    flush = torch.ones(2**24)  # 64 MiB: twice the last-level cache of the machines measured
    print(f"threads {torch.get_num_threads()}, {args.dtype}, paths {', '.join(runs)}")
    with torch.no_grad():
        for tokens in args.tokens:
            ms: dict[str, list[float]] = {n: [] for n in runs}
            ratio: dict[str, list[float]] = {n: [] for n in runs}
            phases: dict[str, list[float]] = {}
            rates, reads = [], []
            for _ in range(args.rounds + 1):  # the first round warms up, untimed
                x = torch.randn(tokens, args.hidden_size).to(block.gate.weight.dtype)
                rate = measure_memory_bandwidth("cpu", repeats=2)["bytes_per_s"]
                need = routed_bytes(block, x)
                for name, run in runs.items():
                    flush.sum()
                    t0 = time.perf_counter()
                    run(x)
                    seconds = time.perf_counter() - t0
                    ms[name].append(1e3 * seconds)
                    ratio[name].append(seconds / (need / rate))
                if args.phases:
                    for key, s in phase_times(block, x).items():
                        phases.setdefault(key, []).append(1e3 * s)
                rates.append(rate)
                reads.append(need)
            line = ", ".join(
                f"{n} {statistics.median(ms[n][1:]):.2f} ms ({statistics.median(ratio[n][1:]):.2f}x)"
                for n in runs
            )
            extra = ", ".join(f"{k} {statistics.median(v[1:]):.3f} ms" for k, v in phases.items())
            print(
                f"{tokens:4d} tokens: reads {statistics.median(reads) / 1e6:.1f} MB at "
                f"{statistics.median(rates[1:]) / 1e9:.1f} GB/s copy -> bound "
                f"{1e3 * statistics.median(reads) / statistics.median(rates[1:]):.2f} ms; {line}"
                + (f"; torch path steps: {extra}" if extra else "")
            )


if __name__ == "__main__":
    main()
