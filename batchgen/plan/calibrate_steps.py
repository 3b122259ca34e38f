"""The steps a calibration times (`batchgen.plan.calibrate`): an engine driven with requests of
random token ids, and the timing of each step it is asked to sample."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchgen.engine.llm_engine import LLMEngine
    from batchgen.engine.stats import StepStats

TIMED_STEPS = 3  # timed decode steps at each batch size
PREFILL_STEPS = 2  # timed full-budget prefill steps
BATCH_GROWTH = 4  # decode batch sizes 1, 4, 16, ... then the largest


@dataclass(frozen=True)
class StepSample:
    """One timed step: `kind` "prefill" or "decode", `series` ("context": rows at the calibration's
    context; "short": at a few tokens), rows `sampled`, `context` keys read by decode attention,
    `prefill` prompt tokens computed, `seconds` of wall time of `LLMEngine.step()`."""

    kind: str
    series: str
    sampled: int
    context: int
    prefill: int
    seconds: float


def decode_batches(max_batch: int) -> list[int]:
    """The decode batch sizes a calibration times: 1, 4, 16, ... below `max_batch`, then it."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= BATCH_GROWTH
    return [*sizes, max(max_batch, 1)]


class _Steps:
    """Drives an engine with random-token requests and times its steps."""

    def __init__(self, engine: LLMEngine, seed: int = 0) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.live: list[str] = []
        self.count = 0
        self.samples: list[StepSample] = []

    def ids(self, n: int) -> list[int]:
        # Above the first 256 ids: byte and special tokens are not ordinary text.
        low = min(256, self.engine.vocab_limit - 1)
        return [self.rng.randrange(low, self.engine.vocab_limit) for _ in range(n)]

    def add(self, prompt: list[int], max_tokens: int, computed: bool = False) -> None:
        """Queue a request of `prompt`; `computed`: as if all but its last prompt token were in the
        KV cache already (`fill_kv` writes their blocks), so it starts decoding at once."""
        from batchgen.sampling_params import SamplingParams

        rid = f"calibration-{self.count}"
        self.count += 1
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        self.engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
        if computed:
            # The scheduler allocates blocks for the computed tokens and runs only the last one: a
            # decode at a context of len(prompt) without prefilling it (its K/V content does not
            # change how long a step takes).
            self.engine.requests[rid].num_computed_tokens = len(prompt) - 1
        self.live.append(rid)

    def fill_kv(self) -> None:
        """Write every live request's KV blocks. A CPU cache is an anonymous map whose unwritten
        pages all read the one zero page, which stays in the core's cache: attention over them
        would be timed far faster than over a run's blocks, which prefill wrote."""
        import torch

        blocks = sorted({b for rid in self.live for b in self.engine.requests[rid].block_table})
        index = torch.tensor(blocks, dtype=torch.long)
        for k, v in self.engine.runner.kv_caches:
            index = index.to(k.device)
            k.index_fill_(0, index, 0.01)
            v.index_fill_(0, index, 0.01)

    def step(self, series: str | None = None) -> StepStats | None:
        """One step; with `series`, its time is a sample. Returns the step's `StepStats`."""
        start = time.perf_counter()
        for out in self.engine.step():
            self.live.remove(out.request_id)
        seconds = time.perf_counter() - start
        s = self.engine.last_step
        if series is not None and s is not None:
            kind = "prefill" if s.num_prompt_tokens else "decode"
            context = 0 if s.num_prompt_tokens else s.num_context_tokens
            self.samples.append(
                StepSample(kind, series, s.num_generation_tokens, context, s.num_prompt_tokens, seconds)
            )
        return s

    def until_decoding(self) -> None:
        """Step until a step computes no prompt token (every live row decodes)."""
        while self.engine.has_unfinished_requests():
            s = self.step()
            if s is not None and s.num_prompt_tokens == 0:
                return

    def clear(self) -> None:
        for rid in self.live:
            self.engine.abort_request(rid)
        self.live = []


def measure_steps(engine: LLMEngine, prompt_len: int, context_len: int, max_batch: int) -> list[StepSample]:
    """Time the steps `batchgen.plan.calibrate` describes on `engine` (an `LLMEngine` with no
    request); returns the samples. The requests it adds are aborted before it returns."""
    steps = _Steps(engine)
    budget = engine.max_num_batched_tokens
    kv_tokens = engine.num_gpu_blocks * engine.block_size
    steps.add(steps.ids(8), 3)  # warm-up: first calls build kernels' state
    steps.until_decoding()
    steps.clear()
    length = max(1, min(prompt_len, budget, engine.max_model_len - 2))
    for _ in range(max(1, min(PREFILL_STEPS * budget, kv_tokens // 2) // length)):
        steps.add(steps.ids(length), 1)
    for _ in range(PREFILL_STEPS):
        if steps.engine.has_unfinished_requests():
            steps.step("prefill")
    steps.clear()
    room = TIMED_STEPS * 2 * len(decode_batches(max_batch)) + 8  # decode steps a row lives
    # Every row's blocks must fit at once: a preempted row would prefill its whole context.
    fit = (kv_tokens - kv_tokens // 10) // max(max_batch, 1) - room
    context = max(2, min(context_len, engine.max_model_len - room, fit))
    for batch in decode_batches(max_batch):
        while len(steps.live) < batch:
            steps.add(steps.ids(context), room, computed=True)
        steps.step()  # admits the new rows (their blocks allocated)
        steps.fill_kv()
        steps.until_decoding()
        for _ in range(TIMED_STEPS):
            steps.step("context")
    steps.clear()
    for _ in range(max(max_batch, 1)):
        steps.add(steps.ids(2), TIMED_STEPS + 4)
    steps.until_decoding()
    for _ in range(TIMED_STEPS):
        steps.step("short")
    steps.clear()
    return steps.samples
