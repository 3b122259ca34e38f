"""Dashboard: the Rich live view renders every field; plain progress lines appear without a terminal."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import time

import pytest
from rich.console import Console

from batchgen.dashboard import Dashboard, counted, format_duration, sparkline
from batchgen.engine.stats import EngineTotals, StepStats
from batchgen.jobs.runner import JobSummary

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def stats(step: int, seqs: int = 24) -> StepStats:
    return StepStats(
        step=step,
        time=time.perf_counter(),
        step_time_s=0.05,
        num_seqs=seqs,
        num_batched_tokens=seqs + 100,
        num_prompt_tokens=100,
        num_generation_tokens=seqs,
        num_running=seqs,
        num_waiting=7,
        num_swapped=2,
        kv_cache_usage=0.42,
        num_preemptions=1,
        prefix_cache_queries=100,
        prefix_cache_hits=25,
        num_finished=3,
    )


def feed(d: Dashboard, steps: int = 4) -> None:
    totals = EngineTotals()
    for i in range(steps):
        s = stats(i, seqs=8 * (i + 1))
        totals.add(s)
        d._last_sample = 0.0  # sample every update (the dashboard samples at most every 0.5 s)
        d.update(10 * (i + 1), 1, s, totals)
        time.sleep(0.01)


def test_live_view_renders_every_field():
    console = Console(record=True, force_terminal=True, width=150, color_system=None)
    d = Dashboard(100, live=True, console=console)
    assert d.live_mode
    d.start()
    feed(d)
    d.stop()
    console.print(d.render())
    text = console.export_text()
    for field in ("rows", "40/100 (40.0%)", "eta", "gen tok/s", "prompt tok/s", "32 seqs / 132 tok"):
        assert field in text, field
    for pattern in (
        r"queues\s+running 32 waiting 7 swapped 2",
        r"kv cache\s+42%",
        r"prefix hit\s+25%",
        r"preemptions\s+4\s",  # one a step over 4 steps
        r"errors\s+1\s",
    ):
        assert re.search(pattern, text), pattern
    assert "batch size" in text and any(c in text for c in "▁▂▃▄▅▆▇█")
    assert d.rates()[0] > 0 and d.eta_s() is not None


def test_plain_lines_without_a_terminal():
    stream = io.StringIO()
    console = Console(file=io.StringIO(), force_terminal=False)
    d = Dashboard(50, live=True, console=console, stream=stream, interval=0.0)
    assert not d.live_mode  # not a terminal: plain lines even when live was asked for
    d.start()
    feed(d, steps=2)
    d.stop()
    first, *lines = stream.getvalue().splitlines()
    assert first.startswith("[batchgen] engine ready")  # a sign of life before the first step ends
    # One line an update (interval 0); stop() adds none, as the last line already shows 20 rows.
    assert len(lines) == 2 and all(line.startswith("[batchgen] rows ") for line in lines)
    assert "kv 42%" in lines[-1] and "prefix hit 25%" in lines[-1] and "batch 16 seqs / 116 tok" in lines[-1]
    d._stopped = d._start + 0.5  # generation took 0.5 s of the 2 s run
    d.print_summary(
        JobSummary(
            "out.parquet",
            50,
            rows_ok=45,
            rows_error=5,
            prompt_tokens=9,
            completion_tokens=7,
            wall_s=2.0,
            complete=True,
        )
    )
    summary = console.file.getvalue()
    assert (
        "50/50 rows (45 ok, 5 error" in summary
        and "output: out.parquet" in summary
        and "wall time: 2.0s (generation 0.5s, model load and set-up 1.5s)" in summary
    )
    # A finished run: its rows' tokens, over the generation time (what the engine did) and over the
    # whole run (what the user waited).
    assert "tokens: 9 prompt, 7 generated" in summary
    assert (
        "throughput: 14.0 generated tok/s and 100.00 rows/s while generating; 3.5 tok/s over the whole run"
        in summary
    )


@pytest.mark.parametrize(
    ("rows", "distinct", "said"),
    [
        (1, 1, "1 row, 1 distinct constraint compiled in"),
        (3, 2, "3 rows, 2 distinct constraints compiled in"),
    ],
)
def test_the_summary_counts_structured_rows_in_words_of_their_number(rows, distinct, said):
    console = Console(file=io.StringIO(), width=200)
    d = Dashboard(rows, live=False, console=console, stream=io.StringIO(), interval=0.0)
    d.start()
    d._stopped = d._start + 1.0
    d.print_summary(
        JobSummary(
            "o.parquet", rows, rows_ok=rows, structured_rows=rows, grammars_compiled=distinct, wall_s=1.0
        )
    )
    assert f"structured outputs: {said} " in console.file.getvalue()
    assert [counted(n, "row") for n in (0, 1, 2)] == ["0 rows", "1 row", "2 rows"]


def test_an_interrupted_runs_summary_counts_the_tokens_of_unfinished_rows_and_says_they_are_redone():
    """An interrupt leaves rows unfinished: the engine generated their tokens (the rate counts them),
    but only committed rows' tokens are kept, and the summary says the rest is generated again."""
    console = Console(file=io.StringIO(), width=200)
    d = Dashboard(50, live=False, console=console, stream=io.StringIO(), interval=0.0)
    d.start()
    d._stopped = d._start + 2.0
    summary = JobSummary(
        "out.parquet", 50, rows_ok=3, prompt_tokens=30, completion_tokens=40, generated_tokens=400,
        wall_s=4.0, interrupted=True,
    )  # fmt: skip
    d.print_summary(summary)
    text = console.file.getvalue()
    assert "interrupted: 3/50 rows" in text
    assert (
        "tokens: 30 prompt, 400 generated: 40 in committed rows, 360 in rows left unfinished (not "
        "committed: a resume generates them again)" in text
    )
    assert "throughput: 200.0 generated tok/s" in text
    assert summary.to_dict(130)["generated_tokens"] == 400 and summary.to_dict(130)["completion_tokens"] == 40


