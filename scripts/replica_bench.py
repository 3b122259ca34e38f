#!/usr/bin/env python
"""The Ray path against the local path (`batchgen run --replicas`): its overhead and its driver's memory.

Two measurements, each a `batchgen run` subprocess timed from the outside (model load included, as
a user sees it), the driver's peak RSS read from its own /proc/PID/status (VmHWM) while it runs:

overhead (the default): one job of --rows chat rows (XSum articles cut to --prompt-words words, from
    ../shared/data, --max-tokens each, greedy) run three ways on the same cores: the local path with
    one engine of --cores threads, Ray with one replica of --cores CPUs, and Ray with --cores
    replicas of one CPU each. Prints rows/s of each and their ratios to the local path.

big: a synthetic job of --rows short prompts (`max_tokens` 1) on --model (a tiny model: the driver
    is what is measured) through 2 replicas; the driver is killed (SIGKILL) once --kill-at of the
    rows are committed, then the same command is run again. Prints the driver's peak RSS of both
    runs and checks the output holds every row exactly once, in order.

Usage::

    python scripts/replica_bench.py overhead --rows 1000
    python scripts/replica_bench.py big --rows 200000 --model /path/to/tiny-model
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
XSUM = REPO.parent / "shared" / "data" / "xsum" / "test.jsonl"


def write_overhead_job(path: Path, rows: int, prompt_words: int, max_tokens: int) -> None:
    if not XSUM.is_file():
        sys.exit(f"{XSUM} is missing: the overhead job's prompts come from the shared XSum file")
    with open(XSUM) as src, open(path, "w") as out:
        for i, line in zip(range(rows), src, strict=False):
            words = json.loads(line)["document"].split()[:prompt_words]
            prompt = "Summarize in one sentence: " + " ".join(words)
            out.write(json.dumps({"id": i, "prompt": prompt, "max_tokens": max_tokens}) + "\n")


def write_big_job(path: Path, rows: int) -> None:
    with open(path, "w") as out:
        for i in range(rows):
            out.write(
                json.dumps({"prompt": f"Row {i}: the number {i * 7919} in words.", "max_tokens": 1}) + "\n"
            )


def peak_rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        return 0


def run(args: list[str], kill_when=None) -> tuple[float, int, int]:
    """(seconds, driver peak RSS in KiB, exit code) of `batchgen run ARGS`; `kill_when()` true: SIGKILL."""
    cmd = [sys.executable, "-m", "batchgen", "run", *args, "--no-dashboard"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, peak_rss_kib(proc.pid))
        if kill_when is not None and kill_when():
            proc.send_signal(signal.SIGKILL)
        time.sleep(0.2)
    seconds = time.perf_counter() - start
    if proc.returncode not in (0, -signal.SIGKILL):
        sys.stderr.write(proc.stderr.read()[-3000:])
    return seconds, peak, proc.returncode


def committed_rows(output: Path) -> int:
    manifest = Path(str(output) + ".parts") / "manifest.jsonl"
    if not manifest.is_file():
        return 0
    rows = 0
    for line in manifest.read_text().splitlines():
        try:
            part = json.loads(line)
        except json.JSONDecodeError:
            continue
        rows += int(part.get("rows", 0))
    return rows


def overhead(a: argparse.Namespace) -> None:
    job = a.workdir / "overhead.jsonl"
    write_overhead_job(job, a.rows, a.prompt_words, a.max_tokens)
    common = [str(job), "--overwrite", "--temperature", "0", "--no-enable-prefix-caching"]
    ways = {
        f"local, 1 engine x {a.cores} threads": ["--num-threads", str(a.cores)],
        f"ray, 1 replica x {a.cores} CPUs": [
            "--replicas",
            "1",
            "--ray-address",
            "local",
            "--cpus-per-replica",
            str(a.cores),
        ],
        f"ray, {a.cores} replicas x 1 CPU": ["--replicas", str(a.cores), "--cpus-per-replica", "1"],
    }
    results = {}
    for name, extra in ways.items():
        output = a.workdir / f"out-{len(results)}.parquet"
        seconds, peak, code = run([*common, *extra, "--output", str(output)])
        if code != 0:
            sys.exit(f"{name}: batchgen run exited {code}")
        results[name] = seconds
        print(
            f"{name:32s} {seconds:7.1f} s  {a.rows / seconds:7.2f} rows/s  driver peak {peak / 1024:.0f} MiB",
            flush=True,
        )
    local = a.rows / next(iter(results.values()))
    for name, seconds in list(results.items())[1:]:
        print(f"{name:32s} rows/s vs local: {a.rows / seconds / local:.3f}")


def big(a: argparse.Namespace) -> None:
    if a.model is None:
        sys.exit("big: give --model (a tiny model directory)")
    job, output = a.workdir / "big.jsonl", a.workdir / "big.parquet"
    write_big_job(job, a.rows)
    args = [str(job), "--model", str(a.model), "--replicas", "2", "--output", str(output), "--overwrite"]
    target = int(a.rows * a.kill_at)
    seconds, peak, code = run(args, kill_when=lambda: committed_rows(output) >= target)
    print(
        f"first run: killed={code == -signal.SIGKILL} after {seconds:.1f} s with {committed_rows(output)} rows committed; driver peak {peak / 1024:.0f} MiB"
    )
    seconds, peak2, code = run([arg for arg in args if arg != "--overwrite"])
    print(f"resumed run: exit {code} after {seconds:.1f} s; driver peak {peak2 / 1024:.0f} MiB")
    import pyarrow.parquet as pq

    index = pq.read_table(output, columns=["row_index"]).column("row_index").to_pylist()
    once = index == list(range(a.rows))
    print(f"output rows {len(index)}, every row once in order: {once}")
    if code != 0 or not once or max(peak, peak2) >= 1024**2:
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=["overhead", "big"])
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--prompt-words", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument(
        "--kill-at", type=float, default=0.4, help="fraction of rows committed when the driver is killed"
    )
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/replica_bench"))
    a = parser.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("RAY_ADDRESS", "")
    overhead(a) if a.what == "overhead" else big(a)


if __name__ == "__main__":
    main()
