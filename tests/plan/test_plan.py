"""`batchgen plan`: the same error rows and prompt tokens as `run`, no weights loaded, bounded memory."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from batchgen.config import EngineConfig
from batchgen.jobs.errors import JobInputError
from batchgen.jobs.runner import JobOptions, default_engine_factory, run_job
from batchgen.plan.inputs import TokenizerEngine
from batchgen.plan.job_plan import format_plan, plan_job
from batchgen.plan.prefix import PrefixEstimate
from tests.jobs.input.test_bad_rows import BAD, bad_lines
from tests.jobs.real_engine import quiet

REPO = Path(__file__).resolve().parents[2]


def test_plan_lists_the_error_rows_and_tokens_run_reports(tmp_path, tiny_model_dir):
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(bad_lines()) + "\n")
    model = str(tiny_model_dir("llama"))
    options = JobOptions(
        str(src), max_tokens=8, engine={"model": model, "max_model_len": 64, "dtype": "float32"}
    )
    plan = plan_job(options)
    summary = run_job(options, default_engine_factory, dashboard=quiet())
    rows = pq.read_table(tmp_path / "bad.out.parquet").to_pylist()
    errors = [r["error"] for r in rows if r["finish_reason"] == "error"]
    ok = [r for r in rows if r["finish_reason"] != "error"]

    assert plan.rows == len(rows) == 9
    assert plan.rows_error == summary.rows_error == len(BAD) == 6
    assert plan.first_errors == errors[:5]
    assert plan.rows_valid == summary.rows_ok == 3
    assert plan.rows_too_long == 1  # row 5, the long prompt
    assert plan.prompt_tokens == summary.prompt_tokens == sum(r["prompt_tokens"] for r in ok)
    assert plan.prompt_tokens_max == max(r["prompt_tokens"] for r in ok)
    assert plan.max_output_tokens == 8 + 3 + 8  # g2 asks for 3
    assert plan.max_model_len == 64
    assert plan.largest_row_tokens == max(r["prompt_tokens"] + (3 if r["id"] == "g2" else 8) for r in ok)


def test_plan_command_prints_json(tmp_path, tiny_model_dir):
    src = tmp_path / "job.jsonl"
    shared = "You are a careful assistant. Answer in one short sentence, please. " * 3
    src.write_text("\n".join(json.dumps({"prompt": f"{shared}Question {i}?"}) for i in range(10)) + "\n")
    cmd = [sys.executable, "-m", "batchgen", "plan", str(src), "--model", str(tiny_model_dir("llama"))]
    summary = tmp_path / "plan.json"
    cmd += ["--max-tokens", "16", "--kv-cache-memory", "64MiB", "--summary-json", str(summary), "--json"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert json.loads(summary.read_text()) == plan  # --summary-json: the same plan, for scripts
    assert plan["rows"] == plan["rows_valid"] == 10 and plan["rows_error"] == 0
    assert plan["max_output_tokens"] == 160
    # Nine rows after the first find its shared prefix blocks in the cache.
    assert plan["prefix_cache_tokens"] > 0 and plan["prefix_cache_tokens"] % plan["block_size"] == 0
    assert plan["prefix_cache_tokens"] <= 9 * (plan["prompt_tokens_max"] - 1)
    assert not list(tmp_path.glob("job.out*"))  # nothing written
    w = plan["wall_time"]  # calibrated on the tiny model (or found in the cache)
    assert 0 < w["low_s"] < w["high_s"] and w["high_output_tokens"] == 160
    assert w["low_output_tokens"] == plan["expected_output_tokens"] == 40  # a quarter of max_tokens
    assert "max_tokens" in w["assumption"] and "steps timed on this machine" in w["rates"]
    # `run`'s command line plans as it is: its options that change no plan are accepted (not listed)
    run_only = ["--no-dashboard", "--commit-every", "5", "--metrics-port", "0", "--replicas", "2"]
    text = subprocess.run(cmd[:-1] + run_only, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert text.returncode == 0 and "rows: 10 (10 valid, 0 error rows" in text.stdout


def test_plan_of_a_resumed_job_plans_the_rows_left(tmp_path, tiny_model_dir):
    from tests.jobs.fake_engine import fake_factory

    src = tmp_path / "job.jsonl"
    src.write_text("\n".join(json.dumps({"prompt": f"Question {i}?"}) for i in range(20)) + "\n")
    options = JobOptions(
        str(src),
        max_tokens=5,
        commit_rows=4,
        engine={"model": str(tiny_model_dir("llama")), "max_num_seqs": 3},
    )

    def crash(step: int) -> None:
        if step == 8:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError):
        run_job(options, fake_factory(on_step=crash), dashboard=quiet())
    plan = plan_job(options)
    summary = run_job(options, fake_factory(), dashboard=quiet())
    assert 0 < plan.rows_resumed == summary.rows_resumed < 20
    assert plan.rows_valid == summary.rows_ok == 20 - plan.rows_resumed
    assert plan.note is None


def test_plan_of_a_job_with_other_settings_committed(tmp_path, tiny_model_dir):
    from tests.jobs.fake_engine import fake_factory

    src = tmp_path / "job.jsonl"
    src.write_text("\n".join(json.dumps({"prompt": f"Question {i}?"}) for i in range(6)) + "\n")
    engine = {"model": str(tiny_model_dir("llama")), "max_num_seqs": 2}

    def crash(step: int) -> None:
        if step == 6:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError):
        run_job(
            JobOptions(str(src), max_tokens=4, commit_rows=1, engine=engine),
            fake_factory(on_step=crash),
            dashboard=quiet(),
        )
    plan = plan_job(JobOptions(str(src), max_tokens=9, engine=engine))
    assert plan.rows_resumed == 0 and plan.rows_valid == 6
    assert "committed by a run with other settings" in plan.note and "max_tokens" in plan.note


@pytest.mark.parametrize(
    "output, says",
    [
        ("missing/out.parquet", "does not exist"),
        ("out.csv", "must end in .parquet"),
        ("job.jsonl", "input"),
        ("", "--output is empty"),
    ],
)
def test_plan_refuses_the_outputs_run_refuses(tmp_path, output, says):
    src = tmp_path / "job.jsonl"
    src.write_text(json.dumps({"prompt": "Hello?"}) + "\n")
    with pytest.raises(JobInputError, match=says):
        plan_job(JobOptions(str(src), output=str(tmp_path / output) if output else ""))


def test_plan_of_a_job_whose_every_row_fails_exits_3_as_run_does(tmp_path, tiny_model_dir):
    src = tmp_path / "bad.jsonl"
    src.write_text(
        json.dumps({"text": "no prompt"}) + "\n" + json.dumps({"prompt": "x", "temperature": "hot"}) + "\n"
    )
    cmd = [sys.executable, "-m", "batchgen", "plan", str(src), "--model", str(tiny_model_dir("llama"))]
    proc = subprocess.run(cmd + ["--no-calibrate"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr
    assert "rows: 2 (0 valid, 2 error rows" in proc.stdout
    assert "every one of the 2 rows would fail" in proc.stderr and "row 0" in proc.stderr


def test_plan_words_every_error_row_as_run_and_refuses_strict_as_run(tmp_path, tiny_model_dir):
    """A stop token outside the vocabulary (the engine's own check) reads as run's error row, and
    --strict refuses the invalid rows before any model is read, with run's message."""
    src = tmp_path / "job.jsonl"
    src.write_text(
        json.dumps({"prompt": "Hi", "stop_token_ids": [999999]}) + "\n" + "\n".join(bad_lines()) + "\n"
    )
    options = JobOptions(
        str(src), max_tokens=4, engine={"model": str(tiny_model_dir("llama")), "dtype": "float32"}
    )
    plan = plan_job(options)
    run_job(options, default_engine_factory, dashboard=quiet())
    errors = [r["error"] for r in pq.read_table(tmp_path / "job.out.parquet").to_pylist() if r["error"]]
    assert plan.first_errors == errors[:5]
    assert errors[0].startswith("row 0 (line 1): stop_token_ids holds ids outside the vocabulary")
    strict = JobOptions(str(src), strict=True, overwrite=True, engine={"model": str(tmp_path / "none")})
    with pytest.raises(JobInputError) as planned:
        plan_job(strict)
    with pytest.raises(JobInputError) as ran:
        run_job(strict, default_engine_factory, dashboard=quiet())
    assert str(planned.value) == str(ran.value) and str(ran.value).startswith("--strict: 5 invalid row(s)")


def test_plan_refuses_a_missing_input(tmp_path):
    with pytest.raises(JobInputError):
        plan_job(JobOptions(str(tmp_path / "nope.jsonl")))


@pytest.mark.slow
def test_plan_of_200k_rows_stays_under_500_mb(tmp_path, tiny_model_dir):
    """As the CLI plans: torch kept out of the process (`plan_child`), whose peak is then the job's."""
    src = tmp_path / "big.jsonl"
    with open(src, "w") as f:
        for i in range(200_000):
            f.write(json.dumps({"prompt": f"Row {i}: summarize the number {i * 7919} in words."}) + "\n")
    # The peak is VmHWM, this process image's own: ru_maxrss would keep the high-water mark of the
    # forked pytest process from before the exec.
    code = (
        "import sys; from batchgen.plan.job_plan import plan_job; from batchgen.jobs.runner import JobOptions;"
        f"p = plan_job(JobOptions({str(src)!r}, engine={{'model': {str(tiny_model_dir('llama'))!r}}}), "
        "torch_free=True);"
        "hwm = [line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM')][0];"
        "print(p.rows, p.prompt_tokens, hwm, sys.modules.get('torch') is not None)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=3000
    )
    assert proc.returncode == 0, proc.stderr
    rows, prompt_tokens, peak_kib, has_torch = proc.stdout.split()
    assert int(rows) == 200_000 and int(prompt_tokens) > 200_000
    assert has_torch == "False"
    # 500 MB as the issue says it (decimal): 488,281 KiB.
    assert int(peak_kib) * 1024 < 500e6, f"plan's peak RSS {int(peak_kib) / 1024:.0f} MiB"


def test_calibration_times_real_steps_of_a_tiny_model_and_is_cached(tmp_path, tiny_model_dir, monkeypatch):
    import torch

    from batchgen.config import EngineConfig
    from batchgen.engine import llm_engine
    from batchgen.plan.calibrate import calibrate
    from batchgen.plan.calibrate_steps import TIMED_STEPS, decode_batches

    config = EngineConfig(
        model=str(tiny_model_dir("llama")),
        dtype="float32",
        max_num_batched_tokens=256,
        kv_cache_memory="16MiB",
    )
    lines = []
    cal = calibrate(config, torch.float32, 64, 128, 6, cache_dir=tmp_path, log=lines.append)
    assert len(lines) == 1 and "--no-calibrate" in lines[0] and not cal.cached
    prefill = [s for s in cal.samples if s.kind == "prefill"]
    # Two full token budgets of 64-token prompts: each step computes 256 tokens and ends 4 prompts.
    assert [(s.prefill, s.sampled) for s in prefill] == [(256, 4), (256, 4)]
    context = [s for s in cal.samples if s.series == "context"]
    assert (
        [s.sampled for s in context]
        == [b for b in decode_batches(6) for _ in range(TIMED_STEPS)]
        == [1, 1, 1, 4, 4, 4, 6, 6, 6]
    )
    # Every row decodes at about the asked context (the rows were never prefilled).
    assert all(s.kind == "decode" and 128 * s.sampled <= s.context <= 160 * s.sampled for s in context)
    short = [s for s in cal.samples if s.series == "short"]
    assert [s.sampled for s in short] == [6] * TIMED_STEPS and all(s.context < 10 * 6 for s in short)
    assert cal.startup_s > 0 and cal.threads >= 1 and all(s.seconds > 0 for s in cal.samples)
    assert 0 < cal.cpu_share <= 1.5  # (CPU time can count a little more than the torch threads)
    costs = cal.costs()
    assert costs.batches == (1, 4, 6) and costs.per_prefill_token > 0
    assert list(costs.seconds) == sorted(costs.seconds)  # more rows never cost less
    assert cal.spread >= 1.0
    assert costs.scaled(cal.spread).step(6, 800, 100) == pytest.approx(cal.spread * costs.step(6, 800, 100))

    def no_engine(config):
        raise AssertionError("a cached calibration builds no engine")

    monkeypatch.setattr(llm_engine, "LLMEngine", no_engine)
    again = calibrate(config, torch.float32, 64, 128, 6, cache_dir=tmp_path)
    assert again.cached and again.samples == cal.samples and again.key == cal.key
    with pytest.raises(AssertionError, match="builds no engine"):  # --calibrate: measure anyway
        calibrate(config, torch.float32, 64, 128, 6, cache_dir=tmp_path, refresh=True)
    other = calibrate(config, torch.float32, 64, 256, 6, cache_dir=tmp_path, measure=False)
    assert other is None  # another context length: not cached, and not measured


def _fake_calibration(monkeypatch):
    """`calibrate` returns fixed step costs: 10 ms a step, 1 ms a sampled row, 1 us a key, 0.1 ms a
    prompt token; startup 2 s of which 0.5 s choosing kernels."""
    from batchgen.plan import calibrate as calibrate_module
    from batchgen.plan.calibrate import Calibration
    from batchgen.plan.calibrate_steps import StepSample

    samples = [
        StepSample("decode", "context", b, 100 * b, 0, 0.010 + 0.001 * b + 1e-6 * 100 * b) for b in (1, 9)
    ]
    samples += [StepSample("decode", "short", 9, 0, 0, 0.010 + 0.001 * 9)]
    samples += [StepSample("prefill", "prefill", 1, 0, 1000, 0.011 + 1e-4 * 1000)]
    cal = Calibration({"k": "v"}, 2.0, 0.5, 1, 0.0, 0.9, samples, "2026-01-01T00:00:00")
    seen = {}

    def fake(config, dtype, prompt_len, context_len, max_batch, **kw):
        seen.update(prompt_len=prompt_len, context_len=context_len, max_batch=max_batch)
        return cal

    monkeypatch.setattr(calibrate_module, "calibrate", fake)
    return seen


def test_wall_time_of_a_resumed_job_expects_the_committed_rows_output(tmp_path, tiny_model_dir, monkeypatch):
    from batchgen.plan.estimate import ScheduleLimits, StepCosts, simulate_schedule
    from batchgen.plan.wall_time import WallTimeOptions
    from tests.jobs.fake_engine import fake_factory

    seen = _fake_calibration(monkeypatch)
    src = tmp_path / "job.jsonl"
    src.write_text(
        "\n".join(json.dumps({"prompt": f"Question number {i} about things?"}) for i in range(30)) + "\n"
    )
    engine = {"model": str(tiny_model_dir("llama")), "max_num_seqs": 4, "kv_cache_memory": "16MiB"}
    options = JobOptions(str(src), max_tokens=12, commit_rows=4, engine=engine)

    def crash(step: int) -> None:
        if step == 30:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError):
        run_job(options, fake_factory(on_step=crash), dashboard=quiet())
    done = [
        r
        for p in sorted((tmp_path / "job.out.parquet.parts").glob("*.parquet"))
        for r in pq.read_table(p).to_pylist()
    ]
    # The fake model stops some rows early at its EOS: the committed rows used part of their budget.
    fraction = sum(r["completion_tokens"] for r in done) / (12 * len(done))
    assert 0 < fraction < 1 and 0 < len(done) < 30

    from batchgen.plan import wall_time

    # Load average 3 on 2 cores: a run's thread gets 2 / (3 + 1) of a core, the calibration's got 0.9.
    monkeypatch.setattr(wall_time, "busy_share", lambda: (3.0, 2))
    plan = plan_job(options, wall_time=WallTimeOptions())
    assert plan.rows_resumed == len(done) and plan.rows_valid == 30 - len(done)
    assert plan.expected_output_tokens == math.ceil(12 * fraction) * plan.rows_valid
    assert (
        f"{100 * fraction:.0f}% of max_tokens, as the rows an earlier run committed"
        in plan.expected_output_basis
    )
    w = plan.wall_time
    assert w.low_output_tokens == plan.expected_output_tokens and w.high_output_tokens == 12 * plan.rows_valid
    # The same schedules at the fake costs: 10 ms + 1 ms a row + 1 us a key + 0.1 ms a prompt token.
    costs = StepCosts((1, 9), (0.011, 0.019), 1e-6, 1e-4)
    tok = TokenizerEngine(EngineConfig(**engine))
    limits = ScheduleLimits(
        4, tok.max_num_batched_tokens, tok.num_blocks, tok.block_size, max_model_len=tok.max_model_len
    )
    seqs = _planned_sequences(options, tok, len(done))
    expected = np.full(len(seqs.prompts), math.ceil(12 * fraction), np.int64)
    low = simulate_schedule(seqs, expected, limits)
    assert low.method == "engine" and "the engine's scheduler replayed" in w.assumption
    assert w.low_s == pytest.approx(1.5 + w.tokenize_s + low.seconds(costs.scaled(0.9)))
    high = simulate_schedule(seqs, np.full(len(seqs.prompts), 12, np.int64), limits)
    assert w.high_s == pytest.approx(2.0 + w.tokenize_s + high.seconds(costs.scaled(0.9 / 0.5)))
    assert "x1.80 (a load average of up to 3.0 on 2 cores leaves a run's thread 50% of a core" in w.assumption
    assert w.low_steps == low.steps and w.high_steps == high.steps and w.low_s < w.high_s
    assert seen["max_batch"] == 4  # max_num_seqs bounds the rows at once
    assert "every row runs to its max_tokens" in w.assumption and "1 thread at 90% of their cores" in w.rates
    assert "estimated wall time:" in format_plan(plan)


