"""Steps launched on the device while the host goes on (`engine.overlap`): the forward and the
sampler of a step run on one device thread, in launch order, and the host reads a step's sampled ids
when it needs them (vLLM's async scheduling; mini-sglang's overlap scheduler).

A decode whose last token is still being sampled by the step before it takes that token from the
earlier step's sampled ids, on the device, just before its forward (`LaunchedStep` holds them): the
host never waits for a token to launch the next step. On a GPU the device thread only queues kernels
on its stream; on a CPU it runs them, while the Python of the next step runs on the main thread
(torch and batchgen's C kernels release the GIL while they compute).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from batchgen.model.flat_step import flatten_step
from batchgen.model.runner import ModelRunner, finite_rows, logit_errors
from batchgen.model.step import StepInput, StepOutput
from batchgen.model.step_rows import sampling_batch


class LaunchedStep:
    """A step queued on the device thread.

    Attributes:
        seqs: its sequences (their positions name a NaN row's error).
        num_rows: its sampled rows (one per sequence: launched steps have no drafts).
        launched_at: `perf_counter` seconds when it was queued.
    """

    def __init__(self, future: Future[torch.Tensor], seqs: list[StepInput], prepare_s: float) -> None:
        self._future = future
        self.seqs = seqs
        self.num_rows = sum(s.sample for s in seqs)
        self.prepare_s = prepare_s
        self.launched_at = time.perf_counter()

    def sampled(self) -> torch.Tensor:
        """int64 `[2, num_rows]` on the device: the sampled ids, then each row's finite flag (1: its
        logits were finite). Waits for the step (called on the device thread by the next step, so
        never a wait there: the thread runs steps in order)."""
        return self._future.result()

    def result(self) -> StepOutput:
        """Wait for the step and copy its sampled ids to the host (the step's one copy); a row whose
        logits were NaN or infinite gets `ModelRunner.execute`'s error (`logit_errors`). `forward_s` is
        the time the host waited."""
        began = time.perf_counter()
        token_ids, finite = self.sampled().tolist()
        waited = time.perf_counter() - began
        errors = logit_errors(finite, self.seqs)
        return StepOutput(
            token_ids, [None] * len(token_ids), errors, prepare_s=self.prepare_s, forward_s=waited
        )


class StepLauncher:
    """Queues steps of a `ModelRunner` on one device thread.

    Only the plain step is launched: each sequence samples (or not) one token with no log
    probabilities, token mask, penalty, drafts or scored rows (the engine runs any other step
    synchronously, through `ModelRunner.execute`), and decodes are not padded (`decode_buckets`'
    persistent buffers would be rewritten by the next launch while a step reads them).
    """

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchgen-device")

    def launch(
        self,
        seqs: list[StepInput],
        previous: LaunchedStep | None = None,
        fill: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> LaunchedStep:
        """Queue one step of `seqs` (decodes first, as `ModelRunner.execute` takes them).

        Args:
            previous: the step launched before this one, whose sampled ids `fill` reads.
            fill: (rows of `seqs`, rows of `previous`'s sampled ids), int64 each: each such row's
                token (a placeholder on the host, all decodes) is `previous`'s sampled id there.

        Raises:
            ValueError: a sequence asks for what a launched step cannot give (see the class).
        """
        if any(
            s.num_draft_tokens or s.logprobs is not None or s.token_mask or s.penalty or s.scored
            for s in seqs
        ):
            raise ValueError("a launched step takes plain sequences only; run this step with execute()")
        began = time.perf_counter()
        runner = self.runner
        input_ids, positions, meta, logits_indices = flatten_step(seqs, runner.block_size, runner.device)
        sampled = [s for s in seqs if s.sample]
        batch = sampling_batch(sampled)
        if fill is not None and previous is not None:
            rows = torch.from_numpy(fill[0]).to(runner.device)
            sources = torch.from_numpy(fill[1]).to(runner.device)
        prepare_s = time.perf_counter() - began

        @torch.inference_mode()
        def run() -> torch.Tensor:
            if fill is not None and previous is not None:
                input_ids[rows] = previous.sampled()[0][sources]
            logits = runner.model(input_ids, positions, runner.kv_caches, meta, logits_indices)
            stacked = runner.sampler.greedy_rows(logits, batch)
            if stacked is not None:
                return stacked
            finite = finite_rows(logits)
            return torch.stack([runner.sampler(logits, batch), finite.to(torch.int64)])

        return LaunchedStep(self._device.submit(run), seqs, prepare_s)

    def shutdown(self) -> None:
        """Let the queued steps finish and stop the device thread."""
        self._device.shutdown(wait=True)
