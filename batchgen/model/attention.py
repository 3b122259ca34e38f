"""Paged attention: the step's metadata, the backend interface, the torch reference backend, selection.

A step is one flat batch of T tokens from B sequences with no padding. Sequences are ordered with the
decodes first (exactly one query token each), then the prefill chunks. Every backend first writes the
step's new K/V rows into the paged cache at `slot_mapping`, then attends each query token to its
sequence's whole context through the sequence's block table (PagedAttention, Kwon et al. 2023,
https://arxiv.org/abs/2309.06180).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from batchgen.kernels.cpu import attention as cpu_attention
from batchgen.kernels.cpu import library as cpu_kernels
from batchgen.kernels.cpu import ops as cpu_ops
from batchgen.kernels.registry import bucket_index
from batchgen.model.sdpa import (  # noqa: F401  (gather_* re-exported)
    causal_attention,
    decode_group_attention,
    decode_groups,
    gather_blocks,
    gather_context,
)


@dataclass
class AttentionMetadata:
    """Where each token of the step lives in the paged KV cache.

    Attributes:
        slot_mapping: int64 `[T]`, cache slot (`block_id * block_size + offset`) of each new token;
            -1 marks a padding token whose K/V are not stored.
        query_start_loc: int32 `[B + 1]`, prefix sums of the query lengths.
        seq_lens: int32 `[B]`, context length of each sequence after this step (cached + new tokens).
        block_tables: int32 `[B, max_blocks]`, physical block ids; entries past a sequence's last
            block are 0 and never read as context.
        num_decodes: the first `num_decodes` sequences have exactly one query token.
        max_query_len / max_seq_len: maxima of the query and context lengths (tokens).
        query_lens_cpu / seq_lens_cpu: the same lengths as Python lists, for host-side loops.
        scratch: per-step values a backend derives from the above on the first layer and reuses in
            the others (the torch backend's decode groups); empty when the step starts.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    scratch: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend:
    """Interface every attention backend implements.

    `forward(query [T, Hq, D], key [T, Hkv, D], value [T, Hkv, D], k_cache, v_cache, meta, scale)`
    stores key/value into `k_cache`/`v_cache` (`[num_blocks, block_size, Hkv, D]`) and returns the
    attention output `[T, Hq, D]` in the query's dtype. Hq must be a multiple of Hkv (GQA).
    """

    name = "abstract"
    # Whether the model also runs its bf16 element-wise ops (RMSNorm, SiLU-and-multiply, rotary) as
    # the C kernels of `cpu_ops`; only the "cpu" backend does, so "torch" stays plain torch.
    fused_cpu_ops = False

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
        """Store the step's K/V rows, then attend; shapes as in the class docstring, `scale` is
        the softmax scale (1/sqrt(head_dim) unless the model says otherwise)."""
        raise NotImplementedError


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
    fully and to the chunk itself causally.
    """

    name = "torch"

    def forward(self, query, key, value, k_cache, v_cache, meta, scale):
        if meta.slot_mapping.numel():
            self._store(key, value, k_cache, v_cache, meta)
        nd = meta.num_decodes
        if nd == meta.num_seqs:
            return self._decode(query, k_cache, v_cache, meta, scale)
        out = torch.empty_like(query)
        if nd:
            out[:nd] = self._decode(query[:nd], k_cache, v_cache, meta, scale)
        self._prefill(query[nd:], key[nd:], value[nd:], k_cache, v_cache, meta, scale, out[nd:])
        return out

    @staticmethod
    def _prefill(query, key, value, k_cache, v_cache, meta, scale, out):
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
            out[start : start + qlen] = causal_attention(q, k, v, scale)
            start += qlen

    @staticmethod
    def _store(key, value, k_cache, v_cache, meta):
        all_valid = meta.scratch.get("all_slots_valid")
        if all_valid is None:  # the same for every layer of the step
            all_valid = meta.scratch["all_slots_valid"] = bool((meta.slot_mapping >= 0).all())
        store_kv_cache_torch(key, value, k_cache, v_cache, meta.slot_mapping, all_valid)

    @staticmethod
    def _decode(query, k_cache, v_cache, meta, scale):
        num_kv_heads = k_cache.shape[2]
        # [B, Hq, D] -> [B, Hkv, G, D]: each KV head's query group becomes a query-length axis, so
        # SDPA needs no GQA expansion of K/V.
        grouped = query.view(query.shape[0], num_kv_heads, -1, query.shape[-1])
        groups = meta.scratch.get("decode_groups")
        if groups is None:
            groups = meta.scratch["decode_groups"] = decode_groups(
                meta, query.shape[0], k_cache.shape[1], query.dtype
            )
        if len(groups) == 1 and groups[0].index is None:
            return decode_group_attention(grouped, k_cache, v_cache, groups[0], scale).reshape(query.shape)
        out = torch.empty_like(query)
        for group in groups:
            attn = decode_group_attention(grouped[group.index], k_cache, v_cache, group, scale)
            out[group.index] = attn.reshape(-1, *query.shape[1:])
        return out


class CPUAttentionBackend(TorchAttentionBackend):
    """The torch backend with its decodes, prefill chunks and KV-cache writes in compiled C kernels.

    See `batchgen.kernels.cpu.attention` (decodes 2.3-2.9x faster than the gather + SDPA path at 64
    sequences; prefill 2.8-3.6x torch's CPU SDPA in bf16). With this backend the model's bf16
    element-wise ops run as C kernels too (`fused_cpu_ops`). A dtype or head size the kernels are
    not compiled for takes the torch path.
    """

    name = "cpu"
    fused_cpu_ops = True

    def _store(self, key, value, k_cache, v_cache, meta):
        # One memcpy a row in C (`cpu_ops.store_kv`) instead of two `index_copy_` calls; the
        # kernel checks the slots itself, so the step's validity scan is not needed either.
        if key.dtype == k_cache.dtype == value.dtype and cpu_kernels.load_library() is not None:
            first_layer = "kv_store_checked" not in meta.scratch  # same layouts in every layer
            meta.scratch["kv_store_checked"] = True
            cpu_ops.store_kv(key, value, k_cache, v_cache, meta.slot_mapping, check_layout=first_layer)
        else:
            TorchAttentionBackend._store(key, value, k_cache, v_cache, meta)

    # Per row bucket (`kernels.registry.ROW_BUCKETS`) of a prefill chunk without a cached prefix:
    # "c" (the C kernel) or "sdpa" (torch's SDPA, which runs oneDNN's AMX kernels where the CPU has
    # them), measured by `batchgen.model.attention_choice`; None: the C kernel for every chunk.
    prefill_by_bucket: list[str] | None = None

    def _prefill(self, query, key, value, k_cache, v_cache, meta, scale, out):
        _, num_heads, head_dim = query.shape
        if not cpu_attention.supports_prefill(query.dtype, head_dim, num_heads, k_cache.shape[2]):
            TorchAttentionBackend._prefill(query, key, value, k_cache, v_cache, meta, scale, out)
            return
        segments = meta.scratch.get("prefill_segments")
        first_layer = segments is None  # the same tables in every layer: check them once
        if first_layer:
            segments = meta.scratch["prefill_segments"] = self._prefill_segments(meta)
        for kind, rows, seqs, query_starts in segments:
            if kind == "sdpa":  # one chunk with no cached prefix: its own K/V are the whole context
                out[rows] = causal_attention(query[rows], key[rows], value[rows], scale)
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
            )

    def _prefill_segments(self, meta: AttentionMetadata) -> list[tuple[str, slice, slice, Any]]:
        """The step's prefill chunks as runs of consecutive sequences for one kernel call each:
        (kind, their rows after the decodes, their sequence indices, for "c" their int32 query
        starts from 0)."""
        nd, by_bucket = meta.num_decodes, self.prefill_by_bucket
        kinds = []
        for i in range(nd, meta.num_seqs):
            qlen = meta.query_lens_cpu[i]
            fresh = qlen == meta.seq_lens_cpu[i]
            use_sdpa = (
                by_bucket is not None
                and fresh
                and by_bucket[min(bucket_index(qlen), len(by_bucket) - 1)] == "sdpa"
            )
            kinds.append("sdpa" if use_sdpa else "c")
        segments = []
        row, i = 0, 0
        while i < len(kinds):
            j = i + 1
            while j < len(kinds) and kinds[i] == "c" == kinds[j]:
                j += 1
            lengths = meta.query_lens_cpu[nd + i : nd + j]
            rows = slice(row, row + sum(lengths))
            starts = None
            if kinds[i] == "c":
                starts = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
            segments.append((kinds[i], rows, slice(nd + i, nd + j), starts))
            row, i = rows.stop, j
        return segments

    def _decode(self, query, k_cache, v_cache, meta, scale):
        num_decodes, num_heads, head_dim = query.shape
        if not cpu_attention.supports(query.dtype, head_dim, num_heads, k_cache.shape[2]):
            return TorchAttentionBackend._decode(query, k_cache, v_cache, meta, scale)
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
        )


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """Pick the attention backend: "auto" is triton on CUDA, cpu on a CPU when its kernel builds, else torch.

    Raises:
        ValueError: "triton" forced with no CUDA device and without `TRITON_INTERPRET=1`; "cpu" forced
            on another device or where its kernel cannot be built; an unknown name.
    """
    if name == "auto":
        if device.type == "cuda":
            name = "triton"
        else:
            name = "cpu" if device.type == "cpu" and cpu_kernels.load_library() is not None else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on the CPU; the model is on {device}")
        if cpu_kernels.load_library() is None:
            if cpu_kernels.disabled_by_environment():
                raise ValueError(
                    "attention_backend='cpu' needs its C kernels, which BATCHGEN_CPU_KERNELS=0 turns off; "
                    "unset BATCHGEN_CPU_KERNELS or use attention_backend='torch'"
                )
            raise ValueError(
                "attention_backend='cpu' needs its C kernels, which could not be built here (see the "
                "warning above; they need a C compiler as $CC or cc); use attention_backend='torch'"
            )
        return CPUAttentionBackend()
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention_backend='triton' needs a CUDA GPU (or TRITON_INTERPRET=1 to run the kernels "
                "in Triton's CPU interpreter, for tests); use attention_backend='torch' on this machine"
            )
        from batchgen.model.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"attention_backend must be auto, torch, cpu or triton; got {name!r}")
