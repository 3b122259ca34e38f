"""Appending a step's sampled tokens to a request: drafts settled, log probabilities, reasoning,
grammar and stop conditions checked token by token (`Scheduler.update`'s general case)."""

from __future__ import annotations

from batchgen.engine.detokenizer import check_stop
from batchgen.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from batchgen.engine.spec_decode import accepted_tokens
from batchgen.engine.structured_check import grammar_refused
from batchgen.model.loading.tokenizer import Tokenizer


def append_sampled(
    item: ScheduledRequest,
    samples: list[tuple],
    out: SchedulerOutput,
    now: float,
    tokenizer: Tokenizer | None,
    max_model_len: int,
) -> str | None:
    """Append a sampling request's kept tokens one at a time, checking the stop conditions after
    each (`detokenizer.check_stop`), and set its computed tokens; returns the finish reason, or None.

    Args:
        item: the request's share of the step (its drafts, if any, are settled here:
            `spec_decode.accepted_tokens`).
        samples: (token id, `SampleLogprobs` or None, error or None) per sampled position.
        out: the step; its `num_accepted_tokens` and `num_output_tokens` grow here.
        now: `perf_counter` seconds (the first token's time).
    """
    r = item.request
    drafts = item.spec_token_ids
    kept = accepted_tokens(drafts, [t for t, _, _ in samples]) if drafts else [samples[0][0]]
    out.num_accepted_tokens += len(kept) - 1
    reason = None
    for token, logprobs, error in samples[: len(kept)]:
        if error is not None:  # no valid token: the request fails here, with what it has so far
            r.error, reason = error, "error"
            break
        r.token_ids.append(token)
        out.num_output_tokens += 1
        if r.output_logprobs is not None:
            r.output_logprobs.append(logprobs)
        if r.first_token_time is None:
            r.first_token_time = now
        if r.reasoning is not None:  # before the grammar: it takes answer tokens only
            r.reasoning.observe(r)
        if r.grammar is not None and not r.grammar.accept(token):  # the mask allowed no token
            r.error, reason = grammar_refused(r, token), "error"
            break
        if (reason := check_stop(r, tokenizer, max_model_len)) is not None:
            break
        if r.grammar is not None and r.grammar.terminated:  # the constraint is complete
            reason = "stop"
            break
    # Every token before the last appended one went through this step (the request's last token,
    # then accepted drafts): their K/V are valid. After an error, the last one's too.
    r.num_computed_tokens = len(r.token_ids) - (0 if reason == "error" else 1)
    return reason
