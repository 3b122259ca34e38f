"""Typer options shared by `batchgen run` and `batchgen bench`: the engine's, with vLLM's spellings.

Each option is an `Annotated` type that both commands declare with the same default, taken from
`EngineConfig`, so the two commands cannot drift apart in names, help or defaults::

    def run_command(max_num_seqs: MaxNumSeqs = EngineConfig.max_num_seqs, ...): ...

`engine_options(locals())` then collects the values into `EngineConfig` keyword arguments.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from batchgen.config import (
    ATTENTION_BACKENDS,
    DEVICES,
    DTYPES,
    KERNEL_MODES,
    PREEMPTION_MODES,
    parse_memory_size,
)


def memory_size(text: str) -> int:
    """`parse_memory_size` for Typer: "1073741824", "2GiB", "512MiB", ... -> bytes.

    Raises:
        typer.BadParameter: not a size (Typer turns it into a usage error, exit 2).
    """
    try:
        return parse_memory_size(text)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def choices(values: tuple[str, ...]) -> str:
    """Help text listing the allowed values of an option: "a | b | c"."""
    return " | ".join(values)


Model = Annotated[
    str | None, typer.Option(help="HF directory, hub id or .gguf file (default: SmolLM2-135M-Instruct)")
]
Dtype = Annotated[
    str,
    typer.Option(
        help=choices(DTYPES)
        + "; auto: bfloat16 (float16 for a float16 checkpoint on CUDA; float32 on a CPU without native bf16)"
    ),
]
MaxNumSeqs = Annotated[int, typer.Option(help="Most sequences per step")]
MaxNumBatchedTokens = Annotated[int | None, typer.Option(help="Most tokens per step")]
BlockSize = Annotated[int, typer.Option(help="Tokens per KV-cache block")]
MaxModelLen = Annotated[int | None, typer.Option(help="Longest prompt + output in tokens")]
GpuMemoryUtilization = Annotated[float, typer.Option(help="Fraction of GPU memory to use (CUDA)")]
KvCacheMemory = Annotated[
    int | None,
    typer.Option(
        parser=memory_size,
        metavar="SIZE",
        help="KV cache size: bytes or 2GiB, 512MiB (default 1GiB on CPU; on CUDA, set, it replaces --gpu-memory-utilization)",
    ),
]
SwapSpace = Annotated[float, typer.Option(help="GiB of CPU swap space for preempted blocks")]
EnablePrefixCaching = Annotated[bool, typer.Option(help="Reuse KV blocks of shared prompt prefixes")]
EnableChunkedPrefill = Annotated[bool, typer.Option(help="Split long prompts across steps")]
PreemptionMode = Annotated[str, typer.Option(help=choices(PREEMPTION_MODES))]
AgingSteps = Annotated[
    int, typer.Option(help="max-throughput: a request waiting this many steps is served next")
]
AttentionBackend = Annotated[str, typer.Option(help=choices(ATTENTION_BACKENDS))]
Kernels = Annotated[
    str,
    typer.Option(
        help=choices(KERNEL_MODES)
        + ": auto times each kernel on this machine (cached), reference is plain torch, native is batchgen's own"
    ),
]
OneWeightLayout = Annotated[
    bool, typer.Option(help="--kernels auto: one weight copy per linear (less memory, maybe slower)")
]
Device = Annotated[str, typer.Option(help=choices(DEVICES))]
NumThreads = Annotated[int | None, typer.Option(help="torch CPU threads")]

# The parameter names above, as both commands spell them (EngineConfig's field names).
ENGINE_OPTIONS = (
    "model",
    "dtype",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "max_model_len",
    "gpu_memory_utilization",
    "kv_cache_memory",
    "swap_space",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "preemption_mode",
    "aging_steps",
    "attention_backend",
    "kernels",
    "one_weight_layout",
    "device",
    "num_threads",
)


def engine_options(values: dict[str, Any]) -> dict[str, Any]:
    """The engine options out of a command's parameters (`locals()`): `EngineConfig` keyword arguments."""
    return {name: values[name] for name in ENGINE_OPTIONS}
