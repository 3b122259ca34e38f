"""CPU prefill attention: the C kernels against the torch path (SDPA per sequence), interleaved.

Default shapes are the default model's (9 query heads, 3 KV heads, head_dim 64, block_size 16,
bf16). For each prompt length, one whole-prompt chunk with no cached prefix goes through both
backends' `forward` (the K/V already in a shuffled paged cache): the AVX-512 kernel ("kernel") and,
where the CPU has AMX, the AMX flash kernel ("amx", `csrc/amx_prefill_attention.c`); prints the
median milliseconds a call, the causal attention's GFLOP/s (4 * Hq * D * L^2 / 2 FLOPs) and each
kernel's speed against torch's:

    python benchmarks/kernels/cpu_prefill_attention_bench.py --lengths 300,1200,2048
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from batchgen.kernels.cpu import attention as cpu_attention  # noqa: E402
from batchgen.model.attention import AttentionMetadata, CPUAttentionBackend, TorchAttentionBackend  # noqa: E402


def prefill_case(length: int, args: argparse.Namespace, dtype: torch.dtype):
    """Query, the chunk's own K/V rows, caches holding them in shuffled blocks, and the metadata."""
    num_blocks = -(-length // args.block_size)
    shape = (num_blocks + 8, args.block_size, args.num_kv_heads, args.head_dim)
    k_cache, v_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    table = torch.randperm(shape[0])[:num_blocks].to(torch.int32)[None]
    slots = [
        int(table[0, t // args.block_size]) * args.block_size + t % args.block_size for t in range(length)
    ]
    key = k_cache.view(-1, args.num_kv_heads, args.head_dim)[slots]
    value = v_cache.view(-1, args.num_kv_heads, args.head_dim)[slots]
    query = torch.randn(length, args.num_q_heads, args.head_dim).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64),
        query_start_loc=torch.tensor([0, length], dtype=torch.int32),
        seq_lens=torch.tensor([length], dtype=torch.int32),
        block_tables=table,
        num_decodes=0,
        max_query_len=length,
        max_seq_len=length,
        query_lens_cpu=[length],
        seq_lens_cpu=[length],
    )
    return query, key, value, k_cache, v_cache, meta


def add_shape_arguments(parser: argparse.ArgumentParser, rounds: int) -> None:
    """The attention shape and timing options both attention scripts take (the default model's
    heads, bf16); `rounds`: interleaved timing rounds by default."""
    parser.add_argument("--num-q-heads", type=int, default=9)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--num-threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=rounds)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", default="300,1200,2048", help="prompt lengths in tokens, comma list")
    add_shape_arguments(parser, rounds=7)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    dtype = getattr(torch, args.dtype)
    if not cpu_attention.supports_prefill(dtype, args.head_dim, args.num_q_heads, args.num_kv_heads):
        sys.exit("the C prefill kernel is not available for these shapes (or could not be built)")
    torch.manual_seed(0)
    backends = {"torch": TorchAttentionBackend(), "kernel": CPUAttentionBackend()}
    if cpu_attention.supports_prefill_amx(dtype, args.head_dim, args.num_q_heads, args.num_kv_heads):
        backends["amx"] = CPUAttentionBackend()
        backends["amx"].prefill_by_bucket = ["amx"]  # every chunk length on the AMX kernel
    scale = args.head_dim**-0.5
    print(
        f"{args.dtype}, {args.num_q_heads} query / {args.num_kv_heads} KV heads of {args.head_dim}, "
        f"{args.num_threads} threads, bf16 dot products: {cpu_attention.prefill_uses_bf16_dot()}"
    )
    for length in (int(x) for x in args.lengths.split(",")):
        case = prefill_case(length, args, dtype)
        times: dict[str, list[float]] = {name: [] for name in backends}
        for _ in range(args.rounds):  # interleaved, so a slow spell of the machine hits both
            for name, backend in backends.items():
                case[-1].scratch.clear()
                start = time.perf_counter()
                backend.forward(*case, scale)
                times[name].append(time.perf_counter() - start)
        flops = 4 * args.num_q_heads * args.head_dim * length * length / 2
        median = {name: statistics.median(t[1:]) for name, t in times.items()}  # first round: warm-up
        print(
            f"L={length}: "
            + ", ".join(
                f"{name} {ms * 1e3:.2f} ms ({flops / ms / 1e9:.0f} GFLOP/s"
                + ("" if name == "torch" else f", {median['torch'] / ms:.2f}x torch")
                + ")"
                for name, ms in median.items()
            )
        )


if __name__ == "__main__":
    main()
