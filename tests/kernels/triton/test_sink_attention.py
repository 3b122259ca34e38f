"""Attention sinks (gpt-oss's per-head logits in the softmax denominator only) in the Triton decode
(unsplit and split, where the merge adds them) and prefill kernels, under TRITON_INTERPRET=1 on a
CPU, with and without a sliding window, against the float64 reference and the torch backend."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed: the kernel tests need it (Linux x86-64)")

from batchgen.kernels.triton import paged_decode_attention, paged_prefill_attention  # noqa: E402
from batchgen.model.attention import TorchAttentionBackend  # noqa: E402
from batchgen.model.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from tests.kernels.cpu.paged_cases import cached_step, windowed_reference  # noqa: E402
from tests.kernels.cpu.test_cpu_sink_attention import make_sinks  # noqa: E402
from tests.kernels.cpu.test_cpu_window_attention import step_rows  # noqa: E402
from tests.kernels.triton.test_window_attention import CHUNKS, DEVICE, make_case  # noqa: E402


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize("window", [None, 7])
def test_prefill_kernel_adds_the_sinks(window, big):
    query, k_cache, v_cache, tables, seq_lens, starts = make_case(CHUNKS, 5)
    sinks = make_sinks(query.shape[1], big)
    expected = windowed_reference(query, k_cache, v_cache, tables, seq_lens, starts, 0.25, window, sinks)
    got = paged_prefill_attention(
        *on_device(query, k_cache, v_cache, tables, starts, seq_lens),
        max(c for _, c in CHUNKS),
        0.25,
        window=window,
        sinks=sinks.to(DEVICE),
    )
    torch.testing.assert_close(got.cpu().double(), expected, rtol=1e-4, atol=1e-4)
    plain = windowed_reference(query, k_cache, v_cache, tables, seq_lens, starts, 0.25, window)
    assert not torch.allclose(expected, plain, atol=1e-2)


@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 7])
def test_decode_kernel_adds_the_sinks(window, num_splits, big):
    chunks = [(n - 1, 1) for n in (1, 6, 7, 8, 24, 90)]
    query, k_cache, v_cache, tables, seq_lens, starts = make_case(chunks, 5)
    sinks = make_sinks(query.shape[1], big)
    expected = windowed_reference(query, k_cache, v_cache, tables, seq_lens, starts, 0.25, window, sinks)
    got = paged_decode_attention(
        *on_device(query, k_cache, v_cache, tables, seq_lens),
        0.25,
        num_splits,
        window=window,
        sinks=sinks.to(DEVICE),
    )
    torch.testing.assert_close(got.cpu().double(), expected, rtol=1e-4, atol=1e-4)


def test_bad_sinks_are_refused():
    query, k_cache, v_cache, tables, seq_lens, _ = make_case([(4, 1)], 16)
    with pytest.raises(ValueError, match=r"sinks must be a contiguous \[4\] tensor"):
        paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, 0.25, sinks=torch.zeros(2))
    with pytest.raises(TypeError, match="sinks must have dtype float32"):
        paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, 0.25, sinks=torch.zeros(4).double())


@pytest.mark.parametrize("window", [None, 7])
def test_triton_backend_matches_torch_with_sinks(window):
    """A mixed step (decodes, then chunks with and without a cached prefix) with sinks: the Triton
    backend equals the torch reference."""
    chunks = [(20, 1), (50, 1), (0, 1), (0, 30), (45, 20), (9, 3)]
    query, k_cache, v_cache, tables, seq_lens, _ = make_case(chunks, 16)
    key, value = step_rows(k_cache, tables, chunks), step_rows(v_cache, tables, chunks)
    sinks = make_sinks(query.shape[1], big=True)
    meta = cached_step([c for _, c in chunks], seq_lens, tables, num_decodes=3)
    expected = TorchAttentionBackend().forward(
        query, key, value, k_cache, v_cache, meta, 0.25, window, None, sinks
    )
    meta.scratch.clear()
    got = TritonAttentionBackend().forward(
        query, key, value, k_cache, v_cache, meta, 0.25, window, None, sinks
    )
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
