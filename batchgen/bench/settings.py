"""One bench's settings (`BenchSettings`, checked at construction) and the configurations they
name, in run and report order (`plan_configs`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from batchgen.bench.baselines.llamacpp import gguf_problem
from batchgen.bench.baselines.processes import executable_problem
from batchgen.bench.spec import WorkloadSpec
from batchgen.config import (
    FCFS,
    POLICY_NAMES,
    QUANTIZATIONS,
    SPECULATIVE_FIELDS,
    SPECULATIVE_METHODS,
    EngineConfig,
)

MODES = ("continuous", "static")
BASELINES = ("hf-static", "hf-cb", "vllm", "llama.cpp")


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
            The process's one-time costs (oneDNN generates a kernel for each new batch shape;
            allocator growth) otherwise land on whichever configuration runs first (measured:
            docs/benchmarks.md).
        vllm_python: the interpreter of a virtual environment with vLLM (baseline `vllm` only).
        vllm_timeout_s: stop a vLLM run after this many seconds (None = never).
        llama_server: the llama.cpp `llama-server` binary (baseline `llama.cpp` only; the model
            must be a GGUF file).
        llama_server_timeout_s: the most seconds a llama.cpp request may wait for its answer
            (None = no limit).
        speculative_methods: the continuous configurations run once per item: None without
            speculative decoding, "ngram" with it (the other speculative options from `engine`).
        quantizations: the continuous configurations run once per item too (named
            <config>+<method> where there are several); empty: `engine.quantization` alone.
    """

    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    modes: list[str] = field(default_factory=lambda: ["continuous", "static"])
    policies: list[str] = field(default_factory=lambda: [FCFS])
    baselines: list[str] = field(default_factory=list)
    static_batch_size: int = 8
    engine: EngineConfig = field(default_factory=EngineConfig)
    measure_ceiling: bool = True
    repeat: int = 1
    warmup_run: bool = True
    vllm_python: str | None = None
    vllm_timeout_s: float | None = None
    llama_server: str | None = None
    llama_server_timeout_s: float | None = None
    speculative_methods: list[str | None] = field(default_factory=lambda: [None])
    quantizations: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.quantizations = list(self.quantizations) or [self.engine.quantization]
        bad = [q for q in self.quantizations if q not in QUANTIZATIONS]
        if bad:
            raise ValueError(
                f"quantization must be a comma list of {', '.join(QUANTIZATIONS)}; got {', '.join(bad)}"
            )
        for name, values, allowed in (
            ("mode", self.modes, MODES),
            ("policy", self.policies, POLICY_NAMES),
            ("baselines", self.baselines, BASELINES),
        ):
            bad = [v for v in values if v not in allowed]
            if bad:
                raise ValueError(f"{name} must be a comma list of {', '.join(allowed)}; got {', '.join(bad)}")
        if not self.modes and not self.baselines:
            raise ValueError("nothing to run: give at least one --mode or --baselines")
        if "continuous" in self.modes and not self.policies:
            raise ValueError("mode continuous needs at least one --policy")
        if "continuous" not in self.modes and [p for p in self.policies if p != FCFS]:
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
        if self.vllm_python and (problem := executable_problem(self.vllm_python)) is not None:
            # A path that cannot run is a typo: said before any run, not as a skipped column after.
            raise ValueError(f"--vllm-python {self.vllm_python} {problem}; give the python of a "
                             "virtual environment with vLLM installed (see docs/vllm.md)")  # fmt: skip
        self._check_llama_cpp()
        if "static" in self.modes and self.static_batch_size > self.engine.max_num_seqs:
            raise ValueError(
                f"--static-batch-size {self.static_batch_size} is more than --max-num-seqs "
                f"{self.engine.max_num_seqs}, the most requests a step runs; lower one or raise the other"
            )

    def _check_llama_cpp(self) -> None:
        """The llama.cpp baseline's options (see the attributes)."""
        if "llama.cpp" in self.baselines:
            if not self.llama_server:
                raise ValueError(
                    "--baselines llama.cpp needs --llama-server PATH, llama.cpp's llama-server binary "
                    "(see docs/llamacpp.md)"
                )
            if (problem := executable_problem(self.llama_server)) is not None:
                raise ValueError(f"--llama-server {self.llama_server} {problem}; give the path of "
                                 "llama.cpp's llama-server binary (see docs/llamacpp.md)")  # fmt: skip
            if (problem := gguf_problem(self.engine.model)) is not None:
                raise ValueError(problem)
        elif self.llama_server:
            raise ValueError(
                "--llama-server applies to --baselines llama.cpp only; add llama.cpp to --baselines"
            )
        if self.llama_server_timeout_s is not None and not self.llama_server_timeout_s > 0:
            raise ValueError(
                "llama-server timeout must be > 0 seconds (0 on the command line = never), "
                f"got {self.llama_server_timeout_s}"
            )


@dataclass(frozen=True)
class ConfigPlan:
    """One configuration to run."""

    name: str
    kind: str
    policy: str | None = None
    speculative: str | None = None
    quantization: str | None = None  # None: the engine options'


def plan_configs(settings: BenchSettings) -> list[ConfigPlan]:
    """The configurations of `settings`, in run and report order."""
    b = settings.static_batch_size
    plans: list[ConfigPlan] = []
    for mode in settings.modes:
        if mode == "continuous":
            several = len(settings.quantizations) > 1
            plans += [
                ConfigPlan(
                    f"continuous/{p}" + (f"+{m}" if m else "") + (f"+{q}" if several else ""),
                    "continuous",
                    p,
                    m,
                    q,
                )
                for p in settings.policies
                for m in settings.speculative_methods
                for q in settings.quantizations
            ]
        else:
            plans.append(ConfigPlan(f"static/b{b}", "static", FCFS))
    for base in settings.baselines:
        plans.append(
            ConfigPlan(f"hf-static/b{b}", "hf-static") if base == "hf-static" else ConfigPlan(base, base)
        )
    return plans


def engine_config_for(settings: BenchSettings, plan: ConfigPlan) -> EngineConfig:
    """The engine options of one batchgen configuration: the policy, prefix caching off for static,
    its quantization, and the speculative options only for a configuration that speculates."""
    caching = settings.engine.enable_prefix_caching and plan.kind != "static"
    quantization = plan.quantization or settings.quantizations[0]
    config = dataclasses.replace(
        settings.engine, policy=plan.policy or FCFS, enable_prefix_caching=caching, quantization=quantization
    )
    if plan.speculative is None and config.speculative_method is not None:
        off: dict[str, Any] = dict.fromkeys(SPECULATIVE_FIELDS)  # each one None
        config = dataclasses.replace(config, speculative_method=None, **off)
    return config
