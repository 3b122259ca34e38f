"""Committed Parquet parts: where a job's finished rows are kept until the job is done.

Finished rows are buffered and committed as Parquet parts: written under a temporary name, fsynced,
renamed atomically, the directory fsynced, and only then recorded in the manifest. A crash at any
point loses at most the uncommitted rows. When every row is committed, `batchgen.jobs.output.final_output`
assembles the final file from the parts.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.cache import fsync_path
from batchgen.jobs.output.json_lines import as_text
from batchgen.jobs.output.manifest import Manifest, PartEntry
from batchgen.jobs.output.resume import (
    ResumeState,
)
from batchgen.jobs.output.schema import (
    INTERNAL_SCHEMA,
    OUTPUT_SCHEMA,
    REASONING_FIELD,
    logprob_fields,
    prompt_logprob_fields,
)

# Log-probability entries (a generated token or one of its alternatives) buffered before a commit
# is due whatever the row count: each is a small dict, a few hundred bytes of Python objects.
MAX_BUFFERED_LOGPROBS = 250_000


def _keep_array(values: list[Any]) -> pa.Array:
    """Arrow array of a kept input column; integers beyond int64 (uint64 ids and hashes) as uint64,
    and mixed-type values as text (`as_text`)."""
    try:
        return pa.array(values)
    except OverflowError:
        with contextlib.suppress(pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            return pa.array(values, pa.uint64())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        pass
    return pa.array([as_text(v) for v in values], pa.string())


class PartWriter:
    """Buffers finished rows and commits them as manifest-recorded Parquet parts.

    Args:
        state: the run's resume state (its manifest and entries are extended on each commit).
        keep_columns: input columns copied to the output, in order.
        commit_rows: commit when this many rows are buffered.
        commit_seconds: commit buffered rows at least this often (seconds).
    """

    def __init__(
        self,
        state: ResumeState,
        keep_columns: tuple[str, ...] = (),
        commit_rows: int = 1000,
        commit_seconds: float = 10.0,
    ) -> None:
        if state.manifest is None:
            raise ValueError("PartWriter needs a resume state with a manifest")
        self.state = state
        self.manifest: Manifest = state.manifest
        self.keep_columns = keep_columns
        self.commit_rows = commit_rows
        self.commit_seconds = commit_seconds
        self._logprob_fields = (
            logprob_fields(keep_columns) + prompt_logprob_fields(keep_columns) + [REASONING_FIELD]
        )
        self._names = OUTPUT_SCHEMA.names + INTERNAL_SCHEMA.names + [f.name for f in self._logprob_fields]
        self._buf: dict[str, list] = {}
        self._logprob_entries = 0
        self._reset()
        self._next_part = len(state.entries)
        self.committed_rows = sum(e.rows for e in state.entries)

    def _reset(self) -> None:
        self._buf = {n: [] for n in [*self._names, *self.keep_columns]}
        self._first_at: float | None = None
        self._logprob_entries = 0

    @property
    def pending(self) -> int:
        """Rows buffered, not yet committed."""
        return len(self._buf["row_index"])

    def add(self, row: dict[str, Any], keep: dict[str, Any] | None = None) -> None:
        """Buffer one finished row: `row` has the OUTPUT_SCHEMA, INTERNAL_SCHEMA, LOGPROB_SCHEMA and
        PROMPT_LOGPROBS_FIELD fields (missing ones are null); `keep` maps kept column names to their
        values."""
        for n in self._names:
            self._buf[n].append(row.get(n))
        if self._logprob_fields:
            positions = [p for c in [row, *(row.get("more_choices") or ())] for p in c.get("logprobs") or ()]
            for position in [*positions, *(row.get("prompt_logprobs") or ())]:
                if position is not None:  # a prompt's first token has none
                    self._logprob_entries += 1 + len(position["top_logprobs"])
        for c in self.keep_columns:
            self._buf[c].append(None if keep is None else keep.get(c))
        if self._first_at is None:
            self._first_at = time.monotonic()

    def due(self) -> bool:
        """True when the buffer should be committed (row count or age reached)."""
        n = self.pending
        if n >= self.commit_rows or self._logprob_entries >= MAX_BUFFERED_LOGPROBS:
            return True
        return (
            n > 0 and self._first_at is not None and time.monotonic() - self._first_at >= self.commit_seconds
        )

    def commit(self, name: str | None = None) -> PartEntry | None:
        """Write the buffered rows as one part (sorted by row_index) and record it; None if empty.
        `name` names the part (a shard's rows, `batchgen.distributed`); default "part-NNNNNN.parquet"."""
        if not self.pending:
            return None
        arrays = [pa.array(self._buf[f.name], f.type) for f in OUTPUT_SCHEMA]
        arrays += [pa.array(self._buf[f.name], f.type) for f in INTERNAL_SCHEMA]
        arrays += [pa.array(self._buf[f.name], f.type) for f in self._logprob_fields]
        arrays += [_keep_array(self._buf[c]) for c in self.keep_columns]
        table = pa.Table.from_arrays(arrays, names=[*self._names, *self.keep_columns]).sort_by("row_index")
        if name is None:
            names = {e.part for e in self.state.entries}
            while f"part-{self._next_part:06d}.parquet" in names:
                self._next_part += 1
            name = f"part-{self._next_part:06d}.parquet"
            self._next_part += 1
        final = os.path.join(self.state.parts_dir, name)
        tmp = os.path.join(self.state.parts_dir, f".tmp-{name}")
        with open(tmp, "wb") as f:
            pq.write_table(table, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_path(self.state.parts_dir)
        idx = table.column("row_index")
        entry = PartEntry(name, table.num_rows, pc.min(idx).as_py(), pc.max(idx).as_py())
        self.manifest.append(entry)
        self.state.entries.append(entry)
        self.committed_rows += entry.rows
        self._reset()
        return entry
