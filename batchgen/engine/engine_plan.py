"""The engine's sizes as one value (`EnginePlan`), apart from `sizing.py`'s torch-bound decisions, so
that a process without torch (`batchgen plan`'s) can hold and check them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EnginePlan:
    """The engine's sizes, decided once at start (`plan_engine`).

    Attributes:
        num_blocks: device KV blocks.
        num_swap_blocks: CPU swap blocks (0 unless `preemption_mode` is "swap").
        bytes_per_block: one KV block, K and V in every layer (`kv_cache_bytes_per_block`).
        max_model_len: the longest sequence served (prompt + output), in tokens.
        max_num_batched_tokens: the token budget of a step.
        max_model_len_note: said wherever max_model_len is quoted, so a limit the KV cache lowered
            is not mistaken for one the user set ("" when it was not lowered).
        too_long_fix: what a prompt too long for max_model_len can do about it.
    """

    num_blocks: int
    num_swap_blocks: int
    bytes_per_block: int
    max_model_len: int
    max_num_batched_tokens: int
    max_model_len_note: str = ""
    too_long_fix: str = "shorten or truncate the prompt, or raise max_model_len"

    def check_prompt_len(self, num_tokens: int) -> str | None:
        """Why a prompt of `num_tokens` tokens can never run (it leaves no room for one output
        token), or None when it fits."""
        if num_tokens < self.max_model_len:
            return None
        return (
            f"prompt has {num_tokens} tokens but max_model_len is {self.max_model_len}"
            f"{self.max_model_len_note} (room is needed for at least one output token): {self.too_long_fix}"
        )
