"""Mixture-of-experts feed-forward (Qwen3-MoE, Mixtral): a router, top-k experts, one stacked weight.

A sparse layer replaces the dense SwiGLU MLP with `num_experts` SwiGLU experts of which each token
uses `top_k` (Shazeer et al. 2017, "Outrageously Large Neural Networks"; Mixtral: Jiang et al. 2024).
The router is a linear `[hidden] -> [num_experts]`; its softmax (in float32) picks the top-k experts,
whose weights are renormalized to sum to 1 where the model says so (Mixtral always; Qwen3-MoE with
`norm_topk_prob`). The experts run on tokens grouped by expert: the (token, slot) pairs are sorted
by expert id and each expert multiplies its contiguous rows in one matmul (experts no token chose
cost nothing); the outputs are scaled by their routing weights, put back in (token, slot) order and
summed over the slots. Those are the steps and the order of transformers' default "grouped_mm"
experts implementation, so float32 outputs are the reference's to the bit where the same matmul
runs (`torch.nn.functional.grouped_mm`).

All experts' weights of a layer stay in one stacked tensor each: `gate_up_proj` `[E, 2 * I, H]`
(gate rows first) and `down_proj` `[E, H, I]`, transformers 5.x's own layout. Checkpoints store
either those fused names or one tensor per expert (`experts.{e}.gate_proj/up_proj/down_proj` for
Qwen3-MoE, `block_sparse_moe.experts.{e}.w1/w3/w2` for Mixtral; transformers 5.x's
`save_pretrained` writes the per-expert form); `load_expert_weight` copies either into the stack.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from batchgen.kernels.cpu.moe import bf16_experts, bf16_experts_apply, fused_experts, pack_experts
from batchgen.kernels.registry import bucket_index
from batchgen.model.layers import MLP

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")

# Per-expert checkpoint names: (module path ending in ".mlp", expert, projection).
_EXPERT_WEIGHT = re.compile(r"^(?P<mlp>.+\.mlp)\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
# Projection -> (stacked parameter, half of gate_up_proj: 0 gate, 1 up; None for down_proj).
_EXPERT_PARTS: dict[str, tuple[str, int | None]] = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
    "w1": ("gate_up_proj", 0),  # Mixtral's names
    "w3": ("gate_up_proj", 1),
    "w2": ("down_proj", None),
}


@dataclass(frozen=True)
class MoeSpec:
    """A config's sparse-MLP settings.

    Attributes:
        num_experts: experts per sparse layer (E).
        top_k: experts each token uses.
        intermediate_size: one expert's SwiGLU width (I).
        norm_topk_prob: renormalize the top-k probabilities to sum to 1.
        float32_weights: the routing weights stay float32 where the expert outputs are scaled
            (Mixtral's router returns them so); Qwen3-MoE's are cast to the activation dtype first.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    float32_weights: bool


def moe_spec(config: PretrainedConfig) -> MoeSpec | None:
    """The sparse-MLP settings of a Qwen3-MoE, Mixtral or gpt-oss config; None for a dense model.
    gpt-oss's give its shapes (weights, active experts) to sizing, `plan` and the bench; its router
    and experts are `gpt_oss`'s own, with biases and a clamped SwiGLU."""
    if config.model_type == "qwen3_moe":
        return MoeSpec(
            num_experts=int(config.num_experts),
            top_k=int(config.num_experts_per_tok),
            intermediate_size=int(config.moe_intermediate_size),
            norm_topk_prob=bool(config.norm_topk_prob),
            float32_weights=False,
        )
    if config.model_type == "gpt_oss":  # a softmax over the top-k logits: weights that sum to 1
        return MoeSpec(
            num_experts=int(config.num_local_experts),
            top_k=int(config.num_experts_per_tok),
            intermediate_size=int(config.intermediate_size),
            norm_topk_prob=True,
            float32_weights=False,
        )
    if config.model_type == "mixtral":
        return MoeSpec(
            num_experts=int(config.num_local_experts),
            top_k=int(config.num_experts_per_tok),
            intermediate_size=int(config.intermediate_size),
            norm_topk_prob=True,
            float32_weights=True,
        )
    return None


def is_sparse_layer(config: PretrainedConfig, index: int) -> bool:
    """Whether decoder layer `index` (from 0) has experts: every Mixtral and gpt-oss layer; a Qwen3-MoE layer
    not in `mlp_only_layers` whose `index + 1` is a multiple of `decoder_sparse_step` (the rule of
    transformers' `Qwen3MoeDecoderLayer`)."""
    spec = moe_spec(config)
    if spec is None or spec.num_experts <= 0:
        return False
    if config.model_type != "qwen3_moe":
        return True
    mlp_only = getattr(config, "mlp_only_layers", None) or []
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return index not in mlp_only and (index + 1) % step == 0


def sparse_layer_count(config: PretrainedConfig) -> int:
    """How many of the config's decoder layers have experts (0 for a dense model)."""
    return sum(is_sparse_layer(config, i) for i in range(int(config.num_hidden_layers)))


def expert_parameters(config: PretrainedConfig) -> int:
    """Weights of every expert of every sparse layer: E experts' `3 * H * I` each (gate, up and
    down; their biases left out). Experts are float tensors, never quantized (0 for a dense model)."""
    spec = moe_spec(config)
    if spec is None:
        return 0
    return (
        sparse_layer_count(config) * spec.num_experts * 3 * int(config.hidden_size) * spec.intermediate_size
    )


def route(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool, weights_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing: router logits `[T, E]` -> (weights `[T, top_k]` in `weights_dtype`, expert ids
    int64 `[T, top_k]`, most probable first).

    The softmax runs in float32 over all E experts, then the k largest probabilities are kept (and
    divided by their sum with `norm_topk_prob`), as transformers' Qwen3-MoE and Mixtral routers do.
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), ids


@dataclass
class ExpertGroups:
    """The (token, slot) pairs of a step sorted by expert.

    Attributes:
        order: int64 `[T * top_k]`: pair indices (`token * top_k + slot`) sorted by expert id
            (torch's default sort, as transformers sorts: the order of an expert's rows moves the
            grouped matmul's rounding, so float32 outputs match the reference's bits only so).
        counts: int64 `[E]`: pairs per expert.
        offsets: int32 `[E]`: the running sum of `counts` (where each expert's rows end).
    """

    order: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor


def group_by_expert(ids: torch.Tensor, num_experts: int) -> ExpertGroups:
    """Sort the pairs of expert ids `ids` (int64 `[T, top_k]`) by expert."""
    flat = ids.reshape(-1)
    order = torch.sort(flat).indices
    counts = torch.bincount(flat, minlength=num_experts)
    return ExpertGroups(order, counts, torch.cumsum(counts, 0, dtype=torch.int32))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of `[S, 2 * I]` rows whose first half is the gate -> `[S, I]`."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# An experts implementation: (expert-sorted input rows `[S, H]`, gate_up `[E, 2I, H]`, down
# `[E, H, I]`, groups) -> each row's expert output `[S, H]`, in the sorted order.
ExpertsMatmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ExpertGroups], torch.Tensor]


