"""`StepStats`' attention counts on a schedule worked out by hand (they set the bench's roofline), and
`EngineTotals.merged` over every field, and where a step's time goes (`StepPhases`)."""

from __future__ import annotations

import time
from dataclasses import fields

import pytest

from batchgen.config import EngineConfig
from batchgen.engine.llm_engine import LLMEngine
from batchgen.engine.stats import EngineTotals
from batchgen.sampling_params import SamplingParams


def test_context_and_attended_keys_per_step(tiny_model_dir) -> None:
    """Prompts of 10 and 3 tokens, 3 output tokens each, at most 8 tokens a step:
    step 0: A's positions 0-7                 context 8,        keys 1+..+8 = 36
    step 1: A's positions 8-9, B's 0-2         context 10 + 3,   keys (9+10) + (1+2+3) = 25
    step 2: decodes at A's 10 and B's 3        context 11 + 4,   keys 11 + 4
    step 3: decodes at A's 11 and B's 4        context 12 + 5,   keys 12 + 5
    """
    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir("llama")), dtype="float32", max_num_batched_tokens=8)
    )
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("A", {"prompt_token_ids": list(range(100, 110))}, params)
    engine.add_request("B", {"prompt_token_ids": [200, 201, 202]}, params)
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        s = engine.last_step
        seen.append((s.num_batched_tokens, s.num_context_tokens, s.num_attended_keys))
    assert seen == [(8, 8, 36), (5, 13, 25), (2, 15, 15), (2, 17, 17)]


def test_kv_cache_usage_counts_a_request_that_finishes_in_its_first_step(tiny_model_dir) -> None:
    """A 10-token prompt with one output token is prefilled, sampled and finished in one step; it held
    one block during it, which the step's usage shows (read before the finished request frees it)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), dtype="float32", block_size=16))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request("A", {"prompt_token_ids": list(range(100, 110))}, params)
    (out,) = engine.step()
    assert out.finished and engine.block_manager.usage == 0
    assert engine.last_step.kv_cache_usage == 1 / engine.block_manager.num_blocks


def test_engine_totals_merged_sums_every_counter_and_keeps_the_highest_peak() -> None:
    """Every field of two totals, each a distinct value: the merge sums all of them but the peak,
    which takes the larger; a field added later is summed too (checked field by field)."""
    a = EngineTotals(**{f.name: 1 + i for i, f in enumerate(fields(EngineTotals))})
    b = EngineTotals(**{f.name: 100 * (1 + i) for i, f in enumerate(fields(EngineTotals))})
    b.peak_kv_cache_usage = 0.25
    a.peak_kv_cache_usage = 0.75
    merged = EngineTotals.merged([a, b])
    for f in fields(EngineTotals):
        if f.name == "peak_kv_cache_usage":
            assert merged.peak_kv_cache_usage == 0.75
        else:
            assert getattr(merged, f.name) == getattr(a, f.name) + getattr(b, f.name), f.name
    assert merged.spec_decode_num_draft_tokens == 10 + 1000  # the counters `_summed` used to drop
    assert EngineTotals.merged([]) == EngineTotals()
    assert a.steps == 1 and b.steps == 100  # inputs untouched


def test_every_peak_in_engine_totals_merges_by_max() -> None:
    """A field named peak_* summed over replicas would be nonsense: it must declare max."""
    peaks = [f for f in fields(EngineTotals) if f.name.startswith("peak_")]
    assert peaks and all(f.metadata.get("merge") is max for f in peaks)


def test_step_phases_split_the_step_time_and_host_time_excludes_the_forward(tiny_model_dir) -> None:
    """A forward made 30 ms slower (as a slow device would be) shows in `forward_s`, not in the host
    time; the phases never add up to more than the step."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), dtype="float32"))
    model = engine.runner.model
    forward = model.forward

    def slow_forward(*args, **kwargs):
        time.sleep(0.03)
        return forward(*args, **kwargs)

    model.forward = slow_forward
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for i in range(4):
        engine.add_request(str(i), {"prompt_token_ids": list(range(100 + i, 110))}, params)
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        steps.append(engine.last_step)
    assert len(steps) == 3
    for s in steps:
        p = s.phases
        assert p.forward_s >= 0.03
        assert min(p.schedule_s, p.inputs_s, p.sample_s, p.update_s) > 0
        assert s.mask_time_s == 0.0  # no structured request: no token mask is filled or applied
        assert p.schedule_s + p.inputs_s + p.forward_s + p.sample_s + p.update_s <= s.step_time_s
        assert s.host_time_s == pytest.approx(s.step_time_s - p.forward_s - p.sample_s)
        assert s.host_time_s < s.step_time_s - 0.03
    assert engine.totals.host_time_s == pytest.approx(sum(s.host_time_s for s in steps))
