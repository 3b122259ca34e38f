"""Exactly-once resume: a job killed (SIGKILL, or SIGINT) at random moments and rerun each time ends
with exactly the rows, and for greedy rows exactly the texts, of an uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPARED = ["row_index", "id", "output", "finish_reason", "prompt_tokens", "completion_tokens", "error"]
NUM_ROWS = 24
SAMPLED = {5, 17}  # rows with temperature > 0: everything but the text must match


def make_job(path: Path) -> None:
    subjects = ["rivers", "volcanoes", "bees", "libraries", "trains", "clouds", "chess", "bread"]
    with open(path, "w") as f:
        for i in range(NUM_ROWS):
            row = {
                "id": f"job-{i}",
                "prompt": f"Write a short note about {subjects[i % 8]} (note {i}).",
                # 8-47 tokens: enough steps (about 1 s of generation at 1,000 rows/s of the tiny model
                # in float32) that a signal sent just after a commit lands before the run ends
                "max_tokens": 8 + (i * 13) % 40,
            }
            if i in SAMPLED:
                row.update(temperature=0.8, seed=i)
            f.write(json.dumps(row) + "\n")


def command(src: Path, out: Path, model: Path) -> list[str]:
    options = (
        "--max-num-seqs 4 --policy max-throughput --window 12 --commit-every 2 --commit-interval 0.2 "
        "--no-dashboard --progress-interval 1000 --kv-cache-memory 64MiB --num-threads 1"
    )
    run = [sys.executable, "-m", "batchgen", "run", str(src), "--output", str(out), "--model", str(model)]
    return run + options.split()


def committed_parts(out: Path) -> int:
    manifest = Path(str(out) + ".parts") / "manifest.jsonl"
    try:
        return max(len(manifest.read_bytes().splitlines()) - 1, 0)
    except FileNotFoundError:
        return 0


def rows_of(path: Path) -> list[dict]:
    rows = pq.read_table(path, columns=COMPARED).to_pylist()
    for r in rows:
        if r["row_index"] in SAMPLED:
            r["output"] = None
    return rows


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("kill")
    src = tmp / "job.jsonl"
    make_job(src)
    model = tiny_model_dir("llama")
    ref = tmp / "reference.parquet"
    proc = subprocess.run(command(src, ref, model), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    expected = rows_of(ref)
    assert [r["row_index"] for r in expected] == list(range(NUM_ROWS))
    return src, model, expected


def interrupt_and_resume(setup, out: Path, sig: int, kills: int, seed: int) -> list[int]:
    """Run the job, sending `sig` `kills` times at random moments after new parts were committed,
    then let it finish; returns the exit codes of the interrupted runs."""
    src, model, _ = setup
    rng = random.Random(seed)
    codes = []
    for _ in range(kills):
        before = committed_parts(out)
        proc = subprocess.Popen(
            command(src, out, model), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        deadline = time.monotonic() + 180
        while proc.poll() is None and committed_parts(out) <= before and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.2))
        if proc.poll() is None:
            proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=180)
        codes.append(proc.returncode)
        if proc.returncode == 0:  # finished before the signal landed
            break
        if sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a clean stop: 130 / 143 / 129
            assert proc.returncode == 128 + sig, stderr
            # the command as typed: this interpreter's path and -m batchgen, quoted
            assert f"Resume with:\n  {shlex.join(command(src, out, model))}\n" in stderr, stderr
    proc = subprocess.run(command(src, out, model), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return codes


@pytest.mark.slow
def test_sigkill_at_random_moments(setup, tmp_path):
    out = tmp_path / "killed.parquet"
    codes = interrupt_and_resume(setup, out, signal.SIGKILL, kills=3, seed=7)
    assert codes and codes[0] == -signal.SIGKILL
    assert not Path(str(out) + ".parts").exists()
    assert rows_of(out) == setup[2]


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["SIGINT", "SIGTERM", "SIGHUP"]
)
def test_sigint_sigterm_and_sighup_commit_and_resume(setup, tmp_path, sig):
    """SIGTERM (timeout, docker stop, Slurm) and SIGHUP (a closed terminal) stop a run as Ctrl-C
    does: finished rows are committed."""
    out = tmp_path / "interrupted.parquet"
    codes = interrupt_and_resume(setup, out, sig, kills=2, seed=11)
    assert codes and codes[0] == 128 + sig
    assert rows_of(out) == setup[2]


def _ignore_sighup_and_sigint() -> None:  # in the child, before exec: what `nohup cmd &` in a script does
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.slow
def test_a_run_started_under_nohup_in_the_background_ignores_sighup_and_sigint(setup, tmp_path):
    """`nohup batchgen run ... &` from a script: closing the terminal (SIGHUP) and the script's
    Ctrl-C (SIGINT, ignored for background jobs) must not stop the job."""
    src, model, expected = setup
    out = tmp_path / "nohup.parquet"
    proc = subprocess.Popen(
        command(src, out, model), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_ignore_sighup_and_sigint,
    )  # fmt: skip
    deadline = time.monotonic() + 180
    while proc.poll() is None and committed_parts(out) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before its first commit was seen"
    proc.send_signal(signal.SIGHUP)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr
    assert rows_of(out) == expected
