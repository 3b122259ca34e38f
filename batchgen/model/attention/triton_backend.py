"""Attention backend on the Triton kernels in `kernels/` (the CUDA path).

Same contract as `TorchAttentionBackend`: store the step's K/V into the paged cache, then attend. The
decodes (the first `meta.num_decodes` sequences, one query token each) go through the decode kernel,
split over the context when the batch is small; the prefill chunks after them go through the
chunked-prefill kernel, which reads all of each chunk's context from the cache.
"""

from __future__ import annotations

import torch

from batchgen.kernels.triton import paged_decode_attention, paged_prefill_attention, store_kv_cache
from batchgen.model.attention.base import AttentionBackend, AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    """Paged attention through Triton kernels; see `AttentionBackend` for the contract."""

    name = "triton"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if meta.slot_mapping.numel():
            store_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        nd = meta.num_decodes
        if nd:
            paged_decode_attention(
                query[:nd],
                k_cache,
                v_cache,
                meta.block_tables[:nd],
                meta.seq_lens[:nd],
                scale,
                max_seq_len=max(meta.seq_lens_cpu[:nd]),
                out=out[:nd],
            )
        if nd < meta.num_seqs:
            # Each decode has one query token, so the prefill chunks start at row nd.
            paged_prefill_attention(
                query[nd:],
                k_cache,
                v_cache,
                meta.block_tables[nd:],
                meta.query_start_loc[nd:] - nd,
                meta.seq_lens[nd:],
                max(meta.query_lens_cpu[nd:]),
                scale,
                out=out[nd:],
            )
        return out
