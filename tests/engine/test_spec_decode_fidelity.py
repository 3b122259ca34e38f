"""Speculative decoding with a real model: greedy float32 outputs are Hugging Face's with speculation
on, under every stress mode of the fidelity suite; drafts are both accepted and rejected; the KV
cache after a rejection is that of a run without speculation; sampled rows do not speculate; the gate
is measured, cached and applied.

Repetitive prompts make the tiny random-weight model's drafts meet its own loops (accepted) and its
departures from them (rejected).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from batchgen import LLM, SamplingParams
from batchgen.engine import spec_gate
from batchgen.kernels.cpu.linear import bf16_kernel_available
from tests.engine.test_fidelity import (
    BATCHING_OPTIONS,
    INSTRUCTION,
    TEXT_PROMPTS,
    _xsum_documents,
    hf_greedy,
    token_ids,
)

SPEC = dict(speculative_method="ngram", speculative_max_batch=64)
REPETITIVE = [
    "one two three four one two three four one two three four one two three",
    "the cat sat on the mat. the cat sat on the mat. the dog sat on the log. the dog sat on the",
    "a b c d e f g a b c d e f g a b c d e f g a b c",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def spec_case(tiny_model_dir):
    """The tiny Llama, text and repetitive prompts, and Hugging Face's greedy outputs for them."""
    path = tiny_model_dir("llama")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt_ids = [tok(p)["input_ids"] for p in TEXT_PROMPTS + REPETITIVE]
    return path, prompt_ids, hf_greedy(path, prompt_ids, GREEDY.max_tokens, ignore_eos=True)


def assert_drafts_accepted_and_rejected(llm: LLM) -> None:
    totals = llm.llm_engine.totals
    assert totals.spec_decode_num_accepted_tokens > 0, "no draft was accepted"
    assert totals.spec_decode_num_accepted_tokens < totals.spec_decode_num_draft_tokens, "none rejected"


@pytest.mark.parametrize("name", list(BATCHING_OPTIONS))
def test_speculation_matches_hf_in_every_batching_mode(spec_case, name):
    path, prompt_ids, expected = spec_case
    llm = LLM(str(path), dtype="float32", **BATCHING_OPTIONS[name], **SPEC)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY)
    assert token_ids(outputs) == expected
    assert_drafts_accepted_and_rejected(llm)
    if name.startswith("preempt"):
        assert llm.llm_engine.totals.preemptions > 0, "the cache was meant to force preemption"


def test_speculation_matches_hf_with_a_warm_prefix_cache(spec_case):
    path, prompt_ids, expected = spec_case
    llm = LLM(str(path), dtype="float32", block_size=8, **SPEC)
    cold = token_ids(llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY))
    hits = llm.llm_engine.totals.prefix_cache_hits
    warm = token_ids(llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY))
    assert cold == warm == expected
    assert llm.llm_engine.totals.prefix_cache_hits > hits, "the second pass should hit the cache"
    assert_drafts_accepted_and_rejected(llm)


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_speculation_matches_hf_on_other_architectures(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt_ids = [tok(p)["input_ids"] for p in REPETITIVE]
    expected = hf_greedy(path, prompt_ids, GREEDY.max_tokens, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", **SPEC)
    assert token_ids(llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY)) == expected
    assert llm.llm_engine.totals.spec_decode_num_drafts > 0


def test_logprobs_and_stops_with_speculation(spec_case):
    """Log probabilities at every output position and stops (EOS off, a stop token id, max_tokens)
    are those of the run without speculation: accepted drafts are appended one at a time."""
    path, prompt_ids, expected = spec_case
    stop_at = expected[-1][10]  # a token the last prompt's output reaches after 10 tokens
    params = SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3, stop_token_ids=[stop_at]
    )
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    plain = LLM(str(path), dtype="float32").generate(prompts, params)
    llm = LLM(str(path), dtype="float32", **SPEC)
    spec = llm.generate(prompts, params)
    assert llm.llm_engine.totals.spec_decode_num_accepted_tokens > 0
    for a, b in zip(plain, spec, strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        assert (cb.token_ids, cb.finish_reason, cb.stop_reason) == (
            ca.token_ids,
            ca.finish_reason,
            ca.stop_reason,
        )
        assert [sorted(p) for p in cb.logprobs] == [sorted(p) for p in ca.logprobs]
        for pa, pb in zip(ca.logprobs, cb.logprobs, strict=True):
            assert [pb[t].logprob for t in pa] == pytest.approx([pa[t].logprob for t in pa], abs=1e-4)
    assert any(o.outputs[0].finish_reason == "stop" for o in spec)


def test_sampled_rows_do_not_speculate(spec_case):
    """Seeded sampled rows give the same tokens with speculation on, and propose no drafts."""
    path, prompt_ids, _ = spec_case
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=20, ignore_eos=True)
        for i in range(len(prompt_ids))
    ]
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    plain = token_ids(LLM(str(path), dtype="float32").generate(prompts, params))
    llm = LLM(str(path), dtype="float32", **SPEC)
    assert token_ids(llm.generate(prompts, params)) == plain
    assert llm.llm_engine.totals.spec_decode_num_drafts == 0


