"""Scheduler + BlockManager + policies driven directly with synthetic requests (no model), and the
real engine's per-request rejection of prompts that can never fit.

`run_workload` stands in for the model only: each step's sampled tokens are fake ones, handed to the
real `Scheduler.update` (which advances computed tokens, caches full blocks, appends the token and
finishes a request after `max_tokens` outputs).
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from batchgen import LLM
from batchgen.engine.block_manager import BlockManager
from batchgen.engine.policy import FCFSPolicy, MaxThroughputPolicy, Policy, PriorityPolicy, make_policy
from batchgen.engine.request import Request, RequestStatus
from batchgen.engine.scheduler import Scheduler, SchedulerOutput
from batchgen.engine.sizing import kv_cache_bytes_per_block
from batchgen.model.step import StepOutput
from batchgen.sampling_params import SamplingParams

BS = 4


@dataclass
class Spec:
    """A synthetic request: prompt tokens, output budget, the step it arrives at, its priority."""

    prompt: list[int]
    max_tokens: int
    arrival_step: int = 0
    priority: int = 0


@dataclass
class Trace:
    requests: list[Request]
    outputs: list[SchedulerOutput] = field(default_factory=list)
    # Per step, (request id, start, num_new_tokens, samples) of each scheduled request.
    batches: list[list[tuple[str, int, int, bool]]] = field(default_factory=list)
    admission_order: list[str] = field(default_factory=list)  # first admissions, in order
    # Per step: requests taken from the waiting queue (re-admissions after a recompute included)
    # and the requests still waiting after the step.
    admitted: list[list[Request]] = field(default_factory=list)
    still_waiting: list[list[Request]] = field(default_factory=list)
    finish_step: dict[str, int] = field(default_factory=dict)

    def hold(self, r: Request) -> int:
        """Steps the request held its running slot (first scheduled through its finishing step)."""
        assert r.first_scheduled_step is not None
        return self.finish_step[r.request_id] - r.first_scheduled_step + 1

    def wait(self, r: Request) -> int:
        assert r.first_scheduled_step is not None
        return r.first_scheduled_step - r.arrival_step


def make_scheduler(
    policy: Policy,
    *,
    num_blocks: int = 256,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 64,
    chunked: bool = True,
    preemption_mode: str = "recompute",
    num_swap_blocks: int = 0,
    prefix_caching: bool = True,
) -> Scheduler:
    bm = BlockManager(num_blocks, BS, prefix_caching, num_swap_blocks)
    return Scheduler(bm, policy, max_num_seqs, max_num_batched_tokens, chunked, preemption_mode)


def fake_token(r: Request) -> int:
    """A deterministic output token, so a recomputed request regenerates the same text."""
    return 1000 + (hash((r.request_id, r.num_tokens)) % 50)


def check_step(s: Scheduler, out: SchedulerOutput, live: list[Request]) -> None:
    """Invariants of one step's decision and of the block pool after it."""
    bm = s.block_manager
    assert out.num_batched_tokens <= s.max_num_batched_tokens
    assert len(out.scheduled) <= s.max_num_seqs
    assert len(s.running) <= s.max_num_seqs
    ids = [item.request.request_id for item in out.scheduled]
    assert len(ids) == len(set(ids)), "a request was scheduled twice in one step"
    is_decode = [item.is_decode for item in out.scheduled]
    assert is_decode == sorted(is_decode, reverse=True), "decodes must come first"
    for item in out.scheduled:
        r = item.request
        assert r.status is RequestStatus.RUNNING and r in s.running
        assert item.num_new_tokens >= 1
        assert item.start == r.num_computed_tokens and item.start + item.num_new_tokens <= r.num_tokens
        assert len(r.block_table) >= bm.blocks_needed(item.start + item.num_new_tokens)
        if not s.enable_chunked_prefill:
            assert item.samples, "with chunked prefill off every chunk runs to the last token"
    assert not {id(r) for r in out.preempted} & {id(item.request) for item in out.scheduled}
    # Block pool: ref counts are exactly the running block tables; others hold no device blocks.
    refs = [0] * bm.num_blocks
    for r in live:
        if r.status is RequestStatus.RUNNING:
            for b in r.block_table:
                refs[b] += 1
        else:
            assert r.block_table == [], f"{r.status} request {r.request_id} holds device blocks"
        if r.status is not RequestStatus.SWAPPED:
            assert r.swap_table == []
    assert [b.ref_count for b in bm.blocks] == refs
    assert bm.num_free_blocks == refs.count(0)
    held_swap = sum(len(r.swap_table) for r in live)
    assert held_swap + len(bm.free_swap_blocks) == bm.num_swap_blocks
    assert len(set(bm.free_swap_blocks)) == len(bm.free_swap_blocks)


