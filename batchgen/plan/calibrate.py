"""The step costs `batchgen plan` prices a job with: a short calibration run of the job's own engine.

The engine is built exactly as `batchgen run` builds it (the same options, so the same dtype, kernel
choice and thread count), and a few real steps are timed on random token ids:

- prefill: two steps of a full token budget (`max_num_batched_tokens`) of prompts of the job's mean
  length (capped at the budget);
- decode: steps at batch sizes 1, 4, 16, ... up to the most rows the job runs at once, every row at
  the job's mean context, then the largest batch again at a context of a few tokens: the difference
  prices decode attention per key. The rows' contexts are not prefilled (that would take longer
  than all the rest): the scheduler is told their prompts are computed, and their KV blocks are
  written so that attention reads memory as a run's does.

`fit_costs` turns the timed steps into `StepCosts` (`batchgen.plan.schedule`), with the fastest time
of each point (what the machine does when least disturbed), the median or the slowest. The
samples are cached on disk under batchgen's cache (`plan_calibration/`), keyed like the kernel
tuning table (`batchgen.model.kernel_choice.choice.tuning_key`: CPU, threads, torch, dtype, kernel sources)
plus the model's fingerprint, the engine options that change a step's time and the calibration's
lengths, so planning the same job again on the same machine measures nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from batchgen.cache import cache_root, write_atomically
from batchgen.config import EngineConfig
from batchgen.plan.calibrate_steps import StepSample, measure_steps
from batchgen.plan.schedule import StepCosts

if TYPE_CHECKING:
    import torch

    from batchgen.model.kernel_choice.choice import KernelChoice

logger = logging.getLogger(__name__)

CALIBRATION_VERSION = 2  # a change in what is measured or stored starts a new cache


@dataclass
class Calibration:
    """What a calibration measured on this machine (JSON on disk: `to_json` / `from_json`).

    Attributes:
        key: what the measurements depend on (`calibration_key`).
        startup_s: seconds to build the engine (model load, kernel choice), as a run's start.
        kernel_choice_s: the part of `startup_s` spent choosing kernels (measuring them where the
            kernel table had no entry: a later start only looks them up).
        kernel_measure_s: `kernel_choice_s` where that start measured kernels (what a start with
            no kernel table spends on them), else None.
        threads: torch threads the steps ran with.
        other_cores: cores' worth of CPU other processes used while the steps ran (None where
            /proc/stat is missing): a busy machine's steps are slower and vary more.
        cpu_share: this process's CPU time over the steps' wall time times `threads`: how much of
            its cores the calibration got (a run that gets less takes longer in proportion).
        samples: the timed steps.
        measured_at: when (local time, ISO 8601).
        cached: read from the cache rather than measured now (not stored).
    """

    key: dict[str, str]
    startup_s: float
    kernel_choice_s: float
    threads: int
    other_cores: float | None
    cpu_share: float
    samples: list[StepSample]
    measured_at: str
    kernel_measure_s: float | None = None
    cached: bool = field(default=False, compare=False)

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data.pop("cached")
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        """Raises: ValueError / KeyError / TypeError on a file that is not a calibration."""
        data = json.loads(text)
        data["samples"] = [StepSample(**s) for s in data["samples"]]
        return cls(**data, cached=True)

    def costs(self, statistic: str = "fastest") -> StepCosts:
        """`fit_costs` of the samples with "fastest", "median" or "slowest" step times."""
        return fit_costs(self.samples, statistic)

    @property
    def spread(self) -> float:
        """The widest ratio of slowest to fastest time among the steps of one kind (>= 1): how
        much the machine's speed varied while it was measured."""
        groups: dict[tuple[str, str, int], list[float]] = {}
        for s in self.samples:
            groups.setdefault((s.kind, s.series, s.sampled), []).append(s.seconds)
        return max((max(t) / min(t) for t in groups.values() if min(t) > 0), default=1.0)


