"""Prompt-lookup speculative decoding without a model: the proposer, the acceptance rule, the options,
the gate's arithmetic, and the scheduler's KV rollback against a run without speculation.

The scheduler tests drive the real `Scheduler` and `BlockManager` with a fake greedy "model": the
next token is a fixed function of the sequence (a copy of the token 5 back, except every 7th
position), so drafts are accepted along the copies and rejected at the exceptions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from batchgen.config import EngineConfig
from batchgen.engine.block_manager import BlockManager
from batchgen.engine.policy import make_policy
from batchgen.engine.request import Request
from batchgen.engine.scheduler import Scheduler
from batchgen.engine.spec_decode import NgramProposer, ShadowDrafts, accepted_tokens
from batchgen.engine.spec_gate import SpeculationGate, gate_from_points
from batchgen.model.step import StepOutput
from batchgen.sampling_params import SamplingParams


def brute_force_drafts(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The proposer's definition, written the slow way: for n from n_max down to n_min, the last
    earlier window equal to the last n tokens (ending before the last token), then up to k tokens."""
    for n in range(n_max, n_min - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


def test_proposer_takes_the_longest_then_most_recent_match() -> None:
    p = NgramProposer(3, 1, 3)
    # "1 2 3" occurs at 0; "2 3" also at 5 (more recent, but shorter): the longer match wins.
    assert p.propose([1, 2, 3, 4, 9, 2, 3, 4, 7, 1, 2, 3]) == [4, 9, 2]
    # No "1 2 3" before the end: the most recent "2 3" (positions 5-6) gives what followed it.
    assert p.propose([5, 2, 3, 4, 9, 2, 3, 4, 7, 1, 2, 3]) == [4, 7, 1]
    # Fewer than k tokens follow the match: all of them.
    assert p.propose([7, 7, 7, 7]) == [7]
    assert p.propose([1, 2, 3]) == []  # nothing recurs
    assert p.propose([1, 2, 3, 4, 9, 2, 3, 4, 7, 1, 2, 3], max_drafts=2) == [4, 9]
    assert p.propose([1, 2, 3, 4, 9, 2, 3, 4, 7, 1, 2, 3], max_drafts=0) == []
    # prompt_lookup_min 3: a 2-token match is not enough.
    assert NgramProposer(3, 3, 4).propose([5, 2, 3, 4, 9, 2, 3, 4, 7, 1, 2, 3]) == []


@pytest.mark.parametrize("k, n_min, n_max", [(4, 2, 4), (2, 1, 1), (5, 1, 5), (3, 3, 3)])
def test_proposer_matches_its_definition_on_random_sequences(k, n_min, n_max) -> None:
    rng = random.Random(k * 100 + n_min * 10 + n_max)
    p = NgramProposer(k, n_min, n_max)
    found = 0
    for _ in range(400):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        expected = brute_force_drafts(tokens, k, n_min, n_max)
        assert p.propose(tokens) == expected, tokens
        found += bool(expected)
    assert found > 50  # the small vocabulary makes matches common: the comparison is not all []


def test_proposer_refuses_bad_lengths() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        NgramProposer(4, 3, 2)
    with pytest.raises(ValueError, match="num_speculative_tokens >= 1"):
        NgramProposer(0, 1, 2)


def test_accepted_tokens() -> None:
    assert accepted_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted, bonus token
    assert accepted_tokens([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the model's token replaces draft 2
    assert accepted_tokens([5, 6, 7], [4, 6, 7, 8]) == [4]  # nothing accepted
    assert accepted_tokens([], [3]) == [3]
    with pytest.raises(ValueError, match="3 drafts need 4 sampled tokens, got 3"):
        accepted_tokens([5, 6, 7], [5, 6, 7])


def test_engine_config_speculative_options() -> None:
    c = EngineConfig(speculative_method="ngram")
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (4, 2, 4)
    assert c.speculative_max_batch is None  # measured by the engine
    assert EngineConfig(speculative_method="ngram", prompt_lookup_max=1).prompt_lookup_min == 1
    assert EngineConfig(speculative_method="ngram", prompt_lookup_min=6).prompt_lookup_max == 6
    assert EngineConfig(speculative_method="ngram", speculative_max_batch=0).speculative_max_batch == 0
    with pytest.raises(ValueError, match=r"num_speculative_tokens apply only .* --speculative-method ngram"):
        EngineConfig(num_speculative_tokens=4)
    with pytest.raises(ValueError, match="speculative_method must be one of ngram; got 'eagle'"):
        EngineConfig(speculative_method="eagle")
    with pytest.raises(ValueError, match=r"prompt_lookup_min \(5\) must be <= prompt_lookup_max \(3\)"):
        EngineConfig(speculative_method="ngram", prompt_lookup_min=5, prompt_lookup_max=3)
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1, got 0"):
        EngineConfig(speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(TypeError, match="speculative_max_batch must be an int"):
        EngineConfig(speculative_method="ngram", speculative_max_batch=2.5)


def test_gate_from_points() -> None:
    # t_spec / t_dec: 1.2, 1.6, 2.4: the boundary 2.0 lies half way between batches 2 and 4.
    points = [(1, 10.0, 12.0), (2, 10.0, 16.0), (4, 10.0, 24.0)]
    assert gate_from_points(points, 2.0) == 3
    assert gate_from_points(points, 1.5) == 1  # a quarter of the way from 1 to 2: 1
    assert gate_from_points(points[:2], 2.0) == 2  # every batch measured passes: the last one
    assert gate_from_points([(1, 10.0, 25.0)], 2.0) == 0  # the first batch fails: never speculate


def test_gate_follows_the_jobs_acceptance() -> None:
    """Before any verification the gate is where t_spec = 2 t_dec (one accepted draft per
    verification pays for the K extra rows); drafts accepted at 3 per verification move it to
    t_spec = 4 t_dec (the prior of 1 keeps a weight of 4 verifications); poor acceptance moves it
    down; a set gate never moves; the gate never passes the limit."""
    points = [(1, 10.0, 12.0), (2, 10.0, 16.0), (4, 10.0, 24.0), (8, 10.0, 32.0), (16, 10.0, 52.0)]
    gate = SpeculationGate(points, limit=64)
    assert gate.max_batch == 3 and gate.accepted_per_verification == 1.0
    gate.observe(0, 0)  # a step without verifications changes nothing
    assert gate.max_batch == 3
    gate.observe(36, 108)  # 3 accepted per verification: (108 + 4) / (36 + 4) = 2.8
    assert gate.accepted_per_verification == pytest.approx(2.8)
    assert gate.max_batch == 10  # 3.8 lies 3/10 of the way from 3.2 (batch 8) to 5.2 (batch 16)
    assert SpeculationGate(points, limit=6).max_batch == 3
    capped = SpeculationGate(points, limit=6)
    capped.observe(36, 108)
    assert capped.max_batch == 6
    poor = SpeculationGate(points, limit=64)
    poor.observe(40, 4)  # 0.1 accepted per verification: (4 + 4) / 44
    assert poor.max_batch == 0
    fixed = SpeculationGate([], 0, fixed=5)
    fixed.observe(10, 0)
    assert fixed.max_batch == 5 and fixed.describe() == "gate running batch <= 5 (set)"


# ---- the scheduler with a fake greedy model ----

VOCAB = 50


def fake_next(seq: list[int]) -> int:
    """Greedy "model": copy the token 5 back, except at every 7th position."""
    return seq[-5] if len(seq) % 7 else (seq[-1] + 3) % VOCAB


@dataclass
class Snapshot:
    """The state of the KV cache after a step, for one request (`num_tokens` names the point)."""

    num_tokens: int
    num_computed_tokens: int
    block_table: list[int]
    block_hashes: list[int]
    num_free_blocks: int
    cached: dict[int, int]


def fake_step_output(out) -> StepOutput:
    """The fake model's tokens for a scheduled step: one per position of each sampling request
    (its drafts' positions included), as the runner samples at every position of a verification."""
    tokens = []
    for item in out.scheduled:
        if item.samples:
            seq, drafts = item.request.token_ids, item.spec_token_ids
            tokens += [fake_next(seq + drafts[:j]) for j in range(len(drafts) + 1)]
    return StepOutput(tokens, [None] * len(tokens))


def run_fake(
    prompts: list[list[int]],
    spec: bool,
    max_tokens: int = 40,
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 64,
    gate: int = 8,
    warm: list[int] | None = None,
):
    """Run `prompts` to completion (after `warm`, run alone first to leave cached blocks in the
    free pool); returns (outputs, snapshots of request 0 after each step, rejections seen)."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    proposer = NgramProposer(4, 2, 4) if spec else None
    sched = Scheduler(bm, make_policy("fcfs", 256), 8, budget, proposer=proposer, speculative_max_batch=gate)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def request(rid: str, prompt: list[int]) -> Request:
        return Request(rid, list(prompt), params, 0.0, max_tokens)

    steps = []  # (requests running at the step's start, the step)

    def step() -> list:
        running = list(sched.running)
        out = sched.schedule()
        steps.append((running, out))
        sched.update(out, fake_step_output(out))
        return out

    if warm is not None:
        sched.add_request(request("warm", warm))
        while sched.has_unfinished():
            step()
    reqs = [request(str(i), p) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    snapshots, rejections = [], []
    while sched.has_unfinished():
        out = step()
        r = reqs[0]
        if not r.is_finished:
            snapshots.append(
                Snapshot(
                    r.num_tokens,
                    r.num_computed_tokens,
                    list(r.block_table),
                    list(r.block_hashes),
                    bm.num_free_blocks,
                    dict(bm.cached),
                )  # fmt: skip
            )
        for item in out.scheduled:
            if item.request is r and item.spec_token_ids:
                kept = r.num_tokens - item.start - 1
                if kept - 1 < len(item.spec_token_ids):
                    rejections.append((len(snapshots) - 1, item))
    sched.steps = steps  # for the tests that look at every step
    return [r.output_token_ids for r in reqs], snapshots, rejections, sched


def test_fake_model_drafts_are_accepted_and_rejected() -> None:
    prompt = [random.Random(1).randrange(VOCAB) for _ in range(11)]
    plain, _, _, _ = run_fake([prompt], spec=False)
    spec, _, rejections, sched = run_fake([prompt], spec=True)
    expected = list(prompt)
    for _ in range(40):
        expected.append(fake_next(expected))
    assert plain == spec == [expected[11:]]
    assert rejections, "the 7th-position exceptions were meant to reject drafts"
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


@pytest.mark.parametrize("warm", [False, True])
def test_rollback_equals_a_run_without_speculation(warm: bool) -> None:
    """After each rejection, the request's block table and hashes, the free-block count and the
    prefix cache's hashes are those of the run without speculation when it held as many tokens.
    `warm`: an earlier request left its cached blocks in the free pool, and the pool is small, so a
    draft block taken from a cached block would show as a missing hash."""
    rng = random.Random(2)
    prompt = [rng.randrange(VOCAB) for _ in range(11)]
    warm_prompt = [rng.randrange(VOCAB) for _ in range(30)] if warm else None
    num_blocks = 24 if warm else 64
    _, plain, _, _ = run_fake([prompt], spec=False, num_blocks=num_blocks, warm=warm_prompt)
    _, spec, rejections, _ = run_fake([prompt], spec=True, num_blocks=num_blocks, warm=warm_prompt)
    by_tokens = {s.num_tokens: s for s in plain}
    freed = 0
    for index, item in rejections:
        after = spec[index]
        assert after == by_tokens[after.num_tokens]
        # Blocks the step held for its drafts, past the ones kept: freed again by the rollback.
        freed += -(-(item.start + item.num_new_tokens) // 4) - len(after.block_table)
    assert len(rejections) >= 3
    assert freed > 0, "no rejection released a block: the rollback of blocks went untested"
    if warm:
        assert spec[0].cached, "the warm request's blocks were meant to stay cached"


def test_drafts_never_preempt_and_leave_budget_to_the_others() -> None:
    """Four requests of up to 49 tokens in 48 blocks of 4 (so the run without speculation preempts)
    with 8 tokens a step: in a step with drafts, every request running at its start is scheduled
    and none is preempted, and outputs match the run without speculation."""
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(9)] for _ in range(4)]
    plain, _, _, plain_sched = run_fake(prompts, spec=False, num_blocks=40, budget=8)
    spec, _, rejections, sched = run_fake(prompts, spec=True, num_blocks=40, budget=8)
    assert spec == plain
    assert any(out.preempted for _, out in plain_sched.steps), "the cache was meant to force preemption"
    with_drafts = [(running, out) for running, out in sched.steps if out.num_drafts]
    assert rejections and with_drafts
    for running, out in with_drafts:
        assert not out.preempted
        assert {id(r) for r in running} <= {id(item.request) for item in out.scheduled}
        assert out.num_batched_tokens <= 8


def test_gate_off_above_the_batch() -> None:
    """gate 1: drafts only once one request is left running; gate 0: never."""
    rng = random.Random(4)
    prompts = [[rng.randrange(VOCAB) for _ in range(9)] for _ in range(3)]
    for gate in (0, 1):
        bm = BlockManager(64, 4)
        sched = Scheduler(bm, make_policy("fcfs", 256), 8, 64, proposer=NgramProposer(4, 2, 4),
                          speculative_max_batch=gate)  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        for i, p in enumerate(prompts):
            sched.add_request(Request(str(i), list(p), params, 0.0, 10 + 10 * i))
        drafted_at = []
        while sched.has_unfinished():
            running = len(sched.running)
            out = sched.schedule()
            if out.num_drafts:
                drafted_at.append(running)
            sched.update(out, fake_step_output(out))
        if gate == 0:
            assert drafted_at == []
        else:
            assert drafted_at and set(drafted_at) == {1}


def test_shadow_drafts_settle_on_the_tokens_that_follow() -> None:
    shadow = ShadowDrafts(NgramProposer(3, 1, 2), per_step=1)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    a = Request("a", [1, 2, 3, 1, 2], params, 0.0, 20)
    b = Request("b", [5, 6, 5, 6], params, 0.0, 20)
    sampled = Request("s", [5, 6, 5, 6], SamplingParams(temperature=1.0, max_tokens=20), 0.0, 20)
    for r in (a, b, sampled):
        r.num_computed_tokens = r.num_tokens - 1  # decoding
    shadow.propose([sampled, a, b])  # one a step: the sampled row is skipped, a gets [3, 1, 2]
    assert shadow.check(b, [9]) == (0, 0)  # b holds none yet
    assert shadow.check(a, [3]) == (0, 0)  # 1 of 3 produced: not settled
    assert shadow.check(a, [1, 7]) == (1, 2)  # the third differs: 2 produced
    assert shadow.check(a, [3]) == (0, 0)  # settled drafts are gone
    shadow.propose([sampled, a, b])  # the cursor moved on: b gets [5, 6] after "5 6"
    assert shadow.check(b, [5, 6, 5]) == (1, 2)  # every draft produced
    shadow.propose([a])
    shadow.drop("a")
    assert shadow.check(a, [1, 2, 3]) == (0, 0)


def test_a_closed_gate_learns_from_shadow_drafts() -> None:
    """Gate 0: nothing is verified, outputs are those without speculation, and the shadow counts are
    exactly what verification would have accepted, computed from the final outputs."""
    rng = random.Random(5)
    prompts = [[rng.randrange(VOCAB) for _ in range(11)] for _ in range(4)]
    plain, _, _, _ = run_fake(prompts, spec=False)
    proposals = []  # (the request's token list, its length then, the drafts)
    real_propose = NgramProposer.propose

    def recording(self, token_ids, max_drafts=None):
        drafts = real_propose(self, token_ids, max_drafts)
        if drafts:
            proposals.append((token_ids, len(token_ids), drafts))
        return drafts

    NgramProposer.propose = recording
    try:
        spec, _, _, sched = run_fake(prompts, spec=True, gate=0)
    finally:
        NgramProposer.propose = real_propose
    assert spec == plain
    outs = [out for _, out in sched.steps]
    assert sum(out.num_drafts for out in outs) == 0
    expected_settled = expected_produced = 0
    for tokens, length, drafts in proposals:
        actual = tokens[length:]  # the list kept growing: it is the final sequence now
        m = 0
        while m < len(drafts) and m < len(actual) and actual[m] == drafts[m]:
            m += 1
        if m == len(drafts) or m < len(actual):  # settled before the request finished
            expected_settled += 1
            expected_produced += m
    assert expected_settled > 10 and 0 < expected_produced
    assert sum(out.num_shadow_drafts for out in outs) == expected_settled
    assert sum(out.num_shadow_accepted_tokens for out in outs) == expected_produced
