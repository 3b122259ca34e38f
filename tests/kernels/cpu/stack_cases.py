"""Steps for the C decoder stack's tests (`test_cpu_stack.py`, `test_cpu_stack_f32.py`): sequences
with their own cache blocks, and one step run with or without the stack."""

from __future__ import annotations

import torch

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
