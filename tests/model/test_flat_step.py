"""`flatten_step` against a plain loop a sequence (the form it replaced), on random steps of decodes,
prefill chunks that sample or not, and decodes that verify draft tokens."""

from __future__ import annotations

import random

import torch

from batchgen.model.flat_step import flatten_step
from batchgen.model.step import StepInput

BLOCK = 16


def _reference(seqs: list[StepInput]) -> dict[str, list]:
    """What each flat input must hold, computed one sequence and one token at a time."""
    ids, positions, slots, logits_rows, tables = [], [], [], [], []
    width = max(len(s.block_table) for s in seqs)
    row = 0
    for s in seqs:
        for j, token in enumerate(s.token_ids):
            pos = s.start + j
            ids.append(token)
            positions.append(pos)
            slots.append(s.block_table[pos // BLOCK] * BLOCK + pos % BLOCK)
        row += len(s.token_ids)
        logits_rows += [row - s.num_sampled + j for j in range(s.num_sampled)]
        tables.append(s.block_table + [0] * (width - len(s.block_table)))
    decodes = 0
    while decodes < len(seqs) and seqs[decodes].is_decode:
        decodes += 1
    return {"ids": ids, "positions": positions, "slots": slots, "logits": logits_rows, "tables": tables,
            "decodes": decodes, "seq_lens": [s.start + len(s.token_ids) for s in seqs]}  # fmt: skip


def _random_step(rng: random.Random) -> list[StepInput]:
    seqs = []
    for _ in range(rng.randint(0, 12)):  # decodes first, some with drafts
        drafts = rng.choice([0, 0, 1, 3])
        start = rng.randint(0, 200)
        blocks = (start + 1 + drafts) // BLOCK + 1
        seqs.append(StepInput([rng.randint(0, 999) for _ in range(1 + drafts)], start,
                              rng.sample(range(500), blocks), True, num_draft_tokens=drafts))  # fmt: skip
    for _ in range(rng.randint(0 if seqs else 1, 4)):  # prefill chunks
        start, n = rng.randint(0, 80), rng.randint(2, 40)
        seqs.append(StepInput([rng.randint(0, 999) for _ in range(n)], start,
                              rng.sample(range(500), (start + n) // BLOCK + 1), rng.random() < 0.5))  # fmt: skip
    return seqs


def test_flat_inputs_equal_a_loop_a_sequence_on_random_steps() -> None:
    rng = random.Random(0)
    for _ in range(150):
        seqs = _random_step(rng)
        want = _reference(seqs)
        ids, positions, meta, logits_rows = flatten_step(seqs, BLOCK, torch.device("cpu"))
        assert ids.tolist() == want["ids"] and positions.tolist() == want["positions"]
        assert meta.slot_mapping.tolist() == want["slots"] and logits_rows.tolist() == want["logits"]
        assert meta.block_tables.tolist() == want["tables"] and meta.num_decodes == want["decodes"]
        assert meta.seq_lens.tolist() == want["seq_lens"] == meta.seq_lens_cpu
        assert meta.query_lens_cpu == [len(s.token_ids) for s in seqs]
        assert meta.verifies_drafts == any(s.num_draft_tokens for s in seqs)
        assert meta.scratch["all_slots_valid"]


def test_decode_only_steps_take_their_own_path_and_equal_the_loop() -> None:
    """A step of plain decodes (the usual step at a full batch) is flattened by its own shorter path
    (`_flatten_decodes`): the same values and dtypes as the reference, at 1 to 300 rows."""
    rng = random.Random(1)
    for n in [1, 2, 7, 64, 255, 300]:
        seqs = []
        for _ in range(n):
            start = rng.randint(0, 500)
            seqs.append(StepInput([rng.randint(0, 999)], start, rng.sample(range(900), start // BLOCK + 1), True,
                                  num_prompt_tokens=rng.randint(1, start + 1)))  # fmt: skip
        want = _reference(seqs)
        ids, positions, meta, logits_rows = flatten_step(seqs, BLOCK, torch.device("cpu"))
        assert ids.tolist() == want["ids"] and positions.tolist() == want["positions"]
        assert meta.slot_mapping.tolist() == want["slots"] and logits_rows.tolist() == want["logits"]
        assert meta.block_tables.tolist() == want["tables"] and meta.num_decodes == n
        assert meta.seq_lens.tolist() == want["seq_lens"] == meta.seq_lens_cpu
        assert meta.query_lens_cpu == [1] * n and meta.max_query_len == 1 and not meta.verifies_drafts
        assert meta.prompt_lens_cpu == [s.num_prompt_tokens for s in seqs]
        assert meta.query_start_loc.tolist() == list(range(n + 1))
        assert (ids.dtype, positions.dtype, logits_rows.dtype) == (torch.int64,) * 3
        assert (meta.slot_mapping.dtype, meta.seq_lens.dtype, meta.block_tables.dtype) == (
            torch.int64, torch.int32, torch.int32)  # fmt: skip
        assert meta.query_start_loc.dtype == torch.int32
