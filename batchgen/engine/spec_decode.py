"""Prompt-lookup (n-gram) speculative decoding: draft tokens from a request's own tokens, and the rule
that keeps the drafts the model agrees with.

Prompt lookup decoding (Saxena 2023, https://github.com/apoorvumang/prompt-lookup-decoding; vLLM's
`ngram` method): a summary, an edit or an extraction copies phrases of its input, so the tokens that
followed an earlier occurrence of the last few tokens are a cheap guess of the next ones. The guess
(the drafts) is verified in the next step as a query of `1 + len(drafts)` tokens, with a token
sampled at every position (`StepInput.num_draft_tokens`); speculative decoding (Leviathan et al.
2023, https://arxiv.org/abs/2211.17192) keeps the drafts up to the first one the model would not
have produced, plus the model's own token after them.

Only greedy rows speculate (`can_speculate`): for them the longest agreeing prefix plus the model's
next token is exactly what one-token decoding produces, so outputs are token-identical with
speculation on or off. Sampled rows (temperature > 0, seeded or not) decode one token a step as
before: their outputs, and a seeded row's reproducibility, do not depend on speculation.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from batchgen.engine.block_manager import BlockManager
from batchgen.engine.request import Request


def can_speculate(request: Request) -> bool:
    """Whether `request` may get draft tokens: greedy, no penalty (their values at a draft position
    would need the drafts in the history), past `min_tokens` (no banned ids) and no structured
    outputs (each draft position would need its own grammar mask: structured rows decode one token
    a step). Log probabilities are fine: each position's come from that position's logits."""
    p = request.sampling_params
    return (
        p.greedy
        and not p.penalized
        and request.num_output_tokens >= p.min_tokens
        and p.structured_outputs is None
    )


def accepted_tokens(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a greedy row keeps: the drafts up to the first one that differs from the model's
    token at its position, then the model's token there (or, all drafts agreeing, the model's token
    after the last draft: the bonus token).

    Args:
        drafts: the draft tokens verified, d of them.
        sampled: the model's greedy token at each of the d + 1 positions (after the last real
            token, then after each draft).

    Returns:
        1 to d + 1 tokens; `len(result) - 1` drafts were accepted.

    Raises:
        ValueError: `sampled` does not hold `len(drafts) + 1` tokens.
    """
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} sampled tokens, got {len(sampled)}")
    for j, draft in enumerate(drafts):
        if sampled[j] != draft:
            return list(sampled[: j + 1])
    return list(sampled)


