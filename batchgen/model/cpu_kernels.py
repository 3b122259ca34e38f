"""The CPU kernels in C (`csrc/*.c`): built once per machine, loaded with ctypes; the bf16 element-wise ops.

The sources are compiled together with the system C compiler (`$CC`, else `cc`) and
`-O3 -march=native -fopenmp` into `$XDG_CACHE_HOME/batchgen/cpu_kernels/` (else `~/.cache/...`). No
torch headers are involved, so a build takes about two seconds. Where there is no compiler, or
`BATCHGEN_CPU_KERNELS=0` is set, `load_library()` returns None and every caller keeps its torch path.

Besides the paged decode attention (`batchgen.model.cpu_attention`), the library holds one-call
versions of a decoder layer's bf16 element-wise chains (`csrc/bf16_ops.c`): RMSNorm with the
residual add before it, SiLU-and-multiply, and the rotary embedding; and the write of a step's K/V
rows into the paged cache (`csrc/kv_store.c`). On a decode step each replaces one or several ATen
calls whose dispatch costs more than their arithmetic.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.c"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
# Without -ffast-math (which would set flush-to-zero for the whole process when the library loads);
# these two are enough for the compiler to vectorize the kernel's loops.
BASE_FLAGS = ["-O3", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math"]
# Tried in order; the later ones serve compilers without -march=native or OpenMP (one thread).
FLAG_SETS = [["-march=native", "-fopenmp"], ["-fopenmp"], ["-march=native"], []]


def _compiler() -> list[str] | None:
    """The C compiler command: `$CC` split as a shell would ("ccache gcc" works), else cc, gcc or clang."""
    if os.environ.get("CC"):
        command = shlex.split(os.environ["CC"])
        if command and shutil.which(command[0]):
            return command
        logger.warning("$CC=%r is not an executable command; trying cc, gcc and clang", os.environ["CC"])
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return [name]
    return None


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME")
    if not root:
        try:
            root = str(Path.home() / ".cache")
        except RuntimeError:  # no $HOME and no passwd entry (a container run as an arbitrary uid)
            root = os.path.join(tempfile.gettempdir(), f"batchgen-{getattr(os, 'getuid', lambda: 'user')()}")
    return Path(root) / "batchgen" / "cpu_kernels"


def _machine_key(compiler: list[str]) -> str:
    """What the built library depends on: sources, compiler, flags and the CPU it was tuned for."""
    digest = hashlib.sha256()
    for source in [*SOURCES, *HEADERS]:
        digest.update(source.read_bytes())
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    digest.update(f"{compiler} {version} {BASE_FLAGS} {FLAG_SETS}".encode())
    digest.update(platform.machine().encode())
    try:  # -march=native output differs between CPU models: a shared home must not mix them
        flags = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith(("flags", "Features"))
        )
    except (OSError, StopIteration):
        flags = platform.processor()
    digest.update(flags.encode())
    return digest.hexdigest()[:16]


def _write_durably(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a synced temporary file and an atomic rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build(compiler: list[str], target: Path) -> dict:
    """Compile SOURCES into one library at `target` and record its checksum beside it.

    The library and its record are written through synced temporary files and atomic renames, so
    concurrent builds and crashes leave either a complete, verifiable library or none.

    Returns:
        the record: {"sha256", "size", "flags"}.

    Raises:
        RuntimeError: no flag set compiled; the message holds the compiler's last error.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    error = ""
    for flags in FLAG_SETS:
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as workdir:
            out = Path(workdir) / "lib.so"
            command = [*compiler, *BASE_FLAGS, *flags, *map(str, SOURCES), "-o", str(out), "-lm"]
            result = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if result.returncode != 0:
                error = result.stderr.strip()[-2000:]
                continue
            data = out.read_bytes()
        record = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "flags": flags}
        _write_durably(target, data)
        _write_durably(target.with_suffix(".json"), json.dumps(record).encode())
        return record
    raise RuntimeError(f"{' '.join(compiler)} could not build the CPU kernels: {error}")