def test_a_narrow_terminal_shows_every_field_whole():
    """At 80 columns, two fields a row cropped the error count next to a long queues value."""
    console = Console(record=True, force_terminal=True, width=80, color_system=None)
    d = Dashboard(20000, live=True, console=console)
    d.start()
    step = dataclasses.replace(stats(1, seqs=256), num_waiting=1024, num_swapped=12)
    totals = EngineTotals()
    totals.add(step)
    d.update(12400, 17, step, totals)
    d.stop()
    console.print(d.render())
    text = console.export_text()
    assert re.search(r"rows\s+12400/20000 \(62.0%\)", text) and re.search(r"errors\s+17\b", text)
    assert "running 256 waiting 1024 swapped 12" in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_the_progress_bar_has_a_line_of_its_own():
    """A ProgressBar ends without a line break: the rows field used to continue the bar's line, cropped
    to "rows 10" at the panel's edge."""
    console = Console(record=True, force_terminal=True, width=80, color_system="standard")
    d = Dashboard(200000, live=True, console=console)
    d.update(100000, 0, None, None)
    console.print(d.render())
    lines = console.export_text().splitlines()
    assert set(lines[1].strip("│ ")) <= set("━╺╸"), lines[1]
    assert re.fullmatch(r"│\s+rows\s+100000/200000 \(50.0%\)\s+│", lines[2]), lines[2]


def test_helpers():
    assert sparkline([0, 1, 2, 4]) == "▁▃▅█" and sparkline([]) == "" and sparkline([0, 0]) == "▁▁"
    assert (
        format_duration(None) == "?"
        and format_duration(3.25) == "3.2s"
        and format_duration(3723) == "1h02m03s"
    )


def test_progress_lines_reach_ci_logs(tmp_path, tiny_model_dir):
    """`batchgen run` without a terminal prints plain progress lines to stderr and a summary to stdout."""
    src = tmp_path / "job.jsonl"
    src.write_text("\n".join(json.dumps({"prompt": f"Tell me about number {i}."}) for i in range(12)) + "\n")
    cmd = [sys.executable, "-m", "batchgen", "run", str(src), "--model", str(tiny_model_dir("llama"))]
    cmd += "--max-tokens 6 --max-num-seqs 2 --progress-interval 0.05 --kv-cache-memory 64MiB --num-threads 1".split()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "[batchgen] rows " in proc.stderr and "tok/s" in proc.stderr
    assert "12/12 rows" in proc.stdout and "job.out.parquet" in proc.stdout


class FakeClock:
    """`time` for the dashboard module: `perf_counter` reads `now`, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_eta_follows_the_recent_rate_and_the_last_line_has_none(monkeypatch):
    """The ETA comes from the rows finished over the last seconds up to the latest update: the rows
    of a burst that finished since the last rate sample count at once, and a slower phase shows in
    the ETA within the rate window. The last line (after stop) shows no `eta ?`."""
    import batchgen.dashboard as dashboard_module

    clock = FakeClock()
    monkeypatch.setattr(dashboard_module, "time", clock)
    stream = io.StringIO()
    d = Dashboard(1000, live=False, console=Console(file=io.StringIO()), stream=stream, interval=1e9)
    d.start()
    totals = EngineTotals()
    d.update(0, 0, None, totals)
    clock.now += 0.2
    d.update(50, 0, None, totals)  # a burst 0.2 s after the last sample: 250 rows/s, not 0
    assert d.eta_s() == pytest.approx(950 / 250)
    for _ in range(40):  # 20 s at 10 rows/s, sampled every 0.5 s
        clock.now += 0.5
        d.update(d.rows_done + 5, 0, None, totals)
    assert d.rates()[2] == pytest.approx(10.0) and d.eta_s() == pytest.approx((1000 - 250) / 10)
    for _ in range(30):  # then 15 s at 2 rows/s: the ETA follows within the 10 s window
        clock.now += 0.5
        d.update(d.rows_done + 1, 0, None, totals)
    assert d.rates()[2] == pytest.approx(2.0) and d.eta_s() == pytest.approx((1000 - 280) / 2)
    clock.now += 0.1
    d.update(1000, 0, None, totals)  # the rest finishes at once
    assert d.eta_s() == 0.0
    d.stop()
    last = stream.getvalue().splitlines()[-1]
    assert last.startswith("[batchgen] rows 1000/1000") and "eta" not in last, last
