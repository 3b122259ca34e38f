"""Prometheus metrics of a running job: `--metrics-port` (HTTP) and `--metrics-file` (textfile).

Names follow vLLM's with a `batchgen:` prefix (`batchgen:num_requests_running`,
`batchgen:kv_cache_usage_perc`, `batchgen:time_to_first_token_seconds`, ...) and Prometheus
conventions: units in names, `_total` only on counters (so vLLM's histogram `iteration_tokens_total`
is `batchgen:iteration_tokens` here), histograms with vLLM's bucket edges. Every metric carries a
`model_name` label, as vLLM's do; under `--replicas` every metric but the job's row totals also
carries a `replica` label (the replica's number: vLLM's data-parallel engines say `engine`), from the
`MetricsRecord` each replica sends back with its shard (`batchgen.metrics_record`). The values are the ones the engine already publishes (`StepStats`
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchgen.metrics_record import (
    JOB_KEYS,
    METRICS,
    QUEUE_GAUGES,
    MetricsRecord,
    RequestTimes,
    apply_request,
    apply_step,
)

if TYPE_CHECKING:
    from batchgen.engine.stats import EngineTotals, StepStats
    from batchgen.outputs import RequestOutput

PREFIX = "batchgen:"
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
    replica_label: bool = False  # set by `--replicas` (`batchgen.distributed`)

    @property
    def enabled(self) -> bool:
        return self.port is not None or self.file is not None


def _input_error(message: str) -> Exception:
    """A JobInputError (imported on use: batchgen.jobs imports this module for MetricsOptions)."""
    from batchgen.jobs.errors import JobInputError

    return JobInputError(message)


def _import_prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise _input_error(
            "--metrics-port and --metrics-file need the prometheus_client package: "
            "pip install 'batchgen[metrics]'"
        ) from None
    return prometheus_client


class JobMetrics:
    """The job's metrics in a dedicated registry, their HTTP server and textfile writer.

    `open()` (before the model loads: a port in use or a file that cannot be written is the
    command's error, with nothing started), `bind(model_name)` once the engine is up, then
    `on_step` / `on_request` / `on_rows` from the job loop, and `close()` (a last file write).
    Under `--replicas` (`options.replica_label`) every metric but the job's row totals carries a
    `replica` label, and the driver applies each replica's `MetricsRecord` with `on_replica`.

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
        self._labels = ("model_name", "replica") if options.replica_label else ("model_name",)
        self._families: dict[str, Any] = {}
        for key, kind, name, doc, *buckets in METRICS:
            labels: tuple[str, ...] = ("model_name",) if key in JOB_KEYS else self._labels
            if key == "success":
                labels += ("finished_reason",)
            cls = {"gauge": prom.Gauge, "counter": prom.Counter, "histogram": prom.Histogram}[kind]
            extra = {"buckets": buckets[0]} if buckets else {}
            self._families[key] = cls(PREFIX + name, doc, labels, registry=self.registry, **extra)
        # One series of value 1 whose labels say what runs (vLLM publishes its configuration as
        # such info series): the model's dtype and quantization.
        self._model_info = prom.Gauge(
            PREFIX + "model_info",
            "The model this job runs, value 1: its dtype and its quantization (none, int8, gguf) as labels.",
            ("model_name", "dtype", "quantization"),
            registry=self.registry,
        )
        self._m: dict[str, Any] = {}  # the series of the local engine (no replica label)
        self._replicas: dict[int, dict[str, Any]] = {}  # replica -> its series
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
            raise _input_error(
                f"--metrics-port {o.port}: {why}; choose another --metrics-port (or --metrics-host)"
            ) from None

    def _check_file(self) -> None:
        path = self.options.file
        if path is None:
            return
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise _input_error(f"--metrics-file {path}: the folder {folder} does not exist")
        try:
            self.write_file()
        except OSError as e:
            raise _input_error(f"--metrics-file {path}: cannot write it: {e.strerror or e}") from None

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

    def bind(
        self,
        model_name: str,
        total_rows: int | None,
        rows_resumed: int,
        model_info: dict[str, str] | None = None,
    ) -> None:
        """Create the `model_name` series (before this, a scrape shows only the metric names).
        `rows_resumed`: the writer's committed rows at the start (earlier runs'); `model_info`:
        the `dtype` and `quantization` of the `batchgen:model_info` series (None: no engine
        started, so none)."""
        self._model_name = model_name
        if model_info is not None:
            self._model_info.labels(model_name=model_name, **model_info).set(1)
        self._committed_base = rows_resumed
        f = self._families
        f["job_rows"].labels(model_name=model_name).set(float("nan") if total_rows is None else total_rows)
        f["rows_resumed"].labels(model_name=model_name).set(rows_resumed)
        if not self.options.replica_label:
            self._m = {
                k: f[k].labels(model_name=model_name) for k in f if k != "success" and k not in JOB_KEYS
            }

    def _series(self, replica: int) -> dict[str, Any]:
        """The series of `replica` (created on its first use)."""
        if replica not in self._replicas:
            labels = {"model_name": self._model_name, "replica": str(replica)}
            f = self._families
            self._replicas[replica] = {
                k: f[k].labels(**labels) for k in f if k != "success" and k not in JOB_KEYS
            }
        return self._replicas[replica]

    def _success(self, replica: int | None) -> Callable[[str], Any]:
        labels = {"model_name": self._model_name}
        if replica is not None:
            labels["replica"] = str(replica)
        return lambda reason: self._families["success"].labels(**labels, finished_reason=reason)

    def on_step(self, s: StepStats | None, totals: EngineTotals | None = None) -> None:
        """One engine step's `StepStats` (None: the step ran no model work) and the engine's
        `EngineTotals` after it (for the cumulative prefix-cache hit rate)."""
        if s is None or not self._m:
            return
        if totals is not None:
            self._m["hit_rate"].set(totals.prefix_cache_hit_rate)
        apply_step(self._m, s)

    def on_request(self, out: RequestOutput) -> None:
        """One finished `RequestOutput`: its latencies (a rejected request has none) and finish reason."""
        if self._m:
            apply_request(self._m, self._success(None), RequestTimes.of(out))

    def on_replica(self, replica: int, record: MetricsRecord | None) -> None:
        """A replica's steps and finished requests since its last record, onto its series."""
        if record is None or self._model_name is None:
            return
        m = self._series(replica)
        for s in record.steps:
            apply_step(m, s)
        if record.hit_rate is not None:
            m["hit_rate"].set(record.hit_rate)
        success = self._success(replica)
        for r in record.requests:
            apply_request(m, success, r)

    def on_rows(
        self, committed_rows: int, rows_errored: int, idle: bool = False, replica: int | None = None
    ) -> None:
        """The writer's committed rows (earlier runs' included) and this run's error rows; `idle`:
        the job loop has ended, so no request is left in the engine (queue gauges to 0); `replica`:
        under `--replicas`, whose shard the rows since the last call came from."""
        if self._model_name is None:
            return
        if replica is not None:
            m = self._series(replica)
        elif self._m:
            m = self._m
        else:  # --replicas and no shard committed since the last call: nothing to attribute
            m = None
        if idle:
            for series in [self._m, *self._replicas.values()]:
                for key in QUEUE_GAUGES:
                    if series:
                        series[key].set(0)
        committed = committed_rows - (self._committed_base or 0)
        if m is not None:
            m["committed"].inc(max(committed - self._committed_seen, 0))
            m["errored"].inc(max(rows_errored - self._errored_seen, 0))
            self._committed_seen = max(committed, self._committed_seen)
            self._errored_seen = max(rows_errored, self._errored_seen)


class NullMetrics:
    """What the job loop calls when no metrics option is given: nothing happens."""

    url = None

    def bind(self, *args: object, **kwargs: object) -> None: ...
    def on_replica(self, *args: object, **kwargs: object) -> None: ...
    def on_step(self, *args: object, **kwargs: object) -> None: ...
    def on_request(self, *args: object, **kwargs: object) -> None: ...
    def on_rows(self, *args: object, **kwargs: object) -> None: ...
    def close(self, final_write: bool = True) -> None: ...
