"""The float32 C decoder stack (`DecoderStack` with dtype float32, `csrc/decoder_stack.c`'s
`decoder_stack_f32`): a `--quantization int8` float32 model's layers in one call, on any CPU the
library builds for (AVX2 among them). Its norms, rotary and SiLU are `csrc/f32_ops.c`'s where the
per-layer path runs torch's, so the two agree to float32 rounding, not bit for bit."""

from __future__ import annotations

import pytest
import torch

from batchgen import LLM
from batchgen.kernels.cpu import library as cpu_kernels
from batchgen.kernels.cpu.linear import bf16_kernel_available
from batchgen.kernels.cpu.stack import DecoderStack, StackLayer
from batchgen.model.kernel_choice.stack import build_decoder_stack
from tests.kernels.cpu.stack_cases import (
    assert_generate_is_the_same_without_the_stack,
    assert_stack_matches_the_layer_path,
    logits_with_down_zeroed,
    tiny_llm,
)

pytestmark = pytest.mark.skipif(
    cpu_kernels.load_library() is None, reason="batchgen's C kernels are not built here (no C compiler)"
)


def tiny_int8_f32_llm(tiny_model_dir) -> LLM:
    return tiny_llm(tiny_model_dir, "float32", quantization="int8")


def test_the_float32_stack_matches_the_layer_by_layer_path(tiny_model_dir) -> None:
    """Prefill, a mixed step (decodes plus a chunk after a cached prefix) and a decode-only step:
    logits and the K/V written agree with the per-layer path (the same int8 kernel) to float32
    rounding, and the stack reads the int8 weights (zeroing one changes its logits)."""
    runner = tiny_int8_f32_llm(tiny_model_dir).llm_engine.runner
    stack = runner.model.decoder_stack
    assert isinstance(stack, DecoderStack) and stack.dtype == torch.float32 and stack.int8_applies()
    assert_stack_matches_the_layer_path(
        runner, lambda got, expected: torch.allclose(got, expected, rtol=1e-4, atol=1e-4)
    )
    kept, zeroed = logits_with_down_zeroed(runner)
    assert not torch.equal(zeroed, kept)
    assert torch.equal(logits_with_down_zeroed(runner)[0], kept)  # restored


def test_greedy_tokens_are_the_same_with_and_without_the_float32_stack(tiny_model_dir) -> None:
    assert_generate_is_the_same_without_the_stack(tiny_int8_f32_llm(tiny_model_dir), max_tokens=12)


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
