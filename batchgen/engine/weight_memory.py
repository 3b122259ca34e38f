"""The bytes a model's weights take as the engine runs them, from its config alone (no weights loaded).

`batchgen plan` prints it, and a CUDA KV-cache budget leaves room for it (`sizing.num_kv_blocks`).
The rules are the engine's own (`batchgen.model.quantization`):
- "int8" (CPU): each decoder linear (q/k/v, o, gate/up, down, a mixture's router) and the LM head
  become `Int8Weight`s: int8 values and a float32 scale per output channel and group of
  `INT8_GROUP_SIZE` inputs (`int8_weight_bytes`); the embedding stays float, also where the head
  is tied to it (the head is then an int8 copy of it);
- "auto" with a GGUF file (CPU): the linears (and the LM head) whose every part the file stores in
  a type the int8 kernels run (`gguf_int8`) become `Int8Weight`s of the same values: a byte a
  weight and a float32 scale (and for Q4_1, Q5_1 and the K-quants an offset) per group of 16-32;
  the others are dequantized to the run dtype. Which is which comes from the note an earlier start
  left beside the converted model (`GGUF_LINEARS_NOTE`), else from the file's tensor infos
  (`gguf_linear_types`);
- everything else (the embedding, an untied LM head but under "int8", a mixture's experts, "none", "auto" on a
  float checkpoint, and every weight on CUDA, where no kernel runs quantized weights) at the run
  dtype's size.
Norms and biases are left out (a few KiB), and so are the second weight layouts the kernel choice
may keep for some row buckets (`KernelChoice.extra_weight_bytes`, known only after measuring), and
the float copies a quantized linear keeps where the kernels do not run it (`kernels="reference"`,
or a dtype the C kernels do not take).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from batchgen.engine.engine_plan import WeightEstimate
from batchgen.kernels.cpu.int8_weight import int8_weight_bytes
from batchgen.model import moe
from batchgen.model.layers import attention_heads

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def decoder_linear_shapes(config: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """The decoder layers' `nn.Linear`s as the engine builds them (q/k/v and gate/up fused), by module
    name ("model.layers.0.self_attn.qkv_proj") -> (out_features, in_features): what quantization
    applies to (`quantization.decoder_linears`). A sparse layer has its router ("mlp.gate", gpt-oss's
    "mlp.router") and no dense MLP; its experts are not `nn.Linear`s (`moe.expert_parameters`)."""
    hidden = int(config.hidden_size)
    heads, kv_heads, head_dim = attention_heads(config)
    router = "mlp.router" if config.model_type == "gpt_oss" else "mlp.gate"
    spec = moe.moe_spec(config)
    shapes = {}
    for i in range(int(config.num_hidden_layers)):
        layer = f"model.layers.{i}."
        shapes[layer + "self_attn.qkv_proj"] = ((heads + 2 * kv_heads) * head_dim, hidden)
        shapes[layer + "self_attn.o_proj"] = (hidden, heads * head_dim)
        if spec is not None and moe.is_sparse_layer(config, i):
            shapes[layer + router] = (spec.num_experts, hidden)
        else:
            inter = int(config.intermediate_size)
            shapes[layer + "mlp.gate_up_proj"] = (2 * inter, hidden)
            shapes[layer + "mlp.down_proj"] = (hidden, inter)
    return shapes


def ties_embeddings(config: PretrainedConfig) -> bool:
    """Whether the LM head is the embedding itself (one copy), as the model classes read it."""
    return bool(getattr(config, "tie_word_embeddings", False))


def embedding_parameters(config: PretrainedConfig) -> int:
    """The embedding's weights, and the LM head's where it is not tied to it."""
    return (1 if ties_embeddings(config) else 2) * int(config.vocab_size) * int(config.hidden_size)


def num_parameters(config: PretrainedConfig) -> int:
    """Parameter count of a Llama-family config's linears (q, k, v, o; the MLP, or every expert of a
    mixture with its router) and embeddings (the LM head once more unless tied; norms and biases
    left out)."""
    linears = sum(n * k for n, k in decoder_linear_shapes(config).values())
    return linears + moe.expert_parameters(config) + embedding_parameters(config)


def estimate_weights(
    config: PretrainedConfig,
    dtype: torch.dtype,
    method: str,
    device: torch.device,
    gguf: Path | None = None,
    model_dir: Path | None = None,
) -> WeightEstimate:
    """The bytes of the weights under `method` (module docstring: what is counted how).

    Args:
        config: the model's transformers config.
        dtype: the run dtype (the float weights').
        method: the `quantization` option: "auto", "none" or "int8".
        device: where the engine runs: quantized weights count on a CPU only.
        gguf / model_dir: the GGUF file the model comes from and its converted directory (where an
            earlier start's `GGUF_LINEARS_NOTE` lies); None for a Hugging Face checkpoint.

    Raises:
        ValueError: a GGUF file gguf-py cannot read (when no note says what it holds).
    """
    shapes = decoder_linear_shapes(config)
    quantized: dict[str, int] = {}
    fmt, dequantized = "", ()
    vocab, hidden = int(config.vocab_size), int(config.hidden_size)
    head = 0  # bytes of an int8 LM head
    if device.type == "cpu" and method == "int8":
        fmt = "int8"
        quantized = {name: int8_weight_bytes(n, k) for name, (n, k) in shapes.items()}
        head = int8_weight_bytes(vocab, hidden)
    elif device.type == "cpu" and method == "auto" and gguf is not None:
        stored = _gguf_stored(gguf, model_dir)
        if stored["runnable"]:
            layouts = stored["int8"]
            quantized = {
                name: int8_weight_bytes(*shapes[name], *layouts[name]) for name in shapes if name in layouts
            }
            if "lm_head" in layouts:
                head = int8_weight_bytes(vocab, hidden, *layouts["lm_head"])
            fmt = "int8" if quantized else ""
        dequantized = tuple(sorted(set(stored["dequantized"].values())))
    element = torch.empty((), dtype=dtype).element_size()
    float_params = sum(n * k for name, (n, k) in shapes.items() if name not in quantized)
    # An int8 head leaves only the embedding float.
    embeddings = vocab * hidden if head else embedding_parameters(config)
    float_params += moe.expert_parameters(config) + embeddings
    return WeightEstimate(
        method=method,
        format=fmt,
        dtype=str(dtype).removeprefix("torch."),
        linears=len(shapes),
        quantized_linears=len(quantized),
        quantized_bytes=sum(quantized.values()) + head,
        quantized_params=sum(n * k for name, (n, k) in shapes.items() if name in quantized)
        + (vocab * hidden if head else 0),
        quantized_head=bool(head),
        float_bytes=float_params * element,
        tied=ties_embeddings(config),
        dequantized=dequantized,
        device=device.type,
    )


def _gguf_stored(gguf: Path, model_dir: Path | None) -> dict[str, Any]:
    """The note an earlier start left in `model_dir` about `gguf`'s linears, else the file's own
    tensor infos (`gguf_linear_types`), in the note's format."""
    from batchgen.model.loading.gguf_blocks import gguf_linear_types
    from batchgen.model.loading.model_defaults import GGUF_LINEARS_NOTE, read_gguf_note

    known = read_gguf_note(model_dir / GGUF_LINEARS_NOTE) if model_dir is not None else None
    return known if known is not None else gguf_linear_types(gguf)
