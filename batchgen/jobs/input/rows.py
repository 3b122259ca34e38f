"""Turning one input record into a `JobRow`: prompt, id, sampling parameters, or the row's error.

`RowParser` holds what the reader resolved from the schema (which column is the prompt, the messages,
the id; the template's fields) and the CLI's sampling defaults. It knows nothing of files: the reader
(`batchgen.jobs.input.reader`) streams records and hands each one here, so a malformed record becomes one
error row naming the row, the field and the fix, never an exception that stops the job.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from batchgen.jobs.input import row_chat
from batchgen.jobs.input.formats import LONE_SURROGATE, check_messages, is_utf8, text_error
from batchgen.jobs.input.row_sampling import (
    LOGPROB_FIELDS,
    SAMPLING_COLUMNS,
    UNAPPLIED_COLUMNS,
    RowSampling,
    requested_logprobs,
    stable_hash,
    unapplied_field_error,
)
from batchgen.jobs.input.row_structured import (
    BODY_FIELDS,
    CONSTRAINT_COLUMNS,
    constraint_flag,
    row_constraint,
)
from batchgen.jobs.output.json_lines import to_json
from batchgen.jobs.output.schema import LOGPROB_COLUMNS
from batchgen.sampling_params import SamplingParams

# Duplicate ids of a plain job: warned about at most this many times, among the ids of this many rows.
MAX_DUPLICATE_NOTICES = 10
MAX_TRACKED_IDS = 500_000
# Field names a plain job's column may be a misspelling of (see RowParser._note_near_misses).
NEAR_MISS_TARGETS = (
    *SAMPLING_COLUMNS,
    "n",
    *UNAPPLIED_COLUMNS,
    "top_logprobs",
    "max_completion_tokens",
    *CONSTRAINT_COLUMNS,
    *BODY_FIELDS,
    "prompt",
    "messages",
    row_chat.FIELD,
)
# The fields of a plain row that set a structured outputs constraint.
STRUCTURED_FIELDS = (*CONSTRAINT_COLUMNS, *BODY_FIELDS)


@dataclass(slots=True)
class JobRow:
    """One input row, ready for the engine or carrying the reason it cannot run.

    Attributes:
        row_index: 0-based position among the input's rows (the output is in this order).
        id: the row's id (`--id-column`, `id`, `custom_id`); the row index as a string when the input
            has no id column; None for a row whose id is null in an input that has one, and for an
            OpenAI batch line without a usable `custom_id` (a made-up id could equal a real one).
        prompt: prompt text, chat messages (`[{"role": ..., "content": ...}]`), or None on error.
        sampling_params: the CLI defaults with the row's overrides, or None on error.
        error: message naming the row, the field and the fix; None for a valid row.
        line_number: 1-based line of a JSONL input, None for columnar inputs.
        keep: values of the `--keep-columns` columns (None when none were asked for).
        row_hash: signed 64-bit hash of the row's input and parameters (resume identity).
        endpoint: "chat" or "completion" for OpenAI batch rows, None otherwise.
        constraint_field: how messages name what set the row's structured outputs constraint
            ("field 'json_schema'", or the job's flag "--json-schema"), None when it has none.
        chat_template_kwargs: extra chat template variables for the row's messages (the job's
            `--chat-template-kwargs` with the row's own merged over them), None when none.
    """

    row_index: int
    id: str | None
    prompt: str | list[dict] | None
    sampling_params: SamplingParams | None
    error: str | None = None
    line_number: int | None = None
    keep: dict[str, Any] | None = None
    row_hash: int = 0
    endpoint: str | None = None
    constraint_field: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def params(self) -> SamplingParams:
        """`sampling_params` of a row without an error (an error row has none).

        Raises:
            ValueError: this is an error row.
        """
        if self.sampling_params is None:
            raise ValueError(f"{self.where} is an error row ({self.error}): it has no sampling params")
        return self.sampling_params

    @property
    def where(self) -> str:
        """How messages name this row, e.g. "row 5 (line 6)"."""
        return row_label(self.row_index, self.line_number)


def row_label(row_index: int, line_number: int | None) -> str:
    """Human name of a row for messages: "row 5 (line 6)" or "row 5"."""
    return f"row {row_index}" if line_number is None else f"row {row_index} (line {line_number})"


def id_text(value: Any) -> str:
    """The output `id` of an input id: text as it is, a number as written, anything else (true,
    an object, a list) as JSON rather than Python's repr."""
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return to_json(value)


def printable(value: Any) -> Any:
    """`value` with any lone surrogate in its strings written as a `\\udXXX` escape, so it can be
    stored as UTF-8 (Parquet, JSON lines); other values are returned as they are."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


class RowParser:
    """Builds `JobRow`s from the records of one job input (`row`); OpenAI batch lines have their own
    parser (`batchgen.jobs.input.openai_rows.OpenAIRowParser`).

    Args:
        options: the reader's `ReaderOptions` (template, keep columns, sampling defaults).
        prompt_column / messages_column / id_column: the columns the reader resolved (None: absent).
        template_fields: the input columns `options.template` names, in order.
        row_index_ids: rows get their row index as id when the input has no id column (False for
            OpenAI batch input, whose error lines without a custom_id get none).
    """

    def __init__(
        self,
        options: Any,  # a `batchgen.jobs.input.reader.ReaderOptions` (that module imports this one)
        prompt_column: str | None = None,
        messages_column: str | None = None,
        id_column: str | None = None,
        template_fields: tuple[str, ...] = (),
        row_index_ids: bool = True,
    ) -> None:
        self.options = options
        self.row_index_ids = row_index_ids
        self.prompt_column = prompt_column
        self.messages_column = messages_column
        self.id_column = id_column
        self.template_fields = template_fields
        # Plain rows' ids -> row index and line of their first row, and the duplicates warned about
        # (kept across passes: a --strict pass and the run's own warn once).
        self._seen_ids: dict[int, int] = {}
        self._duplicates_noted: set[str] = set()
        prompt_columns = (prompt_column, messages_column, *template_fields)
        self._prompt_columns = frozenset(c for c in prompt_columns if c is not None)
        self._data_columns = self._prompt_columns | {c for c in (id_column, *options.keep_columns) if c}
        self._resolve_sampling = RowSampling(options.defaults).resolve
        # How messages name the job's own constraint (`--json-schema`, ...), which rows without one take.
        self.flag_label = constraint_flag(options.defaults.get("structured_outputs"))
        self._greedy_choices_noted = False
        # A kept input column named like an output column of log probabilities makes the job's
        # log-probability fields data too: the output cannot hold both.
        self._logprobs_are_data = any(c in options.keep_columns for c in LOGPROB_COLUMNS)
        # Messages for the user, taken by the job runner as rows are read (`_note_near_misses`).
        self.notices: list[str] = []
        # Known names are never near misses of another (max_completion_tokens applies, best_of is refused).
        self._names_checked: set[str] = set(self._data_columns) | set(NEAR_MISS_TARGETS)

    def salvaged_id(self, rec: dict | None) -> Any:
        """The id of a record read with its invalid bytes replaced, when the id came through whole
        (None otherwise: a damaged id would name no row of the input)."""
        if rec is None:
            return None
        rid = rec.get(self.id_column or "custom_id")
        return None if rid is None or "\ufffd" in to_json(rid) else rid

    def start(self) -> None:
        """Forget the ids seen so far: a new pass over the input begins."""
        self._seen_ids = {}

    def error_row(
        self,
        row_index: int,
        line_number: int | None,
        row_id: Any,
        message: str,
        raw: Any,
        endpoint: str | None = None,
        keep: dict[str, Any] | None = None,
    ) -> JobRow:
        """A row that will not run: `message` (naming the field and the fix) prefixed with the row's
        name; `raw` is what is hashed as its resume identity; `keep` holds the row's
        `--keep-columns` values when the record could be read (so the row can still be joined)."""
        rid = printable(id_text(row_id)) if row_id is not None else self._made_up_id(row_index)
        if self.options.keep_columns:
            keep = {c: printable((keep or {}).get(c)) for c in self.options.keep_columns}
        return JobRow(
            row_index=row_index,
            id=rid,
            prompt=None,
            sampling_params=None,
            error=f"{row_label(row_index, line_number)}: {message}",
            line_number=line_number,
            keep=keep or None,
            row_hash=stable_hash(["error", raw]),
            endpoint=endpoint,
        )

    def _made_up_id(self, row_index: int) -> str | None:
        """The id of a row without one: its index when the input has no id column at all; None when
        it has one (the index could equal another row's real id)."""
        return str(row_index) if self.row_index_ids and self.id_column is None else None

    def _note_near_misses(self, rec: dict) -> None:
        """A notice, once per name, for a column that is not a sampling field but nearly spells one
        (`temprature`): other columns are data by design, so it would otherwise be silently kept
        as data while the row runs with the default value."""
        if len(self._names_checked) > 10_000:  # a file whose every row has new keys: stop looking
            return
        for name in rec.keys() - self._names_checked:
            self._names_checked.add(name)
            close = difflib.get_close_matches(str(name), NEAR_MISS_TARGETS, n=1, cutoff=0.8)
            if close:
                self.notices.append(
                    f"note: column '{name}' is not a sampling field, so it is kept as data and changes "
                    f"nothing; did you mean '{close[0]}'?"
                )

    def _sampling(self, values: dict) -> tuple[SamplingParams | None, int, str | None]:
        """A row's sampling values -> (params, hash of params, error) (`RowSampling.resolve`), adding
        one notice the first time a row asks for n > 1 completions under greedy sampling: they are
        all the same text."""
        params, params_hash, err = self._resolve_sampling(values)
        if params is not None and not self._greedy_choices_noted and params.n > 1 and params.temperature == 0:
            self._greedy_choices_noted = True
            self.notices.append(
                f"note: rows ask for n={params.n} completions with greedy sampling (temperature 0, the "
                "default), so their completions are the same text; set temperature above 0 (a row's "
                "'temperature' or --temperature) for different ones"
            )
        return params, params_hash, err

    def _note_duplicate_id(self, rid: str, row_index: int, line_number: int | None) -> None:
        """A warning, once per id and process, for a plain row whose id an earlier row of this pass
        has: both rows run (ids are the user's data), but output joined on `id` would mix them.
        At most `MAX_DUPLICATE_NOTICES` are given, then one line that more were left out; ids are
        remembered for the first `MAX_TRACKED_IDS` rows of a pass (bounded memory)."""
        # Keyed by the id's hash, the first row packed into one int: about 100 bytes an id.
        key = hash(rid)
        packed = self._seen_ids.get(key)
        if packed is None:
            if len(self._seen_ids) < MAX_TRACKED_IDS:
                self._seen_ids[key] = (row_index << 32) | (line_number or 0)
            return
        if rid in self._duplicates_noted:
            return
        first = (packed >> 32, (packed & 0xFFFFFFFF) or None)
        self._duplicates_noted.add(rid)
        if len(self._duplicates_noted) > MAX_DUPLICATE_NOTICES:
            if len(self._duplicates_noted) == MAX_DUPLICATE_NOTICES + 1:
                self.notices.append(
                    f"warning: more duplicate ids than the {MAX_DUPLICATE_NOTICES} above; "
                    "the others are not listed"
                )
            return
        self.notices.append(
            f"warning: {row_label(row_index, line_number)} has the id {rid!r} of {row_label(*first)}; "
            f"both run, but rows joined on '{self.id_column}' would mix them: make each id unique"
        )

    def row(self, row_index: int, line_number: int | None, rec: dict) -> JobRow:
        """A row of a plain job (prompt / messages / template columns, optional sampling columns)."""
        self._note_near_misses(rec)
        rid = rec.get(self.id_column) if self.id_column else None
        keep = {c: rec.get(c) for c in self.options.keep_columns} or None
        if "custom_id" in rec and "body" in rec and not any(c in rec for c in self._prompt_columns):
            mixed = (
                "this line is an OpenAI batch request (custom_id, body), but the file's first line is not; "
                "a file holds one format, so put OpenAI batch lines in a file of their own"
            )
            return self.error_row(row_index, line_number, rid, mixed, raw=rec, keep=keep)
        prompt, err = self._prompt_of(rec)
        if err is None:
            err = unapplied_field_error(rec, self._data_columns)
        if err is None:
            values = {k: rec.get(k) for k in SAMPLING_COLUMNS}
            # OpenAI's newer name wins when set, as in batch lines (and in vLLM's OpenAI server)
            if rec.get("max_completion_tokens") is not None:
                values["max_tokens"] = rec.get("max_completion_tokens")
            # A template field or kept column named logprobs is data, as it was before batchgen
            # wrote log probabilities.
            asked = [
                None if f in self._data_columns or self._logprobs_are_data else rec.get(f)
                for f in LOGPROB_FIELDS
            ]
            values["logprobs"], err = requested_logprobs(asked[0], asked[1])  # LOGPROB_FIELDS' two
            # vLLM's n: completions per row (the output's `choices`); a template field, kept or id
            # column of that name is data.
            values["n"] = None if "n" in self._data_columns else rec.get("n")
            # A template field, kept or id column named prompt_logprobs is data (as before batchgen
            # wrote them), and the job writes no column of that name.
            values["prompt_logprobs"] = (
                None if "prompt_logprobs" in self._data_columns else rec.get("prompt_logprobs")
            )
        field = None
        kwargs = None
        if err is None:  # a column of that name the job uses as data sets nothing
            own = {} if row_chat.FIELD in self._data_columns else rec
            kwargs, err = row_chat.row_kwargs(
                own, self.options.chat_template_kwargs, f"field '{row_chat.FIELD}'"
            )
        if err is None:
            values["structured_outputs"], field, err = row_constraint(
                rec, STRUCTURED_FIELDS, self._data_columns
            )
            field = field or self.flag_label
        if err is None:
            params, params_hash, err = self._sampling(values)
            if err is not None and err.startswith("invalid sampling value in field 'n'"):
                err += (
                    " (field 'n' is the number of completions to sample, as vLLM's n; if the column is "
                    "data, pass --keep-columns n)"
                )
        if err is not None:
            return self.error_row(row_index, line_number, rid, err, raw=rec, keep=keep)
        if keep is not None and not all(is_utf8(v) for v in keep.values() if isinstance(v, str)):
            err = f"a --keep-columns value {LONE_SURROGATE}; fix it"
            return self.error_row(row_index, line_number, rid, err, raw=rec, keep=keep)
        rid_s = self._made_up_id(row_index) if rid is None else id_text(rid)
        if rid_s is not None and not is_utf8(rid_s):
            err = f"the id {LONE_SURROGATE}; fix field '{self.id_column}'"
            return self.error_row(row_index, line_number, rid, err, raw=rec, keep=keep)
        if rid is not None and rid_s is not None:
            self._note_duplicate_id(rid_s, row_index, line_number)
        return JobRow(
            row_index=row_index,
            id=rid_s,
            prompt=prompt,
            sampling_params=params,
            line_number=line_number,
            keep=keep,
            row_hash=stable_hash(
                [rid_s, prompt, params_hash, keep, *row_chat.own_kwargs(rec, self._data_columns)]
            ),
            constraint_field=field,
            chat_template_kwargs=kwargs,
        )

    def _prompt_of(self, rec: dict) -> tuple[str | list[dict] | None, str | None]:
        template = self.options.template  # its fields are `template_fields`
        if template is not None:
            for f in self.template_fields:
                if rec.get(f) is None or rec.get(f) == "":
                    return None, f"field '{f}' (used by --template) is null or empty; fill it or drop the row"
            try:
                text = template.format(**{f: rec[f] for f in self.template_fields})
            # TypeError: e.g. {tags[0]} on a number, or {q:x} on an object.
            except (KeyError, IndexError, AttributeError, ValueError, TypeError) as e:
                return None, f"--template could not be filled from this row ({e!r}); check its placeholders"
            return text, text_error(text, "--template")
        msgs = self.messages_column
        if msgs is not None and self.prompt_column is not None:
            # Both columns found in the file: a job may mix plain and chat rows, but a row that
            # fills both is ambiguous (which one did the user mean to run?).
            if rec.get(msgs) is not None and rec.get(self.prompt_column) is not None:
                return None, (
                    f"fields '{self.prompt_column}' and '{msgs}' are both set; keep one of them "
                    "(or pass --prompt-column / --messages-column to choose one for the whole file)"
                )
        if msgs is not None and (self.prompt_column is None or rec.get(msgs) is not None):
            return check_messages(rec.get(msgs), msgs)
        col = self.prompt_column
        if col is None:  # neither column: the reader's format detection stops that before any row
            return None, "no prompt column; pass --prompt-column or --messages-column"
        value = rec.get(col)
        if isinstance(value, list):
            return check_messages(value, col)
        if col not in rec:
            return None, f"field '{col}' is missing; add the prompt text under '{col}' or drop the row"
        if value is None or (isinstance(value, str) and not value.strip()):
            state = "null" if value is None else "empty" if not value else "only whitespace"
            return None, f"field '{col}' is {state}; put the prompt text there or drop the row"
        if not isinstance(value, str):
            return None, (
                f"field '{col}' must be a string, got {type(value).__name__}; quote the prompt in JSONL, "
                "or store the column as strings in Parquet"
            )
        return value, text_error(value, col)
