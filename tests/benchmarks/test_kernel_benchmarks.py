"""Each kernel micro-benchmark of benchmarks/kernels/ runs with tiny sizes in seconds and prints the
lines it promises (no timings checked: they depend on the machine)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from batchgen.kernels.cpu.linear import amx_kernel_available, bf16_kernel_available, can_prepack

KERNELS = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels"


def run(script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python benchmarks/kernels/SCRIPT ARGS` in a fresh interpreter (its output captured)."""
    return subprocess.run(
        [sys.executable, str(KERNELS / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_cpu_decode_attention() -> None:
    result = run(
        "cpu_attention_bench.py",
        "--num-seqs",
        "4",
        "--median-context",
        "20",
        "--layers",
        "1",
        "--rounds",
        "1",
    )
    assert result.returncode == 0, result.stderr
    assert "speed-up:" in result.stdout


def test_cpu_prefill_attention() -> None:
    result = run("cpu_prefill_attention_bench.py", "--lengths", "5,40", "--rounds", "2", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert "L=5:" in result.stdout and "L=40:" in result.stdout


def test_cpu_verify_attention() -> None:
    result = run(
        "verify_attention_bench.py", "--num-seqs", "2", "--contexts", "40", "--rows", "3,20", "--rounds", "2"
    )
    assert result.returncode == 0, result.stderr
    assert "2 x 40 tokens, 3 rows:" in result.stdout and "short walk" in result.stdout


def test_cpu_linear(tmp_path: Path) -> None:
    """Every candidate and the registry's choice (one layer, two row counts, a fresh tuning cache):
    bf16 where this CPU's oneDNN has it."""
    dtype = "bfloat16" if can_prepack(torch.bfloat16, torch.device("cpu")) else "float32"
    args = ["--rows", "1", "7", "--layers", "1", "--rounds", "1", "--num-threads", "1", "--dtype", dtype]
    result = run("linear_bench.py", *args, env={"BATCHGEN_CACHE": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("rows")]
    assert len(lines) == 2 and all("torch" in line and "chosen/fastest" in line for line in lines)
    assert ("bf16_c" in lines[0]) == (dtype == "bfloat16" and bf16_kernel_available())
    assert "worst chosen/fastest" in result.stdout
    assert list((tmp_path / "kernel_tuning").glob("*.json"))  # the choice was measured and cached


def test_int8_linear(tmp_path: Path) -> None:
    """One line a shape and row count: the float kernel named, each int8 kernel this build has
    ("int8_c" always, "int8_w8a8" where the library has it) with its ratio to it."""
    from batchgen.kernels.cpu.quantized_linear import w8a8_available

    args = ["--rows", "1", "3", "--layers", "1", "--rounds", "1", "--num-threads", "1", "--dtype", "float32"]
    result = run(
        "int8_linear_bench.py", *args, "--float-impl", "torch", env={"BATCHGEN_CACHE": str(tmp_path)}
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "float " in line and "(torch)" in line]
    assert len(lines) == 8 and all("int8_c " in line and "x)" in line for line in lines)
    assert all(("int8_w8a8" in line) == w8a8_available() for line in lines)
    assert not any("int8_c_dpbf16" in line for line in lines)  # bf16 activations only


def test_cpu_swiglu() -> None:
    """With AMX: one line a row count, after checking the fused output equals the unfused one;
    without: the reason, exit 1."""
    result = run("swiglu_bench.py", "--rows", "1,16", "--rounds", "2", "--num-threads", "1")
    if not amx_kernel_available():
        assert result.returncode == 1
        assert "AMX kernel is not available on this machine" in result.stdout
        return
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split()[0] for line in result.stdout.splitlines()[2:]]
    assert rows == ["1", "16"] and result.stdout.count("x\n") == 2


def test_prefill_row_slices(tiny_model_dir) -> None:
    args = ["--model", str(tiny_model_dir("llama")), "--rows", "8", "16", "--rounds", "2", "--prompts", "2",
            "--prompt-len", "20", "--num-threads", "1", "--kernels", "native"]  # fmt: skip
    result = run("row_chunk_bench.py", *args)  # native kernels: nothing measured, no table written
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["rows     8", "rows    16"]
    assert lines[2].startswith("rows 16 / rows 8: median ratio") and "(of 2 rounds faster)" not in lines[2]
    assert lines[2].endswith("/2 rounds faster)")


def test_triton_attention() -> None:
    """On a CUDA device, the quick sizes run every stage; without one, it says so and exits 1."""
    result = run("kernel_bench.py", "--quick", "--out", os.devnull)
    if not torch.cuda.is_available():
        assert result.returncode == 1
        assert "no CUDA device; nothing to measure" in result.stderr
        return
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for stage in ("copy bandwidth", "decode attention", "prefill attention", "decode tile sweep"):
        assert f"--- {stage}" in result.stdout
    assert "=== kernel_bench summary ===" in result.stdout and "ERROR" not in result.stdout


def test_moe_experts() -> None:
    """One small layer at 1 and 3 tokens: every path's time and ratio to the bytes / copy-rate bound."""
    result = run(
        "moe_bench.py", "--tokens", "1", "3", "--hidden-size", "64", "--intermediate-size", "32",
        "--experts", "6", "--top-k", "2", "--rounds", "1", "--dtype", "float32", "--phases",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for tokens in (1, 3):
        line = next(
            line for line in result.stdout.splitlines() if line.strip().startswith(f"{tokens} tokens:")
        )
        assert "torch " in line and "fused_c " in line and "x)" in line and "route" in line
