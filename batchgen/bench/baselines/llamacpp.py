"""The llama.cpp baseline of `batchgen bench --baselines llama.cpp --llama-server PATH`.

The bench starts llama.cpp's own server (`llama-server`, built as docs/llamacpp.md says) on the
bench's GGUF file, listening on 127.0.0.1 only at a free port, with one slot per parallel sequence
(`-np`: the bench's `max_num_seqs`, capped at the number of requests), continuous batching on, the
bench's thread count (`-t`, `-tb`), the bench's token budget as the logical batch (`-b`), prompt
caching off (`--no-cache-prompt`, `--cache-ram 0`, and `cache_prompt: false` in each request) and
a context of `n_ctx` = slots x the longest request (llama.cpp splits one context evenly among its
slots; context shift is off, so a slot that fills stops short and the count check says so). After an untimed warm-up request it sends every workload request at its arrival time, all
concurrently (one thread each), to `POST /completion` as token ids::

    {"prompt": [token id, ...], "n_predict": output_len, "ignore_eos": true, "temperature": 0,
     "cache_prompt": false, "return_tokens": true, "stream": false}

and checks each answer: exactly `output_len` tokens generated and `prompt_len` prompt tokens
evaluated (a request that got other counts is an error row, not silently counted).

What it measures: wall time (first send to last answer) and so throughput, and each request's
end-to-end latency from its arrival; answers are not streamed, so there is no TTFT or TPOT, and no
step count. Peak RSS is the server's resident memory sampled every 0.1 s over the whole run (its
KV cache included). Traffic goes to 127.0.0.1 only, through `http.client` (no proxy settings apply).
"""

from __future__ import annotations

import http.client
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from batchgen.bench.baselines.llama_server import (
    DOCS,
    HOST,
    LlamaCppRunError,
    LlamaCppUnavailable,
    free_port,
    http_json,
    running_server,
)
from batchgen.bench.baselines.processes import PeakRss, executable_problem
from batchgen.bench.report.metrics import RequestRecord, RunResult
from batchgen.bench.workload.distributions import BenchRequest, Workload


def gguf_problem(model: str | None) -> str | None:
    """Why the bench's `--model` cannot be given to llama.cpp (it reads GGUF files only), or None
    (None = the default model, itself a GGUF file)."""
    if model is None or model.lower().endswith(".gguf"):
        return None
    return (
        f"--baselines llama.cpp needs a GGUF model file, got --model {model}: give --model FILE.gguf "
        f"(a Q8_0 file of the default model: {DOCS})"
    )


def check_server(server: str | Path) -> None:
    """Check that `server` names an executable file (cheap: nothing is started).

    Raises:
        LlamaCppUnavailable: naming the path, what is wrong and the fix.
    """
    problem = executable_problem(server)
    if problem is not None:
        raise LlamaCppUnavailable(
            f"--llama-server {server} {problem}; give the path of llama.cpp's llama-server binary "
            f"(build: {DOCS})"
        )


@dataclass(frozen=True)
class ServerPlan:
    """The server's sizes for one workload.

    Attributes:
        parallel: slots (`-np`): the bench's `max_num_seqs`, at most the number of requests (a slot
            no request can reach only costs memory).
        slot_tokens: context of one slot: the longest request's prompt + output tokens.
        ctx_size: `-c`, the context llama.cpp splits evenly among the slots (`parallel` x `slot_tokens`).
        threads: `-t` and `-tb`.
        batch_size: `-b`, the most tokens one `llama_decode` takes (the bench's token budget).
    """

    parallel: int
    slot_tokens: int
    ctx_size: int
    threads: int
    batch_size: int


def server_plan(
    workload: Workload, *, max_num_seqs: int, num_threads: int, max_num_batched_tokens: int
) -> ServerPlan:
    """The `ServerPlan` that runs `workload` as batchgen's engine would: the same sequence cap,
    thread count and token budget.

    Raises:
        ValueError: an empty workload.
    """
    if not workload.requests:
        raise ValueError("the llama.cpp baseline needs at least one request")
    parallel = max(1, min(max_num_seqs, len(workload.requests)))
    slot = max(r.prompt_len + r.output_len for r in workload.requests)
    return ServerPlan(parallel, slot, parallel * slot, num_threads, max_num_batched_tokens)


