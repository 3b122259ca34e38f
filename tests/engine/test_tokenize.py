"""Prompt encoding's BOS rule (`_single_bos`): a doubled leading BOS becomes one; a missing one is
not added (the tokenizer or the chat template decides, as in vLLM and Hugging Face)."""

from __future__ import annotations

import pytest

from batchgen.engine.tokenize import _single_bos, encode_prompt

BOS = 1


class WordTokenizer:
    """One id a word ("<s>" is BOS); adds a BOS itself when `add_bos`, like Llama's tokenizers."""

    def __init__(self, add_bos: bool = True, template: str = "<s> user: {content} assistant:") -> None:
        self.bos_token_id = BOS if add_bos is not None else None
        self.add_bos = bool(add_bos)
        self.template = template

    def __len__(self) -> int:
        return 1000

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = [BOS if w == "<s>" else 10 + len(w) for w in text.split()]
        return {"input_ids": ([BOS] if add_special_tokens and self.add_bos else []) + ids}

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool) -> str:
        return " ".join(self.template.format(content=m["content"]) for m in messages)


@pytest.mark.parametrize(
    ("ids", "expected"),
    [
        ([BOS, BOS, 5], [BOS, 5]),  # doubled: one is dropped
        ([BOS, BOS, BOS, 5], [BOS, 5]),
        ([BOS, 5], [BOS, 5]),
        ([5, 6], [5, 6]),  # missing: not added
        ([BOS, 5, BOS], [BOS, 5, BOS]),  # a BOS later in the prompt is the prompt's own
        ([BOS], [BOS]),
    ],
)
def test_single_bos_collapses_a_doubled_bos_and_adds_none(ids, expected):
    assert _single_bos(WordTokenizer(), ids) == expected


def test_a_tokenizer_without_bos_leaves_the_ids_alone():
    assert _single_bos(WordTokenizer(add_bos=None), [BOS, BOS, 5]) == [BOS, BOS, 5]


def test_encoded_prompts_start_with_at_most_one_bos():
    tok = WordTokenizer()
    # Text that starts with the BOS, from a tokenizer that adds one: one BOS.
    assert encode_prompt(tok, "<s> hello there")[1] == [BOS, 15, 15]
    # A chat template that writes the BOS: one BOS (the template's).
    assert encode_prompt(tok, [{"role": "user", "content": "hi"}])[1] == [BOS, 15, 12, 20]
    # A chat template without one: none is added, as Hugging Face's apply_chat_template and vLLM do.
    plain = WordTokenizer(template="user: {content} assistant:")
    assert encode_prompt(plain, [{"role": "user", "content": "hi"}])[1] == [15, 12, 20]
    # A tokenizer that adds no BOS: plain text gets none.
    assert encode_prompt(WordTokenizer(add_bos=False), "hello")[1] == [15]
