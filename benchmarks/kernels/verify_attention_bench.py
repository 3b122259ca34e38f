#!/usr/bin/env python
"""CPU attention of short chunks (a verification of speculative draft tokens): the prefill kernels'
tiles against the decode kernel's walk (`short_chunks`), interleaved.

For each (sequences, context, rows a chunk): B sequences of L tokens whose last Q positions are the
chunk (their K/V already in a shuffled paged cache). Prints the median milliseconds a call of the C
prefill kernel's tiles, the AMX kernel's (where the CPU has AMX), the short-chunk walk
(`paged_prefill_attention_cpu(..., short_chunks=True)`, which the engine uses in steps that verify
drafts, up to 8 rows on the C kernel and 6 on the AMX one) and, for scale, one decode row a
sequence at the same context::

    python benchmarks/kernels/verify_attention_bench.py --num-seqs 1,4,6 --contexts 300,1500 --rows 2,5,8,16
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cpu_prefill_attention_bench import add_shape_arguments  # noqa: E402  (this folder: sys.path[0])

from batchgen.kernels.cpu import attention as cpu_attention  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-seqs", default="1,4,6", help="sequences a call, comma list")
    parser.add_argument("--contexts", default="300,1500", help="context tokens a sequence, comma list")
    parser.add_argument("--rows", default="2,5,8,16", help="query rows a chunk (its last positions)")
    add_shape_arguments(parser, rounds=15)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    dtype = getattr(torch, args.dtype)
    hq, hkv, d, bs = args.num_q_heads, args.num_kv_heads, args.head_dim, args.block_size
    if not cpu_attention.supports_prefill(dtype, d, hq, hkv):
        sys.exit("the C prefill kernel is not available for these shapes (or could not be built)")
    has_amx = cpu_attention.supports_prefill_amx(dtype, d, hq, hkv)
    scale = d**-0.5
    print(f"{args.dtype}, {hq} query / {hkv} KV heads of {d}, {args.num_threads} threads, AMX: {has_amx}")
    torch.manual_seed(0)
    for num_seqs in _ints(args.num_seqs):
        for context in _ints(args.contexts):
            per_seq = -(-context // bs)
            num_blocks = num_seqs * per_seq + 8
            k_cache = torch.randn(num_blocks, bs, hkv, d).to(dtype)
            v_cache = torch.randn(num_blocks, bs, hkv, d).to(dtype)
            tables = torch.randperm(num_blocks)[: num_seqs * per_seq].to(torch.int32).view(num_seqs, per_seq)
            seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
            decode_query = torch.randn(num_seqs, hq, d).to(dtype)
            for rows in _ints(args.rows):
                query = torch.randn(num_seqs * rows, hq, d).to(dtype)
                starts = torch.arange(num_seqs + 1, dtype=torch.int32) * rows

                cache = (k_cache, v_cache, tables, seq_lens)
                prefill = functools.partial(cpu_attention.paged_prefill_attention_cpu, query, *cache)
                calls = {
                    "c tiles": functools.partial(prefill, starts, scale, kernel="c"),
                    "short walk": functools.partial(prefill, starts, scale, kernel="c", short_chunks=True),
                }
                if has_amx:
                    calls["amx tiles"] = functools.partial(prefill, starts, scale, kernel="amx")
                calls["1 decode row"] = functools.partial(
                    cpu_attention.paged_decode_attention_cpu, decode_query, *cache, scale
                )
                times: dict[str, list[float]] = {name: [] for name in calls}
                for _ in range(args.rounds):  # interleaved, so a slow spell of the machine hits all
                    for name, call in calls.items():
                        start = time.perf_counter()
                        call()
                        times[name].append(time.perf_counter() - start)
                median = {name: statistics.median(t[1:]) * 1e3 for name, t in times.items()}  # 1st: warm-up
                print(
                    f"{num_seqs} x {context} tokens, {rows} rows: "
                    + ", ".join(f"{name} {ms:.3f} ms" for name, ms in median.items())
                )


if __name__ == "__main__":
    main()
