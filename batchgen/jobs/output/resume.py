"""Lock and start (the run header: `jobs.header`): what makes a job resumable exactly once (the manifest: `jobs.manifest`).

Beside the output `out.parquet` a run keeps `out.parquet.parts/`:
    manifest.jsonl   line 1: {"header": {...}}; then one {"part": name, "rows", "min_row", "max_row"}
                     line per committed part, appended and fsynced after the part's atomic rename.
    part-000000.parquet ...  committed rows, each part sorted by row_index.
    lock             flock'ed by the live run, so two runs never write one output.
The manifest is the truth: a part file it does not name (a crash between rename and append) is
deleted and its rows are generated again; a torn last manifest line is dropped.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from batchgen.cache import fsync_path, write_atomically
from batchgen.jobs.errors import JobInputError
from batchgen.jobs.output.header import header_differences
from batchgen.jobs.output.manifest import MANIFEST, CommittedRows, Manifest, PartEntry

LOCK = "lock"
HEADER_METADATA_KEY = b"batchgen.header"
# The rows a finished Parquet output was written with: tools that rewrite a file keep its metadata,
# so the header alone would vouch for a file filtered in place.
NUM_ROWS_METADATA_KEY = b"batchgen.num_rows"


def parts_dir_for(output_path: str) -> str:
    """Directory of the committed parts of `output_path`."""
    return output_path + ".parts"


@dataclass
class ResumeState:
    """Where a run starts: its manifest, committed parts and rows, and whether the output is already done."""

    output_path: str
    parts_dir: str
    manifest: Manifest | None
    entries: list[PartEntry]
    committed: CommittedRows
    complete: bool = False
    lock_fd: int | None = None
    fresh: bool = False  # this run created the parts directory (new job or --overwrite)

    def release(self) -> None:
        """Release the run's lock on the parts directory."""
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None

    def discard_if_unused(self) -> None:
        """Delete the parts directory this run created when nothing was committed to it, so a run
        that could not start (say its engine options were refused) leaves the output as it found
        it: with `--overwrite`, a later run without it must still be refused over a finished
        output from other settings, not resume the overwrite that never began."""
        if self.fresh and not self.entries and self.lock_fd is not None and os.path.isdir(self.parts_dir):
            delete_parts_dir(self.parts_dir)


def header_sidecar_path(output_path: str) -> str:
    """Where a finished JSON-lines output keeps its run header (Parquet keeps it in its metadata):
    a hidden `.NAME.batchgen.json` beside the output."""
    folder, name = os.path.split(os.path.abspath(output_path))
    return os.path.join(folder, f".{name}.batchgen.json")


def write_header_sidecar(output_path: str, header: dict[str, Any]) -> None:
    """Record `header` for a finished JSON-lines output, with the output's size in bytes, so a rerun
    of the same job reports it complete (and an output changed since is not mistaken for ours)."""
    record = {"header": header, "output_bytes": os.path.getsize(output_path)}
    write_atomically(Path(header_sidecar_path(output_path)), json.dumps(record).encode())


def remove_earlier_output(output_path: str) -> bool:
    """Delete a finished output that `--overwrite` replaces (and its JSON-lines sidecar), durably;
    returns whether there was one. Called once the new run has its engine: from then on, an
    interrupted run must not leave the old job's complete output beside the new run's parts, where
    it would pass for this run's result."""
    removed = False
    for path in (output_path, header_sidecar_path(output_path)):
        if os.path.isfile(path) or os.path.islink(path):
            os.remove(path)
            removed = removed or path == output_path
    if removed:
        fsync_path(os.path.dirname(os.path.abspath(output_path)))
    return removed


