"""`--dtype auto`: 16-bit like vLLM's auto, whatever the checkpoint stores, except float32 on a CPU
that would only emulate bf16."""

import pytest
import torch
from transformers import LlamaConfig

from batchgen.config import EngineConfig
from batchgen.engine import sizing
from batchgen.engine.sizing import resolve_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(
    ("stored", "device", "expected"),
    [
        ("float32", CPU, torch.bfloat16),
        ("float32", CUDA, torch.bfloat16),
        ("bfloat16", CPU, torch.bfloat16),
        ("float16", CPU, torch.bfloat16),  # float16 matmuls are slow on CPUs
        ("float16", CUDA, torch.float16),
        (None, CPU, torch.bfloat16),
    ],
)
def test_auto_dtype(stored, device, expected, monkeypatch):
    monkeypatch.setattr(sizing, "cpu_has_native_bf16", lambda: True)
    config = LlamaConfig(torch_dtype=stored) if stored else LlamaConfig()
    assert resolve_dtype("auto", config, device) == expected


@pytest.mark.parametrize(
    ("stored", "device", "expected"),
    [("bfloat16", CPU, torch.float32), ("float32", CPU, torch.float32), ("bfloat16", CUDA, torch.bfloat16)],
)
def test_auto_dtype_on_a_cpu_without_native_bf16(stored, device, expected, monkeypatch):
    # bf16 would be emulated there, several times slower than float32; a GPU is not affected.
    monkeypatch.setattr(sizing, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", LlamaConfig(torch_dtype=stored), device) == expected


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_explicit_dtype_wins(name, monkeypatch):
    monkeypatch.setattr(sizing, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype(name, LlamaConfig(torch_dtype="bfloat16"), CPU) == getattr(torch, name)


@pytest.mark.parametrize(
    "given,expected",
    [
        (torch.bfloat16, "bfloat16"),
        (torch.float16, "float16"),
        (torch.float32, "float32"),
        ("bf16", "bfloat16"),
        ("half", "float16"),
        ("float", "float32"),
        ("fp32", "float32"),
        ("auto", "auto"),
    ],
)
def test_dtype_takes_torch_dtypes_and_vllm_spellings(given, expected):
    assert EngineConfig(dtype=given).dtype == expected


@pytest.mark.parametrize("given", ["int8", torch.int8, 16])
def test_an_unknown_dtype_is_refused_with_the_choices(given):
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16"):
        EngineConfig(dtype=given)


@pytest.mark.parametrize("native_bf16", [True, False])
def test_slow_explicit_dtypes_are_named(native_bf16, monkeypatch):
    """An explicit dtype far below the CPU's speed gets a reason (the engine logs it); auto's picks never do."""
    monkeypatch.setattr(sizing, "cpu_has_native_bf16", lambda: native_bf16)
    assert "float16" in sizing.slow_dtype_reason(torch.float16, CPU)
    assert (sizing.slow_dtype_reason(torch.bfloat16, CPU) is None) == native_bf16
    assert sizing.slow_dtype_reason(torch.float32, CPU) is None
    assert sizing.slow_dtype_reason(torch.float16, CUDA) is None
    auto = resolve_dtype("auto", LlamaConfig(torch_dtype="float16"), CPU)
    assert sizing.slow_dtype_reason(auto, CPU) is None
