"""Sliding-window attention in the C kernels (decode, short chunks, prefill) against a float64
reference, the keys before every window never read, and the "cpu" backend against the torch one."""

from __future__ import annotations

import pytest
import torch

from batchgen.kernels.cpu import attention as cpu_attention
from batchgen.kernels.cpu import library as cpu_kernels
from batchgen.model.attention import CPUAttentionBackend, TorchAttentionBackend
from tests.kernels.cpu.paged_cases import (
    cached_step,
    poison_before_windows,
    shuffled_caches,
    windowed_reference,
)

pytestmark = pytest.mark.skipif(
    cpu_kernels._compiler() is None, reason="no C compiler ($CC, cc, gcc, clang) to build the CPU kernels"
)

# (cached prefix, chunk) in tokens: chunks inside and across 32-row tiles and 64/128-key chunks,
# after prefixes shorter and longer than the windows, and short chunks (<= 8 rows).
CHUNKS = [(0, 1), (0, 40), (5, 64), (100, 50), (0, 130), (250, 7), (300, 1), (37, 5), (3, 2), (70, 33)]
# 1: only the row's own key; 7 and 40 cut inside blocks and key chunks; 129 spans a tile's rows
# across two key chunks; 1000: longer than every context (the global result).
WINDOWS = [1, 7, 40, 129, 1000]


def make_case(dtype, head_dim, group, block_size, chunks=CHUNKS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [prefix + chunk for prefix, chunk in chunks]
    k_cache, v_cache, tables = shuffled_caches(seq_lens, dtype, head_dim, block_size, 2, gen)
    query = (torch.randn(sum(c for _, c in chunks), 2 * group, head_dim, generator=gen) * 2).to(dtype)
    starts = torch.tensor([0] + [c for _, c in chunks], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return query, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), starts


def assert_near(got, expected, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    else:  # bf16 storage (and, on AVX512-BF16, probabilities rounded to bf16)
        torch.testing.assert_close(got.double(), expected, rtol=2**-8, atol=5e-3)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("short_chunks", [False, True])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("dtype, head_dim, group", [(torch.float32, 16, 2), (torch.bfloat16, 64, 3)])
def test_prefill_kernel_honours_the_window(dtype, head_dim, group, block_size, short_chunks, window):
    query, k_cache, v_cache, tables, seq_lens, starts = make_case(dtype, head_dim, group, block_size)
    expected = windowed_reference(query, k_cache, v_cache, tables, seq_lens, starts, head_dim**-0.5, window)
    poison_before_windows(k_cache, v_cache, tables, seq_lens, starts, window)
    got = cpu_attention.paged_prefill_attention_cpu(
        query,
        k_cache,
        v_cache,
        tables,
        seq_lens,
        starts,
        head_dim**-0.5,
        short_chunks=short_chunks,
        window=window,
    )
    assert_near(got, expected, dtype)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("dtype, head_dim, group", [(torch.float32, 32, 1), (torch.bfloat16, 128, 4)])
def test_decode_kernel_honours_the_window(dtype, head_dim, group, block_size, window):
    chunks = [(n - 1, 1) for n in (1, 2, 7, 8, 9, 40, 41, 130, 300)]
    query, k_cache, v_cache, tables, seq_lens, starts = make_case(dtype, head_dim, group, block_size, chunks)
    expected = windowed_reference(query, k_cache, v_cache, tables, seq_lens, starts, head_dim**-0.5, window)
    poison_before_windows(k_cache, v_cache, tables, seq_lens, starts, window)
    got = cpu_attention.paged_decode_attention_cpu(
        query, k_cache, v_cache, tables, seq_lens, head_dim**-0.5, window=window
    )
    assert_near(got, expected, dtype)


def test_no_window_reads_the_whole_context():
    """window=None is the global result (and a NaN anywhere in the context reaches the output)."""
    query, k_cache, v_cache, tables, seq_lens, starts = make_case(torch.float32, 16, 2, 16)
    expected = windowed_reference(query, k_cache, v_cache, tables, seq_lens, starts, 0.25)
    got = cpu_attention.paged_prefill_attention_cpu(query, k_cache, v_cache, tables, seq_lens, starts, 0.25)
    assert_near(got, expected, torch.float32)
    poison_before_windows(k_cache, v_cache, tables, seq_lens, starts, 1)
    got = cpu_attention.paged_prefill_attention_cpu(query, k_cache, v_cache, tables, seq_lens, starts, 0.25)
    assert torch.isnan(got[starts[3] :]).any()


def test_bad_windows_and_the_amx_kernel_are_refused():
    query, k_cache, v_cache, tables, seq_lens, starts = make_case(torch.float32, 16, 1, 16)
    with pytest.raises(ValueError, match="window must be None or at least 1"):
        cpu_attention.paged_prefill_attention_cpu(
            query, k_cache, v_cache, tables, seq_lens, starts, 0.25, window=0
        )
    with pytest.raises(ValueError, match="amx.*no sliding window"):
        cpu_attention.paged_prefill_attention_cpu(
            query, k_cache, v_cache, tables, seq_lens, starts, 0.25, kernel="amx", window=8
        )


def step_rows(cache, tables, chunks):
    """The chunks' own K (or V) rows `[T, Hkv, D]`, read back from `cache` at their positions."""
    block_size = cache.shape[1]
    rows = [
        cache[int(tables[seq, t // block_size]), t % block_size]
        for seq, (prefix, chunk) in enumerate(chunks)
        for t in range(prefix, prefix + chunk)
    ]
    return torch.stack(rows)


@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("window", [None, 7, 40])
@pytest.mark.parametrize("prefill", [None, "c", "sdpa", "amx"])
def test_cpu_backend_matches_torch_backend_with_windows(window, softcap, prefill):
    """A mixed step (decodes, then chunks with and without a cached prefix) through the "cpu"
    backend equals the torch reference's, with a window and Gemma 2's softcap (which the C kernels
    leave to the torch path), whatever prefill kernel was measured fastest (a windowed layer's
    chunks on AMX's buckets run the C kernel, which has the window)."""
    if (
        prefill == "amx"
        and window is None
        and not cpu_attention.supports_prefill_amx(torch.float32, 16, 4, 2)
    ):
        pytest.skip("no AMX prefill kernel for these shapes here")
    chunks = [(20, 1), (50, 1), (0, 1), (0, 30), (45, 20), (9, 3)]
    query, k_cache, v_cache, tables, seq_lens, _ = make_case(torch.float32, 16, 2, 16, chunks)
    key, value = step_rows(k_cache, tables, chunks), step_rows(v_cache, tables, chunks)
    meta = cached_step([c for _, c in chunks], seq_lens, tables, num_decodes=3)
    expected = TorchAttentionBackend().forward(
        query, key, value, k_cache, v_cache, meta, 0.25, window, softcap
    )
    meta.scratch.clear()
    backend = CPUAttentionBackend()
    backend.prefill_by_bucket = backend.prefill_after_prefix_by_bucket = (
        None if prefill is None else [prefill] * 12
    )
    got = backend.forward(query, key, value, k_cache, v_cache, meta, 0.25, window, softcap)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    reference = windowed_reference(
        query, k_cache, v_cache, tables, seq_lens, meta.query_start_loc, 0.25, window
    )
    if softcap is None:
        assert_near(got, reference, torch.float32)
    else:  # the cap changes the result
        assert not torch.allclose(got.double(), reference, atol=1e-3)
