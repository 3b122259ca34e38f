"""GGUF quantized blocks as `Int8Weight`s, value for value: the layout batchgen's int8 kernels read.

Every common GGML type stores, per block of 16-32 weights of a row, small integers q with a float
scale and, in some types, a minimum: Q8_0/Q4_0/Q5_0 `d * q`, Q4_1/Q5_1 `d * q + m`, Q4_K/Q5_K
`(d * sc_j) * q - dmin * m_j` per sub-block j of 32, Q6_K `(d * sc_j) * q` per sub-block of 16
(ggml's `ggml-common.h`). Each q fits in int8, each sub-block's factor `d * sc_j` and minimum are
exact in float32, and so is every product with q, so the int8 kernels' multiply-add
(`csrc/int8_w8a16.c`: scale times value plus offset, one rounding) gives each weight exactly as
gguf-py dequantizes it (checked bit for bit in tests/model/test_gguf_int8.py, and at load against
the converted float weights). The file's 4- and 5-bit values take a byte each here: a Q4_1 linear
reads 1.25 bytes a weight instead of 0.625, still a third of float32's 4 (no 4-bit kernel is built).

The bit layouts are gguf-py's (`gguf.quants`' block decoders): the blocks are dequantized once with
their scales set to 1 and their minimums to 0, which leaves q times the sub-block's integer scale.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from batchgen.kernels.cpu.int8_weight import Int8Weight

# GGML type -> (byte offset of the block's float16 scale d, of its float16 minimum or None, inputs a
# scale covers). K-quants: d and dmin scale each sub-block's integer scale and minimum.
_FIELDS = {
    "Q8_0": (0, None, 32),
    "Q4_0": (0, None, 32),
    "Q5_0": (0, None, 32),
    "Q4_1": (0, 2, 32),
    "Q5_1": (0, 2, 32),
    "Q4_K": (0, 2, 32),
    "Q5_K": (0, 2, 32),
    "Q6_K": (208, None, 16),
}
GGUF_INT8_TYPES = frozenset(_FIELDS)
_ONE_F16 = np.array([1.0], dtype=np.float16).view(np.uint8)
_ZERO_F16 = np.array([0.0], dtype=np.float16).view(np.uint8)


def gguf_int8(rows: np.ndarray, type_name: str, in_features: int) -> Int8Weight:
    """A GGUF tensor's blocks as an `Int8Weight` holding the same weights.

    Args:
        rows: uint8 `[N, bytes a row]`: each output channel's blocks as the file stores them.
        type_name: the GGML type, one of `GGUF_INT8_TYPES` (gguf-py's enum name, e.g. "Q4_1").
        in_features: K, a multiple of the type's block size.

    Returns:
        int8 values `[N, K]`, float32 scales (and offsets for types with a minimum) `[N, K / group]`,
        group 32 (Q6_K: 16), `source` the type name.

    Raises:
        ValueError: a type not in `GGUF_INT8_TYPES`, or rows whose size does not match K.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    if type_name not in _FIELDS:
        raise ValueError(f"no int8 layout for GGUF type {type_name}; it takes {', '.join(sorted(_FIELDS))}")
    qtype = GGMLQuantizationType[type_name]
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    n = rows.shape[0]
    if in_features % block or rows.shape[1] != in_features // block * block_bytes:
        raise ValueError(
            f"{type_name} rows of {in_features} weights take {in_features // block * block_bytes} bytes "
            f"in blocks of {block}; got {rows.shape[1]}"
        )
    blocks = np.ascontiguousarray(rows).reshape(-1, block_bytes)
    d_at, min_at, group = _FIELDS[type_name]
    d = blocks[:, d_at : d_at + 2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]
    dmin = (
        None if min_at is None else blocks[:, min_at : min_at + 2].copy().view(np.float16).astype(np.float32)
    )
    unit = blocks.copy()
    unit[:, d_at : d_at + 2] = _ONE_F16
    if min_at is not None:
        unit[:, min_at : min_at + 2] = _ZERO_F16
    # q times the sub-block's integer scale (1 outside the K-quants), exact in float32: the type's
    # block decoder on every block at once (gguf-py's `dequantize` takes 16 rows a call: slower)
    scaled_q = getattr(quants, type_name).dequantize_blocks(unit).reshape(-1, block // group, group)
    sub_scales, sub_mins = _sub_block_factors(blocks, type_name)
    safe = np.where(sub_scales == 0, 1.0, sub_scales).astype(np.float32)[..., None]
    qweight = np.where(sub_scales[..., None] == 0, 0.0, scaled_q / safe).astype(np.int8)
    scales = d * sub_scales  # float32: an 11-bit float16 times an integer of at most 8 bits: exact
    offsets = None if dmin is None else dmin * sub_mins
    groups = in_features // group

    def per_channel(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(n, groups))

    return Int8Weight(
        torch.from_numpy(qweight.reshape(n, in_features)),
        per_channel(scales),
        group,
        None if offsets is None else per_channel(offsets),
        source=type_name,
    )


def _sub_block_factors(blocks: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray]:
    """float32 `[blocks, sub-blocks]` factors of each sub-block's scale and offset: the block's
    float16 d times the first, its float16 minimum times the second. K-quants: the sub-blocks'
    integer scales and minus their integer minimums (their weights are `d sc q - dmin m`); Q4_1 and
    Q5_1 (`d q + m`): one and one."""
    from gguf.quants import Q4_K

    if type_name in ("Q4_K", "Q5_K"):
        sc, m = Q4_K.get_scale_min(blocks[:, 4 : 4 + Q4_K.K_SCALE_SIZE])
        return sc.reshape(len(blocks), -1).astype(np.float32), -m.reshape(len(blocks), -1).astype(np.float32)
    if type_name == "Q6_K":
        sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
        return sc, np.zeros_like(sc)
    return np.ones((len(blocks), 1), np.float32), np.ones((len(blocks), 1), np.float32)


def int8_layout(type_names: Iterable[str]) -> tuple[int, bool]:
    """(scale group, whether it has offsets) of the `Int8Weight` that parts stored in these GGML types
    join into (`join_parts`): the smallest group among them, offsets where one type has a minimum."""
    fields = [_FIELDS[name] for name in type_names]
    return min(group for _, _, group in fields), any(min_at is not None for _, min_at, _ in fields)


def with_group(weight: Int8Weight, group: int) -> Int8Weight:
    """`weight` with scale groups of `group` inputs (a divisor of its own, a multiple of 4): each
    scale and offset repeated, the same weights.

    Raises:
        ValueError: a `group` that does not divide the weight's own or is not a multiple of 4.
    """
    if group == weight.group_size:
        return weight
    if weight.group_size % group or group % 4:
        raise ValueError(f"groups of {weight.group_size} cannot be split into groups of {group}")
    repeat = weight.group_size // group
    offsets = None if weight.offsets is None else weight.offsets.repeat_interleave(repeat, dim=1)
    return Int8Weight(
        weight.qweight, weight.scales.repeat_interleave(repeat, dim=1), group, offsets, source=weight.source
    )


def join_parts(parts: list[Int8Weight]) -> Int8Weight:
    """The parts of a fused linear (q/k/v, gate/up; the same K) stacked by output channel, in the
    smallest group among them, with offsets (zeros for a symmetric part) where one has them."""
    group = min(p.group_size for p in parts)
    parts = [with_group(p, group) for p in parts]
    has_offsets = any(p.offsets is not None for p in parts)
    offsets = (
        torch.cat([torch.zeros_like(p.scales) if p.offsets is None else p.offsets for p in parts])
        if has_offsets
        else None
    )
    sources = "/".join(sorted({p.source for p in parts}))
    return Int8Weight(
        torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), group, offsets, sources
    )
