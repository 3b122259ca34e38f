"""Phi-3's LongRoPE row choice: transformers' `generate` rule, per token, whatever the chunking."""

from __future__ import annotations

import torch

from batchgen.model.attention import AttentionMetadata
from batchgen.model.phi import longrope_index


def step(query_lens: list[int], seq_lens: list[int], prompt_lens: list[int] | None) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64),
        query_start_loc=torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.zeros(len(seq_lens), 1, dtype=torch.int32),
        num_decodes=0,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        prompt_lens_cpu=prompt_lens,
    )


def test_long_factors_where_the_prompt_or_the_position_passes_the_original_length():
    # A 20-token prompt's first chunk (positions 0-4): long, as its whole prefill is in transformers.
    # A 5-token prompt decoding positions 15 and 16 (original length 16): short, then long.
    positions = torch.tensor([0, 1, 2, 3, 4, 15, 16])
    meta = step([5, 1, 1], [5, 16, 17], [20, 5, 5])
    index = longrope_index(positions, meta, original=16, max_positions=100)
    assert index.tolist() == [100, 101, 102, 103, 104, 15, 116]
    # Without prompt lengths (a synthetic step) the position alone decides.
    index = longrope_index(positions, step([5, 1, 1], [5, 16, 17], None), original=16, max_positions=100)
    assert index.tolist() == [0, 1, 2, 3, 4, 15, 116]
