"""Run every configuration of one bench on one workload, in one process, and collect the report.

Configurations, in this order (ratios in the report are against the first one that ran):
    continuous/<policy>  batchgen's continuous batching (`baselines.continuous`), once per `--policy`,
                         each in a fresh engine; once per `--speculative-method` item too, named
                         continuous/<policy>+ngram with speculative decoding ("none": without)
    static/b<N>          padded static batches of N through batchgen's engine (`baselines.static`)
    hf-static/b<N>       transformers `generate` in padded static batches of N (`baselines.hf`)
    hf-cb                transformers' continuous batching
    vllm                 vLLM's `LLM.generate` in its own interpreter (`baselines.vllm`)
    llama.cpp            llama.cpp's `llama-server` on the bench's GGUF file (`baselines.llamacpp`)
`--mode static,continuous` puts static first (`bench.settings`). Every configuration gets a fresh
engine or model, a short untimed warm-up, the same workload, dtype and thread count. The workload's
compute ceiling (`report.ceiling`) and each batchgen run's
roofline (`report.roofline`, in its `extra`) use the matmul rate and memory bandwidth
measured before the first run and after every run (`report.rates`).
"""

from __future__ import annotations

import cProfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from batchgen.bench.baselines.continuous import run_continuous
from batchgen.bench.baselines.hf import (
    hf_cb_unavailable,
    load_hf_model,
    resolve_hf_dir,
    run_hf_cb,
    run_hf_static,
)
from batchgen.bench.baselines.llamacpp import run_llamacpp, server_plan
from batchgen.bench.baselines.processes import BaselineRunError, BaselineUnavailable
from batchgen.bench.baselines.static import run_static
from batchgen.bench.baselines.vllm import child_request, offline_reason, run_vllm
from batchgen.bench.model_facts import EngineFactory, ModelFacts, bench_workload, model_facts, pad_id
from batchgen.bench.report.ceiling import ModelShape, compute_ceiling, workload_flops
from batchgen.bench.report.json_report import build_report
from batchgen.bench.report.metrics import ResourceMonitor, RunResult, release_memory, summarize
from batchgen.bench.report.rates import RateSamples
from batchgen.bench.report.roofline import prefill_flops
from batchgen.bench.settings import MODES, BenchSettings, ConfigPlan, engine_config_for, plan_configs
from batchgen.bench.spec import BenchInputError
from batchgen.bench.workload.distributions import Workload
from batchgen.config import FCFS, MAX_THROUGHPUT, EngineConfig
from batchgen.engine.protocol import BenchEngine


def default_engine_factory(config: EngineConfig) -> BenchEngine:
    """A real `LLMEngine` (imported late so `batchgen bench --help` stays fast)."""
    from batchgen.engine.llm_engine import LLMEngine

    return LLMEngine(config)


