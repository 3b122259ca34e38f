"""The C paged prefill-attention kernel against a float64 reference, its checks, and the backend using it."""

from __future__ import annotations

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.kernels.cpu import attention as cpu_attention
from batchgen.kernels.cpu import library as cpu_kernels
from tests.kernels.cpu.paged_cases import assert_cpu_backend_matches_torch, cached_step, shuffled_caches

pytestmark = pytest.mark.skipif(
    cpu_kernels._compiler() is None, reason="no C compiler ($CC, cc, gcc, clang) to build the CPU kernels"
)

# (cached prefix, chunk) in tokens. The kernel's tiles hold 32 query rows and its key chunks 64 or
# 128 keys: one row, rows left after whole tiles, a tile boundary, a prefix that ends inside a key
# chunk and one longer than several, and a one-token chunk after a long prefix (a decode-like row).
# With `short_chunks`, chunks of up to 8 rows (6 on the AMX kernel) run the short-chunk path
# (`paged_short_chunk_attention`: each context walked once for all the chunk's rows, causally): both
# sides of the AMX limit here, of the C one in `test_short_chunks_on_both_sides_of_the_c_limit`.
CHUNKS = [(0, 1), (0, 31), (0, 33), (5, 64), (100, 50), (0, 130), (250, 7), (300, 1)]
CHUNKS += [(37, 5), (90, 6), (21, 16), (140, 17), (3, 2)]


