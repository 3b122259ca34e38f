"""Kernel choice by measurement: each op's candidates are checked against a reference and timed where
they run, and the fastest correct one is used; the table is cached on disk.

No rule by CPU flag picks a kernel: the same 2-core box can be an AMD Zen 5 with AVX-512 BF16 (where
batchgen's own bf16 linear beats oneDNN at few rows) or an Intel Xeon with AMX (where oneDNN is
several times faster from 16 rows up). So for each op, shape and row bucket, `choose` runs every
candidate on real shapes, drops a candidate whose output differs from the reference (or that raises,
with one warning line), and keeps the fastest of the rest.

The table lives in `kernel_tuning/<key>.json` under batchgen's cache, keyed by what can change a
timing or a result (`machine_key`): CPU model and flags, threads, torch version, dtype, the kernels'
source hash and the environment switches that emulate lesser machines (`ONEDNN_MAX_CPU_ISA`). A
second start on the same machine looks every choice up in it. A file that does not parse, or that
holds another key, is rebuilt, never trusted.

Timings taken while other processes keep a core busy are not the kernels' own: each candidate waits
out a scheduler slice at a thread barrier (measured: docs/benchmarks.md). Such a table records the
load (`others_load`, in cores); it is used while the machine stays busy, and measured again at the
first start that finds the machine quiet.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from batchgen.cache import cache_root, write_atomically
from batchgen.kernels.machine_load import BUSY_CORES, other_load
from batchgen.progress import PROGRESS

logger = logging.getLogger(__name__)

Run = Callable[[], torch.Tensor]  # one call of a candidate on prepared input
Setup = Callable[[int], Run]  # a candidate: rows -> its run on that many rows of prepared input

# Row-count buckets of a flat step (a mixed prefill+decode step counts all its rows). A step of m rows
# uses the bucket of the smallest bound >= m; steps past the last bound use the last.
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
# A candidate this many times slower than the fastest at two buckets in a row is not timed at the
# larger ones (its time there is recorded as None): tuning stays seconds, not minutes.
PRUNE_RATIO = 3.0
# A timed call at least this long (seconds) is measured over 3 rounds instead of 5 (`fastest_seconds`).
LONG_CALL_S = 0.02
# 2: linear times taken over weights that stream from memory (`calls_per_run`); 3: a quantized
# linear's float candidates timed at every bucket (`tune_linear`: no pruning)
TABLE_VERSION = 3
# Environment switches that change which code oneDNN, torch or batchgen's kernels run.
_ENV_KEYS = (
    "BATCHGEN_MAX_CPU_ISA",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "BATCHGEN_CPU_KERNELS",
    "ATEN_CPU_CAPABILITY",
)


def entry_key(op: str, shape: str, rows: int) -> str:
    """A `TuningTable` entry's key: op, shape name and row bucket, e.g. "linear|576x1536:bfloat16|64"."""
    return f"{op}|{shape}|{rows}"


def bucket_index(rows: int) -> int:
    """Index into `ROW_BUCKETS` of a step with `rows` rows (>= 1): the smallest bound >= rows."""
    return min(max(rows - 1, 0).bit_length(), len(ROW_BUCKETS) - 1)


def buckets_up_to(max_rows: int) -> tuple[int, ...]:
    """The bucket bounds a step of at most `max_rows` rows can fall in."""
    return ROW_BUCKETS[: bucket_index(max(1, max_rows)) + 1]


@functools.lru_cache(maxsize=1)
def _cpu_identity() -> tuple[str, str]:
    """(CPU model name, SHA-256 of its flags line), from /proc/cpuinfo where there is one."""
    model, flags = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            name = name.strip()
            if name in ("model name", "Model") and model in (platform.processor(), platform.machine()):
                model = value.strip()
            elif name in ("flags", "Features") and not flags:
                flags = value.strip()
    except OSError:
        pass
    return model, hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:16]


KERNELS_ROOT = Path(__file__).parent


