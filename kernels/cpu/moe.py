"""Mixture-of-experts matmuls on the CPU: batchgen's own kernels for a layer's experts.

- `bf16_experts`: batchgen's AVX512-BF16 linear kernel (`csrc/bf16_linear.c`), one call per expert
  and projection on rows sorted by expert.
- `fused_experts`: the whole layer in one call (`csrc/moe_experts.c`): routing lists built in C, each
  routed expert's gate/up and down weights read once for all its tokens, SiLU(gate) * up fused, the
  outputs scaled by their routing weights and summed per token. One thread team for the layer
  instead of one per expert call: at a decode step's one or two tokens an expert, those wake-ups
  cost more than the products on a busy machine (measured: docs/benchmarks.md).

A layer's experts stay one stacked tensor: plain (`[E, N, K]`, the model's layout, any dtype and
width: `fused_experts` only) or each expert's `[N, K]` weight packed as `Bf16Linear` packs a linear
(`[N/16, K/2, 16, 2]`: strips of 16 output columns, K in pairs), so the stack is
`[E, N/16, K/2, 16, 2]` and expert e's weight starts at `e * stride(0)` (both kernels, bf16 on a CPU
with AVX512-BF16). torch's bf16 `F.linear` (and the grouped matmul on it) re-lays-out the plain
weight on every call, which costs more than the product at a decode step's few rows an expert.
"""

from __future__ import annotations

import ctypes
from typing import Any

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


def _moe_experts_kernel() -> Any:  # a ctypes foreign function
    """`csrc/moe_experts.c`'s `moe_experts` with its argument types declared (ctypes would pass every
    argument as a C int): (is_bf16, packed, x, ldx, tokens, hidden, inter, experts, top_k, ids, weights,
    gate_up, down, act, acc, lists, out, ldo, num_threads) -> status."""
    kernel = cpu_kernels.require_library().moe_experts
    if kernel.argtypes is None:  # once per loaded library
        ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        kernel.restype = i32
        kernel.argtypes = [
            i32,
            i32,
            ptr,
            i64,
            i64,
            i64,
            i64,
            i64,
            i32,
            ptr,
            ptr,
            ptr,
            ptr,
            ptr,
            ptr,
            ptr,
            ptr,
            i64,
            i32,
        ]
    return kernel


def fused_experts_apply(gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether `fused_experts` takes stacked weights `gate_up` and `down`: plain (`[E, 2I, H]`,
    `[E, H, I]`; float32 or bf16, any widths) or packed by `pack_experts` (bf16, where the library
    has the packed kernel: AVX512-BF16), on the CPU with the kernel library built."""
    if (
        not gate_up.is_cpu
        or gate_up.dtype not in (torch.float32, torch.bfloat16)
        or down.dtype != gate_up.dtype
    ):
        return False
    lib = cpu_kernels.load_library()
    if lib is None:
        return False
    return gate_up.dim() == 3 or bool(lib.moe_experts_packed_available())


def _expert_dims(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[int, int, int]:
    """(E, H, I) of plain `[E, 2I, H]` / `[E, H, I]` or packed `[E, 2I/16, H/2, 16, 2]` /
    `[E, H/16, I/2, 16, 2]` stacks.

    Raises:
        ValueError: the two stacks do not fit each other.
    """
    if gate_up.dim() == 3:
        experts, two_i, hidden = gate_up.shape
        expected: tuple[int, ...] = (experts, hidden, two_i // 2)
    else:
        experts, strips, pairs = gate_up.shape[:3]
        two_i, hidden = 16 * strips, 2 * pairs
        expected = (experts, hidden // 16, two_i // 4, 16, 2)
    if tuple(down.shape) != expected or two_i % 2:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} do not fit")
    return experts, hidden, two_i // 2


def fused_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """A layer's experts in one C call (`csrc/moe_experts.c`): each token's routed SwiGLU experts,
    scaled by their routing weights and summed, reading each routed expert's weights once.

    Args:
        x: `[T, H]` float32 or bf16, unit column stride.
        weights: `[T, top_k]` routing weights (any float dtype; used as float32).
        ids: int64 `[T, top_k]` expert ids in `[0, E)`.
        gate_up: `[E, 2I, H]` in x's dtype (gate rows first), or bf16 packed by `pack_experts`;
            contiguous.
        down: `[E, H, I]` in x's dtype, or bf16 packed; contiguous.

    Returns:
        `[T, H]` in x's dtype. bf16: rounded where torch's bf16 ops round (see the C source), the
        weighted sum over the slots in float32, rounded once.

    Raises:
        ValueError: shapes, dtypes or layouts that do not fit (see `fused_experts_apply`), or an
            expert id out of range.
    """
    tokens, hidden = x.shape
    experts, weight_hidden, inter = _expert_dims(gate_up, down)
    if x.dtype != gate_up.dtype or down.dtype != x.dtype or x.stride(1) != 1 or weight_hidden != hidden:
        raise ValueError(
            f"x must be {gate_up.dtype} [T, {weight_hidden}] with contiguous rows; got {x.dtype} {tuple(x.shape)}"
        )
    if not (gate_up.is_contiguous() and down.is_contiguous()):
        raise ValueError("gate_up and down must be contiguous")
    if ids.shape != weights.shape or ids.shape[0] != tokens:
        raise ValueError(
            f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must be [{tokens}, top_k]"
        )
    top_k = ids.shape[1]
    ids = ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    act = torch.empty(tokens * top_k, inter, dtype=x.dtype)
    acc = torch.empty(tokens, hidden, dtype=torch.float32)
    lists = torch.empty(2 * experts + 1 + tokens * top_k, dtype=torch.int32)
    out = torch.empty(tokens, hidden, dtype=x.dtype)
    status = _moe_experts_kernel()(
        int(x.dtype == torch.bfloat16), int(gate_up.dim() == 5), x.data_ptr(), x.stride(0), tokens, hidden,
        inter, experts, top_k, ids.data_ptr(), weights.data_ptr(), gate_up.data_ptr(), down.data_ptr(),
        act.data_ptr(), acc.data_ptr(), lists.data_ptr(), out.data_ptr(), hidden, torch.get_num_threads(),
    )  # fmt: skip
    if status == 1:
        raise ValueError(f"an expert id is outside [0, {experts}): {ids.min().item()}..{ids.max().item()}")
    if status != 0:
        raise ValueError(f"the packed experts kernel does not take {x.dtype} H={hidden}, I={inter} here")
    return out
