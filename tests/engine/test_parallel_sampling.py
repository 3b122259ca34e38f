"""`SamplingParams.n` > 1: n completions per prompt, merged into one output as vLLM returns them."""

from __future__ import annotations

import pytest

from batchgen import LLM, SamplingParams
from batchgen.engine.parallel_sampling import child_params


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir("llama")), dtype="float32", num_threads=1)


def test_seeded_completions_are_the_seeds_plus_index(llm) -> None:
    """Completion i of a seeded n=3 request is exactly the n=1 request seeded with seed + i, also
    when it shares the batch with another prompt."""
    prompt = {"prompt_token_ids": [1, 5, 6, 7]}
    params = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=6, ignore_eos=True)
    other = {"prompt_token_ids": [9, 9, 2]}
    out, single = llm.generate([prompt, other], [params, SamplingParams(max_tokens=3)])
    assert [c.index for c in out.outputs] == [0, 1, 2] and len(single.outputs) == 1
    alone = [
        llm.generate([prompt], SamplingParams(temperature=1.0, seed=11 + i, max_tokens=6, ignore_eos=True))[0]
        for i in range(3)
    ]
    assert [c.token_ids for c in out.outputs] == [a.outputs[0].token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different seeds, different samples
    assert out.metrics.first_token_time <= out.metrics.finish_time


def test_the_prompt_is_computed_once_and_shared_from_the_prefix_cache(llm) -> None:
    """With prefix caching (the default) children 1..n-1 wait for child 0's prompt, then hit its two
    full 16-token blocks: 3 x 32 cached tokens; the tokens are those of the seeded singles."""
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": list(range(200, 240))}  # 40 tokens: 2 full blocks
    hits = engine.totals.prefix_cache_hits
    (out,) = llm.generate(
        [prompt], SamplingParams(temperature=1.0, seed=5, n=4, max_tokens=4, ignore_eos=True)
    )
    assert engine.totals.prefix_cache_hits - hits == 3 * 32
    alone = [
        llm.generate([prompt], SamplingParams(temperature=1.0, seed=5 + i, max_tokens=4, ignore_eos=True))[0]
        for i in range(4)
    ]
    assert [c.token_ids for c in out.outputs] == [a.outputs[0].token_ids for a in alone]


def test_greedy_n_repeats_the_greedy_completion(llm) -> None:
    prompt = {"prompt_token_ids": [3, 4, 5]}
    (one,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    (two,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, n=2))
    assert [c.token_ids for c in two.outputs] == [one.outputs[0].token_ids] * 2


def test_a_rejected_prompt_is_one_error_output(llm) -> None:
    (out,) = llm.generate([{"prompt_token_ids": [10**9]}], SamplingParams(n=2))
    assert out.error and [c.finish_reason for c in out.outputs] == ["error", "error"]


def test_abort_drops_every_sequence(llm) -> None:
    engine = llm.llm_engine
    engine.add_request(
        "p", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(n=3, max_tokens=50, ignore_eos=True)
    )
    engine.step()
    engine.abort_request("p")
    assert not engine.has_unfinished_requests() and "p" not in engine.groups
    with pytest.raises(ValueError, match="n must be >= 1"):
        SamplingParams(n=0)


def test_child_seeds_stay_in_range() -> None:
    top = 2**64 - 1
    assert child_params(SamplingParams(seed=top, n=2), 1).seed == 0
    assert child_params(SamplingParams(seed=-5, n=2), 1).seed == -4
    assert child_params(SamplingParams(n=2), 1).seed is None and child_params(SamplingParams(n=2), 1).n == 1
