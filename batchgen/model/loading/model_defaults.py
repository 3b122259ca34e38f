"""What a model's defaults resolve to, read from its files without loading it (no torch): the longest
sequence it serves (`max_model_len`'s default, `model_max_len`) and the weights
`quantization="auto"` runs. The run header records an option given as the value its default
resolves to as the default, so a resumed run that words it the other way still resumes
(`batchgen.jobs.output.header_options`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# Beside a GGUF file's converted directory: whether the file has linears a kernel runs as stored,
# the types of the rest, and the int8 layout of those it runs. gguf-py parses a file's whole
# metadata (the vocabulary's strings too) to list its tensors: about 3 s a start for the default
# model.
# Written by `batchgen.model.quantization` at the first start under "auto".
GGUF_LINEARS_NOTE = "gguf_linears.json"


def model_max_len(config: Any) -> int:
    """The longest sequence the model serves exactly: `max_position_embeddings` (2048 if unset)
    of its config (a transformers `PretrainedConfig`, or any object with its fields). A sliding
    window does not limit it: its layers attend to their window only
    (`batchgen.model.layers.layer_windows`), as transformers' do."""
    return int(getattr(config, "max_position_embeddings", None) or 2048)


def read_gguf_note(note: Path) -> dict[str, Any] | None:
    """The `GGUF_LINEARS_NOTE` at `note` ({"runnable": bool, "dequantized": {name: type}, "int8":
    {name: [group, offsets]}}, `gguf_blocks.gguf_linear_types`), or None when it is missing or
    damaged."""
    try:
        known = json.loads(note.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(known, dict) or not isinstance(known.get("runnable"), bool):
        return None
    dequantized, int8 = known.get("dequantized"), known.get("int8")
    if not isinstance(dequantized, dict) or not all(isinstance(v, str) for v in dequantized.values()):
        return None
    layout_ok = lambda v: (  # noqa: E731  [group, offsets], as `gguf_linear_types` writes it
        isinstance(v, list) and len(v) == 2 and type(v[0]) is int and v[0] > 0 and isinstance(v[1], bool)
    )
    if not isinstance(int8, dict) or not all(layout_ok(v) for v in int8.values()):
        return None
    # "runnable" says whether a decoder linear (not the LM head alone) runs as int8: the two agree
    return known if known["runnable"] == any(name != "lm_head" for name in int8) else None


@dataclass(frozen=True)
class ModelDefaults:
    """A model's defaults as its files tell them; None where they do not (yet).

    Attributes:
        max_len: `model_max_len` of its config (a config without `max_position_embeddings`: None,
            as transformers' own default for it differs by architecture).
        auto_quantization: what "auto" runs: "none" (float weights: every Hugging Face checkpoint,
            and a GGUF file no kernel runs as stored, as a start under "auto" noted), or "gguf"
            (a GGUF file's own blocks).
    """

    max_len: int | None = None
    auto_quantization: str | None = None


def model_defaults(spec: str | None, cache_dir: Path | None = None) -> ModelDefaults:
    """The defaults of the model `spec` names, as `loader.resolve_model` takes it (None: the
    default model), from its files without converting, downloading or loading anything: a GGUF
    file's from its converted directory, a hub id's from the local Hugging Face cache. Never
    raises: what cannot be read is None (`ModelDefaults`)."""
    from batchgen.model.loading import gguf_cache, loader
    from batchgen.model.loading.architectures import ModelNotFoundError

    try:
        path = loader._default_gguf_path() if spec is None else Path(spec).expanduser()
        if path.suffix != ".gguf":
            folder = path if path.is_dir() else _hub_folder(str(spec))
            return ModelDefaults() if folder is None else ModelDefaults(_max_len(folder), "none")
        if not path.is_file():
            return ModelDefaults()
        models = (loader.default_cache_dir() if cache_dir is None else Path(cache_dir)) / "models"
        folder = models / gguf_cache.gguf_cache_key(path, models)
        note = read_gguf_note(folder / GGUF_LINEARS_NOTE)
        auto = None if note is None else ("gguf" if note["runnable"] else "none")
        return ModelDefaults(_max_len(folder), auto)
    except (ModelNotFoundError, OSError, ValueError, ImportError):  # no default model, no cache
        return ModelDefaults()


def _hub_folder(repo_id: str) -> Path | None:
    """The local Hugging Face cache's folder of a hub id's config, or None when it is not there."""
    import huggingface_hub

    try:
        found = huggingface_hub.try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a repo id
        return None
    return Path(found).parent if isinstance(found, str) else None


def _max_len(folder: Path | None) -> int | None:
    if folder is None:
        return None
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("max_position_embeddings"), int):
        return None
    return model_max_len(SimpleNamespace(**raw))