def _verified_record(target: Path) -> dict | None:
    """The build record of `target` when the library on disk matches it byte for byte, else None.

    A truncated library would crash the process inside dlopen (SIGBUS), so it is never loaded.
    """
    try:
        record = json.loads(target.with_suffix(".json").read_text())
        data = target.read_bytes()
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or len(data) != record.get("size"):
        return None
    return record if hashlib.sha256(data).hexdigest() == record.get("sha256") else None


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernel library, built on first use; None when it is disabled or cannot be built.

    A library missing from the cache, or one that does not match its recorded checksum, is (re)built.
    A failed build logs one warning naming the cause; the engine then runs the torch path.
    """
    if os.environ.get("BATCHGEN_CPU_KERNELS", "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found ($CC, cc, gcc, clang): the CPU path runs on torch alone")
        return None
    try:
        target = _cache_dir() / f"batchgen_cpu-{_machine_key(compiler)}.so"
        record = _verified_record(target) or _build(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("CPU kernels unavailable, using the torch path: %s", exc)
        return None
    if "-fopenmp" not in record["flags"]:
        logger.warning(
            "CPU kernels were built without OpenMP (%s): they run on one thread", " ".join(compiler)
        )
    lib.paged_decode_attention.restype = ctypes.c_int
    lib.paged_decode_attention.argtypes = [
        ctypes.c_int,  # is_bf16
        ctypes.c_void_p,  # query
        ctypes.c_void_p,  # k_cache
        ctypes.c_void_p,  # v_cache
        ctypes.c_void_p,  # block_tables
        ctypes.c_int64,  # table_stride
        ctypes.c_void_p,  # seq_lens
        ctypes.c_int,  # num_seqs
        ctypes.c_int,  # num_q_heads
        ctypes.c_int,  # num_kv_heads
        ctypes.c_int,  # head_dim
        ctypes.c_int,  # block_size
        ctypes.c_float,  # scale
        ctypes.c_void_p,  # out
        ctypes.c_int,  # num_threads
    ]
    lib.paged_decode_attention_supported.restype = ctypes.c_int
    lib.paged_decode_attention_supported.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.add_rms_norm_bf16.restype = None
    lib.add_rms_norm_bf16.argtypes = [
        ptr,
        i64,
        ptr,
        i64,
        ptr,
        ctypes.c_float,
        i64,
        ctypes.c_int,
        ptr,
        i64,
        ctypes.c_int,
    ]
    lib.silu_mul_bf16.restype = None
    lib.silu_mul_bf16.argtypes = [ptr, i64, i64, ctypes.c_int, ptr, i64, ctypes.c_int]
    lib.rotary_bf16.restype = None
    lib.rotary_bf16.argtypes = [
        ptr,
        i64,
        ptr,
        ptr,
        i64,
        i64,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ptr,
        ptr,
        ctypes.c_int,
    ]
    lib.store_kv_rows.restype = i64
    lib.store_kv_rows.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
    return lib


def bf16_ops_apply(x: torch.Tensor) -> bool:
    """Whether the C element-wise ops take `x`: a bf16 CPU tensor, with the library built."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and load_library() is not None


def _check_rows(name: str, t: torch.Tensor, cols: int) -> None:
    if t.dim() != 2 or t.shape[1] < cols or t.stride(1) != 1 or t.dtype != torch.bfloat16:
        raise ValueError(
            f"{name} must be a 2-D bf16 tensor of at least {cols} contiguous columns; got {t.shape}"
        )


