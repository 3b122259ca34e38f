"""The bench's host time figures (`batchgen.bench.report.host_time`) on steps worked out by hand."""

from __future__ import annotations

import pytest

from batchgen.bench.report.host_time import host_time
from batchgen.bench.report.metrics import StepRecord


def _step(seqs: int, prompt: int, step_s: float, host_s: float, mask_s: float = 0.0) -> StepRecord:
    return StepRecord(
        t=0.0,
        num_seqs=seqs,
        num_batched_tokens=seqs + prompt,
        num_generation_tokens=seqs,
        num_prompt_tokens=prompt,
        step_time_s=step_s,
        host_time_s=host_s,
        schedule_s=host_s / 4,
        inputs_s=host_s / 4,
        update_s=host_s / 4,
        mask_time_s=mask_s,
    )


def test_host_time_means_share_and_the_widest_decode_steps() -> None:
    """A prefill step (8 ms host of 100 ms), decode steps of 100, 95 and 50 rows: the widest decode
    batch is 100 rows, and steps with at least 90 rows (100 and 95) make its figure."""
    steps = [
        _step(10, 500, 0.100, 0.008),
        _step(100, 0, 0.020, 0.002, mask_s=0.001),
        _step(95, 0, 0.020, 0.004),
        _step(50, 0, 0.010, 0.002),
    ]
    out = host_time(steps)
    assert out["host_ms_per_step"] == pytest.approx(4.0)
    assert out["schedule_ms_per_step"] == pytest.approx(1.0)
    assert out["mask_ms_per_step"] == pytest.approx(0.25)
    assert out["host_share"] == pytest.approx(0.016 / 0.150)
    assert out["host_ms_full_decode"] == pytest.approx(3.0)
    assert out["full_decode_rows"] == pytest.approx(97.5)


def test_records_without_host_time_give_none() -> None:
    """The Hugging Face baselines' records carry no phases: every figure is None, not 0."""
    out = host_time([StepRecord(t=0.0, num_seqs=4, num_batched_tokens=4, num_generation_tokens=4)])
    assert set(out.values()) == {None}
