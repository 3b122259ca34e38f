"""batchgen: offline LLM batch inference with continuous batching over a paged KV cache."""

from batchgen.config import EngineConfig
from batchgen.llm import LLM
from batchgen.outputs import CompletionOutput, RequestOutput
from batchgen.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
