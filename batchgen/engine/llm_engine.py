"""LLMEngine: the step loop (schedule -> execute -> scheduler.update -> outputs)."""

from __future__ import annotations

import logging
import time

import torch

from batchgen.config import EngineConfig, resolve_device
from batchgen.engine.block_manager import BlockManager
from batchgen.engine.cpu_threads import CpuThreads
from batchgen.engine.logprobs import TokenTexts
from batchgen.engine.overlap import OverlappedSteps, overlappable
from batchgen.engine.parallel_sampling import SampleGroups, child_params, link_children
from batchgen.engine.policy import make_policy
from batchgen.engine.reasoning import ReasoningGrammar, ReasoningParser
from batchgen.engine.request import Request, RequestStatus
from batchgen.engine.request_output import request_output
from batchgen.engine.scheduler import Scheduler, SchedulerOutput
from batchgen.engine.sizing import plan_engine, resolve_dtype, slow_dtype_reason
from batchgen.engine.spec_gate import plan_speculation
from batchgen.engine.stats import EngineTotals, StepPhases, StepStats, step_stats
from batchgen.engine.step_inputs import step_inputs
from batchgen.engine.structured import RequestGrammar, StructuredRequests
from batchgen.engine.tokenize import encode_prompt, vocabulary_limit
from batchgen.model.loading import loader
from batchgen.model.quantization import check_quantization, quantize_model
from batchgen.model.runner import ModelRunner
from batchgen.model.step import StepOutput
from batchgen.outputs import CompletionOutput, RequestMetrics, RequestOutput
from batchgen.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """Continuous batching over a paged KV cache.

    Args:
        config: engine options (vLLM's names). `num_threads`, when set, is applied with
            `torch.set_num_threads`, which is process-wide: it stays after the engine is gone.

    Raises:
        ValueError: inconsistent options (e.g. `max_num_batched_tokens` below `max_model_len`
            with chunked prefill off); loader errors for a missing or unsupported model.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Before the kernels are measured: they are timed at the thread count the run will use. (It
        # refuses more threads than CPUs, so before torch is given them.)
        self.cpu_threads = CpuThreads(config.num_threads) if config.device != "cuda" else None
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        # Before any model work: "cuda" without CUDA is a ValueError naming `device`, not torch's assert.
        self.device = torch.device(resolve_device(config.device))
        check_quantization(config.quantization, self.device)  # --device auto on a GPU: before any loading
        files = loader.resolve_model(config.model)
        self.model_files = files
        self.model_config = files.config
        self.tokenizer = loader.load_tokenizer(files)
        self.token_texts = TokenTexts(self.tokenizer)  # token id -> its text alone, for log probabilities
        self.vocab_limit = vocabulary_limit(self.tokenizer, int(files.config.vocab_size))
        self.eos_token_ids = loader.eos_token_ids(files, self.tokenizer)
        self.dtype = resolve_dtype(config.dtype, files.config, self.device)
        if (slow := slow_dtype_reason(self.dtype, self.device)) is not None:
            logger.warning("dtype %s: %s; --dtype auto picks the fastest one here", config.dtype, slow)
        self.block_size = config.block_size

        self.plan = plan_engine(config, files.config, self.device, self.dtype)
        self.max_model_len = self.plan.max_model_len
        self.max_num_batched_tokens = self.plan.max_num_batched_tokens
        num_blocks, num_swap_blocks = self.plan.num_blocks, self.plan.num_swap_blocks

        self.runner = self._make_runner(files, num_blocks, num_swap_blocks)
        self.num_gpu_blocks = num_blocks
        # The measured kernels: their summary is the start line's; the bench and `tune` read the rest.
        self.kernel_choice = self.runner.kernel_choice
        # What runs quantized, and the bytes of the weights a step reads (the bench's roofline).
        self.quantization = self.runner.quantization
        self.weight_bytes = self.runner.weight_bytes
        self.block_manager = BlockManager(
            num_blocks, self.block_size, config.enable_prefix_caching, num_swap_blocks
        )
        self.speculation = plan_speculation(config, self.runner, self.max_num_batched_tokens, self.dtype)
        self.scheduler = Scheduler(
            self.block_manager,
            make_policy(config.policy, config.aging_steps),
            config.max_num_seqs,
            self.max_num_batched_tokens,
            config.enable_chunked_prefill,
            config.preemption_mode,
            tokenizer=self.tokenizer,
            max_model_len=self.max_model_len,
            proposer=self.speculation.proposer if self.speculation else None,
            speculative_max_batch=self.speculation.gate.max_batch if self.speculation else 0,
        )
        self.requests: dict[str, Request] = {}
        # Structured requests wait there, outside the scheduler, until their grammar compiles.
        self.structured = StructuredRequests(
            self.tokenizer, int(files.config.vocab_size), self.eos_token_ids, config.grammar_compile_timeout
        )
        self._new_structured = 0  # requests with structured outputs added since the last step
        self.reasoning_parser = (
            ReasoningParser(config.reasoning_parser, self.tokenizer) if config.reasoning_parser else None
        )
        self.groups = SampleGroups()  # requests with n > 1
        self._rejected: list[RequestOutput] = []
        self.last_step: StepStats | None = None
        self.totals = EngineTotals()
        self.overlap = OverlappedSteps(self) if config.async_scheduling else None

    def _make_runner(self, files: loader.ModelFiles, num_blocks: int, num_swap_blocks: int) -> ModelRunner:
        """The model runner: weights loaded (and quantized), kernels chosen, KV cache allocated."""
        config = self.config
        return ModelRunner(
            files.config,
            loader.iter_weights(files),
            self.dtype,
            self.device,
            self.block_size,
            num_blocks,
            num_swap_blocks,
            max_positions=self.max_model_len + 1,
            attention_backend=config.attention_backend,
            kernels=config.kernels,
            one_weight_layout=config.one_weight_layout,
            max_step_rows=self.max_num_batched_tokens,
            max_logit_rows=config.max_num_seqs,
            seed=config.seed,
            quantize=lambda model: quantize_model(model, config.quantization, files),
            decode_buckets=config.decode_buckets,
        )

    @property
    def model_name(self) -> str:
        """The model's short display name (GGUF stem, hub repo name or directory name)."""
        return self.model_files.name

    @property
    def start_line(self) -> str:
        """What the engine settled on at start, for the job's log: the quantization, the kernel
        choice and the speculative decoding gate."""
        parts = [self.runner.describe()]
        if self.speculation is not None:
            parts.append(self.speculation.describe())
        return "; ".join(parts)

    # ---- requests ----
    def encode_prompt(self, prompt: object) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) for a string, chat messages or a token-id dict.

        Raises:
            ValueError / TypeError: empty or malformed prompt, or token ids the model cannot embed.
        """
        return encode_prompt(self.tokenizer, prompt, vocab_size=int(self.model_config.vocab_size))

    def check_prompt_len(self, num_tokens: int) -> str | None:
        """Why a prompt of `num_tokens` tokens can never run here (no room for one output token
        within max_model_len), or None when it fits. The one length check: jobs ask it too."""
        return self.plan.check_prompt_len(num_tokens)

    def add_request(
        self,
        request_id: str,
        prompt: object,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a prompt. A prompt that can never run comes back from the next `step()` as an
        error output (finish_reason "error") instead of raising, so one bad row never stops a job.
        With `sampling_params.n` > 1 the prompt runs as n sequences, and one output with n
        completions comes back when the last of them finishes (`parallel_sampling`).

        Raises:
            ValueError: `request_id` is already live, or a sampling field is out of range.
            TypeError: `sampling_params` is not a `SamplingParams`, or a field has the wrong type.
        """
        if (
            request_id in self.requests
            or request_id in self.groups
            or any(out.request_id == request_id for out in self._rejected)  # its error not yet returned
        ):
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}; "
                "write SamplingParams(max_tokens=..., ...)"
            )
        params.validate()  # again: its fields may have been changed since it was built
        self._new_structured += params.structured_outputs is not None
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        if params.n > 1:  # n child sequences, merged into one output when the last one finishes
            ids = self.groups.add(request_id, params.n)
            for i, child_id in enumerate(ids):
                self._add_one(child_id, prompt, child_params(params, i), arrival)
            first = self.requests.get(ids[0])
            if first is not None:  # admitted once the first has the prompt's blocks cached
                # (a child whose grammar is known to fail is already an error output, not a request)
                children = [self.requests[child_id] for child_id in ids[1:] if child_id in self.requests]
                link_children(first, children, self.config.enable_prefix_caching, self.block_size)
            return
        self._add_one(request_id, prompt, params, arrival)

    def _add_one(self, request_id: str, prompt: object, params: SamplingParams, arrival: float) -> None:
        """Queue one sequence (n = 1), or its rejection."""
        try:
            text, token_ids = self.encode_prompt(prompt)
        except (ValueError, TypeError) as exc:
            self._reject(request_id, None, [], arrival, f"invalid prompt: {exc}")
            return
        unknown = [t for t in params.stop_token_ids or () if t >= self.vocab_limit]
        if unknown:  # never sampled: the request would run to max_tokens while asking to stop
            self._reject(
                request_id,
                text,
                token_ids,
                arrival,
                f"stop_token_ids holds ids outside the vocabulary [0, {self.vocab_limit}): {unknown[:5]}; "
                "fix or remove them",
            )
            return
        if (too_long := self.check_prompt_len(len(token_ids))) is not None:
            self._reject(request_id, text, token_ids, arrival, too_long)
            return
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        request = Request(
            request_id=request_id,
            token_ids=list(token_ids),
            sampling_params=params,
            arrival_time=arrival,
            max_tokens=max_tokens,
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            prompt=text,
            generator=generator,
            output_logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
        )
        if self.reasoning_parser is not None:
            request.reasoning = self.reasoning_parser.state(request.prompt_token_ids)
        self.requests[request_id] = request
        if self.overlap is not None and not overlappable(params):
            self.overlap.sync_only.add(request_id)
        if params.structured_outputs is not None:
            self.structured.add(request)  # the scheduler gets it once its grammar is compiled
            self._release_structured()
        else:
            self.scheduler.add_request(request)

    def prepare(self, sampling_params: SamplingParams) -> None:
        """Start what a request with `sampling_params` needs before it can run (compiling its
        structured outputs constraint), so that it is ready when the request is added; a job calls
        it as rows enter its look-ahead window. Never raises for a bad constraint: the request that
        uses it gets the error."""
        if sampling_params.structured_outputs is not None:
            self.structured.prepare(sampling_params.structured_outputs)

    def _release_structured(self) -> None:
        """Hand the structured requests whose grammar is ready to the scheduler, and turn those
        whose grammar failed into error outputs (returned by the next step)."""
        ready, failed = self.structured.release()
        for request in ready:
            if request.reasoning is not None and isinstance(request.grammar, RequestGrammar):
                # The grammar takes the answer only: it starts after the thinking.
                request.grammar = ReasoningGrammar(request.grammar, request.reasoning)
            self.scheduler.add_request(request)
        for request, error in failed:
            del self.requests[request.request_id]
            field = f"structured_outputs.{request.sampling_params.structured_outputs.kind}"
            self._reject(
                request.request_id,
                request.prompt,
                request.prompt_token_ids,
                request.arrival_time,
                f"{field} {error}",
            )

    def _reject(
        self, request_id: str, text: str | None, token_ids: list[int], arrival: float, message: str
    ) -> None:
        now = time.perf_counter()
        if self.overlap is not None:
            self.overlap.sync_only.discard(request_id)
        self._rejected.append(
            RequestOutput(
                request_id=request_id,
                prompt=text,
                prompt_token_ids=list(token_ids),
                outputs=[CompletionOutput(0, "", [], "error")],
                finished=True,
                metrics=RequestMetrics(arrival_time=arrival, finish_time=now),
                error=message,
            )
        )

    def abort_request(self, request_id: str) -> None:
        """Drop a live request (with n > 1, all its sequences) and free its blocks (no output is produced)."""
        for rid in self.groups.children(request_id) or [request_id]:
            request = self.requests.pop(rid, None)
            if request is not None and not request.is_finished and not self.structured.drop(request):
                self.scheduler.remove(request)
                request.status = RequestStatus.FINISHED  # so a step in flight drops its row
            if self.overlap is not None:
                self.overlap.sync_only.discard(rid)
            self._rejected = [out for out in self._rejected if out.request_id != rid]
        self.groups.drop(request_id)

    def has_unfinished_requests(self) -> bool:
        in_flight = self.overlap is not None and self.overlap.in_flight is not None
        return bool(self._rejected) or self.scheduler.has_unfinished() or bool(self.structured) or in_flight

    def num_unfinished_requests(self) -> int:
        """Requests whose output has not come back yet; one with n > 1 counts once, as in vLLM."""
        pending = list(self.requests) + [out.request_id for out in self._rejected]
        return sum(not self.groups.is_child(rid) for rid in pending) + self.groups.num_live()

    # ---- the loop ----
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns the requests that finished in it (rejected ones included)."""
        start = time.perf_counter()
        if self.cpu_threads is not None:
            self.cpu_threads.maybe_adjust()
        self.last_step = None  # set again below when the step runs the model
        self._release_structured()
        if not self.scheduler.has_unfinished() and self.structured and not self._rejected:
            self.structured.wait(0.05)  # nothing to run but grammars compiling: no busy loop
            self._release_structured()
        finished = self._rejected
        self._rejected = []
        if self.overlap is not None and (done := self.overlap.step(start)) is not None:
            return self._finished_outputs(finished, done)
        if not self.scheduler.has_unfinished():
            return self.groups.collect(finished)
        sched = self.scheduler.schedule()
        scheduled = time.perf_counter()
        # Read before the update frees the blocks of the requests that finish in this step: a
        # request prefilled and finished in one step still held its blocks during it.
        kv_cache_usage = self.block_manager.usage
        self.runner.swap_out(sched.swap_out)
        self.runner.swap_in(sched.swap_in)
        inputs_began = time.perf_counter()
        inputs = step_inputs(sched, persistent=self.overlap is None)
        inputs_s = time.perf_counter() - inputs_began
        sampled = self.runner.execute(inputs) if sched.scheduled else StepOutput([], [])
        now = time.perf_counter()
        outputs = self._finished_outputs(finished, self.scheduler.update(sched, sampled, start, now))
        if self.speculation is not None:  # the gate follows the job's acceptance
            self.scheduler.speculative_max_batch = self.speculation.observe(sched)
        phases = StepPhases(schedule_s=scheduled - start, inputs_s=inputs_s + sampled.prepare_s)
        self.record_step(sched, sampled, start, now, phases, len(outputs), kv_cache_usage)
        return outputs

    def _finished_outputs(self, outputs: list[RequestOutput], requests: list[Request]) -> list[RequestOutput]:
        """`outputs` and those of the finished `requests` (which leave the engine), n > 1 merged."""
        for r in requests:
            del self.requests[r.request_id]
            if self.overlap is not None:
                self.overlap.sync_only.discard(r.request_id)
            outputs.append(request_output(r, self.tokenizer, self.token_texts))
        return self.groups.collect(outputs)

    def record_step(
        self,
        sched: SchedulerOutput,
        sampled: StepOutput,
        start: float,
        updated_at: float,
        phases: StepPhases,
        num_finished: int,
        kv_cache_usage: float,
    ) -> None:
        """The step's `StepStats` (`stats.step_stats`), kept in `last_step` and added to `totals`."""
        stats = step_stats(
            self.totals.steps,
            sched,
            sampled,
            (start, updated_at),
            phases,
            num_finished,
            kv_cache_usage,
            self.scheduler,
            self._new_structured,
            tuple(self.structured.take_compile_times()),
        )
        self._new_structured = 0
        self.last_step = stats
        self.totals.add(stats)
