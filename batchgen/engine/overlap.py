"""Overlapped steps: the host schedules and launches step N+1 while the device runs step N, and
applies step N's tokens after (vLLM's async scheduling, `async_scheduling=True`).

The scheduler's bookkeeping runs one step behind the device. When step N is launched, each request
it samples gets a placeholder as its last token (`PLACEHOLDER`), so step N+1 can schedule it as a
decode; its input token is taken on the device from step N's sampled ids (`model.launch`). Once
step N+1 is launched, step N's tokens come back (the step's one copy to the host) and replace the
placeholders, with the usual stop checks: a request that stopped at step N is finished then, its
row of step N+1 is dropped (no token of it is written) and its blocks are freed once step N+1 is
done (step N+1 still writes into them).

Only plain requests overlap (no log probabilities, prompt log probabilities, penalties, structured
outputs or reasoning parser, no speculative decoding or swapped requests), and a step launched
while another runs never preempts (`Scheduler.schedule(allow_preemption=False)`): otherwise the
engine first applies the running step, then steps synchronously.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from batchgen.engine.request import Request, RequestStatus
from batchgen.engine.scheduler_output import SchedulerOutput
from batchgen.engine.stats import StepPhases
from batchgen.engine.step_inputs import step_inputs
from batchgen.model.launch import LaunchedStep, StepLauncher
from batchgen.sampling_params import SamplingParams

if TYPE_CHECKING:
    from batchgen.engine.block_manager import BlockManager
    from batchgen.engine.scheduler import Scheduler
    from batchgen.model.runner import ModelRunner
    from batchgen.model.step import StepOutput


class Engine(Protocol):
    """What the overlapped loop uses of its `LLMEngine`."""

    @property
    def runner(self) -> ModelRunner: ...

    @property
    def scheduler(self) -> Scheduler: ...

    @property
    def block_manager(self) -> BlockManager: ...

    @property
    def reasoning_parser(self) -> object | None: ...

    @property
    def speculation(self) -> object | None: ...

    def record_step(
        self,
        sched: SchedulerOutput,
        sampled: StepOutput,
        start: float,
        updated_at: float,
        phases: StepPhases,
        num_finished: int,
        kv_cache_usage: float,
    ) -> None: ...


# A token the host does not know yet: sampled by a step still on the device.
PLACEHOLDER = -1


def overlappable(params: SamplingParams) -> bool:
    """Whether a request with `params` can run in overlapped steps (see the module)."""
    return (
        params.logprobs is None
        and params.prompt_logprobs is None
        and params.structured_outputs is None
        and not params.penalized
    )


@dataclass
class _InFlight:
    """A launched step whose tokens the host has not applied yet."""

    sched: SchedulerOutput
    launched: LaunchedStep
    rows: dict[int, int]  # id(request) -> its row of the step's sampled ids
    kv_cache_usage: float  # when it was scheduled
    free_after: list[Request] = field(default_factory=list)  # finished; blocks freed after this step


class OverlappedSteps:
    """The overlapped step loop of one `LLMEngine` (its `overlap` when `async_scheduling` is on)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.launcher = StepLauncher(engine.runner)
        self.in_flight: _InFlight | None = None
        self.sync_only: set[str] = set()  # live request ids that need synchronous steps

    def can_overlap(self) -> bool:
        e = self.engine
        return (
            not self.sync_only
            and e.reasoning_parser is None
            and e.speculation is None
            and not e.scheduler.swapped
            and not (self.in_flight is not None and self.in_flight.sched.stalled)
        )

    def step(self, start: float) -> list[Request] | None:
        """One overlapped step: launch the next step, then apply the one before it (its stats are
        this step's). Returns the requests that finished (their outputs are the engine's to build),
        or None when this step must run synchronously (nothing is in flight then)."""
        e = self.engine
        previous = self.in_flight
        if not self.can_overlap():
            if previous is None:
                return None
            self.in_flight = None  # applied alone: the next step runs synchronously
            return self._apply(previous, start, StepPhases())
        sched = e.scheduler.schedule(allow_preemption=previous is None)
        scheduled = time.perf_counter()
        usage = e.block_manager.usage
        # Swaps come from preemption and swapped requests, so only with nothing in flight.
        e.runner.swap_out(sched.swap_out)
        e.runner.swap_in(sched.swap_in)
        self.in_flight = self._launch(sched, previous, usage) if sched.scheduled else None
        phases = StepPhases(schedule_s=scheduled - start, inputs_s=time.perf_counter() - scheduled)
        finished = self._apply(previous, start, phases) if previous is not None else []
        if self.in_flight is not None:
            self._hold_placeholders(self.in_flight)
        return finished

    def drain(self) -> list[Request]:
        """Apply the step in flight, waiting for it (nothing is launched); returns the requests
        that finished."""
        flight, self.in_flight = self.in_flight, None
        return self._apply(flight, time.perf_counter(), StepPhases()) if flight is not None else []

    def _launch(self, sched: SchedulerOutput, previous: _InFlight | None, kv_cache_usage: float) -> _InFlight:
        inputs = step_inputs(sched)
        fill = None
        if previous is not None:
            dst, src = [], []
            for i, item in enumerate(sched.scheduled):
                row = previous.rows.get(id(item.request))
                if row is not None and item.request.token_ids[item.start] == PLACEHOLDER:
                    dst.append(i)
                    src.append(row)
            fill = (np.array(dst, dtype=np.int64), np.array(src, dtype=np.int64))
        launched = self.launcher.launch(inputs, previous.launched if previous else None, fill)
        bm = self.engine.block_manager
        for item in sched.scheduled:  # the prompt chunks' progress, known before their K/V are
            if item.request.first_scheduled_time is None:  # its wait ends when a step serves it
                item.request.first_scheduled_time = launched.launched_at
            if not item.samples:
                item.request.num_computed_tokens = item.start + item.num_new_tokens
                bm.cache_full_blocks(item.request)
        rows = {id(item.request): j for j, item in enumerate(s for s in sched.scheduled if s.samples)}
        return _InFlight(sched, launched, rows, kv_cache_usage)

    def _hold_placeholders(self, flight: _InFlight) -> None:
        """Each request the step samples (and that is still running) gets a placeholder token, so
        the next step schedules it as a decode."""
        bm = self.engine.block_manager
        for item in flight.sched.scheduled:
            r = item.request
            if item.samples and r.status is RequestStatus.RUNNING:
                r.token_ids.append(PLACEHOLDER)
                r.num_computed_tokens = len(r.token_ids) - 1
                bm.cache_full_blocks(r)

    def _apply(self, flight: _InFlight, start: float, phases: StepPhases) -> list[Request]:
        """Wait for `flight`, then replace its placeholders by the sampled tokens and check the
        stops (`detokenizer.check_stop`, as `Scheduler.update` does); its stats are recorded as
        those of the engine step that began at `start` (`phases`: its schedule and inputs)."""
        e = self.engine
        sampled = flight.launched.result()
        now = time.perf_counter()
        errors = sampled.errors
        finished: list[Request] = []
        in_next = set() if self.in_flight is None else {id(s.request) for s in self.in_flight.sched.scheduled}
        for item in flight.sched.scheduled:
            r = item.request
            if not item.samples or r.status is not RequestStatus.RUNNING:
                continue  # a prompt chunk, or a request that finished (or was aborted) a step ago
            row = flight.rows[id(r)]
            r.token_ids.pop()  # its placeholder
            error = None if errors is None else errors[row]
            reason: str | None
            if error is not None:
                r.error, reason = error, "error"
                r.num_computed_tokens = len(r.token_ids)
            else:
                reason = e.scheduler.append_token(r, sampled.token_ids[row], now)
                flight.sched.num_output_tokens += 1
            if reason is None:
                continue
            # The next step still writes into its blocks when it is in that step: freed after it.
            in_next_step = id(r) in in_next
            e.scheduler.finish(r, reason, now, free_blocks=not in_next_step)
            self.sync_only.discard(r.request_id)
            if in_next_step:
                self.in_flight.free_after.append(r)  # type: ignore[union-attr]
            finished.append(r)
        for r in flight.free_after:
            e.block_manager.free(r)
        e.record_step(flight.sched, sampled, start, now, phases, len(finished), flight.kv_cache_usage)
        return finished
