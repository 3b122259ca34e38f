"""A generated token's exact bytes and its text, for the log-probability outputs of `batchgen run`.

A token of a byte-level BPE vocabulary (GPT-2, Llama 3, SmolLM, Qwen) can hold part of a
multi-byte UTF-8 character (an emoji is often two tokens); decoded alone it reads as U+FFFD, so
two different tokens look the same and their bytes are lost. `TokenBytes` recovers the bytes from
the vocabulary entry, and names a token whose bytes are not UTF-8 on their own as OpenAI's API
does: "bytes:\\xf0\\x9f".
"""

from __future__ import annotations

import re

from batchgen.model.loading.tokenizer import Tokenizer


def byte_level_table() -> dict[str, int]:
    """Character -> byte of GPT-2's byte-level BPE alphabet (Radford et al., 2019, the `encoder.py`
    of openai/gpt-2, used by every byte-level tokenizer since): the printable Latin-1 bytes stand
    for themselves, the 68 others are given the characters from U+0100 on, in byte order."""
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    table = {chr(b): b for b in printable}
    others = (b for b in range(256) if b not in printable)
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's tokens for single bytes


class TokenBytes:
    """Token id -> its bytes, from a Hugging Face tokenizer's vocabulary (cached per id).

    Byte-level vocabularies map their entry's characters back to bytes; SentencePiece's byte
    tokens (`<0xE2>`) are that byte and its word marker "▁" a space; any other token (special
    tokens outside the byte alphabet, a tokenizer of another kind, or none) is its decoded text
    in UTF-8.

    Args:
        tokenizer: the engine's tokenizer, or None (then the decoded text is all there is).
    """

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.table = byte_level_table() if _is_byte_level(tokenizer) else None
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int, decoded: str | None) -> bytes:
        """The bytes of `token_id`, whose text decoded alone is `decoded`."""
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._bytes(token_id, decoded or "")
        return cached

    def _bytes(self, token_id: int, decoded: str) -> bytes:
        piece = None
        if self.tokenizer is not None:
            try:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
            except (IndexError, KeyError, TypeError, ValueError, OverflowError):
                piece = None
        if not isinstance(piece, str):
            return decoded.encode("utf-8", "backslashreplace")
        if self.table is not None and all(c in self.table for c in piece):
            return bytes(self.table[c] for c in piece)
        match = _BYTE_FALLBACK.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        if "▁" in piece:
            return piece.replace("▁", " ").encode("utf-8", "backslashreplace")
        return decoded.encode("utf-8", "backslashreplace")


def token_text(data: bytes) -> str:
    """A token's text: its bytes as UTF-8, or, when they are part of a character, OpenAI's name
    for them ("bytes:\\xe2\\x80")."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def _is_byte_level(tokenizer: Tokenizer | None) -> bool:
    """Whether a (fast) tokenizer decodes with the byte-level decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        from tokenizers import decoders
    except ImportError:
        return False
    return isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)
