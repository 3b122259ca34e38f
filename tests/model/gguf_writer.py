"""Tiny GGUF files written as llama.cpp's `convert_hf_to_gguf.py` writes them, for the GGUF tests.

`write_gguf` turns a tiny Hugging Face directory (`tests/conftest.py`) into a `.gguf` file with the
`gguf` package: the metadata keys llama.cpp's converter writes for the architecture, its tensor names
(gguf's own name map, as the converter uses it), its tensor edits (the q/k row permutation of the
"llama" architecture, Gemma's norms stored as `1 + weight`, experts stacked per layer as
`ffn_{gate,up,down}_exps`), float32 tensors with the chosen ones quantized (gguf's own quantizer:
Q8_0, Q4_0/Q4_1, Q5_0/Q5_1), and
the tokenizer fields of the default model's GGUF cut to the model's vocabulary.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

# config.json's model_type -> the GGUF architecture llama.cpp writes (Mistral and Mixtral as "llama").
GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "mixtral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "smollm3": "smollm3",
}


def write_gguf(hf_dir: Path, tokenizer: dict, out: Path, stored_as: Mapping[str, str] | None = None) -> None:
    """Write `hf_dir`'s model as the GGUF file `out`.

    Args:
        hf_dir: a tiny model directory (config.json, model.safetensors).
        tokenizer: the `tokenizer.*` fields to write (`tiny_tokenizer`), name -> (value, value types).
        out: the file to write.
        stored_as: GGUF tensor kind (the name between `blk.N.` and `.weight`, or e.g. "output" for
            `output.weight`) -> the GGML type it is stored in (e.g. "Q8_0"); the rest F32.
    """
    import gguf
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH[config["model_type"]]
    writer = gguf.GGUFWriter(out, arch)
    writer.add_name(f"tiny {hf_dir.name}")
    _write_metadata(writer, config)
    for name, (value, types) in tokenizer.items():
        writer.add_key_value(name, value, types[0], sub_type=types[1] if len(types) > 1 else None)
    model_arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch)
    name_map = gguf.get_tensor_name_map(model_arch, config["num_hidden_layers"])
    tensors = _stack_experts(load_file(hf_dir / "model.safetensors"))
    for name, factors in _rope_factors(config).items():
        writer.add_tensor(name, factors)
    for hf_name, tensor in tensors.items():
        for name, data in _gguf_tensors(hf_name, tensor, config, arch, name_map):
            kind = name.split(".")[2] if name.startswith("blk.") else name.removesuffix(".weight")
            if kind in (stored_as or {}):
                qtype = gguf.GGMLQuantizationType[(stored_as or {})[kind]]
                writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
            else:
                writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_tokenizer(tokenizer_gguf: Path, vocab_size: int) -> dict[str, tuple[object, list]]:
    """The `tokenizer.*` fields of `tokenizer_gguf` (name -> (value, GGUF value types)) cut to its
    first `vocab_size` tokens and the BPE merges among them: a byte-level BPE keeps its 256 byte
    tokens near the start, so any text still tokenizes. Parsing the 49,152 tokens of the default
    model's vocabulary takes seconds, a tiny file's conversion with this one a fraction of one."""
    import gguf

    fields = {k: f for k, f in gguf.GGUFReader(tokenizer_gguf).fields.items() if k.startswith("tokenizer.")}
    kept = set(fields["tokenizer.ggml.tokens"].contents()[:vocab_size])
    out: dict[str, tuple[object, list]] = {}
    for name, field in fields.items():
        value = field.contents()
        if name in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            value = value[:vocab_size]
        elif name == "tokenizer.ggml.merges":
            value = [m for m in value if set(m.split(" ")) <= kept and m.replace(" ", "") in kept]
        out[name] = value, list(field.types)
    return out


def _rope_factors(config: dict) -> dict[str, np.ndarray]:
    """Phi-3's LongRoPE factors as the tensors llama.cpp writes them (float32 `[rotary dims / 2]`)."""
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") != "longrope":
        return {}
    return {
        f"rope_factors_{kind}.weight": np.asarray(rope[f"{kind}_factor"], dtype=np.float32)
        for kind in ("long", "short")
    }