def run_workload(s: Scheduler, specs: list[Spec], max_steps: int = 3000) -> Trace:
    """Run the workload to completion; every step is checked with `check_step`."""
    requests = [
        Request(f"r{i}", list(spec.prompt), SamplingParams(priority=spec.priority), 0.0, spec.max_tokens)
        for i, spec in enumerate(specs)
    ]
    pending = sorted(zip(specs, requests, strict=True), key=lambda pair: pair[0].arrival_step)  # stable
    trace = Trace(requests)
    live: list[Request] = []
    while pending or s.has_unfinished():
        assert s.step_index < max_steps, "the workload did not finish (deadlock or livelock)"
        while pending and pending[0][0].arrival_step <= s.step_index:
            r = pending.pop(0)[1]
            s.add_request(r)
            live.append(r)
        step = s.step_index
        waiting_before = {id(r) for r in live if r.status is RequestStatus.WAITING}
        out = s.schedule()
        trace.admitted.append([it.request for it in out.scheduled if id(it.request) in waiting_before])
        trace.still_waiting.append([r for r in live if r.status is RequestStatus.WAITING])
        check_step(s, out, live)
        trace.outputs.append(out)
        trace.batches.append(
            [(it.request.request_id, it.start, it.num_new_tokens, it.samples) for it in out.scheduled]
        )
        for item in out.scheduled:
            r = item.request
            if r.first_scheduled_step == step and r.request_id not in trace.admission_order:
                trace.admission_order.append(r.request_id)
        tokens = [fake_token(item.request) for item in out.scheduled if item.samples]
        for r in s.update(out, StepOutput(tokens, [None] * len(tokens))):
            assert r.finish_reason == "length"
            live.remove(r)
            trace.finish_step[r.request_id] = step
    bm = s.block_manager
    assert bm.num_used_blocks == 0 and len(bm.free_swap_blocks) == bm.num_swap_blocks
    for r in requests:
        assert r.is_finished and r.num_output_tokens == r.max_tokens
    return trace


def random_specs(rng: random.Random, n: int, max_len: int, arrivals: int) -> list[Spec]:
    """Prompts sharing a few prefixes (so the prefix cache is hit), total length <= max_len."""
    heads = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    specs = []
    for _ in range(n):
        head = rng.choice(heads) if rng.random() < 0.6 else []
        prompt = (head + [rng.randrange(3, 500) for _ in range(rng.randint(1, 20))])[: max_len - 1]
        max_tokens = rng.randint(1, min(16, max_len - len(prompt)))
        specs.append(Spec(prompt, max_tokens, rng.randrange(arrivals), rng.randrange(3)))
    return specs


# ---- budgets under randomized workloads ----


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("policy", ["fcfs", "max-throughput", "priority"])
def test_budgets_hold_under_preemption(seed: int, chunked: bool, mode: str, policy: str) -> None:
    rng = random.Random(seed)
    num_blocks = 10  # 40 tokens of cache for 30 requests: constant preemption
    budget = 12 if chunked else 24
    # The engine lowers max_model_len to what the cache holds, and with chunked prefill off it must
    # fit the token budget (a whole prompt, outputs included after a recompute, runs in one step).
    max_len = num_blocks * BS if chunked else budget
    s = make_scheduler(
        make_policy(policy, aging_steps=8),
        num_blocks=num_blocks,
        max_num_seqs=3,
        max_num_batched_tokens=budget,
        chunked=chunked,
        preemption_mode=mode,
        num_swap_blocks=6,  # small: some swap-outs fall back to recompute
    )
    trace = run_workload(s, random_specs(rng, 30, max_len, arrivals=25))
    preempted = [r for out in trace.outputs for r in out.preempted]
    assert preempted, "the workload was meant to force preemption"
    if mode == "swap":
        assert any(out.swap_out for out in trace.outputs) and any(out.swap_in for out in trace.outputs)
    if chunked:
        assert any(not samples for b in trace.batches for *_, samples in b), "no prompt was ever chunked"
    assert max(out.num_batched_tokens for out in trace.outputs) <= budget
    # Head of line: whatever is admitted from the waiting queue, preempted requests included, comes
    # before everything left waiting in policy order.
    keys: dict[str, Callable[[Request], tuple]] = {
        "fcfs": lambda r: (r.seq_no,),
        "priority": lambda r: (r.priority, r.seq_no),
    }
    if policy in keys:
        key = keys[policy]
        for admitted, waiting in zip(trace.admitted, trace.still_waiting, strict=True):
            if admitted and waiting:
                assert max(key(r) for r in admitted) < min(key(r) for r in waiting)


