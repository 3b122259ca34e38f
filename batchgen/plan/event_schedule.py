"""The scheduler's rules replayed by events: `batchgen plan`'s schedule for a job too large to replay
with the engine's own scheduler (`batchgen.plan.estimate.simulate_schedule` chooses).

Each step gives every decoding row one token, then the unfinished prompt its next chunk, then
admits waiting rows in file order while the step's token budget (`max_num_batched_tokens`), the
sequence budget (`max_num_seqs`) and the KV cache's free blocks allow. Between two admissions and
finishes every step is the same decode-only step, so a run of them costs one calculation, and a job
of n rows takes O(n log n) work however long its outputs are.

What it leaves out, next to the engine's scheduler:
- rows are admitted in file order (the `fcfs` policy; `max-throughput` reorders within its window,
  which changes who waits, not the total work);
- a row is admitted only when the blocks of its whole row (prompt + output) are free, so nothing is
  preempted (the engine admits on the prompt's blocks, runs a few more rows at once and recomputes
  the ones it preempts);
- prefix-cache hits are an input (`Sequences.cached`, counted with the rows in file order), not
  found as rows run.
Where none of these matters, its schedule is the engine's step for step
(`tests/plan/test_estimate.py` replays both).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from batchgen.model.step import is_decode
from batchgen.plan.schedule import Schedule, ScheduleLimits


class _Events:
    """The state of `event_schedule` (see there)."""

    def __init__(
        self,
        prompts: Iterable[int],
        cached: Iterable[int],
        outputs: Iterable[int],
        limits: ScheduleLimits,
        trace: bool,
    ) -> None:
        # Plain ints: indexing a numpy array per row costs more than the whole simulation's logic.
        self.prompts, self.cached, self.outputs = (list(map(int, a)) for a in (prompts, cached, outputs))
        if not len(self.prompts) == len(self.cached) == len(self.outputs):
            raise ValueError("event_schedule needs one prompt, cached and output length per row")
        self.limits = limits
        bs = limits.block_size
        self.blocks = [
            min(-(-(p + o) // bs), limits.num_blocks) for p, o in zip(self.prompts, self.outputs, strict=True)
        ]
        self.free = limits.num_blocks
        self.next_row = 0
        self.running = 0  # rows admitted and not finished
        self.partial: list[int] | None = None  # [row, prompt tokens left] of a chunked prompt
        self.last_chunk: dict[int, int] = {}  # rows completing their prompt this step -> its last chunk
        # Decoding rows as (step of their last token, row, step of their first). Row i, its first
        # token sampled at step s0, attends to prompt_i + (s - s0) keys at step s: the sum over the
        # decoding rows is `keys + len(decoding) * s`.
        self.decoding: list[tuple[int, int, int]] = []
        self.keys = 0
        self.result = Schedule("events", prefix_cache_hits=sum(self.cached), trace=[] if trace else None)

    def run(self) -> Schedule:
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
                self.last_chunk[row] = take
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
                self.last_chunk[row] = take
            else:
                self.partial = [row, left - take]
        if prefill == 0:
            return False
        r = self.result
        step = r.steps + 1
        decodes = len(self.decoding)
        context = self.keys + decodes * step
        tokens = decodes + prefill
        # A prompt's last token alone is a decode (`is_decode`: the runner's decode path), reading
        # the prompt's keys.
        for row in completed:
            if is_decode(self.last_chunk[row], True):
                context += self.prompts[row]
                prefill -= 1
        self._peak()
        r.add_steps(1, tokens, decodes + len(completed), context, context, prefill)
        self._finish_decodes(step)
        for row in completed:
            self._start_decoding(row, step)
        self.last_chunk.clear()
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
        self._peak()
        r.add_steps(count, batch, batch, self.keys + batch * first, keys, 0)
        self._finish_decodes(last)

    def _peak(self) -> None:
        self.result.peak_seqs = max(self.result.peak_seqs, self.running)


def event_schedule(
    prompt_tokens: Iterable[int],
    cached_tokens: Iterable[int],
    output_tokens: Iterable[int],
    limits: ScheduleLimits,
    trace: bool = False,
) -> Schedule:
    """The schedule of rows of known lengths, in file order (module docstring).

    Args:
        prompt_tokens: each row's prompt length in tokens (>= 1).
        cached_tokens: each row's prompt tokens the prefix cache serves (< its prompt length).
        output_tokens: each row's output length in tokens (>= 1). A row with n > 1 is n rows here
            (its siblings find its prompt in the prefix cache).
        limits: the engine's budgets (its policy, window and preemption mode are not modelled).
        trace: keep every run of identical steps in the result.

    Returns:
        Schedule, method "events".

    Raises:
        ValueError: the three lengths differ in number.
        RuntimeError: the schedule cannot advance (never with valid limits: a row larger than the
            KV cache is admitted alone, as its blocks are capped at the cache's).
    """
    return _Events(prompt_tokens, cached_tokens, output_tokens, limits, trace).run()
