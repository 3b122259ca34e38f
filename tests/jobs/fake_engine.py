"""A model-free engine with the LLMEngine job API (API.txt), for fast job-layer tests.

Tokens are characters (BOS = 1, then one id per character); the "model" emits a deterministic
letter sequence derived from the prompt ids, one token per step per running request, so jobs
take several steps and requests finish out of order like in the real engine. Token id 27 ("z")
is EOS (finish_reason "stop").
"""

from __future__ import annotations

import time
from collections import deque

from batchgen.config import EngineConfig
from batchgen.engine.stats import EngineTotals, StepStats
from batchgen.outputs import CompletionOutput, RequestMetrics, RequestOutput
from batchgen.sampling_params import SamplingParams

BOS = 1
EOS = 27


def char_ids(text: str) -> list[int]:
    """The fake tokenization: BOS then one id per character (ids 2..251)."""
    return [BOS] + [ord(c) % 250 + 2 for c in text]


class FakeEngine:
    """Engine stand-in implementing `batchgen.engine.protocol.Engine`, with no tokenizer, no model
    name and an empty start line.

    Args:
        config: engine options; `max_num_seqs` bounds requests advanced per step, `max_model_len`
            (default 64) rejects longer prompts with finish_reason "error".
        on_step: called with the step index before each step (tests raise or send signals here).
    """

    def __init__(self, config: EngineConfig | None = None, on_step=None) -> None:
        self.config = config or EngineConfig()
        self.max_model_len = self.config.max_model_len or 64
        self.block_size = self.config.block_size
        self.tokenizer = None
        self.model_name = None
        self.start_line = ""
        self.on_step = on_step
        self.requests: dict[str, dict] = {}
        self.queue: deque[str] = deque()
        self.rejected: list[RequestOutput] = []
        self.last_step: StepStats | None = None
        self.totals = EngineTotals()
        self.added: list[str] = []
        self.prepared: list[SamplingParams] = []

    def encode_prompt(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, list):
            text = "".join(f"<{m['role']}>{m['content']}" for m in prompt)
        elif isinstance(prompt, str):
            text = prompt
        else:
            raise TypeError(f"a prompt must be a string or messages, got {type(prompt).__name__}")
        if not text.strip():
            raise ValueError("the prompt is empty")
        return text, char_ids(text)

    def check_prompt_len(self, num_tokens: int) -> str | None:
        if num_tokens < self.max_model_len:
            return None
        return f"prompt has {num_tokens} tokens but max_model_len is {self.max_model_len}"

    def prepare(self, sampling_params: SamplingParams) -> None:
        self.prepared.append(sampling_params)

    def add_request(
        self, request_id: str, prompt, sampling_params: SamplingParams, arrival_time=None
    ) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        text, ids = self.encode_prompt(prompt)
        now = time.perf_counter() if arrival_time is None else arrival_time
        self.added.append(request_id)
        if (too_long := self.check_prompt_len(len(ids))) is not None:
            self.rejected.append(
                RequestOutput(
                    request_id,
                    text,
                    ids,
                    [CompletionOutput(0, "", [], "error")],
                    True,
                    RequestMetrics(now, finish_time=now),
                    error=too_long,
                )
            )
            return
        room = self.max_model_len - len(ids)
        max_tokens = room if sampling_params.max_tokens is None else min(sampling_params.max_tokens, room)
        self.requests[request_id] = {"ids": ids, "out": [], "max": max_tokens, "arrival": now, "first": None}
        self.queue.append(request_id)

    def abort_request(self, request_id: str) -> None:
        if self.requests.pop(request_id, None) is not None:
            self.queue.remove(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self.rejected)

    def num_unfinished_requests(self) -> int:
        return len(self.requests) + len(self.rejected)

    def step(self) -> list[RequestOutput]:
        if self.on_step is not None:
            self.on_step(self.totals.steps)
        start = time.perf_counter()
        finished, self.rejected = self.rejected, []
        batch = list(self.queue)[: self.config.max_num_seqs]
        prompt_tokens = 0
        now = time.perf_counter()
        for rid in batch:
            r = self.requests[rid]
            if not r["out"]:
                prompt_tokens += len(r["ids"])
                r["first"] = now
            token = 2 + (sum(r["ids"]) + 7 * len(r["out"])) % 26
            r["out"].append(token)
            reason = "stop" if token == EOS else "length" if len(r["out"]) >= r["max"] else None
            if reason is not None:
                del self.requests[rid]
                self.queue.remove(rid)
                text = "".join(chr(95 + t) for t in r["out"] if t != EOS)
                finished.append(
                    RequestOutput(
                        rid,
                        None,
                        r["ids"],
                        [CompletionOutput(0, text, list(r["out"]), reason)],
                        True,
                        RequestMetrics(r["arrival"], r["first"], r["first"], now),
                    )
                )
        stats = StepStats(
            step=self.totals.steps,
            time=now,
            step_time_s=now - start,
            num_seqs=len(batch),
            num_batched_tokens=prompt_tokens + len(batch),
            num_prompt_tokens=prompt_tokens,
            num_generation_tokens=len(batch),
            num_running=len(self.queue),
            num_waiting=0,
            num_swapped=0,
            kv_cache_usage=min(1.0, len(self.queue) / 64),
            num_preemptions=0,
            prefix_cache_queries=prompt_tokens,
            prefix_cache_hits=0,
            num_finished=len(finished),
        )
        self.last_step = stats
        self.totals.add(stats)
        return finished


def fake_factory(**kwargs):
    """An engine_factory for run_job that builds a FakeEngine (kwargs go to FakeEngine)."""
    engines: list[FakeEngine] = []

    def factory(config: EngineConfig) -> FakeEngine:
        engine = FakeEngine(config, **kwargs)
        engines.append(engine)
        return engine

    factory.engines = engines  # type: ignore[attr-defined]
    return factory
