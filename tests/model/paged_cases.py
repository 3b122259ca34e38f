"""Random paged caches shared by the CPU attention-kernel tests."""

from __future__ import annotations

import torch


def shuffled_caches(seq_lens, dtype, head_dim, block_size, num_kv_heads, gen):
    """K/V caches `[num_blocks, block_size, Hkv, D]` of random values and int32 block tables for
    sequences of `seq_lens` tokens, their blocks shuffled over the pool (plus 5 unused blocks).

    The tables are a slice of a wider tensor, so their rows are strided 3 entries further than the
    kernels read, and each row holds one more entry (0) than its sequence needs.
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 5
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    wide = torch.zeros(len(seq_lens), max(blocks_per_seq) + 4, dtype=torch.int32)
    used = 0
    for row, count in enumerate(blocks_per_seq):
        wide[row, :count] = order[used : used + count]
        used += count
    return k_cache, v_cache, wide[:, : max(blocks_per_seq) + 1]