def _existing_output_header(output_path: str) -> dict[str, Any] | None:
    """The header of a finished output of ours: from the metadata of a Parquet output that still has
    its rows, else from the sidecar of a JSON-lines output whose size still matches; None for any
    other file."""
    try:
        import pyarrow.parquet as pq

        parquet = pq.read_metadata(output_path)
        meta = parquet.schema.to_arrow_schema().metadata or {}
        if HEADER_METADATA_KEY not in meta:
            return None
        if NUM_ROWS_METADATA_KEY in meta and int(meta[NUM_ROWS_METADATA_KEY]) != parquet.num_rows:
            return None  # rows were added or removed since
        return json.loads(meta[HEADER_METADATA_KEY])
    except Exception:  # pyarrow raises several types for a file that is not Parquet
        pass
    try:
        with open(header_sidecar_path(output_path), "rb") as f:
            record = json.load(f)
        if record.get("output_bytes") == os.path.getsize(output_path):
            return record["header"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def _lock(parts_dir: str) -> int:
    fd = os.open(os.path.join(parts_dir, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as e:
        os.close(fd)
        raise JobInputError(
            f"another batchgen run is writing {parts_dir}; wait for it or use another --output"
        ) from e
    return fd


def check_output_location(output_path: str) -> None:
    """Refuse an output whose folder is missing or not writable, or that is a folder or read-only.

    Raises:
        JobInputError: naming the path and the fix.
    """
    out_dir = os.path.dirname(os.path.abspath(output_path))
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise JobInputError(
            f"--output {output_path}: {out_dir} is a file, not a directory; pass another --output"
        )
    if not os.path.isdir(out_dir):
        raise JobInputError(f"output directory {out_dir} does not exist; create it or pass another --output")
    if os.path.isdir(output_path):
        raise JobInputError(f"--output {output_path} is a directory; give a file path")
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise JobInputError(f"output directory {out_dir} is not writable; pass a writable --output")
    if os.path.exists(output_path) and not os.access(output_path, os.W_OK):
        raise JobInputError(f"output {output_path} is not writable; pass another --output")


def prepare_output(output_path: str, header: dict[str, Any], overwrite: bool) -> ResumeState:
    """Check the output location and resume state before any model work.

    - `overwrite`: earlier parts are deleted (an earlier final output is removed by the caller once
      the run has its engine, `remove_earlier_output`).
    - parts directory present: same header -> resume (orphan parts removed, committed rows loaded);
      another header -> refuse.
    - final output present without parts: same header (Parquet metadata) -> `complete`; else refuse.
    - otherwise a new parts directory and manifest are created.

    Raises:
        JobInputError: unwritable location, changed header, or an output that is not ours.
    """
    parts_dir = parts_dir_for(output_path)
    empty = CommittedRows(np.zeros(0, np.int64), np.zeros(0, np.int64))
    check_output_location(output_path)
    manifest_path = os.path.join(parts_dir, MANIFEST)
    if overwrite:
        return _start_fresh(output_path, parts_dir, header, empty)
    if os.path.exists(manifest_path):
        # The lock comes before the manifest is read: loading may truncate a torn last line, which
        # must not happen under a live run's append.
        lock_fd = _lock(parts_dir)
        try:
            return _resume(output_path, parts_dir, header, lock_fd, empty)
        except BaseException:
            os.close(lock_fd)
            raise
    if os.path.exists(output_path) and not overwrite:
        old = _existing_output_header(output_path)
        diffs = header_differences(old, header) if old is not None else []
        if old is not None and not diffs:
            if os.path.isdir(parts_dir):
                _remove_leftover_parts(parts_dir)
            return ResumeState(output_path, parts_dir, None, [], empty, complete=True)
        raise JobInputError(
            f"output {output_path} already exists"
            + (
                f" from a run with other settings ({'; '.join(diffs)})"
                if old is not None
                else " and is not a finished batchgen output (another file, a damaged one, or one changed since)"
            )
            + ". Pass --overwrite to replace it, or choose another --output"
        )
    # No manifest: a new job, or a crash while the parts directory was being created.
    return _start_fresh(output_path, parts_dir, header, empty)


def delete_parts_dir(parts_dir: str) -> None:
    """Delete a parts directory with everything in it (its lock file included).

    The manifest goes first, durably: a kill part-way through leaves parts without a manifest,
    which a rerun treats as the leftovers of a finished job (the output is complete), never as a
    run to resume with parts missing.
    """
    manifest = os.path.join(parts_dir, MANIFEST)
    if os.path.exists(manifest):
        os.remove(manifest)
        fsync_path(parts_dir)
    for name in os.listdir(parts_dir):
        os.remove(os.path.join(parts_dir, name))
    os.rmdir(parts_dir)
    fsync_path(os.path.dirname(os.path.abspath(parts_dir)))


def _remove_leftover_parts(parts_dir: str) -> None:
    """Delete what a finished job's cleanup left when it was killed (parts, no manifest), under the
    lock so that nothing a live run writes is touched."""
    lock_fd = _lock(parts_dir)
    try:
        delete_parts_dir(parts_dir)
    finally:
        os.close(lock_fd)


def _resume(
    output_path: str, parts_dir: str, header: dict[str, Any], lock_fd: int, empty: CommittedRows
) -> ResumeState:
    """Load the manifest and the committed rows of an interrupted run (the lock is held)."""
    manifest = Manifest(parts_dir)
    old, entries = manifest.load()
    diffs = header_differences(old, header)
    if diffs and not entries:
        # A run that stopped before committing a row (say its model failed to load) holds nothing
        # worth keeping, so its settings do not bind the next run.
        return _replace_empty_run(output_path, parts_dir, header, lock_fd, empty)
    if diffs:
        raise JobInputError(
            f"{output_path} has {sum(e.rows for e in entries)} committed rows from a run with other "
            f"settings ({'; '.join(diffs)}). Pass --overwrite to discard them and start over, "
            "or choose another --output"
        )
    keep = {MANIFEST, LOCK} | {e.part for e in entries}
    for name in os.listdir(parts_dir):
        if name not in keep:  # temp files and parts renamed but never recorded
            os.remove(os.path.join(parts_dir, name))
    import pyarrow.parquet as pq

    idx, hashes = [], []
    for e in entries:
        path = os.path.join(parts_dir, e.part)
        if not os.path.exists(path):
            raise JobInputError(f"committed part {path} is missing; pass --overwrite to start over")
        try:
            t = pq.read_table(path, columns=["row_index", "row_hash"])
        except Exception as e:  # pyarrow raises several types for a damaged file
            raise JobInputError(
                f"committed part {path} cannot be read ({e}); pass --overwrite to start over"
            ) from e
        idx.append(t.column("row_index").to_numpy())
        hashes.append(t.column("row_hash").to_numpy())
    committed = (
        CommittedRows(np.concatenate(idx).astype(np.int64), np.concatenate(hashes).astype(np.int64))
        if idx
        else empty
    )
    return ResumeState(output_path, parts_dir, manifest, entries, committed, lock_fd=lock_fd)


def _replace_empty_run(
    output_path: str, parts_dir: str, header: dict[str, Any], lock_fd: int, empty: CommittedRows
) -> ResumeState:
    """A parts directory without committed rows, from a run with other settings (the lock is held):
    beside a finished output of these settings it is removed and the output is complete; otherwise
    it starts over with this run's header."""
    finished = _existing_output_header(output_path) if os.path.exists(output_path) else None
    if finished is not None and not header_differences(finished, header):
        delete_parts_dir(parts_dir)
        return ResumeState(output_path, parts_dir, None, [], empty, complete=True, lock_fd=lock_fd)
    manifest = _new_manifest(parts_dir, header)
    return ResumeState(output_path, parts_dir, manifest, [], empty, lock_fd=lock_fd, fresh=True)


def _new_manifest(parts_dir: str, header: dict[str, Any]) -> Manifest:
    """Empty a parts directory whose lock is held (the lock file stays) and write a new manifest."""
    for name in os.listdir(parts_dir):
        if name != LOCK:
            os.remove(os.path.join(parts_dir, name))
    return Manifest.create(parts_dir, header)


def _start_fresh(
    output_path: str, parts_dir: str, header: dict[str, Any], empty: CommittedRows
) -> ResumeState:
    """Take the lock, then empty the parts directory and write a new manifest.

    The lock comes first so that a run started with `--overwrite` beside a live run is refused
    before it deletes anything the live run committed.
    """
    lock_fd = None
    try:
        os.makedirs(parts_dir, exist_ok=True)
        lock_fd = _lock(parts_dir)
        manifest = _new_manifest(parts_dir, header)
    except BaseException as e:
        if lock_fd is not None:
            os.close(lock_fd)
        if isinstance(e, OSError):
            raise JobInputError(
                f"cannot write the parts directory {parts_dir} beside --output {output_path}: "
                f"{e.strerror or e}; pass an --output in a writable directory"
            ) from e
        raise
    return ResumeState(output_path, parts_dir, manifest, [], empty, lock_fd=lock_fd, fresh=True)
