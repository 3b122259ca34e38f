"""JSON-lines output: strict JSON text of output values, and OpenAI batch output lines.

The final JSONL and OpenAI batch outputs are written by `batchgen.jobs.output.final_output.finalize_output`
through these helpers; `as_text` also gives mixed-type kept columns one text form in Parquet.
"""

from __future__ import annotations

import base64
import codecs
import datetime
import json
import math
from typing import Any


def json_default(value: Any) -> Any:
    """`json.dumps` fallback for values Arrow hands back: bytes as base64 text, dates and times in
    ISO 8601, anything else as its `str`."""
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    return str(value)


def _finite(value: Any) -> Any:
    """`value` with NaN and infinite floats (at any depth) as None: JSON has no literal for them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def to_json(value: Any) -> str:
    """Strict JSON text of an output value: non-finite floats as null, other non-JSON values by
    `json_default`, non-ASCII text as it is."""
    return json.dumps(_finite(value), ensure_ascii=False, default=json_default, allow_nan=False)


def as_text(value: Any) -> str | None:
    """One text form for a kept value that must go into a string column: a string as it is,
    anything else as JSON (the same whichever commit the row landed in)."""
    if value is None or isinstance(value, str):
        return value
    return to_json(value)


def openai_record(row: dict[str, Any], model: str) -> dict[str, Any]:
    """One OpenAI batch output line for a finished row (chat.completion or text_completion body,
    with usage; error rows get status 400 and an `error` object). Ids derive from the row hash, so
    a resumed run writes the same lines. A row with prompt log probabilities gets them where vLLM's
    OpenAI server puts them: in each choice (completions) or in the body (chat), as
    `vllm_prompt_logprobs`. A job with a reasoning parser (its rows have a `reasoning` key) gives
    each choice's thinking as `reasoning_content` (vLLM's OpenAI server's field): in the message
    of chat choices, beside `text` in completion choices."""
    suffix = f"{row['row_hash'] & 0xFFFFFFFFFFFFFFFF:016x}"
    request_id = f"req_{suffix}"
    record: dict[str, Any] = {"id": f"batch_req_{suffix}", "custom_id": row["id"]}
    if row["finish_reason"] == "error":
        message = row["error"] or "request failed"
        err = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
        record["response"] = {"status_code": 400, "request_id": request_id, "body": {"error": err}}
        record["error"] = {"code": "invalid_request", "message": message}
        return record
    usage = {
        "prompt_tokens": row["prompt_tokens"] or 0,
        "completion_tokens": row["completion_tokens"] or 0,
        "total_tokens": (row["prompt_tokens"] or 0) + (row["completion_tokens"] or 0),
    }
    first = {
        "output": row["output"],
        "finish_reason": row["finish_reason"],
        "logprobs": row.get("logprobs"),
        "reasoning": row.get("reasoning"),
    }
    completions = [first, *(row.get("more_choices") or ())]
    reasons = "reasoning" in row  # the job has a reasoning parser: every choice says its thinking
    prompt_logprobs = row.get("prompt_logprobs")
    scored = {} if prompt_logprobs is None else {"prompt_logprobs": vllm_prompt_logprobs(prompt_logprobs)}
    if row["endpoint"] == "completion":
        choices = [
            {
                "index": i,
                "text": c["output"],
                **({"reasoning_content": c.get("reasoning")} if reasons else {}),
                "logprobs": None if c.get("logprobs") is None else completion_logprobs(c["logprobs"]),
                "finish_reason": c["finish_reason"],
                **scored,
            }
            for i, c in enumerate(completions)
        ]
        body: dict[str, Any] = {"id": f"cmpl-{suffix}", "object": "text_completion"}
    else:
        choices = [
            {
                "index": i,
                "message": {
                    "role": "assistant",
                    "content": c["output"],
                    **({"reasoning_content": c.get("reasoning")} if reasons else {}),
                },
                "logprobs": None if c.get("logprobs") is None else chat_logprobs(c["logprobs"]),
                "finish_reason": c["finish_reason"],
            }
            for i, c in enumerate(completions)
        ]
        body = {"id": f"chatcmpl-{suffix}", "object": "chat.completion"}
    body.update({"created": row["created"], "model": model, "choices": choices, "usage": usage})
    if row["endpoint"] != "completion":
        body.update(scored)
    record["response"] = {"status_code": 200, "request_id": request_id, "body": body}
    record["error"] = None
    return record


def vllm_prompt_logprobs(positions: list[dict[str, Any] | None]) -> list[dict[str, Any] | None]:
    """vLLM's OpenAI-server `prompt_logprobs` from an output row's `prompt_logprobs` value
    (`batchgen.jobs.requests.prompt_token_logprobs`): per prompt token, null for the first, else
    {token id (text): {logprob, rank, decoded_token}} for the prompt token and the most likely ones."""
    out: list[dict[str, Any] | None] = []
    for p in positions:
        if p is None:
            out.append(None)
            continue
        entry = {
            str(p["token_id"]): {"logprob": p["logprob"], "rank": p["rank"], "decoded_token": p["token"]}
        }
        for rank, a in enumerate(p["top_logprobs"], start=1):
            entry.setdefault(
                str(a["token_id"]), {"logprob": a["logprob"], "rank": rank, "decoded_token": a["token"]}
            )
        out.append(entry)
    return out


def chat_logprobs(positions: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI chat `choices[].logprobs` from an output row's `logprobs` value
    (`batchgen.jobs.requests.token_logprobs`): {"content": [{token, logprob, bytes, top_logprobs}],
    "refusal": None}, `bytes` being the token's exact bytes as a list of integers."""
    content = [
        {
            "token": p["token"],
            "logprob": p["logprob"],
            "bytes": list(_bytes_of(p)),
            "top_logprobs": [
                {"token": a["token"], "logprob": a["logprob"], "bytes": list(_bytes_of(a))}
                for a in p["top_logprobs"]
            ],
        }
        for p in positions
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(positions: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI (legacy) completions `choices[].logprobs` from an output row's `logprobs` value:
    parallel lists `tokens`, `token_logprobs`, `top_logprobs` (token text -> log probability of the
    most likely tokens and, as in OpenAI's API, of the sampled one: up to logprobs + 1 entries) and
    `text_offset` (where each token starts in the generated text, in characters from 0; a token
    that ends inside a character gives the next token that character's offset too)."""
    # An incremental decoder holds back a character's first bytes until the rest comes, and turns
    # an invalid sequence into the one U+FFFD the text shows for it; a token whose first byte does
    # not continue the held-back bytes starts after that U+FFFD.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets, emitted = [], 0
    for p in positions:
        data = _bytes_of(p)
        held = decoder.getstate()[0]
        continues = bool(data) and 0x80 <= data[0] <= 0xBF
        offsets.append(emitted + (1 if held and not continues else 0))
        emitted += len(decoder.decode(data))
    return {
        "tokens": [p["token"] for p in positions],
        "token_logprobs": [p["logprob"] for p in positions],
        "top_logprobs": [{a["token"]: a["logprob"] for a in [*p["top_logprobs"], p]} for p in positions],
        "text_offset": offsets,
    }


def _bytes_of(entry: dict[str, Any]) -> bytes:
    """A token entry's bytes; the UTF-8 of its text for entries committed before batchgen stored
    the bytes (their parts read them as null)."""
    data = entry.get("bytes")
    return data if data is not None else (entry.get("token") or "").encode("utf-8", "backslashreplace")
