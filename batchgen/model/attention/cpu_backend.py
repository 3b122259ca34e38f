"""The "cpu" attention backend: the torch backend with its decodes, prefill chunks and KV-cache
writes in batchgen's compiled C kernels (`batchgen.kernels.cpu`)."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from batchgen.kernels.cpu import attention as cpu_attention
from batchgen.kernels.cpu import library as cpu_kernels
from batchgen.kernels.cpu import ops as cpu_ops
from batchgen.kernels.registry import bucket_index
from batchgen.model.attention.base import AttentionMetadata
from batchgen.model.attention.sdpa import causal_attention, gather_context
from batchgen.model.attention.torch_backend import TorchAttentionBackend


class CPUAttentionBackend(TorchAttentionBackend):
    """The torch backend with its decodes, prefill chunks and KV-cache writes in compiled C kernels.

    See `batchgen.kernels.cpu.attention` (its decodes read the cache in place instead of gathering
    it for SDPA; which kernel runs at which size is measured on the machine, `attention_choice`). With this backend the model's bf16
    element-wise ops run as C kernels too (`fused_cpu_ops`). A dtype or head size the kernels are
    not compiled for takes the torch path, and so does a layer with an attention softcap (Gemma 2;
    the C kernels have none). A sliding window and attention sinks (gpt-oss) run in the C kernels
    (the "c" prefill kernel: the AMX one has neither, so such a layer's chunks measured fastest on
    AMX take "c").
    """

    name = "cpu"
    fused_cpu_ops = True

    def _store(  # type: ignore[override]  # an instance method where the base has a staticmethod: same call
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        # One memcpy a row in C (`cpu_ops.store_kv`) instead of two `index_copy_` calls; the
        # kernel checks the slots itself, so the step's validity scan is not needed either.
        if key.dtype == k_cache.dtype == value.dtype and cpu_kernels.load_library() is not None:
            first_layer = "kv_store_checked" not in meta.scratch  # same layouts in every layer
            meta.scratch["kv_store_checked"] = True
            cpu_ops.store_kv(key, value, k_cache, v_cache, meta.slot_mapping, check_layout=first_layer)
        else:
            TorchAttentionBackend._store(key, value, k_cache, v_cache, meta)

    # Per row bucket (`kernels.registry.ROW_BUCKETS`) of a prefill chunk without a cached prefix,
    # and of one after a cached prefix: "c" (the C kernel), "amx" (the C kernel on AMX tiles) or
    # "sdpa" (torch's SDPA), measured by `batchgen.model.kernel_choice.attention`; None: the C kernel for
    # every such chunk.
    prefill_by_bucket: list[str] | None = None
    prefill_after_prefix_by_bucket: list[str] | None = None

    def _prefill(  # type: ignore[override]  # as _store
        self,
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
        _, num_heads, head_dim = query.shape
        if softcap is not None or not cpu_attention.supports_prefill(
            query.dtype, head_dim, num_heads, k_cache.shape[2]
        ):
            TorchAttentionBackend._prefill(
                query, key, value, k_cache, v_cache, meta, scale, out, window, softcap, sinks
            )
            return
        segments = meta.scratch.get("prefill_segments")
        first_layer = segments is None  # the same tables in every layer: check them once
        if segments is None:
            segments = meta.scratch["prefill_segments"] = self._prefill_segments(meta)
        for kind, rows, seqs, query_starts in segments:
            if kind == "sdpa":  # one chunk
                seq_len = meta.seq_lens_cpu[seqs.start]
                if seq_len == rows.stop - rows.start:  # no cached prefix: its own K/V are the context
                    k, v = key[rows], value[rows]
                else:
                    k = gather_context(k_cache, meta.block_tables[seqs.start], seq_len)
                    v = gather_context(v_cache, meta.block_tables[seqs.start], seq_len)
                out[rows] = causal_attention(query[rows], k, v, scale, window, sinks=sinks)
                continue
            cpu_attention.paged_prefill_attention_cpu(
                query[rows].contiguous(),
                k_cache,
                v_cache,
                meta.block_tables[seqs],
                meta.seq_lens[seqs],
                query_starts,
                scale,
                check_bounds=first_layer,
                out=out[rows],
                kernel="c" if window is not None or sinks is not None else kind,
                short_chunks=meta.verifies_drafts,
                window=window,
                sinks=sinks,
            )

    def _prefill_segments(self, meta: AttentionMetadata) -> list[tuple[str, slice, slice, Any]]:
        """The step's prefill chunks as runs of consecutive sequences for one call each: (kind: "c",
        "amx" or "sdpa", their rows after the decodes, their sequence indices, for the C kernels
        their int32 query starts from 0); an "sdpa" run is one chunk."""
        nd = meta.num_decodes
        kinds = []
        for i in range(nd, meta.num_seqs):
            qlen = meta.query_lens_cpu[i]
            fresh = qlen == meta.seq_lens_cpu[i]
            by_bucket = self.prefill_by_bucket if fresh else self.prefill_after_prefix_by_bucket
            kinds.append("c" if by_bucket is None else by_bucket[min(bucket_index(qlen), len(by_bucket) - 1)])
        segments = []
        row, i = 0, 0
        while i < len(kinds):
            j = i + 1
            while j < len(kinds) and kinds[i] == kinds[j] != "sdpa":  # a kernel call takes many chunks
                j += 1
            lengths = meta.query_lens_cpu[nd + i : nd + j]
            rows = slice(row, row + sum(lengths))
            starts = None
            if kinds[i] != "sdpa":
                starts = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
            segments.append((kinds[i], rows, slice(nd + i, nd + j), starts))
            row, i = rows.stop, j
        return segments

    # Per row bucket of a step's decodes: "c" (the C kernel) or "torch" (gather + SDPA), measured
    # by `batchgen.model.kernel_choice.attention`; None: the C kernel at every batch.
    decode_by_bucket: list[str] | None = None

    def _decode(  # type: ignore[override]  # as _store
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_decodes, num_heads, head_dim = query.shape
        by_bucket = self.decode_by_bucket
        if (
            softcap is not None
            or not cpu_attention.supports(query.dtype, head_dim, num_heads, k_cache.shape[2])
            or (
                by_bucket is not None
                and by_bucket[min(bucket_index(num_decodes), len(by_bucket) - 1)] == "torch"
            )
        ):
            return TorchAttentionBackend._decode(query, k_cache, v_cache, meta, scale, window, softcap, sinks)
        # The tables are the same for every layer of the step: check their bounds on the first only.
        first_layer = "cpu_decode_checked" not in meta.scratch
        meta.scratch["cpu_decode_checked"] = True
        return cpu_attention.paged_decode_attention_cpu(
            query.contiguous(),
            k_cache,
            v_cache,
            meta.block_tables[:num_decodes],
            meta.seq_lens[:num_decodes],
            scale,
            check_bounds=first_layer,
            window=window,
            sinks=sinks,
        )
