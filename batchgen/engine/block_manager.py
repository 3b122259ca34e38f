"""KV-cache block pool: allocation, ref counts, prefix caching, LRU eviction and CPU swap space.

Blocks are content-addressed once full: `hash((parent_hash, block token ids))`, chained from the first
block, so a block's hash names its whole prefix (vLLM's automatic prefix caching). A hit also
compares the stored token ids and parent hash, and a block is registered only when its parent hash
is held by its own physical predecessor, so hits follow physical chains and a hash collision can
never hand one prompt another prompt's K/V. Blocks whose ref count drops to 0 keep their content
and hash in an O(1) LRU pool (an `OrderedDict`) and are evicted only when a fresh block is needed.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from batchgen.engine.request import Request

HashFn = Callable[[int | None, tuple[int, ...]], int]


def default_block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """Hash of a full block given its parent's hash (None for the first block). Deterministic."""
    return hash((parent, tokens))


@dataclass
class Block:
    """One physical KV block: `block_size` token slots in every layer's K and V cache.

    Attributes:
        block_id: index into the caches' first dimension.
        ref_count: live requests whose block tables hold it (0: free, possibly still cached).
        block_hash / parent_hash: prefix-cache keys once the block is full (None before).
        token_ids: the block's tokens, kept with the hash to rule out a hash collision.
    """

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


