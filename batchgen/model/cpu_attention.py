"""Paged decode attention on the CPU, in C (`csrc/paged_decode_attention.c`, built by `cpu_kernels`).

The torch decode path gathers every sequence's blocks into a padded copy before SDPA reads it, so
each K/V byte crosses memory three times. The C kernel reads the blocks in place through the block
table. On the default model's shapes (64 sequences, 19,296 context tokens, bf16, 30 layers with a
cache each: one decode step), `python scripts/cpu_attention_bench.py --num-threads 2` measured
131-154 ms for the torch path and 44-57 ms for the kernel (2.3-2.9x, 8-10 GB/s of K/V against about
14.5 GB/s of plain reads) on the 2-core development machine. On a 2-core AVX2 EPYC in float32 at 58
sequences around 400 tokens, the torch path took 771 ms and the kernel 131 ms (10 GB/s of K/V).
"""

from __future__ import annotations

import functools

import torch

from batchgen.model.cpu_kernels import load_library

DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def supports(dtype: torch.dtype, head_dim: int, num_q_heads: int, num_kv_heads: int) -> bool:
    """Whether the kernel library is available and compiled for this dtype, head size and GQA group.

    Compiled in: float32 and bfloat16; head_dim 16, 32, 64, 128; up to 16 query heads per KV head.
    """
    lib = load_library()
    if lib is None or dtype not in DTYPES or num_q_heads % num_kv_heads:
        return False
    group = num_q_heads // num_kv_heads
    return lib.paged_decode_attention_supported(int(dtype == torch.bfloat16), head_dim, group) == 0


def paged_decode_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    check_bounds: bool = True,
) -> torch.Tensor:
    """Attention of one query token per sequence to its paged context, in place (no gather).

    Args:
        query: `[B, Hq, D]`, float32 or bfloat16.
        k_cache / v_cache: `[num_blocks, block_size, Hkv, D]`, the query's dtype, contiguous.
        block_tables: int32 `[B, max_blocks]` (rows may be strided), covering each context.
        seq_lens: int32 `[B]`, context length of each sequence in tokens (>= 1), this step's token
            included (its K/V must already be in the cache).
        scale: softmax scale, usually `D ** -0.5`.
        check_bounds: check that every length and block id stays inside the tables and the cache
            (the kernel does not); a caller that calls once per layer with the same tables checks once.

    Returns:
        `[B, Hq, D]` in the query's dtype.

    Raises:
        RuntimeError: the library is not available, or the kernel failed to allocate scratch memory.
        ValueError: a shape, dtype, device or layout the kernel does not take (check `supports`).
    """
    lib = load_library()
    if lib is None:
        raise RuntimeError("the CPU attention kernel library is not available (see the log for why)")
    num_seqs, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if not supports(query.dtype, head_dim, num_q_heads, num_kv_heads):
        raise ValueError(
            f"no CPU kernel for dtype {query.dtype}, head_dim {head_dim}, {num_q_heads} query heads over "
            f"{num_kv_heads} KV heads; use the torch path"
        )
    if cache_head_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"cache shapes {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not fit query {tuple(query.shape)}"
        )
    if k_cache.dtype != query.dtype or v_cache.dtype != query.dtype:
        raise ValueError(f"caches must have the query's dtype {query.dtype}")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_tables and seq_lens must be int32")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} / seq_lens {tuple(seq_lens.shape)} do not match {num_seqs} sequences"
        )
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache), ("seq_lens", seq_lens)):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous CPU tensor")
    if block_tables.device.type != "cpu" or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be a CPU tensor with contiguous rows")
    if check_bounds and num_seqs:
        if int(seq_lens.min()) < 1 or int(seq_lens.max()) > block_tables.shape[1] * block_size:
            raise ValueError(
                f"seq_lens must lie in [1, {block_tables.shape[1] * block_size}] (the block tables' capacity)"
            )
        if int(block_tables.min()) < 0 or int(block_tables.max()) >= num_blocks:
            raise ValueError(f"block ids must lie in [0, {num_blocks})")
    out = torch.empty_like(query)
    status = lib.paged_decode_attention(
        int(query.dtype == torch.bfloat16),
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        num_seqs,
        num_q_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status:
        raise RuntimeError(f"CPU paged decode attention failed with status {status} (2: out of memory)")
    return out
