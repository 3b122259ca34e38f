"""batchgen: offline LLM batch inference with continuous batching over a paged KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchgen.config import EngineConfig
from batchgen.outputs import CompletionOutput, Logprob, RequestOutput
from batchgen.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from batchgen.llm import LLM

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "EngineConfig",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> type[LLM]:
    # `LLM` pulls in torch (seconds to import): imported on first use, so `batchgen --help` and the CLI's
    # argument checks answer at once and a Ctrl-C at start-up lands where the CLI handles it.
    if name == "LLM":
        from batchgen.llm import LLM

        return LLM
    raise AttributeError(f"module 'batchgen' has no attribute {name!r}")
