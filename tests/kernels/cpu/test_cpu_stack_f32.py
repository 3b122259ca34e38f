"""The float32 C decoder stack (`DecoderStack` with dtype float32, `csrc/decoder_stack.c`'s
`decoder_stack_f32`): a `--quantization int8` float32 model's layers in one call, on any CPU the
library builds for (AVX2 among them). Its norms, rotary and SiLU are `csrc/f32_ops.c`'s where the
per-layer path runs torch's, so the two agree to float32 rounding, not bit for bit."""

from __future__ import annotations

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.kernels.cpu import library as cpu_kernels
from batchgen.kernels.cpu.linear import bf16_kernel_available
from batchgen.kernels.cpu.stack import DecoderStack, StackLayer
from batchgen.model.kernel_choice.stack import build_decoder_stack
from tests.kernels.cpu.stack_cases import BLOCK, run_step, step_inputs

pytestmark = pytest.mark.skipif(
    cpu_kernels.load_library() is None, reason="batchgen's C kernels are not built here (no C compiler)"
)


def tiny_int8_f32_llm(tiny_model_dir, arch: str = "llama") -> LLM:
    return LLM(
        str(tiny_model_dir(arch)),
        dtype="float32",
        max_num_seqs=8,
        device="cpu",
        block_size=BLOCK,
        kernels="native",
        quantization="int8",
    )


def test_the_float32_stack_matches_the_layer_by_layer_path(tiny_model_dir) -> None:
    """Prefill, a mixed step (decodes plus a chunk after a cached prefix) and a decode-only step:
    logits and the K/V written agree with the per-layer path (the same int8 kernel) to float32
    rounding, and the stack reads the int8 weights (zeroing one changes its logits)."""
    runner = tiny_int8_f32_llm(tiny_model_dir).llm_engine.runner
    stack = runner.model.decoder_stack
    assert isinstance(stack, DecoderStack) and stack.dtype == torch.float32 and stack.int8_applies()
    steps = [
        step_inputs([(0, 0, 3), (4, 0, 17), (8, 0, 40)]),
        step_inputs([(0, 3, 1), (4, 17, 1), (8, 40, 25)]),
        step_inputs([(0, 4, 1), (4, 18, 1), (8, 65, 1)]),
    ]
    for seqs in steps:
        before = [t.clone() for pair in runner.kv_caches for t in pair]
        expected = run_step(runner, seqs, use_stack=False)
        cache_expected = [t.clone() for pair in runner.kv_caches for t in pair]
        for t, saved in zip((t for pair in runner.kv_caches for t in pair), before, strict=True):
            t.copy_(saved)
        got = run_step(runner, seqs, use_stack=True)
        assert got.dtype == torch.float32 and got.shape == (3, runner.config.vocab_size)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
        cache_got = [t for pair in runner.kv_caches for t in pair]
        for a, b in zip(cache_got, cache_expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert not all(torch.equal(a, b) for a, b in zip(cache_got, before, strict=True))
    seqs = step_inputs([(12, 0, 5)])
    kept = run_step(runner, seqs, use_stack=True)
    down = stack.layers[0].int8[3].values
    saved = down.clone()
    down.zero_()
    assert not torch.equal(run_step(runner, seqs, use_stack=True), kept)
    down.copy_(saved)
    assert torch.equal(run_step(runner, seqs, use_stack=True), kept)


def test_greedy_tokens_are_the_same_with_and_without_the_float32_stack(tiny_model_dir) -> None:
    llm = tiny_int8_f32_llm(tiny_model_dir)
    assert llm.llm_engine.runner.model.decoder_stack is not None
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (1, 3, 17, 40, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.llm_engine.runner.model.decoder_stack = None
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected and all(len(t) == 12 for t in got)


def test_a_float32_model_without_int8_linears_has_no_stack(tiny_model_dir) -> None:
    llm = LLM(
        str(tiny_model_dir("llama")), dtype="float32", device="cpu", kernels="native", quantization="none"
    )
    assert build_decoder_stack(llm.llm_engine.runner.model, max_rows=0) is None


def test_a_float32_stack_refuses_layers_without_int8_weights(tiny_model_dir) -> None:
    stack = tiny_int8_f32_llm(tiny_model_dir).llm_engine.runner.model.decoder_stack
    bare = [StackLayer(x.input_norm, None, None, x.post_norm, None, None, None) for x in stack.layers]
    with pytest.raises(ValueError, match="int8 linears only"):
        DecoderStack(stack.dims, bare, dtype=torch.float32)
    if bf16_kernel_available():  # else a bf16 stack cannot be built at all (`applies`)
        with pytest.raises(ValueError, match="packed bf16 weights"):
            DecoderStack(stack.dims, stack.layers, dtype=torch.bfloat16)
    hidden = torch.zeros(4, stack.hidden_size)
    assert stack.takes(hidden, max_rows=0) and not stack.takes(hidden.bfloat16(), max_rows=0)
