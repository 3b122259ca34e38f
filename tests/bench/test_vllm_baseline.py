"""The vLLM baseline: the child's protocol, the parent's checks and errors, the report's ratio row.

Every test but the last runs without vLLM: a fake interpreter (a Python script with its own
shebang) stands in for vLLM's, reads the request the bench wrote and answers as the real child
would. The last test runs the real vLLM when BATCHGEN_VLLM_PYTHON names an interpreter that
imports it (see docs/vllm.md), and is skipped, saying so, otherwise.
"""

from __future__ import annotations

import ast
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from rich.console import Console

from batchgen.bench.baselines import vllm as vllm_baseline
from batchgen.bench.baselines import vllm_child
from batchgen.bench.baselines.vllm import (
    VLLM_CHILD,
    VllmRunError,
    VllmUnavailable,
    check_python,
    child_env,
    child_request,
    run_child,
    run_vllm,
    threads_bind,
)
from batchgen.bench.report.json_report import build_report
from batchgen.bench.report.metrics import RequestRecord, RunResult, summarize
from batchgen.bench.report.table import render
from batchgen.bench.settings import BenchSettings
from batchgen.bench.workload.distributions import BenchRequest, Workload
from tests.bench.test_bench_smoke import invoke_bench, tiny_run_args

# What the fake does, chosen per test through FAKE_VLLM_MODE in its environment.
FAKE = """#!{python}
import json, os, sys, time
mode = os.environ.get("FAKE_VLLM_MODE", "ok")
child, request_path, result_path = sys.argv[1:4]
request = json.load(open(request_path))
counts = list(request["max_tokens"])
if mode == "crash":
    print("Segmentation fault in the fake engine", file=sys.stderr)
    sys.exit(139)
if mode == "sleep":
    open(os.environ["FAKE_VLLM_PIDFILE"], "w").write(str(os.getpid()))
    time.sleep(60)
if mode == "short":
    counts[0] -= 1
result = {{"protocol": 1, "vllm_version": "0.0-fake", "elapsed_s": 0.5, "output_tokens": sum(counts),
          "num_output_tokens": counts, "load_s": 1.0, "warmup_s": 0.25,
          "seen": {{"child": child, "child_text": open(child).read(), "model": request["model"], "dtype": request["dtype"],
                   "prompts": request["prompts"], "cwd": os.getcwd(),
                   "env": {{k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")}}}}}}
if mode == "load-error":
    result = {{"protocol": 1, "stage": "load", "error": "ValueError: no such architecture"}}
if mode == "no-vllm":
    result = {{"protocol": 1, "stage": "import", "error": "ModuleNotFoundError: No module named 'vllm'"}}
json.dump(result, open(result_path, "w"))
sys.exit(0 if "error" not in result else 3)
"""


def _log_of(error: Exception) -> Path:
    """The child's log an error names (it must exist)."""
    log = Path(str(error).rsplit("its log: ", 1)[1])
    assert log.is_file()
    return log


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    path = tmp_path / "bin" / "python"
    path.parent.mkdir()
    path.write_text(FAKE.format(python=sys.executable))
    path.chmod(0o755)
    return path


def workload(lengths: list[tuple[int, int]]) -> Workload:
    """Requests with prompts 10, 11, ... of the given (prompt, output) lengths, all at time 0."""
    return Workload(
        "fixed", [BenchRequest(str(i), list(range(10, 10 + p)), o) for i, (p, o) in enumerate(lengths)]
    )


def request_for(w: Workload) -> dict:
    return child_request(
        w,
        model_dir="/models/m",
        dtype="bfloat16",
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=256,
    )


# --- the child ---------------------------------------------------------------------------------------


def test_child_imports_only_the_standard_library_and_vllm() -> None:
    tree = ast.parse(VLLM_CHILD.read_text())
    roots = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert roots == {"__future__", "json", "sys", "time", "traceback", "vllm"}
    assert vllm_child.PROTOCOL == vllm_baseline.PROTOCOL == 1


