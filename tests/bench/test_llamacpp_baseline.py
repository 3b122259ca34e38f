"""The llama.cpp baseline: the server's command line and sizes, the request bodies, the count check,
the errors, the report's ratio row and the bench command.

Every test but the last two runs without llama.cpp: a fake `llama-server` (a Python script with
its own shebang, an `http.server` on 127.0.0.1 at the port it is given) answers as the real server
would and writes down what it was sent. The last two run the real binary when BATCHGEN_LLAMA_SERVER
names it (built as docs/llamacpp.md says), and are skipped, saying so, otherwise.
"""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import pytest
from rich.console import Console

from batchgen.bench.baselines.llama_server import HOST, LlamaCppRunError, LlamaCppUnavailable
from batchgen.bench.baselines.llamacpp import (
    answer_error,
    check_server,
    completion_body,
    gguf_problem,
    run_llamacpp,
    server_command,
    server_plan,
)
from batchgen.bench.baselines.processes import executable_problem
from batchgen.bench.report.json_report import build_report
from batchgen.bench.report.metrics import RequestRecord, RunResult, summarize
from batchgen.bench.report.table import render
from batchgen.bench.settings import BenchSettings
from batchgen.bench.workload.distributions import BenchRequest, Workload
from batchgen.config import EngineConfig
from tests.bench.test_bench_smoke import invoke_bench, tiny_run_args

# What the fake does, chosen per test through FAKE_LLAMA_MODE; it appends what it sees to FAKE_LLAMA_SEEN.
FAKE = """#!{python}
import json, os, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
mode = os.environ.get("FAKE_LLAMA_MODE", "ok")
seen = os.environ["FAKE_LLAMA_SEEN"]
args = sys.argv[1:]
lock, state = threading.Lock(), {{"in_flight": 0, "most": 0, "answered": 0}}
def note(kind, value):
    with lock, open(seen, "a") as f:
        f.write(json.dumps({{"kind": kind, "value": value, "t": time.time()}}) + "\\n")
note("argv", args)
if mode == "crash":
    print("error: failed to load model 'x.gguf'", flush=True)
    sys.exit(1)
class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        if self.path == "/health":
            self.answer(200, {{"status": "ok"}})
        else:
            self.answer(200, {{"build_info": "b1-fake"}})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        note("completion", body)
        with lock:
            state["in_flight"] += 1
            state["most"] = max(state["most"], state["in_flight"])
        time.sleep(0.3 if len(body["prompt"]) != 16 else 0)  # workload requests overlap
        with lock:
            state["in_flight"] -= 1
            state["answered"] += 1
            most = state["most"]
        n, prompt = body["n_predict"], len(body["prompt"])
        if mode == "http-error" and prompt != 16:
            return self.answer(400, {{"error": {{"code": 400, "message": "the request exceeds the context"}}}})
        if mode == "short" and prompt == 3:
            n -= 1
        if mode == "bos" and prompt == 3:
            prompt += 1
        self.answer(200, {{"tokens": list(range(n)), "tokens_predicted": n, "tokens_evaluated": prompt,
                          "most_in_flight": most}})
ThreadingHTTPServer(("{host}", int(args[args.index("--port") + 1])), Handler).serve_forever()
"""


@pytest.fixture
def fake_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "bin" / "llama-server"
    path.parent.mkdir()
    path.write_text(FAKE.format(python=sys.executable, host=HOST))
    path.chmod(0o755)
    monkeypatch.setenv("FAKE_LLAMA_SEEN", str(tmp_path / "seen.jsonl"))
    return path


def seen(tmp_path: Path, kind: str) -> list:
    lines = (tmp_path / "seen.jsonl").read_text().splitlines()
    return [json.loads(line)["value"] for line in lines if json.loads(line)["kind"] == kind]