def run_bench(
    settings: BenchSettings,
    engine_factory: EngineFactory | None = None,
    log: Callable[[str], None] = print,
    profiles: dict[str, cProfile.Profile] | None = None,
) -> dict[str, Any]:
    """Run every configuration of `settings` and return the report dict (see `bench.report`).

    Every configuration builds its own engine or model inside its `ResourceMonitor` (so its peak
    RSS includes loading) and frees it afterwards. A configuration that raises is recorded as
    failed (with the error) and the bench goes on; an unavailable baseline is recorded as skipped
    with the reason. With `repeat` > 1 the configurations run round-robin, each round starting one
    configuration later, and each configuration's median run is reported. With `profiles` (a dict
    to fill: `bench --profile`), each timed batchgen configuration's engine steps run under the
    cProfile profiler `profiles[name]` (its runs together).

    Raises:
        BenchInputError: before any timed run, when the engine cannot start with these options
            (e.g. `device` cuda without CUDA, a missing model) or the workload cannot be built
            (a missing job file or trace, a job file without a usable row).
    """
    factory = engine_factory or default_engine_factory
    if settings.engine.num_threads is not None:
        torch.set_num_threads(settings.engine.num_threads)
    plans = plan_configs(settings)
    first_engine_plan = next((plan for plan in plans if plan.kind in MODES), None)
    facts = _model_facts(settings, factory, first_engine_plan)
    workload = _workload(settings, facts, log)
    shape = ModelShape.from_config(facts.model_config)
    flops = workload_flops(shape, [(r.prompt_len, r.output_len) for r in workload.requests])
    rates = RateSamples(shape, facts.dtype, facts.device) if settings.measure_ceiling else None

    def run(plan: ConfigPlan, label: str, timed: bool = True) -> RunResult:
        profiled = profiles is not None and timed and plan.kind in MODES
        profiler = (
            profiles.setdefault(plan.name, cProfile.Profile()) if profiles is not None and profiled else None
        )
        return _run_logged(plan, label, settings, facts, workload, factory, log, profiler)

    if rates is not None:
        first = compute_ceiling(flops, rates.first)
        log(
            f"compute ceiling: {first['tokens_per_s']:.0f} tokens/s ({rates.first['flops_per_s'] / 1e9:.0f} "
            f"GFLOP/s {rates.first['dtype']} matmul, first of the measurements between runs)"
        )
        rates.measure()
    if settings.warmup_run and first_engine_plan is not None:  # its result is thrown away
        run(first_engine_plan, f"{first_engine_plan.name} (warm-up, untimed)", timed=False)
        if rates is not None:
            rates.measure()
    runs = _timed_runs(plans, settings.repeat, run, rates)
    results = [median_run(runs[plan.name]) for plan in plans]
    for result in results:
        if result.steps:
            result.extra["prefill_flops"] = prefill_flops(result.steps, shape)
    return build_report(
        settings=settings,
        workload=workload,
        results=results,
        ceiling=rates.ceiling(flops, results) if rates is not None else None,
        model_info={
            "model": settings.engine.model or "default",
            "hf_dir": str(facts.hf_dir) if facts.hf_dir is not None else None,
            "dtype": str(facts.dtype).replace("torch.", ""),
            "device": facts.device,
            "non_embedding_params": shape.non_embedding_params,
            "active_params": shape.active_params,
            "max_model_len": facts.max_model_len,
            "kv_cache_tokens": facts.kv_cache_tokens,
            "max_num_batched_tokens": facts.max_num_batched_tokens,
        },
        flops=flops,
    )


def _model_facts(
    settings: BenchSettings, factory: EngineFactory, probe_plan: ConfigPlan | None
) -> ModelFacts:
    """What the bench needs of the model (`model_facts`), from the engine options of the first
    batchgen configuration.

    Raises:
        BenchInputError: the engine cannot start (a missing model, bad options), as `batchgen run` says.
    """
    from batchgen.model.loading.architectures import ModelNotFoundError

    probe = engine_config_for(settings, probe_plan) if probe_plan is not None else None
    try:
        return model_facts(settings.engine, factory, probe)
    except (ModelNotFoundError, ValueError) as exc:  # as `batchgen run` does: a usage error
        model = settings.engine.model or "(default)"
        raise BenchInputError(f"cannot start the engine for model {model}: {exc}") from exc


def _workload(settings: BenchSettings, facts: ModelFacts, log: Callable[[str], None]) -> Workload:
    """The bench's workload for this model, logged with its sizes and any warning.

    Raises:
        BenchInputError: a job file or trace is missing, naming `--dist`.
    """
    try:
        workload = bench_workload(settings.workload, facts.tokenizer, facts.model_config, facts.max_model_len)
    except FileNotFoundError as exc:
        raise BenchInputError(f"--dist {settings.workload.dist}: {exc}") from exc
    log(
        f"workload {workload.name}: {len(workload.requests)} requests, {workload.total_prompt_tokens} prompt + "
        f"{workload.total_output_tokens} output tokens"
    )
    for warning in workload.warnings():
        log(warning)
    return workload


