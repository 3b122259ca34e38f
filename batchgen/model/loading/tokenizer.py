"""What batchgen asks of a tokenizer, as a type: the calls it makes on a Hugging Face tokenizer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class Tokenizer(Protocol):
    """A Hugging Face tokenizer (`transformers.PreTrainedTokenizerBase`, as `load_tokenizer` loads
    it) as batchgen calls it: one text in, its token ids out; token ids in, one text out. (The
    transformers signatures also cover batches, so their results are unions that these calls never
    return.)"""

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_id(self) -> int | None: ...

    def __len__(self) -> int:
        """Tokens in the vocabulary, added ones included."""
        ...

    def __call__(self, text: str, *, add_special_tokens: bool = True) -> Mapping[str, Any]:
        """The encoding of `text`; its "input_ids" are a list of token ids."""
        ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...

    def convert_ids_to_tokens(self, ids: int) -> str: ...

    def apply_chat_template(
        self, conversation: list[dict[str, Any]], *, add_generation_prompt: bool, tokenize: bool
    ) -> str:
        """The chat rendered as text (with `tokenize=False`, the only way batchgen calls it)."""
        ...
