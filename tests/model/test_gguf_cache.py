"""GGUF files of each family transformers converts (`batchgen/model/loading/gguf_cache.py`,
`gguf_config.py`): Mistral (as llama.cpp's "llama", q/k rows permuted), Qwen2, Qwen3, Qwen3-MoE,
Phi-3, Gemma 2 and Gemma 3, each written with the `gguf` package as llama.cpp's converter writes it (`tests/model/gguf_writer.py`),
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

from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from batchgen import LLM
from batchgen.cache import cache_root
from batchgen.model.loading.architectures import UnsupportedModelError
from batchgen.model.loading.loader import resolve_model
from tests import conftest
from tests.engine.test_fidelity import GREEDY, TEXT_PROMPTS, hf_greedy, token_ids
from tests.model.gguf_writer import tiny_tokenizer, write_gguf

FAMILIES = ("mistral", "qwen2", "qwen3", "qwen3_moe", "phi3", "gemma2", "gemma3")
# The tiny models' vocabulary: the default model's first 512 tokens (`tiny_tokenizer`).
VOCAB = 512


def _config(family: str):
    """The tiny model of `family` a GGUF file can hold (module docstring), with a `VOCAB`-token vocabulary."""
    config = _family_config(family)
    config.vocab_size = VOCAB
    return config


def _family_config(family: str):
    if family in ("mistral", "qwen2", "qwen3", "phi3", "smollm3"):
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
    """batchgen's cache in a folder of this module's own, so each file is converted here; the built
    C kernels and the kernel tuning table are the usual cache's (building them takes most of a minute)."""
    path = tmp_path_factory.mktemp("cache")
    for shared in ("cpu_kernels", "kernel_tuning"):
        (cache_root() / shared).mkdir(parents=True, exist_ok=True)
        (path / shared).symlink_to(cache_root() / shared)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BATCHGEN_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def family_files(tmp_path_factory, default_model_files):
    """Factory `(family, q8_0 kinds) -> (Hugging Face directory, .gguf file)`, each built once; the
    directory of a family of `FAMILIES` holds the tokenizer transformers reads from the file."""
    if default_model_files.gguf is None:
        pytest.skip("the default model is not a GGUF file here (its tokenizer fields are copied)")
    tokenizer = tiny_tokenizer(default_model_files.gguf, VOCAB)
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
            gguf = root / f"tiny-{family}.{'Q8_0' if q8_0 else 'F32'}.gguf"
            write_gguf(hf_dir, tokenizer, gguf, dict.fromkeys(q8_0, "Q8_0"))
            if family in FAMILIES:  # transformers reads no other GGUF architecture (not even its tokenizer)
                transformers.AutoTokenizer.from_pretrained(root, gguf_file=gguf.name).save_pretrained(hf_dir)
            built[family, q8_0] = hf_dir, gguf
        return built[family, q8_0]

    return make


def _prompt_ids(path: Path) -> list[list[int]]:
    """`TEXT_PROMPTS` tokenized; for Phi-3 without those whose sequence crosses LongRoPE's original
    length while decoding (where batchgen differs from transformers by design: docs/engine.md,
    "Models"): the others run on the short or on the long factors."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompt_ids = [tok(p)["input_ids"] for p in TEXT_PROMPTS]
    original = getattr(
        transformers.AutoConfig.from_pretrained(path), "original_max_position_embeddings", None
    )
    if original is None:
        return prompt_ids
    prompt_ids = [ids for ids in prompt_ids if not len(ids) <= original < len(ids) + GREEDY.max_tokens]
    assert {len(ids) > original for ids in prompt_ids} == {False, True}
    return prompt_ids


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
    got, want = _config_fields(converted), _config_fields(hf_dir)
    if family == "mistral":  # llama.cpp writes Mistral as "llama": it converts as a Llama
        assert got.pop("architectures") == ["LlamaForCausalLM"] and want.pop("sliding_window") > 2048
        got = {key: value for key, value in got.items() if key in want}
        want = {key: value for key, value in want.items() if key not in ("architectures", "model_type")}
        assert got.pop("model_type") == "llama"
    assert got == want

    prompt_ids = _prompt_ids(hf_dir)
    expected = hf_greedy(converted, prompt_ids, GREEDY.max_tokens, ignore_eos=True)
    assert _batchgen(gguf, prompt_ids) == expected
    assert _batchgen(hf_dir, prompt_ids) == expected


def _config_fields(path: Path) -> dict:
    """A model's config as transformers reads it, less what does not change the model."""
    config = transformers.AutoConfig.from_pretrained(path).to_dict()
    ignored = (
        "_name_or_path",
        "_model_name_or_path",
        "initializer_range",
        "unk_token_id",
        "transformers_version",
    )
    return {key: value for key, value in config.items() if key not in ignored}


