"""Request: one prompt's state inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from batchgen.sampling_params import SamplingParams

if TYPE_CHECKING:  # only a type here: the scheduler and block manager run without torch (`batchgen plan`)
    import torch

    from batchgen.model.step import StepInput


class Matcher(Protocol):
    """A structured request's grammar matcher as the scheduler and runner use it
    (`batchgen.engine.structured.RequestGrammar`, or `batchgen.engine.reasoning.ReasoningGrammar`
    around one)."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool: ...

    def accept(self, token_id: int) -> bool: ...

    @property
    def terminated(self) -> bool: ...

    def sync(self, output_token_ids: list[int]) -> bool: ...


class Reasoning(Protocol):
    """Where a request's output is in its thinking and its answer, with a reasoning parser
    (`batchgen.engine.reasoning.ReasoningState`)."""

    @property
    def answer_char(self) -> int | None:
        """Offset in `output_text` where the answer begins (None while thinking)."""
        ...

    def observe(self, request: Request) -> None: ...

    def split(self, request: Request, text: str, drop_last: bool) -> tuple[str | None, str]: ...


class RequestStatus(enum.Enum):
    """Where a request is: in the waiting queue, in the running batch, swapped to CPU, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


# eq=False: a request is its own object. The queues' `in` and `remove` then compare identities; a
# generated __eq__ compared every field (the token lists too) against each request it passed.
@dataclass(eq=False)
class Request:
    """A prompt being served, tracked by computed versus total tokens (no prefill/decode phase flag).

    `token_ids` holds the prompt followed by the generated tokens. `num_computed_tokens` counts the
    leading tokens whose K/V are in the cache; a step schedules some of the rest, and a new token is
    sampled when a step reaches the last one. Preemption by recompute resets the count to 0, so the
    request resumes by prefilling its prompt and its own outputs again.

    Attributes:
        request_id: caller's id (unique among live requests).
        token_ids: prompt + output token ids.
        num_prompt_tokens: length of the prompt in tokens.
        sampling_params: decoding options.
        max_tokens: output tokens allowed, resolved against `max_model_len`.
        eos_token_ids: ids that end the request (empty when `ignore_eos`).
        block_table: physical KV block ids, one per `block_size` tokens.
        block_hashes: prefix hashes of the request's full, computed blocks.
        swap_table: CPU swap block ids while the request is swapped out.
        num_cached_tokens: prompt tokens served from the prefix cache at admission.
        arrival_time / first_scheduled_time / first_token_time / finish_time: `time.perf_counter()` seconds.
        arrival_step: scheduler step at which the request joined the waiting queue.
        generator: the request's own sampling generator when it has a `seed`.
        output_logprobs: one `SampleLogprobs` per output token when `sampling_params.logprobs`
            is set, else None.
        prompt_logprobs: with `sampling_params.prompt_logprobs` set, one `SampleLogprobs` per prompt
            token from the second on, in order, as far as the prompt's logits have been computed
            (the i-th entry scores token i + 1); else None. Positions already scored are never
            asked again after a preemption by recompute.
        wait_for: the sibling (n > 1) whose prompt this request reuses from the prefix cache: not
            admitted while that sibling is running and has not computed its prompt yet.
        grammar: the matcher of a request with `structured_outputs` (set when its grammar is
            compiled, before the scheduler gets it; a `ReasoningGrammar` around it with a
            reasoning parser), else None.
        reasoning: where the output is in its thinking and answer, with a reasoning parser
            (`batchgen.engine.reasoning.ReasoningState`), else None.
        decode_input: the `StepInput` of this request's plain decodes, kept between steps and
            updated in place (`step_inputs.step_inputs(..., persistent=True)`), else None.
    """

    request_id: str
    token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    swap_table: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    arrival_step: int = 0
    first_scheduled_step: int | None = None
    num_preemptions: int = 0
    seq_no: int = 0
    generator: torch.Generator | None = None
    output_logprobs: list | None = None
    prompt_logprobs: list | None = None
    wait_for: Request | None = None
    grammar: Matcher | None = None
    reasoning: Reasoning | None = None
    decode_input: StepInput | None = field(default=None, repr=False)
    output_text: str = ""
    _detok_prefix_offset: int = 0
    _detok_read_offset: int = 0
    _stop_checked: int = 0  # characters of output_text already searched for stop strings

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def waits_for_prompt(self) -> bool:
        """Whether `wait_for` is running and still computing the prompt this request will reuse
        (a sibling that is waiting, swapped or done blocks nobody, so no two wait on each other)."""
        w = self.wait_for
        return (
            w is not None
            and w.status == RequestStatus.RUNNING
            and w.num_computed_tokens < w.num_prompt_tokens
        )

    @property
    def scores_prompt(self) -> bool:
        """Whether prompt log probabilities are asked and some are still to come."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def max_cached_prefix(self) -> int:
        """Leading tokens the prefix cache may serve: all, except while prompt log probabilities
        are still to come; then only the positions whose logits were already scored (a cache hit
        skips its positions' logits). vLLM takes no hits at all for such a request; this also lets
        one preempted after its prompt was scored take them again."""
        scored = self.prompt_logprobs
        return len(scored) if scored is not None and self.scores_prompt else self.num_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def remaining_work(self) -> int:
        """Tokens still to process: uncomputed tokens plus outputs not yet generated."""
        return (self.num_tokens - self.num_computed_tokens) + (self.max_tokens - self.num_output_tokens)

    @property
    def priority(self) -> int:
        return self.sampling_params.priority

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
