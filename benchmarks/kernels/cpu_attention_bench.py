"""CPU decode attention: the C kernel against the torch path (gather + SDPA), interleaved.

The default shapes are the default model's (9 query heads, 3 KV heads, head_dim 64, block_size 16)
at 64 sequences with log-normal contexts around 250 tokens and shuffled blocks. One "step" is 30
calls (the model's 30 layers), each on its own cache as in the engine. Prints the median milliseconds a step of each path and their ratio:

    python benchmarks/kernels/cpu_attention_bench.py --num-threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from batchgen.kernels.cpu import attention as cpu_attention  # noqa: E402
from batchgen.model.attention import AttentionMetadata, CPUAttentionBackend, TorchAttentionBackend  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--median-context", type=int, default=250, help="tokens")
    parser.add_argument("--num-q-heads", type=int, default=9)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30, help="calls per step")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--num-threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if cpu_attention.load_library() is None:
        sys.exit("the CPU kernel could not be built here (no C compiler?)")
    torch.set_num_threads(args.num_threads)
    dtype = getattr(torch, args.dtype)
    rng = np.random.default_rng(0)
    lens = np.clip(rng.lognormal(np.log(args.median_context), 0.6, args.num_seqs).astype(int), 1, None)
    blocks = -(-lens // args.block_size)
    order = rng.permutation(int(blocks.sum()))
    tables = np.zeros((args.num_seqs, int(blocks.max())), np.int32)
    used = 0
    for row, count in enumerate(blocks):
        tables[row, :count] = order[used : used + count]
        used += count
    shape = (int(blocks.sum()), args.block_size, args.num_kv_heads, args.head_dim)
    # A cache per layer, as in the engine: one layer's K/V alone would stay in the CPU's L3 cache.
    caches = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(args.layers)]
    query = torch.randn(args.num_seqs, args.num_q_heads, args.head_dim).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64),
        query_start_loc=torch.arange(args.num_seqs + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.from_numpy(tables),
        num_decodes=args.num_seqs,
        max_query_len=1,
        max_seq_len=int(lens.max()),
        query_lens_cpu=[1] * args.num_seqs,
        seq_lens_cpu=lens.tolist(),
    )
    empty = torch.empty(0, args.num_kv_heads, args.head_dim, dtype=dtype)
    scale = args.head_dim**-0.5
    backends = {"torch": TorchAttentionBackend(), "cpu kernel": CPUAttentionBackend()}
    times: dict[str, list[float]] = {name: [] for name in backends}
    for _ in range(args.rounds):
        for name, backend in backends.items():
            meta.scratch.clear()
            start = time.perf_counter()
            for k_cache, v_cache in caches:
                backend.forward(query, empty, empty, k_cache, v_cache, meta, scale)
            times[name].append((time.perf_counter() - start) * 1e3)
    kv_mb = int(lens.sum()) * 2 * args.num_kv_heads * args.head_dim * caches[0][0].element_size() / 1e6
    print(
        f"{args.num_seqs} sequences, {int(lens.sum())} context tokens, {kv_mb:.1f} MB of K/V a layer, "
        f"{args.dtype}, {args.num_threads} threads, {args.layers} layers a step, median of {args.rounds}"
    )
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, ms in medians.items():
        print(f"{name:>10}: {ms:7.1f} ms a step  ({kv_mb * args.layers / ms:.1f} GB/s of K/V)")
    print(f"speed-up: {medians['torch'] / medians['cpu kernel']:.2f}x")


if __name__ == "__main__":
    main()
