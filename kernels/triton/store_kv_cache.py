"""The paged KV cache: its layout checks (shared by the attention kernels) and the KV write kernel.

The cache of one layer is a K tensor and a V tensor, each `[num_blocks, block_size, num_kv_heads,
head_dim]`; token slot `s` lives at block `s // block_size`, row `s % block_size` (PagedAttention,
Kwon et al. 2023, https://arxiv.org/abs/2309.06180). A slot of -1 marks a padding token whose K/V are
not stored.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_tensor(name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """Raise TypeError unless `t` is a tensor of one of `dtypes`, ValueError unless it has `ndim` dims."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}; got {str(t.dtype).removeprefix('torch.')}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions; got shape {tuple(t.shape)}")
    return t


def check_inner_contiguous(name: str, t: torch.Tensor) -> None:
    """Raise ValueError unless the last dim has stride 1 (rows are loaded as contiguous vectors)."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must have stride 1 in its last dimension; got strides {t.stride()} (call .contiguous())"
        )


def check_device(tensors: dict[str, torch.Tensor]) -> torch.device:
    """Raise ValueError unless all tensors share one device that Triton can run on."""
    devices = {name: t.device for name, t in tensors.items()}
    first_name, device = next(iter(devices.items()))
    for name, dev in devices.items():
        if dev != device:
            raise ValueError(
                f"{name} is on {dev} but {first_name} is on {device}; put all inputs on one device"
            )
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"the Triton kernels need CUDA tensors (got {device}); set TRITON_INTERPRET=1 before importing "
            "kernels to run them in Triton's CPU interpreter"
        )
    return device


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Check a K/V cache pair `[num_blocks, block_size, num_kv_heads, head_dim]`; return its shape.

    Both caches must have the same shape, dtype and strides (one set of strides is passed to the
    kernels), stride 1 in head_dim, and a head_dim of at most 256.
    """
    check_tensor("k_cache", k_cache, 4, FLOAT_DTYPES)
    check_tensor("v_cache", v_cache, 4, FLOAT_DTYPES)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) differ in dtype")
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache strides {k_cache.stride()} and v_cache strides {v_cache.stride()} differ")
    check_inner_contiguous("k_cache", k_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if min(num_blocks, block_size, num_kv_heads, head_dim) < 1:
        raise ValueError(f"k_cache has an empty dimension: shape {tuple(k_cache.shape)}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM}; got {head_dim}")
    return num_blocks, block_size, num_kv_heads, head_dim


def padded_dim(n: int) -> int:
    """The power of two >= max(n, 16) that a tile dimension of n is padded to (tl.dot needs >= 16)."""
    return max(16, triton.next_power_of_2(n))


_stage_fallback: dict[tuple, int] = {}


def launch(
    kernel, grid: tuple[int, ...], args: tuple, constexprs: dict, num_warps: int, num_stages: int
) -> None:
    """Launch `kernel`; if the GPU lacks shared memory for `num_stages`, retry with fewer stages.

    Pipelining depth is a speed choice, never a correctness one, so a tile configuration that does not
    fit a smaller GPU still runs. The stage count that worked is remembered per configuration.
    """
    key = (id(kernel), tuple(sorted(constexprs.items())), num_warps)
    num_stages = _stage_fallback.get(key, num_stages)
    while True:
        try:
            kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
            return
        except OutOfResources:
            if num_stages <= 1:
                raise
            num_stages -= 1
            _stage_fallback[key] = num_stages


@triton.jit
def _store_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # One program per token: all of its heads' K and V rows.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    # (A tensor-vs-scalar `&` yields a non-boolean mask in Triton's interpreter: compare as a tensor.)
    stored = (tl.zeros([HEADS_PAD, HEAD_DIM_PAD], tl.int64) + slot) >= 0
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM) & stored
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    # A padding slot (-1) must not become a negative address even though its stores are masked off.
    slot = tl.maximum(slot, 0)
    dst = (
        (slot // BLOCK_SIZE) * stride_cb
        + (slot % BLOCK_SIZE) * stride_cs
        + heads[:, None] * stride_ch
        + dims[None, :]
    )
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V rows into the paged cache at its slot; slots of -1 are skipped.

    Args:
        key, value: `[num_tokens, num_kv_heads, head_dim]`, float16 / bfloat16 / float32, same dtype as
            the caches; any token and head strides (views into a fused QKV output are fine), head_dim
            stride 1.
        k_cache, v_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, written in place.
        slot_mapping: int64 `[num_tokens]`, slot `block_id * block_size + offset` of each token, or -1
            for a padding token. Slots must be distinct and below `num_blocks * block_size` (not
            checked: that would need a device sync).

    Raises:
        TypeError: a non-tensor argument or a wrong dtype.
        ValueError: mismatched shapes, devices or strides.

    Source: the paged KV layout of PagedAttention (Kwon et al. 2023, https://arxiv.org/abs/2309.06180).
    """
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    check_tensor("key", key, 3, FLOAT_DTYPES)
    check_tensor("value", value, 3, FLOAT_DTYPES)
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,))
    expected = (key.shape[0], num_kv_heads, head_dim)
    for name, t in (("key", key), ("value", value)):
        if tuple(t.shape) != expected:
            raise ValueError(
                f"{name} must be [num_tokens, num_kv_heads, head_dim] = {expected}; got {tuple(t.shape)}"
            )
        if t.dtype != k_cache.dtype:
            raise TypeError(f"{name} dtype {t.dtype} differs from the cache dtype {k_cache.dtype}")
        check_inner_contiguous(name, t)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    if slot_mapping.numel() > 1 and slot_mapping.stride(0) != 1:
        raise ValueError("slot_mapping must be contiguous")
    check_device(
        {"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slot_mapping}
    )
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    launch(
        _store_kv_cache_kernel,
        (num_tokens,),
        (
            key,
            value,
            k_cache,
            v_cache,
            slot_mapping,
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
        ),
        dict(
            NUM_KV_HEADS=num_kv_heads,
            HEADS_PAD=triton.next_power_of_2(num_kv_heads),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
            BLOCK_SIZE=block_size,
        ),
        num_warps=4,
        num_stages=1,
    )
