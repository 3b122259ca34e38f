"""Incremental detokenization and the stop conditions checked after each new token."""

from __future__ import annotations

from batchgen.engine.request import Request
from batchgen.model.loading.tokenizer import Tokenizer

# Tokens decoded again before the read offset, so merges across the boundary (spaces, multi-byte
# characters) come out as they would in a one-shot decode.
_CONTEXT_TOKENS = 6


def detokenize_incrementally(tokenizer: Tokenizer, request: Request) -> str:
    """Append the text of the request's newest tokens to `request.output_text`; returns the new text.

    Text is released only once it no longer ends in U+FFFD, so a character split over several byte
    tokens appears whole. Cost per call is O(context), not O(output length).
    """
    ids = request.output_token_ids
    skip = request.sampling_params.skip_special_tokens
    prefix = request._detok_prefix_offset
    read = request._detok_read_offset
    seen = tokenizer.decode(ids[prefix:read], skip_special_tokens=skip)
    full = tokenizer.decode(ids[prefix:], skip_special_tokens=skip)
    if len(full) <= len(seen) or full.endswith("\ufffd"):
        return ""
    new_text = full[len(seen) :]
    request.output_text += new_text
    # The next call re-decodes from here: some context before the new tokens, never past what was
    # already read, so its `seen` text still ends where output_text ends.
    request._detok_prefix_offset = min(read, max(0, len(ids) - _CONTEXT_TOKENS))
    request._detok_read_offset = len(ids)
    return new_text


def check_stop(request: Request, tokenizer: Tokenizer | None, max_model_len: int) -> str | None:
    """After a token was appended: the finish reason ("stop" / "length"), or None to go on.

    Order as in vLLM: EOS (unless `ignore_eos`), stop token ids, stop strings (text cut before the
    match), then `max_tokens` and `max_model_len`. EOS and stop ids count only once `min_tokens`
    tokens exist, stop strings only once more than `min_tokens` do (vLLM's v1 detokenizer); a stop
    string completed before then is not looked for again. With a reasoning parser
    (`Request.reasoning`), stop strings are looked for in the answer only, never in the thinking.
    """
    params = request.sampling_params
    tokens = request.token_ids
    token = tokens[-1]
    # (`num_output_tokens` and `num_tokens` inlined: this runs for every token of every request)
    num_out = len(tokens) - request.num_prompt_tokens
    if num_out >= params.min_tokens:
        if token in request.eos_token_ids:
            return "stop"
        if params.stop_token_ids and token in params.stop_token_ids:
            request.stop_reason = token
            return "stop"
    if params.stop is not None and params.stop_strings:  # (the property builds a list)
        assert (
            tokenizer is not None
        )  # the engine's scheduler has its tokenizer; bare ones take no stop strings
        detokenize_incrementally(tokenizer, request)  # the text is kept up to date anyway
        # The text since the last check (a reasoning parser may have detokenized it already).
        new_len = len(request.output_text) - request._stop_checked
        request._stop_checked = len(request.output_text)
        reasoning = request.reasoning
        # With a reasoning parser, stop strings are looked for in the answer's text only.
        answer_char = 0 if reasoning is None else reasoning.answer_char
        if (
            new_len > 0
            and answer_char is not None
            and num_out > params.min_tokens
            and _cut_at_stop_string(request, new_len, answer_char)
        ):
            return "stop"
    if num_out >= request.max_tokens or len(tokens) >= max_model_len:
        return "length"
    return None


def _cut_at_stop_string(request: Request, new_len: int, answer_char: int = 0) -> bool:
    """Find the earliest stop string that overlaps the new text and lies in the answer (from
    `answer_char` on); cut the output before it."""
    text = request.output_text
    longest = max(len(s) for s in request.sampling_params.stop_strings)
    search_from = max(answer_char, len(text) - new_len - longest + 1)
    best: tuple[int, str] | None = None
    for stop in request.sampling_params.stop_strings:
        pos = text.find(stop, search_from)
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, stop)
    if best is None:
        return False
    keep = len(best[1]) if request.sampling_params.include_stop_str_in_output else 0
    request.output_text = text[: best[0] + keep]
    request.stop_reason = best[1]
    return True


def final_text(tokenizer: Tokenizer, request: Request) -> str:
    """The request's output text: cut at its stop string, else a one-shot decode of its tokens,
    less the token that stopped it (EOS or a stop token id) unless `include_stop_str_in_output`,
    as vLLM's detokenizer leaves it out."""
    params = request.sampling_params
    if request.stop_reason is not None and isinstance(request.stop_reason, str):
        return request.output_text
    ids = request.output_token_ids
    if drops_last_token(request):
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)


def drops_last_token(request: Request) -> bool:
    """Whether the output text leaves out the request's last token: it stopped ("stop") without a
    stop string, so on EOS or a stop token id, and `include_stop_str_in_output` is off."""
    return (
        request.finish_reason == "stop"
        and not isinstance(request.stop_reason, str)
        and not request.sampling_params.include_stop_str_in_output
    )


def final_texts(tokenizer: Tokenizer, request: Request) -> tuple[str | None, str]:
    """(reasoning or None, text) of a finished request: `final_text`, split into its thinking and
    its answer when the engine has a reasoning parser (`Request.reasoning`); (None, the whole text)
    without one."""
    text = final_text(tokenizer, request)
    if request.reasoning is None:
        return None, text
    return request.reasoning.split(request, text, drops_last_token(request))
