"""`batchgen bench`: the Typer command (registered by `batchgen/cli.py` as `bench`).

Example (the comparison of issue 4, on a CPU, default model in bf16)::

    batchgen bench --dist longtail --num-prompts 64 --mode continuous,static \\
        --policy fcfs,max-throughput --baselines hf-static,hf-cb --output bench.json --plot bench.png
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer

from batchgen.bench.workloads import DISTS, WorkloadSpec
from batchgen.cli_types import memory_size as parse_size
from batchgen.config import EngineConfig


def _split(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip() and p.strip().lower() != "none"]


def bench_command(
    dist: Annotated[str, typer.Option(help=f"Workload: {', '.join(DISTS)}.")] = "longtail",
    num_prompts: Annotated[int, typer.Option(help="Requests in the workload (file: 0 = all rows).")] = 64,
    seed: Annotated[int, typer.Option(help="Seed of lengths, prompts and arrivals.")] = 0,
    scale: Annotated[
        float, typer.Option(help="Multiplies longtail / azure lengths (1 = the trace's).")
    ] = 0.25,
    input_len: Annotated[int, typer.Option(help="uniform / fixed prompt tokens.")] = 256,
    output_len: Annotated[int, typer.Option(help="uniform / fixed output tokens; file: default.")] = 64,
    range_ratio: Annotated[
        float, typer.Option(help="uniform spread in [0, 1) (vLLM's random dataset).")
    ] = 0.0,
    request_rate: Annotated[
        float, typer.Option(help="Poisson arrivals, requests/s; inf = all at t=0.")
    ] = math.inf,
    trace_arrivals: Annotated[bool, typer.Option(help="azure-*: replay the trace's arrival times.")] = False,
    data_dir: Annotated[
        Path | None, typer.Option(help="Folder with the Azure traces (default ../shared/data).")
    ] = None,
    mode: Annotated[
        str, typer.Option(help="Comma list of continuous, static (first = ratio base).")
    ] = "continuous,static",
    policy: Annotated[
        str, typer.Option(help="Comma list of fcfs, max-throughput, priority (continuous).")
    ] = "fcfs",
    baselines: Annotated[str, typer.Option(help="Comma list of hf-static, hf-cb (or none).")] = "",
    static_batch_size: Annotated[int, typer.Option(help="Requests per static batch.")] = 8,
    output: Annotated[Path | None, typer.Option(help="Write the JSON report here.")] = None,
    plot: Annotated[
        Path | None, typer.Option(help="Write a PNG of batch size and tokens/s over time.")
    ] = None,
    ceiling: Annotated[bool, typer.Option(help="Measure the matmul rate for the compute ceiling.")] = True,
    repeat: Annotated[
        int,
        typer.Option(
            help="Runs per configuration, interleaved (each round starts one configuration later); the median run is reported."
        ),
    ] = 1,
    model: Annotated[
        str | None, typer.Option(help="HF directory, hub id or .gguf (default model if unset).")
    ] = None,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16, float16.")] = "auto",
    max_num_seqs: Annotated[int, typer.Option(help="Most sequences per step.")] = 256,
    max_num_batched_tokens: Annotated[int | None, typer.Option(help="Most tokens per step.")] = None,
    max_model_len: Annotated[int | None, typer.Option(help="Longest prompt + output.")] = None,
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    kv_cache_memory: Annotated[
        str | None, typer.Option(help="CPU KV cache: bytes or 2GiB, 1.5GiB, 512MiB.")
    ] = None,
    gpu_memory_utilization: Annotated[float, typer.Option(help="CUDA memory fraction.")] = 0.9,
    num_threads: Annotated[int | None, typer.Option(help="torch threads (all configurations).")] = None,
    enable_prefix_caching: Annotated[bool, typer.Option(help="Prefix caching (off in static).")] = True,
    enable_chunked_prefill: Annotated[bool, typer.Option(help="Chunked prefill.")] = True,
    preemption_mode: Annotated[str, typer.Option(help="recompute or swap.")] = "recompute",
    swap_space: Annotated[float, typer.Option(help="GiB of CPU swap space.")] = 4.0,
    aging_steps: Annotated[int, typer.Option(help="max-throughput starvation bound in steps.")] = 256,
    attention_backend: Annotated[str, typer.Option(help="auto, torch, cpu, triton.")] = "auto",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda.")] = "auto",
) -> None:
    """Benchmark continuous against static batching and Hugging Face on one workload.

    Prints a table (ratios against the first configuration), the compute ceiling, and optionally
    writes a JSON report and a PNG timeline. Exits 1 when a batchgen configuration failed.
    """
    from rich.console import Console

    from batchgen.bench.report import plot as plot_report
    from batchgen.bench.report import render, write_json
    from batchgen.bench.runner import BenchSettings, run_bench

    console = Console()
    if not console.is_terminal:  # logs and CI: wide enough that the table does not wrap
        console = Console(width=200)
    try:
        settings = BenchSettings(
            workload=WorkloadSpec(
                dist=dist,
                num_prompts=num_prompts,
                seed=seed,
                scale=scale,
                input_len=input_len,
                output_len=output_len,
                range_ratio=range_ratio,
                request_rate=request_rate,
                trace_arrivals=trace_arrivals,
                data_dir=data_dir,
            ),
            modes=_split(mode),
            policies=_split(policy),
            baselines=_split(baselines),
            static_batch_size=static_batch_size,
            engine=EngineConfig(
                model=model,
                dtype=dtype,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                block_size=block_size,
                max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization,
                kv_cache_memory=parse_size(kv_cache_memory) if kv_cache_memory else None,
                swap_space=swap_space,
                enable_prefix_caching=enable_prefix_caching,
                enable_chunked_prefill=enable_chunked_prefill,
                preemption_mode=preemption_mode,
                aging_steps=aging_steps,
                attention_backend=attention_backend,
                device=device,
                num_threads=num_threads,
            ),
            measure_ceiling=ceiling,
            repeat=repeat,
        )
    except (ValueError, TypeError) as exc:
        raise typer.BadParameter(str(exc)) from exc

    report = run_bench(settings, log=lambda msg: console.print(msg, markup=False, highlight=False))
    render(report, console)
    if output is not None:
        write_json(report, output)
        console.print(f"report written to {output}")
    if plot is not None:
        try:
            plot_report(report, plot)
            console.print(f"plot written to {plot}")
        except RuntimeError as exc:
            console.print(f"[yellow]{exc}[/]")
    if any(
        c["status"] == "failed" and c["kind"] in ("continuous", "static") for c in report["configurations"]
    ):
        raise typer.Exit(code=1)
