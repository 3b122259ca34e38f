"""The host time of batchgen's steps in a bench run: what a step spends outside the model's forward
and the sampler (scheduling, input preparation, token masks, the update and outputs), from the
engine's `StepPhases` (`batchgen.engine.stats`). On a GPU this is the time a faster device cannot
shorten."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class TimedStep(Protocol):
    """The fields of a step record (`metrics.StepRecord`) read here; seconds, None where unknown."""

    num_seqs: int
    num_prompt_tokens: int | None
    step_time_s: float | None
    host_time_s: float | None
    schedule_s: float | None
    inputs_s: float | None
    update_s: float | None
    mask_time_s: float | None


# Host time parts of a step, as `StepRecord` fields -> the report's keys (ms a step).
_HOST_PARTS = {
    "host_time_s": "host_ms_per_step",
    "schedule_s": "schedule_ms_per_step",
    "inputs_s": "inputs_ms_per_step",
    "update_s": "update_ms_per_step",
    "mask_time_s": "mask_ms_per_step",
}


def host_time(steps: Sequence[TimedStep]) -> dict[str, float | None]:
    """The mean host time a step spends outside the forward and the sampler, and its parts, in
    milliseconds (`host_ms_per_step`, `schedule_ms_per_step`, `inputs_ms_per_step`,
    `update_ms_per_step`, `mask_ms_per_step`), its share of the step time (`host_share`), and the
    same at the run's largest decode-only batch (`host_ms_full_decode`, over the decode steps with
    at least 90% of that batch's rows; `full_decode_rows` their mean rows). None where a record
    lacks the figures (the baselines)."""
    keys = [*_HOST_PARTS.values(), "host_share", "host_ms_full_decode", "full_decode_rows"]
    timed = [s for s in steps if s.host_time_s is not None and s.step_time_s]
    if not steps or len(timed) != len(steps):
        return dict.fromkeys(keys)
    out: dict[str, float | None] = {
        key: 1000 * float(np.mean([getattr(s, field) or 0.0 for s in timed]))
        for field, key in _HOST_PARTS.items()
    }
    total = sum(s.step_time_s or 0.0 for s in timed)
    out["host_share"] = sum(s.host_time_s or 0.0 for s in timed) / total if total else None
    decodes = [s for s in timed if not s.num_prompt_tokens]
    widest = max((s.num_seqs for s in decodes), default=0)
    full = [s for s in decodes if s.num_seqs >= 0.9 * widest] if widest else []
    out["host_ms_full_decode"] = 1000 * float(np.mean([s.host_time_s for s in full])) if full else None
    out["full_decode_rows"] = float(np.mean([s.num_seqs for s in full])) if full else None
    return out