def _write_metadata(writer, config: dict) -> None:
    """The hyperparameters llama.cpp's converter writes for the architecture (`TextModel` and the
    architecture's `set_gguf_parameters`)."""
    import gguf

    model_type = config["model_type"]
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    if model_type != "gemma2" and "rope_theta" in rope:
        writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if config.get("head_dim") is not None and model_type != "phi3":
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    experts = config.get("num_local_experts") or config.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if model_type == "qwen3_moe":
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if GGUF_ARCH[model_type] == "llama":
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(config.get("head_dim") or hidden // heads)
    if model_type == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if model_type in ("gemma2", "gemma3_text", "phi3") or config.get("sliding_window"):
        writer.add_sliding_window(config.get("sliding_window") or 0)
    if model_type == "phi3":
        rotary = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(int(rotary * hidden) // heads)
        original = config.get("original_max_position_embeddings", 4096)
        writer.add_rope_scaling_orig_ctx_len(original)
        if rope.get("rope_type") == "longrope":
            scale = config["max_position_embeddings"] / original
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
            )


# Per-expert checkpoint names (Mixtral's w1/w3/w2, Qwen3-MoE's gate/up/down) -> the stacked kind.
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")
_EXPERT_KIND = {
    "w1": "gate",
    "gate_proj": "gate",
    "w3": "up",
    "up_proj": "up",
    "w2": "down",
    "down_proj": "down",
}


def _stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert weights stacked into one `[E, out, in]` tensor a layer and kind, under the name
    `model.layers.N.experts.<gate|up|down>` (llama.cpp's converter merges experts the same way);
    transformers 5's fused `gate_up_proj` `[E, 2I, H]` is split into gate and up."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if match := _EXPERT.fullmatch(name):
            experts.setdefault((match[1], _EXPERT_KIND[match[3]]), {})[int(match[2])] = tensor
        elif name.endswith("mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, 1)
            out[f"model.layers.{name.split('.')[2]}.experts.gate"] = gate
            out[f"model.layers.{name.split('.')[2]}.experts.up"] = up
        elif name.endswith("mlp.experts.down_proj"):
            out[f"model.layers.{name.split('.')[2]}.experts.down"] = tensor
        else:
            out[name] = tensor
    for (layer, kind), by_index in experts.items():
        out[f"model.layers.{layer}.experts.{kind}"] = torch.stack([by_index[i] for i in sorted(by_index)])
    return out


def _gguf_tensors(hf_name: str, tensor: torch.Tensor, config: dict, arch: str, name_map) -> Iterator:
    """(GGUF name, float32 array) of one checkpoint tensor, edited as llama.cpp's converter edits it."""
    data = tensor.to(torch.float32)
    module, _, suffix = hf_name.rpartition(".")  # suffix: "weight" or "bias"
    layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
    if ".experts." in hf_name:
        yield f"blk.{layer}.ffn_{hf_name.rsplit('.', 1)[1]}_exps.weight", data.contiguous().numpy()
        return
    if arch == "llama" and module.endswith(("q_proj", "k_proj")):
        heads = config["num_attention_heads"] if module.endswith("q_proj") else config["num_key_value_heads"]
        data = data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:]).swapaxes(1, 2)
        data = data.reshape(tensor.shape)
    if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
        data = data + 1  # Gemma's RMSNorm scales by (1 + weight); llama.cpp stores the sum
    name = name_map.get_name(module)
    if name is None:
        raise KeyError(f"gguf has no name for {hf_name} in architecture {arch}")
    yield f"{name}.{suffix}", data.contiguous().numpy()
