"""`batchgen bench`: the Typer command (registered by `batchgen/cli.py` as `bench`).

Example (the comparison of issue 4, on a CPU, default model in bf16)::

    batchgen bench --dist longtail --num-prompts 64 --mode continuous,static \\
        --policy fcfs,max-throughput --baselines hf-static,hf-cb --output bench.json --plot bench.png

With vLLM's own build side by side (its own virtual environment, see docs/vllm.md)::

    batchgen bench --baselines vllm --vllm-python /work/vllm-venv/bin/python

With llama.cpp's server on the same GGUF file (built as docs/llamacpp.md says)::

    batchgen bench --model SmolLM2-135M-Instruct.Q8_0.gguf --baselines llama.cpp \\
        --llama-server /work/llama.cpp/build/bin/llama-server
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import typer

from batchgen import cli_types as opt
from batchgen.bench.spec import DISTS, BenchInputError, WorkloadSpec
from batchgen.config import EngineConfig, resolve_device


def _split(text: str) -> list[str]:
    """The items of a comma list, each once, in order ("none" and blanks dropped)."""
    return list(
        dict.fromkeys(p.strip() for p in text.split(",") if p.strip() and p.strip().lower() != "none")
    )


def check_output_file(option: str, path: Path) -> None:
    """Check, before the bench runs, that `path` can be written (`cli_types.output_file_problem`).

    Raises:
        typer.BadParameter: naming `option` (e.g. "--output"), the path and the fix (exit 2).
    """
    problem = opt.output_file_problem(path)
    if problem is not None:
        raise typer.BadParameter(f"{option} {path} {problem}")


@opt.engine_flags()
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
    baselines: Annotated[
        str,
        typer.Option(
            "--baselines", "--baseline", help="Comma list of hf-static, hf-cb, vllm, llama.cpp (or none)."
        ),
    ] = "",
    vllm_python: Annotated[
        Path | None,
        typer.Option(help="--baselines vllm: the python of a virtual environment with vLLM (docs/vllm.md)."),
    ] = None,
    vllm_timeout: Annotated[
        float, typer.Option(help="--baselines vllm: stop a vLLM run after this many seconds (0 = never).")
    ] = 0.0,
    llama_server: Annotated[
        Path | None,
        typer.Option(help="--baselines llama.cpp: llama.cpp's llama-server binary (docs/llamacpp.md)."),
    ] = None,
    llama_server_timeout: Annotated[
        float,
        typer.Option(
            help="--baselines llama.cpp: most seconds a request waits for its answer (0 = no limit)."
        ),
    ] = 0.0,
    static_batch_size: Annotated[int, typer.Option(help="Requests per static batch.")] = 8,
    output: Annotated[Path | None, typer.Option(help="Write the JSON report here.")] = None,
    plot: Annotated[
        Path | None, typer.Option(help="Write a PNG of batch size and tokens/s over time.")
    ] = None,
    ceiling: Annotated[bool, typer.Option(help="Measure the matmul rate for the compute ceiling.")] = True,
    repeat: Annotated[
        int,
        typer.Option(
            help="Runs per configuration, interleaved (each round starts one configuration later); the median run is reported (with an even count, the faster of the two middle runs: with 2, the faster run)."
        ),
    ] = 1,
    warmup_run: Annotated[
        bool,
        typer.Option(
            help="Run the first batchgen configuration once, untimed, first (one-time process costs)."
        ),
    ] = True,
    profile: Annotated[
        bool,
        typer.Option(
            help="Run each timed batchgen configuration's engine steps under cProfile; print the top "
            "functions and write them to --profile-output (a profiled run is slower than a plain one)."
        ),
    ] = False,
    profile_output: Annotated[
        Path, typer.Option(help="--profile: the text file the functions' table is written to.")
    ] = Path("bench-profile.txt"),
    # --- engine: EngineConfig's flags (vLLM spellings; shared with run, tune and plan) ---
    engine: opt.EngineArgs = opt.ENGINE_FLAGS,
    # bench's own --quantization, at that flag's place: a list of configurations to run.
    quantization: Annotated[
        str,
        typer.Option(
            help="Comma list of auto, none, int8: each continuous configuration runs once per item "
            "(named <config>+<method> where there are several; int8 quantizes the linears at load)"
        ),
    ] = "auto",
    # bench's own --speculative-method, at that flag's place: a list of configurations to run.
    speculative_method: Annotated[
        str,
        typer.Option(
            help="Comma list of none, ngram: each continuous configuration runs once per item "
            "(ngram: prompt-lookup speculative decoding, named <config>+ngram)"
        ),
    ] = "none",
) -> None:
    """Benchmark continuous against static batching, Hugging Face, vLLM and llama.cpp on one workload.

    Prints a table (ratios against the first configuration), the compute ceiling, and optionally
    writes a JSON report, a PNG timeline and (`--profile`) the engine's profile. Exits 2 for bad options or inputs (unwritable
    --output / --plot / --profile-output, a missing job file or trace, --device cuda without CUDA: all found before any
    model work; a job file without a usable row: found before any timed run), 1 when a batchgen
    configuration failed, no configuration was measured at all (a skipped vLLM or llama.cpp run alone), or the
    report or plot could not be written at the end after all.
    """
    from rich.console import Console

    quantizations = list(dict.fromkeys(q.strip() for q in engine["quantization"].split(",") if q.strip()))
    # The engine options carry the first quantization; each continuous configuration sets its own.
    engine["quantization"] = quantizations[0] if quantizations else ""
    methods = _speculative_methods(engine["speculative_method"])
    # The engine options carry the method that speculates; each configuration turns it on or off.
    engine["speculative_method"] = next((m for m in methods if m is not None), None)

    from batchgen.bench.report.table import render
    from batchgen.bench.runner import run_bench
    from batchgen.bench.settings import BenchSettings

    console = Console()
    if not console.is_terminal:  # logs and CI: wide enough that the table does not wrap
        console = Console(width=200)  # log lines and notes print whole (soft_wrap): grep finds them
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
            engine=EngineConfig(**engine),
            measure_ceiling=ceiling,
            repeat=repeat,
            warmup_run=warmup_run,
            vllm_python=str(vllm_python) if vllm_python is not None else None,
            vllm_timeout_s=vllm_timeout or None,
            llama_server=str(llama_server) if llama_server is not None else None,
            llama_server_timeout_s=llama_server_timeout or None,
            speculative_methods=methods,
            quantizations=quantizations,
        )
        # Everything that can fail without the model fails now, not after minutes of benchmarking.
        resolve_device(settings.engine.device)
        settings.workload.check_inputs()
    except (ValueError, TypeError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    _check_outputs(output, plot, profile_output if profile else None)
    profiles: dict | None = {} if profile else None
    try:
        report = run_bench(
            settings,
            log=lambda msg: console.print(msg, markup=False, highlight=False, soft_wrap=True),
            profiles=profiles,
        )
    except BenchInputError as exc:
        raise typer.BadParameter(str(exc)) from exc
    except KeyboardInterrupt:
        console.print("interrupted: no report written")
        raise typer.Exit(130) from None
    render(report, console)
    written = _write_outputs(report, output, plot, console) & _write_profile(
        profiles, profile_output, console
    )
    _exit_on_failure(report["configurations"], written, console)


def _exit_on_failure(configurations: list[dict], written: bool, console: Any) -> None:
    """Exit 1 when no configuration was measured, a batchgen configuration failed, or an output
    asked for could not be written (`written` False).

    Raises:
        typer.Exit: code 1 in those cases.
    """
    if not any(c["status"] == "ok" for c in configurations):
        # A skipped baseline leaves the others' figures standing; with nothing else run, a script
        # must not read the report of nothing as a success.
        console.print("error: no configuration was measured (every one skipped or failed)")
        raise typer.Exit(code=1)
    if not written or any(
        c["status"] == "failed" and c["kind"] in ("continuous", "static") for c in configurations
    ):
        raise typer.Exit(code=1)


def _speculative_methods(text: str) -> list[str | None]:
    """`--speculative-method`'s comma list, each item once, in order: None for "none"."""
    items = (p.strip() for p in text.split(","))
    return list(dict.fromkeys(None if p.lower() == "none" else p for p in items if p))


