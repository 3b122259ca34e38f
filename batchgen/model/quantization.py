"""Quantized weights at load (`EngineConfig.quantization`), and the quantized-weight cache.

- "int8": every decoder linear (q/k/v, o, gate/up, down) and the LM head are quantized to
  symmetric int8 with a float32 scale per output channel and group of `INT8_GROUP_SIZE` inputs
  (`Int8Weight.quantize`); the embedding stays float (a tied LM head becomes an int8 copy of it).
  The LM head is a fifth to two fifths of the weight bytes a decode step of a small model reads
  (the default model: 113 of 246 MB in float32), and its int8 kernel is 3-5x oneDNN's float32 at
  1-4 rows on an AVX2 CPU; it costs the default model 0.5 points of teacher-forced top-1 agreement
  (docs/benchmarks.md). The result is cached under batchgen's cache (`quantized/`), keyed by the
  checkpoint's digest (`fingerprint.model_fingerprint`), the method and the dtype the weights were
  loaded in, so a second start reads it instead of quantizing again.
- "auto": a GGUF file's decoder linears and LM head stored in a type the int8 kernels run value
  for value (Q8_0, Q4_0/Q4_1, Q5_0/Q5_1, Q4_K/Q5_K/Q6_K: `gguf_int8`) run as int8 weights holding
  the blocks' very values (`gguf_blocks`), cached like "int8"'s; the others, and every float
  checkpoint, run dequantized as before.
- "none": everything dequantized (float), as before quantization existed.

Each "int8" linear's float weight in the model is replaced by its dequantized value (a GGUF
file's are already equal to theirs), so the float kernels (still candidates of the registry, `kernels.cpu.quantized_linear`) and the reference
compute with the very weights the quantized kernels read.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from batchgen.cache import cache_root, remove_stale_temporaries, write_atomically
from batchgen.config import QUANTIZATIONS
from batchgen.kernels.cpu.int8_weight import INT8_GROUP_SIZE
from batchgen.kernels.cpu.quantized_linear import Int8Weight, QuantizedWeight
from batchgen.model.llama import LlamaForCausalLM, decoder_layers
from batchgen.model.loading.loader import ModelFiles
from batchgen.model.loading.model_defaults import GGUF_LINEARS_NOTE, read_gguf_note

logger = logging.getLogger(__name__)

# Bump when the int8 quantization or the cache's layout changes, so old files are not read.
_CACHE_FORMAT = 5  # 3: the LM head quantized too; 4: a checksum in the metadata; 5: offsets, layouts


def check_quantization(method: str, device: torch.device) -> None:
    """Refuse a method this device cannot run, in one line.

    Raises:
        ValueError: an unknown method, or "int8" on a CUDA device (no GPU int8 kernel yet).
    """
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {method!r}")
    if method == "int8" and device.type != "cpu":
        raise ValueError(
            f"quantization 'int8' runs on the CPU only (this engine runs on {device.type}); use --device cpu, "
            "or quantization auto / none"
        )


@dataclass
class Quantization:
    """What `quantize_model` did.

    Attributes:
        method: "int8", "gguf" (a GGUF file's own values, as int8 weights) or "none".
        weights: module name (e.g. "model.layers.0.mlp.down_proj", "lm_head") -> its int8 weight.
        source: where the weights came from: "quantized at load", "from the cache" or "GGUF file".
        dequantized: GGUF only: module name -> the stored type of the linears dequantized because no
            kernel runs it (e.g. "IQ4_XS").
        seconds: spent quantizing or reading.
    """

    method: str = "none"
    weights: dict[str, QuantizedWeight] = field(default_factory=dict)
    source: str = ""
    dequantized: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def nbytes(self) -> int:
        """Bytes of the quantized weights (values and scales)."""
        return sum(w.nbytes for w in self.weights.values())

    def summary(self) -> str:
        """A few words for the start line, e.g. "int8 (120 linears, 101.6 MiB, from the cache)"."""
        if not self.weights:
            if self.dequantized:
                types = ", ".join(sorted(set(self.dequantized.values())))
                return f"none (GGUF {types} dequantized: no kernel runs it as stored)"
            return "none"
        size = f"{self.nbytes / 2**20:.1f} MiB"
        words = f"{len(self.weights)} linears, {size}, {self.source}"
        if self.dequantized:
            words += (
                f"; {len(self.dequantized)} {'/'.join(sorted(set(self.dequantized.values())))} dequantized"
            )
        if self.method == "gguf":
            sources = {part for w in self.weights.values() for part in w.source.split("/")}
            return f"GGUF {'/'.join(sorted(sources))} as int8 ({words})"
        return f"{'/'.join(sorted({w.format for w in self.weights.values()}))} ({words})"


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The decoder layers' linears by module name: what quantization applies to ("int8" the LM head
    too: `int8_linears`; the embedding stays float)."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.startswith("model.layers.")
    }


def int8_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """What "int8" quantizes: the decoder linears (`decoder_linears`) and the LM head ("lm_head")."""
    linears = decoder_linears(model)
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear):
        linears["lm_head"] = head
    return linears


def quantize_model(
    model: LlamaForCausalLM, method: str, files: ModelFiles | None, cache_dir: Path | None = None
) -> Quantization:
    """Quantize `model`'s linears as `method` says (weights loaded, in their dtype: the decoder
    linears, and for "int8" the LM head) and give each quantized linear its dequantized weight as
    its float parameter (a new one: a tied LM head's embedding stays as it was).

    Args:
        model: a `LlamaForCausalLM` with its weights loaded.
        method: one of `QUANTIZATIONS`.
        files: the model's files (its GGUF file, its digest for the cache); None: no cache, no GGUF.
        cache_dir: batchgen's cache root (None: `cache_root()`).

    Raises:
        ValueError: an unknown method.
    """
    start = time.perf_counter()
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {method!r}")
    linears = decoder_linears(model)
    dtype = next(iter(linears.values())).weight.dtype if linears else torch.float32
    if method == "int8" and linears:
        linears = int8_linears(model)
        result = _int8(linears, files, dtype, cache_dir)
        for name, weight in result.weights.items():
            # A parameter of its own: a tied LM head's is the embedding's, which stays float.
            linears[name].weight = nn.Parameter(weight.dequantize().to(dtype), requires_grad=False)
    elif method == "auto" and files is not None and files.gguf is not None and linears:
        # The GGUF weights equal the float ones already (checked): nothing to replace.
        result = _gguf(int8_linears(model), model, files, dtype, cache_dir)
    else:
        return Quantization()
    result.seconds = time.perf_counter() - start
    return result


def _int8(
    linears: dict[str, nn.Linear], files: ModelFiles | None, dtype: torch.dtype, cache_dir: Path | None
) -> Quantization:
    """`linears` quantized to int8: read from the cache where it holds them, else quantized now
    and written there (no cache where `files` is None or the checkpoint has no digest)."""
    path = _cache_path(files, f"int8-g{INT8_GROUP_SIZE}-{str(dtype).removeprefix('torch.')}", cache_dir)
    cached = _read_cache(path, linears) if path is not None else None
    if cached is not None:
        return Quantization("int8", cached, "from the cache")
    weights: dict[str, QuantizedWeight] = {
        name: Int8Weight.quantize(linear.weight, INT8_GROUP_SIZE) for name, linear in linears.items()
    }
    if path is not None:
        _write_cache(path, weights)
    return Quantization("int8", weights, "quantized at load")


def _gguf(
    linears: dict[str, nn.Linear],
    model: LlamaForCausalLM,
    files: ModelFiles,
    dtype: torch.dtype,
    cache_dir: Path | None,
) -> Quantization:
    """The GGUF file's runnable blocks as int8 weights (`gguf_blocks`), each checked against the
    converted float weight (which transformers dequantized from the same blocks): a linear whose
    weights differ stays float. The weights are cached like "int8"'s (the file parsed and its
    blocks repacked once); `GGUF_LINEARS_NOTE` in the converted directory (keyed by the file's
    digest) says what an earlier start found, so a file with none is not parsed again."""
    from batchgen.model.loading.gguf_blocks import gguf_linear_blocks

    assert files.gguf is not None
    note = files.path / GGUF_LINEARS_NOTE
    known = read_gguf_note(note)
    if known is not None and not known["runnable"]:
        return Quantization("gguf", {}, "GGUF file", dequantized=known["dequantized"])
    path = _cache_path(files, "gguf", cache_dir)
    if known is not None and path is not None:
        cached = _read_cache(path, {name: linears[name] for name in known["int8"] if name in linears})
        if cached is not None:
            return Quantization("gguf", cached, "from the cache", dequantized=known["dequantized"])
    attn = decoder_layers(model)[0].self_attn  # `linears` is not empty: the model has layers
    blocks, other_types = gguf_linear_blocks(files.gguf, attn.num_heads, attn.num_kv_heads)
    weights: dict[str, QuantizedWeight] = {}
    for name, weight in blocks.items():
        linear = linears.get(name)
        if linear is None or tuple(linear.weight.shape) != weight.shape:
            continue
        if not torch.equal(weight.dequantize().to(linear.weight.dtype), linear.weight.detach()):
            logger.warning(
                "GGUF blocks of %s do not dequantize to the converted weight; it runs in float", name
            )
            continue
        weights[name] = weight
    runnable = any(name != "lm_head" for name in weights)
    layouts = {name: [w.group_size, w.offsets is not None] for name, w in weights.items()}
    try:
        write_atomically(
            note, json.dumps({"runnable": runnable, "dequantized": other_types, "int8": layouts}).encode()
        )
    except OSError:  # a read-only cache: parsed again next time
        pass
    if not runnable:
        return Quantization("gguf", {}, "GGUF file", dequantized=other_types)
    if path is not None:
        _write_cache(path, weights)
    return Quantization("gguf", weights, "GGUF file", dequantized=other_types)


# ---------------------------------------------------------------------------------------------
# The cache


def _cache_path(files: ModelFiles | None, kind: str, cache_dir: Path | None) -> Path | None:
    """`quantized/<digest>-<kind>-v<format>.safetensors` under the cache (`kind`: e.g.
    "int8-g16-float32", "gguf"); None when the checkpoint has no digest (its files cannot be read)."""
    from batchgen.model.loading.fingerprint import model_fingerprint

    if files is None:
        return None
    root = cache_root() if cache_dir is None else Path(cache_dir)
    source = files.gguf if files.gguf is not None else files.path
    digest = model_fingerprint(str(source), cache_dir=root)
    if digest is None:
        return None
    name = f"{digest[:24]}-{kind}-v{_CACHE_FORMAT}.safetensors"
    return root / "quantized" / name


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    """CRC-32 of the tensors' names and bytes in name order: finds a damaged cache file (a few
    hundredths of a second for the default model's 160 MiB), not a forged one."""
    crc = 0
    for name in sorted(tensors):
        crc = zlib.crc32(name.encode(), crc)
        data = tensors[name].detach().contiguous().reshape(-1).view(torch.uint8)
        crc = zlib.crc32(data.numpy().data, crc)
    return f"{crc:08x}"


