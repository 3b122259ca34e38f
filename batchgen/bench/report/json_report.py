"""The bench report: a JSON-ready dict (printed as a table by `bench.table`, plotted by `bench.plot`).

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
    the roofline at the rate measured around the run: see `report.roofline`), ratios (metric / the base's metric, for the
    keys in `RATIO_KEYS`), for each peer engine of `PEERS` that ran (vLLM, llama.cpp)
    ratios_vs_<stem> (metric / that baseline's, for the keys in `PEER_RATIO_KEYS`: above 1 in
    throughput means faster than the peer; `ratios_vs_vllm`, `ratios_vs_llamacpp`), extra, notes,
    and the per-step timeline. `<stem>_base` names that peer's configuration (None when none ran:
    `vllm_base`, `llamacpp_base`) and `software.<kind>` its version (`software.vllm`,
    `software["llama.cpp"]`).
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

from batchgen.bench.report.metrics import RunResult, process_peak_rss_mb, summarize

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
    "tail_output_tokens_per_s",
    "roofline_s",
)

PEER_RATIO_KEYS = ("output_tokens_per_s", "total_tokens_per_s", "wall_s")

# The peer engines a bench runs beside batchgen: configuration kind -> (the stem of its report keys,
# the `extra` key of its version).
PEERS = {"vllm": ("vllm", "vllm_version"), "llama.cpp": ("llamacpp", "llama_cpp_build")}


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
    configs = [_config_entry(r, ceiling) for r in results]
    base = next((c for c in configs if c["status"] == "ok"), None)
    peers = {
        kind: next((c for c in configs if c["kind"] == kind and c["status"] == "ok"), None) for kind in PEERS
    }
    _add_ratios(configs, base, peers)
    software = _software()
    for kind, peer in peers.items():
        if peer is not None:
            software[kind] = str(peer["extra"].get(PEERS[kind][1]))
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
        **{f"{PEERS[kind][0]}_base": peer["name"] if peer else None for kind, peer in peers.items()},
        "configurations": configs,
    }


def _config_entry(r: RunResult, ceiling: dict[str, Any] | None) -> dict[str, Any]:
    """One configuration's report entry (see the module docstring); `ratios` are added later."""
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
            # Against the rate measured around this run when there is one (see report.rates).
            rate = m["matmul_flops_per_s"] or ceiling["matmul"]["flops_per_s"]
            m["ceiling_fraction"] = ceiling["flops"]["total"] / rate / m["wall_s"]
        m["roofline_s"] = r.extra.get("roofline_s")
        m |= _prefill_rate(r.extra, m["prefill_step_s"])
        own = r.extra.get("roofline_own_rate_s")
        m["roofline_fraction"] = own / m["wall_s"] if own and m["wall_s"] else None
        entry["metrics"] = m
    return entry


def _prefill_rate(extra: dict[str, Any], prefill_step_s: float | None) -> dict[str, float | None]:
    """`prefill_flops_per_s`: the model FLOPs of the prefill steps over their seconds; and
    `prefill_table_fraction`: that over the kernel table's rate for the model's linears at the
    largest row bucket (the registry's own measure of the machine, `table_flops_per_s`)."""
    flops, table_rate = extra.get("prefill_flops"), extra.get("table_flops_per_s")
    rate = flops / prefill_step_s if flops and prefill_step_s else None
    return {
        "prefill_flops_per_s": rate,
        "prefill_table_fraction": rate / table_rate if rate and table_rate else None,
    }


def _add_ratios(configs: list[dict[str, Any]], base: dict | None, peers: dict[str, dict | None]) -> None:
    """Each finished configuration's `ratios` (its `RATIO_KEYS` metrics over `base`'s) and, for each
    peer of `peers` (kind -> its configuration, None when it did not run), its `ratios_vs_<stem>`
    (`PEER_RATIO_KEYS` over the peer's)."""
    for c in configs:
        if c["status"] != "ok":
            continue
        if base is not None:
            for key in RATIO_KEYS:
                a, b = c["metrics"].get(key), base["metrics"].get(key)
                c["ratios"][key] = a / b if a is not None and b else None
        for kind, peer in peers.items():
            if peer is not None and c is not peer:
                c[f"ratios_vs_{PEERS[kind][0]}"] = {
                    key: (
                        a / b
                        if (a := c["metrics"].get(key)) is not None and (b := peer["metrics"].get(key))
                        else None
                    )
                    for key in PEER_RATIO_KEYS
                }


def write_json(report: dict[str, Any], path: str | Path) -> None:
    """Write the report as indented JSON (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
