"""MXFP4 weights (gpt-oss checkpoints' expert projections) dequantized to floats at load.

MXFP4 is the OCP Microscaling format (OCP "Microscaling Formats (MX) v1.0", 2023): blocks of 32
values share one E8M0 scale byte (`2 ** (byte - 127)`), and each value is a 4-bit E2M1 float (a
sign bit, then one of 0, 0.5, 1, 1.5, 2, 3, 4, 6), two to a byte, the low nibble first. gpt-oss
checkpoints store an expert projection `W` (transformers' `[E, in, out]`) as two tensors:
`{name}_blocks` uint8 `[E, out, in / 32, 16]` and `{name}_scales` uint8 `[E, out, in / 32]`; the
dequantized `[E, out, in]` is transposed back to `[E, in, out]`.

batchgen has no MXFP4 kernel yet, so the weights are dequantized once at load and run as floats
in the model's dtype (docs/models.md): 4.25 bits a weight on disk, 16 or 32 in memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

# The 16 E2M1 codes' values: bit 3 is the sign, bits 0-2 index the magnitudes.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = torch.tensor(_E2M1 + tuple(-v for v in _E2M1), dtype=torch.float32)
BLOCK = 32  # values per scale
_SUFFIXES = ("_blocks", "_scales")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 `blocks` uint8 `[..., G, 16]` and E8M0 `scales` uint8 `[..., G]` -> float32 `[..., G * 32]`
    (value `2 * i` of a block from byte i's low nibble, `2 * i + 1` from its high one, each times
    `2 ** (scale - 127)`).

    Raises:
        ValueError: not uint8, or shapes that do not pair one scale with each block of 16 bytes.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8; got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair: blocks must be "
            f"[..., G, {BLOCK // 2}] and scales [..., G]"
        )
    low = E2M1_VALUES[(blocks & 0x0F).long()]
    high = E2M1_VALUES[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2)


def dequantize_checkpoint(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors with each `{name}_blocks` / `{name}_scales` pair replaced by `{name}`,
    dequantized (`dequantize`) and transposed to transformers' `[E, in, out]`; other tensors pass
    through unchanged, in order.

    Raises:
        ValueError: a `_blocks` tensor without its `_scales` (or the reverse) by the end.
    """
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        base = name[: -len(suffix)]
        parts = pending.setdefault(base, {})
        parts[suffix] = tensor
        if len(parts) == 2:
            del pending[base]
            yield base, dequantize(parts["_blocks"], parts["_scales"]).transpose(-2, -1).contiguous()
    if pending:
        raise ValueError(
            "MXFP4 checkpoint tensors lack their other half: "
            + ", ".join(f"{base}{next(iter(parts))}" for base, parts in pending.items())
        )
