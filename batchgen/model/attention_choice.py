"""The measured choice of prefill attention on the CPU: batchgen's C kernel or torch's SDPA.

The C kernel (`kernels/cpu/csrc/paged_prefill_attention.c`) reads the paged cache in place and
serves many chunks in one call, so it wins on short chunks; torch's CPU SDPA runs oneDNN's
matrix kernels (AMX tiles where the CPU has them) and can win on long ones. Which one wins, and
from what chunk length, depends on the machine, so `tune_prefill_attention` times both on the
model's head shapes at each row bucket (a chunk of that many tokens with no cached prefix) and
the "cpu" backend runs each such chunk with the faster (`CPUAttentionBackend.prefill_by_bucket`).
"""

from __future__ import annotations

import torch

from batchgen.kernels.cpu import attention as cpu_attention
from batchgen.kernels.registry import TuningTable, buckets_up_to, choose
from batchgen.model.attention.base import AttentionMetadata
from batchgen.model.attention.sdpa import causal_attention
from batchgen.model.attention.torch_backend import TorchAttentionBackend

_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


# Chunks per timed call: the C kernel serves a step's chunks in one call and SDPA takes one call
# each, so the fixed cost of a C call (its checks, the thread pool's wake-up) is shared as in a
# step that holds several prompts.
_CHUNKS = 4


def tune_prefill_attention(
    table: TuningTable,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    max_rows: int,
    block_size: int = 16,
) -> list[str]:
    """The faster prefill attention ("c" or "sdpa") at each row bucket up to `max_rows`, for a chunk
    of that many tokens with no cached prefix: from `table` or measured (added to `table`).

    Each timed call computes the causal attention of `_CHUNKS` such chunks, each `[rows, num_heads,
    head_dim]` queries over their own K/V `[rows, num_kv_heads, head_dim]`: the C kernel in one call,
    reading the K/V from a paged cache of `block_size`-token blocks in shuffled order as in a running
    engine; SDPA one call a chunk. Both are checked against the float32 SDPA result, and one that
    differs or raises is dropped. Times are per chunk.
    """
    generator = torch.Generator().manual_seed(0)
    scale = head_dim**-0.5
    prepared: dict[int, dict[str, torch.Tensor]] = {}

    def data(rows: int) -> dict[str, torch.Tensor]:
        if rows not in prepared:
            prepared.clear()
            prepared[rows] = _prefill_chunks(
                rows, num_heads, num_kv_heads, head_dim, dtype, block_size, generator
            )
        return prepared[rows]

    def c_kernel(rows: int):
        d = data(rows)
        out = torch.empty_like(d["q"])
        return lambda: cpu_attention.paged_prefill_attention_cpu(
            d["q"], d["k_cache"], d["v_cache"], d["tables"], d["seq_lens"], d["starts"], scale, out=out
        )

    def per_chunk(rows: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        for first in range(0, q.shape[0], rows):
            chunk = slice(first, first + rows)
            out[chunk] = causal_attention(q[chunk], k[chunk], v[chunk], scale)
        return out

    def sdpa(rows: int):
        d = data(rows)
        return lambda: per_chunk(rows, d["q"], d["k"], d["v"])

    def reference(rows: int) -> torch.Tensor:
        d = data(rows)
        return per_chunk(rows, d["q"].float(), d["k"].float(), d["v"].float())

    shape = f"{num_heads}x{num_kv_heads}x{head_dim}:{str(dtype).removeprefix('torch.')}"
    buckets = buckets_up_to(max_rows)
    chosen = choose(
        table,
        "prefill_attention",
        shape,
        buckets,
        {"c": c_kernel, "sdpa": sdpa},
        reference,
        _RTOL.get(dtype, 2e-2),
        # One chunk's causal triangle: Q K^T and P V, 2 flops a multiply-add each.
        work=lambda rows: 2.0 * num_heads * head_dim * rows * (rows + 1),
        calls_per_run=_CHUNKS,
        prune=False,  # SDPA loses short chunks by its per-call cost and may win long ones
    )
    return [chosen[rows] for rows in buckets]


def _prefill_chunks(
    rows: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int,
    generator: torch.Generator,
) -> dict[str, torch.Tensor]:
    """`_CHUNKS` random prompt chunks of `rows` tokens each: queries `q` `[_CHUNKS x rows, num_heads,
    head_dim]` and keys / values `k`, `v` `[_CHUNKS x rows, num_kv_heads, head_dim]`, the same K/V
    written into a paged cache (`k_cache`, `v_cache`) at blocks in shuffled order (`tables`), and
    the kernel's `seq_lens` and query `starts`."""
    per_seq = -(-rows // block_size)
    tokens = _CHUNKS * rows
    q = torch.randn(tokens, num_heads, head_dim, generator=generator).to(dtype)
    k = torch.randn(tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(tokens, num_kv_heads, head_dim, generator=generator).to(dtype)
    tables = torch.randperm(_CHUNKS * per_seq, generator=generator).view(_CHUNKS, per_seq)
    shape = (_CHUNKS * per_seq, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    position = torch.arange(rows)
    for chunk in range(_CHUNKS):
        slots = tables[chunk, position // block_size] * block_size + position % block_size
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = k[chunk * rows : (chunk + 1) * rows]
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = v[chunk * rows : (chunk + 1) * rows]
    return {
        "q": q,
        "k": k,
        "v": v,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "tables": tables.to(torch.int32),
        "seq_lens": torch.full((_CHUNKS,), rows, dtype=torch.int32),
        "starts": torch.arange(0, tokens + 1, rows, dtype=torch.int32),
    }


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

    def c_kernel(rows: int):
        d = data(rows)
        return lambda: cpu_attention.paged_decode_attention_cpu(
            d["q"], d["k_cache"], d["v_cache"], d["tables"], d["seq_lens"], scale
        )

    def torch_path(rows: int):
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
