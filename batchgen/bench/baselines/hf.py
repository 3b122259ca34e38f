"""Hugging Face transformers baselines: what users run when they do not use an engine.

`hf-static`
    `model.generate` on padded static batches of `batch_size` requests (left padding with the
    tokenizer's pad token, an attention mask, greedy), each batch generating exactly its longest
    request's output length (`min_new_tokens = max_new_tokens`). Accounting as for batchgen's static
    configuration (see `batchgen.bench.baselines.static`): first token time = the batch's first decoding
    step, finish = the batch's end, only real tokens count.
`hf-cb`
    transformers' own continuous batching (`ContinuousBatchingManager`, what
    `model.generate_batch` uses in transformers 5.x): every request added with its own
    `max_new_tokens` and EOS disabled, per-token timestamps recorded. Its cache is sized like
    batchgen's: enough pages (`page_size` tokens each) to hold the whole workload at once, capped
    at batchgen's KV-cache budget, the same token budget per step (`max_batch_tokens`) and the same
    sequence cap (`max_requests_per_batch`). Left to itself on a CPU it would size the cache from
    90% of system memory. Skipped, with the reason, when the installed transformers lacks it.

Both load the model from the same Hugging Face directory batchgen's loader resolves, in the same
dtype, with the same torch thread count.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from batchgen.bench.report.metrics import RequestRecord, ResourceMonitor, RunResult, StepRecord
from batchgen.bench.workload.distributions import Workload


def resolve_hf_dir(model: str | None) -> Path:
    """The Hugging Face directory batchgen's loader uses for `model` (None = the default model).

    Raises:
        RuntimeError: when the loader is unavailable and `model` is not a directory.
    """
    try:
        from batchgen.model.loading.loader import resolve_model
    except ImportError as exc:
        if model is not None and Path(model).is_dir():
            return Path(model)
        raise RuntimeError(f"cannot resolve {model!r} to a Hugging Face directory: {exc}") from exc
    files = resolve_model(model)
    return files.path


def load_hf_model(path: str | Path, dtype: torch.dtype, device: str = "cpu") -> Any:
    """`AutoModelForCausalLM` from `path` in `dtype` on `device`, in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    # transformers types `to` through a decorator that loses its self: the device reads as the model.
    return model.to(device).eval()  # type: ignore[arg-type]


