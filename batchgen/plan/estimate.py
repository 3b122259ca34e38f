"""A job's wall time before it runs: its continuous-batching schedule, simulated, at measured step costs.

`simulate_schedule` replays the scheduler's rules (`batchgen.engine.scheduler`) on the rows' lengths
alone: each step gives every decoding row one token, then the unfinished prompt its next chunk, then
admits waiting rows in file order while the step's token budget (`max_num_batched_tokens`), the
sequence budget (`max_num_seqs`) and the KV cache's free blocks allow. It is event-driven: between
two admissions and finishes every step is the same decode-only step, so a run of them costs one
calculation, and a job of n rows takes O(n log n) work however long its outputs are.

Two simplifications, named where the estimate is printed:
- rows are admitted in file order (the `fcfs` policy; `max-throughput` reorders within its window,
  which changes who waits, not the total work), and
- a row is admitted only when the blocks of its whole row (prompt + output) are free, so nothing is
  preempted. The engine admits on the prompt's blocks and preempts when decodes run out of blocks:
  it runs a few more rows at once and recomputes the preempted ones; both effects are small next to
  the uncertainty in the output lengths.

`StepCosts` prices one step from what the calibration measured (`batchgen.plan.calibrate`).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field


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
    """The engine's budgets, as `EnginePlan` sized them: tokens and sequences a step, KV blocks."""

    max_num_seqs: int
    max_num_batched_tokens: int
    num_blocks: int
    block_size: int
    enable_chunked_prefill: bool = True


@dataclass
class ScheduleResult:
    """A simulated run: `steps` steps taking `seconds` (at the given costs), `prefill_tokens`
    computed, `output_tokens` sampled, at most `peak_seqs` rows at once. `trace` (when asked):
    one `(count, batched_tokens, sampled, context_tokens)` per run of `count` steps alike, with the
    context (keys read by decoding rows) of the run's first step; in a decode run it grows by
    `sampled` a step."""

    steps: int = 0
    seconds: float = 0.0
    prefill_tokens: int = 0
    output_tokens: int = 0
    peak_seqs: int = 0
    trace: list[tuple[int, int, int, int]] | None = field(default=None, repr=False)


