"""The scheduler: one unified step under a token budget and a sequence budget.

There are no prefill and decode phases. Each request knows how many of its tokens are computed; a step
hands out tokens until each catches up (vLLM v1's design, after Orca's iteration-level scheduling, Yu et
al. 2022). A decode is one token, an unfinished prompt gets its next chunk (chunked prefill), and both
share a step. Running requests come first, then swapped ones, then waiting ones in policy order.

The scheduler owns the request lifecycle: `schedule()` decides a step, `update()` applies what the
step sampled (tokens appended, stop conditions, full blocks cached, finished requests freed), as
vLLM v1's `update_from_output` and nano-vllm's `postprocess` do.

With a `proposer` (speculative decoding, `engine.spec_decode`), a running greedy decode may carry
draft tokens while the running batch is at most `speculative_max_batch`: it is scheduled as
`1 + len(drafts)` tokens, and `update()` keeps the drafts the model agrees with and rolls the rest
back (computed tokens, and the blocks taken only for rejected drafts).
"""

from __future__ import annotations

import sys
import time
from collections import deque

from batchgen.engine.appending import append_sampled
from batchgen.engine.block_manager import BlockManager
from batchgen.engine.detokenizer import check_stop
from batchgen.engine.policy import Policy
from batchgen.engine.request import Request, RequestStatus
from batchgen.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from batchgen.engine.spec_decode import NgramProposer, ShadowDrafts, draft_with_slots
from batchgen.model.loading.tokenizer import Tokenizer
from batchgen.model.step import StepOutput

__all__ = ["ScheduledRequest", "Scheduler", "SchedulerOutput"]