def add_rms_norm_bf16(
    hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`hidden += delta` in place (when given), then RMSNorm of `hidden` times `weight`.

    Args:
        hidden: bf16 `[T, H]` with contiguous rows; updated in place when `delta` is given.
        delta: bf16 `[T, H]` with contiguous rows, or None.
        weight: bf16 `[H]`.
        eps: added to the mean square.

    Returns:
        bf16 `[T, H]`, rounded where Hugging Face's LlamaRMSNorm rounds (see `csrc/bf16_ops.c`).

    Raises:
        ValueError: a shape, dtype or layout the kernel does not take.
    """
    rows, cols = hidden.shape
    _check_rows("hidden", hidden, cols)
    if delta is not None:
        _check_rows("delta", delta, cols)
        if delta.shape[0] != rows:
            raise ValueError(f"delta has {delta.shape[0]} rows, hidden {rows}")
    if weight.shape != (cols,) or not weight.is_contiguous() or weight.dtype != torch.bfloat16:
        raise ValueError(f"weight must be a contiguous bf16 [{cols}] tensor")
    out = torch.empty((rows, cols), dtype=torch.bfloat16)
    load_library().add_rms_norm_bf16(
        hidden.data_ptr(),
        hidden.stride(0),
        None if delta is None else delta.data_ptr(),
        0 if delta is None else delta.stride(0),
        weight.data_ptr(),
        eps,
        rows,
        cols,
        out.data_ptr(),
        cols,
        torch.get_num_threads(),
    )
    return out


def silu_mul_bf16(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's `silu(gate) * up` for bf16 `[T, 2 * I]` rows (gate then up): bf16 `[T, I]`.

    Raises:
        ValueError: a shape, dtype or layout the kernel does not take.
    """
    rows, width = gate_up.shape
    _check_rows("gate_up", gate_up, width)
    if width % 2:
        raise ValueError(f"gate_up must have an even width; got {width}")
    out = torch.empty((rows, width // 2), dtype=torch.bfloat16)
    load_library().silu_mul_bf16(
        gate_up.data_ptr(),
        gate_up.stride(0),
        rows,
        width // 2,
        out.data_ptr(),
        width // 2,
        torch.get_num_threads(),
    )
    return out


def rotary_bf16(
    qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries and keys by the step's cos/sin; split them into contiguous tensors.

    Args:
        qk: bf16 `[T, Hq + Hkv, D]`, each row's heads contiguous (rows may be strided, as a slice of a
            fused QKV output).
        cos / sin: bf16 `[T, 1, D]` or `[T, D]` with contiguous rows.
        num_q_heads: Hq; the remaining heads are keys.

    Returns:
        queries `[T, Hq, D]` and keys `[T, Hkv, D]`, contiguous bf16.

    Raises:
        ValueError: a shape, dtype or layout the kernel does not take.
    """
    rows, heads, head_dim = qk.shape
    if qk.dtype != torch.bfloat16 or qk.stride(2) != 1 or qk.stride(1) != head_dim or head_dim % 2:
        raise ValueError(f"qk must be bf16 [T, heads, D] with contiguous heads and an even D; got {qk.shape}")
    if cos.numel() != rows * head_dim or sin.numel() != rows * head_dim:
        raise ValueError(
            f"cos and sin must hold [{rows}, {head_dim}] values; got {cos.shape} and {sin.shape}"
        )
    cos, sin = cos.reshape(rows, head_dim), sin.reshape(rows, head_dim)
    if cos.stride(1) != 1 or sin.stride() != cos.stride() or {cos.dtype, sin.dtype} != {torch.bfloat16}:
        raise ValueError("cos and sin must be bf16 [T, D] with contiguous rows of the same layout")
    q = torch.empty((rows, num_q_heads, head_dim), dtype=torch.bfloat16)
    k = torch.empty((rows, heads - num_q_heads, head_dim), dtype=torch.bfloat16)
    load_library().rotary_bf16(
        qk.data_ptr(),
        qk.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        cos.stride(0),
        rows,
        num_q_heads,
        heads - num_q_heads,
        head_dim,
        q.data_ptr(),
        k.data_ptr(),
        torch.get_num_threads(),
    )
    return q, k


def _rows_layout(name: str, t: torch.Tensor, row_shape: tuple[int, ...]) -> None:
    """Check `t` is `[T, *row_shape]` with each row's elements contiguous (rows may be strided)."""
    if t.dim() != 1 + len(row_shape) or tuple(t.shape[1:]) != row_shape:
        raise ValueError(f"{name} must be [T, {', '.join(map(str, row_shape))}]; got {tuple(t.shape)}")
    expected = 1
    for dim in range(t.dim() - 1, 0, -1):
        if t.shape[dim] > 1 and t.stride(dim) != expected:
            raise ValueError(f"{name} must have contiguous rows (a row's heads and dims in order)")
        expected *= t.shape[dim]


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    check_layout: bool = True,
) -> None:
    """Write `key`/`value` rows into the paged caches at `slot_mapping`; slot -1 is skipped.

    Args:
        key / value: `[T, Hkv, D]` in the caches' dtype; each row contiguous, rows may be strided (a
            slice of a fused QKV output).
        k_cache / v_cache: contiguous `[num_blocks, block_size, Hkv, D]`.
        slot_mapping: int64 `[T]`, `block_id * block_size + offset` per row, or -1.
        check_layout: check the dtypes, shapes and strides (about 15 us). A caller that has checked
            the same layout already in this step (the other layers) passes False; the slots are
            always checked, in C.

    Raises:
        ValueError: a dtype, shape or layout the kernel does not take, or a slot outside the cache
            (then nothing is written).
    """
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if check_layout:
        _check_store_layout(key, value, k_cache, v_cache, slot_mapping)
    size = k_cache.element_size()
    bad = load_library().store_kv_rows(
        key.data_ptr(),
        key.stride(0) * size,
        value.data_ptr(),
        value.stride(0) * size,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        key.shape[0],
        num_kv_heads * head_dim * size,
        num_blocks * block_size,
        torch.get_num_threads(),
    )
    if bad >= 0:
        raise ValueError(
            f"slot_mapping[{bad}] = {int(slot_mapping[bad])} is outside the cache's "
            f"{num_blocks * block_size} slots"
        )


def _check_store_layout(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    row_shape = tuple(k_cache.shape[2:])
    for name, t in (("key", key), ("value", value)):
        _rows_layout(name, t, row_shape)
        if t.dtype != k_cache.dtype or t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU {k_cache.dtype} tensor; got {t.dtype} on {t.device}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError("k_cache and v_cache must have the same shape and dtype")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    num_tokens = key.shape[0]
    if value.shape[0] != num_tokens or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"key, value and slot_mapping must have the same number of rows; got "
            f"{num_tokens}, {value.shape[0]} and {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be a contiguous int64 tensor")
