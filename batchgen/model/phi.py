"""Phi-3 and Phi-4 (`Phi3ForCausalLM`): the Llama-family decoder with Phi's rotary.

Phi-3's layers are Llama's (`llama.DecoderLayer`); its checkpoints store q/k/v as one `qkv_proj`
and gate/up as one `gate_up_proj`, the layouts of batchgen's own fused linears, so they load as
they are (`LlamaForCausalLM.load_weights`). What differs is the rotary embedding:
- a partial rotary (`partial_rotary_factor`, Phi-4-mini's 0.75: `layers.apply_rotary`);
- LongRoPE scaling (Ding et al. 2024, arXiv:2402.13753): two sets of frequencies, `short_factor`
  and `long_factor`, and transformers picks one per forward call: long when the call's largest
  position is past `original_max_position_embeddings`. In `generate` that is the whole prompt at
  its prefill and each new token at its decode, so a token at position p uses the long factors
  when `max(prompt length, p + 1)` exceeds the original length. batchgen applies that rule per
  token (`longrope_index`), whatever the chunking or batching: a sequence whose prompt is longer
  than the original length runs on the long factors throughout, one that ends within it on the
  short ones, token-identical to transformers in both cases. One that crosses the original length
  while decoding differs: transformers' `Phi3ForCausalLM.prepare_inputs_for_generation` then
  drops its cache and recomputes every earlier position on the long factors, while batchgen keeps
  the keys it computed on the short ones and rotates the positions past the original length on
  the long ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from batchgen.model.attention.base import AttentionBackend, AttentionMetadata
from batchgen.model.layers import RotaryEmbedding, attention_heads, rope_parameters
from batchgen.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class LongRopeEmbedding(RotaryEmbedding):
    """LongRoPE tables: rows `[0, max_positions)` hold the short factors' cos/sin, rows
    `[max_positions, 2 * max_positions)` the long factors' (`[2 * max_positions, R]` float32, the
    attention factor applied to both as transformers does); `longrope_index` picks the row."""

    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int) -> None:
        super().__init__(config, head_dim, max_positions)  # the short factors (no sequence length)
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        original = int(rope_parameters(config)["original_max_position_embeddings"])
        inv_freq, scale = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=original + 1)
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = torch.cat((self.cos, emb.cos() * scale))
        self.sin = torch.cat((self.sin, emb.sin() * scale))
        self.max_positions = max_positions


def longrope_index(
    positions: torch.Tensor, meta: AttentionMetadata, original: int, max_positions: int
) -> torch.Tensor:
    """Each token's row of a `LongRopeEmbedding` (int64 `[T]`): its position, plus `max_positions`
    where it takes the long factors (`max(its sequence's prompt length, position + 1) > original`).
    A step without prompt lengths (`meta.prompt_lens_cpu` None: a synthetic step timing kernels)
    counts them as 0: the position alone decides, as in a decode."""
    lengths = meta.prompt_lens_cpu or [0] * meta.num_seqs
    prompt = torch.tensor(lengths, dtype=torch.int64, device=positions.device)
    counts = torch.tensor(meta.query_lens_cpu, dtype=torch.int64, device=positions.device)
    per_token = torch.repeat_interleave(prompt, counts)
    long = torch.maximum(per_token, positions + 1) > original
    return positions + long.to(positions.dtype) * max_positions


class PhiForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-4 (`model_type` "phi3"): `LlamaForCausalLM` with `LongRopeEmbedding` where the
    config's `rope_type` is "longrope" (partial rotary needs nothing more than the shared layers).

    Raises:
        ValueError: as `LlamaForCausalLM`.
    """

    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__(config, backend, max_positions)
        self.max_positions = max_positions
        self.longrope = rope_parameters(config)["rope_type"] == "longrope"
        _, _, head_dim = attention_heads(config)
        # The stack rotates all of head_dim by position alone.
        self.fits_decoder_stack = not self.longrope and self.model.rotary.cos.shape[-1] == head_dim
        if self.longrope:
            self.model.rotary = LongRopeEmbedding(config, head_dim, max_positions)

    def rebuild_rotary(self, max_positions: int, device: torch.device) -> None:
        if not self.longrope:
            super().rebuild_rotary(max_positions, device)
            return
        _, _, head_dim = attention_heads(self.config)
        self.model.rotary = LongRopeEmbedding(self.config, head_dim, max_positions).to(device)
        self.max_positions = max_positions

    def rotary_cos_sin(
        self, positions: torch.Tensor, meta: AttentionMetadata, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.longrope:
            return super().rotary_cos_sin(positions, meta, dtype)
        original = int(rope_parameters(self.config)["original_max_position_embeddings"])
        index = longrope_index(positions, meta, original, self.max_positions)
        return self.model.rotary.cos_sin(index, dtype)
