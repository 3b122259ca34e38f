"""What a bench measures: per-request and per-step records, their summary, and resource use.

Definitions (vLLM's benchmark names):
    TTFT   first token time - arrival time (seconds).
    e2e    finish time - arrival time (seconds).
    TPOT   (e2e - TTFT) / (output tokens - 1), over requests with more than one output token.
    wait   first scheduled time - arrival time: how long a request sat in the queue before it
           got any compute (the starvation check). `wait_steps` counts the engine steps that
           ended between the request entering the engine's queue and its first step.
    output tokens/s   real output tokens (padding never counts) / wall time.
    total tokens/s    (real prompt tokens + real output tokens) / wall time.
    wall time         bench start (time 0, where arrivals are measured from) -> last finish.
    tail              the moment fewer than `TAIL_REQUESTS` requests are left unfinished -> last
                      finish: the end of a job, where the batch shrinks and the machine idles.
    tail output tokens/s   output tokens of the steps that end in the tail / tail time. Two runs'
                      tails can hold different work (a faster run reaches "fewer than 8 left"
                      with more of its long requests' tokens still to go), so their speeds
                      compare by this rate, not by the tail's length.
    acceptance rate   speculative decoding: draft tokens accepted / draft tokens verified.
    mean batch size   mean over steps of the sequences in the step (running batch size).
All times are `time.perf_counter()` seconds relative to the configuration's start.
A run whose `extra["per_request_times"]` is False (the vLLM baseline) knows only its wall time: its
latencies and step count are None; one whose `extra["steps_measured"]` is False (the llama.cpp
baseline) has no step count.
"""

from __future__ import annotations

import gc
import os
import resource
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import psutil
import torch

from batchgen.bench.report.host_time import host_time
from batchgen.kernels.cpu.linear import release_freed_heap

# The tail starts when fewer than this many requests are left (issue 27's definition).
TAIL_REQUESTS = 8


@dataclass
class RequestRecord:
    """One request's outcome. Times in seconds since the configuration started; None = never.

    `arrival` is when the workload says the request arrives; `queued` is when the bench handed it
    to the engine (at most one step later); `first_scheduled` when it first got compute.
    """

    request_id: str
    prompt_len: int
    output_len: int
    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finish: float | None
    error: str | None = None
    queued: float | None = None


@dataclass
class StepRecord:
    """One engine step (or one forward of a baseline), ending at `t` seconds since the start.

    `num_seqs` is the running batch size the hardware computed (padded rows included for static
    batching); `num_generation_tokens` counts only real output tokens, `num_sampled` every row
    sampled (padding included). Engine-only fields are None for the Hugging Face baselines:
    `num_sampled`, `num_attended_keys` and `num_context_tokens` set the step's roofline
    (`batchgen.bench.report.roofline`, see `StepStats` for their meaning); `num_prompt_tokens` (prefill
    tokens computed, padding included) and `step_time_s` (seconds) split the run's time into
    prefill and decode; `num_draft_tokens` / `num_accepted_tokens` count speculative draft tokens
    verified / accepted. `host_time_s` is the step's time outside the forward and the sampler
    (`StepStats.host_time_s`), `schedule_s`, `inputs_s`, `update_s` and `mask_time_s` its largest
    parts (`StepPhases`), all seconds.
    """

    t: float
    num_seqs: int
    num_batched_tokens: int
    num_generation_tokens: int
    kv_cache_usage: float | None = None
    num_preemptions: int | None = None
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    num_sampled: int | None = None
    num_attended_keys: int | None = None
    num_context_tokens: int | None = None
    num_prompt_tokens: int | None = None
    step_time_s: float | None = None
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None
    host_time_s: float | None = None
    schedule_s: float | None = None
    inputs_s: float | None = None
    update_s: float | None = None
    mask_time_s: float | None = None


@dataclass
class RunResult:
    """Everything measured for one configuration.

    Attributes:
        name: configuration label ("continuous/fcfs", "static/b8", "hf-static/b8", "hf-cb", "vllm").
        kind: "continuous", "static", "hf-static", "hf-cb" or "vllm".
        policy: scheduling policy for batchgen configurations, else None.
        requests / steps: the records.
        resources: `ResourceMonitor.result()` of the timed section.
        extra: configuration facts (batch size, aging bound, padding, ...).
        notes: caveats to print under the table.
        skipped: why the configuration did not run (then the records are empty).
    """

    name: str
    kind: str
    policy: str | None = None
    requests: list[RequestRecord] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    resources: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    skipped: str | None = None

    def timeline(self) -> dict[str, list[int] | list[float]]:
        """Per-step arrays (`t`, `num_seqs`, `num_batched_tokens`, `num_generation_tokens`, and for
        batchgen's configurations `num_sampled`, `num_attended_keys`, `num_context_tokens`,
        `num_prompt_tokens`, `step_time_s`, `num_draft_tokens`, `num_accepted_tokens`)."""
        out: dict[str, list[int] | list[float]] = {
            "t": [round(s.t, 6) for s in self.steps],
            "num_seqs": [s.num_seqs for s in self.steps],
            "num_batched_tokens": [s.num_batched_tokens for s in self.steps],
            "num_generation_tokens": [s.num_generation_tokens for s in self.steps],
        }
        for key in (
            "num_sampled",
            "num_attended_keys",
            "num_context_tokens",
            "num_prompt_tokens",
            "step_time_s",
            "num_draft_tokens",
            "num_accepted_tokens",
        ):
            if self.steps and all(getattr(s, key) is not None for s in self.steps):
                out[key] = [getattr(s, key) for s in self.steps]
        return out


