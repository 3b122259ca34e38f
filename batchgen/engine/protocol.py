"""What the jobs layer needs of an engine: `LLMEngine`, and the fake engine of the job tests.

The contract is this Protocol and nothing else, so the jobs layer reads no engine attribute it
does not name here.
"""

from __future__ import annotations

from typing import Any, Protocol

from batchgen.engine.stats import EngineTotals, StepStats
from batchgen.outputs import RequestOutput
from batchgen.sampling_params import SamplingParams


class Engine(Protocol):
    """An engine a job runs on.

    Attributes:
        tokenizer: the Hugging Face tokenizer (chat templates, BOS id, token bytes), or None for an
            engine without one (prompts are then not chat-rendered, and chat prompts are cut as
            token ids).
        max_model_len: the longest sequence served (prompt + output), in tokens.
        model_name: the model's short display name, or None when the engine has none.
        start_line: what the engine settled on at start, logged once when a job starts ("": nothing).
        last_step / totals: statistics of the latest step (None before the first) and since start.
    """

    tokenizer: Any
    max_model_len: int
    last_step: StepStats | None
    totals: EngineTotals

    @property
    def model_name(self) -> str | None: ...

    @property
    def start_line(self) -> str: ...

    def encode_prompt(self, prompt: Any) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) for a string, chat messages or a token-id dict.

        Raises:
            ValueError / TypeError: an empty or malformed prompt.
        """
        ...

    def check_prompt_len(self, num_tokens: int) -> str | None:
        """Why a prompt of `num_tokens` tokens can never run (None: it fits)."""
        ...

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a prompt; one that can never run comes back from `step()` as an error output."""
        ...

    def step(self) -> list[RequestOutput]:
        """Run one step; the requests that finished in it."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    def num_unfinished_requests(self) -> int: ...

    def abort_request(self, request_id: str) -> None: ...
