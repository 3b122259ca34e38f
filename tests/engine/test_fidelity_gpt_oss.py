"""gpt-oss gives Hugging Face `generate`'s greedy float32 tokens on every CPU attention backend and
under the stress modes of `test_fidelity`: chunked prefill, a tiny cache with preemption by
recompute and by swap, a warm prefix cache, shuffled batches. The tiny model (`conftest`'s
`_tiny_gpt_oss_config`) alternates 8-token sliding windows (shorter than most prompts) with full
layers, has sinks of a few units and biases everywhere, YaRN rotary, and routes its steps unevenly
over 8 experts (checked)."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from batchgen import LLM
from batchgen.kernels.cpu import attention as cpu_attention
from batchgen.model import moe
from tests.engine.test_fidelity import GREEDY, TEXT_PROMPTS, hf_greedy, token_ids
from tests.engine.test_fidelity_moe import STRESS, _block_bytes


@pytest.fixture(scope="module")
def gpt_oss_case(tiny_model_dir):
    """The tiny gpt-oss, its prompts' token ids and Hugging Face's greedy outputs."""
    path = tiny_model_dir("gpt_oss")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt_ids = [tok(p)["input_ids"] for p in TEXT_PROMPTS]
    return path, prompt_ids, hf_greedy(path, prompt_ids, GREEDY.max_tokens, ignore_eos=True)


@pytest.fixture
def expert_counts(monkeypatch) -> list[list[int]]:
    """Tokens per expert of every sparse layer call, recorded."""
    seen: list[list[int]] = []
    real = moe.group_by_expert

    def recording(ids: torch.Tensor, num_experts: int) -> moe.ExpertGroups:
        groups = real(ids, num_experts)
        seen.append(groups.counts.tolist())
        return groups

    monkeypatch.setattr(moe, "group_by_expert", recording)
    return seen


def _generate(path, prompt_ids, **options) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(path), dtype="float32", device="cpu", **options)
    return llm, token_ids(llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY))


def test_prompts_are_longer_than_the_window(gpt_oss_case):
    path, prompt_ids, _ = gpt_oss_case
    window = transformers.AutoConfig.from_pretrained(path).sliding_window
    assert sum(len(ids) > window for ids in prompt_ids) >= len(prompt_ids) // 2


@pytest.fixture
def kernel_calls_with_sinks(monkeypatch) -> dict[str, int]:
    """Calls of the C decode and prefill kernels that carried sinks, counted."""
    calls = {"decode": 0, "prefill": 0}
    for kind in calls:
        real = getattr(cpu_attention, f"paged_{kind}_attention_cpu")

        def counting(*args, _real=real, _kind=kind, **kwargs):
            calls[_kind] += kwargs.get("sinks") is not None
            return _real(*args, **kwargs)

        monkeypatch.setattr(cpu_attention, f"paged_{kind}_attention_cpu", counting)
    return calls


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_gpt_oss_matches_hf(gpt_oss_case, backend, expert_counts, kernel_calls_with_sinks):
    if backend == "cpu" and cpu_attention.load_library() is None:
        pytest.skip("no C compiler here to build the CPU attention kernel")
    path, prompt_ids, expected = gpt_oss_case
    _, got = _generate(path, prompt_ids, attention_backend=backend, max_num_seqs=8)
    assert got == expected
    if backend == "cpu":  # the sinks ran in the C kernels, not in a torch fallback
        assert kernel_calls_with_sinks["decode"] > 0 and kernel_calls_with_sinks["prefill"] > 0
    # Steps route unevenly: some expert gets no token while another gets several.
    assert any(0 in counts and max(counts) >= 2 for counts in expert_counts)
    assert any(max(counts) > min(c for c in counts if c) for counts in expert_counts)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("name", list(STRESS))
def test_gpt_oss_stress_modes_match_hf(gpt_oss_case, name, backend):
    if backend == "cpu" and cpu_attention.load_library() is None:
        pytest.skip("no C compiler here to build the CPU attention kernel")
    path, prompt_ids, expected = gpt_oss_case
    options = dict(STRESS[name])
    if name.startswith("preempt"):
        # 16 blocks of 8 tokens cannot hold 8 requests of up to 104 tokens at once.
        options["kv_cache_memory"] = 16 * _block_bytes(path, 8)
    llm, got = _generate(path, prompt_ids, attention_backend=backend, **options)
    assert got == expected
    totals = llm.llm_engine.totals
    if name.startswith("preempt"):
        assert totals.preemptions > 0, "the cache was meant to force preemption"
    if name == "chunked_prefill":
        total = sum(len(ids) for ids in prompt_ids) + len(prompt_ids) * (GREEDY.max_tokens - 1)
        assert totals.steps >= -(-total // 5)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_gpt_oss_warm_prefix_cache_and_shuffled(gpt_oss_case, backend):
    if backend == "cpu" and cpu_attention.load_library() is None:
        pytest.skip("no C compiler here to build the CPU attention kernel")
    path, prompt_ids, expected = gpt_oss_case
    llm = LLM(
        str(path),
        dtype="float32",
        device="cpu",
        attention_backend=backend,
        block_size=4,
        enable_prefix_caching=True,
    )
    cold = token_ids(llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY))
    hits = llm.llm_engine.totals.prefix_cache_hits
    order = list(range(len(prompt_ids)))
    random.Random(3).shuffle(order)
    warm = token_ids(llm.generate([{"prompt_token_ids": prompt_ids[i]} for i in order], GREEDY))
    assert cold == expected
    assert [warm[order.index(i)] for i in range(len(order))] == expected
    assert llm.llm_engine.totals.prefix_cache_hits > hits, "the second pass should hit the cache"


def test_sinks_change_the_output(gpt_oss_case, tmp_path):
    """The sinks matter in this model: with them zeroed, transformers' greedy tokens differ (so the
    tests above would fail for a backend that dropped them)."""
    path, prompt_ids, expected = gpt_oss_case
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.zero_()
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    without = hf_greedy(tmp_path, prompt_ids, GREEDY.max_tokens, ignore_eos=True)
    assert sum(a != b for a, b in zip(without, expected, strict=True)) >= len(expected) // 2
    # Nor is any greedy output one repeated token (a model that attention cannot move).
    assert all(len(set(tokens)) > 4 for tokens in expected)
