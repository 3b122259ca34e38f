"""One engine replica: the class a Ray actor runs, and how it turns a shard of rows into output rows.

A replica holds one engine (the model is loaded once, when the actor starts) and runs each shard it
is given through `batchgen.jobs.runner`'s own admission / step loop, so a row's prompt rendering,
tokenization, truncation, error rows and output columns are those of the local path: one code path
for a row, whatever runs it. The replica writes nothing: it returns the shard's output rows and the
driver commits them (`batchgen.distributed.driver`), so the manifest has one writer.

Nothing here imports Ray: `batchgen.distributed.pool` wraps `Replica` in `ray.remote` at run time.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from batchgen.config import EngineConfig
from batchgen.engine.protocol import Engine
from batchgen.engine.stats import EngineTotals, StepStats
from batchgen.jobs.input.rows import JobRow
from batchgen.jobs.options import JobOptions, JobSummary
from batchgen.jobs.output.manifest import PartEntry
from batchgen.metrics import MetricsRecord, NullMetrics


@dataclass
class Shard:
    """A run of input rows sent to one replica: `rows` hold row indices `first..last` (inclusive)
    that no earlier run committed, in input order (committed rows inside the range are absent)."""

    first: int
    last: int
    rows: list[JobRow]

    @property
    def name(self) -> str:
        """The part file its rows are committed as: named by the rows it holds, so a part can never
        be written under two names, nor two shards under one."""
        return f"part-r{self.first:012d}-{self.last:012d}.parquet"


@dataclass
class ShardResult:
    """What a replica returns for a shard: one (output row, kept columns) pair per input row, in
    no particular order, and the replica's engine counters so far (for the dashboard)."""

    first: int
    last: int
    rows: list[tuple[dict[str, Any], dict[str, Any] | None]]
    pid: int
    totals: EngineTotals = field(default_factory=EngineTotals)
    metrics: MetricsRecord | None = None  # the shard's steps and requests, when the job has metrics


@dataclass
class ReplicaInfo:
    """What a started replica reports: its process and host, and either its engine's facts or the
    reason it could not start (`error`)."""

    index: int
    pid: int
    host: str
    error: str | None = None
    model_name: str | None = None
    start_line: str = ""
    max_model_len: int | None = None


class _Rows:
    """The reader `engine_loop` reads: a shard's rows (already parsed on the driver, so no notices)."""

    class _Parser:
        notices: list[str] = []

    def __init__(self, rows: list[JobRow]) -> None:
        self.rows = rows
        self.parser = self._Parser()

    def __iter__(self) -> Iterator[JobRow]:
        return iter(self.rows)


class _NothingCommitted:
    """The resume state `engine_loop` asks: the driver sends only rows not committed yet."""

    class _Committed:
        @staticmethod
        def is_committed(row_index: int, row_hash: int, where: str = "") -> bool:
            return False

    committed = _Committed()
    entries: tuple[PartEntry, ...] = ()


class _Collector:
    """The writer `engine_loop` fills: it keeps the rows; the driver commits them."""

    def __init__(self) -> None:
        self.rows: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
        self.committed_rows = 0  # the driver's count is the job's (its metrics)

    def add(self, row: dict[str, Any], keep: dict[str, Any] | None = None) -> None:
        self.rows.append((row, keep))

    def due(self) -> bool:
        return False

    def commit(self, name: str | None = None) -> None:
        return None


class _Silent:
    """The dashboard `engine_loop` talks to inside a replica (progress is the driver's)."""

    def log(self, message: str) -> None:
        pass

    def update(
        self, rows_done: int, rows_error: int, step: StepStats | None, totals: EngineTotals | None, /
    ) -> None:
        pass


class Replica:
    """An engine replica (run as a Ray actor): loads the model once, then runs shards.

    A model that cannot be loaded does not raise from the constructor (Ray would report only that
    the actor died): the error is kept and `info()` returns it, so the driver can fail the job at
    once with one message naming the replica and the cause.

    Args:
        index: the replica's number (0-based), for messages.
        options: the job's options (prompt rendering, truncation, policy and window).
        config: the engine configuration (`num_threads` None: the CPUs Ray gave the actor).
        num_cpus: the CPUs the actor holds; the engine's default thread count.
    """

    def __init__(
        self,
        index: int,
        options: JobOptions,
        config: EngineConfig,
        num_cpus: float = 1.0,
    ) -> None:
        from batchgen.jobs.runner import default_engine_factory

        self.index = index
        self.options = options
        if config.num_threads is None:  # torch would take every core of the node, not the actor's
            config = dataclasses.replace(config, num_threads=max(1, int(num_cpus)))
        self.config = config
        self.engine: Engine | None = None
        self.error: str | None = None
        try:
            self.engine = default_engine_factory(config)
        except Exception as e:  # JobInputError for a missing model; anything else is as fatal
            self.error = str(e) or type(e).__name__

    def info(self) -> ReplicaInfo:
        """This replica's process, host and engine facts, or the reason it could not start."""
        info = ReplicaInfo(self.index, os.getpid(), socket.gethostname(), self.error)
        if self.engine is not None:
            info.model_name = self.engine.model_name
            info.start_line = self.engine.start_line
            info.max_model_len = self.engine.max_model_len
        return info

    def run_shard(self, shard: Shard) -> ShardResult:
        """Run every row of `shard` to its output row (error rows included) with the local path's loop.

        Raises:
            RuntimeError: the replica has no engine (its `info()` error says why).
        """
        from batchgen.jobs.interrupt import Interrupt
        from batchgen.jobs.loop import JobRun, engine_loop

        if self.engine is None:
            raise RuntimeError(f"replica {self.index} has no engine: {self.error}")
        collector = _Collector()
        summary = JobSummary("", len(shard.rows))
        record = MetricsRecord() if self.options.metrics.enabled else None
        # The interrupt is never entered: signals are the driver's; a shard runs to its end.
        run = JobRun(
            self.options,
            self.config,
            self.engine,
            _Rows(shard.rows),
            _NothingCommitted(),
            collector,
            _Silent(),
            summary,
            Interrupt(),
            record if record is not None else NullMetrics(),
        )
        engine_loop(run)
        totals = dataclasses.replace(getattr(self.engine, "totals", None) or EngineTotals())
        return ShardResult(shard.first, shard.last, collector.rows, os.getpid(), totals, record)
