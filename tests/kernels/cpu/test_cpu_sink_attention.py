"""Attention sinks (gpt-oss: one logit per query head in the softmax denominator only) in the C
kernels (decode, short chunks, prefill) and the torch reference, against a float64 reference, with
and without a sliding window, and the "cpu" backend against the torch one."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels.cpu import attention as cpu_attention
from batchgen.kernels.cpu import library as cpu_kernels
from batchgen.model.attention import CPUAttentionBackend, TorchAttentionBackend
from tests.kernels.cpu.paged_cases import cached_step, windowed_reference
from tests.kernels.cpu.test_cpu_window_attention import CHUNKS, assert_near, make_case, step_rows

needs_compiler = pytest.mark.skipif(
    cpu_kernels._compiler() is None, reason="no C compiler ($CC, cc, gcc, clang) to build the CPU kernels"
)


def make_sinks(num_heads: int, big: bool) -> torch.Tensor:
    """Sink logits `[num_heads]`: around the scores' size, or (big) far above them on some heads, so
    that a sink holds most of the mass and a kernel that adds it at the wrong maximum overflows or
    loses it."""
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(1))
    if big:
        sinks[::2] += 30.0
    return sinks


@needs_compiler
@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize("window", [None, 7, 40])
@pytest.mark.parametrize("short_chunks", [False, True])
@pytest.mark.parametrize("dtype, head_dim, group", [(torch.float32, 16, 2), (torch.bfloat16, 64, 3)])
def test_prefill_kernel_adds_the_sinks(dtype, head_dim, group, short_chunks, window, big):
    query, k_cache, v_cache, tables, seq_lens, starts = make_case(dtype, head_dim, group, 16)
    sinks = make_sinks(query.shape[1], big)
    scale = head_dim**-0.5
    expected = windowed_reference(query, k_cache, v_cache, tables, seq_lens, starts, scale, window, sinks)
    got = cpu_attention.paged_prefill_attention_cpu(
        query,
        k_cache,
        v_cache,
        tables,
        seq_lens,
        starts,
        scale,
        short_chunks=short_chunks,
        window=window,
        sinks=sinks,
    )
    assert_near(got, expected, dtype)
    # The sinks change the result (a kernel that ignored them would fail above).
    plain = windowed_reference(query, k_cache, v_cache, tables, seq_lens, starts, scale, window)
    assert not torch.allclose(expected, plain, atol=1e-2)


@needs_compiler
@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize("window", [None, 7, 40])
@pytest.mark.parametrize("dtype, head_dim, group", [(torch.float32, 32, 1), (torch.bfloat16, 128, 4)])
def test_decode_kernel_adds_the_sinks(dtype, head_dim, group, window, big):
    chunks = [(n - 1, 1) for n in (1, 2, 7, 8, 9, 40, 41, 130, 300)]
    query, k_cache, v_cache, tables, seq_lens, starts = make_case(dtype, head_dim, group, 5, chunks)
    sinks = make_sinks(query.shape[1], big)
    scale = head_dim**-0.5
    expected = windowed_reference(query, k_cache, v_cache, tables, seq_lens, starts, scale, window, sinks)
    got = cpu_attention.paged_decode_attention_cpu(
        query, k_cache, v_cache, tables, seq_lens, scale, window=window, sinks=sinks
    )
    assert_near(got, expected, dtype)


@needs_compiler
def test_bad_sinks_and_the_amx_kernel_are_refused():
    query, k_cache, v_cache, tables, seq_lens, starts = make_case(torch.float32, 16, 1, 16)
    with pytest.raises(ValueError, match="sinks must be float32 of shape"):
        cpu_attention.paged_prefill_attention_cpu(
            query, k_cache, v_cache, tables, seq_lens, starts, 0.25, sinks=torch.zeros(3)
        )
    with pytest.raises(ValueError, match="amx.*no attention sinks"):
        cpu_attention.paged_prefill_attention_cpu(
            query, k_cache, v_cache, tables, seq_lens, starts, 0.25, kernel="amx", sinks=torch.zeros(2)
        )


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize(
    "backend, prefill", [("torch", None), ("cpu", None), ("cpu", "c"), ("cpu", "sdpa"), ("cpu", "amx")]
)
def test_backends_add_the_sinks(backend, prefill, window):
    """A mixed step (decodes, then chunks with and without a cached prefix) with sinks through the
    torch reference and the "cpu" backend, whatever prefill kernel was measured fastest (AMX's
    buckets take the C kernel, which has the sinks), equals the float64 reference."""
    if backend == "cpu" and cpu_kernels._compiler() is None:
        pytest.skip("no C compiler to build the CPU kernels")
    chunks = [(20, 1), (50, 1), (0, 1), (0, 30), (45, 20), (9, 3), *CHUNKS[3:5]]
    query, k_cache, v_cache, tables, seq_lens, _ = make_case(torch.float32, 16, 2, 16, chunks)
    key, value = step_rows(k_cache, tables, chunks), step_rows(v_cache, tables, chunks)
    meta = cached_step([c for _, c in chunks], seq_lens, tables, num_decodes=3)
    sinks = make_sinks(query.shape[1], big=True)
    attention = TorchAttentionBackend() if backend == "torch" else CPUAttentionBackend()
    if backend == "cpu":
        attention.prefill_by_bucket = attention.prefill_after_prefix_by_bucket = (
            None if prefill is None else [prefill] * 12
        )
    got = attention.forward(query, key, value, k_cache, v_cache, meta, 0.25, window, None, sinks)
    reference = windowed_reference(
        query, k_cache, v_cache, tables, seq_lens, meta.query_start_loc, 0.25, window, sinks
    )
    assert_near(got, reference, torch.float32)
