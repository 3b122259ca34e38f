"""Paged decode and prefill attention on the CPU, in C (`csrc/paged_*_attention.c`, built by `cpu_kernels`).

The torch decode path gathers every sequence's blocks into a padded copy before SDPA reads it, so
each K/V byte crosses memory three times. The C kernel reads the blocks in place through the block
table. `python benchmarks/kernels/cpu_attention_bench.py` times both on the default model's shapes
(measured: docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from batchgen.kernels.cpu.library import isa_cap_allows, load_library

DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def supports(dtype: torch.dtype, head_dim: int, num_q_heads: int, num_kv_heads: int) -> bool:
    """Whether the decode kernel is available and compiled for this dtype, head size and GQA group.

    Compiled in: float32 and bfloat16; head_dim 16, 32, 64, 128; up to 16 query heads per KV head.
    """
    return _kernel_supports("paged_decode_attention_supported", dtype, head_dim, num_q_heads, num_kv_heads)


def paged_decode_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    check_bounds: bool = True,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
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
        window: a sliding-window layer's window in tokens: each query sees only the `window` keys
            up to its own position (Hugging Face's `kv_idx > q_idx - sliding_window`), and blocks
            wholly before that are not read; None sees the whole context.
        sinks: float32 `[Hq]`, each query head's attention sink logit (gpt-oss), which joins its
            softmax denominator and nothing else; None: no sinks.

    Returns:
        `[B, Hq, D]` in the query's dtype.

    Raises:
        RuntimeError: the library is not available, or the kernel failed to allocate scratch memory.
        ValueError: a shape, dtype, device or layout the kernel does not take (check `supports`).
    """
    lib = _checked_library(query, k_cache, v_cache, block_tables, seq_lens, query.shape[0], supports)
    if check_bounds and query.shape[0]:
        check_table_bounds(k_cache, block_tables, seq_lens, min_len=1)
    return _launch(
        lib.paged_decode_attention,
        "decode",
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale,
        extra=(window_arg(window), sinks_arg(sinks, query.shape[1])),
    )


def window_arg(window: int | None) -> int:
    """The C kernels' `window` argument: the window in tokens, 0 for none.

    Raises:
        ValueError: a window below 1.
    """
    if window is None:
        return 0
    if window < 1:
        raise ValueError(f"window must be None or at least 1 token; got {window}")
    return int(window)


def sinks_arg(sinks: torch.Tensor | None, num_q_heads: int) -> int | None:
    """The C kernels' `sinks` argument: the address of float32 `[num_q_heads]` sink logits, None
    (NULL) for none.

    Raises:
        ValueError: sinks that are not a contiguous float32 CPU tensor of one logit per query head.
    """
    if sinks is None:
        return None
    if sinks.dtype != torch.float32 or sinks.shape != (num_q_heads,) or sinks.device.type != "cpu":
        raise ValueError(
            f"sinks must be float32 of shape ({num_q_heads},) on the CPU; got {sinks.dtype} {tuple(sinks.shape)}"
        )
    if not sinks.is_contiguous():
        raise ValueError("sinks must be contiguous")
    return sinks.data_ptr()


@functools.cache
def supports_prefill(dtype: torch.dtype, head_dim: int, num_q_heads: int, num_kv_heads: int) -> bool:
    """Whether the prefill kernel is available for this dtype, head size and GQA group (as `supports`)."""
    return _kernel_supports("paged_prefill_attention_supported", dtype, head_dim, num_q_heads, num_kv_heads)


def _kernel_supports(
    check: str, dtype: torch.dtype, head_dim: int, num_q_heads: int, num_kv_heads: int
) -> bool:
    """Ask the library's `check` function (0: compiled in) about a dtype, head size and GQA group."""
    lib = load_library()
    if lib is None or dtype not in DTYPES or num_q_heads % num_kv_heads:
        return False
    group = num_q_heads // num_kv_heads
    return getattr(lib, check)(int(dtype == torch.bfloat16), head_dim, group) == 0


def supports_prefill_amx(dtype: torch.dtype, head_dim: int, num_q_heads: int, num_kv_heads: int) -> bool:
    """Whether the AMX prefill kernel (`csrc/amx_prefill_attention.c`) takes these shapes here: bf16,
    head_dim a multiple of 32 up to 128, a whole GQA group, a CPU with AMX that Linux lets this
    process use (and no `ONEDNN_MAX_CPU_ISA` below AMX emulating a machine without it)."""
    if dtype != torch.bfloat16 or head_dim % 32 or head_dim > 128 or num_q_heads % num_kv_heads:
        return False
    lib = load_library()
    return lib is not None and isa_cap_allows("amx") and lib.paged_prefill_attention_amx_available() == 1


