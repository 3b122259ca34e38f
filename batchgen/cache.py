"""Where batchgen keeps what it builds once per machine: converted models and compiled CPU kernels."""

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
