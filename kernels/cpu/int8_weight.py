"""The int8 weight of `--quantization int8` (`Int8Weight`) and the packed layout its C kernels read
(`PackedInt8`, csrc/int8_packed.h); the kernels themselves are wrapped in `quantized_linear`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Inputs sharing one int8 scale (`Int8Weight.quantize`): one scale per output channel lost too
# much of the default model's accuracy (docs/benchmarks.md).
INT8_GROUP_SIZE = 16


def int8_group_size(in_features: int, group_size: int = INT8_GROUP_SIZE) -> int:
    """The inputs sharing a scale in a weight of `in_features` inputs: `group_size`, or K rounded up
    to a multiple of 4 where that is smaller (one scale per channel; the kernels take K in quads)."""
    return min(group_size, -(-in_features // 4) * 4)


def int8_weight_bytes(
    out_features: int, in_features: int, group_size: int = INT8_GROUP_SIZE, offsets: bool = False
) -> int:
    """Bytes of an `Int8Weight` `[N, K]` in groups of `group_size` (`Int8Weight.nbytes`, computed
    from the shape alone): N * K int8 values and N * ceil(K / group) float32 scales, and as many
    float32 offsets with `offsets`."""
    groups = -(-in_features // int8_group_size(in_features, group_size))
    return out_features * in_features + 4 * out_features * groups * (2 if offsets else 1)


# torch's CPU allocations start at 64-byte boundaries; so must every tensor its int8 kernel reads.
_ALIGNMENT = 64


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` contiguous and starting at a 64-byte boundary (a copy where it does not)."""
    tensor = tensor.contiguous()
    return tensor if tensor.data_ptr() % _ALIGNMENT == 0 else tensor.clone()


@dataclass
class Int8Weight:
    """int8 values with a float32 scale per output channel and group of `group_size` inputs, and
    optionally a float32 offset alike: `qweight` int8 `[N, K]`, `scales` and `offsets` float32
    `[N, ceil(K / group_size)]`, the weight at (n, k) being
    `scales[n, k // group_size] * qweight[n, k] + offsets[n, k // group_size]`. Without offsets it is
    symmetric (what `quantize` makes: values in [-127, 127]); a GGUF file's Q4_1 or K-quant blocks
    carry a minimum, which the offsets hold exactly (`gguf_int8`). A `group_size` of K or more is one
    scale per channel.

    Raises:
        ValueError: a `group_size` that is not a positive multiple of 4 (the kernels take K in
            quads), or `scales` or `offsets` of another shape.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    group_size: int
    offsets: torch.Tensor | None = None
    # Where the values came from, for the start line and the bench report: "int8" (quantized by
    # batchgen) or the GGUF type repacked (e.g. "Q4_1").
    source: str = "int8"

    format = "int8"

    def __post_init__(self) -> None:
        if self.group_size < 4 or self.group_size % 4:
            raise ValueError(f"int8 group_size must be a positive multiple of 4; got {self.group_size}")
        n, k = self.qweight.shape
        groups = -(-k // self.group_size)
        for name, value in (("scales", self.scales), ("offsets", self.offsets)):
            if value is not None and tuple(value.shape) != (n, groups):
                raise ValueError(
                    f"int8 {name} of a [{n}, {k}] weight in groups of {self.group_size} must be "
                    f"[{n}, {groups}]; got {list(value.shape)}"
                )
        # Tensors read from a file (safetensors puts them after its header) may start anywhere; torch's
        # int8 kernel reads them with aligned loads and crashes the process otherwise.
        self.qweight, self.scales = aligned(self.qweight), aligned(self.scales)
        if self.offsets is not None:
            self.offsets = aligned(self.offsets)
        self._packed: dict[int, PackedInt8] = {}

    @classmethod
    def quantize(cls, weight: torch.Tensor, group_size: int = INT8_GROUP_SIZE) -> Int8Weight:
        """Quantize a float weight `[N, K]`: each group's scale is its largest magnitude / 127, and
        each value is rounded to the nearest multiple of it (ties to even), in [-127, 127]. A group
        of zeros gets scale 1. `group_size` at or above K: one scale per channel."""
        w = weight.detach().float()
        n, k = w.shape
        group_size = int8_group_size(k, group_size)
        groups = -(-k // group_size)
        padded = torch.nn.functional.pad(w, (0, groups * group_size - k)).reshape(n, groups, group_size)
        absmax = padded.abs().amax(dim=2)
        scales = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
        qweight = torch.round(padded / scales[..., None]).clamp_(-127, 127).to(torch.int8)
        return cls(qweight.reshape(n, -1)[:, :k].contiguous(), scales.contiguous(), group_size)

    @property
    def tag(self) -> str:
        """The layout in a few characters, for the tuning table's shape names (timings differ with
        it): "int8" for `quantize`'s own (groups of `INT8_GROUP_SIZE`, symmetric), else e.g.
        "int8g32o" (groups of 32, with offsets)."""
        if self.group_size == INT8_GROUP_SIZE and self.offsets is None:
            return "int8"
        return f"int8g{self.group_size}" + ("o" if self.offsets is not None else "")

    @property
    def shape(self) -> tuple[int, int]:
        """`(N, K)`: output channels, input features."""
        n, k = self.qweight.shape
        return n, k

    @property
    def nbytes(self) -> int:
        """Bytes a forward pass reads: the int8 values, the scales and the offsets."""
        offsets = 0 if self.offsets is None else self.offsets.numel()
        return self.qweight.numel() + 4 * (self.scales.numel() + offsets)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight `[N, K]` the kernels compute with (the kernels multiply and add in one
        rounding; for a GGUF type's values the product is exact, so the two agree)."""
        k = self.qweight.shape[1]
        weight = self.qweight.float() * self.scales.repeat_interleave(self.group_size, dim=1)[:, :k]
        if self.offsets is not None:
            weight += self.offsets.repeat_interleave(self.group_size, dim=1)[:, :k]
        return weight

    def packed(self, lanes: int) -> PackedInt8:
        """This weight in the C kernels' layout for strips of `lanes` channels (made once, shared by
        the kernels that run it)."""
        if lanes not in self._packed:
            self._packed[lanes] = PackedInt8.pack(self, lanes)
        return self._packed[lanes]


