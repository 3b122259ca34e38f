"""The Gemma 2 and Gemma 3 (text) decoders, on the shared layers of `layers`.

What differs from the Llama family, each read from the Hugging Face config as transformers'
`Gemma2ForCausalLM` / `Gemma3ForCausalLM` compute it:
- RMSNorm scales by `1 + weight` in float32 (`GemmaRMSNorm`); four norms a layer (before and after
  attention, before and after the MLP), the post-norms applied before the residual adds;
- GeGLU MLP (tanh-approximated GELU, `hidden_activation`);
- embeddings scaled by `sqrt(hidden_size)` in the model dtype;
- softmax scale `query_pre_attn_scalar ** -0.5`;
- sliding-window layers interleaved with global ones (`layer_types`, `layers.layer_windows`);
- Gemma 2: attention logits and final logits soft-capped (`tanh(x / cap) * cap`);
- Gemma 3: per-head q/k norms and two rotary tables, the local base for sliding layers and the
  global one (with its scaling) for full-attention layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from batchgen.model.attention.base import AttentionBackend, AttentionMetadata
from batchgen.model.layers import MLP, Attention, RMSNorm, RotaryEmbedding, attention_heads, layer_windows
from batchgen.model.llama import LlamaForCausalLM, LlamaModel

if TYPE_CHECKING:
    from transformers import PretrainedConfig

GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: `x * rsqrt(mean(x^2) + eps) * (1 + weight)`, computed in float32 and cast
    back to the input's dtype, operation for operation as transformers' `Gemma2RMSNorm`. Input and
    output `[..., hidden]`; `c_ops` is accepted for `RMSNorm`'s signature and unused (the C norm
    scales by `weight`)."""

    def __init__(self, hidden_size: int, eps: float, c_ops: bool = False) -> None:
        super().__init__(hidden_size, eps, c_ops=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """`tanh(x / cap) * cap` (Gemma 2's logit soft-capping); `x` unchanged when `cap` is None."""
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap


class GemmaDecoderLayer(nn.Module):
    """One Gemma 2/3 layer on `[T, hidden_size]` rows: norm -> attention -> post-attention norm ->
    residual add -> pre-MLP norm -> GeGLU -> post-MLP norm -> residual add."""

    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, window: int | None) -> None:
        super().__init__()
        gemma3 = config.model_type == "gemma3_text"
        self.self_attn = Attention(
            config,
            backend,
            window,
            scale=float(config.query_pre_attn_scalar) ** -0.5,
            softcap=getattr(config, "attn_logit_softcapping", None),
            qk_norm=GemmaRMSNorm if gemma3 else None,
        )
        self.mlp = MLP(
            config.hidden_size,
            config.intermediate_size,
            activation=getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh",
        )
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The layer's output `[T, hidden_size]` for input `hidden` (not changed)."""
        attn = self.self_attn(self.input_layernorm(hidden), cos_sin, kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


def gemma_rotary(config: PretrainedConfig, max_positions: int, sliding: bool) -> RotaryEmbedding:
    """The rotary table of Gemma's global layers (`sliding` False) or sliding ones: one table for
    Gemma 2; for Gemma 3 the `full_attention` or `sliding_attention` parameters of its
    `rope_parameters` (global base 1,000,000 with its scaling, local base 10,000 in the real models)."""
    _, _, head_dim = attention_heads(config)
    layer_type = None
    if config.model_type == "gemma3_text":
        layer_type = "sliding_attention" if sliding else "full_attention"
    return RotaryEmbedding(config, head_dim, max_positions, layer_type)


class GemmaModel(LlamaModel):
    """Embedding, Gemma decoder layers and final norm; `rotary` is the global layers' table."""

    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, max_positions: int) -> None:
        nn.Module.__init__(self)
        self.rotary = gemma_rotary(config, max_positions, sliding=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, backend, w) for w in layer_windows(config))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 text decoder plus LM head (tied to the embedding unless the config says
    otherwise), with `LlamaForCausalLM`'s step interface and weight loading.

    Raises:
        ValueError: a `model_type` not in `GEMMA_MODEL_TYPES`, Gemma 3's bidirectional attention
            (an embedding model's setting), or a layer the backend cannot run (`Attention`).
    """

    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, max_positions: int) -> None:
        nn.Module.__init__(self)
        if config.model_type not in GEMMA_MODEL_TYPES:
            raise ValueError(f"model_type {config.model_type!r} is not a Gemma 2/3 text model")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention (Gemma embedding models) is not supported")
        self.config = config
        self.model = GemmaModel(config, backend, max_positions)
        # Gemma 3's sliding layers rotate by their own (local) table; Gemma 2 has one table.
        self.local_rotary = (
            gemma_rotary(config, max_positions, sliding=True) if config.model_type == "gemma3_text" else None
        )
        self.sliding_layers = [window is not None for window in layer_windows(config)]
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self.decoder_stack = None
        self.fits_decoder_stack = False  # the C decoder stack runs Llama layers only

    def rebuild_rotary(self, max_positions: int, device: torch.device) -> None:
        self.model.rotary = gemma_rotary(self.config, max_positions, sliding=False).to(device)
        if self.local_rotary is not None:
            self.local_rotary = gemma_rotary(self.config, max_positions, sliding=True).to(device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return softcap(self.lm_head(hidden), self.final_softcap)

    @torch.inference_mode()
    def final_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """As `LlamaForCausalLM.final_hidden`: the final-norm hidden states of `rows`."""
        hidden = self.model.embed_tokens(input_ids)
        # transformers scales by sqrt(hidden_size) rounded to the model dtype first.
        hidden = hidden * torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype)
        global_cos_sin = self.model.rotary.cos_sin(positions, hidden.dtype)
        local_cos_sin = global_cos_sin
        if self.local_rotary is not None:
            local_cos_sin = self.local_rotary.cos_sin(positions, hidden.dtype)
        layers = cast(list[GemmaDecoderLayer], list(self.model.layers))
        for layer, kv_cache, sliding in zip(layers, kv_caches, self.sliding_layers, strict=True):
            hidden = layer(hidden, local_cos_sin if sliding else global_cos_sin, kv_cache, meta)
        return self.model.norm(hidden[rows])
