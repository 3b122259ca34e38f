"""CPU linear layers: the candidates the kernel registry times, and `TunedLinear`, which runs the
one measured fastest for each step's row count.

- `PlainLinear` ("torch"): `F.linear`, torch's own path (MKL's sgemm in float32; in bf16 oneDNN with a
  reorder of the plain weight on every call).
- `PrepackedLinear` ("onednn"): the weight reordered once into oneDNN's blocked layout (what
  PyTorch's inductor does when it freezes a CPU model, `torch._inductor.config.freezing`), so no call
  pays the reorder; oneDNN then runs its best ISA for the machine (AMX tiles where there are some).
- `Bf16Linear` ("bf16_c"): batchgen's own AVX512-BF16 kernel (`csrc/bf16_linear.c`) on a weight
  packed for VDPBF16PS.
- `AmxLinear` ("amx_c"): batchgen's own AMX kernel (`csrc/amx_linear.c`) on the same packed weight,
  where the CPU has AMX tiles.

Which is fastest depends on the machine and on the row count (few rows are memory-bound, many are
compute-bound), so none is chosen by rule: `linear_candidates` lists what applies to a weight and
`kernels.registry.choose` times them (`batchgen.model.kernel_choice.choice` wires it into the model).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F

from batchgen.kernels.cpu import library as cpu_kernels
from batchgen.kernels.registry import ROW_BUCKETS, bucket_index


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

    KERNEL = "bf16_linear"  # the C function: (x, ldx, w_packed, bias, y, ldy, m, n, k, threads) -> status
    NEEDS = "AVX512-BF16"

    @staticmethod
    def kernel_available() -> bool:
        return bf16_kernel_available()

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
        if not self.kernel_available():
            raise RuntimeError(
                f"batchgen's {self.KERNEL} kernel is not built here: it needs a CPU with {self.NEEDS} and a "
                "C compiler (see bf16_linear_applies); use PrepackedLinear or nn.Linear"
            )
        self._library = cpu_kernels.require_library()
        self._kernel = getattr(self._library, self.KERNEL)

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
            raise RuntimeError(f"{self.KERNEL} refused [{m}, {self.in_features}] x {self.extra_repr()}")
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


class AmxLinear(Bf16Linear):
    """`y = x @ W^T + b` in bf16 through batchgen's AMX kernel (`csrc/amx_linear.c`) on the same packed
    weight as `Bf16Linear` (each 16 pair lines of a strip are one AMX B tile). Input `[..., K]` and
    output `[..., N]` are bf16; K must be a multiple of 32 (`amx_linear_applies`)."""

    KERNEL = "amx_linear"
    NEEDS = "AMX (amx_bf16, amx_tile) and AVX512-BF16"

    @staticmethod
    def kernel_available() -> bool:
        return amx_kernel_available()

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU on this layer as the fused gate/up projection (outputs: I gate, then I up):
        bf16 `x [M, K]` (unit column stride) -> bf16 `silu(gate) * up` `[M, I]`, bit for bit
        `silu_mul_bf16(self(x))` (kernels.cpu.ops) without the `[M, 2 I]` intermediate.

        Raises:
            ValueError: `x` is not bf16 `[M, in_features]` rows, or out_features is not a
                multiple of 32 (I a multiple of 16).
        """
        if x.dim() != 2 or x.stride(1) != 1 or x.dtype != torch.bfloat16 or x.shape[1] != self.in_features:
            raise ValueError(
                f"swiglu takes bf16 [M, {self.in_features}] rows; got {x.dtype} {tuple(x.shape)}"
            )
        if self.out_features % 32:
            raise ValueError(f"swiglu needs 2 x a multiple of 16 outputs; this layer has {self.out_features}")
        m, intermediate = x.shape[0], self.out_features // 2
        out = torch.empty((m, intermediate), dtype=torch.bfloat16)
        bias = None if self.bias is None else self.bias.data_ptr()
        status = self._library.amx_swiglu(
            x.data_ptr(), x.stride(0), self.packed_weight.data_ptr(), bias, out.data_ptr(), intermediate,
            m, intermediate, self.in_features, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:  # the layer was built for this kernel: a failure here is a bug
            raise RuntimeError(f"amx_swiglu refused [{m}, {self.in_features}] x {self.extra_repr()}")
        return out


def amx_linear_applies(weight: torch.Tensor) -> bool:
    """Whether `AmxLinear` takes `weight` `[N, K]`: as `bf16_linear_applies` with K a multiple of 32,
    on a machine whose kernel library has the AMX kernel (`amx_kernel_available`)."""
    return bf16_linear_applies(weight) and weight.shape[1] % 32 == 0 and amx_kernel_available()


def amx_kernel_available() -> bool:
    """Whether the C library is built here with the AMX linear kernel and Linux grants this process
    the AMX tile state (and no `ONEDNN_MAX_CPU_ISA` below AMX emulates a machine without it)."""
    lib = cpu_kernels.load_library()
    return lib is not None and cpu_kernels.isa_cap_allows("amx") and bool(lib.amx_linear_available())


def bf16_kernel_available() -> bool:
    """Whether the C library is built here with the AVX512-BF16 linear kernel (and no
    `ONEDNN_MAX_CPU_ISA` below AVX512_CORE_BF16 emulates a machine without it)."""
    lib = cpu_kernels.load_library()
    return lib is not None and cpu_kernels.isa_cap_allows("avx512_bf16") and bool(lib.bf16_linear_available())


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

    Without it, bf16 matmuls are emulated, several times slower than float32 (measured:
    docs/benchmarks.md).
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
    `bf16_linear_applies`, else by a `PrepackedLinear`: `--kernels native`, batchgen's own kernels
    wherever they apply, unmeasured.

    A tied LM head gets its own packed copy (the embedding keeps the plain weight for lookups):
    about `vocab x hidden x dtype size` bytes more memory. Returns the number of layers replaced.
    """
    # Names only: a list of the modules would keep every plain weight alive until the trim below.
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = cast(nn.Linear, model.get_submodule(name))  # a name of an nn.Linear (above)
        packed_class = Bf16Linear if bf16_linear_applies(linear.weight) else PrepackedLinear
        setattr(parent, child, packed_class.from_linear(linear))
    release_freed_heap()
    return len(names)


def release_freed_heap() -> None:
    """Return freed heap pages to the OS (glibc's `malloc_trim`; a no-op without glibc).

    The plain weights freed by packing sit in glibc's heap, which keeps them resident until trimmed
    (measured: docs/benchmarks.md).
    """
    try:  # the process's own symbols: the C library it already loaded, no library search
        process = ctypes.CDLL(None)
    except (OSError, TypeError):  # TypeError: Windows has no handle for the process itself
        return
    trim = getattr(process, "malloc_trim", None)
    if trim is not None:
        trim(0)


class PlainLinear(nn.Module):
    """`y = x @ W^T + b` through `F.linear` on the plain weight `[out_features, in_features]` (torch's
    own path: the "torch" candidate). Input `[..., in_features]`, output `[..., out_features]`, the
    weight's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def linear_candidates(weight: torch.Tensor, bias: torch.Tensor | None) -> dict[str, Callable[[], nn.Module]]:
    """Builders of every linear implementation that takes this CPU weight `[N, K]` (float32 or bf16):
    "torch" always, "onednn" where `can_prepack`, "bf16_c" where `bf16_linear_applies`, "amx_c" where
    `amx_linear_applies`. Each builder
    packs the weight when called, except that "bf16_c" and "amx_c" share one packed copy
    (`WEIGHT_LAYOUTS`)."""
    weight, bias = weight.detach(), None if bias is None else bias.detach()
    builders: dict[str, Callable[[], nn.Module]] = {"torch": lambda: PlainLinear(weight, bias)}
    if can_prepack(weight.dtype, weight.device):
        builders["onednn"] = lambda: PrepackedLinear(
            pack_weight(weight), bias, weight.shape[1], weight.shape[0]
        )
    if bf16_linear_applies(weight):
        packed = functools.cache(lambda: Bf16Linear.from_weight(weight, bias))  # one copy for both kernels
        builders["bf16_c"] = packed
        if amx_linear_applies(weight):
            builders["amx_c"] = lambda: AmxLinear(packed().packed_weight, packed().bias)
    return builders


# The weight layout each implementation holds: implementations of one layout share one copy.
WEIGHT_LAYOUTS = {"torch": "plain", "onednn": "onednn", "bf16_c": "packed_bf16", "amx_c": "packed_bf16"}


class TunedLinear(nn.Module):
    """A linear layer that runs, for each call's row count, the implementation measured fastest there.

    Holds one module per implementation it uses (so one packed weight layout each: memory grows by
    one weight copy per extra implementation) and a table from `kernels.registry.ROW_BUCKETS` index
    to module. Input `[M, in_features]` (or `[..., in_features]`, counted as rows), output
    `[..., out_features]`, the weight's dtype. The choice is one list index by row count: a
    per-call bucket computation and a second module call cost a visible share of a 1-row decode
    step (measured: docs/benchmarks.md).
    """

    def __init__(self, impls: dict[str, nn.Module], by_bucket: list[str]) -> None:
        """`impls`: name -> built module (all of one weight); `by_bucket`: the name used at each
        bucket index (its length covers every bucket; the last serves bigger steps too)."""
        super().__init__()
        self.impls = nn.ModuleDict(impls)
        self.by_bucket = list(by_bucket)
        first = cast(nn.Linear, next(iter(impls.values())))  # every implementation has its features
        self.in_features, self.out_features = first.in_features, first.out_features
        # Row count -> the implementation's forward (no nn.Module call: no hooks are ever set on them),
        # and -> its fused SwiGLU where it has one (`fused_swiglu`, for `swiglu_at`).
        forwards = {name: impl.forward for name, impl in impls.items()}
        swiglus = {name: fused_swiglu(impl) for name, impl in impls.items()}
        self._by_rows = [forwards[by_bucket[0]]]  # 0 rows: as 1
        self._swiglu_by_rows = [swiglus[by_bucket[0]]]
        for index, name in enumerate(by_bucket):
            count = ROW_BUCKETS[index] - len(self._by_rows) + 1
            self._by_rows += [forwards[name]] * count
            self._swiglu_by_rows += [swiglus[name]] * count

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else x.numel() // self.in_features
        by_rows = self._by_rows
        return (by_rows[rows] if rows < len(by_rows) else by_rows[-1])(x)

    def swiglu_at(self, rows: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """`fused_swiglu` of the implementation a call of `rows` rows runs."""
        by_rows = self._swiglu_by_rows
        return by_rows[rows] if rows < len(by_rows) else by_rows[-1]

    def kind_at(self, rows: int) -> str:
        """The implementation name a call of `rows` rows runs."""
        return self.by_bucket[min(bucket_index(rows), len(self.by_bucket) - 1)]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, by_bucket={self.by_bucket}"


def fused_swiglu(linear: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """`AmxLinear.swiglu` of `linear` where it is an `AmxLinear` whose outputs split into two halves
    of whole 16-column strips (a SwiGLU gate/up projection can run fused), else None."""
    return linear.swiglu if isinstance(linear, AmxLinear) and linear.out_features % 32 == 0 else None


def swiglu_for_rows(linear: nn.Module, rows: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The fused SwiGLU (`AmxLinear.swiglu`) of a gate/up projection for a call of `rows` rows: where
    the implementation chosen for that row count is batchgen's AMX kernel; else None (run the linear,
    then SiLU-and-multiply)."""
    return linear.swiglu_at(rows) if isinstance(linear, TunedLinear) else fused_swiglu(linear)
