"""`plan_engine` without a model: blocks from the memory budget, max_model_len within the model's
limit and the cache, the token budget, and the one too-long message."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from batchgen.config import EngineConfig
from batchgen.engine.sizing import kv_cache_bytes_per_block, plan_engine

CPU = torch.device("cpu")
# 2 layers x 2 KV heads x head_dim 16: a 16-token block is 2 * 2 * 16 * 2 * 16 * 4 = 8192 bytes in float32.
MODEL = LlamaConfig(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def plan(**options):
    return plan_engine(EngineConfig(block_size=16, **options), MODEL, CPU, torch.float32)


def test_kv_block_bytes_and_counts() -> None:
    assert kv_cache_bytes_per_block(MODEL, 16, torch.float32) == 8192
    p = plan(kv_cache_memory=64 * 8192)
    assert (p.num_blocks, p.num_swap_blocks, p.bytes_per_block) == (64, 0, 8192)
    assert p.max_model_len == 128 and p.max_model_len_note == ""  # the model's limit: 1024 tokens fit
    assert p.max_num_batched_tokens == 2048  # the CPU default with chunked prefill
    swap = plan(kv_cache_memory=64 * 8192, preemption_mode="swap", swap_space=8 * 8192 / 2**30)
    assert swap.num_swap_blocks == 8


def test_one_too_long_message_for_each_limit() -> None:
    at_model_limit = plan(kv_cache_memory=64 * 8192)
    assert at_model_limit.check_prompt_len(127) is None
    message = at_model_limit.check_prompt_len(128)
    assert message.startswith("prompt has 128 tokens but max_model_len is 128 (room is needed")
    assert "128 tokens is the model's limit" in message and "raise max_model_len" not in message
    lowered = plan(kv_cache_memory=4 * 8192)  # 4 blocks hold 64 tokens
    assert lowered.max_model_len == 64
    message = lowered.check_prompt_len(64)
    assert (
        "(lowered from the model's 128: the KV cache holds only 64 tokens; raise kv_cache_memory)" in message
    )
    assert message.endswith("give the KV cache more memory") and "raise max_model_len" not in message
    chosen = plan(kv_cache_memory=64 * 8192, max_model_len=32)
    assert chosen.check_prompt_len(40).endswith("shorten or truncate the prompt, or raise max_model_len")


def test_refusals() -> None:
    with pytest.raises(ValueError, match="max_model_len 256 exceeds the model's limit of 128 tokens"):
        plan(kv_cache_memory=64 * 8192, max_model_len=256)
    with pytest.raises(ValueError, match="the KV cache holds 64 tokens .*fewer than max_model_len 100"):
        plan(kv_cache_memory=4 * 8192, max_model_len=100)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(16\) is below max_model_len \(128\)"):
        plan(kv_cache_memory=64 * 8192, enable_chunked_prefill=False, max_num_batched_tokens=16)
    assert plan(kv_cache_memory=64 * 8192, enable_chunked_prefill=False).max_num_batched_tokens == 2048


def test_cuda_budget_counts_the_memory_a_dropped_engine_left_in_torchs_allocator(monkeypatch) -> None:
    """A first engine's KV cache, dropped, stays reserved by torch's caching allocator and shows as
    used in `mem_get_info` until `empty_cache`: the next engine must size its cache after handing it
    back (seen on an H200: the second `LLM` of a test run got an 8-token max_model_len)."""
    from batchgen.engine.sizing import num_kv_blocks
    from batchgen.engine.weight_memory import num_parameters

    total, held_by_allocator = 10**9, 9 * 10**8
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda device=None: (total - (0 if emptied else held_by_allocator), total)
    )
    weights = int(num_parameters(MODEL) * 4 * 1.5)
    blocks = num_kv_blocks(EngineConfig(block_size=16), torch.device("cuda"), torch.float32, 8192, MODEL)
    assert blocks == (int(total * 0.9) - weights) // 8192


def _linear_and_embedding_params(config) -> int:
    """transformers' own count for `config`, built on the meta device: every parameter but the norms."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for name, p in model.named_parameters() if "norm" not in name)


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "mixtral"])
def test_num_parameters_counts_every_expert(kind) -> None:
    """The CUDA budget's weight count equals transformers' parameter count (norms aside), all
    experts and routers of a mixture included; Qwen3-30B-A3B's shape gives its published 30.5B."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    from batchgen.engine.weight_memory import num_parameters

    heads = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    config = {
        "llama": LlamaConfig(**heads, intermediate_size=96, num_hidden_layers=2, head_dim=32),
        "qwen3_moe": Qwen3MoeConfig(
            **heads, intermediate_size=96, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
            num_hidden_layers=4, mlp_only_layers=[2], head_dim=32,
        ),
        "mixtral": MixtralConfig(**heads, intermediate_size=40, num_local_experts=6, num_hidden_layers=2),
    }[kind]  # fmt: skip
    assert num_parameters(config) == _linear_and_embedding_params(config)
    a3b = Qwen3MoeConfig(
        hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_hidden_layers=48,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, vocab_size=151936,
    )  # fmt: skip
    assert round(num_parameters(a3b) / 1e9, 1) == 30.5


def test_num_parameters_of_gpt_oss() -> None:
    """gpt-oss: every expert and router counted (biases and sinks left out, as norms are);
    gpt-oss-20b's shape gives its published 20.9B parameters."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    from batchgen.engine.weight_memory import num_parameters

    config = GptOssConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1000,
        intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    weights = sum(
        p.numel()
        for name, p in model.named_parameters()
        if not any(s in name for s in ("norm", "bias", "sinks"))
    )
    assert num_parameters(config) == weights
    gpt_oss_20b = GptOssConfig(num_hidden_layers=24, num_local_experts=32)
    assert round(num_parameters(gpt_oss_20b) / 1e9, 1) == 20.9
