"""The compute ceiling of a workload: its forward FLOPs over the measured matrix-product rate.

`batchgen bench` prints the fastest the workload could possibly run on this machine, to show how
much of the hardware each configuration uses: total FLOPs (`workload_flops`, the Kaplan et al. 2020
count) divided by the best FLOP/s of the model's own linear layers at its own shapes
(`measure_matmul_rate`, timed in the same run).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from batchgen.kernels.cpu.linear import (
    Bf16Linear,
    bf16_linear_applies,
    can_prepack,
    pack_weight,
    prepacked_linear,
)
from batchgen.model import moe
from batchgen.model.layers import attention_heads


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-family decoder that set its FLOPs and the weight bytes its steps read.

    A mixture of experts (Qwen3-MoE, Mixtral) has `num_sparse_layers` layers whose feed-forward is
    `num_experts` experts of width `expert_intermediate_size` behind a router, of which each token
    uses `experts_per_token`; its other layers have the dense MLP of `intermediate_size`.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_sparse_layers: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a transformers `PretrainedConfig` (Llama, Mistral, Qwen2/3, SmolLM, Qwen3-MoE, Mixtral)."""
        heads, kv_heads, head_dim = attention_heads(config)
        spec = moe.moe_spec(config)
        return cls(
            hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size),
            num_layers=int(config.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=int(config.vocab_size),
            num_sparse_layers=moe.sparse_layer_count(config),
            num_experts=spec.num_experts if spec else 0,
            experts_per_token=spec.top_k if spec else 0,
            expert_intermediate_size=spec.intermediate_size if spec else 0,
        )

    @property
    def layer_linear_params(self) -> int:
        """Weights of one dense layer's q, k, v, o, gate, up and down projections."""
        return self.attention_params + 3 * self.hidden_size * self.intermediate_size

    @property
    def attention_params(self) -> int:
        """Weights of one layer's q, k, v and o projections."""
        d, hd = self.hidden_size, self.head_dim
        return d * hd * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * hd * d

    @property
    def non_embedding_params(self) -> int:
        """Linear weights of all layers, every expert and router included (norms, embeddings and
        the LM head excluded): what the weights occupy."""
        return int(self._layer_params(self.num_experts))

    @property
    def active_params(self) -> int:
        """The linear weights one token is multiplied by: `non_embedding_params` with each sparse
        layer's `experts_per_token` experts instead of all (equal for a dense model)."""
        return int(self._layer_params(self.experts_per_token))

    def routed_experts(self, tokens: int) -> float:
        """Experts a step of `tokens` tokens reads in each sparse layer, expected under uniform
        routing: E * (1 - (1 - k/E)^tokens) (each expert is missed by every token with probability
        1 - k/E); k at one token, near E at many."""
        if not self.num_experts:
            return 0.0
        return self.num_experts * (1.0 - (1.0 - self.experts_per_token / self.num_experts) ** tokens)

    def step_weight_params(self, tokens: int) -> float:
        """Linear weights a step of `tokens` tokens reads: a dense model's all; a mixture's attention,
        dense layers, routers and the experts it routes to (`routed_experts`)."""
        if not self.num_sparse_layers:
            return float(self.non_embedding_params)
        return self._layer_params(self.routed_experts(tokens))

    def _layer_params(self, experts: float) -> float:
        """Linear weights of all layers with `experts` experts counted in each sparse layer."""
        d = self.hidden_size
        dense = (self.num_layers - self.num_sparse_layers) * 3 * d * self.intermediate_size
        sparse = self.num_sparse_layers * (
            d * self.num_experts + experts * 3 * d * self.expert_intermediate_size
        )
        return self.num_layers * self.attention_params + dense + sparse


def forward_flops(shape: ModelShape, tokens: int, attended_keys: int, sampled: int) -> dict[str, float]:
    """FLOPs of a forward pass over `tokens` tokens (one step, or a whole workload).

    Per token: 2 x active non-embedding parameters (one multiply-add per weight a token meets;
    Kaplan et al. 2020; a mixture of experts' token meets its top-k experts only). Per
    attended key: 4 x layers x (heads x head_dim) (QK^T and attention x V, one multiply-add each).
    The LM head (2 x hidden x vocab) counts once per sampled token: logits are needed only where a
    token is sampled. Embedding lookups, norms, rotary and activations are left out (well under 1%).

    Args:
        tokens: tokens computed. attended_keys: keys attended to, summed over those tokens.
        sampled: tokens sampled (LM head rows).

    Returns:
        dict with `linear`, `attention`, `lm_head` and `total` FLOPs.
    """
    linear = 2.0 * shape.active_params * tokens
    attention = 4.0 * shape.num_layers * shape.num_heads * shape.head_dim * attended_keys
    lm_head = 2.0 * shape.hidden_size * shape.vocab_size * sampled
    return {
        "linear": linear,
        "attention": attention,
        "lm_head": lm_head,
        "total": linear + attention + lm_head,
    }