class Scheduler:
    """Decides each step's batch and keeps the queues.

    Args:
        block_manager: the KV block pool.
        policy: waiting-queue order and victim rule.
        max_num_seqs: most sequences per step.
        max_num_batched_tokens: most tokens per step.
        enable_chunked_prefill: allow a prompt to be split across steps; when off a prompt is
            scheduled whole or not at all.
        preemption_mode: "recompute" or "swap" (falls back to recompute when swap space is full).
        tokenizer: decodes outputs for stop strings (None: no request may have stop strings).
        max_model_len: a request stops ("length") once it holds this many tokens (None: no limit).
        proposer: draft tokens for greedy decodes (None: no speculative decoding).
        speculative_max_batch: drafts are proposed only in steps that start with at most this
            many running requests (the gate; 0: never).
    """

    def __init__(
        self,
        block_manager: BlockManager,
        policy: Policy[Request],
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        preemption_mode: str = "recompute",
        *,
        tokenizer: Tokenizer | None = None,
        max_model_len: int | None = None,
        proposer: NgramProposer | None = None,
        speculative_max_batch: int = 0,
    ) -> None:
        self.block_manager = block_manager
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.preemption_mode = preemption_mode
        self.tokenizer = tokenizer
        self.max_model_len = sys.maxsize if max_model_len is None else max_model_len
        self.proposer = proposer
        self.speculative_max_batch = speculative_max_batch
        self.shadow = ShadowDrafts(proposer) if proposer is not None else None
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.step_index = 0
        self._seq_counter = 0

    # ---- queues ----
    def add_request(self, request: Request) -> None:
        """Queue a new request (it keeps its arrival order in `seq_no` and step in `arrival_step`)."""
        request.seq_no = self._seq_counter
        self._seq_counter += 1
        request.arrival_step = self.step_index
        request.status = RequestStatus.WAITING
        self.policy.push(request)

    @property
    def num_waiting(self) -> int:
        return len(self.policy)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.swapped or len(self.policy))

    def remove(self, request: Request) -> None:
        """Take an unfinished request out of every queue and release its blocks (abort)."""
        if self.shadow is not None:
            self.shadow.drop(request.request_id)
        if request in self.running:
            self.running.remove(request)
        elif request in self.swapped:
            self.swapped.remove(request)
            self.block_manager.release_swap(request)
        else:
            self.policy.remove(request)
        self.block_manager.free(request)

    # ---- the step ----
    def schedule(self, allow_preemption: bool = True) -> SchedulerOutput:
        """Build one step. Never exceeds `max_num_batched_tokens` or `max_num_seqs`.

        `allow_preemption` False (while an earlier step is still running on the device, whose
        requests must keep their blocks, `engine.overlap`): where a running request finds no free
        block the step ends there, with `stalled` set, and admits nobody."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        queue = self.running
        speculate = self.proposer is not None and len(queue) <= self.speculative_max_batch
        if self.shadow is not None and not speculate:  # the gate learns the acceptance while closed
            self.shadow.propose(self.running)
        slots_held = self.block_manager.block_size  # tokens a block holds
        i = 0
        num_plain_decodes = 0  # steps of these only skip the sort below
        while i < len(queue) and budget > 0:
            request = queue[i]
            i += 1
            uncomputed = len(request.token_ids) - request.num_computed_tokens
            if (
                uncomputed == 1
                and not speculate
                and len(request.token_ids) <= len(request.block_table) * slots_held
            ):
                # The usual decode: its slot is in a block it holds already (no allocation).
                out.scheduled.append(ScheduledRequest(request, request.num_computed_tokens, 1, None, True))
                budget -= 1
                num_plain_decodes += 1
                continue
            num_new = min(uncomputed, budget)
            if speculate and uncomputed == 1:
                drafts = draft_with_slots(self.proposer, self.block_manager, request, budget, len(queue) - i)
                if drafts:
                    assert self.shadow is not None  # drafts come from the proposer, which has one
                    self.shadow.drop(request.request_id)
                    out.scheduled.append(
                        ScheduledRequest(request, request.num_computed_tokens, 1 + len(drafts), drafts)
                    )
                    budget -= 1 + len(drafts)
                    continue
            allocated = self.block_manager.allocate_slots(request, num_new) is not None
            if not allocated and not allow_preemption:
                out.stalled = True
                break
            while not allocated and self.block_manager.allocate_slots(request, num_new) is None:
                # The victim is one of the requests not scheduled yet, this one included.
                victim = self.policy.victim(queue[i - 1 :])
                self._preempt(victim, out)
                del queue[queue.index(victim, i - 1)]
                if victim is request:
                    i -= 1  # the next request now sits where this one was
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, request.num_computed_tokens, num_new))
                budget -= num_new
        # The running requests this step reached no budget for stay running, unscheduled (the
        # preempted ones were taken out of `queue`, which is `self.running`).
        if out.preempted:
            self.running = [r for r in queue if r.status is RequestStatus.RUNNING]

        # Swapped and waiting requests are admitted only when nothing was preempted this step;
        # otherwise the freed blocks would be fought over in the same step.
        if not out.preempted and not out.stalled:
            budget = self._admit_swapped(out, budget)
            if not self.swapped:
                self._admit_waiting(out, budget)

        # Decodes first: the attention backends expect them at the front of the flat batch.
        out.plain_decodes = len(out.scheduled) == num_plain_decodes
        if not out.plain_decodes:
            out.scheduled.sort(key=_prefill_last)
        self.step_index += 1
        return out

    def _admit_swapped(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.swapped[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.block_manager.can_swap_in(request, num_new):
                break
            self.swapped.popleft()
            out.swap_in += self.block_manager.swap_in(request, num_new)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, request.num_computed_tokens, num_new))
            budget -= num_new
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.policy.peek(self.step_index)
            if request is None or request.waits_for_prompt:
                # A sibling of a request with n > 1 keeps its place until the first one's prompt
                # blocks are in the prefix cache (the next step, or a few for a long prompt).
                break
            hits = self.block_manager.find_cached_prefix(request) if request.num_computed_tokens == 0 else []
            remaining = (
                request.num_tokens - request.num_computed_tokens - len(hits) * self.block_manager.block_size
            )
            if not self.enable_chunked_prefill and remaining > budget:
                break
            num_new = min(remaining, budget)
            hit = self.block_manager.allocate_slots(request, num_new, hits)
            if hit is None:
                # Head-of-line: nobody overtakes the next request in policy order for blocks, so
                # an aged request gets the next blocks that free up.
                break
            if hit:  # its cached prefix counts as computed: the chunk starts after it
                request.num_computed_tokens += hit
                request.num_cached_tokens = request.num_computed_tokens
            self.policy.pop(self.step_index)
            out.prefix_cache_queries += request.num_tokens if not request.num_preemptions else 0
            out.prefix_cache_hits += (
                len(hits) * self.block_manager.block_size if not request.num_preemptions else 0
            )
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_step is None:
                request.first_scheduled_step = self.step_index
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, request.num_computed_tokens, num_new))
            budget -= num_new

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        request.num_preemptions += 1
        out.preempted.append(request)
        if self.preemption_mode == "swap" and self.block_manager.can_swap_out(request):
            out.swap_out += self.block_manager.swap_out(request)
            request.status = RequestStatus.SWAPPED
            self.swapped.append(request)
            return
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.policy.push(request)

    # ---- after the forward pass ----
    def update(
        self,
        out: SchedulerOutput,
        sampled: StepOutput,
        scheduled_at: float | None = None,
        now: float | None = None,
    ) -> list[Request]:
        """Apply a step's results: computed tokens advance, full blocks join the prefix cache, each
        sampled token is appended and the stop conditions checked (`detokenizer.check_stop`).

        A structured request's matcher takes each appended token; the request stops ("stop") when
        its constraint is complete (its matcher accepted EOS, the one token it then allows).

        A request that verified drafts keeps the tokens `spec_decode.accepted_tokens` picks, each
        appended and checked as if decoded one by one (a stop ends it there); its computed tokens
        and blocks are rolled back to the tokens whose K/V are valid, so no block is hashed from
        a rejected draft and the blocks taken only for rejected drafts are free again.

        Args:
            out: the step, as `schedule()` returned it; `num_accepted_tokens` and
                `num_output_tokens` are set here.
            sampled: per scheduled request that `samples`, in `out.scheduled` order, its
                `1 + len(spec_token_ids)` tokens (with their log probabilities and errors); per
                scheduled request, its scored prompt positions' log probabilities, if any.
            scheduled_at / now: `perf_counter` seconds at the step's start (a request's wait ends
                then) and after its forward pass (first-token and finish times); None: now.

        Returns:
            The requests that finished in the step, in step order: `finish_reason` ("stop",
            "length" or "error", with `error` set) and `finish_time` set, blocks freed, status
            FINISHED.
        """
        now = time.perf_counter() if now is None else now
        scheduled_at = now if scheduled_at is None else scheduled_at
        finished: list[Request] = []
        token_ids, errors = sampled.token_ids, sampled.errors
        errors_or_none = errors or [None] * len(token_ids)
        at = 0  # index of the next request's first sampled token
        scored = sampled.scored or [None] * len(out.scheduled)
        caching = self.block_manager.enable_prefix_caching
        block_size = self.block_manager.block_size
        for item, prompt_logprobs in zip(out.scheduled, scored, strict=True):
            r = item.request
            if r.first_scheduled_time is None:  # the wait ends when the step that serves it begins
                r.first_scheduled_time = scheduled_at
            if prompt_logprobs and r.prompt_logprobs is not None:  # scored: it asked for them
                r.prompt_logprobs.extend(prompt_logprobs)
            if not item.samples:
                r.num_computed_tokens = item.start + item.num_new_tokens
                self.block_manager.cache_full_blocks(r)
                continue
            before = len(r.token_ids)
            # A token that needs nothing but appending and the stop checks: no error, drafts, log
            # probabilities, grammar or reasoning parser to feed (read here, not through a
            # property: this runs for every running request every step).
            plain = r.output_logprobs is None and r.grammar is None and r.reasoning is None
            if errors is None and not item.spec_token_ids and plain:
                reason = self.append_token(r, token_ids[at], now)
                at += 1
                out.num_output_tokens += 1
            else:
                end = at + 1 + len(item.spec_token_ids)
                samples = list(
                    zip(token_ids[at:end], sampled.logprobs[at:end], errors_or_none[at:end], strict=True)
                )
                at = end
                reason = append_sampled(item, samples, out, now, self.tokenizer, self.max_model_len)
            if self.shadow is not None:
                settled, produced = self.shadow.check(r, r.token_ids[before:])
                out.num_shadow_drafts += settled
                out.num_shadow_accepted_tokens += produced
            if caching and r.num_computed_tokens >= (len(r.block_hashes) + 1) * block_size:
                self.block_manager.cache_full_blocks(r)  # a block filled up
            if item.spec_token_ids:
                self.block_manager.free_tail(r, r.num_computed_tokens)
            if reason is not None:
                finished.append(self.finish(r, reason, now))
        return finished

    def append_token(self, r: Request, token: int, now: float) -> str | None:
        """`append_sampled` for a sampled token that needs nothing but appending and the stop checks
        (no drafts, error, log probabilities, grammar or reasoning parser): the decode fast path,
        one call a running request a step."""
        r.token_ids.append(token)
        if r.first_token_time is None:
            r.first_token_time = now
        reason = check_stop(r, self.tokenizer, self.max_model_len)
        r.num_computed_tokens = len(r.token_ids) - 1
        return reason

    def finish(self, request: Request, reason: str, now: float, free_blocks: bool = True) -> Request:
        """Drop a finished request from the running queue and release its blocks (unless
        `free_blocks` is False: a step still in flight writes into them, `engine.overlap`)."""
        if self.shadow is not None:
            self.shadow.drop(request.request_id)
        self.running.remove(request)
        if free_blocks:
            self.block_manager.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason, request.finish_time = reason, now
        return request


def _prefill_last(item: ScheduledRequest) -> bool:
    """Sort key putting decodes (`ScheduledRequest.is_decode`, inlined: it runs per request a
    step) before prefill chunks."""
    return item.num_new_tokens != 1 or not item.samples
