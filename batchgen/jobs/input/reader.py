"""Streaming job-file reader: Parquet, JSONL, OpenAI batch JSONL, Hugging Face datasets.

The reader never holds the whole file: Parquet is read by record batches, JSONL line by line (so one
malformed line is one error row, with its line number), datasets through `datasets` batch iterators
(hub datasets in streaming mode). Each input row becomes one `JobRow`, valid or carrying an error.
"""

from __future__ import annotations

import os
import string
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from batchgen.jobs.input.formats import (
    JobInputError,
    check_hub_reachable,
    detect_format,
    file_sha256,
    hub_offline,
    iter_jsonl,
    parse_hf_reference,
    sniff_jsonl,
)
from batchgen.jobs.input.openai_rows import OpenAIRowParser
from batchgen.jobs.input.row_sampling import LOGPROB_FIELDS, SAMPLING_COLUMNS, UNAPPLIED_COLUMNS
from batchgen.jobs.input.rows import STRUCTURED_FIELDS, JobRow, RowParser


@dataclass
class ReaderOptions:
    """How rows are turned into prompts and sampling parameters.

    Attributes:
        prompt_column / messages_column / id_column: schema overrides (None: detect).
        template: `str.format` template whose `{column}` placeholders name input columns.
        keep_columns: input columns copied to the output.
        defaults: SamplingParams keyword defaults from the CLI; row columns override them.
        batch_size: rows per Parquet / dataset batch (bounds the reader's memory).
        limit: read only the first `limit` rows (None: all).
        chat_template_kwargs: the job's chat template variables (`--chat-template-kwargs`); a
            row's own `chat_template_kwargs` is merged over them (`row_chat.row_kwargs`).
    """

    prompt_column: str | None = None
    messages_column: str | None = None
    id_column: str | None = None
    template: str | None = None
    keep_columns: tuple[str, ...] = ()
    defaults: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 1024
    limit: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class JobReader:
    """Detects a job input's format and schema, then streams its rows as `JobRow`s.

    Construction does all the checks that need no model (file exists, format known, prompt / id /
    template / keep columns present), so a bad job fails before any model work.

    Args:
        source: path to a .jsonl / .parquet file, a dataset directory, or "hf://NAME[:CONFIG]:SPLIT".
        options: schema overrides, template and sampling defaults.

    Raises:
        JobInputError: with the available columns when a named or needed column is missing.
    """

    def __init__(self, source: str, options: ReaderOptions | None = None) -> None:
        self.source = source
        self.options = options or ReaderOptions()
        self.format = detect_format(source)
        self._dataset: Any = None
        self.columns = self._read_columns()
        self._refuse_empty()
        self.prompt_column: str | None = None
        self.messages_column: str | None = None
        self.id_column: str | None = None
        self.template_fields: tuple[str, ...] = ()
        if self.format != "openai":
            self._resolve_schema()
        else:
            self._refuse_schema_options()
        self.parser: RowParser = (
            OpenAIRowParser(self.options)
            if self.format == "openai"
            else RowParser(
                self.options, self.prompt_column, self.messages_column, self.id_column, self.template_fields
            )
        )

    # ----- schema -----

    def _read_columns(self) -> list[str]:
        if self.format in ("jsonl", "openai"):
            cols: dict[str, None] = {}
            for _, rec, _ in sniff_jsonl(self.source):
                if rec is not None:
                    cols.update(dict.fromkeys(rec))
            return list(cols)
        if self.format == "parquet":
            return list(open_parquet(self.source).schema_arrow.names)
        self._dataset = self._open_dataset()
        names = self._dataset.column_names
        if names is None:  # streaming dataset without declared features: peek at one row
            first = next(iter(self._dataset), None)
            names = list(first) if first else []
        return list(names)

    def _refuse_empty(self) -> None:
        """An input with no rows stops the job here, before any model loads, as an empty JSONL file
        does (`detect_format`): running it would load a model to write an empty output. A streamed
        dataset whose size is not known runs (its rows are only counted by reading them)."""
        if self.format not in ("jsonl", "openai") and self._count_rows() == 0:
            raise JobInputError(f"{self.source} is empty (no rows): there is nothing to run; check the input")

    def _open_dataset(self) -> Any:
        import datasets

        if self.format == "hf_dir":
            try:
                ds = datasets.load_from_disk(self.source)
            except Exception as e:
                raise JobInputError(f"cannot load dataset directory {self.source}: {e}") from e
            if isinstance(ds, datasets.DatasetDict):
                if len(ds) != 1:
                    splits = ", ".join(os.path.join(self.source, s) for s in ds)
                    raise JobInputError(f"{self.source} holds several splits; pass one of: {splits}")
                ds = next(iter(ds.values()))
            return ds
        name, config, split = parse_hf_reference(self.source)
        offline = hub_offline()
        if not offline and not os.path.exists(name):  # a local data folder as NAME needs no hub
            check_hub_reachable(self.source)
        try:
            return datasets.load_dataset(name, config, split=split, streaming=True)
        except Exception as e:
            hint = (
                " (HF_HUB_OFFLINE is set: only a copy in the local Hugging Face cache can be read; "
                "unset it to download the dataset)"
                if offline
                else ""
            )
            raise JobInputError(f"cannot load {self.source} with datasets.load_dataset: {e}{hint}") from e

    def _refuse_schema_options(self) -> None:
        """An OpenAI batch line has its prompt in `body`, its id in `custom_id` and an output line
        with no room for extra columns: the column options would be silently ignored."""
        o = self.options
        given = [
            flag
            for flag, value in (
                ("--prompt-column", o.prompt_column),
                ("--messages-column", o.messages_column),
                ("--template", o.template),
                ("--id-column", o.id_column),
                ("--keep-columns", o.keep_columns or None),
            )
            if value is not None
        ]
        if given:
            raise JobInputError(
                f"{self.source} is an OpenAI batch file (prompt in 'body', id in 'custom_id'), so "
                f"{', '.join(given)} {'do' if len(given) > 1 else 'does'} not apply to it; "
                f"drop {'them' if len(given) > 1 else 'it'}"
            )

    def _missing(self, what: str, name: str, flag: str) -> JobInputError:
        avail = ", ".join(self.columns) or "(none)"
        return JobInputError(
            f"{what} '{name}' not found in {self.source}; available columns: {avail}. Fix {flag}"
        )

    def _resolve_schema(self) -> None:
        o = self.options
        cols = set(self.columns)
        if o.template is not None:
            fields_: list[str] = []
            try:
                parsed = list(string.Formatter().parse(o.template))
            except ValueError as e:
                raise JobInputError(
                    f"--template {o.template!r} is not a valid template ({e}); name columns in braces, "
                    "e.g. 'Summarize: {document}', and double a literal brace ({{ or }})"
                ) from e
            for _, name, _, _ in parsed:
                if name is None:
                    continue
                if not name or name.isdigit():
                    raise JobInputError(
                        f"--template placeholders must name columns, e.g. {{document}}; got {{{name}}}"
                    )
                base = name.split(".")[0].split("[")[0]
                if "." in name.split("[")[0]:  # {doc.upper} would put a method's repr in the prompt
                    raise JobInputError(
                        f"--template placeholder {{{name}}} reads an attribute; placeholders name columns "
                        "and may index them ({tags[0]}, {meta[key]}), nothing else"
                    )
                if base not in cols:
                    error = self._missing("template column", base, "--template")
                    if not base.isidentifier():  # {"a": 1} in the text: braces meant literally
                        error = JobInputError(
                            f"{error}; for a literal brace in the template, double it ({{{{ or }}}})"
                        )
                    raise error
                fields_.append(base)
            self.template_fields = tuple(dict.fromkeys(fields_))
        elif o.prompt_column is not None:
            if o.prompt_column not in cols:
                raise self._missing("prompt column", o.prompt_column, "--prompt-column")
            self.prompt_column = o.prompt_column
        elif o.messages_column is not None:
            if o.messages_column not in cols:
                raise self._missing("messages column", o.messages_column, "--messages-column")
            self.messages_column = o.messages_column
        elif "prompt" in cols or "messages" in cols:
            # Both present: each row uses the one it fills (a job may mix plain and chat rows;
            # a row that fills both is an error row).
            self.prompt_column = "prompt" if "prompt" in cols else None
            self.messages_column = "messages" if "messages" in cols else None
        else:
            avail = ", ".join(self.columns) or "(none)"
            hint = ""
            if {"custom_id", "url", "method", "body"} & cols:
                # An OpenAI batch file is recognised by its first request line holding both
                # custom_id and body; a typo there makes the whole file read as plain JSONL.
                hint = (
                    " It looks like an OpenAI batch file: check that its first line has both "
                    "'custom_id' and 'body' (spelled so)."
                )
            raise JobInputError(
                f"no prompt column in {self.source}; available columns: {avail}. Pass --prompt-column NAME, "
                f"--messages-column NAME, or --template 'text with {{column}} placeholders'.{hint}"
            )
        if o.id_column is not None:
            if o.id_column not in cols:
                raise self._missing("id column", o.id_column, "--id-column")
            self.id_column = o.id_column
        else:
            self.id_column = next((c for c in ("id", "custom_id") if c in cols), None)
        for c in o.keep_columns:
            if c not in cols:
                raise self._missing("keep column", c, "--keep-columns")

    @property
    def needed_columns(self) -> list[str]:
        """Input columns the reader uses (the others are never read from columnar inputs)."""
        names = [self.prompt_column, self.messages_column, self.id_column, *self.template_fields]
        names += [
            c
            for c in (
                *SAMPLING_COLUMNS,
                *LOGPROB_FIELDS,
                *UNAPPLIED_COLUMNS,
                *STRUCTURED_FIELDS,
                "max_completion_tokens",
                "n",
            )
            if c in self.columns
        ]
        names += list(self.options.keep_columns)
        return list(dict.fromkeys(n for n in names if n is not None))

    def identity(self) -> dict[str, Any]:
        """What identifies the input for resume: path, size and the SHA-256 of its whole content
        (files), the file list with sizes and the hash of its state.json (dataset dirs), or the hub
        reference."""
        if self.format == "hf_hub":
            return {"hub": self.source}
        path = os.path.abspath(self.source)
        if self.format == "hf_dir":
            files = []
            for root, _, names in os.walk(path):
                for n in sorted(names):
                    p = os.path.join(root, n)
                    files.append([os.path.relpath(p, path), os.path.getsize(p)])
            state = os.path.join(path, "state.json")
            fp = file_sha256(state) if os.path.exists(state) else None
            return {"path": path, "files": sorted(files), "state_sha256": fp}
        return {"path": path, "size": os.path.getsize(path), "sha256": file_sha256(path)}

    def count_rows(self) -> int | None:
        """Number of rows (streamed count for JSONL; metadata for Parquet / datasets; None if unknown),
        at most `limit`."""
        n = self._count_rows()
        limit = self.options.limit
        return limit if limit is not None and (n is None or n > limit) else n

    def _count_rows(self) -> int | None:
        if self.format in ("jsonl", "openai"):
            n = 0
            with open(self.source, "rb") as f:
                for raw in f:
                    if raw.strip():
                        n += 1
            return n
        if self.format == "parquet":
            return open_parquet(self.source).metadata.num_rows
        try:
            return len(self._dataset)
        except TypeError:
            info = getattr(self._dataset, "info", None)
            split = parse_hf_reference(self.source)[2] if self.format == "hf_hub" else None
            splits = getattr(info, "splits", None) or {}
            return splits[split].num_examples if split in splits else None

    # ----- rows -----

    def __iter__(self) -> Iterator[JobRow]:
        """Yield every input row (the first `limit` ones) in order as a `JobRow`, valid or with `error` set."""
        limit = self.options.limit
        for row in self._rows():
            if limit is not None and row.row_index >= limit:
                return
            yield row

    def _rows(self) -> Iterator[JobRow]:
        parser = self.parser
        parser.start()
        for row_index, (line_number, rec, err) in enumerate(self._records()):
            if err is not None:
                yield parser.error_row(row_index, line_number, parser.salvaged_id(rec), err, raw=err)
            else:
                assert rec is not None  # a record or its error
                yield parser.row(row_index, line_number, rec)

    def _records(self) -> Iterator[tuple[int | None, dict | None, str | None]]:
        if self.format in FILE_FORMATS:
            yield from iter_records(self.source, self.format, self.needed_columns, self.options.batch_size)
            return
        ds = self._dataset.select_columns(self.needed_columns)
        for batch in ds.iter(batch_size=self.options.batch_size):
            keys = list(batch)
            for values in zip(*(batch[k] for k in keys), strict=True):
                yield None, dict(zip(keys, values, strict=True)), None


