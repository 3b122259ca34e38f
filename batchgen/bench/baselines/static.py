"""Static batching through batchgen's own engine, and the helpers both engine configurations share.

Static batching is what serving looked like before iteration-level scheduling (Orca: Yu et al.,
"Orca: A Distributed Serving System for Transformer-Based Generative Models", OSDI 2022): the
server takes `batch_size` requests, pads every prompt on the left to the batch's longest prompt,
runs the batch until its longest request has all its tokens, and only then takes the next batch.
Running it in our engine (one batch admitted at a time, every row `max_tokens` = the batch's
longest output, `ignore_eos`) keeps the model code, dtype and threads identical to the continuous
configuration, so the difference measured is the scheduling alone.

Accounting, as a padded static batcher would see it:
    - every request's first token time is the step at which every row of its batch has a first
      token (a padded batch's prefill delivers them together);
    - every request's finish time is the batch's finish;
    - its wait ends when its batch is admitted; a batch is admitted when the previous one has
      finished and its own last request has arrived;
    - only the request's own (unpadded) prompt and output tokens count toward tokens/s.
The engine for this configuration runs with prefix caching off: otherwise the left pads shared by
a batch's rows would come from the prefix cache and the padding would cost nothing, which no
padded batcher gets.
"""

from __future__ import annotations

import cProfile
import time
from typing import Any

from batchgen.bench.report.metrics import RequestRecord, ResourceMonitor, RunResult, StepRecord
from batchgen.bench.report.profile import profiled_step
from batchgen.bench.workload.distributions import BenchRequest, Workload
from batchgen.engine.protocol import Engine
from batchgen.sampling_params import SamplingParams


def bench_sampling_params(output_len: int) -> SamplingParams:
    """Greedy, exactly `output_len` tokens: EOS is ignored so the work is fixed by the workload."""
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def warmup_prompt(prompt_token_ids: list[int], length: int = 16) -> list[int]:
    """A short warm-up prompt from a workload's tokens, reversed so it shares no prefix-cache block
    with any request (a shared first block would show up as a prefix-cache hit in the timed run)."""
    return list(reversed(prompt_token_ids[:length]))


def warmup_engine(engine: Engine, prompt_token_ids: list[int], output_len: int = 4) -> None:
    """Run one short request to completion so one-time costs (first kernels, allocator) stay untimed."""
    engine.add_request(
        "__warmup__", {"prompt_token_ids": list(prompt_token_ids)}, bench_sampling_params(output_len)
    )
    while engine.has_unfinished_requests():
        engine.step()


def step_record(stats: Any, t0: float, real_generation_tokens: int | None = None) -> StepRecord:
    """A `StepRecord` from the engine's `StepStats`, with time relative to `t0` (perf_counter s).

    `real_generation_tokens` replaces the step's sampled count for static batching, where part of
    every row's output is padding (see `run_static`).
    """
    return StepRecord(
        t=stats.time - t0,
        num_seqs=stats.num_seqs,
        num_batched_tokens=stats.num_batched_tokens,
        num_generation_tokens=stats.num_generation_tokens
        if real_generation_tokens is None
        else real_generation_tokens,
        kv_cache_usage=stats.kv_cache_usage,
        num_preemptions=stats.num_preemptions,
        prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits,
        # Rows of the LM head: one per sampled token, plus one per draft token verified.
        num_sampled=stats.num_generation_tokens - stats.num_accepted_tokens + stats.num_draft_tokens,
        num_attended_keys=stats.num_attended_keys,
        num_context_tokens=stats.num_context_tokens,
        num_prompt_tokens=stats.num_prompt_tokens,
        step_time_s=stats.step_time_s,
        num_draft_tokens=stats.num_draft_tokens,
        num_accepted_tokens=stats.num_accepted_tokens,
        host_time_s=stats.host_time_s,
        schedule_s=stats.phases.schedule_s,
        inputs_s=stats.phases.inputs_s,
        update_s=stats.phases.update_s,
        mask_time_s=stats.mask_time_s,
    )


def output_error(out: Any, expected_tokens: int) -> str | None:
    """Why a finished `RequestOutput` is not a valid bench result, else None."""
    completion = out.outputs[0] if out.outputs else None
    if out.error or completion is None or completion.finish_reason == "error":
        return out.error or "request failed"
    if len(completion.token_ids) != expected_tokens:
        return f"generated {len(completion.token_ids)} tokens, expected {expected_tokens}"
    return None


def _rel(t: float | None, t0: float) -> float | None:
    return None if t is None else t - t0


