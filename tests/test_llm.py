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


def test_ids_past_a_smaller_model_vocab_fail_their_row_not_the_call(tmp_path, tiny_model_dir):
    """A model whose vocab_size (1001) is below its tokenizer's length (49152): ids in between
    cannot be embedded, so such a prompt (given as ids, or text the tokenizer turns into them) comes
    back as an error output naming the mismatch, and the other prompts of the call still run."""
    import json
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    source = tiny_model_dir("llama")
    config = json.loads((source / "config.json").read_text())
    config["vocab_size"] = 1001
    path = tmp_path / "small-vocab"
    shutil.copytree(source, path)
    (path / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.resize_token_embeddings(1001)
    model.save_pretrained(path)

    llm = LLM(str(path), dtype="float32", device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5000, 6]}, "The capital of France is", {"prompt_token_ids": [5, 6, 7]}]
    ids_out, text_out, good = llm.generate(prompts, params)
    for out, source_words in ((ids_out, "prompt_token_ids holds"), (text_out, "the tokenizer produced")):
        assert out.outputs[0].finish_reason == "error"
        assert source_words in out.error and "[0, 1001)" in out.error
        assert "vocab_size is 1001 but its tokenizer has 49152 tokens" in out.error
    assert "[5000]" in ids_out.error
    assert good.error is None and len(good.outputs[0].token_ids) == 4
    # A stop token id the model can never sample fails its request instead of running to max_tokens.
    (never,) = llm.generate(
        [{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=4, stop_token_ids=[7, 1001])
    )
    assert never.outputs[0].finish_reason == "error"
    assert "stop_token_ids holds ids outside the vocabulary [0, 1001): [1001]" in never.error


def test_chat_and_priority_as_in_vllm(tiny_model_dir):
    """`LLM.chat` takes one conversation or a list of them (the chat template applies, as in
    `generate` with message lists); `generate(priority=...)` orders the "priority" policy's queue."""
    from batchgen import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", num_threads=1, policy="priority", max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    talk = [{"role": "user", "content": "Hello there"}]
    (one,) = llm.chat(talk, params)
    assert one.outputs[0].token_ids == llm.generate([talk], params)[0].outputs[0].token_ids
    assert len(llm.chat([talk, talk], params)) == 2
    with pytest.raises(TypeError, match="conversation"):
        llm.chat("Hello", params)
    # OpenAI's content parts read as their text joined by newlines, as in job files and vLLM
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}
    ]
    joined = [{"role": "user", "content": "Hello\nthere"}]
    assert llm.chat(parts, params)[0].prompt_token_ids == llm.chat(joined, params)[0].prompt_token_ids
    (image,) = llm.chat(
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params
    )
    assert image.outputs[0].finish_reason == "error" and "'type': 'text'" in image.error

    prompts = [{"prompt_token_ids": [5, 6, i]} for i in range(3)]
    outs = llm.generate(prompts, params, priority=[2, 0, 1])
    served = sorted(range(3), key=lambda i: outs[i].metrics.first_token_time)
    assert served == [1, 2, 0]
    with pytest.raises(ValueError, match="priority"):
        llm.generate(prompts, params, priority=[1])


def test_prompts_of_no_accepted_form_are_refused_naming_the_forms(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", num_threads=1)
    for value, kind in [(None, "NoneType"), (5, "int")]:
        with pytest.raises(TypeError) as caught:
            llm.generate(value, SamplingParams(max_tokens=2))
        message = str(caught.value)
        assert message.startswith("prompts must be a string, a list of chat messages") and message.endswith(
            f"or a list of these; got {kind}"
        )
        assert "{'prompt_token_ids': [...]}" in message


def test_an_unknown_chat_role_is_an_error_output_worded_as_a_job_rows(tiny_model_dir, tmp_path):
    """The role check of job files (`check_messages`) applies to `generate`'s message lists: the
    request fails alone with the job row's message (behind the engine's "invalid prompt: ")."""
    import json

    from batchgen.jobs.input.reader import JobReader

    wizard = [{"role": "wizard", "content": "hi"}]
    job = tmp_path / "job.jsonl"
    job.write_text(json.dumps({"messages": wizard}) + "\n")
    (row,) = JobReader(str(job))
    prefix = "row 0 (line 1): "
    assert row.error.startswith(prefix) and "'wizard', not a chat role" in row.error

    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", num_threads=1)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    bad, good = llm.generate([wizard, [{"role": "user", "content": "hi"}]], params)
    assert bad.outputs[0].finish_reason == "error"
    assert bad.error == "invalid prompt: " + row.error[len(prefix) :]
    assert good.outputs[0].finish_reason == "length" and len(good.outputs[0].token_ids) == 2
