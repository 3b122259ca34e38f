"""llama.cpp's server as a process of the bench's: start `llama-server` on 127.0.0.1 at a free port,
wait until it is ready, talk JSON over HTTP to it, and stop it (`baselines.llamacpp` runs the
workload through it). Every connection goes to `HOST` through `http.client`, so no proxy setting
can send it elsewhere."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from batchgen.bench.baselines.processes import (
    BaselineRunError,
    BaselineUnavailable,
    kill_tree,
    log_tail,
    start_logged,
)

HOST = "127.0.0.1"
READY_TIMEOUT_S = 300.0  # loading a GGUF file and llama.cpp's own warm-up decode
_POLL_S = 0.2
DOCS = "docs/llamacpp.md"


class LlamaCppUnavailable(BaselineUnavailable):
    """llama.cpp cannot run here: no such server binary, or one that cannot be started (skipped)."""


class LlamaCppRunError(BaselineRunError):
    """llama-server started but failed, answered badly or ran past its time (failed)."""


def free_port() -> int:
    """A TCP port on `HOST` that nothing listens on now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def http_json(
    port: int, method: str, path: str, body: dict | None = None, timeout_s: float | None = None
) -> tuple[int, Any]:
    """One HTTP request to `HOST`:`port`; returns the status and the answer's JSON (None when it is
    not JSON). Raises OSError (and http.client.HTTPException) when the connection fails."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    try:
        return response.status, json.loads(raw)
    except ValueError:
        return response.status, None


@contextmanager
def running_server(
    command: list[str], port: int, ready_timeout_s: float = READY_TIMEOUT_S
) -> Iterator[tuple[psutil.Process, Path]]:
    """Start `command` (a llama-server listening on `port`), wait until `GET /health` answers 200,
    yield its process and log; stop it (SIGKILL, with anything it started) on the way out. The log
    (stdout and stderr) is deleted when the block ends without an error, and kept otherwise.

    Raises:
        LlamaCppUnavailable: the binary cannot be started.
        LlamaCppRunError: it exited, or did not answer within `ready_timeout_s` seconds.
    """
    log_fd, log_name = tempfile.mkstemp(prefix="batchgen-llama-server-", suffix=".log")
    log_path = Path(log_name)
    child = start_logged(
        command,
        log_fd,
        log_path,
        LlamaCppUnavailable,
        f"--llama-server {command[0]}",
        f"give the path of llama.cpp's llama-server binary (build: {DOCS})",
    )
    proc = psutil.Process(child.pid)
    ok = False
    try:
        _wait_ready(child, port, log_path, ready_timeout_s)
        yield proc, log_path
        ok = True
    finally:
        kill_tree(proc)
        child.wait()
        if ok:
            log_path.unlink(missing_ok=True)


def _wait_ready(child: subprocess.Popen, port: int, log_path: Path, timeout_s: float) -> None:
    """Poll `GET /health` until it answers 200 (503 while the model loads)."""
    started = time.monotonic()
    while True:
        if child.poll() is not None:
            last = (log_tail(log_path, 1) or ["(no output)"])[0].strip()
            raise LlamaCppRunError(
                f"llama-server exited with status {child.returncode} before it was ready (last line: "
                f"{last}); its log: {log_path}"
            )
        try:
            status, _ = http_json(port, "GET", "/health", timeout_s=5)
            if status == 200:
                return
        except (OSError, http.client.HTTPException):
            pass  # not listening yet
        if time.monotonic() - started > timeout_s:
            raise LlamaCppRunError(f"llama-server was not ready after {timeout_s:.0f} s; its log: {log_path}")
        time.sleep(_POLL_S)