def server_command(server: str | Path, model: str | Path, port: int, plan: ServerPlan) -> list[str]:
    """The llama-server command line of `plan` on `model`, listening on `HOST`:`port`."""
    return [
        str(server),
        "--model", str(model),
        "--host", HOST,
        "--port", str(port),
        "--parallel", str(plan.parallel),
        "--cont-batching",
        "--ctx-size", str(plan.ctx_size),
        "--threads", str(plan.threads),
        "--threads-batch", str(plan.threads),
        "--batch-size", str(plan.batch_size),
        "--no-cache-prompt",
        "--cache-ram", "0",  # no prompt cache in RAM either: every prompt is computed
        "--no-context-shift",  # a slot that fills stops short, and the count check says so
    ]  # fmt: skip


def completion_body(prompt: list[int], n_predict: int) -> dict[str, Any]:
    """The JSON body of `POST /completion` for one request: token ids, exactly `n_predict` greedy
    tokens (EOS ignored), no prompt cache, the generated token ids returned."""
    return {
        "prompt": [int(t) for t in prompt],
        "n_predict": int(n_predict),
        "ignore_eos": True,
        "temperature": 0.0,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
    }


def answer_error(request: BenchRequest, status: int, answer: Any) -> tuple[int, str | None]:
    """The output token count of llama-server's answer to `request` and the request's error (None
    when the answer is a success with exactly the workload's counts).

    The count is the length of the returned `tokens`, else `tokens_predicted`; `tokens_evaluated`
    must equal the prompt's length (token ids in, nothing added or cut).
    """
    if not isinstance(answer, dict):
        return 0, f"llama.cpp answered HTTP {status} with no JSON object"
    if status != 200:
        error = answer.get("error")
        message = error.get("message") if isinstance(error, dict) else error
        return 0, f"llama.cpp answered HTTP {status}: {message or answer}"
    tokens = answer.get("tokens")
    count = len(tokens) if isinstance(tokens, list) and tokens else answer.get("tokens_predicted")
    if not isinstance(count, int):
        return 0, "llama.cpp's answer has neither tokens nor tokens_predicted"
    if count != request.output_len:
        return count, f"llama.cpp generated {count} tokens, expected {request.output_len}"
    evaluated = answer.get("tokens_evaluated")
    if evaluated is not None and evaluated != request.prompt_len:
        return count, f"llama.cpp evaluated {evaluated} prompt tokens, expected {request.prompt_len}"
    return count, None


def send_all(port: int, workload: Workload, timeout_s: float | None = None) -> list[RequestRecord]:
    """Send every request of `workload` at its arrival time (seconds after the start), each on a
    thread of its own, and wait for every answer; one record each, in workload order, with times in
    seconds since the start (`queued` = sent, `finish` = answered)."""
    records: list[RequestRecord | None] = [None] * len(workload.requests)
    start = time.perf_counter()

    def send(i: int, r: BenchRequest) -> None:
        wait = r.arrival_time - (time.perf_counter() - start)
        if wait > 0:
            time.sleep(wait)
        sent = time.perf_counter() - start
        try:
            status, answer = http_json(
                port, "POST", "/completion", completion_body(r.prompt_token_ids, r.output_len), timeout_s
            )
            count, error = answer_error(r, status, answer)
        except (OSError, http.client.HTTPException) as exc:
            count, error = 0, f"llama.cpp did not answer: {type(exc).__name__}: {exc}"
        done = time.perf_counter() - start
        records[i] = RequestRecord(
            r.request_id, r.prompt_len, count, r.arrival_time, None, None, done, error, sent
        )

    threads = [
        threading.Thread(target=send, args=(i, r), daemon=True) for i, r in enumerate(workload.requests)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in records if r is not None]


