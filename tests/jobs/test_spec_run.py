"""Speculative decoding through `batchgen run` and what a job shows of it: the flags, the same output
as without them, the Prometheus counters and the dashboard's line."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from rich.console import Console

from batchgen.dashboard import Dashboard
from batchgen.engine.stats import EngineTotals, StepStats

REPO = Path(__file__).resolve().parents[2]
P = "batchgen:"
PROMPTS = [
    "one two three four one two three four one two three four one two three",
    "the cat sat on the mat. the cat sat on the mat. the dog sat on the log. the dog sat on the",
    "a b c d e f g a b c d e f g a b c d e f g a b c",
    "Hello, my name is",
]


def run(job: Path, out: Path, model: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "batchgen", "run", str(job), "--output", str(out), "--model", str(model)]
    cmd += "--max-tokens 32 --ignore-eos --no-chat-template --dtype float32 --num-threads 1".split()
    cmd += "--kv-cache-memory 16MiB --no-dashboard".split() + list(extra)
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_run_with_speculation_writes_the_same_rows_and_its_metrics(tmp_path, tiny_model_dir):
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    model = tiny_model_dir("llama")
    job = tmp_path / "job.jsonl"
    job.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    plain = run(job, tmp_path / "plain.parquet", model)
    assert plain.returncode == 0, plain.stderr
    prom = tmp_path / "job.prom"
    spec = run(
        job, tmp_path / "spec.parquet", model, "--speculative-method", "ngram",
        "--num-speculative-tokens", "3", "--speculative-max-batch", "8", "--metrics-file", str(prom),
    )  # fmt: skip
    assert spec.returncode == 0, spec.stderr
    assert "speculative ngram k=3 n=2-4, gate running batch <= 8 (set)" in spec.stderr
    columns = ["output", "completion_tokens", "finish_reason"]
    assert (
        pq.read_table(tmp_path / "spec.parquet", columns=columns).to_pylist()
        == pq.read_table(tmp_path / "plain.parquet", columns=columns).to_pylist()
    )
    values = {s.name: s.value for f in text_string_to_metric_families(prom.read_text()) for s in f.samples}
    drafts, accepted = (
        values[P + "spec_decode_num_draft_tokens_total"],
        values[P + "spec_decode_num_accepted_tokens_total"],
    )
    assert 0 < accepted < drafts
    assert 0 < values[P + "spec_decode_num_drafts_total"] <= drafts
    # The progress line says it too.
    assert re.search(rf"spec {int(accepted)}/{int(drafts)} drafts accepted \(\d+%\)", spec.stderr)


def test_speculative_options_without_the_method_are_a_usage_error(tmp_path):
    job = tmp_path / "job.jsonl"
    job.write_text('{"prompt": "hi"}\n')
    cmd = [
        sys.executable,
        "-m",
        "batchgen",
        "run",
        str(job),
        "--num-speculative-tokens",
        "3",
        "--no-dashboard",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "num_speculative_tokens apply only with speculative decoding" in proc.stderr
    assert "--speculative-method ngram" in proc.stderr and "Traceback" not in proc.stderr


def _stats(drafts: int, accepted: int) -> StepStats:
    return StepStats(
        step=0, time=time.perf_counter(), step_time_s=0.05, num_seqs=2, num_batched_tokens=2 + drafts,
        num_prompt_tokens=0, num_generation_tokens=2 + accepted, num_running=2, num_waiting=0,
        num_swapped=0, kv_cache_usage=0.1, num_preemptions=0, prefix_cache_queries=0,
        prefix_cache_hits=0, num_finished=0, num_drafts=2 if drafts else 0, num_draft_tokens=drafts,
        num_accepted_tokens=accepted,
    )  # fmt: skip


def test_dashboard_shows_drafts_accepted_and_the_rate():
    totals = EngineTotals()
    for drafts, accepted in ((8, 3), (6, 6), (0, 0)):
        totals.add(_stats(drafts, accepted))
    assert (totals.spec_decode_num_draft_tokens, totals.spec_decode_num_accepted_tokens) == (14, 9)
    console = Console(record=True, force_terminal=True, width=150, color_system=None)
    d = Dashboard(10, live=True, console=console)
    d.update(1, 0, _stats(0, 0), totals)
    console.print(d.render())
    assert re.search(r"spec decode\s+9/14 drafts accepted \(64%\)", console.export_text())
    assert d.progress_line().endswith("| spec 9/14 drafts accepted (64%)")
    plain = Dashboard(10, live=False, console=Console(file=io.StringIO()), stream=io.StringIO())
    plain.update(1, 0, _stats(0, 0), EngineTotals())
    assert "spec" not in plain.progress_line()  # nothing proposed: nothing said
