"""Steps for the C decoder stack's tests (`test_cpu_stack.py`, `test_cpu_stack_f32.py`): the tiny
model on the "native" kernels, sequences with their own cache blocks, one step run with or without
the stack, and the comparison of the two over a prefill, a mixed and a decode-only step."""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchgen import LLM, SamplingParams
from batchgen.model.runner import StepInput

BLOCK = 16


def step_inputs(spec: list[tuple[int, int, int]]) -> list[StepInput]:
    """(first block, start position, new tokens) per sequence -> StepInputs with their own blocks."""
    seqs = []
    for first_block, start, count in spec:
        blocks = list(range(first_block, first_block + (start + count + BLOCK - 1) // BLOCK))
        tokens = [(7 * first_block + 3 * i) % 500 + 5 for i in range(start, start + count)]
        seqs.append(StepInput(token_ids=tokens, start=start, block_table=blocks, sample=True))
    return seqs


def run_step(runner, seqs: list[StepInput], use_stack: bool) -> torch.Tensor:
    stack = runner.model.decoder_stack
    if not use_stack:
        runner.model.decoder_stack = None
    try:
        input_ids, positions, meta, logits_indices = runner.prepare(seqs)
        with torch.inference_mode():
            return runner.model(input_ids, positions, runner.kv_caches, meta, logits_indices)
    finally:
        runner.model.decoder_stack = stack


def tiny_llm(tiny_model_dir, dtype: str, quantization: str = "auto", arch: str = "llama") -> LLM:
    """The tiny model `arch` in `dtype` on batchgen's own kernels ("native": the stack at every row
    count where it applies), 8 sequences at a time, BLOCK-token cache blocks."""
    return LLM(
        str(tiny_model_dir(arch)),
        dtype=dtype,
        max_num_seqs=8,
        device="cpu",
        block_size=BLOCK,
        kernels="native",
        quantization=quantization,
    )


def assert_stack_matches_the_layer_path(
    runner, same: Callable[[torch.Tensor, torch.Tensor], bool] = torch.equal
) -> None:
    """Prefill, a mixed step (decodes plus a chunk continuing a cached prefix) and a decode-only
    step: logits and KV caches that are `same` (bit for bit, unless told) with and without the
    stack, and a step that wrote K/V."""
    steps = [
        step_inputs([(0, 0, 3), (4, 0, 17), (8, 0, 40)]),  # prefill of three prompts
        step_inputs([(0, 3, 1), (4, 17, 1), (8, 40, 25)]),  # two decodes, then a continued chunk
        step_inputs([(0, 4, 1), (4, 18, 1), (8, 65, 1)]),  # decodes only
    ]
    dtype = runner.kv_caches[0][0].dtype
    for seqs in steps:
        before = [t.clone() for pair in runner.kv_caches for t in pair]
        expected = run_step(runner, seqs, use_stack=False)
        cache_expected = [t.clone() for pair in runner.kv_caches for t in pair]
        for t, saved in zip((t for pair in runner.kv_caches for t in pair), before, strict=True):
            t.copy_(saved)
        got = run_step(runner, seqs, use_stack=True)
        assert got.dtype == dtype and got.shape == (3, runner.config.vocab_size)
        assert same(got, expected) and torch.equal(got.argmax(-1), expected.argmax(-1))
        cache_got = [t for pair in runner.kv_caches for t in pair]
        assert all(same(a, b) for a, b in zip(cache_got, cache_expected, strict=True))
        # the step wrote K/V: the cache is not what it was before it
        assert not all(torch.equal(a, b) for a, b in zip(cache_got, before, strict=True))


def assert_generate_is_the_same_without_the_stack(llm: LLM, max_tokens: int = 10) -> None:
    """Greedy tokens of five prompts (1 to 70 tokens) with `llm`'s decoder stack, then without it:
    the same, every one `max_tokens` long."""
    assert llm.llm_engine.runner.model.decoder_stack is not None
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (1, 3, 17, 40, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.llm_engine.runner.model.decoder_stack = None
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected and all(len(t) == max_tokens for t in got)


def logits_with_down_zeroed(runner) -> tuple[torch.Tensor, torch.Tensor]:
    """A 5-token prefill's logits through the stack, and again with the first layer's down
    projection's packed int8 values zeroed (restored after): they differ where the stack reads
    them."""
    seqs = step_inputs([(12, 0, 5)])
    kept = run_step(runner, seqs, use_stack=True)
    layer = runner.model.decoder_stack.layers[0]
    down = layer.int8[3].values
    saved = down.clone()
    down.zero_()
    try:
        return kept, run_step(runner, seqs, use_stack=True)
    finally:
        down.copy_(saved)
