"""Results handed back to callers (vLLM's `RequestOutput` / `CompletionOutput` shape)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """A token's log probability (natural log) at one position, as vLLM's `Logprob`.

    Attributes:
        logprob: log-softmax of the model's raw logits at the token (<= 0).
        rank: 1 for the most likely token at that position, 2 for the next, ...
        decoded_token: the token's text on its own.
    """

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence.

    Attributes:
        text: detokenized output, cut before a matched stop string.
        token_ids: generated token ids (including those of a matched stop string).
        finish_reason: "stop" (EOS, stop token or stop string), "length" (max_tokens or
            max_model_len) or "error" (the request was rejected; see `RequestOutput.error`).
        stop_reason: the stop string or stop token id that ended it, else None.
        logprobs: with `SamplingParams.logprobs` set, one dict per generated token: token id ->
            `Logprob` for the `logprobs` most likely tokens and the sampled one; else None.
        cumulative_logprob: sum of the sampled tokens' log probabilities, with `logprobs` set.
        reasoning_content: with a reasoning parser (`EngineConfig.reasoning_parser`), the
            thinking between `<think>` and `</think>` ("" for an empty one; `text` is then the
            answer after it, "" when the output ended inside its thinking); None when the output
            has no thinking or the engine has no parser (`text` is then the whole output).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    reasoning_content: str | None = None


@dataclass
class RequestMetrics:
    """Timestamps in seconds (`time.perf_counter()` clock); None when the event never happened."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token in seconds."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        """End-to-end latency in seconds."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class RequestOutput:
    """A finished (or rejected) request, as `LLM.generate` and `LLMEngine.step` return it.

    Attributes:
        prompt_logprobs: with `SamplingParams.prompt_logprobs` set (vLLM's meaning), one entry per
            prompt token: None for the first (nothing predicts it), then for token i a dict
            token id -> `Logprob` holding token i itself (its log probability given tokens 0..i-1
            and its rank) and the `prompt_logprobs` most likely tokens at that position, from
            the log-softmax in float32 of the model's raw logits at position i - 1. None when not
            asked (and for a rejected request). With n > 1 the prompt is scored once.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = None
    num_preemptions: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