@dataclass
class PackedInt8:
    """An `Int8Weight` as csrc/int8_packed.h lays it out for strips of `lanes` output channels:
    `values` int8 `[ceil(N / lanes), K4 / 4, lanes, 4]` (K4: K rounded up to 4, zero padded),
    `scales` float32, `offsets` float32 (or None: symmetric) and `comp` int32 (128 * each group's
    sum of values, for VPDPBUSD's unsigned activations) `[ceil(N / lanes), groups, lanes]`; `group`
    the K of a scale group (a multiple of 4: K4 for one scale per channel)."""

    values: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    comp: torch.Tensor
    group: int

    @classmethod
    def pack(cls, weight: Int8Weight, lanes: int) -> PackedInt8:
        n, k = weight.shape
        k4, strips = -(-k // 4) * 4, -(-n // lanes)
        group = min(weight.group_size, k4)
        groups = weight.scales.shape[1]
        q = torch.zeros(strips * lanes, groups * group, dtype=torch.int8)
        q[:n, :k] = weight.qweight
        values = q[:, :k4].reshape(strips, lanes, k4 // 4, 4).permute(0, 2, 1, 3).contiguous()
        comp = 128 * q.reshape(strips * lanes, groups, group).sum(dim=2, dtype=torch.int32)

        def strip_major(per_channel: torch.Tensor) -> torch.Tensor:
            padded = torch.zeros(strips * lanes, groups, dtype=per_channel.dtype)
            padded[: per_channel.shape[0]] = per_channel
            return aligned(padded.reshape(strips, lanes, groups).permute(0, 2, 1).contiguous())

        offsets = None if weight.offsets is None else strip_major(weight.offsets)
        return cls(aligned(values), strip_major(weight.scales), offsets, strip_major(comp), group)
