"""Per-row sampling parameters of a job: which columns set them, and a row's values on top of the
command's defaults (`RowSampling`), or the error naming every bad field.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from typing import Any

from batchgen.jobs.output.json_lines import to_json
from batchgen.sampling_params import MAX_LOGPROBS, SamplingParams

SAMPLING_COLUMNS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "ignore_eos",
    "priority",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "prompt_logprobs",
)
_BOOL_FIELDS = frozenset({"skip_special_tokens", "include_stop_str_in_output"})
_INT_FIELDS = frozenset(
    {"max_tokens", "top_k", "seed", "min_tokens", "priority", "logprobs", "n", "prompt_logprobs"}
)
# Generation parameters of vLLM's SamplingParams and OpenAI's API that `batchgen run` does not
# apply, with the value that asks for nothing. A row of a plain job that sets one to anything else is
# an error row: ignoring it would silently give another output than the row asks for. Names that are
# as likely to be data (`n`, `tools`) are left out here; OpenAI batch bodies check every field
# (`batchgen.jobs.input.openai_rows.OPENAI_BODY_FIELDS`).
UNAPPLIED_COLUMNS = {
    "best_of": 1,
    "logit_bias": None,
    "use_beam_search": False,
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
}
# Why vLLM's old structured outputs fields are refused: they have other names here.
UNAPPLIED_REASONS = {
    f"guided_{kind}": f"vLLM's old guided_{kind} is column '{column}' here (or vLLM's structured_outputs)"
    for kind, column in (
        ("json", "json_schema"),
        ("regex", "regex"),
        ("choice", "choice"),
        ("grammar", "grammar"),
    )
}
# The two fields that ask for generated tokens' log probabilities, in their two dialects:
# vLLM and OpenAI's completions API take `logprobs: K`; OpenAI's chat API takes `logprobs: true`
# with `top_logprobs: K`.
LOGPROB_FIELDS = ("logprobs", "top_logprobs")
# A row's explicit "no log probabilities" (`logprobs: false`), which overrides `--logprobs`
# where null takes it; `RowSampling` turns it into `SamplingParams.logprobs=None`.
LOGPROBS_OFF = "off"


def _shown(value: Any) -> str:
    """A field value as JSON, NaN and infinities by name (JSON would write them as null)."""
    return repr(value) if isinstance(value, float) and not math.isfinite(value) else to_json(value)


def _count(value: Any) -> int | None:
    """`value` as a number of alternatives (0 to MAX_LOGPROBS), or None when it is not one."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        return None
    return value


def requested_logprobs(logprobs: Any, top_logprobs: Any, chat_api: bool = False) -> tuple[Any, str | None]:
    """(the `SamplingParams.logprobs` a record asks for, None) or (None, the error naming the field).

    `logprobs` true means `top_logprobs` alternatives (0 when unset), a number K means K, false
    means none (`LOGPROBS_OFF`, whatever `--logprobs` says) and null the command's default.
    `top_logprobs` without `logprobs` true is an error, as in OpenAI's API (and vLLM's server); so
    is a number in `logprobs` next to a `top_logprobs`, and in the chat API (`chat_api`) a number
    other than 0 (read as false) in `logprobs`, where OpenAI takes a boolean.
    """
    if chat_api and logprobs == 0 and not isinstance(logprobs, bool):
        logprobs = False  # a 0 reads as false (OpenAI's server coerces it), a 1 could mean K = 1
    top_set = top_logprobs is not None and top_logprobs is not False
    top_asks = top_set and top_logprobs != 0  # top_logprobs 0 asks for nothing beyond logprobs
    if logprobs is None or logprobs is False:
        if top_asks:
            return None, (
                f"field 'top_logprobs' is {_shown(top_logprobs)} but field 'logprobs' is not true; "
                "set logprobs to true to get the top_logprobs most likely tokens at each position"
            )
        return (None if logprobs is None else LOGPROBS_OFF), None
    if logprobs is True:
        k = _count(top_logprobs) if top_set else 0
        if k is None:
            return None, (
                f"field 'top_logprobs' is {_shown(top_logprobs)}; it must be a whole number from 0 to "
                f"{MAX_LOGPROBS} (the most likely tokens returned at each position)"
            )
        return k, None
    if chat_api:
        return None, (
            f"field 'logprobs' is {_shown(logprobs)}, but the chat API takes true or false there; "
            "set logprobs to true and top_logprobs to the number of alternatives"
        )
    k = _count(logprobs)
    if k is None:
        return None, (
            f"field 'logprobs' is {_shown(logprobs)}; it must be true, false, or a whole number from 0 to "
            f"{MAX_LOGPROBS} (the most likely tokens returned at each position besides the chosen one)"
        )
    if top_asks:
        return None, (
            f"fields 'logprobs' ({_shown(logprobs)}) and 'top_logprobs' are both set; give the number "
            "of alternatives once: logprobs: K, or logprobs: true with top_logprobs: K"
        )
    return k, None


def stable_hash(obj: Any) -> int:
    """Signed 64-bit blake2b hash of `obj`'s canonical JSON (stable across runs and machines).

    Lone surrogates (from JSON `\\ud800` escapes) are hashed as they are, never an error."""
    data = json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big", signed=True)


