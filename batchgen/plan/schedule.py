"""The types of `batchgen plan`'s schedule: the engine's budgets (`ScheduleLimits`), the job's
sequences (`Sequences`), a simulated run reduced to what prices it (`Schedule`), and the price of a
step (`StepCosts`, from the calibration). `batchgen.plan.estimate.simulate_schedule` makes the
schedule."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one engine step on this machine, as a function of its work.

        step seconds = base(sampled rows) + per_context_token * keys read by decode attention
                       + per_prefill_token * prefill tokens

    `base` is piecewise linear through the measured points (`batches`, `seconds`) and extends the
    last segment past the last point (a step of 0 sampled rows costs base(1): the step's fixed
    cost). Decode attention is priced apart because it reads every decoding row's K/V: it grows with
    the context, not with the batch alone.

    Attributes:
        batches: rows sampled in the measured steps, ascending, the first one 1.
        seconds: a step's seconds at each of `batches`, with no context and no prefill.
        per_context_token: seconds per key (context token) a decoding row attends to.
        per_prefill_token: seconds per prompt token computed in a step (its attention included).

    Raises:
        ValueError: the points are empty, not ascending, unequal in number, or a cost is negative.
    """

    batches: tuple[int, ...]
    seconds: tuple[float, ...]
    per_context_token: float
    per_prefill_token: float

    def __post_init__(self) -> None:
        if not self.batches or len(self.batches) != len(self.seconds):
            raise ValueError(f"StepCosts needs as many batches as seconds: {self.batches}, {self.seconds}")
        if any(b >= c for b, c in zip(self.batches, self.batches[1:], strict=False)) or self.batches[0] < 1:
            raise ValueError(f"StepCosts batches must be ascending from 1 or more, got {self.batches}")
        if min(self.seconds) < 0 or self.per_context_token < 0 or self.per_prefill_token < 0:
            raise ValueError("StepCosts costs must be >= 0")

    def scaled(self, factor: float) -> StepCosts:
        """Every cost times `factor` (a machine `factor` times slower)."""
        return StepCosts(
            self.batches,
            tuple(factor * s for s in self.seconds),
            factor * self.per_context_token,
            factor * self.per_prefill_token,
        )

    def base(self, sampled: int) -> float:
        """Seconds of a step that samples `sampled` rows, before its context and prefill."""
        b, s = self.batches, self.seconds
        x = max(sampled, 1)
        if x <= b[0]:
            return s[0]
        if len(b) == 1:  # one point: proportional to the rows
            return s[0] * x / b[0]
        i = next((i for i in range(1, len(b)) if x <= b[i]), len(b) - 1)
        slope = (s[i] - s[i - 1]) / (b[i] - b[i - 1])
        return max(s[i - 1] + slope * (x - b[i - 1]), 0.0)

    def step(self, sampled: int, context_tokens: int, prefill_tokens: int) -> float:
        """Seconds of one step (the model at the top of this class)."""
        return (
            self.base(sampled)
            + self.per_context_token * context_tokens
            + self.per_prefill_token * prefill_tokens
        )


@dataclass(frozen=True)
class ScheduleLimits:
    """The engine's budgets, as `EnginePlan` sized them, and how the job feeds it.

    Attributes:
        max_num_seqs / max_num_batched_tokens: sequences and tokens a step.
        num_blocks / block_size / num_swap_blocks: the KV cache, in blocks of `block_size` tokens.
        enable_chunked_prefill / enable_prefix_caching / preemption_mode: as `EngineConfig`.
        policy / aging_steps: the engine's and the window's order (`EngineConfig.policy`).
        window: the look-ahead window in rows (`batchgen run --window`).
        max_model_len: a sequence stops at this many tokens (None: no limit).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    num_blocks: int
    block_size: int
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    num_swap_blocks: int = 0
    policy: str = "fcfs"
    aging_steps: int = 256
    window: int = 1024
    max_model_len: int | None = None


@dataclass
class Sequences:
    """The sequences `run` would start (a row with n > 1 is n of them), in file order.

    Attributes:
        prompts: prompt tokens, `int64 [n]`.
        cached: prompt tokens the prefix cache serves with the rows in file order, one at a time
            (`batchgen.plan.job_plan`; the event schedule's input: the replay finds its own).
        budgets: output budget (`max_tokens` capped by `max_model_len`), `int64 [n]`.
        expected / basis: the expected outputs (`int64 [n]`, <= budgets) and what they rest on.
        first: whether each is the first sequence of its row (`bool [n]`; None: all are).
        work / priority: the row's window work (`batchgen.jobs.loop.window_work`) and priority,
            `int64 [n]` (None: prompt + budget, and 0).
        scores_prompt: whether each asks for prompt log probabilities (`bool [n]`, a row's first
            sequence only; the prefix cache serves it nothing); None: none does.
        block_hashes / block_offsets: the chain hashes of each sequence's full prompt blocks
            (`BlockManager.cache_full_blocks`' `Request.block_hashes`), flat `int64 [total]`,
            sequence i's at `block_offsets[i]:block_offsets[i + 1]` (`int64 [n + 1]`). None:
            not kept (too many for a replay; `REPLAY_MAX_BLOCKS`).
    """

    prompts: np.ndarray
    cached: np.ndarray
    budgets: np.ndarray
    expected: np.ndarray | None = None
    basis: str = ""
    first: np.ndarray | None = None
    work: np.ndarray | None = None
    priority: np.ndarray | None = None
    scores_prompt: np.ndarray | None = None
    block_hashes: np.ndarray | None = None
    block_offsets: np.ndarray | None = None


@dataclass
class Schedule:
    """A simulated run, reduced to what prices it.

    Attributes:
        method: "engine" (the engine's scheduler replayed) or "events" (`event_schedule`).
        steps / prefill_tokens / output_tokens: steps, prompt tokens computed (recomputed ones
            after a preemption included), tokens sampled.
        context_tokens: keys read by decoding rows, summed over steps.
        steps_by_sampled: steps, by how many rows they sampled.
        peak_seqs: the most rows running at once; preemptions: as the engine counts them.
        prefix_cache_hits: prompt tokens the prefix cache served.
        trace: when asked, one `(count, batched_tokens, sampled, context_tokens)` per run of
            `count` steps alike, with the context of the run's first step (in a decode run it
            grows by `sampled` a step); the replay's runs are single steps.
    """

    method: str
    steps: int = 0
    prefill_tokens: int = 0
    output_tokens: int = 0
    context_tokens: int = 0
    steps_by_sampled: Counter[int] = field(default_factory=Counter)
    peak_seqs: int = 0
    preemptions: int = 0
    prefix_cache_hits: int = 0
    trace: list[tuple[int, int, int, int]] | None = field(default=None, repr=False)

    def add_steps(
        self, count: int, tokens: int, sampled: int, first_context: int, context: int, prefill: int
    ) -> None:
        """`count` steps alike of `tokens` tokens that sample `sampled` rows each: the first reads
        `first_context` keys, all of them `context`; `prefill` prompt tokens in all."""
        self.steps += count
        self.steps_by_sampled[sampled] += count
        self.context_tokens += context
        self.prefill_tokens += prefill
        self.output_tokens += count * sampled
        if self.trace is not None:
            self.trace.append((count, tokens, sampled, first_context))

    def seconds(self, costs: StepCosts) -> float:
        """The schedule's seconds at `costs`: the sum of `costs.step` over its steps."""
        base = sum(n * costs.base(sampled) for sampled, n in self.steps_by_sampled.items())
        return (
            base
            + costs.per_context_token * self.context_tokens
            + costs.per_prefill_token * self.prefill_tokens
        )
