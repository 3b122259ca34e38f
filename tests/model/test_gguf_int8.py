"""GGUF blocks as int8 weights (`batchgen/model/loading/gguf_int8.py`): every type it takes gives,
weight for weight, what gguf-py's own dequantization gives, bit for bit; fused parts and group
changes keep the values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchgen.kernels.cpu.int8_weight import Int8Weight
from batchgen.model.loading.gguf_int8 import GGUF_INT8_TYPES, gguf_int8, int8_layout, join_parts, with_group

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize  # noqa: E402

# Byte offsets of each type's float16 scale and minimum (ggml-common.h), set to finite values below
# so random bytes make valid blocks.
_F16_FIELDS = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q5_0": (0,),
    "Q4_1": (0, 2),
    "Q5_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def _random_rows(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 `[n, bytes a row]`: random blocks of `type_name` with finite float16 fields."""
    qtype = gguf.GGMLQuantizationType[type_name]
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 256, (n, k // block * block_bytes), dtype=np.uint8)
    blocks = rows.reshape(-1, block_bytes)
    for at in _F16_FIELDS[type_name]:
        blocks[:, at : at + 2] = rng.uniform(-0.05, 0.05, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return rows


def _gguf_weights(rows: np.ndarray, type_name: str, k: int) -> torch.Tensor:
    qtype = gguf.GGMLQuantizationType[type_name]
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    return torch.from_numpy(
        dequantize(rows.reshape(-1, block_bytes), qtype).reshape(rows.shape[0], k).astype(np.float32)
    )


def test_the_types_are_ggmls_common_ones():
    assert set(_F16_FIELDS) == GGUF_INT8_TYPES


@pytest.mark.parametrize("type_name", sorted(GGUF_INT8_TYPES))
def test_each_type_holds_gguf_pys_weights_bit_for_bit(type_name):
    n, k = 12, 512
    rows = _random_rows(type_name, n, k)
    weight = gguf_int8(rows, type_name, k)
    group, offsets = int8_layout([type_name])
    assert weight.group_size == group and (weight.offsets is not None) == offsets
    assert weight.source == type_name and weight.qweight.dtype == torch.int8
    assert torch.equal(weight.dequantize(), _gguf_weights(rows, type_name, k))


def test_a_zero_sub_block_scale_leaves_the_minimum():
    """A K-quant sub-block whose integer scale is 0 holds its minimum alone, whatever its values."""
    rows = _random_rows("Q4_K", 2, 256, seed=3)
    rows[:, 4:16] = 0  # every sub-block's 6-bit scale and minimum 0
    rows[0, 4] = 5  # sub-block 0 of row 0: scale 5
    weight = gguf_int8(rows, "Q4_K", 256)
    assert torch.equal(weight.dequantize(), _gguf_weights(rows, "Q4_K", 256))
    assert int(weight.qweight[1].abs().sum()) == 0


def test_fused_parts_join_in_the_smallest_group_with_the_same_weights():
    """q/k/v stored as Q4_K, Q4_K, Q6_K (a Q4_K_M file's mix): one weight in groups of 16 with
    offsets (zeros for the symmetric part), its rows each part's weights."""
    parts = [("Q4_K", 8), ("Q4_K", 4), ("Q6_K", 4)]
    k = 256
    rows = [_random_rows(t, n, k, seed=i) for i, (t, n) in enumerate(parts)]
    joined = join_parts([gguf_int8(r, t, k) for r, (t, _) in zip(rows, parts, strict=True)])
    assert joined.group_size == 16 and joined.offsets is not None and joined.source == "Q4_K/Q6_K"
    expected = torch.cat([_gguf_weights(r, t, k) for r, (t, _) in zip(rows, parts, strict=True)])
    assert torch.equal(joined.dequantize(), expected)
    assert int8_layout([t for t, _ in parts]) == (16, True)


def test_a_group_splits_but_does_not_merge():
    weight = gguf_int8(_random_rows("Q8_0", 3, 64), "Q8_0", 64)
    assert torch.equal(with_group(weight, 8).dequantize(), weight.dequantize())
    assert with_group(weight, 32) is weight
    with pytest.raises(ValueError, match="cannot be split"):
        with_group(weight, 64)


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="no int8 layout for GGUF type IQ4_XS; it takes Q4_0"):
        gguf_int8(np.zeros((1, 18), np.uint8), "IQ4_XS", 32)
    with pytest.raises(ValueError, match="Q4_0 rows of 64 weights take 36 bytes"):
        gguf_int8(np.zeros((1, 18), np.uint8), "Q4_0", 64)
    with pytest.raises(ValueError, match="offsets of a"):
        Int8Weight(torch.zeros(2, 8, dtype=torch.int8), torch.ones(2, 2), 4, torch.zeros(2, 3))
