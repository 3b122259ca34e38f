"""Log probabilities as the engine returns them: the runner's `SampleLogprobs` turned into vLLM's
per-position dicts (`CompletionOutput.logprobs`, `RequestOutput.prompt_logprobs`), and which rows of
a prefill chunk are scored for prompt log probabilities (`scored_rows`).
"""

from __future__ import annotations

from typing import Any

from batchgen.engine.request import Request
from batchgen.model.sampler import SampleLogprobs
from batchgen.model.step import ScoredRows
from batchgen.outputs import Logprob


class TokenTexts:
    """Token id -> the token's text on its own (`Logprob.decoded_token`), decoded once per engine:
    at most one entry per vocabulary token, shared by all requests."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text


def position_logprobs(lp: SampleLogprobs, text: TokenTexts) -> dict[int, Logprob]:
    """One position's dict: token id -> `Logprob` of the `top` most likely tokens (ranks 1..k)
    and of the chosen token (sampled, or the prompt's next token) with its own rank."""
    entry = {t: Logprob(v, rank, text(t)) for rank, (t, v) in enumerate(lp.top, start=1)}
    entry.setdefault(lp.token_id, Logprob(lp.logprob, lp.rank, text(lp.token_id)))
    return entry


def output_logprobs(r: Request, text: TokenTexts) -> tuple[list[dict[int, Logprob]] | None, float | None]:
    """(per output token: its position's dict, the sum of the sampled tokens' log probabilities),
    or (None, None) when the request asked for none."""
    if r.output_logprobs is None:
        return None, None
    positions = [position_logprobs(lp, text) for lp in r.output_logprobs]
    return positions, sum(lp.logprob for lp in r.output_logprobs)


def prompt_logprobs(r: Request, text: TokenTexts) -> list[dict[int, Logprob] | None] | None:
    """`RequestOutput.prompt_logprobs`: None for the first prompt token, then one dict per prompt
    token; None when the request asked for none."""
    if r.prompt_logprobs is None:
        return None
    return [None, *(position_logprobs(lp, text) for lp in r.prompt_logprobs)]


def scored_rows(r: Request, start: int, num_real_tokens: int) -> ScoredRows | None:
    """The rows of a request's step share (`num_real_tokens` tokens from position `start`, drafts
    aside) whose logits score the prompt: positions from the first not scored yet up to the one
    before the prompt's last token (whose logits predict the first output token, not a prompt
    token). None when there are none, as for every request that did not ask.

    Positions scored before a preemption by recompute are computed again but not scored again;
    the prefix cache never skips a position not scored yet (`Request.max_cached_prefix`), so
    none is ever lost.

    Raises:
        RuntimeError: the step starts past the first position not scored yet (a broken invariant:
            that position's log probabilities would be lost).
    """
    if r.prompt_logprobs is None or not r.scores_prompt:
        return None
    done = len(r.prompt_logprobs)
    if start > done:
        raise RuntimeError(
            f"request {r.request_id!r}: the step starts at position {start}, but prompt log "
            f"probabilities stop at {done}; positions would be lost"
        )
    lo, hi = done, min(start + num_real_tokens, r.num_prompt_tokens - 1)
    if hi <= lo:
        return None
    top = r.sampling_params.prompt_logprobs or 0  # set: the request scores its prompt
    return ScoredRows(lo - start, r.token_ids[lo + 1 : hi + 1], top)
