"""A GGUF file's quantized linears as int8 weights holding the very values of its blocks, for the
int8 kernels (`quantization="auto"`, `batchgen.model.quantization`).

The loader's float directory (`gguf_cache`) holds every tensor dequantized; this reads the blocks of
the decoder linears (and the LM head's) stored in a type `gguf_int8` repacks, straight from the file
(memory-mapped by gguf-py's `GGUFReader`), joined into the engine's fused layers (q/k/v into
`qkv_proj`, gate/up into `gate_up_proj`). llama.cpp's converter permutes the rows of a Llama's q and
k weights for its rotary layout; the rows are put back as transformers' GGUF loader puts them back
(`LlamaTensorProcessor`), so that the weights equal the converted directory's (which `quantization`
checks).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from batchgen.kernels.cpu.int8_weight import Int8Weight
from batchgen.model.loading.gguf_int8 import GGUF_INT8_TYPES, gguf_int8, int8_layout, join_parts, with_group

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
# GGML tensor types the int8 kernels run, value for value (gguf-py's enum names).
RUNNABLE_TYPES = GGUF_INT8_TYPES
# Float types: run as the floats they are, not counted as dequantized.
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})
_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
# The LM head: its own tensor, or the embedding's where the two are tied.
_HEAD_TENSORS = ("output.weight", "token_embd.weight")


def gguf_linear_blocks(
    gguf: Path, num_heads: int, num_kv_heads: int
) -> tuple[dict[str, Int8Weight], dict[str, str]]:
    """The decoder linears of `gguf` whose every part is stored in a type of `RUNNABLE_TYPES`, and
    the LM head ("lm_head") where its tensor is, as `Int8Weight`s (`gguf_int8`).

    Args:
        gguf: the file.
        num_heads / num_kv_heads: the model's query and KV heads (for the q/k row order).

    Returns:
        (module name such as "model.layers.0.self_attn.qkv_proj" -> its weight, module name -> the
        quantized GGML type of the parts no kernel runs as stored, e.g. "IQ4_XS"; those are
        dequantized; float parts, F32 and the like, run as the floats they are and are not listed).

    Raises:
        ValueError: the file is not a GGUF file gguf-py can read.
    """
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    arch, tensors = _decoder_linear_tensors(reader)
    parts: dict[str, dict[int, Int8Weight]] = {}
    other_types: dict[str, str] = {}
    for name, part, projection, tensor in tensors:
        type_name = tensor.tensor_type.name
        if type_name not in RUNNABLE_TYPES:
            if type_name not in _FLOAT_TYPES:
                other_types[name] = type_name
            continue
        rows = np.asarray(tensor.data)
        if arch == "llama" and projection in ("attn_q", "attn_k"):
            rows = _unpermute_rows(rows, num_heads if projection == "attn_q" else num_kv_heads)
        parts.setdefault(name, {})[part] = gguf_int8(rows, type_name, int(tensor.shape[0]))
    weights = {}
    for name, by_part in parts.items():
        expected = _expected_parts(arch, name)
        if name in other_types or sorted(by_part) != list(range(expected)):
            continue
        if len({p.shape[1] for p in by_part.values()}) != 1:
            continue
        weights[name] = join_parts([by_part[i] for i in range(expected)])
    # The decoder stack runs its layers' linears with one scale group (csrc/decoder_stack.c).
    group = min((w.group_size for w in weights.values()), default=0)
    weights = {name: with_group(w, group) for name, w in weights.items()}
    head = _head_tensor(reader)
    if head is not None and head.tensor_type.name in RUNNABLE_TYPES:
        weights["lm_head"] = gguf_int8(np.asarray(head.data), head.tensor_type.name, int(head.shape[0]))
    return weights, other_types


def _head_tensor(reader: Any) -> Any:
    """gguf-py's tensor the LM head is (its own, else the tied embedding), or None."""
    by_name = {tensor.name: tensor for tensor in reader.tensors}
    return next((by_name[name] for name in _HEAD_TENSORS if name in by_name), None)


def gguf_linear_types(gguf: Path) -> dict[str, Any]:
    """What `gguf_linear_blocks` would find, from the tensor infos alone (no tensor data read): the
    `GGUF_LINEARS_NOTE`'s content, {"runnable": whether some decoder linear has every part stored
    in a type of `RUNNABLE_TYPES`, "dequantized": module name -> the quantized type of its parts
    none runs (float parts not listed),
    "int8": module name (the LM head's "lm_head") -> [scale group, whether it has offsets] of each
    weight it returns}. gguf-py parses the whole header, the tokenizer's arrays included (about
    2.5 s for the default model's file): callers read the note first where there is one.

    Raises:
        ValueError: the file is not a GGUF file gguf-py can read.
    """
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    arch, tensors = _decoder_linear_tensors(reader)
    runnable_parts: dict[str, dict[int, str]] = {}
    other_types: dict[str, str] = {}
    for name, part, _, tensor in tensors:
        if tensor.tensor_type.name in RUNNABLE_TYPES:
            runnable_parts.setdefault(name, {})[part] = tensor.tensor_type.name
        elif tensor.tensor_type.name not in _FLOAT_TYPES:
            other_types[name] = tensor.tensor_type.name
    layouts = {
        name: int8_layout(parts.values())
        for name, parts in runnable_parts.items()
        if name not in other_types and set(parts) == set(range(_expected_parts(arch, name)))
    }
    group = min((g for g, _ in layouts.values()), default=0)
    int8 = {name: [group, offsets] for name, (_, offsets) in layouts.items()}
    head = _head_tensor(reader)
    if head is not None and head.tensor_type.name in RUNNABLE_TYPES:
        int8["lm_head"] = list(int8_layout([head.tensor_type.name]))
    return {"runnable": bool(layouts), "dequantized": other_types, "int8": int8}


def _decoder_linear_tensors(reader: Any) -> tuple[str, list[tuple[str, int, str, Any]]]:
    """(the file's architecture, (engine module name, part of the fused layer, llama.cpp's
    projection name, gguf-py's tensor) of each decoder linear's tensor) of a `GGUFReader`."""
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else ""
    projections = {**_PROJECTIONS, **_FUSED} if arch == "phi3" else _PROJECTIONS
    found = []
    for tensor in reader.tensors:
        match = _NAME.fullmatch(tensor.name)
        if match is None or match[2] not in projections:
            continue
        module, part = projections[match[2]]
        found.append((f"model.layers.{match[1]}.{module}", part, match[2], tensor))
    return arch, found


def _expected_parts(arch: str, name: str) -> int:
    """How many stored tensors make up the engine's linear `name` (q/k/v: 3; gate/up: 2; Phi-3's are
    stored fused: 1)."""
    return 1 if arch == "phi3" else _PARTS.get(name.split(".", 3)[3], 1)


def _unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation of whole rows (each row is one output channel's blocks):
    within each head, the two interleaved halves go back side by side."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
