"""Benchmark workloads: how many tokens each request reads and writes, and when it arrives.

Every request's prompt is a list of random token ids (special tokens excluded) and it runs for
exactly its sampled output length (`SamplingParams(temperature=0, ignore_eos=True, max_tokens=n)`),
so the work is fixed by the workload and not by what the model happens to say.

Distributions (`--dist`):

`longtail` (default)
    Input and output lengths drawn independently from log-normal distributions, fitted by maximum
    likelihood (mean and standard deviation of the natural logarithm) to the Azure LLM inference
    trace of conversation requests (`AzureLLMInferenceTrace_conv.csv`: 19,366 requests, one hour of
    production traffic on 2023-11-16; Patel et al., "Splitwise", ISCA 2024)::

        input  ~ LogNormal(mu=6.633, sigma=0.985), clipped at 14,050   (trace: p50 1020, mean 1155, p99 4142)
        output ~ LogNormal(mu=5.019, sigma=0.859), clipped at 1,000    (trace: p50 129,  mean 211,  p99 601)

    The trace's log input and log output lengths are nearly uncorrelated (r = 0.09), hence the
    independent draws. The fitted tails are heavier than the trace's beyond its p90 (fitted p99
    7,516 input / 1,115 output tokens), which is why samples are clipped at the trace's maxima.
    The lengths are then multiplied by `scale` (default 0.25, so a 64-request run of a 135M-parameter
    model on two CPU cores takes minutes), rounded, and clipped to input >= 1, output >= 1 and
    input + output <= max_model_len. At scale 0.25: input p50 190, mean 307, p99 1887 tokens;
    output p50 38, mean 53, p99 250 tokens.
`uniform`
    vLLM's random dataset (`benchmark_serving.py --dataset-name random`): input lengths uniform
    integers in [floor(input_len * (1 - range_ratio)), ceil(input_len * (1 + range_ratio))],
    output lengths likewise around output_len.
`fixed`
    Every request has exactly input_len prompt tokens and output_len output tokens.
`azure-conv` / `azure-code`
    A contiguous window of `num_prompts` records of the Azure conversation / code trace, starting at
    a seeded random record; lengths are the trace's ContextTokens / GeneratedTokens times `scale`
    (pass `scale=1` for the raw lengths), and the trace's own arrival times (seconds since the
    window's first record) are kept for `trace_arrivals`.
`file:PATH`
    A job file (JSONL or Parquet): rows with `prompt`, `messages` (chat), `prompt_token_ids` or
    OpenAI batch lines (`body.messages`); output lengths from `max_tokens` (top level,
    `sampling_params.max_tokens`, or `body.max_tokens` / `body.max_completion_tokens`), else
    `output_len`.

Arrivals: all requests at time 0 (offline) by default; `request_rate` R > 0 draws a Poisson process
(exponential gaps of mean 1/R seconds, the first request at 0), as vLLM's serving benchmark does;
`trace_arrivals` replays the trace's timestamps (azure dists only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from batchgen.bench.spec import WorkloadSpec
from batchgen.bench.workload.job import PromptEncoder, read_workload_rows
from batchgen.bench.workload.traces import LONGTAIL_INPUT, LONGTAIL_OUTPUT, TRACE_FILES, load_azure_trace


@dataclass
class LengthPlan:
    """Sampled lengths in tokens (int64 `[n]` each) and, for traces, arrival times in seconds."""

    input_lens: np.ndarray
    output_lens: np.ndarray
    trace_times: np.ndarray | None
    params: dict[str, Any]


def _rng(seed: int, stream: int) -> np.random.Generator:
    # Separate streams: the lengths do not change when the vocabulary or the arrival model does.
    return np.random.default_rng([seed, stream])


def clip_lengths(
    inputs: np.ndarray, outputs: np.ndarray, max_model_len: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Round to input >= 1 and output >= 1 tokens, then clip to input + output <= max_model_len.

    Returns:
        The input and output lengths (int64 `[n]` each) and how many requests were shortened to fit
        `max_model_len` (a length of 0 raised to 1 does not count).

    Raises:
        ValueError: `max_model_len` below 2.
    """
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    i0 = np.maximum(np.rint(inputs).astype(np.int64), 1)
    o0 = np.maximum(np.rint(outputs).astype(np.int64), 1)
    i = np.minimum(i0, max_model_len - 1)
    o = np.minimum(o0, max_model_len - i)
    clipped = int(np.count_nonzero((i < i0) | (o < o0)))
    return i, o, clipped


