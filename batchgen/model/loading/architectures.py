"""The architectures batchgen's model implements, and the errors a model that cannot be served raises.

The loader (`loader`) and the GGUF conversion (`gguf_cache`) both check a config against this table,
so it sits below both of them.
"""

from __future__ import annotations

from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "SmolLM3ForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "GptOssForCausalLM",
)
# For configs without `architectures` (GGUF conversions, hand-written configs).
ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


class ModelNotFoundError(RuntimeError):
    """The model spec names nothing that can be found, fetched or installed."""


class UnsupportedModelError(ValueError):
    """The model's architecture is not one our model implements."""


# The MLP's gate activation per architecture: (the config field transformers reads, its default,
# the values batchgen's MLP computes). The Llama family is SwiGLU ("swish" is transformers' alias of
# SiLU); Gemma 2/3 are GeGLU with the tanh approximation of GELU. gpt-oss's experts compute their
# own clamped SwiGLU whatever `hidden_act` says (transformers' does too), so its "silu" is checked
# as the field's value only.
_SWIGLU = ("hidden_act", "silu", ("silu", "swish"), "SwiGLU")
_GEGLU = ("hidden_activation", "gelu_pytorch_tanh", ("gelu_pytorch_tanh",), "GeGLU")
ACTIVATIONS = {arch: _GEGLU if arch.startswith("Gemma") else _SWIGLU for arch in SUPPORTED_ARCHITECTURES}


def check_architecture(raw_config: dict[str, Any]) -> str:
    """Return the supported architecture of a raw `config.json` dict, or raise UnsupportedModelError
    (also for a gate activation the architecture's MLP does not compute, which the model would
    otherwise run as its own and give plausible but wrong text)."""
    arch = _architecture(raw_config)
    field, default, allowed, kind = ACTIVATIONS[arch]
    activation = raw_config.get(field) or default
    if activation not in allowed:
        raise UnsupportedModelError(
            f"config.json sets {field} {activation!r}; batchgen's {arch} MLP is {kind} and supports only "
            f"{' or '.join(repr(a) for a in allowed)}"
        )
    return arch


def _architecture(raw_config: dict[str, Any]) -> str:
    """The supported architecture a raw config names (or implies by its `model_type`)."""
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


# Quantized checkpoints the loader dequantizes at load: (model_type, quant_method) -> how.
DEQUANTIZED_AT_LOAD = {("gpt_oss", "mxfp4"): "gpt-oss's MXFP4 experts (batchgen.model.mxfp4)"}


def check_not_quantized(raw_config: dict[str, Any], where: object) -> None:
    """Refuse a Hugging Face checkpoint stored quantized (a `quantization_config` in its config.json:
    GPTQ, AWQ, bitsandbytes, FP8, ...), whose packed weights the model cannot load as floats; those
    in `DEQUANTIZED_AT_LOAD` (gpt-oss's MXFP4) pass, and are dequantized as they load.

    Raises:
        UnsupportedModelError: naming the method and what batchgen runs instead.
    """
    quantization = raw_config.get("quantization_config")
    if not quantization:
        return
    method = quantization.get("quant_method", "unknown") if isinstance(quantization, dict) else quantization
    if (raw_config.get("model_type"), method) in DEQUANTIZED_AT_LOAD:
        return
    raise UnsupportedModelError(
        f"{where}: the checkpoint is quantized ({method}), a format batchgen does not run; batchgen runs "
        "float safetensors checkpoints (float32, bfloat16, float16), which quantization='int8' quantizes "
        "at load, GGUF files (Q8_0, Q4_0/Q4_1, Q5_0/Q5_1 and Q4_K/Q5_K/Q6_K values as stored, other types dequantized) and gpt-oss's MXFP4 "
        "checkpoints (dequantized at load)"
    )
