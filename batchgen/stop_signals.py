"""The signals that stop a run with its finished rows committed, in one place for the job loop
(`batchgen.jobs.runner`), the `run` command (`batchgen.cli`) and the process (`batchgen.__main__`).

SIGINT is Ctrl-C; SIGTERM is what `timeout`, `docker stop`, systemd and Slurm send; SIGHUP is what
a closed terminal sends (absent on Windows). A signal the process was started with ignored stays
ignored: `nohup` starts a command with SIGHUP ignored so that closing the terminal does not stop it,
and a shell script's `cmd &` starts it with SIGINT ignored (POSIX job control). Imports nothing
heavy: the command's start-up reads it.
"""

from __future__ import annotations

import signal

STOP_SIGNALS: tuple[signal.Signals, ...] = tuple(
    s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None
)


def handled_stop_signals() -> tuple[signal.Signals, ...]:
    """The `STOP_SIGNALS` not ignored now: the ones a run installs its handlers for. Called where a
    run installs them, before it does, so an ignore inherited from `nohup` or a script's background
    job is kept, as the shell's own commands keep it."""
    return tuple(s for s in STOP_SIGNALS if signal.getsignal(s) != signal.SIG_IGN)
