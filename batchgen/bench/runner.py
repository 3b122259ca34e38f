"""Run every configuration of one bench on one workload, in one process, and collect the report.

Configurations, in this order (ratios in the report are against the first one that ran):
    continuous/<policy>  batchgen's continuous batching (`bench.continuous`), once per `--policy`,
                         each in a fresh engine; once per `--speculative-method` item too, named
                         continuous/<policy>+ngram with speculative decoding ("none": without)
    static/b<N>          padded static batches of N through batchgen's engine (`bench.static`)
    hf-static/b<N>       transformers `generate` in padded static batches of N (`bench.hf_baselines`)
    hf-cb                transformers' continuous batching
    vllm                 vLLM's `LLM.generate` in its own interpreter (`bench.vllm_baseline`)
`--mode static,continuous` puts static first. Every configuration gets a fresh engine or model, a
short untimed warm-up, the same workload, dtype and thread count. The workload's compute ceiling
(`ceiling.workload_flops` / `ceiling.measure_matmul_rate`) uses the matmul rate measured before the
first run and again after every run: on a shared machine the rate moves by 2x within minutes, so each
run's share of the ceiling is taken against the rate measured on either side of it. With the
ceiling, the memory bandwidth is measured at the same points, and each batchgen run's roofline
(`roofline.roofline_seconds`: per step, its FLOPs at a matmul rate or its bytes at a bandwidth,
whichever is slower) goes in its `extra`: `roofline_s` at the median rates (comparable between
configurations) and `roofline_own_rate_s` at the matmul rate measured around the run and the median
bandwidth (its share reached).
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from batchgen.bench.ceiling import ModelShape, compute_ceiling, measure_matmul_rate, workload_flops
from batchgen.bench.continuous import run_continuous
from batchgen.bench.hf_baselines import (
    hf_cb_unavailable,
    load_hf_model,
    resolve_hf_dir,
    run_hf_cb,
    run_hf_static,
)
from batchgen.bench.metrics import ResourceMonitor, RunResult, release_memory, summarize
from batchgen.bench.model_facts import EngineFactory, ModelFacts, bench_workload, model_facts, pad_id
from batchgen.bench.report import build_report
from batchgen.bench.roofline import (
    kv_bytes_per_token,
    measure_memory_bandwidth,
    roofline_seconds,
    weight_bytes,
)
from batchgen.bench.spec import BenchInputError, WorkloadSpec
from batchgen.bench.static import run_static
from batchgen.bench.vllm_baseline import (
    VllmRunError,
    VllmUnavailable,
    child_request,
    offline_reason,
    run_vllm,
)
from batchgen.bench.workloads import Workload
from batchgen.config import POLICIES, SPECULATIVE_FIELDS, SPECULATIVE_METHODS, EngineConfig

MODES = ("continuous", "static")
BASELINES = ("hf-static", "hf-cb", "vllm")


@dataclass
class BenchSettings:
    """One bench: the workload, the configurations to compare and the engine options they share.

    Attributes:
        workload: what to run.
        modes: subset of `MODES`, in report order.
        policies: scheduling policies for the continuous mode (each runs once).
        baselines: subset of `BASELINES`.
        static_batch_size: requests per static batch (static and hf-static).
        engine: engine options; `policy` and `enable_prefix_caching` are set per configuration.
        measure_ceiling: time the matmul benchmark for the compute ceiling (about a second).
        repeat: runs of each configuration, interleaved round-robin so that a slow spell of the
            machine hits every configuration alike; the report shows each configuration's median
            run by wall time and lists every run's wall time.
        warmup_run: run the first batchgen configuration once, untimed, before the timed runs.
            The process's one-time costs (oneDNN generates a kernel for each new batch shape, about
            1-9 ms each; allocator growth) otherwise land on whichever configuration runs first:
            it took about 15% longer than later runs of the same configuration.
        vllm_python: the interpreter of a virtual environment with vLLM (baseline `vllm` only).
        vllm_timeout_s: stop a vLLM run after this many seconds (None = never).
        speculative_methods: the continuous configurations run once per item: None without
            speculative decoding, "ngram" with it (the other speculative options from `engine`).
    """

    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    modes: list[str] = field(default_factory=lambda: ["continuous", "static"])
    policies: list[str] = field(default_factory=lambda: ["fcfs"])
    baselines: list[str] = field(default_factory=list)
    static_batch_size: int = 8
    engine: EngineConfig = field(default_factory=EngineConfig)
    measure_ceiling: bool = True
    repeat: int = 1
    warmup_run: bool = True
    vllm_python: str | None = None
    vllm_timeout_s: float | None = None
    speculative_methods: list[str | None] = field(default_factory=lambda: [None])

    def __post_init__(self) -> None:
        for name, values, allowed in (
            ("mode", self.modes, MODES),
            ("policy", self.policies, POLICIES),
            ("baselines", self.baselines, BASELINES),
        ):
            bad = [v for v in values if v not in allowed]
            if bad:
                raise ValueError(f"{name} must be a comma list of {', '.join(allowed)}; got {', '.join(bad)}")
        if not self.modes and not self.baselines:
            raise ValueError("nothing to run: give at least one --mode or --baselines")
        if "continuous" in self.modes and not self.policies:
            raise ValueError("mode continuous needs at least one --policy")
        if "continuous" not in self.modes and [p for p in self.policies if p != "fcfs"]:
            # Static batches and the baselines run in arrival order: the policy would be ignored.
            raise ValueError(
                f"--policy {','.join(self.policies)} applies to --mode continuous only; add continuous "
                "to --mode or drop --policy"
            )
        bad = [m for m in self.speculative_methods if m not in (None, *SPECULATIVE_METHODS)]
        if bad or not self.speculative_methods:
            raise ValueError(
                f"speculative method must be a comma list of none, {', '.join(SPECULATIVE_METHODS)}; "
                f"got {', '.join(map(str, bad)) or 'nothing'}"
            )
        if any(self.speculative_methods) and self.engine.speculative_method is None:
            raise ValueError("the engine options need speculative_method set when a configuration speculates")
        if self.static_batch_size < 1:
            raise ValueError(f"static_batch_size must be >= 1, got {self.static_batch_size}")
        if self.repeat < 1:
            raise ValueError(f"repeat must be >= 1, got {self.repeat}")
        if "vllm" in self.baselines and not self.vllm_python:
            raise ValueError(
                "--baselines vllm needs --vllm-python PATH, the python of a virtual environment with "
                "vLLM installed (see docs/vllm.md)"
            )
        if self.vllm_timeout_s is not None and not self.vllm_timeout_s > 0:
            raise ValueError(
                f"vllm timeout must be > 0 seconds (0 on the command line = never), got {self.vllm_timeout_s}"
            )
        if self.vllm_python and "vllm" not in self.baselines:
            raise ValueError("--vllm-python applies to --baselines vllm only; add vllm to --baselines")


@dataclass(frozen=True)
class ConfigPlan:
    """One configuration to run."""

    name: str
    kind: str
    policy: str | None = None
    speculative: str | None = None


def plan_configs(settings: BenchSettings) -> list[ConfigPlan]:
    """The configurations of `settings`, in run and report order."""
    b = settings.static_batch_size
    plans: list[ConfigPlan] = []
    for mode in settings.modes:
        if mode == "continuous":
            plans += [
                ConfigPlan(f"continuous/{p}" + (f"+{m}" if m else ""), "continuous", p, m)
                for p in settings.policies
                for m in settings.speculative_methods
            ]
        else:
            plans.append(ConfigPlan(f"static/b{b}", "static", "fcfs"))
    for base in settings.baselines:
        plans.append(
            ConfigPlan(f"hf-static/b{b}", "hf-static") if base == "hf-static" else ConfigPlan(base, base)
        )
    return plans


def default_engine_factory(config: EngineConfig) -> Any:
    """A real `LLMEngine` (imported late so `batchgen bench --help` stays fast)."""
    from batchgen.engine.llm_engine import LLMEngine

    return LLMEngine(config)


def engine_config_for(settings: BenchSettings, plan: ConfigPlan) -> EngineConfig:
    """The engine options of one batchgen configuration: the policy, prefix caching off for static,
    and the speculative options only for a configuration that speculates."""
    caching = settings.engine.enable_prefix_caching and plan.kind != "static"
    config = dataclasses.replace(settings.engine, policy=plan.policy or "fcfs", enable_prefix_caching=caching)
    if plan.speculative is None and config.speculative_method is not None:
        off = dict.fromkeys(SPECULATIVE_FIELDS)
        config = dataclasses.replace(config, speculative_method=None, **off)
    return config


def run_bench(
    settings: BenchSettings,
    engine_factory: EngineFactory | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run every configuration of `settings` and return the report dict (see `bench.report`).

    Every configuration builds its own engine or model inside its `ResourceMonitor` (so its peak
    RSS includes loading) and frees it afterwards. A configuration that raises is recorded as
    failed (with the error) and the bench goes on; an unavailable baseline is recorded as skipped
    with the reason. With `repeat` > 1 the configurations run round-robin, each round starting one
    configuration later, and each configuration's median run is reported.

    Raises:
        BenchInputError: before any timed run, when the engine cannot start with these options
            (e.g. `device` cuda without CUDA, a missing model) or the workload cannot be built
            (a missing job file or trace, a job file without a usable row).
    """
    from batchgen.model.loading.architectures import ModelNotFoundError

    factory = engine_factory or default_engine_factory
    if settings.engine.num_threads is not None:
        torch.set_num_threads(settings.engine.num_threads)
    plans = plan_configs(settings)
    first_engine_plan = next((plan for plan in plans if plan.kind in MODES), None)
    probe = engine_config_for(settings, first_engine_plan) if first_engine_plan is not None else None
    try:
        facts = model_facts(settings.engine, factory, probe)
    except (ModelNotFoundError, ValueError) as exc:  # as `batchgen run` does: a usage error
        model = settings.engine.model or "(default)"
        raise BenchInputError(f"cannot start the engine for model {model}: {exc}") from exc
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
    shape = ModelShape.from_config(facts.model_config)
    flops = workload_flops(shape, [(r.prompt_len, r.output_len) for r in workload.requests])
    first_rate = measure_matmul_rate(shape, facts.dtype, facts.device) if settings.measure_ceiling else None
    dtype_bytes = facts.dtype.itemsize
    # (matmul FLOP/s, memory bytes/s): first, after the warm-up, then after every timed run
    rates: list[tuple[float, float]] = []

    def measure_rates() -> tuple[float, float] | None:
        if first_rate is None:
            return None
        flops_per_s = (
            measure_matmul_rate(shape, facts.dtype, facts.device)["flops_per_s"]
            if rates
            else first_rate["flops_per_s"]
        )
        rates.append((flops_per_s, measure_memory_bandwidth(facts.device)["bytes_per_s"]))
        return rates[-1]

    before = measure_rates()
    if first_rate is not None:
        first = compute_ceiling(flops, first_rate)
        log(
            f"compute ceiling: {first['tokens_per_s']:.0f} tokens/s ({first_rate['flops_per_s'] / 1e9:.0f} "
            f"GFLOP/s {first_rate['dtype']} matmul, first of the measurements between runs)"
        )
    if settings.warmup_run and first_engine_plan is not None:  # its result is thrown away
        label = f"{first_engine_plan.name} (warm-up, untimed)"
        _run_logged(first_engine_plan, label, settings, facts, workload, factory, log)
        before = measure_rates()
    runs: dict[str, list[RunResult]] = {plan.name: [] for plan in plans}
    for round_index in range(settings.repeat):
        # Each round starts one configuration later, so no configuration always runs first or always
        # right after the Hugging Face baselines (whose memory and cache state the next run inherits).
        shift = round_index % len(plans)
        for plan in plans[shift:] + plans[:shift]:
            label = (
                plan.name
                if settings.repeat == 1
                else f"{plan.name} (run {round_index + 1}/{settings.repeat})"
            )
            result = _run_logged(plan, label, settings, facts, workload, factory, log)
            after = measure_rates()
            if before is not None and after is not None:
                result.extra["matmul_flops_per_s"] = (before[0] + after[0]) / 2
                result.extra["memory_bytes_per_s"] = (before[1] + after[1]) / 2
            before = after
            runs[plan.name].append(result)
    results = [median_run(runs[plan.name]) for plan in plans]
    ceiling = None
    if first_rate is not None:
        # The headline ceiling: the median of every measurement (each run's own rate is in its extra).
        flops_samples = [r[0] for r in rates]
        bytes_samples = [r[1] for r in rates]
        median_rate = dict(first_rate, flops_per_s=_median(flops_samples), samples_flops_per_s=flops_samples)
        ceiling = compute_ceiling(flops, median_rate)
        ceiling["memory"] = {
            "bytes_per_s": _median(bytes_samples),
            "samples_bytes_per_s": bytes_samples,
            "weight_bytes": weight_bytes(shape, dtype_bytes),
            "kv_bytes_per_token": kv_bytes_per_token(shape, dtype_bytes),
        }
        bandwidth = ceiling["memory"]["bytes_per_s"]
        for result in results:
            own_rate = result.extra.get("matmul_flops_per_s")
            if result.skipped or own_rate is None or not result.steps:  # vllm: no steps to price
                continue
            # At the median rates, so that two configurations' rooflines differ only by their
            # schedules; the share reached is against the matmul rate measured around the run. The
            # bandwidth is the median for both: single copies read up to 1.7x the median here
            # (40.6-80.5 GB/s) after some runs, which would have moved a run's share by itself.
            result.extra["roofline_s"] = roofline_seconds(
                result.steps, shape, dtype_bytes, median_rate["flops_per_s"], bandwidth
            )
            result.extra["roofline_own_rate_s"] = roofline_seconds(
                result.steps, shape, dtype_bytes, own_rate, bandwidth
            )

    return build_report(
        settings=settings,
        workload=workload,
        results=results,
        ceiling=ceiling,
        model_info={
            "model": settings.engine.model or "default",
            "hf_dir": str(facts.hf_dir) if facts.hf_dir is not None else None,
            "dtype": str(facts.dtype).replace("torch.", ""),
            "device": facts.device,
            "non_embedding_params": shape.non_embedding_params,
            "max_model_len": facts.max_model_len,
            "kv_cache_tokens": facts.kv_cache_tokens,
            "max_num_batched_tokens": facts.max_num_batched_tokens,
        },
        flops=flops,
    )


