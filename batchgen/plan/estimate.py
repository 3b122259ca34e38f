"""A job's continuous-batching schedule before it runs, and its price at measured step costs.

`simulate_schedule` is the one way in. It drives the engine's own `Scheduler` and `BlockManager`
(`batchgen.plan.replay`): requests built from token ids, fake sampled tokens that give each sequence
its expected output length, the same look-ahead window and policy as `batchgen run`, preemption
and the prefix cache's LRU as they are; so a change to the scheduler changes the plan with it.
That costs the scheduler's own time, some microseconds per sequence and step: for a job too large
to replay in about a minute (`REPLAY_MAX_WORK`) it falls back to `batchgen.plan.event_schedule`,
the scheduler's rules replayed by events in O(n log n) (file order, no preemption), which
`tests/plan/test_estimate.py` holds to the same schedule as the replay where both apply.

A schedule keeps what pricing needs (`Schedule`); `StepCosts` prices one step from what the
calibration measured (`batchgen.plan.calibrate`), so one schedule is priced at several costs.
"""

from __future__ import annotations

import numpy as np

from batchgen.plan.event_schedule import event_schedule
from batchgen.plan.replay import replay_schedule
from batchgen.plan.schedule import Schedule, ScheduleLimits, Sequences, StepCosts

__all__ = ["Schedule", "ScheduleLimits", "Sequences", "StepCosts", "replayable", "simulate_schedule"]

# Replay with the engine's scheduler up to this much work (output tokens of the schedule plus its
# sequences: the scheduler's per-sequence steps), and prompt blocks kept for it up to
# REPLAY_MAX_BLOCKS (8 bytes each); above either, the event schedule. Measured: docs/benchmarks.md.
REPLAY_MAX_WORK = 2_000_000
REPLAY_MAX_BLOCKS = 8_000_000


def replayable(seqs: Sequences, outputs: np.ndarray) -> str | None:
    """None when the engine's scheduler can replay `outputs` for `seqs` in about a minute, else why
    not (for the printed assumption)."""
    if seqs.block_offsets is None:
        return f"more than {REPLAY_MAX_BLOCKS:,} prompt blocks"
    work = int(np.sum(outputs)) + len(outputs)
    if work > REPLAY_MAX_WORK:
        return f"{work:,} sequence steps, more than the {REPLAY_MAX_WORK:,} it replays in about a minute"
    return None


def simulate_schedule(
    seqs: Sequences, outputs: np.ndarray, limits: ScheduleLimits, trace: bool = False, method: str = "auto"
) -> Schedule:
    """The schedule of `seqs` with each sequence stopping after its `outputs` tokens.

    Args:
        seqs: the sequences, in file order.
        outputs: each sequence's output tokens, `int64 [n]`, each >= 1.
        limits: the engine's budgets and the job's window.
        trace: keep every step (or run of steps alike) in `Schedule.trace`.
        method: "engine" (`batchgen.plan.replay`), "events" (`batchgen.plan.event_schedule`) or
            "auto": the engine's scheduler unless `replayable` says no.

    Returns:
        Schedule: its steps, tokens and peak, to price with `Schedule.seconds`.

    Raises:
        ValueError: an unknown method, lengths that differ in number, or "engine" without the
            prompt blocks.
        RuntimeError: the schedule cannot advance (never with limits `EnginePlan` sized).
    """
    if method not in ("auto", "engine", "events"):
        raise ValueError(f"method must be 'auto', 'engine' or 'events', got {method!r}")
    if method == "auto":
        method = "events" if replayable(seqs, outputs) else "engine"
    if method == "engine":
        return replay_schedule(seqs, outputs, limits, trace)
    return event_schedule(seqs.prompts, seqs.cached, outputs, limits, trace)
