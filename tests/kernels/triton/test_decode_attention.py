"""paged_decode_attention against a float64 per-sequence softmax and the torch reference backend."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed: the kernel tests need it (Linux x86-64)")

from batchgen.kernels.triton import choose_num_splits, paged_decode_attention  # noqa: E402
from batchgen.model.attention import AttentionMetadata, TorchAttentionBackend  # noqa: E402

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def context_lengths(block_size: int) -> list[int]:
    # 1, block edges, several blocks, and more than one 128-token tile.
    return [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 130]


def torch_reference(query, k_cache, v_cache, block_tables, seq_lens, scale):
    lens = seq_lens.tolist()
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=query.device),
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32, device=query.device),
        seq_lens=seq_lens,
        block_tables=block_tables,
        num_decodes=len(lens),
        max_query_len=1,
        max_seq_len=max(lens),
        query_lens_cpu=[1] * len(lens),
        seq_lens_cpu=lens,
    )
    return TorchAttentionBackend().forward(query, None, None, k_cache, v_cache, meta, scale)


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
    num_splits,
    lens=None,
    config=None,
    strided=False,
):
    lens = lens or context_lengths(block_size)
    num_blocks = sum((n + block_size - 1) // block_size for n in lens) + 3
    k_cache, v_cache = helpers.make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, gen)
    tables = helpers.make_block_tables(lens, block_size, num_blocks, gen, device, strided=strided)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    query = torch.randn(len(lens), group * num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    scale = head_dim**-0.5

    out = paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, scale, num_splits, config=config)

    assert out.shape == query.shape and out.dtype == dtype
    for i, n in enumerate(lens):
        k = helpers.gather(k_cache, tables[i], n)
        v = helpers.gather(v_cache, tables[i], n)
        expected = helpers.naive_attention(query[i : i + 1].cpu(), k.cpu(), v.cpu(), scale)[0]
        helpers.assert_close(out[i].cpu(), expected, dtype, f"sequence {i} (context {n})")
    reference = torch_reference(query, k_cache, v_cache, tables, seq_lens, scale)
    helpers.assert_close(out.cpu(), reference.cpu(), dtype, "vs TorchAttentionBackend")
    return out


@pytest.mark.parametrize("group, num_kv_heads", [(1, 2), (2, 2), (4, 1), (8, 1)], ids=lambda x: str(x))
def test_gqa_ratios(group, num_kv_heads, device, helpers, gen):
    run_case(
        device,
        helpers,
        gen,
        dtype=F16,
        head_dim=64,
        block_size=16,
        group=group,
        num_kv_heads=num_kv_heads,
        num_splits=1,
    )


@pytest.mark.parametrize(
    "dtype, head_dim, block_size, group",
    [
        (BF16, 128, 16, 2),
        (F32, 128, 16, 2),
        (F16, 80, 16, 2),  # padded to 128
        (BF16, 96, 8, 4),  # padded to 128
        (F16, 256, 32, 2),
        (F32, 64, 8, 1),
        (F16, 64, 32, 4),
        (F32, 16, 16, 4),  # the tiny test models' shapes (fidelity runs on these)
        (F32, 32, 16, 2),
    ],
    ids=str,
)
def test_dtypes_head_dims_block_sizes(dtype, head_dim, block_size, group, device, helpers, gen):
    run_case(
        device,
        helpers,
        gen,
        dtype=dtype,
        head_dim=head_dim,
        block_size=block_size,
        group=group,
        num_kv_heads=1,
        num_splits=1,
    )


@pytest.mark.parametrize(
    "dtype, head_dim, block_size, num_splits, block_n",
    [
        (F16, 64, 16, 2, None),
        (F16, 64, 8, 5, 16),  # several 16-token tiles per split, tiles spanning two blocks
        (BF16, 80, 32, 3, 16),  # tiles of half a block
        (F32, 128, 16, 16, None),  # most splits empty (32-token tiles): the merge must ignore them
    ],
    ids=str,
)
def test_split_context_matches(dtype, head_dim, block_size, num_splits, block_n, device, helpers, gen):
    config = {"BLOCK_N": block_n} if block_n else None
    run_case(
        device,
        helpers,
        gen,
        dtype=dtype,
        head_dim=head_dim,
        block_size=block_size,
        group=4,
        num_kv_heads=1,
        num_splits=num_splits,
        config=config,
    )


def test_split_and_unsplit_agree(device, helpers, gen):
    """Same inputs through one program per head and through the split + merge path."""
    lens = [200, 7, 64]
    common = dict(dtype=F32, head_dim=64, block_size=16, group=2, num_kv_heads=1, lens=lens)
    state = gen.get_state()
    whole = run_case(device, helpers, gen, num_splits=1, **common)
    gen.set_state(state)
    split = run_case(device, helpers, gen, num_splits=4, config={"BLOCK_N": 16}, **common)
    torch.testing.assert_close(whole, split, atol=1e-5, rtol=1e-5)


def test_strided_block_tables_and_auto_splits(device, helpers, gen):
    from batchgen.kernels.triton.decode_attention import num_sms

    lens = [600, 9]
    # The auto choice must split here (2 programs; the table spans 608 tokens), on CPU and on a GPU.
    assert choose_num_splits(len(lens), 1, 608, num_sms(device)) > 1
    run_case(
        device,
        helpers,
        gen,
        dtype=F16,
        head_dim=64,
        block_size=16,
        group=2,
        num_kv_heads=1,
        num_splits=None,
        lens=lens,
        strided=True,
    )


def test_writes_into_out(device, helpers, gen):
    k_cache, v_cache = helpers.make_cache(8, 16, 1, 64, F16, device, gen)
    tables = helpers.make_block_tables([20, 33], 16, 8, gen, device)
    seq_lens = torch.tensor([20, 33], dtype=torch.int32, device=device)
    query = torch.randn(2, 2, 64, generator=gen).half().to(device)
    for splits in (1, 3):
        out = torch.full((2, 2, 64), float("nan"), dtype=F16, device=device)
        got = paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, 0.125, splits, out=out)
        assert got is out and torch.isfinite(out).all()
        expected = torch_reference(query, k_cache, v_cache, tables, seq_lens, 0.125)
        torch.testing.assert_close(out, expected, atol=4e-3, rtol=4e-3)


def test_choose_num_splits():
    # Many (sequence, KV head) pairs already fill 132 SMs: no split.
    assert choose_num_splits(64, 8, 4096, 132) == 1
    # One long sequence: split up to filling the GPU, bounded by the 64 cap.
    assert choose_num_splits(1, 8, 32768, 132) == 33
    assert choose_num_splits(1, 1, 1 << 20, 132) == 64
    # Short contexts are not cut below 256 tokens a split.
    assert choose_num_splits(1, 8, 512, 132) == 2
    assert choose_num_splits(1, 8, 100, 132) == 1


def test_input_checks(device, helpers, gen):
    k_cache, v_cache = helpers.make_cache(4, 16, 2, 64, F16, device, gen)
    query = torch.randn(2, 4, 64, generator=gen).half().to(device)
    tables = torch.zeros(2, 2, dtype=torch.int32, device=device)
    lens = torch.tensor([3, 5], dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match="block_tables"):
        paged_decode_attention(query, k_cache, v_cache, tables.long(), lens, 0.1)
    with pytest.raises(TypeError, match="query dtype"):
        paged_decode_attention(query.float(), k_cache, v_cache, tables, lens, 0.1)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_decode_attention(query[:, :3], k_cache, v_cache, tables, lens, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(query[..., :32], k_cache, v_cache, tables, lens, 0.1)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(query, k_cache, v_cache, tables, lens[:1], 0.1)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.1, num_splits=0)
    with pytest.raises(ValueError, match="scale"):
        paged_decode_attention(query, k_cache, v_cache, tables, lens, float("nan"))
    with pytest.raises(ValueError, match="stride 1"):
        head_dim_strided = torch.randn(2, 64, 4, generator=gen).half().to(device).transpose(1, 2)
        paged_decode_attention(head_dim_strided, k_cache, v_cache, tables, lens, 0.1)
    with pytest.raises(ValueError, match="at most 256"):
        big_k, big_v = helpers.make_cache(1, 8, 1, 512, F16, device, gen)
        paged_decode_attention(
            torch.zeros(1, 1, 512, dtype=F16, device=device), big_k, big_v, tables[:1], lens[:1], 0.1
        )
