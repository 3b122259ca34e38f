#!/usr/bin/env python
"""Reproduce the throughput comparison of issue 6 (and the batching comparison of issue 4) in one run.

Runs `batchgen bench` on the long-tail workload with the default model in bf16: batchgen's
continuous batching (fcfs and max-throughput), static batching of 8 in batchgen's own engine,
transformers `generate` in static batches of 8 and transformers' continuous batching, all with
the same model, dtype and threads. Prints the table, the compute ceiling, and each target:

    issue 6: continuous output tokens/s >= 6x hf-static and >= 5x hf-cb; >= 60% of the compute
             ceiling; peak RSS of the batchgen run < 2 GB.
    issue 4: continuous >= 3.75x static on throughput, lower mean and p99 latency;
             max-throughput finishes no later than fcfs; no wait beyond the aging bound.

Usage (about 10 minutes on two CPU cores)::

    python scripts/bench_compare.py --output bench.json --plot bench.png

`--strict` exits 1 when a target is missed. CI runs it only as a smoke test on a tiny model (no
timing assertions): `--model TINY_DIR --num-prompts 6 --scale 0.05`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from batchgen.bench.report.json_report import write_json  # noqa: E402
from batchgen.bench.report.plot import plot  # noqa: E402
from batchgen.bench.report.table import render  # noqa: E402
from batchgen.bench.runner import run_bench  # noqa: E402
from batchgen.bench.settings import BenchSettings  # noqa: E402
from batchgen.bench.spec import WorkloadSpec  # noqa: E402
from batchgen.config import EngineConfig, GiB  # noqa: E402

GB = 1e9


def _config(report: dict[str, Any], prefix: str) -> dict[str, Any] | None:
    return next(
        (c for c in report["configurations"] if c["name"].startswith(prefix) and c["status"] == "ok"), None
    )


def targets(report: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) for every target whose configurations ran; met None = not measurable."""
    fcfs = _config(report, "continuous/fcfs")
    mt = _config(report, "continuous/max-throughput")
    cont = fcfs or mt
    static = _config(report, "static/")
    hf_static = _config(report, "hf-static/")
    hf_cb = _config(report, "hf-cb")
    rows: list[tuple[str, str, bool | None]] = []

    def m(c: dict[str, Any], key: str) -> float:
        return c["metrics"][key] or 0.0

    if cont is None:
        return rows
    name = cont["name"]
    for base, need in ((hf_static, 6.0), (hf_cb, 5.0)):
        if base is not None and m(base, "output_tokens_per_s") > 0:
            x = m(cont, "output_tokens_per_s") / m(base, "output_tokens_per_s")
            rows.append((f"{name} output tokens/s >= {need:g}x {base['name']}", f"{x:.2f}x", x >= need))
    frac = cont["metrics"].get("ceiling_fraction")
    rows.append(
        (
            f"{name} >= 60% of the compute ceiling",
            "-" if frac is None else f"{frac:.1%}",
            None if frac is None else frac >= 0.6,
        )
    )
    rss = (
        max(
            c["metrics"]["peak_rss_mb"]
            for c in report["configurations"]
            if c["status"] == "ok" and c["kind"] == "continuous"
        )
        * 2**20
    )
    rows.append(("peak RSS of the batchgen run < 2 GB", f"{rss / GB:.2f} GB", rss < 2 * GB))
    if static is not None:
        x = m(cont, "output_tokens_per_s") / max(m(static, "output_tokens_per_s"), 1e-9)
        # What the two schedules alone allow: their rooflines' ratio (equal kernel efficiency).
        roofs = (static["metrics"].get("roofline_s"), cont["metrics"].get("roofline_s"))
        bound = f" (rooflines {roofs[0] / roofs[1]:.2f}x)" if all(roofs) else ""
        rows.append((f"{name} >= 3.75x {static['name']} throughput", f"{x:.2f}x{bound}", x >= 3.75))
        for key, label in (("e2e_mean_s", "mean"), ("e2e_p99_s", "p99")):
            rows.append(
                (
                    f"{name} {label} latency below {static['name']}",
                    f"{m(cont, key):.1f} s vs {m(static, key):.1f} s",
                    m(cont, key) < m(static, key),
                )
            )
    if fcfs is not None and mt is not None:
        rows.append(
            (
                "max-throughput finishes no later than fcfs",
                f"{m(mt, 'wall_s'):.1f} s vs {m(fcfs, 'wall_s'):.1f} s",
                m(mt, "wall_s") <= m(fcfs, "wall_s"),
            )
        )
    for c in (fcfs, mt):
        if c is not None and c["metrics"].get("aging_bound_steps") is not None:
            rows.append(
                (
                    f"{c['name']} max wait within the aging bound",
                    f"{c['metrics']['max_wait_steps']} <= {c['metrics']['aging_bound_steps']} steps",
                    c["metrics"]["aging_bound_held"],
                )
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model (default: batchgen's default model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", default="fcfs,max-throughput")
    parser.add_argument("--mode", default="continuous,static")
    parser.add_argument("--baselines", default="hf-static,hf-cb")
    parser.add_argument("--static-batch-size", type=int, default=8)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-gib", type=float, default=None)
    parser.add_argument("--repeat", type=int, default=1, help="runs per configuration (median reported)")
    parser.add_argument("--output", type=Path, default=None, help="JSON report")
    parser.add_argument("--plot", type=Path, default=None, help="PNG timeline")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)

    def split(text: str) -> list[str]:
        return [p for p in (s.strip() for s in text.split(",")) if p and p != "none"]

    console = Console() if Console().is_terminal else Console(width=200)
    settings = BenchSettings(
        workload=WorkloadSpec(
            dist="longtail", num_prompts=args.num_prompts, seed=args.seed, scale=args.scale
        ),
        modes=split(args.mode),
        policies=split(args.policy),
        baselines=split(args.baselines),
        static_batch_size=args.static_batch_size,
        engine=EngineConfig(
            model=args.model,
            dtype=args.dtype,
            num_threads=args.num_threads,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory=int(args.kv_cache_gib * GiB) if args.kv_cache_gib else None,
        ),
        repeat=args.repeat,
    )
    report = run_bench(settings, log=lambda msg: console.print(msg, markup=False, highlight=False))
    render(report, console)
    rows = targets(report)
    report["targets"] = [{"target": t, "measured": v, "met": ok} for t, v, ok in rows]
    table = Table(title="targets (issues 4 and 6)")
    for col in ("target", "measured", "met"):
        table.add_column(col)
    for t, v, ok in rows:
        table.add_row(t, v, "-" if ok is None else ("[green]yes[/]" if ok else "[red]no[/]"))
    console.print(table)
    if args.output:
        write_json(report, args.output)
        console.print(f"report written to {args.output}")
    if args.plot:
        plot(report, args.plot)
        console.print(f"plot written to {args.plot}")
    failed = any(c["status"] == "failed" for c in report["configurations"])
    missed = any(ok is False for _, _, ok in rows)
    return 1 if failed or (args.strict and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
