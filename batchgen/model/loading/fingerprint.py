"""What identifies a model's files for resume: a digest of their content, taken without loading them.

A resumed job must not mix rows of two models. The model's name or path alone does not show that a
checkpoint was overwritten in place, or that a chat template or tokenizer was edited, so the job
header also holds `model_fingerprint`: the SHA-256 of the files that set the outputs. File digests
are remembered (`batchgen.cache.file_digest`), so only the first run reads the weights.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from batchgen.cache import cache_root, file_digest
from batchgen.model.loading import gguf_cache, loader

# A Hugging Face directory's files that change outputs: configs, tokenizer files (tokenizer.json,
# vocab.json, merges.txt, tokenizer.model, ...), the chat template and the weights. Other files
# (README, optimizer states, .bin weights the loader does not read) are left out.
_MODEL_FILE_SUFFIXES = frozenset({".json", ".jinja", ".txt", ".model", ".safetensors"})


def model_fingerprint(spec: str | None, cache_dir: Path | None = None) -> str | None:
    """SHA-256 (64 hex digits) of the files of the model `spec` names, as `resolve_model` reads them.

    Args:
        spec: None for the default model (its GGUF file), a `.gguf` path, or a Hugging Face
            directory (its top-level files with the suffixes in `_MODEL_FILE_SUFFIXES`, by name
            and content; hidden files are left out).
        cache_dir: batchgen's cache root (the digests are remembered under `models/.digests`);
            None means `batchgen.cache.cache_root()`.

    Returns:
        The digest; None for a hub id (its files are only known once the engine fetches them, so
        the id is what identifies it) or when the model cannot be found (the engine's start then
        reports why).
    """
    memo = (cache_root() if cache_dir is None else Path(cache_dir)) / "models" / ".digests"
    try:
        path = loader._default_gguf_path() if spec is None else Path(spec).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            # The same digest as the converted model's cache key: the file is read once for both.
            return file_digest(path, memo, salt=gguf_cache.GGUF_DIGEST_SALT)
        if path.is_dir():
            files = sorted(
                p
                for p in path.iterdir()
                if p.is_file() and p.suffix in _MODEL_FILE_SUFFIXES and not p.name.startswith(".")
            )
            combined = hashlib.sha256()
            for f in files:
                combined.update(f"{f.name}\0{file_digest(f, memo)}\n".encode())
            return combined.hexdigest()
    except (OSError, loader.ModelNotFoundError):
        return None
    return None
