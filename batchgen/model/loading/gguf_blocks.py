"""A GGUF file's decoder linears as their stored blocks, for the kernels that run them as they are
(`quantization="auto"`, `batchgen.model.quantization`).

The loader's float directory (`gguf_cache`) holds every tensor dequantized; this reads the blocks of
the ones a kernel takes straight from the file (memory-mapped by gguf-py's `GGUFReader`), joined
into the engine's fused layers (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`). llama.cpp's
converter permutes the rows of a Llama's q and k weights for its rotary layout; the rows are put
back as transformers' GGUF loader puts them back (`LlamaTensorProcessor`), so that the blocks
dequantize to exactly the converted directory's weights (which `quantization` checks).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from batchgen.kernels.cpu.quantized_linear import Q8_0Weight

# llama.cpp's tensor name -> (the engine's module under `model.layers.<i>.`, part of the fused layer).
_PROJECTIONS = {
    "attn_q": ("self_attn.qkv_proj", 0),
    "attn_k": ("self_attn.qkv_proj", 1),
    "attn_v": ("self_attn.qkv_proj", 2),
    "attn_output": ("self_attn.o_proj", 0),
    "ffn_gate": ("mlp.gate_up_proj", 0),
    "ffn_up": ("mlp.gate_up_proj", 1),
    "ffn_down": ("mlp.down_proj", 0),
}
# Phi-3's checkpoint stores q/k/v and gate/up fused, and llama.cpp keeps them so: one part each.
_FUSED = {"attn_qkv": ("self_attn.qkv_proj", 0), "ffn_up": ("mlp.gate_up_proj", 0)}
_PARTS = {"self_attn.qkv_proj": 3, "mlp.gate_up_proj": 2}
# GGML tensor types a kernel runs as stored, by gguf-py's enum name -> the weight class holding them.
RUNNABLE_TYPES = {"Q8_0": Q8_0Weight}
_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def gguf_linear_blocks(
    gguf: Path, num_heads: int, num_kv_heads: int
) -> tuple[dict[str, Q8_0Weight], dict[str, str]]:
    """The decoder linears of `gguf` whose every part is stored in a type of `RUNNABLE_TYPES`.

    Args:
        gguf: the file.
        num_heads / num_kv_heads: the model's query and KV heads (for the q/k row order).

    Returns:
        (module name such as "model.layers.0.self_attn.qkv_proj" -> its weight, module name -> the
        GGML type of the parts no kernel runs as stored, e.g. "Q4_1"; those are dequantized).

    Raises:
        ValueError: the file is not a GGUF file gguf-py can read.
    """
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else ""
    projections = {**_PROJECTIONS, **_FUSED} if arch == "phi3" else _PROJECTIONS
    parts: dict[str, dict[int, tuple[np.ndarray, int]]] = {}
    other_types: dict[str, str] = {}
    for tensor in reader.tensors:
        match = _NAME.fullmatch(tensor.name)
        if match is None or match[2] not in projections:
            continue
        module, part = projections[match[2]]
        name = f"model.layers.{match[1]}.{module}"
        type_name = tensor.tensor_type.name
        if type_name not in RUNNABLE_TYPES:
            other_types[name] = type_name
            continue
        rows = np.asarray(tensor.data)
        if arch == "llama" and match[2] in ("attn_q", "attn_k"):
            rows = _unpermute_rows(rows, num_heads if match[2] == "attn_q" else num_kv_heads)
        parts.setdefault(name, {})[part] = (rows, int(tensor.shape[0]))
    weights = {}
    for name, by_part in parts.items():
        expected = 1 if arch == "phi3" else _PARTS.get(name.split(".", 3)[3], 1)
        if name in other_types or sorted(by_part) != list(range(expected)):
            continue
        k = {in_features for _, in_features in by_part.values()}
        if len(k) != 1:
            continue
        blocks = np.concatenate([by_part[i][0] for i in range(expected)], axis=0)
        weights[name] = Q8_0Weight(torch.from_numpy(np.ascontiguousarray(blocks)), k.pop())
    return weights, other_types


def _unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation of whole rows (each row is one output channel's blocks):
    within each head, the two interleaved halves go back side by side."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
