"""The roofline of a run: the least time its own steps could take on this machine.

The compute ceiling (`batchgen.bench.report.ceiling`) counts FLOPs only, but a decode step of a small batch
is bound by memory, not arithmetic: it streams every weight and the batch's KV cache once to produce
a handful of tokens. The roofline model (Williams, Waterman and Patterson, "Roofline: An Insightful
Visual Performance Model for Multicore Architectures", CACM 2009) bounds each step by whichever
takes longer::

    step bound = max(FLOPs / matmul rate, bytes / memory bandwidth)

with FLOPs from `ceiling.forward_flops` (the step's tokens, attended keys and sampled rows) and bytes
the weights read once per step plus the KV cache read (the sequences' context lengths) and written
(the step's tokens). A run's roofline is the sum of its steps' bounds; `roofline reached` = roofline /
wall time. Unlike the compute ceiling, it is computed from the schedule the configuration actually ran
(static batching's padding included), so two configurations' rooflines compare their schedules at
equal kernel efficiency, and each one's fraction compares its kernels with the hardware.

It assumes the weights and the KV cache stream from memory every step: a model small enough to stay
in the last-level cache can beat it (a fraction over 100%).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from batchgen.bench.report.ceiling import ModelShape, forward_flops


def weight_bytes(shape: ModelShape, dtype_bytes: int) -> int:
    """Bytes of the weights a forward pass reads: every layer's linears and the LM head."""
    return (shape.non_embedding_params + shape.hidden_size * shape.vocab_size) * dtype_bytes


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    """Bytes of K and V one token holds in the cache, over all layers."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype_bytes


def step_bytes(
    shape: ModelShape, dtype_bytes: int, tokens: int, context_tokens: int, weights: int | None = None
) -> float:
    """Least memory traffic of one step, in bytes: the weights it reads once (`weights` bytes where
    given, e.g. a quantized model's; else `weight_bytes` in the dtype), of a mixture of experts the
    routed experts' share only (`ModelShape.step_weight_params`), the KV cache of `context_tokens`
    positions read, and that of `tokens` new positions written."""
    held = weight_bytes(shape, dtype_bytes) if weights is None else weights
    head = shape.hidden_size * shape.vocab_size
    read = held * (shape.step_weight_params(tokens) + head) / (shape.non_embedding_params + head)
    return read + kv_bytes_per_token(shape, dtype_bytes) * (context_tokens + tokens)


def measure_memory_bandwidth(
    device: str | torch.device = "cpu", nbytes: int | None = None, repeats: int = 5
) -> dict[str, Any]:
    """Memory bandwidth in bytes/s: the best of `repeats` copies of an `nbytes` buffer, counting the
    bytes read and written (STREAM's "copy" convention: McCalpin, "Memory Bandwidth and Machine
    Balance in Current High Performance Computers", 1995).

    The buffer (default 128 MiB on a CPU, 1 GiB on a GPU) is several times any last-level cache, so
    the copy streams from memory. Runs with the current torch thread count.

    Returns:
        {"bytes_per_s": float, "buffer_bytes": int, "device": str, "threads": int}
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    nbytes = nbytes or (2**30 if cuda else 2**27)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    best = float("inf")
    for i in range(repeats + 1):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        if i:  # the first copy also faults in the destination's pages
            best = min(best, time.perf_counter() - t0)
    buffer_bytes = src.numel() * 4
    del src, dst
    if cuda:  # hand the buffers back, or the engine's KV-cache sizing would see them as used
        torch.cuda.empty_cache()
    return {
        "bytes_per_s": 2 * buffer_bytes / best,
        "buffer_bytes": buffer_bytes,
        "device": str(device),
        "threads": torch.get_num_threads(),
    }


def roofline_seconds(
    steps: list[Any],
    shape: ModelShape,
    dtype_bytes: int,
    flops_per_s: float,
    bytes_per_s: float,
    weights: int | None = None,
) -> float | None:
    """Sum over `steps` of max(FLOPs / `flops_per_s`, bytes / `bytes_per_s`), in seconds.

    Args:
        steps: `StepRecord`s with `num_batched_tokens`, `num_sampled`, `num_attended_keys` and
            `num_context_tokens`; None when any of those is unknown (the Hugging Face baselines).
        dtype_bytes: bytes per weight and per KV-cache element.
        weights: bytes of the weights a step reads, as the run held them (the engine's
            `ModelRunner.weight_bytes`: int8 weights at a byte each); None: `weight_bytes` in the dtype.
    """
    total = 0.0
    for s in steps:
        if s.num_sampled is None or s.num_attended_keys is None or s.num_context_tokens is None:
            return None
        flops = forward_flops(shape, s.num_batched_tokens, s.num_attended_keys, s.num_sampled)["total"]
        moved = step_bytes(shape, dtype_bytes, s.num_batched_tokens, s.num_context_tokens, weights)
        total += max(flops / flops_per_s, moved / bytes_per_s)
    return total


def prefill_flops(steps: list[Any], shape: ModelShape) -> float | None:
    """Forward FLOPs (`ceiling.forward_flops`: linears, attention and LM head) of the `steps` that
    computed prompt tokens, decode rows mixed into them included: over the prefill steps' seconds,
    the rate the bench compares with the kernel table's (`KernelChoice.largest_bucket_flops_per_s`).
    None when a step's counts are unknown (the Hugging Face baselines)."""
    total = 0.0
    for s in steps:
        if s.num_prompt_tokens is None or s.num_sampled is None or s.num_attended_keys is None:
            return None
        if s.num_prompt_tokens:
            total += forward_flops(shape, s.num_batched_tokens, s.num_attended_keys, s.num_sampled)["total"]
    return total
