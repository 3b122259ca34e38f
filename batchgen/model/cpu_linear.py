"""Linear layers with oneDNN-prepacked weights, for float32 and bf16 on CPU.

`F.linear` on a CPU bf16 weight hands oneDNN a plain row-major matrix, which oneDNN reorders into
its blocked (AMX/AVX-512) layout on every call. Decode steps multiply only a few rows, so that
reorder is a large share of each matmul. Reordering each weight once at load time is what
PyTorch's inductor does on CPU when it freezes a model (`torch._inductor.config.freezing`) and
what Intel's extension for PyTorch does; here it is done by hand so no compile step is needed.

Measured on the default model's shapes (1 thread, all 30 layers, bf16, AMX): 34.6 -> 23.4 ms at 1
row, 47.9 -> 35.2 ms at 64 rows, 186 -> 70 ms at 256 rows, and about the same at 2048 rows.

float32 gains too, against MKL's sgemm that `F.linear` calls: on a 2-core AVX2 EPYC (2 threads, all
30 layers), 54 -> 21 ms at 2 rows, 49 -> 30 ms at 8 rows, 77 -> 62 ms at 32 rows and about the same
from 64 rows up; the default model's 49,152-row LM head takes 24 -> 7 ms at 8 rows. A whole
long-tail bench workload (`scripts/profile_engine.py`) went from 90.3 to 72.2 s.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn


class PrepackedLinear(nn.Module):
    """`y = x @ W^T + b` with `W` held in oneDNN's blocked layout (an opaque mkldnn tensor).

    Input `[..., in_features]` and output `[..., out_features]` have the weight's dtype (float32 or
    bf16). The packed weight cannot be read back as a plain tensor; build the module from a loaded
    `nn.Linear` with `from_linear`.
    """

    def __init__(
        self, packed_weight: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int
    ):
        super().__init__()
        self.packed_weight = packed_weight
        self.bias = bias
        self.in_features = in_features
        self.out_features = out_features

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PrepackedLinear:
        """Pack a loaded float32 or bf16 `nn.Linear`'s weight `[out_features, in_features]` (the
        bias is kept)."""
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls(pack_weight(linear.weight.detach()), bias, linear.in_features, linear.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return prepacked_linear(x, self.packed_weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A plain weight `[out_features, in_features]` (float32 or bf16) reordered into oneDNN's blocked
    layout, for `prepacked_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def prepacked_linear(
    x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x @ W^T + b` for `x` `[..., in_features]` and a weight packed by `pack_weight` (same dtype);
    returns `[..., out_features]`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (oneDNN's check: AVX-512 bf16 or AMX on x86).

    Without it, bf16 matmuls are emulated: measured on a 2-core AVX2 EPYC (torch 2.13, one
    thread, 256 x 576 by 576 x 2048), 9 GFLOP/s in bf16 against 76 GFLOP/s in float32.
    """
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `prepack_linears` applies: float32 on a CPU with oneDNN, or bf16 on one whose oneDNN
    has bf16 support.

    float32 stays float32 all the way (oneDNN's default fp32 math mode, no bf16 or tf32 shortcuts):
    results differ from MKL's `F.linear` only in summation order (about 1e-6 relative), and the
    float32 greedy-fidelity tests against `transformers` run on the packed path.
    """
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and cpu_has_native_bf16()


def prepack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` in `model` (weights already loaded) by a `PrepackedLinear`.

    A tied LM head gets its own packed copy (the embedding keeps the plain weight for lookups):
    about `vocab x hidden x dtype size` bytes more memory. Returns the number of layers replaced.
    """
    # Names only: a list of the modules would keep every plain weight alive until the trim below.
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PrepackedLinear.from_linear(model.get_submodule(name)))
    release_freed_heap()
    return len(names)


def release_freed_heap() -> None:
    """Return freed heap pages to the OS (glibc's `malloc_trim`; a no-op without glibc).

    The plain weights freed by packing sit in glibc's heap, which keeps them: measured on the
    default model in float32, the engine's RSS after loading was 1,265 MiB with them and 1,054 MiB
    after the trim (954 MiB unpacked; the packed LM head copy is the rest).
    """
    try:  # the process's own symbols: the C library it already loaded, no library search
        process = ctypes.CDLL(None)
    except (OSError, TypeError):  # TypeError: Windows has no handle for the process itself
        return
    trim = getattr(process, "malloc_trim", None)
    if trim is not None:
        trim(0)
