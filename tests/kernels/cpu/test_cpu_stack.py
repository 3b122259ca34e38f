"""The C decoder stack (`cpu_stack.DecoderStack`, `csrc/decoder_stack.c`): the same kernels as the
layer-by-layer path in one call, so logits, the KV cache and sampled tokens must be bit-identical."""

from __future__ import annotations

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.kernels.cpu.linear import Bf16Linear, TunedLinear, bf16_kernel_available
from batchgen.kernels.cpu.quantized_linear import Int8Bf16DotLinear, bf16_dot_available
from batchgen.kernels.cpu.stack import DecoderStack
from batchgen.kernels.registry import ROW_BUCKETS
from batchgen.model.kernel_choice.stack import build_decoder_stack
from tests.kernels.cpu.stack_cases import (
    BLOCK,
    assert_generate_is_the_same_without_the_stack,
    assert_stack_matches_the_layer_path,
    logits_with_down_zeroed,
    run_step,
    step_inputs,
    tiny_llm,
)

pytestmark = pytest.mark.skipif(
    not bf16_kernel_available(),
    reason="the C decoder stack needs batchgen's bf16 linear kernel (a CPU with AVX512-BF16 and a C compiler)",
)


def tiny_bf16_llm(tiny_model_dir, arch: str = "llama") -> LLM:
    return tiny_llm(tiny_model_dir, "bfloat16", arch=arch)


def test_stack_is_bit_identical_to_the_layer_by_layer_path(tiny_model_dir) -> None:
    runner = tiny_bf16_llm(tiny_model_dir).llm_engine.runner
    assert isinstance(runner.model.decoder_stack, DecoderStack)
    assert_stack_matches_the_layer_path(runner)


def test_generate_gives_the_same_tokens_with_and_without_the_stack(tiny_model_dir) -> None:
    assert_generate_is_the_same_without_the_stack(tiny_bf16_llm(tiny_model_dir))


def test_steps_above_the_row_limit_take_the_layer_path(tiny_model_dir) -> None:
    stack = tiny_bf16_llm(tiny_model_dir).llm_engine.runner.model.decoder_stack
    hidden = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert stack.takes(hidden, max_rows=64) and stack.takes(hidden, max_rows=0)
    assert not stack.takes(hidden, max_rows=63)
    assert not stack.takes(hidden.float(), max_rows=0)
    assert not stack.takes(hidden[:, :32], max_rows=0)  # strided rows
    assert not stack.takes(hidden[:0], max_rows=0)


@pytest.mark.parametrize(
    "arch,dtype",
    [("qwen2", "bfloat16"), ("qwen3", "bfloat16"), ("llama", "float32")],
    ids=["qkv-bias", "qk-norm", "float32"],
)
def test_models_the_stack_does_not_cover_keep_the_layer_path(tiny_model_dir, arch: str, dtype: str) -> None:
    llm = LLM(str(tiny_model_dir(arch)), dtype=dtype, max_num_seqs=4, device="cpu")
    assert llm.llm_engine.runner.model.decoder_stack is None
    outputs = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(outputs[0].outputs[0].token_ids) == 3


def test_a_slot_outside_the_cache_is_a_clear_error(tiny_model_dir) -> None:
    runner = tiny_bf16_llm(tiny_model_dir).llm_engine.runner
    input_ids, positions, meta, logits_indices = runner.prepare(step_inputs([(0, 0, 5)]))
    num_slots = runner.kv_caches[0][0].shape[0] * BLOCK
    meta.slot_mapping[2] = num_slots
    with pytest.raises(
        ValueError, match=rf"slot_mapping\[2\] = {num_slots} is outside the cache's {num_slots}"
    ):
        with torch.inference_mode():
            runner.model(input_ids, positions, runner.kv_caches, meta, logits_indices)


def test_a_block_id_outside_the_cache_is_a_clear_error(tiny_model_dir) -> None:
    runner = tiny_bf16_llm(tiny_model_dir).llm_engine.runner
    input_ids, positions, meta, logits_indices = runner.prepare(step_inputs([(0, 0, 1), (2, 0, 20)]))
    meta.num_decodes = 1
    meta.block_tables[1, 0] = runner.kv_caches[0][0].shape[0]
    with pytest.raises(ValueError, match="block ids must lie in"):
        with torch.inference_mode():
            runner.model(input_ids, positions, runner.kv_caches, meta, logits_indices)


