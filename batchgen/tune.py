"""`batchgen tune`: load the model, choose its kernels (measuring what the cache lacks) and print
the table: op, shape, row bucket, each candidate's time and rate, and the chosen one."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer

from batchgen import cli_types as opt
from batchgen.config import EngineConfig

if TYPE_CHECKING:
    from batchgen.kernels.registry import TuningTable


def table_rows(table: TuningTable) -> list[dict[str, Any]]:
    """The tuning table's entries with each candidate's rate (GFLOP/s or GB/s) next to its time."""
    rows = []
    for row in table.rows():
        rates = {}
        for name, ms in row["ms"].items():
            if ms and row.get("work"):
                rates[name] = row["work"] / (ms * 1e-3) / 1e9
        rows.append({**row, "rate": rates})
    return rows


def print_table(rows: list[dict[str, Any]], seconds: float, summary: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kernel choice ({summary}); chosen in {seconds:.2f} s", title_justify="left")
    for column in ("op", "shape", "rows", "candidates: ms (GFLOP/s)", "chosen"):
        table.add_column(column, justify="right" if column == "rows" else "left")
    for row in rows:
        cells = []
        for name, ms in row["ms"].items():
            if ms is None:
                reason = row["dropped"].get(name)
                cells.append(f"{name} {'dropped' if reason else 'not timed (slower)'}")
            else:
                rate = row["rate"].get(name)
                cells.append(f"{name} {ms:.3f}" + (f" ({rate:.0f})" if rate else ""))
        table.add_row(row["op"], row["shape"], str(row["rows"]), ", ".join(cells), row["chosen"])
    Console().print(table)


# The engine flags that change the kernels chosen (and the engine started to choose them).
TUNE_FLAGS = (
    "model",
    "dtype",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "kv_cache_memory",
    "attention_backend",
    "device",
    "quantization",
    "num_threads",
)


@opt.engine_flags(TUNE_FLAGS)
def tune_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print the table as JSON lines")] = False,
    engine: opt.EngineArgs = opt.ENGINE_FLAGS,
    # tune's own --kv-cache-memory: the engine it starts only measures, so a small cache does.
    kv_cache_memory: Annotated[
        int | None,
        typer.Option(
            parser=opt.memory_size,
            metavar="SIZE",
            help="KV cache of the engine started to measure (bytes or 2GiB, 512MiB); small, as the "
            "table does not depend on it",
        ),
    ] = "64MiB",  # type: ignore[assignment]  # Click parses a default too: bytes, as the help says 64MiB
) -> None:
    """Choose the kernels for a model on this machine and print the measured table (cached: a
    second call, like a second `batchgen run`, measures nothing)."""
    from batchgen.engine.llm_engine import LLMEngine
    from batchgen.jobs.options import flag_hint
    from batchgen.model.loading.architectures import ModelNotFoundError

    try:
        llm_engine = LLMEngine(EngineConfig(**engine, kernels="auto"))
    except (ModelNotFoundError, ValueError) as e:  # `run` and `bench` answer the same options so
        typer.echo(f"error: {e}{flag_hint(str(e))}", err=True)
        raise typer.Exit(2) from None
    choice = llm_engine.kernel_choice
    seconds = choice.seconds
    if choice.table is None:
        typer.echo(
            f"{llm_engine.runner.describe()}: nothing to measure on {llm_engine.device} in {llm_engine.dtype}"
        )
        return
    rows = table_rows(choice.table)
    if as_json:
        for row in rows:
            typer.echo(json.dumps(row))
        return
    print_table(rows, seconds, llm_engine.runner.describe())
    typer.echo(f"cache: {choice.table.path}")
    if choice.table.measured_busy:
        typer.echo(
            f"measured while other processes used {choice.table.others_load:.1f} cores: these times are "
            "not the kernels' own; the next start on a quiet machine measures again"
        )
