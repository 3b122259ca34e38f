"""`--dtype auto`: 16-bit like vLLM's auto, whatever the checkpoint stores."""

import pytest
import torch
from transformers import LlamaConfig

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
def test_auto_dtype(stored, device, expected):
    config = LlamaConfig(torch_dtype=stored) if stored else LlamaConfig()
    assert resolve_dtype("auto", config, device) == expected


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_explicit_dtype_wins(name):
    assert resolve_dtype(name, LlamaConfig(torch_dtype="bfloat16"), CPU) == getattr(torch, name)