def prefill_uses_bf16_dot() -> bool:
    """Whether bf16 prefill runs on AVX512-BF16 dot products, which round the softmax probabilities
    to bf16 before the product with V (as FlashAttention's bf16 kernels do); elsewhere, and for
    float32, all of the kernel's arithmetic is float32."""
    lib = load_library()
    return lib is not None and lib.paged_prefill_attention_bf16_dot() == 1


def paged_prefill_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_starts: torch.Tensor,
    scale: float,
    check_bounds: bool = True,
    out: torch.Tensor | None = None,
    kernel: str = "c",
    short_chunks: bool = False,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of prefill chunks to their paged context, in place (no gather).

    Sequence b's query rows `query[query_starts[b]:query_starts[b + 1]]` are the last positions of
    its `seq_lens[b]` context tokens; each row attends to every cached token up to and including its
    own position (a cached prefix fully, its chunk causally). Their K/V must already be in the cache.
    With `short_chunks` (a step that verifies speculative draft tokens), chunks of a few rows (up to
    8 on "c", 6 on "amx") walk their context once in the decode kernel's loop
    (`paged_short_chunk_attention` in `csrc/paged_decode_attention.c`); without it a row's result
    does not depend on how its prompt was cut into chunks (a resumed job's greedy text stays the same).
    Against torch's SDPA: `benchmarks/kernels/cpu_prefill_attention_bench.py` (measured: docs/benchmarks.md).

    Args:
        query: `[T, Hq, D]`, float32 or bfloat16, the chunks' rows back to back.
        k_cache / v_cache: `[num_blocks, block_size, Hkv, D]`, the query's dtype, contiguous.
        block_tables: int32 `[B, max_blocks]` (rows may be strided), covering each context.
        seq_lens: int32 `[B]`, each sequence's context length in tokens after this chunk.
        query_starts: int32 `[B + 1]`, prefix sums of the chunk lengths, from 0 to T.
        scale: softmax scale, usually `D ** -0.5`.
        check_bounds: check lengths, offsets and block ids against the tables and the cache (the
            kernel does not); a caller that calls once per layer with the same tables checks once.
        out: where to write the result (a contiguous CPU tensor of the query's shape and dtype, such
            as the prefill rows of a step's output); None allocates one.
        kernel: "c" (`csrc/paged_prefill_attention.c`) or "amx" (`csrc/amx_prefill_attention.c`,
            bf16 on AMX tiles, where `supports_prefill_amx`).
        short_chunks: route chunks of a few rows to the decode kernel's walk (above).
        window: a sliding-window layer's window in tokens (as `paged_decode_attention_cpu`'s);
            only the "c" kernel takes one.
        sinks: float32 `[Hq]` sink logits (as `paged_decode_attention_cpu`'s); only the "c" kernel
            takes them.

    Returns:
        `[T, Hq, D]` in the query's dtype (`out` when given).

    Raises:
        RuntimeError: the library is not available, or the kernel failed to allocate memory.
        ValueError: a shape, dtype, device, layout or offset the kernel does not take.
    """
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if kernel not in ("c", "amx"):
        raise ValueError(f'kernel must be "c" or "amx"; got {kernel!r}')
    if kernel == "amx" and window is not None:
        raise ValueError('the "amx" prefill kernel has no sliding window; use kernel="c"')
    if kernel == "amx" and sinks is not None:
        raise ValueError('the "amx" prefill kernel has no attention sinks; use kernel="c"')
    supported = supports_prefill if kernel == "c" else supports_prefill_amx
    lib = _checked_library(query, k_cache, v_cache, block_tables, seq_lens, num_seqs, supported)
    _check_chunk_arguments(query, query_starts, num_seqs, out)
    if check_bounds and num_seqs:
        check_query_starts(query_starts, seq_lens, query.shape[0])
        check_table_bounds(k_cache, block_tables, seq_lens, min_len=0)
    return _launch(
        lib.paged_prefill_attention if kernel == "c" else lib.paged_prefill_attention_amx,
        "prefill",
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale,
        query_starts,
        out=out,
        extra=(int(short_chunks),)
        if kernel == "amx"
        else (int(short_chunks), window_arg(window), sinks_arg(sinks, query.shape[1])),
    )


def _check_chunk_arguments(
    query: torch.Tensor, query_starts: torch.Tensor, num_seqs: int, out: torch.Tensor | None
) -> None:
    """`query_starts` is a contiguous int32 CPU tensor of `[num_seqs + 1]`; `out`, when given, a
    contiguous CPU tensor of the query's shape and dtype.

    Raises:
        ValueError: naming the argument and what it must be.
    """
    if query_starts.dtype != torch.int32 or query_starts.shape != (num_seqs + 1,):
        raise ValueError(
            f"query_starts must be int32 of shape ({num_seqs + 1},), got {query_starts.dtype} "
            f"{tuple(query_starts.shape)}"
        )
    if query_starts.device.type != "cpu" or not query_starts.is_contiguous():
        raise ValueError("query_starts must be a contiguous CPU tensor")
    if out is not None and (
        out.shape != query.shape
        or out.dtype != query.dtype
        or out.device.type != "cpu"
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"out must be a contiguous CPU tensor of the query's shape {tuple(query.shape)} and dtype"
        )


def _launch(
    kernel: Callable[..., int],
    what: str,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *offsets: torch.Tensor,
    out: torch.Tensor | None = None,
    extra: tuple[int | None, ...] = (),
) -> torch.Tensor:
    """Call one attention kernel (arguments checked) into `out` (None: a new tensor); `offsets` are the
    tensors a kernel takes after `seq_lens` (the prefill kernel's query starts), `extra` the integers
    (and addresses, None for NULL) it takes after `num_threads`. Raises RuntimeError when the kernel fails."""
    out = torch.empty_like(query) if out is None else out
    _, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    status = kernel(
        int(query.dtype == torch.bfloat16),
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        *(t.data_ptr() for t in offsets),
        seq_lens.shape[0],
        num_q_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
        *extra,
    )
    if status:
        raise RuntimeError(f"CPU paged {what} attention failed with status {status} (2: out of memory)")
    return out


def _checked_library(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_seqs: int,
    supported: Callable[[torch.dtype, int, int, int], bool],
) -> ctypes.CDLL:
    """The kernel library, after checking the arguments both kernels share (Raises as they do)."""
    lib = load_library()
    if lib is None:
        raise RuntimeError("the CPU attention kernel library is not available (see the log for why)")
    _, num_q_heads, head_dim = query.shape
    _, _, num_kv_heads, cache_head_dim = k_cache.shape
    if not supported(query.dtype, head_dim, num_q_heads, num_kv_heads):
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
            f"block_tables {tuple(block_tables.shape)} / seq_lens {tuple(seq_lens.shape)} do not match "
            f"{num_seqs} sequences"
        )
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache), ("seq_lens", seq_lens)):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous CPU tensor")
    if block_tables.device.type != "cpu" or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be a CPU tensor with contiguous rows")
    return lib


def check_query_starts(query_starts: torch.Tensor, seq_lens: torch.Tensor, num_rows: int) -> None:
    """Check prefill chunk offsets: int32 `query_starts` `[B + 1]` rise from 0 to `num_rows`, and
    no chunk has more rows than its sequence's context (`seq_lens` `[B]`, tokens).

    Raises:
        ValueError: naming the violated rule.
    """
    lengths = query_starts[1:] - query_starts[:-1]
    if int(query_starts[0]) != 0 or int(query_starts[-1]) != num_rows or int(lengths.min()) < 0:
        raise ValueError(f"query_starts must rise from 0 to the {num_rows} query rows")
    if bool((lengths > seq_lens).any()):
        raise ValueError("a sequence has more query rows than context tokens (seq_lens)")


def check_table_bounds(
    k_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, min_len: int
) -> None:
    """Every length in [min_len, table capacity] and every block id inside the cache (the kernels
    trust both).

    Raises:
        ValueError: a length or block id out of range.
    """
    capacity = block_tables.shape[1] * k_cache.shape[1]
    if int(seq_lens.min()) < min_len or int(seq_lens.max()) > capacity:
        raise ValueError(f"seq_lens must lie in [{min_len}, {capacity}] (the block tables' capacity)")
    if int(block_tables.min()) < 0 or int(block_tables.max()) >= k_cache.shape[0]:
        raise ValueError(f"block ids must lie in [0, {k_cache.shape[0]})")
