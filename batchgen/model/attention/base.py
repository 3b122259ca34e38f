"""Paged attention's contract: the step's metadata and the interface every backend implements.

A step is one flat batch of T tokens from B sequences with no padding. Sequences are ordered with the
decodes first (exactly one query token each), then the prefill chunks. Every backend first writes the
step's new K/V rows into the paged cache at `slot_mapping`, then attends each query token to its
sequence's whole context through the sequence's block table (PagedAttention, Kwon et al. 2023,
https://arxiv.org/abs/2309.06180).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


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
        verifies_drafts: some sequence verifies speculative draft tokens this step: the CPU
            kernels may then walk short chunks' contexts once (`paged_prefill_attention_cpu`'s
            `short_chunks`); without drafts a prompt row's result never depends on its chunking.
        prompt_lens_cpu: each sequence's prompt length in tokens, for a rotary that depends on it
            (Phi-3's LongRoPE); None where the caller does not know them.
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
    verifies_drafts: bool = False
    prompt_lens_cpu: list[int] | None = None
    scratch: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def decodes(
        cls, slot_mapping: torch.Tensor, block_tables: torch.Tensor, context: int
    ) -> AttentionMetadata:
        """A step of decodes only: one query token for each row of `block_tables` (int32
        `[B, max_blocks]`), every sequence `context` tokens long after it; `slot_mapping` int64 `[B]`
        (or empty: nothing stored). Used to time kernels on synthetic steps."""
        rows = block_tables.shape[0]
        return cls(
            slot_mapping=slot_mapping,
            query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
            seq_lens=torch.full((rows,), context, dtype=torch.int32),
            block_tables=block_tables,
            num_decodes=rows,
            max_query_len=1,
            max_seq_len=context,
            query_lens_cpu=[1] * rows,
            seq_lens_cpu=[context] * rows,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend:
    """Interface every attention backend implements.

    `forward(query [T, Hq, D], key [T, Hkv, D], value [T, Hkv, D], k_cache, v_cache, meta, scale,
    window, softcap, sinks)` stores key/value into `k_cache`/`v_cache` (`[num_blocks, block_size, Hkv, D]`)
    and returns the attention output `[T, Hq, D]` in the query's dtype. Hq must be a multiple of Hkv
    (GQA). `window` (a sliding-window layer), `softcap` (Gemma 2's attention logit soft-capping) and
    `sinks` (gpt-oss's per-head attention sink logits) are per layer; a backend that cannot honour one says so in `check_layer`, never ignores it.
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
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store the step's K/V rows, then attend; shapes as in the class docstring, `scale` is
        the softmax scale (1/sqrt(head_dim) unless the model says otherwise), `window` the layer's
        sliding window in tokens (each query sees the `window` keys up to its own position; None:
        all), `softcap` its attention logit cap (`tanh(s / cap) * cap` of the scaled scores; None:
        none), `sinks` float32 `[Hq]` its per-head sink logits, which join each row's softmax
        denominator and nothing else (`sdpa.attend`; None: none)."""
        raise NotImplementedError

    # Whether `forward` takes a `softcap` (the torch and cpu backends do; the Triton kernels do not).
    supports_softcap = True

    def check_layer(self, window: int | None, softcap: float | None) -> None:
        """Raise ValueError, naming the fix, where this backend cannot run a layer with this
        `window` and `softcap` (checked when the model is built)."""
        if window is not None and window < 1:
            raise ValueError(f"sliding_window must be at least 1 token; got {window}")
        if softcap is not None and not self.supports_softcap:
            raise ValueError(
                f"attention_backend {self.name!r} has no attention logit soft-capping (Gemma 2's "
                "attn_logit_softcapping); use attention_backend='torch' or 'cpu'"
            )
