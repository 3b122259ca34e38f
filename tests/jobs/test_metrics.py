"""Prometheus metrics of a job: a real HTTP scrape during a tiny-model run, the textfile's final
counts against the job's output, a port in use, a missing prometheus_client."""

from __future__ import annotations

import json
import socket
import sys
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchgen.jobs.errors import JobInputError
from batchgen.jobs.runner import JobOptions, run_job
from batchgen.metrics import MetricsOptions
from tests.jobs.fake_engine import fake_factory
from tests.jobs.real_engine import quiet

parser = pytest.importorskip("prometheus_client.parser")

P = "batchgen:"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def samples(text: str) -> dict[str, float]:
    """{sample name with its labels but model_name: value} of a scrape or a textfile."""
    out: dict[str, float] = {}
    for family in parser.text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return samples(r.read().decode())


def write_job(path: Path, n: int, bad_line: bool = True) -> None:
    lines = [json.dumps({"prompt": f"Tell me about number {i}."}) for i in range(n)]
    if bad_line:
        lines.insert(3, '{"prompt": "unterminated')  # one error row
    path.write_text("\n".join(lines) + "\n")


def test_scrape_during_a_tiny_model_run_and_final_counts(tmp_path, tiny_model_dir):
    from batchgen.engine.llm_engine import LLMEngine

    src, out, prom = tmp_path / "job.jsonl", tmp_path / "job.out.parquet", tmp_path / "job.prom"
    write_job(src, 12)
    port = free_port()
    scrapes: list[tuple[dict[str, float], dict[str, float]]] = []  # (scrape, engine state then)

    engines = []

    def factory(config):
        engine = LLMEngine(config)
        engines.append(engine)
        step = engine.step

        def scraping_step():
            # Between steps: the scrape must show the state the last step left.
            if engine.totals.steps in (2, 5) and engine.last_step is not None:
                s, t = engine.last_step, engine.totals
                state = {
                    "running": s.num_running,
                    "waiting": s.num_waiting,
                    "kv": s.kv_cache_usage,
                    "generation": t.generation_tokens,
                    "prompt": t.prompt_tokens,
                    "steps": t.steps,
                }
                scrapes.append((scrape(port), state))
            return step()

        engine.step = scraping_step
        return engine

    summary = run_job(
        JobOptions(
            str(src),
            output=str(out),
            max_tokens=8,
            commit_rows=1,
            engine={"model": str(tiny_model_dir("llama")), "max_num_seqs": 2, "kv_cache_memory": "64MiB"},
            metrics=MetricsOptions(port=port, file=str(prom), interval_s=0.05),
        ),
        factory,
        dashboard=quiet(),
    )
    assert summary.complete and summary.rows_ok == 12 and summary.rows_error == 1

    assert len(scrapes) == 2
    for got, state in scrapes:
        assert got[P + "num_requests_running"] == state["running"]
        assert got[P + "num_requests_waiting"] == state["waiting"]
        assert got[P + "kv_cache_usage_perc"] == pytest.approx(state["kv"])
        assert got[P + "generation_tokens_total"] == state["generation"]
        assert got[P + "prompt_tokens_total"] == state["prompt"]
        assert got[P + "engine_step_duration_seconds_count"] == state["steps"]
        assert got[P + "iteration_tokens_count"] == state["steps"]
        assert got[P + "job_rows"] == 13
    (first, _), (second, _) = scrapes
    for name in ("generation_tokens_total", "engine_step_duration_seconds_count"):
        assert second[P + name] > first[P + name] > 0, name
    assert (
        second[P + "prompt_tokens_total"] >= first[P + "prompt_tokens_total"] > 0
    )  # decode-only steps add none
    assert second[P + "rows_committed_total"] >= first[P + "rows_committed_total"]

    # The textfile's last write holds the final values: exactly the job's output.
    final = samples(prom.read_text())
    rows = pq.read_table(out).to_pylist()
    ok = [r for r in rows if r["finish_reason"] != "error"]
    assert final[P + "rows_committed_total"] == len(rows) == 13
    assert final[P + "rows_errored_total"] == 1
    assert final[P + "generation_tokens_total"] == summary.completion_tokens
    assert final[P + "generation_tokens_total"] == sum(r["completion_tokens"] for r in ok)
    finished = {k: v for k, v in final.items() if k.startswith(P + "request_success_total")}
    assert sum(finished.values()) == 12
    assert all(r["finish_reason"] in ("stop", "length") for r in ok)
    for reason in {r["finish_reason"] for r in ok}:
        want = sum(r["finish_reason"] == reason for r in ok)
        assert final[P + f"request_success_total{{finished_reason={reason}}}"] == want
    assert final[P + "time_to_first_token_seconds_count"] == 12
    assert final[P + "e2e_request_latency_seconds_count"] == 12
    assert final[P + "num_requests_running"] == 0 and final[P + "kv_cache_usage_perc"] == 0
    assert final[P + "rows_resumed"] == 0
    # What runs: the tiny model in the engine's dtype, not quantized.
    dtype = str(engines[0].dtype).removeprefix("torch.")
    assert {k: v for k, v in final.items() if k.startswith(P + "model_info")} == {
        P + f"model_info{{dtype={dtype},quantization=none}}": 1.0
    }
    # The server is gone once the job has ended.
    with pytest.raises(OSError):
        scrape(port)


