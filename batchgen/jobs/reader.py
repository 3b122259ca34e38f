"""Streaming job-file reader: Parquet, JSONL, OpenAI batch JSONL, Hugging Face datasets.

The reader never holds the whole file: Parquet is read by record batches, JSONL line by line (so one
malformed line is one error row, with its line number), datasets through `datasets` batch iterators
(hub datasets in streaming mode). Each input row becomes one `JobRow`, valid or carrying an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import string
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from batchgen.jobs.formats import (  # noqa: F401  (re-exported: the reader's public names)
    FORMATS_HELP,
    SNIFF_LINES,
    JobInputError,
    check_messages,
    detect_format,
    head_tail_sha256,
    iter_jsonl,
    parse_hf_reference,
    sniff_jsonl,
)
from batchgen.sampling_params import SamplingParams

SAMPLING_COLUMNS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "priority")
_INT_FIELDS = frozenset({"max_tokens", "top_k", "seed", "priority"})
OPENAI_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


@dataclass(slots=True)
class JobRow:
    """One input row, ready for the engine or carrying the reason it cannot run.

    Attributes:
        row_index: 0-based position among the input's rows (the output is in this order).
        id: the row's id (`--id-column`, `id`, `custom_id`), else the row index as a string.
        prompt: prompt text, chat messages (`[{"role": ..., "content": ...}]`), or None on error.
        sampling_params: the CLI defaults with the row's overrides, or None on error.
        error: message naming the row, the field and the fix; None for a valid row.
        line_number: 1-based line of a JSONL input, None for columnar inputs.
        keep: values of the `--keep-columns` columns (None when none were asked for).
        row_hash: signed 64-bit hash of the row's input and parameters (resume identity).
        endpoint: "chat" or "completion" for OpenAI batch rows, None otherwise.
    """

    row_index: int
    id: str
    prompt: str | list[dict] | None
    sampling_params: SamplingParams | None
    error: str | None = None
    line_number: int | None = None
    keep: dict[str, Any] | None = None
    row_hash: int = 0
    endpoint: str | None = None

    @property
    def where(self) -> str:
        """How messages name this row, e.g. "row 5 (line 6)"."""
        return row_label(self.row_index, self.line_number)


def row_label(row_index: int, line_number: int | None) -> str:
    """Human name of a row for messages: "row 5 (line 6)" or "row 5"."""
    return f"row {row_index}" if line_number is None else f"row {row_index} (line {line_number})"


def stable_hash(obj: Any) -> int:
    """Signed 64-bit blake2b hash of `obj`'s canonical JSON (stable across runs and machines)."""
    data = json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big", signed=True)


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
    """

    prompt_column: str | None = None
    messages_column: str | None = None
    id_column: str | None = None
    template: str | None = None
    keep_columns: tuple[str, ...] = ()
    defaults: dict[str, Any] = field(default_factory=dict)
    batch_size: int = 1024
    limit: int | None = None


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
        self.prompt_column: str | None = None
        self.messages_column: str | None = None
        self.id_column: str | None = None
        self.template_fields: tuple[str, ...] = ()
        if self.format != "openai":
            self._resolve_schema()
        self._seen_custom_ids: dict[int, int] = {}
        self._params_cache: dict[str, tuple[SamplingParams, int]] = {}

    # ----- schema -----

    def _read_columns(self) -> list[str]:
        if self.format in ("jsonl", "openai"):
            cols: dict[str, None] = {}
            for _, rec, _ in sniff_jsonl(self.source):
                if rec is not None:
                    cols.update(dict.fromkeys(rec))
            return list(cols)
        if self.format == "parquet":
            import pyarrow.parquet as pq

            try:
                return list(pq.ParquetFile(self.source).schema_arrow.names)
            except Exception as e:  # pyarrow raises several types for corrupt footers
                raise JobInputError(f"cannot read Parquet file {self.source}: {e}") from e
        self._dataset = self._open_dataset()
        names = self._dataset.column_names
        if names is None:  # streaming dataset without declared features: peek at one row
            first = next(iter(self._dataset), None)
            names = list(first) if first else []
        return list(names)

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
        try:
            return datasets.load_dataset(name, config, split=split, streaming=True)
        except Exception as e:
            raise JobInputError(f"cannot load {self.source} with datasets.load_dataset: {e}") from e

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
            for _, name, _, _ in string.Formatter().parse(o.template):
                if name is None:
                    continue
                if not name or name.isdigit():
                    raise JobInputError("--template placeholders must name columns, e.g. {document}; got {}")
                base = name.split(".")[0].split("[")[0]
                if base not in cols:
                    raise self._missing("template column", base, "--template")
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
            # Both present: each row uses its non-null one (a job may mix plain and chat rows).
            self.prompt_column = "prompt" if "prompt" in cols else None
            self.messages_column = "messages" if "messages" in cols else None
        else:
            avail = ", ".join(self.columns) or "(none)"
            raise JobInputError(
                f"no prompt column in {self.source}; available columns: {avail}. Pass --prompt-column NAME, "
                "--messages-column NAME, or --template 'text with {column} placeholders'"
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
        names += [c for c in SAMPLING_COLUMNS if c in self.columns]
        names += list(self.options.keep_columns)
        return list(dict.fromkeys(n for n in names if n is not None))

    def identity(self) -> dict[str, Any]:
        """What identifies the input for resume: path, size and a hash of its first and last MiB
        (files), the file list with sizes and fingerprint (dataset dirs), or the hub reference."""
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
            fp = head_tail_sha256(state) if os.path.exists(state) else None
            return {"path": path, "files": sorted(files), "state_sha256": fp}
        return {"path": path, "size": os.path.getsize(path), "head_tail_sha256": head_tail_sha256(path)}

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
            import pyarrow.parquet as pq

            return pq.ParquetFile(self.source).metadata.num_rows
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
        self._seen_custom_ids = {}
        if self.format in ("jsonl", "openai"):
            make = self._openai_row if self.format == "openai" else self._plain_row
            for row_index, (line_number, rec, err) in enumerate(iter_jsonl(self.source)):
                if err is not None:
                    yield self._error_row(row_index, line_number, None, err, raw=err)
                else:
                    yield make(row_index, line_number, rec)
            return
        row_index = 0
        for rec in self._iter_records():
            yield self._plain_row(row_index, None, rec)
            row_index += 1

    def _iter_records(self) -> Iterator[dict]:
        cols = self.needed_columns
        bs = self.options.batch_size
        if self.format == "parquet":
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(self.source)
            for batch in pf.iter_batches(batch_size=bs, columns=cols):
                yield from batch.to_pylist()
            return
        ds = self._dataset.select_columns(cols)
        for batch in ds.iter(batch_size=bs):
            keys = list(batch)
            for values in zip(*(batch[k] for k in keys), strict=True):
                yield dict(zip(keys, values, strict=True))

    def _error_row(
        self, row_index: int, line_number: int | None, row_id: Any, message: str, raw: Any, endpoint=None
    ) -> JobRow:
        rid = str(row_index) if row_id is None else str(row_id)
        return JobRow(
            row_index=row_index,
            id=rid,
            prompt=None,
            sampling_params=None,
            error=f"{row_label(row_index, line_number)}: {message}",
            line_number=line_number,
            keep={c: None for c in self.options.keep_columns} if self.options.keep_columns else None,
            row_hash=stable_hash(["error", raw]),
            endpoint=endpoint,
        )

    def _sampling(self, values: dict[str, Any]) -> tuple[SamplingParams | None, int, str | None]:
        """(params, hash of params, None) or (None, 0, error) for the defaults plus a row's overrides.

        Rows with the same overrides share one (read-only) SamplingParams, so the common case of no
        overrides costs a dict lookup instead of a validation per row."""
        overrides = tuple((k, v) for k, v in values.items() if v is not None)
        key = repr(overrides)
        hit = self._params_cache.get(key)
        if hit is not None:
            return hit[0], hit[1], None
        merged = dict(self.options.defaults)
        for k, v in overrides:
            if k in _INT_FIELDS and isinstance(v, float) and v.is_integer():
                v = int(v)
            merged[k] = v
        try:
            params = SamplingParams(**merged)
        except (ValueError, TypeError) as e:
            bad = [k for k, _ in overrides if k in str(e)]
            fld = f"field '{bad[0]}'" if bad else "sampling fields"
            return (
                None,
                0,
                f"invalid sampling value in {fld}: {e}; fix the value or remove it to use the default",
            )
        if len(self._params_cache) >= 4096:  # bounded: per-row seeds would otherwise fill it
            self._params_cache.clear()
        self._params_cache[key] = (params, stable_hash(params.to_dict()))
        return params, self._params_cache[key][1], None

    def _plain_row(self, row_index: int, line_number: int | None, rec: dict) -> JobRow:
        rid = rec.get(self.id_column) if self.id_column else None
        keep = {c: rec.get(c) for c in self.options.keep_columns} or None
        prompt, err = self._prompt_of(rec)
        if err is not None:
            return self._error_row(row_index, line_number, rid, err, raw=rec)
        params, params_hash, err = self._sampling({k: rec.get(k) for k in SAMPLING_COLUMNS})
        if err is not None:
            return self._error_row(row_index, line_number, rid, err, raw=rec)
        rid_s = str(row_index) if rid is None else str(rid)
        return JobRow(
            row_index=row_index,
            id=rid_s,
            prompt=prompt,
            sampling_params=params,
            line_number=line_number,
            keep=keep,
            row_hash=stable_hash([rid_s, prompt, params_hash, keep]),
        )

    def _prompt_of(self, rec: dict) -> tuple[str | list[dict] | None, str | None]:
        if self.template_fields or self.options.template is not None:
            for f in self.template_fields:
                if rec.get(f) is None or rec.get(f) == "":
                    return None, f"field '{f}' (used by --template) is null or empty; fill it or drop the row"
            try:
                return self.options.template.format(**{f: rec[f] for f in self.template_fields}), None
            except (KeyError, IndexError, AttributeError, ValueError) as e:
                return None, f"--template could not be filled from this row ({e!r}); check its placeholders"
        msgs = self.messages_column
        if msgs is not None and (self.prompt_column is None or rec.get(msgs) is not None):
            return check_messages(rec.get(msgs), msgs)
        col = self.prompt_column
        value = rec.get(col)
        if isinstance(value, list):
            return check_messages(value, col)
        if value is None or (isinstance(value, str) and not value.strip()):
            return None, f"field '{col}' is null or empty; put the prompt text there or drop the row"
        if not isinstance(value, str):
            return None, f"field '{col}' must be a string, got {type(value).__name__}; quote the prompt"
        return value, None

    def _openai_row(self, row_index: int, line_number: int, rec: dict) -> JobRow:
        cid = rec.get("custom_id")
        body = rec.get("body")
        url = rec.get("url")
        endpoint = OPENAI_ENDPOINTS.get(url) if isinstance(url, str) else None

        def fail(msg: str) -> JobRow:
            return self._error_row(row_index, line_number, cid, msg, raw=rec, endpoint=endpoint or "chat")

        if not isinstance(cid, str) or not cid:
            return fail(
                "field 'custom_id' is missing or not a non-empty string; give each request a unique id"
            )
        key = stable_hash(cid)
        first = self._seen_custom_ids.get(key)
        if first is not None:
            return fail(
                f"duplicate custom_id '{cid}' (first used on line {first}); make each custom_id unique"
            )
        self._seen_custom_ids[key] = line_number
        method = rec.get("method", "POST")
        if method != "POST":
            return fail(f"field 'method' is {method!r}; batch requests must use \"POST\"")
        if endpoint is None:
            return fail(f"field 'url' is {url!r}; use one of {', '.join(OPENAI_ENDPOINTS)}")
        if not isinstance(body, dict):
            return fail("field 'body' is missing or not an object; put the request parameters in 'body'")
        if endpoint == "chat":
            prompt, err = check_messages(body.get("messages"), "body.messages")
        else:
            prompt, err = body.get("prompt"), None
            if not isinstance(prompt, str) or not prompt.strip():
                err = "field 'body.prompt' must be a non-empty string (one prompt per request)"
        if err is not None:
            return fail(err)
        unsupported = sorted(
            k for k, v in body.items() if k not in OPENAI_BODY_FIELDS and v not in (None, False, 0, [], {})
        )
        if unsupported:
            return fail(
                f"field 'body.{unsupported[0]}' is not supported by batchgen (it would change the output); "
                f"remove it (supported: {', '.join(sorted(OPENAI_BODY_FIELDS))})"
            )
        n = body.get("n")
        if n not in (None, 1):
            return fail(
                f"field 'body.n' is {n!r}; only n=1 is supported, split the request into several lines"
            )
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        values = {k: body.get(k) for k in SAMPLING_COLUMNS if k != "max_tokens"}
        values["max_tokens"] = max_tokens
        params, params_hash, err = self._sampling(values)
        if err is not None:
            return fail(err.replace("field '", "field 'body."))
        return JobRow(
            row_index=row_index,
            id=cid,
            prompt=prompt,
            sampling_params=params,
            line_number=line_number,
            keep=None,
            row_hash=stable_hash([cid, endpoint, prompt, params_hash]),
            endpoint=endpoint,
        )


# Request fields honoured (or, like `model` and `user`, harmless to ignore). Anything else that is set
# (logprobs, penalties, tools, response_format, ...) would silently change the meaning of the output.
OPENAI_BODY_FIELDS = frozenset(
    {"messages", "prompt", "model", "user", "metadata", "stream", "n", "max_tokens", "max_completion_tokens"}
    | set(SAMPLING_COLUMNS)
)
