"""SamplingParams: every field checked with a message naming it; changes after construction count."""

from __future__ import annotations

import numpy as np
import pytest

from batchgen import LLM, SamplingParams, StructuredOutputsParams


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"temperature": -0.1}, ValueError, "temperature must be >= 0"),
        ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, ValueError, "top_k must be -1, 0"),
        ({"min_p": 1.5}, ValueError, r"min_p must be in \[0, 1\]"),
        ({"max_tokens": 0}, ValueError, "max_tokens must be >= 1"),
        ({"min_tokens": 5, "max_tokens": 2}, ValueError, "min_tokens .* must be <= max_tokens"),
        ({"seed": 2**64}, ValueError, r"seed must be in \[-2\*\*63, 2\*\*64\)"),
        ({"seed": -(2**63) - 1}, ValueError, "seed must be in"),
        ({"seed": 1.5}, TypeError, "seed must be an integer"),
        ({"stop": [""]}, ValueError, "stop strings must not be empty"),
        ({"stop": 5}, TypeError, "stop must be a string or a list of strings"),
        ({"stop_token_ids": 5}, TypeError, "stop_token_ids must be a list of token ids"),
        ({"stop_token_ids": [1, "2"]}, TypeError, r"stop_token_ids\[\] must be an integer"),
        ({"stop_token_ids": [3, -1]}, ValueError, r"stop_token_ids must be token ids \(>= 0\), got -1"),
        ({"ignore_eos": "yes"}, TypeError, "ignore_eos must be True or False"),
        ({"skip_special_tokens": None}, TypeError, "skip_special_tokens must be True or False"),
        ({"priority": 1.0}, TypeError, "priority must be an integer"),
        ({"prompt_logprobs": 21}, ValueError, r"prompt_logprobs must be None or in \[0, 20\], got 21"),
        ({"prompt_logprobs": -1}, ValueError, r"prompt_logprobs must be None or in \[0, 20\]"),
        ({"prompt_logprobs": True}, TypeError, "prompt_logprobs must be an integer"),
        ({"prompt_logprobs": 2.0}, TypeError, "prompt_logprobs must be an integer"),
    ],
)
def test_invalid_fields_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)


def test_extreme_seeds_are_accepted():
    for seed in (0, 2**64 - 1, -(2**63)):
        SamplingParams(seed=seed)


def test_top_k_off_has_one_form():
    """-1 and 0 both turn top_k off (vLLM's two words): one value, so the two hash alike (a job's
    row hash, its resume identity) and a job resumed with the other word keeps its rows."""
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=-1).to_dict() == SamplingParams(top_k=0).to_dict()
    assert SamplingParams(top_k=5).top_k == 5


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("llama")), dtype="float32", num_threads=1)


def test_the_largest_seed_samples(tiny_llm):
    params = SamplingParams(temperature=1.0, seed=2**64 - 1, max_tokens=4, ignore_eos=True)
    first, again = (tiny_llm.generate([{"prompt_token_ids": [5, 6, 7]}], params)[0] for _ in range(2))
    assert first.outputs[0].token_ids == again.outputs[0].token_ids and len(first.outputs[0].token_ids) == 4


def test_fields_changed_after_construction_are_used_and_checked(tiny_llm):
    prompt = [{"prompt_token_ids": [5, 6, 7, 8]}]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = tiny_llm.generate(prompt, params)[0].outputs[0].token_ids
    params.stop_token_ids = [tokens[2]]
    params.max_tokens = 6
    out = tiny_llm.generate(prompt, params)[0].outputs[0]
    assert out.token_ids == tokens[:3] and out.finish_reason == "stop"
    params.stop_token_ids, params.stop = None, "x"
    assert params.stop_strings == ["x"]
    params.max_tokens = 0
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        tiny_llm.generate(prompt, params)
    assert not tiny_llm.llm_engine.has_unfinished_requests()


def test_generate_refuses_sampling_params_of_another_type(tiny_llm):
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a list of them"):
        tiny_llm.generate("Hello", {"max_tokens": 3})


def test_a_list_of_sampling_params_holds_only_sampling_params(tiny_llm):
    # `None` there once ran its prompt on SamplingParams() (temperature 1, 16 tokens) without a word
    with pytest.raises(TypeError, match=r"sampling_params\[1\] is NoneType, not SamplingParams"):
        tiny_llm.generate(["a", "b"], [SamplingParams(max_tokens=2), None])


def test_bytes_are_refused_as_prompts_not_read_byte_by_byte(tiny_llm):
    with pytest.raises(TypeError, match=r"not bytes: decode them first"):
        tiny_llm.generate(b"hello", SamplingParams(max_tokens=2))


