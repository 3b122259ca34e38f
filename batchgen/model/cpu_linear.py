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

On a CPU with AVX512-BF16, bf16 linears go one step further: `Bf16Linear` runs batchgen's own
kernel (`csrc/bf16_linear.c`) on a weight packed for VDPBF16PS, about 1.2-1.45x faster than oneDNN's
prepacked path up to 64 rows (decode steps) and as fast at 2,048 (prefill chunks).
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from batchgen.model import cpu_kernels


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


class Bf16Linear(nn.Module):
    """`y = x @ W^T + b` in bf16 through batchgen's AVX512-BF16 kernel (`csrc/bf16_linear.c`).

    The weight `[N, K]` is held as `[N/16, K/2, 16, 2]` bf16 (strips of 16 output columns with the
    K dimension in pairs: one 64-byte load is one VDPBF16PS operand), the bias as float32 `[N]`
    (added to the float32 sums before the one rounding to bf16). Input `[..., K]` and output
    `[..., N]` are bf16. Build it with `from_linear` where `bf16_linear_applies` says so.
    """

    def __init__(self, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """`packed_weight` bf16 `[N/16, K/2, 16, 2]` (see `from_weight`), `bias` float32 `[N]` or None.

        Raises:
            RuntimeError: the kernel is not built on this machine (`bf16_kernel_available`).
        """
        super().__init__()
        strips, pairs, _, _ = packed_weight.shape
        self.packed_weight = packed_weight
        self.bias = bias
        self.in_features = 2 * pairs
        self.out_features = 16 * strips
        if not bf16_kernel_available():
            raise RuntimeError(
                "batchgen's bf16 linear kernel is not built here: it needs a CPU with AVX512-BF16 and a C "
                "compiler (see bf16_linear_applies); use PrepackedLinear or nn.Linear"
            )
        self._kernel = cpu_kernels.load_library().bf16_linear

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Bf16Linear:
        """Pack a loaded bf16 `nn.Linear` (`bf16_linear_applies(linear.weight)` must hold)."""
        return cls.from_weight(linear.weight, linear.bias)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Bf16Linear:
        """Pack a bf16 weight `[N, K]` (`bf16_linear_applies(weight)` must hold) and bias `[N]`."""
        n, k = weight.shape
        packed = weight.detach().reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()
        return cls(packed, None if bias is None else bias.detach().float().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` bf16 `[..., in_features]` -> bf16 `[..., out_features]`.

        Raises:
            ValueError: `x` is not bf16 or its last dimension is not `in_features`.
        """
        if x.dim() == 2 and x.stride(1) == 1 and x.dtype == torch.bfloat16 and x.shape[1] == self.in_features:
            return self._rows(x)  # every call in the engine: the few microseconds below add up per step
        if x.dtype != torch.bfloat16 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"Bf16Linear takes bf16 [..., {self.in_features}] input; got {x.dtype} {tuple(x.shape)}"
            )
        rows = x.reshape(-1, self.in_features)
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        return self._rows(rows).view(*x.shape[:-1], self.out_features)

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        """bf16 `[M, in_features]` with unit column stride -> new bf16 `[M, out_features]`."""
        m = rows.shape[0]
        out = torch.empty((m, self.out_features), dtype=torch.bfloat16)
        status = self._kernel(
            rows.data_ptr(),
            rows.stride(0),
            self.packed_weight.data_ptr(),
            None if self.bias is None else self.bias.data_ptr(),
            out.data_ptr(),
            self.out_features,
            m,
            self.out_features,
            self.in_features,
            torch.get_num_threads(),
        )
        if status != 0:  # from_weight only packs what the kernel takes; a failure here is a bug
            raise RuntimeError(f"bf16_linear refused [{m}, {self.in_features}] x {self.extra_repr()}")
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def bf16_linear_applies(weight: torch.Tensor) -> bool:
    """Whether `Bf16Linear` takes `weight` `[N, K]`: bf16 on the CPU, N a multiple of 16, K even,
    and a kernel library built with AVX512-BF16 (`bf16_kernel_available`)."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        return False
    n, k = weight.shape
    return n % 16 == 0 and k % 2 == 0 and k > 0 and bf16_kernel_available()


def bf16_kernel_available() -> bool:
    """Whether the C library is built here with the AVX512-BF16 linear kernel."""
    lib = cpu_kernels.load_library()
    return lib is not None and bool(lib.bf16_linear_available())


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
    """Replace every `nn.Linear` in `model` (weights already loaded) by a `Bf16Linear` where
    `bf16_linear_applies`, else by a `PrepackedLinear`.

    A tied LM head gets its own packed copy (the embedding keeps the plain weight for lookups):
    about `vocab x hidden x dtype size` bytes more memory. Returns the number of layers replaced.
    """
    # Names only: a list of the modules would keep every plain weight alive until the trim below.
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = model.get_submodule(name)
        packed_class = Bf16Linear if bf16_linear_applies(linear.weight) else PrepackedLinear
        setattr(parent, child, packed_class.from_linear(linear))
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
