"""The model runner's step path copies to the host once a step: the sampled ids with each row's
finite-logits flag (`ModelRunner.execute`). On a GPU every such copy is a sync that stalls the host
while the device drains its queue, so a second one would cost a step's pipelining."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from batchgen.config import EngineConfig
from batchgen.engine.llm_engine import LLMEngine
from batchgen.sampling_params import SamplingParams

# Tensor methods that read a tensor's values into Python: on a device tensor each is a copy to the
# host and a sync.
_HOST_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__")


@pytest.fixture
def host_reads(monkeypatch) -> Counter:
    """Counts the calls of `_HOST_READS` on any tensor while the test runs."""
    seen: Counter = Counter()
    for name in _HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            seen[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return seen


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0.7, presence_penalty=0.5, repetition_penalty=1.2, max_tokens=4, seed=3),
    ],
    ids=["greedy", "filters", "penalties"],
)
def test_a_step_reads_the_device_once(tiny_model_dir, host_reads, params) -> None:
    """Prefill steps (chunked: 8 tokens a step), mixed steps and decode steps on the torch backend
    (the device-agnostic path a GPU runs): one read for each step that samples (the sampled ids),
    none for a step that only prefills."""
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir("llama")),
            dtype="float32",
            attention_backend="torch",
            max_num_batched_tokens=8,
        )
    )
    engine.add_request("a", {"prompt_token_ids": list(range(100, 112))}, params)
    engine.add_request("b", {"prompt_token_ids": [7, 8, 9]}, params)
    host_reads.clear()  # set-up reads (weights, the warm-up) are not the step path
    sampling, prefill_only = [], []
    while engine.has_unfinished_requests():
        before = sum(host_reads.values())
        engine.step()
        reads = sum(host_reads.values()) - before
        (sampling if engine.last_step.num_generation_tokens else prefill_only).append(reads)
    assert sampling and set(sampling) == {1}, (sampling, host_reads)
    assert prefill_only and set(prefill_only) == {0}, prefill_only  # the 12-token prompt's first chunk
    assert host_reads["tolist"] == len(sampling)
