"""`batchgen plan`'s estimated wall time: the job's schedule simulated twice at measured step costs.

- low: every row stops after its expected output (measured on the rows an earlier run of the job
  committed, or `--expected-output-tokens`, else a quarter of its `max_tokens`), steps at the
  fastest time the calibration measured (less what its threads waited for a core), the model load
  without measuring kernels;
- high: every row runs to its `max_tokens` (a greedy row can stop earlier at EOS, so this is the
  most work the job can be), steps that much slower as the calibration's steps varied at most
  (`Calibration.spread`) and, on a CPU whose load average says other processes keep more threads
  runnable than it has cores, as much slower as a fair share of the cores would make them
  (`_load_slowdown`; docs/benchmarks.md shows how much a shared machine's load moves a run), the
  model load as measured.

Both add the time to read and tokenize the rows (the plan just did the same work `run` does) and
the model's load and set-up. The step costs come from `batchgen.plan.calibrate`; the two schedules
from `batchgen.plan.estimate.simulate_schedule` (the engine's scheduler where the job is small
enough to replay, else its rules by events), each simulated once and priced at both ends' costs.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from batchgen.plan.estimate import replayable, simulate_schedule
from batchgen.plan.schedule import Schedule, ScheduleLimits, Sequences

if TYPE_CHECKING:
    import torch

    from batchgen.config import EngineConfig
    from batchgen.plan.calibrate import Calibration

LOW_FRACTION = 0.25  # of max_tokens: the expected output when nothing better is known


@dataclass(frozen=True)
class WallTimeOptions:
    """How `plan` estimates the wall time.

    Attributes:
        calibrate: True: measure the step costs now (a few seconds: the model is loaded on the
            job's device), even when a calibration is cached; False: only a cached one; None: a
            cached one, else on a CPU measure now (on CUDA none, so `plan` never takes a GPU a
            job may be using unless asked).
        expected_output_tokens: the expected output of a sequence in tokens (capped by its
            `max_tokens`), for the low end; None: measured on committed rows, else a quarter of
            `max_tokens`.
        use_cache: read and write the calibration cache.
        cache_dir: the calibration cache folder (default: batchgen's cache).
        log: a line to the user before a calibration starts.
        kernels_cached: whether the run will find its kernel table measured (`plan.child.sizes`);
            when not, and the calibration is an earlier one, the run's start also measures them.
    """

    calibrate: bool | None = None
    expected_output_tokens: int | None = None
    use_cache: bool = True
    cache_dir: Path | None = None
    log: Callable[[str], None] | None = None
    kernels_cached: bool = True


@dataclass
class WallTimeEstimate:
    """The estimate `plan` prints: `low_s` .. `high_s` seconds, under `assumption`, from `rates`.

    `startup_s`: model load and set-up (measured), `kernel_measure_s` of it measuring this
    machine's kernels where the run will (its table is not cached); `tokenize_s`: reading and
    tokenizing the rows (this plan's own time); `*_steps` / `*_output_tokens`: the simulated
    schedules; `peak_seqs`: the most rows at once in them.
    """

    low_s: float
    high_s: float
    assumption: str
    rates: str
    startup_s: float
    tokenize_s: float
    low_steps: int
    high_steps: int
    low_output_tokens: int
    high_output_tokens: int
    peak_seqs: int
    kernel_measure_s: float | None = None


def expected_outputs(
    budgets: np.ndarray, given: int | None, committed_fraction: float | None
) -> tuple[np.ndarray, str]:
    """(each sequence's expected output tokens `int64 [n]`, >= 1 and <= its budget; what they rest
    on, in words): `given` tokens, else the fraction of `max_tokens` the committed rows used, else
    `LOW_FRACTION` of it."""
    if given is not None:
        return np.clip(np.minimum(budgets, given), 1, None), f"{given} tokens a sequence (as given)"
    if committed_fraction is not None:
        basis = f"{100 * committed_fraction:.0f}% of max_tokens, as the rows an earlier run committed"
        fraction = committed_fraction
    else:
        basis = f"{100 * LOW_FRACTION:.0f}% of max_tokens (no earlier run of this job to measure)"
        fraction = LOW_FRACTION
    return np.clip(np.ceil(budgets * fraction).astype(np.int64), 1, None), basis


def _pow2(x: float) -> int:
    """The power of two nearest `x` (>= 16): calibration lengths, so similar jobs share one."""
    return max(16, 2 ** round(math.log2(max(x, 1.0))))


def estimate_wall_time(
    seqs: Sequences,
    limits: ScheduleLimits,
    config: EngineConfig,
    dtype: torch.dtype,
    tokenize_s: float,
    options: WallTimeOptions,
    device: str | None = None,
    measure: Callable[..., tuple[Calibration | None, tuple[float, int] | None]] | None = None,
) -> tuple[WallTimeEstimate | None, str | None]:
    """(the estimate, None) or (None, why there is none).

    Args:
        seqs: the sequences to run, with `expected` filled.
        limits: the engine's budgets (from `EnginePlan`).
        config: the job's `EngineConfig` (the calibration's engine).
        dtype: the engine's resolved dtype.
        tokenize_s: seconds the plan took to read the job and tokenize the rows (`run` does the
            same before and between its steps; its start-up is the calibration's `startup_s`).
        options: calibration and expectation options.
        device: the engine's device, "cpu" or "cuda" (None: `config.device` resolved here).
        measure: `measure_machine` or a stand-in with its arguments (`plan_child.ask_measure`
            runs it in a child process).

    Raises:
        ValueError / ModelNotFoundError: a calibration's engine cannot be built.
    """
    from batchgen.config import resolve_device

    if not len(seqs.prompts):
        return None, "no rows to run"
    # The high schedule is the larger: one method for both, so the two ends compare.
    why_not = replayable(seqs, seqs.budgets)
    method = "events" if why_not else "engine"
    assert seqs.expected is not None  # `expected_outputs` set them
    low, high = (simulate_schedule(seqs, out, limits, method=method) for out in (seqs.expected, seqs.budgets))
    peak = max(low.peak_seqs, high.peak_seqs)
    # Up to the next power of two (within max_num_seqs): a job of 9 rows and one of 10 share a calibration.
    max_batch = min(1 << max(peak - 1, 0).bit_length(), max(limits.max_num_seqs, peak))
    device = device or resolve_device(config.device)
    lengths = {
        "prompt_len": _pow2(float(seqs.prompts.mean())),
        "context_len": _pow2(float(seqs.prompts.mean() + seqs.budgets.mean() / 2)),
        "max_batch": max_batch,
    }
    calibration, load = (measure or measure_machine)(config, dtype, device, lengths, options)
    if calibration is None:
        why = "--no-calibrate" if options.calibrate is False else f"on {device}, only with --calibrate"
        shape = f"batches up to {max_batch}, prompts of about {lengths['prompt_len']} tokens"
        return None, (
            f"no measured step times for this model, machine and job shape ({shape}) in the cache; "
            f"{why} skipped measuring them: a few seconds' run"
        )
    estimate = _estimate(seqs, (low, high, why_not), calibration, tokenize_s, peak, load)
    return _with_kernel_measuring(estimate, calibration, options.kernels_cached), None


def _with_kernel_measuring(
    estimate: WallTimeEstimate, calibration: Calibration, kernels_cached: bool
) -> WallTimeEstimate:
    """`estimate` with the run's kernel measuring added to its start-up where the run will measure
    (the table is not cached) and the calibration did not just measure them (a calibration made
    now leaves the table cached for the run): the seconds the calibration's own start spent
    measuring when it measured (`Calibration.kernel_measure_s`), else a note that it is not known."""
    if kernels_cached or not calibration.cached:
        return estimate
    extra = calibration.kernel_measure_s
    if extra is None:
        note = "; the kernel table is not cached, so the run's start also measures this machine's kernels (not timed here)"
        return dataclasses.replace(estimate, assumption=estimate.assumption + note)
    return dataclasses.replace(
        estimate,
        low_s=estimate.low_s + extra,
        high_s=estimate.high_s + extra,
        startup_s=estimate.startup_s + extra,
        kernel_measure_s=extra,
    )


def measure_machine(
    config: EngineConfig, dtype: torch.dtype, device: str, lengths: dict[str, int], options: WallTimeOptions
) -> tuple[Calibration | None, tuple[float, int] | None]:
    """(the calibration: cached, measured now or None (`calibrate`); on a CPU the load before it,
    `busy_share`). `lengths`: `calibrate`'s prompt_len, context_len and max_batch.

    Raises:
        ValueError / ModelNotFoundError: a calibration's engine cannot be built.
    """
    from batchgen.plan.calibrate import calibrate

    measure = options.calibrate if options.calibrate is not None else device == "cpu"
    load = busy_share() if device == "cpu" else None  # read before the calibration adds to it
    calibration = calibrate(
        config,
        dtype,
        **lengths,
        measure=measure,
        refresh=options.calibrate is True,
        use_cache=options.use_cache,
        cache_dir=options.cache_dir,
        log=options.log,
    )
    return calibration, load


def busy_share() -> tuple[float, int] | None:
    """(the largest of the 1, 5 and 15-minute load averages, usable cores), or None where the
    system keeps no load average."""
    from batchgen.kernels.machine_load import usable_cores

    try:
        return max(os.getloadavg()), usable_cores()
    except (AttributeError, OSError):
        return None


def _load_slowdown(calibration: Calibration, load: tuple[float, int] | None) -> tuple[float, str]:
    """How much slower than in the calibration a run's steps can be on a machine this loaded, and
    why: a run's threads get about cores / (load + threads) of a core each when other processes
    keep `load` threads runnable (Linux shares the cores fairly among runnable threads); the
    calibration's steps ran with `cpu_share` of theirs. 1 on a machine with cores to spare."""
    if load is None:
        return 1.0, ""
    average, cores = load
    share = min(1.0, cores / (average + calibration.threads))
    slowdown = max(1.0, calibration.cpu_share / share)
    if slowdown == 1.0:
        return 1.0, ""
    why = (
        f" x{slowdown:.2f} (a load average of up to {average:.1f} on {cores} cores leaves a run's "
        f"thread{'s' if calibration.threads != 1 else ''} {100 * share:.0f}% of a core; the calibration's "
        f"got {100 * calibration.cpu_share:.0f}%)"
    )
    return slowdown, why


def _schedule_words(schedule: Schedule, why_not: str | None) -> str:
    """How the schedules were made, for the printed assumption."""
    if schedule.method == "engine":
        return "the engine's scheduler replayed (its policy, window, preemption and prefix cache)"
    return f"the scheduler's rules by events, rows in file order without preemption ({why_not})"


def _estimate(
    seqs: Sequences,
    schedules: tuple[Schedule, Schedule, str | None],
    calibration: Calibration,
    tokenize_s: float,
    peak: int,
    load: tuple[float, int] | None,
) -> WallTimeEstimate:
    """The two schedules (low, high, why the engine did not replay them) at the calibration's costs,
    and their description."""
    low, high, why_not = schedules
    costs, spread = calibration.costs("fastest"), calibration.spread
    slowdown, why = _load_slowdown(calibration, load)
    # A calibration whose threads waited for a core ran slower than a run on an idle machine would.
    low_s = low.seconds(costs.scaled(min(calibration.cpu_share, 1.0)))
    high_s = high.seconds(costs.scaled(spread * slowdown))
    when = f"cached from {calibration.measured_at}" if calibration.cached else "now"
    threads = f"{calibration.threads} thread{'s' if calibration.threads != 1 else ''}"
    threads += f" at {100 * calibration.cpu_share:.0f}% of their cores"
    if calibration.other_cores is not None:
        threads += f"; other processes used {calibration.other_cores:.1f} cores meanwhile"
    return WallTimeEstimate(
        low_s=max(calibration.startup_s - calibration.kernel_choice_s, 0.0) + tokenize_s + low_s,
        high_s=calibration.startup_s + tokenize_s + high_s,
        assumption=(
            f"low: rows stop after {seqs.basis}, at the fastest measured step times; high: every "
            "row runs to its max_tokens (greedy rows may stop earlier at EOS), at those times "
            f"x{spread:.2f} (the widest spread of one step's times while measured){why}; schedule: "
            f"{_schedule_words(low, why_not)}"
        ),
        rates=f"{len(calibration.samples)} steps timed on this machine ({when}, {threads})",
        startup_s=calibration.startup_s,
        tokenize_s=tokenize_s,
        low_steps=low.steps,
        high_steps=high.steps,
        low_output_tokens=low.output_tokens,
        high_output_tokens=high.output_tokens,
        peak_seqs=peak,
    )


def duration(seconds: float) -> str:
    """`seconds` as 45s, 3m05s or 2h07m."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s // 60 % 60:02d}m"