def kv_snapshots(llm: LLM, prompt_ids: list[int], max_tokens: int) -> list[tuple]:
    """Step one request to the end; after each step: (step stats, num_tokens, block table, block
    hashes, free blocks, the prefix cache's hash -> block map)."""
    engine = llm.llm_engine
    bm = engine.block_manager
    engine.add_request(
        "r",
        {"prompt_token_ids": prompt_ids},
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )
    request = engine.requests["r"]
    out = []
    while engine.has_unfinished_requests():
        engine.step()
        if not request.is_finished:
            out.append((engine.last_step, request.num_tokens, list(request.block_table), list(request.block_hashes),
                        bm.num_free_blocks, dict(bm.cached)))  # fmt: skip
    return out


def test_kv_rollback_equals_a_run_without_speculation(spec_case):
    """After every step that rejected a draft, the request's block table and hashes, the free
    blocks and the prefix cache equal the run without speculation's when it held as many tokens;
    4-token blocks, so rejected drafts span blocks of their own that the rollback frees."""
    path, prompt_ids, _ = spec_case
    options = dict(dtype="float32", block_size=4, kv_cache_memory=64 * 4 * 1024)
    plain = kv_snapshots(LLM(str(path), **options), prompt_ids[-1], 60)
    spec = kv_snapshots(LLM(str(path), **options, **SPEC), prompt_ids[-1], 60)
    by_tokens = {s[1]: s[2:] for s in plain}
    rejected = [s for s in spec if s[0].num_accepted_tokens < s[0].num_draft_tokens]
    assert rejected and any(s[0].num_accepted_tokens for s in spec)
    for _, num_tokens, *state in rejected:
        assert state == list(by_tokens[num_tokens])


