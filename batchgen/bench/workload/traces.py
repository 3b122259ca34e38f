"""Length distributions and the Azure LLM inference traces they are fitted to.

`LONGTAIL_INPUT` / `LONGTAIL_OUTPUT` are maximum-likelihood log-normal fits to the conversation trace
(`AzureLLMInferenceTrace_conv.csv`; Patel et al., "Splitwise", ISCA 2024); see `batchgen.bench.workload.distributions`
for how the workloads use them. The traces are read from `../shared/data` unless told otherwise.
"""

from __future__ import annotations

import csv
import datetime as _dt
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TRACE_FILES = {
    "azure-conv": "AzureLLMInferenceTrace_conv.csv",
    "azure-code": "AzureLLMInferenceTrace_code.csv",
}


@dataclass(frozen=True)
class LogNormal:
    """A log-normal length distribution: exp(Normal(mu, sigma)), clipped at `max_value` tokens."""

    mu: float
    sigma: float
    max_value: float

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` lengths in tokens (float, before scaling and rounding)."""
        return np.minimum(rng.lognormal(self.mu, self.sigma, n), self.max_value)

    @property
    def median(self) -> float:
        return math.exp(self.mu)


# Maximum-likelihood fit to AzureLLMInferenceTrace_conv.csv (see the module docstring);
# tests/bench/test_workloads.py re-fits the trace and checks these numbers.
LONGTAIL_INPUT = LogNormal(mu=6.633, sigma=0.985, max_value=14050)
LONGTAIL_OUTPUT = LogNormal(mu=5.019, sigma=0.859, max_value=1000)


def fit_lognormal(values: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """Maximum-likelihood log-normal fit: (mean, standard deviation) of log(values).

    Raises:
        ValueError: when `values` is empty or holds a value <= 0.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0 or np.any(x <= 0):
        raise ValueError("fit_lognormal needs a non-empty array of positive lengths")
    logs = np.log(x)
    return float(logs.mean()), float(logs.std())


TICKS_PER_SECOND = 10_000_000  # the traces' timestamps carry 7 fractional digits (100 ns)


def parse_trace_timestamp(text: str) -> int:
    """Parse `2023-11-16 18:15:46.6805900` into 100-ns ticks since 1970-01-01 (naive time).

    Integer ticks keep all 7 fractional digits exactly (Python's `%f` takes only 6, and a float
    of epoch seconds loses the 7th). Fractions shorter than 7 digits are accepted.

    Raises:
        ValueError: when the text is not `YYYY-MM-DD HH:MM:SS[.fraction]`.
    """
    text = text.strip()
    whole, _, frac = text.partition(".")
    try:
        moment = _dt.datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
    except ValueError as exc:
        raise ValueError(f"bad trace timestamp {text!r}: expected 'YYYY-MM-DD HH:MM:SS.fffffff'") from exc
    if frac and (not frac.isdigit() or len(frac) > 7):
        raise ValueError(f"bad trace timestamp {text!r}: fraction must be 1-7 digits")
    seconds = (moment - _dt.datetime(1970, 1, 1)) // _dt.timedelta(seconds=1)
    return seconds * TICKS_PER_SECOND + int(frac.ljust(7, "0") or 0)


@dataclass(frozen=True)
class AzureTrace:
    """One Azure LLM inference trace (Patel et al., "Splitwise", ISCA 2024).

    Attributes:
        times: arrival of each record in seconds since the first record, float64 `[n]`.
        context_tokens: prompt lengths in tokens, int64 `[n]`.
        generated_tokens: output lengths in tokens, int64 `[n]`.
    """

    times: np.ndarray
    context_tokens: np.ndarray
    generated_tokens: np.ndarray

    def __len__(self) -> int:
        return int(self.times.shape[0])


def load_azure_trace(path: str | Path) -> AzureTrace:
    """Read `TIMESTAMP,ContextTokens,GeneratedTokens` (CRLF or LF, with or without a final newline).

    Raises:
        FileNotFoundError: when the file is absent.
        ValueError: naming the line of a malformed record, or when the file has no records.
    """
    path = Path(path)
    ticks: list[int] = []
    ctx: list[int] = []
    gen: list[int] = []
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or [h.strip() for h in header] != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
            raise ValueError(f"{path}: expected header TIMESTAMP,ContextTokens,GeneratedTokens, got {header}")
        for lineno, row in enumerate(reader, start=2):
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != 3:
                raise ValueError(f"{path}:{lineno}: expected 3 fields, got {len(row)}")
            try:
                ticks.append(parse_trace_timestamp(row[0]))
                ctx.append(int(row[1]))
                gen.append(int(row[2]))
            except ValueError as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from exc
    if not ticks:
        raise ValueError(f"{path}: no records")
    t = np.asarray(ticks, dtype=np.int64)
    return AzureTrace(
        times=(t - t[0]).astype(np.float64) / TICKS_PER_SECOND,
        context_tokens=np.asarray(ctx, dtype=np.int64),
        generated_tokens=np.asarray(gen, dtype=np.int64),
    )


def default_data_dir() -> Path:
    """`../shared/data` next to the repository root (where the Azure traces live)."""
    return Path(__file__).resolve().parents[3] / ".." / "shared" / "data"
