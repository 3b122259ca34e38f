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
    for bad in (0, 129, 2**40):
        with pytest.raises(ValueError, match=r"n must be in \[1, 128\]"):
            SamplingParams(n=bad)


def test_child_seeds_stay_in_range() -> None:
    top = 2**64 - 1
    assert child_params(SamplingParams(seed=top, n=2), 1).seed == 0
    assert child_params(SamplingParams(seed=-5, n=2), 1).seed == -4
    assert child_params(SamplingParams(n=2), 1).seed is None and child_params(SamplingParams(n=2), 1).n == 1


def test_ids_of_children_and_of_pending_errors_are_taken(llm) -> None:
    """A child's id (while its parent is live) and the id of a rejected request whose error has not
    come back yet are refused like any live id."""
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(n=3, max_tokens=4))
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request("a\x1f1", {"prompt_token_ids": [4]}, SamplingParams(max_tokens=2))
    engine.add_request("b", {"prompt_token_ids": [10**9]}, SamplingParams(max_tokens=2))  # rejected
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request("b", {"prompt_token_ids": [4]}, SamplingParams(max_tokens=2))
    assert engine.num_unfinished_requests() == 2  # "a" once, whatever its n, and "b"'s error
    finished = engine.totals.finished
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert sorted(o.request_id for o in outs) == ["a", "b"] and engine.totals.finished - finished == 2


def test_children_keep_their_place_in_the_queue(tiny_model_dir) -> None:
    """fcfs with 4 sequences a step: a request with n=4 queued before 8 others finishes first (its
    children wait for the first one's prompt blocks but keep their place), and its prompt's full
    block comes from the prefix cache for 3 of them."""
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", num_threads=1, max_num_seqs=4)
    engine = llm.llm_engine
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
    engine.add_request(
        "parent", {"prompt_token_ids": list(range(300, 320))}, SamplingParams(**{**params.to_dict(), "n": 4})
    )
    for i in range(8):
        engine.add_request(f"s{i}", {"prompt_token_ids": [400 + i, 7, 8]}, params)
    done_at = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done_at[out.request_id] = engine.totals.steps
    assert done_at["parent"] < min(v for k, v in done_at.items() if k != "parent")
    assert engine.totals.prefix_cache_hits == 3 * 16


def test_a_step_that_only_returns_errors_leaves_no_stale_stats(llm) -> None:
    engine = llm.llm_engine
    llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(max_tokens=2))
    assert engine.last_step is not None
    engine.add_request("bad", {"prompt_token_ids": [10**9]}, SamplingParams(max_tokens=2))
    assert [o.request_id for o in engine.step()] == ["bad"] and engine.last_step is None
