"""How a job stops on a signal: the first SIGINT / SIGTERM / SIGHUP asks the loop to stop, and
signals that arrive during a commit wait for it to end."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from batchgen.stop_signals import STOP_SIGNALS, handled_stop_signals


class Interrupt:
    """SIGINT, SIGTERM and SIGHUP handler: the first signal asks the loop to stop (finished rows are
    committed), a second goes to the handler that was there before (the CLI's, which records the
    signal for the exit code; Python's KeyboardInterrupt for SIGINT), else raises KeyboardInterrupt.
    SIGTERM is what `timeout`, `docker stop`, systemd and Slurm send, and SIGHUP what a closed
    terminal sends, so both are handled as Ctrl-C is; one the process was started with ignored
    (`nohup`'s SIGHUP) stays ignored. Inside `shielded()` (a commit) signals are only recorded, so
    a burst of Ctrl-C cannot stop a commit half-way and lose its rows."""

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

    def __enter__(self) -> Interrupt:
        if threading.current_thread() is threading.main_thread():  # signals only reach the main thread
            # A signal ignored since the process started (`nohup`: SIGHUP) stays ignored.
            handled = [s for s in handled_stop_signals() if s in self.SIGNALS]
            self._previous = {s: signal.signal(s, self._handle) for s in handled}
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
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

    def __exit__(self, *exc: object) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
