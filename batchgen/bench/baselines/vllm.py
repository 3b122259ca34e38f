"""The vLLM baseline of `batchgen bench --baselines vllm --vllm-python PATH`.

vLLM lives in its own virtual environment (its torch and dependencies pin versions batchgen's do
not), so the bench runs `bench/baselines/vllm_child.py` with that environment's interpreter, in a subprocess,
on exactly the bench's workload: the same token-id prompts, each with its own output length
(greedy, EOS ignored), the same model directory (for the default GGUF model, the Hugging Face copy
batchgen converted it into), dtype, maximum length, token budget and sequence cap, prefix caching
off. The child times one `LLM.generate` after an untimed warm-up and reports its wall time and each
request's output token count as JSON (protocol in `vllm_child`); the bench checks the counts against
the workload.

What it measures: throughput and wall time. `LLM.generate` returns every output at the end, so
there are no per-request latencies or steps; the report shows those as "-". Peak RSS is the largest
sum, over the child and its processes (vLLM's engine core and worker run in their own), of their
resident memory, sampled every 0.1 s (shared pages count once per process; vLLM's whole KV cache is
in it); CPU utilisation is not measured.

Environment of the child (each set only when the user has not set it):
    VLLM_CPU_KVCACHE_SPACE     GiB of KV cache on a CPU (`DEFAULT_KVCACHE_GIB`).
    VLLM_CPU_OMP_THREADS_BIND  the bench's thread count as the first that many cores this process
                               may run on (e.g. "0-1" for 2 threads); vLLM's "auto" would keep one
                               core free for its scheduler and run one thread fewer than batchgen.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil

from batchgen.bench.baselines.processes import (
    BaselineRunError,
    BaselineUnavailable,
    executable_problem,
    kill_tree,
    log_tail,
    start_logged,
    tree_rss,
)
from batchgen.bench.report.metrics import RequestRecord, RunResult
from batchgen.bench.workload.distributions import Workload

VLLM_CHILD = Path(__file__).with_name("vllm_child.py")
PROTOCOL = 1  # must equal vllm_child.PROTOCOL (a test checks)
DEFAULT_KVCACHE_GIB = 4
_DOCS = "docs/vllm.md"


class VllmUnavailable(BaselineUnavailable):
    """vLLM cannot run here: no such interpreter, not one that starts, or one without vLLM (the
    configuration is reported as skipped)."""


class VllmRunError(BaselineRunError):
    """vLLM started but failed (the configuration is reported as failed)."""


def offline_reason(workload: Workload) -> str | None:
    """Why `LLM.generate` cannot run `workload` as batchgen does (requests arriving after time 0:
    it has no arrival times), or None when every request arrives at 0."""
    late = sum(r.arrival_time > 0 for r in workload.requests)
    if late:
        return (
            f"vLLM's LLM.generate takes every request at once, but {late} requests arrive later "
            "(--request-rate / --trace-arrivals); drop those options to compare with vLLM"
        )
    return None


def child_request(
    workload: Workload,
    *,
    model_dir: str | Path,
    dtype: str,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    gpu_memory_utilization: float | None = None,
    seed: int = 0,
    warmup: bool = True,
) -> dict[str, Any]:
    """The request (protocol 1, see `vllm_child`) that runs `workload` in vLLM.

    Args:
        model_dir: a Hugging Face directory (vLLM cannot read batchgen's GGUF cache key, only the
            converted directory).
        dtype: "bfloat16", "float16" or "float32" (the dtype batchgen runs in).
        max_model_len / max_num_batched_tokens / max_num_seqs: as batchgen's engine resolved them.
        gpu_memory_utilization: fraction of GPU memory for vLLM on CUDA; None on a CPU.
    """
    return {
        "protocol": PROTOCOL,
        "model": str(model_dir),
        "dtype": dtype,
        "max_model_len": int(max_model_len),
        "max_num_seqs": int(max_num_seqs),
        "max_num_batched_tokens": int(max_num_batched_tokens),
        "gpu_memory_utilization": gpu_memory_utilization,
        "seed": seed,
        "warmup": warmup,
        "prompts": [list(map(int, r.prompt_token_ids)) for r in workload.requests],
        "max_tokens": [int(r.output_len) for r in workload.requests],
    }


def threads_bind(num_threads: int, cores: list[int] | None = None) -> str:
    """The first `num_threads` of `cores` (default: the cores this process may run on) as a
    VLLM_CPU_OMP_THREADS_BIND list of ranges, e.g. "0-1" or "0,2-3".

    Raises:
        ValueError: `num_threads` < 1.
    """
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    if cores is None:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        cores = cores or list(range(os.cpu_count() or 1))
    chosen = sorted(cores)[:num_threads]
    spans: list[list[int]] = []
    for c in chosen:
        if spans and c == spans[-1][1] + 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def child_env(num_threads: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The child's environment: `base` (default `os.environ`) plus `VLLM_CPU_KVCACHE_SPACE` and
    `VLLM_CPU_OMP_THREADS_BIND` where `base` lacks them (see the module docstring)."""
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(DEFAULT_KVCACHE_GIB))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", threads_bind(num_threads))
    # The child's own files, not a batchgen checkout that happens to be the working directory.
    env.pop("PYTHONPATH", None)
    return env


