"""A GGUF file's model config: which GGUF architectures batchgen converts, and what transformers'
GGUF reader drops from the file's metadata, put back before the weights are loaded.

transformers reads a GGUF file's hyperparameters through a table of keys per architecture
(`transformers.integrations.ggml.GGUF_CONFIG_MAPPING`); a field the table lacks keeps its config
class's default. Where that default differs from the file, the converted model is another model:
weights of the wrong shape (Qwen3's `head_dim`, Qwen3-MoE's expert width) or plausible but wrong text
(Gemma 2's attention soft-cap, Gemma 3's linear rotary scaling, Phi-3's partial rotary and sliding
window). `gguf_config_fixes` reads those fields from the file, under the keys llama.cpp's
`convert_hf_to_gguf.py` writes, and where the file holds no field llama.cpp derives the value by a
rule (Gemma's attention scale, `llama_load_hparams` in llama.cpp's `src/llama-model.cpp`), the same
rule gives it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from batchgen.model.loading.architectures import UnsupportedModelError

# GGUF `general.architecture` -> the architecture transformers converts it into, for the GGUF
# architectures both transformers' GGUF reader and batchgen's model have. (llama.cpp writes Mistral
# as "llama"; Mixtral too, with expert tensors, which transformers cannot load: `_check_experts`.)
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# Layer counts at which llama.cpp scales Gemma's attention by hidden / heads instead of head_dim
# (the 27B models: Gemma 2 27B has 46 layers, Gemma 3 27B 62).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def gguf_architecture(fields: dict[str, Any], where: object) -> str:
    """The file's GGUF architecture, checked against `GGUF_ARCHITECTURES`.

    Args:
        fields: the file's metadata, key -> value (`gguf.GGUFReader(...).fields` read with `.contents()`).
        where: the file, for the message.

    Raises:
        UnsupportedModelError: an architecture transformers cannot convert or batchgen does not run
            (one line naming it and the supported set), or a "llama" file with experts (Mixtral).
    """
    arch = str(fields.get("general.architecture", ""))
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{where}: GGUF architecture {arch!r} is not supported: batchgen converts GGUF files through "
            f"transformers, and of batchgen's architectures it reads {', '.join(GGUF_ARCHITECTURES)} "
            "(Mistral as llama); pass the model's Hugging Face directory or hub id instead"
        )
    experts = fields.get(f"{arch}.expert_count") or 0
    if arch == "llama" and int(experts) > 0:
        raise UnsupportedModelError(
            f"{where}: a GGUF 'llama' file with {int(experts)} experts (Mixtral) is not supported: "
            "transformers converts it as a dense Llama without its expert weights; pass the model's "
            "Hugging Face directory or hub id instead"
        )
    return arch


def gguf_config_fixes(
    fields: dict[str, Any], tensors: dict[str, np.ndarray], config: dict[str, Any]
) -> dict[str, Any]:
    """The config fields transformers' GGUF reader got wrong, with the file's values.

    Args:
        fields: the file's metadata, key -> value.
        tensors: the file's float tensors that hold config (`rope_factors_long.weight`,
            `rope_factors_short.weight`: Phi-3's LongRoPE factors, float32 `[rotary dims / 2]`).
        config: the config transformers read from the file (`PretrainedConfig.to_dict()`).

    Returns:
        Fields to set on that config (possibly none).
    """
    arch = str(fields["general.architecture"])

    def get(key: str) -> Any:
        return fields.get(f"{arch}.{key}")

    fixes: dict[str, Any] = {}
    # GGUF stores float32: 1e-6 comes back as 9.99999997e-07; the shortest float32 repr is the source's.
    if (eps := get("attention.layer_norm_rms_epsilon")) is not None:
        fixes["rms_norm_eps"] = _float32(eps)
    if arch in ("qwen3", "qwen3moe") and (head_dim := get("attention.key_length")) is not None:
        fixes["head_dim"] = int(head_dim)
    if arch == "qwen3moe" and (width := get("expert_feed_forward_length")) is not None:
        fixes["moe_intermediate_size"] = int(width)
    if arch in _GEMMA_27B_LAYERS:
        fixes.update(_gemma(arch, get, config))
    if arch == "phi3":
        fixes.update(_phi3(get, tensors, config))
    return fixes


def _gemma(arch: str, get: Any, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2/3: soft-caps, the attention scale (llama.cpp's rule), Gemma 3's rotary scaling."""
    fixes: dict[str, Any] = {}
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if (cap := get(key)) is not None:
            fixes[key] = _float32(cap)
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length") or hidden // heads)
    big = int(get("block_count")) == _GEMMA_27B_LAYERS[arch]
    fixes["query_pre_attn_scalar"] = hidden // heads if big else head_dim
    rope = config.get("rope_parameters")
    if arch == "gemma3" and isinstance(rope, dict) and "full_attention" in rope:
        full = dict(rope["full_attention"])
        if str(get("rope.scaling.type") or "") == "linear" and get("rope.scaling.factor"):
            full.update(rope_type="linear", factor=_float32(get("rope.scaling.factor")))
        local = dict(rope.get("sliding_attention") or {"rope_type": "default"})
        if (local_base := get("rope.freq_base_swa")) is not None:
            local["rope_theta"] = _float32(local_base)
        fixes["rope_parameters"] = {**rope, "full_attention": full, "sliding_attention": local}
    return fixes


def _phi3(get: Any, tensors: dict[str, np.ndarray], config: dict[str, Any]) -> dict[str, Any]:
    """Phi-3: partial rotary, sliding window, LongRoPE (its factors are tensors of the file)."""
    fixes: dict[str, Any] = {}
    window = get("attention.sliding_window")
    if window is not None:
        fixes["sliding_window"] = int(window) or None  # llama.cpp writes 0 for none
    rope = dict(config.get("rope_parameters") or {})
    if (dims := get("rope.dimension_count")) is not None:
        # llama.cpp writes int(partial_rotary_factor * hidden) // heads rotary dimensions a head.
        head_dim = int(get("embedding_length")) // int(get("attention.head_count"))
        rope["partial_rotary_factor"] = int(dims) / head_dim
    original = get("rope.scaling.original_context_length")
    long, short = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
    if long is not None and short is not None and original is not None:
        rope.update(
            rope_type="longrope",
            long_factor=[_float32(x) for x in long.tolist()],
            short_factor=[_float32(x) for x in short.tolist()],
            original_max_position_embeddings=int(original),
        )
        fixes["original_max_position_embeddings"] = int(original)
    if rope:
        fixes["rope_parameters"] = rope
    return fixes


def _float32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-06, not 9.99...e-07)."""
    return float(str(np.float32(value)))
