"""What a bench workload is made of, as the user asked for it: `WorkloadSpec` and its checks.

The distributions themselves are described in `batchgen.bench.workload.distributions`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from batchgen.bench.workload.traces import TRACE_FILES, default_data_dir

DISTS = ("longtail", "uniform", "fixed", "azure-conv", "azure-code", "file:PATH")


class BenchInputError(ValueError):
    """A bench option or input that cannot work, found before any timed run (the CLI exits 2)."""


@dataclass
class WorkloadSpec:
    """What to generate (`batchgen bench` options of the same names).

    Attributes:
        dist: one of `DISTS` (`file:PATH` with a real path).
        num_prompts: requests in the workload (for `file:` the first `num_prompts` rows; 0 = all).
        seed: seeds lengths, prompt tokens and arrivals (independently of each other).
        scale: multiplies trace-derived lengths (`longtail`, `azure-*`).
        input_len / output_len: tokens, for `uniform` and `fixed` (`output_len` is also the
            `file:` default when a row has no `max_tokens`).
        range_ratio: `uniform` spread, in [0, 1).
        request_rate: requests per second of a Poisson process; inf = all at time 0.
        trace_arrivals: replay the trace's arrival times (`azure-*` only).
        data_dir: folder holding the Azure traces; None = `default_data_dir()`.
    """

    dist: str = "longtail"
    num_prompts: int = 64
    seed: int = 0
    scale: float = 0.25
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.0
    request_rate: float = math.inf
    trace_arrivals: bool = False
    data_dir: Path | None = None

    def __post_init__(self) -> None:
        if not (self.dist in DISTS[:-1] or self.dist.startswith("file:")):
            raise ValueError(f"dist must be one of {', '.join(DISTS)}; got {self.dist!r}")
        if self.dist.startswith("file:") and not self.dist[5:]:
            raise ValueError("dist file:PATH needs a path, e.g. file:jobs/prompts.jsonl")
        minimum = 0 if self.dist.startswith("file:") else 1
        if not isinstance(self.num_prompts, int) or self.num_prompts < minimum:
            raise ValueError(f"num_prompts must be an int >= {minimum}, got {self.num_prompts!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(
                f"seed must be an int >= 0 (numpy's generators take no negative seed), got {self.seed!r}"
            )
        if not self.scale > 0:
            raise ValueError(f"scale must be > 0, got {self.scale}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(
                f"input_len and output_len must be >= 1, got {self.input_len}, {self.output_len}"
            )
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 requests/s (inf = offline), got {self.request_rate}")
        if self.trace_arrivals and self.dist not in TRACE_FILES:
            raise ValueError(f"trace_arrivals needs dist azure-conv or azure-code, got {self.dist!r}")
        if self.trace_arrivals and math.isfinite(self.request_rate):
            raise ValueError("use either trace_arrivals or request_rate, not both")

    @property
    def trace_dir(self) -> Path:
        return self.data_dir if self.data_dir is not None else default_data_dir()

    def check_inputs(self) -> None:
        """Check that the files the workload reads exist (cheap; run before any model work).

        Raises:
            BenchInputError: the `file:` job file or the Azure trace is missing, naming the option,
                the path and the fix.
        """
        if self.dist.startswith("file:"):
            path = Path(self.dist[5:])
            if not path.is_file():
                what = "is a folder" if path.is_dir() else "does not exist"
                raise BenchInputError(
                    f"--dist {self.dist}: the job file {path} {what}; give the path of a .jsonl or .parquet file"
                )
        elif self.dist in TRACE_FILES:
            path = self.trace_dir / TRACE_FILES[self.dist]
            if not path.is_file():
                where = (
                    f"--data-dir {self.data_dir}" if self.data_dir is not None else "the default data folder"
                )
                raise BenchInputError(
                    f"--dist {self.dist}: {where} has no {TRACE_FILES[self.dist]} ({path} does not exist); "
                    "pass --data-dir FOLDER holding the Azure traces"
                )
