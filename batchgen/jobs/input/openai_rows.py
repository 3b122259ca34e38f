"""Turning one line of an OpenAI batch file into a `JobRow`: its `custom_id`, the endpoint its `url`
names, the prompt and sampling parameters in its `body`, or the line's error.

The line format is OpenAI's Batch API input (`{"custom_id", "method", "url", "body"}`, one request a
line); the output lines (`batchgen.jobs.output.json_lines.openai_record`) are its output format.
"""

from __future__ import annotations

from typing import Any

from batchgen.jobs.input import row_chat
from batchgen.jobs.input.formats import LONE_SURROGATE, check_messages, is_utf8, text_error
from batchgen.jobs.input.row_sampling import (
    LOGPROB_FIELDS,
    SAMPLING_COLUMNS,
    UNAPPLIED_REASONS,
    requested_logprobs,
    stable_hash,
)
from batchgen.jobs.input.row_structured import BODY_FIELDS, row_constraint
from batchgen.jobs.input.rows import JobRow, RowParser

OPENAI_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
# Request fields honoured (or, like `model` and `user`, harmless to ignore). Anything else that is set
# (logit_bias, tools, response_format, ...) would silently change the meaning of the output.
OPENAI_BODY_FIELDS = frozenset(
    {"messages", "prompt", "model", "user", "metadata", "stream", "n", "max_tokens", "max_completion_tokens"}
    | set(SAMPLING_COLUMNS)
    | set(LOGPROB_FIELDS)
    | set(BODY_FIELDS)
    | {row_chat.FIELD}
)


class OpenAIRowParser(RowParser):
    """Builds `JobRow`s from the lines of an OpenAI batch file; custom_ids must be unique within a
    pass over the file (`start()` begins one).

    Args:
        options: the reader's `ReaderOptions` (its sampling defaults; the column options do not
            apply to OpenAI batch files, `batchgen.jobs.input.reader.JobReader` refuses them).
    """

    def __init__(self, options: Any) -> None:  # a ReaderOptions, as RowParser's
        super().__init__(options, row_index_ids=False)
        self._seen_custom_ids: dict[int, int | None] = {}  # stable hash of a custom_id -> its first line

    def start(self) -> None:
        """Forget the custom_ids seen so far: a new pass over the input begins."""
        super().start()
        self._seen_custom_ids = {}

    def row(self, row_index: int, line_number: int | None, rec: dict) -> JobRow:
        """A line of an OpenAI batch file (`custom_id`, `method`, `url`, `body`)."""
        cid = rec.get("custom_id")
        body: dict[str, Any] = rec.get("body") or {}  # a dict unless the envelope error says not
        url = rec.get("url")
        endpoint = OPENAI_ENDPOINTS.get(url) if isinstance(url, str) else None
        usable_cid = cid if isinstance(cid, str) and cid and is_utf8(cid) else None
        err = self._envelope_error(rec, line_number, cid, usable_cid, url, endpoint)
        prompt = None
        if err is None:
            prompt, err = _body_prompt(body, endpoint)
        if err is None:
            err = _unsupported_field_error(body)
        field = None
        kwargs = None
        if err is None:
            kwargs, err = row_chat.row_kwargs(
                body, self.options.chat_template_kwargs, f"field 'body.{row_chat.FIELD}'"
            )
        if err is None:
            values, err = _sampling_values(body, endpoint)
            err = err and err.replace("field '", "field 'body.")  # the field is in the body
        if err is None:  # its messages name the body's fields themselves
            values["structured_outputs"], field, err = row_constraint(body, BODY_FIELDS, prefix="body.")
            field = field or self.flag_label
        if err is None:
            params, params_hash, err = self._sampling(values)
            err = err and err.replace("field '", "field 'body.")
        if err is not None:
            return self.error_row(
                row_index, line_number, usable_cid, err, raw=rec, endpoint=endpoint or "chat"
            )
        return JobRow(
            row_index=row_index,
            id=cid,
            prompt=prompt,
            sampling_params=params,
            line_number=line_number,
            keep=None,
            row_hash=stable_hash([cid, endpoint, prompt, params_hash, *row_chat.own_kwargs(body)]),
            endpoint=endpoint,
            constraint_field=field,
            chat_template_kwargs=kwargs,
        )

    def _envelope_error(
        self,
        rec: dict,
        line_number: int | None,
        cid: Any,
        usable_cid: str | None,
        url: Any,
        endpoint: str | None,
    ) -> str | None:
        """What is wrong with the line around its body (custom_id, method, url, body an object), or
        None; a custom_id that passes is remembered, so its next use is a duplicate."""
        if isinstance(cid, str) and cid and usable_cid is None:
            return f"field 'custom_id' {LONE_SURROGATE}; fix it"
        if "custom_id" not in rec and "body" not in rec and ("prompt" in rec or "messages" in rec):
            return (
                "this line is a plain request (prompt or messages), but the file's first line is an "
                "OpenAI batch request; a file holds one format, so put plain lines in a file of their own "
                'or wrap this one as {"custom_id": ..., "method": "POST", "url": ..., "body": {...}}'
            )
        if not isinstance(cid, str) or not cid:
            return "field 'custom_id' is missing or not a non-empty string; give each request a unique id"
        key = stable_hash(cid)
        first = self._seen_custom_ids.get(key)
        if first is not None:
            return f"duplicate custom_id '{cid}' (first used on line {first}); make each custom_id unique"
        self._seen_custom_ids[key] = line_number
        method = rec.get("method", "POST")
        if method != "POST":
            return f"field 'method' is {method!r}; batch requests must use \"POST\""
        if endpoint is None:
            return f"field 'url' is {url!r}; use one of {', '.join(OPENAI_ENDPOINTS)}"
        if not isinstance(rec.get("body"), dict):
            return "field 'body' is missing or not an object; put the request parameters in 'body'"
        return None


