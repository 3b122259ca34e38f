"""`run_distributed`: a job over several engine replicas on Ray, every row committed exactly once.

The driver is `batchgen.jobs.runner.run_job` with two parts swapped: the engine is a
`ReplicaPool`, and the loop (`replica_loop`) reads the job file, cuts the rows no earlier run
committed into shards of consecutive rows, keeps a bounded number of shards queued on each replica,
and commits each finished shard as one part named by its rows, through the job's manifest. All the
checks before any model work, the resume header, the lock, SIGINT / SIGTERM handling and the final
assembly are `run_job`'s, so a job resumes the same way whichever path ran it (and may switch).

Exactly once: only the driver writes parts and the manifest, and it commits a shard when its result
arrives, once; a shard that Ray runs again after its replica died returns once too (its first try
never returned). A driver killed mid-job leaves committed parts and a manifest; the same command
resumes from them, as on one machine.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from batchgen.config import EngineConfig
from batchgen.distributed.pool import ReplicaOptions, ReplicaPool
from batchgen.distributed.replica import Shard, ShardResult
from batchgen.engine.stats import EngineTotals
from batchgen.jobs.input.rows import JobRow
from batchgen.jobs.loop import JobRun, Progress, ResumeView, RowSource
from batchgen.jobs.options import JobOptions, JobSummary

if TYPE_CHECKING:
    from batchgen.jobs.runner import RunDashboard

# A shard is at least this many rows (fewer only at the end), so each replica's engine batches well.
MIN_SHARD_ROWS = 16
# Shards per replica over the job: enough that the last wave is short, few enough that each is big.
WAVES = 4


def run_distributed(
    options: JobOptions, replicas: ReplicaOptions, dashboard: RunDashboard | None = None
) -> JobSummary:
    """Run one job over `replicas.replicas` engine replicas on Ray, to completion or until SIGINT.

    Args:
        options: the job, as for `batchgen.jobs.runner.run_job`.
        replicas: how many replicas, where (a local Ray instance, or a cluster's address) and with
            what CPUs and GPUs each.
        dashboard: as for `run_job`.

    Returns:
        JobSummary, as `run_job`'s.

    Raises:
        JobInputError: as `run_job`; also when Ray is missing, or a replica cannot start or keeps
            dying (naming the replica and the cause). Committed rows are kept in every case.
    """
    from batchgen.jobs.runner import run_job

    pools: list[ReplicaPool] = []
    # Each replica's metrics carry its number (the driver applies the records the shards bring).
    options = dataclasses.replace(options, metrics=dataclasses.replace(options.metrics, replica_label=True))

    def start_pool(config: EngineConfig) -> ReplicaPool:
        pool = ReplicaPool(replicas, options, config)
        pools.append(pool)
        return pool

    try:
        return run_job(options, engine_factory=start_pool, dashboard=dashboard, loop=replica_loop)
    finally:
        for pool in pools:
            pool.shutdown()


def shard_size(remaining: int | None, replicas: int, commit_rows: int, override: int | None = None) -> int:
    """Rows a shard: about 1/WAVES of each replica's share of the `remaining` rows, at least
    MIN_SHARD_ROWS and at most `commit_rows` (the job's --commit-every), or `override`."""
    if override is not None:
        return override
    if remaining is None:
        return commit_rows
    share = math.ceil(remaining / (replicas * WAVES))
    return max(1, min(commit_rows, max(share, MIN_SHARD_ROWS)))


class _Shards:
    """Cuts the rows not yet committed into shards of at most `size` consecutive input rows."""

    def __init__(self, reader: RowSource, state: ResumeView, size: int, dashboard: Progress) -> None:
        self.reader = reader
        self.rows: Iterator[JobRow] = iter(reader)
        self.state = state
        self.size = size
        self.dashboard = dashboard
        self.rows_read = 0  # input rows read so far, committed ones included
        self.exhausted = False

    def next(self) -> Shard | None:
        """The next shard, or None when every row was read."""
        batch: list[JobRow] = []
        while len(batch) < self.size:
            row = next(self.rows, None)
            while self.reader.parser.notices:  # e.g. a column name one typo away from a sampling field
                self.dashboard.log(self.reader.parser.notices.pop(0))
            if row is None:
                self.exhausted = True
                break
            self.rows_read = row.row_index + 1
            if not self.state.committed.is_committed(row.row_index, row.row_hash, row.where):
                batch.append(row)
        if not batch:
            return None
        return Shard(batch[0].row_index, batch[-1].row_index, batch)


class _Progress:
    """Per-replica engine counters, summed for the dashboard, and a plain line of them now and then."""

    def __init__(self, pool: ReplicaPool, interval: float) -> None:
        n = len(pool.infos)
        self.pids = [info.pid for info in pool.infos]
        self.restarts = [0] * n
        self.latest = [EngineTotals() for _ in range(n)]
        self.earlier = [EngineTotals() for _ in range(n)]  # counters of a replica's previous processes
        self.interval = interval
        self.last_line = time.monotonic()
        self.gen_at_line = [0] * n

    def record(self, replica: int, result: ShardResult) -> str | None:
        """Take a shard's counters; returns a note when the replica's process changed (a restart)."""
        note = None
        if result.pid != self.pids[replica]:
            note = f"replica {replica} was restarted (pid {self.pids[replica]} -> {result.pid}); its shard ran again"
            self.pids[replica] = result.pid
            self.restarts[replica] += 1
            self.earlier[replica] = EngineTotals.merged([self.earlier[replica], self.latest[replica]])
        self.latest[replica] = result.totals
        return note

    def totals(self) -> EngineTotals:
        """Counters over every replica (and their earlier processes)."""
        return EngineTotals.merged(self.earlier + self.latest)

    def line(self) -> str | None:
        """Per-replica generated tokens/s since the last line, every `interval` seconds."""
        now = time.monotonic()
        dt = now - self.last_line
        if dt < self.interval:
            return None
        self.last_line = now
        parts = []
        for i in range(len(self.latest)):
            gen = self.earlier[i].generation_tokens + self.latest[i].generation_tokens
            parts.append(f"{i}: {(gen - self.gen_at_line[i]) / dt:.0f} gen tok/s")
            self.gen_at_line[i] = gen
        restarts = sum(self.restarts)
        return f"[batchgen] replicas {len(self.latest)} (restarts {restarts}) | " + " | ".join(parts)


def replica_loop(run: JobRun[ReplicaPool]) -> tuple[int, bool]:
    """`run_job`'s loop over replicas: shards out, each finished shard committed as one part.

    Returns:
        (input rows read, whether every row finished), as `batchgen.jobs.loop.engine_loop`.

    Raises:
        JobInputError: a replica failed beyond Ray's restarts (`ReplicaPool.result`).
    """
    options, pool, reader, state, writer = run.options, run.engine, run.reader, run.state, run.writer
    dashboard, summary, interrupt, metrics = run.dashboard, run.summary, run.interrupt, run.metrics
    n = len(pool.infos)
    for info in pool.infos:
        dashboard.log(f"replica {info.index} ready: pid {info.pid} on {info.host}")
    remaining = summary.rows_total - summary.rows_resumed if summary.rows_total else None  # 0: unknown
    size = shard_size(remaining, n, options.commit_rows, pool.options.shard_rows)
    shards = _Shards(reader, state, size, dashboard)
    progress = _Progress(pool, options.progress_interval)
    inflight: dict[Any, tuple[int, int, int, int]] = {}  # ref -> (replica, first, last, rows)
    queued = [0] * n
    committed_parts = {e.part for e in state.entries}
    while not interrupt.requested:
        while not shards.exhausted and not interrupt.requested:
            replica = min(range(n), key=queued.__getitem__)
            if queued[replica] >= pool.options.shards_in_flight:
                break
            shard = shards.next()
            if shard is None:
                break
            ref = pool.submit(replica, shard)
            inflight[ref] = (replica, shard.first, shard.last, len(shard.rows))
            queued[replica] += 1
            del shard  # Ray keeps the rows until the shard's task is done (to run it again)
        if not inflight:
            if shards.exhausted:
                break
            continue
        for ref in pool.wait(list(inflight), timeout=0.25):
            replica, first, last, count = inflight.pop(ref)
            queued[replica] -= 1
            result = pool.result(ref, replica, (first, last))
            if len(result.rows) != count:
                raise RuntimeError(
                    f"replica {replica} returned {len(result.rows)} rows for a shard of {count}"
                )
            for row, keep in result.rows:
                _count(summary, row)
                writer.add(row, keep)
            name = Shard(first, last, []).name
            if name in committed_parts:  # never: a shard's rows were not committed when it was cut
                raise RuntimeError(f"{name} is committed already")
            with interrupt.shielded():
                writer.commit(name=name)
            committed_parts.add(name)
            metrics.on_replica(replica, result.metrics)
            metrics.on_rows(writer.committed_rows, summary.rows_error, replica=replica)
            note = progress.record(replica, result)
            if note:
                dashboard.log(note)
        dashboard.update(summary.rows_done, summary.rows_error, None, progress.totals())
        line = progress.line()
        if line and not getattr(dashboard, "live_mode", False):
            dashboard.log(line)
    finished = shards.exhausted and not inflight
    summary.generated_tokens += progress.totals().generation_tokens
    return shards.rows_read, finished


def _count(summary: JobSummary, row: dict[str, Any]) -> None:
    """Add a finished row to the run's summary (as the local loop's `finish` does)."""
    if row["finish_reason"] == "error":
        summary.rows_error += 1
        summary.first_error = summary.first_error or row.get("error")
    else:
        summary.rows_ok += 1
        summary.prompt_tokens += row.get("prompt_tokens") or 0
        summary.completion_tokens += row.get("completion_tokens") or 0
