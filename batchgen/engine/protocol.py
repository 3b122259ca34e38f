"""What the jobs layer and the bench need of an engine: `LLMEngine`, and the fake engine of the job tests.

The contract is these Protocols and nothing else: the jobs layer reads no engine attribute that
`Engine` does not name, the bench none that `BenchEngine` does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from batchgen.engine.stats import EngineTotals, StepStats
from batchgen.model.loading.tokenizer import Tokenizer
from batchgen.outputs import RequestOutput
from batchgen.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from batchgen.engine.spec_gate import SpeculationPlan
    from batchgen.model.kernel_choice.choice import KernelChoice
    from batchgen.model.loading.loader import ModelFiles
    from batchgen.model.quantization import Quantization


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

    max_model_len: int
    last_step: StepStats | None
    totals: EngineTotals

    @property
    def tokenizer(self) -> Tokenizer | None: ...

    @property
    def model_name(self) -> str | None: ...

    @property
    def start_line(self) -> str: ...

    def encode_prompt(self, prompt: object) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) for a string, chat messages or a token-id dict.

        Raises:
            ValueError / TypeError: an empty or malformed prompt.
        """
        ...

    def check_prompt_len(self, num_tokens: int) -> str | None:
        """Why a prompt of `num_tokens` tokens can never run (None: it fits)."""
        ...

    def prepare(self, sampling_params: SamplingParams) -> None:
        """Start what a request with these parameters needs before it runs (compiling its
        structured outputs constraint); called as rows enter the look-ahead window."""
        ...

    def add_request(
        self,
        request_id: str,
        prompt: object,
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


class BenchEngine(Engine, Protocol):
    """An engine `batchgen bench` measures: a job's engine, and what the bench reads back of it.

    Attributes:
        model_config: the model's Hugging Face config (`transformers.PretrainedConfig`): the shapes
            of the compute ceiling and the roofline, `vocab_size` for random prompts.
        model_files: where the weights came from; `model_files.path` is the Hugging Face directory
            the transformers baselines load.
        dtype: the dtype the model runs in (`--dtype auto` resolved).
        block_size: tokens a KV-cache block holds.
        num_gpu_blocks: KV-cache blocks (vLLM's name, on a CPU too).
        max_num_batched_tokens: the token budget of a step as the engine resolved it.
        kernel_choice: the kernels measured at start (`summary()`, `seconds`, `extra_weight_bytes`).
        quantization: what runs quantized (`batchgen.model.quantization.Quantization`, `summary()`).
        weight_bytes: bytes of the weights a step reads, quantized ones at their size.
        speculation: the speculative decoding proposer and gate; None without `speculative_method`.
    """

    model_config: Any
    model_files: ModelFiles
    dtype: torch.dtype
    block_size: int
    num_gpu_blocks: int
    max_num_batched_tokens: int
    kernel_choice: KernelChoice
    quantization: Quantization
    weight_bytes: int
    speculation: SpeculationPlan | None
