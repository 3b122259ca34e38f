"""Paged decode attention on the CPU, in C: build, load and call `csrc/paged_decode_attention.c`.

The torch decode path gathers every sequence's blocks into a padded copy before SDPA reads it, so
each K/V byte crosses memory three times. The C kernel reads the blocks in place through the block
table. On the default model's shapes (64 sequences, 19,296 context tokens, bf16, 30 layers with a
cache each: one decode step), `python scripts/cpu_attention_bench.py --num-threads 2` measured
131-154 ms for the torch path and 44-57 ms for the kernel (2.3-2.9x, 8-10 GB/s of K/V against about
14.5 GB/s of plain reads) on the 2-core development machine.

The source is compiled once per machine with the system C compiler (`$CC`, else `cc`) and
`-O3 -march=native -fopenmp`, into `$XDG_CACHE_HOME/batchgen/cpu_kernels/` (else `~/.cache/...`), and
loaded with ctypes; no torch headers, so a build takes about a second. Where there is no compiler, or
`BATCHGEN_CPU_KERNELS=0` is set, `load_library()` returns None and callers keep the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.c"
DTYPES = (torch.float32, torch.bfloat16)
# Without -ffast-math (which would set flush-to-zero for the whole process when the library loads);
# these two are enough for the compiler to vectorize the kernel's loops.
BASE_FLAGS = ["-O3", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math"]
# Tried in order; the later ones serve compilers without -march=native or OpenMP (one thread).
FLAG_SETS = [["-march=native", "-fopenmp"], ["-fopenmp"], ["-march=native"], []]


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "batchgen" / "cpu_kernels"


def _machine_key(compiler: str) -> str:
    """What the built library depends on: the source, the compiler and the CPU it was tuned for."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    digest.update(version.encode())
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


def _build(compiler: str, target: Path) -> None:
    """Compile SOURCE into `target` (atomically: concurrent processes may build at once).

    Raises:
        RuntimeError: no flag set compiled; the message holds the compiler's last error.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    error = ""
    for flags in FLAG_SETS:
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        command = [compiler, *BASE_FLAGS, *flags, str(SOURCE), "-o", tmp, "-lm"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if result.returncode == 0:
            os.replace(tmp, target)
            if "-fopenmp" not in flags:
                logger.warning("CPU attention kernel built without OpenMP: it runs on one thread")
            return
        os.unlink(tmp)
        error = result.stderr.strip()[-2000:]
    raise RuntimeError(f"{compiler} could not build {SOURCE.name}: {error}")


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernel library, built on first use; None when it is disabled or cannot be built.

    A failed build logs one warning naming the cause; the engine then runs the torch path.
    """
    if os.environ.get("BATCHGEN_CPU_KERNELS", "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found ($CC, cc, gcc, clang): CPU decode attention uses the torch path")
        return None
    target = _cache_dir() / f"paged_decode_attention-{_machine_key(compiler)}.so"
    try:
        if not target.exists():
            _build(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("CPU decode attention kernel unavailable, using the torch path: %s", exc)
        return None
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
    return lib


@functools.cache
def supports(dtype: torch.dtype, head_dim: int, num_q_heads: int, num_kv_heads: int) -> bool:
    """Whether the kernel library is available and compiled for this dtype, head size and GQA group.

    Compiled in: float32 and bfloat16; head_dim 16, 32, 64, 128; up to 16 query heads per KV head.
    """
    lib = load_library()
    if lib is None or dtype not in DTYPES or num_q_heads % num_kv_heads:
        return False
    group = num_q_heads // num_kv_heads
    return lib.paged_decode_attention_supported(int(dtype == torch.bfloat16), head_dim, group) == 0


def paged_decode_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    check_bounds: bool = True,
) -> torch.Tensor:
    """Attention of one query token per sequence to its paged context, in place (no gather).

    Args:
        query: `[B, Hq, D]`, float32 or bfloat16.
        k_cache / v_cache: `[num_blocks, block_size, Hkv, D]`, the query's dtype, contiguous.
        block_tables: int32 `[B, max_blocks]` (rows may be strided), covering each context.
        seq_lens: int32 `[B]`, context length of each sequence in tokens (>= 1), this step's token
            included (its K/V must already be in the cache).
        scale: softmax scale, usually `D ** -0.5`.
        check_bounds: check that every length and block id stays inside the tables and the cache
            (the kernel does not); a caller that calls once per layer with the same tables checks once.

    Returns:
        `[B, Hq, D]` in the query's dtype.

    Raises:
        RuntimeError: the library is not available, or the kernel failed to allocate scratch memory.
        ValueError: a shape, dtype, device or layout the kernel does not take (check `supports`).
    """
    lib = load_library()
    if lib is None:
        raise RuntimeError("the CPU attention kernel library is not available (see the log for why)")
    num_seqs, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if not supports(query.dtype, head_dim, num_q_heads, num_kv_heads):
        raise ValueError(
            f"no CPU kernel for dtype {query.dtype}, head_dim {head_dim}, {num_q_heads} query heads over "
            f"{num_kv_heads} KV heads; use the torch path"
        )
    if cache_head_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"cache shapes {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not fit query {tuple(query.shape)}"
        )
    if k_cache.dtype != query.dtype or v_cache.dtype != query.dtype:
        raise ValueError(f"caches must have the query's dtype {query.dtype}")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_tables and seq_lens must be int32")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} / seq_lens {tuple(seq_lens.shape)} do not match {num_seqs} sequences"
        )
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache), ("seq_lens", seq_lens)):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous CPU tensor")
    if block_tables.device.type != "cpu" or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be a CPU tensor with contiguous rows")
    if check_bounds and num_seqs:
        if int(seq_lens.min()) < 1 or int(seq_lens.max()) > block_tables.shape[1] * block_size:
            raise ValueError(
                f"seq_lens must lie in [1, {block_tables.shape[1] * block_size}] (the block tables' capacity)"
            )
        if int(block_tables.min()) < 0 or int(block_tables.max()) >= num_blocks:
            raise ValueError(f"block ids must lie in [0, {num_blocks})")
    out = torch.empty_like(query)
    status = lib.paged_decode_attention(
        int(query.dtype == torch.bfloat16),
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        num_seqs,
        num_q_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status:
        raise RuntimeError(f"CPU paged decode attention failed with status {status} (2: out of memory)")
    return out
