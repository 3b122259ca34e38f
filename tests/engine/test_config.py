"""`--device`: "cuda" without an available CUDA device is a clear error, in the engine and in both CLIs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from batchgen.config import EngineConfig, resolve_device

MESSAGE = "device is 'cuda' but torch.cuda.is_available() is False"


@pytest.fixture
def no_cuda(monkeypatch) -> None:
    """torch as a CPU-only build sees it (the same on a GPU machine)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_resolve_device(no_cuda) -> None:
    assert resolve_device("auto") == "cpu"
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match=r"device is 'cuda' .* use --device cpu or --device auto"):
        resolve_device("cuda")


def test_engine_refuses_cuda_before_loading_the_model(no_cuda, tmp_path: Path) -> None:
    from batchgen.engine.llm_engine import LLMEngine

    # The model does not exist: a ModelNotFoundError would mean the device was checked too late.
    config = EngineConfig(model=str(tmp_path / "no-model"), device="cuda")
    with pytest.raises(ValueError, match=re.escape(MESSAGE)):
        LLMEngine(config)


def test_run_with_cuda_unavailable_is_a_usage_error(no_cuda, tmp_path: Path) -> None:
    from batchgen.cli import app

    job = tmp_path / "job.jsonl"
    job.write_text('{"prompt": "hi"}\n')
    result = CliRunner().invoke(app, ["run", str(job), "--device", "cuda", "--no-dashboard"])
    assert result.exit_code == 2, result.output
    assert MESSAGE in result.stderr and "--device cpu" in result.stderr
    assert "Traceback" not in result.output and not isinstance(result.exception, AssertionError)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.jsonl"]  # nothing written beside it


def test_a_cpu_kv_cache_larger_than_memory_is_refused_before_allocating(tiny_model_dir) -> None:
    import psutil

    from batchgen import LLM

    too_big = psutil.virtual_memory().total * 2
    with pytest.raises(ValueError, match=r"kv_cache_memory plus swap_space is .* GiB but only .* GiB"):
        LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu", kv_cache_memory=too_big)


def test_kv_cache_memory_takes_the_flags_sizes() -> None:
    """The Python API takes "2MiB" as `--kv-cache-memory` does; a bad size names the field's rule."""
    from batchgen.config import EngineConfig

    assert EngineConfig(kv_cache_memory="2MiB").kv_cache_memory == 2 * 2**20
    assert EngineConfig(kv_cache_memory="1.5GB").kv_cache_memory == 1_500_000_000
    with pytest.raises(ValueError):
        EngineConfig(kv_cache_memory="2 parsecs")
