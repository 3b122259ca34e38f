"""The final output file, assembled from a job's committed parts once every row is committed.

The file (Parquet, JSONL, or OpenAI batch output JSONL) is assembled in input order a chunk of row
indices at a time (memory bounded by the chunk), written under a temporary name, fsynced and renamed;
then the parts are removed. A crash at any point leaves the parts, from which a rerun assembles the
file again.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.cache import fsync_path
from batchgen.jobs.output.json_lines import as_text, openai_record, to_json
from batchgen.jobs.output.resume import (
    HEADER_METADATA_KEY,
    NUM_ROWS_METADATA_KEY,
    ResumeState,
    delete_parts_dir,
    write_header_sidecar,
)
from batchgen.jobs.output.schema import (
    CHOICES_COLUMN,
    INTERNAL_SCHEMA,
    OUTPUT_SCHEMA,
    PROMPT_LOGPROBS_FIELD,
    REASONING_FIELD,
    OptionalColumns,
    choices_type,
    logprob_fields,
    prompt_logprob_fields,
)


def _some_row_holds(paths: list[str], column: str) -> bool:
    """Whether some committed part has a non-null `column` value (parts of older versions may lack
    the column)."""
    for path in paths:
        if column in pq.read_schema(path).names:
            values = pq.read_table(path, columns=[column])[column]
            if values.null_count < len(values):
                return True
    return False


def has_logprobs(paths: list[str], header: dict[str, Any]) -> bool:
    """Whether the final output gets the LOGPROB_SCHEMA columns: the command asked for log
    probabilities (`--logprobs`, in the run header) or some committed row holds them."""
    if header.get("options", {}).get("sampling", {}).get("logprobs") is not None:
        return True
    return _some_row_holds(paths, "cumulative_logprob")


def has_prompt_logprobs(paths: list[str], header: dict[str, Any]) -> bool:
    """Whether the final output gets the `prompt_logprobs` column: the command asked for them
    (`--prompt-logprobs`, in the run header) or some committed row holds them."""
    if header.get("options", {}).get("sampling", {}).get("prompt_logprobs") is not None:
        return True
    return _some_row_holds(paths, PROMPT_LOGPROBS_FIELD.name)


def has_choices(paths: list[str], header: dict[str, Any]) -> bool:
    """Whether the final Parquet or JSON-lines output gets the `choices` column: the command asked
    for n > 1 (`--n`, in the run header) or some committed row holds more than one completion."""
    if (header.get("options", {}).get("sampling", {}).get("n") or 1) > 1:
        return True
    return _some_row_holds(paths, "more_choices")


def has_reasoning(paths: list[str], header: dict[str, Any]) -> bool:
    """Whether the final output gets the `reasoning` column: the job has a reasoning parser
    (`--reasoning-parser`, in the run header) or some committed row holds a reasoning."""
    if header.get("options", {}).get("reasoning_parser") is not None:
        return True
    return _some_row_holds(paths, REASONING_FIELD.name)


def _choices_array(t: pa.Table, logprobs: bool, reasoning: bool = False) -> pa.Array:
    """The `choices` values of the rows of `t` (output columns and `more_choices`)."""
    names = ["output", "finish_reason", "completion_tokens", "more_choices"]
    names += ["cumulative_logprob", "logprobs"] if logprobs else []
    names += [REASONING_FIELD.name] if reasoning else []
    values: list[Any] = []
    for row in t.select(names).to_pylist():
        if row["finish_reason"] == "error":
            values.append(None)
            continue
        more = row["more_choices"] or []
        total = row["completion_tokens"] or 0
        # A row's completion_tokens counts all its completions (as OpenAI's usage does).
        first = {
            "output": row["output"],
            "finish_reason": row["finish_reason"],
            "completion_tokens": total - sum(c["completion_tokens"] or 0 for c in more),
        }
        if logprobs:
            first.update(cumulative_logprob=row["cumulative_logprob"], logprobs=row["logprobs"])
        if reasoning:
            first["reasoning"] = row["reasoning"]
        values.append([first, *more])
    return pa.array(values, choices_type(logprobs, reasoning))


def _unified_schema(
    paths: list[str], keep_columns: tuple[str, ...], columns: OptionalColumns = OptionalColumns()
) -> pa.Schema:
    """Output schema of the final file: OUTPUT_SCHEMA, the optional `columns`, then the kept
    columns with types unified across parts (a column whose parts disagree beyond null/int/float
    promotion becomes string)."""
    fields = list(OUTPUT_SCHEMA) + columns.fields()
    if not keep_columns:
        return pa.schema(fields)
    schemas = [pq.read_schema(p) for p in paths]
    for c in keep_columns:
        types = [s.field(c).type for s in schemas] or [pa.null()]
        try:
            unified = pa.unify_schemas([pa.schema([(c, t)]) for t in types], promote_options="permissive")
            t = unified.field(c).type
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            t = pa.string()
        fields.append(pa.field(c, pa.string() if pa.types.is_null(t) else t))
    return pa.schema(fields)


def _cast_column(col: pa.ChunkedArray, t: pa.DataType) -> pa.ChunkedArray:
    if col.type == t:
        return col
    try:
        return col.cast(t)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return pa.chunked_array([pa.array([as_text(v) for v in col.to_pylist()], t)])


def iter_ordered_chunks(
    state: ResumeState,
    total_rows: int,
    keep_columns: tuple[str, ...] = (),
    chunk_rows: int = 20000,
    columns: OptionalColumns = OptionalColumns(),
) -> Iterator[tuple[pa.Schema, pa.Table]]:
    """Yield (schema, table) chunks holding row indices [lo, lo + chunk_rows) in order, with the
    optional `columns` (`choices` built from each row's completions).

    Each chunk reads only the parts whose row range overlaps it, so memory is bounded by the chunk.

    Raises:
        RuntimeError: a row index is missing or present twice (an invariant violation).
    """
    paths = {e.part: os.path.join(state.parts_dir, e.part) for e in state.entries}
    schema = _unified_schema(list(paths.values()), keep_columns, columns)
    target = pa.schema([*schema, *INTERNAL_SCHEMA])
    # Parts written before a column existed (log probabilities, more_choices) get it as nulls; each
    # part's footer is read once here, not once per chunk its rows fall in.
    columns_of = {part: set(pq.read_schema(path).names) for part, path in paths.items()}
    for lo in range(0, total_rows, chunk_rows):
        hi = min(lo + chunk_rows, total_rows)
        tables = []
        for e in state.entries:
            if e.max_row >= lo and e.min_row < hi:
                present = columns_of[e.part]
                t = pq.read_table(paths[e.part], columns=[n for n in target.names if n in present])
                t = t.filter(pc.and_(pc.greater_equal(t["row_index"], lo), pc.less(t["row_index"], hi)))
                arrays = [
                    _cast_column(t[f.name], f.type) if f.name in present else pa.nulls(t.num_rows, f.type)
                    for f in target
                ]
                tables.append(pa.Table.from_arrays(arrays, schema=target))
        t = pa.concat_tables(tables).sort_by("row_index") if tables else target.empty_table()
        if not np.array_equal(t["row_index"].to_numpy(), np.arange(lo, hi)):
            raise RuntimeError(
                f"rows {lo}..{hi - 1}: {t.num_rows} committed rows instead of {hi - lo}; the parts directory "
                "is inconsistent, rerun with --overwrite"
            )
        if columns.choices:  # built from the row's output columns and more_choices, never stored in parts
            t = t.set_column(
                t.schema.get_field_index(CHOICES_COLUMN),
                CHOICES_COLUMN,
                _choices_array(t, columns.logprobs, columns.reasoning),
            )
        yield schema, t


def finalize_output(
    state: ResumeState,
    total_rows: int,
    output_format: str,
    header: dict[str, Any],
    keep_columns: tuple[str, ...] = (),
    model_name: str = "",
    chunk_rows: int = 20000,
) -> None:
    """Assemble the final output in input order, atomically, then remove the parts directory.

    Args:
        output_format: "parquet" (header kept in the schema metadata), "jsonl" (one output row a
            line) or "openai" (OpenAI batch output lines).
        model_name: `model` field of OpenAI output bodies.

    Raises:
        RuntimeError: committed rows do not cover 0..total_rows-1 exactly once.
    """
    out = state.output_path
    tmp = os.path.join(os.path.dirname(os.path.abspath(out)), f".{os.path.basename(out)}.tmp")
    paths = [os.path.join(state.parts_dir, e.part) for e in state.entries]
    columns = OptionalColumns(
        logprobs=bool(logprob_fields(keep_columns)) and has_logprobs(paths, header),
        prompt_logprobs=bool(prompt_logprob_fields(keep_columns)) and has_prompt_logprobs(paths, header),
        choices=output_format != "openai" and has_choices(paths, header),
        reasoning=has_reasoning(paths, header),
    )
    try:
        with open(tmp, "wb") as f:
            if output_format == "parquet":
                _write_parquet(f, state, total_rows, header, keep_columns, chunk_rows, columns)
            else:
                chunks = iter_ordered_chunks(state, total_rows, keep_columns, chunk_rows, columns)
                for schema, t in chunks:
                    names = schema.names
                    for row in t.to_pylist():
                        rec = (
                            openai_record(row, model_name)
                            if output_format == "openai"
                            else {n: row[n] for n in names}
                        )
                        f.write(to_json(rec).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        # The committed parts stay: a rerun assembles the output again.
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_path(os.path.dirname(os.path.abspath(out)))
    if output_format != "parquet":  # Parquet carries its header in its own metadata
        write_header_sidecar(out, header)
    remove_parts(state)


def _write_parquet(
    f: Any,
    state: ResumeState,
    total_rows: int,
    header: dict[str, Any],
    keep_columns: tuple[str, ...],
    chunk_rows: int,
    columns: OptionalColumns,
) -> None:
    """The final Parquet output into the open file `f`, the run header and row count in the schema
    metadata, with the optional `columns`."""
    meta = {HEADER_METADATA_KEY: json.dumps(header).encode(), NUM_ROWS_METADATA_KEY: str(total_rows).encode()}
    writer = None
    try:
        for schema, t in iter_ordered_chunks(state, total_rows, keep_columns, chunk_rows, columns):
            if writer is None:
                writer = pq.ParquetWriter(f, schema.with_metadata(meta))
            writer.write_table(t.select(schema.names).replace_schema_metadata(writer.schema.metadata))
        if writer is None:  # an empty job: an empty file with the schema
            schema = _unified_schema(
                [os.path.join(state.parts_dir, e.part) for e in state.entries],
                keep_columns,
                columns,
            )
            writer = pq.ParquetWriter(f, schema.with_metadata(meta))
    finally:
        if writer is not None:
            writer.close()


def remove_parts(state: ResumeState) -> None:
    """Delete the parts directory (after the final output is durable; `delete_parts_dir`) and
    release the lock."""
    if os.path.isdir(state.parts_dir):
        delete_parts_dir(state.parts_dir)
    state.release()


def count_output_errors(output_path: str, output_format: str) -> tuple[int, int, str | None]:
    """Rows, error rows and the first error message of a finished output, so that the rerun of a
    finished job reports its error rows as the run that wrote it did.

    Reads only the `finish_reason` and `error` columns of Parquet; JSONL lines one at a time.

    Raises:
        OSError, pyarrow.ArrowInvalid, ValueError: the output cannot be read.
    """
    if output_format == "parquet":
        t = pq.read_table(output_path, columns=["finish_reason", "error"])
        failed = pc.fill_null(pc.equal(t["finish_reason"], "error"), False)
        errors = t["error"].filter(failed)
        first = next((e for e in errors.to_pylist() if e), None)
        return t.num_rows, int(pc.sum(failed).as_py() or 0), first
    rows, n_errors, first = 0, 0, None
    with open(output_path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            rows += 1
            record = json.loads(line)
            if output_format == "openai":
                err = record.get("error")
                failed, message = err is not None, err.get("message") if isinstance(err, dict) else None
            else:
                message, failed = record.get("error"), record.get("finish_reason") == "error"
            if failed:
                n_errors += 1
                first = first or message
    return rows, n_errors, first