def test_child_without_vllm_reports_the_import_error(tmp_path: Path) -> None:
    """The real child under this interpreter, which has no vLLM (batchgen's environment)."""
    probe = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip("this interpreter has vLLM installed")
    req, res = tmp_path / "req.json", tmp_path / "res.json"
    req.write_text(json.dumps(request_for(workload([(3, 2)]))))
    done = subprocess.run(
        [sys.executable, str(VLLM_CHILD), str(req), str(res)], capture_output=True, cwd=tmp_path
    )
    assert done.returncode == vllm_child.EXIT_NO_VLLM
    result = json.loads(res.read_text())
    assert result["stage"] == "import" and "vllm" in result["error"]


def test_child_refuses_a_bad_request(tmp_path: Path) -> None:
    req, res = tmp_path / "req.json", tmp_path / "res.json"
    req.write_text(json.dumps({"protocol": 1, "prompts": [[1, 2]], "max_tokens": [0]}))
    done = subprocess.run([sys.executable, str(VLLM_CHILD), str(req), str(res)], capture_output=True)
    assert done.returncode == vllm_child.EXIT_ERROR
    result = json.loads(res.read_text())
    assert result["stage"] == "request" and "max_tokens must be >= 1" in result["error"]


def test_child_request_carries_the_workload() -> None:
    w = workload([(3, 2), (5, 7)])
    req = request_for(w)
    assert req["prompts"] == [[10, 11, 12], [10, 11, 12, 13, 14]]
    assert req["max_tokens"] == [2, 7]
    assert (req["model"], req["dtype"], req["max_model_len"]) == ("/models/m", "bfloat16", 512)
    assert (req["max_num_seqs"], req["max_num_batched_tokens"], req["gpu_memory_utilization"]) == (
        8,
        256,
        None,
    )


# --- the parent --------------------------------------------------------------------------------------


def test_threads_bind_takes_the_first_cores() -> None:
    assert threads_bind(2, [0, 1, 2, 3]) == "0-1"
    assert threads_bind(3, [5, 0, 2, 3]) == "0,2-3"
    assert threads_bind(1, [7]) == "7"
    assert threads_bind(8, [0, 1]) == "0-1"
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        threads_bind(0, [0])


def test_child_env_keeps_what_the_user_set() -> None:
    env = child_env(2, {"VLLM_CPU_KVCACHE_SPACE": "9", "PYTHONPATH": "/src", "HOME": "/root"})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "9"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == threads_bind(2)
    assert "PYTHONPATH" not in env and env["HOME"] == "/root"
    assert child_env(1, {"VLLM_CPU_OMP_THREADS_BIND": "auto"}) == {
        "VLLM_CPU_OMP_THREADS_BIND": "auto",
        "VLLM_CPU_KVCACHE_SPACE": "4",
    }


def test_fake_vllm_run_gives_throughput_and_no_latencies(fake_python: Path) -> None:
    w = workload([(3, 2), (5, 7), (4, 1)])
    run = run_vllm(fake_python, w, request_for(w), num_threads=1)
    assert [r.output_len for r in run.requests] == [2, 7, 1]
    assert all(r.error is None and r.finish == 0.5 for r in run.requests)
    m = summarize(run)
    assert (m["output_tokens"], m["prompt_tokens"], m["wall_s"]) == (10, 12, 0.5)
    assert m["output_tokens_per_s"] == pytest.approx(20.0)
    assert m["total_tokens_per_s"] == pytest.approx(44.0)
    assert m["e2e_mean_s"] is None and m["ttft_mean_s"] is None and m["tpot_mean_s"] is None
    assert m["num_steps"] is None and m["num_errors"] == 0
    assert run.extra["vllm_version"] == "0.0-fake" and run.extra["load_s"] == 1.0
    assert run.extra["env"]["VLLM_CPU_OMP_THREADS_BIND"] == threads_bind(1)
    # In MiB: a sample can land while the short fake child is still being exec'd (0.2 MiB on a
    # busy machine), so only the unit is checked (bytes would be millions).
    assert run.resources["peak_rss_mb"] is None or 0 < run.resources["peak_rss_mb"] < 10_000