def experts_loop(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, groups: ExpertGroups
) -> torch.Tensor:
    """One `F.linear` pair per expert that received rows (the reference; any device and dtype)."""
    out = torch.empty(x.shape[0], down.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for expert, count in enumerate(groups.counts.tolist()):  # one host sync a layer
        if count:
            rows = slice(start, start + count)
            out[rows] = F.linear(silu_mul(F.linear(x[rows], gate_up[expert])), down[expert])
            start += count
    return out


def experts_grouped_mm(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, groups: ExpertGroups
) -> torch.Tensor:
    """torch's grouped matmul (`F.grouped_mm`, one call per projection over all experts' rows), the
    call transformers' default experts implementation makes."""
    h = F.grouped_mm(x, gate_up.transpose(-2, -1), offs=groups.offsets)
    return F.grouped_mm(silu_mul(h), down.transpose(-2, -1), offs=groups.offsets)


def experts_triton(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, groups: ExpertGroups
) -> torch.Tensor:
    """batchgen's Triton grouped GEMM (`kernels/triton/fused_moe.py`): two launches, SiLU(gate) * up
    fused into the first, only the routed experts' weights read, no host sync."""
    from batchgen.kernels.triton.fused_moe import fused_moe_experts  # imports Triton: CUDA only

    return fused_moe_experts(x, gate_up, down, groups.counts)


def experts_bf16_c(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, groups: ExpertGroups
) -> torch.Tensor:
    """batchgen's AVX512-BF16 linear kernel, one call per expert that received rows, on weights
    packed by `use_bf16_kernel` (`kernels/cpu/moe.py`)."""
    return bf16_experts(x, gate_up, down, groups.counts.tolist())


def use_bf16_kernel(experts: FusedExperts) -> bool:
    """Pack `experts`' stacked weights for batchgen's bf16 CPU kernel and run it (`experts_bf16_c`),
    where it applies (`bf16_experts_apply`: bf16 on a CPU with AVX512-BF16); the plain weights are
    released. Returns whether it did."""
    if not bf16_experts_apply(experts.gate_up_proj, experts.down_proj):
        return False
    experts.gate_up_proj = nn.Parameter(pack_experts(experts.gate_up_proj), requires_grad=False)
    experts.down_proj = nn.Parameter(pack_experts(experts.down_proj), requires_grad=False)
    experts.matmul = experts_bf16_c
    return True


@functools.cache
def default_experts_matmul(device_type: str) -> ExpertsMatmul:
    """The experts implementation for a device type ("cpu", "cuda"): the Triton kernel on CUDA where Triton is installed;
    torch's grouped matmul on the CPU where this torch has one (2.9 and later, the call transformers
    makes); else the per-expert loop."""
    if device_type == "cuda" and importlib.util.find_spec("triton") is not None:
        return experts_triton
    if device_type == "cpu" and hasattr(F, "grouped_mm"):
        return experts_grouped_mm
    return experts_loop


def combine(
    out: torch.Tensor, weights: torch.Tensor, groups: ExpertGroups, dtype: torch.dtype
) -> torch.Tensor:
    """Expert outputs `[T * top_k, H]` in sorted order, routing weights `[T, top_k]` -> `[T, H]` in
    `dtype`: each row scaled by its weight, put back in (token, slot) order and summed over the slots
    (the product widens to float32 where the weights are float32, as in the reference)."""
    num_tokens, top_k = weights.shape
    scaled = out * weights.reshape(-1)[groups.order].unsqueeze(-1)
    pairs = torch.empty_like(scaled)
    pairs[groups.order] = scaled
    return pairs.view(num_tokens, top_k, -1).sum(dim=1).to(dtype)


class FusedExperts(nn.Module):
    """All experts of one layer: `gate_up_proj` `[E, 2 * I, H]` and `down_proj` `[E, H, I]`.

    forward(x `[T, H]`, routing weights `[T, top_k]`, expert ids int64 `[T, top_k]`) -> `[T, H]` in
    x's dtype: by `grouped` (rows sorted by expert, `matmul`, `combine`), or where `fused_by_bucket`
    says so for T's row bucket (`kernels.registry.bucket_index`; steps past the last bucket use the
    last), by batchgen's one-call C kernel (`kernels/cpu/moe.py fused_experts`), as
    `kernel_choice.experts` measured.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.matmul: ExpertsMatmul | None = None  # None: `default_experts_matmul` of the weights' device
        self.fused_by_bucket: list[bool] = []  # per row bucket: the one-call kernel (CPU only)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if (
            self.fused_by_bucket
            and self.fused_by_bucket[min(bucket_index(x.shape[0]), len(self.fused_by_bucket) - 1)]
        ):
            return fused_experts(x, weights, ids, self.gate_up_proj, self.down_proj)
        return self.grouped(x, weights, ids)

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The rows sorted by expert, each expert's through `matmul`, put back and summed (`forward`'s
        arguments and result)."""
        groups = group_by_expert(ids, self.num_experts)
        top_k = ids.shape[1]
        matmul = self.matmul or default_experts_matmul(x.device.type)
        out = matmul(x[groups.order // top_k], self.gate_up_proj, self.down_proj, groups)
        return combine(out, weights, groups, x.dtype)

    def missing(self, name: str, loaded: set[str]) -> list[str]:
        """The checkpoint parts of parameter `name` (this module's `gate_up_proj` or `down_proj`,
        fully named) not in `loaded`: none when the fused tensor was loaded, else each expert's."""
        if name in loaded:
            return []
        halves = ("gate", "up") if name.endswith("gate_up_proj") else ("down",)
        keys = [f"{name}#{e}.{h}" for e in range(self.num_experts) for h in halves]
        return [key for key in keys if key not in loaded]


class SparseMoeBlock(nn.Module):
    """The router (`gate`, a linear `[H] -> [E]`) and the experts: `[T, H]` -> `[T, H]`."""

    def __init__(self, hidden_size: int, spec: MoeSpec) -> None:
        super().__init__()
        self.spec = spec
        self.gate = nn.Linear(hidden_size, spec.num_experts, bias=False)
        self.experts = FusedExperts(spec.num_experts, hidden_size, spec.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        dtype = torch.float32 if self.spec.float32_weights else logits.dtype
        weights, ids = route(logits, self.spec.top_k, self.spec.norm_topk_prob, dtype)
        return self.experts(x, weights, ids)


def feed_forward(config: PretrainedConfig, index: int, c_ops: bool) -> MLP | SparseMoeBlock:
    """Layer `index`'s feed-forward: a `SparseMoeBlock` where the config puts experts
    (`is_sparse_layer`), else the dense SwiGLU `MLP` (`c_ops`: its C element-wise ops)."""
    spec = moe_spec(config)
    if spec is not None and is_sparse_layer(config, index):
        return SparseMoeBlock(int(config.hidden_size), spec)
    bias = bool(getattr(config, "mlp_bias", False))
    return MLP(config.hidden_size, config.intermediate_size, bias=bias, c_ops=c_ops)


def checkpoint_name(name: str) -> str:
    """A checkpoint tensor's name in our model: Mixtral's `block_sparse_moe` is our `mlp`."""
    return name.replace(".block_sparse_moe.", ".mlp.")


def load_expert_weight(model: nn.Module, name: str, tensor: torch.Tensor) -> str | None:
    """Copy one expert's projection (`...mlp.experts.{e}.{gate_proj|up_proj|down_proj|w1|w3|w2}.weight`)
    into its slice of the layer's stacked parameter; returns the key `FusedExperts.missing` looks
    for, or None when `name` is not a per-expert weight (fused names load as plain parameters).

    Raises:
        ValueError: the layer has no experts, the expert index is out of range, or the shape is wrong.
    """
    match = _EXPERT_WEIGHT.match(name)
    if match is None or match["proj"] not in _EXPERT_PARTS:
        return None
    try:
        experts = model.get_submodule(match["mlp"] + ".experts")
    except AttributeError:
        experts = None
    if not isinstance(experts, FusedExperts):
        raise ValueError(f"unexpected weight {name!r}: that layer has no experts")
    expert = int(match["expert"])
    if expert >= experts.num_experts:
        raise ValueError(f"weight {name!r}: expert {expert} of {experts.num_experts}")
    param_name, half = _EXPERT_PARTS[match["proj"]]
    target = getattr(experts, param_name).data[expert]
    if half is not None:
        size = experts.intermediate_size
        target = target[half * size : (half + 1) * size]
    if target.shape != tensor.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    target.copy_(tensor)
    part = "down" if half is None else ("gate", "up")[half]
    return f"{match['mlp']}.experts.{param_name}#{expert}.{part}"