class BlockManager:
    """Owns the `num_blocks` physical KV blocks and `num_swap_blocks` CPU swap blocks.

    Counts (in blocks): `num_free_blocks` (ref count 0, cached or not), `num_used_blocks`
    (ref count > 0) and `num_cached_blocks` (blocks holding a registered prefix hash).

    Args:
        num_blocks: physical blocks in the device cache.
        block_size: tokens per block.
        enable_prefix_caching: register full blocks by hash and reuse them.
        num_swap_blocks: CPU blocks for swapped-out requests.
        hash_fn: block hash function (tests inject a colliding one).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_swap_blocks: int = 0,
        hash_fn: HashFn = default_block_hash,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.num_swap_blocks = num_swap_blocks
        self.free_swap_blocks: list[int] = list(range(num_swap_blocks - 1, -1, -1))

    # ---- counts ----
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests."""
        return self.num_used_blocks / self.num_blocks

    def num_fresh_free_blocks(self, limit: int) -> int:
        """Free blocks holding no cached prefix, counted from the front of the pool up to `limit`:
        the blocks the next allocations take without evicting anything (O(limit))."""
        count = 0
        for block_id in itertools.islice(self.free_queue, limit):
            if self.blocks[block_id].block_hash is not None:
                break
            count += 1
        return count

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens (ceiling division by `block_size`)."""
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ----
    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids holding the longest cached prefix of `request`'s tokens.

        At most `(num_tokens - 1) // block_size` blocks: the last token is always computed, since
        its logits are needed; and none past `request.max_cached_prefix` (a request asking for
        prompt log probabilities needs the logits of the positions it has not scored yet).
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent: int | None = None
        bs = self.block_size
        for i in range(min(request.num_tokens - 1, request.max_cached_prefix) // bs):
            tokens = tuple(request.token_ids[i * bs : (i + 1) * bs])
            block_hash = self.hash_fn(parent, tokens)
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tokens or block.parent_hash != parent:
                break  # a hash collision: the cached block holds other tokens
            hits.append(block_id)
            parent = block_hash
        return hits

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that became full of computed tokens since the last call."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = request.num_computed_tokens // bs
        hashes = request.block_hashes
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full):
            tokens = tuple(request.token_ids[i * bs : (i + 1) * bs])
            block_hash = self.hash_fn(parent, tokens)
            hashes.append(block_hash)
            block = self.blocks[request.block_table[i]]
            # Register a block only under its own physical parent. A block whose parent hash is held
            # by another block (a duplicate, or a collision) would otherwise be served after that
            # block's tokens, and the token check cannot see that its K/V were computed after others.
            parent_is_ours = parent is None or self.cached.get(parent) == request.block_table[i - 1]
            if parent_is_ours and block.block_hash is None and block_hash not in self.cached:
                block.block_hash, block.parent_hash, block.token_ids = block_hash, parent, tokens
                self.cached[block_hash] = block.block_id
            parent = block_hash

    # ---- allocation ----
    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_prefix: list[int] | None = None
    ) -> int | None:
        """Make room for `num_new_tokens` more tokens of `request`, taking `cached_prefix` blocks first.

        A `cached_prefix` (from `find_cached_prefix`, for a request holding no blocks) joins the
        request's block table; the caller counts those tokens as computed, and `num_new_tokens`
        are the ones after them.

        Returns:
            The tokens the cached prefix holds (0 without one), or None, changing nothing, when
            there are not enough free blocks.
        """
        cached_prefix = cached_prefix or []
        hit = len(cached_prefix) * self.block_size
        num_held = len(request.block_table) + len(cached_prefix)
        needed = self.blocks_needed(request.num_computed_tokens + hit + num_new_tokens) - num_held
        # Cached blocks sitting in the free pool stop being free once taken.
        reviving = sum(1 for b in cached_prefix if self.blocks[b].ref_count == 0)
        if needed > self.num_free_blocks - reviving:
            return None
        for block_id in cached_prefix:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1
            request.block_table.append(block_id)
            assert block.block_hash is not None  # a cached prefix's blocks are full and hashed
            request.block_hashes.append(block.block_hash)
        for _ in range(max(needed, 0)):
            request.block_table.append(self._take_free_block())
        return hit

    def _take_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            # Evict: the block is about to hold new content.
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = block.parent_hash = block.token_ids = None
        block.ref_count = 1
        return block_id

    def free(self, request: Request) -> None:
        """Release the request's blocks. Tails are freed first so they are evicted first."""
        for block_id in reversed(request.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.block_hash is None:
                    # Holds nothing reusable: hand it out before any cached block.
                    self.free_queue.move_to_end(block_id, last=False)
        request.block_table = []
        request.block_hashes = []

    def free_tail(self, request: Request, num_tokens: int) -> None:
        """Release the request's blocks past the first `num_tokens` tokens: the blocks taken only for
        speculative draft tokens that were rejected (their slots are rolled back).

        Such blocks were fresh (`allocate_slots` takes no cached block past the computed tokens) and
        never hashed (`cache_full_blocks` reads computed tokens only), so they go back to the front of
        the free pool, last first: the pool is in the order it had before they were taken, and the
        next allocation gets the same blocks a run without speculation would.
        """
        keep = self.blocks_needed(num_tokens)
        while len(request.block_table) > keep:
            block = self.blocks[request.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = None
                if block.block_hash is None:
                    self.free_queue.move_to_end(block.block_id, last=False)

    # ---- swap ----
    def can_swap_out(self, request: Request) -> bool:
        """Whether the CPU swap space has a free block for each of the request's blocks."""
        return len(request.block_table) <= len(self.free_swap_blocks)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to CPU swap blocks; returns (device block, swap block) copies.

        The caller must run the copies before any block freed here is written again (the runner does
        swap-outs first in a step).
        """
        mapping = [(block_id, self.free_swap_blocks.pop()) for block_id in request.block_table]
        request.swap_table = [cpu for _, cpu in mapping]
        self.free(request)
        return mapping

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        """Whether enough device blocks are free for the request's computed tokens plus
        `num_new_tokens` more (tokens this step will add)."""
        total = self.blocks_needed(request.num_computed_tokens + num_new_tokens)
        return total <= self.num_free_blocks

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]]:
        """Bring a swapped request back; returns (swap block, device block) copies."""
        mapping = [(cpu, self._take_free_block()) for cpu in request.swap_table]
        request.block_table = [dev for _, dev in mapping]
        self.release_swap(request)
        extra = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(request.block_table)
        for _ in range(max(extra, 0)):
            request.block_table.append(self._take_free_block())
        return mapping

    def release_swap(self, request: Request) -> None:
        """Return the request's CPU swap blocks to the pool (swapped in, or aborted while swapped out)."""
        self.free_swap_blocks.extend(request.swap_table)
        request.swap_table = []
