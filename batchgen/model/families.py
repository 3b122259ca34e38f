"""Which model class runs which Hugging Face `model_type`: the one table the runner reads.

Each family lives in its own module on the shared layers (`layers`): the Llama family (`llama`:
Llama, Mistral, Qwen2, Qwen3, SmolLM3, and the mixtures of experts Qwen3-MoE and Mixtral),
Phi-3/4 (`phi`), Gemma 2/3 (`gemma`) and gpt-oss (`gpt_oss`). The architectures a checkpoint may name are
checked before this, by `loading.architectures.check_architecture`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchgen.model.gemma import GemmaForCausalLM
from batchgen.model.gpt_oss import GptOssForCausalLM
from batchgen.model.llama import LlamaForCausalLM
from batchgen.model.phi import PhiForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "smollm3": LlamaForCausalLM,
    "phi3": PhiForCausalLM,
    "gemma2": GemmaForCausalLM,
    "gemma3_text": GemmaForCausalLM,
    "qwen3_moe": LlamaForCausalLM,  # experts in place of the MLP where the config says (`moe`)
    "mixtral": LlamaForCausalLM,
    "gpt_oss": GptOssForCausalLM,
}


def model_class(config: PretrainedConfig) -> type[LlamaForCausalLM]:
    """The class that runs `config`'s `model_type`.

    Raises:
        ValueError: a `model_type` none of the families implements, naming the ones they do.
    """
    cls = MODEL_CLASSES.get(config.model_type)
    if cls is None:
        raise ValueError(
            f"model_type {config.model_type!r} is not supported; supported: {', '.join(MODEL_CLASSES)}"
        )
    return cls
