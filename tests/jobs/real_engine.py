"""Helpers for job tests on the real engine (a tiny model): a quiet dashboard, and an engine factory
whose engine raises at a chosen step, to test what a crash leaves and how the job resumes."""

from __future__ import annotations

import io
from typing import Any

import rich.console

from batchgen.dashboard import Dashboard


def quiet() -> Dashboard:
    """A dashboard that prints nothing (plain mode, into a buffer)."""
    return Dashboard(None, live=False, stream=io.StringIO(), console=rich.console.Console(file=io.StringIO()))


def crashing_factory(at_step: int):
    """An `engine_factory` for `run_job` whose LLMEngine raises RuntimeError("simulated crash") at
    its `at_step`-th step (1-based), after the steps before it ran as usual."""
    from batchgen.engine.llm_engine import LLMEngine

    def make(config: Any) -> LLMEngine:
        engine = LLMEngine(config)
        step, steps = engine.step, [0]

        def step_or_crash():
            steps[0] += 1
            if steps[0] == at_step:
                raise RuntimeError("simulated crash")
            return step()

        engine.step = step_or_crash
        return engine

    return make