class _Simulation:
    """The state of `simulate_schedule` (see there)."""

    def __init__(self, prompts, cached, outputs, limits: ScheduleLimits, costs: StepCosts, trace: bool):
        # Plain ints: indexing a numpy array per row costs more than the whole simulation's logic.
        self.prompts, self.cached, self.outputs = (list(map(int, a)) for a in (prompts, cached, outputs))
        if not len(self.prompts) == len(self.cached) == len(self.outputs):
            raise ValueError("simulate_schedule needs one prompt, cached and output length per row")
        self.limits, self.costs = limits, costs
        bs = limits.block_size
        self.blocks = [
            min(-(-(p + o) // bs), limits.num_blocks) for p, o in zip(self.prompts, self.outputs, strict=True)
        ]
        self.free = limits.num_blocks
        self.next_row = 0
        self.running = 0  # rows admitted and not finished
        self.partial: list[int] | None = None  # [row, prompt tokens left] of a chunked prompt
        # Decoding rows as (step of their last token, row, step of their first). Row i, its first
        # token sampled at step s0, attends to prompt_i + (s - s0) keys at step s: the sum over the
        # decoding rows is `keys + len(decoding) * s`.
        self.decoding: list[tuple[int, int, int]] = []
        self.keys = 0
        self.result = ScheduleResult(trace=[] if trace else None)

    def run(self) -> ScheduleResult:
        n = len(self.prompts)
        while self.next_row < n or self.running:
            if not self._mixed_step():
                self._decode_run()
        return self.result

    def _start_decoding(self, row: int, step: int) -> None:
        """Row `row` sampled its first token at `step`: it decodes until its output is done."""
        last = step + self.outputs[row] - 1
        if last == step:
            self._finish(row)
            return
        heapq.heappush(self.decoding, (last, row, step))
        self.keys += self.prompts[row] - step

    def _finish(self, row: int) -> None:
        self.free += self.blocks[row]
        self.running -= 1

    def _finish_decodes(self, step: int) -> None:
        while self.decoding and self.decoding[0][0] == step:
            _, row, first = heapq.heappop(self.decoding)
            self.keys -= self.prompts[row] - first
            self._finish(row)

    def _mixed_step(self) -> bool:
        """One step with prompt work (a chunk, or admissions); False when none can be scheduled."""
        lim = self.limits
        budget = lim.max_num_batched_tokens - len(self.decoding)
        prefill, completed = 0, []
        if self.partial is not None and budget > 0:
            row, left = self.partial
            take = min(left, budget)
            prefill, budget = take, budget - take
            if take == left:
                completed.append(row)
                self.partial = None
            else:
                self.partial[1] -= take
        while budget > 0 and self.partial is None and self.running < lim.max_num_seqs:
            row = self.next_row
            if row >= len(self.prompts) or self.blocks[row] > self.free:
                break
            left = self.prompts[row] - self.cached[row]
            if not lim.enable_chunked_prefill and left > budget:
                break
            self.next_row += 1
            self.running += 1
            self.free -= self.blocks[row]
            take = min(left, budget)
            prefill, budget = prefill + take, budget - take
            if take == left:
                completed.append(row)
            else:
                self.partial = [row, left - take]
        if prefill == 0:
            return False
        r = self.result
        step = r.steps + 1
        decodes = len(self.decoding)
        context = self.keys + decodes * step
        sampled = decodes + len(completed)
        self._record(1, decodes + prefill, sampled, context, self.costs.step(sampled, context, prefill))
        r.prefill_tokens += prefill
        r.output_tokens += sampled
        self._finish_decodes(step)
        for row in completed:
            self._start_decoding(row, step)
        return True

    def _decode_run(self) -> None:
        """The decode-only steps up to the next row that finishes (nothing can be admitted before)."""
        if not self.decoding:
            raise RuntimeError("schedule stalled: no row decodes and none can be admitted")
        r = self.result
        last = self.decoding[0][0]
        count, batch, first = last - r.steps, len(self.decoding), r.steps + 1
        # Keys over steps first..last: sum of (keys + batch * s).
        keys = count * self.keys + batch * (first + last) * count // 2
        seconds = count * self.costs.base(batch) + self.costs.per_context_token * keys
        self._record(count, batch, batch, self.keys + batch * first, seconds)
        r.output_tokens += count * batch
        self._finish_decodes(last)

    def _record(self, count: int, tokens: int, sampled: int, context: int, seconds: float) -> None:
        r = self.result
        r.steps += count
        r.seconds += seconds
        r.peak_seqs = max(r.peak_seqs, self.running)
        if r.trace is not None:
            r.trace.append((count, tokens, sampled, context))


def simulate_schedule(
    prompt_tokens: Sequence[int],
    cached_tokens: Sequence[int],
    output_tokens: Sequence[int],
    limits: ScheduleLimits,
    costs: StepCosts,
    trace: bool = False,
) -> ScheduleResult:
    """Simulate the engine's steps over rows of known lengths, in file order (module docstring).

    Args:
        prompt_tokens: each row's prompt length in tokens (>= 1).
        cached_tokens: each row's prompt tokens the prefix cache serves (< its prompt length).
        output_tokens: each row's output length in tokens (>= 1). A row with n > 1 is n rows here
            (its siblings find its prompt in the prefix cache).
        limits: the engine's budgets.
        costs: seconds of a step.
        trace: keep every run of identical steps in the result (for tests and curious readers).

    Returns:
        ScheduleResult: steps, seconds, tokens and the peak number of rows at once.

    Raises:
        ValueError: the three lengths differ in number.
        RuntimeError: the schedule cannot advance (never with valid limits: a row larger than the
            KV cache is admitted alone, as its blocks are capped at the cache's).
    """
    return _Simulation(prompt_tokens, cached_tokens, output_tokens, limits, costs, trace).run()
