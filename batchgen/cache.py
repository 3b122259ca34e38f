"""Where batchgen keeps what it builds once per machine (converted models, compiled CPU kernels), and how
it writes there."""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
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


def fsync_path(path: str | Path) -> None:
    """fsync a file, or a directory so that a rename or unlink inside it is durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a synced temporary file in the same folder and an atomic rename.

    Concurrent writers and crashes leave either the old file or the whole new one, never a part.

    Raises:
        OSError: the folder is missing or not writable (the temporary file is removed).
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        # mkstemp makes the file private (0o600); give it what open() would (0o666 less the umask),
        # so other users of a shared folder can read it as they read the files beside it.
        if hasattr(os, "fchmod"):
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def remove_stale_temporaries(folder: Path, max_age_s: float = 3600.0) -> None:
    """Delete the temporary files `write_atomically` left in `folder` when its process died
    mid-write (a killed first start leaves up to a whole cache file: 160 MB of the default model's
    int8 weights). Only files older than `max_age_s` go: a live writer's file is younger, as one
    write takes seconds. Files that cannot be removed are left."""
    now = time.time()
    for entry in folder.glob(".tmp-*"):
        try:
            if entry.is_file() and now - entry.stat().st_mtime > max_age_s:
                entry.unlink()
        except OSError:
            continue


def file_digest(path: Path, memo_dir: Path, salt: str = "") -> str:
    """SHA-256 (64 hex digits) of `salt` then the bytes of the file at `path`.

    The digest is remembered in `memo_dir` per resolved path, size and modification time, so a large
    file (a model's weights) is read once; an edited file has a new size or mtime
    and is read again. A memo folder that cannot be written only costs the reread.

    Raises:
        OSError: the file cannot be read.
    """
    resolved = path.resolve()
    stat = resolved.stat()
    identity = f"{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    memo = memo_dir / hashlib.sha256(salt.encode() + b"\0" + identity).hexdigest()[:24]
    try:
        digest = memo.read_text().strip()
    except OSError:
        digest = ""
    if len(digest) != 64:
        content = hashlib.sha256(salt.encode())
        with resolved.open("rb") as f:
            while chunk := f.read(1 << 24):
                content.update(chunk)
        digest = content.hexdigest()
        try:
            memo_dir.mkdir(parents=True, exist_ok=True)
            write_atomically(memo, digest.encode())
        except OSError:
            pass
    return digest
