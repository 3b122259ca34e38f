"""A job row's `chat_template_kwargs` (vLLM's name): extra variables for the tokenizer's chat
template, such as Qwen3's `{"enable_thinking": false}`.

The job's `--chat-template-kwargs` (a JSON object) applies to every chat row; a row's own
`chat_template_kwargs` field (a plain row's column, an OpenAI batch line's `body` field) is merged
over it key by key, so the row's own values win. A value that is not an object is that row's error.
"""

from __future__ import annotations

import json
from typing import Any

FIELD = "chat_template_kwargs"
# Arguments batchgen itself passes to `apply_chat_template`: a template variable cannot take them.
RESERVED_KEYS = ("conversation", "add_generation_prompt", "tokenize")


def kwargs_error(value: Any, label: str) -> str | None:
    """What is wrong with a `chat_template_kwargs` value (an object whose keys are strings, none of
    `RESERVED_KEYS`), naming it as `label`, or None."""
    if not isinstance(value, dict):
        shown = json.dumps(value)[:80] if _jsonable(value) else type(value).__name__
        return (
            f"{label} must be a JSON object of chat template variables, got {shown}; "
            'write e.g. {"enable_thinking": false}'
        )
    bad = [k for k in value if not isinstance(k, str) or k in RESERVED_KEYS]
    if bad:
        return (
            f"{label} may not set {', '.join(map(str, bad))}: batchgen passes "
            f"{', '.join(RESERVED_KEYS)} to the chat template itself; remove them"
        )
    return None


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def parse_chat_template_kwargs(text: str) -> dict[str, Any]:
    """The `--chat-template-kwargs` flag's value: a JSON object, e.g. '{"enable_thinking": false}'.

    Raises:
        ValueError: not JSON, or not an object (the message names the flag and the fix).
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"--chat-template-kwargs {text!r} is not JSON ({e.msg}); write a JSON object, e.g. "
            "'{\"enable_thinking\": false}'"
        ) from None
    err = kwargs_error(value, "--chat-template-kwargs")
    if err is not None:
        raise ValueError(err)
    return value


def row_kwargs(
    rec: dict, default: dict[str, Any] | None, label: str
) -> tuple[dict[str, Any] | None, str | None]:
    """(the chat template variables of a row, None) or (None, error).

    Args:
        rec: the record holding the row's own `chat_template_kwargs` (a plain row, a batch body).
        default: the job's `--chat-template-kwargs` (None: none).
        label: how messages name the row's field ("field 'body.chat_template_kwargs'").

    Returns:
        The job's variables with the row's own merged over them key by key, None when neither
        sets any.
    """
    own = rec.get(FIELD)
    if own is None:
        return (dict(default) if default else None), None
    err = kwargs_error(own, label)
    if err is not None:
        return None, err
    merged = {**(default or {}), **own}
    return merged or None, None


def own_kwargs(rec: dict, data_columns: frozenset[str] = frozenset()) -> list[Any]:
    """[the row's own chat_template_kwargs] for its resume hash, [] when it sets none (so a row
    without one keeps the hash it had before the field existed)."""
    value = None if FIELD in data_columns else rec.get(FIELD)
    return [] if value is None else [value]
