"""`batchgen run --replicas 2` on a real Ray cluster on 127.0.0.1: the same output as the local path,
every row exactly once through a replica killed mid-job and a driver killed mid-job, and a replica
that cannot start failing the job at once, its committed rows kept.

One Ray head (`ray start --head --block`, 127.0.0.1 only, stopped at the end) serves the runs that
pass --ray-address; one run starts its own local instance, as `--replicas 2` alone does.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray", reason='the Ray tests need the ray extra: pip install -e ".[ray]"')

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
COMPARED = ["row_index", "id", "output", "finish_reason", "prompt_tokens", "completion_tokens", "error"]
NUM_ROWS = 64
BAD_ROWS = {3: "unterminated", 10: "null prompt", 20: "negative temperature"}
READY = re.compile(r"replica (\d+) ready: pid (\d+)")
ENGINE = (
    "--max-num-seqs 4 --kv-cache-memory 32MiB --num-threads 1 --no-dashboard --progress-interval 1000 "
    "--commit-interval 1000"
)


def job_lines() -> list[str]:
    subjects = ["rivers", "volcanoes", "bees", "libraries", "trains", "clouds", "chess", "bread"]
    lines = []
    for i in range(NUM_ROWS):
        row = {
            "id": f"job-{i}",
            "prompt": f"Write about {subjects[i % 8]} ({i}).",
            "max_tokens": 4 + (i * 7) % 29,
        }
        if i == 3:
            lines.append('{"id": "job-3", "prompt": "unterminated')
            continue
        if i == 10:
            row["prompt"] = None
        if i == 20:
            row["temperature"] = -1
        if i == 33:
            row.update(temperature=0.9, seed=33)  # seeded sampling: the same text on any replica
        lines.append(json.dumps(row))
    return lines


# Every Ray process of these tests on 127.0.0.1 only (Ray's one-node mode, as
# `batchgen.distributed.pool` starts a local instance), and the head's token for its drivers.
RAY_ENV = {
    **os.environ,
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": secrets.token_hex(32),
}


def command(src: Path, out: Path, model: Path, *extra: str) -> list[str]:
    run = [sys.executable, "-m", "batchgen", "run", str(src), "--output", str(out), "--model", str(model)]
    return run + ENGINE.split() + list(extra)


def rows_of(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        return [{k: r.get(k) for k in COMPARED} for r in map(json.loads, path.read_text().splitlines())]
    return pq.read_table(path, columns=COMPARED).to_pylist()


def committed_parts(out: Path) -> list[str]:
    manifest = Path(str(out) + ".parts") / "manifest.jsonl"
    try:
        return [json.loads(line)["part"] for line in manifest.read_text().splitlines()[1:] if line.strip()]
    except FileNotFoundError:
        return []


def committed_rows(out: Path) -> int:
    parts = Path(str(out) + ".parts")
    return sum(pq.ParquetFile(parts / part).metadata.num_rows for part in committed_parts(out))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    """A Ray head on 127.0.0.1 (2 CPUs, no dashboard), for the runs that join one; stopped after."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    head = subprocess.Popen(
        [
            sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
            "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "2", "--num-gpus", "0",
            "--include-dashboard", "false", "--object-store-memory", str(256 * 1024**2),
            "--disable-usage-stats",
        ],
        env=RAY_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        probe = f"import ray; ray.init(address={address!r}, log_to_driver=False); ray.shutdown()"
        deadline = time.monotonic() + 120
        while True:
            check = subprocess.run(
                [sys.executable, "-c", probe], env=RAY_ENV, capture_output=True, timeout=120
            )
            if check.returncode == 0:
                break
            assert head.poll() is None, "ray start --head exited"
            assert time.monotonic() < deadline, (
                f"the Ray head on {address} did not come up: {check.stderr[-2000:]}"
            )
            time.sleep(1)
        yield address
    finally:
        stop_group(head)


