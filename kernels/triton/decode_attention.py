"""Paged decode attention: one query token per sequence against its whole cached context.

Each program owns one (sequence, KV head) pair and all the query heads of that KV head's GQA group, so
every K/V row is read from device memory once per step: decode is memory-bound and the bytes of K/V
are the cost. The context is walked in tiles of BLOCK_N tokens that span several cache blocks, looked
up through the block table (PagedAttention, Kwon et al. 2023, https://arxiv.org/abs/2309.06180), with
an online softmax in float32 (FlashAttention-2, Dao 2023, https://arxiv.org/abs/2307.08691).

When there are too few (sequence, KV head) pairs to fill the GPU, the context is split into
`num_splits` ranges processed by separate programs, each writing a partial output and its
log-sum-exp; a second kernel merges them (flash-decoding, Dao et al. 2023,
https://crfm.stanford.edu/2023/10/12/flashdecoding.html).

Attention sinks (gpt-oss: one logit per query head that joins the softmax denominator and nothing
else) are added once a row's maximum over its keys is known: unsplit, at the end of the walk; split,
in the merge, where the sink is one more log-sum-exp term without an output.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

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

LOG2E = 1.4426950408889634
MAX_SPLITS = 64
# A split shorter than this spends more on its partial output and the merge than it saves.
MIN_TOKENS_PER_SPLIT = 256


@triton.jit
def mma(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """`acc + a @ b` with a float32 accumulator.

    UPCAST is set only under TRITON_INTERPRET for bfloat16: Triton's interpreter multiplies the raw
    bits of bfloat16 operands as integers, so there both operands go to float32 first (bf16 products
    are exact in float32, so the result matches the GPU's bf16 MMA up to summation order).
    """
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def paged_rows(
    block_table_ptr,
    stride_bt,
    tokens,
    token_mask,
    kv_head,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    MASK_TOKENS: tl.constexpr,
):
    """Element offsets (int64) of the cache rows holding `tokens` of one sequence, for one KV head."""
    if MASK_TOKENS:
        # Tokens past the context may index past the block table's row: never load those entries.
        blocks = tl.load(block_table_ptr + (tokens // BLOCK_SIZE) * stride_bt, mask=token_mask, other=0)
    else:
        blocks = tl.load(block_table_ptr + (tokens // BLOCK_SIZE) * stride_bt)
    return blocks.to(tl.int64) * stride_cb + (tokens % BLOCK_SIZE) * stride_cs + kv_head * stride_ch


@triton.jit
def load_rows(
    ptr,
    rows,
    row_mask,
    dims,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    MASK_ROWS: tl.constexpr,
):
    """Load `[len(rows), HEAD_DIM_PAD]`; masked rows and padded dims read as 0."""
    ptrs = ptr + rows[:, None] + dims[None, :]
    # Masks only where needed: an all-true mask the compiler cannot prove costs vectorized loads.
    if MASK_ROWS:
        if HEAD_DIM == HEAD_DIM_PAD:
            x = tl.load(ptrs, mask=row_mask[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_mask[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    else:
        if HEAD_DIM == HEAD_DIM_PAD:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=dims[None, :] < HEAD_DIM, other=0.0)
    return x


@triton.jit
def window_start(seq_len, window):
    """The first key a sequence's last position sees: `seq_len - window` in a sliding window
    (`window` > 0, Hugging Face's `kv_idx > q_idx - sliding_window`), else 0."""
    return tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)


@triton.jit
def add_sink(acc, m_i, l_i, sinks_ptr, heads, head_mask):
    """Fold each row's sink logit (natural units, `sinks_ptr[heads]`) into an online softmax's state
    (`m_i`, `l_i` in log2 units): both terms rescaled to the larger maximum, the sink's exp2 added to
    the sum, the output unchanged otherwise. Returns (acc, l_i)."""
    sink = tl.load(sinks_ptr + heads, mask=head_mask, other=0.0) * 1.4426950408889634
    top = tl.maximum(m_i, sink)
    rescale = tl.exp2(m_i - top)
    return acc * rescale[:, None], l_i * rescale + tl.exp2(sink - top)


def check_sinks(sinks: torch.Tensor | None, num_q_heads: int, device: torch.device) -> torch.Tensor | None:
    """The kernels' sinks: float32 `[num_q_heads]` on `device`, contiguous, or None (no sinks).

    Raises:
        TypeError: not a float32 tensor.
        ValueError: another shape, device or layout.
    """
    if sinks is None:
        return None
    check_tensor("sinks", sinks, 1, (torch.float32,))
    if sinks.shape[0] != num_q_heads or sinks.device != device or (num_q_heads > 1 and sinks.stride(0) != 1):
        raise ValueError(
            f"sinks must be a contiguous [{num_q_heads}] tensor on {device}; got {tuple(sinks.shape)} on {sinks.device}"
        )
    return sinks


@triton.jit
def split_length(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Tokens per split of one sequence: an even share rounded up to whole tiles (>= one tile)."""
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(per_split, BLOCK_N)


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    sinks_ptr,
    qk_scale,
    num_splits,
    window,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_btb,
    stride_btn,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Only the keys from `first` on are attended (a sliding window's), and only they are split.
    first = window_start(seq_len, window)
    if SPLIT:
        per_split = split_length(seq_len - first, num_splits, BLOCK_N)
        start = first + split * per_split
        end = tl.minimum(start + per_split, seq_len)
    else:
        start = first
        end = seq_len

    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
    head_mask = tl.arange(0, GROUP_PAD) < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    q_rows = seq.to(tl.int64) * stride_qb + heads * stride_qh
    q = load_rows(q_ptr, q_rows, head_mask, dims, HEAD_DIM, HEAD_DIM_PAD, True)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_btb
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        rows = paged_rows(
            table, stride_btn, tokens, token_mask, kv_head, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, True
        )
        k = load_rows(k_cache_ptr, rows, token_mask, dims, HEAD_DIM, HEAD_DIM_PAD, True)
        v = load_rows(v_cache_ptr, rows, token_mask, dims, HEAD_DIM, HEAD_DIM_PAD, True)
        # Scores in log2 units: exp2 is the cheap exponential on the GPU.
        s = mma(q, tl.trans(k), tl.zeros([GROUP_PAD, BLOCK_N], tl.float32), PRECISION, UPCAST) * qk_scale
        s = tl.where(token_mask[None, :], s, float("-inf"))
        # Every tile holds at least one valid token, so m_new is finite and no NaN arises.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], PRECISION, UPCAST)
        m_i = m_new

    if HAS_SINKS and not SPLIT:  # split: the merge adds the sink, once
        acc, l_i = add_sink(acc, m_i, l_i, sinks_ptr, heads, head_mask)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if SPLIT:
        # Partials are [B, Hq, num_splits, HEAD_DIM_PAD] float32 and their log2-sum-exp [B, Hq, num_splits].
        num_q_heads = tl.num_programs(1) * GROUP
        part = (seq.to(tl.int64) * num_q_heads + heads) * num_splits + split
        # (A tensor-vs-scalar `&` yields a non-boolean mask in Triton's interpreter: compare as a tensor.)
        written = head_mask & ((start + 0 * heads) < seq_len)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], o, mask=written[:, None])
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_safe), mask=written)
    else:
        out_rows = seq.to(tl.int64) * stride_ob + heads * stride_oh
        mask = head_mask[:, None] & (dims[None, :] < HEAD_DIM)
        tl.store(out_ptr + out_rows[:, None] + dims[None, :], o.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    sinks_ptr,
    num_splits,
    window,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Only the splits that held tokens wrote partials; this count mirrors the decode kernel's ranges.
    attended = seq_len - window_start(seq_len, window)
    num_active = tl.cdiv(attended, split_length(attended, num_splits, BLOCK_N))
    splits = tl.arange(0, SPLITS_PAD)
    active = splits < num_active
    part = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_splits + splits
    lse = tl.load(part_lse_ptr + part, mask=active, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    if HAS_SINKS:  # the sink: one more term of the denominator, with no output
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634
        lse_max = tl.maximum(lse_max, sink)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # an empty context: output zeros
    weights = tl.where(active, tl.exp2(lse - lse_max), 0.0)
    dims = tl.arange(0, HEAD_DIM_PAD)
    parts = tl.load(
        part_out_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], mask=active[:, None], other=0.0
    )
    total = tl.sum(weights, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - lse_max)
    o = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    out = out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + dims
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def check_window(window: int | None) -> int:
    """The kernels' `window` argument: the window in tokens, 0 for none.

    Raises:
        ValueError: a window that is not None or an int >= 1.
    """
    if window is None:
        return 0
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be None or an int >= 1; got {window!r}")
    return window


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a nominal 16 for the interpreter."""
    if device.type != "cuda":
        return 16
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, sms: int) -> int:
    """Context splits so that few long sequences still occupy the whole GPU.

    One program per (sequence, KV head) fills the GPU once there are about two per multiprocessor
    (enough bytes in flight per SM); below that, each context is cut into more ranges, but never into
    ranges shorter than MIN_TOKENS_PER_SPLIT tokens, and never into more than MAX_SPLITS.
    """
    programs = max(1, batch * num_kv_heads)
    target = 2 * sms
    if programs >= target:
        return 1
    wanted = math.ceil(target / programs)
    by_length = max(1, max_seq_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def decode_config(dtype: torch.dtype, head_dim: int) -> dict[str, int]:
    """Tile size and launch shape for the decode kernel.

    A tile of BLOCK_N tokens of K (or V) takes at most 16 KiB in 16-bit dtypes (64 tokens at
    head_dim 128), so a program keeps ~40 KiB of shared memory and five fit on a Hopper SM. float32
    gets 8 KiB tiles: its IEEE dot runs on FMAs, and larger tiles made ptxas spill (sm_90 build).
    """
    elem = torch.tensor([], dtype=dtype).element_size()
    budget = 16384 if elem <= 2 else 8192
    block_n = min(128, max(16, budget // (padded_dim(head_dim) * elem)))
    return {"BLOCK_N": block_n, "num_warps": 4, "num_stages": 3}


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    *,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    Args:
        query: `[B, Hq, D]` float16 / bfloat16 / float32 (the cache dtype); head_dim stride 1, any
            other strides.
        k_cache, v_cache: `[num_blocks, block_size, Hkv, D]`; Hq must be a multiple of Hkv (GQA: query
            head h reads KV head h // (Hq / Hkv)). D at most 256; non-power-of-two D is padded with masks.
        block_tables: int32 `[B, max_blocks]`, physical block ids of each sequence; any strides. Only
            the first ceil(seq_len / block_size) entries of a row are read.
        seq_lens: int32 `[B]`, context length in tokens including the query token itself (>= 1; a
            length of 0 gives a zero output).
        scale: softmax scale applied to q.k (usually head_dim ** -0.5).
        num_splits: context ranges per sequence (flash-decoding), 1 to 64; None picks one from the
            batch size, the KV head count and the context length (`choose_num_splits`).
        max_seq_len: longest context in tokens, used only to pick num_splits; default
            `max_blocks * block_size`, an upper bound known without a device sync.
        out: optional `[B, Hq, D]` tensor of the query's dtype to write into (head_dim stride 1).
        config: tile overrides (`BLOCK_N`, `num_warps`, `num_stages`) for benchmarking.
        window: a sliding-window layer's window in tokens: each query sees only its last `window`
            keys (its own included), and the blocks before them are not read; None: all of them.
        sinks: float32 `[Hq]` on the query's device, each query head's attention sink logit
            (gpt-oss), which joins its softmax denominator and nothing else; None: no sinks.

    Returns:
        `[B, Hq, D]` in the query's dtype (`out` when given). Softmax and accumulation are float32.

    Raises:
        TypeError: a non-tensor argument or a wrong dtype.
        ValueError: inconsistent shapes, devices, strides or arguments out of range.

    Sources: PagedAttention (Kwon et al. 2023), FlashAttention-2 online softmax (Dao 2023),
    flash-decoding split-KV (Dao et al. 2023).
    """
    _, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    check_tensor("query", query, 3, FLOAT_DTYPES)
    check_tensor("block_tables", block_tables, 2, (torch.int32,))
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,))
    batch, num_q_heads, q_dim = query.shape
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
    if seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens must be [B={batch}]; got {tuple(seq_lens.shape)}")
    if batch > 1 and seq_lens.stride(0) != 1:
        raise ValueError("seq_lens must be contiguous")
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number; got {scale!r}")
    if num_splits is not None and (not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits must be None or an int in [1, {MAX_SPLITS}]; got {num_splits!r}")
    if max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len < 0):
        raise ValueError(f"max_seq_len must be None or an int >= 0; got {max_seq_len!r}")
    window_arg = check_window(window)
    tensors = {
        "query": query,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": block_tables,
        "seq_lens": seq_lens,
    }
    if out is None:
        out = torch.empty(batch, num_q_heads, head_dim, dtype=query.dtype, device=query.device)
    else:
        check_tensor("out", out, 3, (query.dtype,))
        if out.shape != query.shape:
            raise ValueError(f"out must have the query's shape {tuple(query.shape)}; got {tuple(out.shape)}")
        check_inner_contiguous("out", out)
        tensors["out"] = out
    device = check_device(tensors)
    sinks = check_sinks(sinks, num_q_heads, device)
    if batch == 0:
        return out

    cfg = decode_config(query.dtype, head_dim)
    cfg.update(config or {})
    if num_splits is None:
        longest = block_tables.shape[1] * block_size if max_seq_len is None else max_seq_len
        longest = longest if window is None else min(longest, window)
        num_splits = choose_num_splits(batch, num_kv_heads, longest, num_sms(device))
    group = num_q_heads // num_kv_heads
    head_dim_pad = padded_dim(head_dim)
    split = num_splits > 1
    if split:
        part_out = torch.empty(
            batch, num_q_heads, num_splits, head_dim_pad, dtype=torch.float32, device=device
        )
        part_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=device)
    else:
        part_out = part_lse = out  # unused
    launch(
        _decode_kernel,
        (batch, num_kv_heads, num_splits),
        (
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            out,
            part_out,
            part_lse,
            query if sinks is None else sinks,  # never read without sinks
            float(scale) * LOG2E,
            num_splits,
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
            GROUP=group,
            GROUP_PAD=padded_dim(group),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            BLOCK_SIZE=block_size,
            BLOCK_N=cfg["BLOCK_N"],
            SPLIT=split,
            HAS_SINKS=sinks is not None,
            PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
            UPCAST=interpreting() and query.dtype == torch.bfloat16,
        ),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if split:
        launch(
            _decode_reduce_kernel,
            (batch, num_q_heads),
            (
                part_out,
                part_lse,
                seq_lens,
                out,
                out if sinks is None else sinks,
                num_splits,
                window_arg,
                out.stride(0),
                out.stride(1),
            ),
            dict(
                HEAD_DIM=head_dim,
                HEAD_DIM_PAD=head_dim_pad,
                SPLITS_PAD=triton.next_power_of_2(num_splits),
                BLOCK_N=cfg["BLOCK_N"],
                HAS_SINKS=sinks is not None,
            ),
            num_warps=4,
            num_stages=1,
        )
    return out
