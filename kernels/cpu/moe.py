"""Mixture-of-experts matmuls on the CPU: batchgen's AVX512-BF16 linear kernel, one call per expert.

A layer's experts stay one stacked tensor, each expert's `[N, K]` weight packed as `Bf16Linear`
packs a linear (`[N/16, K/2, 16, 2]`: strips of 16 output columns, K in pairs), so the stack is
`[E, N/16, K/2, 16, 2]` and expert e's weight starts at `e * stride(0)`. The rows arrive sorted by
expert: each expert that received rows multiplies its contiguous rows in place, with no copy of
the input, the weights or the output. torch's bf16 `F.linear` (and the grouped matmul on it)
re-lays-out the plain weight on every call, which costs more than the product at a decode step's
few rows an expert.
"""

from __future__ import annotations

import torch

from batchgen.kernels.cpu import library as cpu_kernels
from batchgen.kernels.cpu import ops as cpu_ops
from batchgen.kernels.cpu.linear import bf16_kernel_available


def bf16_experts_apply(gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether `bf16_experts` takes plain stacked weights `gate_up` `[E, 2I, H]` and `down`
    `[E, H, I]`: bf16 on the CPU, H and 2I multiples of 16, I and H even, the kernel built."""
    if gate_up.dtype != torch.bfloat16 or down.dtype != torch.bfloat16 or not gate_up.is_cpu:
        return False
    _, two_i, hidden = gate_up.shape
    return two_i % 32 == 0 and hidden % 16 == 0 and bf16_kernel_available()


def pack_experts(weight: torch.Tensor) -> torch.Tensor:
    """Stacked plain weights bf16 `[E, N, K]` -> packed `[E, N/16, K/2, 16, 2]` (one new tensor)."""
    experts, n, k = weight.shape
    return weight.detach().reshape(experts, n // 16, 16, k // 2, 2).permute(0, 1, 3, 2, 4).contiguous()


def _linear_rows(
    x: torch.Tensor, packed: torch.Tensor, out: torch.Tensor, counts: list[int], n: int, k: int
) -> None:
    """`out[rows] = x[rows] @ W[e]^T` for each expert's contiguous rows (`counts` in expert order);
    x bf16 `[S, k]`, out bf16 `[S, n]`, both contiguous."""
    kernel = cpu_kernels.require_library().bf16_linear
    threads = torch.get_num_threads()
    expert_bytes = packed.stride(0) * packed.element_size()
    x_ptr, w_ptr, out_ptr = x.data_ptr(), packed.data_ptr(), out.data_ptr()
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        status = kernel(
            x_ptr + start * k * 2, k, w_ptr + expert * expert_bytes, None, out_ptr + start * n * 2, n,
            count, n, k, threads,
        )  # fmt: skip
        if status != 0:  # bf16_experts_apply admits only what the kernel takes: a bug
            raise RuntimeError(f"bf16_linear refused [{count}, {k}] x [{n}, {k}] of expert {expert}")
        start += count


def bf16_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: list[int]
) -> torch.Tensor:
    """Each row's expert SwiGLU for rows sorted by expert.

    Args:
        x: bf16 `[S, H]` rows sorted by expert id.
        gate_up: packed `[E, 2I/16, H/2, 16, 2]` (`pack_experts` of `[E, 2I, H]`, gate rows first).
        down: packed `[E, H/16, I/2, 16, 2]` (`pack_experts` of `[E, H, I]`).
        counts: rows per expert (summing to S).

    Returns:
        bf16 `[S, H]`: `down[e] @ (SiLU(gate[e] @ x) * (up[e] @ x))` per row, float32 sums rounded
        once per product.
    """
    x = x.contiguous()
    rows, hidden = x.shape
    two_i = gate_up.shape[1] * 16
    h = torch.empty(rows, two_i, dtype=torch.bfloat16)
    _linear_rows(x, gate_up, h, counts, two_i, hidden)
    act = cpu_ops.silu_mul_bf16(h)
    out = torch.empty(rows, hidden, dtype=torch.bfloat16)
    _linear_rows(act, down, out, counts, hidden, two_i // 2)
    return out
