"""`--truncate-prompt left|right`: fit a too-long prompt into `max_model_len`, leaving room to generate.

A plain prompt is cut as token ids (keeping one BOS in front). A chat prompt is cut inside its
messages' text and then rendered again: cutting the rendered ids would remove the template's tail
(the assistant header the model answers after) or its head (system message, first role header),
and the model would continue the user's text instead of answering it.
"""

from __future__ import annotations

from collections.abc import Callable

from batchgen.model.loading.tokenizer import Tokenizer

# Token merges across the cut can shift a count by a token or two; each retry cuts that much more.
_SLACK_TOKENS = 2


def truncate_ids(ids: list[int], side: str, keep: int, bos: int | None) -> list[int]:
    """The first (`side` "right") or last ("left") `keep` tokens of `ids`; a leading BOS stays in
    front when the left side is cut."""
    if len(ids) <= keep:
        return ids
    if side == "right":
        return ids[:keep]
    if bos is not None and ids and ids[0] == bos:
        return [bos, *ids[len(ids) - keep + 1 :]]
    return ids[len(ids) - keep :]


def truncate_chat(
    messages: list[dict[str, str]],
    side: str,
    keep: int,
    encode: Callable[[list[dict[str, str]]], list[int]],
    tokenizer: Tokenizer,
) -> list[int] | None:
    """Token ids of `messages` rendered in at most `keep` tokens, or None when even empty contents
    do not fit (the template and system prompt alone are too long, or cutting would leave no text).

    "right" shortens the end of the last non-system message's content; "left" the start of the
    first one (a message emptied entirely moves the cut to the next). System messages stay whole.

    Args:
        encode: renders messages with the chat template and returns their token ids.
        tokenizer: a Hugging Face tokenizer (`encode(text, add_special_tokens=False)`, `decode`).
    """
    messages = [dict(m) for m in messages]
    for attempt in range(2 * len(messages) + 4):
        try:
            ids = encode(messages)
        except ValueError:
            if attempt == 0:
                raise  # the caller's own messages: not a cut's doing
            return None  # the cut emptied every message (a template's own system prompt took the room)
        over = len(ids) - keep
        if over <= 0:
            return ids
        cuttable = [i for i, m in enumerate(messages) if m["role"] != "system" and m["content"]]
        if not cuttable:
            return None
        index = cuttable[-1] if side == "right" else cuttable[0]
        content_ids = tokenizer.encode(messages[index]["content"], add_special_tokens=False)
        cut = min(len(content_ids), over + _SLACK_TOKENS)
        kept = content_ids[: len(content_ids) - cut] if side == "right" else content_ids[cut:]
        messages[index]["content"] = tokenizer.decode(kept) if kept else ""
    return None


def uncuttable_tokens(
    messages: list[dict[str, str]],
    encode: Callable[[list[dict[str, str]]], list[int]],
    tokenizer: Tokenizer,
) -> tuple[int, int | None]:
    """What `truncate_chat` cannot cut, to say why a chat did not fit: (the tokens of the system
    messages' text, the tokens of the chat rendered with every other message emptied: the template
    and the system messages together; None where the template cannot render empty messages)."""
    system = sum(
        len(tokenizer.encode(m["content"], add_special_tokens=False))
        for m in messages
        if m["role"] == "system" and m["content"]
    )
    emptied = [m if m["role"] == "system" else {**m, "content": ""} for m in messages]
    try:
        return system, len(encode(emptied))
    except Exception:  # noqa: BLE001  a template may refuse empty messages in its own way
        return system, None