STATISTICS: dict[str, Callable[[list[float]], float]] = {
    "fastest": min,
    "median": statistics.median,
    "slowest": max,
}


def _stat(values: list[float], statistic: str) -> float:
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {', '.join(STATISTICS)}, got {statistic!r}")
    return float(STATISTICS[statistic](values))


def fit_costs(samples: list[StepSample], statistic: str = "fastest") -> StepCosts:
    """`StepCosts` from timed steps: per decode batch size the step's time (its `statistic` over the
    timed steps) less its context's (never below a smaller batch's), the context's price per key from the largest batch measured at
    two contexts, and the prefill price per token from the prefill steps less their sampled rows'.

    Args:
        samples: decode samples of series "context" at one or more batch sizes; optionally
            "short" decode samples at the largest of them (without, decode attention is priced
            into each batch size's base time); prefill samples (without, prefill is free: only
            for tests).
        statistic: "fastest" (the minimum of each point's times), "median" or "slowest".

    Raises:
        ValueError: no "context" decode samples, or an unknown statistic.
    """
    points: dict[tuple[str, int], tuple[list[float], list[int]]] = {}
    for s in samples:
        if s.kind == "decode":
            times, contexts = points.setdefault((s.series, s.sampled), ([], []))
            times.append(s.seconds)
            contexts.append(s.context)
    long = {
        b: (_stat(t, statistic), statistics.fmean(c)) for (k, b), (t, c) in points.items() if k == "context"
    }
    if not long:
        raise ValueError("fit_costs needs decode samples of the 'context' series")
    batches = sorted(long)
    per_key = 0.0
    largest = batches[-1]
    if ("short", largest) in points:
        times, contexts = points[("short", largest)]
        t_long, c_long = long[largest]
        c_short = statistics.fmean(contexts)
        if c_long > c_short:
            per_key = (t_long - _stat(times, statistic)) / (c_long - c_short)
        # Never more than the whole step at any batch size: a base time stays >= 0.
        per_key = min(max(per_key, 0.0), *(t / c for t, c in long.values() if c > 0))
    seconds, floor = [], 0.0
    for b in batches:  # more rows never make a step cheaper: timing noise can say otherwise
        floor = max(floor, long[b][0] - per_key * long[b][1])
        seconds.append(floor)
    costs = StepCosts(tuple(batches), tuple(seconds), per_key, 0.0)
    prefill = [
        (s.seconds - costs.base(s.sampled)) / s.prefill for s in samples if s.kind == "prefill" and s.prefill
    ]
    if prefill:
        costs = dataclasses.replace(costs, per_prefill_token=max(_stat(prefill, statistic), 0.0))
    return costs


def calibration_key(
    config: EngineConfig, dtype: torch.dtype, threads: int, lengths: dict[str, int]
) -> dict[str, str]:
    """What a calibration's times depend on: the machine (as the kernel table's key), the model's
    files, the engine options that change a step's time, and the calibration's own lengths."""
    import torch

    from batchgen.config import resolve_device
    from batchgen.model.kernel_choice.choice import tuning_key
    from batchgen.model.loading.fingerprint import model_fingerprint

    device = resolve_device(config.device)
    key = tuning_key(dtype, threads, torch.device(device))  # on CUDA: the GPU, CUDA and Triton too
    key["calibration"] = str(CALIBRATION_VERSION)
    key["device"] = device
    key["model"] = model_fingerprint(config.model) or str(config.model)
    for name in ("max_num_batched_tokens", "block_size", "attention_backend", "kernels", "one_weight_layout"):
        key[name] = str(getattr(config, name))
    key.update({name: str(value) for name, value in sorted(lengths.items())})
    return key


def _path(key: dict[str, str], directory: Path | None) -> Path:
    directory = directory if directory is not None else cache_root() / "plan_calibration"
    return directory / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20] + ".json")