def test_textfile_final_counts_with_a_resumed_job(tmp_path):
    src, out, prom = tmp_path / "job.jsonl", tmp_path / "job.out.parquet", tmp_path / "m.prom"
    write_job(src, 20)
    opts = {"output": str(out), "max_tokens": 5, "commit_rows": 4, "engine": {"max_num_seqs": 3}}

    def crash(step: int) -> None:
        if step == 8:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        run_job(JobOptions(str(src), **opts), fake_factory(on_step=crash), dashboard=quiet())
    summary = run_job(
        JobOptions(str(src), **opts, metrics=MetricsOptions(file=str(prom))),
        fake_factory(),
        dashboard=quiet(),
    )
    final = samples(prom.read_text())
    assert summary.rows_resumed > 0
    assert final[P + "rows_resumed"] == summary.rows_resumed
    assert final[P + "rows_committed_total"] == 21 - summary.rows_resumed
    assert final[P + "rows_committed_total"] == summary.rows_ok + summary.rows_error
    assert final[P + "generation_tokens_total"] == summary.completion_tokens
    assert final[P + "job_rows"] == 21
    types = {f.name: f.type for f in parser.text_string_to_metric_families(prom.read_text())}
    assert types[P + "generation_tokens"] == "counter"
    assert types[P + "num_requests_running"] == "gauge"
    assert types[P + "time_to_first_token_seconds"] == "histogram"


def _no_model(config):
    raise AssertionError("the model must not load")


