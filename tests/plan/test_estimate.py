"""The wall-time model of `batchgen plan`: the schedules (the engine's scheduler replayed, and the
event schedule kept for large jobs) against hand-computed steps, against each other and against the
scheduler driven directly; step prices, and fitting prices to timed steps."""

from __future__ import annotations

import random

import numpy as np
import pytest

from batchgen.engine.policy import FCFSPolicy
from batchgen.plan.calibrate import fit_costs
from batchgen.plan.calibrate_steps import StepSample, decode_batches
from batchgen.plan.estimate import ScheduleLimits, Sequences, StepCosts, simulate_schedule
from tests.engine.test_scheduler import BS, Spec, make_scheduler, run_workload

BOTH = ["engine", "events"]


def limits(seqs: int = 8, tokens: int = 16, blocks: int = 1000, chunked: bool = True, **kw) -> ScheduleLimits:
    return ScheduleLimits(seqs, tokens, blocks, BS, chunked, **kw)


def seqs_of(prompts, cached=None, shared: dict[int, list[int]] | None = None) -> Sequences:
    """Sequences of these prompt lengths; `shared`: sequence -> the chain hashes of its full prompt
    blocks (other prompts share nothing); `cached`: the event schedule's hits."""
    n = len(prompts)
    hashes = [(shared or {}).get(i, []) for i in range(n)]
    return Sequences(
        np.array(prompts, np.int64),
        np.array(cached or [0] * n, np.int64),
        np.array(prompts, np.int64),  # budgets: read by the window's order only (outputs are given)
        block_hashes=np.array([h for hs in hashes for h in hs], np.int64),
        block_offsets=np.cumsum([0] + [len(h) for h in hashes], dtype=np.int64),
    )


def simulate(prompts, cached, outputs, lim, method, shared=None):
    seqs = seqs_of(prompts, cached, shared)
    return simulate_schedule(seqs, np.array(outputs, np.int64), lim, trace=True, method=method)


def expanded(trace) -> list[tuple[int, int, int]]:
    """A trace's runs of steps alike as single steps (tokens, rows sampled, keys read by decodes)."""
    steps = []
    for count, tokens, sampled, context in trace:
        for k in range(count):
            steps.append((tokens, sampled, context + k * sampled * (tokens == sampled)))
    return steps


@pytest.mark.parametrize("method", BOTH)
def test_known_rows_give_the_hand_computed_steps_and_seconds(method):
    costs = StepCosts(batches=(1, 3), seconds=(1.0, 2.0), per_context_token=0.01, per_prefill_token=0.1)
    r = simulate([10, 10, 10], [0, 0, 0], [2, 3, 1], limits(seqs=2), method)
    # 1: row 0 whole (10) + 6 of row 1; row 0 samples its first token.
    # 2: row 0 decodes (at 10 + 1 keys), row 1's last 4 prompt tokens; row 0 ends (2 tokens).
    # 3: row 1 decodes (11 keys); row 2 admitted (running was 2 = max_num_seqs until row 0 ended),
    #    its whole prompt; row 2 ends at once (1 token).
    # 4: row 1 decodes its third token at 12 keys.
    assert r.trace == [(1, 16, 1, 0), (1, 5, 2, 11), (1, 11, 2, 11), (1, 1, 1, 12)]
    assert (r.steps, r.prefill_tokens, r.output_tokens, r.peak_seqs) == (4, 30, 6, 2)
    base2 = 1.5  # halfway from (1, 1.0) to (3, 2.0)
    want = (1.0 + 1.6) + (base2 + 0.11 + 0.4) + (base2 + 0.11 + 1.0) + (1.0 + 0.12)
    assert r.seconds(costs) == pytest.approx(want) and r.method == method


