"""The jobs layer's engine contract (`batchgen.engine.protocol.Engine`): the real engine and the job
tests' fake engine both provide every member it names."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from batchgen.engine.llm_engine import LLMEngine
from batchgen.engine.protocol import BenchEngine, Engine
from tests.jobs.fake_engine import FakeEngine


def protocol_members() -> tuple[set[str], set[str]]:
    """(attributes the protocol annotates, its methods and properties)."""
    attributes = set(Engine.__annotations__)
    callables = {
        n
        for n, v in vars(Engine).items()
        if not n.startswith("_") and (callable(v) or isinstance(v, property))
    }
    return attributes, callables


def test_the_fake_engine_provides_the_protocol() -> None:
    attributes, callables = protocol_members()
    assert {"encode_prompt", "check_prompt_len", "add_request", "step", "start_line"} <= callables
    engine = FakeEngine()
    for name in attributes | callables:
        assert hasattr(engine, name), name
    assert engine.check_prompt_len(engine.max_model_len - 1) is None
    assert "max_model_len is 64" in engine.check_prompt_len(64)


def test_the_real_engine_provides_the_protocol() -> None:
    attributes, callables = protocol_members()
    init = inspect.getsource(LLMEngine.__init__)
    for name in callables:  # a read-only member (`tokenizer`) may be an attribute __init__ sets
        assert hasattr(LLMEngine, name) or re.search(rf"self\.{name}\b(: [^=]+)? = ", init), name
    for name in attributes:  # set on the instance by __init__
        assert re.search(rf"self\.{name}\b(: [^=]+)? = ", init), name


def test_the_real_engine_provides_what_the_bench_reads() -> None:
    """`BenchEngine`'s own members are set on an `LLMEngine` by `__init__` (the bench reads no other)."""
    init = inspect.getsource(LLMEngine.__init__)
    own = set(BenchEngine.__annotations__)
    assert {"model_config", "dtype", "num_gpu_blocks", "kernel_choice", "speculation"} <= own
    for name in own:
        assert re.search(rf"self\.{name}\b(: [^=]+)? = ", init), name


def test_the_bench_reads_the_engine_through_the_protocol() -> None:
    """No `getattr` / `hasattr` on an engine object anywhere in batchgen/bench/."""
    bench = Path(__file__).resolve().parents[2] / "batchgen" / "bench"
    probes = [
        f"{path.name}: {line.strip()}"
        for path in sorted(bench.rglob("*.py"))
        for line in path.read_text().splitlines()
        if re.search(r"\b(getattr|hasattr)\((self\.)?engine\b", line)
    ]
    assert not probes, probes
