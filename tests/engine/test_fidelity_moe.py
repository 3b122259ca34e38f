"""Mixture-of-experts models (Qwen3-MoE, Mixtral) give Hugging Face `generate`'s greedy float32
tokens on both CPU attention backends and under the stress modes of `test_fidelity`: chunked
prefill, a tiny cache with preemption by recompute and by swap, a warm prefix cache, shuffled
batches. The tiny models have 8 experts (top-3 and top-2) and their steps route unevenly (checked)."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from batchgen import LLM
from batchgen.kernels.cpu import attention as cpu_attention
from batchgen.model import moe
from tests.engine.test_fidelity import GREEDY, TEXT_PROMPTS, hf_greedy, token_ids

MOE_ARCHS = ("qwen3_moe", "mixtral")


@pytest.fixture(scope="module", params=MOE_ARCHS)
def moe_case(request, tiny_model_dir):
    """A tiny MoE model, its prompts' token ids and Hugging Face's greedy outputs."""
    path = tiny_model_dir(request.param)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt_ids = [tok(p)["input_ids"] for p in TEXT_PROMPTS]
    return path, prompt_ids, hf_greedy(path, prompt_ids, GREEDY.max_tokens, ignore_eos=True)


@pytest.fixture
def expert_counts(monkeypatch) -> list[list[int]]:
    """Tokens per expert of every sparse layer call, recorded at the routing (whichever kernel
    then runs the experts)."""
    seen: list[list[int]] = []
    real = moe.route

    def recording(logits: torch.Tensor, *args) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = real(logits, *args)
        seen.append(torch.bincount(ids.reshape(-1), minlength=logits.shape[-1]).tolist())
        return weights, ids

    monkeypatch.setattr(moe, "route", recording)
    return seen


def _block_bytes(path, block_size: int) -> int:
    """Bytes of one KV block of the model at `path` in float32, all layers, K and V."""
    config = transformers.AutoConfig.from_pretrained(path)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * head_dim * 4


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_moe_matches_hf(moe_case, backend, expert_counts):
    if backend == "cpu" and cpu_attention.load_library() is None:
        pytest.skip("no C compiler here to build the CPU attention kernel")
    path, prompt_ids, expected = moe_case
    llm = LLM(str(path), dtype="float32", attention_backend=backend, device="cpu", max_num_seqs=8)
    assert token_ids(llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY)) == expected
    # Steps route unevenly: some expert gets no token while another gets several.
    assert any(0 in counts and max(counts) >= 2 for counts in expert_counts)
    assert any(max(counts) > min(c for c in counts if c) for counts in expert_counts)


STRESS = {
    "chunked_prefill": dict(max_num_batched_tokens=5),
    "preempt_recompute": dict(block_size=8, preemption_mode="recompute"),
    "preempt_swap": dict(block_size=8, preemption_mode="swap"),
    "max_num_seqs=3": dict(max_num_seqs=3),
}


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_moe_sliding_window_matches_hf(tiny_model_dir, backend):
    """Mixtral's `sliding_window` (8 tokens here, shorter than most prompts) on every layer, in
    prefill, chunked prefill and decode."""
    path = tiny_model_dir("mixtral_window")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt_ids = [tok(p)["input_ids"] for p in TEXT_PROMPTS]
    expected = hf_greedy(path, prompt_ids, GREEDY.max_tokens, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", attention_backend=backend, device="cpu", max_num_batched_tokens=16)
    assert token_ids(llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY)) == expected


@pytest.mark.parametrize("name", list(STRESS))
def test_moe_stress_modes_match_hf(moe_case, name):
    path, prompt_ids, expected = moe_case
    options = dict(STRESS[name])
    if name.startswith("preempt"):
        # 16 blocks of 8 tokens cannot hold 8 requests of up to 104 tokens at once.
        options["kv_cache_memory"] = 16 * _block_bytes(path, 8)
    llm = LLM(str(path), dtype="float32", **options)
    assert token_ids(llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY)) == expected
    totals = llm.llm_engine.totals
    if name.startswith("preempt"):
        assert totals.preemptions > 0, "the cache was meant to force preemption"
    if name == "chunked_prefill":
        total = sum(len(ids) for ids in prompt_ids) + len(prompt_ids) * (GREEDY.max_tokens - 1)
        assert totals.steps >= -(-total // 5)


def test_moe_warm_prefix_cache_and_shuffled(moe_case):
    path, prompt_ids, expected = moe_case
    llm = LLM(str(path), dtype="float32", block_size=4, enable_prefix_caching=True)
    cold = token_ids(llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY))
    hits = llm.llm_engine.totals.prefix_cache_hits
    order = list(range(len(prompt_ids)))
    random.Random(3).shuffle(order)
    warm = token_ids(llm.generate([{"prompt_token_ids": prompt_ids[i]} for i in order], GREEDY))
    assert cold == expected
    assert [warm[order.index(i)] for i in range(len(order))] == expected
    assert llm.llm_engine.totals.prefix_cache_hits > hits, "the second pass should hit the cache"
