"""Prompt encoding: strings, chat messages and token-id dicts to token ids (one BOS at most)."""

from __future__ import annotations

from typing import Any

from batchgen.model.loading.tokenizer import Tokenizer


def encode_prompt(
    tokenizer: Tokenizer, prompt: object, vocab_size: int | None = None
) -> tuple[str | None, list[int]]:
    """Turn one prompt into (text or None, token ids).

    Accepts a string (tokenized with the tokenizer's special tokens), a list of chat messages
    (`[{"role": ..., "content": ...}]`, rendered with the tokenizer's chat template and a generation
    prompt; the template supplies the special tokens), or a dict with `prompt_token_ids`, `prompt` or
    `messages` (with `messages`, an optional `chat_template_kwargs` dict of extra template variables,
    vLLM's name: `{"enable_thinking": False}` for Qwen3). A doubled BOS (template or text already
    starting with it) is collapsed to one.
    `vocab_size`: the model's (its embedding rows), when it may be smaller than the tokenizer's
    length: token ids must lie below both, or the model's embedding lookup would fail.

    Raises:
        ValueError: an empty prompt, empty message list, a message role not in CHAT_ROLES
            (`role_error`), or token ids outside the vocabulary.
        TypeError: a prompt of another type, or a malformed message.
    """
    text, ids = _encode(tokenizer, prompt)
    limit = vocabulary_limit(tokenizer, vocab_size)
    bad = [t for t in ids if not 0 <= t < limit]
    if bad:
        source = "prompt_token_ids holds" if _has_ids(prompt) else "the tokenizer produced"
        mismatch = (
            f" (the model's vocab_size is {vocab_size} but its tokenizer has {len(tokenizer)} tokens: "
            "the tokenizer does not belong to this model)"
            if vocab_size is not None and vocab_size < len(tokenizer)
            else ""
        )
        raise ValueError(f"{source} ids outside the vocabulary [0, {limit}): {bad[:5]}{mismatch}")
    return text, ids


def vocabulary_limit(tokenizer: Tokenizer, vocab_size: int | None = None) -> int:
    """One past the largest token id both the tokenizer and the model (its `vocab_size` embedding
    rows, when given) know: ids at or above it cannot be embedded, nor ever sampled."""
    return len(tokenizer) if vocab_size is None else min(len(tokenizer), vocab_size)


def _has_ids(prompt: object) -> bool:
    return isinstance(prompt, dict) and "prompt_token_ids" in prompt


def _encode(
    tokenizer: Tokenizer, prompt: object, template_kwargs: dict[str, Any] | None = None
) -> tuple[str | None, list[int]]:
    if isinstance(prompt, dict):
        if prompt.get("multi_modal_data") is not None:
            raise ValueError("multi_modal_data is not supported: batchgen runs text-only models")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list | tuple) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise TypeError("prompt_token_ids must be a list of integers")
            if not ids:
                raise ValueError("prompt_token_ids is empty: give at least one token")
            return prompt.get("prompt"), list(ids)
        if "messages" in prompt:
            kwargs = prompt.get("chat_template_kwargs")
            if kwargs is not None and not (
                isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)
            ):
                raise TypeError(
                    "chat_template_kwargs must be a dict of chat template variables, e.g. "
                    f"{{'enable_thinking': False}}; got {kwargs!r:.80}"
                )
            return _encode(tokenizer, prompt["messages"], kwargs or {})
        if "prompt" in prompt:
            return _encode(tokenizer, prompt["prompt"])
        raise TypeError("a prompt dict needs 'prompt_token_ids', 'prompt' or 'messages'")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("the prompt is empty: give some text")
        return prompt, _single_bos(tokenizer, tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if isinstance(prompt, list | tuple):
        if not prompt:
            raise ValueError("the message list is empty: give at least one message")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise TypeError(
                "a list of integers is read as a chat message list; for token ids pass "
                "{'prompt_token_ids': [...]} (vLLM's TokensPrompt)"
            )
        messages = []
        for i, message in enumerate(prompt):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise TypeError(f"message {i} must be a dict with 'role' and 'content', got {message!r:.80}")
            if err := role_error(message["role"], f"messages[{i}].role"):
                raise ValueError(err)
            content = content_text(message["content"])
            if content is None:
                raise TypeError(
                    f"message {i} 'content' must be a string or a list of {{'type': 'text', 'text': ...}} "
                    f"parts, got {message['content']!r:.80}"
                )
            messages.append({**message, "content": content})
        if not any(m["content"].strip() for m in messages):
            raise ValueError("every message is empty: give some text")
        # Any: the template's own variables are keyword arguments of transformers'
        # apply_chat_template, which the Tokenizer protocol does not list.
        render: Any = tokenizer.apply_chat_template
        text = render(messages, add_generation_prompt=True, tokenize=False, **(template_kwargs or {}))
        return text, _single_bos(tokenizer, tokenizer(text, add_special_tokens=False)["input_ids"])
    if prompt is None:
        raise ValueError("the prompt is null: give a string, chat messages or token ids")
    raise TypeError(f"a prompt must be a string, a list of messages or a dict, got {type(prompt).__name__}")


# The roles of OpenAI's chat API (and Llama 3's "ipython"): a chat template renders any string it is
# given, so a typo such as "usr" would quietly make every prompt of a job a malformed one.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")


def role_error(role: object, field: str) -> str | None:
    """The error for a chat message's role that is not one of CHAT_ROLES, naming `field` (such as
    "messages[0].role") and the roles to use; None for a known role. Job rows
    (`batchgen.jobs.input.formats.check_messages`) and `LLM.generate`'s prompts share it."""
    if role in CHAT_ROLES:
        return None
    return f"field '{field}' is {role!r}, not a chat role; use one of {', '.join(CHAT_ROLES)}"


def content_text(content: object) -> str | None:
    """A chat message's content as text: a string, or OpenAI's list of content parts when every part
    is `{"type": "text", "text": str}` (joined with newlines, as vLLM does); None otherwise."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = [p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None for p in content]
        texts = [t for t in parts if isinstance(t, str)]
        if len(texts) == len(parts):
            return "\n".join(texts)
    return None


def _single_bos(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    """`ids` with a doubled leading BOS collapsed to one (a chat template that writes the BOS, or a
    text that starts with it, tokenized by a tokenizer that adds one too). A missing BOS is not
    added: whether a prompt starts with one is the tokenizer's `add_bos_token` (plain text) or the
    chat template's choice, as in vLLM and Hugging Face `generate` (Qwen's models have none).
    BOS tokens after the first position are left alone."""
    bos = tokenizer.bos_token_id
    while bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    return list(ids)
