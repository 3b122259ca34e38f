"""The torch reference path's attention building blocks: paged-cache gathers and SDPA calls.

`TorchAttentionBackend` (and the prefill chunks of the "cpu" backend) attend through torch's
`F.scaled_dot_product_attention`: decodes in groups of similar context length, gathered from the
paged cache into one padded, masked batch each (`decode_groups`, `decode_group_attention`), and
prefill chunks one call each, causally, after any cached prefix (`causal_attention`).

Three per-layer options reach both: a sliding `window` (each query sees only the `window` keys up to
its own position, Hugging Face's `kv_idx > q_idx - sliding_window`; None: all of them), Gemma 2's
attention logit `softcap` (scores `tanh(s / cap) * cap` before the mask and softmax, as
transformers' eager attention computes them) and gpt-oss's attention `sinks` (one learned logit per
query head that joins the softmax's denominator only: `p_j = exp(s_j) / (exp(sink) + sum_i
exp(s_i))`, a probability mass that attends to nothing; Xiao et al. 2023, arXiv:2309.17453, as
gpt-oss learns them). SDPA has neither step, so those layers take `attend`'s explicit products.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from batchgen.model.attention.base import AttentionMetadata


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Copy whole blocks out of a paged cache: `[n, block_size, Hkv, D]` for int `block_ids` `[n]`.

    The rows are moved as int64 words when the block's byte size allows: CPU `index_select` on
    16-bit floats copies element by element, several times slower than the word-sized copy
    (measured: docs/benchmarks.md).
    """
    block_ids = block_ids.long()
    flat = cache.view(cache.shape[0], -1)
    if cache.device.type == "cpu" and (flat.shape[1] * cache.element_size()) % 8 == 0:
        words = flat.view(torch.int64).index_select(0, block_ids)
        return words.view(cache.dtype).view(-1, *cache.shape[1:])
    return flat.index_select(0, block_ids).view(-1, *cache.shape[1:])


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached rows of one sequence: `[length, Hkv, D]` from `[N, bs, Hkv, D]`."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    rows = gather_blocks(cache, block_table[:num_blocks])
    return rows.reshape(-1, *cache.shape[2:])[:length]


@dataclass
class DecodeGroup:
    """Decode rows gathered and attended together (the same for every layer of a step).

    Attributes:
        index: int64 `[b]` rows of the step's decodes, or None for all of them in order.
        block_ids: int64 `[b * max_blocks]`, each row's first `max_blocks` block-table entries.
        mask: additive `[b, 1, 1, max_blocks * block_size]` in the query dtype: 0 within the row's
            context, -inf past it (SDPA converts a bool mask on every call; measured:
            docs/benchmarks.md).
    """

    index: torch.Tensor | None
    block_ids: torch.Tensor
    mask: torch.Tensor


