"""The manifest of a run's parts directory, and the rows it says are committed.

`manifest.jsonl`: line 1 `{"header": {...}}`, then one `{"part", "rows", "min_row", "max_row"}` line
per committed part, appended and fsynced after the part's atomic rename (the commit point). See
`batchgen.jobs.output.resume` for how a run starts from it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchgen.cache import fsync_path
from batchgen.jobs.errors import JobInputError

MANIFEST = "manifest.jsonl"


@dataclass(slots=True)
class PartEntry:
    """One committed part: file name, row count and row-index range (inclusive)."""

    part: str
    rows: int
    min_row: int
    max_row: int


class Manifest:
    """Append-only, fsynced record of a run's header and committed parts.

    Args:
        parts_dir: the run's parts directory (see `parts_dir_for`).
    """

    def __init__(self, parts_dir: str) -> None:
        self.parts_dir = parts_dir
        self.path = os.path.join(parts_dir, MANIFEST)

    @classmethod
    def create(cls, parts_dir: str, header: dict[str, Any]) -> Manifest:
        """Make `parts_dir` and write a manifest holding only `header` (atomically)."""
        os.makedirs(parts_dir, exist_ok=True)
        m = cls(parts_dir)
        tmp = m.path + ".tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps({"header": header}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, m.path)
        fsync_path(parts_dir)
        fsync_path(os.path.dirname(os.path.abspath(parts_dir)))
        return m

    def load(self) -> tuple[dict[str, Any], list[PartEntry]]:
        """Read the header and part entries; a torn (unterminated) last line is cut off.

        Raises:
            JobInputError: the manifest has no readable header, or a line after it is not a part
                entry (the parts directory is damaged).
        """
        with open(self.path, "rb") as f:
            data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # a crash mid-append: drop the partial line
            with open(self.path, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
        lines = data[:end].splitlines()
        try:
            header = json.loads(lines[0])["header"]
        except (IndexError, KeyError, ValueError) as e:
            raise JobInputError(f"{self.path} has no valid header; pass --overwrite to start over") from e
        entries = []
        for number, line in enumerate(lines[1:], start=2):
            if not line.strip():
                continue
            try:
                entries.append(PartEntry(**json.loads(line)))
            except (TypeError, ValueError) as e:  # not JSON, or not a part entry's fields
                raise JobInputError(
                    f"{self.path} line {number} is not a part entry, so the parts directory is damaged; "
                    "pass --overwrite to start over"
                ) from e
        return header, entries

    def append(self, entry: PartEntry) -> None:
        """Append one part entry and fsync it (the commit point of that part's rows)."""
        line = json.dumps(
            {"part": entry.part, "rows": entry.rows, "min_row": entry.min_row, "max_row": entry.max_row}
        )
        with open(self.path, "ab") as f:
            f.write(line.encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())


class CommittedRows:
    """Row indices and hashes already committed, as sorted int64 arrays (16 bytes a row).

    `is_committed` is called with increasing row indices (the reader's order) and walks forward,
    so a check is O(1) amortized and no per-row Python object is kept.
    """

    def __init__(self, row_index: np.ndarray, row_hash: np.ndarray) -> None:
        order = np.argsort(row_index, kind="stable")
        self.row_index = row_index[order]
        self.row_hash = row_hash[order]
        if len(self.row_index) > 1 and np.any(self.row_index[1:] == self.row_index[:-1]):
            raise JobInputError(
                "committed parts hold a row twice; the parts directory is corrupt, pass --overwrite"
            )
        self._pos = 0

    def __len__(self) -> int:
        return len(self.row_index)

    def is_committed(self, row_index: int, row_hash: int, where: str = "") -> bool:
        """True when the row was committed by an earlier run (row indices must come in increasing order).

        Raises:
            JobInputError: the committed row has another hash, i.e. the input changed underneath.
        """
        idx = self.row_index
        while self._pos < len(idx) and idx[self._pos] < row_index:
            self._pos += 1
        if self._pos < len(idx) and idx[self._pos] == row_index:
            if int(self.row_hash[self._pos]) != row_hash:
                raise JobInputError(
                    f"{where or f'row {row_index}'} differs from the committed result of an earlier run "
                    "(the input or its parameters changed); pass --overwrite to start over"
                )
            return True
        return False