@functools.lru_cache(maxsize=4)
def kernel_source_hash(root: Path = KERNELS_ROOT) -> str:
    """SHA-256 (16 hex digits) of every kernel source under `root` (`batchgen.kernels`): Python and C."""
    return files_hash(root, sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c", ".h")))


def files_hash(root: Path, paths: list[Path]) -> str:
    """SHA-256 (16 hex digits) of `paths`' names (relative to `root`) and contents, in the order given."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def machine_key(dtype: torch.dtype, num_threads: int | None = None) -> dict[str, str]:
    """What a tuning table depends on: CPU model and flags, threads, torch, dtype, kernel sources and
    the environment switches that emulate lesser CPUs. `num_threads` None: torch's current count."""
    model, flags = _cpu_identity()
    key = {
        "version": str(TABLE_VERSION),
        "cpu": model,
        "cpu_flags": flags,
        "threads": str(num_threads or torch.get_num_threads()),
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "kernels": kernel_source_hash(),
    }
    key.update({name: os.environ[name] for name in _ENV_KEYS if name in os.environ})
    return key


@dataclass
class TuningTable:
    """Measured choices for one `machine_key`: entries by `"op|shape|rows"`.

    Each entry: `chosen` (candidate name), `ms` (candidate -> fastest milliseconds, None where not timed),
    `dropped` (candidate -> why it was not a choice) and `work` / `unit` (flops or bytes of one call,
    for rates in the printed table). `others_load`: the most CPU other processes used (cores) while
    entries were measured, None where that is unknown.
    """

    key: dict[str, str]
    path: Path | None
    entries: dict[str, dict] = field(default_factory=dict)
    dirty: bool = False
    others_load: float | None = None
    announced: bool = field(default=False, compare=False)  # `choose` said it measures (not saved)

    @classmethod
    def load(
        cls,
        key: dict[str, str],
        directory: Path | None = None,
        load_now: Callable[[], float | None] | None = None,
    ) -> TuningTable:
        """The cached table for `key` under `directory` (default: batchgen's cache), or an empty one
        when there is none, the file is corrupt or holds another key, or it was measured on a busy
        machine (`others_load` >= `BUSY_CORES`) and `load_now()` (other processes' cores now, by default
        measured over 0.1 s; called only then) finds it quiet."""
        directory = directory if directory is not None else cache_root() / "kernel_tuning"
        name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        path = directory / f"{name}.json"
        table = cls(key=key, path=path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return table
        except (OSError, ValueError) as exc:
            logger.warning("kernel tuning cache %s is unreadable (%s); measuring again", path, exc)
            return table
        if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("entries"), dict):
            logger.warning("kernel tuning cache %s does not match this machine; measuring again", path)
            return table
        busy_then = data.get("others_load")
        table.others_load = float(busy_then) if isinstance(busy_then, (int, float)) else None
        if table.measured_busy:
            now = load_now() if load_now is not None else other_load(0.1)
            if now is not None and now < BUSY_CORES:
                logger.warning(
                    "kernel tuning cache %s was measured while other processes used %.1f cores, so its "
                    "timings were not the kernels' own; measuring again on the quiet machine",
                    path,
                    table.others_load,
                )
                return cls(key=key, path=path)
        table.entries = {k: v for k, v in data["entries"].items() if _valid_entry(v)}
        table.dirty = len(table.entries) != len(data["entries"])
        return table

    @property
    def measured_busy(self) -> bool:
        """Whether entries were measured beside `BUSY_CORES` or more of other processes' work."""
        return self.others_load is not None and self.others_load >= BUSY_CORES

    def note_load(self, others: float | None) -> None:
        """Record that entries measured since the table was loaded ran beside `others` cores of other
        processes' work (None: unknown; a table with nothing new measured keeps its record)."""
        if self.dirty and others is not None:
            self.others_load = max(self.others_load or 0.0, others)

    def save(self) -> None:
        """Write the table atomically when something was measured since it was loaded (a cache
        folder that cannot be written costs a warning, not the run)."""
        if not self.dirty or self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            data = {"key": self.key, "entries": self.entries, "others_load": self.others_load}
            text = json.dumps(data, indent=1, sort_keys=True)
            write_atomically(self.path, text.encode())
            self.dirty = False
        except OSError as exc:
            logger.warning("could not write the kernel tuning cache %s: %s", self.path, exc)

    def rows(self) -> list[dict]:
        """Every entry as a flat dict (op, shape, rows, chosen, ms, dropped, work, unit), sorted."""
        out = []
        for name, entry in self.entries.items():
            op, shape, rows = name.split("|")
            out.append({"op": op, "shape": shape, "rows": int(rows), **entry})
        return sorted(out, key=lambda r: (r["op"], r["shape"], r["rows"]))


def _valid_entry(entry: object) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("chosen"), str)
        and isinstance(entry.get("ms"), dict)
        and entry["chosen"] in entry["ms"]
    )


