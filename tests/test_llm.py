"""`LLM.generate`: an interrupted call leaves the engine empty for the next one."""

from __future__ import annotations

import pytest

from batchgen import LLM, SamplingParams


def test_interrupted_generate_aborts_its_requests(tiny_model_dir, monkeypatch):
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", num_threads=1)
    engine = llm.llm_engine
    prompts = [{"prompt_token_ids": [5 + i, 9, 11 + i]} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    real_step = engine.step
    steps = {"n": 0}

    def interrupted_step():
        steps["n"] += 1
        if steps["n"] == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params)
    assert not engine.has_unfinished_requests() and engine.block_manager.num_used_blocks == 0
    monkeypatch.setattr(engine, "step", real_step)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected


def test_a_request_is_scheduled_before_its_first_token(tiny_model_dir):
    """The wait ends when the step that serves the request begins, not after its forward pass."""
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", num_threads=1)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": list(range(3, 40))}], params)
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time < m.first_token_time <= m.finish_time
