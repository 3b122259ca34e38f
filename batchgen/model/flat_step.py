"""A step's sequences as the model's flat inputs: token ids, positions, the attention metadata
(slot mapping, block tables, lengths) and the rows whose logits are sampled."""

from __future__ import annotations

import itertools
import operator

import numpy as np
import torch

from batchgen.model.attention import AttentionMetadata
from batchgen.model.step import StepInput


def flatten_step(
    seqs: list[StepInput], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """Flatten a step's sequences into the model's inputs on `device`: (input_ids int64 [T],
    positions int64 [T], attention metadata, logits_indices int64 [B']), T the step's tokens, B'
    the sum of the sequences' `num_sampled`; KV slots from `block_size`-token blocks.

    One pass over the sequences collects their lengths, tokens and block tables; the rest is
    numpy on whole arrays (a Python loop a sequence cost 2.5x as much at 256 decode rows:
    docs/benchmarks.md)."""
    bs, n = block_size, len(seqs)
    query_lens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=n)
    if n and int(query_lens.sum()) == n and all(s.sample for s in seqs):
        return _flatten_decodes(seqs, block_size, device)
    starts = np.fromiter((s.start for s in seqs), dtype=np.int64, count=n)
    num_sampled = np.fromiter((s.num_sampled for s in seqs), dtype=np.int64, count=n)
    seq_lens = starts + query_lens
    num_tokens = int(query_lens.sum())
    input_ids = np.fromiter(
        itertools.chain.from_iterable(s.token_ids for s in seqs), dtype=np.int64, count=num_tokens
    )
    query_start_loc = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    seq_index = np.repeat(np.arange(n), query_lens)
    positions = np.arange(num_tokens, dtype=np.int64) - query_start_loc[seq_index] + starts[seq_index]
    block_tables, _ = _block_tables(seqs)
    slot_mapping = block_tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs
    # A sequence with draft tokens needs logits at its last `num_draft_tokens + 1` positions.
    sampled_before = np.repeat(np.cumsum(num_sampled) - num_sampled, num_sampled)
    logits_indices = (
        np.repeat(query_start_loc[1:] - num_sampled, num_sampled)
        + np.arange(int(num_sampled.sum()))
        - sampled_before
    )
    decodes = (query_lens == 1) & np.fromiter((s.sample for s in seqs), dtype=bool, count=n)
    num_decodes = n if decodes.all() else int(np.argmin(decodes))  # the leading run of decodes
    dev = device
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slot_mapping).to(dev),
        query_start_loc=torch.from_numpy(query_start_loc).to(dev),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
        block_tables=torch.from_numpy(block_tables).to(dev),
        num_decodes=num_decodes,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_lens_cpu=query_lens.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
        verifies_drafts=bool((num_sampled > 1).any()),
        prompt_lens_cpu=[s.num_prompt_tokens for s in seqs],
    )
    # Known here, on the host: a backend that asked the device would sync once a step.
    meta.scratch["all_slots_valid"] = bool((slot_mapping >= 0).all())
    return (
        torch.from_numpy(input_ids).to(dev),
        torch.from_numpy(positions).to(dev),
        meta,
        torch.from_numpy(logits_indices.astype(np.int64)).to(dev),
    )


def _block_tables(seqs: list[StepInput]) -> tuple[np.ndarray, np.ndarray]:
    """The sequences' block tables as one int32 array `[n, max blocks]`, zero-padded, and each
    table's length (int64 `[n]`)."""
    table_lens = np.fromiter((len(s.block_table) for s in seqs), dtype=np.int64, count=len(seqs))
    block_tables = np.zeros((len(seqs), int(table_lens.max())), dtype=np.int32)
    # Row-major order of the mask is the order of the chained tables.
    block_tables[np.arange(block_tables.shape[1]) < table_lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(s.block_table for s in seqs),
        dtype=np.int32,
        count=int(table_lens.sum()),
    )
    return block_tables, table_lens