def make_case(dtype, head_dim, group, block_size, num_kv_heads=2, seed=0):
    """Random caches with the sequences' blocks shuffled over the pool (`paged_cases`), the chunks' queries."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [prefix + chunk for prefix, chunk in CHUNKS]
    k_cache, v_cache, tables = shuffled_caches(seq_lens, dtype, head_dim, block_size, num_kv_heads, gen)
    num_rows = sum(chunk for _, chunk in CHUNKS)
    query = (torch.randn(num_rows, num_kv_heads * group, head_dim, generator=gen) * 2).to(dtype)
    starts = torch.tensor([0] + [chunk for _, chunk in CHUNKS], dtype=torch.int32).cumsum(
        0, dtype=torch.int32
    )
    return query, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), starts


def reference(query, k_cache, v_cache, tables, seq_lens, starts, scale):
    """Each query row alone, in float64: its context up to its own position, softmax, weighted V."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = query.shape[1] // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    for seq, length in enumerate(seq_lens.tolist()):
        slots = [int(tables[seq, t // block_size]) * block_size + t % block_size for t in range(length)]
        k = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(group, 1)
        v = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].double().repeat_interleave(group, 1)
        first, last = int(starts[seq]), int(starts[seq + 1])
        for row in range(first, last):
            position = length - (last - first) + (row - first)
            scores = torch.einsum("hd,lhd->hl", query[row].double() * scale, k[: position + 1])
            out[row] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v[: position + 1])
    return out


@pytest.mark.parametrize("short_chunks", [False, True])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("head_dim, group", [(16, 1), (32, 2), (64, 3), (128, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_float64_reference(dtype, head_dim, group, block_size, short_chunks):
    query, k_cache, v_cache, tables, seq_lens, starts = make_case(dtype, head_dim, group, block_size)
    scale = head_dim**-0.5
    got = cpu_attention.paged_prefill_attention_cpu(
        query, k_cache, v_cache, tables, seq_lens, starts, scale, short_chunks=short_chunks
    )
    expected = reference(query, k_cache, v_cache, tables, seq_lens, starts, scale)
    assert got.shape == query.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    elif not cpu_attention.prefill_uses_bf16_dot():  # float32 arithmetic, one rounding to bf16
        torch.testing.assert_close(got.double(), expected, rtol=2**-8, atol=2e-3)
    else:  # also the probabilities rounded to bf16 (2^-9 relative each) before the product with V
        torch.testing.assert_close(got.double(), expected, rtol=2**-8, atol=5e-3)
    # The first sequence's only row sees one context token: its output is that V row, exactly.
    first_v = v_cache[int(tables[0, 0]), 0].repeat_interleave(group, 0)
    assert torch.equal(got[0], first_v)


NEEDS_AMX = pytest.mark.skipif(
    not cpu_attention.supports_prefill_amx(torch.bfloat16, 64, 6, 2),
    reason="the AMX prefill kernel needs a CPU with AMX tiles (amx_bf16) that Linux lets this process use",
)


@NEEDS_AMX
@pytest.mark.parametrize("short_chunks", [False, True])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("head_dim, group", [(32, 2), (64, 3), (96, 1), (128, 4)])
def test_amx_kernel_matches_float64_reference(head_dim, group, block_size, short_chunks):
    """bf16 products on the tiles, the probabilities rounded to bf16 before the product with V: as
    the AVX512-BF16 kernel's bound. Every tail: 16-row query tiles and 64-key blocks cut anywhere."""
    query, k_cache, v_cache, tables, seq_lens, starts = make_case(torch.bfloat16, head_dim, group, block_size)
    scale = head_dim**-0.5
    got = cpu_attention.paged_prefill_attention_cpu(
        query, k_cache, v_cache, tables, seq_lens, starts, scale, kernel="amx", short_chunks=short_chunks
    )
    expected = reference(query, k_cache, v_cache, tables, seq_lens, starts, scale)
    assert got.shape == query.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), expected, rtol=2**-8, atol=5e-3)
    first_v = v_cache[int(tables[0, 0]), 0].repeat_interleave(group, 0)
    assert torch.equal(got[0], first_v)


@NEEDS_AMX
def test_amx_kernel_rescales_as_scores_climb_along_the_context():
    """Key t scores about 0.25 t more than key 0 (a ramp in one dimension): every row's maximum
    passes the kernel's lazy-rescaling margin (2^8) again and again along its context, and the
    probabilities end up nearly one-hot on its last keys."""
    query, k_cache, v_cache, tables, seq_lens, starts = make_case(torch.bfloat16, 64, 3, 16)
    block_size = k_cache.shape[1]
    rows = k_cache.view(-1, *k_cache.shape[2:])
    for seq, length in enumerate(seq_lens.tolist()):
        for t in range(length):
            rows[int(tables[seq, t // block_size]) * block_size + t % block_size, :, 0] = 0.1 * t
    query[:, :, 0] = 20.0
    scale = 64**-0.5
    got = cpu_attention.paged_prefill_attention_cpu(
        query, k_cache, v_cache, tables, seq_lens, starts, scale, kernel="amx"
    )
    expected = reference(query, k_cache, v_cache, tables, seq_lens, starts, scale)
    torch.testing.assert_close(got.double(), expected, rtol=2**-8, atol=5e-3)


def test_the_amx_kernel_takes_only_what_it_supports():
    assert not cpu_attention.supports_prefill_amx(torch.float32, 64, 9, 3)
    assert not cpu_attention.supports_prefill_amx(torch.bfloat16, 48, 9, 3)  # head_dim % 32
    assert not cpu_attention.supports_prefill_amx(torch.bfloat16, 256, 9, 3)
    query, k_cache, v_cache, tables, seq_lens, starts = make_case(torch.float32, 64, 3, 16)
    with pytest.raises(ValueError, match="no CPU kernel"):
        cpu_attention.paged_prefill_attention_cpu(
            query, k_cache, v_cache, tables, seq_lens, starts, 0.125, kernel="amx"
        )
    with pytest.raises(ValueError, match='kernel must be "c" or "amx"'):
        cpu_attention.paged_prefill_attention_cpu(
            query, k_cache, v_cache, tables, seq_lens, starts, 0.125, kernel="tiles"
        )


def test_an_emulated_machine_without_amx_has_no_amx_prefill(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert not cpu_attention.supports_prefill_amx(torch.bfloat16, 64, 9, 3)


def chunk_rows(cache, tables, seq_lens, query_lens):
    """The cache rows at each sequence's chunk positions, back to back: the step's own K or V."""
    block_size = cache.shape[1]
    slots = [
        int(tables[seq, t // block_size]) * block_size + t % block_size
        for seq, (length, qlen) in enumerate(zip(seq_lens, query_lens, strict=True))
        for t in range(length - qlen, length)
    ]
    return cache.reshape(-1, *cache.shape[2:])[slots]


def prefill_and_mixed_steps(dtype=torch.float32):
    """A step of `CHUNKS`'s prefill chunks, and one whose first two sequences decode instead (their
    first token): each as (num_decodes, query rows, key, value, k_cache, v_cache, metadata)."""
    query, k_cache, v_cache, tables, seq_lens, starts = make_case(dtype, 64, 3, 16)
    chunk_lens = [chunk for _, chunk in CHUNKS]
    for num_decodes in (0, 2):
        first_rows = [query[int(starts[i]) : int(starts[i]) + 1] for i in range(num_decodes)]
        rows = torch.cat([*first_rows, query[int(starts[num_decodes]) :]])
        query_lens = [1] * num_decodes + chunk_lens[num_decodes:]
        step_lens = seq_lens.clone()
        step_lens[:num_decodes] = 1
        meta = cached_step(query_lens, step_lens, tables, num_decodes)
        key = chunk_rows(k_cache, tables, step_lens.tolist(), query_lens)
        value = chunk_rows(v_cache, tables, step_lens.tolist(), query_lens)
        yield num_decodes, rows, key, value, k_cache, v_cache, meta


def test_backend_prefill_and_mixed_steps_match_torch_backend():
    """A step of prefill chunks, and one with decodes first, equal the torch backend's outputs."""
    for _, rows, key, value, k_cache, v_cache, meta in prefill_and_mixed_steps():
        assert_cpu_backend_matches_torch(rows, key, value, k_cache, v_cache, meta)


@pytest.mark.parametrize(
    "by_bucket, after_prefix",
    [
        (["sdpa"] * 12, None),
        (["c", "sdpa"] * 6, None),
        (["c"] * 6 + ["sdpa"] * 6, None),
        (["c"] * 12, ["sdpa"] * 12),
        (["c", "sdpa"] * 6, ["sdpa", "c"] * 6),
    ],
    ids=["sdpa-everywhere", "alternating", "sdpa-from-64-rows", "sdpa-after-prefix", "both-alternating"],
)
def test_measured_sdpa_chunks_match_torch_backend(by_bucket, after_prefix):
    """With the measured choices sending some chunks to torch's SDPA (chunks without a cached prefix
    by one table, chunks after one by the other, whose context is gathered from the cache) and the
    rest to the C kernel in runs of consecutive sequences, a prefill step and a mixed step equal
    the torch backend's outputs."""
    chunk_lens = [chunk for _, chunk in CHUNKS]
    used = []
    for num_decodes, rows, key, value, k_cache, v_cache, meta in prefill_and_mixed_steps():
        assert_cpu_backend_matches_torch(
            rows,
            key,
            value,
            k_cache,
            v_cache,
            meta,
            prefill_by_bucket=by_bucket,
            after_prefix_by_bucket=after_prefix,
        )
        kinds = [kind for kind, *_ in meta.scratch["prefill_segments"]]
        fresh = [prefix == 0 for prefix, _ in CHUNKS[num_decodes:]]
        expected = []
        for is_fresh, chunk in zip(fresh, chunk_lens[num_decodes:], strict=True):
            table = by_bucket if is_fresh else after_prefix
            kind = "sdpa" if table is not None and table[(chunk - 1).bit_length()] == "sdpa" else "c"
            if not (expected and expected[-1] == "c" == kind):
                expected.append(kind)
        assert kinds == expected
        used += kinds
    assert "sdpa" in used and "c" in used


@NEEDS_AMX
def test_measured_amx_chunks_match_torch_backend():
    """bf16 steps whose chunks the measured choice sends to the AMX kernel (runs of consecutive
    sequences in one call), the C kernel and SDPA by turns equal the torch backend's outputs."""
    from batchgen.model.attention import CPUAttentionBackend, TorchAttentionBackend

    used = []
    for _, rows, key, value, k_cache, v_cache, meta in prefill_and_mixed_steps(torch.bfloat16):
        expected = TorchAttentionBackend().forward(rows, key, value, k_cache, v_cache, meta, 0.125)
        meta.scratch.clear()
        backend = CPUAttentionBackend()
        backend.prefill_by_bucket = ["amx"] * 5 + ["sdpa", "c"] + ["amx"] * 5  # chunks of 1, 31, 33, 130
        backend.prefill_after_prefix_by_bucket = ["c", "amx"] * 6
        got = backend.forward(rows, key, value, k_cache, v_cache, meta, 0.125)
        torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=1e-2)
        used += [kind for kind, *_ in meta.scratch["prefill_segments"]]
    assert {"amx", "c", "sdpa"} <= set(used)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t, s, q: s.__setitem__(1, 0), "more query rows than context"),
        (lambda t, s, q: s.__setitem__(0, 10_000), "seq_lens must lie"),
        (lambda t, s, q: q.__setitem__(0, 1), "query_starts must rise"),
        (lambda t, s, q: q.__setitem__(2, 0), "query_starts must rise"),
        (lambda t, s, q: t.__setitem__((0, 0), -1), "block ids must lie"),
    ],
)
def test_bad_tables_and_offsets_are_refused(change, message):
    query, k_cache, v_cache, tables, seq_lens, starts = make_case(torch.float32, 64, 3, 16)
    change(tables, seq_lens, starts)
    with pytest.raises(ValueError, match=message):
        cpu_attention.paged_prefill_attention_cpu(query, k_cache, v_cache, tables, seq_lens, starts, 0.125)


def test_writes_into_a_given_output():
    """With `out` (as the backend passes a step output's prefill rows) the result lands there, equal
    to a freshly allocated one; an `out` of another shape is refused."""
    query, k_cache, v_cache, tables, seq_lens, starts = make_case(torch.bfloat16, 64, 3, 16)
    fresh = cpu_attention.paged_prefill_attention_cpu(
        query, k_cache, v_cache, tables, seq_lens, starts, 0.125
    )
    step_out = torch.full((query.shape[0] + 2, *query.shape[1:]), 7.0, dtype=torch.bfloat16)
    got = cpu_attention.paged_prefill_attention_cpu(
        query, k_cache, v_cache, tables, seq_lens, starts, 0.125, out=step_out[2:]
    )
    assert got.data_ptr() == step_out[2:].data_ptr()
    assert torch.equal(step_out[2:], fresh) and bool((step_out[:2] == 7.0).all())
    with pytest.raises(ValueError, match="out must be"):
        cpu_attention.paged_prefill_attention_cpu(
            query, k_cache, v_cache, tables, seq_lens, starts, 0.125, out=step_out[1:]
        )


def test_unsupported_shapes_are_refused():
    assert cpu_attention.supports_prefill(torch.bfloat16, 64, 9, 3)
    assert not cpu_attention.supports_prefill(torch.float16, 64, 9, 3)
    assert not cpu_attention.supports_prefill(torch.float32, 80, 9, 3)
    query, k_cache, v_cache, tables, seq_lens, starts = make_case(torch.float32, 64, 3, 16)
    with pytest.raises(ValueError, match="query_starts must be int32"):
        cpu_attention.paged_prefill_attention_cpu(
            query, k_cache, v_cache, tables, seq_lens, starts.long(), 0.125
        )


@pytest.mark.parametrize("block_size", [16, 4])
def test_engine_tokens_match_torch_backend_with_chunks_and_prefix_hits(tiny_model_dir, block_size):
    """float32 greedy tokens of the "cpu" backend equal the "torch" backend's when prompts are
    split into several prefill chunks (a 24-token budget) and later prompts hit the prefix cache,
    so the kernel runs chunks that continue a cached prefix, over both block sizes."""
    shared = [5 + (7 * i) % 300 for i in range(40)]
    prompts = [{"prompt_token_ids": shared + [400 + i] * (1 + 3 * i)} for i in range(5)]
    prompts.append({"prompt_token_ids": [9, 8, 7]})
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for backend in ("cpu", "torch"):
        llm = LLM(
            str(tiny_model_dir("llama")),
            dtype="float32",
            device="cpu",
            attention_backend=backend,
            block_size=block_size,
            max_num_batched_tokens=24,
            max_num_seqs=3,
            enable_prefix_caching=True,
        )
        first = llm.generate(prompts[:1], params)  # caches the shared prefix's full blocks
        rest = llm.generate(prompts[1:], params)
        tokens[backend] = [o.outputs[0].token_ids for o in first + rest]
        assert sum(o.num_cached_tokens for o in rest) > 0  # later prompts reused the prefix
    assert tokens["cpu"] == tokens["torch"]


@pytest.mark.parametrize("kernel", ["c", "amx"])
def test_without_drafts_a_rows_result_does_not_depend_on_its_chunking(kernel):
    """A prompt cut into a long chunk and a short last one gives its rows the values of one chunk
    (a resumed job's greedy text depends on it); with `short_chunks` the short one walks once."""
    if kernel == "amx" and not cpu_attention.supports_prefill_amx(torch.bfloat16, 64, 6, 2):
        pytest.skip("no AMX prefill kernel on this machine")
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, tables = shuffled_caches([80], torch.bfloat16, 64, 16, 2, gen)
    query = torch.randn(80, 6, 64, generator=gen).to(torch.bfloat16)
    lens = torch.tensor([80], dtype=torch.int32)

    def attend(rows: slice, short_chunks: bool) -> torch.Tensor:
        starts = torch.tensor([0, rows.stop - rows.start], dtype=torch.int32)
        return cpu_attention.paged_prefill_attention_cpu(
            query[rows].contiguous(), k_cache, v_cache, tables, torch.tensor([rows.stop], dtype=torch.int32),
            starts, 0.125, kernel=kernel, short_chunks=short_chunks,
        )  # fmt: skip

    whole = cpu_attention.paged_prefill_attention_cpu(
        query, k_cache, v_cache, tables, lens, torch.tensor([0, 80], dtype=torch.int32), 0.125, kernel=kernel
    )
    assert torch.equal(torch.cat([attend(slice(0, 76), False), attend(slice(76, 80), False)]), whole)
    # The short walk is another kernel: it may round otherwise (it does on AVX-512, not on an AVX2
    # build), so it is held to bf16's tolerance, not to equality either way.
    walked = attend(slice(76, 80), True)
    torch.testing.assert_close(walked.float(), whole[76:].float(), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_chunks_on_both_sides_of_the_c_limit(dtype):
    """8 rows walk the context once (`short_chunks`), 9 take the tiles: both as the float64 reference."""
    gen = torch.Generator().manual_seed(5)
    chunks = [(60, 8), (77, 9), (0, 8)]
    seq_lens = [prefix + chunk for prefix, chunk in chunks]
    k_cache, v_cache, tables = shuffled_caches(seq_lens, dtype, 64, 16, 2, gen)
    query = (torch.randn(sum(c for _, c in chunks), 6, 64, generator=gen) * 2).to(dtype)
    starts = torch.tensor([0, 8, 17, 25], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    got = cpu_attention.paged_prefill_attention_cpu(
        query, k_cache, v_cache, tables, lens, starts, 0.125, short_chunks=True
    )
    expected = reference(query, k_cache, v_cache, tables, lens, starts, 0.125)
    tolerance = 1e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)
