"""The CPU kernels in C (`csrc/*.c`): built once per machine and loaded with ctypes.

The sources are compiled together with the system C compiler (`$CC`, else `cc`) and
`-O3 -march=native -fopenmp` into `cpu_kernels/` of batchgen's cache (`batchgen.cache.cache_root`). No
torch headers are involved, so a build takes about two seconds. `BATCHGEN_MAX_CPU_ISA=AVX2` (oneDNN's
level names; `ONEDNN_MAX_CPU_ISA` when it is unset) emulates a lesser CPU: the kernels are compiled for
that level instead of `native`, and no kernel above it is offered. Where there is no compiler, or
`BATCHGEN_CPU_KERNELS=0` is set, `load_library()` returns None and every caller keeps its torch path.

The library holds the paged decode and prefill attention (wrapped by `batchgen.kernels.cpu.attention`), one-call
versions of a decoder layer's bf16 element-wise chains and the write of a step's K/V rows into the
paged cache (wrapped by `batchgen.kernels.cpu.ops`), the bf16 linear layers for CPUs with AVX512-BF16
and with AMX (wrapped by `batchgen.kernels.cpu.linear.Bf16Linear` and `AmxLinear`), the linears on
int8 weights (`batchgen.kernels.cpu.quantized_linear`: `--quantization int8`'s and a GGUF file's), a mixture-of-experts layer's
experts in one call (`batchgen.kernels.cpu.moe`), and a driver that runs all of a step's decoder
layers through these kernels in one call (wrapped by `batchgen.kernels.cpu.stack`).
"""

from __future__ import annotations

import contextlib
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
import time
from pathlib import Path
from typing import Any

from batchgen.cache import cache_root, write_atomically
from batchgen.kernels.cpu.compile import compile_and_link