def _timed_runs(
    plans: list[ConfigPlan],
    repeat: int,
    run: Callable[[ConfigPlan, str], RunResult],
    rates: RateSamples | None,
) -> dict[str, list[RunResult]]:
    """`repeat` rounds of every configuration, each round starting one configuration later (so no
    configuration always runs first, or always right after the Hugging Face baselines, whose memory
    and cache state the next run inherits). With `rates`, a sample after each run, and each run's
    `extra` holds the mean of the samples on either side of it."""
    runs: dict[str, list[RunResult]] = {plan.name: [] for plan in plans}
    for round_index in range(repeat):
        shift = round_index % len(plans)
        for plan in plans[shift:] + plans[:shift]:
            label = plan.name if repeat == 1 else f"{plan.name} (run {round_index + 1}/{repeat})"
            result = run(plan, label)
            if rates is not None:
                before, after = rates.samples[-1], rates.measure()
                result.extra["matmul_flops_per_s"] = (before[0] + after[0]) / 2
                result.extra["memory_bytes_per_s"] = (before[1] + after[1]) / 2
            runs[plan.name].append(result)
    return runs


def _run_logged(
    plan: ConfigPlan,
    label: str,
    settings: BenchSettings,
    facts: ModelFacts,
    workload: Workload,
    factory: EngineFactory,
    log: Callable[[str], None],
    profiler: cProfile.Profile | None = None,
) -> RunResult:
    """One run of one configuration (its engine steps under `profiler` when given); a failure is
    recorded in the result, not raised."""
    log(f"running {label} ...")
    started = time.perf_counter()
    try:
        with ResourceMonitor() as monitor:
            result = _run_one(plan, settings, facts, workload, factory, monitor, profiler)
        # The peers ran in processes of their own: their resources are measured there.
        if not result.skipped and plan.kind not in _OWN_PROCESSES:
            result.resources = monitor.result()
    except Exception as exc:  # keep the other configurations' results
        log(traceback.format_exc())
        result = RunResult(plan.name, plan.kind, plan.policy, skipped=f"failed: {type(exc).__name__}: {exc}")
        result.extra["failed"] = True
    finally:
        release_memory()
    summary = f"skipped: {result.skipped}" if result.skipped else f"{len(result.requests)} requests"
    log(f"  {label}: {summary} ({time.perf_counter() - started:.1f} s in all, model load included)")
    return result