def load_cached(key: dict[str, str], directory: Path | None = None) -> Calibration | None:
    """The cached calibration for `key`, or None (none, unreadable, or another key's)."""
    path = _path(key, directory)
    try:
        found = Calibration.from_json(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("plan calibration cache %s is unreadable (%s); measuring again", path, exc)
        return None
    return found if found.key == key else None


def save(calibration: Calibration, directory: Path | None = None) -> None:
    """Write the calibration atomically (a cache that cannot be written costs a warning)."""
    path = _path(calibration.key, directory)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, calibration.to_json().encode())
    except OSError as exc:
        logger.warning("could not write the plan calibration cache %s: %s", path, exc)


def calibrate(
    config: EngineConfig,
    dtype: torch.dtype,
    prompt_len: int,
    context_len: int,
    max_batch: int,
    measure: bool = True,
    refresh: bool = False,
    use_cache: bool = True,
    cache_dir: Path | None = None,
    log: Callable[[str], None] | None = None,
) -> Calibration | None:
    """The step costs of the job's engine on this machine: cached, or measured now (module docstring).

    Args:
        config: the job's engine options (the engine is built with them, as `run` builds it).
        dtype: the dtype the engine resolves to (`engine.sizing.resolve_dtype`), for the cache key.
        prompt_len: prompt length of the prefill steps (the job's mean prompt, in tokens).
        context_len: keys each decoding row attends to (the job's mean prompt + half its output).
        max_batch: the largest decode batch to time (the most rows the job runs at once).
        measure: build the engine and measure when the cache has no calibration (False: None then).
        refresh: measure even when the cache has a calibration (and replace it).
        use_cache: look the calibration up first and store a new one (False: measure, store nothing).
        cache_dir: the cache folder (default: `plan_calibration` under batchgen's cache).
        log: called with a line before the model loads (a calibration takes seconds).

    Raises:
        ValueError / ModelNotFoundError: the engine cannot be built with these options.
    """
    import torch

    from batchgen.config import resolve_device
    from batchgen.engine.cpu_threads import CpuThreads
    from batchgen.engine.llm_engine import LLMEngine
    from batchgen.kernels.machine_load import LoadSample

    lengths = {"prompt_len": prompt_len, "context_len": context_len, "max_batch": max_batch}
    if use_cache and not refresh:
        # The thread count the engine will pick at this load (it measures the same way).
        cpu = resolve_device(config.device) == "cpu"
        threads = CpuThreads(config.num_threads).threads if cpu else torch.get_num_threads()
        if (found := load_cached(calibration_key(config, dtype, threads, lengths), cache_dir)) is not None:
            return found
    if not (measure or refresh):
        return None
    if log is not None:
        log("calibrating: loading the model and timing a few steps (--no-calibrate skips this)")
    start = time.perf_counter()
    engine = LLMEngine(config)
    startup = time.perf_counter() - start
    threads = torch.get_num_threads()
    load, cpu_start, wall = LoadSample(), time.process_time(), time.perf_counter()
    samples = measure_steps(engine, prompt_len, context_len, max_batch)
    cpu_share = (time.process_time() - cpu_start) / ((time.perf_counter() - wall) * threads)
    calibration = Calibration(
        key=calibration_key(config, engine.dtype, threads, lengths),
        startup_s=startup,
        kernel_choice_s=engine.runner.kernel_choice.seconds,
        kernel_measure_s=_measuring_seconds(engine.runner.kernel_choice),
        threads=threads,
        other_cores=LoadSample().other_cores_since(load),
        cpu_share=cpu_share,
        samples=samples,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
    if use_cache:
        save(calibration, cache_dir)
    return calibration


def _measuring_seconds(choice: KernelChoice) -> float | None:
    """A `KernelChoice`'s seconds where its table measured something (`TuningTable.announced`)."""
    table = getattr(choice, "table", None)
    return choice.seconds if table is not None and table.announced else None
