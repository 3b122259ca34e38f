"""The C paged decode-attention kernel against a float64 reference, its checks, and the engine using it."""

from __future__ import annotations

import pytest
import torch

from batchgen import LLM
from batchgen.kernels.cpu import attention as cpu_attention
from batchgen.kernels.cpu import library as cpu_kernels
from tests.kernels.cpu.paged_cases import assert_cpu_backend_matches_torch, cached_step, shuffled_caches

pytestmark = pytest.mark.skipif(
    cpu_kernels._compiler() is None, reason="no C compiler ($CC, cc, gcc, clang) to build the CPU kernels"
)

# Cover the kernel's paths: one row, rows left after groups of four, exact and partial blocks.
SEQ_LENS = [1, 3, 4, 15, 16, 17, 64, 203]


def make_case(dtype, head_dim, group, block_size, num_kv_heads=2, seed=0):
    """Random caches with the sequences' blocks shuffled over the pool, and wider-than-needed tables."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = shuffled_caches(SEQ_LENS, dtype, head_dim, block_size, num_kv_heads, gen)
    query = (torch.randn(len(SEQ_LENS), num_kv_heads * group, head_dim, generator=gen) * 2).to(dtype)
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    return query, k_cache, v_cache, tables, seq_lens


def reference(query, k_cache, v_cache, tables, seq_lens, scale):
    """Each sequence alone, in float64: gather its rows, repeat K/V over the GQA group, softmax."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    for row, length in enumerate(seq_lens.tolist()):
        slots = [int(tables[row, t // block_size]) * block_size + t % block_size for t in range(length)]
        k = k_cache.reshape(-1, num_kv_heads, k_cache.shape[3])[slots].double().repeat_interleave(group, 1)
        v = v_cache.reshape(-1, num_kv_heads, v_cache.shape[3])[slots].double().repeat_interleave(group, 1)
        scores = torch.einsum("hd,lhd->hl", query[row].double() * scale, k)
        out[row] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("block_size", [16, 5, 1])
@pytest.mark.parametrize("head_dim, group", [(16, 1), (32, 2), (64, 3), (128, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_float64_reference(dtype, head_dim, group, block_size):
    query, k_cache, v_cache, tables, seq_lens = make_case(dtype, head_dim, group, block_size)
    scale = head_dim**-0.5
    got = cpu_attention.paged_decode_attention_cpu(query, k_cache, v_cache, tables, seq_lens, scale)
    expected = reference(query, k_cache, v_cache, tables, seq_lens, scale)
    assert got.shape == query.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    else:  # float32 arithmetic, then one rounding to bf16 (2^-8 relative)
        torch.testing.assert_close(got.double(), expected, rtol=2**-8, atol=2e-3)
    # The first sequence has one context row: its output is that V row, exactly.
    first_v = v_cache[int(tables[0, 0]), 0].repeat_interleave(group, 0)
    assert torch.equal(got[0], first_v)


def test_bf16_output_rounds_to_nearest_even_as_torch():
    """Equal scores (zero query) over two rows give (v0 + v1) / 2 in float32, rounded once like torch."""
    query, k_cache, v_cache, tables, _ = make_case(torch.bfloat16, 64, 3, 16)
    query.zero_()
    seq_lens = torch.full((query.shape[0],), 2, dtype=torch.int32)
    got = cpu_attention.paged_decode_attention_cpu(query, k_cache, v_cache, tables, seq_lens, 0.125)
    for row in range(query.shape[0]):
        block = v_cache[int(tables[row, 0])].float()
        expected = ((block[0] + block[1]) * 0.5).repeat_interleave(3, 0).to(torch.bfloat16)
        assert torch.equal(got[row], expected)


def test_backend_decode_matches_torch_backend():
    """The backend's decode rows (and a mixed step's) equal the torch backend's within float32 error."""
    query, k_cache, v_cache, tables, seq_lens = make_case(torch.float32, 64, 3, 16)
    meta = cached_step([1] * len(SEQ_LENS), seq_lens, tables, num_decodes=len(SEQ_LENS))
    empty = torch.empty(0, 6, 64)
    assert_cpu_backend_matches_torch(query, empty, empty, k_cache, v_cache, meta)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda q, k, v, t, s: s.__setitem__(0, 0), "seq_lens must lie"),
        (lambda q, k, v, t, s: s.__setitem__(0, 10_000), "seq_lens must lie"),
        (lambda q, k, v, t, s: t.__setitem__((0, 0), k.shape[0]), "block ids must lie"),
        (lambda q, k, v, t, s: t.__setitem__((0, 0), -1), "block ids must lie"),
    ],
)
def test_out_of_bounds_tables_are_refused(change, message):
    query, k_cache, v_cache, tables, seq_lens = make_case(torch.float32, 64, 3, 16)
    change(query, k_cache, v_cache, tables, seq_lens)
    with pytest.raises(ValueError, match=message):
        cpu_attention.paged_decode_attention_cpu(query, k_cache, v_cache, tables, seq_lens, 0.125)


def test_unsupported_shapes_are_refused():
    assert not cpu_attention.supports(torch.float16, 64, 9, 3)
    assert not cpu_attention.supports(torch.float32, 80, 9, 3)
    assert not cpu_attention.supports(torch.float32, 64, 9, 2)  # not a whole GQA group
    query, k_cache, v_cache, tables, seq_lens = make_case(torch.float32, 64, 3, 16)
    with pytest.raises(ValueError, match="no CPU kernel"):
        cpu_attention.paged_decode_attention_cpu(query.half(), k_cache, v_cache, tables, seq_lens, 0.125)
    with pytest.raises(ValueError, match="int32"):
        cpu_attention.paged_decode_attention_cpu(query, k_cache, v_cache, tables.long(), seq_lens, 0.125)


def test_engine_uses_the_kernel_by_default_on_cpu(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu")
    assert llm.llm_engine.runner.backend.name == "cpu"
