"""The scheduler's decision for one step (`SchedulerOutput`, one `ScheduledRequest` per request in
it), consumed by the engine and, through it, the model runner (vLLM v1's `sched/output.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from batchgen.engine.request import Request
from batchgen.model.step import is_decode

_NO_DRAFTS: list[int] = []


class ScheduledRequest:
    """A request's share of a step: `num_new_tokens` tokens from position `start` on.

    `spec_token_ids`: draft tokens to verify, the last `len(spec_token_ids)` of the
    `num_new_tokens` (they follow the request's last token and are not in `request.token_ids`).
    `samples` (set at construction, so it still holds once the step's tokens are appended): the
    step reaches the request's last token, so a new token is sampled (one per position with drafts);
    a caller that knows it may pass it (the scheduler's decode fast path), else it is computed.

    A plain class with slots: the scheduler builds one per running request a step (a dataclass's
    `__post_init__` cost a third of the decode fast path).
    """

    __slots__ = ("num_new_tokens", "request", "samples", "spec_token_ids", "start")

    def __init__(
        self,
        request: Request,
        start: int,
        num_new_tokens: int,
        spec_token_ids: list[int] | None = None,
        samples: bool | None = None,
    ) -> None:
        self.request = request
        self.start = start
        self.num_new_tokens = num_new_tokens
        # One shared empty list for the requests without drafts (nothing appends to it), rather
        # than a new one a running request a step.
        self.spec_token_ids = _NO_DRAFTS if spec_token_ids is None else spec_token_ids
        self.samples = (
            start + num_new_tokens - len(self.spec_token_ids) == len(request.token_ids)
            if samples is None
            else samples
        )

    def __repr__(self) -> str:
        return (
            f"ScheduledRequest({self.request.request_id!r}, start={self.start}, "
            f"num_new_tokens={self.num_new_tokens}, spec_token_ids={self.spec_token_ids})"
        )

    @property
    def is_decode(self) -> bool:
        return is_decode(self.num_new_tokens, self.samples)


class StepCounts(NamedTuple):
    """A step's sizes, summed in one pass over its requests (`SchedulerOutput.counts`); the
    fields of `batchgen.engine.stats.StepStats` of the same names."""

    num_batched_tokens: int
    num_prompt_tokens: int  # tokens that are neither decodes nor drafts being verified
    num_drafts: int
    num_draft_tokens: int
    num_context_tokens: int
    num_attended_keys: int
    num_structured_seqs: int


@dataclass
class SchedulerOutput:
    """The scheduler's decision for one step, consumed by the model runner.

    Attributes:
        scheduled: the step's requests, decodes (`ScheduledRequest.is_decode`) first, then
            prefill chunks.
        swap_out: (device block, CPU block) copies to run before anything else.
        swap_in: (CPU block, device block) copies to run before the forward pass.
        preempted: requests preempted in this step.
        prefix_cache_queries / prefix_cache_hits: tokens looked up / found in the prefix cache.
        num_accepted_tokens: draft tokens the model agreed with, set by `Scheduler.update`.
        num_output_tokens: tokens appended to requests, set by `Scheduler.update`.
        num_shadow_drafts / num_shadow_accepted_tokens: drafts proposed while the gate was closed
            (never verified) whose fate the step's tokens settled, and how many of their tokens
            the model produced (`spec_decode.ShadowDrafts`), set by `Scheduler.update`.
        stalled: a running request found no free block and preemption was not allowed
            (`Scheduler.schedule(allow_preemption=False)`): the requests after it were left out.
        plain_decodes: every scheduled request is a decode of one token with its slot in a block
            it held already (the scheduler's fast path; `counts` then takes two short sums).
            False for a hand-built output, which is then counted in general.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_accepted_tokens: int = 0
    num_output_tokens: int = 0
    num_shadow_drafts: int = 0
    num_shadow_accepted_tokens: int = 0
    stalled: bool = False
    plain_decodes: bool = False

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.scheduled if s.is_decode)

    @property
    def num_drafts(self) -> int:
        """Requests verifying draft tokens in the step."""
        return sum(1 for s in self.scheduled if s.spec_token_ids)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(s.spec_token_ids) for s in self.scheduled)

    @property
    def num_verify_tokens(self) -> int:
        """Tokens of the requests verifying drafts (their last token and the drafts)."""
        return sum(s.num_new_tokens for s in self.scheduled if s.spec_token_ids)

    def counts(self) -> StepCounts:
        """The step's `StepCounts`, in one pass over `scheduled` (each property above is a pass
        of its own)."""
        if self.plain_decodes:  # one token each at `start`: it attends to `start + 1` keys
            n = len(self.scheduled)
            context = sum(s.start for s in self.scheduled) + n
            structured = sum(s.request.grammar is not None for s in self.scheduled)
            return StepCounts(n, 0, 0, 0, context, context, structured)
        num_tokens = num_decode_tokens = num_drafts = num_draft_tokens = 0
        num_context = num_attended = num_structured = 0
        for s in self.scheduled:
            n, begin = s.num_new_tokens, s.start
            num_tokens += n
            num_context += begin + n
            # tokens begin .. begin + n - 1 attend to begin + 1 .. begin + n keys
            num_attended += n * begin + n * (n + 1) // 2
            if s.spec_token_ids:  # the last token and its drafts: not prompt tokens
                num_drafts += 1
                num_draft_tokens += len(s.spec_token_ids)
                num_decode_tokens += n
            elif n == 1 and s.samples:  # a decode (`is_decode`)
                num_decode_tokens += 1
            if s.samples and s.request.grammar is not None:
                num_structured += 1
        return StepCounts(
            num_tokens,
            num_tokens - num_decode_tokens,
            num_drafts,
            num_draft_tokens,
            num_context,
            num_attended,
            num_structured,
        )
