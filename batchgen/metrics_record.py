"""What a job's metrics hold and how they change: the metric table (vLLM's names and bucket edges),
what one step and one finished request add to a set of series, and the record a replica keeps of
them for the driver (`batchgen.metrics.JobMetrics` puts them in Prometheus' registry).

Nothing here imports prometheus_client: a replica records without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchgen.engine.stats import EngineTotals, StepStats
    from batchgen.outputs import RequestOutput

# vLLM's bucket edges (seconds, or tokens per step).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
ITERATION_SEQS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# Grammar compilations: under a millisecond (a choice list) to the time limit (30 s by default).
GRAMMAR_COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# (key, kind, name, help[, buckets]): every metric of a job. prometheus_client adds `_total` to
# counter names in the exposition.
METRICS: tuple[tuple[Any, ...], ...] = (
    ("running", "gauge", "num_requests_running", "Requests in the engine's running batch."),
    ("waiting", "gauge", "num_requests_waiting", "Requests in the engine's waiting queue."),
    ("swapped", "gauge", "num_requests_swapped", "Requests swapped out to CPU swap space."),
    ("kv", "gauge", "kv_cache_usage_perc", "Fraction of KV-cache blocks held by live requests (0-1)."),
    ("hit_rate", "gauge", "prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / looked up, since start."),
    ("job_rows", "gauge", "job_rows", "Rows in the job file (NaN when it cannot be counted up front)."),
    ("rows_resumed", "gauge", "rows_resumed", "Rows committed by earlier runs of this job."),
    ("prompt", "counter", "prompt_tokens", "Prefill tokens computed (prefix-cache hits excluded)."),
    ("generation", "counter", "generation_tokens", "Tokens generated."),
    ("preemptions", "counter", "num_preemptions", "Preemptions of running requests."),
    ("pc_queries", "counter", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("pc_hits", "counter", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    # Speculative decoding (vLLM's names); the acceptance rate is PromQL's
    # rate(..._num_accepted_tokens_total) / rate(..._num_draft_tokens_total).
    ("spec_drafts", "counter", "spec_decode_num_drafts", "Speculative decoding: verifications of draft tokens."),
    ("spec_draft_tokens", "counter", "spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified."),
    ("spec_accepted", "counter", "spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted."),
    # Structured outputs: requests with a constraint, each distinct constraint's compile time, and
    # the host time of the steps' token masks (fill + apply).
    ("structured", "counter", "structured_requests", "Requests with a structured outputs constraint."),
    ("mask_time", "counter", "structured_mask_seconds", "Seconds steps spent filling and applying token masks."),
    ("grammar_compile", "histogram", "grammar_compile_seconds",
     "Time to compile one distinct structured outputs constraint.", GRAMMAR_COMPILE_BUCKETS),
    ("committed", "counter", "rows_committed", "Rows committed to part files by this run (error rows included)."),
    ("errored", "counter", "rows_errored", "Rows that finished as error rows in this run."),
    ("success", "counter", "request_success", "Requests finished, by finish reason."),
    ("ttft", "histogram", "time_to_first_token_seconds",
     "Time from a request's arrival in the engine to its first token.", TTFT_BUCKETS),
    ("tpot", "histogram", "request_time_per_output_token_seconds",
     "Mean time per output token after the first, one observation per request.", TOKEN_LATENCY_BUCKETS),
    ("e2e", "histogram", "e2e_request_latency_seconds",
     "Time from a request's arrival in the engine to its last token.", REQUEST_LATENCY_BUCKETS),
    ("queue", "histogram", "request_queue_time_seconds",
     "Time a request waited in the engine before its first step.", REQUEST_LATENCY_BUCKETS),
    ("step_time", "histogram", "engine_step_duration_seconds", "Wall time of one engine step.",
     TOKEN_LATENCY_BUCKETS),
    ("step_tokens", "histogram", "iteration_tokens", "Tokens in one engine step (batch size in tokens).",
     ITERATION_TOKENS_BUCKETS),
    ("step_seqs", "histogram", "iteration_seqs", "Sequences in one engine step (batch size).",
     ITERATION_SEQS_BUCKETS),
)  # fmt: skip
# The job's own figures: one series a job, never a replica's.
JOB_KEYS = frozenset({"job_rows", "rows_resumed"})
QUEUE_GAUGES = ("running", "waiting", "swapped", "kv")


@dataclass(frozen=True)
class RequestTimes:
    """What the metrics keep of a finished request: its completions' finish reasons and latencies
    in seconds (None where the request never ran: a rejected one)."""

    reasons: tuple[str, ...]
    ttft: float | None = None
    queue: float | None = None
    e2e: float | None = None
    tpot: float | None = None

    @classmethod
    def of(cls, out: RequestOutput) -> RequestTimes:
        """From a `RequestOutput`."""
        # A finished output's completions all have a reason (str(): a label, as prometheus makes it).
        reasons = tuple(str(c.finish_reason) for c in out.outputs) or ("error",)
        t = out.metrics
        if t is None or t.ttft is None:
            return cls(reasons)
        queue = None if t.first_scheduled_time is None else t.first_scheduled_time - t.arrival_time
        tpot = None
        n = max(len(c.token_ids) for c in out.outputs)
        if t.latency is not None and n > 1:
            tpot = (t.latency - t.ttft) / (n - 1)
        return cls(reasons, t.ttft, queue, t.latency, tpot)


@dataclass
class MetricsRecord:
    """A replica's metrics since the last `take()`: its steps' `StepStats`, its finished requests'
    `RequestTimes` and its engine's prefix-cache hit rate. A replica fills one in place of
    `JobMetrics` (it has the same `on_*` methods) and sends it back with each shard; the driver
    applies it with `JobMetrics.on_replica`. Plain data: it travels through Ray as a pickle."""

    steps: list[StepStats] = field(default_factory=list)
    requests: list[RequestTimes] = field(default_factory=list)
    hit_rate: float | None = None

    def on_step(self, s: StepStats | None, totals: EngineTotals | None = None) -> None:
        if s is not None:
            self.steps.append(s)
            if totals is not None:
                self.hit_rate = totals.prefix_cache_hit_rate

    def on_request(self, out: RequestOutput) -> None:
        self.requests.append(RequestTimes.of(out))

    def on_rows(self, *args: object, **kwargs: object) -> None: ...  # rows are the driver's to count

    def on_replica(self, *args: object, **kwargs: object) -> None: ...  # so are the replicas' records

    def take(self) -> MetricsRecord:
        """What was recorded since the last take; the record starts empty again."""
        taken = MetricsRecord(self.steps, self.requests, self.hit_rate)
        self.steps, self.requests = [], []
        return taken


def apply_step(m: dict[str, Any], s: StepStats) -> None:
    """One step's `StepStats` onto a series set (`m`: key -> labelled metric)."""
    m["running"].set(s.num_running)
    m["waiting"].set(s.num_waiting)
    m["swapped"].set(s.num_swapped)
    m["kv"].set(s.kv_cache_usage)
    m["prompt"].inc(s.num_prompt_tokens)
    m["generation"].inc(s.num_generation_tokens)
    m["preemptions"].inc(s.num_preemptions)
    m["pc_queries"].inc(s.prefix_cache_queries)
    m["pc_hits"].inc(s.prefix_cache_hits)
    m["spec_drafts"].inc(s.num_drafts)
    m["spec_draft_tokens"].inc(s.num_draft_tokens)
    m["spec_accepted"].inc(s.num_accepted_tokens)
    m["structured"].inc(s.num_structured_requests)
    m["mask_time"].inc(s.mask_time_s)
    for seconds in s.grammar_compile_s:
        m["grammar_compile"].observe(seconds)
    m["step_time"].observe(s.step_time_s)
    m["step_tokens"].observe(s.num_batched_tokens)
    m["step_seqs"].observe(s.num_seqs)


def apply_request(m: dict[str, Any], success: Callable[[str], Any], r: RequestTimes) -> None:
    """One finished request onto a series set; `success(reason)` is its labelled finish counter."""
    for reason in r.reasons:
        success(reason).inc()
    for key, value in (("ttft", r.ttft), ("queue", r.queue), ("e2e", r.e2e), ("tpot", r.tpot)):
        if value is not None:
            m[key].observe(value)
