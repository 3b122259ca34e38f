"""One config-driven Llama-family decoder: Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM 2/3, and the
mixtures of experts Qwen3-MoE and Mixtral.

The differences between these architectures are a few switches read from the Hugging Face config:
GQA (`num_key_value_heads`), tied embeddings, QKV bias (Qwen2), per-head q/k norm (Qwen3 and
Qwen3-MoE), explicit `head_dim`, the rotary scaling rule (llama3 and friends), sliding-window layers
(Mistral's `sliding_window`, Qwen2/3's `use_sliding_window`; `layers.layer_windows`), layers without
rotary (SmolLM3's `no_rope_layers`; `layers.layer_rotary`) and which layers' feed-forward is a
sparse mixture of experts (`moe.feed_forward`). Other families
(`gemma`) subclass `LlamaForCausalLM` and reuse its weight loading and step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from batchgen.model import moe
from batchgen.model.attention.base import AttentionBackend, AttentionMetadata
from batchgen.model.layers import (
    MLP,
    Attention,
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    attention_heads,
    layer_rotary,
    layer_windows,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from batchgen.kernels.cpu.stack import DecoderStack

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "phi3", *moe.MOE_MODEL_TYPES)

# Hugging Face projection name -> (our fused module, shard index)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer: RMSNorm -> attention -> residual add -> RMSNorm -> SwiGLU MLP (or
    the mixture of experts where the config puts one at layer `index`) -> residual add, on
    `[T, hidden_size]` rows in the model's dtype."""

    def __init__(
        self,
        config: PretrainedConfig,
        backend: AttentionBackend,
        window: int | None = None,
        rotary: bool = True,
        index: int = 0,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(config, backend, window, rotary=rotary)
        c_ops = backend.fused_cpu_ops
        self.mlp: MLP | moe.SparseMoeBlock = moe.feed_forward(config, index, c_ops)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, c_ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, c_ops)

    def forward(
        self,
        hidden: torch.Tensor,
        delta: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        row_chunk: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the layer on the residual stream `hidden` `[T, hidden_size]` (updated in place).

        `delta` is the previous layer's MLP output, not yet added to `hidden` (None for the first
        layer): the add happens inside this layer's first norm, one pass instead of two (vLLM's
        fused residual). Returns `(hidden, delta)` for the next layer, whose own delta is this
        layer's MLP output; the caller adds the last one (`LlamaForCausalLM.forward`).

        With `row_chunk` > 0 and more rows than that, everything but attention (norms, projections,
        rotary, MLP) runs on row slices of `row_chunk` tokens; see `prefill_row_chunk`. That path
        adds its MLP outputs itself and returns delta None.
        """
        num_tokens = hidden.shape[0]
        if row_chunk <= 0 or num_tokens <= row_chunk:
            attn = self.self_attn(self.input_layernorm.add_forward(hidden, delta), cos_sin, kv_cache, meta)
            return hidden, self.mlp(self.post_attention_layernorm.add_forward(hidden, attn))
        if delta is not None:
            hidden += delta
        rows = [slice(start, start + row_chunk) for start in range(0, num_tokens, row_chunk)]
        cos, sin = cos_sin
        parts = [self.self_attn.project(self.input_layernorm(hidden[r]), (cos[r], sin[r])) for r in rows]
        q, k, v = (torch.cat([p[i] for p in parts]) for i in range(3))
        del parts
        attn = self.self_attn.attend(q, k, v, kv_cache, meta)
        for r in rows:
            h = hidden[r]
            h += self.mlp(self.post_attention_layernorm.add_forward(h, self.self_attn.o_proj(attn[r])))
        return hidden, None


def prefill_row_chunk(config: PretrainedConfig, dtype: torch.dtype, device: torch.device) -> int:
    """Rows per slice for the non-attention work of a large CPU step; 0 = no slicing (GPU).

    The element-wise passes of a big step (norms, SiLU, products, residual adds) are memory-bound,
    so slicing keeps their activations in cache; the matrix products, though, want many rows. Slices
    whose gate/up output is about 12 MiB (2,048 rows of the default model) balance the two
    (`python benchmarks/kernels/row_chunk_bench.py --rows 512 2048`; measured: docs/benchmarks.md).
    Steps above the slice (a raised `max_num_batched_tokens`) are still sliced.
    """
    if device.type != "cpu":
        return 0
    row_bytes = 2 * config.intermediate_size * torch.empty((), dtype=dtype).element_size()
    return max(64, (12 * 2**20 // row_bytes) // 64 * 64)


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm."""

    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        _, _, head_dim = attention_heads(config)
        self.rotary = RotaryEmbedding(config, head_dim, max_positions)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend, window, rotary, index)
            for index, (window, rotary) in enumerate(
                zip(layer_windows(config), layer_rotary(config), strict=True)
            )
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.fused_cpu_ops)


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head, over flat token batches and a paged KV cache.

    Args:
        config: a Hugging Face config whose `model_type` is in `SUPPORTED_MODEL_TYPES`.
        backend: the attention backend (torch reference or Triton kernels).
        max_positions: positions to precompute rotary tables for (>= max_model_len).

    Raises:
        ValueError: for an unsupported `model_type`.
    """

    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        self.config = config
        self.model = LlamaModel(config, backend, max_positions)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # All layers of a step in one C call (`cpu_stack.DecoderStack`), set by the runner once the
        # linears are packed where it applies; None runs the layers one by one.
        self.decoder_stack: DecoderStack | None = None
        # Whether the stack's C code computes this model's layers (its rotary is the full-width
        # table of `rotary_cos_sin`; a family that differs sets False).
        self.fits_decoder_stack = True

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run one flat step.

        Args:
            input_ids: int64 `[T]`.
            positions: int64 `[T]`, each token's position in its sequence.
            kv_caches: per layer, (K, V) each `[num_blocks, block_size, num_kv_heads, head_dim]`.
            meta: where the tokens go in the cache and what each attends to.
            logits_indices: int64 `[B']`, rows of the flat batch that need next-token logits
                (each sequence's last scheduled position when it reaches the end of its tokens).

        Returns:
            logits `[B', vocab_size]` in the model dtype (the sampler widens them when it needs to).
        """
        return self.logits(self.final_hidden(input_ids, positions, kv_caches, meta, logits_indices))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits `[R, vocab_size]` of final-norm hidden states `[R, hidden_size]` (the
        LM head; a family with a final logit cap applies it here)."""
        return self.lm_head(hidden)

    def rotary_cos_sin(
        self, positions: torch.Tensor, meta: AttentionMetadata, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's rotary cos and sin `[T, 1, R]` in `dtype` for int64 `positions` `[T]` (a
        family whose rotary depends on more than the position reads `meta`)."""
        return self.model.rotary.cos_sin(positions, dtype)

    def rebuild_rotary(self, max_positions: int, device: torch.device) -> None:
        """Build the rotary tables again, for real and in float32 as the reference does (the runner
        builds the model on the meta device, where they hold nothing)."""
        _, _, head_dim = attention_heads(self.config)
        self.model.rotary = RotaryEmbedding(self.config, head_dim, max_positions).to(device)

    @torch.inference_mode()
    def final_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """Run one flat step up to the LM head (arguments as `forward`'s, `rows` its
        `logits_indices`); returns the final-norm hidden states of `rows`, `[len(rows),
        hidden_size]` in the model dtype, which `lm_head` turns into logits (a caller scoring many
        rows applies it a slice at a time)."""
        hidden = self.model.embed_tokens(input_ids)  # a new tensor: the layers add into it in place
        cos_sin = self.rotary_cos_sin(positions, meta, hidden.dtype)
        row_chunk = prefill_row_chunk(self.config, hidden.dtype, hidden.device)
        if self.decoder_stack is not None and self.decoder_stack.takes(hidden, row_chunk):
            delta = self.decoder_stack(hidden, cos_sin, kv_caches, meta)
        else:
            delta = None
            for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
                hidden, delta = layer(hidden, delta, cos_sin, kv_cache, meta, row_chunk)
        # The last residual add and final norm only for the rows asked: most prefill rows need no
        # logits.
        rows_delta = None if delta is None else delta[rows]
        return self.model.norm.add_forward(hidden[rows], rows_delta)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the model (fusing q/k/v and gate/up, and stacking
        per-expert weights: `moe.load_expert_weight`).

        Raises:
            ValueError: a weight has an unexpected name or shape, or a parameter was never loaded.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            name = moe.checkpoint_name(name)
            expert_key = moe.load_expert_weight(self, name, tensor)
            if expert_key is not None:
                loaded.add(expert_key)
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in _FUSED:
                fused, shard = _FUSED[parts[-2]]
                module_name = ".".join(parts[:-2] + [fused])
                target = module_name + "." + parts[-1]
                if target not in params:
                    raise ValueError(f"unexpected weight {name!r} (no parameter {target!r})")
                cast(MergedLinear, self.get_submodule(module_name)).load_shard(shard, parts[-1], tensor)
                loaded.add(f"{target}#{shard}")
                continue
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} in the checkpoint")
            if params[name].shape != tensor.shape:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}"
                )
            params[name].data.copy_(tensor)
            loaded.add(name)
            # A checkpoint that stores a fused projection whole (Phi-3's qkv_proj, gate_up_proj, in
            # our layout) fills every shard at once.
            shards = getattr(self.get_submodule(name.rpartition(".")[0]), "shard_sizes", None)
            loaded.update(f"{name}#{i}" for i in range(len(shards or ())))
        missing = []
        for pname, _ in self.named_parameters():
            module = self.get_submodule(pname.rpartition(".")[0])
            shards = getattr(module, "shard_sizes", None)
            if isinstance(module, moe.FusedExperts):
                missing += module.missing(pname, loaded)
            elif shards is not None:
                missing += [f"{pname} (part {i})" for i in range(len(shards)) if f"{pname}#{i}" not in loaded]
            elif pname not in loaded and not (pname == "lm_head.weight" and self.tie_word_embeddings):
                missing.append(pname)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}")


def decoder_layers(model: LlamaForCausalLM) -> list[DecoderLayer]:
    """`model`'s decoder layers in order (`model.model.layers`, whose items a type checker sees as
    plain `nn.Module`s)."""
    return cast(list[DecoderLayer], list(model.model.layers))
