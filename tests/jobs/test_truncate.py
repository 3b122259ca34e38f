"""--truncate-prompt on chat prompts cuts the messages' text, never the template around it."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from batchgen.engine.tokenize import encode_prompt
from batchgen.jobs.truncate import truncate_chat, truncate_ids, uncuttable_tokens


def test_truncate_ids_keeps_one_bos_in_front():
    ids = [1, 10, 11, 12, 13, 14]
    assert truncate_ids(ids, "right", 3, bos=1) == [1, 10, 11]
    assert truncate_ids(ids, "left", 3, bos=1) == [1, 13, 14]
    assert truncate_ids(ids, "left", 3, bos=None) == [12, 13, 14]
    assert truncate_ids(ids, "left", 9, bos=1) == ids


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.parametrize("side", ["right", "left"])
def test_chat_prompt_keeps_its_template(tokenizer, side):
    user = "START " + " ".join(f"w{i}" for i in range(400)) + " END"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": user}]

    def encode(m):
        return encode_prompt(tokenizer, m)[1]

    full = encode(messages)
    ids = truncate_chat(messages, side, 120, encode, tokenizer)
    assert ids is not None and 110 <= len(ids) <= 120 < len(full)
    text = tokenizer.decode(ids)
    # The template's head (system message) and tail (the assistant header) are intact.
    short = tokenizer.decode(encode([messages[0], {"role": "user", "content": "@@"}]))
    head, tail = short.split("@@")
    assert text.startswith(head) and text.endswith(tail)
    kept = text[len(head) : len(text) - len(tail)]
    assert kept.startswith("START") if side == "right" else kept.endswith("END")
    assert messages[1]["content"] == user  # the caller's messages are not changed


def test_chat_prompt_that_cannot_fit_is_none(tokenizer):
    messages = [{"role": "system", "content": "word " * 300}, {"role": "user", "content": "hi " * 50}]
    assert truncate_chat(messages, "right", 64, lambda m: encode_prompt(tokenizer, m)[1], tokenizer) is None


def test_a_cut_that_would_empty_the_only_message_is_none(tokenizer):
    """SmolLM2's template adds its own system prompt (about 35 tokens): at 30 tokens the user's text
    would have to go entirely, and a chat of empty messages cannot be rendered."""
    messages = [{"role": "user", "content": "word " * 100}]
    assert truncate_chat(messages, "right", 30, lambda m: encode_prompt(tokenizer, m)[1], tokenizer) is None
    blank = [{"role": "user", "content": "Summarize this:" + " \n" * 200}]
    assert truncate_chat(blank, "left", 30, lambda m: encode_prompt(tokenizer, m)[1], tokenizer) is None


def test_what_no_cut_can_free_is_the_system_message_and_the_template(tokenizer):
    """`uncuttable_tokens`: the system message's own tokens, and the chat rendered with the other
    messages emptied (exactly the rendering of that chat)."""
    system = "word " * 300
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi " * 50}]

    def encode(m):
        return encode_prompt(tokenizer, m)[1]

    emptied = [messages[0], {"role": "user", "content": ""}]
    assert uncuttable_tokens(messages, encode, tokenizer) == (
        len(tokenizer.encode(system, add_special_tokens=False)),
        len(encode(emptied)),
    )
    assert uncuttable_tokens([messages[1]], encode, tokenizer)[0] == 0  # no system message

    def refuse_empty(m):
        if any(not x["content"] for x in m):
            raise ValueError("empty message")
        return encode(m)

    assert uncuttable_tokens(messages, refuse_empty, tokenizer)[1] is None