@pytest.mark.parametrize("method", BOTH)
def test_decode_steps_between_finishes(method):
    costs = StepCosts((1, 2), (1.0, 1.5), per_context_token=0.001, per_prefill_token=0.0)
    r = simulate([4, 4], [0, 0], [5, 9], limits(tokens=100), method)
    # Steps 2-5: both rows decode, reading 5, 6, 7, 8 keys each; steps 6-9: row 1 alone, 9 to 12.
    # The event schedule takes each run of them as one event.
    runs = [(1, 8, 2, 0), (4, 2, 2, 10), (4, 1, 1, 9)]
    assert r.trace == (runs if method == "events" else [(1, *step) for step in expanded(runs)])
    keys = sum(2 * k for k in range(5, 9)) + sum(range(9, 13))
    assert (r.steps, r.output_tokens, r.context_tokens) == (9, 14, keys)
    assert r.seconds(costs) == pytest.approx(1.5 + 4 * 1.5 + 4 * 1.0 + 0.001 * keys)


def test_kv_blocks_and_max_num_seqs_bound_the_rows_at_once():
    rows = 6
    # Events: a row of 4 + 4 tokens holds 2 blocks of 4: 5 blocks run two rows at once.
    r = simulate([4] * rows, [0] * rows, [4] * rows, limits(blocks=5), "events")
    assert r.peak_seqs == 2 and r.steps == rows // 2 * 4 and r.output_tokens == rows * 4
    r = simulate([4] * rows, [0] * rows, [4] * rows, limits(seqs=3), "events")
    assert r.peak_seqs == 3 and r.steps == rows // 3 * 4
    # A row larger than the whole cache still runs (alone), as the engine would admit it.
    r = simulate([40], [0], [40], limits(blocks=5), "events")
    assert r.steps == 3 + 39 and r.output_tokens == 40


def test_the_engine_admits_on_prompt_blocks_and_preempts_when_decodes_run_out():
    """The engine's scheduler with 5 blocks of 4 and 16 tokens a step: four 4-token prompts start
    at once (a block each); their first decodes need a second block each, so rows are preempted
    (recompute) and prefilled again: what the event schedule, admitting two whole rows at a time,
    leaves out."""
    rows = 6
    r = simulate([4] * rows, [0] * rows, [4] * rows, limits(blocks=5), "engine")
    assert r.peak_seqs == 4 and r.output_tokens == rows * 4 and r.trace[0] == (1, 16, 4, 0)
    assert r.preemptions > 0 and r.prefill_tokens > rows * 4  # recomputed prompts (and outputs)
    events = simulate([4] * rows, [0] * rows, [4] * rows, limits(blocks=5), "events")
    assert events.preemptions == 0 and events.prefill_tokens == rows * 4 and events.trace[0] == (1, 8, 2, 0)


@pytest.mark.parametrize("method", BOTH)
def test_chunked_prefill_off_waits_for_room(method):
    # Off: the second prompt (12) does not fit in the 16 - 10 tokens left, so it waits a step.
    r = simulate([10, 12], [0, 0], [3, 3], limits(chunked=False), method)
    assert r.trace[:2] == [(1, 10, 1, 0), (1, 13, 2, 11)]


