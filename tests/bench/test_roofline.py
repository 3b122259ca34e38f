"""The roofline's FLOP and byte counts, worked out by hand on a toy shape."""

from __future__ import annotations

import pytest

from batchgen.bench.report.ceiling import ModelShape, forward_flops, workload_flops
from batchgen.bench.report.metrics import StepRecord
from batchgen.bench.report.roofline import (
    kv_bytes_per_token,
    measure_memory_bandwidth,
    prefill_flops,
    roofline_seconds,
    step_bytes,
    weight_bytes,
)

# One layer: q/k/v 8 x 4 x (2 + 2 x 1) = 128, o 2 x 4 x 8 = 64, gate/up/down 3 x 8 x 16 = 384 -> 576.
SHAPE = ModelShape(
    hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, vocab_size=10
)


def step(tokens: int, keys: int, sampled: int, context: int, prompt: int = 0) -> StepRecord:
    return StepRecord(
        t=0.0, num_seqs=1, num_batched_tokens=tokens, num_generation_tokens=sampled,
        num_sampled=sampled, num_attended_keys=keys, num_context_tokens=context, num_prompt_tokens=prompt,
    )  # fmt: skip


def test_counts() -> None:
    assert SHAPE.non_embedding_params == 2 * 576
    assert weight_bytes(SHAPE, 2) == (1152 + 8 * 10) * 2 == 2464
    assert kv_bytes_per_token(SHAPE, 2) == 2 * 2 * 1 * 4 * 2 == 32
    assert step_bytes(SHAPE, 2, tokens=3, context_tokens=10) == 2464 + 32 * 13
    flops = forward_flops(SHAPE, tokens=3, attended_keys=20, sampled=1)
    assert flops == {"linear": 6912.0, "attention": 4 * 2 * 2 * 4 * 20.0, "lm_head": 160.0, "total": 8352.0}
    # A workload of one 2 + 1 request: 3 tokens attending to 1 + 2 + 3 keys, one LM head row.
    assert workload_flops(SHAPE, [(2, 1)])["total"] == forward_flops(SHAPE, 3, 6, 1)["total"]


def test_each_step_takes_the_slower_of_compute_and_memory() -> None:
    steps = [step(3, 20, 1, 10), step(1, 11, 1, 11)]  # 8352 FLOPs / 2880 B, 3168 FLOPs / 2848 B
    assert roofline_seconds(steps, SHAPE, 2, flops_per_s=1000, bytes_per_s=1000) == pytest.approx(
        8.352 + 3.168
    )
    assert roofline_seconds(steps, SHAPE, 2, flops_per_s=1000, bytes_per_s=500) == pytest.approx(
        8.352 + 5.696
    )


def test_a_quantized_run_counts_its_own_weight_bytes() -> None:
    """An int8 run reads its linears at a byte each: the engine's `weight_bytes` replaces the dtype's."""
    assert step_bytes(SHAPE, 2, tokens=3, context_tokens=10, weights=1000) == 1000 + 32 * 13
    steps = [step(1, 11, 1, 11)]  # 3168 FLOPs; 1000 + 32 * 12 bytes
    assert roofline_seconds(steps, SHAPE, 2, 1e9, 1000, weights=1000) == pytest.approx(1.384)
    assert roofline_seconds(steps, SHAPE, 2, 1e9, 1000) == pytest.approx(2.848)


def test_steps_without_counts_have_no_roofline() -> None:
    baseline_step = StepRecord(t=0.0, num_seqs=1, num_batched_tokens=3, num_generation_tokens=1)
    assert roofline_seconds([step(3, 20, 1, 10), baseline_step], SHAPE, 2, 1.0, 1.0) is None


def test_prefill_flops_count_every_row_of_the_steps_that_computed_prompt_tokens() -> None:
    # A 2-token prompt chunk mixed with one decode row (8352 FLOPs), then a decode-only step.
    steps = [step(3, 20, 1, 10, prompt=2), step(1, 11, 1, 11, prompt=0)]
    assert prefill_flops(steps, SHAPE) == 8352.0
    assert prefill_flops(steps[1:], SHAPE) == 0.0
    baseline_step = StepRecord(t=0.0, num_seqs=1, num_batched_tokens=3, num_generation_tokens=1)
    assert prefill_flops([*steps, baseline_step], SHAPE) is None


def test_memory_bandwidth_is_measured() -> None:
    result = measure_memory_bandwidth(nbytes=2**20, repeats=2)
    assert result["buffer_bytes"] == 2**20 and result["device"] == "cpu"
    assert result["bytes_per_s"] > 1e8  # any machine copies a MiB faster than 100 MB/s


# SHAPE with its second layer a mixture: 4 experts of width 4, top-2. Attention 192 a layer; layer 1's
# MLP 384; layer 2's router 8 x 4 = 32 and experts 3 x 8 x 4 = 96 each.
MOE = ModelShape(
    hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, vocab_size=10,
    num_sparse_layers=1, num_experts=4, experts_per_token=2, expert_intermediate_size=4,
)  # fmt: skip


def test_moe_counts_only_routed_experts() -> None:
    assert MOE.non_embedding_params == 2 * 192 + 384 + 32 + 4 * 96 == 1184
    assert MOE.active_params == 2 * 192 + 384 + 32 + 2 * 96 == 992
    # one token reads its 2 experts; two tokens 4 x (1 - (1/2)^2) = 3 on average; many nearly all 4
    assert MOE.routed_experts(1) == 2.0 and MOE.routed_experts(2) == 3.0
    assert MOE.routed_experts(64) == pytest.approx(4.0)
    assert step_bytes(MOE, 2, tokens=1, context_tokens=10) == (992 + 80) * 2 + 32 * 11
    assert step_bytes(MOE, 2, tokens=2, context_tokens=10) == (1088 + 80) * 2 + 32 * 12
    assert weight_bytes(MOE, 2) == (1184 + 80) * 2  # memory: every expert
    assert forward_flops(MOE, tokens=3, attended_keys=0, sampled=0)["linear"] == 2 * 992 * 3
    # a dense model reads all its weights at any step size
    assert SHAPE.step_weight_params(1) == SHAPE.step_weight_params(64) == SHAPE.non_embedding_params


def test_moe_shape_from_config_matches_transformers() -> None:
    """`ModelShape.from_config` of a Qwen3-MoE config (one dense layer) counts transformers' own
    linear parameters; at Qwen3-30B-A3B's shape the counts are its model card's (29.9B non-embedding,
    3.3B activated)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=96,
        moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2, num_hidden_layers=3,
        mlp_only_layers=[0], vocab_size=100,
    )  # fmt: skip
    shape = ModelShape.from_config(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linears = sum(p.numel() for n, p in model.model.layers.named_parameters() if "norm" not in n)
    assert shape.num_sparse_layers == 2 and shape.non_embedding_params == linears
    a3b = ModelShape.from_config(
        Qwen3MoeConfig(
            hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_hidden_layers=48,
            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, vocab_size=151936,
        )
    )  # fmt: skip
    embeddings = 2 * 2048 * 151936
    assert round(a3b.non_embedding_params / 1e9, 1) == 29.9  # the model card's non-embedding count
    assert 3.3e9 < a3b.active_params + embeddings < 3.4e9  # "3.3B activated"
