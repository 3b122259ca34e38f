"""A tiny `batchgen bench` end to end: every configuration runs and the JSON report is consistent.

No timing assertions: only structure, token accounting and orderings that hold on any machine.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from batchgen.bench.cli import bench_command
from batchgen.cli_types import memory_size as parse_size

REPO = Path(__file__).parents[2]


def invoke_bench(args: list[str]):
    """`batchgen bench ARGS` through Typer's test runner."""
    app = typer.Typer()
    app.command()(bench_command)
    return CliRunner().invoke(app, args, env={"COLUMNS": "1000"})  # wide: no message wraps


def tiny_run_args(model: Path, tmp_path: Path, *workload: str) -> list[str]:
    """A continuous-only bench of the tiny model on one thread, its JSON report in tmp_path."""
    return [
        "--model", str(model), *workload, "--mode", "continuous", "--no-ceiling",
        "--num-threads", "1", "--kv-cache-memory", "16MiB", "--output", str(tmp_path / "r.json"),
    ]  # fmt: skip


EXPECTED = ["continuous/fcfs", "continuous/max-throughput", "static/b4", "hf-static/b4", "hf-cb"]


@pytest.fixture(scope="module")
def bench_report(tiny_model_dir, tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("bench")
    args = [
        "--model", str(tiny_model_dir("llama")),
        "--dist", "longtail", "--num-prompts", "10", "--scale", "0.05", "--seed", "1",
        "--mode", "continuous,static", "--policy", "fcfs,max-throughput", "--baselines", "hf-static,hf-cb",
        "--static-batch-size", "4", "--num-threads", "1", "--kv-cache-memory", "64MiB",
        "--output", str(out / "bench.json"), "--plot", str(out / "bench.png"),
    ]  # fmt: skip
    result = invoke_bench(args)
    assert result.exit_code == 0, result.output
    assert "output tokens/s" in result.output and "compute ceiling" in result.output
    assert "steps (forward passes)" in result.output
    # The first batchgen configuration ran once untimed, before every timed run.
    lines = result.output.splitlines()
    warmup = lines.index("running continuous/fcfs (warm-up, untimed) ...")
    assert warmup < lines.index("running continuous/fcfs ...")
    return json.loads((out / "bench.json").read_text()), out


def test_every_configuration_present(bench_report) -> None:
    report, out = bench_report
    configs = {c["name"]: c for c in report["configurations"]}
    assert list(configs) == EXPECTED
    assert report["warmup_run"] is True and report["repeat"] == 1
    for name, c in configs.items():
        if name == "hf-cb" and c["status"] == "skipped":
            assert c["reason"]  # transformers without continuous batching: skipped with the reason
            continue
        assert c["status"] == "ok", (name, c["reason"])
        assert c["metrics"]["num_errors"] == 0
        assert c["metrics"]["num_requests"] == report["workload"]["num_requests"] == 10
    assert (out / "bench.png").stat().st_size > 0


def test_output_tokens_equal_sampled_lengths(bench_report) -> None:
    report, _ = bench_report
    sampled = report["sampled_output_tokens"]
    assert sampled == report["workload"]["total_output_tokens"] > 0
    for c in report["configurations"]:
        if c["status"] == "ok":
            assert c["metrics"]["output_tokens"] == sampled, c["name"]
            assert c["metrics"]["prompt_tokens"] == report["sampled_prompt_tokens"], c["name"]
            assert sum(c["timeline"]["num_generation_tokens"]) == sampled, c[
                "name"
            ]  # static: spread, exact in total


def test_latencies_ordered(bench_report) -> None:
    report, _ = bench_report
    for c in report["configurations"]:
        if c["status"] != "ok":
            continue
        m = c["metrics"]
        for name in ("ttft", "e2e"):
            assert 0 <= m[f"{name}_p50_s"] <= m[f"{name}_p90_s"] <= m[f"{name}_p99_s"], c["name"]
        assert m["tpot_mean_s"] is None or m["tpot_mean_s"] >= 0
        assert m["ttft_mean_s"] <= m["e2e_mean_s"]
        assert m["e2e_p99_s"] <= m["wall_s"] + 1e-9
        assert 1 <= m["batch_size_mean"] <= m["batch_size_max"]
        assert m["peak_rss_mb"] > 0 and m["cpu_percent"] >= 0


def test_ratios_consistent(bench_report) -> None:
    report, _ = bench_report
    ok = [c for c in report["configurations"] if c["status"] == "ok"]
    base = ok[0]
    assert report["ratio_base"] == base["name"] == "continuous/fcfs"
    for c in ok:
        for key, ratio in c["ratios"].items():
            if c["metrics"][key] is None:  # the baselines have no roofline
                assert ratio is None and c["kind"].startswith("hf-") and key == "roofline_s", (c["name"], key)
                continue
            expected = c["metrics"][key] / base["metrics"][key]
            assert ratio == pytest.approx(expected), (c["name"], key)
        assert c["ratios"]["output_tokens_per_s"] == pytest.approx(1 / c["ratios"]["wall_s"])
    assert all(v == pytest.approx(1.0) for v in base["ratios"].values())


def test_engine_metrics_and_starvation_check(bench_report) -> None:
    report, _ = bench_report
    configs = {c["name"]: c for c in report["configurations"]}
    mt = configs["continuous/max-throughput"]["metrics"]
    assert mt["aging_bound_steps"] == report["engine_options"]["aging_steps"] + 1
    assert mt["aging_bound_held"] is True and mt["max_wait_steps"] <= mt["aging_bound_steps"]
    assert configs["continuous/fcfs"]["metrics"]["aging_bound_held"] is None  # no bound under fcfs
    assert configs["continuous/fcfs"]["metrics"]["max_wait_steps"] >= 0
    assert configs["static/b4"]["metrics"]["max_wait_steps"] is None  # whole batches: not a step count
    for name in ("continuous/fcfs", "static/b4"):
        m = configs[name]["metrics"]
        assert 0 < m["kv_cache_peak"] <= 1 and m["preemptions"] == 0
        assert (
            m["prefix_cache_hit_rate"] == 0.0
        )  # random prompts share no block with each other or the warm-up
    assert configs["static/b4"]["metrics"]["batch_size_max"] <= 4
    for c in report["configurations"]:  # one step record per forward pass, shown as its own row
        assert c["metrics"]["num_steps"] == len(c["timeline"]["t"]) > 0
    assert configs["static/b4"]["extra"]["padded_output_tokens"] >= report["sampled_output_tokens"]
    ceiling = report["ceiling"]
    assert ceiling["flops"]["tokens"] == report["sampled_prompt_tokens"] + report["sampled_output_tokens"]
    assert ceiling["matmul"]["flops_per_s"] > 0 and ceiling["seconds"] > 0
    # The rate is measured first, after the warm-up and after each of the five runs; the headline is
    # their median, and each run's share of the ceiling is against the mean of its two neighbours.
    samples = ceiling["matmul"]["samples_flops_per_s"]
    assert len(samples) == 2 + len(report["configurations"]) and min(samples) > 0
    assert ceiling["matmul"]["flops_per_s"] == sorted(samples)[(len(samples) - 1) // 2]
    for i, c in enumerate(report["configurations"]):
        m = c["metrics"]
        if c["status"] == "ok":
            assert m["matmul_flops_per_s"] == pytest.approx((samples[i + 1] + samples[i + 2]) / 2)
            assert m["ceiling_fraction"] == pytest.approx(
                ceiling["flops"]["total"] / m["matmul_flops_per_s"] / m["wall_s"]
            )


def test_step_counts_and_roofline(bench_report) -> None:
    """The timeline's token counts are exactly the schedule's work (no preemption or prefix hit
    here: a request's last output token is sampled, never fed back), and every batchgen run has a
    roofline; the baselines, whose steps carry no attention counts, have none."""
    report, _ = bench_report
    configs = {c["name"]: c for c in report["configurations"]}
    n = report["workload"]["num_requests"]
    prompt, output = report["sampled_prompt_tokens"], report["sampled_output_tokens"]
    static = configs["static/b4"]
    expected = {
        "continuous/fcfs": (prompt + output - n, output),
        "continuous/max-throughput": (prompt + output - n, output),
        "static/b4": (
            static["extra"]["padded_prompt_tokens"] + static["extra"]["padded_output_tokens"] - n,
            static["extra"]["padded_output_tokens"],
        ),
    }
    memory = report["ceiling"]["memory"]
    assert memory["weight_bytes"] > 0 and memory["kv_bytes_per_token"] > 0
    # measured where the matmul rate is: first, after the warm-up, after each run; the median heads
    samples = memory["samples_bytes_per_s"]
    assert len(samples) == len(report["ceiling"]["matmul"]["samples_flops_per_s"]) and min(samples) > 0
    assert memory["bytes_per_s"] == sorted(samples)[(len(samples) - 1) // 2]
    for i, c in enumerate(report["configurations"]):
        if c["status"] == "ok":
            assert c["extra"]["memory_bytes_per_s"] == pytest.approx((samples[i + 1] + samples[i + 2]) / 2)
    for name, (tokens, sampled) in expected.items():
        tl, m = configs[name]["timeline"], configs[name]["metrics"]
        assert (sum(tl["num_batched_tokens"]), sum(tl["num_sampled"])) == (tokens, sampled), name
        assert len(tl["num_attended_keys"]) == len(tl["num_context_tokens"]) == m["num_steps"]
        extra = configs[name]["extra"]
        assert m["roofline_s"] == extra["roofline_s"] > 0
        assert m["roofline_fraction"] == pytest.approx(extra["roofline_own_rate_s"] / m["wall_s"])
        # prefill steps are those that computed prompt tokens: every prompt token (padding
        # included) is computed in one, and the two phases' step times add up to the steps' time
        prefill_steps = [i for i, p in enumerate(tl["num_prompt_tokens"]) if p]
        assert sum(tl["num_prompt_tokens"]) == tokens - (sampled - n), name
        assert m["prefill_step_s"] == pytest.approx(sum(tl["step_time_s"][i] for i in prefill_steps))
        assert m["prefill_step_s"] + m["decode_step_s"] == pytest.approx(sum(tl["step_time_s"]))
        assert 0 < m["prefill_step_s"] and 0 < m["decode_step_s"] and sum(tl["step_time_s"]) <= m["wall_s"]
        # the prefill rate: the prefill steps' model FLOPs (more than their linears' alone) over
        # their seconds, and that against the kernel table's rate where the table has one
        linear_flops = (
            2
            * report["model"]["non_embedding_params"]
            * sum(tl["num_batched_tokens"][i] for i in prefill_steps)
        )
        assert extra["prefill_flops"] > linear_flops, name
        assert m["prefill_flops_per_s"] == pytest.approx(extra["prefill_flops"] / m["prefill_step_s"])
        table_rate = extra.get("table_flops_per_s")
        assert m["prefill_table_fraction"] == (
            pytest.approx(m["prefill_flops_per_s"] / table_rate) if table_rate else None
        )
    for c in report["configurations"]:
        if c["kind"].startswith("hf-") and c["status"] == "ok":
            assert c["metrics"]["roofline_s"] is None and "num_sampled" not in c["timeline"]
            assert c["metrics"]["prefill_step_s"] is None and "step_time_s" not in c["timeline"]
            assert c["metrics"]["prefill_flops_per_s"] is None


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("2GiB", 2 << 30),
        ("1.5GiB", 3 << 29),
        ("512MiB", 512 << 20),
        ("64M", 64 << 20),
        ("100B", 100),
        ("4096", 4096),
        ("1.5GB", 1_500_000_000),
        ("4g", 4 << 30),
    ],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_bad_options_are_usage_errors() -> None:
    for args, message in (
        (["--mode", "dynamic"], "mode must be a comma list"),
        (["--dist", "zipf"], "dist must be one of"),
        (["--policy", "lifo"], "policy must be a comma list"),
        (["--kv-cache-memory", "lots"], "is not a memory size"),
        (["--repeat", "0"], "repeat must be >= 1"),
        (["--mode", "static", "--policy", "max-throughput"], "applies to --mode continuous only"),
        # a static batch above max_num_seqs ran max_num_seqs requests under the larger batch's label
        (
            ["--mode", "static", "--static-batch-size", "8", "--max-num-seqs", "2"],
            "is more than --max-num-seqs 2",
        ),
    ):
        result = invoke_bench(args)
        # The message, not only the exit code: typer also exits 2 for a flag that does not exist.
        assert result.exit_code == 2 and message in result.output, (args, result.output)


def test_resource_monitor_nesting_times_only_the_inner_window() -> None:
    import mmap
    import time

    from batchgen.bench.report.metrics import ResourceMonitor

    size = 64 << 20
    with ResourceMonitor(interval=0.01) as monitor:
        # 64 MiB of a fresh anonymous mapping, every page touched: resident while the outer window is
        # open whatever the allocator holds already (a tensor could reuse pages freed by earlier tests,
        # and RSS would not move). The inner entry samples RSS, so no sampler timing is relied on.
        block = mmap.mmap(-1, size)
        for offset in range(0, size, mmap.PAGESIZE):
            block[offset] = 1
        with monitor:
            time.sleep(0.02)
        block.close()
    r = monitor.result()
    assert r["peak_rss_mb"] >= r["rss_before_mb"] + 48
    assert r["cpu_core_seconds"] < 0.5 and r["cpu_percent"] is not None


def test_repeat_interleaves_runs_and_reports_the_median(tiny_model_dir, tmp_path: Path) -> None:
    workload = ["--dist", "fixed", "--input-len", "8", "--output-len", "4", "--num-prompts", "3"]
    args = tiny_run_args(tiny_model_dir("llama"), tmp_path, *workload)
    result = invoke_bench([*args, "--policy", "fcfs,max-throughput", "--repeat", "3", "--no-warmup-run"])
    assert result.exit_code == 0, result.output
    assert "warm-up" not in result.output
    runs = [line for line in result.output.splitlines() if line.startswith("running ")]
    # Round-robin, each round starting one configuration later.
    rounds = [("fcfs", "max-throughput"), ("max-throughput", "fcfs"), ("fcfs", "max-throughput")]
    assert runs == [
        f"running continuous/{policy} (run {i}/3) ..."
        for i, order in enumerate(rounds, start=1)
        for policy in order
    ]
    report = json.loads((tmp_path / "r.json").read_text())
    for config in report["configurations"]:
        walls = config["extra"]["runs_wall_s"]
        assert len(walls) == 3
        assert config["metrics"]["wall_s"] == pytest.approx(sorted(walls)[1], abs=1e-3)
        assert config["metrics"]["output_tokens"] == 12


def test_median_run_prefers_failures_and_picks_the_lower_middle() -> None:
    from batchgen.bench.report.metrics import RequestRecord, RunResult
    from batchgen.bench.runner import median_run

    def run(wall: float) -> RunResult:
        record = RequestRecord("r", 1, 1, 0.0, 0.0, wall / 2, wall, None, 0.0)
        return RunResult("c", "continuous", "fcfs", requests=[record])

    runs = [run(3.0), run(1.0), run(4.0), run(2.0)]
    assert median_run(runs) is runs[3]  # 2.0 s: the lower of the middle two
    assert runs[3].extra["runs_wall_s"] == [3.0, 1.0, 4.0, 2.0]
    failed = RunResult("c", "continuous", "fcfs", skipped="failed: boom")
    assert median_run([run(1.0), failed]) is failed


def test_clipped_lengths_are_reported(tiny_model_dir, tmp_path: Path) -> None:
    """Lengths over max_model_len are shortened, and the log says so (not only the JSON)."""
    workload = ["--dist", "fixed", "--input-len", "60", "--output-len", "8", "--num-prompts", "2"]
    args = tiny_run_args(tiny_model_dir("llama"), tmp_path, *workload)
    result = invoke_bench([*args, "--max-model-len", "64"])
    assert result.exit_code == 0, result.output
    assert "warning: 2 requests were shortened to fit max_model_len 64" in result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["workload"]["total_output_tokens"] == 2 * 4  # 60 + 4 = 64


def no_model_args(tmp_path: Path) -> list[str]:
    """A model path that does not exist: any model work would fail, with exit 1 and another message."""
    return ["--model", str(tmp_path / "no-model"), "--mode", "continuous", "--no-ceiling"]


def test_unwritable_output_and_plot_are_usage_errors_before_any_model_work(
    tmp_path: Path, monkeypatch
) -> None:
    import os

    missing = tmp_path / "missing"
    ro = tmp_path / "ro"
    ro.mkdir()
    for args, expected in (
        (["--output", "/proc/nope/b.json"], "--output /proc/nope/b.json cannot be written"),
        (["--plot", "/proc/nope/x.png"], "--plot /proc/nope/x.png cannot be written"),
        (["--output", str(missing / "b.json")], f"the folder {missing} does not exist"),
        (["--output", str(tmp_path / "r.json"), "--plot", str(missing / "x.png")], f"--plot {missing}"),
        (["--output", str(tmp_path)], f"--output {tmp_path} is a folder"),
        # /proc's folder passes the permission checks, but no file can be created in it
        (["--output", "/proc/b.json"], "--output /proc/b.json cannot be written ("),
        (["--plot", "/proc/x.png"], "--plot /proc/x.png cannot be written ("),
    ):
        result = invoke_bench([*no_model_args(tmp_path), *args])
        assert result.exit_code == 2 and expected in result.output, (args, result.output)
    assert list(tmp_path.iterdir()) == [ro]  # the probe of r.json left nothing behind
    # As root permission bits do not stop writes; os.access is what the check asks.
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: str(p) != str(ro) and real_access(p, mode))
    result = invoke_bench([*no_model_args(tmp_path), "--output", str(ro / "b.json")])
    assert result.exit_code == 2 and f"the folder {ro} is not writable" in result.output, result.output


def test_plot_without_matplotlib_is_a_usage_error_before_the_run(tmp_path: Path, monkeypatch) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    result = invoke_bench([*no_model_args(tmp_path), "--plot", str(tmp_path / "x.png")])
    assert result.exit_code == 2, result.output
    assert "--plot needs matplotlib: pip install 'batchgen[plot]'" in result.output


def test_plot_format_matplotlib_cannot_write_is_a_usage_error_before_the_run(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    for name, given in (("x.txt", "'.txt'"), ("noext", "no suffix")):
        result = invoke_bench([*no_model_args(tmp_path), "--plot", str(tmp_path / name)])
        assert result.exit_code == 2, result.output
        assert f"has {given}; name a file ending in .png" in " ".join(result.output.split()), result.output


def test_missing_job_file_and_trace_are_usage_errors(tmp_path: Path) -> None:
    job = tmp_path / "nonexistent.jsonl"
    data = tmp_path / "nonexistent"
    for args, expected in (
        (["--dist", f"file:{job}"], f"the job file {job} does not exist"),
        (["--dist", f"file:{tmp_path}"], f"the job file {tmp_path} is a folder"),
        (
            ["--dist", "azure-conv", "--data-dir", str(data)],
            f"--data-dir {data} has no AzureLLMInferenceTrace_conv.csv",
        ),
    ):
        result = invoke_bench([*no_model_args(tmp_path), *args])
        assert result.exit_code == 2 and expected in result.output, (args, result.output)
        assert result.exception is None or isinstance(result.exception, SystemExit)


def test_device_cuda_without_cuda_is_a_usage_error(tmp_path: Path, monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for extra in ([], ["--baselines", "hf-static", "--mode", "none"]):  # with and without a batchgen engine
        result = invoke_bench([*no_model_args(tmp_path), "--device", "cuda", *extra])
        text = result.output
        assert result.exit_code == 2, (extra, text)
        assert "device is 'cuda' but torch.cuda.is_available() is False" in text and "--device cpu" in text


def test_job_file_bad_rows_are_skipped_with_one_warning(tiny_model_dir, tmp_path: Path) -> None:
    job = tmp_path / "job.jsonl"
    job.write_text('{"prompt": "hello", "max_tokens": 3}\nnot json\n{"prompt": ""}\n{"prompt": "hi"}\n')
    args = tiny_run_args(tiny_model_dir("llama"), tmp_path, "--dist", f"file:{job}", "--output-len", "2")
    result = invoke_bench(args)
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("warning: skipped")]
    assert len(warnings) == 1 and "skipped 2 unusable rows" in warnings[0], result.output
    assert "line 2: not JSON" in warnings[0]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["workload"]["num_requests"] == 2 and report["workload"]["total_output_tokens"] == 5
    # Text prompts are encoded as `batchgen run` encodes them: in the chat template when there is one.
    from transformers import AutoTokenizer

    from batchgen.engine.tokenize import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    assert tokenizer.chat_template
    expected = sum(
        len(encode_prompt(tokenizer, [{"role": "user", "content": t}])[1]) for t in ("hello", "hi")
    )
    assert report["workload"]["total_prompt_tokens"] == expected > 2 * 5

    job.write_text('not json\n{"prompt": ""}\n')
    result = invoke_bench(args)
    text = result.output
    assert result.exit_code == 2, result.output
    assert "no usable row" in text and "all 2 rows are unusable (first: line 1: not JSON" in text

    damaged = tmp_path / "job.parquet"  # a Parquet name and magic, nothing readable behind them
    damaged.write_bytes(b"PAR1garbagegarbage")
    args = tiny_run_args(tiny_model_dir("llama"), tmp_path, "--dist", f"file:{damaged}")
    result = invoke_bench(args)
    assert result.exit_code == 2, result.output
    assert (
        f"cannot read Parquet file {damaged}" in result.output and "not truncated or damaged" in result.output
    )


def test_ctrl_c_during_the_bench_exits_130_without_a_report(tiny_model_dir, tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    cmd = [
        sys.executable, "-m", "batchgen", "bench", "--model", str(tiny_model_dir("llama")),
        "--dist", "fixed", "--input-len", "32", "--output-len", "64", "--num-prompts", "5000",
        "--mode", "continuous", "--no-ceiling", "--num-threads", "1", "--kv-cache-memory", "16MiB",
        "--output", str(report),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("running continuous/fcfs"):  # the (warm-up) run has started
            proc.send_signal(signal.SIGINT)
            break
    output = "".join(lines) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, output
    assert "interrupted: no report written" in output
    assert "Traceback" not in output
    assert not report.exists()


def test_quantizations_run_side_by_side_with_their_own_weight_bytes(tiny_model_dir, tmp_path: Path) -> None:
    """`--quantization none,int8`: each continuous configuration once per method, named by it, its
    kernel line naming the quantization and its roofline priced at the bytes its weights hold."""
    args = tiny_run_args(tiny_model_dir("llama"), tmp_path, "--num-prompts", "4", "--scale", "0.05")
    result = invoke_bench(
        [*args, "--quantization", "none,int8", "--kernels", "native", "--ceiling", "--dtype", "float32"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    configs = {c["name"]: c for c in report["configurations"]}
    assert list(configs) == ["continuous/fcfs+none", "continuous/fcfs+int8"]
    none, int8 = configs["continuous/fcfs+none"]["extra"], configs["continuous/fcfs+int8"]["extra"]
    assert none["kernels"].startswith("quantization none;") and none["kernels"] in result.output
    assert int8["kernels"].startswith("quantization int8 (9 linears, ") and int8["kernels"] in result.output
    # The tiny Llama's 2 layers of linears (73,728 weights) and its untied LM head (49152 x 64) at 4
    # bytes, then 1 byte plus a float32 scale per group of 16 inputs (every input width is a
    # multiple of 16).
    weights = 73728 + 49152 * 64
    assert none["weight_bytes"] == weights * 4
    assert int8["weight_bytes"] == weights + 4 * (weights // 16)
    assert none["roofline_s"] and int8["roofline_s"]
    bad = invoke_bench([*args, "--quantization", "none,fp4"])
    assert (
        bad.exit_code == 2 and "quantization must be a comma list of auto, none, int8; got fp4" in bad.output
    )


def test_a_configuration_named_twice_runs_once() -> None:
    from batchgen.bench.cli import _split

    assert _split("continuous, continuous,static,none,") == ["continuous", "static"]


def test_a_report_that_cannot_be_written_at_the_end_is_an_error_not_a_traceback(
    tiny_model_dir, tmp_path: Path, monkeypatch
) -> None:
    """Writable when checked, not when the bench ends (a full disk, say): exit 1, the reason named."""
    from batchgen.bench.report import json_report as report

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "write_json", fail)
    args = tiny_run_args(tiny_model_dir("llama"), tmp_path, "--num-prompts", "2", "--scale", "0.05")
    result = invoke_bench(args)
    assert result.exit_code == 1, result.output
    assert f"--output {tmp_path / 'r.json'} could not be written" in result.output
    assert "No space left on device" in result.output and "output tokens/s" in result.output
