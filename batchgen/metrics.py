"""Prometheus metrics of a running job: `--metrics-port` (HTTP) and `--metrics-file` (textfile).

Names follow vLLM's with a `batchgen:` prefix (`batchgen:num_requests_running`,
`batchgen:kv_cache_usage_perc`, `batchgen:time_to_first_token_seconds`, ...) and Prometheus
conventions: units in names, `_total` only on counters (so vLLM's histogram `iteration_tokens_total`
is `batchgen:iteration_tokens` here), histograms with vLLM's bucket edges. Every metric carries a
`model_name` label, as vLLM's do. The values are the ones the engine already publishes (`StepStats`
of each step, `RequestOutput.metrics` of each finished request) and the job's row counts; nothing is
measured twice.

The metrics live in their own `CollectorRegistry`, never the process-global one, so two jobs in one
process (tests, a notebook) never collide. `prometheus_client` is an optional extra
(`pip install 'batchgen[metrics]'`); it is imported only when a metrics option is used.
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass
from typing import Any

from batchgen.jobs.reader import JobInputError

PREFIX = "batchgen:"
# vLLM's bucket edges (seconds, or tokens per step).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
ITERATION_SEQS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
FILE_INTERVAL_S = 5.0


@dataclass(frozen=True)
class MetricsOptions:
    """Where the metrics go. `port`: serve them over HTTP at http://HOST:PORT/metrics (`host`
    127.0.0.1 by default: only this machine can read them unless the user widens it); `file`: write
    them in the text format, atomically, every `interval_s` seconds and when the job ends."""

    port: int | None = None
    host: str = "127.0.0.1"
    file: str | None = None
    interval_s: float = FILE_INTERVAL_S

    @property
    def enabled(self) -> bool:
        return self.port is not None or self.file is not None


def _import_prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise JobInputError(
            "--metrics-port and --metrics-file need the prometheus_client package: "
            "pip install 'batchgen[metrics]'"
        ) from None
    return prometheus_client


class JobMetrics:
    """The job's metrics in a dedicated registry, their HTTP server and textfile writer.

    `open()` (before the model loads: a port in use or a file that cannot be written is the
    command's error, with nothing started), `bind(model_name)` once the engine is up, then
    `on_step` / `on_request` / `on_rows` from the job loop, and `close()` (a last file write).

    Raises:
        JobInputError: prometheus_client is missing, the port is in use or not allowed, or the file
            cannot be written.
    """

    def __init__(self, options: MetricsOptions) -> None:
        self.options = options
        prom = _import_prometheus()
        # No `*_created` series next to every counter and histogram (as vLLM does): they double the
        # exposition and no dashboard reads them. The switch is process-wide in prometheus_client.
        prom.disable_created_metrics()
        self._prom = prom
        self.registry = prom.CollectorRegistry(auto_describe=True)
        labels = ("model_name",)

        def gauge(name: str, doc: str) -> Any:
            return prom.Gauge(PREFIX + name, doc, labels, registry=self.registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return prom.Counter(PREFIX + name, doc, labels + extra, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return prom.Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        # prometheus_client adds `_total` to counter names in the exposition.
        self._families = {
            "running": gauge("num_requests_running", "Requests in the engine's running batch."),
            "waiting": gauge("num_requests_waiting", "Requests in the engine's waiting queue."),
            "swapped": gauge("num_requests_swapped", "Requests swapped out to CPU swap space."),
            "kv": gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks held by live requests (0-1)."),
            "hit_rate": gauge(
                "prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / looked up, since start."
            ),
            "job_rows": gauge("job_rows", "Rows in the job file (NaN when it cannot be counted up front)."),
            "rows_resumed": gauge("rows_resumed", "Rows committed by earlier runs of this job."),
            "prompt": counter("prompt_tokens", "Prefill tokens computed (prefix-cache hits excluded)."),
            "generation": counter("generation_tokens", "Tokens generated."),
            "preemptions": counter("num_preemptions", "Preemptions of running requests."),
            "pc_queries": counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
            "pc_hits": counter("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
            "spec_drafts": counter(
                "spec_decode_num_drafts", "Speculative decoding: requests' verifications of draft tokens."
            ),
            "spec_draft_tokens": counter(
                "spec_decode_num_draft_tokens", "Speculative decoding: draft tokens proposed and verified."
            ),
            "spec_accepted": counter(
                "spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted."
            ),
            "spec_rate": gauge(
                "spec_decode_draft_acceptance_rate",
                "Speculative decoding: draft tokens accepted / verified, since start (0 before any).",
            ),
            "committed": counter(
                "rows_committed", "Rows committed to part files by this run (error rows included)."
            ),
            "errored": counter("rows_errored", "Rows that finished as error rows in this run."),
            "success": counter(
                "request_success", "Requests finished, by finish reason.", extra=("finished_reason",)
            ),
            "ttft": histogram(
                "time_to_first_token_seconds",
                "Time from a request's arrival in the engine to its first token.",
                TTFT_BUCKETS,
            ),
            "tpot": histogram(
                "request_time_per_output_token_seconds",
                "Mean time per output token after the first, one observation per request.",
                TOKEN_LATENCY_BUCKETS,
            ),
            "e2e": histogram(
                "e2e_request_latency_seconds",
                "Time from a request's arrival in the engine to its last token.",
                REQUEST_LATENCY_BUCKETS,
            ),
            "queue": histogram(
                "request_queue_time_seconds",
                "Time a request waited in the engine before its first step.",
                REQUEST_LATENCY_BUCKETS,
            ),
            "step_time": histogram(
                "engine_step_duration_seconds", "Wall time of one engine step.", TOKEN_LATENCY_BUCKETS
            ),
            "step_tokens": histogram(
                "iteration_tokens",
                "Tokens in one engine step (batch size in tokens).",
                ITERATION_TOKENS_BUCKETS,
            ),
            "step_seqs": histogram(
                "iteration_seqs", "Sequences in one engine step (batch size).", ITERATION_SEQS_BUCKETS
            ),
        }
        self._m: dict[str, Any] = {}
        self._model_name: str | None = None
        self._committed_base: int | None = None
        self._committed_seen = 0
        self._errored_seen = 0
        self._server: Any = None
        self._server_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._file_thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one file write at a time (the writer thread and close())

    # ----- lifecycle -----

    @classmethod
    def open(cls, options: MetricsOptions) -> JobMetrics | NullMetrics:
        """Start the HTTP server and the file writer (NullMetrics when neither is asked for)."""
        if not options.enabled:
            return NullMetrics()
        metrics = cls(options)
        try:
            if options.port is not None:  # first: a port in use leaves no file behind
                metrics._serve()
            if options.file is not None:
                metrics._check_file()
                metrics._file_thread = threading.Thread(
                    target=metrics._write_loop, name="batchgen-metrics-file", daemon=True
                )
                metrics._file_thread.start()
        except BaseException:
            metrics.close(final_write=False)
            raise
        return metrics

    def _serve(self) -> None:
        o = self.options
        try:
            self._server, self._server_thread = self._prom.start_http_server(
                o.port, addr=o.host, registry=self.registry
            )
        except OSError as e:
            where = f"{o.host}:{o.port}"
            if e.errno == errno.EADDRINUSE:
                why = f"{where} is already in use (another batchgen run or exporter?)"
            elif e.errno in (errno.EACCES, errno.EPERM):
                why = f"{where} is not allowed for this user (ports below 1024 need privileges)"
            else:
                why = f"cannot listen on {where}: {e.strerror or e}"
            raise JobInputError(
                f"--metrics-port {o.port}: {why}; choose another --metrics-port (or --metrics-host)"
            ) from None

    def _check_file(self) -> None:
        path = self.options.file
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise JobInputError(f"--metrics-file {path}: the folder {folder} does not exist")
        try:
            self.write_file()
        except OSError as e:
            raise JobInputError(f"--metrics-file {path}: cannot write it: {e.strerror or e}") from None

    def _write_loop(self) -> None:
        while not self._stop.wait(self.options.interval_s):
            try:
                self.write_file()
            except OSError:  # a full disk for a moment: the next write tries again
                pass

    def write_file(self) -> None:
        """Write the metrics to `options.file` atomically (a temporary file in the same folder,
        renamed over it: the textfile collector never reads half a file)."""
        if self.options.file is not None:
            with self._lock:
                self._prom.write_to_textfile(self.options.file, self.registry)

    def close(self, final_write: bool = True) -> None:
        """Stop the writer (after a last write of the final values) and the HTTP server."""
        self._stop.set()
        if self._file_thread is not None:
            self._file_thread.join()
            self._file_thread = None
        if final_write and self.options.file is not None:
            try:
                self.write_file()
            except OSError:
                pass
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def url(self) -> str | None:
        """http://HOST:PORT/metrics of the server (the bound port), or None."""
        if self._server is None:
            return None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/metrics"

    # ----- values -----

    def bind(self, model_name: str, total_rows: int | None, rows_resumed: int) -> None:
        """Create the `model_name` series (before this, a scrape shows only the metric names).
        `rows_resumed`: the writer's committed rows at the start (earlier runs')."""
        self._model_name = model_name
        self._committed_base = rows_resumed
        self._m = {k: f.labels(model_name=model_name) for k, f in self._families.items() if k != "success"}
        self._m["job_rows"].set(float("nan") if total_rows is None else total_rows)
        self._m["rows_resumed"].set(rows_resumed)

    def on_step(self, s: Any, totals: Any = None) -> None:
        """One engine step's `StepStats` (None: the step ran no model work) and the engine's
        `EngineTotals` after it (for the cumulative prefix-cache hit rate)."""
        if s is None or not self._m:
            return
        m = self._m
        if totals is not None:
            m["hit_rate"].set(totals.prefix_cache_hit_rate)
            m["spec_rate"].set(totals.spec_decode_acceptance_rate)
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
        m["step_time"].observe(s.step_time_s)
        m["step_tokens"].observe(s.num_batched_tokens)
        m["step_seqs"].observe(s.num_seqs)

    def on_request(self, out: Any) -> None:
        """One finished `RequestOutput`: its latencies (a rejected request has none) and finish reason."""
        if not self._m:
            return
        reasons = [c.finish_reason for c in out.outputs] or ["error"]
        for reason in reasons:
            self._families["success"].labels(model_name=self._model_name, finished_reason=reason).inc()
        t = out.metrics
        if t is None or t.ttft is None:
            return
        self._m["ttft"].observe(t.ttft)
        if t.first_scheduled_time is not None:
            self._m["queue"].observe(t.first_scheduled_time - t.arrival_time)
        if t.latency is not None:
            self._m["e2e"].observe(t.latency)
            n = max(len(c.token_ids) for c in out.outputs)
            if n > 1:
                self._m["tpot"].observe((t.latency - t.ttft) / (n - 1))

    def on_rows(self, committed_rows: int, rows_errored: int, idle: bool = False) -> None:
        """The writer's committed rows (earlier runs' included) and this run's error rows; `idle`:
        the job loop has ended, so no request is left in the engine (queue gauges to 0)."""
        if not self._m:
            return
        if idle:
            for key in ("running", "waiting", "swapped", "kv"):
                self._m[key].set(0)
        committed = committed_rows - (self._committed_base or 0)
        self._m["committed"].inc(max(committed - self._committed_seen, 0))
        self._m["errored"].inc(max(rows_errored - self._errored_seen, 0))
        self._committed_seen = max(committed, self._committed_seen)
        self._errored_seen = max(rows_errored, self._errored_seen)


class NullMetrics:
    """What the job loop calls when no metrics option is given: nothing happens."""

    url = None

    def bind(self, *args: Any, **kwargs: Any) -> None: ...
    def on_step(self, *args: Any, **kwargs: Any) -> None: ...
    def on_request(self, *args: Any, **kwargs: Any) -> None: ...
    def on_rows(self, *args: Any, **kwargs: Any) -> None: ...
    def close(self, final_write: bool = True) -> None: ...
