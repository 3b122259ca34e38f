"""model_fingerprint: a model's files by content, so a resume notices an edited checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

from batchgen.model.loading.fingerprint import model_fingerprint
from batchgen.model.loading.gguf_cache import gguf_cache_key


def make_model_dir(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "tokenizer.json").write_text('{"model": {}}')
    (path / "chat_template.jinja").write_text("{{ messages }}")
    (path / "model.safetensors").write_bytes(b"\x00" * 4096)
    (path / "README.md").write_text("about the model")
    return path


def test_directory_fingerprint_follows_content_not_path_or_mtime(tmp_path):
    cache = tmp_path / "cache"
    model = make_model_dir(tmp_path / "m")
    first = model_fingerprint(str(model), cache)
    assert first is not None and len(first) == 64
    assert model_fingerprint(str(model), cache) == first  # memoized digests give the same answer
    assert model_fingerprint(str(shutil.copytree(model, tmp_path / "copy")), cache) == first
    (model / "README.md").write_text("edited docs change no output")
    (model / ".hidden.json").write_text("{}")
    assert model_fingerprint(str(model), cache) == first
    (model / "chat_template.jinja").write_text("{{ messages }} edited")
    edited = model_fingerprint(str(model), cache)
    assert edited not in (None, first)
    (model / "model.safetensors").write_bytes(b"\x01" + b"\x00" * 4095)  # same size, new weights
    assert model_fingerprint(str(model), cache) not in (None, first, edited)


def test_gguf_fingerprint_is_the_conversion_cache_digest(tmp_path):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)))
    cache = tmp_path / "cache"
    digest = model_fingerprint(str(gguf), cache)
    assert gguf_cache_key(gguf, cache / "models") == f"tiny-{digest[:12]}"


def test_hub_ids_and_missing_paths_have_no_fingerprint(tmp_path):
    assert model_fingerprint("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path) is None
    assert model_fingerprint(str(tmp_path / "missing"), tmp_path) is None
