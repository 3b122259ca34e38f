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
- "auto": a GGUF file's decoder linears stored in a type a kernel runs (Q8_0) keep their blocks
  (`gguf_blocks`); the others, and every float checkpoint, run dequantized as before.
- "none": everything dequantized (float), as before quantization existed.

Each quantized linear's float weight in the model is replaced by its dequantized value, so the
float kernels (still candidates of the registry, `kernels.cpu.quantized_linear`) and the reference
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

from batchgen.cache import cache_root, write_atomically
from batchgen.config import QUANTIZATIONS
from batchgen.kernels.cpu.int8_weight import INT8_GROUP_SIZE, int8_group_size
from batchgen.kernels.cpu.quantized_linear import Int8Weight, QuantizedWeight
from batchgen.model.llama import LlamaForCausalLM, decoder_layers
from batchgen.model.loading.loader import ModelFiles
from batchgen.model.loading.model_defaults import GGUF_LINEARS_NOTE, read_gguf_note

logger = logging.getLogger(__name__)

# Bump when the int8 quantization or the cache's layout changes, so old files are not read.
_CACHE_FORMAT = 4  # 3: the LM head quantized too; 4: a checksum in the metadata


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
        method: "int8", "gguf" (a GGUF file's own blocks) or "none".
        weights: decoder module name (e.g. "model.layers.0.mlp.down_proj") -> its quantized weight.
        source: where the weights came from: "quantized at load", "cache" or "GGUF file".
        dequantized: GGUF only: module name -> the stored type of the linears dequantized because no
            kernel runs it (e.g. "Q4_1").
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
        formats = sorted({w.format for w in self.weights.values()})
        size = f"{self.nbytes / 2**20:.1f} MiB"
        words = f"{len(self.weights)} linears, {size}, {self.source}"
        if self.dequantized:
            words += (
                f"; {len(self.dequantized)} {'/'.join(sorted(set(self.dequantized.values())))} dequantized"
            )
        return f"{'/'.join(formats)} ({words})"


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
    elif method == "auto" and files is not None and files.gguf is not None and linears:
        result = _gguf(linears, model, files.gguf, files.path / GGUF_LINEARS_NOTE)
    else:
        return Quantization()
    for name, weight in result.weights.items():
        # A parameter of its own: a tied LM head's is the embedding's, which stays float.
        linears[name].weight = nn.Parameter(weight.dequantize().to(dtype), requires_grad=False)
    result.seconds = time.perf_counter() - start
    return result


def _int8(
    linears: dict[str, nn.Linear], files: ModelFiles | None, dtype: torch.dtype, cache_dir: Path | None
) -> Quantization:
    """`linears` quantized to int8: read from the cache where it holds them, else quantized now
    and written there (no cache where `files` is None or the checkpoint has no digest)."""
    path = _cache_path(files, dtype, cache_dir)
    cached = _read_cache(path, linears) if path is not None else None
    if cached is not None:
        return Quantization("int8", cached, "from the cache")
    weights: dict[str, QuantizedWeight] = {
        name: Int8Weight.quantize(linear.weight, INT8_GROUP_SIZE) for name, linear in linears.items()
    }
    if path is not None:
        _write_cache(path, weights)
    return Quantization("int8", weights, "quantized at load")


def _gguf(linears: dict[str, nn.Linear], model: LlamaForCausalLM, gguf: Path, note: Path) -> Quantization:
    """The GGUF file's runnable blocks, each checked against the converted float weight (which
    transformers dequantized from the same blocks): a linear whose blocks differ stays float.
    `note` (`GGUF_LINEARS_NOTE` in the converted directory, which is keyed by the file's digest)
    says when an earlier start found none, so the file is not parsed again."""
    from batchgen.model.loading.gguf_blocks import gguf_linear_blocks

    known = read_gguf_note(note)
    if known is not None and not known["runnable"]:
        return Quantization("gguf", {}, "GGUF file", dequantized=known["dequantized"])
    attn = decoder_layers(model)[0].self_attn  # `linears` is not empty: the model has layers
    blocks, other_types = gguf_linear_blocks(gguf, attn.num_heads, attn.num_kv_heads)
    if known is None:
        try:
            write_atomically(
                note, json.dumps({"runnable": bool(blocks), "dequantized": other_types}).encode()
            )
        except OSError:  # a read-only cache: parsed again next time
            pass
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
    return Quantization("gguf", weights, "GGUF file", dequantized=other_types)


# ---------------------------------------------------------------------------------------------
# The cache


def _cache_path(files: ModelFiles | None, dtype: torch.dtype, cache_dir: Path | None) -> Path | None:
    """`quantized/<digest>-int8-g<group size>-<dtype>-v<format>.safetensors` under the cache; None when the checkpoint has
    no digest (its files cannot be read)."""
    from batchgen.model.loading.fingerprint import model_fingerprint

    if files is None:
        return None
    root = cache_root() if cache_dir is None else Path(cache_dir)
    source = files.gguf if files.gguf is not None else files.path
    digest = model_fingerprint(str(source), cache_dir=root)
    if digest is None:
        return None
    dtype_name = str(dtype).removeprefix("torch.")
    name = f"{digest[:24]}-int8-g{INT8_GROUP_SIZE}-{dtype_name}-v{_CACHE_FORMAT}.safetensors"
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
    weights: dict[str, QuantizedWeight] = {}
    for name, linear in linears.items():
        qweight, scales = tensors.get(f"{name}.qweight"), tensors.get(f"{name}.scales")
        if (
            qweight is None
            or scales is None
            or qweight.dtype != torch.int8
            or tuple(qweight.shape) != tuple(linear.weight.shape)
            or scales.dim() != 2
            or scales.shape[0] != linear.weight.shape[0]
        ):
            logger.warning("quantized-weight cache %s does not match this model; quantizing again", path)
            return None
        try:  # ValueError: scales of another group size
            group_size = int8_group_size(qweight.shape[1])
            weights[name] = Int8Weight(qweight, scales.float(), group_size)
        except ValueError:
            logger.warning("quantized-weight cache %s does not match this model; quantizing again", path)
            return None
    return weights


def _write_cache(path: Path, weights: dict[str, QuantizedWeight]) -> None:
    """Save the int8 weights atomically (`write_atomically`); a cache folder that cannot be written
    costs a warning, not the run."""
    from safetensors.torch import save

    tensors = {}
    for name, weight in weights.items():
        if isinstance(weight, Int8Weight):
            tensors[f"{name}.qweight"], tensors[f"{name}.scales"] = weight.qweight, weight.scales
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, save(tensors, metadata={"crc32": _checksum(tensors)}))
    except OSError as exc:
        logger.warning("could not write the quantized-weight cache %s: %s", path, exc)
