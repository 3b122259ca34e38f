"""What the baselines that run in processes of their own (vLLM's child, llama.cpp's server) share:
their two kinds of failure, the check of the executable a flag names, and their processes' memory,
log and end."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import psutil

LOG_TAIL_LINES = 40


class BaselineUnavailable(RuntimeError):
    """The baseline cannot run here (no such program, not one that starts): the configuration is
    reported as skipped, and the bench goes on."""


class BaselineRunError(RuntimeError):
    """The baseline started but failed: the configuration is reported as failed, and the bench goes on."""


def executable_problem(path: str | Path) -> str | None:
    """What keeps `path` from being run ("does not exist", "is a folder", "is not executable"), or
    None when it names an executable file. Cheap: nothing is started."""
    path = Path(path).expanduser()
    if not path.exists():
        return "does not exist"
    if path.is_dir():
        return "is a folder"
    if not os.access(path, os.X_OK):
        return "is not executable"
    return None


def start_logged(
    command: list[str],
    log_fd: int,
    log_path: Path,
    unavailable: type[BaselineUnavailable],
    what: str,
    fix: str,
    **popen: Any,
) -> subprocess.Popen:
    """Start `command` with no stdin and its stdout and stderr in the log (`log_fd`, open for writing,
    closed here; at `log_path`); `popen` goes to `subprocess.Popen` (env, cwd).

    Raises:
        `unavailable`: it cannot be started (exec format error, permission denied), worded
            "{what} cannot be started (why); {fix}"; the log is deleted.
    """
    with os.fdopen(log_fd, "w") as log:
        try:
            return subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, **popen
            )
        except OSError as exc:
            log_path.unlink(missing_ok=True)
            raise unavailable(f"{what} cannot be started ({exc.strerror or exc}); {fix}") from exc


def tree_rss(proc: psutil.Process) -> int:
    """Resident bytes of `proc` and every descendant (0 for those that are gone)."""
    total = 0
    try:
        members = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    for p in members:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last `lines` non-blank lines of the log at `path` ([] when it cannot be read)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-lines:]


def kill_tree(proc: psutil.Process) -> None:
    """SIGKILL `proc` and its descendants (vLLM's engine core is a process of the child's own), and
    wait for them (10 s at most)."""
    try:
        members = [*proc.children(recursive=True), proc]
    except psutil.Error:
        members = [proc]
    for p in members:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(members, timeout=10)


class PeakRss:
    """Samples `tree_rss(proc)` every `interval_s` seconds on a thread of its own while open;
    `peak` holds the largest sample in bytes (0 before the first).

    Use as a context manager around the part to measure.
    """

    def __init__(self, proc: psutil.Process, interval_s: float = 0.1) -> None:
        self.proc = proc
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="batchgen-peak-rss", daemon=True)

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, tree_rss(self.proc))
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
