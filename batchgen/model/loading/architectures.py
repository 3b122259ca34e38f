"""The architectures batchgen's model implements, and the errors a model that cannot be served raises.

The loader (`loader`) and the GGUF conversion (`gguf_cache`) both check a config against this table,
so it sits below both of them.
"""

from __future__ import annotations

from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# For configs without `architectures` (GGUF conversions, hand-written configs).
ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class ModelNotFoundError(RuntimeError):
    """The model spec names nothing that can be found, fetched or installed."""


class UnsupportedModelError(ValueError):
    """The model's architecture is not one our model implements."""


# The MLP's gate activation: batchgen's MLP is SwiGLU ("swish" is transformers' alias of SiLU).
SUPPORTED_ACTIVATIONS = ("silu", "swish")


def check_architecture(raw_config: dict[str, Any]) -> str:
    """Return the supported architecture of a raw `config.json` dict, or raise UnsupportedModelError
    (also for a `hidden_act` other than SiLU, which the model would otherwise run as SiLU and give
    plausible but wrong text)."""
    activation = raw_config.get("hidden_act", "silu")
    if activation not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedModelError(
            f"config.json sets hidden_act {activation!r}; batchgen's MLP is SwiGLU and supports only "
            f"{' or '.join(repr(a) for a in SUPPORTED_ACTIVATIONS)}"
        )
    architectures = raw_config.get("architectures") or []
    for arch in architectures:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    model_type = raw_config.get("model_type")
    if not architectures and model_type in ARCHITECTURE_BY_MODEL_TYPE:
        return ARCHITECTURE_BY_MODEL_TYPE[model_type]
    found = ", ".join(architectures) if architectures else f"none listed (model_type {model_type!r})"
    raise UnsupportedModelError(
        f"unsupported model architecture: {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def check_not_quantized(raw_config: dict[str, Any], where: object) -> None:
    """Refuse a Hugging Face checkpoint stored quantized (a `quantization_config` in its config.json:
    GPTQ, AWQ, bitsandbytes, FP8, ...), whose packed weights the model cannot load as floats.

    Raises:
        UnsupportedModelError: naming the method and what batchgen runs instead.
    """
    quantization = raw_config.get("quantization_config")
    if not quantization:
        return
    method = quantization.get("quant_method", "unknown") if isinstance(quantization, dict) else quantization
    raise UnsupportedModelError(
        f"{where}: the checkpoint is quantized ({method}), a format batchgen does not run; batchgen runs "
        "float safetensors checkpoints (float32, bfloat16, float16), which quantization='int8' quantizes "
        "at load, and GGUF files (Q8_0 blocks as stored, other types dequantized)"
    )
