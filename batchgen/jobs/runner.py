"""run_job: a job file through the engine into committed parts and the final output.

Everything that can fail without a model is checked first (input, schema, output location, resume
header, `--strict` validation); then the engine is built (unless no row is left to run), rows
stream through the look-ahead window into it, finished rows are committed every `commit_rows` rows
or `commit_seconds` seconds, and the final file is written once every row is committed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa

from batchgen.config import EngineConfig, resolve_device
from batchgen.engine.protocol import Engine
from batchgen.jobs.formats import JobInputError
from batchgen.jobs.options import (
    JobOptions,
    JobSummary,
    check_job_options,
    check_output_path,
    default_output_path,
    flag_hint,
    output_format,
)
from batchgen.jobs.reader import JobReader, ReaderOptions
from batchgen.jobs.requests import Prepared, error_result, output_result, prepare_row
from batchgen.jobs.resume import make_header, prepare_output, remove_earlier_output
from batchgen.jobs.token_bytes import TokenBytes
from batchgen.jobs.window import LookaheadWindow
from batchgen.jobs.writer import PartWriter, count_output_errors, finalize_output
from batchgen.metrics import JobMetrics, NullMetrics
from batchgen.model.loading.fingerprint import model_fingerprint
from batchgen.sampling_params import SamplingParams
from batchgen.stop_signals import STOP_SIGNALS


def default_engine_factory(config: EngineConfig) -> Engine:
    """Build the real engine (imported here so pre-flight checks never load torch or a model).

    Raises:
        JobInputError: the model is missing or unsupported, or the engine options conflict.
    """
    from batchgen.engine.llm_engine import LLMEngine
    from batchgen.model.loading.architectures import ModelNotFoundError

    try:
        return LLMEngine(config)
    except (ModelNotFoundError, ValueError) as e:
        raise JobInputError(
            f"cannot start the engine for model {config.model or '(default)'}: {e}{flag_hint(str(e))}"
        ) from e


def _model_label(options: JobOptions) -> str:
    model = options.engine.get("model")
    if model and os.path.exists(model):
        return os.path.abspath(model)
    return model or "default"


def _header_options(options: JobOptions, reader: JobReader, fmt: str) -> dict[str, Any]:
    """Options that change the output rows (engine options that only change speed are left out)."""
    return {
        "output_format": fmt,
        "prompt_column": reader.prompt_column,
        "messages_column": reader.messages_column,
        "id_column": reader.id_column,
        "template": options.template,
        "system_prompt": options.system_prompt,
        "chat_template": options.chat_template,
        "keep_columns": list(options.keep_columns),
        "limit": options.limit,
        "sampling": options.sampling_defaults(),
        "truncate_prompt": options.truncate_prompt,
        "dtype": options.engine.get("dtype", "auto"),
        "max_model_len": options.engine.get("max_model_len"),
    }


def job_header(options: JobOptions, reader: JobReader, fmt: str) -> dict[str, Any]:
    """What a resumed run must share with the run that committed the rows (input, model, options)."""
    return make_header(
        reader.identity(),
        _model_label(options),
        _header_options(options, reader, fmt),
        model_fingerprint(options.engine.get("model")),
    )


def validate_job(reader: JobReader, limit: int = 10) -> None:
    """--strict: read every row and fail on the first `limit` invalid ones (no model needed).

    Raises:
        JobInputError: listing the invalid rows and their fixes.
    """
    errors: list[str] = []
    count = 0
    for row in reader:
        if row.error is not None:
            count += 1
            if len(errors) < limit:
                errors.append(row.error)
    if count:
        more = f"\n  ... and {count - limit} more" if count > limit else ""
        raise JobInputError(
            f"--strict: {count} invalid row(s) in {reader.source}:\n  "
            + "\n  ".join(errors)
            + more
            + "\nFix them, or run without --strict to get an error row for each"
        )


class _Interrupt:
    """SIGINT, SIGTERM and SIGHUP handler: the first signal asks the loop to stop (finished rows are
    committed), a second goes to the handler that was there before (the CLI's, which records the
    signal for the exit code; Python's KeyboardInterrupt for SIGINT), else raises KeyboardInterrupt.
    SIGTERM is what `timeout`, `docker stop`, systemd and Slurm send, and SIGHUP what a closed
    terminal sends, so both are handled as Ctrl-C is. Inside `shielded()` (a commit) signals are
    only recorded, so a burst of Ctrl-C cannot stop a commit half-way and lose its rows."""

    SIGNALS = STOP_SIGNALS

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._shielded = False

    @contextlib.contextmanager
    def shielded(self) -> Iterator[None]:
        """Signals that arrive inside only set `requested` (the caller then stops)."""
        self._shielded = True
        try:
            yield
        finally:
            self._shielded = False

    def __enter__(self) -> _Interrupt:
        if threading.current_thread() is threading.main_thread():  # signals only reach the main thread
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self._shielded:
            self.requested = True
            self.signum = self.signum or signum
            return
        if self.requested:
            previous = self._previous.get(signum)
            if callable(previous):
                previous(signum, frame)
            raise KeyboardInterrupt
        self.requested = True
        self.signum = signum

    def __exit__(self, *exc: Any) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)


def _finished_summary(output: str, fmt: str, reader: JobReader) -> JobSummary:
    """The summary of a job whose output was already complete: its ok and error rows are counted
    from the output, so a rerun of a job whose every row failed still reports (and exits) so."""
    summary = JobSummary(output, reader.count_rows() or 0, complete=True, already_complete=True)
    try:
        rows, summary.rows_error, summary.first_error = count_output_errors(output, fmt)
    except (OSError, ValueError, pa.ArrowException):  # unreadable: report it complete, uncounted
        return summary
    summary.rows_ok = rows - summary.rows_error
    summary.output_error_rows = summary.rows_error
    return summary


def check_run_options(options: JobOptions, check_device: bool = True) -> EngineConfig:
    """The checks on a job's options that need no input nor model; returns the engine config.
    `check_device` False leaves the device to the replicas that run on it (`batchgen.distributed`:
    --device cuda from a driver without a GPU, a CPU head node).

    Raises:
        JobInputError: naming the option (and its flag) that is out of range.
    """
    check_job_options(options)
    try:
        config = EngineConfig(**options.engine, policy=options.policy)
        if check_device:
            resolve_device(config.device)  # "cuda" without CUDA fails here, before the output is touched
    except (TypeError, ValueError) as e:
        raise JobInputError(f"invalid engine option: {e}{flag_hint(str(e))}") from e
    try:
        # The job-wide defaults apply to every row: a bad one is the command's error, not the rows'.
        SamplingParams(**options.sampling_defaults())
    except (TypeError, ValueError) as e:
        # The message names the field first ("temperature must be >= 0"); name its flag.
        fields = [f for f in options.sampling_defaults() if str(e).startswith(f"{f} ") or f"({f})" in str(e)]
        flag = f" (flag --{fields[0].replace('_', '-')})" if fields else ""
        raise JobInputError(f"invalid sampling option: {e}{flag}") from e
    return config


def job_reader(options: JobOptions) -> JobReader:
    """The job file's reader, with the job's columns, template, sampling defaults and limit."""
    return JobReader(
        options.input,
        ReaderOptions(
            prompt_column=options.prompt_column,
            messages_column=options.messages_column,
            id_column=options.id_column,
            template=options.template,
            keep_columns=tuple(options.keep_columns),
            defaults=options.sampling_defaults(),
            limit=options.limit,
        ),
    )


def run_job(
    options: JobOptions,
    engine_factory: Callable[[EngineConfig], Engine] | None = None,
    dashboard: Any = None,
    loop: Callable[..., tuple[int, bool]] | None = None,
) -> JobSummary:
    """Run one job to completion, or until SIGINT.

    Args:
        options: the job (see JobOptions).
        engine_factory: EngineConfig -> an `Engine` (the protocol); the default builds LLMEngine.
        dashboard: a `batchgen.dashboard.Dashboard` (default: one chosen from `options.dashboard`).
        loop: what runs the rows, with `_loop`'s arguments and result (default `_loop`: one engine
            here); `batchgen.distributed` passes its own, whose "engine" is a pool of replicas.

    Returns:
        JobSummary; `interrupted` is True when SIGINT or SIGTERM stopped the run (committed rows are
        kept; `stop_signal` says which).

    Raises:
        JobInputError: before any model work, for a bad input, schema, output location or a resume
            whose header changed (the CLI exits with code 2).
    """
    start = time.perf_counter()
    config = check_run_options(options, check_device=loop is None)
    reader = job_reader(options)
    output = options.output or default_output_path(options.input, reader.format)
    check_output_path(output, options.input)
    fmt = output_format(output, reader.format)
    header = job_header(options, reader, fmt)
    if options.strict:
        validate_job(reader)
    state = prepare_output(output, header, options.overwrite)
    if state.complete:
        return _finished_summary(output, fmt, reader)
    metrics: JobMetrics | NullMetrics = NullMetrics()
    try:
        total = reader.count_rows()
        if dashboard is None:
            from batchgen.dashboard import Dashboard

            dashboard = Dashboard(total, live=options.dashboard, interval=options.progress_interval)
        summary = JobSummary(output, total or 0, rows_resumed=len(state.committed))
        if len(state.committed):
            dashboard.log(f"resuming: {len(state.committed)} rows already committed in {state.parts_dir}")
            dashboard.update(summary.rows_done, 0, None, None)  # progress starts from what is committed
        # An empty input, or one whose rows were all committed before a crash stopped the final
        # write, needs no model: loading one (a GGUF conversion on first use) would be wasted time.
        nothing_left = total is not None and len(state.committed) >= total
        try:
            # Before the model loads: a metrics port in use stops the command with nothing started.
            metrics = JobMetrics.open(options.metrics)
            engine = None if nothing_left else (engine_factory or default_engine_factory)(config)
        except BaseException:
            state.discard_if_unused()
            raise
        if options.overwrite and remove_earlier_output(output):
            dashboard.log(f"--overwrite: removed the earlier output {output}; this run writes it anew")
        writer = PartWriter(state, tuple(options.keep_columns), options.commit_rows, options.commit_seconds)
        model_name = (engine and engine.model_name) or os.path.basename(_model_label(options).rstrip("/"))
        metrics.bind(model_name, total, writer.committed_rows)
        if metrics.url:
            dashboard.log(f"metrics at {metrics.url}")
        with _Interrupt() as interrupt:
            dashboard.start()
            if engine is not None and engine.start_line:
                dashboard.log(engine.start_line)
            try:
                if engine is None:
                    rows_read, finished = total or 0, True
                else:
                    rows_read, finished = (loop or _loop)(
                        options,
                        config,
                        engine,
                        reader,
                        state,
                        writer,
                        dashboard,
                        summary,
                        interrupt,
                        metrics,
                    )
                summary.interrupted = not finished
                summary.stop_signal = interrupt.signum if summary.interrupted else None
            except BaseException:
                # Rows that finished are kept whatever stopped the loop; a failure to write them
                # (say the output folder is gone) must not hide the error that stopped it.
                with contextlib.suppress(OSError), interrupt.shielded():
                    writer.commit()
                dashboard.stop()
                raise
            with interrupt.shielded():
                writer.commit()
            metrics.on_rows(writer.committed_rows, summary.rows_error, idle=True)
            dashboard.stop()
        if not summary.interrupted:
            summary.rows_total = rows_read
            finalize_output(state, rows_read, fmt, header, tuple(options.keep_columns), model_name)
            summary.complete = True
            summary.output_error_rows = summary.rows_error
            if summary.rows_resumed:  # the earlier runs' error rows are in the output too
                with contextlib.suppress(OSError, ValueError, pa.ArrowException):
                    summary.output_error_rows = count_output_errors(output, fmt)[1]
        summary.wall_s = time.perf_counter() - start
        if summary.interrupted:
            dashboard.log(
                f"interrupted: {writer.committed_rows} of {summary.rows_total or '?'} rows committed in "
                f"{state.parts_dir}. Resume with:\n  {options.resume_command or 'the same command'}"
            )
        dashboard.print_summary(summary)
        return summary
    finally:
        metrics.close()  # the file's last write holds the final counts
        state.release()


def _loop(
    options: JobOptions,
    config: EngineConfig,
    engine: Engine,
    reader: JobReader,
    state: Any,
    writer: PartWriter,
    dashboard: Any,
    summary: JobSummary,
    interrupt: _Interrupt,
    metrics: JobMetrics | NullMetrics | None = None,
) -> tuple[int, bool]:
    """The admission / step / commit loop; returns (input rows read, whether every row finished)."""
    tokenizer = engine.tokenizer
    chat = options.chat_template and bool(getattr(tokenizer, "chat_template", None))
    bos = getattr(tokenizer, "bos_token_id", None)
    token_bytes = TokenBytes(tokenizer)
    max_len: int = engine.max_model_len
    inflight_limit = max(2 * config.max_num_seqs, 8)
    window: LookaheadWindow[Prepared] = LookaheadWindow(options.policy, options.window)
    pending: dict[str, Prepared] = {}
    rows = iter(reader)
    rows_read = 0
    exhausted = False
    metrics = metrics or NullMetrics()

    def finish(result: dict[str, Any], keep: dict[str, Any] | None) -> None:
        writer.add(result, keep)
        if result["finish_reason"] == "error":
            summary.rows_error += 1  # its prompt (often a too-long one) never ran: not counted
            summary.first_error = summary.first_error or result.get("error")
        else:
            summary.rows_ok += 1
            summary.prompt_tokens += result.get("prompt_tokens") or 0
            summary.completion_tokens += result.get("completion_tokens") or 0
        if writer.due():
            writer.commit()

    while not interrupt.requested:
        while not exhausted and not window.full and not interrupt.requested:
            row = next(rows, None)
            while reader.parser.notices:  # e.g. a column name one typo away from a sampling field
                dashboard.log(reader.parser.notices.pop(0))
            if row is None:
                exhausted = True
                break
            rows_read = row.row_index + 1
            if state.committed.is_committed(row.row_index, row.row_hash, row.where):
                continue
            if row.error is not None:
                finish(error_result(row, row.error), row.keep)
                continue
            prepared, error = prepare_row(row, engine, options, chat, bos, max_len)
            if error is not None:
                finish(error_result(row, error, prepared and prepared.prompt_tokens), row.keep)
                continue
            sp = row.sampling_params
            work = prepared.prompt_tokens + sp.n * (sp.max_tokens or max_len - prepared.prompt_tokens)
            window.push(prepared, work=work, priority=sp.priority)
        while window and engine.num_unfinished_requests() < inflight_limit and not interrupt.requested:
            p = window.pop()
            rid = str(p.row.row_index)
            engine.add_request(rid, {"prompt_token_ids": p.token_ids}, p.row.sampling_params)
            p.token_ids = None  # the engine holds them now
            pending[rid] = p
        if engine.has_unfinished_requests():
            for out in engine.step():
                metrics.on_request(out)
                p = pending.pop(out.request_id)
                finish(output_result(p, out, token_bytes), p.row.keep)
            metrics.on_step(getattr(engine, "last_step", None), getattr(engine, "totals", None))
        elif exhausted and not window:
            break
        dashboard.update(
            summary.rows_done,
            summary.rows_error,
            engine.last_step,
            engine.totals,
        )
        metrics.on_rows(writer.committed_rows, summary.rows_error)
    finished = exhausted and not window and not pending
    if not finished:
        for rid in pending:
            engine.abort_request(rid)
    return rows_read, finished
