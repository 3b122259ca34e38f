"""CPU threads that follow the cores other processes leave free.

A step's work is split over torch's OpenMP threads (and batchgen's C kernels, which share torch's
OpenMP runtime). OpenMP threads meet at a barrier after every parallel region; when another
process holds one of the cores, the thread on it is descheduled for a whole scheduler slice
(milliseconds) while its peers spin at the barrier, once per region and hundreds of regions per
step, which made batchgen many times slower beside one busy process on a 2-core machine (issue 29;
measured: docs/benchmarks.md). Running as many threads as there are cores nobody else uses keeps
the loss to about the share of the cores taken.

`CpuThreads` measures the other processes' load (`batchgen.kernels.machine_load`: /proc/stat, all
CPU time on the machine less this process's own) at engine start and again every `recheck_s`
seconds between steps, and sets `torch.set_num_threads` to the cores left free (at least one). A
user's `--num-threads` is kept as given (with a warning when the machine is busy). On a system
without /proc/stat (not Linux), nothing is measured and torch's default stays.
"""

from __future__ import annotations

import logging
import time

import torch

from batchgen.kernels.machine_load import BUSY_CORES, LoadSample, other_load, usable_cores

logger = logging.getLogger(__name__)


class CpuThreads:
    """Keeps torch's thread count at the cores other processes leave free.

    Args:
        requested: the user's `num_threads` (kept as given), or None to follow the load.
        recheck_s: seconds between measurements during the run (between steps; a measurement is
            two reads of /proc/stat, microseconds).
        sample_s: length of the first measurement at start (seconds).

    Raises:
        ValueError: `requested` is more than the CPUs this process may run on. The threads of every
            parallel region wait for each other at its end, so threads beyond the CPUs spend each
            region waiting for a CPU: a 1,000-thread run on 2 cores seemed to hang at start.
    """

    def __init__(self, requested: int | None, recheck_s: float = 20.0, sample_s: float = 0.1) -> None:
        self.requested = requested
        self.cores = usable_cores()
        if requested is not None and requested > self.cores:
            raise ValueError(
                f"num_threads is {requested}, more than the {self.cores} CPUs this process may run on; "
                f"give at most {self.cores}, or leave it unset to use the CPUs other processes leave free"
            )
        self.recheck_s = recheck_s
        self.threads = requested or torch.get_num_threads()
        self._default = torch.get_num_threads()
        load = other_load(sample_s)
        self._last = LoadSample()
        if load is not None:
            self._apply(load, at_start=True)

    def free_cores(self, load: float) -> int:
        """Cores left when others use `load` cores' worth of CPU (at least one)."""
        taken = int(load + (1 - BUSY_CORES))  # 0.5 of a core or more counts as a core
        return max(1, min(self._default, self.cores - taken))

    def maybe_adjust(self) -> None:
        """Measure again once `recheck_s` has passed since the last measurement; cheap otherwise."""
        if self.requested is not None or time.monotonic() - self._last.wall < self.recheck_s:
            return
        now = LoadSample()
        load = now.other_cores_since(self._last)
        self._last = now
        if load is not None:
            self._apply(load, at_start=False)

    def _apply(self, load: float, at_start: bool) -> None:
        if self.requested is not None:
            if at_start and load >= BUSY_CORES:
                logger.warning(
                    "the machine is busy: other processes use %.1f of its %d cores; batchgen keeps the "
                    "--num-threads %d given (fewer threads than free cores run faster on a busy machine)",
                    load,
                    self.cores,
                    self.requested,
                )
            return
        threads = self.free_cores(load)
        if threads == self.threads:
            return
        if at_start or threads < self.threads:
            logger.warning(
                "the machine is busy: other processes use %.1f of its %d cores; batchgen runs %d "
                "thread%s (it measures again every %.0f s; --num-threads fixes the count)",
                load,
                self.cores,
                threads,
                "" if threads == 1 else "s",
                self.recheck_s,
            )
        else:
            logger.info(
                "the machine is less busy (others use %.1f cores): batchgen runs %d threads", load, threads
            )
        self.threads = threads
        torch.set_num_threads(threads)