class NgramProposer:
    """Draft tokens by prompt lookup: find the most recent earlier occurrence of the request's last n
    tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`: the longest n that occurs
    wins) and propose up to `num_speculative_tokens` tokens that followed it.

    Args:
        num_speculative_tokens: most drafts proposed (K).
        prompt_lookup_min / prompt_lookup_max: the n-gram lengths matched, 1 <= min <= max.

    Raises:
        ValueError: a length out of range.
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if num_speculative_tokens < 1 or not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "need num_speculative_tokens >= 1 and 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{num_speculative_tokens}, {prompt_lookup_min}, {prompt_lookup_max}"
            )
        self.k = num_speculative_tokens
        self.n_min = prompt_lookup_min
        self.n_max = prompt_lookup_max

    def propose(self, token_ids: Sequence[int], max_drafts: int | None = None) -> list[int]:
        """Up to min(K, `max_drafts`) draft tokens to follow `token_ids` (prompt + output), or [].

        Vectorized over the sequence: every earlier position holding the last token is a candidate,
        and each candidate's match is extended backwards one token at a time up to
        `prompt_lookup_max` (a pass over the sequence plus `prompt_lookup_max` passes over the
        candidates, instead of one window comparison per n).
        """
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        n_tokens = len(token_ids)
        if k < 1 or n_tokens <= self.n_min:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # Candidates end where the last token recurs, at most at n_tokens - 2: one token must follow.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        length = 1
        while ends.size and length < self.n_max:
            room = ends[ends >= length]  # a token before the match to compare
            longer = room[tokens[room - length] == tokens[n_tokens - 1 - length]]
            if not longer.size:
                break
            ends, length = longer, length + 1
        if length < self.n_min or not ends.size:
            return []
        start = int(ends[-1]) + 1  # the most recent of the longest matches
        return tokens[start : start + k].tolist()


class ShadowDrafts:
    """What verification would accept while the gate is closed, at the cost of proposals only.

    A closed gate (a batch too large for drafts to pay at the acceptance seen so far) would never
    learn the job's acceptance, so it could never open before the tail. Instead, a few running
    greedy decodes a step get drafts proposed but not verified (`propose`); the tokens the request
    then decodes settle them (`check`): for a greedy row the drafts a verification would have
    accepted are exactly the leading ones the model goes on to produce. The counts feed the gate
    like real verifications do (`spec_gate.SpeculationGate.observe`).

    Args:
        proposer: the drafts' source.
        per_step: most proposals tried a step (round-robin over the running requests), which bounds
            the proposer's cost on a large batch.
    """

    def __init__(self, proposer: NgramProposer, per_step: int = 8) -> None:
        self.proposer = proposer
        self.per_step = per_step
        self._open: dict[str, tuple[list[int], int]] = {}  # request id -> (drafts, matched so far)
        self._cursor = 0

    def propose(self, running: list[Request]) -> None:
        """Propose drafts for up to `per_step` running greedy decodes holding none yet."""
        tried = examined = 0
        n = len(running)
        while examined < n and tried < self.per_step:
            r = running[(self._cursor + examined) % n]
            examined += 1
            decoding = r.num_tokens - r.num_computed_tokens == 1
            if r.request_id in self._open or not decoding or not can_speculate(r):
                continue
            tried += 1
            drafts = self.proposer.propose(r.token_ids, r.max_tokens - r.num_output_tokens - 1)
            if drafts:
                self._open[r.request_id] = (drafts, 0)
        # The next step starts after the last request examined: every one gets its turn.
        self._cursor = (self._cursor + examined) % max(n, 1)

    def drop(self, request_id: str) -> None:
        """Forget a request's drafts (it finished, left, or verifies real ones)."""
        self._open.pop(request_id, None)

    def check(self, request: Request, new_tokens: list[int]) -> tuple[int, int]:
        """Settle the request's drafts against the tokens it just appended: (1, drafts the model
        produced) once they are settled (a token differs, or all were produced), else (0, 0)."""
        entry = self._open.get(request.request_id)
        if entry is None:
            return 0, 0
        drafts, matched = entry
        for token in new_tokens:
            if token != drafts[matched]:
                break  # settled: the model left the drafts here
            matched += 1
            if matched == len(drafts):
                break  # settled: every draft produced
        else:  # every new token agreed and drafts remain: not settled yet
            self._open[request.request_id] = (drafts, matched)
            return 0, 0
        del self._open[request.request_id]
        return 1, matched


def draft_with_slots(
    proposer: NgramProposer | None, bm: BlockManager, request: Request, budget: int, num_after: int
) -> list[int]:
    """Draft tokens for a running decode, with their slots allocated in `bm`, or [] (then the
    request is scheduled as a plain decode). Drafts never cost another request its place: each of
    the `num_after` running requests still to schedule keeps one token of `budget` and one free
    block, so drafts never cause a preemption. Their extra blocks are fresh ones only (never a
    cached prefix evicted for a draft that may be rejected), and they never run past `max_tokens`."""
    if proposer is None or not can_speculate(request):
        return []
    room = min(budget - 1 - num_after, request.max_tokens - request.num_output_tokens - 1)
    drafts = proposer.propose(request.token_ids, room) if room > 0 else []
    if not drafts:
        return []
    most_extra = max(bm.blocks_needed(request.num_tokens + len(drafts)) - len(request.block_table), 0)
    extra = max(bm.num_fresh_free_blocks(num_after + most_extra) - num_after, 0)
    # Slots for the last token and the drafts (positions up to num_tokens - 1 + d) in the blocks
    # held and the extra ones.
    drafts = drafts[: (len(request.block_table) + extra) * bm.block_size - request.num_tokens]
    if not drafts or bm.allocate_slots(request, 1 + len(drafts)) is None:
        return []
    return drafts
