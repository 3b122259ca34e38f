"""The measured choice of a mixture of experts' kernels: per row bucket, batchgen's one-call C kernel
or the per-expert path.

A step's tokens spread over many experts: at 8 tokens and top-8 of 128, some 52 experts get one or two
tokens each. The per-expert path (`FusedExperts.grouped`: batchgen's bf16 linear one expert at a
time on the packed stack where the CPU has AVX512-BF16, else torch's grouped matmul or loop) makes two
calls an expert; `fused_experts` (`kernels/cpu/moe.py`) runs the layer in one. Which is faster at a
row count depends on the machine and on how busy it is (each call wakes the thread team), so for the
model's expert shape `choose_experts` times both on one layer's real weights at each row bucket, with
random routing, and sets every layer's `fused_by_bucket`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from batchgen.kernels.cpu.moe import fused_experts, fused_experts_apply
from batchgen.kernels.registry import Setup, TuningTable, buckets_up_to, choose
from batchgen.model import moe

# The one-call kernel against the per-expert path, relative to the output's largest magnitude:
# float32 sums in another order; in bf16 a product rounded in another place (a couple of ulps).
_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def choose_experts(model: nn.Module, table: TuningTable | None, max_rows: int) -> list[str]:
    """Put every mixture-of-experts layer of `model` (weights loaded) on the kernels chosen for it.

    The stacks are packed for batchgen's bf16 kernel where it applies (`moe.use_bf16_kernel`); then
    each row bucket up to `max_rows` gets the faster of the one-call kernel and the per-expert path,
    measured on the first layer's weights (every layer has the same shape) and recorded in `table`;
    with `table` None ("native") the one-call kernel runs every step, unmeasured.

    Returns:
        What runs at each row bucket up to `max_rows` ("fused_c", "bf16_c" or "torch"); empty for a
        model without experts, or where torch's path is the only one.
    """
    blocks = [m for m in model.modules() if isinstance(m, moe.SparseMoeBlock)]
    if not blocks:
        return []
    packed = sum(moe.use_bf16_kernel(block.experts) for block in blocks) > 0
    per_expert = "bf16_c" if packed else "torch"
    first = blocks[0].experts
    buckets = buckets_up_to(max_rows)
    if not fused_experts_apply(first.gate_up_proj, first.down_proj):
        return [per_expert] * len(buckets) if packed else []
    if table is None:
        chosen = ["fused_c"] * len(buckets)
    else:
        by_rows = _measure(blocks[0], table, buckets, per_expert)
        chosen = [by_rows[rows] for rows in buckets]
    for block in blocks:
        block.experts.fused_by_bucket = [name == "fused_c" for name in chosen]
    return chosen


def _measure(
    block: moe.SparseMoeBlock, table: TuningTable, buckets: tuple[int, ...], per_expert: str
) -> dict[int, str]:
    """Time the one-call kernel and the per-expert path on `block` at each bucket (`choose`)."""
    experts = block.experts
    hidden = experts.down_proj.shape[1] if experts.down_proj.dim() == 3 else 16 * experts.down_proj.shape[1]
    top_k, dtype = block.spec.top_k, experts.gate_up_proj.dtype

    def inputs(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`rows` tokens, each routed to `top_k` distinct experts drawn uniformly (seeded by rows)."""
        generator = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, hidden, generator=generator).to(dtype)
        ids = torch.rand(rows, experts.num_experts, generator=generator).topk(top_k, dim=-1).indices
        weights = torch.rand(rows, top_k, generator=generator)
        return x, (weights / weights.sum(-1, keepdim=True)).to(dtype), ids

    def setup(run: Callable[..., torch.Tensor]) -> Setup:
        def ready(rows: int) -> Callable[[], torch.Tensor]:
            x, weights, ids = inputs(rows)
            return lambda: run(x, weights, ids)

        return ready

    def fused(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return fused_experts(x, weights, ids, experts.gate_up_proj, experts.down_proj)

    candidates = {per_expert: setup(experts.grouped), "fused_c": setup(fused)}
    layout = ":packed" if experts.gate_up_proj.dim() == 5 else ""
    shape = f"{experts.num_experts}x{hidden}x{experts.intermediate_size}x{top_k}:{str(dtype).removeprefix('torch.')}{layout}"
    with torch.no_grad():
        return choose(
            table,
            "moe_experts",
            shape,
            buckets,
            candidates,
            lambda rows: candidates[per_expert](rows)(),
            _RTOL.get(dtype, 2e-2),
            work=lambda rows: 6.0 * rows * top_k * hidden * experts.intermediate_size,
        )
