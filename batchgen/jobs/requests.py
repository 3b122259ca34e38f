"""A job row's trip through the engine: the prompt it sends, its token ids, the output row it gets.

`prepare_row` renders and tokenizes a row (chat template, system prompt) and applies
`--truncate-prompt`; `output_result` turns the engine's `RequestOutput` into the row written to the
output; `error_result` is the row written for a row that never ran.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from batchgen.jobs.input.rows import JobRow
from batchgen.jobs.options import JobOptions, flag_hint
from batchgen.jobs.output.token_bytes import TokenBytes, token_text
from batchgen.jobs.truncate import truncate_chat, truncate_ids, uncuttable_tokens
from batchgen.model.loading.tokenizer import Tokenizer
from batchgen.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass(slots=True)
class Prepared:
    """A row ready for the engine: its token ids (None when it cannot run) and their count."""

    row: JobRow
    token_ids: list[int] | None
    prompt_tokens: int


def with_template_kwargs(prompt: str | list[dict], row: JobRow) -> str | list[dict] | dict:
    """`prompt` as the engine takes it: chat messages with the row's `chat_template_kwargs` as
    `{"messages", "chat_template_kwargs"}`; anything else as it is."""
    if isinstance(prompt, list) and row.chat_template_kwargs:
        return {"messages": prompt, "chat_template_kwargs": row.chat_template_kwargs}
    return prompt


def engine_prompt(row: JobRow, system_prompt: str | None, chat: bool) -> str | list[dict]:
    """What the engine encodes for a row: messages (system prompt added unless present), a plain
    prompt wrapped as a user message when `chat`, or the text (OpenAI completions stay raw)."""
    p = row.prompt
    if p is None:
        raise ValueError(f"{row.where} is an error row: it has no prompt")
    if isinstance(p, list):
        if system_prompt and not any(m["role"] == "system" for m in p):
            return [{"role": "system", "content": system_prompt}, *p]
        return p
    if row.endpoint == "completion":
        return p
    if chat:
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        return [*system, {"role": "user", "content": p}]
    return f"{system_prompt}\n\n{p}" if system_prompt else p


class PromptEngine(Protocol):
    """What `prepare_row` asks of an engine (an `Engine`, or `batchgen plan`'s tokenizer-only one)."""

    @property
    def tokenizer(self) -> Tokenizer | None: ...

    def encode_prompt(self, prompt: object) -> tuple[str | None, list[int]]: ...

    def check_prompt_len(self, num_tokens: int) -> str | None: ...


def prepare_row(
    row: JobRow, engine: PromptEngine, options: JobOptions, chat: bool, bos: int | None, max_len: int
) -> tuple[Prepared | None, str | None]:
    """Tokenize a row and apply --truncate-prompt; (prepared, None) or (prepared or None, error)."""
    prompt = engine_prompt(row, options.system_prompt, chat)
    try:
        _, ids = engine.encode_prompt(with_template_kwargs(prompt, row))
    except Exception as e:  # tokenizer and chat-template errors are this row's problem only
        return None, f"{row.where}: the prompt could not be tokenized ({e}); fix the prompt field"
    n = len(ids)
    too_long = engine.check_prompt_len(n)
    if too_long is not None:
        if options.truncate_prompt is None:
            return Prepared(row, None, n), (
                f"{row.where}: the prompt is too long: {too_long}{flag_hint(too_long)}; "
                "or pass --truncate-prompt left|right"
            )
        room = min(row.params.max_tokens or 1, max_len // 2)
        keep = max_len - room
        if isinstance(prompt, list) and engine.tokenizer is not None:
            cut: list[int] | None
            try:
                cut = truncate_chat(
                    prompt,
                    options.truncate_prompt,
                    keep,
                    lambda m: engine.encode_prompt(with_template_kwargs(m, row))[1],
                    engine.tokenizer,
                )
            except Exception:  # a cut that empties the only message cannot be rendered: the row fails
                cut = None
            if cut is None:
                error = _uncuttable_error(row, prompt, keep, engine, options, engine.tokenizer)
                return Prepared(row, None, n), error
            ids = cut
        else:
            ids = truncate_ids(ids, options.truncate_prompt, keep, bos)
    row.prompt = None  # free the text: only the token ids travel on
    return Prepared(row, ids, len(ids)), None


def _uncuttable_error(
    row: JobRow,
    messages: list[dict],
    keep: int,
    engine: PromptEngine,
    options: JobOptions,
    tokenizer: Tokenizer,
) -> str:
    """The error of a chat prompt `--truncate-prompt` cannot fit into `keep` tokens, naming what
    takes the room: the system message (the row's or --system-prompt's) or the template itself."""
    system, fixed = uncuttable_tokens(
        messages, lambda m: engine.encode_prompt(with_template_kwargs(m, row))[1], tokenizer
    )
    head = f"{row.where}: the chat prompt cannot be cut to {keep} tokens and keep any of its text: "
    took = f" ({fixed} tokens with the template)" if fixed is not None else ""
    if system:
        own = isinstance(row.prompt, list) and any(m.get("role") == "system" for m in row.prompt)
        source = "the row's system message" if own or not options.system_prompt else "--system-prompt"
        return (
            f"{head}its system message is {system} tokens{took} and is never cut; shorten {source} "
            "or raise --max-model-len"
        )
    took = f" ({fixed} tokens with its own default system prompt)" if fixed is not None else ""
    return f"{head}the chat template takes that room{took}; raise --max-model-len"


def result_row(row: JobRow, **values: Any) -> dict[str, Any]:
    """The output row of `row` with `values` (output, finish_reason, token counts, times) set."""
    base = {
        "row_index": row.row_index,
        "id": row.id,
        "row_hash": row.row_hash,
        "endpoint": row.endpoint,
        "created": int(time.time()),
    }
    base.update(values)
    return base


def error_result(row: JobRow, message: str, prompt_tokens: int | None = None) -> dict[str, Any]:
    """The output row of a row that did not run: finish_reason "error" and `message`."""
    return result_row(
        row, finish_reason="error", error=message, prompt_tokens=prompt_tokens, completion_tokens=0
    )


def output_result(p: Prepared, out: RequestOutput, token_bytes: TokenBytes | None = None) -> dict[str, Any]:
    """The output row of a prepared row from the engine's `RequestOutput` `out`; `token_bytes`
    (the engine tokenizer's) gives the bytes of the tokens in its log probabilities.

    A request with n > 1 completions (a row's or an OpenAI batch line's `n`, or `--n`) keeps the
    first in `output` and the others in `more_choices`; `completion_tokens` counts them all, as
    OpenAI's usage does. The final output lists them all in `choices` (`batchgen.jobs.output.final_output`)."""
    completions = out.outputs
    c = completions[0]
    metrics = out.metrics
    values: dict[str, Any] = {
        "prompt_tokens": len(out.prompt_token_ids) or p.prompt_tokens,
        "completion_tokens": sum(len(x.token_ids) for x in completions),
        "finish_reason": c.finish_reason or "length",
        "ttft_s": metrics.ttft,
        "latency_s": metrics.latency,
    }
    if out.error or any(x.finish_reason == "error" for x in completions):
        message = out.error or "the engine rejected the request"
        if p.row.constraint_field and message.startswith("structured_outputs."):
            # The engine names structured_outputs' field; the row's own field (or flag) is clearer.
            message = p.row.constraint_field + message[message.find(" ") :]
        values["finish_reason"] = "error"
        values["error"] = f"{p.row.where}: {message}{flag_hint(message)}"
        return result_row(p.row, **values)
    params = p.row.params
    top = params.logprobs
    token_bytes = token_bytes or TokenBytes(None)
    values["output"] = c.text
    values["reasoning"] = c.reasoning_content
    values.update(_logprob_values(c, top, token_bytes))
    if out.prompt_logprobs is not None:
        values["prompt_logprobs"] = prompt_token_logprobs(
            out.prompt_token_ids, out.prompt_logprobs, params.prompt_logprobs or 0, token_bytes
        )
    if len(completions) > 1:
        values["more_choices"] = [
            {
                "output": x.text,
                "finish_reason": x.finish_reason or "length",
                "completion_tokens": len(x.token_ids),
                "reasoning": x.reasoning_content,
                **_logprob_values(x, top, token_bytes),
            }
            for x in completions[1:]
        ]
    return result_row(p.row, **values)


def _logprob_values(c: CompletionOutput, top: int | None, token_bytes: TokenBytes) -> dict[str, Any]:
    """`logprobs` and `cumulative_logprob` of a completion that has log probabilities, else {}."""
    if c.logprobs is None:
        return {}
    return {
        "logprobs": token_logprobs(c.token_ids, c.logprobs, top or 0, token_bytes),
        "cumulative_logprob": c.cumulative_logprob,
    }


def token_logprobs(
    token_ids: list[int], positions: list[dict[int, Logprob]], top: int, token_bytes: TokenBytes
) -> list[dict[str, Any]]:
    """The `logprobs` output value of a completion: per generated token, its `token_id`, `token`
    (its text alone; OpenAI's "bytes:\\xNN" name for part of a character), `bytes` (exact),
    `logprob` (natural log) and `top_logprobs`, the `top` most likely tokens at that position, most
    likely first, each as {token_id, token, bytes, logprob}.

    Args:
        token_ids: the generated token ids.
        positions: `CompletionOutput.logprobs`, one dict token id -> `Logprob` per generated token.
        top: the request's `SamplingParams.logprobs`.
        token_bytes: the tokenizer's token id -> bytes.
    """

    return [
        _position_entry(token_id, position, top, token_bytes)
        for token_id, position in zip(token_ids, positions, strict=True)
    ]


def prompt_token_logprobs(
    token_ids: list[int], positions: list[dict[int, Any] | None], top: int, token_bytes: TokenBytes
) -> list[dict[str, Any] | None]:
    """The `prompt_logprobs` output value of a row: per prompt token, None for the first (nothing
    predicts it), then the `token_logprobs` entry of the prompt token with its `rank` added.

    Args:
        token_ids: the prompt's token ids (as the engine ran them).
        positions: `RequestOutput.prompt_logprobs` (None, then one dict token id -> `Logprob`).
        top: the request's `SamplingParams.prompt_logprobs`.
        token_bytes: the tokenizer's token id -> bytes.
    """
    entries: list[dict[str, Any] | None] = [None] if token_ids else []
    for token_id, position in zip(token_ids[1:], positions[1:], strict=True):
        assert position is not None  # only the first position has none
        entry = _position_entry(token_id, position, top, token_bytes)
        entries.append({**entry, "rank": position[token_id].rank})
    return entries


def _position_entry(token_id: int, position: dict[int, Any], top: int, token_bytes: TokenBytes) -> dict:
    """One position's entry: the chosen token's {token_id, token, bytes, logprob} and, in
    `top_logprobs`, the `top` most likely tokens' (rank order)."""

    def entry(t: int, lp: Any) -> dict[str, Any]:
        data = token_bytes(t, lp.decoded_token)
        return {"token_id": t, "token": token_text(data), "bytes": data, "logprob": lp.logprob}

    alternatives = sorted((lp.rank, t, lp) for t, lp in position.items() if lp.rank <= top)
    chosen = entry(token_id, position[token_id])
    chosen["top_logprobs"] = [entry(t, lp) for _, t, lp in alternatives]
    return chosen