def test_decodes_come_first_in_mixed_steps() -> None:
    s = make_scheduler(FCFSPolicy(), max_num_seqs=4, max_num_batched_tokens=10)
    specs = [Spec(list(range(10, 13)), 6), Spec(list(range(20, 50)), 3, arrival_step=2), Spec([7, 8], 5, 3)]
    trace = run_workload(s, specs)  # check_step asserts the order in every step
    mixed = [
        b
        for b in trace.batches
        if any(n == 1 and smp for _, _, n, smp in b) and any(n > 1 for _, _, n, _ in b)
    ]
    assert len(mixed) >= 3, "the workload was meant to mix decodes and prefill chunks in a step"
    for batch in mixed:
        decode = [n == 1 and smp for _, _, n, smp in batch]
        assert decode == sorted(decode, reverse=True)
    # A one-token prompt admitted after a longer one is a decode-shaped row: it is moved in front.
    s = make_scheduler(FCFSPolicy(), max_num_seqs=4, max_num_batched_tokens=10)
    for i, prompt in enumerate([[5, 6, 7, 8, 9], [4], [3, 3]]):
        s.add_request(Request(f"q{i}", prompt, SamplingParams(), 0.0, 3))
    out = s.schedule()
    assert [(it.request.request_id, it.num_new_tokens) for it in out.scheduled] == [
        ("q1", 1),
        ("q0", 5),
        ("q2", 2),
    ]


# ---- policies ----


def test_fcfs_admits_in_arrival_order() -> None:
    rng = random.Random(7)
    specs = [
        Spec(
            [rng.randrange(3, 500) for _ in range(rng.randint(1, 20))],
            rng.randint(1, 10),
            arrival_step=rng.randrange(15),
        )
        for _ in range(25)
    ]
    s = make_scheduler(FCFSPolicy(), num_blocks=12, max_num_seqs=3, max_num_batched_tokens=16)
    trace = run_workload(s, specs)
    assert any(out.preempted for out in trace.outputs)
    file_order = sorted(range(len(specs)), key=lambda i: specs[i].arrival_step)  # stable: file order
    assert trace.admission_order == [f"r{i}" for i in file_order]
    assert trace.admission_order != [f"r{i}" for i in range(len(specs))]  # arrivals did reorder
    # A preempted request goes back to the front: it is re-admitted before anything that came later.
    for admitted, waiting in zip(trace.admitted, trace.still_waiting, strict=True):
        if admitted and waiting:
            assert max(r.seq_no for r in admitted) < min(r.seq_no for r in waiting)
    # Preempted requests rejoin ahead of later arrivals, among themselves in arrival order.
    policy = FCFSPolicy()
    reqs = [Request(f"f{i}", [1], SamplingParams(), 0.0, 1) for i in range(5)]
    for i, r in enumerate(reqs):
        r.seq_no = i
        policy.push(r)
    assert [policy.pop(0).request_id for _ in range(3)] == ["f0", "f1", "f2"]
    for i in (1, 2, 0):
        reqs[i].num_preemptions += 1
        policy.push(reqs[i])
    assert [policy.pop(0).request_id for _ in range(5)] == ["f0", "f1", "f2", "f3", "f4"]
    # With no arrivals after step 0 it is plain file order, even if later rows are shorter.
    specs0 = [Spec(list(range(3, 3 + n)), m) for n, m in [(20, 9), (2, 1), (15, 4), (1, 1), (9, 2)]]
    trace0 = run_workload(make_scheduler(FCFSPolicy(), max_num_seqs=1), specs0)
    assert trace0.admission_order == [f"r{i}" for i in range(len(specs0))]


