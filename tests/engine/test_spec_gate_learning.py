"""The gate learns the job's acceptance while closed (shadow drafts) and opens on it: a real engine
on a tiny model, with a cost curve set by the test so that the gate starts closed."""

from __future__ import annotations

import transformers

from batchgen import LLM
from batchgen.engine.spec_gate import SpeculationGate
from tests.engine.test_fidelity import TEXT_PROMPTS, hf_greedy
from tests.engine.test_spec_decode_fidelity import GREEDY, REPETITIVE

# t_spec / t_dec: 2.2 at every batch: closed at the prior of 1 accepted draft per verification,
# open to every batch once the job accepts 1.2 or more (the tiny model's loops accept about 1.3).
POINTS = [(1, 1.0, 2.2), (2, 1.0, 2.2), (4, 1.0, 2.2), (8, 1.0, 2.2), (16, 1.0, 2.2)]


def test_a_closed_gate_opens_on_the_acceptance_it_sees(tiny_model_dir, monkeypatch):
    path = tiny_model_dir("llama")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt_ids = [tok(p)["input_ids"] for p in TEXT_PROMPTS + REPETITIVE]
    expected = hf_greedy(path, prompt_ids, GREEDY.max_tokens, ignore_eos=True)
    llm = LLM(str(path), dtype="float32", speculative_method="ngram", speculative_max_batch=0)
    engine = llm.llm_engine
    gate = engine.speculation.gate = SpeculationGate(POINTS, limit=16)
    engine.scheduler.speculative_max_batch = gate.max_batch
    assert gate.max_batch == 0
    schedule = engine.scheduler.schedule
    steps = []  # (running at the step's start, the gate then, the step)

    def watched():
        running, limit = len(engine.scheduler.running), engine.scheduler.speculative_max_batch
        out = schedule()
        steps.append((running, limit, out))
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", watched)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    shadow = sum(out.num_shadow_drafts for _, _, out in steps)
    real = sum(out.num_drafts for _, _, out in steps)
    assert shadow > 0 and gate.num_drafts == shadow + real
    assert gate.accepted_per_verification >= 1.2, "the tiny model's loops were meant to accept"
    first_open = next(i for i, (_, limit, _) in enumerate(steps) if limit > 0)
    assert all(out.num_drafts == 0 for _, _, out in steps[:first_open])  # closed: shadows only
    assert real > 0 and all(running <= limit for running, limit, out in steps if out.num_drafts)
