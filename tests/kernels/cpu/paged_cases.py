"""Random paged caches, step metadata and the backend comparison shared by the CPU attention-kernel tests."""

from __future__ import annotations

import torch

from batchgen.model.attention import AttentionMetadata, CPUAttentionBackend, TorchAttentionBackend


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


def cached_step(query_lens, seq_lens, tables, num_decodes) -> AttentionMetadata:
    """Metadata of a step whose K/V rows the caches already hold (no slots to write): sequence i has
    `query_lens[i]` query rows, the last of its `seq_lens[i]` (int32 tensor) context tokens."""
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64),
        query_start_loc=torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32),
        seq_lens=seq_lens,
        block_tables=tables,
        num_decodes=num_decodes,
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens.tolist(),
    )


def assert_cpu_backend_matches_torch(
    query,
    key,
    value,
    k_cache,
    v_cache,
    meta,
    scale=0.125,
    prefill_by_bucket=None,
    after_prefix_by_bucket=None,
):
    """The "cpu" backend's output for one step equals the "torch" backend's within float32 error
    (`prefill_by_bucket` / `after_prefix_by_bucket`: the backend's measured prefill choice for chunks
    without and with a cached prefix, None: the C kernel throughout)."""
    expected = TorchAttentionBackend().forward(query, key, value, k_cache, v_cache, meta, scale)
    meta.scratch.clear()
    backend = CPUAttentionBackend()
    backend.prefill_by_bucket = prefill_by_bucket
    backend.prefill_after_prefix_by_bucket = after_prefix_by_bucket
    got = backend.forward(query, key, value, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def windowed_reference(query, k_cache, v_cache, tables, seq_lens, starts, scale, window=None, sinks=None):
    """Each query row alone, in float64: the keys of its context from `position - window + 1` (0
    without a window) up to its own position, softmax, weighted V. Sequence b's rows are
    `query[starts[b]:starts[b + 1]]`, the last positions of its `seq_lens[b]` tokens. `sinks` `[Hq]`:
    each head's sink logit joins its softmax as one more score whose probability is dropped."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = query.shape[1] // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    for seq, length in enumerate(seq_lens.tolist()):
        slots = [int(tables[seq, t // block_size]) * block_size + t % block_size for t in range(length)]
        k = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(group, 1)
        v = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(group, 1)
        first, last = int(starts[seq]), int(starts[seq + 1])
        for row in range(first, last):
            position = length - (last - first) + (row - first)
            lo = 0 if window is None else max(0, position - window + 1)
            scores = torch.einsum("hd,lhd->hl", query[row].double() * scale, k[lo : position + 1])
            if sinks is None:
                probs = scores.softmax(-1)
            else:
                probs = torch.cat((scores, sinks.double()[:, None]), dim=-1).softmax(-1)[:, :-1]
            out[row] = torch.einsum("hl,lhd->hd", probs, v[lo : position + 1])
    return out


def poison_before_windows(k_cache, v_cache, tables, seq_lens, starts, window):
    """Fill with NaN every cached K/V row that lies before all of its sequence's query rows'
    windows: a kernel that reads one (instead of skipping it) gives NaN."""
    block_size = k_cache.shape[1]
    for seq, length in enumerate(seq_lens.tolist()):
        first_position = length - (int(starts[seq + 1]) - int(starts[seq]))
        for t in range(max(0, first_position - window + 1)):
            block, offset = int(tables[seq, t // block_size]), t % block_size
            k_cache[block, offset] = float("nan")
            v_cache[block, offset] = float("nan")
