"""The bench report: a JSON-ready dict, a Rich table with ratios, and an optional PNG timeline.

JSON layout (`schema` "batchgen-bench/1"):
    command, created, hardware, software, model, engine_options, workload (summary and the
    distribution's parameters), ceiling (FLOPs, the median measured matmul rate and every
    measurement in `matmul.samples_flops_per_s`, seconds, tokens/s, and `memory`: the median
    measured bandwidth, every measurement in `samples_bytes_per_s`, and the weight and KV-cache
    bytes the roofline counts),
    ratio_base (name of the first configuration that ran), and `configurations`: one entry each
    with name, kind, policy, status ("ok", "skipped", "failed"), reason, metrics
    (`metrics.summarize` plus `ceiling_fraction`, against the matmul rate measured around that run,
    `matmul_flops_per_s`; `roofline_s` at the median matmul rate, and `roofline_fraction` against
    the roofline at the rate measured around the run: see `bench.roofline`), ratios (metric / the base's metric, for the
    keys in `RATIO_KEYS`), ratios_vs_vllm (metric / the vLLM baseline's, for the keys in
    `VLLM_RATIO_KEYS`, when a vLLM baseline ran: above 1 in throughput means faster than vLLM),
    extra, notes, and the per-step timeline. `vllm_base` names that vLLM configuration (None when
    none ran) and `software.vllm` its version.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from batchgen.bench.metrics import RunResult, process_peak_rss_mb, summarize

RATIO_KEYS = (
    "output_tokens_per_s",
    "total_tokens_per_s",
    "requests_per_s",
    "ttft_mean_s",
    "ttft_p99_s",
    "e2e_mean_s",
    "e2e_p99_s",
    "tpot_mean_s",
    "wall_s",
    "tail_s",
    "roofline_s",
)

VLLM_RATIO_KEYS = ("output_tokens_per_s", "total_tokens_per_s", "wall_s")

# (label, metric key, format, unit scale); `x` marks rows that show a ratio to the base column.
_ROWS: list[tuple[str, str, str, float, bool]] = [
    ("output tokens/s", "output_tokens_per_s", "{:.1f}", 1, True),
    ("total tokens/s", "total_tokens_per_s", "{:.1f}", 1, True),
    ("requests/s", "requests_per_s", "{:.3f}", 1, True),
    ("compute ceiling reached", "ceiling_fraction", "{:.1%}", 1, False),
    # The least time this configuration's own steps could take (batchgen.bench.roofline): its ratio
    # compares two schedules at equal kernel efficiency.
    ("roofline time, median rates (s)", "roofline_s", "{:.1f}", 1, True),
    ("roofline reached, rate around run", "roofline_fraction", "{:.1%}", 1, False),
    # The machine's matmul rate measured on either side of the run: a slow phase shows here.
    ("matmul GFLOP/s around run", "matmul_flops_per_s", "{:.0f}", 1e-9, False),
    ("wall time (s)", "wall_s", "{:.1f}", 1, True),
    # From the moment fewer than 8 requests are left to the end (`metrics.TAIL_REQUESTS`).
    ("tail: < 8 requests left (s)", "tail_s", "{:.1f}", 1, True),
    (
        "drafts accepted / verified",
        ("spec_decode_num_accepted_tokens", "spec_decode_num_draft_tokens"),
        "{:d}",
        1,
        False,
    ),  # fmt: skip
    ("draft acceptance rate", "spec_decode_acceptance_rate", "{:.1%}", 1, False),
    # Steps that computed prompt tokens / steps of decodes only: which phase a schedule saves in.
    ("prefill / decode steps (s)", ("prefill_step_s", "decode_step_s"), "{:.1f}", 1, False),
    ("TTFT mean (s)", "ttft_mean_s", "{:.2f}", 1, True),
    ("TTFT p50 / p90", ("ttft_p50_s", "ttft_p90_s"), "{:.2f}", 1, False),
    ("TTFT p99 (s)", "ttft_p99_s", "{:.2f}", 1, True),
    ("e2e latency mean (s)", "e2e_mean_s", "{:.2f}", 1, True),
    ("e2e p50 / p90", ("e2e_p50_s", "e2e_p90_s"), "{:.2f}", 1, False),
    ("e2e latency p99 (s)", "e2e_p99_s", "{:.2f}", 1, True),
    ("TPOT mean (ms)", "tpot_mean_s", "{:.1f}", 1000, True),
    ("TPOT p99 (ms)", "tpot_p99_s", "{:.1f}", 1000, False),
    # Equal step counts mean equal work: then a wall-time gap is the machine's noise, not the policy.
    ("steps (forward passes)", "num_steps", "{:d}", 1, False),
    ("batch size mean / max", ("batch_size_mean", "batch_size_max"), "{:.1f}", 1, False),
    ("KV cache peak", "kv_cache_peak", "{:.1%}", 1, False),
    ("preemptions", "preemptions", "{:d}", 1, False),
    ("prefix cache hit rate", "prefix_cache_hit_rate", "{:.1%}", 1, False),
    ("max wait (s)", "max_wait_s", "{:.2f}", 1, False),
    ("max wait (steps) / bound", ("max_wait_steps", "aging_bound_steps"), "{:d}", 1, False),
    ("CPU utilisation", "cpu_percent", "{:.0f}%", 1, False),
    ("GPU util / mem (MiB)", ("gpu_util_percent", "gpu_mem_peak_mb"), "{:.0f}", 1, False),
    ("peak RSS (MiB)", "peak_rss_mb", "{:.0f}", 1, False),
    ("output tokens", "output_tokens", "{:d}", 1, False),
    ("errors", "num_errors", "{:d}", 1, False),
]


def _hardware() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores_available": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _software() -> dict[str, str]:
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def build_report(
    *,
    settings: Any,
    workload: Any,
    results: list[RunResult],
    ceiling: dict[str, Any] | None,
    model_info: dict[str, Any],
    flops: dict[str, float],
) -> dict[str, Any]:
    """Assemble the report dict from the runs (see the module docstring for its layout)."""
    configs: list[dict[str, Any]] = []
    for r in results:
        failed = bool(r.extra.get("failed"))
        entry: dict[str, Any] = {
            "name": r.name,
            "kind": r.kind,
            "policy": r.policy,
            "status": "failed" if failed else ("skipped" if r.skipped else "ok"),
            "reason": r.skipped,
            "metrics": {},
            "ratios": {},
            "extra": {k: v for k, v in r.extra.items() if k != "failed"},
            "notes": list(r.notes),
            "timeline": r.timeline(),
        }
        if not r.skipped:
            m = summarize(r)
            m["ceiling_fraction"] = None
            m["matmul_flops_per_s"] = r.extra.get("matmul_flops_per_s")
            if ceiling is not None and m["wall_s"]:
                # Against the rate measured around this run when there is one (see bench.runner).
                rate = m["matmul_flops_per_s"] or ceiling["matmul"]["flops_per_s"]
                m["ceiling_fraction"] = ceiling["flops"]["total"] / rate / m["wall_s"]
            m["roofline_s"] = r.extra.get("roofline_s")
            own = r.extra.get("roofline_own_rate_s")
            m["roofline_fraction"] = own / m["wall_s"] if own and m["wall_s"] else None
            entry["metrics"] = m
        configs.append(entry)
    base = next((c for c in configs if c["status"] == "ok"), None)
    for c in configs:
        if base is None or c["status"] != "ok":
            continue
        for key in RATIO_KEYS:
            a, b = c["metrics"].get(key), base["metrics"].get(key)
            c["ratios"][key] = a / b if a is not None and b else None
    vllm = next((c for c in configs if c["kind"] == "vllm" and c["status"] == "ok"), None)
    software = _software()
    if vllm is not None:
        software["vllm"] = str(vllm["extra"].get("vllm_version"))
    for c in configs:
        if vllm is None or c["status"] != "ok" or c is vllm:
            continue
        c["ratios_vs_vllm"] = {
            key: (
                a / b
                if (a := c["metrics"].get(key)) is not None and (b := vllm["metrics"].get(key))
                else None
            )
            for key in VLLM_RATIO_KEYS
        }
    return {
        "schema": "batchgen-bench/1",
        "command": " ".join(sys.argv),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hardware": _hardware(),
        "software": software,
        "model": model_info,
        "engine_options": dataclasses.asdict(settings.engine),
        "static_batch_size": settings.static_batch_size,
        "repeat": settings.repeat,
        "warmup_run": settings.warmup_run,
        "workload": workload.summary(),
        "sampled_output_tokens": workload.total_output_tokens,
        "sampled_prompt_tokens": workload.total_prompt_tokens,
        "flops": flops,
        "ceiling": ceiling,
        "process_peak_rss_mb": process_peak_rss_mb(),
        "ratio_base": base["name"] if base else None,
        "vllm_base": vllm["name"] if vllm else None,
        "configurations": configs,
    }


def write_json(report: dict[str, Any], path: str | Path) -> None:
    """Write the report as indented JSON (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")


def _fmt(value: Any, spec: str, scale: float) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if spec == "{:d}":
        return str(int(value))
    return spec.format(value * scale)


def _cell(metrics: dict[str, Any], key: str | tuple[str, ...], spec: str, scale: float) -> str:
    if isinstance(key, tuple):
        return " / ".join(_fmt(metrics.get(k), spec, scale) for k in key)
    return _fmt(metrics.get(key), spec, scale)


def ceiling_line(report: dict[str, Any]) -> str:
    """One line: tokens x FLOPs per token / measured matmul rate = ceiling."""
    c = report.get("ceiling")
    if not c:
        return "compute ceiling: not measured"
    f, mm = c["flops"], c["matmul"]
    samples = mm.get("samples_flops_per_s") or [mm["flops_per_s"]]
    spread = (
        f"median of {len(samples)} measurements between runs, {min(samples) / 1e9:.0f}-{max(samples) / 1e9:.0f}; "
        if len(samples) > 1
        else ""
    )
    return (
        f"compute ceiling: {f['tokens']:,} tokens x {f['per_token'] / 1e9:.3f} GFLOP/token "
        f"(2 x {f['non_embedding_params'] / 1e6:.1f}M non-embedding params + attention + LM head on outputs) "
        f"/ {mm['flops_per_s'] / 1e9:.0f} GFLOP/s ({spread}{mm['dtype']} matmul at the model's shapes, "
        f"{mm['threads']} threads) = {c['seconds']:.1f} s, {c['tokens_per_s']:.0f} tokens/s; each run's "
        "share is against the rate measured around it" + _roofline_text(c.get("memory"))
    )


def _roofline_text(memory: dict[str, Any] | None) -> str:
    if not memory:
        return ""
    samples = memory.get("samples_bytes_per_s") or [memory["bytes_per_s"]]
    return (
        f"; roofline: per step, its FLOPs at the median rate or its bytes (weights "
        f"{memory['weight_bytes'] / 1e6:.0f} MB + KV cache read and written, "
        f"{memory['kv_bytes_per_token'] / 1e3:.1f} kB/token) at {memory['bytes_per_s'] / 1e9:.1f} GB/s "
        f"(memory copy rate, median of {len(samples)}, {min(samples) / 1e9:.1f}-{max(samples) / 1e9:.1f}), "
        "whichever is slower; each run's share against the matmul rate measured around it"
    )


def render(report: dict[str, Any], console: Any = None) -> None:
    """Print the workload line, the ceiling, the comparison table and the notes with Rich."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    w = report["workload"]
    console.print(
        f"[bold]workload[/] {w['name']}: {w['num_requests']} requests, {w['total_prompt_tokens']:,} prompt + "
        f"{w['total_output_tokens']:,} output tokens (input mean {w['input_len'].get('mean', 0):.0f}, "
        f"output mean {w['output_len'].get('mean', 0):.0f}); arrivals {w['params'].get('arrivals')}"
    )
    m = report["model"]
    hw = report["hardware"]
    console.print(
        f"[bold]model[/] {m['model']} ({m['dtype']}, {m['device']}); {hw['cpu']}, "
        f"{hw['cores_available']} cores, {hw['torch_threads']} torch threads"
        + (f", {hw['gpu']}" if "gpu" in hw else "")
    )
    # Left for the terminal to wrap: Rich's own wrapping split numbers from their units.
    console.print(ceiling_line(report), soft_wrap=True, highlight=False)
    base = report.get("ratio_base")
    table = Table(title=f"batchgen bench (ratios against {base})" if base else "batchgen bench")
    table.add_column("metric")
    configs = report["configurations"]
    for c in configs:
        table.add_column(c["name"], justify="right")
    for label, key, spec, scale, with_ratio in _ROWS:
        cells = []
        for c in configs:
            if c["status"] != "ok":
                cells.append(c["status"])
                continue
            text = _cell(c["metrics"], key, spec, scale)
            ratio = c["ratios"].get(key) if with_ratio and isinstance(key, str) else None
            if ratio is not None and c["name"] != base:
                text += f" ({ratio:.2f}x)"
            cells.append(text)
        table.add_row(label, *cells)
        if key == "output_tokens_per_s" and report.get("vllm_base"):
            table.add_row(f"output tokens/s / {report['vllm_base']}", *[_vs_vllm_cell(c) for c in configs])
    held = [
        c["metrics"].get("aging_bound_held")
        for c in configs
        if c["status"] == "ok" and c["metrics"].get("aging_bound_steps")
    ]
    if held:
        table.add_row(
            "aging bound held",
            *[
                _fmt(c["metrics"].get("aging_bound_held"), "", 1) if c["status"] == "ok" else c["status"]
                for c in configs
            ],
        )
    console.print(table)
    kernels: dict[str, dict] = {}  # summary -> the first configuration that ran with it
    for c in configs:
        if c.get("extra", {}).get("kernels"):
            kernels.setdefault(c["extra"]["kernels"], c)
    for summary, c in kernels.items():
        extra = c["extra"]
        layouts = " (--one-weight-layout holds one)" if extra["second_layout_mib"] else ""
        console.print(
            f"kernels ({c['name']}): {summary}{layouts}; chosen in {extra['kernel_choice_s']:.2f} s",
            soft_wrap=True,
            highlight=False,
        )
    for c in configs:
        if c["status"] != "ok":
            console.print(f"[yellow]{c['name']} {c['status']}[/]: {c['reason']}")
        for note in c["notes"]:
            console.print(f"note: {note}")


def _vs_vllm_cell(config: dict[str, Any]) -> str:
    """A configuration's output tokens/s over the vLLM baseline's ("1.00x" for vLLM itself)."""
    if config["status"] != "ok":
        return config["status"]
    if config["kind"] == "vllm":
        return "1.00x"
    ratio = config.get("ratios_vs_vllm", {}).get("output_tokens_per_s")
    return "-" if ratio is None else f"{ratio:.2f}x"


def check_plot_format(path: str | Path) -> None:
    """Check that matplotlib can write `path`'s format (its suffix: png, pdf, svg, ...); call
    `require_matplotlib` first.

    Raises:
        ValueError: no suffix, or one matplotlib cannot write; the message lists the formats.
    """
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in formats:
        given = f"'.{suffix}'" if suffix else "no suffix"
        raise ValueError(
            f"--plot {path} has {given}; name a file ending in .png (or one of: "
            f"{', '.join('.' + f for f in sorted(formats))})"
        )


def require_matplotlib() -> Any:
    """`matplotlib.pyplot` with the non-interactive Agg backend (the `plot` extra).

    Raises:
        RuntimeError: when matplotlib is not installed, saying how to install it.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install 'batchgen[plot]' (or matplotlib)") from exc
    return plt


def plot(report: dict[str, Any], path: str | Path, bin_s: float | None = None) -> None:
    """PNG: running batch size (top) and output tokens/s (bottom) over time, one line per configuration.

    Tokens/s is binned in `bin_s`-second bins (default: the longest wall time / 60).

    Raises:
        RuntimeError: when matplotlib is not installed (`pip install 'batchgen[plot]'`).
    """
    plt = require_matplotlib()
    import numpy as np

    ok = [c for c in report["configurations"] if c["status"] == "ok" and c["timeline"]["t"]]
    longest = max((c["metrics"]["wall_s"] or 0.0 for c in ok), default=1.0) or 1.0
    bin_s = bin_s or max(longest / 60.0, 1e-3)
    fig, (ax_b, ax_t) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for c in ok:
        tl = c["timeline"]
        t = np.asarray(tl["t"])
        ax_b.step(t, tl["num_seqs"], where="pre", label=c["name"], linewidth=1.2)
        edges = np.arange(0.0, t.max() + bin_s, bin_s)
        counts, _ = np.histogram(t, bins=edges, weights=np.asarray(tl["num_generation_tokens"], dtype=float))
        ax_t.step(edges[1:], counts / bin_s, where="pre", label=c["name"], linewidth=1.2)
    ax_b.set_ylabel("running batch size (sequences)")
    ax_t.set_ylabel(f"output tokens/s ({bin_s:.2g} s bins)")
    ax_t.set_xlabel("time since start (s)")
    w = report["workload"]
    fig.suptitle(f"batchgen bench: {w['name']}, {w['num_requests']} requests, {report['model']['dtype']}")
    ax_b.legend(loc="upper right", fontsize="small")
    ax_b.grid(alpha=0.3)
    ax_t.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