def test_port_in_use_fails_before_the_model_loads(tmp_path):
    src, out = tmp_path / "job.jsonl", tmp_path / "job.out.parquet"
    write_job(src, 3, bad_line=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(
            JobInputError, match=rf"--metrics-port {port}: 127.0.0.1:{port} is already in use"
        ):
            run_job(
                JobOptions(str(src), output=str(out), metrics=MetricsOptions(port=port)),
                _no_model,
                dashboard=quiet(),
            )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.jsonl"]  # no output, no parts folder


def test_port_in_use_on_the_command_line_exits_2(tmp_path):
    from typer.testing import CliRunner

    from batchgen.cli import app

    src = tmp_path / "job.jsonl"
    write_job(src, 2, bad_line=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(
            app, ["run", str(src), "--no-dashboard", "--metrics-port", str(port), "--model", str(tmp_path)]
        )
    assert result.exit_code == 2, result.output
    assert "already in use" in result.output and "--metrics-port" in result.output


def test_metrics_file_in_a_missing_folder(tmp_path):
    src = tmp_path / "job.jsonl"
    write_job(src, 2, bad_line=False)
    missing = tmp_path / "nowhere" / "m.prom"
    with pytest.raises(JobInputError, match="--metrics-file .*does not exist"):
        run_job(JobOptions(str(src), metrics=MetricsOptions(file=str(missing))), _no_model, dashboard=quiet())


def test_missing_prometheus_client_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import raises ImportError
    src = tmp_path / "job.jsonl"
    write_job(src, 2, bad_line=False)
    with pytest.raises(JobInputError, match=r"pip install 'batchgen\[metrics\]'"):
        run_job(JobOptions(str(src), metrics=MetricsOptions(port=free_port())), _no_model, dashboard=quiet())
    # Without a metrics option the job does not need it.
    summary = run_job(JobOptions(str(src), max_tokens=3), fake_factory(), dashboard=quiet())
    assert summary.complete and summary.rows_ok == 2


def test_replicas_metrics_carry_a_replica_label(tmp_path, monkeypatch):
    from batchgen.distributed import driver
    from batchgen.distributed.pool import ReplicaOptions
    from tests.distributed.test_driver import NUM_ROWS, InlinePool
    from tests.distributed.test_driver import write_job as write_driver_job

    class Pool(InlinePool):
        """Replicas in this process; remembers which replica ran each shard's rows."""

        def __init__(self, options, config):
            super().__init__(options, replicas=2, shard_rows=6)
            self.rows_by_replica = [0, 0]
            self.requests_by_replica = [0, 0]  # rows that reach the engine

        def submit(self, replica, shard):
            self.rows_by_replica[replica] += len(shard.rows)
            self.requests_by_replica[replica] += sum(row.error is None for row in shard.rows)
            return super().submit(replica, shard)

        def shutdown(self):
            pass

    pools = []
    monkeypatch.setattr(
        driver,
        "ReplicaPool",
        lambda replicas, options, config: pools.append(Pool(options, config)) or pools[-1],
    )
    src, out, prom = tmp_path / "job.jsonl", tmp_path / "out.parquet", tmp_path / "m.prom"
    write_driver_job(src)  # 50 rows, row 7 a line that is not JSON (an error row with no request)
    options = JobOptions(str(src), output=str(out), metrics=MetricsOptions(file=str(prom)), dashboard=False)
    summary = driver.run_distributed(options, ReplicaOptions(replicas=2), dashboard=quiet())
    assert summary.complete and summary.rows_ok == NUM_ROWS - 1

    final = samples(prom.read_text())
    ran = pools[0].rows_by_replica
    assert all(ran) and sum(ran) == NUM_ROWS
    per_replica = {}
    for r in ("0", "1"):
        per_replica[r] = {k.split("{")[0]: v for k, v in final.items() if k.endswith(f"replica={r}}}")}
    assert [per_replica[r][P + "rows_committed_total"] for r in ("0", "1")] == ran
    gen = [per_replica[r][P + "generation_tokens_total"] for r in ("0", "1")]
    assert all(gen) and sum(gen) == summary.completion_tokens
    prompt = sum(per_replica[r][P + "prompt_tokens_total"] for r in ("0", "1"))
    assert prompt == summary.prompt_tokens
    ttft = [per_replica[r][P + "time_to_first_token_seconds_count"] for r in ("0", "1")]
    assert ttft == pools[0].requests_by_replica and sum(ttft) == NUM_ROWS - 1
    steps = [per_replica[r][P + "engine_step_duration_seconds_count"] for r in ("0", "1")]
    assert all(steps)
    success = sum(v for k, v in final.items() if k.startswith(P + "request_success_total"))
    assert success == NUM_ROWS - 1
    assert all(
        k.startswith(P + "request_success_total{finished_reason=") and ",replica=" in k
        for k in final
        if k.startswith(P + "request_success_total")
    )
    # The job's own totals have no replica; nothing else lacks one.
    assert final[P + "job_rows"] == NUM_ROWS and final[P + "rows_resumed"] == 0
    unlabelled = {k for k in final if "replica=" not in k}
    assert unlabelled == {P + "job_rows", P + "rows_resumed"}
    assert final[P + "num_requests_running{replica=0}"] == 0  # the job ended: queues empty
