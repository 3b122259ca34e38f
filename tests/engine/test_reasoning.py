"""Reasoning parsers: the split of texts as vLLM's parsers make it, and the engine keeping the
thinking apart from the answer: a row with thinking then answer, a row cut inside its thinking,
stop strings and structured outputs applying to the answer only, Qwen3's chat template with
`enable_thinking` false, and tokenizers without single-token think tags (split by text).

The engine tests run a scripted tiny model (`tests.engine.thinking_model`): greedy, it writes
`<think>I, maybe</think>\\n\\nyes.` and then EOS, token-identical to Hugging Face `generate`.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
import transformers

from batchgen import LLM, SamplingParams
from batchgen.config import EngineConfig
from batchgen.engine.reasoning import ANSWER, OPEN, THINKING, ReasoningParser, split_text
from batchgen.sampling_params import StructuredOutputsParams
from tests.engine.thinking_model import ANSWER as SCRIPTED_ANSWER
from tests.engine.thinking_model import REASONING, build_thinking_model, script_ids

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
GREEDY = SamplingParams(temperature=0, max_tokens=20)


# ---- texts: vLLM's extract_reasoning on finished outputs ----
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("I think</think>\n\nyes", ("I think", "\n\nyes")),  # the template opened <think>
        ("<think>I think</think>yes", ("I think", "yes")),  # R1-0528 writes the tag itself
        ("I think, and think", ("I think, and think", "")),  # no end tag: all reasoning
        ("<think></think>yes", ("", "yes")),  # an empty thinking is "" (vLLM's too)
        ("a</think>b</think>c", ("a", "b</think>c")),  # the first end tag ends it
    ],
)
def test_deepseek_r1_texts(text, expected):
    assert split_text(text, THINKING) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>\nI think\n</think>\n\nyes", ("\nI think\n", "\n\nyes")),
        ("<think>I think", ("I think", "")),  # cut inside its thinking: all reasoning
        ("just an answer", (None, "just an answer")),  # no start tag: all content
        ("an answer</think> and more", (None, "an answer</think> and more")),
        ("<think><think>x</think>y", ("<think>x", "y")),  # inside the thinking a tag is text
    ],
)
def test_qwen3_texts(text, expected):
    assert split_text(text, OPEN) == expected


def test_an_output_after_a_closed_thinking_is_all_answer():
    assert split_text("yes</think>no", ANSWER) == (None, "yes</think>no")


# ---- where an output starts ----
@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory, tokenizer_dir):
    return build_thinking_model(tmp_path_factory.mktemp("thinking"), tokenizer_dir)


@pytest.fixture(scope="module")
def tokenizer(thinking_model):
    return transformers.AutoTokenizer.from_pretrained(thinking_model)


@pytest.fixture(scope="module")
def ids(tokenizer) -> dict[str, int]:
    return dict(
        zip(
            ["nl", "think", "i", "comma", "maybe", "end", "nlnl", "yes", "dot", "eos"],
            script_ids(tokenizer),
            strict=True,
        )
    )


def test_the_parser_finds_single_token_tags_and_reads_the_prompts_last_tag(tokenizer, ids):
    qwen3, r1 = ReasoningParser("qwen3", tokenizer), ReasoningParser("deepseek_r1", tokenizer)
    assert (qwen3.start_id, qwen3.end_id) == (ids["think"], ids["end"])
    plain = [ids["yes"], ids["nl"]]
    opened = [*plain, ids["think"], ids["nl"]]
    closed = [*opened, ids["end"], ids["nlnl"]]
    assert [qwen3.start_phase(p) for p in (plain, opened, closed)] == [OPEN, THINKING, ANSWER]
    assert [r1.start_phase(p) for p in (plain, opened, closed)] == [THINKING, THINKING, ANSWER]


def test_without_single_token_tags_the_parser_reads_text(tokenizer_dir):
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)  # no <think> token
    parser = ReasoningParser("qwen3", tok)
    assert parser.start_id is None and parser.end_id is None
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    assert parser.start_phase(enc("Hi\n")) == OPEN
    assert parser.start_phase(enc("Hi\n<think>\n")) == THINKING
    assert parser.start_phase(enc("Hi\n<think>\n\n</think>\n\n")) == ANSWER


@pytest.mark.parametrize(
    ("name", "consequence"),
    [("deepseek_r1", "is all reasoning: its text (the answer) is empty"), ("qwen3", "is all answer")],
)
def test_without_think_tokens_the_parser_warns_once(tokenizer_dir, name, consequence, caplog):
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)  # SmolLM2's: no <think> token
    with caplog.at_level("WARNING", logger="batchgen.engine.reasoning"):
        ReasoningParser(name, tok)
    (record,) = caplog.records
    message = record.getMessage()
    assert record.levelname == "WARNING" and message.startswith(f"reasoning_parser {name!r}:")
    assert "no '<think>' / '</think>' token" in message and consequence in message


def test_with_think_tokens_the_parser_does_not_warn(tokenizer, caplog):
    with caplog.at_level("WARNING", logger="batchgen.engine.reasoning"):
        ReasoningParser("deepseek_r1", tokenizer)
    assert caplog.records == []


def test_an_unknown_parser_is_refused_naming_the_option():
    with pytest.raises(ValueError, match="reasoning_parser must be one of qwen3, deepseek_r1"):
        EngineConfig(reasoning_parser="r1")


# ---- the engine ----
@pytest.fixture(scope="module")
def llms(thinking_model):
    made: dict[str | None, LLM] = {}

    def get(parser: str | None) -> LLM:
        if parser not in made:
            made[parser] = LLM(
                str(thinking_model),
                dtype="float32",
                num_threads=1,
                reasoning_parser=parser,
                max_model_len=256,
            )
        return made[parser]

    return get


def prompt(ids: dict[str, int], *tail: str) -> dict:
    """A token-id prompt: BOS, "assistant" (any tokens), then the tokens named by `tail`."""
    return {"prompt_token_ids": [1, 520, 9531, *(ids[t] for t in tail)]}


def test_the_scripted_model_is_hf_generate(thinking_model, llms, ids):
    """The engine's greedy tokens are Hugging Face's (the script comes from the model, not a fake)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(thinking_model, dtype=torch.float32)
    p = prompt(ids, "nl")["prompt_token_ids"]
    hf = model.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False)[0, len(p) :].tolist()
    (out,) = llms(None).generate([prompt(ids, "nl")], GREEDY)
    want = [ids[k] for k in ("think", "i", "comma", "maybe", "end", "nlnl", "yes", "dot", "eos")]
    assert hf == want and out.outputs[0].token_ids == want
    # Without a parser the text is the whole output, and there is no reasoning.
    assert out.outputs[0].text == f"<think>{REASONING}</think>{SCRIPTED_ANSWER}"
    assert out.outputs[0].reasoning_content is None


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_a_row_with_thinking_then_answer(llms, ids, parser):
    (out,) = llms(parser).generate([prompt(ids, "nl")], GREEDY)
    c = out.outputs[0]
    assert (c.reasoning_content, c.text, c.finish_reason) == (REASONING, SCRIPTED_ANSWER, "stop")
    assert len(c.token_ids) == 9  # the tags and EOS stay in the token ids


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_a_prompt_that_opens_the_thinking(llms, ids, parser):
    """DeepSeek-R1's template ends the prompt with <think>: the output starts inside the thinking."""
    (out,) = llms(parser).generate([prompt(ids, "think")], GREEDY)
    c = out.outputs[0]
    assert (c.reasoning_content, c.text) == (REASONING, SCRIPTED_ANSWER)
    assert c.token_ids[0] == ids["i"]


