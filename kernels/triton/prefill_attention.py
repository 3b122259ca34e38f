"""Chunked-prefill attention over the paged KV cache.

Each sequence contributes a chunk of query_len query tokens: the LAST query_len positions of its
seq_len-token context. A chunk attends fully to the cached prefix (seq_len - query_len tokens) and
causally to itself. All K/V, the chunk's own included, are read from the paged cache (the caller has
already stored the chunk's K/V with `store_kv_cache`).

One program computes BLOCK_M query rows of one head of one sequence with FlashAttention-2's online
softmax (Dao 2023, https://arxiv.org/abs/2307.08691), accumulating in float32. K/V tiles of BLOCK_N
tokens are gathered through the block table (PagedAttention, Kwon et al. 2023,
https://arxiv.org/abs/2309.06180). Tiles entirely before the row block's first position need no mask;
only the tiles on the causal diagonal are masked. In a sliding window (`window`) every tile from the
block's first window on is masked, and the tiles before it are not read. Attention sinks (gpt-oss's
per-head logits in the softmax denominator only) join each row's sum after the walk (`add_sink`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from batchgen.kernels.triton.decode_attention import (
    LOG2E,
    add_sink,
    check_sinks,
    check_window,
    load_rows,
    mma,
    paged_rows,
)
from batchgen.kernels.triton.store_kv_cache import (
    FLOAT_DTYPES,
    check_device,
    check_inner_contiguous,
    check_kv_cache,
    check_tensor,
    interpreting,
    launch,
    padded_dim,
)


@triton.jit
def _attend_tile(
    q,
    acc,
    m_i,
    l_i,
    tile_start,
    positions,
    row_lo,
    seq_len,
    table,
    k_cache_ptr,
    v_cache_ptr,
    kv_head,
    dims,
    qk_scale,
    stride_btn,
    stride_cb,
    stride_cs,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One online-softmax step of a query block over the K/V tile starting at `tile_start`; a row
    sees the keys after `row_lo` (its window's start - 1) up to its position."""
    tokens = tile_start + tl.arange(0, BLOCK_N)
    token_mask = tokens < seq_len
    rows = paged_rows(
        table, stride_btn, tokens, token_mask, kv_head, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, MASKED
    )
    k = load_rows(k_cache_ptr, rows, token_mask, dims, HEAD_DIM, HEAD_DIM_PAD, MASKED)
    v = load_rows(v_cache_ptr, rows, token_mask, dims, HEAD_DIM, HEAD_DIM_PAD, MASKED)
    s = mma(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK_N], tl.float32), PRECISION, UPCAST) * qk_scale
    if MASKED:
        allowed = (tokens[None, :] <= positions[:, None]) & (tokens[None, :] > row_lo[:, None])
        s = tl.where(allowed & token_mask[None, :], s, float("-inf"))
    # Without a window each row sees a key in its first tile (the unmasked tiles come first, and a
    # diagonal tile starts at or before the block's first position); in a window a row may see none
    # of a tile yet, so a maximum still -inf counts as 0 (exp2(-inf) = 0, no NaN).
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = mma(p.to(v.dtype), v, acc * alpha[:, None], PRECISION, UPCAST)
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    sinks_ptr,
    qk_scale,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_btb,
    stride_btn,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # Heads vary fastest across programs: the GQA group's heads of one row block run side by side and
    # share their K/V tiles through L2.
    head = tl.program_id(0)
    row_block = tl.program_id(1)
    seq = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - query_len

    first_row = row_block * BLOCK_M
    rows = first_row + tl.arange(0, BLOCK_M)
    row_mask = rows < query_len
    positions = prefix + rows
    dims = tl.arange(0, HEAD_DIM_PAD)
    q_offsets = (q_start + rows).to(tl.int64) * stride_qt + head * stride_qh
    q = load_rows(q_ptr, q_offsets, row_mask, dims, HEAD_DIM, HEAD_DIM_PAD, True)

    # Keys before the block's first position are visible to every row: no mask. Tiles from there to
    # the block's last position straddle the causal diagonal. A block past the chunk does nothing.
    active = first_row < query_len
    # A sliding window: every row's keys after row_lo; the tiles start at the first row's window (not
    # rounded down to a tile: no key before every window is read) and are all masked. Else row_lo
    # is -1 and the keys from 0 to the diagonal need no mask.
    row_lo = tl.where(window > 0, positions - window, -1)
    lo = tl.where(window > 0, tl.maximum(prefix + first_row - window + 1, 0), 0)
    diagonal = tl.where(active, (prefix + first_row) // BLOCK_N * BLOCK_N, 0)
    diagonal = tl.where(window > 0, lo, diagonal)
    end = tl.where(active, tl.minimum(seq_len, prefix + first_row + BLOCK_M), 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_btb
    for tile_start in range(lo, diagonal, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q,
            acc,
            m_i,
            l_i,
            tile_start,
            positions,
            row_lo,
            seq_len,
            table,
            k_cache_ptr,
            v_cache_ptr,
            kv_head,
            dims,
            qk_scale,
            stride_btn,
            stride_cb,
            stride_cs,
            stride_ch,
            HEAD_DIM,
            HEAD_DIM_PAD,
            BLOCK_SIZE,
            BLOCK_N,
            False,
            PRECISION,
            UPCAST,
        )
    for tile_start in range(diagonal, end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q,
            acc,
            m_i,
            l_i,
            tile_start,
            positions,
            row_lo,
            seq_len,
            table,
            k_cache_ptr,
            v_cache_ptr,
            kv_head,
            dims,
            qk_scale,
            stride_btn,
            stride_cb,
            stride_cs,
            stride_ch,
            HEAD_DIM,
            HEAD_DIM_PAD,
            BLOCK_SIZE,
            BLOCK_N,
            True,
            PRECISION,
            UPCAST,
        )

    if HAS_SINKS:  # rows past the chunk (m_i -inf) get l_i 1 and a zero output, never stored
        acc, l_i = add_sink(acc, m_i, l_i, sinks_ptr, head + 0 * rows, rows >= 0)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_offsets = (q_start + rows).to(tl.int64) * stride_ot + head * stride_oh
    mask = row_mask[:, None] & (dims[None, :] < HEAD_DIM)
    tl.store(out_ptr + out_offsets[:, None] + dims[None, :], o.to(out_ptr.dtype.element_ty), mask=mask)


def prefill_config(dtype: torch.dtype, head_dim: int) -> dict[str, int]:
    """Tile sizes and launch shape for the prefill kernel.

    16-bit dtypes, head_dim <= 128: 128x64 tiles, 8 warps, 3 stages (~96 KiB of shared memory; the
    sm_90 build uses wgmma). head_dim 256: 64x32 tiles. float32 runs its IEEE dots on FMAs, where
    larger tiles made ptxas spill registers (sm_90 build), hence 32x16 tiles.
    """
    if dtype == torch.float32:
        return {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 8, "num_stages": 2}
    if padded_dim(head_dim) <= 128:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of variable-length query chunks over their paged contexts (chunked prefill).

    Args:
        query: `[T, Hq, D]` float16 / bfloat16 / float32 (the cache dtype), the chunks of B sequences
            back to back; head_dim stride 1, any other strides.
        k_cache, v_cache: `[num_blocks, block_size, Hkv, D]` holding every context token, the chunk's
            own included; Hq a multiple of Hkv (GQA), D at most 256 (padded to a power of two).
        block_tables: int32 `[B, max_blocks]`, any strides; entries past a sequence's last block are
            never read.
        query_start_loc: int32 `[B + 1]`, prefix sums of the chunk lengths: sequence i's queries are
            rows `query_start_loc[i]:query_start_loc[i + 1]` of `query`, its last positions.
        seq_lens: int32 `[B]`, context length in tokens after this chunk (cached prefix + chunk), at
            least the chunk length.
        max_query_len: the longest chunk in tokens (sizes the grid; longer chunks would be cut off).
        scale: softmax scale applied to q.k.
        out: optional `[T, Hq, D]` tensor of the query's dtype to write into (head_dim stride 1).
        config: tile overrides (`BLOCK_M`, `BLOCK_N`, `num_warps`, `num_stages`) for benchmarking.
        window: a sliding-window layer's window in tokens: each query row sees only the `window`
            keys up to its own position; None: its whole context.
        sinks: float32 `[Hq]` on the query's device, per-head attention sink logits (as
            `paged_decode_attention`'s); None: no sinks.

    Returns:
        `[T, Hq, D]` in the query's dtype (`out` when given); rows outside every chunk are not written.

    Raises:
        TypeError: a non-tensor argument or a wrong dtype.
        ValueError: inconsistent shapes, devices, strides or arguments out of range.

    Sources: FlashAttention-2 (Dao 2023) online softmax over PagedAttention's block tables (Kwon et
    al. 2023).
    """
    _, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    check_tensor("query", query, 3, FLOAT_DTYPES)
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    check_tensor("query_start_loc", query_start_loc, 1, (torch.int32,))
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    num_tokens, num_q_heads, q_dim = query.shape
    batch = seq_lens.shape[0]
    if query.dtype != k_cache.dtype:
        raise TypeError(f"query dtype {query.dtype} differs from the cache dtype {k_cache.dtype}")
    if q_dim != head_dim:
        raise ValueError(f"query head_dim {q_dim} differs from the cache head_dim {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    check_inner_contiguous("query", query)
    if block_tables.shape[0] != batch or block_tables.shape[1] < 1:
        raise ValueError(
            f"block_tables must be [B={batch}, max_blocks >= 1]; got {tuple(block_tables.shape)}"
        )
    if query_start_loc.shape[0] != batch + 1:
        raise ValueError(f"query_start_loc must be [B + 1 = {batch + 1}]; got {tuple(query_start_loc.shape)}")
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if t.shape[0] > 1 and t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")
    if (
        not isinstance(max_query_len, int)
        or max_query_len < 0
        or (max_query_len == 0 and num_tokens and batch)
    ):
        raise ValueError(f"max_query_len must be a positive int (the longest chunk); got {max_query_len!r}")
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number; got {scale!r}")
    window_arg = check_window(window)
    tensors = {
        "query": query,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": block_tables,
        "query_start_loc": query_start_loc,
        "seq_lens": seq_lens,
    }
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    else:
        check_tensor("out", out, 3, (query.dtype,))
        if out.shape != query.shape:
            raise ValueError(f"out must have the query's shape {tuple(query.shape)}; got {tuple(out.shape)}")
        check_inner_contiguous("out", out)
        tensors["out"] = out
    sinks = check_sinks(sinks, num_q_heads, check_device(tensors))
    if batch == 0 or num_tokens == 0:
        return out

    cfg = prefill_config(query.dtype, head_dim)
    cfg.update(config or {})
    launch(
        _prefill_kernel,
        (num_q_heads, triton.cdiv(max_query_len, cfg["BLOCK_M"]), batch),
        (
            query,
            k_cache,
            v_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            out,
            query if sinks is None else sinks,  # never read without sinks
            float(scale) * LOG2E,
            window_arg,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            block_tables.stride(0),
            block_tables.stride(1),
        ),
        dict(
            GROUP=num_q_heads // num_kv_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=padded_dim(head_dim),
            BLOCK_SIZE=block_size,
            BLOCK_M=cfg["BLOCK_M"],
            BLOCK_N=cfg["BLOCK_N"],
            HAS_SINKS=sinks is not None,
            PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
            UPCAST=interpreting() and query.dtype == torch.bfloat16,
        ),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out
