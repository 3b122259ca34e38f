"""A GGUF file's quantized linears under `quantization="auto"` (`batchgen/model/quantization.py`,
`model/loading/gguf_blocks.py`): run as int8 weights holding the file's very values (equal to the
converted float weights, so the run equals the dequantized one within the kernels' tolerance), by
the per-layer kernels and the float32 decoder stack, cached after the first start, and noted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.kernels.cpu import library as cpu_kernels
from batchgen.kernels.cpu.linear import can_prepack
from batchgen.kernels.cpu.quantized_linear import Int8Linear, Int8Weight
from batchgen.model.quantization import decoder_linears
from tests.kernels.cpu.stack_cases import (
    BLOCK,
    assert_generate_is_the_same_without_the_stack,
    assert_stack_matches_the_layer_path,
    logits_with_down_zeroed,
)

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "Hello"]
needs_kernels = pytest.mark.skipif(
    cpu_kernels.load_library() is None, reason="the C kernels are not built here"
)
# Each decoder linear's part in a type gguf-py quantizes, symmetric and not, mixed within fused
# layers (q/k/v: Q4_1, Q4_1, Q5_0; gate/up: Q8_0, Q4_0); the LM head (its own tensor) Q8_0.
TYPES = {
    "attn_q": "Q4_1",
    "attn_k": "Q4_1",
    "attn_v": "Q5_0",
    "attn_output": "Q4_1",
    "ffn_gate": "Q8_0",
    "ffn_up": "Q4_0",
    "ffn_down": "Q5_1",
    "output": "Q8_0",
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory, tokenizer_dir) -> Path:
    """batchgen's cache in a folder of this module's own (the GGUF file converted once)."""
    path = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BATCHGEN_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def quantized_gguf(tiny_model_dir, default_model_files, tmp_path_factory) -> Path:
    """The tiny Llama as a GGUF file written as llama.cpp's converter writes one (q/k rows permuted),
    its linears in `TYPES`."""
    from tests.model.gguf_writer import tiny_tokenizer, write_gguf

    if default_model_files.gguf is None:
        pytest.skip("the default model is not a GGUF file here (its tokenizer fields are needed)")
    path = tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf"
    write_gguf(tiny_model_dir("llama"), tiny_tokenizer(default_model_files.gguf, 49152), path, TYPES)
    return path


def _fresh(cache: Path) -> None:
    """No quantized weights cached (the first start repacks the file's blocks)."""
    for file in (cache / "quantized").glob("*"):
        file.unlink()


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gguf_linears_run_as_int8_weights_of_their_values(quantized_gguf, cache, dtype):
    """ "auto" turns every decoder linear and the LM head into an int8 weight of the file's values
    (each equal to the converted float weight: the q/k row order is checked too) run by the int8
    kernel; "none" runs the floats (torch's reference path): the logits agree within the kernels' tolerance, the greedy
    tokens too in float32."""
    if dtype == "bfloat16" and not can_prepack(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no native bfloat16 here (an AVX2-only CPU): bf16 runs torch's linears")
    _fresh(cache)
    quantized = LLM(str(quantized_gguf), dtype=dtype, device="cpu", quantization="auto", kernels="native")
    floats = LLM(str(quantized_gguf), dtype=dtype, device="cpu", quantization="none", kernels="reference")
    quantization = quantized.llm_engine.runner.quantization
    assert quantization.method == "gguf" and len(quantization.weights) == 9  # 2 layers x 4, the head
    assert all(isinstance(w, Int8Weight) for w in quantization.weights.values())
    qkv = quantization.weights["model.layers.0.self_attn.qkv_proj"]
    assert (qkv.source, qkv.group_size, qkv.offsets is not None) == ("Q4_1/Q5_0", 32, True)
    gate_up = quantization.weights["model.layers.0.mlp.gate_up_proj"]
    assert (gate_up.source, gate_up.offsets) == ("Q4_0/Q8_0", None)
    assert isinstance(quantized.llm_engine.runner.model.model.layers[0].self_attn.qkv_proj, Int8Linear)
    start = quantized.llm_engine.start_line
    assert "quantization GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 as int8 (9 linears" in start, start
    assert floats.llm_engine.runner.quantization.weights == {}
    float_model = floats.llm_engine.runner.model
    for name, linear in [*decoder_linears(float_model).items(), ("lm_head", float_model.lm_head)]:
        stored = quantization.weights[name].dequantize().to(linear.weight.dtype)
        assert torch.equal(stored, linear.weight.detach()), name
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    a, b = quantized.generate(PROMPTS, params), floats.generate(PROMPTS, params)
    tolerance = 1e-4 if dtype == "float32" else 5e-2
    for x, y in zip(a, b, strict=True):
        if dtype == "float32":
            assert x.outputs[0].token_ids == y.outputs[0].token_ids
        first_x, first_y = x.outputs[0].logprobs[0], y.outputs[0].logprobs[0]
        for token, logprob in first_y.items():
            if token in first_x:
                assert abs(first_x[token].logprob - logprob.logprob) <= tolerance


@needs_kernels
def test_a_float32_gguf_model_runs_its_decoder_stack_on_the_int8_weights(quantized_gguf, cache):
    """In float32 the decoder stack runs the repacked weights, offsets included: logits and K/V agree
    with the per-layer path on the same int8 kernel to float32 rounding, the stack reads the
    weights (zeroing one layer's changes its logits), and greedy tokens are the same with and
    without it. (Its timing against the per-layer path, as an int8 model's: test_kernel_choice.py.)"""
    llm = LLM(
        str(quantized_gguf),
        dtype="float32",
        device="cpu",
        quantization="auto",
        kernels="native",
        block_size=BLOCK,
    )
    runner = llm.llm_engine.runner
    stack = runner.model.decoder_stack
    assert stack is not None and stack.int8_applies()
    qkv = runner.quantization.weights["model.layers.0.self_attn.qkv_proj"]
    assert stack.layers[0].int8[0].offsets is not None and stack.layers[0].int8[0] is qkv.packed(
        int(cpu_kernels.require_library().int8_linear_lanes())
    )
    assert_stack_matches_the_layer_path(
        runner, lambda got, want: torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    )
    kept, zeroed = logits_with_down_zeroed(runner)
    assert not torch.equal(zeroed, kept)
    assert_generate_is_the_same_without_the_stack(llm)


@needs_kernels
def test_a_second_start_reads_the_repacked_weights_from_the_cache(quantized_gguf, cache, monkeypatch):
    """The first start notes what the file holds and caches the repacked weights; the next reads
    them without parsing the file (gguf-py's parse of a real file's metadata takes seconds)."""
    import batchgen.model.loading.gguf_blocks as gguf_blocks
    from batchgen.model.quantization import GGUF_LINEARS_NOTE

    _fresh(cache)
    first = LLM(str(quantized_gguf), dtype="float32", device="cpu", quantization="auto", kernels="reference")
    notes = list(Path(cache).rglob(GGUF_LINEARS_NOTE))
    assert len(notes) == 1
    note = json.loads(notes[0].read_text())
    assert note["runnable"] is True and note["dequantized"] == {}
    assert note["int8"]["model.layers.1.mlp.down_proj"] == [32, True]
    assert note["int8"]["lm_head"] == [32, False]

    def parse(*args, **kwargs):
        raise AssertionError("the GGUF file was parsed although its repacked weights are cached")

    monkeypatch.setattr(gguf_blocks, "gguf_linear_blocks", parse)
    second = LLM(str(quantized_gguf), dtype="float32", device="cpu", quantization="auto", kernels="reference")
    again = second.llm_engine.runner.quantization
    assert again.source == "from the cache" and set(again.weights) == set(
        first.llm_engine.runner.quantization.weights
    )
    for name, weight in again.weights.items():
        assert torch.equal(
            weight.dequantize(), first.llm_engine.runner.quantization.weights[name].dequantize()
        )


def test_a_gguf_file_without_runnable_linears_is_not_parsed_again(tmp_path, monkeypatch):
    """The note beside a converted GGUF directory says an earlier start found no linear the int8
    kernels run: "auto" then reads it instead of parsing the file."""
    import types

    import batchgen.model.loading.gguf_blocks as gguf_blocks
    from batchgen.model import quantization as q

    note = tmp_path / q.GGUF_LINEARS_NOTE
    stored = {"runnable": False, "dequantized": {"model.layers.0.mlp.down_proj": "IQ4_XS"}, "int8": {}}
    note.write_text(json.dumps(stored))

    def parse(*args, **kwargs):
        raise AssertionError("the GGUF file was parsed although the note says it has no runnable linear")

    monkeypatch.setattr(gguf_blocks, "gguf_linear_blocks", parse)
    files = types.SimpleNamespace(path=tmp_path, gguf=tmp_path / "model.gguf")
    result = q._gguf({}, None, files, torch.float32, tmp_path)  # type: ignore[arg-type]
    assert result.method == "gguf" and result.weights == {}
    assert result.dequantized == {"model.layers.0.mlp.down_proj": "IQ4_XS"}
    layer = '"model.layers.0.mlp.down_proj"'
    for damaged in (
        "{damaged",
        '{"runnable": "no", "dequantized": {}, "int8": {}}',
        "[]",
        '{"runnable": false, "dequantized": {}}',  # an older batchgen's note (it ran Q8_0 only)
        f'{{"runnable": true, "dequantized": {{{layer}: 5}}, "int8": {{{layer}: [32, true]}}}}',
        f'{{"runnable": true, "dequantized": {{}}, "int8": {{{layer}: "abc"}}}}',
        '{"runnable": false, "dequantized": {}, "int8": {"lm_head": null}}',
        f'{{"runnable": true, "dequantized": {{}}, "int8": {{{layer}: [0, true]}}}}',
        '{"runnable": true, "dequantized": {}, "int8": {}}',  # runnable, yet nothing runs
        f'{{"runnable": false, "dequantized": {{}}, "int8": {{{layer}: [32, false]}}}}',
    ):  # read as no note: the file is parsed again and the note rewritten (found by a fresh-eyes
        note.write_text(damaged)  # session: a wrong value type crashed the start line and plan)
        assert q.read_gguf_note(note) is None, damaged


def test_int8_on_a_gguf_file_quantizes_its_floats(quantized_gguf, cache):
    """ "int8" on a GGUF file quantizes the dequantized floats (groups of 16, symmetric; its own
    blocks unused)."""
    _fresh(cache)
    llm = LLM(str(quantized_gguf), dtype="float32", device="cpu", quantization="int8", kernels="reference")
    weights = llm.llm_engine.runner.quantization.weights
    assert len(weights) == 9 and all(w.group_size == 16 and w.offsets is None for w in weights.values())


def test_float_tensors_are_not_called_dequantized(tiny_model_dir, default_model_files, tmp_path):
    """An F32 file's linears run as the floats they are: nothing runs as int8 and nothing is listed
    as dequantized (the start line said "GGUF F32 dequantized"; found by a fresh-eyes session)."""
    from batchgen.model.loading.gguf_blocks import gguf_linear_types
    from batchgen.model.quantization import Quantization
    from tests.model.gguf_writer import tiny_tokenizer, write_gguf

    if default_model_files.gguf is None:
        pytest.skip("the default model is not a GGUF file here (its tokenizer fields are needed)")
    path = tmp_path / "tiny.F32.gguf"
    write_gguf(tiny_model_dir("llama"), tiny_tokenizer(default_model_files.gguf, 49152), path)
    found = gguf_linear_types(path)
    assert found == {"runnable": False, "dequantized": {}, "int8": {}}
    assert Quantization("gguf", {}, "GGUF file", dequantized=found["dequantized"]).summary() == "none"
