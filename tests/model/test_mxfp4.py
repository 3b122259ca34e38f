"""The MXFP4 dequantizer: a hand-built block, transformers' own conversion as a second opinion, and
the pairing of a checkpoint's `_blocks` / `_scales` tensors."""

from __future__ import annotations

import pytest
import torch

from batchgen.model.mxfp4 import dequantize, dequantize_checkpoint


def test_a_hand_built_block():
    # Bytes hold two E2M1 codes, the low nibble first: 0x21 is (0.5, 1.0), 0xF8 is (-0, -6),
    # 0x7A is (-1, 6), 0x53 is (1.5, 3), 0xCE is (-4, -2); the rest zero. Scale byte 128 = 2 ** 1.
    blocks = torch.tensor([[0x21, 0xF8, 0x7A, 0x53, 0xCE] + [0] * 11], dtype=torch.uint8)
    scales = torch.tensor([128], dtype=torch.uint8)
    expected = [1.0, 2.0, -0.0, -12.0, -2.0, 12.0, 3.0, 6.0, -8.0, -4.0] + [0.0] * 22
    got = dequantize(blocks, scales)
    assert got.dtype == torch.float32 and got.shape == (32,)
    assert got.tolist() == expected
    # Scale byte 124 = 2 ** -3; 255 (NaN in E8M0) is never written by gpt-oss's exporter.
    assert dequantize(blocks, torch.tensor([124], dtype=torch.uint8)).tolist()[:4] == [
        0.0625,
        0.125,
        -0.0,
        -0.75,
    ]


def test_matches_transformers_conversion():
    """Random experts `[E, out, in / 32, 16]` dequantized and transposed to `[E, in, out]` equal
    transformers' `convert_moe_packed_tensors` (the function its gpt-oss loader uses)."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 12, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 135, (3, 12, 4), dtype=torch.uint8, generator=gen)
    ((name, got),) = dequantize_checkpoint(
        [("experts.down_proj_blocks", blocks), ("experts.down_proj_scales", scales)]
    )
    assert name == "experts.down_proj" and got.shape == (3, 128, 12)
    expected = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(got, expected)


def test_other_tensors_pass_through_in_order():
    blocks = torch.zeros(1, 2, 1, 16, dtype=torch.uint8)
    scales = torch.full((1, 2, 1), 127, dtype=torch.uint8)
    bias = torch.ones(2)
    weights = [("a.bias", bias), ("a.w_scales", scales), ("b", bias), ("a.w_blocks", blocks), ("c", bias)]
    out = list(dequantize_checkpoint(weights))
    assert [name for name, _ in out] == ["a.bias", "b", "a.w", "c"]
    assert out[2][1].shape == (1, 32, 2) and not out[2][1].any()


def test_bad_inputs_are_refused():
    blocks = torch.zeros(2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize(blocks.float(), torch.zeros(2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="do not pair"):
        dequantize(blocks, torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="do not pair"):
        dequantize(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="lack their other half: x.w_blocks"):
        list(dequantize_checkpoint([("x.w_blocks", blocks)]))