def test_the_stacks_check_runs_the_layers_on_its_c_attention_whatever_was_measured(tiny_model_dir) -> None:
    """`tune_decoder_stack` compares the stack with the per-layer path on the stack's own kernels. The
    stack always calls the C attention kernels, while the measured choice may be torch's at some
    batch sizes (with more threads than free cores); torch rounds otherwise in bf16, which dropped a
    correct stack. Within `_layers_on` the layers run the C kernels; after it, the measured choice."""
    from batchgen.model.kernel_choice.stack import _layers_on

    runner = tiny_bf16_llm(tiny_model_dir).llm_engine.runner
    backend = runner.model.model.layers[0].self_attn.backend
    measured = (["torch"] * 12, ["sdpa"] * 12, ["sdpa"] * 12)
    backend.decode_by_bucket, backend.prefill_by_bucket, backend.prefill_after_prefix_by_bucket = measured
    for seqs in (
        step_inputs([(0, 0, 3), (4, 0, 17), (8, 0, 40)]),  # first chunks (sdpa by the measured choice)
        step_inputs([(0, 3, 1), (4, 17, 1), (8, 40, 1)]),  # decodes (torch by the measured choice)
    ):
        before = [t.clone() for pair in runner.kv_caches for t in pair]
        with _layers_on(runner.model, "bf16_c"):
            assert backend.decode_by_bucket is None and backend.prefill_by_bucket is None
            layers = run_step(runner, seqs, use_stack=False)
        for t, saved in zip((t for pair in runner.kv_caches for t in pair), before, strict=True):
            t.copy_(saved)
        assert torch.equal(run_step(runner, seqs, use_stack=True), layers)
    assert (
        backend.decode_by_bucket,
        backend.prefill_by_bucket,
        backend.prefill_after_prefix_by_bucket,
    ) == measured


def tiny_int8_stack_llm(tiny_model_dir) -> LLM:
    """The tiny Llama in bf16 with `quantization="int8"`, each layer linear holding batchgen's int8
    kernel for bf16 activations ("int8_c_dpbf16", run at every row count) and the bf16 layout of its
    dequantized weight, and a decoder stack set to run its int8 linears: what `--kernels auto`
    builds where it measures the int8 stack fastest."""
    llm = tiny_llm(tiny_model_dir, "bfloat16", quantization="int8")
    runner = llm.llm_engine.runner
    model = runner.model
    for name, weight in runner.quantization.weights.items():
        if name == "lm_head":
            continue
        parent, _, child = name.rpartition(".")
        impls = {
            "int8_c_dpbf16": Int8Bf16DotLinear(weight, None),
            "bf16_c": Bf16Linear.from_weight(weight.dequantize().bfloat16(), None),
        }
        setattr(model.get_submodule(parent), child, TunedLinear(impls, ["int8_c_dpbf16"] * len(ROW_BUCKETS)))
    stack = build_decoder_stack(model, max_rows=0)
    assert stack is not None and stack.int8_applies()
    stack.linear_by_bucket = ["int8_c_dpbf16"]
    model.decoder_stack = stack
    return llm


@pytest.mark.skipif(not bf16_dot_available(), reason="the int8 kernel's VDPBF16PS tiles are not built here")
def test_the_int8_stack_is_bit_identical_to_the_layer_by_layer_path(tiny_model_dir) -> None:
    """The stack on a `--quantization int8` model's int8 weights (csrc/decoder_stack.c's LINEAR_INT8)
    against the per-layer path on the same int8 kernel: equal logits and KV caches for a prefill, a
    mixed and a decode-only step. (Its VDPBF16PS tiles round each scaled int8 weight to the very bf16
    weight the bf16 layout holds, so here the bf16 stack gives the same logits.)"""
    runner = tiny_int8_stack_llm(tiny_model_dir).llm_engine.runner
    stack = runner.model.decoder_stack
    assert_stack_matches_the_layer_path(runner)
    # The stack reads the int8 weights (not the bf16 layout it also holds): zeroing one layer's
    # int8 down projection changes its logits, and only under the int8 kind.
    kept, zeroed = logits_with_down_zeroed(runner)
    assert not torch.equal(zeroed, kept)
    stack.linear_by_bucket = ["bf16_c"]
    assert torch.equal(logits_with_down_zeroed(runner)[1], kept)  # equal weights: VDPBF16PS alike


def test_a_stack_without_int8_weights_offers_no_int8_linears(tiny_model_dir) -> None:
    stack = tiny_bf16_llm(tiny_model_dir).llm_engine.runner.model.decoder_stack
    assert isinstance(stack, DecoderStack) and not stack.int8_applies()
