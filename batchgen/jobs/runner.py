"""run_job: a job file through the engine into committed parts and the final output.

Everything that can fail without a model is checked first (input, schema, output location, resume
header, `--strict` validation); then the engine is built (unless no row is left to run), rows
stream through the look-ahead window into it, finished rows are committed every `commit_rows` rows
or `commit_seconds` seconds, and the final file is written once every row is committed.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

import pyarrow as pa

from batchgen import progress
from batchgen.config import EngineConfig, resolve_device
from batchgen.engine.protocol import Engine
from batchgen.jobs.errors import JobInputError
from batchgen.jobs.input.reader import JobReader, ReaderOptions
from batchgen.jobs.interrupt import Interrupt
from batchgen.jobs.loop import JobRun, Progress, RunEngine, engine_loop
from batchgen.jobs.options import (
    JobOptions,
    JobSummary,
    check_job_options,
    check_output_path,
    flag_hint,
    output_format,
)
from batchgen.jobs.output.final_output import count_output_errors, finalize_output
from batchgen.jobs.output.header import make_header
from batchgen.jobs.output.header_options import canonical_options
from batchgen.jobs.output.resume import ResumeState, prepare_output, remove_earlier_output
from batchgen.jobs.output.writer import PartWriter
from batchgen.metrics import JobMetrics, NullMetrics
from batchgen.model.loading.fingerprint import model_fingerprint
from batchgen.sampling_params import SamplingParams


class RunDashboard(Progress, Protocol):
    """A run's dashboard (`batchgen.dashboard.Dashboard`): progress, shown while the loop runs."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def print_summary(self, summary: JobSummary, /) -> None: ...


E = TypeVar("E", bound=RunEngine)  # the engine the factory builds and the loop runs
R = TypeVar("R", bound=RunEngine | None)  # the same, or None when no row is left to run


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
    """Options that change the output rows (engine options that only change speed are left out),
    each in one form per meaning (`canonical_options`). The quantization only where it is not
    "auto", so a job written before the option resumes."""
    header = {
        "output_format": fmt,
        "prompt_column": reader.prompt_column,
        "messages_column": reader.messages_column,
        "id_column": reader.id_column,
        "template": options.template,
        "system_prompt": options.system_prompt,
        "chat_template": options.chat_template,
        "chat_template_kwargs": options.chat_template_kwargs,
        "reasoning_parser": options.engine.get("reasoning_parser"),
        "keep_columns": list(options.keep_columns),
        "limit": options.limit,
        "sampling": options.sampling_defaults(),
        "truncate_prompt": options.truncate_prompt,
        "dtype": options.engine.get("dtype", "auto"),
        "max_model_len": options.engine.get("max_model_len"),
    }
    if (quantization := options.engine.get("quantization", "auto")) != "auto":
        header["quantization"] = quantization
    return canonical_options(header, _model_label(options))


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
    _check_job_constraint(options)
    return config


def _check_job_constraint(options: JobOptions) -> None:
    """The job-wide constraint (`--json-schema`, `--regex`, `--choice`, `--grammar`) compiles in
    the library (its time limit aside): a bad one would fail every row, so it is the command's error.

    Raises:
        JobInputError: naming the flag, what is wrong and the fix.
    """
    default = options.sampling_defaults().get("structured_outputs")
    if default is None:
        return
    from batchgen.engine.structured_check import constraint_error
    from batchgen.jobs.input.row_structured import constraint_flag

    params = SamplingParams(structured_outputs=default).structured_outputs
    if params is None:
        return
    error = constraint_error(params, constraint_flag(default) or "structured_outputs")
    if error is not None:
        raise JobInputError(error)


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
            chat_template_kwargs=options.chat_template_kwargs,
        ),
    )