def test_token_id_lists_and_images_are_error_rows_that_say_what_to_pass(tiny_llm):
    ids, image = tiny_llm.generate(
        [[5, 6, 7], {"prompt": "hi", "multi_modal_data": {"image": "x"}}], SamplingParams(max_tokens=2)
    )
    assert ids.outputs[0].finish_reason == "error" and "{'prompt_token_ids': [...]}" in ids.error
    assert image.outputs[0].finish_reason == "error" and "multi_modal_data is not supported" in image.error


def test_numpy_scalars_are_taken_as_python_numbers():
    """Values read from a pandas or Arrow column are NumPy scalars."""
    params = SamplingParams(max_tokens=np.int64(5), temperature=np.float32(0.5), seed=np.uint64(3))
    assert (params.max_tokens, params.temperature, params.seed) == (5, 0.5, 3)
    assert type(params.max_tokens) is int and type(params.temperature) is float and type(params.seed) is int
    with pytest.raises(TypeError, match="max_tokens must be an integer"):
        SamplingParams(max_tokens=True)


def test_generate_needs_one_sampling_params_per_prompt(tiny_llm):
    with pytest.raises(
        ValueError, match=r"lengths of prompts \(2\) and sampling_params \(1\) must be the same"
    ):
        tiny_llm.generate(["a", "b"], [SamplingParams(max_tokens=2)])


def test_prompt_logprobs_join_a_rows_identity_only_when_set(tiny_llm):
    """None leaves `to_dict` (a job row's hash) as it was before the field existed; and an output
    has `prompt_logprobs`, None unless asked, as vLLM's."""
    assert "prompt_logprobs" not in SamplingParams().to_dict()
    assert SamplingParams(prompt_logprobs=0).to_dict()["prompt_logprobs"] == 0
    (out,) = tiny_llm.generate("Hello there", SamplingParams(max_tokens=2))
    assert out.prompt_logprobs is None


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({}, ValueError, "needs exactly one of json, regex, choice, grammar, json_object; got none"),
        ({"json": {}, "regex": "a"}, ValueError, "got json and regex: give one constraint"),
        ({"json_object": False}, ValueError, "got none"),
        ({"json": "{bad"}, ValueError, r"structured_outputs.json is not valid JSON \(.*\); fix the schema"),
        ({"json": "[1, 2]"}, TypeError, "must be a JSON schema object, got list"),
        ({"regex": ""}, TypeError, "structured_outputs.regex must be a non-empty string"),
        ({"grammar": 5}, TypeError, "structured_outputs.grammar must be a non-empty string"),
        ({"choice": []}, ValueError, "structured_outputs.choice must be a non-empty list"),
        ({"choice": "a,b"}, ValueError, "structured_outputs.choice must be a non-empty list"),
        ({"choice": ["a", ""]}, TypeError, "must hold non-empty strings only"),
        ({"json_object": "yes"}, TypeError, "json_object must be True or False"),
    ],
)
def test_invalid_structured_outputs_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        StructuredOutputsParams(**kwargs)
    with pytest.raises(error, match=message):
        SamplingParams(structured_outputs=kwargs)


def test_structured_outputs_from_a_dict_and_their_canonical_text():
    """A dict of fields is taken as StructuredOutputsParams; JSON text and a dict of the same
    schema share one canonical text (key order kept: it is the output's property order); an
    unknown field and min_tokens are refused by name."""
    params = SamplingParams(
        structured_outputs={"json": '{ "type": "object", "properties": {"b": {}, "a": {}} }'}
    )
    assert isinstance(params.structured_outputs, StructuredOutputsParams)
    same = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    assert params.structured_outputs.key == same.key == 'json:{"type":"object","properties":{"b":{},"a":{}}}'
    other = StructuredOutputsParams(json={"type": "object", "properties": {"a": {}, "b": {}}})
    assert other.key != same.key
    assert params.to_dict()["structured_outputs"] == {
        "json": '{"type":"object","properties":{"b":{},"a":{}}}'
    }
    assert "structured_outputs" not in SamplingParams().to_dict()  # old rows' hashes unchanged
    assert StructuredOutputsParams(choice=["a", "b"]).key == 'choice:["a", "b"]'
    with pytest.raises(TypeError, match="unknown field.*'guided_json'; use one of json, regex"):
        SamplingParams(structured_outputs={"guided_json": {}})
    with pytest.raises(ValueError, match=r"min_tokens \(2\) cannot be combined with structured_outputs"):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a+"})
    with pytest.raises(TypeError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")