def check_python(python: str | Path) -> None:
    """Check that `python` names an executable file (cheap: nothing is started).

    Raises:
        VllmUnavailable: naming the path, what is wrong and the fix.
    """
    path = Path(python).expanduser()
    fix = f"give --vllm-python the python of a virtual environment with vLLM installed (see {_DOCS})"
    problem = executable_problem(path)
    if problem is None:
        return
    example = f", e.g. {path / 'bin' / 'python'}" if problem == "is a folder" else ""
    raise VllmUnavailable(f"--vllm-python {python} {problem}; {fix}{example}")


def run_child(
    python: str | Path,
    request: dict[str, Any],
    env: Mapping[str, str],
    timeout_s: float | None = None,
) -> tuple[dict[str, Any], int]:
    """Run `vllm_child.py` under `python` on `request`; return its result dict and the peak RSS of
    its process tree in bytes. The child's log (stdout and stderr) is deleted on success and kept,
    named in the error, on failure.

    Raises:
        VllmUnavailable: `python` is missing, cannot start, or cannot import vLLM.
        VllmRunError: vLLM failed, the child died without a result, or ran past `timeout_s`
            seconds (it is then killed with its processes).
    """
    check_python(python)
    log_fd, log_name = tempfile.mkstemp(prefix="batchgen-vllm-", suffix=".log")
    log_path = Path(log_name)
    with tempfile.TemporaryDirectory(prefix="batchgen-vllm-") as tmp:
        req_path, res_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req_path.write_text(json.dumps(request), encoding="utf-8")
        # A copy in a folder of its own: Python puts a script's folder first on sys.path, and
        # batchgen/bench/'s modules (metrics, report, runner, ...) must not shadow vLLM's imports.
        script = Path(tmp) / VLLM_CHILD.name
        shutil.copyfile(VLLM_CHILD, script)
        peak = 0
        child = start_logged(
            [str(python), str(script), str(req_path), str(res_path)],
            log_fd,
            log_path,
            VllmUnavailable,
            f"--vllm-python {python}",
            f"give the python of a virtual environment with vLLM installed (see {_DOCS})",
            env=dict(env),
            cwd=tmp,  # nor the caller's working directory (a checkout with a `vllm` folder)
        )
        proc = psutil.Process(child.pid)
        started = time.monotonic()
        try:
            while child.poll() is None:
                peak = max(peak, tree_rss(proc))
                if timeout_s is not None and time.monotonic() - started > timeout_s:
                    raise VllmRunError(
                        f"vLLM ran past {timeout_s:.0f} s and was stopped; its log: {log_path}"
                    )
                time.sleep(0.1)
        finally:
            if child.poll() is None:  # the timeout, or Ctrl-C in the bench
                kill_tree(proc)
        result = _read_result(res_path)
    if result is None:
        last = (log_tail(log_path, 1) or ["(no output)"])[0]
        raise VllmRunError(
            f"{python} exited with status {child.returncode} before reporting a result (last line: "
            f"{last.strip()}); its log: {log_path}"
        )
    if "error" in result:
        if result.get("stage") == "import":
            log_path.unlink(missing_ok=True)
            raise VllmUnavailable(
                f"{python} cannot import vllm ({result['error']}); install vLLM into that "
                f"environment (see {_DOCS}), or give another --vllm-python"
            )
        raise VllmRunError(
            f"vLLM failed while {_STAGES.get(str(result.get('stage')), 'running')}: {result['error']}; "
            f"its log: {log_path}"
        )
    if result.get("protocol") != PROTOCOL:
        raise VllmRunError(
            f"the vLLM child spoke protocol {result.get('protocol')!r}, the bench {PROTOCOL}: run the "
            f"vllm_child.py of this batchgen; its log: {log_path}"
        )
    log_path.unlink(missing_ok=True)
    return result, peak