def distribution(values: list[float] | np.ndarray) -> dict[str, float | None]:
    """mean, p50, p90, p99 (linear interpolation), None when there are no values."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def _sum_or_none(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _finish(r: RequestRecord) -> float:
    """`r.finish` of a request that finished (`summarize` keeps only those)."""
    assert r.finish is not None
    return r.finish


def summarize(result: RunResult) -> dict[str, Any]:
    """The metrics of one configuration as a flat dict (seconds, tokens, tokens/s; see module doc)."""
    ok = [r for r in result.requests if r.error is None and r.finish is not None]
    errors = len(result.requests) - len(ok)
    wall = max((_finish(r) for r in ok), default=0.0)
    prompt_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)

    ttft = [r.first_token - r.arrival for r in ok if r.first_token is not None]
    e2e = [_finish(r) - r.arrival for r in ok]
    tpot = [
        (_finish(r) - r.first_token) / (r.output_len - 1)
        for r in ok
        if r.first_token is not None and r.output_len > 1
    ]
    waits = [r.first_scheduled - r.arrival for r in ok if r.first_scheduled is not None]
    step_ends = np.asarray([s.t for s in result.steps], dtype=np.float64)
    wait_steps = [
        int(
            np.searchsorted(step_ends, r.first_scheduled, "left")
            - np.searchsorted(step_ends, r.arrival if r.queued is None else r.queued, "right")
        )
        for r in ok
        if r.first_scheduled is not None
    ]
    seqs = [s.num_seqs for s in result.steps]
    kv = [s.kv_cache_usage for s in result.steps if s.kv_cache_usage is not None]
    queries = _sum_or_none([s.prefix_cache_queries for s in result.steps])
    hits = _sum_or_none([s.prefix_cache_hits for s in result.steps])

    out: dict[str, Any] = {
        "num_requests": len(ok),
        "num_errors": errors,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "wall_s": wall,
        "output_tokens_per_s": output_tokens / wall if wall > 0 else None,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / wall if wall > 0 else None,
        "requests_per_s": len(ok) / wall if wall > 0 else None,
    }
    for name, values in (("ttft", ttft), ("e2e", e2e), ("tpot", tpot)):
        for stat, v in distribution(values).items():
            out[f"{name}_{stat}_s"] = v
    # Where the time went: steps that computed prompt tokens (chunked prefill mixes decodes in)
    # and steps of decodes only; the scheduler's time between steps is in neither.
    timed = [(s.num_prompt_tokens, s.step_time_s) for s in result.steps if s.num_prompt_tokens is not None]
    times = [(prompt, t) for prompt, t in timed if t is not None]
    timed_all = bool(result.steps) and len(times) == len(result.steps)
    out |= {
        "prefill_step_s": sum(t for prompt, t in times if prompt) if timed_all else None,
        "decode_step_s": sum(t for prompt, t in times if not prompt) if timed_all else None,
    }
    out |= _tail_and_speculation(result, ok, wall)
    out |= host_time(result.steps)
    out |= {
        "num_steps": len(seqs) if result.extra.get("steps_measured", True) else None,  # llama.cpp: its own
        "batch_size_mean": float(np.mean(seqs)) if seqs else None,
        "batch_size_max": max(seqs) if seqs else None,
        "kv_cache_peak": max(kv) if kv else None,
        "preemptions": _sum_or_none([s.num_preemptions for s in result.steps]),
        "prefix_cache_hit_rate": ((hits or 0) / queries if queries else 0.0) if queries is not None else None,
        "max_wait_s": max(waits) if waits else None,
        # Steps waited is the starvation check of a continuous policy; static batches and the
        # baselines admit whole batches, so a count of their steps would say nothing (shown as "-").
        "max_wait_steps": max(wait_steps) if wait_steps and result.kind == "continuous" else None,
    }
    if result.extra.get("per_request_times") is False:
        # Only the run's wall time is known (vLLM's LLM.generate returns every output at the end):
        # each request's "finish" is that wall time, so its latencies and steps would be made up.
        for name in ("ttft", "e2e", "tpot"):
            for stat in ("mean", "p50", "p90", "p99"):
                out[f"{name}_{stat}_s"] = None
        out["num_steps"] = None
    bound = result.extra.get("aging_bound_steps")
    out["aging_bound_steps"] = bound
    out["aging_bound_held"] = (
        None if bound is None or out["max_wait_steps"] is None else out["max_wait_steps"] <= bound
    )
    out |= result.resources
    return out


def _tail_and_speculation(result: RunResult, ok: list[RequestRecord], wall: float) -> dict[str, Any]:
    """`tail_s` (see the module docstring; the whole wall time when fewer than `TAIL_REQUESTS`
    requests ran; None where the last `TAIL_REQUESTS` finished together, as a static batch's do:
    no moment had fewer left), the tail's output tokens/s (None without step records or a tail)
    and the speculative decoding counts (None without them)."""
    finishes = sorted(_finish(r) for r in ok)
    tail_start = finishes[-TAIL_REQUESTS] if len(finishes) >= TAIL_REQUESTS else 0.0
    drafts = _sum_or_none([s.num_draft_tokens for s in result.steps])
    accepted = _sum_or_none([s.num_accepted_tokens for s in result.steps])
    no_tail = not finishes or (len(finishes) >= TAIL_REQUESTS and tail_start >= finishes[-1])
    tail_s = None if no_tail else wall - tail_start
    tail_tokens = sum(s.num_generation_tokens for s in result.steps if s.t > tail_start)
    return {
        "tail_s": tail_s,
        "tail_output_tokens_per_s": tail_tokens / tail_s if tail_s and result.steps else None,
        "spec_decode_num_draft_tokens": drafts,
        "spec_decode_num_accepted_tokens": accepted,
        "spec_decode_acceptance_rate": accepted / drafts if drafts and accepted is not None else None,
    }


# --- resources ----------------------------------------------------------------------------------------


def _available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def process_peak_rss_mb() -> float:
    """Peak resident set size of this process since it started, in MiB (getrusage)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class ResourceMonitor:
    """Samples this process's RSS (and GPU utilisation / memory on CUDA) while a configuration runs.

    Use as a context manager. Entering it again while it is open (nesting) marks the start of the
    timed window without restarting the sampling, so a caller can open it before building the
    engine or model (RSS then includes loading) and the run can open it around the timed section
    (CPU utilisation covers only that). `result()` then gives:
        cpu_percent: process CPU time / (wall time x available cores) x 100 over the timed window,
            so 100 = every core busy.
        cpu_core_seconds: user + system CPU seconds of the process in the timed window.
        peak_rss_mb: highest sampled RSS in MiB since the outermost entry (sampled every
            `interval` s, plus at every entry and exit).
        rss_before_mb: RSS at the outermost entry (interpreter, libraries, earlier leftovers).
        gpu_util_percent: mean of `torch.cuda.utilization()` samples (needs NVML), CUDA only.
        gpu_mem_peak_mb: `torch.cuda.max_memory_allocated()` in MiB, CUDA only.
    """

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._depth = 0
        self._rss_peak = 0
        self._rss_before = 0
        self._gpu_util: list[float] = []
        self._nvml_missing = False
        self._cuda = torch.cuda.is_available()
        self._t0 = self._c0 = self._wall = self._cpu = 0.0
        self._window_open = False

    def _sample(self) -> None:
        self._rss_peak = max(self._rss_peak, self._proc.memory_info().rss)
        if self._cuda and not self._nvml_missing:
            try:
                self._gpu_util.append(float(torch.cuda.utilization()))
            except Exception:  # NVML missing: report no utilisation rather than fail the bench
                self._nvml_missing = True

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _cpu_seconds(self) -> float:
        c = self._proc.cpu_times()
        return c.user + c.system

    def __enter__(self) -> ResourceMonitor:
        self._depth += 1
        if self._depth == 1:
            if self._cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self._rss_before = self._proc.memory_info().rss
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="bench-monitor", daemon=True)
            self._thread.start()
        elif self._cuda:
            torch.cuda.synchronize()
        self._sample()
        self._window_open = True
        self._t0 = time.perf_counter()
        self._c0 = self._cpu_seconds()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._cuda:
            torch.cuda.synchronize()
        if self._window_open:  # the innermost exit closes the timed window
            self._window_open = False
            self._wall = time.perf_counter() - self._t0
            self._cpu = self._cpu_seconds() - self._c0
        self._sample()
        self._depth -= 1
        if self._depth == 0:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()

    def result(self) -> dict[str, float | int | None]:
        cores = _available_cores()
        return {
            "cpu_percent": 100.0 * self._cpu / (self._wall * cores) if self._wall > 0 else None,
            "cpu_core_seconds": self._cpu,
            "cpu_cores": cores,
            "torch_threads": torch.get_num_threads(),
            "peak_rss_mb": self._rss_peak / 2**20,
            "rss_before_mb": self._rss_before / 2**20,
            "gpu_util_percent": float(np.mean(self._gpu_util)) if self._gpu_util else None,
            "gpu_mem_peak_mb": torch.cuda.max_memory_allocated() / 2**20 if self._cuda else None,
        }


def release_memory() -> None:
    """Collect garbage and hand freed heap memory back to the OS (glibc `malloc_trim`), so the
    next configuration's RSS does not include what the previous one left in the allocator."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    release_freed_heap()


def record_dicts(result: RunResult) -> list[dict[str, Any]]:
    """The request records as plain dicts (for the JSON report)."""
    return [asdict(r) for r in result.requests]