def stop_group(head: subprocess.Popen) -> None:
    """SIGTERM to the head's process group (`ray start --block` stops what it started), then SIGKILL
    to whatever of it is left after 5 s (a GCS server takes about 30 s to stop on SIGTERM)."""
    os.killpg(head.pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and head.poll() is None:
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(head.pid, signal.SIGKILL)
    head.wait()


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_model_dir):
    """The job as JSONL and as Parquet (the bad JSON line dropped), and the local path's outputs."""
    tmp = tmp_path_factory.mktemp("replicas")
    model = tiny_model_dir("llama")
    src = tmp / "job.jsonl"
    src.write_text("\n".join(job_lines()) + "\n")
    records = [json.loads(line) for line in job_lines() if "unterminated" not in line]
    parquet = tmp / "job.parquet"
    pq.write_table(pa.Table.from_pylist(records), parquet)
    expected = {}
    for name, path, out in (("jsonl", src, tmp / "local.parquet"), ("parquet", parquet, tmp / "local.jsonl")):
        proc = subprocess.run(
            command(path, out, model), cwd=REPO, env=RAY_ENV, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr
        expected[name] = rows_of(out)
    assert [r["finish_reason"] for r in expected["jsonl"] if r["row_index"] in BAD_ROWS] == ["error"] * 3
    return {"model": model, "jsonl": src, "parquet": parquet, "expected": expected, "tmp": tmp}


class Run:
    """A `batchgen run` in the background whose stderr is read as it comes (for replica pids)."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=RAY_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    def pids(self) -> dict[int, int]:
        return {int(m[1]): int(m[2]) for line in list(self.lines) if (m := READY.search(line))}

    def wait(self, timeout: float = 300) -> tuple[int, str]:
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        self.proc.stdout.close()
        return self.proc.returncode, "".join(self.lines)


def wait_for(condition, run: Run, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert run.proc.poll() is None, "".join(run.lines)
        assert time.monotonic() < deadline, "timed out; stderr:\n" + "".join(run.lines)
        time.sleep(0.02)


def test_two_replicas_match_the_local_path(job, cluster, tmp_path):
    """JSONL in (bad rows included) to Parquet, and Parquet in to JSONL: row for row, token for token."""
    for name, out in (("jsonl", tmp_path / "ray.parquet"), ("parquet", tmp_path / "ray.jsonl")):
        cmd = command(
            job[name], out, job["model"], "--replicas", "2", "--ray-address", cluster, "--commit-every", "8"
        )
        proc = subprocess.run(cmd, cwd=REPO, env=RAY_ENV, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert rows_of(out) == job["expected"][name]
        assert not Path(str(out) + ".parts").exists()
        assert len(READY.findall(proc.stderr)) == 2, proc.stderr


def test_sigkill_of_a_replica_the_job_completes_every_row_once(job, cluster, tmp_path):
    out = tmp_path / "killed-replica.parquet"
    cmd = command(
        job["jsonl"], out, job["model"], "--replicas", "2", "--ray-address", cluster, "--commit-every", "4"
    )
    run = Run(cmd)
    wait_for(lambda: len(run.pids()) == 2 and committed_parts(out), run)
    time.sleep(random.Random(3).uniform(0.0, 0.3))
    victim = run.pids()[1]
    os.kill(victim, signal.SIGKILL)
    code, stderr = run.wait()
    assert code == 0, stderr
    assert rows_of(out) == job["expected"]["jsonl"]


def test_sigkill_of_the_driver_a_replica_that_cannot_start_then_resume(job, cluster, tmp_path):
    """The driver killed mid-job keeps its committed parts; a rerun whose replicas cannot start (a
    KV cache of one byte) fails at once naming the replica, and keeps them too; the next resumes."""
    base = ["--replicas", "2", "--ray-address", cluster, "--commit-every", "4"]
    delays = random.Random(5)
    for attempt in range(3):
        out = tmp_path / f"killed-driver-{attempt}.parquet"
        run = Run(command(job["jsonl"], out, job["model"], *base))
        wait_for(lambda out=out: len(committed_parts(out)) >= 2, run)
        time.sleep(delays.uniform(0.0, 0.3) if attempt == 0 else 0.0)
        run.proc.send_signal(signal.SIGKILL)
        code, _ = run.wait()
        assert code == -signal.SIGKILL
        # On a fast machine every row can be committed before the kill lands: then nothing is left
        # to resume (a rerun loads no replica), so kill a fresh job sooner.
        if committed_rows(out) < NUM_ROWS:
            break
    else:
        pytest.fail("three jobs committed every row before their driver was killed")
    kept = committed_parts(out)
    assert kept and all(re.fullmatch(r"part-r\d{12}-\d{12}\.parquet", p) for p in kept)

    cmd = command(job["jsonl"], out, job["model"], *base, "--kv-cache-memory", "1")
    proc = subprocess.run(cmd, cwd=REPO, env=RAY_ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert re.search(r"error: replica \d of 2 \(pid \d+ on .*\) cannot start: .*kv", proc.stderr, re.I), (
        proc.stderr
    )
    assert committed_parts(out) == kept

    proc = subprocess.run(
        command(job["jsonl"], out, job["model"], *base),
        cwd=REPO,
        env=RAY_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "resuming:" in proc.stderr
    assert rows_of(out) == job["expected"]["jsonl"]


def test_a_local_ray_instance_and_a_model_that_cannot_load(job, tmp_path):
    """No --ray-address: the run starts Ray on 127.0.0.1 itself and stops it; a model directory
    without a model fails the job before any row, with the replica and the cause."""
    empty = tmp_path / "no-model"
    empty.mkdir()
    out = tmp_path / "none.parquet"
    proc = subprocess.run(
        command(job["jsonl"], out, empty, "--replicas", "2"),
        cwd=REPO,
        env=RAY_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert re.search(
        r"error: replica \d of 2 .*cannot start: cannot start the engine for model .*no-model", proc.stderr
    ), proc.stderr
    assert not out.exists() and not Path(str(out) + ".parts").exists()


SPEC_FLAGS = (
    "--speculative-method ngram --speculative-max-batch 8 --no-chat-template --ignore-eos --max-tokens 32"
)
SPEC = re.compile(r"\| spec (\d+)/(\d+) drafts accepted")


def test_two_replicas_show_the_speculative_decoding_counters(cluster, tiny_model_dir, tmp_path):
    """--speculative-method ngram over two replicas: the last progress line carries the draft
    counters summed over both replicas, as the local path's does (the driver used to drop them)."""
    src = tmp_path / "spec.jsonl"
    prompts = [  # repetitive: the tiny random model's loops meet the prompt's n-grams
        "one two three four one two three four one two three four one two three",
        "a b c d e f g a b c d e f g a b c d e f g a b c",
    ]
    src.write_text("".join(json.dumps({"id": f"s{i}", "prompt": prompts[i % 2]}) + "\n" for i in range(12)))
    model = tiny_model_dir("llama")
    lines = {}
    for name, extra in (("local", []), ("ray", ["--replicas", "2", "--ray-address", cluster])):
        cmd = command(src, tmp_path / f"{name}.parquet", model, *SPEC_FLAGS.split(), *extra)
        proc = subprocess.run(cmd, cwd=REPO, env=RAY_ENV, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        lines[name] = SPEC.findall(proc.stderr)
    assert lines["local"] and int(lines["local"][-1][1]) > 0, "the tiny model drafts nothing locally"
    accepted, drafted = map(int, lines["ray"][-1]) if lines["ray"] else (0, 0)
    assert drafted > 0 and 0 <= accepted <= drafted, lines
