"""The wall-time model of `batchgen plan`: the simulated schedule against hand-computed steps and
against the engine's own scheduler, step prices, and fitting prices to timed steps."""

from __future__ import annotations

import random

import pytest

from batchgen.engine.policy import FCFSPolicy
from batchgen.plan.calibrate import fit_costs
from batchgen.plan.calibrate_steps import StepSample, decode_batches
from batchgen.plan.estimate import ScheduleLimits, StepCosts, simulate_schedule
from tests.engine.test_scheduler import BS, Spec, make_scheduler, run_workload

UNIT = StepCosts((1,), (1.0,), 0.0, 0.0)


def limits(seqs: int = 8, tokens: int = 16, blocks: int = 1000, chunked: bool = True) -> ScheduleLimits:
    return ScheduleLimits(seqs, tokens, blocks, BS, chunked)


def test_known_rows_give_the_hand_computed_steps_and_seconds():
    costs = StepCosts(batches=(1, 3), seconds=(1.0, 2.0), per_context_token=0.01, per_prefill_token=0.1)
    r = simulate_schedule([10, 10, 10], [0, 0, 0], [2, 3, 1], limits(seqs=2), costs, trace=True)
    # 1: row 0 whole (10) + 6 of row 1; row 0 samples its first token.
    # 2: row 0 decodes (at 10 + 1 keys), row 1's last 4 prompt tokens; row 0 ends (2 tokens).
    # 3: row 1 decodes (11 keys); row 2 admitted (running was 2 = max_num_seqs until row 0 ended),
    #    its whole prompt; row 2 ends at once (1 token).
    # 4: row 1 decodes its third token at 12 keys.
    assert r.trace == [(1, 16, 1, 0), (1, 5, 2, 11), (1, 11, 2, 11), (1, 1, 1, 12)]
    assert (r.steps, r.prefill_tokens, r.output_tokens, r.peak_seqs) == (4, 30, 6, 2)
    base2 = 1.5  # halfway from (1, 1.0) to (3, 2.0)
    want = (1.0 + 1.6) + (base2 + 0.11 + 0.4) + (base2 + 0.11 + 1.0) + (1.0 + 0.12)
    assert r.seconds == pytest.approx(want)


def test_decode_steps_between_finishes_are_one_run():
    costs = StepCosts((1, 2), (1.0, 1.5), per_context_token=0.001, per_prefill_token=0.0)
    r = simulate_schedule([4, 4], [0, 0], [5, 9], limits(tokens=100), costs, trace=True)
    # Steps 2-5: both rows decode, reading 5, 6, 7, 8 keys each; steps 6-9: row 1 alone, 9 to 12.
    assert r.trace == [(1, 8, 2, 0), (4, 2, 2, 10), (4, 1, 1, 9)]
    assert r.steps == 9 and r.output_tokens == 14
    keys = sum(2 * k for k in range(5, 9)) + sum(range(9, 13))
    assert r.seconds == pytest.approx(1.5 + 4 * 1.5 + 4 * 1.0 + 0.001 * keys)


def test_kv_blocks_and_max_num_seqs_bound_the_rows_at_once():
    rows = 6
    # A row of 4 + 4 tokens holds 2 blocks of 4: 5 blocks run two rows at once.
    r = simulate_schedule([4] * rows, [0] * rows, [4] * rows, limits(blocks=5), UNIT)
    assert r.peak_seqs == 2 and r.steps == rows // 2 * 4 and r.output_tokens == rows * 4
    r = simulate_schedule([4] * rows, [0] * rows, [4] * rows, limits(seqs=3), UNIT)
    assert r.peak_seqs == 3 and r.steps == rows // 3 * 4
    # A row larger than the whole cache still runs (alone), as the engine would admit it.
    r = simulate_schedule([40], [0], [40], limits(blocks=5), UNIT)
    assert r.steps == 3 + 39 and r.output_tokens == 40


def test_prefix_cache_hits_skip_prefill_and_chunked_prefill_off_waits_for_room():
    r = simulate_schedule([20, 20], [0, 16], [1, 1], limits(tokens=64), UNIT, trace=True)
    assert r.prefill_tokens == 24 and r.trace == [(1, 24, 2, 0)]
    # Off: the second prompt (12) does not fit in the 16 - 10 tokens left, so it waits a step.
    r = simulate_schedule([10, 12], [0, 0], [3, 3], limits(chunked=False), UNIT, trace=True)
    assert r.trace[:2] == [(1, 10, 1, 0), (1, 13, 2, 11)]


def test_simulation_matches_the_engine_scheduler_step_by_step():
    """Without preemption (the cache holds every row), the simulation is the scheduler's schedule."""
    rng = random.Random(7)
    prompts = [rng.randint(1, 40) for _ in range(30)]
    outputs = [rng.randint(1, 25) for _ in range(30)]
    s = make_scheduler(
        FCFSPolicy(), num_blocks=2000, max_num_seqs=5, max_num_batched_tokens=32, prefix_caching=False
    )
    real = run_workload(
        s, [Spec([3 + i % 400 for i in range(p)], o) for p, o in zip(prompts, outputs, strict=True)]
    )
    sim = simulate_schedule(
        prompts, [0] * 30, outputs, limits(seqs=5, tokens=32, blocks=2000), UNIT, trace=True
    )
    expanded = []
    for count, tokens, sampled, context in sim.trace:
        for k in range(count):
            expanded.append((tokens, sampled, context + k * sampled * (tokens == sampled)))
    engine = [
        (
            out.num_batched_tokens,
            sum(it.samples for it in out.scheduled),
            sum(it.start + 1 for it in out.scheduled if it.is_decode),
        )
        for out in real.outputs
    ]
    assert expanded == engine
    assert sim.output_tokens == sum(outputs) and sim.prefill_tokens == sum(prompts)


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
    import numpy as np

    from batchgen.config import EngineConfig
    from batchgen.plan import calibrate, wall_time

    asked = {}
    monkeypatch.setattr(calibrate, "calibrate", lambda *a, **kw: asked.update(kw))  # returns None
    seqs = wall_time.Sequences(*(np.full(rows, v, np.int64) for v in (20, 0, 8)))
    seqs.expected = seqs.budgets
    limits = ScheduleLimits(max_num_seqs=256, max_num_batched_tokens=8192, num_blocks=4096, block_size=16)
    options = wall_time.WallTimeOptions(calibrate=False)
    estimate, note = wall_time.estimate_wall_time(
        seqs, limits, EngineConfig(device="cpu"), None, 0.0, options
    )
    assert estimate is None and asked["max_batch"] == batch and f"batches up to {batch}" in note
