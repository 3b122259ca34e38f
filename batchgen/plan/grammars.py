"""`batchgen plan`'s structured outputs check: every distinct constraint of the job compiled as the
engine would compile it (the model's tokenizer, `grammar_compile_timeout`), the bad ones listed
with the rows that use them, and the compile time.

The compiling needs xgrammar, and so torch: a plan that keeps torch out of its process
(`batchgen.plan.child`) runs it in its child.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from batchgen.config import EngineConfig
from batchgen.dashboard import counted
from batchgen.jobs.options import flag_hint
from batchgen.sampling_params import StructuredOutputsParams

MAX_CONSTRAINTS = 10_000  # distinct constraints checked (a job with more: the first ones)
MAX_LISTED = 5


@dataclass
class Constraints:
    """The distinct constraints of the job's valid rows, as they are read: per constraint's
    canonical text, the constraint, its rows and how the first one names it."""

    seen: dict[str, list[Any]] = field(default_factory=dict)  # key -> [params, rows, first row, label]
    rows: int = 0

    def add(self, params: StructuredOutputsParams, where: str, label: str | None) -> None:
        self.rows += 1
        entry = self.seen.get(params.key)
        if entry is not None:
            entry[1] += 1
        elif len(self.seen) < MAX_CONSTRAINTS:
            self.seen[params.key] = [params, 1, where, label or f"structured_outputs.{params.kind}"]


@dataclass
class GrammarReport:
    """What `plan` says of the job's constraints (`JobPlan.structured`).

    Attributes:
        rows: rows with a constraint; distinct: distinct constraints compiled (at most
            `MAX_CONSTRAINTS`); compile_s: their compile times summed (seconds).
        error_rows: rows whose constraint fails; errors: the first `MAX_LISTED` failures, each
            naming its first row, how many other rows share it, the field, the reason and the fix.
    """

    rows: int = 0
    distinct: int = 0
    compile_s: float = 0.0
    error_rows: int = 0
    errors: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """What `batchgen plan` prints of the constraints."""
        fails = {
            0: "all compile",
            1: "1 row's constraint fails (an error row in run):",
        }.get(self.error_rows, f"{self.error_rows} rows' constraints fail (error rows in run):")
        rows, distinct = counted(self.rows, "row"), counted(self.distinct, "distinct constraint")
        head = f"structured outputs: {rows}, {distinct}, compiled in "
        return [f"{head}{self.compile_s:.2f} s; {fails}", *(f"  {e}" for e in self.errors)]


def compile_all(
    tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int], timeout_s: float, constraints: list[dict]
) -> list[tuple[str | None, float]]:
    """Compile each constraint (`StructuredOutputsParams` fields) as the engine would, on its
    worker threads; (the error after the field name or None, compile seconds) for each, in order."""
    from batchgen.engine.structured import GrammarCache

    cache = GrammarCache(tokenizer, vocab_size, list(stop_token_ids), timeout_s)
    entries = [cache.submit(StructuredOutputsParams(**c)) for c in constraints]
    results = []
    for entry in entries:
        while entry.state(timeout_s) == "pending":
            entry.done.wait(0.05)
        results.append((entry.error, entry.compile_s or time.perf_counter() - (entry.started or 0.0)))
    return results


def in_this_process(config: EngineConfig, constraints: list[dict]) -> list[tuple[str | None, float]]:
    """`compile_all` with the model's tokenizer, vocabulary and EOS ids (the engine's)."""
    from batchgen.model.loading import loader

    files = loader.resolve_model(config.model)
    tokenizer = loader.load_tokenizer(files)
    eos = loader.eos_token_ids(files, tokenizer)
    return compile_all(
        tokenizer, int(files.config.vocab_size), eos, config.grammar_compile_timeout, constraints
    )


def report(constraints: Constraints, results: list[tuple[str | None, float]]) -> GrammarReport:
    """The plan's lines of the compiled constraints."""
    out = GrammarReport(rows=constraints.rows, distinct=len(constraints.seen))
    for (_, rows, where, label), (error, seconds) in zip(constraints.seen.values(), results, strict=True):
        out.compile_s += seconds
        if error is None:
            continue
        out.error_rows += rows
        if len(out.errors) < MAX_LISTED:
            others = f" and {rows - 1} other row(s) with the same constraint" if rows > 1 else ""
            out.errors.append(f"{where}{others}: {label} {error}{flag_hint(error)}")
    return out


def failing(constraints: Constraints, results: list[tuple[str | None, float]]) -> dict[str, str]:
    """The constraints that failed to compile, by canonical text (`StructuredOutputsParams.key`):
    their error after the field name, as the engine gives it."""
    return {
        key: error for key, (error, _) in zip(constraints.seen, results, strict=True) if error is not None
    }


def row_error(where: str, label: str, error: str) -> str:
    """The error row `batchgen run` writes for a row whose constraint failed with `error` (the
    engine's message after the field name; `batchgen.jobs.requests.output_result`'s wording)."""
    message = f"{label} {error}"
    return f"{where}: {message}{flag_hint(message)}"


def as_request(constraints: Constraints) -> list[dict]:
    """The constraints as JSON-ready `StructuredOutputsParams` fields (for the child)."""
    return [
        {k: v for k, v in dataclasses.asdict(entry[0]).items() if v is not None}
        for entry in constraints.seen.values()
    ]