def test_max_throughput_admits_least_remaining_work_first() -> None:
    rng = random.Random(3)
    specs = [Spec([5] * rng.randint(1, 20), rng.randint(1, 12)) for _ in range(15)]
    s = make_scheduler(MaxThroughputPolicy(aging_steps=10**9), max_num_seqs=1)
    trace = run_workload(s, specs)
    work = {f"r{i}": (len(spec.prompt) + spec.max_tokens, i) for i, spec in enumerate(specs)}
    assert trace.admission_order == sorted(work, key=work.__getitem__)
    assert trace.admission_order != [f"r{i}" for i in range(len(specs))]


def aging_workload(num_shorts: int) -> list[Spec]:
    """One long request first in file order, then a steady stream of short ones: two at step 0 and
    one per step after. With two slots the shorts alone keep both busy, so shortest-first never
    reaches the long request while shorts keep coming."""
    specs = [Spec(list(range(100, 104)), 30)]
    specs += [Spec([7, 8], 2, arrival_step=max(0, i - 1)) for i in range(num_shorts)]
    return specs


@pytest.mark.parametrize("aging_steps", [5, 12])
def test_max_throughput_aging_bounds_waiting(aging_steps: int) -> None:
    specs = aging_workload(num_shorts=100)

    def run(k: int) -> Trace:
        return run_workload(make_scheduler(MaxThroughputPolicy(aging_steps=k), max_num_seqs=2), specs)

    aged = run(aging_steps)
    max_hold = max(aged.hold(r) for r in aged.requests)
    for r in aged.requests:
        assert aged.wait(r) <= aging_steps + max_hold, f"{r.request_id} waited {aged.wait(r)} steps"
    long = aged.requests[0]
    assert aged.wait(long) > aging_steps  # it did age: shorter work went first until then
    # Tighter for the long request: aged, it takes the first slot that frees up.
    before = [r for r in aged.requests if r.first_scheduled_step < long.first_scheduled_step]
    assert aged.wait(long) <= aging_steps + max(aged.hold(r) for r in before)

    # Without aging the long request waits for the whole stream of shorts: the bound fails.
    starved = run(10**9)
    long = starved.requests[0]
    starved_hold = max(starved.hold(r) for r in starved.requests)
    assert starved.wait(long) > aging_steps + starved_hold
    assert starved.admission_order[-1] == long.request_id


def test_priority_policy_order_and_victim() -> None:
    rng = random.Random(5)
    specs = [
        Spec([9] * rng.randint(1, 10), rng.randint(1, 5), priority=rng.randrange(-2, 3)) for _ in range(20)
    ]
    trace = run_workload(make_scheduler(PriorityPolicy(), max_num_seqs=1), specs)
    key = {f"r{i}": (spec.priority, i) for i, spec in enumerate(specs)}
    assert trace.admission_order == sorted(key, key=key.__getitem__)
    assert trace.admission_order != [f"r{i}" for i in range(len(specs))]
    # Under memory pressure the least important running request is the one preempted.
    reqs = [Request(f"p{p}", [1], SamplingParams(priority=p), 0.0, 4) for p in (0, 2, 1)]
    for i, r in enumerate(reqs):
        r.seq_no = i
    assert PriorityPolicy().victim(reqs).request_id == "p2"


def test_priority_preempts_lowest_priority_first() -> None:
    # Two requests fill the cache; the more important one (lower value) keeps its blocks.
    specs = [Spec([5] * 7, 9, priority=1), Spec([6] * 7, 9, priority=0)]
    s = make_scheduler(PriorityPolicy(), num_blocks=6, max_num_seqs=2, max_num_batched_tokens=32)
    trace = run_workload(s, specs)
    victims = [r.request_id for out in trace.outputs for r in out.preempted]
    assert victims and set(victims) == {"r0"}