def test_gate_is_measured_cached_and_applied(spec_case, tmp_path, monkeypatch):
    """No --speculative-max-batch: the gate comes from the measured cost curve, is cached (a second
    engine reads it), and drafts are proposed only in steps that start with at most that many
    running requests."""
    path, prompt_ids, expected = spec_case
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path))
    # One thread fixed: the cache is per thread count, and a busy machine moves the default.
    llm = LLM(str(path), dtype="float32", speculative_method="ngram", num_threads=1)
    plan = llm.llm_engine.speculation
    assert "(measured;" in plan.describe() and llm.llm_engine.start_line.endswith(plan.describe())
    assert plan.gate.points and not plan.gate.cached
    files = list((tmp_path / "spec_gate").glob("*.json"))
    assert len(files) == 1
    again = LLM(str(path), dtype="float32", speculative_method="ngram", num_threads=1).llm_engine.speculation
    assert again.gate.cached and "(cached measurement;" in again.describe()
    assert again.gate.points == plan.gate.points and again.gate.max_batch == plan.gate.max_batch
    # The engine hands the gate's value to the scheduler after every step.
    engine = llm.llm_engine
    engine.scheduler.speculative_max_batch = 999  # above any gate: the next step must replace it
    llm.generate([{"prompt_token_ids": prompt_ids[-1]}], SamplingParams(temperature=0.0, max_tokens=3))
    assert engine.scheduler.speculative_max_batch == engine.speculation.gate.max_batch <= 256
    # The gate itself, forced to 2 so that some steps run above it whatever the machine measured.
    llm = LLM(str(path), dtype="float32", speculative_method="ngram", speculative_max_batch=2)
    engine = llm.llm_engine
    schedule = engine.scheduler.schedule
    drafted_at = []

    def watched():
        running = len(engine.scheduler.running)
        out = schedule()
        if out.num_drafts:
            drafted_at.append(running)
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", watched)
    # Two long rows (repetitive prompts) outlive the rest: a tail of two, as a real job's end.
    lengths = [10] * (len(prompt_ids) - 2) + [30, 40]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    assert token_ids(outputs) == [e[:n] for e, n in zip(expected, lengths, strict=True)]
    assert drafted_at and max(drafted_at) <= 2


def test_gate_points_come_from_the_runner(spec_case, monkeypatch):
    """`measure_points` times real steps of the runner, up to the limit or the first batch whose
    verification costs more than 1 + k decode steps."""
    path, _, _ = spec_case
    runner = LLM(str(path), dtype="float32").llm_engine.runner
    points = spec_gate.measure_points(runner, 4, max_batch=8)
    assert [p[0] for p in points] == [1, 2, 4, 8][: len(points)] and all(
        p[1] > 0 and p[2] > 0 for p in points
    )
    # Measured until the cost passes 1 + k, or the limit: then the last point measured fails it.
    assert len(points) == 4 or points[-1][2] > 5 * points[-1][1]
    assert spec_gate.measure_points(runner, 4, max_batch=1)[0][0] == 1


@pytest.mark.slow
def test_default_model_with_speculation_matches_hf_on_xsum(default_model_dir):
    """SmolLM2-135M-Instruct, float32, chat template, summarization: HF's tokens with speculation on."""
    messages = [[{"role": "user", "content": INSTRUCTION + doc}] for doc in _xsum_documents(8)]
    tok = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    prompt_ids = [
        tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        for m in messages
    ]
    expected = hf_greedy(Path(default_model_dir), prompt_ids, 48, ignore_eos=False)
    llm = LLM(dtype="float32", **SPEC)
    outputs = llm.generate(messages, SamplingParams(temperature=0.0, max_tokens=48))
    assert token_ids(outputs) == expected
    assert_drafts_accepted_and_rejected(llm)


def test_bfloat16_greedy_tokens_are_those_without_speculation(spec_case):
    """In bf16 a verification must round as the decodes it replaces: its short chunks walk the
    context on the decode kernel's loop (`short_chunks`), so greedy outputs with speculation equal
    those without, not just Hugging Face's in float32. `--kernels native` keeps every linear on one
    kernel whatever a step's row count (under "auto" a verification's rows can fall in another
    linear bucket than the decodes', which on some machines is another kernel)."""
    if not bf16_kernel_available():
        pytest.skip("the bf16 C kernels need a CPU with AVX512-BF16 and a C compiler")
    path, prompt_ids, _ = spec_case
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    options = dict(dtype="bfloat16", kernels="native", max_num_seqs=8)
    plain = token_ids(LLM(str(path), **options).generate(prompts, params))
    llm = LLM(str(path), **options, **SPEC)
    assert token_ids(llm.generate(prompts, params)) == plain
    assert_drafts_accepted_and_rejected(llm)