def _check_outputs(output: Path | None, plot: Path | None, profile_output: Path | None) -> None:
    """Before the bench runs: `--output`, `--plot` and `--profile-output` (None: not asked for) can be
    written, and `--plot` in a format matplotlib (installed) writes.

    Raises:
        typer.BadParameter: naming the option, the path and the fix (exit 2).
    """
    from batchgen.bench.report.plot import check_plot_format, require_matplotlib

    for option, path in (("--output", output), ("--plot", plot), ("--profile-output", profile_output)):
        if path is not None:
            check_output_file(option, path)
    if plot is not None:
        try:
            require_matplotlib()
            check_plot_format(plot)
        except (RuntimeError, ValueError) as exc:
            raise typer.BadParameter(str(exc)) from exc


def _write_outputs(report: dict, output: Path | None, plot: Path | None, console: Any) -> bool:
    """Write the JSON report and the plot asked for; False when one could not be written after all
    (writable when checked, not now: the disk filled, the folder went), each failure printed."""
    from batchgen.bench.report.json_report import write_json
    from batchgen.bench.report.plot import plot as plot_report

    written = True
    if output is not None:
        try:
            write_json(report, output)
            console.print(f"report written to {output}")
        except OSError as exc:
            console.print(
                f"[red]error:[/] --output {output} could not be written ({exc}); the table above is the result"
            )
            written = False
    if plot is not None:
        try:
            plot_report(report, plot)
            console.print(f"plot written to {plot}")
        except (RuntimeError, OSError) as exc:
            console.print(f"[yellow]--plot {plot} could not be written: {exc}[/]")
            written = False
    return written


def _write_profile(profiles: dict | None, path: Path, console: Any) -> bool:
    """Print each profiled configuration's top functions and write the longer tables to `path`;
    False when the file could not be written (printed). Nothing to do without `--profile`."""
    from batchgen.bench.report.profile import PRINTED_ROWS, render_profile, write_profiles

    if profiles is None:
        return True
    for name, profiler in profiles.items():
        console.print(render_profile(name, profiler, PRINTED_ROWS), markup=False, highlight=False)
    try:
        write_profiles(profiles, path)
    except OSError as exc:
        console.print(f"[red]error:[/] --profile-output {path} could not be written ({exc})")
        return False
    console.print(f"profile written to {path}")
    return True
