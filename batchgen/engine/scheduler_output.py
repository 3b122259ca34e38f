"""The scheduler's decision for one step (`SchedulerOutput`, one `ScheduledRequest` per request in
it), consumed by the engine and, through it, the model runner (vLLM v1's `sched/output.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchgen.engine.request import Request
from batchgen.model.step import is_decode


@dataclass
class ScheduledRequest:
    """A request's share of a step: `num_new_tokens` tokens from position `start` on.

    `spec_token_ids`: draft tokens to verify, the last `len(spec_token_ids)` of the
    `num_new_tokens` (they follow the request's last token and are not in `request.token_ids`).
    `samples` (set at construction, so it still holds once the step's tokens are appended): the
    step reaches the request's last token, so a new token is sampled (one per position with drafts).
    """

    request: Request
    start: int
    num_new_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_new_tokens - len(self.spec_token_ids) == self.request.num_tokens

    @property
    def is_decode(self) -> bool:
        return is_decode(self.num_new_tokens, self.samples)


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
