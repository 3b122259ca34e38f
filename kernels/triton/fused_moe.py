"""Fused mixture-of-experts matmuls: a grouped GEMM over rows sorted by expert.

The rows of a step's (token, slot) pairs arrive sorted by expert id, so each expert's rows are one
contiguous range. The rows are cut into tiles of BLOCK_M that never straddle two experts (each
expert's range is padded up to a multiple of BLOCK_M, as in vLLM's `moe_align_block_size` and the
grouped GEMM of Tan et al. 2024, "Scattered Mixture-of-Experts Implementation"), and one program
computes a BLOCK_M x BLOCK_N tile of one expert's output, reading only that expert's weights. The
first GEMM runs the gate and up halves of `gate_up_proj` together and stores SiLU(gate) * up, so the
`[S, 2 * I]` intermediate never reaches memory; the second runs `down_proj`. Experts no row chose
have no tiles: a decode step reads only the routed experts' weights.

The tile table (which expert, which rows) is built on the device with torch ops and no host sync,
for an upper bound of `cdiv(S, BLOCK_M) + min(E, S)` tiles; tiles past the real ones exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchgen.kernels.triton.decode_attention import mma
from batchgen.kernels.triton.store_kv_cache import (
    FLOAT_DTYPES,
    check_device,
    check_inner_contiguous,
    check_tensor,
    interpreting,
    launch,
)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    tile_end_ptr,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    SWIGLU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # One program: rows [row0, row0 + BLOCK_M) of one expert (cut at the expert's last row) x
    # BLOCK_N output columns.
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:
        return
    row0 = tl.load(tile_row_ptr + tile)
    row_end = tl.load(tile_end_ptr + tile)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(
            a_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        w_mask = k_mask[:, None] & col_mask[None, :]
        b = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None] * stride_wk, mask=w_mask, other=0.0)
        acc = mma(a, b, acc, PRECISION, UPCAST)
        if SWIGLU:
            # The up half: rows N.. of gate_up_proj.
            b = tl.load(
                w_base + (cols[None, :] + N) * stride_wn + ks[:, None] * stride_wk, mask=w_mask, other=0.0
            )
            acc_up = mma(a, b, acc_up, PRECISION, UPCAST)
    if SWIGLU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def expert_tiles(
    counts: torch.Tensor, block_m: int, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tile table of rows sorted by expert, built on `counts`' device without a host sync.

    Args:
        counts: int64 `[E]`, rows per expert (the rows are sorted by expert).
        block_m: rows per tile.
        num_rows: S, the sum of `counts` (known to the caller without a sync: tokens x top_k).

    Returns:
        (expert, first row, end row) per tile, each int32 `[cdiv(S, block_m) + min(E, S)]`: tile i
        covers rows `[first, min(first + block_m, end))` of `expert`; expert -1 marks an unused tile.
    """
    num_experts = counts.shape[0]
    ends = torch.cumsum(counts, 0)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    max_tiles = triton.cdiv(num_rows, block_m) + min(num_experts, num_rows)
    tile_starts = torch.arange(max_tiles, device=counts.device, dtype=torch.int64) * block_m
    expert = torch.searchsorted(padded_ends, tile_starts, right=True)
    used = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    first = ends[e] - counts[e] + (tile_starts - (padded_ends[e] - padded[e]))
    expert = torch.where(used, expert, -1)
    return expert.to(torch.int32), first.to(torch.int32), ends[e].to(torch.int32)


def _block_m(num_rows: int, num_experts: int) -> int:
    """Rows per tile: about the rows an expert gets, 16 to 64 (tl.dot needs 16)."""
    per_expert = max(1, num_rows // max(1, num_experts))
    return min(64, max(16, triton.next_power_of_2(per_expert)))


def fused_moe_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Every row's expert SwiGLU: `down[e] @ (SiLU(gate[e] @ x) * (up[e] @ x))` for rows sorted by
    expert.

    Args:
        x: `[S, H]` rows sorted by expert id (float16, bfloat16 or float32), row stride free, stride
            1 in H.
        gate_up: `[E, 2 * I, H]`, each expert's gate rows then its up rows, same dtype, stride 1 in H.
        down: `[E, H, I]`, same dtype, stride 1 in I.
        counts: int64 `[E]`, rows per expert, summing to S (not checked: that would need a sync).

    Returns:
        `[S, H]` in x's dtype, row i the output of row i's expert. Products accumulate in float32
        (IEEE float32 for float32 inputs: no TF32).

    Raises:
        TypeError: a non-tensor argument or a wrong dtype. ValueError: shapes, devices or strides.
    """
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("gate_up", gate_up, 3, (x.dtype,))
    check_tensor("down", down, 3, (x.dtype,))
    check_tensor("counts", counts, 1, (torch.int64,))
    num_rows, hidden = x.shape
    num_experts, two_i, _ = gate_up.shape
    inter = two_i // 2
    if gate_up.shape != (num_experts, 2 * inter, hidden) or two_i % 2:
        raise ValueError(f"gate_up must be [E, 2 * I, H={hidden}]; got {tuple(gate_up.shape)}")
    if down.shape != (num_experts, hidden, inter):
        raise ValueError(f"down must be [E={num_experts}, H={hidden}, I={inter}]; got {tuple(down.shape)}")
    if counts.shape[0] != num_experts:
        raise ValueError(f"counts has {counts.shape[0]} entries for {num_experts} experts")
    for name, t in (("x", x), ("gate_up", gate_up), ("down", down)):
        check_inner_contiguous(name, t)
    check_device({"x": x, "gate_up": gate_up, "down": down, "counts": counts})
    out = torch.empty(num_rows, hidden, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    block_m = _block_m(num_rows, num_experts)
    tiles = expert_tiles(counts, block_m, num_rows)
    h = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    _gemm(x, gate_up, h, tiles, block_m, swiglu=True)
    _gemm(h, down, out, tiles, block_m, swiglu=False)
    return out


def _gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    block_m: int,
    swiglu: bool,
) -> None:
    """Launch one grouped GEMM: `out[rows] = a[rows] @ w[e].T` per tile (SiLU(gate) * up with `swiglu`)."""
    n, k = out.shape[1], a.shape[1]
    block_n = 64 if n >= 64 else 32 if n >= 32 else 16
    block_k = 32 if a.dtype == torch.float32 else 64
    upcast = interpreting() and a.dtype == torch.bfloat16
    grid = (tiles[0].shape[0], triton.cdiv(n, block_n))
    launch(
        _grouped_gemm_kernel,
        grid,
        (a, w, out, *tiles, n, k, a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0)),
        dict(
            SWIGLU=swiglu,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
            UPCAST=upcast,
        ),
        num_warps=4,
        num_stages=2,
    )