def sample_lengths(spec: WorkloadSpec, max_model_len: int) -> LengthPlan:
    """Input and output lengths for every distribution except `file:` (see the module docstring).

    Raises:
        ValueError: for `file:` specs (their lengths come from the file) or a bad max_model_len.
        FileNotFoundError: when an Azure trace is requested and `spec.trace_dir` lacks it.
    """
    n = spec.num_prompts
    rng = _rng(spec.seed, 0)
    trace_times = None
    params: dict[str, Any] = {"dist": spec.dist, "num_prompts": n, "seed": spec.seed}
    if spec.dist == "longtail":
        raw_in = LONGTAIL_INPUT.sample(rng, n) * spec.scale
        raw_out = LONGTAIL_OUTPUT.sample(rng, n) * spec.scale
        params |= {
            "scale": spec.scale,
            "input": {
                "family": "lognormal",
                "mu": LONGTAIL_INPUT.mu,
                "sigma": LONGTAIL_INPUT.sigma,
                "clip_before_scale": LONGTAIL_INPUT.max_value,
            },
            "output": {
                "family": "lognormal",
                "mu": LONGTAIL_OUTPUT.mu,
                "sigma": LONGTAIL_OUTPUT.sigma,
                "clip_before_scale": LONGTAIL_OUTPUT.max_value,
            },
            "fitted_to": "AzureLLMInferenceTrace_conv.csv (maximum likelihood on log lengths)",
        }
    elif spec.dist in ("uniform", "fixed"):
        r = spec.range_ratio if spec.dist == "uniform" else 0.0

        def uniform(center: int) -> np.ndarray:
            low = max(1, math.floor(center * (1 - r)))
            high = max(low, math.ceil(center * (1 + r)))
            return rng.integers(low, high + 1, size=n).astype(np.float64)

        raw_in, raw_out = uniform(spec.input_len), uniform(spec.output_len)
        params |= {"input_len": spec.input_len, "output_len": spec.output_len, "range_ratio": r}
    elif spec.dist in TRACE_FILES:
        path = spec.trace_dir / TRACE_FILES[spec.dist]
        if not path.is_file():
            raise FileNotFoundError(
                f"{spec.dist} needs {path} (pass --data-dir to point at the Azure traces)"
            )
        trace = load_azure_trace(path)
        start = int(rng.integers(0, max(1, len(trace) - n + 1)))
        idx = np.arange(start, start + n) % len(trace)  # wraps only when n exceeds the trace
        raw_in = trace.context_tokens[idx] * spec.scale
        raw_out = trace.generated_tokens[idx] * spec.scale
        t = trace.times[idx]
        trace_times = np.maximum(t - t[0], 0.0)
        params |= {"scale": spec.scale, "trace": path.name, "first_record": start}
    else:
        raise ValueError(f"sample_lengths cannot sample {spec.dist!r}; file workloads read their lengths")
    inputs, outputs, clipped = clip_lengths(np.asarray(raw_in), np.asarray(raw_out), max_model_len)
    params |= {"max_model_len": max_model_len, "num_clipped": clipped}
    return LengthPlan(inputs, outputs, trace_times, params)


