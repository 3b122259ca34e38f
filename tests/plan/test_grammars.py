"""`batchgen plan` compiles each distinct structured outputs constraint as the engine would and
lists the bad ones with their rows, in its own process and in the child of a torch-free plan."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from batchgen.jobs.runner import JobOptions
from batchgen.plan.job_plan import format_plan, plan_job

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


def write(path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def test_plan_compiles_each_distinct_constraint_and_lists_the_bad(tmp_path, tiny_model_dir):
    src = write(tmp_path / "job.jsonl")
    engine = {"model": str(tiny_model_dir("llama")), "grammar_compile_timeout": 0.05}
    plan = plan_job(JobOptions(str(src), max_tokens=8, engine=engine))
    g = plan.structured
    # the keyword xgrammar ignores is an error row already (as in run); the rest compile here
    assert plan.rows_error == 1 and "keyword 'uniqueItems'" in plan.first_errors[0]
    assert (g.rows, g.distinct, g.error_rows) == (4, 3, 2)
    assert g.errors == [
        TIMEOUT
        + "; simplify it (fewer nested or repeated parts, smaller maxLength / maxItems bounds) or raise grammar_compile_timeout (flag --grammar-compile-timeout)"
    ]
    assert g.compile_s > 0.05
    text = format_plan(plan)
    assert text.startswith(f"job: {src} (model ") and ", quantization auto)" in text.splitlines()[0]
    assert "structured outputs: 4 rows, 3 distinct constraints, compiled in " in text
    assert "2 rows' constraint fails (error rows in run):" in text


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