def workload(lengths: list[tuple[int, int]], arrivals: list[float] | None = None) -> Workload:
    """Requests with prompts 10, 11, ... of the given (prompt, output) lengths."""
    times = arrivals or [0.0] * len(lengths)
    return Workload(
        "fixed",
        [
            BenchRequest(str(i), list(range(10, 10 + p)), o, t)
            for i, ((p, o), t) in enumerate(zip(lengths, times, strict=True))
        ],
    )


def plan_for(w: Workload, max_num_seqs: int = 8):
    return server_plan(w, max_num_seqs=max_num_seqs, num_threads=2, max_num_batched_tokens=256)


# --- what is sent -------------------------------------------------------------------------------------


def test_server_plan_sizes_one_slot_per_sequence() -> None:
    w = workload([(3, 2), (5, 7), (4, 1)])
    plan = plan_for(w)
    assert (plan.parallel, plan.slot_tokens, plan.ctx_size, plan.threads, plan.batch_size) == (
        3,
        12,
        36,
        2,
        256,
    )
    capped = plan_for(w, max_num_seqs=2)
    assert (capped.parallel, capped.ctx_size) == (2, 24)
    with pytest.raises(ValueError, match="at least one request"):
        plan_for(Workload("fixed", []))


def test_server_command_listens_on_localhost_only() -> None:
    cmd = server_command("/b/llama-server", "/m/x.Q8_0.gguf", 8123, plan_for(workload([(3, 2), (5, 7)])))
    opts = {
        a: b for a, b in zip(cmd[1:], cmd[2:], strict=False) if a.startswith("--") and not b.startswith("--")
    }
    assert cmd[0] == "/b/llama-server" and opts["--model"] == "/m/x.Q8_0.gguf"
    assert (opts["--host"], opts["--port"]) == ("127.0.0.1", "8123")
    assert (opts["--parallel"], opts["--ctx-size"], opts["--threads"], opts["--threads-batch"]) == (
        "2",
        "24",
        "2",
        "2",
    )
    assert opts["--batch-size"] == "256" and opts["--cache-ram"] == "0"
    assert {"--cont-batching", "--no-cache-prompt", "--no-context-shift"} <= set(cmd)


def test_completion_body_is_greedy_exact_and_uncached() -> None:
    assert completion_body([5, 6, 7], 4) == {
        "prompt": [5, 6, 7],
        "n_predict": 4,
        "ignore_eos": True,
        "temperature": 0.0,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
    }


def test_answer_check_counts_tokens_and_prompt() -> None:
    r = BenchRequest("0", [1, 2, 3], 4)
    assert answer_error(r, 200, {"tokens": [9, 9, 9, 9], "tokens_evaluated": 3}) == (4, None)
    assert answer_error(r, 200, {"tokens": [], "tokens_predicted": 4}) == (4, None)
    assert answer_error(r, 200, {"tokens": [9, 9]}) == (2, "llama.cpp generated 2 tokens, expected 4")
    assert answer_error(r, 200, {"tokens_predicted": 4, "tokens_evaluated": 4}) == (
        4,
        "llama.cpp evaluated 4 prompt tokens, expected 3",
    )
    assert (
        answer_error(r, 200, {"content": "hi"})[1]
        == "llama.cpp's answer has neither tokens nor tokens_predicted"
    )
    assert answer_error(r, 500, {"error": {"message": "boom"}}) == (0, "llama.cpp answered HTTP 500: boom")
    assert answer_error(r, 502, None) == (0, "llama.cpp answered HTTP 502 with no JSON object")


# --- settings and the binary ------------------------------------------------------------------------