class _StepTimer:
    """A `generate` streamer that stamps each decoding step (the first `put` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if self._seen_prompt:
            self.times.append(time.perf_counter())
        self._seen_prompt = True

    def end(self) -> None:
        return None


def _generate(
    model: Any, rows: list[list[int]], new_tokens: int, pad_token_id: int, timer: Any = None
) -> None:
    from transformers import GenerationConfig

    width = max(len(r) for r in rows)
    device = model.device
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    config = GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad_token_id,
        eos_token_id=model.generation_config.eos_token_id,
    )
    with torch.inference_mode():
        model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config, streamer=timer
        )


def run_hf_static(
    model: Any,
    workload: Workload,
    batch_size: int,
    pad_token_id: int,
    name: str = "",
    monitor: ResourceMonitor | None = None,
) -> RunResult:
    """`generate` over padded static batches of `batch_size` (see the module docstring); `monitor`:
    an open `ResourceMonitor` to time the run in, else a new one."""
    reqs = sorted(workload.requests, key=lambda r: r.arrival_time)
    batches = [reqs[i : i + batch_size] for i in range(0, len(reqs), batch_size)]
    if reqs:
        _generate(model, [reqs[0].prompt_token_ids[:16][::-1]] * 2, 2, pad_token_id)  # warm-up, untimed
    records: list[RequestRecord] = []
    steps: list[StepRecord] = []
    monitor = monitor or ResourceMonitor()
    with monitor:
        t0 = time.perf_counter()
        for batch in batches:
            start = t0 + max(r.arrival_time for r in batch)
            if (delay := start - time.perf_counter()) > 0:
                time.sleep(delay)
            admitted = time.perf_counter() - t0
            olen = max(r.output_len for r in batch)
            plen = max(r.prompt_len for r in batch)
            timer = _StepTimer()
            _generate(model, [r.prompt_token_ids for r in batch], olen, pad_token_id, timer)
            times = [t - t0 for t in timer.times]
            for k, t in enumerate(times):
                steps.append(
                    StepRecord(
                        t=t,
                        num_seqs=len(batch),
                        num_batched_tokens=len(batch) * (plen if k == 0 else 1),
                        num_generation_tokens=sum(r.output_len > k for r in batch),
                    )
                )
            first = times[0] if times else None
            finish = times[-1] if times else time.perf_counter() - t0
            for r in batch:
                records.append(
                    RequestRecord(
                        r.request_id,
                        r.prompt_len,
                        r.output_len,
                        r.arrival_time,
                        admitted,
                        first,
                        finish,
                        None if len(times) == olen else f"{len(times)} steps, expected {olen}",
                        admitted,
                    )
                )
    result = RunResult(
        name or f"hf-static/b{batch_size}", "hf-static", None, records, steps, monitor.result()
    )
    result.extra = {"static_batch_size": batch_size}
    return result


def hf_cb_unavailable(model: Any) -> str | None:
    """Why transformers' continuous batching cannot run here, or None when it can."""
    try:
        import transformers
        from transformers import ContinuousBatchingConfig  # noqa: F401
    except ImportError:
        import transformers

        return (
            f"transformers {transformers.__version__} has no ContinuousBatchingConfig (continuous batching)"
        )
    if not hasattr(model, "continuous_batching_context_manager"):
        return f"transformers {transformers.__version__}: model has no continuous batching API"
    return None