def test_prefix_cache_hits_skip_prefill():
    # Events: the hits are given.
    r = simulate([20, 20], [0, 16], [1, 1], limits(tokens=64), "events")
    assert r.prefill_tokens == 24 and r.trace == [(1, 24, 2, 0)] and r.prefix_cache_hits == 16
    # The engine finds them: prompts sharing their first 4 blocks (of 5), and a third sharing only
    # the first. Admitted in one step, none finds the others' blocks (computed in that step); one
    # row at a time, the second is served 16 tokens and the third 4.
    shared = {0: [1, 2, 3, 4, 5], 1: [1, 2, 3, 4, 6], 2: [1, 7, 8, 9, 10]}
    together = simulate([20] * 3, None, [1] * 3, limits(tokens=64), "engine", shared)
    assert together.prefix_cache_hits == 0 and together.trace == [(1, 60, 3, 0)]
    alone = simulate([20] * 3, None, [1] * 3, limits(seqs=1), "engine", shared)
    assert alone.prefix_cache_hits == 16 + 4 and alone.prefill_tokens == 20 + 4 + 16
    scoring = seqs_of([20] * 3, shared=shared)  # the second asks for prompt log probabilities
    scoring.scores_prompt = np.array([False, True, False])
    r = simulate_schedule(scoring, np.ones(3, np.int64), limits(seqs=1), True, "engine")
    assert r.prefix_cache_hits == 4 and r.prefill_tokens == 20 + 20 + 16
    # The third row shares the first's 4 blocks; between them a row sharing nothing takes 5 fresh
    # blocks: in a cache of 10 it leaves the first's (the LRU hands out free uncached blocks first),
    # in a cache of 5 it evicts them.
    other = {0: [1, 2, 3, 4, 5], 1: [6, 7, 8, 9, 10], 2: [1, 2, 3, 4, 11]}
    for blocks, hits in ((10, 16), (5, 0)):
        r = simulate([20] * 3, None, [1] * 3, limits(seqs=1, blocks=blocks), "engine", other)
        assert r.prefix_cache_hits == hits, blocks


def test_the_replay_links_a_rows_sequences_and_orders_rows_by_the_policy():
    # A row with n = 2 (sequences 0 and 1) and a row of 8 tokens: the second sequence waits for
    # the first's prompt (and the next row behind it: head of line), then finds 16 tokens cached.
    seqs = seqs_of([20, 20, 8], shared={0: [1, 2, 3, 4, 5], 1: [1, 2, 3, 4, 5]})
    seqs.first = np.array([True, False, True])
    r = simulate_schedule(seqs, np.array([2, 2, 2], np.int64), limits(tokens=64), True, "engine")
    assert r.prefix_cache_hits == 16 and r.trace[:2] == [(1, 20, 1, 0), (1, 13, 3, 21)]
    # max-throughput: the window and the engine take the least work first (prompt + budget).
    outputs = np.array([1, 1, 1], np.int64)
    for policy, first_step in (("fcfs", 16), ("max-throughput", 5)):
        lim = limits(seqs=1, policy=policy)
        assert simulate_schedule(seqs_of([30, 5, 10]), outputs, lim, True, "engine").trace[0][1] == first_step


def test_the_replay_is_the_schedule_of_the_scheduler_driven_directly():
    """The replay measures the scheduler's steps as `run_workload` (the scheduler tests' driver)
    sees them, preemption and chunked prefill included."""
    rng = random.Random(3)
    prompts = [rng.randint(1, 40) for _ in range(30)]
    outputs = [rng.randint(1, 25) for _ in range(30)]
    s = make_scheduler(
        FCFSPolicy(), num_blocks=24, max_num_seqs=5, max_num_batched_tokens=32, prefix_caching=False
    )
    specs = [Spec([3 + i % 400 for i in range(p)], o) for p, o in zip(prompts, outputs, strict=True)]
    real = run_workload(s, specs)
    lim = limits(seqs=5, tokens=32, blocks=24, enable_prefix_caching=False)
    replay = simulate(prompts, None, outputs, lim, "engine")
    direct = [
        (
            out.num_batched_tokens,
            sum(it.samples for it in out.scheduled),
            sum(it.start + 1 for it in out.scheduled if it.is_decode),
        )
        for out in real.outputs
    ]
    assert expanded(replay.trace) == direct
    assert replay.preemptions == sum(len(out.preempted) for out in real.outputs) > 0


