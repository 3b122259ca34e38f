"""What a step's sequences ask of the forward and the sampler, worked out once per set of rows.

A step of decodes that runs the same `StepInput` objects as the step before
(`flat_step.DecodeRows.kept`) asks the same: its sampled rows, sampling settings, scored rows and
log probabilities depend on the sequences' settings, never on their token or position, so the
runner keeps the `StepRows` of the last step and works them out again only when the rows change.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchgen.model.sampler import SamplingBatch
from batchgen.model.step import StepInput


@dataclass
class StepRows:
    """The per-row facts of a step's sequences that the runner reads after the forward.

    Attributes:
        sampled: a `StepInput` per sampled row (a sequence with draft tokens has one per position).
        batch: the sampled rows' settings (`sampling_batch`).
        scored_rows: flat batch rows (int64) of the sequences' `ScoredRows`, or None.
        masked: whether any sampled row has a token mask.
        asked: indices into `sampled` of the rows that want log probabilities.
    """

    sampled: list[StepInput]
    batch: SamplingBatch
    scored_rows: np.ndarray | None
    masked: bool
    asked: list[int]


def step_rows(seqs: list[StepInput]) -> StepRows:
    """The `StepRows` of `seqs`.

    Raises:
        ValueError: draft tokens on a sequence with a penalty, banned token ids or a token mask
            (their values at each draft position would need the drafts in the history; the
            engine never asks).
    """
    if any(s.num_draft_tokens and (s.penalty or s.banned_token_ids or s.token_mask) for s in seqs):
        raise ValueError("draft tokens cannot be verified with penalties, banned token ids or token masks")
    sampled = [s for s in seqs for _ in range(s.num_sampled)]
    return StepRows(
        sampled=sampled,
        batch=sampling_batch(sampled),
        scored_rows=scored_row_indices(seqs),
        masked=any(s.token_mask is not None for s in sampled),
        asked=[i for i, s in enumerate(sampled) if s.logprobs is not None],
    )


def sampling_batch(sampled: list[StepInput]) -> SamplingBatch:
    """The sampler's settings of `sampled`, a `StepInput` per sampled row."""
    return SamplingBatch(
        temperatures=[s.temperature for s in sampled],
        top_ks=[s.top_k for s in sampled],
        top_ps=[s.top_p for s in sampled],
        min_ps=[s.min_p for s in sampled],
        generators=[s.generator for s in sampled],
        banned_token_ids=[s.banned_token_ids for s in sampled],
        penalties=[s.penalty for s in sampled],
    )


def scored_row_indices(seqs: list[StepInput]) -> np.ndarray | None:
    """Flat batch rows (int64) of the sequences' `ScoredRows`, in sequence order, or None when no
    sequence scores any (then the step computes the sampled rows' logits only, as always)."""
    if all(s.scored is None for s in seqs):
        return None
    rows, start = [], 0
    for s in seqs:
        if s.scored is not None:
            first = start + s.scored.first
            rows.append(np.arange(first, first + len(s.scored.targets), dtype=np.int64))
        start += len(s.token_ids)
    return np.concatenate(rows)