def fastest_seconds(
    calls: Mapping[str, Callable[[], object]],
    min_rounds: int = 5,
    max_rounds: int = 30,
    min_total_s: float = 0.05,
    long_call_s: float | None = None,
    long_call_rounds: int = 3,
) -> dict[str, float]:
    """Each call's fastest wall time in seconds over interleaved rounds (A, B, A, B, ...).

    The minimum, not the mean or median: another process taking the core (a scheduler quantum is
    milliseconds) can only add time, so the fastest run is the kernel's own cost, and interleaving
    puts a slow phase of the machine on every candidate alike. At least `min_rounds` rounds, more
    until `min_total_s` is spent or `max_rounds` are done; with `long_call_s`, `long_call_rounds`
    rounds are enough when every call of the first round took at least that long (a call of tens
    of milliseconds spans several scheduler quanta, so its minimum settles in fewer rounds, and the
    rounds it saves are most of a first start's kernel choice). The calls must be warm (run once).
    """
    best = dict.fromkeys(calls, float("inf"))
    spent, rounds = 0.0, 0
    while rounds < min_rounds or (spent < min_total_s and rounds < max_rounds):
        if rounds == 1 and long_call_s is not None and min(best.values(), default=0.0) >= long_call_s:
            min_rounds = min(min_rounds, long_call_rounds)
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            elapsed = time.perf_counter() - start
            best[name] = min(best[name], elapsed)
            spent += elapsed
        rounds += 1
    return best


def matches(out: torch.Tensor, reference: torch.Tensor, rtol: float) -> bool:
    """Whether `out` equals `reference` within `rtol` of the reference's largest magnitude
    (a relative error on the whole tensor: fine for kernels whose error is rounding)."""
    if out.shape != reference.shape:
        return False
    diff = (out.float() - reference.float()).abs().max().item()
    return diff == diff and diff <= rtol * max(reference.float().abs().max().item(), 1e-6)


