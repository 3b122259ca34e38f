"""TritonAttentionBackend against TorchAttentionBackend on whole steps: outputs and cache contents."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed: the kernel tests need it (Linux x86-64)")

from batchgen.model.attention import AttentionMetadata, TorchAttentionBackend, select_backend  # noqa: E402
from batchgen.model.attention.triton_backend import TritonAttentionBackend  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 64, 16


def make_step(seqs, tables, device, padding_rows=0):
    """Metadata for one step. `seqs`: (query_len, seq_len) per sequence, decodes (query_len 1) first."""
    qlens = [q for q, _ in seqs]
    lens = [n for _, n in seqs]
    slots = []
    for i, (qlen, n) in enumerate(seqs):
        for pos in range(n - qlen, n):
            slots.append(int(tables[i, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
    slots += [-1] * padding_rows
    starts = [0]
    for q in qlens:
        starts.append(starts[-1] + q)
    num_decodes = 0
    while num_decodes < len(seqs) and qlens[num_decodes] == 1 and lens[num_decodes] > 1:
        num_decodes += 1
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        num_decodes=num_decodes,
        max_query_len=max(qlens),
        max_seq_len=max(lens),
        query_lens_cpu=qlens,
        seq_lens_cpu=lens,
    )


def tables_for(max_lens, gen):
    """Disjoint random blocks for sequences of at most `max_lens` tokens."""
    blocks = [(n + BLOCK_SIZE - 1) // BLOCK_SIZE for n in max_lens]
    perm = torch.randperm(sum(blocks) + 3, generator=gen).to(torch.int32)
    table = torch.zeros(len(max_lens), max(blocks), dtype=torch.int32)
    at = 0
    for i, b in enumerate(blocks):
        table[i, :b] = perm[at : at + b]
        at += b
    return table, sum(blocks) + 3


def run_both(query, key, value, caches, meta, dtype, helpers, backend=None):
    """Run both backends on copies of the caches; check outputs and resulting caches; keep triton's caches."""
    k_cache, v_cache = caches
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    scale = HEAD_DIM**-0.5
    expected = TorchAttentionBackend().forward(query, key, value, k_ref, v_ref, meta, scale)
    backend = backend or TritonAttentionBackend()
    got = backend.forward(query, key, value, k_cache, v_cache, meta, scale)
    valid = int(meta.query_start_loc[-1])
    assert got.shape == query.shape and got.dtype == query.dtype
    helpers.assert_close(got[:valid].cpu(), expected[:valid].cpu(), dtype, "vs TorchAttentionBackend")
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref), "caches differ after the store"


def random_qkv(num_tokens, dtype, device, gen):
    def draw(heads):
        return torch.randn(num_tokens, heads, HEAD_DIM, generator=gen).to(dtype).to(device)

    return draw(NUM_Q_HEADS), draw(NUM_KV_HEADS), draw(NUM_KV_HEADS)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_mixed_step_with_padding(dtype, device, helpers, gen):
    # Three decodes, a first chunk, a later chunk after a cached prefix, then two padding tokens.
    seqs = [(1, 9), (1, 16), (1, 40), (7, 7), (5, 25)]
    table, num_blocks = tables_for([n for _, n in seqs], gen)
    caches = helpers.make_cache(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype, device, gen)
    meta = make_step(seqs, table, device, padding_rows=2)
    assert meta.num_decodes == 3
    query, key, value = random_qkv(meta.slot_mapping.shape[0], dtype, device, gen)
    run_both(query, key, value, caches, meta, dtype, helpers)


@pytest.mark.parametrize("kind", ["decodes only", "prefills only"])
def test_pure_steps(kind, device, helpers, gen):
    seqs = [(1, 3), (1, 17), (1, 33)] if kind == "decodes only" else [(4, 4), (16, 16), (2, 30)]
    table, num_blocks = tables_for([n for _, n in seqs], gen)
    caches = helpers.make_cache(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float16, device, gen)
    meta = make_step(seqs, table, device)
    query, key, value = random_qkv(meta.slot_mapping.shape[0], torch.float16, device, gen)
    run_both(query, key, value, caches, meta, torch.float16, helpers)


def test_engine_like_sequence_of_steps(device, helpers, gen):
    """Chunked prefill of two prompts, then decodes: every step's output and cache match the reference."""
    dtype = torch.float32
    table, num_blocks = tables_for([24, 12], gen)
    caches = helpers.make_cache(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype, device, gen)
    steps = [
        [(12, 12)],  # A: first chunk of a 20-token prompt
        [(8, 20), (9, 9)],  # A: last chunk; B: its whole prompt
        [(1, 21), (1, 10)],  # both decode
        [(1, 22), (1, 11)],
    ]
    for seqs in steps:
        rows = [0] if len(seqs) == 1 else [0, 1]
        meta = make_step(seqs, table[rows], device)
        query, key, value = random_qkv(meta.slot_mapping.shape[0], dtype, device, gen)
        run_both(query, key, value, caches, meta, dtype, helpers)


