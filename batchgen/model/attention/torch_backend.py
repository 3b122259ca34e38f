"""The torch reference attention backend: paged-cache writes in torch, attention through SDPA
(`sdpa`). The CPU path where no C kernel applies, and the oracle the other backends are tested against.
"""

from __future__ import annotations

import torch

from batchgen.model.attention.base import AttentionBackend, AttentionMetadata
from batchgen.model.attention.sdpa import (
    causal_attention,
    decode_group_attention,
    decode_groups,
    gather_context,
)


def store_kv_cache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    all_valid: bool | None = None,
) -> None:
    """Write `key`/`value` `[T, Hkv, D]` into the paged caches at `slot_mapping` `[T]` (-1 skipped).

    `all_valid`: whether no slot is -1, when the caller knows (it saves two operations a call).
    """
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if all_valid is None:
        all_valid = bool((slot_mapping >= 0).all())
    if not all_valid:
        valid = slot_mapping >= 0
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


class TorchAttentionBackend(AttentionBackend):
    """Reference backend in plain torch (the CPU path, and the oracle for the Triton kernels).

    Decodes are batched: the decode sequences are grouped by context length, and each group's blocks
    are gathered into one padded `[b, max_blocks * block_size, Hkv, D]` tensor, masked by length, one
    SDPA call a group.
    Prefill chunks run one SDPA call each: the chunk's queries attend to the sequence's cached prefix
    fully and to the chunk itself causally. A sliding window, a softcap and attention sinks are
    applied as `sdpa` describes.
    """

    name = "torch"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if meta.slot_mapping.numel():
            self._store(key, value, k_cache, v_cache, meta)
        nd = meta.num_decodes
        if nd == meta.num_seqs:
            return self._decode(query, k_cache, v_cache, meta, scale, window, softcap, sinks)
        out = torch.empty_like(query)
        if nd:
            out[:nd] = self._decode(query[:nd], k_cache, v_cache, meta, scale, window, softcap, sinks)
        self._prefill(
            query[nd:], key[nd:], value[nd:], k_cache, v_cache, meta, scale, out[nd:], window, softcap, sinks
        )
        return out

    @staticmethod
    def _prefill(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """The prefill chunks' attention into `out`: `query` / `key` / `value` / `out` are the rows
        after the decodes."""
        start = 0
        for i in range(meta.num_decodes, meta.num_seqs):
            qlen = meta.query_lens_cpu[i]
            seq_len = meta.seq_lens_cpu[i]
            q = query[start : start + qlen]
            if seq_len == qlen:
                # No cached prefix: the chunk's own K/V are the whole context.
                k, v = key[start : start + qlen], value[start : start + qlen]
            else:
                k = gather_context(k_cache, meta.block_tables[i], seq_len)
                v = gather_context(v_cache, meta.block_tables[i], seq_len)
            out[start : start + qlen] = causal_attention(q, k, v, scale, window, softcap, sinks)
            start += qlen

    @staticmethod
    def _store(
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        all_valid = meta.scratch.get("all_slots_valid")
        if all_valid is None:  # the same for every layer of the step
            all_valid = meta.scratch["all_slots_valid"] = bool((meta.slot_mapping >= 0).all())
        store_kv_cache_torch(key, value, k_cache, v_cache, meta.slot_mapping, all_valid)

    @staticmethod
    def _decode(
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_kv_heads = k_cache.shape[2]
        # [B, Hq, D] -> [B, Hkv, G, D]: each KV head's query group becomes a query-length axis, so
        # SDPA needs no GQA expansion of K/V.
        grouped = query.view(query.shape[0], num_kv_heads, -1, query.shape[-1])
        key = f"decode_groups/{window}"  # the masks differ between windows
        groups = meta.scratch.get(key)
        if groups is None:
            groups = meta.scratch[key] = decode_groups(
                meta, query.shape[0], k_cache.shape[1], query.dtype, window
            )
        if len(groups) == 1 and groups[0].index is None:
            attn = decode_group_attention(grouped, k_cache, v_cache, groups[0], scale, softcap, sinks)
            return attn.reshape(query.shape)
        out = torch.empty_like(query)
        for group in groups:
            attn = decode_group_attention(
                grouped[group.index], k_cache, v_cache, group, scale, softcap, sinks
            )
            out[group.index] = attn.reshape(-1, *query.shape[1:])
        return out
