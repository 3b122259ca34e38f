"""A step's sequences as the model's flat inputs: token ids, positions, the attention metadata
(slot mapping, block tables, lengths) and the rows whose logits are sampled."""

from __future__ import annotations

import itertools

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
    table_lens = np.fromiter((len(s.block_table) for s in seqs), dtype=np.int64, count=n)
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
    block_tables = _block_tables(seqs, table_lens)
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


def _block_tables(seqs: list[StepInput], table_lens: np.ndarray) -> np.ndarray:
    """The sequences' block tables as one int32 array `[n, max blocks]`, zero-padded."""
    block_tables = np.zeros((len(seqs), int(table_lens.max())), dtype=np.int32)
    # Row-major order of the mask is the order of the chained tables.
    block_tables[np.arange(block_tables.shape[1]) < table_lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(s.block_table for s in seqs),
        dtype=np.int32,
        count=int(table_lens.sum()),
    )
    return block_tables


def _flatten_decodes(
    seqs: list[StepInput], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """`flatten_step` for a step of decodes only (one token each, each sampled; so no drafts):
    the usual step at a full batch, without the per-token index arithmetic a mixed step needs."""
    bs, n = block_size, len(seqs)
    positions = np.fromiter((s.start for s in seqs), dtype=np.int64, count=n)
    input_ids = np.fromiter((s.token_ids[0] for s in seqs), dtype=np.int64, count=n)
    table_lens = np.fromiter((len(s.block_table) for s in seqs), dtype=np.int64, count=n)
    block_tables = _block_tables(seqs, table_lens)
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
        prompt_lens_cpu=[s.num_prompt_tokens for s in seqs],
    )
    meta.scratch["all_slots_valid"] = bool((slot_mapping >= 0).all())
    return torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), meta, rows.to(dev)
