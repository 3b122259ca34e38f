"""GGUF files of the families beyond Llama (`batchgen/model/loading/gguf_cache.py`, `gguf_config.py`):
each written with the `gguf` package as llama.cpp's converter writes it (`tests/model/gguf_writer.py`),
converted once, and run. Greedy float32 output is token-identical to the same model loaded from its
Hugging Face directory and to transformers' `generate` on the converted directory; the converted
weights and config equal the source's. The GGUF architectures transformers cannot convert (SmolLM3;
Mixtral, which llama.cpp stores as "llama" with expert tensors) are refused in one line.

The tiny models are the suite's (`tests/conftest.py`) where a GGUF file can hold them; where llama.cpp
has no field for a setting it fixes by rule, the model follows the rule: Gemma's attention scale is
its head_dim (`query_pre_attn_scalar`), Gemma 3's sliding layers are five of every six, Qwen3-MoE
has experts in every layer and renormalizes its top-k.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from batchgen import LLM
from batchgen.model.loading.architectures import UnsupportedModelError
from batchgen.model.loading.gguf_config import GGUF_ARCHITECTURES
from batchgen.model.loading.loader import TOKENIZER_FILES, resolve_model
from batchgen.model.quantization import decoder_linears
from tests import conftest
from tests.engine.test_fidelity import GREEDY, TEXT_PROMPTS, hf_greedy, token_ids
from tests.model.gguf_writer import write_gguf

FAMILIES = ("qwen3", "qwen3_moe", "phi3", "gemma2", "gemma3")


def _config(family: str):
    """The tiny model of `family` a GGUF file can hold (module docstring)."""
    if family in ("qwen3", "phi3", "smollm3"):
        return conftest._tiny_config(family)
    if family == "mixtral":
        return conftest._tiny_moe_config("mixtral")
    if family == "qwen3_moe":
        config = conftest._tiny_moe_config("qwen3_moe")
        config.mlp_only_layers, config.norm_topk_prob = [], True
        return config
    config = conftest._tiny_gemma_config(family)
    config.query_pre_attn_scalar = config.head_dim
    if family == "gemma3":  # six layers: five sliding (local base), the sixth global (linear scaling)
        config.num_hidden_layers = 6
        config.layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    return config


@pytest.fixture(scope="module")
def cache(tmp_path_factory, tokenizer_dir) -> Path:
    """batchgen's cache in a folder of this module's own, so each file is converted here."""
    path = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BATCHGEN_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def family_files(tmp_path_factory, default_model_files, tokenizer_dir):
    """Factory `(family, q8_0 kinds) -> (Hugging Face directory, .gguf file)`, each built once."""
    if default_model_files.gguf is None:
        pytest.skip("the default model is not a GGUF file here (its tokenizer fields are copied)")
    built: dict[tuple[str, tuple[str, ...]], tuple[Path, Path]] = {}

    def make(family: str, q8_0: tuple[str, ...] = ()) -> tuple[Path, Path]:
        if (family, q8_0) not in built:
            root = tmp_path_factory.mktemp(f"gguf-{family}")
            hf_dir = root / family
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32)
            with torch.no_grad():  # decisive routing, as the suite's tiny mixtures (conftest)
                for name, param in model.named_parameters():
                    if name.endswith("mlp.gate.weight"):
                        param.mul_(conftest._ROUTER_SCALE)
            model.generation_config = transformers.GenerationConfig(bos_token_id=1, eos_token_id=[2, 0])
            model.save_pretrained(hf_dir)
            for name in TOKENIZER_FILES:
                if (tokenizer_dir / name).is_file():
                    shutil.copy2(tokenizer_dir / name, hf_dir / name)
            gguf = root / f"tiny-{family}.{'Q8_0' if q8_0 else 'F32'}.gguf"
            write_gguf(hf_dir, default_model_files.gguf, gguf, q8_0=q8_0)
            built[family, q8_0] = hf_dir, gguf
        return built[family, q8_0]

    return make


def _prompt_ids(path: Path) -> list[list[int]]:
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return [tok(p)["input_ids"] for p in TEXT_PROMPTS]


def _batchgen(model: Path, prompt_ids: list[list[int]], **options) -> list[list[int]]:
    llm = LLM(str(model), dtype="float32", device="cpu", **options)
    return token_ids(llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_gguf_file_runs_as_its_hugging_face_directory(family_files, cache, family):
    """F32 tensors: the converted directory holds the source's weights and config, and batchgen on
    the .gguf file, batchgen on the directory and transformers on the converted directory agree."""
    hf_dir, gguf = family_files(family)
    converted = resolve_model(str(gguf)).path
    source, weights = load_file(hf_dir / "model.safetensors"), load_file(converted / "model.safetensors")
    assert source.keys() == weights.keys()
    for name, tensor in source.items():
        assert torch.equal(weights[name], tensor), name
    assert _config_fields(converted) == _config_fields(hf_dir)

    prompt_ids = _prompt_ids(hf_dir)
    expected = hf_greedy(converted, prompt_ids, GREEDY.max_tokens, ignore_eos=True)
    assert _batchgen(gguf, prompt_ids) == expected
    assert _batchgen(hf_dir, prompt_ids) == expected


def _config_fields(path: Path) -> dict:
    """A model's config as transformers reads it, less what does not change the model."""
    config = transformers.AutoConfig.from_pretrained(path).to_dict()
    ignored = ("_name_or_path", "_model_name_or_path", "initializer_range", "unk_token_id", "transformers_version")
    return {key: value for key, value in config.items() if key not in ignored}