# ---- the real engine: requests that can never fit fail alone ----


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir: Callable[[str], Path]) -> Iterator[Path]:
    threads = torch.get_num_threads()  # the engine sets torch's thread count process-wide
    yield tiny_model_dir("llama")
    torch.set_num_threads(threads)


def _check_isolated_failures(outs, bad: set[int], max_tokens: int, limit: int) -> None:
    for i, out in enumerate(outs):
        if i in bad:
            assert out.outputs[0].finish_reason == "error"
            assert out.outputs[0].token_ids == []
            assert out.error and "max_model_len" in out.error and str(limit) in out.error
        else:
            assert out.error is None
            assert out.outputs[0].finish_reason == "length"
            assert len(out.outputs[0].token_ids) == max_tokens


def test_oversize_prompt_fails_alone(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=48, kv_cache_memory=1 << 20, num_threads=1)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = [
        {"prompt_token_ids": list(range(100, 110))},
        {"prompt_token_ids": list(range(100, 160))},  # 60 tokens > max_model_len 48
        {"prompt_token_ids": list(range(200, 220))},
        {"prompt_token_ids": list(range(300, 348))},  # 48 tokens: no room for an output token
    ]
    outs = llm.generate(prompts, params)
    _check_isolated_failures(outs, {1, 3}, 5, 48)


def test_request_larger_than_the_whole_cache_fails_alone(tiny_llama: Path) -> None:
    per_block = kv_cache_bytes_per_block(AutoConfig.from_pretrained(tiny_llama), 16, torch.float32)
    llm = LLM(str(tiny_llama), dtype="float32", block_size=16, kv_cache_memory=4 * per_block, num_threads=1)
    engine = llm.llm_engine
    assert engine.num_gpu_blocks == 4 and engine.max_model_len == 64  # lowered to the cache size
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [
        {"prompt_token_ids": list(range(100, 120))},
        {"prompt_token_ids": list(range(100, 180))},  # 80 tokens: 5 blocks > the 4 in the cache
        {"prompt_token_ids": list(range(400, 430))},
    ]
    outs = llm.generate(prompts, params)
    _check_isolated_failures(outs, {1}, 4, 64)
    assert engine.block_manager.num_used_blocks == 0
    # The limit came from the cache, not from the user: the message says so and what to raise.
    assert "the KV cache holds only 64 tokens; raise kv_cache_memory)" in outs[1].error  # CPU: no GPU knob


def test_a_kv_cache_smaller_than_one_block_is_refused(tiny_llama: Path) -> None:
    per_block = kv_cache_bytes_per_block(AutoConfig.from_pretrained(tiny_llama), 16, torch.float32)
    with pytest.raises(
        ValueError, match=rf"kv_cache_memory is 1024 bytes, less than one KV block .*{per_block}"
    ):
        LLM(str(tiny_llama), dtype="float32", block_size=16, kv_cache_memory=1024, num_threads=1)


def test_explicit_max_model_len_larger_than_the_cache_is_refused(tiny_llama: Path) -> None:
    # 4 blocks of 16 tokens hold 64 tokens: an explicit max_model_len of 128 can never be served.
    with pytest.raises(ValueError, match="KV cache holds 64 tokens.*max_model_len 128"):
        LLM(str(tiny_llama), dtype="float32", max_model_len=128, kv_cache_memory=4 * 8192, num_threads=1)


def test_a_sliding_window_does_not_limit_max_model_len(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """Sliding-window attention is implemented: a Mistral with a 16-token window serves a
    max_model_len past it and a 20-token prompt (its output against transformers':
    tests/engine/test_fidelity.py)."""
    model = tmp_path / "windowed"
    shutil.copytree(tiny_model_dir("mistral"), model)
    raw = json.loads((model / "config.json").read_text())
    raw["sliding_window"] = 16
    (model / "config.json").write_text(json.dumps(raw))
    llm = LLM(str(model), dtype="float32", max_model_len=100, num_threads=1)
    assert llm.llm_engine.max_model_len == 100
    (out,) = llm.generate([{"prompt_token_ids": list(range(5, 25))}], SamplingParams(max_tokens=2))
    assert out.error is None
    assert len(out.outputs[0].token_ids) == 2
