"""batchgen's CPU threads follow the cores other processes leave free (issue 29)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from batchgen.engine import cpu_threads
from batchgen.engine.cpu_threads import CpuThreads
from batchgen.kernels import machine_load
from batchgen.kernels.machine_load import other_load

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat (Linux)")


@pytest.fixture(autouse=True)
def keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_busy_process_is_measured():
    """A spinning child process is seen as most of a core's load; our own work is not counted."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # started and spinning
        load = other_load(0.5)
    finally:
        busy.kill()
        busy.wait()
    assert load is not None and load >= 0.7


def test_our_own_threads_are_not_counted_as_others(monkeypatch):
    """The machine's busy time less this process's own: a run that keeps both cores busy itself
    does not see a busy machine."""
    clock = {"now": 0.0}
    monkeypatch.setattr(machine_load, "_busy_seconds", lambda cpus: 2.0 * clock["now"])
    monkeypatch.setattr(machine_load, "_own_seconds", lambda: 1.9 * clock["now"])
    monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: clock["now"])
    first = machine_load.LoadSample()
    clock["now"] = 10.0
    assert machine_load.LoadSample().other_cores_since(first) == pytest.approx(0.1)


class FakeMachine:
    """/proc/stat and the clock as the governor sees them: `others` cores' worth of load."""

    def __init__(self, monkeypatch, cores: int, others: float) -> None:
        self.now, self.busy, self.others = 1000.0, 0.0, others
        monkeypatch.setattr(cpu_threads, "usable_cores", lambda: cores)
        monkeypatch.setattr(machine_load, "_busy_seconds", lambda cpus: self.busy)
        monkeypatch.setattr(machine_load, "_own_seconds", lambda: 0.0)
        monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(cpu_threads.time, "sleep", self.advance)

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.busy += self.others * seconds


def test_threads_follow_the_free_cores(monkeypatch, caplog):
    torch.set_num_threads(4)
    machine = FakeMachine(monkeypatch, cores=4, others=1.0)
    with caplog.at_level("WARNING", logger="batchgen.engine.cpu_threads"):
        governor = CpuThreads(None, recheck_s=10.0)
    assert governor.threads == 3 and torch.get_num_threads() == 3
    assert sum("the machine is busy" in r.getMessage() for r in caplog.records) == 1

    machine.advance(5.0)
    governor.maybe_adjust()  # too soon: no measurement
    assert torch.get_num_threads() == 3
    machine.others = 2.6  # a second and a third busy process
    machine.advance(6.0)
    governor.maybe_adjust()  # over the last 11 s others averaged (5 * 1 + 6 * 2.6) / 11 = 1.9 cores
    assert torch.get_num_threads() == 2
    machine.others = 0.0
    machine.advance(20.0)
    governor.maybe_adjust()
    assert torch.get_num_threads() == 4  # back to the default when the others are gone


def test_an_idle_machine_keeps_the_default_and_a_given_count_is_kept(monkeypatch, caplog):
    torch.set_num_threads(2)
    FakeMachine(monkeypatch, cores=2, others=0.1)
    assert CpuThreads(None).threads == 2 and torch.get_num_threads() == 2
    FakeMachine(monkeypatch, cores=2, others=1.0)
    with caplog.at_level("WARNING", logger="batchgen.engine.cpu_threads"):
        kept = CpuThreads(2)
    assert kept.threads == 2 and torch.get_num_threads() == 2
    assert any("keeps the --num-threads 2" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("load, free", [(0.0, 4), (0.4, 4), (0.5, 3), (1.4, 3), (1.6, 2), (9.0, 1)])
def test_free_cores(monkeypatch, load, free):
    torch.set_num_threads(4)
    FakeMachine(monkeypatch, cores=4, others=0.0)
    assert CpuThreads(None).free_cores(load) == free


def test_more_threads_than_cpus_are_refused_before_torch_gets_them(monkeypatch):
    """A 1,000-thread run on 2 cores seemed to hang at start (every parallel region waits for
    threads that have no CPU): refused, naming the CPUs, before `torch.set_num_threads`."""
    torch.set_num_threads(1)
    FakeMachine(monkeypatch, cores=2, others=0.0)
    assert CpuThreads(2).threads == 2
    with pytest.raises(ValueError, match="num_threads is 3, more than the 2 CPUs this process may run on"):
        CpuThreads(3)
    from batchgen.config import EngineConfig
    from batchgen.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="num_threads is 1000"):
        LLMEngine(EngineConfig(model="/nonexistent", num_threads=1000))  # before the model is looked up
    assert torch.get_num_threads() == 1
