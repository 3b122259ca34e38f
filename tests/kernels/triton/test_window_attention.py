"""Sliding windows in the Triton decode and prefill kernels (under TRITON_INTERPRET=1 on a CPU)
against a float64 reference, with the keys before every window poisoned (a kernel that read one
would give NaN), and the Triton backend's refusal of Gemma 2's softcap."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed: the kernel tests need it (Linux x86-64)")

from batchgen.kernels.triton import paged_decode_attention, paged_prefill_attention  # noqa: E402
from batchgen.model.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from tests.kernels.cpu.paged_cases import (  # noqa: E402
    poison_before_windows,
    shuffled_caches,
    windowed_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (cached prefix, chunk): 32-row query blocks and 16-key tiles (float32) cut anywhere.
CHUNKS = [(0, 1), (0, 40), (5, 20), (60, 9), (17, 33)]


def make_case(chunks, block_size, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [prefix + chunk for prefix, chunk in chunks]
    k_cache, v_cache, tables = shuffled_caches(seq_lens, torch.float32, 16, block_size, 2, gen)
    query = torch.randn(sum(c for _, c in chunks), 4, 16, generator=gen) * 2
    starts = torch.tensor([0] + [c for _, c in chunks], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return query, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), starts


@pytest.mark.parametrize("window", [1, 7, 23, 500])
@pytest.mark.parametrize("block_size", [16, 5])
def test_prefill_kernel_honours_the_window(window, block_size):
    query, k_cache, v_cache, tables, seq_lens, starts = make_case(CHUNKS, block_size)
    expected = windowed_reference(query, k_cache, v_cache, tables, seq_lens, starts, 0.25, window)
    poison_before_windows(k_cache, v_cache, tables, seq_lens, starts, window)
    got = paged_prefill_attention(
        query.to(DEVICE),
        k_cache.to(DEVICE),
        v_cache.to(DEVICE),
        tables.to(DEVICE),
        starts.to(DEVICE),
        seq_lens.to(DEVICE),
        max(c for _, c in CHUNKS),
        0.25,
        window=window,
    )
    torch.testing.assert_close(got.cpu().double(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [1, 7, 23, 500])
def test_decode_kernel_honours_the_window(window, num_splits):
    chunks = [(n - 1, 1) for n in (1, 6, 7, 8, 24, 90)]
    query, k_cache, v_cache, tables, seq_lens, starts = make_case(chunks, 5)
    expected = windowed_reference(query, k_cache, v_cache, tables, seq_lens, starts, 0.25, window)
    poison_before_windows(k_cache, v_cache, tables, seq_lens, starts, window)
    got = paged_decode_attention(
        query.to(DEVICE),
        k_cache.to(DEVICE),
        v_cache.to(DEVICE),
        tables.to(DEVICE),
        seq_lens.to(DEVICE),
        0.25,
        num_splits,
        window=window,
    )
    torch.testing.assert_close(got.cpu().double(), expected, rtol=1e-4, atol=1e-4)


def test_bad_windows_and_a_softcap_are_refused():
    query, k_cache, v_cache, tables, seq_lens, _ = make_case([(4, 1)], 16)
    with pytest.raises(ValueError, match="window must be None or an int >= 1"):
        paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, 0.25, window=0)
    with pytest.raises(ValueError, match="no attention logit soft-capping.*attention_backend='torch'"):
        TritonAttentionBackend().check_layer(None, 50.0)
    TritonAttentionBackend().check_layer(4096, None)  # a window alone is fine