def arrival_times(spec: WorkloadSpec, n: int, trace_times: np.ndarray | None = None) -> np.ndarray:
    """Arrival of each request in seconds after the bench starts, float64 `[n]`, non-decreasing."""
    if spec.trace_arrivals:
        if trace_times is None:
            raise ValueError("trace_arrivals needs trace times")
        return np.asarray(trace_times, dtype=np.float64)
    if not math.isfinite(spec.request_rate) or n == 0:
        return np.zeros(n)
    gaps = _rng(spec.seed, 2).exponential(1.0 / spec.request_rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


# --- prompts -----------------------------------------------------------------------------------------


def allowed_token_ids(vocab_size: int, special_token_ids: Sequence[int] = ()) -> np.ndarray:
    """Token ids in [0, vocab_size) minus the special ones, int64 sorted.

    Raises:
        ValueError: when nothing is left.
    """
    ids = np.setdiff1d(
        np.arange(vocab_size, dtype=np.int64), np.asarray(list(special_token_ids), dtype=np.int64)
    )
    if ids.size == 0:
        raise ValueError(f"no ordinary token ids in a vocabulary of {vocab_size}")
    return ids


def random_prompts(lengths: Sequence[int] | np.ndarray, allowed: np.ndarray, seed: int) -> list[list[int]]:
    """One list of random token ids per length, drawn uniformly from `allowed`."""
    rng = _rng(seed, 1)
    return [allowed[rng.integers(0, allowed.size, size=int(k))].tolist() for k in lengths]


@dataclass
class BenchRequest:
    """One request of a workload.

    Attributes:
        request_id: unique id (`"0"`, `"1"`, ... in workload order).
        prompt_token_ids: the prompt.
        output_len: output tokens it must generate (it ignores EOS).
        arrival_time: seconds after the bench starts.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_len: int
    arrival_time: float = 0.0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class Workload:
    """The requests of one bench and the parameters that produced them."""

    name: str
    requests: list[BenchRequest]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def total_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    def warnings(self) -> list[str]:
        """What the workload changed from what was asked, one log line each: requests shortened to
        fit `max_model_len` (their count and the limit), unusable job-file rows skipped (their
        count and the first one's row and reason), fewer usable rows than --num-prompts asked, and
        the rows' sampling fields left unused."""
        p = self.params
        lines = []
        if clipped := p.get("num_clipped"):
            lines.append(
                f"warning: {clipped} requests were shortened to fit max_model_len {p['max_model_len']} "
                f"(prompt + output tokens: prompts cut to {p['max_model_len'] - 1} tokens, then outputs to "
                "the room left); raise --max-model-len or lower the lengths to run them whole"
            )
        if skipped := p.get("num_skipped"):
            lines.append(
                f"warning: skipped {skipped} unusable rows of {p['path']} (first: {p['first_skipped']}); "
                "fix them to bench them"
            )
        if p.get("dist") == "file" and 0 < p["num_prompts"] < (p.get("num_prompts_asked") or 0):
            lines.append(
                f"note: {p['path']} has {p['num_prompts']} usable rows, fewer than --num-prompts "
                f"{p['num_prompts_asked']}: the workload is all {p['num_prompts']} (0 takes every row)"
            )
        if unused := p.get("unused_sampling_fields"):
            lines.append(
                f"note: the rows' {', '.join(unused)} are not used: a bench runs every request greedy to "
                "exactly its max_tokens (ignore_eos), so configurations compare on the same tokens"
            )
        return lines

    def summary(self) -> dict[str, Any]:
        """Request count, token totals and length percentiles (for the report)."""

        def stats(values: list[int]) -> dict[str, float]:
            a = np.asarray(values, dtype=np.float64)
            if a.size == 0:
                return {}
            return {
                "mean": float(a.mean()),
                "p50": float(np.percentile(a, 50)),
                "p90": float(np.percentile(a, 90)),
                "p99": float(np.percentile(a, 99)),
                "min": float(a.min()),
                "max": float(a.max()),
            }

        arrivals = [r.arrival_time for r in self.requests]
        return {
            "name": self.name,
            "num_requests": len(self.requests),
            "total_prompt_tokens": self.total_prompt_tokens,
            "total_output_tokens": self.total_output_tokens,
            "input_len": stats([r.prompt_len for r in self.requests]),
            "output_len": stats([r.output_len for r in self.requests]),
            "last_arrival_s": max(arrivals, default=0.0),
            "params": self.params,
        }


def build_workload(
    spec: WorkloadSpec,
    *,
    vocab_size: int,
    special_token_ids: Sequence[int] = (),
    max_model_len: int,
    encode: PromptEncoder | None = None,
) -> Workload:
    """Sample lengths (or read the job file), draw the prompts and the arrival times.

    Args:
        spec: the workload options.
        vocab_size: ids are drawn from [0, vocab_size) (use the tokenizer's length, not a padded
            embedding size).
        special_token_ids: never drawn (BOS, EOS, pad, chat markers).
        max_model_len: longest prompt + output in tokens.
        encode: turns a job-file prompt (str or chat messages) into token ids; needed for `file:`.

    Raises:
        ValueError / FileNotFoundError: from `sample_lengths` or the job file.
    """
    if spec.dist.startswith("file:"):
        if encode is None:
            raise ValueError("file: workloads need an encoder for the prompts")
        return file_workload(spec, encode, max_model_len)
    plan = sample_lengths(spec, max_model_len)
    prompts = random_prompts(plan.input_lens, allowed_token_ids(vocab_size, special_token_ids), spec.seed)
    arrivals = arrival_times(spec, len(prompts), plan.trace_times)
    requests = [
        BenchRequest(str(i), p, int(o), float(a))
        for i, (p, o, a) in enumerate(zip(prompts, plan.output_lens, arrivals, strict=True))
    ]
    params = plan.params | arrival_params(spec)
    return Workload(spec.dist, requests, params)


def file_workload(spec: WorkloadSpec, encode: PromptEncoder, max_model_len: int) -> Workload:
    """The first `spec.num_prompts` usable rows (0 = all) of the job file `spec.dist[5:]` as a
    workload (`job_workload.read_workload_rows`), lengths clipped to `max_model_len`.

    Unusable rows are skipped: `params["num_skipped"]` counts them and `params["first_skipped"]`
    names the first ("line 3: not JSON (...)"); `Workload.warnings` turns that into a log line.

    Raises:
        BenchInputError: the file is absent or unreadable, or has no usable row (naming the first bad one).
    """
    prompts, outs, skipped, unused = read_workload_rows(spec, encode)
    path = Path(spec.dist[5:])
    inputs, outputs, clipped = clip_lengths(
        np.asarray([len(p) for p in prompts], dtype=np.float64),
        np.asarray(outs, dtype=np.float64),
        max_model_len,
    )
    arrivals = arrival_times(spec, len(prompts))
    requests = [
        BenchRequest(str(i), p[: int(k)], int(o), float(a))
        for i, (p, k, o, a) in enumerate(zip(prompts, inputs, outputs, arrivals, strict=True))
    ]
    params = {
        "dist": "file",
        "path": str(path),
        "num_prompts": len(requests),
        "num_prompts_asked": spec.num_prompts,
        "default_output_len": spec.output_len,
        "max_model_len": max_model_len,
        "num_clipped": clipped,
        "num_skipped": len(skipped),
        "first_skipped": skipped[0] if skipped else None,
        "unused_sampling_fields": sorted(unused),
    } | arrival_params(spec)
    return Workload(f"file:{path.name}", requests, params)


def arrival_params(spec: WorkloadSpec) -> dict[str, Any]:
    """How the requests arrive, for the report: offline, Poisson (with its rate) or the trace's times."""
    if spec.trace_arrivals:
        return {"arrivals": "trace"}
    if math.isfinite(spec.request_rate):
        return {"arrivals": "poisson", "request_rate": spec.request_rate}
    return {"arrivals": "offline"}
