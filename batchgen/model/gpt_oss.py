"""gpt-oss (`GptOssForCausalLM`, model_type "gpt_oss"): OpenAI's open-weight mixture of experts, on
the shared layers of `layers` and the Llama family's step (`llama`).

What differs from the Llama family, each as transformers' `modeling_gpt_oss` computes it:
- attention sinks: one learned logit per query head (`self_attn.sinks`) that joins each query's
  softmax denominator and nothing else (`attention.sdpa.attend`; every attention backend takes it);
- sliding-window layers alternating with full ones (`layer_types`, `layers.layer_windows`);
- biases on q/k/v and o projections (`attention_bias`);
- YaRN rotary scaling as configured (`rope_parameters`, through transformers' own init function);
- every layer a mixture of experts whose router (`mlp.router`, a linear with bias) keeps the top-k
  logits and takes their softmax (not the softmax of all, then the top-k);
- the experts' clamped SwiGLU with biases: `gate_up = x W_gu + b_gu` with gate and up in
  interleaved columns (gate at even, up at odd), `gate = min(gate, limit)`,
  `up = clamp(up, -limit, limit)`, `(up + 1) * gate * sigmoid(alpha * gate)`, then `W_d` and `b_d`.

The experts' weights stay in transformers' stacked layout: `gate_up_proj` `[E, H, 2I]`,
`down_proj` `[E, I, H]` (input rows, output columns) and their biases `[E, 2I]`, `[E, H]`. The steps
run in the order of transformers' default "grouped_mm" experts (pairs sorted by expert, one grouped
matmul a projection, the bias of each row's expert added after it), so float32 outputs are the
reference's. MXFP4 checkpoints are dequantized at load (`mxfp4`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.model import moe
from batchgen.model.attention.base import AttentionBackend
from batchgen.model.layers import Attention, RMSNorm, RotaryEmbedding, attention_heads, layer_windows
from batchgen.model.llama import DecoderLayer, LlamaForCausalLM, LlamaModel
from batchgen.model.mxfp4 import dequantize_checkpoint

if TYPE_CHECKING:
    from transformers import PretrainedConfig

GPT_OSS_MODEL_TYPES = ("gpt_oss",)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gated activation of `[S, 2I]` rows whose even columns are the gate and odd ones the
    up projection -> `[S, I]`: `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with
    `g = min(gate, limit)`."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssExperts(nn.Module):
    """All experts of one layer, in transformers' layout (the module docstring).

    forward(x `[T, H]`, routing weights `[T, top_k]`, expert ids int64 `[T, top_k]`) -> `[T, H]` in
    x's dtype.
    """

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        experts, hidden, inter = (
            int(config.num_local_experts),
            int(config.hidden_size),
            int(config.intermediate_size),
        )
        self.num_experts = experts
        self.alpha, self.limit = float(config.swiglu_alpha), float(config.swiglu_limit)
        self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(experts, inter, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))

    def _linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        groups: moe.ExpertGroups,
        ids: torch.Tensor,
    ) -> torch.Tensor:
        """Each expert-sorted row `x[s]` (`[S, in]`) times its expert's `weight` `[E, in, out]`, plus
        its `bias` `[E, out]` (`ids` int64 `[S]`: each row's expert) -> `[S, out]`: torch's grouped matmul on the CPU where this torch has one (the call transformers makes),
        else one matmul per expert that received rows."""
        if x.device.type == "cpu" and hasattr(F, "grouped_mm"):
            out = F.grouped_mm(x, weight, offs=groups.offsets)
        else:
            out = torch.empty(x.shape[0], weight.shape[2], dtype=x.dtype, device=x.device)
            start = 0
            for expert, count in enumerate(groups.counts.tolist()):  # one host sync a call
                if count:
                    out[start : start + count] = x[start : start + count] @ weight[expert]
                    start += count
        return out.add_(bias[ids])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        groups = moe.group_by_expert(ids, self.num_experts)
        top_k = ids.shape[1]
        sorted_ids = ids.reshape(-1)[groups.order]
        h = self._linear(
            x[groups.order // top_k], self.gate_up_proj, self.gate_up_proj_bias, groups, sorted_ids
        )
        h = clamped_swiglu(h, self.alpha, self.limit)
        out = self._linear(h, self.down_proj, self.down_proj_bias, groups, sorted_ids)
        return moe.combine(out, weights, groups, x.dtype)


class GptOssMoeBlock(nn.Module):
    """The router (`router`, a linear `[H] -> [E]` with bias) and the experts: `[T, H]` -> `[T, H]`.

    Routing: the `num_experts_per_tok` largest router logits of a token, then the softmax of those
    alone (in the logits' dtype) as their weights."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.top_k = int(config.num_experts_per_tok)
        self.router = nn.Linear(int(config.hidden_size), int(config.num_local_experts), bias=True)
        self.experts = GptOssExperts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        weights = torch.softmax(top, dim=1, dtype=top.dtype)
        return self.experts(x, weights, ids)


class GptOssDecoderLayer(DecoderLayer):
    """`llama.DecoderLayer` (pre-norm, residual adds, its row-chunked prefill) with sink attention
    and the experts in place of the MLP."""

    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, window: int | None) -> None:
        nn.Module.__init__(self)
        self.self_attn = Attention(config, backend, window, sinks=True)
        self.mlp = GptOssMoeBlock(config)  # type: ignore[assignment]  # the same call as the MLP's
        c_ops = backend.fused_cpu_ops
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, c_ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, c_ops)


class GptOssModel(LlamaModel):
    """Embedding, gpt-oss decoder layers and final norm."""

    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, max_positions: int) -> None:
        nn.Module.__init__(self)
        _, _, head_dim = attention_heads(config)
        self.rotary = RotaryEmbedding(config, head_dim, max_positions)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GptOssDecoderLayer(config, backend, w) for w in layer_windows(config))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.fused_cpu_ops)


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss decoder plus LM head, with `LlamaForCausalLM`'s step interface and weight loading
    (MXFP4 expert weights dequantized first: `mxfp4.dequantize_checkpoint`).

    Raises:
        ValueError: a `model_type` other than "gpt_oss", or a layer the backend cannot run.
    """

    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, max_positions: int) -> None:
        nn.Module.__init__(self)
        if config.model_type not in GPT_OSS_MODEL_TYPES:
            raise ValueError(f"model_type {config.model_type!r} is not gpt-oss")
        self.config = config
        self.model = GptOssModel(config, backend, max_positions)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.decoder_stack = None
        self.fits_decoder_stack = False  # the C decoder stack has no sinks, biases or these experts

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(dequantize_checkpoint(weights))