def workload_flops(shape: ModelShape, lengths: list[tuple[int, int]]) -> dict[str, float]:
    """Forward FLOPs to process a workload once, without padding or recomputation (`forward_flops`
    with every prompt and output token computed once, each attending to its position + 1 keys, and
    the LM head on every output token).

    Args:
        lengths: (prompt tokens, output tokens) per request.

    Returns:
        dict with `tokens` (prompt + output), `linear`, `attention`, `lm_head`, `total` FLOPs and
        `per_token` (total / tokens).
    """
    tokens = sum(p + o for p, o in lengths)
    # sum over positions 1..n of n = n(n+1)/2 keys attended to
    keys = sum((p + o) * (p + o + 1) // 2 for p, o in lengths)
    flops = forward_flops(shape, tokens, keys, sum(o for _, o in lengths))
    return {
        "tokens": tokens,
        **flops,
        "per_token": flops["total"] / tokens if tokens else 0.0,
        "non_embedding_params": shape.non_embedding_params,
        "active_params": shape.active_params,
    }


def measure_matmul_rate(
    shape: ModelShape,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    rows: tuple[int, ...] = (64, 128, 256, 512),
    min_time_s: float = 0.15,
) -> dict[str, Any]:
    """Best FLOP/s of one decoder layer's linear layers (the model's shapes) at `rows` rows.

    Every matmul path the engine may take is timed, and the fastest counts at each row count:
    `F.linear`, oneDNN-prepacked weights where the engine packs them (`can_prepack`: float32 on a
    CPU, or bf16 on one with native bf16), and batchgen's own bf16 kernel where it applies
    (`bf16_linear_applies`: a CPU with AVX512-BF16). Runs with the current torch thread count, after two
    warm-up rounds; each row count and path is timed for at least `min_time_s`. The best row count
    is the rate the compute ceiling uses, so the ceiling is an upper bound on what the model's
    matrix products can reach.

    Returns:
        {"flops_per_s": best rate, "by_rows": {rows: rate}, "dtype": str, "device": str, "threads": int}
    """
    d, hd, i = shape.hidden_size, shape.head_dim, shape.intermediate_size
    gen = torch.Generator(device="cpu").manual_seed(0)
    paths = _matmul_paths(_layer_weights(shape, dtype, device, gen), dtype, device)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    flops_per_row = 2.0 * shape.layer_linear_params
    by_rows: dict[int, float] = {}
    with torch.inference_mode():
        for m in rows:
            acts = tuple(
                torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
                for k in (d, shape.num_heads * hd, i)
            )
            by_rows[m] = max(flops_per_row * m / _time_layer(ops, acts, sync, min_time_s) for ops in paths)
    best = max(by_rows.values())
    return {
        "flops_per_s": best,
        "by_rows": by_rows,
        "dtype": str(dtype).replace("torch.", ""),
        "device": str(device),
        "threads": torch.get_num_threads(),
    }


def _layer_weights(
    shape: ModelShape, dtype: torch.dtype, device: str | torch.device, gen: torch.Generator
) -> list[torch.Tensor]:
    """Random weights of one layer's fused linears: qkv `[(heads + 2 kv_heads) x head_dim, hidden]`,
    o `[hidden, heads x head_dim]`, gate_up `[2 x intermediate, hidden]`, down `[hidden, intermediate]`."""
    d, hd, i = shape.hidden_size, shape.head_dim, shape.intermediate_size

    def weight(out_f: int, in_f: int) -> torch.Tensor:
        return (torch.randn(out_f, in_f, generator=gen) * 0.02).to(device=device, dtype=dtype)

    return [
        weight(hd * (shape.num_heads + 2 * shape.num_kv_heads), d),
        weight(d, shape.num_heads * hd),
        weight(2 * i, d),
        weight(d, i),
    ]


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight)


def _prepacked(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return prepacked_linear(x, packed)


def _matmul_paths(
    weights: list[torch.Tensor], dtype: torch.dtype, device: str | torch.device
) -> list[list[Callable[[torch.Tensor], torch.Tensor]]]:
    """Each matmul path the engine may take for these weights, as one callable per weight:
    `F.linear`, oneDNN-prepacked weights (`can_prepack`) and batchgen's bf16 kernel (`bf16_linear_applies`)."""
    paths: list[list[Callable[[torch.Tensor], torch.Tensor]]] = [
        [functools.partial(_linear, weight=w) for w in weights]
    ]
    if can_prepack(dtype, torch.device(device)):
        packed = [pack_weight(w) for w in weights]
        paths.append([functools.partial(_prepacked, packed=p) for p in packed])
    if all(bf16_linear_applies(w) for w in weights):
        paths.append([Bf16Linear.from_weight(w) for w in weights])
    return paths


def _time_layer(
    ops: list[Callable[[torch.Tensor], torch.Tensor]],
    acts: tuple[torch.Tensor, ...],
    sync: Callable[[], None],
    min_time_s: float,
) -> float:
    """Seconds one layer's four linears take (qkv and gate_up on `acts[0]`, o on `acts[1]`, down on
    `acts[2]`): the mean of at least `min_time_s` of repeats, after two warm-up rounds."""
    qkv, o, gate_up, down = ops
    x, a, h = acts

    def layer() -> None:
        qkv(x)
        o(a)
        gate_up(x)
        down(h)

    for _ in range(2):
        layer()
    sync()
    n, t0 = 0, time.perf_counter()
    while True:
        layer()
        n += 1
        if n % 4 == 0:
            sync()
            elapsed = time.perf_counter() - t0
            if elapsed >= min_time_s:
                return elapsed / n


def compute_ceiling(flops: dict[str, float], rate: dict[str, Any]) -> dict[str, Any]:
    """The fastest the workload could run: its FLOPs at the measured matmul rate.

    Returns:
        {"seconds": total FLOPs / rate, "tokens_per_s": (prompt + output tokens) / seconds, ...}
    """
    seconds = flops["total"] / rate["flops_per_s"]
    return {
        "seconds": seconds,
        "tokens_per_s": flops["tokens"] / seconds if seconds > 0 else None,
        "flops": flops,
        "matmul": rate,
    }