def _planned_sequences(options, tok, skip):
    """The sequences of the rows after the first `skip`, as plan reads them (n = 1, max_tokens 12)."""
    from batchgen.jobs.loop import window_work
    from batchgen.jobs.requests import prepare_row
    from batchgen.jobs.runner import job_reader
    from batchgen.plan.estimate import Sequences

    prefix = PrefixEstimate(tok.block_size, tok.num_blocks)
    prompts, cached, hashes, offsets = [], [], [], [0]
    chat = bool(getattr(tok.tokenizer, "chat_template", None))
    for row in job_reader(options):
        if row.row_index < skip:
            continue
        prepared, _ = prepare_row(row, tok, options, chat, tok.tokenizer.bos_token_id, tok.max_model_len)
        prompts.append(prepared.prompt_tokens)
        hits, blocks = prefix.add(prepared.token_ids)
        cached.append(hits)
        hashes += blocks
        offsets.append(len(hashes))
    p = np.array(prompts, np.int64)
    return Sequences(
        p,
        np.array(cached, np.int64),
        np.full(len(p), 12, np.int64),
        work=np.array([window_work(n, 1, 12, tok.max_model_len) for n in prompts], np.int64),
        block_hashes=np.array(hashes, np.int64),
        block_offsets=np.array(offsets, np.int64),
    )


