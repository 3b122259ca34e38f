"""How `batchgen run` runs a job and ends: the signal handling around `run_job` (or the Ray
driver), the messages of a failed or interrupted run, `--summary-json`, and the exit code (listed in
`batchgen.cli`'s docstring)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import sys
from typing import TYPE_CHECKING

import typer

from batchgen.stop_signals import STOP_SIGNALS, handled_stop_signals

if TYPE_CHECKING:
    from batchgen.distributed.pool import ReplicaOptions
    from batchgen.jobs.options import JobOptions, JobSummary


def resume_command(args: list[str]) -> str:
    """The command that resumes this run, shell-quoted: the program as the user started it
    (`_program`), then `args` (the command's arguments) without `--overwrite`, which would
    discard the committed rows the resumed run is to keep."""
    return shlex.join([*_program(), *(a for a in args if a != "--overwrite")])


def _program() -> list[str]:
    """How the user started batchgen: the interpreter and `-m batchgen` as typed (`sys.orig_argv`)
    when it runs as a module; else `sys.argv[0]` as given (`.venv/bin/batchgen`), or the bare name
    where that name on PATH is this very file (the shell passes a PATH lookup's full path on)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name in ("batchgen", "batchgen.__main__"):  # python -m batchgen
        typed = list(getattr(sys, "orig_argv", ()))
        for i, arg in enumerate(typed):
            if arg == "-m" and typed[i + 1 : i + 2] in (["batchgen"], ["batchgen.__main__"]):
                return typed[: i + 2]
            if arg in ("-mbatchgen", "-mbatchgen.__main__"):
                return typed[: i + 1]
        return [sys.executable, "-m", "batchgen"]
    program = sys.argv[0]
    name = os.path.basename(program)
    found = shutil.which(name)
    try:
        if found and os.path.samefile(found, program):
            return [name]
    except OSError:  # argv[0] is no file (an embedding host's name): keep it as given
        pass
    return [program]


def run_and_exit(
    options: JobOptions, summary_json: str | None = None, scale_out: ReplicaOptions | None = None
) -> None:
    """`run_job` with the command's signal handling and exit codes. The process's handlers are
    restored on the way out, so an in-process caller (a test runner, say) does not inherit ignored
    signals, nor pass them on to the processes it starts; the `batchgen` command itself ignores
    them again until it exits (`batchgen.__main__.main`)."""
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    try:
        _run_with_stop_handlers(options, summary_json, scale_out)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def check_summary_json(path: str | None) -> None:
    """Refuse, before any work, a `--summary-json` path that cannot be written
    (`cli_types.output_file_problem`). Exits 2 with the path and the fix."""
    from pathlib import Path

    from batchgen.cli_types import output_file_problem

    problem = None if path is None else output_file_problem(Path(path))
    if problem is not None:
        typer.echo(f"error: --summary-json {path} {problem}", err=True)
        raise typer.Exit(2)


def write_summary_json(path: str, data: dict) -> bool:
    """`--summary-json`: `data` (a run's outcome, `JobSummary.to_dict`, or a plan) as JSON, written
    atomically. A failure to write it is reported and returned (False), not raised: the rows are
    committed whatever happens to the summary."""
    import json
    from pathlib import Path

    from batchgen.cache import write_atomically

    try:
        write_atomically(Path(path), (json.dumps(data, indent=1) + "\n").encode())
    except OSError as e:
        typer.echo(f"error: --summary-json {path} could not be written: {e}", err=True)
        return False
    return True


def _exit_code(summary: JobSummary) -> int:
    """`batchgen run`'s exit code for a run that returned (see the module docstring)."""
    if summary.interrupted:  # the shell's convention: 128 + the signal (130 for Ctrl-C, 143 for SIGTERM)
        return 128 + (summary.stop_signal or signal.SIGINT)
    return 3 if summary.every_row_failed else 0


def _run_with_stop_handlers(
    options: JobOptions, summary_json: str | None = None, scale_out: ReplicaOptions | None = None
) -> None:
    summary = _run_reporting_errors(options, scale_out)
    # Everything is committed (or the run stopped cleanly): a Ctrl-C or SIGTERM from here to the end
    # of the process has nothing left to stop, and must not kill it with a KeyboardInterrupt traceback.
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    summary_written = summary_json is None or write_summary_json(
        summary_json, summary.to_dict(_exit_code(summary))
    )
    if summary.already_complete:
        errors = (
            f", {summary.rows_error} of its {summary.rows_done} rows are error rows"
            if summary.rows_error
            else ""
        )
        typer.echo(
            f"{summary.output_path} is already complete (same input and settings){errors}; --overwrite redoes it"
        )
    if summary.interrupted:
        raise typer.Exit(_exit_code(summary))
    if summary.every_row_failed:
        # A script that checks the exit code must not take an output of nothing but errors for a
        # finished job; the rows stay recorded, so a fixed command reruns with --overwrite.
        typer.echo(
            f"error: every one of the {summary.rows_error} rows failed; the first: {summary.first_error}\n"
            "The error rows are in the output. Fix the cause, then rerun with --overwrite",
            err=True,
        )
        raise typer.Exit(3)
    if not summary_written:  # the rows are done, but a script reading the summary would find none
        raise typer.Exit(1)


def _run_reporting_errors(options: JobOptions, scale_out: ReplicaOptions | None) -> JobSummary:
    """The job, here or on Ray replicas; a failure ends the command with its message and exit code
    (2 bad input, 1 the output could not be written, 128 + the signal that stopped it)."""
    from batchgen.jobs.errors import JobInputError
    from batchgen.jobs.runner import run_job

    last_signal: list[int] = [signal.SIGINT]

    def stop_on_sigterm(signum: int, frame: object) -> None:
        # Outside the job loop (model loading, the final assembly) SIGTERM stops the run as Ctrl-C
        # does, instead of killing it without a word; inside it, `run_job` handles both itself.
        last_signal[0] = signum
        raise KeyboardInterrupt

    for s in handled_stop_signals():  # SIGINT keeps Python's KeyboardInterrupt, and its exit code 130
        if s != signal.SIGINT:
            signal.signal(s, stop_on_sigterm)
    try:
        if scale_out is None:
            return run_job(options)
        from batchgen.distributed import run_distributed

        return run_distributed(options, scale_out)
    except JobInputError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    except OSError as e:  # the disk, not the input: the output folder vanished, the disk filled up
        folder = os.path.dirname(e.filename) if isinstance(e.filename, str) else None
        if folder and not os.path.isdir(folder):  # the rows committed there went with it
            kept = (
                f"The folder {folder} is gone, and with it the rows committed there; fix the cause and rerun"
            )
        else:
            kept = "Rows committed before this are kept; fix the cause and resume"
        typer.echo(
            f"error: cannot write the job's output: {e}. {kept} with:\n  {options.resume_command}", err=True
        )
        raise typer.Exit(1) from None
    except KeyboardInterrupt:  # a second Ctrl-C, one during model loading, or SIGTERM: rows are kept
        typer.echo(
            f"interrupted; committed rows are kept. Resume with:\n  {options.resume_command}", err=True
        )
        raise typer.Exit(128 + last_signal[0]) from None
