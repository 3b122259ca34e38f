"""The engine loop of a job: rows read into the look-ahead window, admitted into the engine in policy
order, stepped, and each finished row handed to the part writer.

`engine_loop` is what `batchgen.jobs.runner.run_job` runs by default (one engine in this process);
each Ray replica runs it on its shards (`batchgen.distributed.replica`), and the driver swaps in its
own loop over a `JobRun` of the same shape (`batchgen.distributed.driver.replica_loop`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from batchgen.config import EngineConfig
from batchgen.engine.protocol import Engine
from batchgen.engine.stats import EngineTotals, StepStats
from batchgen.jobs.input.rows import JobRow
from batchgen.jobs.interrupt import Interrupt
from batchgen.jobs.options import JobOptions, JobSummary
from batchgen.jobs.output.manifest import PartEntry
from batchgen.jobs.output.token_bytes import TokenBytes
from batchgen.jobs.requests import Prepared, error_result, output_result, prepare_row
from batchgen.jobs.window import LookaheadWindow
from batchgen.metrics import JobMetrics, NullMetrics
from batchgen.metrics_record import MetricsRecord


def inflight_limit(max_num_seqs: int) -> int:
    """Rows the loop keeps in the engine (twice max_num_seqs, at least 8: enough to fill the next
    steps while the rest wait in the window, where the policy can still reorder them)."""
    return max(2 * max_num_seqs, 8)


def window_work(prompt_tokens: int, n: int, max_tokens: int | None, max_model_len: int) -> int:
    """A row's work as the window orders it under max-throughput: its prompt tokens and n times its
    output budget (`max_tokens`, else the room max_model_len leaves)."""
    return prompt_tokens + n * (max_tokens or max_model_len - prompt_tokens)


class Notices(Protocol):
    """The reader's row parser, as a loop reads it."""

    @property
    def notices(self) -> list[str]:
        """Messages about the input (a column one typo away from a field), logged as they come."""
        ...


class RowSource(Protocol):
    """The job's rows in input order: `batchgen.jobs.input.reader.JobReader`, or a replica's shard."""

    @property
    def parser(self) -> Notices: ...

    def __iter__(self) -> Iterator[JobRow]: ...


class Committed(Protocol):
    """The rows earlier runs committed (`batchgen.jobs.output.manifest.CommittedRows`)."""

    def is_committed(self, row_index: int, row_hash: int, where: str = "") -> bool: ...


class ResumeView(Protocol):
    """What a loop asks of the resume state (`batchgen.jobs.output.resume.ResumeState`): the rows and
    parts earlier runs committed."""

    @property
    def committed(self) -> Committed: ...

    @property
    def entries(self) -> Sequence[PartEntry]: ...


class RowSink(Protocol):
    """Where finished rows go (`batchgen.jobs.output.writer.PartWriter`, or a replica's collector)."""

    @property
    def committed_rows(self) -> int: ...

    def add(self, row: dict[str, Any], keep: dict[str, Any] | None = None) -> None: ...

    def due(self) -> bool: ...

    def commit(self, name: str | None = None) -> object: ...


class Progress(Protocol):
    """What a loop reports to (`batchgen.dashboard.Dashboard`; a replica's is silent)."""

    def log(self, message: str, /) -> None: ...

    def update(
        self, rows_done: int, rows_error: int, step: StepStats | None, totals: EngineTotals | None, /
    ) -> None: ...


class RunEngine(Protocol):
    """What `run_job` itself reads of the engine its loop runs (an `Engine`, the driver's pool)."""

    @property
    def model_name(self) -> str | None: ...

    @property
    def start_line(self) -> str:
        """What the engine settled on at start, logged once when a job starts ("": nothing)."""
        ...


E = TypeVar("E")  # the engine: an `Engine` here, the driver's pool of replicas in its loop


@dataclass
class JobRun(Generic[E]):
    """One run of a job's rows, as `run_job` hands it to its loop (`engine_loop`, the driver's).

    Attributes:
        options / config: the job and its engine configuration.
        engine: what runs the rows (an `Engine`; the driver's loop: a `ReplicaPool`).
        reader: the job's rows; their parser's `notices` are logged as they come.
        state: the resume state; rows it holds as committed are skipped.
        writer: takes each finished row (`add`) and commits when `due()`.
        dashboard: `log` and `update` (progress).
        summary: its row and token counts grow as rows finish.
        interrupt: `requested` stops the loop; `run_job` enters it (its signal handlers) around
            the loop, a replica's is never entered.
        metrics: Prometheus metrics, or a replica's record of them for the driver.
    """

    options: JobOptions
    config: EngineConfig
    engine: E
    reader: RowSource
    state: ResumeView
    writer: RowSink
    dashboard: Progress
    summary: JobSummary
    interrupt: Interrupt
    metrics: JobMetrics | NullMetrics | MetricsRecord = field(default_factory=NullMetrics)


def engine_loop(run: JobRun[Engine]) -> tuple[int, bool]:
    """The admission / step / commit loop, until every row is done or `run.interrupt.requested`.

    Returns:
        (input rows read, whether every row finished); rows still in the engine when it stops are
        aborted (the next run regenerates them).
    """
    return _EngineLoop(run).run()