_STAGES = {"request": "reading the request", "load": "loading the model", "generate": "generating"}


def _read_result(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def run_vllm(
    python: str | Path,
    workload: Workload,
    request: dict[str, Any],
    *,
    num_threads: int,
    name: str = "vllm",
    timeout_s: float | None = None,
    runner: Callable[..., tuple[dict[str, Any], int]] = run_child,
) -> RunResult:
    """Run `request` (from `child_request` on `workload`) in vLLM and turn the child's report into a
    `RunResult` with one record per request: arrival 0, finish at the measured wall time (seconds),
    no first-token time, an error where vLLM's output token count differs from the workload's.

    Args:
        python: the interpreter of vLLM's environment.
        num_threads: the bench's thread count (sets VLLM_CPU_OMP_THREADS_BIND unless the user has).
        timeout_s: stop the child after this many seconds (None = never).
        runner: `run_child` (tests pass a stand-in).

    Raises:
        VllmUnavailable / VllmRunError: from `run_child`; VllmRunError also when the child reports
            a different number of requests than it was given.
    """
    env = child_env(num_threads)
    result, peak_rss = runner(python, request, env, timeout_s)
    counts = result.get("num_output_tokens")
    elapsed = result.get("elapsed_s")
    if not isinstance(counts, list) or len(counts) != len(workload.requests):
        got = len(counts) if isinstance(counts, list) else "no"
        raise VllmRunError(f"vLLM returned {got} outputs for {len(workload.requests)} requests")
    if not isinstance(elapsed, (int, float)) or not math.isfinite(elapsed) or elapsed <= 0:
        raise VllmRunError(f"vLLM reported an elapsed time of {elapsed!r} s")
    records = [
        RequestRecord(
            r.request_id,
            r.prompt_len,
            int(n),
            0.0,
            None,
            None,
            float(elapsed),
            None if n == r.output_len else f"vLLM generated {n} tokens, expected {r.output_len}",
            0.0,
        )
        for r, n in zip(workload.requests, counts, strict=True)
    ]
    run = RunResult(name, "vllm", None, records, [])
    run.resources = {
        "cpu_percent": None,
        "peak_rss_mb": peak_rss / 2**20 if peak_rss else None,
        "rss_before_mb": None,
    }
    version = result.get("vllm_version", "unknown")
    run.extra = {
        "per_request_times": False,
        "vllm_version": version,
        "vllm_python": str(python),
        "model_dir": request.get("model"),
        "load_s": result.get("load_s"),
        "warmup_s": result.get("warmup_s"),
        "env": {k: env[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")},
    }
    load, warm = result.get("load_s"), result.get("warmup_s")
    timing = (
        f"model load {load:.1f} s and warm-up {warm:.1f} s untimed; "
        if isinstance(load, (int, float)) and isinstance(warm, (int, float))
        else ""
    )
    run.notes.append(
        f"{name}: vLLM {version} LLM.generate; {timing}it returns every output at the "
        "end, so per-request latencies and steps are not measured; peak RSS sums vLLM's processes"
    )
    return run
