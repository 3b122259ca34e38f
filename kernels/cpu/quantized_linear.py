"""CPU linear layers on int8 weights, and the candidates the kernel registry times for a layer that
holds one.

The weight (`Int8Weight`, `int8_weight.py`, with `PackedInt8`, the strips its kernels read): int8
values with a scale per output channel and group of K, and optionally an offset alike,
`W[n, k] = scales[n, k // group_size] * q[n, k] (+ offsets[n, k // group_size])`: what
`--quantization int8` makes of a float checkpoint at load (symmetric), or a GGUF file's blocks
repacked value for value (`batchgen.model.loading.gguf_int8`). `dequantize()` gives the float32
weight its kernels compute with.

Candidates (`quantized_candidates`):
- "int8_c" (`Int8Linear`, `csrc/int8_w8a16.c`): batchgen's C kernel which widens the int8 weights
  in registers (W8A16: float32 or bf16 activations); "int8_c_dpbf16" (`Int8Bf16DotLinear`): the
  same kernel's VDPBF16PS tiles for bf16 activations on AVX512-BF16;
- "int8_w8a8" (`Int8W8A8Linear`, `csrc/int8_w8a8.c`): per-row int8 activations and integer dot
  products on the same packed weight (W8A8, symmetric weights), where the library has it and the caller asks for it
  (not by default: see `quantized_candidates`);
- "int8_torch" (`TorchInt8Linear`): torch's `aten._weight_int8pack_mm` on the same int8 tensors;
- the float candidates of `linear.linear_candidates` on the dequantized weight, so the registry can
  still pick a float kernel where it wins (at the price of a float copy of the weight).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from batchgen.kernels.cpu import library as cpu_kernels
from batchgen.kernels.cpu.int8_weight import Int8Weight, PackedInt8, aligned
from batchgen.kernels.cpu.linear import linear_candidates

# The weight layout each quantized implementation holds (as `linear.WEIGHT_LAYOUTS`): torch's int8
# kernel and batchgen's run on the very same int8 tensors.
QUANTIZED_LAYOUTS = {
    "int8_c": "int8",
    "int8_c_dpbf16": "int8",
    "int8_w8a8": "int8",
    "int8_torch": "int8",
}


QuantizedWeight = Int8Weight


class _QuantizedCLinear(nn.Module):
    """`y = x @ W^T + b` through a C kernel on an `Int8Weight` (`csrc/int8_w8a16.c`, `int8_w8a8.c`): input `[..., K]` float32 or
    bf16, output `[..., N]` in the input's dtype, the bias (float32 `[N]`) added to the float32 sums
    before the one rounding."""

    KERNEL = ""

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().float().contiguous()
        library = cpu_kernels.load_library()
        if library is None:
            raise RuntimeError(
                f"batchgen's {self.KERNEL} kernel needs the C library, which is not built here"
            )
        self._kernel = getattr(library, self.KERNEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` float32 or bf16 `[..., in_features]` -> `[..., out_features]` of its dtype.

        Raises:
            ValueError: another dtype, or a last dimension other than `in_features`.
        """
        if x.dim() == 2 and x.stride(1) == 1 and x.shape[1] == self.in_features and x.dtype in _C_DTYPES:
            return self._rows(x)
        if x.dtype not in _C_DTYPES or x.shape[-1] != self.in_features:
            raise ValueError(
                f"{type(self).__name__} takes float32 or bf16 [..., {self.in_features}] input; got "
                f"{x.dtype} {tuple(x.shape)}"
            )
        rows = x.reshape(-1, self.in_features)
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        return self._rows(rows).view(*x.shape[:-1], self.out_features)

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        m, bf16 = rows.shape[0], int(rows.dtype == torch.bfloat16)
        out = torch.empty((m, self.out_features), dtype=rows.dtype)
        bias = None if self.bias is None else self.bias.data_ptr()
        status = self._kernel(
            rows.data_ptr(), bf16, *self._mode_args(), rows.stride(0), *self._weight_args(), bias, out.data_ptr(), bf16,
            self.out_features, m, self.out_features, self.in_features, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:  # the weight was checked when it was built: a failure here is a bug or no memory
            raise RuntimeError(
                f"{self.KERNEL} failed ({status}) on [{m}, {self.in_features}] x {self.extra_repr()}"
            )
        return out

    def _weight_args(self) -> tuple[int | None, ...]:
        raise NotImplementedError

    def _mode_args(self) -> tuple[int, ...]:
        return ()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


_C_DTYPES = (torch.float32, torch.bfloat16)


class Int8Linear(_QuantizedCLinear):
    """ "int8_c": W8A16, batchgen's kernel on an `Int8Weight` packed in strips (`csrc/int8_w8a16.c`):
    the weights widened and scaled in registers, the activations float32 or bf16 as they come."""

    KERNEL = "int8_w8a16_linear"
    BF16_DOT = 0

    def _mode_args(self) -> tuple[int, ...]:
        return (self.BF16_DOT,)

    def _weight_args(self) -> tuple[int | None, ...]:
        packed = self.packed_weight
        offsets = None if packed.offsets is None else packed.offsets.data_ptr()
        return (packed.values.data_ptr(), packed.scales.data_ptr(), offsets, packed.group)

    @property
    def packed_weight(self) -> PackedInt8:
        """The weight in the C kernels' layout for this library's lanes (made once, shared by every
        kernel on this `Int8Weight`, the decoder stack's included)."""
        return self.weight.packed(int(cpu_kernels.require_library().int8_linear_lanes()))


class Int8Bf16DotLinear(Int8Linear):
    """ "int8_c_dpbf16": W8A16 for bf16 activations on CPUs with AVX512-BF16, the same kernel and
    packed weight as "int8_c" through VDPBF16PS tiles: each scaled weight rounded to bf16 in
    registers (the very bf16 weight the layer's float layouts hold), two products a lane an
    instruction, and the widening shared by 8 rows instead of 4. Takes bf16 input only."""

    BF16_DOT = 1


def bf16_dot_available() -> bool:
    """Whether the C library is built with the VDPBF16PS tiles of "int8_c_dpbf16"."""
    library = cpu_kernels.load_library()
    return library is not None and bool(library.int8_w8a16_bf16_dot_available())


class Int8W8A8Linear(Int8Linear):
    """ "int8_w8a8": W8A8, batchgen's kernel on the same packed weight (`csrc/int8_w8a8.c`): each
    row's activations quantized to int8 with one scale a row (max |x| / 127) once a call, then
    integer dot products (AVX512-VNNI, or AVX2). The rounding of the activations changes the sums by
    up to about 2^-8 of the output's magnitude: the registry's check against the float product
    admits it where the dtype's own tolerance does (bf16), not in float32."""

    KERNEL = "int8_w8a8_linear"

    def _mode_args(self) -> tuple[int, ...]:
        return ()

    def _weight_args(self) -> tuple[int | None, ...]:
        packed = self.packed_weight
        return (packed.values.data_ptr(), packed.scales.data_ptr(), packed.comp.data_ptr(), packed.group)


def w8a8_available() -> bool:
    """Whether the C library is built with the W8A8 kernel (AVX512-VNNI, or AVX2 under an AVX2 cap)."""
    library = cpu_kernels.load_library()
    return library is not None and bool(library.int8_w8a8_available())


class TorchInt8Linear(nn.Module):
    """ "int8_torch": torch's `aten._weight_int8pack_mm(x, qweight, scales)` on an `Int8Weight` (its
    int8 tensor shared, the scales cast to the input's dtype once), plus the bias. Input
    `[..., K]` float32 or bf16, output `[..., N]` of its dtype."""

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach()
        self._scales: dict[torch.dtype, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scales = self._scales.get(x.dtype)
        if scales is None:
            scales = self._scales[x.dtype] = aligned(self.weight.scales.reshape(-1).to(x.dtype))
        rows = aligned(x.reshape(-1, self.in_features))
        out = torch.ops.aten._weight_int8pack_mm(rows, self.weight.qweight, scales)
        if self.bias is not None:
            out += self.bias.to(out.dtype)
        return out.view(*x.shape[:-1], self.out_features)


def torch_int8_available() -> bool:
    """Whether this torch has `aten._weight_int8pack_mm` (2.4 and later)."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def torch_int8_applies(weight: Int8Weight, dtype: torch.dtype) -> bool:
    """Whether "int8_torch" takes `weight` with `dtype` activations: torch has the kernel, the
    activations are float32 or bf16, K is a multiple of 16 (see `TorchInt8Linear`) and the weight
    has one scale a channel and no offsets (torch's kernel takes neither groups nor offsets)."""
    one_scale = weight.scales.shape[1] == 1 and weight.offsets is None
    return torch_int8_available() and dtype in _C_DTYPES and weight.shape[1] % 16 == 0 and one_scale


def quantized_candidates(
    weight: QuantizedWeight, dequantized: torch.Tensor, bias: torch.Tensor | None, w8a8: bool = False
) -> dict[str, Callable[[], nn.Module]]:
    """Builders of every implementation that runs `weight` on the CPU: "int8_c" (and for bf16
    activations "int8_c_dpbf16"; the C kernels where the library is built and the activations are
    float32 or bf16) and "int8_torch" (where `torch_int8_applies`), then the float candidates of `linear_candidates` on
    `dequantized` (the weight dequantized to the activations' dtype, `[N, K]`).

    "int8_w8a8" joins them only with `w8a8` (and where the library has it): int8 activations with
    one scale a row cost the default model 9 points of teacher-forced top-1 agreement (89.2%
    against 98.6% for W8A16, docs/benchmarks.md), which the registry's check on random inputs
    cannot see, so no model runs it unasked."""
    builders: dict[str, Callable[[], nn.Module]] = {}
    c_kernels = dequantized.dtype in _C_DTYPES and cpu_kernels.load_library() is not None
    if c_kernels:
        builders["int8_c"] = lambda: Int8Linear(weight, bias)
        if dequantized.dtype == torch.bfloat16 and bf16_dot_available():
            builders["int8_c_dpbf16"] = lambda: Int8Bf16DotLinear(weight, bias)
        if w8a8 and w8a8_available() and weight.offsets is None:  # its kernel takes no offsets
            builders["int8_w8a8"] = lambda: Int8W8A8Linear(weight, bias)
    if torch_int8_applies(weight, dequantized.dtype):
        builders["int8_torch"] = lambda: TorchInt8Linear(weight, bias)
    builders.update(linear_candidates(dequantized, bias))
    return builders