def choose(
    table: TuningTable,
    op: str,
    shape: str,
    buckets: tuple[int, ...],
    candidates: Mapping[str, Setup],
    reference: Callable[[int], torch.Tensor],
    rtol: float,
    work: Callable[[int], float] | None = None,
    unit: str = "flop",
    calls_per_run: int | Callable[[int], int] = 1,
    prune: bool = True,
) -> dict[int, str]:
    """The fastest correct candidate of `op` at each row bucket, measured (or looked up in `table`).

    Args:
        table: the machine's tuning table; new measurements are added to it (save it afterwards).
        op / shape: names of the op and of its shape (e.g. "linear", "576x1536"), the entry's key.
        buckets: row counts to choose for, ascending.
        candidates: name -> `setup(rows)`, which returns a zero-argument callable computing the op
            on `rows` rows of prepared input. A `setup` or call that raises drops the candidate.
        reference: `rows` -> the reference output for that input; a candidate whose output differs
            by more than `rtol` (relative to the reference's largest magnitude) is dropped.
        work: `rows` -> flops (or bytes) of one op, kept for the printed rates.
        calls_per_run: how many ops one call runs (e.g. on distinct weights, so that they stream
            from memory as in a model step instead of staying in a core's cache), or `rows` -> that
            count; the recorded times are per op. Calls of `LONG_CALL_S` or more are timed over
            fewer rounds (`fastest_seconds`).
        prune: stop timing a candidate after two buckets in a row at `PRUNE_RATIO` times the
            fastest: right where a candidate only falls further behind as rows grow (a vector
            kernel against a matrix-unit one), wrong where the lead changes hands.

    Returns:
        bucket -> chosen candidate name.

    Raises:
        RuntimeError: no candidate is correct at some bucket (the reference's own path should
            always be among the candidates).
    """
    chosen: dict[int, str] = {}
    slow_streak = dict.fromkeys(candidates, 0)
    dropped: dict[str, str] = {}
    for rows in buckets:
        key = entry_key(op, shape, rows)
        entry = table.entries.get(key)
        if entry is not None and entry["chosen"] in candidates:
            chosen[rows] = entry["chosen"]
            continue
        _announce_measuring(table)
        skipped = {n for n in candidates if n in dropped or (prune and slow_streak[n] >= 2)}
        ready = _correct_calls(candidates, skipped, rows, reference(rows), rtol, dropped, f"{op} {shape}")
        per_call = calls_per_run(rows) if callable(calls_per_run) else calls_per_run
        seconds = fastest_seconds(ready, long_call_s=LONG_CALL_S)
        measured = {name: 1e3 * s / per_call for name, s in seconds.items()}
        times: dict[str, float | None] = {name: measured.get(name) for name in candidates}
        timed = {n: t for n, t in times.items() if t is not None}
        if not timed:
            raise RuntimeError(f"no correct kernel for {op} {shape} at {rows} rows: {dropped}")
        best = min(timed, key=timed.__getitem__)
        for name, t in timed.items():
            slow_streak[name] = slow_streak[name] + 1 if t > PRUNE_RATIO * timed[best] else 0
        chosen[rows] = best
        table.entries[key] = {
            "chosen": best,
            "ms": times,
            "dropped": {n: r for n, r in dropped.items() if n in candidates},
            "work": None if work is None else float(work(rows)),
            "unit": unit,
        }
        table.dirty = True
    return chosen


def _announce_measuring(table: TuningTable) -> None:
    """Say once per table, before the first measurement, that this start measures the kernels."""
    if table.announced:
        return
    table.announced = True
    where = f" in {table.path}" if table.path else ""
    logger.info(
        "measuring this machine's kernels on the model's shapes (once for a machine, model "
        "shape and thread count: later starts read the table%s)",
        where,
        extra=PROGRESS,
    )


def _correct_calls(
    candidates: Mapping[str, Callable[[int], Callable[[], torch.Tensor]]],
    skipped: set[str],
    rows: int,
    expected: torch.Tensor,
    rtol: float,
    dropped: dict[str, str],
    what: str,
) -> dict[str, Callable[[], torch.Tensor]]:
    """The candidates (but `skipped`) set up for `rows` rows whose output matches `expected` within
    `rtol`: name -> the call to time. A candidate that raises or differs goes into `dropped` (name ->
    reason) with one warning naming `what` (op and shape)."""
    ready: dict[str, Callable[[], torch.Tensor]] = {}
    for name, setup in candidates.items():
        if name in skipped:
            continue
        try:
            call = setup(rows)
            if not matches(call(), expected, rtol):  # also the warm-up call
                raise ValueError(f"output differs from the reference by more than {rtol:g} relative")
            ready[name] = call
        except Exception as exc:  # noqa: BLE001  a broken candidate must never stop the run
            dropped[name] = f"{type(exc).__name__}: {exc}"
            logger.warning("kernel %s for %s dropped at %d rows: %s", name, what, rows, exc)
    return ready