def _flatten_decodes(
    seqs: list[StepInput], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """`flatten_step` for a step of decodes only (one token each, each sampled; so no drafts):
    the usual step at a full batch, without the per-token index arithmetic a mixed step needs."""
    n = len(seqs)
    block_tables, _ = _block_tables(seqs)
    positions = np.fromiter((s.start for s in seqs), dtype=np.int64, count=n)
    prompt_lens = [s.num_prompt_tokens for s in seqs]
    return _decode_arrays(seqs, positions, block_tables, prompt_lens, block_size, device)


def _decode_arrays(
    seqs: list[StepInput],
    positions: np.ndarray,
    block_tables: np.ndarray,
    prompt_lens: list[int],
    block_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """A decodes-only step's model inputs from its rows' positions (int64 `[n]`), block tables
    (int32 `[n, >= blocks]`) and prompt lengths."""
    bs, n = block_size, len(seqs)
    input_ids = np.fromiter((s.token_ids[0] for s in seqs), dtype=np.int64, count=n)
    slot_mapping = block_tables[np.arange(n), positions // bs].astype(np.int64) * bs + positions % bs
    seq_lens = positions + 1
    rows = torch.arange(n, dtype=torch.int64)
    dev = device
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slot_mapping).to(dev),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32).to(dev),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
        block_tables=torch.from_numpy(block_tables).to(dev),
        num_decodes=n,
        max_query_len=1,
        max_seq_len=int(seq_lens.max()),
        query_lens_cpu=[1] * n,
        seq_lens_cpu=seq_lens.tolist(),
        verifies_drafts=False,
        prompt_lens_cpu=prompt_lens,
    )
    meta.scratch["all_slots_valid"] = bool((slot_mapping >= 0).all())
    return torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), meta, rows.to(dev)


class DecodeRows:
    """`flatten_step` that keeps a decodes-only step's block tables for the next step: vLLM v1's
    persistent batch (its `InputBatch`, updated by difference), in small.

    When a step decodes the very `StepInput` objects of the step before, in the same order (the
    engine keeps one a running request and updates it in place: `step_inputs(...,
    persistent=True)`), each row's block table can only have gained blocks since (a table
    changes otherwise only by preemption, swapping or rejected drafts, each of which puts
    another object in the step), so only the rows whose new position lies past their kept
    table are read again; at 256 rows that is about one in `block_size`. Any other step is
    flattened from scratch, and a decodes-only one starts a new kept batch.

    A caller that passes a `StepInput` again must have changed only its token, its position and
    the end of its block table (as the engine does).

    Attributes:
        kept: whether the last `flatten` ran the rows of the call before it (so what else the
            caller worked out of those rows still holds, `step_rows`).
    """

    def __init__(self) -> None:
        self.kept = False
        self._seqs: list[StepInput] = []
        self._tables = np.zeros((0, 0), dtype=np.int32)  # [rows, blocks], zero-padded
        self._table_lens = np.zeros(0, dtype=np.int64)  # blocks of each row held in `_tables`
        self._prompt_lens: list[int] = []

    def flatten(
        self, seqs: list[StepInput], block_size: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """`flatten_step(seqs, block_size, device)`, the same tensors."""
        n = len(seqs)
        kept = self._seqs
        self.kept = bool(n) and len(kept) == n and all(map(operator.is_, seqs, kept))
        if not self.kept:
            self._seqs = []
            if not n or not all(len(s.token_ids) == 1 and s.sample for s in seqs):
                return flatten_step(seqs, block_size, device)
            self._tables, self._table_lens = _block_tables(seqs)
            self._prompt_lens = [s.num_prompt_tokens for s in seqs]
            self._seqs = list(seqs)
        positions = np.fromiter((s.start for s in seqs), dtype=np.int64, count=n)
        if self.kept:
            self._read_new_blocks(seqs, positions // block_size)
        return _decode_arrays(seqs, positions, self._tables, self._prompt_lens, block_size, device)

    def _read_new_blocks(self, seqs: list[StepInput], blocks: np.ndarray) -> None:
        """Read again the tables of the rows whose position lies in a block not kept (`blocks`:
        each row's block index, int64 `[n]`)."""
        for row in np.flatnonzero(blocks >= self._table_lens).tolist():
            table = seqs[row].block_table
            if len(table) > self._tables.shape[1]:  # a wider batch: copied once
                wider = np.zeros((len(seqs), len(table)), dtype=np.int32)
                wider[:, : self._tables.shape[1]] = self._tables
                self._tables = wider
            self._tables[row, : len(table)] = table
            self._table_lens[row] = len(table)
