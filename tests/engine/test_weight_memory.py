"""The weights' bytes from a config (`engine.weight_memory`): the linears the engine builds, the
parameters it holds, and what quantization makes of them on each device. The bytes of a loaded
engine: tests/plan/test_plan_weights.py."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.engine_plan import WeightEstimate
from batchgen.engine.weight_memory import decoder_linear_shapes, estimate_weights, num_parameters
from batchgen.model.attention import select_backend
from batchgen.model.families import model_class
from batchgen.model.quantization import decoder_linears
from tests.conftest import TINY_MOE_ARCHS, _tiny_config, _tiny_moe_config

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _engine_model(arch: str):
    config = _tiny_moe_config(arch) if arch in TINY_MOE_ARCHS else _tiny_config(arch)
    with torch.device("meta"):
        return config, model_class(config)(config, select_backend("torch", CPU), 64)


@pytest.mark.parametrize(
    "arch", ["llama", "qwen2", "qwen3", "phi3", "gemma3", "qwen3_moe", "mixtral", "gpt_oss"]
)
def test_the_shapes_and_count_are_the_engine_models(arch) -> None:
    """The decoder linears by name and shape are the engine model's own (built on the meta device),
    and the parameter count is its parameters' (a tied LM head once; norms, biases, sinks aside)."""
    config, model = _engine_model(arch)
    assert decoder_linear_shapes(config) == {
        name: tuple(linear.weight.shape) for name, linear in decoder_linears(model).items()
    }
    held = sum(
        p.numel()
        for name, p in model.named_parameters()
        if not any(s in name for s in ("norm", "bias", "sinks"))
    )
    assert num_parameters(config) == held


def test_int8_and_gguf_count_quantized_on_a_cpu_only() -> None:
    config, _ = _engine_model("qwen3")  # tied: the embedding once
    linears = sum(n * k for n, k in decoder_linear_shapes(config).values())
    embedding = 49152 * 64
    none = estimate_weights(config, torch.bfloat16, "none", CPU)
    auto = estimate_weights(config, torch.bfloat16, "auto", CPU)  # a float checkpoint: as "none"
    assert auto.total_bytes == none.total_bytes and auto.quantized_linears == 0
    assert none.total_bytes == (linears + embedding) * 2 and none.tied and none.quantized_linears == 0
    int8 = estimate_weights(config, torch.bfloat16, "int8", CPU)
    # Every linear's K (64 or 128) is a multiple of 16: a byte and a quarter of a float32 scale a
    # weight. The LM head too, an int8 copy of the tied embedding, which stays bf16.
    assert (int8.quantized_bytes, int8.quantized_params) == (
        (linears + embedding) * 5 // 4,
        linears + embedding,
    )
    assert int8.float_bytes == embedding * 2 and int8.quantized_linears == int8.linears == 8
    assert int8.quantized_head and "; the LM head an int8 copy of the tied embedding;" in int8.describe()
    assert WeightEstimate.from_json(int8.to_json()) == int8
    assert int8.to_json()["total_bytes"] == int8.total_bytes
    # On CUDA the engine holds float weights (no GPU kernel runs quantized ones), GGUF or not.
    on_gpu = estimate_weights(config, torch.bfloat16, "auto", CUDA)
    assert on_gpu.total_bytes == none.total_bytes
    assert on_gpu.describe().startswith("auto: no cuda kernel runs quantized weights: all ")


def test_the_cuda_budget_leaves_room_for_the_tied_embedding_once(monkeypatch) -> None:
    from batchgen.config import EngineConfig
    from batchgen.engine.sizing import num_kv_blocks

    config, _ = _engine_model("qwen3")
    total = 10**9
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total, total))
    weights = (sum(n * k for n, k in decoder_linear_shapes(config).values()) + 49152 * 64) * 2
    blocks = num_kv_blocks(EngineConfig(block_size=16), CUDA, torch.bfloat16, 8192, config)
    assert blocks == (int(total * 0.9) - int(weights * 1.5)) // 8192
