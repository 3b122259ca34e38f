"""Where batchgen keeps what it builds once per machine (converted models, compiled CPU kernels), and how
it writes there."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_root() -> Path:
    """batchgen's cache folder (not created here).

    `$BATCHGEN_CACHE`, else `$XDG_CACHE_HOME/batchgen`, else `~/.cache/batchgen`; where there is no
    home directory either (a container run as an arbitrary uid), a per-user folder in the system's
    temporary directory. Everything in it can be deleted: it is rebuilt on the next start.
    """
    if env := os.environ.get("BATCHGEN_CACHE"):
        return Path(env).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "batchgen"
    try:
        return Path.home() / ".cache" / "batchgen"
    except RuntimeError:  # no $HOME and no passwd entry
        return Path(tempfile.gettempdir()) / f"batchgen-{getattr(os, 'getuid', lambda: 'user')()}"


def write_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a synced temporary file in the same folder and an atomic rename.

    Concurrent writers and crashes leave either the old file or the whole new one, never a part.

    Raises:
        OSError: the folder is missing or not writable (the temporary file is removed).
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
