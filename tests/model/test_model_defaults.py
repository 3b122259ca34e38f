"""batchgen.model.loading.model_defaults: a model's max_model_len limit and what quantization
"auto" runs, from its files alone (no torch, nothing converted or downloaded)."""

from __future__ import annotations

import json
import subprocess
import sys

from batchgen.model.loading.gguf_cache import gguf_cache_key
from batchgen.model.loading.model_defaults import GGUF_LINEARS_NOTE, ModelDefaults, model_defaults


def test_a_hugging_face_folder_runs_float_weights_under_auto(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "max_position_embeddings": 4096})
    )
    assert model_defaults(str(tmp_path)) == ModelDefaults(4096, "none")
    # transformers' default for a missing limit differs by architecture: not told
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma"}))
    assert model_defaults(str(tmp_path)) == ModelDefaults(None, "none")
    assert model_defaults(str(tmp_path / "missing")) == ModelDefaults()


def test_a_gguf_file_is_told_by_its_converted_folder_and_note(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF and some bytes")
    cache = tmp_path / "cache"
    assert model_defaults(str(gguf), cache) == ModelDefaults()  # never converted: nothing told
    folder = cache / "models" / gguf_cache_key(gguf, cache / "models")
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    assert model_defaults(str(gguf), cache) == ModelDefaults(8192, None)  # no start under auto yet
    note = {"runnable": False, "dequantized": {"model.layers.0.mlp.down_proj": "IQ4_XS"}, "int8": {}}
    (folder / GGUF_LINEARS_NOTE).write_text(json.dumps(note))
    assert model_defaults(str(gguf), cache) == ModelDefaults(8192, "none")  # no type runs: float weights
    note = {"runnable": True, "dequantized": {}, "int8": {"model.layers.0.mlp.down_proj": [32, True]}}
    (folder / GGUF_LINEARS_NOTE).write_text(json.dumps(note))
    assert model_defaults(str(gguf), cache) == ModelDefaults(8192, "gguf")
    (folder / GGUF_LINEARS_NOTE).write_text(json.dumps({"runnable": False, "dequantized": {}}))
    assert model_defaults(str(gguf), cache) == ModelDefaults(8192, None)  # an older batchgen's note
    assert model_defaults(str(tmp_path / "gone.gguf"), cache) == ModelDefaults()


def test_it_imports_no_torch(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    code = (
        "import sys; from batchgen.model.loading.model_defaults import model_defaults; "
        f"print(model_defaults({str(tmp_path)!r}).max_len, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["64", "False"], out.stderr
