"""Parallel sampling (`SamplingParams.n` > 1): a request runs as n child sequences, and their
finished outputs are merged back into one `RequestOutput` with n completions, as vLLM returns them.

Each child is an ordinary request to the scheduler (its own blocks, its own preemption), queued
together at arrival. With prefix caching on and a prompt of at least one full block, children 1..n-1
are admitted only once child 0, while running, has computed the prompt (`Request.wait_for`), and then
reuse its full blocks from the prefix cache: the prompt is computed about once, not n times (vLLM
forks the sequence after the prompt for the same reason).
"""

from __future__ import annotations

from dataclasses import replace

from batchgen.engine.request import Request
from batchgen.outputs import RequestMetrics, RequestOutput
from batchgen.sampling_params import SamplingParams

# Joins a parent id and a child's index into the child's request id; a control character, so the
# ids a caller picks (row ids, "gen-1-0") do not collide with a child's.
_CHILD_SEP = "\x1f"
_SEED_SPAN = 2**64


def _child_id(parent_id: str, index: int) -> str:
    return f"{parent_id}{_CHILD_SEP}{index}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The i-th child's parameters: n = 1, and seed + i (wrapped into the 64-bit range) when seeded.
    Only child 0 scores the prompt (`prompt_logprobs`): the others reuse its prompt blocks from the
    prefix cache, and the merged output carries child 0's prompt log probabilities."""
    seed = params.seed
    if seed is not None:
        seed = seed + index if seed < 0 else (seed + index) % _SEED_SPAN
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


def link_children(first: Request, children: list[Request], prefix_caching: bool, block_size: int) -> None:
    """Make `children` (sequences 1..n-1 of a request) wait for `first` (`Request.wait_for`) when
    they will find its prompt in the prefix cache: prefix caching on and a prompt of at least one
    full block of `block_size` tokens. Otherwise they are left to run at once."""
    if prefix_caching and first.num_prompt_tokens >= block_size:
        for child in children:
            child.wait_for = first


class SampleGroups:
    """The live requests with n > 1: which child ids belong to which parent, and the children's
    outputs until all n have finished."""

    def __init__(self) -> None:
        self._parent_of: dict[str, tuple[str, int]] = {}
        self._done: dict[str, list[RequestOutput | None]] = {}

    def __contains__(self, request_id: str) -> bool:
        """Whether `request_id` is a live parent or one of its children."""
        return request_id in self._done or request_id in self._parent_of

    def num_live(self) -> int:
        """Live parents (each counts as one request, whatever its n)."""
        return len(self._done)

    def is_child(self, request_id: str) -> bool:
        return request_id in self._parent_of

    def add(self, parent_id: str, n: int) -> list[str]:
        """Register a parent with `n` children; returns the children's request ids in order."""
        ids = [_child_id(parent_id, i) for i in range(n)]
        for i, child in enumerate(ids):
            self._parent_of[child] = (parent_id, i)
        self._done[parent_id] = [None] * n
        return ids

    def children(self, parent_id: str) -> list[str]:
        """The children's request ids of a live parent (empty for any other id)."""
        return [_child_id(parent_id, i) for i in range(len(self._done.get(parent_id, ())))]

    def drop(self, parent_id: str) -> None:
        """Forget a parent and its children (after an abort)."""
        for child in self.children(parent_id):
            self._parent_of.pop(child, None)
        self._done.pop(parent_id, None)

    def collect(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """`outputs` with each child's output held back until its parent's last child finishes,
        then replaced by the parent's merged output."""
        if not self._parent_of:
            return outputs
        result = []
        for out in outputs:
            owner = self._parent_of.pop(out.request_id, None)
            if owner is None:
                result.append(out)
                continue
            parent_id, index = owner
            done = self._done[parent_id]
            done[index] = out
            finished = [d for d in done if d is not None]
            if len(finished) == len(done):
                del self._done[parent_id]
                result.append(_merge(parent_id, finished))
        return result


def _merge(parent_id: str, children: list[RequestOutput]) -> RequestOutput:
    """One output with the children's completions (index i = child i); times span the children."""
    completions = [replace(child.outputs[0], index=i) for i, child in enumerate(children)]
    first = children[0]

    def earliest(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return min(known) if known else None

    metrics = RequestMetrics(
        arrival_time=min(c.metrics.arrival_time for c in children),
        first_scheduled_time=earliest([c.metrics.first_scheduled_time for c in children]),
        first_token_time=earliest([c.metrics.first_token_time for c in children]),
        finish_time=max(
            (c.metrics.finish_time for c in children if c.metrics.finish_time is not None), default=None
        ),
    )
    return RequestOutput(
        request_id=parent_id,
        prompt=first.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=completions,
        finished=True,
        metrics=metrics,
        num_cached_tokens=first.num_cached_tokens,
        error=next((c.error for c in children if c.error), None),
        num_preemptions=sum(c.num_preemptions for c in children),
        prompt_logprobs=first.prompt_logprobs,
    )