def _read_cache(path: Path, linears: dict[str, nn.Linear]) -> dict[str, QuantizedWeight] | None:
    """The cached weights of every linear in `linears`, or None when the file is missing, damaged
    (unreadable, or its bytes not those its checksum was taken of) or does not hold them all with
    their shapes."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118  (safe_open has no __iter__)
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001  safetensors raises its own error type for a damaged file
        logger.warning("quantized-weight cache %s is unreadable (%s); quantizing again", path, exc)
        return None
    if metadata.get("crc32") != _checksum(tensors):
        logger.warning(
            "quantized-weight cache %s is damaged (its checksum does not match); quantizing again", path
        )
        return None
    try:
        layouts = json.loads(metadata.get("layouts", ""))
    except ValueError:
        layouts = None
    weights: dict[str, QuantizedWeight] = {}
    for name, linear in linears.items():
        qweight, scales = tensors.get(f"{name}.qweight"), tensors.get(f"{name}.scales")
        layout = layouts.get(name) if isinstance(layouts, dict) else None
        if (
            qweight is None
            or scales is None
            or not isinstance(layout, list)
            or qweight.dtype != torch.int8
            or tuple(qweight.shape) != tuple(linear.weight.shape)
        ):
            logger.warning("quantized-weight cache %s does not match this model; quantizing again", path)
            return None
        try:  # ValueError: scales or offsets of another shape
            group_size, source = int(layout[0]), str(layout[1])
            offsets = tensors.get(f"{name}.offsets")
            weights[name] = Int8Weight(qweight, scales, group_size, offsets, source)
        except (ValueError, IndexError):
            logger.warning("quantized-weight cache %s does not match this model; quantizing again", path)
            return None
    return weights


def _write_cache(path: Path, weights: dict[str, QuantizedWeight]) -> None:
    """Save the int8 weights atomically (`write_atomically`); a cache folder that cannot be written
    costs a warning, not the run."""
    from safetensors.torch import save

    tensors, layouts = {}, {}
    for name, weight in weights.items():
        tensors[f"{name}.qweight"], tensors[f"{name}.scales"] = weight.qweight, weight.scales
        if weight.offsets is not None:
            tensors[f"{name}.offsets"] = weight.offsets
        layouts[name] = [weight.group_size, weight.source]
    metadata = {"crc32": _checksum(tensors), "layouts": json.dumps(layouts)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(path.parent)
        write_atomically(path, save(tensors, metadata=metadata))
    except OSError as exc:
        logger.warning("could not write the quantized-weight cache %s: %s", path, exc)
