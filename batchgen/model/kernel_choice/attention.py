"""The measured choice of prefill attention: batchgen's kernels or torch's SDPA, per chunk length.

The C kernels read the paged cache in place and serve many chunks in one call:
`paged_prefill_attention.c` on AVX-512 (or plain vector) arithmetic everywhere, and
`amx_prefill_attention.c` on AMX tiles where the CPU has them. torch's CPU SDPA runs oneDNN's
matrix kernels and takes one call a chunk. Which one wins, and from what chunk length, depends on
the machine, so `tune_prefill_attention` times them on the model's head shapes at each row bucket,
for a chunk of that many tokens with no cached prefix and for one that continues a cached prefix,
and the "cpu" backend runs each chunk with the fastest (`CPUAttentionBackend.prefill_by_bucket`,
`prefill_after_prefix_by_bucket`).

On CUDA the same question stands between the Triton chunked-prefill kernel and torch's SDPA (its
flash-attention kernels) for a chunk with no cached prefix, where SDPA can run on the chunk's own K/V:
`tune_triton_prefill_attention`, read by `TritonAttentionBackend.prefill_by_bucket`. On an H200 SDPA
runs a long causal prompt faster than the Triton kernel (measured: docs/benchmarks.md), while short
chunks pay SDPA's one call a chunk.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from batchgen.kernels.cpu import attention as cpu_attention
from batchgen.kernels.registry import Run, Setup, TuningTable, buckets_up_to, choose
from batchgen.model.attention.base import AttentionMetadata
from batchgen.model.attention.sdpa import causal_attention, gather_context
from batchgen.model.attention.torch_backend import TorchAttentionBackend

_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


# Chunks per timed call: the C kernel serves a step's chunks in one call and SDPA takes one call
# each, so the fixed cost of a C call (its checks, the thread pool's wake-up) is shared as in a
# step that holds several prompts. A step holds at most max_num_batched_tokens rows, so long chunks
# come fewer to a step: `_chunks`.
_CHUNKS = 4
_CHUNK_ROWS = 256  # a timed call holds _CHUNKS chunks up to _CHUNK_ROWS / _CHUNKS rows, then fewer


def _chunks(rows: int) -> int:
    """Chunks of `rows` rows in one timed call: `_CHUNKS` for short ones, down to 1 from `_CHUNK_ROWS`."""
    return max(1, min(_CHUNKS, _CHUNK_ROWS // rows))


def tune_prefill_attention(
    table: TuningTable,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    max_rows: int,
    block_size: int = 16,
    prefix: bool = False,
) -> list[str]:
    """The fastest prefill attention ("c", "amx" where the AMX kernel applies, or "sdpa") at each row
    bucket up to `max_rows`, for a chunk of that many tokens with no cached prefix, or with `prefix`
    one of as many tokens already in the cache (a prompt continued by chunked prefill): from `table`
    or measured (added to `table`).

    Each timed call computes the attention of `_chunks(rows)` such chunks, each `[rows, num_heads,
    head_dim]` queries over their context's K/V (`[rows or 2 * rows, num_kv_heads, head_dim]`): the C
    kernel in one call, reading the K/V from a paged cache of `block_size`-token blocks in shuffled
    order as in a running engine; SDPA one call a chunk, on the chunk's own K/V or (with a prefix)
    on the context gathered from the cache as the torch backend does. Both are checked against the
    float32 SDPA result, and one that differs or raises is dropped. Times are per chunk.
    """
    generator = torch.Generator().manual_seed(0)
    scale = head_dim**-0.5
    heads = (num_heads, num_kv_heads, head_dim, dtype, block_size)

    @functools.lru_cache(maxsize=1)  # one bucket's case at a time: 2,048 rows of context are megabytes
    def data(rows: int) -> dict[str, torch.Tensor]:
        return _prefill_case(rows, 2 * rows if prefix else rows, *heads, generator)

    def kernel_setup(kernel: str) -> Setup:
        def setup(rows: int) -> Run:
            d, out = data(rows), torch.empty_like(data(rows)["q"])
            args = (d["q"], d["k_cache"], d["v_cache"], d["tables"], d["seq_lens"], d["starts"], scale)
            return lambda: cpu_attention.paged_prefill_attention_cpu(*args, out=out, kernel=kernel)

        return setup

    def sdpa(rows: int) -> Run:
        return lambda: _sdpa_chunks(data(rows), rows, data(rows)["q"].dtype, scale)

    def reference(rows: int) -> torch.Tensor:
        return _sdpa_chunks(data(rows), rows, torch.float32, scale)

    candidates = {"c": kernel_setup("c"), "sdpa": sdpa}
    if cpu_attention.supports_prefill_amx(dtype, head_dim, num_heads, num_kv_heads):
        candidates["amx"] = kernel_setup("amx")
    shape = f"{num_heads}x{num_kv_heads}x{head_dim}:{str(dtype).removeprefix('torch.')}"
    buckets = buckets_up_to(max_rows)
    chosen = choose(
        table,
        "prefill_attention_after_prefix" if prefix else "prefill_attention",
        shape,
        buckets,
        candidates,
        reference,
        _RTOL.get(dtype, 2e-2),
        # Q K^T and P V over the chunk's causal triangle (and the prefix), 2 flops a multiply-add.
        work=lambda rows: 2.0 * num_heads * head_dim * rows * (rows + 1 + (2 * rows if prefix else 0)),
        calls_per_run=_chunks,
        prune=False,  # SDPA loses short chunks by its per-call cost and may win long ones
    )
    return [chosen[rows] for rows in buckets]


def _sdpa_chunks(case: dict[str, torch.Tensor], rows: int, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """The causal attention of `case`'s chunks of `rows` queries through torch's SDPA in `dtype`, one
    call a chunk: on the chunk's own K/V where `case` holds them ("k", "v": fresh chunks, as a step
    computed them), else on its context gathered from the paged cache, as the torch backend does."""
    q = case["q"].to(dtype)
    out = torch.empty_like(q)
    own_kv = "k" in case
    context = rows if own_kv else int(case["seq_lens"][0])
    for chunk, first in enumerate(range(0, q.shape[0], rows)):
        if own_kv:
            k, v = case["k"][first : first + rows], case["v"][first : first + rows]
        else:
            k = gather_context(case["k_cache"], case["tables"][chunk], context)
            v = gather_context(case["v_cache"], case["tables"][chunk], context)
        out[first : first + rows] = causal_attention(q[first : first + rows], k.to(dtype), v.to(dtype), scale)
    return out


def _prefill_case(
    rows: int,
    context: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int,
    generator: torch.Generator,
) -> dict[str, torch.Tensor]:
    """`_chunks(rows)` chunks of `rows` queries, each the last `rows` tokens of a `context`-token
    sequence whose K/V lie in a paged cache of shuffled `block_size`-token blocks."""
    per_seq = -(-context // block_size)
    chunks = _chunks(rows)
    q = torch.randn(chunks * rows, num_heads, head_dim, generator=generator).to(dtype)
    tables = torch.randperm(chunks * per_seq, generator=generator).view(chunks, per_seq)
    shape = (chunks * per_seq, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    return {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "tables": tables.to(torch.int32),
        "seq_lens": torch.full((chunks,), context, dtype=torch.int32),
        "starts": torch.arange(0, chunks * rows + 1, rows, dtype=torch.int32),
    }


def tune_triton_prefill_attention(
    table: TuningTable,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    max_rows: int,
    device: torch.device,
    block_size: int = 16,
) -> list[str]:
    """The faster attention for a prefill chunk with no cached prefix on the Triton backend, at each
    row bucket up to `max_rows`: "triton" (the chunked-prefill kernel over the paged cache, all of a
    step's chunks in one launch) or "sdpa" (torch's SDPA on the chunk's own K/V, one call a chunk);
    from `table` or measured on `device` (added to `table`).

    Each timed call attends `_chunks(rows)` chunks of `[rows, num_heads, head_dim]` queries over their own
    `[rows, num_kv_heads, head_dim]` K/V, which for the Triton kernel lie in a paged cache of
    `block_size`-token blocks in shuffled order. Both are checked against SDPA in float32; one that
    differs or raises is dropped. Calls end with `torch.cuda.synchronize()` on CUDA, so the timer
    sees the kernels, not their launches. Times are per chunk.

    Raises:
        ImportError: Triton is not installed (the backend that reads the choice needs it anyway).
    """
    from batchgen.kernels.triton import paged_prefill_attention  # needs Triton: only on this path

    generator = torch.Generator().manual_seed(0)
    scale = head_dim**-0.5
    heads = (num_heads, num_kv_heads, head_dim, dtype, block_size)

    @functools.lru_cache(maxsize=1)
    def data(rows: int) -> dict[str, torch.Tensor]:
        case = {name: t.to(device) for name, t in _prefill_case(rows, rows, *heads, generator).items()}
        # The chunks' own K/V, as the step computed them before storing them in the cache.
        k = [gather_context(case["k_cache"], table_row, rows) for table_row in case["tables"]]
        v = [gather_context(case["v_cache"], table_row, rows) for table_row in case["tables"]]
        return {**case, "k": torch.cat(k), "v": torch.cat(v)}

    def triton(rows: int) -> Run:
        d = data(rows)
        out = torch.empty_like(d["q"])
        args = (d["q"], d["k_cache"], d["v_cache"], d["tables"], d["starts"], d["seq_lens"], rows, scale)
        return _synced(lambda: paged_prefill_attention(*args, out=out), device)

    def sdpa(rows: int) -> Run:
        return _synced(lambda: _sdpa_chunks(data(rows), rows, dtype, scale), device)

    def reference(rows: int) -> torch.Tensor:
        return _sdpa_chunks(data(rows), rows, torch.float32, scale)

    shape = f"{num_heads}x{num_kv_heads}x{head_dim}/{block_size}:{str(dtype).removeprefix('torch.')}"
    buckets = buckets_up_to(max_rows)
    chosen = choose(
        table,
        "triton_prefill_attention",
        shape,
        buckets,
        {"triton": triton, "sdpa": sdpa},
        reference,
        _RTOL.get(dtype, 2e-2),
        work=lambda rows: 2.0 * num_heads * head_dim * rows * (rows + 1),
        calls_per_run=_chunks,
        prune=False,  # the lead changes hands with the chunk length
    )
    data.cache_clear()
    return [chosen[rows] for rows in buckets]


def _synced(call: Callable[[], torch.Tensor], device: torch.device) -> Callable[[], torch.Tensor]:
    """`call`, then on CUDA a wait for the device, so that a timer sees the kernels, not their launch.
    (Triton's interpreter, in tests, runs on the host: nothing to wait for.)"""
    if device.type != "cuda":
        return call

    def call_and_wait() -> torch.Tensor:
        out = call()
        torch.cuda.synchronize(device)
        return out

    return call_and_wait


# Context tokens of each sequence in the timed decode steps: about a long-tail job's median.
_DECODE_CONTEXT = 256


def tune_decode_attention(
    table: TuningTable,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    max_rows: int,
    block_size: int = 16,
) -> list[str]:
    """The faster decode attention ("c", the C kernel, or "torch", the gather + SDPA path) at each
    row bucket (decoding sequences in the step) up to `max_rows`: from `table` or measured.

    Each sequence has `_DECODE_CONTEXT` tokens in a paged cache of `block_size`-token blocks in
    shuffled order; queries `[rows, num_heads, head_dim]`. The torch path keeps its per-step groups
    between calls, as the later layers of a step do. Both are checked against the torch path in
    float32.
    """
    generator = torch.Generator().manual_seed(0)
    scale = head_dim**-0.5
    per_seq = -(-_DECODE_CONTEXT // block_size)
    prepared: dict[int, dict] = {}

    def data(rows: int) -> dict:
        if rows not in prepared:
            prepared.clear()
            shape = (rows * per_seq, block_size, num_kv_heads, head_dim)
            k_cache = torch.randn(shape, generator=generator).to(dtype)
            v_cache = torch.randn(shape, generator=generator).to(dtype)
            tables = torch.randperm(rows * per_seq, generator=generator).view(rows, per_seq).to(torch.int32)
            no_slots = torch.empty(0, dtype=torch.int64)

            def meta() -> AttentionMetadata:
                return AttentionMetadata.decodes(no_slots, tables, _DECODE_CONTEXT)

            prepared[rows] = {
                "q": torch.randn(rows, num_heads, head_dim, generator=generator).to(dtype),
                "k_cache": k_cache,
                "v_cache": v_cache,
                "tables": tables,
                "seq_lens": torch.full((rows,), _DECODE_CONTEXT, dtype=torch.int32),
                "meta": meta,
            }
        return prepared[rows]

    def c_kernel(rows: int) -> Run:
        d = data(rows)
        return lambda: cpu_attention.paged_decode_attention_cpu(
            d["q"], d["k_cache"], d["v_cache"], d["tables"], d["seq_lens"], scale
        )

    def torch_path(rows: int) -> Run:
        d = data(rows)
        meta = d["meta"]()
        return lambda: TorchAttentionBackend._decode(d["q"], d["k_cache"], d["v_cache"], meta, scale)

    def reference(rows: int) -> torch.Tensor:
        d = data(rows)
        q, k, v = d["q"].float(), d["k_cache"].float(), d["v_cache"].float()
        return TorchAttentionBackend._decode(q, k, v, d["meta"](), scale)

    element_size = torch.empty((), dtype=dtype).element_size()
    shape = f"{num_heads}x{num_kv_heads}x{head_dim}@{_DECODE_CONTEXT}:{str(dtype).removeprefix('torch.')}"
    buckets = buckets_up_to(max_rows)
    chosen = choose(
        table,
        "decode_attention",
        shape,
        buckets,
        {"c": c_kernel, "torch": torch_path},
        reference,
        _RTOL.get(dtype, 2e-2),
        # Bytes of K and V read: the decode step's cost is reading the cache.
        work=lambda rows: 2.0 * rows * _DECODE_CONTEXT * num_kv_heads * head_dim * element_size,
        unit="byte",
    )
    return [chosen[rows] for rows in buckets]
