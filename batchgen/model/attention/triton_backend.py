"""Attention backend on the Triton kernels in `kernels/` (the CUDA path).

Same contract as `TorchAttentionBackend`: store the step's K/V into the paged cache, then attend. The
decodes (the first `meta.num_decodes` sequences, one query token each) go through the decode kernel,
split over the context when the batch is small; the prefill chunks after them go through the
chunked-prefill kernel, which reads all of each chunk's context from the cache, except chunks with
no cached prefix at lengths where torch's SDPA was measured faster (`prefill_by_bucket`, set by
`batchgen.model.kernel_choice.attention.tune_triton_prefill_attention`): those attend to their own K/V
through SDPA, one call a chunk.
"""

from __future__ import annotations

import torch

from batchgen.kernels.registry import bucket_index
from batchgen.kernels.triton import paged_decode_attention, paged_prefill_attention, store_kv_cache
from batchgen.model.attention.base import AttentionBackend, AttentionMetadata
from batchgen.model.attention.sdpa import causal_attention


class TritonAttentionBackend(AttentionBackend):
    """Paged attention through Triton kernels; see `AttentionBackend` for the contract."""

    name = "triton"
    supports_softcap = False  # the kernels have no attention logit soft-capping (Gemma 2)

    # Per row bucket (`kernels.registry.ROW_BUCKETS`) of a prefill chunk with no cached prefix:
    # "triton" or "sdpa", as measured on the device; None: the Triton kernel for every chunk.
    prefill_by_bucket: list[str] | None = None

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
        if softcap is not None:  # refused when the model is built (`check_layer`); never ignored
            raise ValueError("the Triton attention kernels have no attention logit soft-capping")
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
                window=window,
                sinks=sinks,
            )
        if nd < meta.num_seqs:
            segments = meta.scratch.get("triton_prefill_segments")
            if segments is None:  # the same for every layer of the step
                segments = meta.scratch["triton_prefill_segments"] = self._prefill_segments(meta)
            for kind, rows, seqs, query_starts in segments:
                if kind == "sdpa":  # one chunk, no cached prefix: its own K/V are its whole context
                    out[rows] = causal_attention(
                        query[rows], key[rows], value[rows], scale, window, sinks=sinks
                    )
                    continue
                assert query_starts is not None  # a chunk on the kernel has its query starts
                paged_prefill_attention(
                    query[rows],
                    k_cache,
                    v_cache,
                    meta.block_tables[seqs],
                    query_starts,
                    meta.seq_lens[seqs],
                    max(meta.query_lens_cpu[seqs]),
                    scale,
                    out=out[rows],
                    window=window,
                    sinks=sinks,
                )
        return out

    def _prefill_segments(
        self, meta: AttentionMetadata
    ) -> list[tuple[str, slice, slice, torch.Tensor | None]]:
        """The step's prefill chunks as runs for one call each: (kind, "triton" or "sdpa"; their rows
        in the step; their sequence indices; for "triton" their int32 query starts counted from the
        run's first row). A "triton" run takes consecutive chunks in one launch; an "sdpa" run is one
        chunk."""
        by_bucket = self.prefill_by_bucket
        runs: list[tuple[str, slice, slice]] = []
        row = meta.num_decodes  # each decode has one query token, so the prefill chunks start here
        for i in range(meta.num_decodes, meta.num_seqs):
            qlen = meta.query_lens_cpu[i]
            kind = "triton"
            if by_bucket is not None and qlen == meta.seq_lens_cpu[i]:
                kind = by_bucket[min(bucket_index(qlen), len(by_bucket) - 1)]
            if runs and kind == runs[-1][0] == "triton":
                _, rows, seqs = runs[-1]
                runs[-1] = (kind, slice(rows.start, row + qlen), slice(seqs.start, i + 1))
            else:
                runs.append((kind, slice(row, row + qlen), slice(i, i + 1)))
            row += qlen
        # Built once a step, not once a layer.
        return [
            (
                kind,
                rows,
                seqs,
                None if kind == "sdpa" else meta.query_start_loc[seqs.start : seqs.stop + 1] - rows.start,
            )
            for kind, rows, seqs in runs
        ]