def test_select_backend_returns_triton(device):
    backend = select_backend("triton", device)
    assert isinstance(backend, TritonAttentionBackend) and backend.name == "triton"


# Per row bucket (1, 2, 4, 8, 16, 32): SDPA for first chunks of 3-4, 9-16 and more than 16 tokens.
SDPA_AT_4_16_AND_LONGER = ["triton", "triton", "sdpa", "triton", "sdpa", "sdpa"]


def segments(backend, meta):
    """`_prefill_segments` with each run's query starts as a list (None for an SDPA chunk)."""
    return [
        (kind, rows, seqs, None if starts is None else starts.tolist())
        for kind, rows, seqs, starts in backend._prefill_segments(meta)
    ]


def test_prefill_segments_follow_the_measured_choice():
    # Two decodes; first chunks of 4 (sdpa), 5 and 6 (triton, one launch), 12 (sdpa); a chunk of 4
    # after a cached prefix (triton whatever its bucket says: SDPA would need the prefix's K/V); a
    # first chunk of 40 (past the list's last bucket: that bucket's choice).
    seqs = [(1, 9), (1, 20), (4, 4), (5, 5), (6, 6), (12, 12), (4, 30), (40, 40)]
    table, _ = tables_for([n for _, n in seqs], torch.Generator().manual_seed(0))
    meta = make_step(seqs, table, torch.device("cpu"))
    backend = TritonAttentionBackend()
    unmeasured = [("triton", slice(2, 73), slice(2, 8), [0, 4, 9, 15, 27, 31, 71])]
    assert segments(backend, meta) == unmeasured
    backend.prefill_by_bucket = SDPA_AT_4_16_AND_LONGER
    assert segments(backend, meta) == [
        ("sdpa", slice(2, 6), slice(2, 3), None),
        ("triton", slice(6, 17), slice(3, 5), [0, 5, 11]),
        ("sdpa", slice(17, 29), slice(5, 6), None),
        ("triton", slice(29, 33), slice(6, 7), [0, 4]),
        ("sdpa", slice(33, 73), slice(7, 8), None),
    ]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "seqs",
    [
        [(1, 9), (1, 20), (4, 4), (5, 5), (6, 6), (12, 12), (4, 30)],  # decodes, then mixed chunks
        [(5, 5), (4, 20), (12, 12)],  # prefill only, an SDPA chunk last before the padding rows
    ],
    ids=["with decodes", "prefill only"],
)
def test_step_with_sdpa_and_triton_chunks_matches_the_reference(seqs, dtype, device, helpers, gen):
    table, num_blocks = tables_for([n for _, n in seqs], gen)
    caches = helpers.make_cache(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype, device, gen)
    meta = make_step(seqs, table, device, padding_rows=2)
    query, key, value = random_qkv(meta.slot_mapping.shape[0], dtype, device, gen)
    backend = TritonAttentionBackend()
    backend.prefill_by_bucket = SDPA_AT_4_16_AND_LONGER
    run_both(query, key, value, caches, meta, dtype, helpers, backend=backend)
    kinds = [kind for kind, *_ in meta.scratch["triton_prefill_segments"]]
    assert "sdpa" in kinds and "triton" in kinds


def test_tuned_prefill_choice_is_measured_checked_and_cached(device, tmp_path, monkeypatch):
    from batchgen.kernels import registry
    from batchgen.kernels.registry import TuningTable
    from batchgen.model.kernel_choice import attention as attention_choice

    key = {"test": "triton prefill"}
    table = TuningTable.load(key, tmp_path)
    heads = (NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, torch.float32)
    chosen = attention_choice.tune_triton_prefill_attention(table, *heads, 4, device, BLOCK_SIZE)
    assert len(chosen) == 3 and set(chosen) <= {"triton", "sdpa"}  # buckets 1, 2, 4
    for rows, kind in zip((1, 2, 4), chosen, strict=True):
        entry = table.entries[f"triton_prefill_attention|4x2x64/16:float32|{rows}"]
        assert entry["chosen"] == kind and entry["dropped"] == {}
        assert entry["ms"]["triton"] > 0 and entry["ms"]["sdpa"] > 0  # both checked and timed
    table.save()

    # A second start looks the choice up in the saved table: nothing is timed.
    monkeypatch.setattr(registry, "fastest_seconds", lambda calls: pytest.fail("timed again"))
    again = TuningTable.load(key, tmp_path)
    assert attention_choice.tune_triton_prefill_attention(again, *heads, 4, device, BLOCK_SIZE) == chosen