def run_llamacpp(
    server: str | Path,
    model: str | Path,
    workload: Workload,
    plan: ServerPlan,
    *,
    name: str = "llama.cpp",
    timeout_s: float | None = None,
) -> RunResult:
    """Run `workload` on llama-server (`server`) serving the GGUF file `model` with `plan`'s sizes
    (see the module docstring) and return a `RunResult`: one record per request (arrival, sent,
    answered; no first-token time), an error where an answer's counts differ from the workload's.

    Args:
        timeout_s: the most seconds one request may wait for its answer (None = no limit); the
            server's start has `llama_server.READY_TIMEOUT_S` of its own.

    Raises:
        LlamaCppUnavailable: `server` is missing or cannot be started.
        LlamaCppRunError: the server exited or was not ready in time, the warm-up failed, the
            server died during the run, or no request got an answer.
    """
    check_server(server)
    port = free_port()
    command = server_command(server, model, port, plan)
    started = time.perf_counter()
    with running_server(command, port) as (proc, log_path), PeakRss(proc) as rss:
        load_s = time.perf_counter() - started
        try:
            build, warmup_s, records = _measure(port, workload, timeout_s)
        except (OSError, http.client.HTTPException) as exc:
            raise LlamaCppRunError(f"llama-server stopped answering ({exc}); its log: {log_path}") from exc
        except LlamaCppRunError as exc:
            raise LlamaCppRunError(f"{exc}; its log: {log_path}") from exc
        if not _alive(proc):
            raise LlamaCppRunError(f"llama-server died during the run; its log: {log_path}")
    return _result(records, rss.peak, name, server, model, command, plan, build, load_s, warmup_s)


def _measure(
    port: int, workload: Workload, timeout_s: float | None
) -> tuple[str, float, list[RequestRecord]]:
    """The server's build, the untimed warm-up's seconds and the timed run's records.

    Raises:
        LlamaCppRunError: the warm-up failed, or no request got an answer.
    """
    _, props = http_json(port, "GET", "/props", timeout_s=30)
    build = str(props.get("build_info", "unknown")) if isinstance(props, dict) else "unknown"
    t = time.perf_counter()
    # The first prompt's head reversed, repeated to 16 tokens: not a workload prompt.
    head = list(workload.requests[0].prompt_token_ids[:16])[::-1]
    warm = BenchRequest("warm-up", (head * 16)[:16], 2)
    status, answer = http_json(port, "POST", "/completion", completion_body(warm.prompt_token_ids, 2), 120)
    if (error := answer_error(warm, status, answer)[1]) is not None:
        raise LlamaCppRunError(f"the warm-up request failed: {error}")
    warmup_s = time.perf_counter() - t
    records = send_all(port, workload, timeout_s)
    if all(r.error is not None for r in records):
        raise LlamaCppRunError(f"no request got an answer (the first: {records[0].error})")
    return build, warmup_s, records


def _alive(proc: psutil.Process) -> bool:
    """Whether `proc` still runs (a process that exited stays a zombie until the bench reaps it)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _result(
    records: list[RequestRecord],
    peak_rss: int,
    name: str,
    server: str | Path,
    model: str | Path,
    command: list[str],
    plan: ServerPlan,
    build: str,
    load_s: float,
    warmup_s: float,
) -> RunResult:
    """The `RunResult` of a finished run, with the server's facts in `extra` and one note."""
    run = RunResult(name, "llama.cpp", None, records, [])
    run.resources = {
        "cpu_percent": None,
        "peak_rss_mb": peak_rss / 2**20 if peak_rss else None,
        "rss_before_mb": None,
    }
    run.extra = {
        "steps_measured": False,
        "llama_cpp_build": build,
        "llama_server": str(server),
        "model_file": str(model),
        "command": command[1:],
        "parallel": plan.parallel,
        "ctx_size": plan.ctx_size,
        "slot_tokens": plan.slot_tokens,
        "threads": plan.threads,
        "batch_size": plan.batch_size,
        "load_s": load_s,
        "warmup_s": warmup_s,
    }
    run.notes.append(
        f"{name}: llama.cpp {build} llama-server, {plan.parallel} slots of {plan.slot_tokens} tokens "
        f"(n_ctx {plan.ctx_size}), {plan.threads} threads, batch {plan.batch_size}; start {load_s:.1f} s and "
        f"warm-up {warmup_s:.1f} s untimed; answers are not streamed, so TTFT, TPOT and steps are not measured"
    )
    return run