def test_settings_need_the_server_and_a_gguf_file() -> None:
    with pytest.raises(ValueError, match="--baselines llama.cpp needs --llama-server PATH"):
        BenchSettings(baselines=["llama.cpp"])
    with pytest.raises(
        ValueError, match="needs a GGUF model file, got --model /m/hf-dir: give --model FILE.gguf"
    ):
        BenchSettings(
            baselines=["llama.cpp"], llama_server=sys.executable, engine=EngineConfig(model="/m/hf-dir")
        )
    with pytest.raises(ValueError, match="--llama-server applies to --baselines llama.cpp only"):
        BenchSettings(llama_server=sys.executable)
    with pytest.raises(ValueError, match="llama-server timeout must be > 0 seconds"):
        BenchSettings(baselines=["llama.cpp"], llama_server=sys.executable, llama_server_timeout_s=0.0)
    # A path that cannot run is a usage error before any run (not a skipped column after one).
    with pytest.raises(ValueError, match="--llama-server /b/s does not exist; give the path of llama.cpp"):
        BenchSettings(baselines=["llama.cpp"], llama_server="/b/s")
    assert gguf_problem(None) is None and gguf_problem("/m/X.Q8_0.GGUF") is None
    BenchSettings(
        baselines=["llama.cpp"], llama_server=sys.executable, engine=EngineConfig(model="/m/x.gguf")
    )


def test_a_server_binary_that_cannot_run_is_unavailable(tmp_path: Path) -> None:
    """A folder (as the vLLM baseline, through the same check: every case in test_vllm_baseline.py)
    and a file that is no program, which only starting it finds out."""
    folder, garbage = tmp_path / "build", tmp_path / "llama-server"
    folder.mkdir()
    garbage.write_bytes(b"\x7fELF garbage")
    garbage.chmod(0o755)
    with pytest.raises(
        LlamaCppUnavailable, match=f"--llama-server {folder} is a folder; give the path of llama.cpp"
    ):
        check_server(folder)
    w = workload([(3, 2)])
    with pytest.raises(
        LlamaCppUnavailable, match=f"--llama-server {garbage} cannot be started .*docs/llamacpp.md"
    ):
        run_llamacpp(garbage, "/m/x.gguf", w, plan_for(w))


# --- runs on the fake server ----------------------------------------------------------------------------


def test_fake_run_sends_every_request_concurrently(fake_server: Path, tmp_path: Path) -> None:
    w = workload([(3, 2), (5, 7), (4, 1)])
    run = run_llamacpp(fake_server, "/m/x.gguf", w, plan_for(w))
    assert [(r.request_id, r.output_len, r.error) for r in run.requests] == [
        ("0", 2, None),
        ("1", 7, None),
        ("2", 1, None),
    ]
    argv = seen(tmp_path, "argv")[0]
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--parallel") + 1] == "3"
    bodies = seen(tmp_path, "completion")
    warm, timed = bodies[0], bodies[1:]
    assert (len(warm["prompt"]), warm["n_predict"]) == (16, 2)  # the untimed warm-up comes first
    assert sorted((b["prompt"], b["n_predict"]) for b in timed) == [
        ([10, 11, 12], 2),
        ([10, 11, 12, 13], 1),
        ([10, 11, 12, 13, 14], 7),
    ]
    assert all(b["ignore_eos"] and b["temperature"] == 0 and b["cache_prompt"] is False for b in bodies)
    m = summarize(run)
    assert (m["output_tokens"], m["prompt_tokens"], m["num_errors"]) == (10, 12, 0)
    assert 0.3 <= m["wall_s"] < 0.9  # three 0.3 s answers at once, not one after another
    assert m["e2e_mean_s"] is not None and m["ttft_mean_s"] is None and m["num_steps"] is None
    assert run.extra["llama_cpp_build"] == "b1-fake" and run.extra["parallel"] == 3
    assert run.resources["peak_rss_mb"] > 1
    assert "llama.cpp b1-fake llama-server, 3 slots of 12 tokens" in run.notes[0]


def test_requests_are_sent_at_their_arrival_times(fake_server: Path) -> None:
    w = workload([(3, 2), (5, 7)], arrivals=[0.0, 0.5])
    run = run_llamacpp(fake_server, "/m/x.gguf", w, plan_for(w))
    first, late = run.requests
    assert first.queued is not None and first.queued < 0.2
    assert late.queued is not None and late.queued >= 0.5 and late.arrival == 0.5
    assert late.finish is not None and late.finish >= 0.8