class _EngineLoop:
    """`engine_loop`'s state: the window, the rows in the engine, how far the input is read."""

    def __init__(self, run: JobRun[Engine]) -> None:
        options, engine = run.options, run.engine
        self.options, self.engine, self.reader, self.state = options, engine, run.reader, run.state
        self.writer, self.dashboard, self.summary = run.writer, run.dashboard, run.summary
        self.interrupt, self.metrics = run.interrupt, run.metrics
        tokenizer = engine.tokenizer
        self.chat = options.chat_template and bool(getattr(tokenizer, "chat_template", None))
        self.bos = getattr(tokenizer, "bos_token_id", None)
        self.token_bytes = TokenBytes(tokenizer)
        self.max_len: int = engine.max_model_len
        self.inflight_limit = inflight_limit(run.config.max_num_seqs)
        self.window: LookaheadWindow[Prepared] = LookaheadWindow(options.policy, options.window)
        self.pending: dict[str, Prepared] = {}  # request id -> the row the engine is running
        self.rows = iter(run.reader)
        self.rows_read = 0
        self.exhausted = False
        # Structured rows of the first window, for the line said once it is read.
        self.first_window: dict[str, int] | None = {}

    def run(self) -> tuple[int, bool]:
        engine, summary, metrics = self.engine, self.summary, self.metrics
        while not self.interrupt.requested:
            self._fill_window()
            if self.first_window is not None:
                self._say_structured()
            self._admit()
            if engine.has_unfinished_requests():
                for out in engine.step():
                    metrics.on_request(out)
                    p = self.pending.pop(out.request_id)
                    self._finish(output_result(p, out, self.token_bytes), p.row.keep)
                metrics.on_step(engine.last_step, engine.totals)
            elif self.exhausted and not self.window:
                break
            self.dashboard.update(summary.rows_done, summary.rows_error, engine.last_step, engine.totals)
            metrics.on_rows(self.writer.committed_rows, summary.rows_error)
        totals = engine.totals
        summary.structured_rows, summary.grammars_compiled = (
            totals.structured_requests,
            totals.grammars_compiled,
        )
        summary.grammar_compile_s = totals.grammar_compile_s
        summary.mask_time_s, summary.step_time_s = totals.mask_time_s, totals.step_time_s
        finished = self.exhausted and not self.window and not self.pending
        summary.generated_tokens += engine.totals.generation_tokens
        if not finished:
            for rid in self.pending:
                engine.abort_request(rid)
        return self.rows_read, finished

    def _fill_window(self) -> None:
        """Read rows until the window is full or the input ends: committed rows are skipped, rows
        that cannot run (bad input, a prompt too long) are finished as error rows at once."""
        while not self.exhausted and not self.window.full and not self.interrupt.requested:
            row = next(self.rows, None)
            notices = self.reader.parser.notices  # e.g. a column name one typo away from a sampling field
            while notices:
                self.dashboard.log(notices.pop(0))
            if row is None:
                self.exhausted = True
                return
            self.rows_read = row.row_index + 1
            if self.state.committed.is_committed(row.row_index, row.row_hash, row.where):
                continue
            if row.error is not None:
                self._finish(error_result(row, row.error), row.keep)
                continue
            prepared, error = prepare_row(row, self.engine, self.options, self.chat, self.bos, self.max_len)
            if error is not None:
                self._finish(error_result(row, error, prepared.prompt_tokens if prepared else None), row.keep)
                continue
            assert prepared is not None  # prepare_row gives the row or its error
            sp = row.params
            work = window_work(prepared.prompt_tokens, sp.n, sp.max_tokens, self.max_len)
            self.window.push(prepared, work=work, priority=sp.priority)
            if sp.structured_outputs is not None:  # its grammar compiles while the row waits
                self.engine.prepare(sp)
                if self.first_window is not None:
                    key = sp.structured_outputs.key
                    self.first_window[key] = self.first_window.get(key, 0) + 1

    def _say_structured(self) -> None:
        """Once, after the first window is read: how many of its rows have a structured outputs
        constraint and how many distinct ones (the dashboard then follows their compile time)."""
        counts, self.first_window = self.first_window, None
        if counts:
            self.dashboard.log(
                f"structured outputs: {sum(counts.values())} of the first {self.rows_read} rows read ask for "
                f"a constraint, {len(counts)} distinct; each compiles once, while its rows wait in the window"
            )

    def _admit(self) -> None:
        """Hand rows from the window to the engine, in policy order, while it holds fewer than
        `inflight_limit` rows."""
        while (
            self.window
            and self.engine.num_unfinished_requests() < self.inflight_limit
            and not self.interrupt.requested
        ):
            p = self.window.pop()
            rid = str(p.row.row_index)
            self.engine.add_request(rid, {"prompt_token_ids": p.token_ids}, p.row.sampling_params)
            p.token_ids = None  # the engine holds them now
            self.pending[rid] = p

    def _finish(self, result: dict[str, Any], keep: dict[str, Any] | None) -> None:
        """A finished row (output or error) to the writer and the summary; commit when due."""
        summary = self.summary
        self.writer.add(result, keep)
        if result["finish_reason"] == "error":
            summary.rows_error += 1  # its prompt (often a too-long one) never ran: not counted
            summary.first_error = summary.first_error or result.get("error")
        else:
            summary.rows_ok += 1
            summary.prompt_tokens += result.get("prompt_tokens") or 0
            summary.completion_tokens += result.get("completion_tokens") or 0
        if self.writer.due():
            self.writer.commit()
