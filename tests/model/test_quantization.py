"""Quantized weights in the engine (`batchgen/model/quantization.py`): `quantization="int8"` on a
tiny random Llama (greedy output the same in any batch, teacher-forced top-1 agreement with the
float model, the quantized-weight cache) and on the default model (teacher-forced on XSum: top-1
agreement and perplexity), and the one-line refusals. A GGUF file's own quantized values under
"auto": tests/model/test_gguf_quantized.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from batchgen import LLM, SamplingParams
from batchgen.config import EngineConfig
from batchgen.kernels.cpu import library as cpu_kernels
from batchgen.kernels.cpu.quantized_linear import Int8Linear
from batchgen.model.loading.architectures import UnsupportedModelError
from batchgen.model.quantization import check_quantization

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "Hello"]
needs_kernels = pytest.mark.skipif(
    cpu_kernels.load_library() is None, reason="the C kernels are not built here"
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory, tokenizer_dir) -> Path:
    """batchgen's cache in a folder of this module's own: the kernel library is built there once, and
    the GGUF file converted once; each test starts without quantized weights cached. (The tiny
    models' tokenizer, the default model, is resolved first, in the usual cache.)"""
    path = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BATCHGEN_CACHE", str(path))
        yield path


@pytest.fixture(autouse=True)
def _no_quantized_cache(cache) -> None:
    shutil.rmtree(cache / "quantized", ignore_errors=True)


def _tokens(llm: LLM, prompts, max_tokens: int = 12) -> list[list[int]]:
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_none_is_vllms_default_and_means_auto():
    assert EngineConfig(quantization=None).quantization == "auto"  # type: ignore[arg-type]


def test_unknown_methods_and_int8_on_cuda_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^quantization must be one of auto, none, int8; got 'gptq'$"):
        EngineConfig(quantization="gptq")
    with pytest.raises(ValueError, match=r"quantization 'int8' runs on the CPU only"):
        EngineConfig(quantization="int8", device="cuda")
    with pytest.raises(ValueError, match=r"runs on the CPU only \(this engine runs on cuda\)"):
        check_quantization("int8", torch.device("cuda"))  # what --device auto resolves to on a GPU
    check_quantization("auto", torch.device("cuda"))


def test_the_cli_refuses_an_unknown_quantization(tmp_path):
    from batchgen.cli import app

    job = tmp_path / "job.jsonl"
    job.write_text('{"prompt": "hi"}\n')
    result = CliRunner().invoke(app, ["run", str(job), "--quantization", "awq", "--no-dashboard"])
    assert result.exit_code == 2, result.output
    assert "quantization must be one of auto, none, int8; got 'awq'" in result.stderr
    assert "Traceback" not in result.output


def test_a_checkpoint_stored_quantized_is_refused_by_name(tiny_model_dir, tmp_path):
    path = tmp_path / "gptq"
    shutil.copytree(tiny_model_dir("llama"), path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    for method in ("auto", "none", "int8"):
        with pytest.raises(
            UnsupportedModelError, match=r"is quantized \(gptq\), a format batchgen does not run"
        ):
            LLM(str(path), device="cpu", quantization=method)


@needs_kernels
def test_int8_runs_int8_weights_and_keeps_the_embedding_float(tiny_model_dir, cache):
    path = str(tiny_model_dir("llama"))
    llm = LLM(path, dtype="float32", device="cpu", quantization="int8", kernels="native")
    engine = llm.llm_engine
    model, quantization = engine.runner.model, engine.runner.quantization
    assert quantization.method == "int8" and quantization.source == "quantized at load"
    assert set(quantization.weights) == {"lm_head"} | {
        f"model.layers.{i}.{m}"
        for i in range(2)
        for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    }
    assert isinstance(model.model.layers[1].mlp.down_proj, Int8Linear)
    assert isinstance(model.lm_head, Int8Linear)
    floats = LLM(path, dtype="float32", device="cpu", quantization="none", kernels="native")
    embedding = model.model.embed_tokens.weight
    assert embedding.dtype == torch.float32
    assert torch.equal(embedding, floats.llm_engine.runner.model.model.embed_tokens.weight)
    vocab = embedding.shape[0]
    assert engine.start_line.startswith("quantization int8 (9 linears, ")
    # 2 layers x (qkv 128x64 + o 64x64 + gate/up 256x64 + down 64x128) and the head (vocab x 64):
    # int8 values and float32 scales, one a channel and group of 16 inputs
    layers = 2 * (128 * 64 + 64 * 64 + 256 * 64 + 64 * 128)
    assert quantization.nbytes == (layers + vocab * 64) * (1 + 4 / 16)


@needs_kernels
def test_a_tied_lm_head_runs_int8_while_the_embedding_stays_the_checkpoints(tiny_model_dir, cache, tmp_path):
    """With the head tied to the embedding, "int8" gives the head its own parameter (the dequantized
    int8) and leaves the embedding the checkpoint's float values: the tokens the model reads are not
    quantized."""
    path = tmp_path / "tied"
    shutil.copytree(tiny_model_dir("llama"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    runs = {
        method: LLM(str(path), dtype="float32", device="cpu", quantization=method, kernels="reference")
        for method in ("none", "int8")
    }
    floats, int8 = (runs[m].llm_engine.runner for m in ("none", "int8"))
    embedding = floats.model.model.embed_tokens.weight
    assert floats.model.lm_head.weight is embedding  # tied
    head = int8.quantization.weights["lm_head"]
    assert torch.equal(int8.model.model.embed_tokens.weight, embedding)
    assert torch.equal(int8.model.lm_head.weight, head.dequantize())
    assert not torch.equal(head.dequantize(), embedding)
    assert (head.dequantize() - embedding).abs().max() <= embedding.abs().max() / 127 / 2 * 1.0001


@needs_kernels
def test_int8_greedy_output_is_the_same_in_any_batch(tiny_model_dir, cache):
    """float32 activations: a request's tokens do not depend on the batch it shares (per-row sums
    in a fixed order), here alone, four together, and with chunked prefill through 2-row steps."""
    path = str(tiny_model_dir("llama"))
    llm = LLM(path, dtype="float32", device="cpu", quantization="int8", kernels="native")
    together = _tokens(llm, PROMPTS)
    alone = [_tokens(llm, [p])[0] for p in PROMPTS]
    small = LLM(path, dtype="float32", device="cpu", quantization="int8", kernels="native", max_num_seqs=2,
                max_num_batched_tokens=8, enable_prefix_caching=False)  # fmt: skip
    assert together == alone == _tokens(small, PROMPTS)


@needs_kernels
def test_int8_teacher_forced_top1_agrees_with_the_float_model(tiny_model_dir, cache):
    """The next-token argmax at every position of a fixed text, quantized against unquantized: the
    prompts are the text's prefixes, one generated token each."""
    path = str(tiny_model_dir("llama"))
    runs = {}
    for method in ("none", "int8"):
        llm = LLM(path, dtype="float32", device="cpu", quantization=method, kernels="native", max_num_seqs=64)
        ids = llm.get_tokenizer()(" ".join(["The quick brown fox jumps over the lazy dog."] * 12))[
            "input_ids"
        ]
        prompts = [{"prompt_token_ids": ids[:i]} for i in range(1, 101)]
        runs[method] = [t[0] for t in _tokens(llm, prompts, max_tokens=1)]
    agree = sum(a == b for a, b in zip(runs["none"], runs["int8"], strict=True)) / len(runs["none"])
    assert agree >= 0.98, agree


XSUM = Path(__file__).resolve().parents[3] / "shared" / "data" / "xsum" / "test.jsonl"


def _teacher_forced(llm: LLM, documents: list[list[int]]) -> tuple[list[int], float]:
    """Each document's next-token argmax at every position after the first (the rank-1 token of
    its prompt logprobs), and the mean negative log-likelihood of the real next tokens (nats)."""
    outputs = llm.generate(
        [{"prompt_token_ids": ids} for ids in documents], SamplingParams(max_tokens=1, prompt_logprobs=1)
    )
    top, nll = [], []
    for output in outputs:
        for token, position in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:], strict=True):
            top.append(next(t for t, p in position.items() if p.rank == 1))
            nll.append(-position[token].logprob)
    return top, float(np.mean(nll))


@pytest.mark.slow
@needs_kernels
def test_int8_on_the_default_model_agrees_with_it_teacher_forced_on_xsum(default_model_dir, cache):
    """The default model with `quantization="int8"` against itself unquantized ("none"), float32,
    teacher-forced over the first 256 tokens of six XSum articles (1,050 positions): the top-1 next
    token agrees at 98% of positions or more, and the perplexity is within 2%. (One scale a channel
    instead of one a group of 16 inputs gave 97.0%: docs/benchmarks.md.)"""
    if not XSUM.exists():
        pytest.skip(f"the XSum sample is not at {XSUM}")
    articles = [json.loads(line)["document"] for line in XSUM.read_text().splitlines()[:6]]
    runs = {}
    for method in ("none", "int8"):
        llm = LLM(
            str(default_model_dir), dtype="float32", device="cpu", quantization=method, kernels="native"
        )
        documents = [llm.get_tokenizer()(a)["input_ids"][:256] for a in articles]
        runs[method] = _teacher_forced(llm, documents)
    (top_float, nll_float), (top_int8, nll_int8) = runs["none"], runs["int8"]
    assert len(top_float) == len(top_int8) > 1000
    agree = sum(a == b for a, b in zip(top_float, top_int8, strict=True)) / len(top_float)
    assert agree >= 0.98, agree
    assert abs(np.exp(nll_int8 - nll_float) - 1) <= 0.02, (nll_float, nll_int8)


@needs_kernels
def test_a_second_start_reads_the_quantized_cache(tiny_model_dir, cache, caplog):
    path = str(tiny_model_dir("llama"))
    first = LLM(path, dtype="float32", device="cpu", quantization="int8", kernels="native")
    assert first.llm_engine.runner.quantization.source == "quantized at load"
    files = list((cache / "quantized").glob("*-int8-g*-float32-*.safetensors"))
    assert len(files) == 1
    second = LLM(path, dtype="float32", device="cpu", quantization="int8", kernels="native")
    quantization = second.llm_engine.runner.quantization
    assert quantization.source == "from the cache" and "from the cache" in second.llm_engine.start_line
    for name, weight in first.llm_engine.runner.quantization.weights.items():
        assert torch.equal(quantization.weights[name].qweight, weight.qweight)
    assert _tokens(first, PROMPTS) == _tokens(second, PROMPTS)
    files[0].write_bytes(b"damaged")  # a damaged file is quantized again, and rewritten
    third = LLM(path, dtype="float32", device="cpu", quantization="int8", kernels="native")
    assert third.llm_engine.runner.quantization.source == "quantized at load"
    assert _tokens(third, PROMPTS) == _tokens(first, PROMPTS)
    # Damage inside the tensors' bytes, the header intact: the checksum finds it.
    data = bytearray(files[0].read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
    files[0].write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="batchgen.model.quantization"):
        fourth = LLM(path, dtype="float32", device="cpu", quantization="int8", kernels="native")
    assert fourth.llm_engine.runner.quantization.source == "quantized at load"
    assert any("is damaged (its checksum does not match)" in r.getMessage() for r in caplog.records)
    assert _tokens(fourth, PROMPTS) == _tokens(first, PROMPTS)
    assert LLM(
        path, dtype="float32", device="cpu", quantization="int8"
    ).llm_engine.runner.quantization.source == (
        "from the cache"  # rewritten whole
    )


@pytest.mark.parametrize("kernels", ["auto", "reference"])
@needs_kernels
def test_int8_under_each_kernel_mode_runs_the_quantized_weights(tiny_model_dir, cache, kernels):
    """ "auto" times the quantized candidates beside the float ones on the dequantized weights (all
    of them checked against the same reference), "reference" runs plain torch on the dequantized
    weights: the greedy tokens are the native int8 kernel's."""
    path = str(tiny_model_dir("llama"))
    native = LLM(path, dtype="float32", device="cpu", quantization="int8", kernels="native")
    other = LLM(path, dtype="float32", device="cpu", quantization="int8", kernels=kernels)
    if kernels == "auto":  # the decoder's shapes are timed as int8 ones, the LM head's as float
        shapes = set(other.llm_engine.runner.kernel_choice.linears)
        assert {s for s in shapes if not s.startswith("49152x")} == {
            "128x64/int8@2048", "64x64/int8@2048", "256x64/int8@2048", "64x128/int8@2048"
        }  # fmt: skip
    assert set(other.llm_engine.runner.quantization.weights) == set(
        native.llm_engine.runner.quantization.weights
    )
    assert _tokens(native, PROMPTS) == _tokens(other, PROMPTS)