def test_fake_child_sees_the_request_and_env(fake_python: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    w = workload([(3, 2)])
    result, _ = run_child(fake_python, request_for(w), child_env(2))
    seen = result["seen"]
    assert seen["child_text"] == VLLM_CHILD.read_text()
    assert Path(seen["child"]).parent == Path(seen["cwd"])  # a folder of its own: nothing shadows vLLM
    assert seen["prompts"] == [[10, 11, 12]] and seen["model"] == "/models/m"
    assert seen["env"] == {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def test_short_output_is_an_error_row(fake_python: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "short")
    w = workload([(3, 2), (5, 7)])
    run = run_vllm(fake_python, w, request_for(w), num_threads=1)
    assert run.requests[0].error == "vLLM generated 1 tokens, expected 2"
    assert summarize(run)["num_errors"] == 1


@pytest.mark.parametrize("what", ["missing", "folder", "not-executable"])
def test_unusable_interpreter_names_the_fix(tmp_path: Path, what: str) -> None:
    path = tmp_path / "python"
    if what == "folder":
        path.mkdir()
    elif what == "not-executable":
        path.write_text("#!/bin/sh\n")
    expected = {"missing": "does not exist", "folder": "is a folder", "not-executable": "is not executable"}
    with pytest.raises(VllmUnavailable) as info:
        check_python(path)
    message = str(info.value)
    assert f"--vllm-python {path} {expected[what]}" in message and "docs/vllm.md" in message


def test_interpreter_that_cannot_start(tmp_path: Path) -> None:
    path = tmp_path / "python"
    path.write_bytes(b"\x7fELF garbage")
    path.chmod(0o755)
    with pytest.raises(VllmUnavailable, match="cannot be started"):
        run_child(path, request_for(workload([(3, 2)])), child_env(1))


def test_interpreter_without_vllm(fake_python: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "no-vllm")
    with pytest.raises(VllmUnavailable, match="cannot import vllm .*install vLLM into that environment"):
        run_child(fake_python, request_for(workload([(3, 2)])), child_env(1))


def test_vllm_error_names_the_stage_and_keeps_the_log(
    fake_python: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "load-error")
    with pytest.raises(
        VllmRunError, match="failed while loading the model: ValueError: no such architecture"
    ) as info:
        run_child(fake_python, request_for(workload([(3, 2)])), child_env(1))
    _log_of(info.value).unlink()  # it was kept for the user


def test_crash_without_result(fake_python: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "crash")
    with pytest.raises(VllmRunError) as info:
        run_child(fake_python, request_for(workload([(3, 2)])), child_env(1))
    message = str(info.value)
    assert "exited with status 139 before reporting a result" in message
    assert "Segmentation fault in the fake engine" in message
    log = _log_of(info.value)
    assert "Segmentation fault" in log.read_text()
    log.unlink()


def test_timeout_kills_the_child(fake_python: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "sleep")
    monkeypatch.setenv("FAKE_VLLM_PIDFILE", str(tmp_path / "pid"))
    with pytest.raises(VllmRunError, match="ran past 1 s and was stopped") as info:
        run_child(fake_python, request_for(workload([(3, 2)])), child_env(1), timeout_s=1)
    assert not psutil.pid_exists(int((tmp_path / "pid").read_text()))
    _log_of(info.value).unlink()


def test_settings_need_the_interpreter() -> None:
    with pytest.raises(ValueError, match="--baselines vllm needs --vllm-python PATH"):
        BenchSettings(baselines=["vllm"])
    with pytest.raises(ValueError, match="--vllm-python applies to --baselines vllm only"):
        BenchSettings(vllm_python="/usr/bin/python3")
    with pytest.raises(ValueError, match="vllm timeout must be > 0 seconds"):
        BenchSettings(baselines=["vllm"], vllm_python="/usr/bin/python3", vllm_timeout_s=-1.0)


# --- the report --------------------------------------------------------------------------------------


def _finished(name: str, kind: str, wall: float, w: Workload) -> RunResult:
    records = [
        RequestRecord(r.request_id, r.prompt_len, r.output_len, 0.0, 0.0, wall / 2, wall) for r in w.requests
    ]
    return RunResult(name, kind, "fcfs" if kind == "continuous" else None, records)


def test_report_ratio_against_vllm(fake_python: Path) -> None:
    w = workload([(3, 2), (5, 7), (4, 1)])
    batchgen_run = _finished("continuous/fcfs", "continuous", 0.25, w)  # twice as fast as the fake's 0.5 s
    vllm_run = run_vllm(fake_python, w, request_for(w), num_threads=1)
    report = build_report(
        settings=BenchSettings(),
        workload=w,
        results=[batchgen_run, vllm_run],
        ceiling=None,
        model_info={"model": "m", "dtype": "bfloat16", "device": "cpu"},
        flops={},
    )
    assert report["vllm_base"] == "vllm" and report["software"]["vllm"] == "0.0-fake"
    cont, vllm = report["configurations"]
    assert cont["ratios_vs_vllm"] == {
        "output_tokens_per_s": pytest.approx(2.0),
        "total_tokens_per_s": pytest.approx(2.0),
        "wall_s": pytest.approx(0.5),
    }
    assert "ratios_vs_vllm" not in vllm and vllm["ratios"]["output_tokens_per_s"] == pytest.approx(0.5)
    out = io.StringIO()
    render(report, Console(file=out, width=200))
    text = out.getvalue()
    row = next(line for line in text.splitlines() if "output tokens/s / vllm" in line)
    assert "2.00x" in row and "1.00x" in row
    assert "vLLM 0.0-fake LLM.generate" in text


# --- the CLI -----------------------------------------------------------------------------------------


def test_bench_with_fake_vllm(tiny_model_dir, tmp_path: Path, fake_python: Path) -> None:
    args = tiny_run_args(tiny_model_dir("llama"), tmp_path, "--num-prompts", "3", "--scale", "0.05")
    result = invoke_bench([*args, "--baselines", "vllm", "--vllm-python", str(fake_python)])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    cont, vllm = report["configurations"]
    assert (cont["name"], vllm["name"], vllm["status"]) == ("continuous/fcfs", "vllm", "ok")
    assert (
        vllm["metrics"]["output_tokens"]
        == report["sampled_output_tokens"]
        == cont["metrics"]["output_tokens"]
    )
    assert vllm["metrics"]["wall_s"] == 0.5
    assert vllm["extra"]["model_dir"] == report["model"]["hf_dir"] == str(tiny_model_dir("llama"))
    expected = cont["metrics"]["output_tokens_per_s"] / vllm["metrics"]["output_tokens_per_s"]
    assert cont["ratios_vs_vllm"]["output_tokens_per_s"] == pytest.approx(expected)
    assert "output tokens/s / vllm" in result.output


def test_bench_with_a_missing_vllm_python_is_a_usage_error(tiny_model_dir, tmp_path: Path) -> None:
    """A typo in the path stops the bench before it runs anything (exit 2, nothing written)."""
    missing = tmp_path / "no-venv" / "bin" / "python"
    args = tiny_run_args(tiny_model_dir("llama"), tmp_path, "--num-prompts", "2", "--scale", "0.05")
    result = invoke_bench([*args, "--baselines", "vllm", "--vllm-python", str(missing)])
    assert result.exit_code == 2, result.output
    assert f"--vllm-python {missing} does not exist" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "r.json").exists()


def test_bench_with_a_python_without_vllm_still_reports(tiny_model_dir, tmp_path: Path) -> None:
    """A python that runs but has no vLLM is found out only by running it: that column is skipped,
    the others are reported."""
    args = tiny_run_args(tiny_model_dir("llama"), tmp_path, "--num-prompts", "2", "--scale", "0.05")
    result = invoke_bench([*args, "--baselines", "vllm", "--vllm-python", sys.executable])
    assert result.exit_code == 0, result.output
    assert "vllm skipped: " in result.output and "Traceback" not in result.output
    report = json.loads((tmp_path / "r.json").read_text())
    statuses = {c["name"]: c["status"] for c in report["configurations"]}
    assert statuses == {"continuous/fcfs": "ok", "vllm": "skipped"}
    assert report["vllm_base"] is None


def test_a_bench_of_a_skipped_vllm_run_alone_exits_1(tiny_model_dir, tmp_path: Path) -> None:
    """With no batchgen configuration beside it, a skipped baseline is a report of nothing."""
    args = tiny_run_args(tiny_model_dir("llama"), tmp_path, "--num-prompts", "2", "--scale", "0.05")
    result = invoke_bench([*args, "--mode", "", "--baselines", "vllm", "--vllm-python", sys.executable])
    assert result.exit_code == 1, result.output
    assert "no configuration was measured" in result.output and "Traceback" not in result.output


def test_bench_vllm_without_interpreter_is_a_usage_error(tmp_path: Path) -> None:
    result = invoke_bench(["--baselines", "vllm", "--output", str(tmp_path / "r.json")])
    assert result.exit_code == 2
    assert "--vllm-python" in result.output


# --- the real vLLM -----------------------------------------------------------------------------------


def _real_vllm_python() -> str:
    """BATCHGEN_VLLM_PYTHON when it names an interpreter that imports vllm; else the test skips."""
    python = os.environ.get("BATCHGEN_VLLM_PYTHON")
    if not python:
        pytest.skip("BATCHGEN_VLLM_PYTHON is not set: point it at vLLM's python (docs/vllm.md) to run vLLM")
    probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, cwd="/")
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"BATCHGEN_VLLM_PYTHON={python} cannot import vllm: {last}")
    return python


