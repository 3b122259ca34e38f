"""Per-step engine statistics for dashboards and benchmarks."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchgen.engine.scheduler import Scheduler
    from batchgen.engine.scheduler_output import SchedulerOutput
    from batchgen.model.step import StepOutput


@dataclass
class StepPhases:
    """Where one step's wall time went, in seconds (`time.perf_counter` spans).

    Attributes:
        schedule_s: `Scheduler.schedule`.
        inputs_s: the runner's inputs: `step_inputs` (per-request lists) and `ModelRunner.prepare`
            (flat tensors, positions, slot mapping, block tables).
        forward_s: the model's forward.
        sample_s: the sampler, log probabilities and the NaN check (token masks excluded). On a
            GPU the forward only queues kernels and the sampled ids' copy to the host waits for
            them, so the device's time lands here, not in `forward_s`. (The token masks' time is
            `StepStats.mask_time_s`.)
        update_s: `Scheduler.update` (appending tokens, stop checks, freeing blocks), the finished
            requests' outputs (detokenization) and the speculation gate.
    """

    schedule_s: float = 0.0
    inputs_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    update_s: float = 0.0


@dataclass
class StepStats:
    """What one `LLMEngine.step()` did and the state it left.

    Attributes:
        step: index of the step (0-based).
        time: `time.perf_counter()` seconds at the end of the step.
        step_time_s: wall time of the step in seconds.
        num_seqs: sequences in the step's batch (running batch size).
        num_batched_tokens: tokens in the step (prefill chunk tokens + decode tokens).
        num_prompt_tokens: prefill tokens computed in the step (after prefix-cache hits).
        num_generation_tokens: tokens sampled in the step.
        num_running / num_waiting / num_swapped: queue lengths after the step.
        kv_cache_usage: fraction of KV blocks held by live requests during the step (after
            scheduling, before finished requests free theirs), in [0, 1].
        num_preemptions: preemptions in this step.
        prefix_cache_queries / prefix_cache_hits: prompt tokens looked up / found in the prefix cache
            this step (hit rate = hits / queries).
        num_finished: requests that finished in the step.
        num_context_tokens: KV-cache positions the step's attention reads: the sum over its sequences
            of each one's context length after the step (cached prefix included). Sets the step's
            KV-cache traffic in the bench's roofline (`batchgen.bench.report.roofline`).
        num_attended_keys: keys attended to, summed over the step's tokens (causal: a token at
            position p attends to p + 1 keys). Sets the step's attention FLOPs.
        num_drafts / num_draft_tokens / num_accepted_tokens: speculative decoding in the step:
            requests that verified drafts, draft tokens verified, drafts the model agreed with
            (vLLM's `spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`).
        num_structured_seqs: sequences sampled under a structured outputs constraint in the step.
        num_structured_requests: requests with structured outputs added since the last step.
        mask_time_s: host seconds the step spent filling and applying their token masks.
        grammar_compile_s: seconds of each grammar compilation that ended since the last step.
        phases: where `step_time_s` went (`StepPhases`); `host_time_s` is the part outside the
            forward and the sampler.
    """

    step: int
    time: float
    step_time_s: float
    num_seqs: int
    num_batched_tokens: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_finished: int
    num_context_tokens: int = 0
    num_attended_keys: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_structured_seqs: int = 0
    num_structured_requests: int = 0
    mask_time_s: float = 0.0
    grammar_compile_s: tuple[float, ...] = ()
    phases: StepPhases = field(default_factory=StepPhases)

    @property
    def host_time_s(self) -> float:
        """Seconds of the step spent on the host outside the model's forward and the sampler:
        scheduling, input preparation, token masks, the update and outputs, and the rest of
        `step()` (swaps, bookkeeping). What a faster device cannot shorten."""
        return max(0.0, self.step_time_s - self.phases.forward_s - self.phases.sample_s)


def step_stats(
    step: int,
    sched: SchedulerOutput,
    sampled: StepOutput,
    span: tuple[float, float],
    phases: StepPhases,
    num_finished: int,
    kv_cache_usage: float,
    scheduler: Scheduler,
    num_structured_requests: int,
    grammar_compile_s: tuple[float, ...],
) -> StepStats:
    """The `StepStats` of step number `step`, which ran `sched` and returned `sampled`. `span`:
    `perf_counter` seconds at the step's start and once the runner returned; the step ends here,
    after its counters are summed (a pass over the step's requests is host time too). `phases`
    holds the schedule and inputs phases; the forward, sampler and update ones are set here. The
    queue lengths are `scheduler`'s now."""
    start, updated_at = span
    counts = sched.counts()
    end = time.perf_counter()
    phases.forward_s, phases.sample_s = sampled.forward_s, sampled.sample_s
    phases.update_s = end - updated_at
    return StepStats(
        step=step,
        time=end,
        step_time_s=end - start,
        num_seqs=len(sched.scheduled),
        num_batched_tokens=counts.num_batched_tokens,
        num_prompt_tokens=counts.num_prompt_tokens,
        num_generation_tokens=sched.num_output_tokens,
        num_running=len(scheduler.running),
        num_waiting=scheduler.num_waiting,
        num_swapped=len(scheduler.swapped),
        kv_cache_usage=kv_cache_usage,
        num_preemptions=len(sched.preempted),
        prefix_cache_queries=sched.prefix_cache_queries,
        prefix_cache_hits=sched.prefix_cache_hits,
        num_finished=num_finished,
        num_drafts=counts.num_drafts,
        num_draft_tokens=counts.num_draft_tokens,
        num_accepted_tokens=sched.num_accepted_tokens,
        num_context_tokens=counts.num_context_tokens,
        num_attended_keys=counts.num_attended_keys,
        num_structured_seqs=counts.num_structured_seqs,
        num_structured_requests=num_structured_requests,
        mask_time_s=sampled.mask_time_s,
        phases=phases,
        grammar_compile_s=grammar_compile_s,
    )


@dataclass
class EngineTotals:
    """Counters since the engine started (sums over all steps; `step_time_s`, `host_time_s`
    (`StepStats.host_time_s`) and `mask_time_s` in seconds).

    A field merges across engines (`merged`) by the function in its metadata's "merge" key, a sum
    when it has none; so a new counter is summed without touching `merged`, and a new peak declares
    `max` where it is declared.
    """

    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    finished: int = 0
    peak_kv_cache_usage: float = field(default=0.0, metadata={"merge": max})
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    structured_requests: int = 0
    grammars_compiled: int = 0
    grammar_compile_s: float = 0.0
    mask_time_s: float = 0.0
    step_time_s: float = 0.0
    host_time_s: float = 0.0

    def add(self, s: StepStats) -> None:
        self.steps += 1
        self.step_time_s += s.step_time_s
        self.host_time_s += s.host_time_s
        self.prompt_tokens += s.num_prompt_tokens
        self.generation_tokens += s.num_generation_tokens
        self.preemptions += s.num_preemptions
        self.prefix_cache_queries += s.prefix_cache_queries
        self.prefix_cache_hits += s.prefix_cache_hits
        self.finished += s.num_finished
        self.peak_kv_cache_usage = max(self.peak_kv_cache_usage, s.kv_cache_usage)
        self.spec_decode_num_drafts += s.num_drafts
        self.spec_decode_num_draft_tokens += s.num_draft_tokens
        self.spec_decode_num_accepted_tokens += s.num_accepted_tokens
        self.structured_requests += s.num_structured_requests
        self.grammars_compiled += len(s.grammar_compile_s)
        self.grammar_compile_s += sum(s.grammar_compile_s)
        self.mask_time_s += s.mask_time_s

    @classmethod
    def merged(cls, totals: Iterable[EngineTotals]) -> EngineTotals:
        """The counters of several engines (replicas, or one replica's successive processes) as one:
        every field combined by its merge rule (sum, or max for peaks). No input is modified.

        Args:
            totals: any number of EngineTotals; none gives all zeros.

        Returns:
            A new EngineTotals.
        """
        out = cls()
        rules = [(f.name, f.metadata.get("merge")) for f in fields(cls)]
        for t in totals:
            for name, rule in rules:
                mine, theirs = getattr(out, name), getattr(t, name)
                setattr(out, name, rule(mine, theirs) if rule else mine + theirs)
        return out

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Draft tokens accepted / proposed since start (0 when none was proposed)."""
        drafts = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / drafts if drafts else 0.0