def decode_groups(
    meta: AttentionMetadata, num_decodes: int, block_size: int, dtype: torch.dtype, window: int | None = None
) -> list[DecodeGroup]:
    """The step's first `num_decodes` sequences (of `meta`, an `AttentionMetadata`) as groups of
    similar context length, each with its block ids and length mask (`dtype`) built once a step;
    with a `window`, the mask also hides each row's keys before its last `window`."""
    groups = []
    device = meta.block_tables.device
    row_groups = length_groups(meta.seq_lens_cpu[:num_decodes], block_size)
    if len(row_groups) == 1:  # all rows alike: keep their order, so no index is needed
        row_groups = [list(range(num_decodes))]
    for rows in row_groups:
        max_blocks = -(-max(meta.seq_lens_cpu[r] for r in rows) // block_size)
        in_order = rows == list(range(num_decodes))
        index = None if in_order else torch.tensor(rows, device=device)
        tables = meta.block_tables[:num_decodes] if in_order else meta.block_tables[index]
        lens = meta.seq_lens[:num_decodes] if in_order else meta.seq_lens[index]
        positions = torch.arange(max_blocks * block_size, device=device)
        outside = positions[None, :] >= lens[:, None]
        if window is not None:
            outside |= positions[None, :] < lens[:, None] - window
        mask = torch.zeros(outside.shape, dtype=dtype, device=device).masked_fill_(outside, float("-inf"))
        groups.append(
            DecodeGroup(
                index=index, block_ids=tables[:, :max_blocks].long().flatten(), mask=mask[:, None, None, :]
            )
        )
    return groups


def decode_group_attention(
    grouped_query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One group's attention: query `[b, Hkv, G, D]` -> `[b, Hkv, G, D]` (`softcap` as `attend`'s;
    `sinks` `[Hq]` float32, query head `kv * G + g`'s sink logit, or None)."""
    num_rows = grouped_query.shape[0]
    shape = (num_rows, group.mask.shape[-1], k_cache.shape[2], k_cache.shape[3])
    k = gather_blocks(k_cache, group.block_ids).view(shape).transpose(1, 2)  # [b, Hkv, L, D]
    v = gather_blocks(v_cache, group.block_ids).view(shape).transpose(1, 2)
    if sinks is not None:  # the grouped layout's heads are (Hkv, G): one sink per (kv, g) row
        sinks = sinks.view(1, *grouped_query.shape[1:3], 1)
    return attend(
        grouped_query, k.to(grouped_query.dtype), v.to(grouped_query.dtype), group.mask, scale, softcap, sinks
    )


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`softmax(q k^T * scale + mask) v` over 4-D `[b, H, Q, D]` queries and `[b, Hkv, L, D]` keys and
    values (H a multiple of Hkv) with an additive `mask` broadcast to `[b, H, Q, L]`: SDPA, or with a
    `softcap` or `sinks` the explicit products in transformers' eager order (scale,
    `tanh(s / cap) * cap`, mask; with sinks, each row's sink logit appended as one more column, the
    row's maximum subtracted and the softmax taken in the scores' dtype, the sink's column then
    dropped, as transformers' gpt-oss does; else a float32 softmax; back to the query dtype, then V).
    `sinks` broadcasts to `[b, H, Q, 1]`."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    repeat = q.shape[1] // k.shape[1]
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + mask
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    combined = torch.cat((scores, sink), dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)


def length_groups(seq_lens: list[int], block_size: int, slack: float = 1.25) -> list[list[int]]:
    """Split decode rows into groups of similar context length (sorted ascending).

    Each group is gathered to its longest member, so grouping keeps the padded gather within `slack`
    times the blocks the group really holds: long-tail batches do not pad every row to the longest.
    """
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    groups: list[list[int]] = []
    current: list[int] = []
    held = 0
    for row in order:
        blocks = -(-seq_lens[row] // block_size)
        if current and blocks * (len(current) + 1) > slack * (held + blocks) + 4:
            groups.append(current)
            current, held = [], 0
        current.append(row)
        held += blocks
    if current:
        groups.append(current)
    return groups


# Query rows per SDPA call for a chunk that follows a cached prefix (see `_causal_attention`).
PREFIX_CHUNK_QUERY_TILE = 256


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q `[Q, Hq, D]` attends to k/v `[L, Hkv, D]` where the queries are the last Q of the L positions.

    Without a prefix (Q == L) one causal SDPA call. With one, SDPA needs an explicit mask and then
    computes the whole Q x L rectangle, masked half included, so the queries go in tiles of
    `PREFIX_CHUNK_QUERY_TILE` rows, each attending only to the keys up to its last row: about the
    causal triangle plus the prefix (measured: docs/benchmarks.md). The mask is additive, in the query dtype: SDPA converts a
    boolean one on every call. With a sliding `window` or a `softcap` (the module docstring) the
    tiles are used at any prefix, each reading only the keys from its first row's window on.
    `sinks`: float32 `[Hq]` per-head sink logits (`attend`), or None.
    """
    qlen, klen = q.shape[0], k.shape[0]
    # 4-D inputs: with 3-D ones, SDPA on CPU falls back to its slow unfused math kernel.
    qh = q.transpose(0, 1)[None]
    kh = k.transpose(0, 1).to(q.dtype)[None]
    vh = v.transpose(0, 1).to(q.dtype)[None]
    if sinks is not None:
        sinks = sinks.view(1, -1, 1, 1)
    if qlen == klen and window is None and softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    offset = klen - qlen
    rows = torch.arange(qlen, device=q.device)[:, None] + offset
    keys_at = torch.arange(klen, device=q.device)[None, :]
    hidden = keys_at > rows
    if window is not None:
        hidden |= keys_at <= rows - window
    mask = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill_(hidden, float("-inf"))
    out = torch.empty_like(q)
    for first in range(0, qlen, PREFIX_CHUNK_QUERY_TILE):
        last = min(qlen, first + PREFIX_CHUNK_QUERY_TILE)
        keys = offset + last
        start = 0 if window is None else max(0, offset + first - window + 1)
        tile = attend(
            qh[:, :, first:last],
            kh[:, :, start:keys],
            vh[:, :, start:keys],
            mask[first:last, start:keys],
            scale,
            softcap,
            sinks,
        )
        out[first:last] = tile[0].transpose(0, 1)
    return out
