"""Greedy float32 outputs of the families beyond Llama, and of sliding-window layers, are
token-identical to Hugging Face `generate`: Mistral with every layer sliding, SmolLM3 (a layer
without rotary, sliding), Phi-3 (fused checkpoint weights, LongRoPE crossing its original length
in prefill and in decode, partial rotary), Gemma 2 (GeGLU,
(1 + weight) norms, scaled embeddings, attention and final soft-capping, one sliding and one global
layer) and Gemma 3 (q/k norms, local and global rotary bases). Every prompt but two is longer than
the tiny models' window (`TINY_WINDOW`), and every output goes past it.

The stress modes are `test_fidelity`'s: chunked prefill, a tiny cache with preemption by recompute
and by swap, a warm prefix cache, shuffled batches; both CPU attention backends.
"""

from __future__ import annotations

import random

import pytest
import transformers

from batchgen import LLM
from batchgen.kernels.cpu import attention as cpu_attention
from tests.conftest import TINY_WINDOW
from tests.engine.test_fidelity import GREEDY, TEXT_PROMPTS, hf_greedy, token_ids

FAMILIES = ["mistral_window", "smollm3", "phi3", "gemma2", "gemma3"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_case(request, tiny_model_dir):
    """(arch, model path, prompt ids, Hugging Face's greedy outputs) of one family."""
    path = tiny_model_dir(request.param)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt_ids = [tok(p)["input_ids"] for p in TEXT_PROMPTS]
    assert sum(len(ids) > TINY_WINDOW for ids in prompt_ids) >= 5
    return request.param, path, prompt_ids, hf_greedy(path, prompt_ids, GREEDY.max_tokens, ignore_eos=True)


def generate(path, prompt_ids, **options):
    llm = LLM(str(path), dtype="float32", **options)
    return llm, token_ids(llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_family_matches_hf(family_case, backend):
    """Both CPU attention backends: torch (SDPA with window masks, explicit products under a
    softcap) and the C kernels (window in the decode and prefill kernels)."""
    if backend == "cpu" and cpu_attention.load_library() is None:
        pytest.skip("no C compiler here to build the CPU attention kernel")
    _, path, prompt_ids, expected = family_case
    _, got = generate(path, prompt_ids, attention_backend=backend, device="cpu")
    assert got == expected


STRESS = {
    # Every prompt is longer than 5 tokens, so each is prefilled in several chunks.
    "chunked_prefill": dict(max_num_batched_tokens=5),
    # 16 blocks of 8 tokens cannot hold 8 requests of up to 104 tokens at once: preemption is forced.
    "preempt_recompute": dict(kv_cache_memory=16 * 4096, block_size=8, preemption_mode="recompute"),
    "preempt_swap": dict(kv_cache_memory=16 * 4096, block_size=8, preemption_mode="swap"),
    # 4-token blocks: the prompt that repeats the first one's start reuses its first full blocks.
    "prefix_caching": dict(block_size=4, max_num_seqs=1),
}


@pytest.mark.parametrize("mode", list(STRESS))
def test_family_under_stress(family_case, mode):
    _, path, prompt_ids, expected = family_case
    llm, got = generate(path, prompt_ids, **STRESS[mode])
    assert got == expected
    totals = llm.llm_engine.totals
    if mode.startswith("preempt"):
        assert totals.preemptions > 0, "the cache was meant to force preemption"
    if mode == "prefix_caching":
        assert totals.prefix_cache_hits >= 2, "the repeated prompt start was meant to hit the cache"


def test_family_with_a_warm_prefix_cache_and_shuffled(family_case):
    """A second pass over the same prompts starts from cached blocks (whole prompts but their last
    token), in another order: the windowed layers read the cached K/V they need."""
    _, path, prompt_ids, expected = family_case
    llm, cold = generate(path, prompt_ids, block_size=4)
    assert cold == expected
    hits = llm.llm_engine.totals.prefix_cache_hits
    order = list(range(len(prompt_ids)))
    random.Random(7).shuffle(order)
    warm = token_ids(llm.generate([{"prompt_token_ids": prompt_ids[i]} for i in order], GREEDY))
    assert [warm[order.index(i)] for i in range(len(order))] == expected
    assert llm.llm_engine.totals.prefix_cache_hits > hits, "the second pass was meant to hit the cache"
