"""Overlapped steps (`async_scheduling`, `batchgen.engine.overlap`): the same tokens and finish
reasons as synchronous steps, exact stops one step behind, and a step time of max(host, device)
rather than their sum."""

from __future__ import annotations

import random
import statistics
import time

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.model import launch


def _prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(100, 4000) for _ in range(rng.randint(2, 30))]} for _ in range(n)
    ]


def _params(stop_ids: list[list[int]]) -> list[SamplingParams]:
    """Greedy rows of different lengths, rows that stop on a token they are known to sample, a
    row with min_tokens, and seeded random rows (their own generators: the same draws either way)."""
    params = []
    for i, stops in enumerate(stop_ids):
        if i % 4 == 3:
            params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=10 + i))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=4 + 2 * i, stop_token_ids=stops,
                                         min_tokens=3 if i == 2 else 0))  # fmt: skip
    return params


def _run(path, prompts, params, **options):
    llm = LLM(str(path), dtype="float32", **options)
    outs = llm.generate(prompts, params)
    return llm, [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


@pytest.mark.parametrize("max_num_seqs", [16, 5])
def test_overlapped_steps_equal_synchronous_steps(tiny_model_dir, max_num_seqs, monkeypatch) -> None:
    """Requests stop at different steps (length, stop ids of tokens the synchronous run sampled
    mid-output, min_tokens), so rows finish while the next step is already running; with 5
    sequences at most, finished rows' places go to waiting prompts as they finish."""
    path = tiny_model_dir("llama")
    prompts = _prompts(14)
    _, free = _run(path, prompts, [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 14)
    stop_ids = [[tokens[3 + i % 5]] if i % 3 == 0 else [] for i, (tokens, _) in enumerate(free)]
    params = _params(stop_ids)
    _, want = _run(path, prompts, params, max_num_seqs=max_num_seqs)
    overlapped = []
    launch_step = launch.StepLauncher.launch

    def counted(self, seqs, previous=None, fill=None):
        overlapped.append(previous is not None and fill is not None and len(fill[0]) > 0)
        return launch_step(self, seqs, previous, fill)

    monkeypatch.setattr(launch.StepLauncher, "launch", counted)
    llm, got = _run(path, prompts, params, max_num_seqs=max_num_seqs, async_scheduling=True)
    assert got == want
    assert any(reason == "stop" for _, reason in want) and any(reason == "length" for _, reason in want)
    assert sum(overlapped) >= 10  # steps whose decodes took their tokens from the step before
    engine = llm.llm_engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # every block back
    assert engine.overlap.in_flight is None and not engine.has_unfinished_requests()


def test_a_request_that_needs_its_tokens_on_the_host_steps_synchronously(tiny_model_dir) -> None:
    """Log probabilities (and penalties, structured outputs) need each step's tokens before the
    next: with such a request live, steps do not overlap, and its outputs are those of a
    synchronous run; plain requests beside it are unchanged."""
    path = tiny_model_dir("llama")
    prompts = _prompts(6, seed=1)
    params = [SamplingParams(temperature=0.0, max_tokens=6 + i) for i in range(6)]
    params[1] = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
    params[4] = SamplingParams(temperature=0.0, max_tokens=9, repetition_penalty=1.3)
    _, want = _run(path, prompts, params)
    llm, got = _run(path, prompts, params, async_scheduling=True)
    assert got == want
    assert not llm.llm_engine.overlap.sync_only


class _SleepingDevice(torch.nn.Module):
    """The model, then a sleep of `device_s` on the device thread: a device that takes that long.
    `times` collects each forward's whole time (the model's own and the sleep)."""

    def __init__(self, model: torch.nn.Module, device_s: float) -> None:
        super().__init__()
        self.model, self.device_s = model, device_s
        self.times: list[float] = []

    def forward(self, *args, **kwargs):
        began = time.perf_counter()
        out = self.model(*args, **kwargs)
        time.sleep(self.device_s)
        self.times.append(time.perf_counter() - began)
        return out


def _decode_step_times(path, overlapped: bool, host_s: float, device_s: float) -> tuple[float, float]:
    """Median step time and median device time of the steady decode steps."""
    llm = LLM(str(path), dtype="float32", async_scheduling=overlapped)
    engine = llm.llm_engine
    device = engine.runner.model = _SleepingDevice(engine.runner.model, device_s)
    schedule = engine.scheduler.schedule

    def slow_schedule(*args, **kwargs):
        time.sleep(host_s)  # host work of that length each step
        return schedule(*args, **kwargs)

    engine.scheduler.schedule = slow_schedule
    for i, prompt in enumerate(_prompts(8, seed=2)):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        began = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - began)
    # The steady decode steps: neither the prefill nor the last ones.
    return statistics.median(times[3:-3]), statistics.median(device.times[3:-3])


def test_overlap_hides_the_host_behind_the_device(tiny_model_dir) -> None:
    """A device of 40 ms a step (a sleep after the real forward) and 25 ms of host work a step
    (a sleep before the real scheduling): a synchronous step takes host + device; an overlapped
    one max(host, device), within 15%, with host and device as the synchronous run measured them."""
    path = tiny_model_dir("llama")
    sync_step, device = _decode_step_times(path, False, 0.025, 0.040)
    host = sync_step - device
    overlapped_step, _ = _decode_step_times(path, True, 0.025, 0.040)
    assert host >= 0.025 and device >= 0.040
    assert overlapped_step <= 1.15 * max(host, device), (host, device, overlapped_step)
    assert overlapped_step < 0.85 * sync_step
