"""The bench report as a Rich table: the workload and model lines, the compute ceiling, every
configuration's metrics side by side with ratios against the first one, and the notes."""

from __future__ import annotations

from typing import Any

from batchgen.bench.report.json_report import PEERS

# (label, metric key, format, unit scale); `x` marks rows that show a ratio to the base column.
# (label, metric key or (numerator, denominator) keys, format, scale, whether a ratio is shown)
_ROWS: list[tuple[str, str | tuple[str, ...], str, float, bool]] = [
    ("output tokens/s", "output_tokens_per_s", "{:.1f}", 1, True),
    ("total tokens/s", "total_tokens_per_s", "{:.1f}", 1, True),
    ("requests/s", "requests_per_s", "{:.3f}", 1, True),
    ("compute ceiling reached", "ceiling_fraction", "{:.1%}", 1, False),
    # The least time this configuration's own steps could take (batchgen.bench.report.roofline): its ratio
    # compares two schedules at equal kernel efficiency.
    ("roofline time, median rates (s)", "roofline_s", "{:.1f}", 1, True),
    ("roofline reached, rate around run", "roofline_fraction", "{:.1%}", 1, False),
    # The machine's matmul rate measured on either side of the run: a slow phase shows here.
    ("matmul GFLOP/s around run", "matmul_flops_per_s", "{:.0f}", 1e-9, False),
    ("wall time (s)", "wall_s", "{:.1f}", 1, True),
    # From the moment fewer than 8 requests are left to the end (`metrics.TAIL_REQUESTS`).
    ("tail: < 8 requests left (s)", "tail_s", "{:.1f}", 1, True),
    # The tail's speed: two runs' tails can hold different work, so compare this, not their length.
    ("tail: output tokens/s", "tail_output_tokens_per_s", "{:.1f}", 1, True),
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
    # Model FLOPs (linears, attention, LM head) of the prefill steps a second, and that against the
    # kernel table's rate for the model's linears at the largest row bucket.
    ("prefill steps: GFLOP/s", "prefill_flops_per_s", "{:.0f}", 1e-9, False),
    ("prefill: of kernel table's rate", "prefill_table_fraction", "{:.1%}", 1, False),
    # Host time a step outside the forward and the sampler (schedule, inputs, masks, update,
    # outputs): what a faster device cannot shorten. Its parts, and at the widest decode batch.
    ("host time a step (ms)", "host_ms_per_step", "{:.2f}", 1, False),
    ("host time: share of step time", "host_share", "{:.1%}", 1, False),
    (
        "host: schedule / inputs / update (ms)",
        ("schedule_ms_per_step", "inputs_ms_per_step", "update_ms_per_step"),
        "{:.2f}",
        1,
        False,
    ),  # fmt: skip
    ("host: token masks (ms)", "mask_ms_per_step", "{:.2f}", 1, False),
    ("host at widest decode batch (ms)", "host_ms_full_decode", "{:.2f}", 1, False),
    ("widest decode batch (mean rows)", "full_decode_rows", "{:.1f}", 1, False),
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
        f"(2 x {_params_text(f)} + attention + LM head on outputs) "
        f"/ {mm['flops_per_s'] / 1e9:.0f} GFLOP/s ({spread}{mm['dtype']} matmul at the model's shapes, "
        f"{mm['threads']} threads) = {c['seconds']:.1f} s, {c['tokens_per_s']:.0f} tokens/s; each run's "
        "share is against the rate measured around it" + _roofline_text(c.get("memory"))
    )


def _params_text(flops: dict) -> str:
    """ "12.3M non-embedding params", or for a mixture of experts the params a token meets out of all."""
    total, active = flops["non_embedding_params"], flops.get("active_params", flops["non_embedding_params"])
    if active == total:
        return f"{total / 1e6:.1f}M non-embedding params"
    return f"{active / 1e6:.1f}M active of {total / 1e6:.1f}M non-embedding params (routed experts only)"


def _routed(memory: dict[str, Any]) -> str:
    if not memory.get("routed_experts"):
        return ""
    return " of which a step reads its routed experts only, expected under uniform routing"


def _roofline_text(memory: dict[str, Any] | None) -> str:
    if not memory:
        return ""
    samples = memory.get("samples_bytes_per_s") or [memory["bytes_per_s"]]
    return (
        f"; roofline: per step, its FLOPs at the median rate or its bytes (weights "
        f"{memory['weight_bytes'] / 1e6:.0f} MB{_routed(memory)} + KV cache read and written, "
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
        for kind, (stem, _) in PEERS.items() if key == "output_tokens_per_s" else ():
            if peer_name := report.get(f"{stem}_base"):
                table.add_row(
                    f"output tokens/s / {peer_name}", *[_vs_peer_cell(c, kind, stem) for c in configs]
                )
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
            console.print(f"[yellow]{c['name']} {c['status']}[/]: {c['reason']}", soft_wrap=True)
        for note in c["notes"]:
            console.print(f"note: {note}", soft_wrap=True, markup=False, highlight=False)


def _vs_peer_cell(config: dict[str, Any], kind: str, stem: str) -> str:
    """A configuration's output tokens/s over the peer baseline's of `kind` ("1.00x" for the peer
    itself); `stem` names its ratios (`ratios_vs_<stem>`, `json_report.PEERS`)."""
    if config["status"] != "ok":
        return config["status"]
    if config["kind"] == kind:
        return "1.00x"
    ratio = config.get(f"ratios_vs_{stem}", {}).get("output_tokens_per_s")
    return "-" if ratio is None else f"{ratio:.2f}x"