@pytest.mark.parametrize(
    ("mode", "error"),
    [
        ("short", "llama.cpp generated 1 tokens, expected 2"),
        ("bos", "llama.cpp evaluated 4 prompt tokens, expected 3"),
    ],
)
def test_wrong_counts_are_error_rows(
    fake_server: Path, monkeypatch: pytest.MonkeyPatch, mode: str, error: str
) -> None:
    monkeypatch.setenv("FAKE_LLAMA_MODE", mode)
    w = workload([(3, 2), (5, 7)])
    run = run_llamacpp(fake_server, "/m/x.gguf", w, plan_for(w))
    assert run.requests[0].error == error and run.requests[1].error is None
    assert summarize(run)["num_errors"] == 1


def test_a_server_that_exits_before_it_is_ready(fake_server: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_LLAMA_MODE", "crash")
    w = workload([(3, 2)])
    with pytest.raises(LlamaCppRunError) as info:
        run_llamacpp(fake_server, "/m/x.gguf", w, plan_for(w))
    message = str(info.value)
    assert "llama-server exited with status 1 before it was ready" in message
    assert "error: failed to load model 'x.gguf'" in message
    log = Path(message.rsplit("its log: ", 1)[1])
    assert "failed to load model" in log.read_text()
    log.unlink()


def test_a_server_that_refuses_every_request(fake_server: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_LLAMA_MODE", "http-error")
    w = workload([(3, 2), (5, 7)])
    with pytest.raises(
        LlamaCppRunError, match="no request got an answer .*HTTP 400: the request exceeds"
    ) as info:
        run_llamacpp(fake_server, "/m/x.gguf", w, plan_for(w))
    Path(str(info.value).rsplit("its log: ", 1)[1]).unlink()


# --- the report -------------------------------------------------------------------------------------------


def test_report_ratio_against_llama_cpp(fake_server: Path) -> None:
    w = workload([(3, 2), (5, 7), (4, 1)])
    peer = run_llamacpp(fake_server, "/m/x.gguf", w, plan_for(w))
    wall = summarize(peer)["wall_s"] / 2  # batchgen twice as fast
    records = [
        RequestRecord(r.request_id, r.prompt_len, r.output_len, 0.0, 0.0, wall / 2, wall) for r in w.requests
    ]
    report = build_report(
        settings=BenchSettings(),
        workload=w,
        results=[RunResult("continuous/fcfs", "continuous", "fcfs", records), peer],
        ceiling=None,
        model_info={"model": "m", "dtype": "float32", "device": "cpu"},
        flops={},
    )
    assert report["llamacpp_base"] == "llama.cpp" and report["vllm_base"] is None
    assert report["software"]["llama.cpp"] == "b1-fake"
    cont, llama = report["configurations"]
    assert cont["ratios_vs_llamacpp"]["output_tokens_per_s"] == pytest.approx(2.0)
    assert cont["ratios_vs_llamacpp"]["wall_s"] == pytest.approx(0.5)
    assert "ratios_vs_llamacpp" not in llama and "ratios_vs_vllm" not in cont
    out = io.StringIO()
    render(report, Console(file=out, width=250))
    row = next(line for line in out.getvalue().splitlines() if "output tokens/s / llama.cpp" in line)
    assert "2.00x" in row and "1.00x" in row


# --- the bench command --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, default_model_files, tmp_path_factory) -> Path:
    """The tiny Llama as a GGUF file with Q8_0 linears (written as llama.cpp's converter writes one)."""
    from tests.model.gguf_writer import tiny_tokenizer, write_gguf

    if default_model_files.gguf is None:
        pytest.skip("the default model is not a GGUF file here (its tokenizer fields are needed)")
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf"
    linears = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    tokenizer = tiny_tokenizer(default_model_files.gguf, 49152)
    write_gguf(tiny_model_dir("llama"), tokenizer, path, dict.fromkeys(linears, "Q8_0"))
    return path


def test_bench_with_fake_llama_server(tiny_gguf: Path, tmp_path: Path, fake_server: Path) -> None:
    args = tiny_run_args(tiny_gguf, tmp_path, "--num-prompts", "3", "--scale", "0.05", "--max-num-seqs", "2")
    result = invoke_bench([*args, "--baselines", "llama.cpp", "--llama-server", str(fake_server)])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    cont, llama = report["configurations"]
    assert (llama["name"], llama["kind"], llama["status"]) == ("llama.cpp", "llama.cpp", "ok")
    assert (
        llama["metrics"]["output_tokens"]
        == report["sampled_output_tokens"]
        == cont["metrics"]["output_tokens"]
    )
    assert llama["extra"]["model_file"] == str(tiny_gguf)
    assert (llama["extra"]["parallel"], llama["extra"]["threads"]) == (2, 1)
    assert "output tokens/s / llama.cpp" in result.output


def test_bench_with_a_missing_llama_server_is_a_usage_error(tiny_gguf: Path, tmp_path: Path) -> None:
    """A typo in the path stops the bench before it runs anything (exit 2, nothing written)."""
    missing = tmp_path / "no-build" / "llama-server"
    args = tiny_run_args(tiny_gguf, tmp_path, "--num-prompts", "2", "--scale", "0.05")
    result = invoke_bench([*args, "--baselines", "llama.cpp", "--llama-server", str(missing)])
    assert result.exit_code == 2, result.output
    assert f"--llama-server {missing} does not exist" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "r.json").exists()


def test_bench_llama_cpp_on_a_model_folder_is_a_usage_error(tiny_model_dir, tmp_path: Path) -> None:
    args = tiny_run_args(tiny_model_dir("llama"), tmp_path)
    result = invoke_bench([*args, "--baselines", "llama.cpp", "--llama-server", sys.executable])
    assert result.exit_code == 2
    assert "needs a GGUF model file" in result.output


# --- the real llama.cpp --------------------------------------------------------------------------------------


def _real_server() -> str:
    """BATCHGEN_LLAMA_SERVER when it names an executable; else the test skips, saying why."""
    server = os.environ.get("BATCHGEN_LLAMA_SERVER", "")
    problem = executable_problem(server) if server else "is not set"
    if problem is not None:
        pytest.skip(
            f"BATCHGEN_LLAMA_SERVER {problem}: point it at llama-server (docs/llamacpp.md) to run llama.cpp"
        )
    return server


@pytest.mark.slow
def test_real_llama_server_generates_every_token(tiny_gguf: Path) -> None:
    server = _real_server()
    w = workload([(8, 4), (20, 3), (5, 6)])
    run = run_llamacpp(server, tiny_gguf, w, plan_for(w, max_num_seqs=2), timeout_s=300)
    assert [(r.output_len, r.error) for r in run.requests] == [(4, None), (3, None), (6, None)]
    m = summarize(run)
    assert m["output_tokens"] == 13 and 0 < m["wall_s"] < 300
    assert run.extra["llama_cpp_build"] != "unknown" and run.resources["peak_rss_mb"] > 1


@pytest.mark.slow
def test_real_llama_server_in_the_bench(tiny_gguf: Path, tmp_path: Path) -> None:
    server = _real_server()
    args = tiny_run_args(tiny_gguf, tmp_path, "--num-prompts", "4", "--scale", "0.05")
    result = invoke_bench([*args, "--baselines", "llama.cpp", "--llama-server", server])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    llama = report["configurations"][1]
    assert llama["status"] == "ok", llama["reason"]
    assert (
        llama["metrics"]["num_errors"] == 0
        and llama["metrics"]["output_tokens"] == report["sampled_output_tokens"]
    )
