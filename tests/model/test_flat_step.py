"""`flatten_step` against a plain loop a sequence (the form it replaced), on random steps of decodes,
prefill chunks that sample or not, and decodes that verify draft tokens; `DecodeRows` (kept decode
rows) against the same loop over a run of steps."""

from __future__ import annotations

import random

import torch

from batchgen.model.flat_step import DecodeRows, flatten_step
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


def _check(flat: tuple, seqs: list[StepInput]) -> None:
    """`flat` (a `flatten_step` result) holds what the one-sequence-at-a-time reference says."""
    want = _reference(seqs)
    ids, positions, meta, logits_rows = flat
    assert ids.tolist() == want["ids"] and positions.tolist() == want["positions"]
    assert meta.slot_mapping.tolist() == want["slots"] and logits_rows.tolist() == want["logits"]
    assert meta.seq_lens.tolist() == want["seq_lens"] == meta.seq_lens_cpu
    assert meta.prompt_lens_cpu == [s.num_prompt_tokens for s in seqs]
    # Each row's blocks up to its length, which is all attention reads (a kept table has not read
    # a block allocated before its position needs it, and may be wider than the longest table).
    used = [-(-n // BLOCK) for n in want["seq_lens"]]
    got = meta.block_tables.tolist()
    assert [row[:n] for row, n in zip(got, used, strict=True)] == [
        s.block_table[:n] for s, n in zip(seqs, used, strict=True)
    ]


def test_kept_decode_rows_equal_the_loop_over_a_run_of_steps() -> None:
    """The engine's way: the same `StepInput` objects step after step, each one token further, a
    block appended to a table when its position opens one (sometimes a step early); `DecodeRows`
    keeps its arrays then (`kept`) and must still give every value of the reference. A new object
    in the rows, a prefill in the step or a different row count flattens anew."""
    rng = random.Random(2)
    device = torch.device("cpu")
    rows = DecodeRows()
    free = iter(range(10_000))
    seqs = []
    for _ in range(40):
        start = rng.randint(0, 60)
        seqs.append(StepInput([rng.randint(0, 999)], start, [next(free) for _ in range(start // BLOCK + 1)],
                              True, num_prompt_tokens=rng.randint(1, start + 1)))  # fmt: skip
    kept = []
    for step in range(70):
        if step == 30:  # a row is replaced (preempted and back, say): another object
            seqs[5] = StepInput([7], seqs[5].start, list(seqs[5].block_table), True, num_prompt_tokens=3)
        if step == 50:  # one row fewer (a request finished)
            seqs = seqs[:-1]
        step_seqs = seqs + [StepInput([1, 2, 3], 0, [next(free)], True)] if step == 40 else seqs
        flat = rows.flatten(step_seqs, BLOCK, device)
        _check(flat, step_seqs)
        kept.append(rows.kept)
        for s in seqs:  # the step's token is appended; the next position may open a block
            s.token_ids[0] = rng.randint(0, 999)
            s.start += 1
            early = rng.random() < 0.1  # a block allocated before its position needs it
            while len(s.block_table) * BLOCK <= s.start + early:
                s.block_table.append(next(free))
    fresh = {0, 30, 40, 41, 50}  # the first step, a new object, a prefill (and the step after), fewer rows
    assert [i for i, k in enumerate(kept) if not k] == sorted(fresh)
    assert max(len(s.block_table) for s in seqs) > 6  # tables grew past the first width
