"""Continuous batching through batchgen's engine: requests join and leave the running batch every step.

Iteration-level scheduling (Orca: Yu et al., OSDI 2022) over the paged KV cache: each request is
handed to the engine when its arrival time comes, and the engine is stepped until all are done.
"""

from __future__ import annotations

import cProfile
import time
from typing import Any

from batchgen.bench.baselines.static import (
    bench_sampling_params,
    output_error,
    step_record,
    warmup_engine,
    warmup_prompt,
)
from batchgen.bench.report.metrics import RequestRecord, ResourceMonitor, RunResult, StepRecord
from batchgen.bench.report.profile import profiled_step
from batchgen.bench.workload.distributions import BenchRequest, Workload
from batchgen.engine.protocol import Engine


def run_continuous(
    engine: Engine,
    workload: Workload,
    name: str,
    policy: str,
    aging_steps: int | None,
    monitor: ResourceMonitor | None = None,
    profiler: cProfile.Profile | None = None,
) -> RunResult:
    """Continuous batching: hand each request to `engine` when its arrival time comes, step until done.

    `aging_steps` (max-throughput) gives the starvation bound checked in the report: a request is
    scheduled at most `aging_steps + 1` steps after it was queued. `monitor`: an open
    `ResourceMonitor` to time the run in (see its docstring), else a new one. `profiler`: the
    steps run under it (`bench --profile`).
    """
    reqs = sorted(workload.requests, key=lambda r: r.arrival_time)
    by_id = {r.request_id: r for r in reqs}
    if reqs:
        warmup_engine(engine, warmup_prompt(reqs[0].prompt_token_ids))
    records: list[RequestRecord] = []
    steps: list[StepRecord] = []
    queued: dict[str, float] = {}
    monitor = monitor or ResourceMonitor()
    with monitor:
        t0 = time.perf_counter()
        i = 0
        while i < len(reqs) or engine.has_unfinished_requests():
            now = time.perf_counter() - t0
            while i < len(reqs) and reqs[i].arrival_time <= now:
                r = reqs[i]
                engine.add_request(
                    r.request_id,
                    {"prompt_token_ids": r.prompt_token_ids},
                    bench_sampling_params(r.output_len),
                    t0 + r.arrival_time,
                )
                queued[r.request_id] = time.perf_counter() - t0
                i += 1
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, reqs[i].arrival_time - (time.perf_counter() - t0)))
                continue
            for out in profiled_step(engine, profiler):
                records.append(request_record(out, by_id[out.request_id], t0, queued))
            if engine.last_step is not None:
                steps.append(step_record(engine.last_step, t0))
    result = RunResult(name, "continuous", policy, records, steps, monitor.result())
    result.extra = {"prefix_caching": True}
    if aging_steps is not None:
        result.extra |= {"aging_steps": aging_steps, "aging_bound_steps": aging_steps + 1}
    return result


def request_record(out: Any, req: BenchRequest, t0: float, queued: dict[str, float]) -> RequestRecord:
    """One finished request's record; times relative to the run's start `t0` (perf_counter seconds)."""
    m = out.metrics
    n = len(out.outputs[0].token_ids) if out.outputs else 0

    def rel(t: float | None) -> float | None:
        return None if t is None else t - t0

    return RequestRecord(
        request_id=req.request_id,
        prompt_len=req.prompt_len,
        output_len=n,
        arrival=req.arrival_time,
        first_scheduled=rel(m.first_scheduled_time),
        first_token=rel(m.first_token_time),
        finish=rel(m.finish_time),
        error=output_error(out, req.output_len),
        queued=queued.get(req.request_id),
    )
