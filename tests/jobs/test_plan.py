"""`batchgen plan`: the same error rows and prompt tokens as `run`, no weights loaded, bounded memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchgen.jobs.formats import JobInputError
from batchgen.jobs.plan import _PrefixEstimate, plan_job
from batchgen.jobs.runner import JobOptions, default_engine_factory, run_job
from tests.jobs.real_engine import quiet
from tests.jobs.test_bad_rows import BAD, bad_lines

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
    cmd += ["--max-tokens", "16", "--kv-cache-memory", "64MiB", "--json"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["rows"] == plan["rows_valid"] == 10 and plan["rows_error"] == 0
    assert plan["max_output_tokens"] == 160
    # Nine rows after the first find its shared prefix blocks in the cache.
    assert plan["prefix_cache_tokens"] > 0 and plan["prefix_cache_tokens"] % plan["block_size"] == 0
    assert plan["prefix_cache_tokens"] <= 9 * (plan["prompt_tokens_max"] - 1)
    assert not list(tmp_path.glob("job.out*"))  # nothing written
    text = subprocess.run(cmd[:-1], cwd=REPO, capture_output=True, text=True, timeout=300)
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


def test_plan_refuses_a_missing_input(tmp_path):
    with pytest.raises(JobInputError):
        plan_job(JobOptions(str(tmp_path / "nope.jsonl")))


def test_prefix_estimate_counts_shared_full_blocks_within_the_cache():
    est = _PrefixEstimate(block_size=4, capacity=100)
    est.add(list(range(9)))  # blocks [0-3], [4-7]: nothing cached yet
    est.add(list(range(8)) + [99])  # both blocks hit
    est.add([7, 7, 7, 7, 1])  # another first block: no hit
    est.add(list(range(6)))  # first block hits; [4, 5] is not full
    assert est.hit_tokens == 8 + 4
    small = _PrefixEstimate(block_size=4, capacity=1)  # one block: the second prompt evicted the first
    small.add([1, 2, 3, 4, 0])
    small.add([5, 6, 7, 8, 0])
    small.add([1, 2, 3, 4, 0])
    assert small.hit_tokens == 0


@pytest.mark.slow
def test_plan_of_200k_rows_stays_under_500_mb(tmp_path, tiny_model_dir):
    src = tmp_path / "big.jsonl"
    with open(src, "w") as f:
        for i in range(200_000):
            f.write(json.dumps({"prompt": f"Row {i}: summarize the number {i * 7919} in words."}) + "\n")
    # The peak is VmHWM, this process image's own: ru_maxrss would keep the high-water mark of the
    # forked pytest process from before the exec.
    code = (
        "from batchgen.jobs.plan import plan_job; from batchgen.jobs.runner import JobOptions;"
        f"p = plan_job(JobOptions({str(src)!r}, engine={{'model': {str(tiny_model_dir('llama'))!r}}}));"
        "hwm = [line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM')][0];"
        "print(p.rows, hwm)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=3000
    )
    assert proc.returncode == 0, proc.stderr
    rows, peak_kib = map(int, proc.stdout.split())
    assert rows == 200_000 and peak_kib < 500 * 1024
