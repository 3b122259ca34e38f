"""Python entry points of the C element-wise kernels (`csrc/bf16_ops.c`, `csrc/kv_store.c`, `csrc/token_mask.c`,
`csrc/greedy_rows.c`).

One-call versions of a decoder layer's bf16 element-wise chains: RMSNorm with the residual add before
it, SiLU-and-multiply and the rotary embedding; and the write of a step's K/V rows into the paged
cache; structured outputs' token masks on a step's logits; and greedy sampling's argmax. On a decode step each replaces one or
several calls whose dispatch or generality costs more than their arithmetic. Each function checks shapes, dtypes and strides before it hands pointers to C; the
library is built and loaded by `batchgen.kernels.cpu.library`.
"""

from __future__ import annotations

import ctypes

import torch

from batchgen.kernels.cpu import library as cpu_kernels


def bf16_ops_apply(x: torch.Tensor) -> bool:
    """Whether the C element-wise ops take `x`: a bf16 CPU tensor, with the library built."""
    return x.dtype == torch.bfloat16 and x.is_cpu and cpu_kernels.load_library() is not None


def _check_rows(name: str, t: torch.Tensor, cols: int) -> None:
    if t.dim() != 2 or t.shape[1] < cols or t.stride(1) != 1 or t.dtype != torch.bfloat16:
        raise ValueError(
            f"{name} must be a 2-D bf16 tensor of at least {cols} contiguous columns; got {t.shape}"
        )