def _median(values: list[float]) -> float:
    """The median (the lower middle value for an even count)."""
    return sorted(values)[(len(values) - 1) // 2]


def _run_logged(
    plan: ConfigPlan,
    label: str,
    settings: BenchSettings,
    facts: ModelFacts,
    workload: Workload,
    factory: EngineFactory,
    log: Callable[[str], None],
) -> RunResult:
    """One run of one configuration; a failure is recorded in the result, not raised."""
    log(f"running {label} ...")
    started = time.perf_counter()
    try:
        with ResourceMonitor() as monitor:
            result = _run_one(plan, settings, facts, workload, factory, monitor)
        if not result.skipped and plan.kind != "vllm":  # vllm's ran in other processes: it has its own
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
    runs, `extra["runs_wall_s"]` lists every run's wall time (seconds) in run order.
    """
    bad = [r for r in runs if r.skipped]
    if bad or len(runs) == 1:
        return (bad or runs)[0]
    walls = [summarize(r)["wall_s"] for r in runs]
    order = sorted(range(len(runs)), key=walls.__getitem__)
    chosen = runs[order[(len(runs) - 1) // 2]]
    chosen.extra["runs_wall_s"] = [round(w, 3) for w in walls]
    which = "median" if len(runs) % 2 else "faster of the two middle runs" if len(runs) > 2 else "faster"
    chosen.notes.append(
        f"{chosen.name}: {which} of {len(runs)} runs by wall time; every run: "
        f"{', '.join(f'{w:.1f}' for w in walls)} s"
    )
    return chosen


def _record_kernels(result: RunResult, engine: Any) -> None:
    """The engine's kernel choice in `result.extra`: its summary and the memory of the second weight
    layouts it holds (MiB), which the report states next to the speed they buy."""
    runner = getattr(engine, "runner", None)
    choice = getattr(runner, "kernel_choice", None)
    if choice is None:
        return
    result.extra["kernels"] = choice.summary()
    result.extra["second_layout_mib"] = round(choice.extra_weight_bytes / 2**20, 1)
    result.extra["kernel_choice_s"] = round(choice.seconds, 3)


def _run_one(
    plan: ConfigPlan,
    settings: BenchSettings,
    facts: ModelFacts,
    workload: Workload,
    factory: EngineFactory,
    monitor: ResourceMonitor,
) -> RunResult:
    """Build the engine or model of one configuration and run it (inside the open `monitor`)."""
    pad = pad_id(facts.tokenizer)
    if plan.kind in MODES:
        engine = factory(engine_config_for(settings, plan))
        if plan.kind == "continuous":
            aging = settings.engine.aging_steps if plan.policy == "max-throughput" else None
            result = run_continuous(engine, workload, plan.name, plan.policy or "fcfs", aging, monitor)
        else:
            result = run_static(engine, workload, settings.static_batch_size, pad, plan.name, monitor)
        _record_kernels(result, engine)
        if (speculation := getattr(engine, "speculation", None)) is not None:
            result.extra["speculation"] = speculation.describe()
            result.notes.append(f"{plan.name}: {speculation.describe()}")
        return result
    if facts.hf_dir is None:
        facts.hf_dir = resolve_hf_dir(settings.engine.model)
    if plan.kind == "vllm":
        return _run_vllm(plan, settings, facts, workload)
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


def _run_vllm(plan: ConfigPlan, settings: BenchSettings, facts: ModelFacts, workload: Workload) -> RunResult:
    """The vLLM baseline; a vLLM that cannot run is skipped and one that fails is failed, each with
    its one-line reason (no traceback: the cause is vLLM's or its environment's, not the bench's)."""
    if (reason := offline_reason(workload)) is not None:
        return RunResult(plan.name, plan.kind, skipped=reason)
    request = child_request(
        workload,
        model_dir=facts.hf_dir,
        dtype=str(facts.dtype).replace("torch.", ""),
        max_model_len=facts.max_model_len,
        max_num_seqs=settings.engine.max_num_seqs,
        max_num_batched_tokens=facts.max_num_batched_tokens,
        gpu_memory_utilization=settings.engine.gpu_memory_utilization if facts.device == "cuda" else None,
    )
    try:
        return run_vllm(
            settings.vllm_python or "",
            workload,
            request,
            num_threads=settings.engine.num_threads or torch.get_num_threads(),
            name=plan.name,
            timeout_s=settings.vllm_timeout_s,
        )
    except VllmUnavailable as exc:
        return RunResult(plan.name, plan.kind, skipped=str(exc))
    except VllmRunError as exc:
        result = RunResult(plan.name, plan.kind, skipped=f"failed: {exc}")
        result.extra["failed"] = True
        return result