def _whole(value: Any) -> bool:
    """A float that holds a whole number (Parquet and pandas store integer columns with nulls as floats)."""
    return isinstance(value, float) and value.is_integer()


def _coerce(name: str, value: Any) -> Any:
    """A row's value as the SamplingParams field takes it: whole floats as ints for integer fields,
    0 / 1 as false / true for `skip_special_tokens` and `include_stop_str_in_output` (JSON writers'
    booleans), `LOGPROBS_OFF` as None (no log probabilities), and a `prompt_logprobs` of false as
    None (none for this row, whatever `--prompt-logprobs` says; null takes the flag's)."""
    if name in _INT_FIELDS and _whole(value):
        return int(value)
    if name in _BOOL_FIELDS and value in (0, 1) and not isinstance(value, bool):
        return bool(value)
    if (name == "logprobs" and value == LOGPROBS_OFF) or (name == "prompt_logprobs" and value is False):
        return None
    return value


def unapplied_field_error(rec: dict, data_columns: frozenset[str] = frozenset()) -> str | None:
    """The error for a record that sets a generation parameter batchgen does not apply (see
    `UNAPPLIED_COLUMNS`), or None. Null, false, empty and neutral values (best_of=1, logprobs 0) pass, and
    so do `data_columns`: the columns the job uses as data (template fields, kept columns)."""
    for name, neutral in UNAPPLIED_COLUMNS.items():
        if name in data_columns:
            continue
        value = rec.get(name)
        if value is None or (value is False and neutral is not True):
            continue
        # the neutral value itself (0 / 1 for a neutral false / true), but not true for a neutral 1
        if value == neutral and (isinstance(neutral, bool) or (value is True) == (neutral is True)):
            continue
        if isinstance(value, list | dict) and not value:
            continue
        if name == "logit_bias" and isinstance(value, dict) and all(v == 0 for v in value.values()):
            continue
        shown = _shown(value)
        reason = UNAPPLIED_REASONS.get(
            name, f"batchgen does not apply {name} (the output would not be what the row asks for)"
        )
        return (
            f"field '{name}' is {shown}, but {reason}; remove the column, set it to null"
            + (f" or {to_json(neutral)}" if neutral is not None else "")
            + f", or pass --keep-columns {name} if it is data, not a parameter"
        )
    return None


class RowSampling:
    """Builds a row's `SamplingParams`: the command's `defaults` (SamplingParams keyword arguments)
    with the row's non-null values on top, validated once per distinct set of values."""

    def __init__(self, defaults: dict[str, Any]) -> None:
        self.defaults = dict(defaults)
        self._cache: dict[str, tuple[SamplingParams, int]] = {}

    def resolve(self, values: dict[str, Any]) -> tuple[SamplingParams | None, int, str | None]:
        """(params, hash of params, None) or (None, 0, error) for the defaults plus a row's overrides.

        Rows with the same overrides share one (read-only) SamplingParams, so the common case of no
        overrides costs a dict lookup instead of a validation per row."""
        overrides = tuple((k, v) for k, v in values.items() if v is not None)
        key = repr(overrides)
        hit = self._cache.get(key)
        if hit is not None:
            return hit[0], hit[1], None
        merged = dict(self.defaults)
        for k, v in overrides:
            merged[k] = _coerce(k, v)
        try:
            params = SamplingParams(**merged)
        except (ValueError, TypeError) as e:
            return None, 0, self._errors(overrides, e)
        if len(self._cache) >= 4096:  # bounded: per-row seeds would otherwise fill it
            self._cache.clear()
        self._cache[key] = (params, stable_hash(params.to_dict()))
        return params, self._cache[key][1], None

    def _errors(self, overrides: tuple[tuple[str, Any], ...], first: Exception) -> str:
        """The message for overrides SamplingParams refused with `first`: that error, then every
        other field that fails on its own (checked alone on the defaults), so a row with two bad
        values is fixed in one go rather than in two reruns."""
        # The field the message names first ("min_tokens (10) must be <= max_tokens (4)" is about
        # min_tokens), not the first field of the row that it mentions somewhere.
        # Whole words: the field `n` is a letter of almost every message.
        at = {k: _word_at(k, str(first)) for k, _ in overrides}
        named = sorted((k for k in at if at[k] >= 0), key=lambda k: at[k])
        message = (
            f"invalid sampling value in {f'field {named[0]!r}' if named else 'sampling fields'}: {first}"
        )
        for k, v in overrides:
            if named and k == named[0]:
                continue
            try:
                SamplingParams(**{**self.defaults, k: _coerce(k, v)})
            except (ValueError, TypeError) as e:
                # A rule between two fields (min_tokens <= max_tokens) checked against a default
                # would name a value the row does not have.
                if not any(_word_at(other, str(e)) >= 0 for other in (*SAMPLING_COLUMNS, "n") if other != k):
                    message += f"; and in field '{k}': {e}"
        return message + "; fix the value or remove it to use the default"


def _word_at(name: str, text: str) -> int:
    """Where `name` first appears in `text` as a whole word (not inside `min_tokens`, say), or -1."""
    m = re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", text)
    return m.start() if m else -1
