"""`batchgen plan` compiles each distinct structured outputs constraint as the engine would and
lists the bad ones with their rows, in its own process and in the child of a torch-free plan."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

from batchgen.jobs.runner import JobOptions, default_engine_factory, run_job
from batchgen.plan.grammars import GrammarReport
from batchgen.plan.job_plan import format_plan, plan_job
from tests.jobs.real_engine import quiet

REPO = Path(__file__).resolve().parents[2]
ROWS = [
    {"prompt": "a", "json_schema": {"type": "object", "properties": {"x": {"type": "integer"}}}},
    {"prompt": "b", "regex": "[a-z]{3000}"},  # about 0.4 s to compile on a 2-core Zen 4
    {"prompt": "c", "regex": "[a-z]{3000}"},
    {"prompt": "d", "choice": ["yes", "no"]},
    {"prompt": "e"},
    {"prompt": "f", "json_schema": {"type": "array", "uniqueItems": True}},
]
TIMEOUT = "row 1 (line 2) and 1 other row(s) with the same constraint: field 'regex' did not compile within the time limit of 0.05 s"


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write(path: Path) -> Path:
    return write_rows(path, ROWS)


def run_errors(options: JobOptions) -> list[str]:
    """The error rows `batchgen run` writes for the job (the real engine), in row order."""
    run_job(options, default_engine_factory, dashboard=quiet())
    return [r["error"] for r in pq.read_table(options.output).to_pylist() if r["error"]]


def test_plan_compiles_each_distinct_constraint_and_lists_the_bad(tmp_path, tiny_model_dir):
    src = write(tmp_path / "job.jsonl")
    engine = {"model": str(tiny_model_dir("llama")), "grammar_compile_timeout": 0.05}
    options = JobOptions(str(src), max_tokens=8, engine=engine, output=str(tmp_path / "out.parquet"))
    plan = plan_job(options)
    g = plan.structured
    # the keyword xgrammar ignores is an error row already (as in run); the two regex rows whose
    # constraint does not compile in time are error rows too, as run makes them, worded as run's
    assert (plan.rows, plan.rows_valid, plan.rows_error) == (6, 3, 3)
    assert plan.first_errors == run_errors(options)
    assert plan.first_errors[0].startswith(
        TIMEOUT.replace(" and 1 other row(s) with the same constraint", "")
    )
    assert "keyword 'uniqueItems'" in plan.first_errors[2]
    # their tokens are not planned: the totals are those of the job without them
    valid = write_rows(tmp_path / "valid.jsonl", [ROWS[0], ROWS[3], ROWS[4]])
    alone = plan_job(JobOptions(str(valid), max_tokens=8, engine=engine))
    assert plan.prompt_tokens > 0 and (
        plan.prompt_tokens,
        plan.max_output_tokens,
        plan.prompt_tokens_max,
    ) == (
        alone.prompt_tokens,
        alone.max_output_tokens,
        alone.prompt_tokens_max,
    )
    assert (g.rows, g.distinct, g.error_rows) == (4, 3, 2)
    assert g.errors == [
        TIMEOUT
        + "; simplify it (fewer nested or repeated parts, smaller maxLength / maxItems bounds) or raise grammar_compile_timeout (flag --grammar-compile-timeout)"
    ]
    assert g.compile_s > 0.05
    text = format_plan(plan)
    assert text.startswith(f"job: {src} (model ") and ", quantization auto)" in text.splitlines()[0]
    assert "structured outputs: 4 rows, 3 distinct constraints, compiled in " in text
    assert "2 rows' constraints fail (error rows in run):" in text


def test_the_plan_lines_count_in_words_of_their_number():
    one = GrammarReport(rows=1, distinct=1, compile_s=0.5, error_rows=1, errors=["row 0: bad"])
    assert one.lines() == [
        "structured outputs: 1 row, 1 distinct constraint, compiled in 0.50 s; "
        "1 row's constraint fails (an error row in run):",
        "  row 0: bad",
    ]
    assert GrammarReport(rows=2, distinct=2).lines() == [
        "structured outputs: 2 rows, 2 distinct constraints, compiled in 0.00 s; all compile"
    ]


def test_the_plan_command_compiles_in_its_child(tmp_path, tiny_model_dir):
    """The CLI's plan keeps torch out of its process: the constraints compile in its child, and a
    constraint's library error (which the torch-free reader cannot see) is listed there."""
    rows = [*ROWS, {"prompt": "g", "json_schema": {"type": "strng"}}]
    src = tmp_path / "job.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [sys.executable, "-m", "batchgen", "plan", str(src), "--model", str(tiny_model_dir("llama"))]
    cmd += ["--max-tokens", "8", "--grammar-compile-timeout", "0.05", "--no-calibrate", "--json"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    g = json.loads(proc.stdout)["structured"]
    assert (g["rows"], g["distinct"], g["error_rows"]) == (5, 4, 3)
    assert g["errors"][0].startswith(TIMEOUT)
    assert g["errors"][1].startswith(
        "row 6 (line 7): field 'json_schema' is not a JSON schema xgrammar can compile"
    )


def test_the_plan_command_counts_rows_whose_constraint_fails_as_run_does(tmp_path, tiny_model_dir):
    """Constraints the torch-free reader cannot check (a schema, a regex xgrammar refuses) compile in
    the plan's child: their rows are the error rows run writes, with run's messages, and their
    tokens are left out of the headline counts; an empty choice list is refused by the reader."""
    model = str(tiny_model_dir("llama"))
    good = [{"prompt": "a", "choice": ["yes", "no"]}, {"prompt": "a longer prompt than the first"}]
    bad = [
        {"prompt": "b", "json_schema": {"type": "strng"}},
        {"prompt": "c", "regex": "(?<=a)b"},
        {"prompt": "d", "structured_outputs": {"choice": []}},
    ]
    src = write_rows(tmp_path / "job.jsonl", [good[0], *bad, good[1]])
    cmd = [sys.executable, "-m", "batchgen", "plan", str(src), "--model", model, "--max-tokens", "8"]
    proc = subprocess.run(
        [*cmd, "--no-calibrate", "--json"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    valid = plan_job(
        JobOptions(str(write_rows(tmp_path / "valid.jsonl", good)), max_tokens=8, engine={"model": model})
    )
    assert (plan["rows"], plan["rows_valid"], plan["rows_error"]) == (5, 2, 3)
    assert (plan["prompt_tokens"], plan["max_output_tokens"]) == (
        valid.prompt_tokens,
        valid.max_output_tokens,
    )
    assert plan["structured"]["error_rows"] == 2  # the empty list is no constraint: the reader's error
    options = JobOptions(
        str(src), max_tokens=8, engine={"model": model}, output=str(tmp_path / "out.parquet")
    )
    errors = run_errors(options)
    assert plan["first_errors"] == errors and len(errors) == 3
    assert errors[0].startswith(
        "row 1 (line 2): field 'json_schema' is not a JSON schema xgrammar can compile"
    )
    assert errors[1].startswith("row 2 (line 3): field 'regex' is not a regex xgrammar can compile")
    # the plain text says so too
    text = subprocess.run(
        [*cmd, "--no-calibrate"], cwd=REPO, capture_output=True, text=True, timeout=300
    ).stdout
    assert "rows: 5 (2 valid, 3 error rows" in text, text
