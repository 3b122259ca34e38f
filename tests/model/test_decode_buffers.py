"""Decode steps padded to bucket sizes in persistent buffers (`DecodeBuffers`): the padding rows
change no real row's tokens, at every bucket edge, on both CPU attention backends."""

from __future__ import annotations

import random

import pytest

from batchgen import LLM, SamplingParams
from batchgen.kernels.cpu import attention as cpu_attention
from batchgen.model import decode_buffers
from batchgen.model.decode_buffers import DecodeBuffers, default_decode_buckets
from tests.engine.test_fidelity import hf_greedy, token_ids

BUCKETS = (1, 2, 4, 8, 16)


def test_default_buckets_are_nano_vllms_sizes_up_to_max_num_seqs() -> None:
    assert default_decode_buckets(256) == (1, 2, 4, 8, *range(16, 257, 16))
    assert default_decode_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert default_decode_buckets(1) == (1,)
    assert default_decode_buckets(8) == (1, 2, 4, 8)


def test_bucket_is_the_smallest_that_holds_the_rows() -> None:
    import torch

    buffers = DecodeBuffers(
        (8, 1, 4, 2), max_blocks=4, scratch_block=9, block_size=16, device=torch.device("cpu")
    )
    assert [buffers.bucket(n) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, None]
    with pytest.raises(ValueError, match="decode_buckets"):
        DecodeBuffers((0, 4), 4, 9, 16, torch.device("cpu"))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_padded_decodes_equal_hf_at_every_bucket_edge(tiny_model_dir, backend, monkeypatch) -> None:
    """17 requests whose output lengths differ by one token: the running batch shrinks from 17 (over
    the largest bucket: unpadded) through every size to 1, so each bucket runs full (1, 2, 4, 8, 16)
    and padded (3 -> 4, 5..7 -> 8, 9..15 -> 16). Greedy float32 tokens equal Hugging Face's."""
    if backend == "cpu" and cpu_attention.load_library() is None:
        pytest.skip("no C compiler here to build the CPU attention kernel")
    path = tiny_model_dir("llama")
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 4000) for _ in range(rng.randint(3, 40))] for _ in range(17)]
    # The first request (the cache's first blocks) runs longest: padding that wrote outside the
    # scratch block would reach it.
    params = [SamplingParams(temperature=0.0, max_tokens=18 - i, ignore_eos=True) for i in range(17)]
    padded: list[tuple[int, int]] = []
    pad = DecodeBuffers.pad

    def spy(self, input_ids, positions, meta, bucket):
        padded.append((meta.num_seqs, bucket))
        return pad(self, input_ids, positions, meta, bucket)

    monkeypatch.setattr(decode_buffers.DecodeBuffers, "pad", spy)
    device = "cpu" if backend == "cpu" else "auto"
    llm = LLM(str(path), dtype="float32", attention_backend=backend, device=device, decode_buckets=BUCKETS)
    got = token_ids(llm.generate([{"prompt_token_ids": ids} for ids in prompts], params))
    want = [
        hf_greedy(path, [ids], p.max_tokens, ignore_eos=True)[0]
        for ids, p in zip(prompts, params, strict=True)
    ]
    assert got == want
    assert {n for n, _ in padded} == set(range(1, 17))  # 17 rows: over every bucket, unpadded
    assert {(n, b) for n, b in padded if n in (1, 2, 3, 4, 5, 8, 9, 16)} == {
        (1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (16, 16)}  # fmt: skip