def add_rms_norm_bf16(
    hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`hidden += delta` in place (when given), then RMSNorm of `hidden` times `weight`.

    Args:
        hidden: bf16 `[T, H]` with contiguous rows; updated in place when `delta` is given.
        delta: bf16 `[T, H]` with contiguous rows, or None.
        weight: bf16 `[H]`.
        eps: added to the mean square.

    Returns:
        bf16 `[T, H]`, rounded where Hugging Face's LlamaRMSNorm rounds (see `csrc/bf16_ops.c`).

    Raises:
        ValueError: a shape, dtype or layout the kernel does not take.
    """
    rows, cols = hidden.shape
    _check_rows("hidden", hidden, cols)
    if delta is not None:
        _check_rows("delta", delta, cols)
        if delta.shape[0] != rows:
            raise ValueError(f"delta has {delta.shape[0]} rows, hidden {rows}")
    if weight.shape != (cols,) or not weight.is_contiguous() or weight.dtype != torch.bfloat16:
        raise ValueError(f"weight must be a contiguous bf16 [{cols}] tensor")
    out = torch.empty((rows, cols), dtype=torch.bfloat16)
    cpu_kernels.require_library().add_rms_norm_bf16(
        hidden.data_ptr(),
        hidden.stride(0),
        None if delta is None else delta.data_ptr(),
        0 if delta is None else delta.stride(0),
        weight.data_ptr(),
        eps,
        rows,
        cols,
        out.data_ptr(),
        cols,
        torch.get_num_threads(),
    )
    return out


def silu_mul_bf16(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's `silu(gate) * up` for bf16 `[T, 2 * I]` rows (gate then up): bf16 `[T, I]`.

    Raises:
        ValueError: a shape, dtype or layout the kernel does not take.
    """
    rows, width = gate_up.shape
    _check_rows("gate_up", gate_up, width)
    if width % 2:
        raise ValueError(f"gate_up must have an even width; got {width}")
    out = torch.empty((rows, width // 2), dtype=torch.bfloat16)
    cpu_kernels.require_library().silu_mul_bf16(
        gate_up.data_ptr(),
        gate_up.stride(0),
        rows,
        width // 2,
        out.data_ptr(),
        width // 2,
        torch.get_num_threads(),
    )
    return out


def rotary_bf16(
    qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries and keys by the step's cos/sin; split them into contiguous tensors.

    Args:
        qk: bf16 `[T, Hq + Hkv, D]`, each row's heads contiguous (rows may be strided, as a slice of a
            fused QKV output).
        cos / sin: bf16 `[T, 1, D]` or `[T, D]` with contiguous rows.
        num_q_heads: Hq; the remaining heads are keys.

    Returns:
        queries `[T, Hq, D]` and keys `[T, Hkv, D]`, contiguous bf16.

    Raises:
        ValueError: a shape, dtype or layout the kernel does not take.
    """
    rows, heads, head_dim = qk.shape
    if qk.dtype != torch.bfloat16 or qk.stride(2) != 1 or qk.stride(1) != head_dim or head_dim % 2:
        raise ValueError(f"qk must be bf16 [T, heads, D] with contiguous heads and an even D; got {qk.shape}")
    if cos.numel() != rows * head_dim or sin.numel() != rows * head_dim:
        raise ValueError(
            f"cos and sin must hold [{rows}, {head_dim}] values; got {cos.shape} and {sin.shape}"
        )
    cos, sin = cos.reshape(rows, head_dim), sin.reshape(rows, head_dim)
    if cos.stride(1) != 1 or sin.stride() != cos.stride() or {cos.dtype, sin.dtype} != {torch.bfloat16}:
        raise ValueError("cos and sin must be bf16 [T, D] with contiguous rows of the same layout")
    q = torch.empty((rows, num_q_heads, head_dim), dtype=torch.bfloat16)
    k = torch.empty((rows, heads - num_q_heads, head_dim), dtype=torch.bfloat16)
    cpu_kernels.require_library().rotary_bf16(
        qk.data_ptr(),
        qk.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        cos.stride(0),
        rows,
        num_q_heads,
        heads - num_q_heads,
        head_dim,
        q.data_ptr(),
        k.data_ptr(),
        torch.get_num_threads(),
    )
    return q, k


def _rows_layout(name: str, t: torch.Tensor, row_shape: tuple[int, ...]) -> None:
    """Check `t` is `[T, *row_shape]` with each row's elements contiguous (rows may be strided)."""
    if t.dim() != 1 + len(row_shape) or tuple(t.shape[1:]) != row_shape:
        raise ValueError(f"{name} must be [T, {', '.join(map(str, row_shape))}]; got {tuple(t.shape)}")
    expected = 1
    for dim in range(t.dim() - 1, 0, -1):
        if t.shape[dim] > 1 and t.stride(dim) != expected:
            raise ValueError(f"{name} must have contiguous rows (a row's heads and dims in order)")
        expected *= t.shape[dim]


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    check_layout: bool = True,
) -> None:
    """Write `key`/`value` rows into the paged caches at `slot_mapping`; slot -1 is skipped.

    Args:
        key / value: `[T, Hkv, D]` in the caches' dtype; each row contiguous, rows may be strided (a
            slice of a fused QKV output).
        k_cache / v_cache: contiguous `[num_blocks, block_size, Hkv, D]`.
        slot_mapping: int64 `[T]`, `block_id * block_size + offset` per row, or -1.
        check_layout: check the dtypes, shapes and strides (a cost on every call). A caller that has checked
            the same layout already in this step (the other layers) passes False; the slots are
            always checked, in C.

    Raises:
        ValueError: a dtype, shape or layout the kernel does not take, or a slot outside the cache
            (then nothing is written).
    """
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if check_layout:
        _check_store_layout(key, value, k_cache, v_cache, slot_mapping)
    size = k_cache.element_size()
    bad = cpu_kernels.require_library().store_kv_rows(
        key.data_ptr(),
        key.stride(0) * size,
        value.data_ptr(),
        value.stride(0) * size,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        key.shape[0],
        num_kv_heads * head_dim * size,
        num_blocks * block_size,
        torch.get_num_threads(),
    )
    if bad >= 0:
        raise ValueError(
            f"slot_mapping[{bad}] = {int(slot_mapping[bad])} is outside the cache's "
            f"{num_blocks * block_size} slots"
        )


def _check_store_layout(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    row_shape = tuple(k_cache.shape[2:])
    for name, t in (("key", key), ("value", value)):
        _rows_layout(name, t, row_shape)
        if t.dtype != k_cache.dtype or t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU {k_cache.dtype} tensor; got {t.dtype} on {t.device}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError("k_cache and v_cache must have the same shape and dtype")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    num_tokens = key.shape[0]
    if value.shape[0] != num_tokens or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"key, value and slot_mapping must have the same number of rows; got "
            f"{num_tokens}, {value.shape[0]} and {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be a contiguous int64 tensor")


_MASK_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> bool:
    """Set the logits of the tokens each row's bitmask disallows to -inf, in place
    (`csrc/token_mask.c`); False (nothing done) where the C library is not built or the tensors are
    not ones it takes, so the caller falls back to xgrammar's apply.

    Args:
        logits: `[B, vocab]` float32, bfloat16 or float16 on the CPU, rows contiguous.
        bitmask: int32 `[>= B, >= ceil(vocab / 32)]` on the CPU, rows contiguous: bit `t % 32` of
            word `t // 32` set when token `t` may be sampled (xgrammar's layout).
        rows: the rows of both to mask, each in `[0, B)`.

    Raises:
        ValueError: a row outside `[0, B)`, or a bitmask narrower than the vocabulary.
    """
    dtype = _MASK_DTYPES.get(logits.dtype)
    if (
        dtype is None
        or not (logits.is_cpu and bitmask.is_cpu)
        or bitmask.dtype != torch.int32
        or logits.dim() != 2
        or logits.stride(1) != 1
        or bitmask.stride(1) != 1
    ):
        return False
    lib = cpu_kernels.load_library()
    if lib is None:
        return False
    vocab = logits.shape[1]
    if bitmask.shape[1] * 32 < vocab or bitmask.shape[0] < logits.shape[0]:
        raise ValueError(
            f"a bitmask of shape {tuple(bitmask.shape)} does not cover logits {tuple(logits.shape)}"
        )
    if any(not 0 <= r < logits.shape[0] for r in rows):
        raise ValueError(f"mask rows must be in [0, {logits.shape[0]}), got {rows}")
    index = torch.tensor(rows, dtype=torch.int64)
    lib.apply_token_bitmask(
        logits.data_ptr(),
        logits.stride(0),
        dtype,
        bitmask.data_ptr(),
        bitmask.stride(0),
        index.data_ptr(),
        len(rows),
        vocab,
    )
    return True


def greedy_rows(logits: torch.Tensor) -> torch.Tensor | None:
    """Each row's argmax (the first maximum) and whether it is free of NaN and infinities, in one
    pass (`csrc/greedy_rows.c`): int64 `[2, B]`, the ids then the flags (1 finite, 0 not). None
    where the C library is not built or `logits` is not a CPU float32 or bfloat16 `[B, vocab]`
    tensor with contiguous rows (the caller takes torch's `max` and a row sum instead).

    Ties between -0.0 and +0.0 go to +0.0 (the kernel orders them); a non-finite row's id is
    meaningless.
    """
    dtype = {torch.float32: 0, torch.bfloat16: 1}.get(logits.dtype)
    if (
        dtype is None
        or not logits.is_cpu
        or logits.dim() != 2
        or logits.stride(1) != 1
        or not logits.shape[1]
    ):
        return None
    lib = cpu_kernels.load_library()
    if lib is None:
        return None
    kernel = lib.greedy_rows
    if kernel.argtypes is None:  # once per loaded library (ctypes would pass every argument as an int)
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        kernel.restype, kernel.argtypes = None, [ptr, i64, i64, i64, i32, ptr, i32]
    out = torch.empty(2, logits.shape[0], dtype=torch.int64)
    kernel(
        logits.data_ptr(),
        logits.shape[0],
        logits.shape[1],
        logits.stride(0),
        dtype,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out
