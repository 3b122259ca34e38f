"""`batchgen bench --profile` (batchgen/bench/report/profile.py): the engine's steps under cProfile,
the top functions printed and written to a file. No timings checked: only counts that hold anywhere."""

from __future__ import annotations

import cProfile
import json
from pathlib import Path

import pytest

from batchgen.bench.report.profile import profile_rows, render_profile, step_calls
from tests.bench.test_bench_smoke import invoke_bench


class CountingEngine:
    """Just enough of an engine for the profiler: `step` calls `schedule` twice."""

    def step(self) -> list:
        self.schedule()
        self.schedule()
        return []

    def schedule(self) -> int:
        return sum(range(100))


def test_rows_count_the_calls_and_the_steps() -> None:
    profiler = cProfile.Profile()
    engine = CountingEngine()
    for _ in range(3):
        profiler.runcall(engine.step)
    assert step_calls(profiler) == 3
    calls = {row.function: row.calls for row in profile_rows(profiler)}
    step, schedule = (
        f"tests/bench/test_profile.py:{f.__code__.co_firstlineno} {f.__name__}"
        for f in (CountingEngine.step, CountingEngine.schedule)
    )
    assert calls[step] == 3 and calls[schedule] == 6
    assert calls["<built-in method builtins.sum>"] == 6
    by_cumulative = profile_rows(profiler, "cumulative")
    assert by_cumulative[0].function == step
    table = render_profile("continuous/fcfs", profiler, rows=2).splitlines()
    assert table[0].startswith("profile of continuous/fcfs: 3 engine steps,")
    assert table[0].endswith("top 2 functions by own time") and len(table) == 2 + 2
    with pytest.raises(ValueError, match="sort must be 'own' or 'cumulative'"):
        profile_rows(profiler, "calls")


def test_bench_profile_on_a_tiny_model(tiny_model_dir, tmp_path: Path) -> None:
    """Each timed configuration's table counts exactly its recorded steps (the warm-up's are left out)."""
    out = tmp_path / "profile.txt"
    args = [
        "--model", str(tiny_model_dir("llama")), "--dist", "longtail", "--num-prompts", "6",
        "--scale", "0.03", "--mode", "continuous,static", "--static-batch-size", "3", "--no-ceiling",
        "--num-threads", "1", "--kv-cache-memory", "16MiB", "--output", str(tmp_path / "r.json"),
        "--profile", "--profile-output", str(out),
    ]  # fmt: skip
    result = invoke_bench(args)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    text = out.read_text()
    for c in report["configurations"]:
        steps = c["metrics"]["num_steps"]
        heading = f"profile of {c['name']}: {steps} engine steps,"
        assert heading in result.output and text.count(heading) == 2, c["name"]  # own, cumulative
        assert f"{c['name']}: timed under cProfile (--profile), slower than a plain run" in c["notes"]
    assert [c["name"] for c in report["configurations"]] == ["continuous/fcfs", "static/b3"]
    assert "batchgen/engine/llm_engine.py" in text and "batchgen/engine/scheduler.py" in text
    assert "batchgen/model/llama.py" in text
    assert f"profile written to {out}" in result.output


def test_an_unwritable_profile_output_is_refused_before_any_run(tmp_path: Path) -> None:
    result = invoke_bench(["--profile", "--profile-output", str(tmp_path / "missing" / "p.txt")])
    assert result.exit_code == 2
    assert "--profile-output" in result.output and "running" not in result.output