def test_no_calibrate_without_a_cached_calibration_says_why(tmp_path, tiny_model_dir):
    from batchgen.plan.wall_time import WallTimeOptions

    src = tmp_path / "job.jsonl"
    src.write_text(json.dumps({"prompt": "Hello?"}) + "\n")
    options = JobOptions(str(src), max_tokens=8, engine={"model": str(tiny_model_dir("llama"))})
    plan = plan_job(options, wall_time=WallTimeOptions(calibrate=False, cache_dir=tmp_path / "none"))
    assert plan.wall_time is None and "--no-calibrate" in plan.wall_time_note
    assert plan.expected_output_tokens == 2 and "25% of max_tokens" in plan.expected_output_basis
    assert "estimated wall time: none (no measured step times" in format_plan(plan)
    given = plan_job(
        options, wall_time=WallTimeOptions(calibrate=False, expected_output_tokens=5, cache_dir=tmp_path)
    )
    assert given.expected_output_tokens == 5 and "as given" in given.expected_output_basis


def test_the_set_up_estimate_adds_kernel_measuring_where_the_run_will_measure() -> None:
    """A run whose kernel table is not cached measures its kernels at start: with an earlier
    calibration that timed such a start, those seconds join the set-up estimate and are named;
    without a figure the assumption says so; a table that is cached, or a calibration made now
    (it leaves the table cached), adds nothing."""
    from types import SimpleNamespace

    from batchgen.plan.job_plan import JobPlan, _wall_time_lines
    from batchgen.plan.wall_time import WallTimeEstimate, _with_kernel_measuring

    estimate = WallTimeEstimate(10.0, 20.0, "low: ...", "3 steps", 4.1, 0.5, 5, 9, 40, 80, 4)
    earlier = SimpleNamespace(cached=True, kernel_measure_s=18.9)
    assert _with_kernel_measuring(estimate, earlier, kernels_cached=True) == estimate
    assert (
        _with_kernel_measuring(estimate, SimpleNamespace(cached=False, kernel_measure_s=18.9), False)
        == estimate
    )
    first = _with_kernel_measuring(estimate, earlier, kernels_cached=False)
    assert (first.low_s, first.high_s, first.startup_s) == pytest.approx((28.9, 38.9, 23.0))
    plan = JobPlan("job.jsonl", "m")
    plan.wall_time = first
    assert "model load and set-up 23.0 s, 18.9 s of it measuring kernels" in _wall_time_lines(plan)[0]
    unknown = _with_kernel_measuring(estimate, SimpleNamespace(cached=True, kernel_measure_s=None), False)
    assert unknown.startup_s == 4.1 and "the kernel table is not cached" in unknown.assumption


@pytest.mark.parametrize("arch, head_dim", [("gemma3", 16), ("phi3", 16), ("mistral_window", 16)])
def test_plan_counts_every_layers_kv_for_the_new_families(tmp_path, tiny_model_dir, arch, head_dim):
    """The engine keeps every block of a sequence, also those wholly outside a sliding window
    (docs/engine.md), so a token costs K and V in every layer: 2 layers x 2 KV heads x head_dim x
    4 bytes (float32) x 2; and the plan's KV cache holds what the engine's does."""
    src = tmp_path / "job.jsonl"
    src.write_text(
        json.dumps({"prompt": "a prompt well past the eight-token window of the tiny models"}) + "\n"
    )
    engine = {"model": str(tiny_model_dir(arch)), "dtype": "float32", "kv_cache_memory": 2**20}
    plan = plan_job(JobOptions(str(src), max_tokens=8, engine=engine))
    assert plan.kv_bytes_per_token == 2 * 2 * 2 * head_dim * 4 == 512
    assert plan.kv_cache_tokens == 2**20 // 512
