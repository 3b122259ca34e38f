"""Decode-only steps padded to a bucket size in persistent input buffers: the fixed shapes and
fixed addresses a captured CUDA graph replays (vLLM's and nano-vllm's decode graphs; nano-vllm pads to
1, 2, 4, 8, then every 16). On a CPU padding is only extra work: the engine pads when asked
(`EngineConfig.decode_buckets`), which is how the padding is tested here."""

from __future__ import annotations

import bisect

import torch

from batchgen.model.attention import AttentionMetadata


def default_decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """nano-vllm's batch sizes for decode graphs, 1, 2, 4, 8, then every 16, up to and including
    `max_num_seqs`."""
    sizes = {b for b in (1, 2, 4, 8) if b < max_num_seqs} | set(range(16, max_num_seqs, 16))
    return tuple(sorted(sizes | {max_num_seqs}))


class DecodeBuffers:
    """Persistent decode inputs of `max(buckets)` rows, filled in place each padded step.

    A step of n decodes runs as the smallest bucket b >= n: rows n to b - 1 are padding, each one
    token at position 0 of the scratch block (a KV block the block manager never hands out): it
    writes its K/V into that block's first slot and attends to that one key, so it reads nothing of
    any sequence and no sequence reads it. Their logits are computed and dropped.

    Args:
        buckets: the batch sizes steps are padded to (positive, any order).
        max_blocks: block-table width, the most blocks a sequence holds (ceil of max_model_len over
            `block_size`).
        scratch_block: the scratch block's id (the cache's last block).
        block_size: tokens per block.
        device: where the buffers live.

    Raises:
        ValueError: no bucket, or a bucket below 1.
    """

    def __init__(
        self,
        buckets: tuple[int, ...],
        max_blocks: int,
        scratch_block: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"decode_buckets must be positive batch sizes, got {buckets!r}")
        self.buckets = sorted(set(buckets))
        rows = self.buckets[-1]
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((rows,), self.scratch_slot, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(rows, max_blocks, dtype=torch.int32, device=device)
        self.block_tables[:, 0] = scratch_block
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(rows, dtype=torch.int64, device=device)

    def bucket(self, num_rows: int) -> int | None:
        """The smallest bucket holding `num_rows` rows, or None when none does (the step runs
        unpadded)."""
        i = bisect.bisect_left(self.buckets, num_rows)
        return self.buckets[i] if i < len(self.buckets) else None

    def pad(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, bucket: int
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """A decode-only step's flat inputs (`flat_step.flatten_step`: `input_ids`/`positions`
        int64 `[n]`, `meta` with n decodes) copied into the buffers and padded to `bucket` rows:
        (input_ids `[bucket]`, positions `[bucket]`, metadata, logits_indices `[bucket]`), views of
        the buffers. The real rows' logits are the first n of the step's logits."""
        n, width = meta.num_seqs, meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.block_tables[:n, width:] = 0  # a longer earlier row's blocks: never read, but zeros
        # Rows n.. may hold an earlier, wider step's values: padding again.
        self.input_ids[n:bucket] = 0
        self.positions[n:bucket] = 0
        self.slot_mapping[n:bucket] = self.scratch_slot
        self.seq_lens[n:bucket] = 1
        self.block_tables[n:bucket] = 0
        self.block_tables[n:bucket, 0] = self.scratch_block
        pad = bucket - n
        padded = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            num_decodes=bucket,
            max_query_len=1,
            max_seq_len=meta.max_seq_len,
            query_lens_cpu=[1] * bucket,
            seq_lens_cpu=meta.seq_lens_cpu + [1] * pad,
            verifies_drafts=False,
            prompt_lens_cpu=None if meta.prompt_lens_cpu is None else meta.prompt_lens_cpu + [1] * pad,
        )
        padded.scratch["all_slots_valid"] = True  # padding rows too: they store into the scratch block
        return self.input_ids[:bucket], self.positions[:bucket], padded, self.logits_indices[:bucket]