Q8_0_CASES = {
    # Gemma 3: q/k/v and down in Q8_0, run from their blocks under "auto" (qkv and down of 6 layers).
    "gemma3": (("attn_q", "attn_k", "attn_v", "ffn_down"), 12),
    # Phi-3: its fused qkv and gate/up (as llama.cpp stores them), o and down: all from their blocks.
    "phi3": (("attn_qkv", "ffn_up", "attn_output", "ffn_down"), 8),
    # Qwen3-MoE: every expert tensor and o_proj in Q8_0; the experts are dequantized, o_proj runs
    # from its blocks (3 layers).
    "qwen3_moe": (("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "attn_output"), 3),
}


@pytest.mark.parametrize("family", list(Q8_0_CASES))
def test_a_gguf_file_with_q8_0_tensors_runs_as_its_converted_directory(family_files, cache, family):
    """Q8_0 tensors convert to exactly gguf's dequantization of their blocks; batchgen on the file
    (its dequantized floats, and "auto": the runnable linears as int8 weights of their blocks' values)
    gives transformers' greedy output on the converted directory."""
    import gguf as gguf_py

    kinds, runnable = Q8_0_CASES[family]
    hf_dir, gguf = family_files(family, kinds)
    converted = resolve_model(str(gguf)).path
    reader = gguf_py.GGUFReader(gguf)
    quantized = [t for t in reader.tensors if t.tensor_type == gguf_py.GGMLQuantizationType.Q8_0]
    assert {t.name.split(".")[2] for t in quantized} == set(kinds)
    source = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).state_dict()
    weights = transformers.AutoModelForCausalLM.from_pretrained(converted).state_dict()
    changed = [name for name in source if not torch.equal(source[name], weights[name])]
    assert changed and all(("experts" in n or "proj" in n) for n in changed)
    for name in changed:  # rounded to a Q8_0 step (its block's largest magnitude / 127, in float16)
        step = source[name].abs().amax() / 127
        assert (weights[name] - source[name]).abs().max() <= step, name

    prompt_ids = _prompt_ids(hf_dir)
    expected = hf_greedy(converted, prompt_ids, GREEDY.max_tokens, ignore_eos=True)
    assert _batchgen(gguf, prompt_ids, quantization="none") == expected
    llm = LLM(str(gguf), dtype="float32", device="cpu", quantization="auto", kernels="native")
    quantization = llm.llm_engine.runner.quantization
    assert quantization.method == "gguf" and len(quantization.weights) == runnable
    assert set(quantization.weights) <= dict(llm.llm_engine.runner.model.named_modules()).keys()
    got = token_ids(llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY))
    assert got == expected


@pytest.mark.parametrize(
    ("family", "message"),
    [
        ("smollm3", r"GGUF architecture 'smollm3' is not supported: .* it reads llama, qwen2, qwen3, "
         r"qwen3moe, phi3, gemma2, gemma3 .*Hugging Face directory"),
        ("mixtral", r"a GGUF 'llama' file with 8 experts \(Mixtral\) is not supported: .*dense Llama"),
    ],
)  # fmt: skip
def test_a_gguf_architecture_transformers_cannot_convert_is_refused_in_one_line(
    family_files, cache, family, message
):
    """SmolLM3 (no GGUF reader in transformers: it raised deep inside, reported as a damaged file)
    and Mixtral (read as a dense Llama whose MLPs were left random) are refused before converting,
    in one line naming the architecture and the supported set; no cache entry is left behind."""
    _, gguf = family_files(family)
    with pytest.raises(UnsupportedModelError, match=message) as error:
        resolve_model(str(gguf))
    assert "\n" not in str(error.value) and str(gguf) in str(error.value)
    assert not list((cache / "models").glob(f"*{gguf.stem}*"))