@pytest.mark.slow
def test_real_vllm_generates_every_token(default_model_dir: Path) -> None:
    python = _real_vllm_python()
    w = workload([(8, 4), (20, 3), (5, 6)])
    req = child_request(
        w,
        model_dir=default_model_dir,
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=256,
    )
    run = run_vllm(python, w, req, num_threads=2, timeout_s=600)
    assert [r.output_len for r in run.requests] == [4, 3, 6]
    assert all(r.error is None for r in run.requests)
    m = summarize(run)
    assert m["output_tokens"] == 13 and 0 < m["wall_s"] < 600
    assert run.extra["vllm_version"].split(".")[0].isdigit()
    assert run.resources["peak_rss_mb"] > 100  # vLLM's processes hold the model


def test_notes_print_whole_in_a_log(tmp_path: Path) -> None:
    """Found by a new user: in a log (not a terminal) a note over the console's width broke in two, so
    grep found half of it."""
    w = workload([(3, 2)])
    run = _finished("continuous/fcfs", "continuous", 0.25, w)
    note = "speculative ngram k=4 n=2-4, " + "gate running batch <= 42 " * 12 + "END"
    run.notes.append(note)
    report = build_report(
        settings=BenchSettings(),
        workload=w,
        results=[run],
        ceiling=None,
        model_info={"model": "m", "dtype": "bfloat16", "device": "cpu"},
        flops={},
    )
    out = io.StringIO()
    render(report, Console(file=out, width=80))
    assert f"note: {note}" in out.getvalue().splitlines()