def run_static(
    engine: Engine,
    workload: Workload,
    batch_size: int,
    pad_token_id: int,
    name: str = "",
    monitor: ResourceMonitor | None = None,
    profiler: cProfile.Profile | None = None,
) -> RunResult:
    """Run `workload` in padded static batches of `batch_size` through `engine`.

    Args:
        engine: a fresh `LLMEngine` (prefix caching off, see the module docstring).
        workload: the requests; batches follow arrival order.
        batch_size: requests per batch.
        pad_token_id: token used for left padding.
        name: configuration label (default `static/b{batch_size}`).
        monitor: an open `ResourceMonitor` to time the run in, else a new one.
        profiler: the steps run under it (`bench --profile`), else none is profiled.

    Returns:
        The `RunResult`; `extra` holds the padding overhead (`padded_prompt_tokens`,
        `padded_output_tokens`: tokens computed including padding). The engine cannot tell a
        row's real tokens from its padding, so each step's `num_generation_tokens` spreads the
        batch's real output tokens over its steps in proportion to the tokens sampled (rounded so
        that every batch's steps add up to its real tokens exactly).
    """
    reqs = sorted(workload.requests, key=lambda r: r.arrival_time)
    batches = [reqs[i : i + batch_size] for i in range(0, len(reqs), batch_size)]
    max_model_len = int(engine.max_model_len)
    if reqs:
        warmup_engine(engine, warmup_prompt(reqs[0].prompt_token_ids))
    records: list[RequestRecord] = []
    steps: list[StepRecord] = []
    padded_prompt = padded_output = truncated = 0
    monitor = monitor or ResourceMonitor()
    with monitor:
        t0 = time.perf_counter()
        for b, batch in enumerate(batches):
            start = t0 + max(r.arrival_time for r in batch)
            if (delay := start - time.perf_counter()) > 0:
                time.sleep(delay)
            plen = max(r.prompt_len for r in batch)
            olen = min(max(r.output_len for r in batch), max_model_len - plen)
            real = sum(min(r.output_len, olen) for r in batch)
            truncated += sum(r.output_len > olen for r in batch)
            padded_prompt += plen * len(batch)
            padded_output += olen * len(batch)
            admitted = time.perf_counter()
            for r in batch:
                ids = [pad_token_id] * (plen - r.prompt_len) + r.prompt_token_ids
                engine.add_request(
                    f"b{b}-{r.request_id}",
                    {"prompt_token_ids": ids},
                    bench_sampling_params(olen),
                    t0 + r.arrival_time,
                )
            outs = []
            sampled = reported = 0
            while engine.has_unfinished_requests():
                outs.extend(profiled_step(engine, profiler))
                if engine.last_step is not None:
                    sampled += engine.last_step.num_generation_tokens
                    step_real = round(real * sampled / (olen * len(batch))) - reported
                    reported += step_real
                    steps.append(step_record(engine.last_step, t0, step_real))
            records.extend(_batch_records(batch, outs, olen, admitted, t0))
    result = RunResult(name or f"static/b{batch_size}", "static", "fcfs", records, steps, monitor.result())
    result.extra = {
        "static_batch_size": batch_size,
        "padded_prompt_tokens": padded_prompt,
        "padded_output_tokens": padded_output,
        "prefix_caching": False,
    }
    if truncated:
        result.notes.append(
            f"{name or 'static'}: {truncated} outputs cut to fit max_model_len after padding "
            "(only the tokens generated count)"
        )
    return result


def _batch_records(
    batch: list[BenchRequest], outs: list[Any], olen: int, admitted: float, t0: float
) -> list[RequestRecord]:
    by_id = {o.request_id.split("-", 1)[1]: o for o in outs}
    first_tokens = [o.metrics.first_token_time for o in outs if o.metrics.first_token_time is not None]
    finishes = [o.metrics.finish_time for o in outs if o.metrics.finish_time is not None]
    batch_first = max(first_tokens) if first_tokens else None
    batch_finish = max(finishes) if finishes else None
    records = []
    for r in batch:
        out = by_id.get(r.request_id)
        error = "no output" if out is None else output_error(out, olen)
        records.append(
            RequestRecord(
                request_id=r.request_id,
                prompt_len=r.prompt_len,
                output_len=min(r.output_len, olen),
                arrival=r.arrival_time,
                first_scheduled=admitted - t0,
                first_token=_rel(batch_first, t0),
                finish=_rel(batch_finish, t0),
                error=error,
                queued=admitted - t0,
            )
        )
    return records