def run_job(
    options: JobOptions,
    engine_factory: Callable[[EngineConfig], E] | None = None,
    dashboard: RunDashboard | None = None,
    loop: Callable[[JobRun[E]], tuple[int, bool]] | None = None,
) -> JobSummary:
    """Run one job to completion, or until SIGINT.

    Args:
        options: the job (see JobOptions).
        engine_factory: EngineConfig -> an `Engine` (the protocol); the default builds LLMEngine.
        dashboard: a `batchgen.dashboard.Dashboard` (default: one chosen from `options.dashboard`).
        loop: what runs the rows of a `JobRun` of the factory's engine (default
            `batchgen.jobs.loop.engine_loop`: one engine here); `batchgen.distributed` passes its
            own with a factory whose "engine" is a pool of replicas.

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
    output = options.output_path(reader.format)
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
        dashboard = _default_dashboard(options, total) if dashboard is None else dashboard
        summary = JobSummary(output, total or 0, rows_resumed=len(state.committed))
        if len(state.committed):
            dashboard.log(f"resuming: {len(state.committed)} rows already committed in {state.parts_dir}")
            dashboard.update(summary.rows_done, 0, None, None)  # progress starts from what is committed
        # An input whose rows were all committed before a crash stopped the final write needs no
        # model (an empty one stopped in JobReader): loading one (a GGUF conversion on first use) would be wasted time.
        nothing_left = total is not None and len(state.committed) >= total
        try:
            # Before the model loads: a metrics port in use stops the command with nothing started.
            metrics = JobMetrics.open(options.metrics)
            if not nothing_left:
                dashboard.log(_loading_line(options))
            engine = None if nothing_left else _start_engine(engine_factory, config, dashboard)
        except BaseException:
            state.discard_if_unused()
            raise
        if options.overwrite and remove_earlier_output(output):
            dashboard.log(f"--overwrite: removed the earlier output {output}; this run writes it anew")
        writer = PartWriter(state, tuple(options.keep_columns), options.commit_rows, options.commit_seconds)
        model_name = (engine and engine.model_name) or os.path.basename(_model_label(options).rstrip("/"))
        metrics.bind(model_name, total, writer.committed_rows, _model_info(engine))
        if metrics.url:
            dashboard.log(f"metrics at {metrics.url}")
        common = (reader, state, writer, dashboard, summary, Interrupt(), metrics)
        if engine is None:
            rows_read = _run_rows(_nothing_to_run(total), JobRun(options, config, None, *common), dashboard)
        else:  # the default loop runs the default factory's engine (the two are a pair)
            run_rows = loop or cast(Callable[[JobRun[E]], tuple[int, bool]], engine_loop)
            rows_read = _run_rows(run_rows, JobRun(options, config, engine, *common), dashboard)
        if not summary.interrupted:
            _finish_output(state, rows_read, fmt, header, options, model_name, summary)
        summary.wall_s = time.perf_counter() - start
        if summary.interrupted:
            dashboard.log(_interrupted_line(summary, writer.committed_rows, state.parts_dir, options))
        dashboard.print_summary(summary)
        return summary
    finally:
        metrics.close()  # the file's last write holds the final counts
        state.release()


def _nothing_to_run(total: int | None) -> Callable[[JobRun[None]], tuple[int, bool]]:
    """The loop of a job whose every row is committed already: it reads nothing and is finished."""
    return lambda run: (total or 0, True)


def _interrupted_line(summary: JobSummary, committed_rows: int, parts_dir: str, options: JobOptions) -> str:
    return (
        f"interrupted: {committed_rows} of {summary.rows_total or '?'} rows committed in "
        f"{parts_dir}. Resume with:\n  {options.resume_command or 'the same command'}"
    )


def _loading_line(options: JobOptions) -> str:
    """Said before the model loads; a GGUF conversion or a kernel measurement says so when it
    happens (`batchgen.progress` notes, shown by `_start_engine`)."""
    label = _model_label(options)
    return f"[batchgen] loading {'the default model' if label == 'default' else label}"


def _model_info(engine: object) -> dict[str, str] | None:
    """The engine's dtype and quantization method for the metrics' `model_info` series; None
    without an engine or where it does not hold the model itself (a Ray replica set's driver)."""
    dtype = getattr(engine, "dtype", None)
    quantization = getattr(getattr(engine, "runner", None), "quantization", None)
    if dtype is None or quantization is None:
        return None
    return {"dtype": str(dtype).removeprefix("torch."), "quantization": quantization.method}


def _start_engine(
    factory: Callable[[EngineConfig], E] | None, config: EngineConfig, dashboard: Progress
) -> E:
    """`factory(config)` (`default_engine_factory` when None), with the progress notes of its start
    (a one-time GGUF conversion, kernel measuring) shown on the dashboard as they happen."""
    with progress.shown(lambda note: dashboard.log(f"[batchgen] {note}")):
        # The default factory's LLMEngine is an `Engine`, what the default loop runs.
        return (factory or cast(Callable[[EngineConfig], E], default_engine_factory))(config)


def _default_dashboard(options: JobOptions, total: int | None) -> RunDashboard:
    """The Rich live view on a terminal (unless `--no-dashboard`), else periodic progress lines."""
    from batchgen.dashboard import Dashboard

    return Dashboard(total, live=options.dashboard, interval=options.progress_interval)


def _run_rows(loop: Callable[[JobRun[R]], tuple[int, bool]], run: JobRun[R], dashboard: RunDashboard) -> int:
    """`loop` under the job's signal handling (`run.interrupt`), with the dashboard (`run.dashboard`)
    running; the rows finished are committed whatever stopped it. Returns the input rows read;
    `summary.interrupted` (and `stop_signal`) say whether a signal stopped it."""
    summary, writer = run.summary, run.writer
    with run.interrupt as interrupt:
        dashboard.start()
        if run.engine is not None and run.engine.start_line:
            dashboard.log(run.engine.start_line)
        try:
            rows_read, finished = loop(run)
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
        run.metrics.on_rows(writer.committed_rows, summary.rows_error, idle=True)
        dashboard.stop()
    return rows_read


def _finish_output(
    state: ResumeState,
    rows_read: int,
    fmt: str,
    header: dict[str, Any],
    options: JobOptions,
    model_name: str,
    summary: JobSummary,
) -> None:
    """The final output from every committed part (`finalize_output`), and the summary's totals:
    the output's error rows include those of earlier runs."""
    summary.rows_total = rows_read
    finalize_output(state, rows_read, fmt, header, tuple(options.keep_columns), model_name)
    summary.complete = True
    summary.output_error_rows = summary.rows_error
    if summary.rows_resumed:  # the earlier runs' error rows are in the output too
        with contextlib.suppress(OSError, ValueError, pa.ArrowException):
            summary.output_error_rows = count_output_errors(summary.output_path, fmt)[1]
