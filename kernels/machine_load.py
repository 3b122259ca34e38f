"""Other processes' CPU use, read from /proc/stat: what the engine's thread count follows
(`batchgen.engine.cpu_threads`) and what tells the kernel registry that its timings were taken on a
busy machine (`registry.TuningTable`).

Load is in cores: 1.0 means other processes kept one core busy on average. This process's own CPU
time is subtracted, so a run keeping every core busy itself does not see a busy machine. On a system
without /proc/stat (not Linux), nothing is measured (None).
"""

from __future__ import annotations

import os
import time

# A core counts as taken when other processes keep it this busy (fraction of one core) on average.
BUSY_CORES = 0.5
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask; all CPUs where that is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _busy_seconds(cpus: frozenset[int] | None) -> float | None:
    """CPU seconds the CPUs in `cpus` (None: all) spent busy, not idle nor waiting for I/O, since
    boot. Only the CPUs this process may use count: in a container pinned to a few CPUs of a big
    host, the others' load is not ours to yield to."""
    try:
        with open("/proc/stat") as stat:
            lines = stat.readlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or not name[3:].isdigit():
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        # user nice system idle iowait irq softirq steal (guest time is already in user / nice)
        ticks = [int(v) for v in rest.split()[:8]]
        busy += sum(ticks[:3]) + sum(ticks[5:8])
    return busy / _CLOCK_TICKS if busy else None


def _allowed_cpus() -> frozenset[int] | None:
    return frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def _own_seconds() -> float:
    times = os.times()
    return times.user + times.system


class LoadSample:
    """Other processes' CPU use between two readings, in cores (1.0 = one core kept busy)."""

    def __init__(self) -> None:
        self.wall = time.monotonic()
        self.machine = _busy_seconds(_allowed_cpus())
        self.own = _own_seconds()

    def other_cores_since(self, earlier: LoadSample) -> float | None:
        if self.machine is None or earlier.machine is None:
            return None
        elapsed = self.wall - earlier.wall
        if elapsed <= 0:
            return None
        others = (self.machine - earlier.machine) - (self.own - earlier.own)
        return max(0.0, others / elapsed)


def other_load(sample_s: float = 0.2) -> float | None:
    """Cores' worth of CPU that other processes use, measured over `sample_s` seconds (None where
    /proc/stat is not available)."""
    first = LoadSample()
    time.sleep(sample_s)
    return LoadSample().other_cores_since(first)