logger = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.c"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
# Without -ffast-math (which would set flush-to-zero for the whole process when the library loads);
# these two are enough for the compiler to vectorize the kernel's loops.
BASE_FLAGS = ["-O3", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math"]
# Tried in order; the later ones serve compilers without -march=native or OpenMP (one thread).
FLAG_SETS = [
    ["-march=native", "-mprefer-vector-width=512", "-fopenmp"],
    ["-march=native", "-fopenmp"],
    ["-fopenmp"],
    ["-march=native"],
    [],
]

# The instruction-set cap that emulates a lesser CPU: `BATCHGEN_MAX_CPU_ISA`, else oneDNN's own
# `ONEDNN_MAX_CPU_ISA` (or `DNNL_MAX_CPU_ISA`), so one variable caps torch's matmuls and these kernels
# alike. oneDNN's names; below AVX-512 the kernels are compiled for that level instead of the machine.
ISA_CAP_VARIABLES = ("BATCHGEN_MAX_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
# What replaces `-march=native` under a cap (gcc and clang names): x86-64-v3 is AVX2 + FMA + F16C, a
# Zen 3 or Haswell; the AVX-512 levels keep the machine's own ISA less what the cap leaves out.
_MARCH_UNDER_CAP = {
    "SSE41": ["-march=x86-64-v2"],
    "AVX": ["-march=x86-64-v2", "-mavx"],
    "AVX2": ["-march=x86-64-v3"],
    "AVX2_VNNI": ["-march=x86-64-v3", "-mavxvnni"],
    "AVX2_VNNI_2": ["-march=x86-64-v3", "-mavxvnni"],
    "AVX512_CORE": ["-march=native", "-mno-avx512bf16", "-mno-avx512vnni", "-mno-amx-tile"],
    "AVX512_CORE_VNNI": ["-march=native", "-mno-avx512bf16", "-mno-amx-tile"],
    "AVX512_CORE_BF16": ["-march=native", "-mno-amx-tile"],
    "AVX512_CORE_FP16": ["-march=native", "-mno-amx-tile"],
}


def isa_cap() -> str | None:
    """The instruction-set cap in force (upper case, oneDNN's names such as "AVX2"), or None.

    Raises:
        ValueError: `BATCHGEN_MAX_CPU_ISA` names no level this module knows; the message lists them.
    """
    for variable in ISA_CAP_VARIABLES:
        if value := os.environ.get(variable):
            cap = value.upper()
            known = (*_MARCH_UNDER_CAP, *_ISAS_WITH_AVX512_BF16)
            if variable == "BATCHGEN_MAX_CPU_ISA" and cap not in known:
                raise ValueError(f"BATCHGEN_MAX_CPU_ISA={value!r} is not one of {', '.join(known)}")
            return cap
    return None


def flag_sets() -> list[list[str]]:
    """`FLAG_SETS` with `-march=native` replaced as the ISA cap (`isa_cap`) asks, for the build."""
    march = _MARCH_UNDER_CAP.get(isa_cap() or "", ["-march=native"])
    sets = []
    for flags in FLAG_SETS:
        if "-march=native" in flags:
            flags = [f for f in flags if f != "-march=native"] + march
            if march[0] != "-march=native":  # a 512-bit preference means nothing below AVX-512
                flags = [f for f in flags if f != "-mprefer-vector-width=512"]
        sets.append(flags)
    return sets


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
    return cache_root() / "cpu_kernels"


def _machine_key(compiler: list[str]) -> str:
    """What the built library depends on: sources, compiler, flags and the CPU it was tuned for."""
    digest = hashlib.sha256()
    for source in [*SOURCES, *HEADERS]:
        digest.update(source.read_bytes())
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    digest.update(f"{compiler} {version} {BASE_FLAGS} {flag_sets()}".encode())
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
    error = first_error = ""
    sets = flag_sets()
    for flags in sets:
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as workdir:
            out = Path(workdir) / "lib.so"
            result = compile_and_link([*compiler, *BASE_FLAGS, *flags], SOURCES, Path(workdir), out)
            if result.returncode != 0:
                error = result.stderr.strip()[-2000:]
                first_error = first_error or error
                continue
            data = out.read_bytes()
        if flags != sets[0]:  # a lesser build runs much slower: say why the first one failed
            logger.warning(
                "CPU kernels built with %s only (%s failed: %s)",
                " ".join(flags) or "no extra flags",
                " ".join(sets[0]),
                first_error[:500],
            )
        record = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "flags": flags}
        write_atomically(target, data)
        write_atomically(target.with_suffix(".json"), json.dumps(record).encode())
        _prune_unused_builds(target.parent, keep=target)
        return record
    raise RuntimeError(f"{' '.join(compiler)} could not build the CPU kernels: {error}")


# A build whose record has not been touched (by a load) for this long is deleted at the next build:
# every change of the sources, compiler or CPU makes a new one, and nothing else removes the old.
UNUSED_BUILD_SECONDS = 30 * 24 * 3600


def _prune_unused_builds(directory: Path, keep: Path) -> None:
    """Delete the libraries (and records) in `directory` not loaded for `UNUSED_BUILD_SECONDS`."""
    cutoff = time.time() - UNUSED_BUILD_SECONDS
    for record in directory.glob("batchgen_cpu-*.json"):
        library = record.with_suffix(".so")
        try:
            if library != keep and record.stat().st_mtime < cutoff:
                library.unlink(missing_ok=True)
                record.unlink()
        except OSError:  # another process pruned it first, or the cache is read-only
            pass


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


# oneDNN's ISA names (`ONEDNN_MAX_CPU_ISA`) at or above which a kernel on AVX512-BF16, or on AMX
# tiles, may run: a cap below them emulates a machine without it, and batchgen's kernels honour it.
_ISAS_WITH_AVX512_BF16 = (
    "AVX512_CORE_BF16",
    "AVX512_CORE_FP16",
    "AVX512_CORE_AMX",
    "AVX512_CORE_AMX_FP16",
    "AVX10_1_512",
    "AVX10_1_512_AMX",
    "AVX10_1_512_AMX_FP16",
    "AVX10_2_512",
    "AVX10_2_512_AMX_2",
    "ALL",
    "DEFAULT",
)
_ISAS_WITH_AMX = tuple(isa for isa in _ISAS_WITH_AVX512_BF16 if "AMX" in isa) + ("ALL", "DEFAULT")


def isa_cap_allows(feature: str) -> bool:
    """Whether the instruction-set cap (`isa_cap`: `BATCHGEN_MAX_CPU_ISA`, else `ONEDNN_MAX_CPU_ISA`),
    when set, leaves `feature` ("avx512_bf16" or "amx") to this process: the kernels that use it are
    then offered.

    Raises:
        ValueError: an unknown `feature`, or an unknown `BATCHGEN_MAX_CPU_ISA`.
    """
    allowed = {"avx512_bf16": _ISAS_WITH_AVX512_BF16, "amx": _ISAS_WITH_AMX}.get(feature)
    if allowed is None:
        raise ValueError(f'feature must be "avx512_bf16" or "amx"; got {feature!r}')
    cap = isa_cap()
    return not cap or cap in allowed


def disabled_by_environment() -> bool:
    """Whether `BATCHGEN_CPU_KERNELS=0` turns the kernels off (then `load_library()` is None)."""
    return os.environ.get("BATCHGEN_CPU_KERNELS", "1") == "0"


def require_library() -> ctypes.CDLL:
    """`load_library()` for a caller that checked the kernels apply here (`*_applies`, `*_available`).

    Raises:
        RuntimeError: the library is off or cannot be built, so that check was skipped.
    """
    lib = load_library()
    if lib is None:
        raise RuntimeError(
            "the CPU kernel library is not available (see the log for why); use the torch path"
        )
    return lib


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernel library, built on first use; None when it is disabled or cannot be built.

    A library missing from the cache, or one that does not match its recorded checksum, is (re)built.
    A failed build logs one warning naming the cause; the engine then runs the torch path.
    """
    if disabled_by_environment():
        logger.warning("BATCHGEN_CPU_KERNELS=0: the C kernels are off, the CPU path runs on torch alone")
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found ($CC, cc, gcc, clang): the CPU path runs on torch alone")
        return None
    try:
        target = _cache_dir() / f"batchgen_cpu-{_machine_key(compiler)}.so"
        record = _verified_record(target) or _build(compiler, target)
        lib = ctypes.CDLL(str(target))
        with contextlib.suppress(OSError):  # marks the build as in use (see _prune_unused_builds)
            os.utime(target.with_suffix(".json"))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("CPU kernels unavailable, using the torch path: %s", exc)
        return None
    if "-fopenmp" not in record["flags"]:
        logger.warning(
            "CPU kernels were built without OpenMP (%s): they run on one thread", " ".join(compiler)
        )
    _declare_signatures(lib)
    return lib


def _declare_signatures(lib: ctypes.CDLL) -> None:
    """Set each entry point's argument and return types (ctypes passes every argument as a C int
    without them), in the order of the C declarations in `csrc/`."""
    # Both attention kernels: (is_bf16, query, k_cache, v_cache, block_tables, table_stride,
    # seq_lens, [prefill: query_starts,] num_seqs, num_q_heads, num_kv_heads, head_dim, block_size,
    # scale, out, num_threads[, prefill: short_chunks][, decode, "c" prefill: window, sinks]) -> status.
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    attention_head: list[type[ctypes._SimpleCData[Any]]] = [i32, ptr, ptr, ptr, ptr, ctypes.c_int64, ptr]
    attention_tail: list[type[ctypes._SimpleCData[Any]]] = [i32, i32, i32, i32, i32, ctypes.c_float, ptr, i32]
    lib.paged_decode_attention.restype = i32
    lib.paged_decode_attention.argtypes = attention_head + attention_tail + [i32, ptr]
    lib.paged_prefill_attention.restype = i32
    lib.paged_prefill_attention.argtypes = attention_head + [ptr] + attention_tail + [i32, i32, ptr]
    lib.paged_decode_attention_supported.restype = i32
    lib.paged_decode_attention_supported.argtypes = [i32, i32, i32]
    lib.paged_prefill_attention_supported.restype = i32
    lib.paged_prefill_attention_supported.argtypes = [i32, i32, i32]
    lib.paged_prefill_attention_amx.restype = i32
    lib.paged_prefill_attention_amx.argtypes = attention_head + [ptr] + attention_tail + [i32]
    lib.paged_prefill_attention_amx_available.restype = i32
    lib.paged_prefill_attention_amx_available.argtypes = []
    lib.paged_prefill_attention_bf16_dot.restype = i32
    lib.paged_prefill_attention_bf16_dot.argtypes = []
    i64 = ctypes.c_int64
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
    lib.apply_token_bitmask.restype = None
    lib.apply_token_bitmask.argtypes = [ptr, i64, ctypes.c_int, ptr, i64, ptr, i64, i64]
    lib.bf16_linear_available.restype = i32
    lib.bf16_linear_available.argtypes = []
    lib.bf16_linear.restype = i32
    lib.bf16_linear.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_int]
    lib.amx_linear_available.restype = i32
    lib.amx_linear_available.argtypes = []
    lib.amx_linear.restype = i32
    lib.amx_linear.argtypes = lib.bf16_linear.argtypes
    # (x, ldx, w_packed, bias, y, ldy, m, intermediate, k, num_threads) -> status; csrc/amx_linear.c.
    lib.amx_swiglu.restype = i32
    lib.amx_swiglu.argtypes = lib.bf16_linear.argtypes
    _declare_quantized_linears(lib)
    lib.store_kv_rows.restype = i64
    lib.store_kv_rows.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
    _declare_decoder_stacks(lib)


def _declare_decoder_stacks(lib: ctypes.CDLL) -> None:
    """csrc/decoder_stack.c: decoder_stack_bf16(layers, num_layers, dims, eps, scale, num_tokens,
    hidden, delta, cos, sin, slots, block_tables, table_stride, seq_lens, num_decodes, num_seqs,
    prefill_query_starts, workspace, num_threads, linear_kind, short_chunks) -> status, and
    decoder_stack_f32 with the same arguments, its buffers float32."""
    ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.decoder_stack_workspace_per_token.restype = i64
    lib.decoder_stack_workspace_per_token.argtypes = [ptr]
    for stack in (lib.decoder_stack_bf16, lib.decoder_stack_f32):
        stack.restype = i32
        stack.argtypes = [ptr, i32, ptr, f32, f32, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr]
        stack.argtypes += [i32, i32, ptr, ptr, i32, i32, i32]


def _declare_quantized_linears(lib: ctypes.CDLL) -> None:
    """csrc/int8_w8a16.c, int8_w8a8.c: (x, x_bf16, [W8A16: bf16_dot,] ldx, weight,
    [int8: scales, [W8A16: offsets,] [W8A8: comp,] group,] bias, y, y_bf16, ldy, m, n, k, num_threads) -> status."""
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    for name in ("int8_linear_lanes", "int8_w8a8_available", "int8_w8a16_bf16_dot_available"):
        getattr(lib, name).restype, getattr(lib, name).argtypes = i32, []
    x: list[Any] = [ptr, i32, i64]  # (x..)
    out: list[Any] = [ptr, ptr, i32, i64, i64, i64, i64, i32]  # (bias, y, .., num_threads)
    lib.int8_w8a16_linear.restype = lib.int8_w8a8_linear.restype = i32
    lib.int8_w8a16_linear.argtypes = [ptr, i32, i32, i64, ptr, ptr, ptr, i64, *out]
    lib.int8_w8a8_linear.argtypes = [*x, ptr, ptr, ptr, i64, *out]
