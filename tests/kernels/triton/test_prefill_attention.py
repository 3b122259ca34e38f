"""paged_prefill_attention against a float64 per-sequence causal softmax and the torch reference backend."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed: the kernel tests need it (Linux x86-64)")

from batchgen.kernels.triton import paged_prefill_attention  # noqa: E402
from batchgen.model.attention import AttentionMetadata, TorchAttentionBackend  # noqa: E402

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def default_chunks(block_size: int) -> list[tuple[int, int]]:
    """(query_len, seq_len) pairs: the chunk is the last query_len of seq_len positions."""
    bs = block_size
    return [
        (1, 1),  # a one-token prompt
        (bs - 1, bs - 1),  # no cached prefix, context one short of a block
        (3, bs),  # a prefix of bs - 3, context exactly one block
        (1, bs + 1),  # a one-token chunk after a prefix of exactly one block
        (bs + 1, 2 * bs),  # prefix bs - 1: the chunk starts just before a block edge
        (20, 150),  # a long prefix: whole tiles before the causal diagonal
    ]


def torch_reference(query, k_cache, v_cache, tables, chunks, helpers):
    """TorchAttentionBackend on the same step (its no-prefix path takes key/value, read back from the cache)."""
    device = query.device
    qlens = [q for q, _ in chunks]
    lens = [n for _, n in chunks]
    starts = [0]
    for q in qlens:
        starts.append(starts[-1] + q)
    key = torch.cat([helpers.gather(k_cache, tables[i], n)[n - q :] for i, (q, n) in enumerate(chunks)])
    value = torch.cat([helpers.gather(v_cache, tables[i], n)[n - q :] for i, (q, n) in enumerate(chunks)])
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=tables,
        num_decodes=0,
        max_query_len=max(qlens),
        max_seq_len=max(lens),
        query_lens_cpu=qlens,
        seq_lens_cpu=lens,
    )
    return TorchAttentionBackend().forward(
        query[: starts[-1]], key, value, k_cache, v_cache, meta, query.shape[-1] ** -0.5
    )


def run_case(
    device,
    helpers,
    gen,
    *,
    dtype,
    head_dim,
    block_size,
    group,
    num_kv_heads,
    chunks=None,
    config=None,
    padding_rows=0,
    strided=False,
):
    chunks = chunks or default_chunks(block_size)
    qlens = [q for q, _ in chunks]
    lens = [n for _, n in chunks]
    num_blocks = sum((n + block_size - 1) // block_size for n in lens) + 2
    k_cache, v_cache = helpers.make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, gen)
    tables = helpers.make_block_tables(lens, block_size, num_blocks, gen, device, strided=strided)
    starts = torch.tensor([0, *qlens], dtype=torch.int64).cumsum(0)
    total = int(starts[-1])
    query = (
        torch.randn(total + padding_rows, group * num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    )
    scale = head_dim**-0.5
    out = torch.full_like(query, float("nan"))

    got = paged_prefill_attention(
        query,
        k_cache,
        v_cache,
        tables,
        starts.to(torch.int32).to(device),
        torch.tensor(lens, dtype=torch.int32, device=device),
        max(qlens),
        scale,
        out=out,
        config=config,
    )

    assert got is out
    assert torch.isnan(out[total:]).all(), "rows outside every chunk must not be written"
    for i, (qlen, n) in enumerate(chunks):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        k = helpers.gather(k_cache, tables[i], n).cpu()
        v = helpers.gather(v_cache, tables[i], n).cpu()
        expected = helpers.naive_attention(query[rows].cpu(), k, v, scale)
        helpers.assert_close(out[rows].cpu(), expected, dtype, f"sequence {i} (chunk {qlen} of {n})")
    reference = torch_reference(query, k_cache, v_cache, tables, chunks, helpers)
    helpers.assert_close(out[:total].cpu(), reference.cpu(), dtype, "vs TorchAttentionBackend")
    return out[:total]


@pytest.mark.parametrize("group, num_kv_heads", [(1, 2), (2, 2), (4, 1), (8, 1)], ids=str)
def test_gqa_ratios(group, num_kv_heads, device, helpers, gen):
    run_case(
        device, helpers, gen, dtype=F16, head_dim=64, block_size=16, group=group, num_kv_heads=num_kv_heads
    )


@pytest.mark.parametrize(
    "dtype, head_dim, block_size",
    [
        (BF16, 128, 16),
        (F32, 128, 16),
        (F16, 80, 16),  # padded to 128
        (BF16, 96, 8),  # padded to 128
        (F16, 256, 32),
        (F32, 64, 8),
        (F16, 64, 32),
        (F32, 16, 16),  # the tiny test models' shapes (fidelity runs on these)
        (F32, 32, 16),
    ],
    ids=str,
)
def test_dtypes_head_dims_block_sizes(dtype, head_dim, block_size, device, helpers, gen):
    run_case(
        device, helpers, gen, dtype=dtype, head_dim=head_dim, block_size=block_size, group=2, num_kv_heads=1
    )


def test_chunk_longer_than_a_row_block(device, helpers, gen):
    """Chunks of 130 tokens need two 128-row blocks; one has a cached prefix, one does not."""
    run_case(
        device,
        helpers,
        gen,
        dtype=F16,
        head_dim=64,
        block_size=16,
        group=2,
        num_kv_heads=1,
        chunks=[(130, 130), (130, 137)],
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_chunks_small_tiles(seed, device, helpers):
    """Random chunk and prefix lengths through 16x16 tiles: many row blocks, diagonals at every offset."""
    gen = torch.Generator().manual_seed(1000 + seed)
    block_size = [8, 16, 32][seed]
    chunks = []
    for _ in range(4):
        qlen = int(torch.randint(1, 41, (), generator=gen))
        prefix = int(torch.randint(0, 51, (), generator=gen))
        chunks.append((qlen, qlen + prefix))
    run_case(
        device,
        helpers,
        gen,
        dtype=F32,
        head_dim=64,
        block_size=block_size,
        group=2,
        num_kv_heads=1,
        chunks=chunks,
        config={"BLOCK_M": 16, "BLOCK_N": 16},
        padding_rows=3,
        strided=seed == 1,
    )


def test_chunked_prefill_equals_whole_prompt(device, helpers, gen):
    """A prompt attended in three chunks over the cache gives the rows of one full causal pass."""
    n, block_size, head_dim = 45, 8, 64
    k_cache, v_cache = helpers.make_cache(8, block_size, 1, head_dim, F32, device, gen)
    table = helpers.make_block_tables([n], block_size, 8, gen, device)
    query = torch.randn(n, 2, head_dim, generator=gen).to(device)
    scale = head_dim**-0.5
    whole = paged_prefill_attention(
        query,
        k_cache,
        v_cache,
        table,
        torch.tensor([0, n], dtype=torch.int32, device=device),
        torch.tensor([n], dtype=torch.int32, device=device),
        n,
        scale,
    )
    pieces = []
    for start, end in [(0, 17), (17, 18), (18, 45)]:
        pieces.append(
            paged_prefill_attention(
                query[start:end],
                k_cache,
                v_cache,
                table,
                torch.tensor([0, end - start], dtype=torch.int32, device=device),
                torch.tensor([end], dtype=torch.int32, device=device),
                end - start,
                scale,
            )
        )
    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-5, rtol=1e-5)


def test_input_checks(device, helpers, gen):
    k_cache, v_cache = helpers.make_cache(4, 16, 2, 64, F16, device, gen)
    query = torch.randn(6, 4, 64, generator=gen).half().to(device)
    tables = torch.zeros(2, 2, dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 2, 6], dtype=torch.int32, device=device)
    lens = torch.tensor([3, 5], dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="query_start_loc"):
        paged_prefill_attention(query, k_cache, v_cache, tables, qsl.long(), lens, 4, 0.1)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(query, k_cache, v_cache, tables, qsl[:2], lens, 4, 0.1)
    with pytest.raises(ValueError, match="block_tables"):
        paged_prefill_attention(query, k_cache, v_cache, tables[:1], qsl, lens, 4, 0.1)
    with pytest.raises(ValueError, match="max_query_len"):
        paged_prefill_attention(query, k_cache, v_cache, tables, qsl, lens, 0, 0.1)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_prefill_attention(query[:, :3], k_cache, v_cache, tables, qsl, lens, 4, 0.1)
    with pytest.raises(TypeError, match="query dtype"):
        paged_prefill_attention(query.bfloat16(), k_cache, v_cache, tables, qsl, lens, 4, 0.1)
    with pytest.raises(ValueError, match="out must have"):
        paged_prefill_attention(query, k_cache, v_cache, tables, qsl, lens, 4, 0.1, out=query[:5])
