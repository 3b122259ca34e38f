"""Building blocks of the Llama-family decoder: RMSNorm, rotary embedding, fused linears, attention.

Each layer works on flat token batches `[num_tokens, ...]` (no batch dimension, no padding).
The arithmetic mirrors Hugging Face's Llama implementation operation for operation so that float32
greedy outputs are token-identical to `transformers` `generate`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.kernels.cpu import ops as cpu_ops
from batchgen.kernels.cpu.linear import swiglu_for_rows
from batchgen.model.attention.base import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019).

    Input and output `[..., hidden]` in the model dtype; `eps` from the config. In float32,
    `F.rms_norm` computes exactly Hugging Face's `weight * x * rsqrt(mean(x^2) + eps)`.

    With `c_ops` (the "cpu" attention backend), in bf16 on a CPU with the C kernels built
    (`cpu_ops`), the norm is one pass per row in C.
    Otherwise, in 16-bit dtypes with many rows (prefill), it is one float32-accumulating reduction and two
    16-bit multiplies. On CPU, `F.rms_norm` widens the whole input to float32 and makes seven
    passes (measured: docs/benchmarks.md). The price is one more
    rounding (of the scale factor), which stays within the 16-bit tolerance of the reference.
    """

    # Below this many rows `F.rms_norm`'s fewer calls win (decode steps).
    FEW_PASSES_MIN_ROWS = 256

    def __init__(self, hidden_size: int, eps: float, c_ops: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.c_ops = c_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.c_ops and _c_rows(x):
            return cpu_ops.add_rms_norm_bf16(x, None, self.weight, self.eps)
        if x.dtype == torch.float32 or x.numel() < self.FEW_PASSES_MIN_ROWS * x.shape[-1]:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        mean_square = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
        mean_square = mean_square.square_().div_(x.shape[-1])
        scale = torch.rsqrt(mean_square.add_(self.eps)).to(x.dtype)
        return (x * scale).mul_(self.weight)

    def add_forward(self, hidden: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """`hidden += delta` in place (the residual add; none when `delta` is None), then the norm of
        `hidden`; one C call for bf16 on CPU."""
        if delta is None:
            return self(hidden)
        if self.c_ops and _c_rows(hidden) and _c_rows(delta):
            return cpu_ops.add_rms_norm_bf16(hidden, delta, self.weight, self.eps)
        hidden += delta
        return self(hidden)


def _c_rows(x: torch.Tensor) -> bool:
    """Whether `x` goes to the C element-wise ops: bf16 on CPU (library built), 2-D, contiguous rows."""
    return x.dim() == 2 and x.stride(1) == 1 and cpu_ops.bf16_ops_apply(x)


def rope_parameters(config: PretrainedConfig) -> dict[str, Any]:
    """The config's rotary settings as one dict with at least `rope_type` and `rope_theta`.

    transformers >= 5 stores them in `config.rope_parameters`; 4.x in `rope_theta` + `rope_scaling`.
    """
    params = getattr(config, "rope_parameters", None)
    if params:
        params = dict(params)
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def inverse_frequencies(
    config: PretrainedConfig, head_dim: int, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """Rotary inverse frequencies `[head_dim // 2]` float32 and the cos/sin scale factor.

    The default rule is RoFormer's (Su et al. 2021); scaled variants (llama3, linear, yarn, ...) come
    from transformers' own `ROPE_INIT_FUNCTIONS`, so they match the reference exactly. `layer_type`
    ("sliding_attention" or "full_attention") picks one of a config whose `rope_parameters` hold
    one set per layer type (Gemma 3's local and global bases).

    Raises:
        ValueError: for "dynamic" scaling, whose frequencies change with the sequence length.
    """
    params = rope_parameters(config)
    if layer_type is not None:
        params = dict(params[layer_type])
        params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    rope_type = params["rope_type"]
    if rope_type == "default":
        base = float(params["rope_theta"])
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    if rope_type == "dynamic":
        raise ValueError(
            "rope_type 'dynamic' is not supported (its frequencies depend on the sequence length)"
        )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS[rope_type]
    if layer_type is not None:
        inv_freq, scale = init(config, None, layer_type=layer_type)
        return inv_freq.float(), float(scale)
    try:
        inv_freq, scale = init(config)
    except TypeError:  # transformers 4.x: init(config, device)
        inv_freq, scale = init(config, None)
    return inv_freq.float(), float(scale)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding tables (RoFormer, Su et al. 2021), as Hugging Face applies them.

    cos/sin are precomputed in float32 for `max_positions` positions (`[max_positions, R]`, R the
    rotary dims: `head_dim` times the config's `partial_rotary_factor`, Phi-4-mini's 0.75) and cast
    to the activation dtype when used, exactly as the reference does per call.
    """

    cos: torch.Tensor  # buffers `[max_positions, R]` float32
    sin: torch.Tensor

    def __init__(
        self, config: PretrainedConfig, head_dim: int, max_positions: int, layer_type: str | None = None
    ) -> None:
        super().__init__()
        factor = rope_parameters(config).get("partial_rotary_factor") or 1.0
        inv_freq, scale = inverse_frequencies(config, int(head_dim * float(factor)), layer_type)
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[T, 1, R]` for int64 positions `[T]`, in `dtype`; computed once a step."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate x `[T, H, D]` (queries and keys together) by the step's (cos, sin) `[T, 1, R]`: its
    first R dims (all of them unless the rotary is partial, R < D; the rest pass unchanged)."""
    cos, sin = cos_sin
    if cos.shape[-1] < x.shape[-1]:
        rotary_dims = cos.shape[-1]
        return torch.cat((apply_rotary(x[..., :rotary_dims], cos_sin), x[..., rotary_dims:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class MergedLinear(nn.Linear):
    """One matmul for several projections of the same input (q/k/v, or gate/up).

    `shard_sizes` are the output widths of the parts in order; `load_shard` copies a Hugging Face
    weight (or bias) into its rows.
    """

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = shard_sizes

    def load_shard(self, index: int, name: str, tensor: torch.Tensor) -> None:
        """Copy checkpoint tensor `tensor` (`[shard_sizes[index], in_features]` for "weight",
        `[shard_sizes[index]]` for "bias") into its rows of the fused parameter.

        Raises:
            RuntimeError: from `copy_`, when the tensor's shape does not match the shard.
        """
        start = sum(self.shard_sizes[:index])
        param = self.weight if name == "weight" else self.bias
        param.data[start : start + self.shard_sizes[index]].copy_(tensor)


def attention_heads(config: PretrainedConfig) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of a Hugging Face config: the one place they are read.

    `num_key_value_heads` defaults to the query heads (no GQA) and `head_dim` to
    `hidden_size // num_attention_heads` where the config does not set them.
    """
    num_heads = int(config.num_attention_heads)
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // num_heads)
    return num_heads, num_kv_heads, head_dim


def layer_rotary(config: PretrainedConfig) -> list[bool]:
    """Whether each decoder layer rotates its queries and keys: all of them, except where
    SmolLM3's `no_rope_layers` holds 0 (its NoPE layers)."""
    flags = getattr(config, "no_rope_layers", None)
    if not flags:
        return [True] * int(config.num_hidden_layers)
    return [bool(flag) for flag in flags]


def layer_windows(config: PretrainedConfig) -> list[int | None]:
    """Each decoder layer's sliding attention window in tokens, None for a global layer.

    As transformers reads them: `layer_types` ("sliding_attention" layers get `sliding_window`;
    Gemma 2/3 interleave them, Qwen2/3 with `use_sliding_window` slide from `max_window_layers`
    on), or, for Mistral, Phi-3, Mixtral and Qwen3-MoE (no `layer_types`), `sliding_window` on
    every layer.
    """
    layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return [None] * layers
    types = getattr(config, "layer_types", None)
    if types:
        return [int(window) if t == "sliding_attention" else None for t in types]
    if config.model_type in ("mistral", "phi3", "mixtral", "qwen3_moe"):
        return [int(window)] * layers
    return [None] * layers


class Attention(nn.Module):
    """Self-attention with fused QKV, optional QKV bias (Qwen2) and per-head q/k RMSNorm (Qwen3,
    Qwen3-MoE;
    Gemma 3 passes its own norm class as `qk_norm`).

    forward(hidden `[T, hidden]`, the step's rotary (cos, sin), kv cache pair, metadata) -> `[T, hidden]`.
    `window` (tokens, None: global) and `softcap` (Gemma 2's attention logit cap) go to the
    backend with every call; `scale` overrides the softmax scale `head_dim ** -0.5`; `rotary`
    False leaves queries and keys unrotated (SmolLM3's NoPE layers); `sinks` gives the layer
    gpt-oss's learned per-head attention sink logits (`self.sinks` `[Hq]`, passed to the backend).

    Raises:
        ValueError: from `backend.check_layer`, where the backend cannot run this layer.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        backend: AttentionBackend,
        window: int | None = None,
        *,
        scale: float | None = None,
        softcap: float | None = None,
        qk_norm: type[RMSNorm] | None = None,
        rotary: bool = True,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        self.rotary = rotary
        self.num_heads, self.num_kv_heads, self.head_dim = attention_heads(config)
        self.scale = self.head_dim**-0.5 if scale is None else scale
        backend.check_layer(window, softcap)
        self.window, self.softcap = window, softcap
        qkv_bias = bool(getattr(config, "attention_bias", False) or config.model_type == "qwen2")
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, [q_size, kv_size, kv_size], bias=qkv_bias)
        self.o_proj = nn.Linear(
            q_size, config.hidden_size, bias=bool(getattr(config, "attention_bias", False))
        )
        if qk_norm is None and config.model_type in ("qwen3", "qwen3_moe"):
            qk_norm = RMSNorm
        self.qk_norm = qk_norm is not None
        if qk_norm is not None:
            self.q_norm = qk_norm(self.head_dim, config.rms_norm_eps, backend.fused_cpu_ops)
            self.k_norm = qk_norm(self.head_dim, config.rms_norm_eps, backend.fused_cpu_ops)
        self.backend = backend
        self.q_size, self.kv_size = q_size, kv_size
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if sinks else None

    def project(
        self, hidden: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed hidden `[T, hidden]` -> rotated queries `[T, Hq, D]` and keys `[T, Hkv, D]`, values `[T, Hkv, D]`."""
        qkv = self.qkv_proj(hidden)
        heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            qk = torch.cat(
                (self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1
            )
        if not self.rotary:
            return qk[:, : self.num_heads], qk[:, self.num_heads :], v
        if (
            self.backend.fused_cpu_ops
            and cpu_ops.bf16_ops_apply(qk)
            and cos_sin[0].shape[-1] == self.head_dim
        ):
            q, k = cpu_ops.rotary_bf16(qk, *cos_sin, self.num_heads)
            return q, k, v
        # One rotation for queries and keys together: half the element-wise passes.
        qk = apply_rotary(qk, cos_sin)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], v

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Store the step's K/V and attend: `[T, Hq, D]`, `[T, Hkv, D]`, `[T, Hkv, D]` -> `[T, Hq * D]`."""
        sinks = None if self.sinks is None else self.sinks.float()
        out = self.backend.forward(
            q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.window, self.softcap, sinks
        )
        return out.reshape(-1, self.q_size)

    def forward(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.project(hidden, cos_sin)
        return self.o_proj(self.attend(q, k, v, kv_cache, meta))


# Gate activations of the gated MLP by Hugging Face name: SwiGLU ("silu", "swish") and Gemma's
# GeGLU with the tanh approximation of GELU ("gelu_pytorch_tanh").
GATE_ACTIVATIONS = ("silu", "swish", "gelu_pytorch_tanh")


class MLP(nn.Module):
    """Gated feed-forward (Shazeer 2020, "GLU Variants Improve Transformer") with one fused
    gate/up matmul: `[T, hidden_size]` -> `[T, 2 * intermediate_size]` -> act(gate) * up
    `[T, intermediate_size]` -> `[T, hidden_size]`, in the input's dtype. `activation` is one of
    `GATE_ACTIVATIONS`: SiLU (SwiGLU, with the C kernels' fused paths) or tanh-GELU (GeGLU, torch).

    Raises:
        ValueError: an activation not in `GATE_ACTIVATIONS`.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        c_ops: bool = False,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        if activation not in GATE_ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {', '.join(GATE_ACTIVATIONS)}; got {activation!r}")
        self.gelu = activation == "gelu_pytorch_tanh"
        # SiLU-and-multiply in C for bf16 on CPU (the "cpu" attention backend); SwiGLU only
        self.c_ops = c_ops and not self.gelu
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.intermediate_size = intermediate_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.c_ops and _c_rows(x):
            # batchgen's AMX kernel, where measured fastest for the gate/up projection at this row
            # count, computes SiLU(gate) * up as it stores (bit for bit the unfused result)
            swiglu = swiglu_for_rows(self.gate_up_proj, x.shape[0])
            if swiglu is not None:
                return self.down_proj(swiglu(x))
        gate_up = self.gate_up_proj(x)
        if self.c_ops and _c_rows(gate_up):
            return self.down_proj(cpu_ops.silu_mul_bf16(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        if self.gelu:
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return self.down_proj(F.silu(gate) * up)
