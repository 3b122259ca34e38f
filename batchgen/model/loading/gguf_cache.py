"""GGUF files -> cached Hugging Face directories: dequantized once, reused by every later start.

A GGUF file is dequantized through transformers into float32 safetensors with its tokenizer and
configs, under `models/` of batchgen's cache (`batchgen.cache`), in a directory named after the
file's content. Hugging Face can load the same directory, so it also serves as the fidelity baseline.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from batchgen.cache import file_digest, fsync_path
from batchgen.model.loading.architectures import ModelNotFoundError, UnsupportedModelError, check_architecture
from batchgen.model.loading.gguf_config import gguf_architecture, gguf_config_fixes
from batchgen.progress import PROGRESS

logger = logging.getLogger(__name__)

# Bump when the GGUF conversion changes what it writes, so old caches are not reused.
_GGUF_CACHE_FORMAT = 2
# Mixed into GGUF digests, so a new conversion format gets new cache keys.
GGUF_DIGEST_SALT = f"{_GGUF_CACHE_FORMAT}\0"
# A temporary conversion directory without an owner lock older than this belongs to a run that died.
_STALE_TMP_SECONDS = 3600
# Held (flock) by the converting process inside its temporary directory; the kernel drops it when
# the process dies, however it dies, so a directory whose lock can be taken is a dead run's.
_OWNER_LOCK = ".owner.lock"


def gguf_cache_key(gguf: Path, models: Path) -> str:
    """`<stem>-<hash>`, the hash taken over the file's bytes (and the conversion format).

    So a copy of the same file at another path (each virtual environment installs its own) reuses
    one conversion, and an edited file converts again. Hashing reads the whole file (measured:
    docs/benchmarks.md); the digest is remembered per path, size and mtime in
    `models/.digests/`, so each file is read once.
    """
    digest = file_digest(gguf, models / ".digests", salt=GGUF_DIGEST_SALT)
    return f"{gguf.stem}-{digest[:12]}"


def cached_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Return the converted directory of `gguf` under `cache_dir/models/`, converting it first when
    no complete copy exists there.

    The conversion writes into a temporary directory next to the final one and renames it into
    place, so a crash never leaves a half-written cache; of two processes racing, the first rename
    wins and the other's copy is discarded.
    """
    models = cache_dir / "models"
    final = models / gguf_cache_key(gguf, models)
    if _is_whole(final):
        return final
    # The same bytes under another file name (a renamed or copied .gguf) were converted already:
    # the name is only there to make the cache readable, the digest is what identifies the model.
    digest = final.name.rsplit("-", 1)[1]
    for other in sorted(models.glob(f"*-{digest}")):
        if not other.name.startswith(".") and _is_whole(other):
            return other
    if final.exists():  # damaged since (renames are atomic, the files synced before): start over
        logger.warning("The converted copy %s is incomplete or damaged; converting %s again", final, gguf)
        shutil.rmtree(final)
    models.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(models)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=models))
    owner = os.open(tmp / _OWNER_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(owner, fcntl.LOCK_EX)
        os.chmod(tmp, 0o755)  # mkdtemp's 0o700 would hide a shared $BATCHGEN_CACHE from other users
        start = time.perf_counter()
        logger.info(
            "converting %s into %s (once: later starts reuse it)", gguf.name, final.parent, extra=PROGRESS
        )
        convert_gguf(gguf, tmp)
        os.remove(tmp / _OWNER_LOCK)  # not part of the model; the open descriptor keeps the lock
        _sync_tree(tmp)  # on disk before the rename makes it the cache: a crash cannot truncate it
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
            logger.info("Another process converted %s first; using its copy", gguf)
        else:
            logger.info("Converted %s in %.1f s", gguf.name, time.perf_counter() - start)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(owner)
    return final


def _is_whole(directory: Path) -> bool:
    """Whether a converted directory is complete: its config, and safetensors files whose headers
    cover them exactly (a truncated file fails; reading the headers takes milliseconds)."""
    from safetensors import safe_open

    weights = sorted(directory.glob("*.safetensors"))
    if not (directory / "config.json").is_file() or not weights:
        return False
    try:
        for path in weights:
            with safe_open(path, framework="pt"):
                pass
    except Exception:  # safetensors raises its own error type for a damaged header
        return False
    return True


def _sync_tree(directory: Path) -> None:
    """fsync every file in `directory` and the directory itself."""
    for path in directory.iterdir():
        if path.is_file():
            fsync_path(path)
    fsync_path(directory)


def _remove_stale_tmp(models: Path) -> None:
    """Delete temporary conversion directories left by runs that died (a killed first conversion
    leaves a float32 copy of the model: 0.5 GB for the default model, tens of GB for a 7B one).

    A directory whose owner lock can be taken has no live owner; one without a lock file (written
    before this lock existed, or between the lock's removal and the rename) only once it is old.
    """
    now = time.time()
    for entry in models.glob(".tmp-*"):
        try:
            if not entry.is_dir():
                continue
            lock = entry / _OWNER_LOCK
            if lock.exists():
                fd = os.open(lock, os.O_RDWR)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live conversion
                finally:
                    os.close(fd)
                shutil.rmtree(entry, ignore_errors=True)
            elif now - entry.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(entry, ignore_errors=True)
        except FileNotFoundError:
            pass


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize `gguf` with transformers and save it into `out_dir` as float32 safetensors.

    Writes the model (without `quantization_config`, with `architectures`), its generation config
    and the tokenizer stored in the GGUF.

    Raises:
        UnsupportedModelError: the GGUF holds an architecture we do not implement.
        ModelNotFoundError: the file is not a readable GGUF file (truncated or damaged).
    """
    with _gguf_parsed_once():
        _convert(gguf, out_dir)


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within the block, gguf's reader and tensor-name map are memoized by their arguments.

    transformers parses the file anew for the config, the weights and the tokenizer, and builds
    gguf's tensor-name map once for every module of the model (hundreds of times): together most of
    a conversion's time. Both are pure functions of their arguments over a file that does not change
    during the conversion, and transformers imports them from `gguf` when it calls them, so the
    memoized versions serve it; the originals are restored after.
    """
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    parsed = functools.cache(reader)

    def read(path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> Any:
        # Keyed by the real path: transformers passes a str, batchgen's own reading a Path.
        return parsed(os.path.realpath(path), *args, **kwargs)

    # A module attribute (a class, a function) swapped for its memoized version: gguf's types do not allow it.
    gguf.GGUFReader = read  # type: ignore[misc,assignment]
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map  # type: ignore[misc]


def _convert(gguf: Path, out_dir: Path) -> None:
    """`convert_gguf`'s work (with gguf's parsing memoized by the caller)."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    fields, tensors = _read_metadata(gguf)
    gguf_architecture(fields, gguf)
    # transformers' reading of the file's config, completed with the fields it drops (gguf_config).
    config = _read_gguf(gguf, AutoConfig.from_pretrained)
    fixes = gguf_config_fixes(fields, tensors, config.to_dict())
    if fixes:
        config = type(config).from_dict({**config.to_dict(), **fixes})
    kwargs: dict[str, Any] = {_dtype_kwarg(): torch.float32, "config": config}
    gguf_config_cls = getattr(transformers, "GgufConfig", None)
    if gguf_config_cls is not None:
        # Newer transformers may keep weights packed for its own kernels; we want plain tensors.
        kwargs["quantization_config"] = gguf_config_cls(dequantize=True)
    model = _read_gguf(gguf, AutoModelForCausalLM.from_pretrained, **kwargs)
    config = model.config
    if not getattr(config, "architectures", None):
        config.architectures = [type(model).__name__]
    check_architecture({"architectures": config.architectures, "model_type": config.model_type})

    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    not_dense = sorted({str(p.dtype) for p in model.parameters()} - {str(torch.float32)})
    if not_dense:
        raise RuntimeError(
            f"dequantizing {gguf} left parameters of dtype {', '.join(not_dense)}, not float32"
        )

    model.save_pretrained(out_dir)
    tokenizer = _read_gguf(gguf, AutoTokenizer.from_pretrained)
    tokenizer.save_pretrained(out_dir)
    if not (out_dir / "generation_config.json").is_file() and model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    # save_pretrained may still copy the quantization config from elsewhere; the file is what counts.
    config_file = out_dir / "config.json"
    raw = json.loads(config_file.read_text())
    if raw.pop("quantization_config", None) is not None or not raw.get("architectures"):
        raw["architectures"] = config.architectures
        config_file.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def _read_gguf(gguf: Path, from_pretrained: Any, **kwargs: Any) -> Any:
    """`from_pretrained(gguf)`, with a bad file's error (transformers' GGUF reader raises struct,
    value and key errors from deep inside) turned into one that names the file and the fix."""
    try:
        return from_pretrained(gguf.parent, gguf_file=gguf.name, **kwargs)
    except UnsupportedModelError:
        raise
    except Exception as e:
        raise _unreadable(gguf, e) from e


def _read_metadata(gguf: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The file's metadata (key -> value, without the tokenizer's vocabulary) and the float tensors
    `gguf_config` reads (Phi-3's LongRoPE factors), through gguf-py's reader (memoized by the caller).

    Raises:
        ModelNotFoundError: the file is not a readable GGUF file.
    """
    import numpy as np
    from gguf import GGUFReader

    try:
        reader = GGUFReader(gguf)
        fields = {key: f.contents() for key, f in reader.fields.items() if not key.startswith("tokenizer.")}
        tensors = {t.name: np.asarray(t.data) for t in reader.tensors if t.name.startswith("rope_factors_")}
    except Exception as e:  # gguf-py raises struct, value and index errors on a damaged file
        raise _unreadable(gguf, e) from e
    return fields, tensors


def _unreadable(gguf: Path, error: Exception) -> ModelNotFoundError:
    # The library's message may end in a period of its own (transformers' "... not a GGUF file.").
    why = str(error).rstrip().rstrip(".")
    return ModelNotFoundError(
        f"{gguf} is not a readable GGUF file (truncated or damaged?): {type(error).__name__}: {why}. "
        "Download it again, or pass another model"
    )


def _dtype_kwarg() -> str:
    """`from_pretrained`'s dtype keyword: `dtype` since transformers 4.56, `torch_dtype` before."""
    from packaging.version import Version
    from transformers import __version__

    return "dtype" if Version(__version__) >= Version("4.56") else "torch_dtype"
