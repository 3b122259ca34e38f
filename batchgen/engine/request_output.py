"""A finished request as the caller gets it: its `RequestOutput` (text, tokens, finish reason, log
probabilities, times), vLLM's shape."""

from __future__ import annotations

from typing import Any

from batchgen.engine.detokenizer import final_texts
from batchgen.engine.logprobs import TokenTexts, output_logprobs, prompt_logprobs
from batchgen.engine.request import Request
from batchgen.outputs import CompletionOutput, RequestMetrics, RequestOutput


def request_output(r: Request, tokenizer: Any, token_texts: TokenTexts) -> RequestOutput:
    """The output of a finished request (one completion: an n > 1 request's children are merged by
    `parallel_sampling.SampleGroups`). `token_texts`: the engine's token id -> text, for log
    probabilities."""
    reasoning, text = final_texts(tokenizer, r)
    return RequestOutput(
        request_id=r.request_id,
        prompt=r.prompt,
        prompt_token_ids=r.prompt_token_ids,
        outputs=[
            CompletionOutput(
                0,
                text,
                r.output_token_ids,
                r.finish_reason,
                r.stop_reason,
                *output_logprobs(r, token_texts),
                reasoning_content=reasoning,
            )
        ],
        finished=True,
        metrics=RequestMetrics(r.arrival_time, r.first_scheduled_time, r.first_token_time, r.finish_time),
        num_cached_tokens=r.num_cached_tokens,
        error=r.error,
        num_preemptions=r.num_preemptions,
        prompt_logprobs=prompt_logprobs(r, token_texts),
    )