@pytest.mark.parametrize(("max_tokens", "reasoning"), [(1, ""), (3, "I,"), (5, REASONING)])
def test_a_row_cut_inside_its_thinking_keeps_it(llms, ids, max_tokens, reasoning):
    """max_tokens=5 ends on </think> itself: the thinking is whole, the answer empty."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    (out,) = llms("qwen3").generate([prompt(ids, "nl")], params)
    c = out.outputs[0]
    assert (c.reasoning_content, c.text, c.finish_reason) == (reasoning, "", "length")


def test_stop_strings_apply_to_the_answer_only(llms, ids):
    llm = llms("qwen3")
    inside = SamplingParams(temperature=0, max_tokens=20, stop=["maybe", "I"])
    (out,) = llm.generate([prompt(ids, "nl")], inside)
    c = out.outputs[0]
    assert (c.reasoning_content, c.text, c.finish_reason, c.stop_reason) == (
        REASONING,
        SCRIPTED_ANSWER,
        "stop",
        None,  # it ended on EOS: neither stop string was looked for in the thinking
    )
    answer = SamplingParams(temperature=0, max_tokens=20, stop=["maybe", "es"])
    (out,) = llm.generate([prompt(ids, "nl")], answer)
    c = out.outputs[0]
    assert (c.reasoning_content, c.text, c.stop_reason) == (REASONING, "\n\ny", "es")
    # Without a parser the same stop strings end the row inside the thinking.
    (out,) = llms(None).generate([prompt(ids, "nl")], inside)
    assert (out.outputs[0].text, out.outputs[0].stop_reason) == ("<think>", "I")


def test_structured_outputs_start_after_the_thinking(llms, ids, tokenizer):
    """The grammar masks nothing while the row thinks (the thinking is the model's own, token for
    token) and takes the answer from the token after </think>: the model's own next token (two
    newlines) is not JSON, so the answer's first token is the grammar's; the answer validates."""
    params = SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    (out,) = llms("qwen3").generate([prompt(ids, "nl")], params)
    c = out.outputs[0]
    thinking = [ids[k] for k in ("think", "i", "comma", "maybe", "end")]
    assert c.token_ids[:5] == thinking and c.reasoning_content == REASONING
    assert c.token_ids[5] != ids["nlnl"] and c.text.startswith("{")
    jsonschema.validate(json.loads(c.text), SCHEMA)
    assert c.finish_reason == "stop"
    # Without a parser the grammar applies from the first token: no thinking at all.
    (plain,) = llms(None).generate([prompt(ids, "nl")], params)
    assert ids["think"] not in plain.outputs[0].token_ids
    jsonschema.validate(json.loads(plain.outputs[0].text), SCHEMA)


def test_structured_outputs_after_a_closed_thinking_apply_from_the_first_token(llms, ids):
    params = SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    (out,) = llms("qwen3").generate([prompt(ids, "think", "nl", "end", "nlnl")], params)
    c = out.outputs[0]
    assert (c.reasoning_content, c.text, c.finish_reason) == (None, "yes", "stop")


def test_enable_thinking_false_through_qwen3s_chat_template(llms, tokenizer):
    messages = [{"role": "user", "content": "Is it?"}]
    llm = llms("qwen3")
    (thinking,) = llm.chat(messages, GREEDY)
    (off,) = llm.chat(messages, GREEDY, chat_template_kwargs={"enable_thinking": False})
    assert thinking.prompt == "<|im_start|>user\nIs it?<|im_end|>\n<|im_start|>assistant\n"
    assert off.prompt == thinking.prompt + "<think>\n\n</think>\n\n"
    assert (thinking.outputs[0].reasoning_content, thinking.outputs[0].text) == (REASONING, SCRIPTED_ANSWER)
    assert (off.outputs[0].reasoning_content, off.outputs[0].text) == (None, "yes.")
    # The same through a prompt dict, as a job sends it.
    (again,) = llm.generate(
        [{"messages": messages, "chat_template_kwargs": {"enable_thinking": False}}], GREEDY
    )
    assert again.prompt == off.prompt and again.outputs[0].text == "yes."


def test_bad_chat_template_kwargs_are_refused(llms):
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
        llms("qwen3").chat([{"role": "user", "content": "x"}], GREEDY, chat_template_kwargs=["x"])


def test_n_completions_each_split(llms, ids):
    params = SamplingParams(temperature=0, max_tokens=20, n=2)
    (out,) = llms("deepseek_r1").generate([prompt(ids, "nl")], params)
    assert [(c.reasoning_content, c.text) for c in out.outputs] == [(REASONING, SCRIPTED_ANSWER)] * 2


# ---- think tags spelled in several tokens: the split is by text ----
@pytest.fixture(scope="module")
def plain_llms(tiny_model_dir):
    """LLMs of a tiny random Llama whose tokenizer writes each think tag in several tokens."""
    path, made = str(tiny_model_dir("llama")), {}

    def get(parser: str | None) -> LLM:
        if parser not in made:
            made[parser] = LLM(
                path, dtype="float32", num_threads=1, kv_cache_memory="64MiB", reasoning_parser=parser
            )
        return made[parser]

    return get


def test_by_text_a_deepseek_r1_row_with_no_end_tag_is_all_reasoning(plain_llms):
    params = SamplingParams(temperature=0, max_tokens=12)
    (ref,) = plain_llms(None).generate(["Hello"], params)
    (out,) = plain_llms("deepseek_r1").generate(["Hello"], params)
    text = ref.outputs[0].text
    assert "</think>" not in text and out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert (out.outputs[0].reasoning_content, out.outputs[0].text) == (text, "")
    (qwen3,) = plain_llms("qwen3").generate(["Hello"], params)  # no <think>: all answer
    assert (qwen3.outputs[0].reasoning_content, qwen3.outputs[0].text) == (None, text)


def test_by_text_a_prompt_that_opens_the_thinking_skips_stop_strings_in_it(plain_llms):
    """A prompt whose text ends with '<think>' opens the thinking (the tags are several tokens
    here); a stop string inside the thinking is not looked for: the row runs to max_tokens and its
    whole text is reasoning."""
    params = SamplingParams(temperature=0, max_tokens=12)
    (ref,) = plain_llms(None).generate(["Hi <think>"], params)
    text = ref.outputs[0].text
    assert len(text.strip()) >= 5 and "</think>" not in text
    stop = SamplingParams(temperature=0, max_tokens=12, stop=[text.strip()[:3]])
    (out,) = plain_llms("qwen3").generate(["Hi <think>"], stop)
    assert (out.outputs[0].reasoning_content, out.outputs[0].text) == (text, "")
    assert out.outputs[0].finish_reason == "length"
    (cut,) = plain_llms(None).generate(["Hi <think>"], stop)  # without a parser it stops there
    assert cut.outputs[0].finish_reason == "stop" and len(cut.outputs[0].text) < len(text)
