"""The signals that stop a run with its finished rows committed, in one place for the job loop
(`batchgen.jobs.runner`), the `run` command (`batchgen.cli`) and the process (`batchgen.__main__`).

SIGINT is Ctrl-C; SIGTERM is what `timeout`, `docker stop`, systemd and Slurm send; SIGHUP is what
a closed terminal sends (absent on Windows). Imports nothing heavy: the command's start-up reads it.
"""

from __future__ import annotations

import signal

STOP_SIGNALS: tuple[signal.Signals, ...] = tuple(
    s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None
)