@pytest.mark.parametrize("seed", [7, 8])
def test_the_event_schedule_is_the_engines_where_both_apply(seed):
    """The copy kept for large jobs against the engine's scheduler on a recorded schedule: file
    order, a cache that holds every row (no preemption), no shared prefixes. A change to the
    scheduler's rules that the copy does not follow fails here."""
    rng = random.Random(seed)
    prompts = [rng.randint(1, 40) for _ in range(60)]
    outputs = [rng.randint(1, 25) for _ in range(60)]
    lim = limits(seqs=5, tokens=32, blocks=2000)
    engine = simulate(prompts, None, outputs, lim, "engine")
    events = simulate(prompts, None, outputs, lim, "events")
    assert expanded(events.trace) == expanded(engine.trace)
    summary = ("steps", "output_tokens", "context_tokens", "prefill_tokens", "peak_seqs", "steps_by_sampled")
    assert [getattr(events, k) for k in summary] == [getattr(engine, k) for k in summary]
    # A prompt's last token alone (a 1-token prompt, or the last of a chunked one, as in seed 8's
    # third step) is a decode: it reads the prompt's keys and is no prefill token.
    assert engine.prefill_tokens <= sum(prompts) and engine.preemptions == 0


def test_step_costs_interpolate_and_refuse_bad_points():
    c = StepCosts((1, 4, 16), (1.0, 1.3, 2.5), 0.0, 0.0)
    assert c.base(0) == c.base(1) == 1.0
    assert c.base(2) == pytest.approx(1.1) and c.base(10) == pytest.approx(1.9)
    assert c.base(32) == pytest.approx(2.5 + 16 * 0.1)  # the last segment, extended
    with pytest.raises(ValueError, match="ascending"):
        StepCosts((4, 1), (1.0, 1.0), 0.0, 0.0)
    with pytest.raises(ValueError, match=">= 0"):
        StepCosts((1,), (1.0,), -1.0, 0.0)


def test_fit_costs_recovers_the_prices_of_synthetic_steps():
    truth = StepCosts((1, 4, 16), (0.02, 0.03, 0.07), per_context_token=2e-6, per_prefill_token=5e-4)
    samples = []
    for b in decode_batches(16):
        for extra in (0.004, 0.0, 0.001):  # noise only adds time: the fastest is the truth
            ctx = b * 500
            samples.append(StepSample("decode", "context", b, ctx, 0, truth.step(b, ctx, 0) + extra))
    for extra in (0.0, 0.002, 0.003):
        samples.append(StepSample("decode", "short", 16, 48, 0, truth.step(16, 48, 0) + extra))
        samples.append(StepSample("prefill", "prefill", 4, 0, 2048, truth.step(4, 0, 2048) + extra))
    fast = fit_costs(samples, "fastest")
    assert fast.batches == (1, 4, 16)
    assert fast.seconds == pytest.approx(truth.seconds)
    assert fast.per_context_token == pytest.approx(truth.per_context_token)
    assert fast.per_prefill_token == pytest.approx(truth.per_prefill_token)
    median = fit_costs(samples, "median")
    assert median.base(16) + median.per_context_token * 8000 > fast.base(16) + fast.per_context_token * 8000
    with pytest.raises(ValueError, match="context"):
        fit_costs([s for s in samples if s.series != "context"])


@pytest.mark.parametrize("rows, batch", [(9, 16), (10, 16), (16, 16), (17, 32), (300, 256)])
def test_jobs_of_similar_size_share_one_calibration(monkeypatch, rows, batch):
    """The calibration is keyed by its largest batch: the job's peak rounded up to a power of two,
    within max_num_seqs, so a job of 9 rows reuses the one of 10 rows."""
    from batchgen.config import EngineConfig
    from batchgen.plan import calibrate, wall_time

    asked = {}
    monkeypatch.setattr(calibrate, "calibrate", lambda *a, **kw: asked.update(kw))  # returns None
    seqs = seqs_of([20] * rows)
    seqs.budgets = np.full(rows, 8, np.int64)
    seqs.expected = seqs.budgets
    limits = ScheduleLimits(max_num_seqs=256, max_num_batched_tokens=8192, num_blocks=4096, block_size=16)
    options = wall_time.WallTimeOptions(calibrate=False)
    estimate, note = wall_time.estimate_wall_time(
        seqs, limits, EngineConfig(device="cpu"), None, 0.0, options
    )
    assert estimate is None and asked["max_batch"] == batch and f"batches up to {batch}" in note