def _body_prompt(body: dict, endpoint: str | None) -> tuple[str | list[dict] | None, str | None]:
    """The prompt of a body: chat messages (`/v1/chat/completions`) or one prompt string
    (`/v1/completions`); or the error naming the field and the fix."""
    if endpoint == "chat":
        prompt, err = check_messages(body.get("messages"), "body.messages")
        if err is not None and body.get("messages") is None and body.get("prompt") is not None:
            err += "; a body with a 'prompt' goes to url /v1/completions"
        return prompt, err
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        err = "field 'body.prompt' must be a non-empty string (one prompt per request)"
        if body.get("messages") is not None and prompt is None:
            err += "; a body with 'messages' goes to url /v1/chat/completions"
        return prompt, err
    return prompt, text_error(prompt, "body.prompt")


def _unsupported_field_error(body: dict) -> str | None:
    """The error for the first body field batchgen does not apply that asks for something, or None."""
    unsupported = sorted(k for k, v in body.items() if k not in OPENAI_BODY_FIELDS and not _unset(v))
    if not unsupported:
        return None
    name = unsupported[0]
    reason = UNAPPLIED_REASONS.get(name, "it would change the output")
    return (
        f"field 'body.{name}' is not supported by batchgen ({reason}); "
        f"remove it (supported: {', '.join(sorted(OPENAI_BODY_FIELDS))})"
    )


def _sampling_values(body: dict, endpoint: str | None) -> tuple[dict[str, Any], str | None]:
    """The body's sampling fields by SamplingParams name (`max_completion_tokens` wins over
    `max_tokens` when set; `logprobs` in the dialect of the endpoint), or the error of its log
    probability fields."""
    # The newer name wins when it is set; a null one does not hide max_tokens.
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    values = {k: body.get(k) for k in SAMPLING_COLUMNS if k != "max_tokens"}
    values["max_tokens"] = max_tokens
    values["n"] = body.get("n")  # completions in the line's `choices` (OpenAI batch output only)
    values["logprobs"], err = requested_logprobs(
        body.get("logprobs"), body.get("top_logprobs"), chat_api=endpoint == "chat"
    )
    return values, err


def _unset(value: Any) -> bool:
    """Whether an OpenAI body field asks for nothing: null, false, empty, or 0."""
    if value is None or value is False or (isinstance(value, list | dict) and not value):
        return True
    return value == 0 and value is not True