# The formats `iter_records` reads (the others are Hugging Face datasets).
FILE_FORMATS = ("jsonl", "openai", "parquet")


def open_parquet(source: str) -> Any:
    """`pyarrow.parquet.ParquetFile` of `source`.

    Raises:
        JobInputError: pyarrow cannot read its footer (a truncated or damaged file), naming it.
    """
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(source)
    except Exception as e:  # pyarrow raises several types for corrupt footers
        raise JobInputError(
            f"cannot read Parquet file {source}: {e}; check that the file is whole (not truncated or damaged)"
        ) from e


def iter_records(
    source: str, fmt: str, columns: list[str] | None = None, batch_size: int = 1024
) -> Iterator[tuple[int | None, dict | None, str | None]]:
    """(line_number, record, error) of each row of a job file, in order, never the whole file at once.

    JSON lines ("jsonl", "openai") line by line (`iter_jsonl`: a bad line comes with its error, and
    with its record as best read or None); Parquet ("parquet") a record batch of `batch_size` rows at
    a time, only `columns` (None: all), line_number None. `batchgen run`'s reader and the bench's
    `file:` workloads (`batchgen.bench.workload.job`) both read job files through it.

    Raises:
        JobInputError: a Parquet file whose footer cannot be read (`open_parquet`).
    """
    if fmt == "parquet":
        for batch in open_parquet(source).iter_batches(batch_size=batch_size, columns=columns):
            for rec in batch.to_pylist():
                yield None, rec, None
        return
    yield from iter_jsonl(source)
