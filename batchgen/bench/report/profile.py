"""`batchgen bench --profile`: cProfile of the engine's steps in each timed batchgen run, as a table.

Only `engine.step()` runs under the profiler (the bench's own loop, the warm-up request and the
untimed warm-up configuration do not), so the table is the engine's time: scheduling, the model's
forward, sampling, bookkeeping. A C kernel called through ctypes is no function to cProfile: its
time is the own time of the Python function that calls it (`kernels/cpu/*.py`); torch's operators
show as `<built-in method ...>`. A profiled run is slower than a plain one (cProfile's overhead on
every Python call), so compare the figures of a profiled run with each other, not with a plain run's.
"""

from __future__ import annotations

import cProfile
import pstats
from dataclasses import dataclass
from pathlib import Path

from batchgen.engine.protocol import Engine
from batchgen.outputs import RequestOutput

PRINTED_ROWS = 20  # rows a configuration prints, by own time
FILE_ROWS = 60  # rows a configuration writes to the file, by own time and again by cumulative time
_PACKAGE_ROOT = Path(__file__).resolve().parents[3]  # the folder holding batchgen/ and kernels/


def profiled_step(engine: Engine, profiler: cProfile.Profile | None) -> list[RequestOutput]:
    """`engine.step()`, under `profiler` when one is given (None: no profiling)."""
    return engine.step() if profiler is None else profiler.runcall(engine.step)


@dataclass
class ProfileRow:
    """One function's line of the table.

    Attributes:
        function: `path:line name`, the path relative to the checkout for batchgen's own files
            (`batchgen/engine/scheduler.py:41 schedule`), else its last two parts; `<built-in
            method ...>` for a function written in C.
        calls: primitive calls (recursive calls not counted again).
        own_s: seconds spent in the function itself (seconds).
        cumulative_s: seconds spent in it and everything it called (seconds).
    """

    function: str
    calls: int
    own_s: float
    cumulative_s: float


def _name(file: str, line: int, name: str) -> str:
    if file == "~":  # a function written in C
        return name
    path = Path(file)
    try:
        shown = path.resolve().relative_to(_PACKAGE_ROOT).as_posix()
    except ValueError:
        shown = "/".join(path.parts[-2:]) if path.parts else file
    return f"{shown}:{line} {name}"


def profile_rows(profiler: cProfile.Profile, sort: str = "own") -> list[ProfileRow]:
    """Every function the profiler saw, by own time (`sort` "own") or cumulative time ("cumulative"),
    largest first.

    Raises:
        ValueError: `sort` is neither "own" nor "cumulative".
    """
    if sort not in ("own", "cumulative"):
        raise ValueError(f"sort must be 'own' or 'cumulative', got {sort!r}")
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]  # pstats' documented table
    rows = [
        ProfileRow(_name(*key), primitive, own, cumulative)
        for key, (primitive, _calls, own, cumulative, _callers) in stats.items()
    ]
    return sorted(rows, key=lambda r: r.own_s if sort == "own" else r.cumulative_s, reverse=True)


def step_calls(profiler: cProfile.Profile) -> int:
    """How many engine steps ran under the profiler: the calls of the functions named `step` that
    nothing profiled called (each `profiler.runcall(engine.step)` enters one)."""
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    return sum(
        primitive
        for (_file, _line, name), (primitive, _calls, _own, _cumulative, callers) in stats.items()
        if name == "step" and not callers
    )


def render_profile(name: str, profiler: cProfile.Profile, rows: int, sort: str = "own") -> str:
    """The table of one configuration: a heading line, then `rows` functions by `sort` time."""
    table = profile_rows(profiler, sort)
    total = sum(r.own_s for r in table)
    by = "own time" if sort == "own" else "cumulative time"
    lines = [
        f"profile of {name}: {step_calls(profiler)} engine steps, {total:.2f} s under cProfile; "
        f"top {min(rows, len(table))} functions by {by}",
        f"{'own s':>9} {'cum s':>9} {'calls':>9}  function",
    ]
    lines += [f"{r.own_s:9.3f} {r.cumulative_s:9.3f} {r.calls:9d}  {r.function}" for r in table[:rows]]
    return "\n".join(lines)


def write_profiles(profiles: dict[str, cProfile.Profile], path: Path) -> None:
    """Write every configuration's table to `path` (text): `FILE_ROWS` functions by own time, then
    by cumulative time.

    Raises:
        OSError: the file cannot be written.
    """
    parts = []
    for name, profiler in profiles.items():
        parts.append(render_profile(name, profiler, FILE_ROWS, "own"))
        parts.append(render_profile(name, profiler, FILE_ROWS, "cumulative"))
    path.write_text("\n\n".join(parts) + "\n")