def run_hf_cb(
    model: Any,
    workload: Workload,
    *,
    max_batch_tokens: int,
    max_num_seqs: int,
    pad_token_id: int = 0,
    kv_cache_tokens: int | None = None,
    page_size: int = 256,
    name: str = "hf-cb",
    monitor: ResourceMonitor | None = None,
) -> RunResult:
    """transformers' continuous batching on `workload` (see the module docstring).

    Args:
        max_batch_tokens: tokens per step (batchgen's `max_num_batched_tokens`).
        max_num_seqs: sequences per step.
        pad_token_id: the tokenizer's pad token.
        kv_cache_tokens: batchgen's KV-cache capacity in tokens; the cache never exceeds it.
        page_size: tokens per cache page (transformers' default 256).
        monitor: an open `ResourceMonitor` to time the run in (entered after the manager's
            warm-up), else a new one.

    Raises:
        RuntimeError: when `hf_cb_unavailable` gives a reason (callers check it first).
    """
    if (reason := hf_cb_unavailable(model)) is not None:
        raise RuntimeError(reason)
    reqs = sorted(workload.requests, key=lambda r: r.arrival_time)
    pages = sum(math.ceil((r.prompt_len + r.output_len) / page_size) for r in reqs) + 1
    if kv_cache_tokens is not None:
        pages = max(1, min(pages, kv_cache_tokens // page_size))
    results: dict[str, Any] = {}
    queued: dict[str, float] = {}
    monitor = monitor or ResourceMonitor()
    with torch.inference_mode():
        manager_cm = model.continuous_batching_context_manager(
            block=True,
            timeout=30,
            **_cb_configs(reqs, pages, page_size, max_batch_tokens, max_num_seqs, pad_token_id),
        )
        with manager_cm as manager, monitor:
            t0 = time.perf_counter()
            _serve(manager, reqs, t0, results, queued)
    records, steps = _cb_records(reqs, results, queued, t0)
    result = RunResult(name, "hf-cb", None, records, steps, monitor.result())
    result.extra = {"page_size": page_size, "num_pages": pages, "max_batch_tokens": max_batch_tokens}
    return result


def _cb_configs(
    reqs: list[Any], pages: int, page_size: int, max_batch_tokens: int, max_num_seqs: int, pad_token_id: int
) -> dict[str, Any]:
    """transformers' continuous-batching settings for `reqs`: greedy, no EOS (every request runs its
    output length), `pages` cache pages of `page_size` tokens, as keyword arguments of
    `continuous_batching_context_manager`."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    return {
        "generation_config": GenerationConfig(
            max_new_tokens=max((r.output_len for r in reqs), default=1),
            do_sample=False,
            eos_token_id=-1,
            pad_token_id=pad_token_id,
        ),
        "continuous_batching_config": ContinuousBatchingConfig(
            page_size=page_size,
            num_blocks=pages,
            max_batch_tokens=max_batch_tokens,
            max_requests_per_batch=max(1, min(max_num_seqs, len(reqs))),
        ),
        "workload_hints": WorkloadHints(
            max_prompt_length=max((r.prompt_len for r in reqs), default=1),
            max_generated_length=max((r.output_len for r in reqs), default=1),
            num_requests=len(reqs),
        ),
    }


def _serve(
    manager: Any, reqs: list[Any], t0: float, results: dict[str, Any], queued: dict[str, float]
) -> None:
    """Hand each request to the running `manager` at its arrival time (seconds after `t0`) and
    collect the finished ones into `results` (request id -> output) until every one is back or the
    manager stops; `queued` gets each request's time of submission."""
    i = 0
    while len(results) < len(reqs):
        now = time.perf_counter() - t0
        while i < len(reqs) and reqs[i].arrival_time <= now:
            r = reqs[i]
            manager.add_request(
                r.prompt_token_ids,
                request_id=r.request_id,
                max_new_tokens=r.output_len,
                record_timestamps=True,
                eos_token_id=-1,
            )
            queued[r.request_id] = time.perf_counter() - t0
            i += 1
        wait = 0.5 if i >= len(reqs) else max(0.0, min(0.5, reqs[i].arrival_time - now))
        out = manager.get_result(timeout=wait)
        if out is not None and out.is_finished():
            results[out.request_id] = out
        elif out is None and not manager.is_running():
            break


def _cb_records(
    reqs: list[Any], results: dict[str, Any], queued: dict[str, float], t0: float
) -> tuple[list[RequestRecord], list[StepRecord]]:
    records: list[RequestRecord] = []
    spans: list[tuple[float, float]] = []
    token_times: dict[float, int] = {}
    for r in reqs:
        out = results.get(r.request_id)
        if out is None:
            records.append(
                RequestRecord(r.request_id, r.prompt_len, 0, r.arrival_time, None, None, None, "no result")
            )
            continue
        stamps = [t - t0 for t in (out.timestamps or [])]
        for t in stamps:
            token_times[t] = token_times.get(t, 0) + 1
        start = out.lifespan[0] - t0 if out.lifespan[0] > 0 else None
        finish = out.lifespan[1] - t0 if out.lifespan[1] > 0 else (stamps[-1] if stamps else None)
        n = len(out.generated_tokens)
        error = out.error or (None if n == r.output_len else f"generated {n} tokens, expected {r.output_len}")
        records.append(
            RequestRecord(
                r.request_id,
                r.prompt_len,
                n,
                r.arrival_time,
                start,
                stamps[0] if stamps else None,
                finish,
                error,
                queued.get(r.request_id),
            )
        )
        if start is not None and finish is not None:
            spans.append((start, finish))
    # One step per distinct token timestamp (all rows of a step share it); the batch size is the
    # number of requests alive then.
    steps = [
        StepRecord(
            t=t, num_seqs=sum(a <= t <= b for a, b in spans), num_batched_tokens=n, num_generation_tokens=n
        )
        for t, n in sorted(token_times.items())
    ]
    return records, steps