def median_run(runs: list[RunResult]) -> RunResult:
    """The run with the median wall time (the lower middle one for an even count).

    A failed or skipped run wins over the others, so no failure is hidden by a repeat. With several
    runs, `extra["runs_wall_s"]` and `extra["runs_tail_s"]` list every run's wall time and tail
    (seconds) in run order.
    """
    bad = [r for r in runs if r.skipped]
    if bad or len(runs) == 1:
        return (bad or runs)[0]
    metrics = [summarize(r) for r in runs]
    walls = [m["wall_s"] for m in metrics]
    order = sorted(range(len(runs)), key=walls.__getitem__)
    chosen = runs[order[(len(runs) - 1) // 2]]
    chosen.extra["runs_wall_s"] = [round(w, 3) for w in walls]
    chosen.extra["runs_tail_s"] = [None if m["tail_s"] is None else round(m["tail_s"], 3) for m in metrics]
    which = "median" if len(runs) % 2 else "faster of the two middle runs" if len(runs) > 2 else "faster"
    tails = ", ".join("-" if t is None else f"{t:.1f}" for t in chosen.extra["runs_tail_s"])
    chosen.notes.append(
        f"{chosen.name}: {which} of {len(runs)} runs by wall time; every run: "
        f"{', '.join(f'{w:.1f}' for w in walls)} s (tails {tails} s)"
    )
    return chosen


def _record_kernels(result: RunResult, engine: BenchEngine) -> None:
    """The engine's quantization and kernel choice in `result.extra`: their summary, the memory of the
    second weight layouts it holds (MiB), which the report states next to the speed they buy, and
    the bytes of its weights (the roofline's)."""
    choice = engine.kernel_choice
    result.extra["kernels"] = f"quantization {engine.quantization.summary()}; kernels {choice.summary()}"
    result.extra["weight_bytes"] = engine.weight_bytes  # as run: quantized weights at their bytes
    result.extra["second_layout_mib"] = round(choice.extra_weight_bytes / 2**20, 1)
    result.extra["kernel_choice_s"] = round(choice.seconds, 3)
    result.extra["table_flops_per_s"] = choice.largest_bucket_flops_per_s


def _run_one(
    plan: ConfigPlan,
    settings: BenchSettings,
    facts: ModelFacts,
    workload: Workload,
    factory: EngineFactory,
    monitor: ResourceMonitor,
    profiler: cProfile.Profile | None = None,
) -> RunResult:
    """Build the engine or model of one configuration and run it (inside the open `monitor`; a
    batchgen engine's steps under `profiler` when given)."""
    pad = pad_id(facts.tokenizer)
    if plan.kind in MODES:
        engine = factory(engine_config_for(settings, plan))
        if plan.kind == "continuous":
            aging = settings.engine.aging_steps if plan.policy == MAX_THROUGHPUT else None
            result = run_continuous(
                engine, workload, plan.name, plan.policy or FCFS, aging, monitor, profiler
            )
        else:
            result = run_static(
                engine, workload, settings.static_batch_size, pad, plan.name, monitor, profiler
            )
        if profiler is not None:
            result.notes.append(f"{plan.name}: timed under cProfile (--profile), slower than a plain run")
        _record_kernels(result, engine)
        if (speculation := engine.speculation) is not None:
            result.extra["speculation"] = speculation.describe()
            result.notes.append(f"{plan.name}: {speculation.describe()}")
        return result
    if plan.kind in _OWN_PROCESSES:
        try:
            return _run_peer(plan, settings, facts, workload)
        except BaselineUnavailable as exc:  # one line, no traceback: the cause is the peer's, not the bench's
            return RunResult(plan.name, plan.kind, skipped=str(exc))
        except BaselineRunError as exc:
            result = RunResult(plan.name, plan.kind, skipped=f"failed: {exc}")
            result.extra["failed"] = True
            return result
    if facts.hf_dir is None:
        facts.hf_dir = resolve_hf_dir(settings.engine.model)
    model = load_hf_model(facts.hf_dir, facts.dtype, facts.device)
    if plan.kind == "hf-static":
        return run_hf_static(model, workload, settings.static_batch_size, pad, plan.name, monitor)
    if (reason := hf_cb_unavailable(model)) is not None:
        return RunResult(plan.name, plan.kind, skipped=reason)
    return run_hf_cb(
        model,
        workload,
        max_batch_tokens=facts.max_num_batched_tokens,
        max_num_seqs=settings.engine.max_num_seqs,
        pad_token_id=pad,
        kv_cache_tokens=facts.kv_cache_tokens,
        name=plan.name,
        monitor=monitor,
    )


# The baselines that run in processes of their own (vLLM's child, llama.cpp's server).
_OWN_PROCESSES = ("vllm", "llama.cpp")


def _run_peer(plan: ConfigPlan, settings: BenchSettings, facts: ModelFacts, workload: Workload) -> RunResult:
    """The vLLM or llama.cpp baseline.

    Raises:
        BaselineUnavailable: the peer cannot run here (the configuration is skipped).
        BaselineRunError: it failed (the configuration is failed).
    """
    threads = settings.engine.num_threads or torch.get_num_threads()
    if plan.kind == "llama.cpp":
        from batchgen.model.loading.loader import resolve_model

        sizes = server_plan(
            workload,
            max_num_seqs=settings.engine.max_num_seqs,
            num_threads=threads,
            max_num_batched_tokens=facts.max_num_batched_tokens,
        )
        model = resolve_model(settings.engine.model).gguf  # settings checked that it is a GGUF file
        return run_llamacpp(
            settings.llama_server or "",
            model or "",
            workload,
            sizes,
            name=plan.name,
            timeout_s=settings.llama_server_timeout_s,
        )
    if (reason := offline_reason(workload)) is not None:
        return RunResult(plan.name, plan.kind, skipped=reason)
    if facts.hf_dir is None:
        facts.hf_dir = resolve_hf_dir(settings.engine.model)
    request = child_request(
        workload,
        model_dir=facts.hf_dir,
        dtype=str(facts.dtype).replace("torch.", ""),
        max_model_len=facts.max_model_len,
        max_num_seqs=settings.engine.max_num_seqs,
        max_num_batched_tokens=facts.max_num_batched_tokens,
        gpu_memory_utilization=settings.engine.gpu_memory_utilization if facts.device == "cuda" else None,
    )
    return run_vllm(
        settings.vllm_python or "",
        workload,
        request,
        num_threads=threads,
        name=plan.name,
        timeout_s=settings.vllm_timeout_s,
    )
