"""Bounded memory: a 200,000-row JSONL job (tiny model, max_tokens 1) grows peak RSS by < 500 MB.

The growth is measured against the same command on a 200-row job, so interpreter, torch and model
memory cancel out; peak RSS is sampled with psutil every 20 ms. The 200k-row run takes about
2-3 minutes on an idle 2-core CPU (engine-bound: ~800 steps of 256 one-token requests); it is cut
off after 600 s.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIG_ROWS = 200_000
LIMIT_BYTES = 500 * 2**20


def write_job(path: Path, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            f.write(f'{{"id": "r{i}", "prompt": "Item {i}: reply ok."}}\n')


def peak_rss(cmd: list[str], timeout: float) -> tuple[int, subprocess.CompletedProcess]:
    """Run `cmd`, sampling its RSS; returns (peak bytes, finished process)."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ps = psutil.Process(proc.pid)
    peak = 0
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        try:
            peak = max(peak, ps.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        if time.monotonic() > deadline:
            proc.kill()
            break
        time.sleep(0.02)
    stdout, stderr = proc.communicate()
    return peak, subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.mark.slow
def test_200k_rows_bounded_rss(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama")

    def command(src: Path) -> list[str]:
        options = (
            "--max-tokens 1 --no-chat-template --no-dashboard --progress-interval 10 --max-num-seqs 256 "
            "--max-num-batched-tokens 4096 --commit-every 20000 --kv-cache-memory 256MiB --num-threads 1"
        )
        return [sys.executable, "-m", "batchgen", "run", str(src), "--model", str(model), *options.split()]

    small, big = tmp_path / "small.jsonl", tmp_path / "big.jsonl"
    write_job(small, 200)
    write_job(big, BIG_ROWS)
    base, proc = peak_rss(command(small), timeout=120)
    assert proc.returncode == 0, proc.stderr
    start = time.monotonic()
    peak, proc = peak_rss(command(big), timeout=600)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, f"rc {proc.returncode} after {elapsed:.0f}s: {proc.stderr[-2000:]}"
    assert pq.read_metadata(tmp_path / "big.out.parquet").num_rows == BIG_ROWS
    growth = peak - base
    print(
        f"peak RSS {peak / 2**20:.0f} MiB, 200-row baseline {base / 2**20:.0f} MiB, growth {growth / 2**20:.0f} MiB, {elapsed:.0f}s"
    )
    assert growth < LIMIT_BYTES
