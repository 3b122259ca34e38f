"""`batchgen plan`'s schedule from the engine's own `Scheduler` and `BlockManager`, with no model.

Each sequence becomes a `Request` of token ids that stand for its prompt
(`batchgen.plan.prefix.stand_in_prompt` of its full blocks' chain hashes, `Sequences.block_hashes`:
two blocks hold the same ids exactly when the real prompts share that prefix, so the block
manager's prefix cache hits where the job's would), the rest of the prompt an id of its own. Rows reach the scheduler as
`batchgen run` hands them over (`batchgen.jobs.loop`: the look-ahead window in the job's policy,
at most `inflight_limit` rows in the engine, a row's n sequences linked as the engine links them).
Each step's `SchedulerOutput` is measured (tokens, rows sampled, keys read by decodes, prompt
tokens) and `Scheduler.update` gets fake sampled tokens: a sequence whose `max_tokens` is its
expected output stops there ("length"), and no token is an EOS or a stop token.
"""

from __future__ import annotations

import numpy as np

from batchgen.engine.block_manager import BlockManager
from batchgen.engine.parallel_sampling import link_children
from batchgen.engine.policy import make_policy
from batchgen.engine.request import Request
from batchgen.engine.scheduler import Scheduler
from batchgen.jobs.loop import inflight_limit
from batchgen.jobs.window import LookaheadWindow
from batchgen.model.step import StepOutput
from batchgen.plan.prefix import stand_in_prompt
from batchgen.plan.schedule import Schedule, ScheduleLimits, Sequences
from batchgen.sampling_params import SamplingParams


class _Replay:
    """The state of `replay_schedule` (see there)."""

    def __init__(self, seqs: Sequences, outputs: np.ndarray, limits: ScheduleLimits, trace: bool) -> None:
        n = len(seqs.prompts)
        if len(outputs) != n or seqs.block_offsets is None or len(seqs.block_offsets) != n + 1:
            raise ValueError("replay_schedule needs one output length and one block range per sequence")
        bm = BlockManager(
            limits.num_blocks, limits.block_size, limits.enable_prefix_caching, limits.num_swap_blocks
        )
        self.scheduler = Scheduler(
            bm,
            make_policy(limits.policy, limits.aging_steps),
            limits.max_num_seqs,
            limits.max_num_batched_tokens,
            limits.enable_chunked_prefill,
            limits.preemption_mode,
            max_model_len=limits.max_model_len,
        )
        self.limits, self.seqs = limits, seqs
        self.prompts, self.outputs = seqs.prompts.tolist(), np.asarray(outputs).tolist()
        first = np.ones(n, bool) if seqs.first is None else np.asarray(seqs.first, bool)
        self.row_starts = np.flatnonzero(first).tolist() + [n]  # row r: sequences row_starts[r]..[r+1]
        self.work = (seqs.prompts + seqs.budgets) if seqs.work is None else seqs.work
        self.priority = np.zeros(n, np.int64) if seqs.priority is None else seqs.priority
        self.scores = np.zeros(n, bool) if seqs.scores_prompt is None else seqs.scores_prompt
        self.window: LookaheadWindow[int] = LookaheadWindow(limits.policy, limits.window)
        self.inflight = inflight_limit(limits.max_num_seqs)
        self.next_row = 0
        self.row_left: dict[int, int] = {}  # rows in the engine -> their sequences not finished
        self.row_of: dict[str, int] = {}
        self.params: dict[int, SamplingParams] = {}
        self.result = Schedule("engine", trace=[] if trace else None)

    def run(self) -> Schedule:
        s = self.scheduler
        while self.next_row < len(self.row_starts) - 1 or self.window or s.has_unfinished():
            self._fill_and_admit()
            out = s.schedule()
            r = self.result
            r.peak_seqs = max(r.peak_seqs, len(s.running))
            r.preemptions += len(out.preempted)
            r.prefix_cache_hits += out.prefix_cache_hits
            sampled = context = prefill = 0
            for item in out.scheduled:
                sampled += item.samples
                if item.is_decode:
                    context += item.start + 1  # keys the decode attends to, its own included
                else:
                    prefill += item.num_new_tokens
            if not out.scheduled and not out.preempted:
                raise RuntimeError("schedule stalled: nothing runs and nothing waiting can be admitted")
            r.add_steps(1, out.num_batched_tokens, sampled, context, context, prefill)
            for request in s.update(out, StepOutput([0] * sampled, [None] * sampled), 0.0, 0.0):
                row = self.row_of.pop(request.request_id)
                self.row_left[row] -= 1
                if not self.row_left[row]:
                    del self.row_left[row]
        return self.result

    def _fill_and_admit(self) -> None:
        """As `batchgen.jobs.loop`: the window filled, then rows to the engine while it holds fewer
        than `inflight_limit` of them."""
        rows = len(self.row_starts) - 1
        while self.next_row < rows and not self.window.full:
            i = self.row_starts[self.next_row]
            self.window.push(self.next_row, work=int(self.work[i]), priority=int(self.priority[i]))
            self.next_row += 1
        while self.window and len(self.row_left) < self.inflight:
            row = self.window.pop()
            start, end = self.row_starts[row], self.row_starts[row + 1]
            requests = [self._request(i) for i in range(start, end)]
            link_children(
                requests[0], requests[1:], self.limits.enable_prefix_caching, self.limits.block_size
            )
            for request in requests:
                self.row_of[request.request_id] = row
                self.scheduler.add_request(request)
            self.row_left[row] = end - start

    def _request(self, i: int) -> Request:
        """Sequence i as a request: its prompt's stand-in ids, its expected output as max_tokens."""
        seqs = self.seqs
        assert seqs.block_hashes is not None and seqs.block_offsets is not None  # `replayable` checked
        hashes = seqs.block_hashes[seqs.block_offsets[i] : seqs.block_offsets[i + 1]].tolist()
        ids = stand_in_prompt(hashes, self.prompts[i], self.limits.block_size, -1 - i)
        priority = int(self.priority[i])
        params = self.params.get(priority) or self.params.setdefault(
            priority, SamplingParams(priority=priority)
        )
        # A sequence scoring its prompt gets no prefix hits (`Request.max_cached_prefix`): no step
        # hands it scored positions here, so not after a preemption either (vLLM takes none).
        scored: list[object] | None = [] if self.scores[i] else None
        return Request(str(i), ids, params, 0.0, self.outputs[i], prompt_logprobs=scored)


def replay_schedule(
    seqs: Sequences, outputs: np.ndarray, limits: ScheduleLimits, trace: bool = False
) -> Schedule:
    """The engine's schedule of `seqs`, each stopping after its `outputs` tokens (module docstring).

    Args:
        seqs: the sequences in file order, with `block_hashes` and `block_offsets`.
        outputs: output tokens per sequence, `int64 [n]`, each >= 1 (and within max_model_len).
        limits: the engine's budgets, policy, preemption mode and the job's window.
        trace: keep every step in `Schedule.trace`.

    Returns:
        Schedule, method "engine".

    Raises:
        ValueError: the lengths differ in number, or the prompt blocks are missing.
        RuntimeError: a step with nothing to run while sequences wait (never with limits
            `EnginePlan` sized: a prompt the cache cannot hold is an error row before this).
    """
    return _Replay(seqs, outputs, limits, trace).run()
